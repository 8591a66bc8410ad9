//! What both ends of the tunnel connection agree on beyond the messages themselves: the
//! HTTP/2 settings under gRPC, the channel the cloud's tonic clients call through on a
//! connection the edge dialled, and how the edge answers the calls on its side. Both
//! sides drive the `h2` crate directly, not through hyper.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use h2::client::SendRequest;
use h2::server::SendResponse;
use h2::{Reason, RecvStream, SendStream};
use http_body::{Body, Frame};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::oneshot;
use tower::ServiceExt;
use tracing::debug;

use crate::config::TransportConfig;

/// The edge's connection window is the protocol maximum, so that only the per-stream
/// windows limit what the cloud sends it.
const CONNECTION_WINDOW: u32 = (1 << 31) - 1;

/// The cloud's side: the gRPC client, which opens the streams. Returns the channel the
/// clients call through and the connection, which must be driven until it ends. Its
/// connection window is `max_buffered_per_edge`: what an edge's answers may hold of the
/// cloud's memory while their clients do not read. Many times a stream's window, so a
/// few stalled clients stall only themselves; a hostile edge answering into many calls
/// stalls its own streams once it is used up, and holds no more. The send buffer is
/// `send_buffer`'s; the other settings are hyper's client defaults, which this side used
/// before it spoke h2 directly.
pub async fn client_handshake<T>(
    t: &TransportConfig,
    io: T,
) -> Result<(Channel, h2::client::Connection<T, Bytes>), h2::Error>
where
    T: AsyncRead + AsyncWrite + Unpin,
{
    let (sender, connection) = h2::client::Builder::new()
        .initial_window_size(t.stream_window)
        .initial_connection_window_size(t.max_buffered_per_edge)
        .max_frame_size(t.max_frame_size)
        .max_concurrent_reset_streams(1024)
        .initial_max_send_streams(100)
        .max_header_list_size(16 * 1024)
        .max_send_buffer_size(send_buffer(t))
        .enable_push(false)
        .handshake(io)
        .await?;
    Ok((Channel(sender), connection))
}

/// The edge's side: the gRPC server, which accepts the streams and bounds how many may
/// be open. Returns the connection, whose `accept` drives it. The send buffer is
/// `send_buffer`'s; the other settings not taken from `t` are hyper's server defaults,
/// which this side used before it spoke h2 directly (no keep-alive pings: the cloud's
/// heartbeats on the Control call watch the connection).
pub async fn server_handshake<T>(
    t: &TransportConfig,
    io: T,
) -> Result<h2::server::Connection<T, Bytes>, h2::Error>
where
    T: AsyncRead + AsyncWrite + Unpin,
{
    h2::server::Builder::new()
        .initial_window_size(t.stream_window)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(t.max_frame_size)
        .max_concurrent_streams(t.max_streams_per_edge)
        .max_pending_accept_reset_streams(1024)
        .max_local_error_reset_streams(Some(1024))
        .max_header_list_size(16 * 1024)
        .max_send_buffer_size(send_buffer(t))
        .handshake(io)
        .await
}

/// Serves one call with a tonic-generated server (`service`) on a stream the edge
/// accepted: the request's body as tonic reads it, then the answer (`send_response`).
/// A caller that resets the stream before the answer ends the call.
pub async fn serve_call<S>(
    service: S,
    request: http::Request<RecvStream>,
    mut respond: SendResponse<Bytes>,
) where
    S: tower::Service<
            http::Request<RecvBody>,
            Response = http::Response<tonic::body::Body>,
            Error = Infallible,
        >,
{
    let answer = service.oneshot(request.map(RecvBody::request));
    if let Some(Ok(response)) = unless_reset(&mut respond, answer).await {
        send_response(respond, response).await;
    }
}

