//! The replicas' listener (`peers.listen`): mTLS that only replicas pass, then a standard
//! gRPC server (ALPN `h2`) with the `tunnel.v1.Peer` service and `grpc.health.v1.Health`.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::StreamExt as _;
use futures::stream::BoxStream;
use proto::chunk_call::{ChunkMethods, ChunkServer, ChunkStream, IncomingChunks};
use proto::peer_server::{Peer, PeerServer};
use proto::{Chunk, DialResult, DialStatus, PeerHello, RouteUpdate};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_util::sync::CancellationToken;
use tonic::codegen::BoxFuture;
use tonic::transport::server::{Connected, TcpConnectInfo};
use tonic::{Request, Response, Status};
use tracing::{Instrument, debug, info, warn};

use super::Peers;
use super::routes::announce;
use crate::call;
use crate::call::copy::describe;
use crate::call::count::OpenGuard;
use crate::call::open::Call;
use crate::cloud::edges::registry::Registry;
use crate::io::accept::{Incoming, Permit};
use crate::ops::metrics::CloudMetrics;

/// The path of `Peer.Dial`, whose answer waits for the edge's dial.
const PEER_DIAL_PATH: &str = "/tunnel.v1.Peer/Dial";

/// Accepts other replicas' connections: gRPC for `Peer` and health checks. Forwarded
/// connections are served from `registry`, this replica's own sessions (weak: connection
/// tasks outlive the listener's task, and the sessions must be freed at shutdown).
pub(crate) async fn serve(
    peers: Arc<Peers>,
    registry: Weak<Registry>,
    metrics: Arc<CloudMetrics>,
    mut listener: Incoming<TcpListener>,
    server_name: String,
    shutdown: CancellationToken,
) {
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<PeerServer<PeerService>>().await;
    let peer_service = PeerService {
        registry,
        peers: peers.clone(),
        metrics,
    };
    // Forwarded connections (Dial) without tonic's copy; Routes through tonic.
    let peer_service = ChunkServer::new(
        PeerServer::new(peer_service.clone()).max_decoding_message_size(proto::MAX_MESSAGE_LEN),
        peer_service,
    );
    let t = &peers.transport;
    let handshake_timeout = t.handshake_timeout;
    // The far replica's edge dial, and a little more, as `Link::open_call` waits.
    let dial_timeout = t.dial_timeout + Duration::from_secs(4);
    let (grpc_conns, mut next_conn) = mpsc::channel::<PeerConn>(16);
    let incoming =
        futures::stream::poll_fn(move |cx| next_conn.poll_recv(cx)).map(Ok::<_, std::io::Error>);
    let grpc = tonic::transport::Server::builder()
        .initial_stream_window_size(t.stream_window)
        .max_frame_size(t.max_frame_size)
        .max_concurrent_streams(t.max_streams_per_edge)
        .http2_keepalive_interval(Some(t.heartbeat_interval))
        .http2_keepalive_timeout(Some(t.heartbeat_timeout))
        .layer(tower::layer::layer_fn(move |inner| Refusals {
            inner,
            first_message: handshake_timeout,
            dial: dial_timeout,
        }))
        .add_service(health_service)
        .add_service(peer_service)
        .serve_with_incoming_shutdown(incoming, shutdown.clone().cancelled_owned());
    let accept = async {
        while let Some((tcp, remote, permit)) = listener.next().await {
            crate::io::net::tune(&tcp);
            let Some(tls) = peers.tls() else { return };
            let span = tracing::info_span!("peer_in", remote = %remote);
            tokio::spawn(
                accept_conn(
                    handshake_timeout,
                    tcp,
                    remote,
                    permit,
                    tls.acceptor.clone(),
                    server_name.clone(),
                    grpc_conns.clone(),
                )
                .instrument(span),
            );
        }
        // Draining: health checks that still reach this replica learn it is going.
        health.set_not_serving::<PeerServer<PeerService>>().await;
        health
            .set_service_status("", tonic_health::ServingStatus::NotServing)
            .await;
    };
    let (_, served) = tokio::join!(accept, grpc);
    if let Err(e) = served {
        warn!(error = %e, "replica gRPC server failed");
    }
}

