//! Multi-replica routing: a connection that reaches a replica without the node's edge
//! session is forwarded to the replica that holds it.
//!
//! Every replica keeps one link (mTLS, then HTTP/2 with this replica as the client) to
//! each other replica. On it, the other replica streams the nodes whose edge sessions
//! it holds itself: everything once, then every change as it happens, so routes
//! converge as fast as a message crosses, and no connection waits for a lookup. A link
//! that breaks takes its routes with it. A forwarded connection is one more stream on
//! the same link, carrying the `DialRequest` with the node named; the replica at the
//! far end serves it from its own sessions only, never forwarding it again, and only
//! announces its own sessions, never what it learned: one hop at most, no loops.
//!
//! When two replicas claim a node (an edge reconnected elsewhere before its old session
//! timed out), the newer session wins.

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use h2::RecvStream;
use h2::client::SendRequest;
use h2::server::SendResponse;
use http::{HeaderValue, Request, Response};
use proto::{DialRequest, DialStatus, FrameDecoder, NodeClaim, PeerHello, RouteUpdate};
use rand::Rng;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_rustls::{TlsAcceptor, TlsConnector};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, warn};

use super::Cloud;
use super::registry::Registry;
use super::session::{DialingStream, OpenError, OpenGuard};
use anyhow::Context as _;

use crate::config::{CloudConfig, TransportConfig, check_node_name};
use crate::splice_h2;
use crate::transport;

