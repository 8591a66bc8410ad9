//! Where a cloud-side connection goes, in one call for the entry: `Router::route` takes
//! what the entry knows ([`Ask`]), decides the node and target over the node table (the
//! pure functions of `route`), then finds the session that carries it: the node's edge
//! session on this replica, or the link to the replica that holds it.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::route::{self, Route, RouteError};
use crate::addr::{NodeName, OrigDst, Target};
use crate::cloud::edges::registry::Registry;
use crate::cloud::edges::session::EdgeSession;
use crate::cloud::nodes::Nodes;
use crate::cloud::nodes::journal::Noted;
use crate::cloud::peer::{self, Link, Peers};

/// The signals of what [`Router::without_tunnel`] reads: the node table, this replica's
/// sessions, the other replicas' routes.
pub(crate) struct RouteChanges([watch::Receiver<u64>; 3]);

impl RouteChanges {
    /// Marks every change so far as seen: call it before reading, so a change in between
    /// wakes [`RouteChanges::changed`] rather than being lost.
    pub(crate) fn mark_seen(&mut self) {
        for signal in &mut self.0 {
            signal.borrow_and_update();
        }
    }

    /// Whether something changed since [`RouteChanges::mark_seen`].
    pub(crate) fn pending(&self) -> bool {
        self.0
            .iter()
            .any(|signal| signal.has_changed().unwrap_or(false))
    }

    /// Returns at the next change after [`RouteChanges::mark_seen`].
    pub(crate) async fn changed(&mut self) {
        let [nodes, registry, peers] = &mut self.0;
        // The senders live in the components the router holds: none is dropped while it
        // is, so an error never ends the wait early.
        tokio::select! {
            Ok(()) = nodes.changed() => {}
            Ok(()) = registry.changed() => {}
            Ok(()) = peers.changed() => {}
            else => std::future::pending().await,
        }
    }
}

/// How long a connection waits for a route to a node that no replica is known to hold
/// while some replica's holdings are unknown: its link is down, so it may be a replica
/// restarting, whose edges are on their way to another. An edge that drains reconnects
/// and its route crosses to every replica within a few hundred ms (`edge/connect.rs`,
/// the link's retry); this leaves room for a reconnect backoff or two.
const ROUTE_WAIT: Duration = Duration::from_secs(3);

/// The versions of what routes are made of: the node table, this replica's sessions,
/// the other replicas' routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct RouteVersion([u64; 3]);

/// Why a connection has nowhere to go.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Unroutable {
    #[error(transparent)]
    Route(#[from] RouteError),
    #[error("node `{0}` has no connected edge")]
    NotConnected(NodeName),
    #[error("no edge is connected")]
    NoEdges,
}