/// TLS with a certificate that names the replicas, then hands the connection to the
/// gRPC server.
async fn accept_conn(
    handshake_timeout: Duration,
    tcp: TcpStream,
    remote: SocketAddr,
    permit: Permit,
    acceptor: TlsAcceptor,
    server_name: String,
    grpc_conns: mpsc::Sender<PeerConn>,
) {
    let local = tcp.local_addr().ok();
    let handshake = async {
        let mut tls = acceptor
            .accept(tcp)
            .await
            .map_err(|e| format!("TLS handshake failed: {e}"))?;
        crate::io::tls::tune_tunnel(tls.get_mut().1);
        let cert = tls
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .map(|c| c.as_ref().to_vec());
        let caller = cert
            .as_deref()
            .and_then(|der| Caller::of(der, &server_name));
        let serial = cert.as_deref().and_then(crate::io::x509::cert_serial);
        // The CA also signs edge certificates: only one naming the replicas, or a relay
        // (`system:tunnel-relay:<node>`, a name no edge certificate can carry), may link.
        caller.map(|caller| (tls, caller, serial)).ok_or_else(|| format!(
            "client certificate names neither `{server_name}` (a replica) nor `{}<node>` (a relay)",
            crate::io::x509::RELAY_CN_PREFIX
        ))
    };
    let (tls, caller, serial) = match tokio::time::timeout(handshake_timeout, handshake).await {
        Ok(Ok(accepted)) => accepted,
        Ok(Err(e)) => return warn!(error = %e, "replica connection refused"),
        Err(_) => return warn!("replica connection refused: TLS handshake timed out"),
    };
    // The serial says which certificate the link presents: a renewed one, after a move.
    let serial = serial.unwrap_or_default();
    match caller {
        Caller::Replica => debug!(%serial, "replica connected"),
        Caller::Relay(node) => info!(%node, %serial, "relay connected"),
    }
    let conn = PeerConn {
        tls,
        local,
        remote,
        _permit: permit,
    };
    // Fails only when the gRPC server stopped: the replica is shutting down.
    let _ = grpc_conns.send(conn).await;
}

/// Who is on the other end of a link, by its client certificate. Both may call
/// `Peer.Routes` and `Peer.Dial` (the whole service): a relay is served exactly as a
/// replica is, and no replica links back to it.
enum Caller {
    /// Its certificate carries the replicas' DNS name (`peers.server_name`).
    Replica,
    /// A relay on this node (CN `system:tunnel-relay:<node>`).
    Relay(String),
}

impl Caller {
    fn of(der: &[u8], server_name: &str) -> Option<Self> {
        if crate::io::x509::cert_has_dns_name(der, server_name) {
            return Some(Self::Replica);
        }
        crate::io::x509::relay_node_from_cert(der).map(Self::Relay)
    }
}

/// The `tunnel.v1.Peer` service.
#[derive(Clone)]
struct PeerService {
    registry: Weak<Registry>,
    peers: Arc<Peers>,
    metrics: Arc<CloudMetrics>,
}

impl ChunkMethods for PeerService {
    fn method(&self, path: &str) -> Option<&'static str> {
        (path == proto::chunk_call::PEER_DIAL).then_some(proto::chunk_call::PEER_DIAL)
    }

    fn call(
        &self,
        _: &'static str,
        request: Request<IncomingChunks>,
    ) -> BoxFuture<Response<ChunkStream>, Status> {
        let service = self.clone();
        Box::pin(async move {
            let relayed = service.dial(request).await?;
            Ok(relayed.map(|s| Box::pin(s) as ChunkStream))
        })
    }
}

#[tonic::async_trait]
impl Peer for PeerService {
    type RoutesStream = BoxStream<'static, Result<RouteUpdate, Status>>;

    async fn routes(
        &self,
        request: Request<PeerHello>,
    ) -> Result<Response<Self::RoutesStream>, Status> {
        let registry = self.registry()?;
        let remote = request.remote_addr();
        let caller = request.into_inner();
        if caller.replica_id.is_empty() {
            return Err(Status::invalid_argument("PeerHello.replica_id is empty"));
        }
        let hello = self.peers.hello_message();
        let (updates, mut next) = mpsc::channel(4);
        let span = tracing::info_span!("announce", to = %caller.replica_id, remote = ?remote);
        info!(parent: &span, "replica subscribed to routes");
        tokio::spawn(announce(registry, self.peers.clone(), updates).instrument(span));
        let stream = futures::stream::poll_fn(move |cx| next.poll_recv(cx)).map(Ok);
        let mut response = Response::new(stream.boxed());
        response
            .metadata_mut()
            .insert_bin(proto::PEER_HELLO_METADATA, proto::to_metadata(&hello));
        Ok(response)
    }
}

impl PeerService {
    /// This replica's sessions, until it shuts down: both calls are refused then.
    fn registry(&self) -> Result<Arc<Registry>, Status> {
        self.registry
            .upgrade()
            .ok_or_else(|| Status::unavailable("the replica is shutting down"))
    }

