//! Multi-replica routing: a connection that reaches a replica without the node's edge
//! session is forwarded to the replica that holds it.
//!
//! Every replica keeps one link (mTLS, then HTTP/2 with this replica as the client) to
//! each other replica (`links`). On it, the other replica streams the nodes whose edge sessions
//! it holds itself: everything once, then every change as it happens, so routes
//! converge as fast as a message crosses, and no connection waits for a lookup. A link
//! that breaks takes its routes with it. A forwarded connection is one more stream on
//! the same link, carrying its request (`call::request`) with the node named; the replica at the
//! far end serves it from its own sessions only, never forwarding it again, and only
//! announces its own sessions, never what it learned: one hop at most, no loops.
//!
//! When two replicas claim a node (an edge reconnected elsewhere before its old session
//! timed out), the newer session wins.
//! (`routes`). Each replica's `peers.listen` is a gRPC server (`serve`): the `Peer`
//! service of `proto/tunnel.proto` and the standard `grpc.health.v1.Health`.

mod links;
mod routes;
mod serve;

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use anyhow::Context as _;
use proto::PeerHello;
use rand::Rng;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_rustls::{TlsAcceptor, TlsConnector};
use tokio_util::sync::CancellationToken;
use tonic::metadata::BinaryMetadataValue;
use tracing::{Instrument, info};

use crate::addr::NodeName;
use crate::cloud::nodes::journal::{Journal, Noted};
use crate::config::{CloudConfig, TransportConfig};

pub(crate) use links::Link;
pub(crate) use routes::{Choice, choose, unix_ms};
pub use routes::{MAX_NODES_PER_PEER, apply_update, route_updates};
pub(crate) use serve::serve;

/// How long a node another replica stopped claiming is taken for an edge moving to
/// another replica: a replica that drains stops announcing its sessions at once, and its
/// edges register again elsewhere within a reconnect or two (`edge/connect.rs`, whose
/// backoff starts within 100 ms) while the links learn of it. Meanwhile a connection to
/// the node waits for its route (`Router::locate_waiting`) and the eBPF program does not
/// fail connects to it as host down (`conn::outage`).
pub(crate) const MOVING: Duration = Duration::from_secs(3);

/// The mTLS both ends of a link use: the cloud certificate, presented as server and as
/// client. Reloaded with the certificate (see `reload`), so links made after a rotation
/// present the new one.
pub(crate) struct PeerTls {
    acceptor: TlsAcceptor,
    /// ALPN `h2`: the gRPC connection (`Peer.Routes`, `Peer.Dial`).
    grpc_connector: TlsConnector,
    server_name: rustls::pki_types::ServerName<'static>,
}

impl PeerTls {
    /// Both ends present `identity`, the replica's serving certificate, whether from
    /// `tunnel.cert`/`key` or self-issued (`cloud::lifecycle::serving`).
    pub(crate) fn build(
        config: &CloudConfig,
        identity: &crate::io::tls::Identity,
    ) -> anyhow::Result<Self> {
        let t = &config.tunnel;
        let ca = config
            .peers
            .ca(t)
            .context("peers.ca or tunnel.client_ca is required for peers")?;
        Ok(Self {
            acceptor: TlsAcceptor::from(crate::io::tls::peer_server_config_with(identity, ca)?),
            grpc_connector: TlsConnector::from(crate::io::tls::peer_client_config_with(
                ca, identity, b"h2",
            )?),
            server_name: crate::io::tls::server_name(&config.peers.server_name)?,
        })
    }
}

/// The CSRs are shared among the replicas this one knows to be up: itself and those its
/// links reach, by replica id.
impl crate::cloud::edges::csr::Replicas for Peers {
    fn live_replicas(&self) -> Vec<String> {
        let links = self.links.read().unwrap_or_else(|e| e.into_inner());
        let mut ids: Vec<String> = links.values().filter_map(|l| l.live_replica()).collect();
        ids.push(self.replica_id.clone());
        ids.sort();
        ids.dedup();
        ids
    }

    fn replica_id(&self) -> &str {
        &self.replica_id
    }
}

/// This replica's view of the others, and what it tells them about itself.
pub(crate) struct Peers {
    replica_id: String,
    instance: u64,
    /// Our `PeerHello`, sent on every call to a peer and in every answer.
    hello: BinaryMetadataValue,
    /// None when this replica has no peers listener (a single replica).
    tls: RwLock<Option<Arc<PeerTls>>>,
    /// Bumped by each `set_tls`: the links up move to the new certificate.
    tls_version: watch::Sender<u64>,
    transport: TransportConfig,
    links: RwLock<HashMap<String, Arc<Link>>>,
    /// Noted whenever what the links know changes: a replica's routes (the nodes they
    /// name), a link that comes up, goes down, joins or leaves the list (every node).
    journal: Journal,
    /// Nodes another replica stopped claiming lately (it released them, or its link went
    /// down), and when: for [`MOVING`] after, such a node is an edge on its way to
    /// another replica.
    departed: Mutex<HashMap<String, Instant>>,
    shutdown: CancellationToken,
}

impl Peers {
    pub(crate) fn new(
        replica_id: String,
        tls: Option<PeerTls>,
        transport: TransportConfig,
        shutdown: CancellationToken,
    ) -> Arc<Self> {
        let instance = rand::rng().random::<u64>();
        let hello = proto::to_metadata(&PeerHello {
            replica_id: replica_id.clone(),
            instance,
        });
        Arc::new(Self {
            replica_id,
            instance,
            hello,
            tls: RwLock::new(tls.map(Arc::new)),
            tls_version: watch::Sender::new(0),
            transport,
            links: RwLock::default(),
            journal: Journal::default(),
            departed: Mutex::default(),
            shutdown,
        })
    }