/// `answer`, unless the caller resets the stream first: then the call is over and
/// `answer` is dropped, as hyper's server dropped a call's future.
pub(crate) async fn unless_reset<F: Future>(
    respond: &mut SendResponse<Bytes>,
    answer: F,
) -> Option<F::Output> {
    let mut answer = std::pin::pin!(answer);
    std::future::poll_fn(|cx| {
        if let Poll::Ready(output) = answer.as_mut().poll(cx) {
            return Poll::Ready(Some(output));
        }
        match respond.poll_reset(cx) {
            Poll::Ready(_) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    })
    .await
}

/// Answers a call: the response's headers, then its body's frames and trailers, as the
/// stream's window allows (`SendBody`); a response without a body (a refusal, its
/// status in the headers) ends the stream with its headers.
pub(crate) async fn send_response<B>(mut respond: SendResponse<Bytes>, response: http::Response<B>)
where
    B: Body<Data = Bytes> + Unpin,
{
    let (head, body) = response.into_parts();
    let end_of_stream = body.is_end_stream();
    match respond.send_response(http::Response::from_parts(head, ()), end_of_stream) {
        Ok(send) if !end_of_stream => SendBody::new(body, send, None).await,
        Ok(_) => {}
        Err(e) => {
            debug!(error = %e, "cannot answer a call");
            respond.send_reset(Reason::INTERNAL_ERROR);
        }
    }
}

/// What HTTP/2 may hold unsent per stream, on both sides: one chunk. A stream takes its
/// next message (and so reads its socket) only once its last one has left h2's queue
/// (`SendBody`, on both sides), so its bytes are sealed soon after they were read.
/// With more per stream (hyper's clients hold 1 MiB), a chunk waits behind
/// every other stream's queued bytes and is cold in the cache by the time TLS copies it
/// into its record: at 8 parallel bulk streams that made the seal copy cost twice per GiB
/// what it cost at one stream, and the socket reads 1.4x (perf; docs/design.md, knob 12).
fn send_buffer(t: &TransportConfig) -> usize {
    t.chunk_size
}

/// A tonic channel over one HTTP/2 connection we are the client of: no reconnect, no
/// buffer task, and h2 driven directly rather than through hyper's client, for one
/// reason: a request's first body bytes leave in the same write as its headers. hyper
/// waits for flow-control capacity before it sends any body data, and h2 grants a stream
/// none until its headers are written, so the two went out in two TLS records and,
/// often, two wake-ups of the edge; a new connection's first request paid for that.
/// Here the first data frame is queued at once (h2 holds it until the stream opens), the
/// rest as the stream's window allows.
///
/// The request goes out on the call's first poll; the body is polled once there, so
/// bytes it has by then join the headers, and then carried by a task of its own. The
/// channel gives every request the same origin, `http://tunnel`: the connection is
/// given, so the authority names nothing.
#[derive(Clone)]
pub struct Channel(SendRequest<Bytes>);

type ResponseFuture =
    Pin<Box<dyn Future<Output = Result<http::Response<RecvBody>, h2::Error>> + Send + 'static>>;

impl tower::Service<http::Request<tonic::body::Body>> for Channel {
    type Response = http::Response<RecvBody>;
    type Error = h2::Error;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let mut sender = self.0.clone();
        Box::pin(async move {
            let (mut parts, body) = request.into_parts();
            parts.uri = with_origin(parts.uri);
            let end_of_stream = body.is_end_stream();
            let (response, send) =
                sender.send_request(http::Request::from_parts(parts, ()), end_of_stream)?;
            let mut cancel_on_drop = None;
            if !end_of_stream {
                let (cancel, cancelled) = oneshot::channel();
                let mut pipe = SendBody::new(body, send, Some(cancelled));
                // Before the connection's task writes the headers: data the body has
                // now is queued behind them.
                let first = std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut pipe).poll(cx)));
                if first.await.is_pending() {
                    tokio::spawn(pipe);
                }
                cancel_on_drop = Some(CancelOnDrop(Some(cancel)));
            }
            let response = response.await?;
            // The answer came: the body goes on for as long as it has frames.
            if let Some(cancel) = cancel_on_drop {
                cancel.disarm();
            }
            Ok(response.map(RecvBody::response))
        })
    }
}

/// `uri`'s path on the edge's connection.
fn with_origin(uri: http::Uri) -> http::Uri {
    let mut parts = uri.into_parts();
    parts.scheme = Some(http::uri::Scheme::HTTP);
    parts.authority = Some(http::uri::Authority::from_static("tunnel"));
    http::Uri::from_parts(parts).expect("a path with a scheme and an authority is a URI")
}

/// Resets the request's stream (CANCEL) if the caller gives up before the answer came,
/// as hyper's client does, so the far end stops and the window is freed.
struct CancelOnDrop(Option<oneshot::Sender<()>>);

impl CancelOnDrop {
    fn disarm(mut self) {
        // Dropped unsent: the body's task stops watching for a cancel.
        self.0.take();
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(cancel) = self.0.take() {
            let _ = cancel.send(());
        }
    }
}

/// Sends a body's frames on its stream, a request's (the cloud's) or a response's (the
/// edge's): the first data frame at once, each later one taken from the body only when
/// the stream can send (hyper's body pipe does the same): a frame taken early would
/// wait in h2's queue, read but unsent; then the trailers or the end of the stream. A
/// body that fails resets the stream (INTERNAL_ERROR, as hyper does for a body's own
/// error); so does a cancel before the answer (CANCEL; a request's). A stream the far
/// end reset ends it, and the body is dropped.
struct SendBody<B> {
    body: B,
    send: SendStream<Bytes>,
    sent_any: bool,
    cancelled: Option<oneshot::Receiver<()>>,
}

impl<B> SendBody<B> {
    fn new(body: B, send: SendStream<Bytes>, cancelled: Option<oneshot::Receiver<()>>) -> Self {
        Self {
            body,
            send,
            sent_any: false,
            cancelled,
        }
    }
}

