//! This replica's links to the others, kept up with backoff: to each, a gRPC connection
//! carrying its route updates (`Peer.Routes`) and the connections forwarded to it
//! (`Peer.Dial`, one call each).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::RwLock;
use std::time::Duration;

use futures::Stream;
use proto::peer_client::PeerClient;
use proto::{Chunk, DialStatus, PeerHello, RouteUpdate};
use rand::Rng;
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;
use tonic::metadata::BinaryMetadataValue;
use tonic::transport::{Channel, Endpoint};
use tracing::{debug, info, warn};

use super::Peers;
use super::routes::apply_update;
use crate::addr::NodeName;
use crate::call;
use crate::call::count::OpenCount;
use crate::call::open::{Call, Method};
use crate::call::outcome::DialFailure;
use crate::call::request::Request;
use crate::cloud::nodes::journal::Noted;

/// Reconnect delays of a link: replicas restart in seconds, so retry soon.
const LINK_RETRY_MIN: Duration = Duration::from_millis(200);
const LINK_RETRY_MAX: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
enum LinkError {
    #[error("cannot connect: {0}")]
    Tcp(std::io::Error),
    #[error("TLS handshake failed: {0}")]
    Tls(std::io::Error),
    #[error("gRPC connection failed: {0}")]
    Grpc(String),
    #[error("{}: {}", .0.code(), .0.message())]
    Status(#[from] tonic::Status),
    #[error("timed out")]
    Timeout,
    #[error("bad answer: {0}")]
    Protocol(String),
    #[error("no route update for {0:?}")]
    Silent(Duration),
    #[error("the address is this replica's own")]
    Itself,
}

/// The link to one other replica, by address.
pub(crate) struct Link {
    pub(crate) addr: String,
    state: RwLock<LinkState>,
    stop: CancellationToken,
    /// Forwarded connections open on the link right now.
    open_streams: Arc<OpenCount>,
    /// This replica's `PeerHello`, sent with every forwarded connection.
    hello: BinaryMetadataValue,
    /// How long the far replica's answer to a forwarded dial is waited for.
    dial_timeout: Duration,
}

#[derive(Default)]
struct LinkState {
    /// The peer's replica id, once it answered.
    replica: String,
    /// The channel forwarded connections are called through (`Peer.Dial`, by
    /// `call::open`); `None` while the link is down.
    channel: Option<Channel>,
    /// Node -> when its session there was established (Unix ms).
    nodes: HashMap<String, u64>,
    /// `nodes` is what the replica holds: its routes came in since the link went up, or
    /// the link leads back to this replica, which holds nothing to learn of.
    known: bool,
}

impl Link {
    pub(super) fn new(addr: String, stop: CancellationToken, peers: &Peers) -> Self {
        Self {
            addr,
            state: RwLock::default(),
            stop,
            open_streams: Arc::default(),
            hello: peers.hello.clone(),
            // The far replica bounds its own edge dial; a little more lets its answer win.
            dial_timeout: peers.transport.dial_timeout + Duration::from_secs(4),
        }
    }

    /// When the node's session on this replica was established, if the link is up and
    /// the replica claims the node.
    pub(super) fn claim(&self, node: &str) -> Option<u64> {
        let state = self.read();
        state.channel.as_ref()?;
        state.nodes.get(node).copied()
    }

    /// Whether this replica knows what the far one holds (see `LinkState::known`).
    pub(super) fn routes_known(&self) -> bool {
        self.read().known
    }

    pub(super) fn stop(&self) {
        self.stop.cancel();
    }

    /// The far replica's id while the link is up.
    pub(super) fn live_replica(&self) -> Option<String> {
        let s = self.read();
        (s.channel.is_some() && !s.replica.is_empty()).then(|| s.replica.clone())
    }