    /// Wakes whenever what the other replicas hold, as this one knows it, changes.
    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.journal.subscribe()
    }

    /// The nodes whose routes changed.
    pub(crate) fn journal(&self) -> &Journal {
        &self.journal
    }

    fn routes_changed(&self, nodes: Noted) {
        match nodes {
            Noted::Nodes(nodes) => self.journal.note(nodes),
            Noted::Everything => self.journal.note_everything(),
        }
    }

    /// Records that a replica stopped claiming `nodes` now.
    fn departed(&self, nodes: impl IntoIterator<Item = String>) {
        self.note_moves_ended();
        let now = Instant::now();
        let mut departed = self.departed.lock().unwrap_or_else(|e| e.into_inner());
        departed.extend(nodes.into_iter().map(|node| (node, now)));
    }

    /// Forgets the nodes that stopped counting as moving and notes them in the journal:
    /// the outage marks, which left them out while they moved, look at them again.
    pub(crate) fn note_moves_ended(&self) {
        let now = Instant::now();
        let mut ended = Vec::new();
        self.departed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|node, at| {
                let moving = now.duration_since(*at) < MOVING;
                if !moving {
                    ended.extend(NodeName::new(node.clone()).ok());
                }
                moving
            });
        if !ended.is_empty() {
            self.journal.note(ended);
        }
    }

    /// Until when `node` counts as moving: a replica claimed it less than [`MOVING`] ago.
    pub(crate) fn moving_until(&self, node: &str) -> Option<Instant> {
        let departed = self.departed.lock().unwrap_or_else(|e| e.into_inner());
        let until = *departed.get(node)? + MOVING;
        (until > Instant::now()).then_some(until)
    }

    /// When the last node counted as moving now stops being so.
    pub(crate) fn moving_ends(&self) -> Option<Instant> {
        let departed = self.departed.lock().unwrap_or_else(|e| e.into_inner());
        let until = *departed.values().max()? + MOVING;
        (until > Instant::now()).then_some(until)
    }

    /// Whether this replica knows which nodes every other replica in its list holds:
    /// each link is up and has brought its replica's routes (or leads back to this
    /// replica). A replica it cannot reach may hold any node.
    pub(crate) fn routes_known(&self) -> bool {
        let links = self.links.read().unwrap_or_else(|e| e.into_inner());
        links.values().all(|link| link.routes_known())
    }

    /// What this replica tells the others about itself.
    fn hello_message(&self) -> PeerHello {
        PeerHello {
            replica_id: self.replica_id.clone(),
            instance: self.instance,
        }
    }

    fn tls(&self) -> Option<Arc<PeerTls>> {
        self.tls.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// New links, both ways, use `tls`, and the links this process opened move to it
    /// (`links::link_session`): a renewed certificate is presented on them too, as an
    /// edge presents its renewal on its open session.
    pub(crate) fn set_tls(&self, tls: PeerTls) {
        *self.tls.write().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(tls));
        self.tls_version.send_modify(|v| *v = v.wrapping_add(1));
    }

    /// Wakes at the next `set_tls`.
    fn tls_changes(&self) -> watch::Receiver<u64> {
        self.tls_version.subscribe()
    }

    /// Whether this replica links to others at all.
    pub(crate) fn enabled(&self) -> bool {
        self.tls().is_some()
    }

    /// The replica to forward a connection for `node` to: one whose session is newer
    /// than `local_since` (this replica's own session, if any). `None`: serve locally,
    /// or nobody holds the node.
    pub(crate) fn holder(&self, node: &str, local_since: Option<u64>) -> Option<Arc<Link>> {
        let links = self.links.read().unwrap_or_else(|e| e.into_inner());
        let mut candidates = Vec::new();
        let mut claims = Vec::new();
        for link in links.values() {
            if let Some(since) = link.claim(node) {
                candidates.push(link.clone());
                claims.push(since);
            }
        }
        match choose(local_since, &claims)? {
            Choice::Local => None,
            Choice::Peer(i) => candidates.into_iter().nth(i),
        }
    }

    /// Makes the set of peer addresses `addrs`: links to new ones start, links to
    /// addresses no longer listed stop.
    pub(crate) fn set_addresses(self: &Arc<Self>, addrs: &BTreeSet<String>) {
        if !self.enabled() {
            return;
        }
        let mut links = self.links.write().unwrap_or_else(|e| e.into_inner());
        let mut changed = false;
        links.retain(|addr, link| {
            let keep = addrs.contains(addr);
            if !keep {
                info!(peer = %addr, "replica left the peer list");
                link.stop();
                changed = true;
            }
            keep
        });
        for addr in addrs {
            if links.contains_key(addr) {
                continue;
            }
            changed = true;
            let link = Arc::new(Link::new(addr.clone(), self.shutdown.child_token(), self));
            links.insert(addr.clone(), link.clone());
            let span = tracing::info_span!("peer", peer = %addr);
            tokio::spawn(links::run_link(self.clone(), link).instrument(span));
        }
        drop(links);
        if changed {
            self.routes_changed(Noted::Everything);
        }
    }
}