/// Claims per `RouteUpdate`: node names are at most 253 bytes, so an update stays well
/// under the 64 KiB message bound.
const CLAIMS_PER_UPDATE: usize = 200;
/// Most nodes one replica may claim: bounds what a peer can make us store.
pub const MAX_NODES_PER_PEER: usize = 200_000;
/// Reconnect delays of a link: replicas restart in seconds, so retry soon.
const LINK_RETRY_MIN: Duration = Duration::from_millis(200);
const LINK_RETRY_MAX: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
enum LinkError {
    #[error("cannot connect: {0}")]
    Tcp(std::io::Error),
    #[error("TLS handshake failed: {0}")]
    Tls(std::io::Error),
    #[error("HTTP/2 failed: {0}")]
    H2(#[from] h2::Error),
    #[error("timed out")]
    Timeout,
    #[error("bad answer: {0}")]
    Protocol(String),
    #[error("no route update for {0:?}")]
    Silent(Duration),
    #[error("the address is this replica's own")]
    Itself,
}

/// The mTLS both ends of a link use: the cloud certificate, presented as server and as
/// client. Reloaded with the certificate (see `reload`), so links made after a rotation
/// present the new one.
pub struct PeerTls {
    acceptor: TlsAcceptor,
    connector: TlsConnector,
    server_name: rustls::pki_types::ServerName<'static>,
}

impl PeerTls {
    pub fn load(config: &CloudConfig) -> anyhow::Result<Self> {
        let t = &config.tunnel;
        let ca = config
            .peers
            .ca(t)
            .context("peers.ca or tunnel.client_ca is required for peers")?;
        Ok(Self {
            acceptor: TlsAcceptor::from(crate::tls::peer_server_config(&t.cert, &t.key, ca)?),
            connector: TlsConnector::from(crate::tls::peer_client_config(ca, &t.cert, &t.key)?),
            server_name: crate::tls::server_name(&config.peers.server_name)?,
        })
    }
}

/// This replica's view of the others, and what it tells them about itself.
pub struct Peers {
    replica_id: String,
    instance: u64,
    /// Our `PeerHello`, sent on every stream to a peer and in every answer.
    hello: HeaderValue,
    /// None when this replica has no peers listener (a single replica).
    tls: RwLock<Option<Arc<PeerTls>>>,
    transport: TransportConfig,
    links: RwLock<HashMap<String, Arc<Link>>>,
    /// Bumped whenever this replica's own edge sessions change; each peer's route
    /// stream wakes on it.
    local_version: watch::Sender<u64>,
    shutdown: CancellationToken,
}

/// The link to one other replica, by address.
pub struct Link {
    pub addr: String,
    state: RwLock<LinkState>,
    stop: CancellationToken,
    /// Forwarded connections open on the link right now.
    open_streams: Arc<AtomicUsize>,
}

#[derive(Default)]
struct LinkState {
    /// The peer's replica id, once it answered.
    replica: String,
    /// `None` while the link is down.
    sender: Option<SendRequest<Bytes>>,
    /// Node -> when its session there was established (Unix ms).
    nodes: HashMap<String, u64>,
}

impl Link {
    pub fn replica(&self) -> String {
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

    /// Forwards one connection to this replica: returns as soon as the dial request is
    /// on its way, with the answer (the edge's, relayed) still to come.
    pub async fn dial(
        &self,
        peers: &Peers,
        request: &DialRequest,
    ) -> Result<DialingStream, OpenError> {
        let sender = self
            .read()
            .sender
            .clone()
            .ok_or_else(|| OpenError::Tunnel("the link to the replica is down".into()))?;
        let guard = OpenGuard::count(&self.open_streams);
        // The far replica bounds its own edge dial; a little more lets its answer win.
        let deadline =
            tokio::time::Instant::now() + peers.transport.dial_timeout + Duration::from_secs(4);
        let (send, answer) = super::session::send_dial(
            &sender,
            proto::PEER_DIAL_PATH,
            request,
            Some(&peers.hello),
            deadline,
        )
        .await?;
        Ok(DialingStream::new(send, answer, guard))
    }
}

/// Which replica a connection for a node goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choice {
    Local,
    /// Index into the claims given to `choose`.
    Peer(usize),
}

/// The newest session wins; a tie goes to the local one (no hop).
pub fn choose(local: Option<u64>, claims: &[u64]) -> Option<Choice> {
    let best_peer = claims
        .iter()
        .enumerate()
        .max_by_key(|(i, since)| (**since, std::cmp::Reverse(*i)));
    match (local, best_peer) {
        (Some(l), Some((i, p))) if *p > l => Some(Choice::Peer(i)),
        (Some(_), _) => Some(Choice::Local),
        (None, Some((i, _))) => Some(Choice::Peer(i)),
        (None, None) => None,
    }
}

/// The updates that take a peer from `sent` to `now`: everything when `reset`, else
/// only what changed, in messages of bounded size. Empty when nothing changed.
pub fn route_updates(
    sent: &HashMap<String, u64>,
    now: &HashMap<String, u64>,
    reset: bool,
) -> Vec<RouteUpdate> {
    let mut held: Vec<NodeClaim> = now
        .iter()
        .filter(|(node, since)| reset || sent.get(*node) != Some(*since))
        .map(|(node, since)| NodeClaim {
            node: node.clone(),
            connected_at_ms: *since,
        })
        .collect();
    held.sort_by(|a, b| a.node.cmp(&b.node));
    let mut released: Vec<String> = if reset {
        Vec::new()
    } else {
        sent.keys()
            .filter(|n| !now.contains_key(*n))
            .cloned()
            .collect()
    };
    released.sort();
    let mut updates: Vec<RouteUpdate> = held
        .chunks(CLAIMS_PER_UPDATE)
        .map(|c| RouteUpdate {
            held: c.to_vec(),
            ..Default::default()
        })
        .chain(released.chunks(CLAIMS_PER_UPDATE).map(|c| RouteUpdate {
            released: c.to_vec(),
            ..Default::default()
        }))
        .collect();
    if reset {
        match updates.first_mut() {
            Some(first) => first.reset = true,
            None => updates.push(RouteUpdate {
                reset: true,
                ..Default::default()
            }),
        }
    }
    updates
}

/// Applies an update from a peer to what it claims; says whether anything changed.
/// Claims with invalid names, or beyond the bound, are dropped.
pub fn apply_update(nodes: &mut HashMap<String, u64>, update: RouteUpdate) -> bool {
    let mut changed = update.reset && !nodes.is_empty();
    if update.reset {
        nodes.clear();
    }
    for claim in update.held {
        if check_node_name(&claim.node).is_err()
            || (nodes.len() >= MAX_NODES_PER_PEER && !nodes.contains_key(&claim.node))
        {
            continue;
        }
        changed |= nodes.insert(claim.node, claim.connected_at_ms) != Some(claim.connected_at_ms);
    }
    for node in update.released {
        changed |= nodes.remove(&node).is_some();
    }
    changed
}

pub fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// This replica's own live sessions, as claims.
fn local_claims(registry: &Registry) -> HashMap<String, u64> {
    registry
        .list()
        .into_iter()
        .filter(|s| !s.is_closed())
        .map(|s| (s.node.clone(), unix_ms(s.connected_at)))
        .collect()
}

impl Peers {
    pub fn new(
        replica_id: String,
        tls: Option<PeerTls>,
        transport: TransportConfig,
        shutdown: CancellationToken,
    ) -> Arc<Self> {
        let instance = rand::rng().random::<u64>();
        let hello = transport::encode_header(&PeerHello {
            replica_id: replica_id.clone(),
            instance,
        });
        Arc::new(Self {
            replica_id,
            instance,
            hello,
            tls: RwLock::new(tls.map(Arc::new)),
            transport,
            links: RwLock::default(),
            local_version: watch::Sender::new(0),
            shutdown,
        })
    }