    /// A connection another replica forwards: dialled on this replica's own session for
    /// the node, and relayed without a task of its own: the caller's messages are the
    /// edge call's, and the edge's answer and messages are the caller's.
    async fn dial(&self, request: Request<IncomingChunks>) -> Result<Response<Relayed>, Status> {
        let registry = self.registry()?;
        let from =
            proto::from_metadata::<PeerHello>(request.metadata(), proto::PEER_HELLO_METADATA)
                .map(|h| h.replica_id)
                .unwrap_or_else(|_| "?".into());
        let dial_request =
            call::request::Request::from_metadata(request.metadata()).map_err(|e| {
                warn!(%from, error = %e, "bad forwarded dial request");
                DialResult::refusal(DialStatus::BadRequest, e.to_string())
            })?;
        self.metrics
            .connections
            .get_or_create(&crate::ops::metrics::EntryLabel { entry: "peer" })
            .inc();
        let node = dial_request.node.as_deref().unwrap_or_default();
        let span = tracing::debug_span!("forwarded", id = dial_request.id, node, target = %dial_request.target, from = %from);
        async {
            let Some(session) = registry.get(node) else {
                info!("forwarded connection refused: node not held here");
                return Err(DialResult::refusal(
                    DialStatus::NotHeld,
                    format!(
                        "replica `{}` holds no edge session for node `{node}` (forwarded connections are never forwarded again)",
                        self.peers.replica_id
                    ),
                ));
            };
            let to_edge = Arc::new(AtomicU64::new(0));
            let counted = to_edge.clone();
            let forward = futures::StreamExt::map(request.into_inner(), move |message| {
                if let Ok(Chunk::Data(data)) = &message {
                    counted.fetch_add(data.len() as u64, Ordering::Relaxed);
                }
                relay_in(message)
            });
            let answer = match session.open_call(&dial_request, forward) {
                Ok(Call { answer, open }) => answer.wait().await.map(|inbound| (inbound, open)),
                Err(e) => Err(e),
            };
            match answer {
                Ok((inbound, open)) => Ok(Response::new(Relayed {
                    inbound,
                    to_edge,
                    from_edge: 0,
                    span: tracing::Span::current(),
                    _open: open,
                })),
                Err(e) => {
                    info!(error = %e, "forwarded connection failed");
                    Err(e.into_status())
                }
            }
        }
        .instrument(span)
        .await
    }
}

/// A forwarding replica's message, on to the edge: its failure (a cancelled call)
/// cancels the edge call too.
fn relay_in(message: Result<Chunk, Status>) -> Chunk {
    message.unwrap_or_else(|status| Chunk::Abort(describe(&status)))
}

/// The edge call's messages, back to the replica that forwarded the connection; counts
/// as open on the edge's session until the call ends, and logs its end.
pub(crate) struct Relayed {
    inbound: IncomingChunks,
    to_edge: Arc<AtomicU64>,
    from_edge: u64,
    span: tracing::Span,
    _open: OpenGuard,
}

impl futures::Stream for Relayed {
    type Item = Result<Chunk, Status>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inbound).poll_next(cx);
        if let Poll::Ready(Some(Ok(Chunk::Data(data)))) = &polled {
            this.from_edge += data.len() as u64;
        }
        polled.map(|m| m.map(|m| m.map_err(|status| Status::aborted(describe(&status)))))
    }
}

impl Drop for Relayed {
    fn drop(&mut self) {
        debug!(parent: &self.span, to_edge = self.to_edge.load(Ordering::Relaxed), from_edge = self.from_edge, "forwarded connection ended");
    }
}

/// Answers and logs, naming the caller, every request on the replicas' listener that is
/// refused before it reaches a method (unknown method, oversized or malformed request,
/// ...), and bounds how long a request may take to get there: one whose first message
/// does not come within `first_message` is answered DEADLINE_EXCEEDED (every `Peer`
/// method answers its headers as soon as it has its request).
#[derive(Clone)]
struct Refusals<S> {
    inner: S,
    first_message: Duration,
    /// `Peer.Dial`'s bound instead: its answer waits for the edge's dial.
    dial: Duration,
}

impl<S, B> tower::Service<http::Request<B>> for Refusals<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let remote = request
            .extensions()
            .get::<TcpConnectInfo>()
            .and_then(|i| i.remote_addr());
        let path = request.uri().path().to_owned();
        let answer = self.inner.call(request);
        let dial = path == PEER_DIAL_PATH;
        let bound = if dial { self.dial } else { self.first_message };
        Box::pin(async move {
            let mut response = match tokio::time::timeout(bound, answer).await {
                Ok(response) => response?,
                Err(_) => Status::deadline_exceeded(format!("no request message within {bound:?}"))
                    .into_http(),
            };
            // A status in the headers is a trailers-only answer: refused before any
            // message of the method went out.
            // Peer.Dial logs its own refusals, with the connection they were for.
            if !dial
                && let Some(status) = Status::from_header_map(response.headers())
                && status.code() != tonic::Code::Ok
            {
                warn!(remote = ?remote, path, code = ?status.code(), detail = status.message(), "request from a replica refused");
                // tonic's router says nothing more; the caller should learn what it asked for.
                if status.code() == tonic::Code::Unimplemented
                    && status.message().is_empty()
                    && let Ok(message) =
                        http::HeaderValue::from_str(&format!("unknown method {path}"))
                {
                    response.headers_mut().insert("grpc-message", message);
                }
            }
            Ok(response)
        })
    }
}

/// An accepted, authenticated replica connection, as tonic's server takes it.
struct PeerConn {
    tls: TlsStream<TcpStream>,
    local: Option<SocketAddr>,
    remote: SocketAddr,
    /// The peer listener's slot, free again when the gRPC server drops the connection.
    _permit: Permit,
}

impl Connected for PeerConn {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        TcpConnectInfo {
            local_addr: self.local,
            remote_addr: Some(self.remote),
        }
    }
}

impl AsyncRead for PeerConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tls).poll_read(cx, buf)
    }
}

impl AsyncWrite for PeerConn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tls).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tls).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tls.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tls).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tls).poll_shutdown(cx)
    }
}
