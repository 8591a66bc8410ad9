//! The edge's side of a call: [`Calls`] accepts the calls the cloud makes on a session's
//! connection, and [`serve`] answers an `Edge.Dial` call with what the edge's [`Callee`]
//! dials for its request, or with the refusal, then copies between the target and the
//! call. The edge drives HTTP/2 itself (`io::transport`), so a call comes here as the
//! stream h2 accepted.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use h2::RecvStream;
use h2::server::{Connection, SendResponse};
use proto::chunk_call::{EDGE_DIAL, EDGE_REVERSE, IncomingChunks};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tonic::metadata::MetadataMap;
use tonic::{Response, Status};
use tracing::{Instrument, debug};

use super::copy::{self, Meter, Outbound, OutboundHandle, ResponseChunks, Totals};
use super::count::{OpenCount, OpenGuard};
use super::outcome::DialFailure;
use super::request::{Request, RequestError};
use crate::io::accept;
use crate::io::transport::{self, RecvBody};

/// What serves a call on the edge: it dials the request's target, or refuses.
pub(crate) trait Callee: Send + Sync + 'static {
    /// Connects to the target `request` names, or says why not (the cloud is answered
    /// with that); a request that did not come off the wire is refused with its problem.
    /// Counts every outcome.
    fn dial(
        &self,
        request: Result<Request, RequestError>,
    ) -> impl Future<Output = Result<Connected, DialFailure>> + Send;

    /// The copy's chunk size, and where it counts the bytes it moves.
    fn copying(&self) -> (usize, &Totals);

    /// Serves an `Edge.Reverse` call: the cloud's answer to an edge-to-cloud request.
    fn reverse(
        &self,
        request: http::Request<RecvStream>,
        respond: SendResponse<Bytes>,
    ) -> impl Future<Output = ()> + Send + 'static;
}

/// Serves the calls the cloud makes on a session's connection, each in a task of its
/// own: the Control call through `control` (tonic's generated server), the byte streams
/// on their HTTP/2 streams directly, so the task that reads a connection's socket writes
/// its bytes into the stream: Dial by [`serve`], Reverse by the callee.
pub(crate) struct Calls<S, C> {
    control: S,
    callee: Arc<C>,
    /// Dial and Reverse calls open: the shutdown waits for them.
    open: Arc<OpenCount>,
}

impl<S, C> Calls<S, C>
where
    S: tower::Service<
            http::Request<RecvBody>,
            Response = http::Response<tonic::body::Body>,
            Error = Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send,
    C: Callee,
{
    pub(crate) fn new(control: S, callee: Arc<C>) -> Self {
        Self {
            control,
            callee,
            open: Arc::default(),
        }
    }

    /// The Dial and Reverse calls open.
    pub(crate) fn open(&self) -> &Arc<OpenCount> {
        &self.open
    }

    /// Accepts the calls and drives the connection until it ends.
    pub(crate) async fn serve<T>(&self, conn: &mut Connection<T, Bytes>) -> Result<(), h2::Error>
    where
        T: AsyncRead + AsyncWrite + Unpin,
    {
        while let Some(accepted) = conn.accept().await {
            let (request, respond) = accepted?;
            match request.uri().path() {
                EDGE_DIAL => tokio::spawn(accept::hold(
                    OpenGuard::count(&self.open),
                    serve(self.callee.clone(), request, respond),
                )),
                EDGE_REVERSE => tokio::spawn(accept::hold(
                    OpenGuard::count(&self.open),
                    self.callee.reverse(request, respond),
                )),
                _ => tokio::spawn(transport::serve_call(
                    self.control.clone(),
                    request,
                    respond,
                )),
            };
        }
        Ok(())
    }
}

/// The connection to a target: plain, or TLS the edge originated.
pub(crate) enum Connected {
    Tcp(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

/// Serves one `Edge.Dial` call from the cloud: dials the target, then copies the call's
/// messages to it in this task while a task of its own answers and sends what the
/// target sends. A refusal is the answer's status; a cloud that resets the stream
/// before the answer ends the dial.
///
/// The answer goes out from a task queued behind this one, not first: a request that
/// came with the dial (the cloud forwards a client's first bytes at once) reaches the
/// target before the answer wakes the cloud, whose process would otherwise take the
/// CPU between the two on a busy node.
pub(crate) async fn serve<C: Callee>(
    callee: Arc<C>,
    request: http::Request<RecvStream>,
    mut respond: SendResponse<Bytes>,
) {
    let (request, recv) = request_of(request);
    let span = match &request {
        Ok(r) => tracing::debug_span!("conn", id = r.id, target = %r.target, client = %r.client()),
        Err(_) => tracing::Span::current(),
    };
    // This task lives as long as the connection: the dial's state and request are boxed
    // and gone once it is done.
    let dial = Box::pin(callee.dial(request));
    let dialed = transport::unless_reset(&mut respond, dial)
        .instrument(span.clone())
        .await;
    match dialed {
        None => {}
        Some(Err(refusal)) => answer(respond, Err(refusal.into_status())).await,
        Some(Ok(target)) => {
            let (outbound, handle) = copy::outbound();
            tokio::spawn(answer(respond, Ok(outbound)));
            let (chunk, totals) = callee.copying();
            let meter = Meter::new(totals.clone());
            let inbound = IncomingChunks::request(RecvBody::request(recv));
            copy_to_target(target, handle, inbound, chunk, meter)
                .instrument(span)
                .await;
        }
    }
}

/// The request in a call's metadata, and the call's incoming messages. (A function of
/// its own so that the rest of the call's head is gone before the dial: the task lives
/// as long as the connection.)
fn request_of(request: http::Request<RecvStream>) -> (Result<Request, RequestError>, RecvStream) {
    let (head, recv) = request.into_parts();
    let metadata = MetadataMap::from_headers(head.headers);
    (Request::from_metadata(&metadata), recv)
}

/// Answers a byte-stream call on the edge (`Edge.Dial`, `Edge.Reverse`): with
/// `outbound`'s messages, or with a refusal, its status in the headers and no messages.
pub(crate) async fn answer(respond: SendResponse<Bytes>, outbound: Result<Outbound, Status>) {
    match outbound {
        Ok(outbound) => {
            let answer = proto::chunk_call::answer(Response::new(ResponseChunks::new(outbound)));
            transport::send_response(respond, answer).await;
        }
        Err(refusal) => {
            transport::send_response(respond, refusal.into_http::<tonic::body::Body>()).await;
        }
    }
}

/// Copies between the dialled target and the call until either side ends.
async fn copy_to_target(
    target: Connected,
    handle: OutboundHandle,
    inbound: IncomingChunks,
    chunk: usize,
    meter: Arc<Meter>,
) {
    let end = match target {
        Connected::Tcp(tcp) => copy::copy(tcp, handle, inbound, Bytes::new(), chunk, &meter).await,
        // Boxed: a TLS stream is large, and held inline it would size
        // every connection's task, plain TCP ones too.
        Connected::Tls(tls) => {
            Box::pin(copy::copy(
                *tls,
                handle,
                inbound,
                Bytes::new(),
                chunk,
                &meter,
            ))
            .await
        }
    };
    debug!(
        to_cloud = meter.to_tunnel(),
        from_cloud = meter.from_tunnel(),
        ?end,
        "connection ended"
    );
}