    fn tls(&self) -> Option<Arc<PeerTls>> {
        self.tls.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// New links, both ways, use `tls`; links already up keep theirs.
    pub fn set_tls(&self, tls: PeerTls) {
        *self.tls.write().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(tls));
    }

    /// Whether this replica links to others at all.
    pub fn enabled(&self) -> bool {
        self.tls().is_some()
    }

    /// This replica's own edge sessions changed: tell every peer.
    pub fn local_edges_changed(&self) {
        self.local_version.send_modify(|v| *v = v.wrapping_add(1));
    }

    /// The replica to forward a connection for `node` to: one whose session is newer
    /// than `local_since` (this replica's own session, if any). `None`: serve locally,
    /// or nobody holds the node.
    pub fn holder(&self, node: &str, local_since: Option<u64>) -> Option<Arc<Link>> {
        let links = self.links.read().unwrap_or_else(|e| e.into_inner());
        let mut candidates = Vec::new();
        let mut claims = Vec::new();
        for link in links.values() {
            let state = link.read();
            if let (Some(since), Some(_)) = (state.nodes.get(node), &state.sender) {
                candidates.push(link.clone());
                claims.push(*since);
            }
        }
        match choose(local_since, &claims)? {
            Choice::Local => None,
            Choice::Peer(i) => candidates.into_iter().nth(i),
        }
    }

