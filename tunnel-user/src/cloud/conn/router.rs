//! Where a cloud-side connection goes: the node table (`Nodes`, replaced when the
//! Kubernetes watch sees the edge Nodes change) and the `Router`, which turns an entry's
//! request into a `Destination`: the node, the target on it, and the edge session on
//! this replica or the link to the replica that holds it. The decisions over the node
//! table alone are the pure functions of `route`.

use std::net::SocketAddr;
use std::sync::Arc;

use super::nodes::Nodes;
use super::route::{self, Route, RouteError};
use crate::cloud::edges::registry::Registry;
use crate::cloud::edges::session::EdgeSession;
use crate::cloud::peer::{self, Link, Peers};

/// Why a connection has nowhere to go.
#[derive(Debug, thiserror::Error)]
pub enum Unroutable {
    #[error(transparent)]
    Route(#[from] RouteError),
    #[error("node `{0}` has no connected edge")]
    NotConnected(String),
    #[error("no edge is connected")]
    NoEdges,
}

/// A routed connection: what the edge dials, and which session carries it.
pub struct Destination {
    pub node: String,
    /// host:port the edge dials.
    pub target: String,
    /// The edge wraps its connection to the target in TLS.
    pub tls: bool,
    pub via: Via,
}

/// The session a connection goes out on.
pub enum Via {
    /// The node's edge session on this replica.
    Session(Arc<EdgeSession>),
    /// The link to the replica that holds the node's edge session.
    Replica(Arc<Link>),
}

/// Decides where each connection goes: from the node table, this replica's sessions and
/// what the other replicas announce.
pub struct Router {
    nodes: Arc<Nodes>,
    registry: Arc<Registry>,
    peers: Arc<Peers>,
}

impl Router {
    pub fn new(nodes: Arc<Nodes>, registry: Arc<Registry>, peers: Arc<Peers>) -> Self {
        Self {
            nodes,
            registry,
            peers,
        }
    }

    /// `CONNECT host:port` (see `route::route_connect`): a node without an address in the
    /// table is still reachable by name while some replica holds its edge.
    pub fn connect(&self, authority: &str) -> Result<Route, RouteError> {
        route::route_connect(&self.nodes.get(), authority, |n| self.is_connected(n))
    }

    /// A connection to a node address (an eBPF-redirected connection's original
    /// destination).
    pub fn address(&self, dst: SocketAddr) -> Result<Route, RouteError> {
        route::route_address(&self.nodes.get(), dst)
    }

    /// A terminated HTTPS connection for `node` (its SNI or Host), to `target` with TLS.
    pub fn https(&self, node: String, target: String) -> Result<Route, RouteError> {
        if self.registry.contains(&node) || self.nodes.get().addresses(&node).is_some() {
            Ok(Route {
                node: Some(node),
                target,
                tls: true,
            })
        } else {
            Err(RouteError::UnknownHost(node))
        }
    }

    /// Whether this replica holds an edge session for `node`.
    pub fn is_here(&self, node: &str) -> bool {
        self.registry.contains(node)
    }

    /// Whether some replica, this one or another, holds an edge session for `node`.
    fn is_connected(&self, node: &str) -> bool {
        self.registry.contains(node) || self.peers.holder(node, None).is_some()
    }

    /// The session that carries `routed`: the node's own here, unless another replica
    /// holds a newer one; the first connected edge when the route names no node.
    pub fn locate(&self, routed: Result<Route, RouteError>) -> Result<Destination, Unroutable> {
        let Route { node, target, tls } = routed?;
        let Some(node) = node else {
            let session = self.registry.first().ok_or(Unroutable::NoEdges)?;
            return Ok(Destination {
                node: session.node.to_string(),
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