/// What an entry knows about where its connection goes.
pub(crate) enum Ask<'a> {
    /// An eBPF-redirected connection: the node address it was going to.
    Redirect(OrigDst),
    /// `CONNECT host:port` (see `route::route_connect`): a node without an address in
    /// the table is still reachable by name while some replica holds its edge.
    Connect(&'a str),
    /// A terminated HTTPS connection for a node (its SNI or Host), to a target with TLS.
    Https { node: String, target: Target },
    /// A fixed forward: the route is the config's.
    Forward(&'a Route),
}

/// A routed connection: what the edge dials, and which session carries it.
pub(crate) struct Destination {
    pub(crate) node: NodeName,
    /// What the edge dials.
    pub(crate) target: Target,
    /// The edge wraps its connection to the target in TLS.
    pub(crate) tls: bool,
    pub(crate) via: Via,
}

/// The session a connection goes out on.
pub(crate) enum Via {
    /// The node's edge session on this replica.
    Session(Arc<EdgeSession>),
    /// The link to the replica that holds the node's edge session.
    Replica(Arc<Link>),
}

/// Decides where each connection goes: from the node table, this replica's sessions and
/// what the other replicas announce.
pub(crate) struct Router {
    nodes: Arc<Nodes>,
    registry: Arc<Registry>,
    peers: Arc<Peers>,
}

impl Router {
    pub(crate) fn new(nodes: Arc<Nodes>, registry: Arc<Registry>, peers: Arc<Peers>) -> Self {
        Self {
            nodes,
            registry,
            peers,
        }
    }

    /// Where the connection goes: the node and target, then the session that carries it
    /// ([`Router::locate_waiting`]).
    pub(crate) async fn route(&self, ask: Ask<'_>) -> Result<Destination, Unroutable> {
        let routed = match ask {
            Ask::Redirect(dst) => route::route_address(&self.nodes.get(), dst.0),
            Ask::Connect(authority) => {
                route::route_connect(&self.nodes.get(), authority, |n| self.is_connected(n))
            }
            Ask::Https { node, target } => self.https(node, target),
            Ask::Forward(route) => Ok(route.clone()),
        };
        self.locate_waiting(routed?, false).await
    }

    /// The session that carries `route` ([`Router::locate`]); a node no replica is
    /// known to hold is waited for, at most [`ROUTE_WAIT`], while some replica's
    /// holdings are unknown or when it is moving: `moving` (this connection's call was
    /// just refused for it), or another replica claimed it a moment ago
    /// ([`Peers::moving_until`]). Otherwise it fails at once, as the eBPF program fails
    /// its connects with "host is down" (`conn::outage`).
    pub(crate) async fn locate_waiting(
        &self,
        route: Route,
        moving: bool,
    ) -> Result<Destination, Unroutable> {
        let deadline = tokio::time::Instant::now() + ROUTE_WAIT;
        let mut changes = self.changes();
        loop {
            changes.mark_seen();
            match self.locate(route.clone()) {
                Err(Unroutable::NotConnected(node))
                    if moving
                        || !self.routes_known()
                        || self.peers.moving_until(&node).is_some() =>
                {
                    let wait = tokio::time::timeout_at(deadline, changes.changed());
                    if wait.await.is_err() {
                        return self.locate(route);
                    }
                }
                located => return located,
            }
        }
    }

    /// Whether the routes changed since `seen` (a [`Router::version`]), waiting for a
    /// change at most [`ROUTE_WAIT`].
    pub(crate) async fn changed_since(&self, seen: RouteVersion) -> bool {
        let mut changes = self.changes();
        changes.mark_seen();
        self.version() != seen
            || tokio::time::timeout(ROUTE_WAIT, changes.changed())
                .await
                .is_ok()
    }

    /// Where the routes stand: a [`Router::changed_since`] on it returns at the next
    /// change.
    pub(crate) fn version(&self) -> RouteVersion {
        RouteVersion([
            *self.nodes.subscribe().borrow(),
            *self.registry.subscribe().borrow(),
            *self.peers.subscribe().borrow(),
        ])
    }

    /// The node a redirected connection goes to, if its destination is a node address.
    pub(crate) fn node_at(&self, dst: OrigDst) -> Option<NodeName> {
        self.nodes.get().node_for_ip(dst.0.ip()).cloned()
    }

    fn https(&self, node: String, target: Target) -> Result<Route, RouteError> {
        let known = self.registry.contains(&node) || self.nodes.get().addresses(&node).is_some();
        match NodeName::new(node.clone()) {
            Ok(node) if known => Ok(Route {
                node: Some(node),
                target,
                tls: true,
            }),
            _ => Err(RouteError::UnknownHost(node)),
        }
    }

    /// Whether this replica holds an edge session for `node`.
    pub(crate) fn is_here(&self, node: &str) -> bool {
        self.registry.contains(node)
    }

    /// Returns once this replica holds an edge session for `node`: woken by each change
    /// of the sessions, not by polling.
    pub(crate) async fn until_here(&self, node: &str) {
        // Subscribed before the check, so a session added between the two is not missed.
        let mut changes = self.registry.subscribe();
        while !self.is_here(node) {
            // The sender lives in the registry this router holds: it cannot be gone.
            if changes.changed().await.is_err() {
                return;
            }
        }
    }

    /// Whether some replica, this one or another, holds an edge session for `node`.
    fn is_connected(&self, node: &str) -> bool {
        self.registry.contains(node) || self.peers.holder(node, None).is_some()
    }

    /// The edge nodes of the table that no replica holds a session for, and none
    /// claimed a moment ago (an edge moving between replicas), with their addresses:
    /// where a connection would find no tunnel. Only as sure as [`Peers::routes_known`]
    /// says.
    pub(crate) fn without_tunnel(&self) -> BTreeMap<NodeName, Vec<IpAddr>> {
        self.nodes
            .get()
            .nodes()
            .filter(|(node, _)| !self.is_connected(node) && self.peers.moving_until(node).is_none())
            .map(|(node, ips)| (node.clone(), ips.to_vec()))
            .collect()
    }

    /// Those of `nodes` that are edges of the table and that no replica holds a session
    /// for, with their addresses: [`Router::without_tunnel`] for them alone.
    pub(crate) fn without_tunnel_among(
        &self,
        nodes: &BTreeSet<NodeName>,
    ) -> BTreeMap<NodeName, Vec<IpAddr>> {
        let table = self.nodes.get();
        nodes
            .iter()
            .filter_map(|node| Some((node, table.addresses(node)?)))
            .filter(|(node, _)| !self.is_connected(node) && self.peers.moving_until(node).is_none())
            .map(|(node, ips)| (node.clone(), ips.to_vec()))
            .collect()
    }

    /// The nodes whose part in [`Router::without_tunnel`] may have changed since the
    /// version `seen`, and the version now: read before what it names is.
    pub(crate) fn changed_nodes(&self, seen: RouteVersion) -> (RouteVersion, Noted) {
        let journals = [
            self.nodes.journal(),
            self.registry.journal(),
            self.peers.journal(),
        ];
        let mut now = seen;
        let mut noted = Noted::Nodes(BTreeSet::new());
        for (i, journal) in journals.into_iter().enumerate() {
            let (version, named) = journal.since(seen.0[i]);
            now.0[i] = version;
            noted.merge(named);
        }
        (now, noted)
    }

    /// When the last node moving between replicas stops counting as such
    /// ([`Router::without_tunnel`] leaves it out until then).
    pub(crate) fn moving_ends(&self) -> Option<tokio::time::Instant> {
        self.peers.moving_ends()
    }

    /// Notes the nodes that stopped counting as moving, so that what follows the
    /// changes (the outage marks) looks at them again.
    pub(crate) fn note_moves_ended(&self) {
        self.peers.note_moves_ended();
    }

    /// Whether this replica knows what every other replica holds.
    pub(crate) fn routes_known(&self) -> bool {
        self.peers.routes_known()
    }

    /// What wakes whoever follows [`Router::without_tunnel`]: a new node table, a
    /// session here added or gone, another replica's routes changed.
    pub(crate) fn changes(&self) -> RouteChanges {
        RouteChanges([
            self.nodes.subscribe(),
            self.registry.subscribe(),
            self.peers.subscribe(),
        ])
    }

    /// The session that carries `route` now: the node's own here, unless another replica
    /// holds a newer one; the first connected edge when the route names no node.
    fn locate(&self, route: Route) -> Result<Destination, Unroutable> {
        let Route { node, target, tls } = route;
        let Some(node) = node else {
            let session = self.registry.first().ok_or(Unroutable::NoEdges)?;
            return Ok(Destination {
                node: session.node.clone(),
                target,
                tls,
                via: Via::Session(session),
            });
        };
        let local = self.registry.get(&node);
        let local_since = local.as_ref().map(|s| peer::unix_ms(s.connected_at));
        let via = match self.peers.holder(&node, local_since) {
            Some(link) => Via::Replica(link),
            None => Via::Session(local.ok_or_else(|| Unroutable::NotConnected(node.clone()))?),
        };
        Ok(Destination {
            node,
            target,
            tls,
            via,
        })
    }
}