    /// Makes the set of peer addresses `addrs`: links to new ones start, links to
    /// addresses no longer listed stop.
    pub fn set_addresses(self: &Arc<Self>, addrs: &BTreeSet<String>) {
        if !self.enabled() {
            return;
        }
        let mut links = self.links.write().unwrap_or_else(|e| e.into_inner());
        links.retain(|addr, link| {
            let keep = addrs.contains(addr);
            if !keep {
                info!(peer = %addr, "replica left the peer list");
                link.stop.cancel();
            }
            keep
        });
        for addr in addrs {
            if links.contains_key(addr) {
                continue;
            }
            let link = Arc::new(Link {
                addr: addr.clone(),
                state: RwLock::default(),
                stop: self.shutdown.child_token(),
                open_streams: Arc::new(AtomicUsize::new(0)),
            });
            links.insert(addr.clone(), link.clone());
            let span = tracing::info_span!("peer", peer = %addr);
            tokio::spawn(run_link(self.clone(), link).instrument(span));
        }
    }
}

/// Keeps the link to one replica up until it is stopped.
async fn run_link(peers: Arc<Peers>, link: Arc<Link>) {
    let mut delay = LINK_RETRY_MIN;
    let mut failures = 0u32;
    loop {
        let result = tokio::select! {
            r = link_session(&peers, &link) => r,
            () = link.stop.cancelled() => Ok(()),
        };
        let lost = {
            let mut state = link.write();
            let had = state.sender.take().is_some();
            state.nodes.clear();
            had
        };
        if lost {
            info!(replica = %link.replica(), forwarded_open = link.open_streams.load(Ordering::Relaxed), "link to replica lost; its routes are dropped");
            delay = LINK_RETRY_MIN;
            failures = 0;
        }
        if link.stop.is_cancelled() {
            return;
        }
        match result {
            Err(LinkError::Itself) => {
                debug!("peer address is this replica; not linking to it");
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

/// One connection to a replica: connects, subscribes to its routes and applies them
/// until the link breaks or the replica goes silent.
async fn link_session(peers: &Peers, link: &Link) -> Result<(), LinkError> {
    let Some(tls) = peers.tls() else {
        return Ok(());
    };
    let t = &peers.transport;
    let connect = async {
        let tcp = TcpStream::connect(&link.addr)
            .await
            .map_err(LinkError::Tcp)?;
        crate::net::tune(&tcp);
        let stream = tls
            .connector
            .connect(tls.server_name.clone(), tcp)
            .await
            .map_err(LinkError::Tls)?;
        Ok::<_, LinkError>(
            transport::client_builder(t)
                .handshake::<_, Bytes>(stream)
                .await?,
        )
    };
    let (sender, mut connection) = tokio::time::timeout(t.handshake_timeout, connect)
        .await
        .map_err(|_| LinkError::Timeout)??;
    // The connection must be polled for anything on it to move, including the
    // subscription below.
    let subscribe = async {
        let mut ready = sender.clone().ready().await?;
        let req = Request::post(format!("http://tunnel{}", proto::PEER_ROUTES_PATH))
            .header(proto::PEER_HELLO_HEADER, peers.hello.clone())
            .body(())
            .map_err(|e| LinkError::Protocol(e.to_string()))?;
        let (response, _send) = ready.send_request(req, false)?;
        let response = response.await?;
        Ok::<_, LinkError>((response, _send))
    };
    let (response, _keep_open) = tokio::select! {
        r = tokio::time::timeout(t.handshake_timeout, subscribe) => r.map_err(|_| LinkError::Timeout)??,
        r = &mut connection => return r.map_err(LinkError::from),
    };
    let hello: PeerHello =
        transport::decode_header(response.headers().get(proto::PEER_HELLO_HEADER))
            .map_err(|e| LinkError::Protocol(format!("peer hello {e}")))?;
    if hello.instance == peers.instance {
        return Err(LinkError::Itself);
    }
    {
        let mut state = link.write();
        state.replica = hello.replica_id.clone();
        state.sender = Some(sender);
    }
    info!(replica = %hello.replica_id, "linked to replica");
    tokio::select! {
        r = receive_routes(link, response.into_body(), t.heartbeat_timeout) => r,
        r = &mut connection => r.map_err(LinkError::from),
    }
}

async fn receive_routes(
    link: &Link,
    mut body: RecvStream,
    silence: Duration,
) -> Result<(), LinkError> {
    let mut decoder = FrameDecoder::default();
    loop {
        let data = match tokio::time::timeout(silence, body.data()).await {
            Err(_) => return Err(LinkError::Silent(silence)),
            Ok(None) => return Ok(()),
            Ok(Some(data)) => data?,
        };
        let _ = body.flow_control().release_capacity(data.len());
        decoder.push(&data);
        while let Some(update) = decoder
            .next_message::<RouteUpdate>()
            .map_err(|e| LinkError::Protocol(e.to_string()))?
        {
            let (held, released) = (update.held.len(), update.released.len());
            let changed = apply_update(&mut link.write().nodes, update);
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
}

/// Accepts other replicas' links: answers route subscriptions with this replica's own
/// sessions and serves forwarded connections from them.
pub async fn serve(
    cloud: Arc<Cloud>,
    listener: TcpListener,
    server_name: String,
    shutdown: CancellationToken,
) {
    while let Some((tcp, remote)) =
        super::entry::next_conn(|| listener.accept(), &shutdown, "peers").await
    {
        crate::net::tune(&tcp);
        let Some(tls) = cloud.peers.tls() else { return };
        let acceptor = tls.acceptor.clone();
        let (cloud, server_name, shutdown) = (cloud.clone(), server_name.clone(), shutdown.clone());
        let span = tracing::info_span!("peer_in", remote = %remote);
        tokio::spawn(
            async move {
                if let Err(e) =
                    serve_link(cloud, tcp, remote, acceptor, &server_name, shutdown).await
                {
                    warn!(error = %e, "replica link refused or failed");
                }
            }
            .instrument(span),
        );
    }
}

async fn serve_link(
    cloud: Arc<Cloud>,
    tcp: TcpStream,
    remote: SocketAddr,
    acceptor: TlsAcceptor,
    server_name: &str,
    shutdown: CancellationToken,
) -> Result<(), LinkError> {
    let t = &cloud.transport;
    let handshake = async {
        let tls = acceptor.accept(tcp).await.map_err(LinkError::Tls)?;
        let cert = tls
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .map(|c| c.as_ref().to_vec());
        // The CA also signs edge certificates: only one naming the replicas may link.
        if !cert.is_some_and(|der| crate::auth::cert_has_dns_name(&der, server_name)) {
            return Err(LinkError::Protocol(format!(
                "client certificate does not name `{server_name}`: not a replica"
            )));
        }
        Ok(transport::server_builder(t)
            .handshake::<_, Bytes>(tls)
            .await?)
    };
    let mut conn = tokio::time::timeout(t.handshake_timeout, handshake)
        .await
        .map_err(|_| LinkError::Timeout)??;
    debug!(%remote, "replica connected");
    loop {
        tokio::select! {
            accepted = conn.accept() => match accepted {
                None => return Ok(()),
                Some(Err(e)) => return Err(e.into()),
                Some(Ok((req, respond))) => dispatch(&cloud, req, respond),
            },
            () = shutdown.cancelled() => return Ok(()),
        }
    }
}

fn dispatch(cloud: &Arc<Cloud>, req: Request<RecvStream>, mut respond: SendResponse<Bytes>) {
    let from = transport::decode_header::<PeerHello>(req.headers().get(proto::PEER_HELLO_HEADER))
        .map(|h| h.replica_id)
        .unwrap_or_else(|_| "?".into());
    match req.uri().path() {
        proto::PEER_ROUTES_PATH => {
            let span = tracing::info_span!("announce", to = %from);
            tokio::spawn(announce(cloud.clone(), respond).instrument(span));
        }
        proto::PEER_DIAL_PATH => {
            tokio::spawn(forwarded(cloud.clone(), req, respond, from));
        }
        path => {
            warn!(path, %from, "unknown stream path from a replica");
            let mut resp = Response::new(());
            *resp.status_mut() = http::StatusCode::NOT_FOUND;
            let _ = respond.send_response(resp, true);
        }
    }
}

/// Streams this replica's own sessions to a peer: all of them, then each change, and a
/// keepalive when nothing changed for a heartbeat interval.
async fn announce(cloud: Arc<Cloud>, mut respond: SendResponse<Bytes>) {
    let mut changes = cloud.peers.local_version.subscribe();
    let mut resp = Response::new(());
    resp.headers_mut()
        .insert(proto::PEER_HELLO_HEADER, cloud.peers.hello.clone());
    let Ok(mut send) = respond.send_response(resp, false) else {
        return;
    };
    let mut sent = HashMap::new();
    let mut reset = true;
    let mut keepalive = tokio::time::interval(cloud.transport.heartbeat_interval);
    keepalive.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        // Mark the version seen before reading the registry, so a change in between
        // wakes us again rather than being lost.
        changes.borrow_and_update();
        let now = local_claims(&cloud.registry);
        for update in route_updates(&sent, &now, reset) {
            if let Err(e) = crate::splice::send_all(&mut send, proto::encode_frame(&update)).await {
                debug!(error = %e, "route stream to replica ended");
                return;
            }
        }
        sent = now;
        reset = false;
        tokio::select! {
            r = changes.changed() => if r.is_err() { return },
            _ = keepalive.tick() => {
                if send.send_data(proto::encode_frame(&RouteUpdate::default()), false).is_err() {
                    return;
                }
            }
            _ = std::future::poll_fn(|cx| send.poll_reset(cx)) => return,
            // Shutdown must not wait for the peer to hang up: the cloud state is freed
            // (and the eBPF programs detached) once the last task lets go of it.
            () = cloud.peers.shutdown.cancelled() => return,
        }
    }
}

/// A connection another replica forwarded here: served from this replica's own
/// session for the node, or refused at once; never forwarded again.
async fn forwarded(
    cloud: Arc<Cloud>,
    req: Request<RecvStream>,
    mut respond: SendResponse<Bytes>,
    from: String,
) {
    let request: DialRequest =
        match transport::decode_header(req.headers().get(proto::DIAL_REQUEST_HEADER)) {
            Ok(r) => r,
            Err(e) => {
                warn!(%from, error = %e, "bad forwarded dial request");
                let result = proto::DialResult {
                    status: DialStatus::BadRequest as i32,
                    message: format!("dial request {e}"),
                };
                let _ = respond.send_response(transport::dial_response(&result), true);
                return;
            }
        };
    cloud
        .metrics
        .connections
        .get_or_create(&crate::metrics::EntryLabel { entry: "peer" })
        .inc();
    let span = tracing::debug_span!("forwarded", id = request.connection_id, node = %request.node, target = %request.target, from = %from);
    async move {
        let Some(session) = cloud.registry.get(&request.node) else {
            let message = format!(
                "replica `{}` holds no edge session for node `{}` (forwarded connections are never forwarded again)",
                cloud.peers.replica_id, request.node
            );
            info!("forwarded connection refused: node not held here");
            let result = proto::DialResult { status: DialStatus::NotHeld as i32, message };
            let _ = respond.send_response(transport::dial_response(&result), true);
            return;
        };
        let dialing = match session.dial(&request).await {
            Ok(dialing) => dialing,
            Err(e) => {
                info!(error = %e, "forwarded connection failed");
                let _ = respond.send_response(transport::dial_response(&e.dial_result()), true);
                return;
            }
        };
        // The forwarding replica's bytes go on to the edge at once, right behind the
        // dial request (the client may be one that waits for nothing); the edge's answer
        // goes back to the forwarding replica when it comes.
        let (edge_send, answer, guard) = dialing.into_parts();
        let answer = async move {
            match answer.wait().await {
                Ok(edge_recv) => {
                    let ok = proto::DialResult { status: DialStatus::Ok as i32, message: String::new() };
                    let send = respond
                        .send_response(transport::dial_response(&ok), false)
                        .map_err(|e| OpenError::Tunnel(format!("the forwarding replica went away: {e}")))?;
                    Ok((edge_recv, send))
                }
                Err(e) => {
                    let _ = respond.send_response(transport::dial_response(&e.dial_result()), true);
                    Err(e)
                }
            }
        };
        let report = splice_h2::relay_dialing(req.into_body(), edge_send, answer).await;
        drop(guard);
        match &report.refused {
            Some(e) => info!(error = %e, "forwarded connection failed"),
            None => debug!(to_edge = report.a_to_b, from_edge = report.b_to_a, aborted = ?report.aborted, "forwarded connection ended"),
        }
    }
    .instrument(span)
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(entries: &[(&str, u64)]) -> HashMap<String, u64> {
        entries.iter().map(|(n, t)| (n.to_string(), *t)).collect()
    }

    #[test]
    fn newest_session_wins_and_ties_stay_local() {
        assert_eq!(choose(None, &[]), None);
        assert_eq!(choose(Some(5), &[]), Some(Choice::Local));
        assert_eq!(choose(None, &[3, 9, 4]), Some(Choice::Peer(1)));
        assert_eq!(choose(Some(10), &[3, 9]), Some(Choice::Local));
        assert_eq!(choose(Some(10), &[3, 11]), Some(Choice::Peer(1)));
        assert_eq!(choose(Some(10), &[10]), Some(Choice::Local));
    }

    #[test]
    fn first_update_resets_then_only_changes_travel() {
        let empty = HashMap::new();
        let first = route_updates(&empty, &empty, true);
        assert_eq!(
            first,
            vec![RouteUpdate {
                reset: true,
                ..Default::default()
            }]
        );
        assert!(route_updates(&empty, &empty, false).is_empty());

        let before = map(&[("edge-a", 1), ("edge-b", 2)]);
        let after = map(&[("edge-b", 2), ("edge-c", 3), ("edge-a", 4)]);
        let updates = route_updates(&before, &after, false);
        let held: Vec<_> = updates
            .iter()
            .flat_map(|u| u.held.iter().map(|c| (c.node.as_str(), c.connected_at_ms)))
            .collect();
        assert_eq!(held, vec![("edge-a", 4), ("edge-c", 3)]);
        assert!(updates.iter().all(|u| !u.reset && u.released.is_empty()));
        let gone = route_updates(&after, &map(&[("edge-c", 3)]), false);
        let released: Vec<_> = gone.iter().flat_map(|u| u.released.clone()).collect();
        assert_eq!(released, vec!["edge-a", "edge-b"]);
    }

    #[test]
    fn large_snapshots_are_split_below_the_message_bound() {
        let now: HashMap<String, u64> = (0..1000)
            .map(|i| (format!("{}-{i}", "n".repeat(240)), i))
            .collect();
        let updates = route_updates(&HashMap::new(), &now, true);
        assert_eq!(updates.len(), 5);
        assert!(updates[0].reset && updates[1..].iter().all(|u| !u.reset));
        for u in &updates {
            assert!(
                proto::encode_frame(u).len() < proto::MAX_MESSAGE_LEN,
                "{}",
                proto::encode_frame(u).len()
            );
        }
        let mut got = HashMap::new();
        for u in updates {
            apply_update(&mut got, u);
        }
        assert_eq!(got, now);
    }

    #[test]
    fn applying_updates_tracks_the_peer_and_drops_bad_names() {
        let mut nodes = map(&[("stale", 1)]);
        let reset = RouteUpdate {
            reset: true,
            held: vec![
                NodeClaim {
                    node: "edge-a".into(),
                    connected_at_ms: 7,
                },
                NodeClaim {
                    node: "Bad_Name".into(),
                    connected_at_ms: 7,
                },
            ],
            released: vec![],
        };
        assert!(apply_update(&mut nodes, reset));
        assert_eq!(nodes, map(&[("edge-a", 7)]));
        assert!(
            !apply_update(&mut nodes, RouteUpdate::default()),
            "a keepalive changes nothing"
        );
        assert!(apply_update(
            &mut nodes,
            RouteUpdate {
                released: vec!["edge-a".into()],
                ..Default::default()
            }
        ));
        assert!(nodes.is_empty());
    }
}