impl<B> Future for SendBody<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        if let Some(cancelled) = &mut this.cancelled {
            match Pin::new(cancelled).poll(cx) {
                Poll::Ready(Ok(())) => {
                    this.send.send_reset(Reason::CANCEL);
                    return Poll::Ready(());
                }
                Poll::Ready(Err(_)) => this.cancelled = None,
                Poll::Pending => {}
            }
        }
        loop {
            if this.send.poll_reset(cx).is_ready() {
                return Poll::Ready(());
            }
            if this.sent_any {
                // A claim of one byte, as hyper makes: h2 raises it to what is buffered
                // once the frame is sent, and grants it once the queue is under its
                // bound (`send_buffer`). The first frame needs none: it joins the
                // headers.
                this.send.reserve_capacity(1);
                while this.send.capacity() == 0 {
                    match ready!(this.send.poll_capacity(cx)) {
                        Some(Ok(_)) => {}
                        Some(Err(_)) | None => return Poll::Ready(()),
                    }
                }
            }
            match ready!(Pin::new(&mut this.body).poll_frame(cx)) {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => {
                        let end = this.body.is_end_stream();
                        this.sent_any = true;
                        if this.send.send_data(data, end).is_err() || end {
                            return Poll::Ready(());
                        }
                    }
                    Err(frame) => {
                        if let Ok(trailers) = frame.into_trailers() {
                            let _ = this.send.send_trailers(trailers);
                            return Poll::Ready(());
                        }
                    }
                },
                Some(Err(_)) => {
                    this.send.send_reset(Reason::INTERNAL_ERROR);
                    return Poll::Ready(());
                }
                None => {
                    let _ = this.send.send_data(Bytes::new(), true);
                    return Poll::Ready(());
                }
            }
        }
    }
}

/// A received stream's body as tonic and `IncomingChunks` read it: data frames (their
/// window released as they are taken, as hyper's body does), then the trailers. A
/// stream reset with NO_ERROR is a plain end (RFC 9113, section 8.1), as in hyper.
pub struct RecvBody {
    recv: RecvStream,
    data_done: bool,
    /// Whether small frames are copied out of the read buffer (`detach_small`).
    detach_small: bool,
}

impl RecvBody {
    /// A response's body on the cloud, small frames detached: the cloud holds an idle
    /// Control call for every edge.
    fn response(recv: RecvStream) -> Self {
        Self {
            recv,
            data_done: false,
            detach_small: true,
        }
    }

    /// A request's body on the edge, its frames as they came: the edge has a single
    /// connection, so a frame that pins its read buffer holds one buffer at most.
    pub(crate) fn request(recv: RecvStream) -> Self {
        Self {
            recv,
            data_done: false,
            detach_small: false,
        }
    }
}

impl Body for RecvBody {
    type Data = Bytes;
    type Error = h2::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, h2::Error>>> {
        let this = self.get_mut();
        let no_error_is_end = |e: h2::Error| match e.reason() {
            Some(Reason::NO_ERROR) => None,
            _ => Some(Err(e)),
        };
        if !this.data_done {
            match ready!(this.recv.poll_data(cx)) {
                Some(Ok(data)) => {
                    let _ = this.recv.flow_control().release_capacity(data.len());
                    let data = if this.detach_small {
                        detach_small(data)
                    } else {
                        data
                    };
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Some(Err(e)) => return Poll::Ready(no_error_is_end(e)),
                None => this.data_done = true,
            }
        }
        Poll::Ready(match ready!(this.recv.poll_trailers(cx)) {
            Ok(trailers) => trailers.map(|t| Ok(Frame::trailers(t))),
            Err(e) => no_error_is_end(e),
        })
    }

    fn is_end_stream(&self) -> bool {
        self.recv.is_end_stream()
    }
}

/// Data frames up to this size are copied out of the connection's read buffer.
const DETACHED_FRAME_MAX: usize = 1024;

/// A small data frame in an allocation of its own. A frame is a slice of h2's 8 KiB read
/// buffer, and tonic's decoder (buffer size 0, `proto::ControlCodec`) takes over the
/// allocation of a frame it is handed when its own buffer is empty and keeps it for the
/// rest of the call: a heartbeat on an idle edge's Control call would hold the whole
/// read buffer that h2 releases between reads. A nonzero decoder buffer would not end
/// that (tonic takes over again whenever the buffer's capacity runs out to exactly
/// zero), so the copy is made here, for the body of every call the cloud makes: on the
/// byte streams (`IncomingChunks`) it only keeps a prefix frame that waits for its
/// payload from pinning that buffer, and a payload frame under 1 KiB costs a copy of
/// under 1 KiB. Larger frames go as they are: copying them would cost on bulk streams,
/// and a call that carries them is not idle.
fn detach_small(data: Bytes) -> Bytes {
    if data.len() <= DETACHED_FRAME_MAX {
        Bytes::copy_from_slice(&data)
    } else {
        data
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
