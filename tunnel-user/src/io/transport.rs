//! What both ends of the tunnel connection agree on beyond the messages themselves: the
//! HTTP/2 settings under gRPC, and the channel the cloud's tonic clients call through on
//! a connection the edge dialled.

use std::future::Ready;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::future::Either;
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncRead, AsyncWrite};

use crate::config::TransportConfig;

/// The connection window is set to the protocol maximum so that only the per-stream
/// windows limit a sender: with a smaller one, a few stalled streams would hold the
/// whole connection's window and stall every other stream of the edge. Memory stays
/// bounded by stream window × streams per edge.
const CONNECTION_WINDOW: u32 = (1 << 31) - 1;

/// The cloud's side: the gRPC client, which opens the streams. Returns the channel the
/// clients call through and the connection, which must be driven until it ends.
pub async fn client_handshake<T>(
    t: &TransportConfig,
    io: T,
) -> hyper::Result<(
    Channel,
    hyper::client::conn::http2::Connection<TokioIo<T>, tonic::body::Body, TokioExecutor>,
)>
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (sender, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .initial_stream_window_size(t.stream_window)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(t.max_frame_size)
        .max_concurrent_reset_streams(1024)
        .handshake(TokioIo::new(io))
        .await?;
    Ok((Channel(sender), connection))
}

/// The edge's side: the gRPC server, which accepts the streams and bounds how many may
/// be open.
pub fn server_builder(t: &TransportConfig) -> hyper::server::conn::http2::Builder<TokioExecutor> {
    let mut b = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    b.initial_stream_window_size(t.stream_window)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(t.max_frame_size)
        .max_concurrent_streams(t.max_streams_per_edge)
        .max_pending_accept_reset_streams(1024);
    b
}

/// A tonic channel over one HTTP/2 connection we are the client of: no reconnect, no
/// buffer task. The request leaves when the call is made (`call`), so a caller may poll
/// a call once and await its answer later (`send_now`).
#[derive(Clone)]
pub struct Channel(SendRequest<tonic::body::Body>);

type ResponseFuture = Pin<
    Box<dyn Future<Output = hyper::Result<http::Response<hyper::body::Incoming>>> + Send + 'static>,
>;

impl tower::Service<http::Request<tonic::body::Body>> for Channel {
    type Response = http::Response<hyper::body::Incoming>;
    type Error = hyper::Error;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        Box::pin(self.0.send_request(req))
    }
}

impl Channel {
    pub fn is_closed(&self) -> bool {
        self.0.is_closed()
    }
}

/// Polls a call once, which puts its request on the connection (the channel is always
/// ready while the connection lives), and returns it for its answer to be awaited later.
pub async fn send_now<F: Future + Unpin>(mut call: F) -> Either<Ready<F::Output>, F> {
    match std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut call).poll(cx))).await {
        Poll::Ready(out) => Either::Left(std::future::ready(out)),
        Poll::Pending => Either::Right(call),
    }
}

/// Messages from a channel, as a call's message stream (the Control calls).
pub struct Outgoing<T>(pub tokio::sync::mpsc::Receiver<T>);

impl<T> futures::Stream for Outgoing<T> {
    type Item = T;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T>> {
        self.get_mut().0.poll_recv(cx)
    }
}