    pub(crate) fn replica(&self) -> String {
        let s = self.read();
        if s.replica.is_empty() {
            self.addr.clone()
        } else {
            s.replica.clone()
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, LinkState> {
        self.state.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, LinkState> {
        self.state.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Opens the `Peer.Dial` call that forwards one connection to this replica, with
    /// `messages` as its outgoing messages (`call::open`): the request leaves when its
    /// answer (the edge's, relayed) is first awaited.
    pub(crate) fn open_call<M>(&self, request: &Request, messages: M) -> Result<Call, DialFailure>
    where
        M: Stream<Item = Chunk> + Send + Unpin + 'static,
    {
        let channel = self.read().channel.clone().ok_or_else(|| {
            DialFailure::new(DialStatus::TunnelFailed, "the link to the replica is down")
        })?;
        let method = Method::PeerDial { hello: &self.hello };
        Ok(call::open::open(
            channel,
            method,
            request,
            messages,
            &self.open_streams,
            self.dial_timeout,
        ))
    }
}

/// Keeps the link to one replica up until it is stopped.
pub(super) async fn run_link(peers: Arc<Peers>, link: Arc<Link>) {
    let mut delay = LINK_RETRY_MIN;
    let mut failures = 0u32;
    loop {
        let result = tokio::select! {
            r = link_session(&peers, &link) => r,
            () = link.stop.cancelled() => Ok(()),
        };
        let lost = {
            let mut state = link.write();
            let had = state.channel.take().is_some();
            // The replica's edges may be on their way to another.
            peers.departed(state.nodes.drain().map(|(node, _)| node));
            state.known = false;
            had
        };
        if lost {
            peers.routes_changed(Noted::Everything);
        }
        if lost {
            info!(replica = %link.replica(), forwarded_open = link.open_streams.get(), "link to replica lost; its routes are dropped");
            delay = LINK_RETRY_MIN;
            failures = 0;
        }
        if link.stop.is_cancelled() {
            return;
        }
        match result {
            Err(LinkError::Itself) => {
                debug!("peer address is this replica; not linking to it");
                link.write().known = true;
                peers.routes_changed(Noted::Everything);
                return;
            }
            Ok(()) => debug!("link closed"),
            // Replicas start in any order: the first failure is worth a line, a peer
            // that stays away is not worth one every few seconds.
            Err(e) if failures == 0 => info!(error = %e, "cannot link to replica; retrying"),
            Err(e) => debug!(error = %e, "cannot link to replica"),
        }
        failures += 1;
        let jittered = delay.mul_f64(rand::rng().random_range(0.5..=1.0));
        tokio::select! {
            () = tokio::time::sleep(jittered) => {}
            () = link.stop.cancelled() => return,
        }
        delay = (delay * 2).min(LINK_RETRY_MAX);
    }
}

/// One link to a replica: connects, subscribes to its routes and applies them until the
/// link breaks or the replica goes silent. When this process's certificate changes
/// (`Peers::set_tls`: a reload, a renewal), a second connection presenting the new one
/// takes the link's place before the first is let go: calls open on the first keep it
/// until they end, new ones go out on the second, and the routes stay known meanwhile.
async fn link_session(peers: &Peers, link: &Link) -> Result<(), LinkError> {
    // Subscribed before the certificate is read, so a change in between is not missed.
    let mut tls_changes = peers.tls_changes();
    tls_changes.borrow_and_update();
    let Some(tls) = peers.tls() else {
        return Ok(());
    };
    let mut routes = subscribe(peers, link, tls).await?;
    info!(replica = %link.replica(), "linked to replica");
    loop {
        tokio::select! {
            r = receive_routes(peers, link, &mut routes) => return r,
            changed = tls_changes.changed() => {
                if changed.is_err() {
                    return Ok(());
                }
                tls_changes.borrow_and_update();
                let Some(tls) = peers.tls() else { return Ok(()) };
                match subscribe(peers, link, tls).await {
                    Ok(renewed) => {
                        routes = renewed;
                        info!(replica = %link.replica(), "link moved to the new certificate; calls open on the previous connection finish there");
                    }
                    // The link up still serves; the next one made presents the new
                    // certificate anyway.
                    Err(e) => warn!(error = %e, "cannot link with the new certificate; keeping the link up with the previous one"),
                }
            }
        }
    }
}

/// Connects to the replica with `tls` and subscribes to its routes; the link's calls go
/// out on the new connection from then on.
async fn subscribe(
    peers: &Peers,
    link: &Link,
    tls: Arc<super::PeerTls>,
) -> Result<tonic::Streaming<RouteUpdate>, LinkError> {
    let subscribe = async {
        let channel = grpc_channel(peers, tls, link.addr.clone()).await?;
        let mut client =
            PeerClient::new(channel.clone()).max_decoding_message_size(proto::MAX_MESSAGE_LEN);
        Ok::<_, LinkError>((client.routes(peers.hello_message()).await?, channel))
    };
    let (routes, channel) = tokio::time::timeout(peers.transport.handshake_timeout, subscribe)
        .await
        .map_err(|_| LinkError::Timeout)??;
    let hello: PeerHello = proto::from_metadata(routes.metadata(), proto::PEER_HELLO_METADATA)
        .map_err(|e| LinkError::Protocol(format!("the Routes answer's PeerHello: {e}")))?;
    if hello.instance == peers.instance {
        return Err(LinkError::Itself);
    }
    let mut state = link.write();
    state.replica = hello.replica_id;
    state.channel = Some(channel);
    Ok(routes.into_inner())
}

/// A gRPC channel to the replica at `addr`, over mTLS with ALPN `h2`.
async fn grpc_channel(
    peers: &Peers,
    tls: Arc<super::PeerTls>,
    addr: String,
) -> Result<Channel, LinkError> {
    let t = &peers.transport;
    let connector = tower::service_fn(move |_: http::Uri| {
        let (tls, addr) = (tls.clone(), addr.clone());
        async move {
            let tcp = TcpStream::connect(&addr).await.map_err(LinkError::Tcp)?;
            crate::io::net::tune(&tcp);
            let mut stream = tls
                .grpc_connector
                .connect(tls.server_name.clone(), tcp)
                .await
                .map_err(LinkError::Tls)?;
            crate::io::tls::tune_tunnel(stream.get_mut().1);
            Ok::<_, LinkError>(hyper_util::rt::TokioIo::new(stream))
        }
    });
    // The address is the connector's; the URI only names the authority in requests.
    Endpoint::from_static("http://tunnel-peer")
        .initial_stream_window_size(t.stream_window)
        .http2_keep_alive_interval(t.heartbeat_interval)
        .keep_alive_timeout(t.heartbeat_timeout)
        .connect_with_connector(connector)
        .await
        .map_err(|e| LinkError::Grpc(error_chain(&e)))
}

/// An error with its causes: tonic's transport error alone says only "transport error".
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// Applies the replica's route updates until its stream ends or goes silent. Stops at
/// a message boundary when dropped: `link_session` drops it to move the link.
async fn receive_routes(
    peers: &Peers,
    link: &Link,
    updates: &mut tonic::Streaming<RouteUpdate>,
) -> Result<(), LinkError> {
    let silence = peers.transport.heartbeat_timeout;
    loop {
        let update = match tokio::time::timeout(silence, updates.message()).await {
            Err(_) => return Err(LinkError::Silent(silence)),
            Ok(Ok(None)) => return Ok(()),
            Ok(Ok(Some(update))) => update,
            Ok(Err(status)) => return Err(status.into()),
        };
        let (held, released) = (update.held.len(), update.released.len());
        let named = if update.reset {
            Noted::Everything
        } else {
            let held = update.held.iter().map(|claim| &claim.node);
            let names = held.chain(&update.released);
            Noted::Nodes(
                names
                    .filter_map(|n| NodeName::new(n.clone()).ok())
                    .collect(),
            )
        };
        let (changed, first) = {
            let mut state = link.write();
            // The replica's first update (`reset`) lists everything it holds.
            let first = !state.known;
            state.known = true;
            let claimed: Vec<String> = match update.reset {
                true => state.nodes.keys().cloned().collect(),
                false => update.released.clone(),
            };
            let changed = apply_update(&mut state.nodes, update);
            let nodes = &state.nodes;
            peers.departed(claimed.into_iter().filter(|n| !nodes.contains_key(n)));
            (changed, first)
        };
        if first {
            peers.routes_changed(Noted::Everything);
        } else if changed {
            peers.routes_changed(named);
        }
        if changed {
            debug!(
                held,
                released,
                nodes = link.read().nodes.len(),
                "routes from replica changed"
            );
        }
    }
}
