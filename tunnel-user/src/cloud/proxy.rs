//! From a routed cloud-side connection to a stream on the node's edge session, and the
//! splice that carries it. Every entry (forward, HTTP CONNECT, eBPF redirect) ends here.

use std::sync::atomic::Ordering;
use std::time::{Instant, SystemTime};

use bytes::Bytes;
use proto::DialRequest;
use tracing::{debug, info, warn};

use super::Cloud;
use super::connections::Connection;
use super::route::{Route, RouteError};
use super::session::{EdgeStream, OpenError};
use crate::metrics::{EntryLabel, ReasonLabel};
use crate::splice::{self, Meter, Socket, SpliceEnd};

#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error(transparent)]
    Route(#[from] RouteError),
    #[error("node `{0}` has no connected edge")]
    NotConnected(String),
    #[error("no edge is connected")]
    NoEdges,
    #[error("node `{node}`: {source}")]
    Open { node: String, source: OpenError },
    #[error("node `{node}` via replica `{replica}`: {source}")]
    Forwarded { node: String, replica: String, source: OpenError },
}

impl ProxyError {
    /// The HTTP status an HTTP CONNECT client gets for this error.
    pub fn http_status(&self) -> (u16, &'static str) {
        match self {
            ProxyError::Route(RouteError::BadAuthority(_)) => (400, "Bad Request"),
            ProxyError::Route(RouteError::UnknownHost(_)) => (404, "Not Found"),
            ProxyError::NotConnected(_) | ProxyError::NoEdges => (502, "Bad Gateway"),
            ProxyError::Open { source, .. } | ProxyError::Forwarded { source, .. } => match source {
                OpenError::Forbidden(_) => (403, "Forbidden"),
                OpenError::Refused(_) | OpenError::Tunnel(_) | OpenError::BadRequest(_) | OpenError::NotHeld(_) => {
                    (502, "Bad Gateway")
                }
                OpenError::Timeout => (504, "Gateway Timeout"),
                OpenError::Overloaded => (503, "Service Unavailable"),
            },
        }
    }

    /// The `reason` label of the dial-failure metric.
    pub fn reason(&self) -> &'static str {
        match self {
            ProxyError::Route(RouteError::BadAuthority(_)) => "bad_request",
            ProxyError::Route(RouteError::UnknownHost(_)) => "unknown_node",
            ProxyError::NotConnected(_) | ProxyError::NoEdges => "not_connected",
            ProxyError::Open { source, .. } | ProxyError::Forwarded { source, .. } => match source {
                OpenError::Forbidden(_) => "forbidden",
                OpenError::Refused(_) => "refused",
                OpenError::Timeout => "timeout",
                OpenError::Overloaded => "overloaded",
                OpenError::BadRequest(_) => "bad_request",
                OpenError::Tunnel(_) => "tunnel",
                OpenError::NotHeld(_) => "not_held",
            },
        }
    }
}

/// A client connection on its way in: which entry took it, and from where.
pub struct Client<'a> {
    pub entry: &'static str,
    pub addr: &'a str,
}

/// An opened stream and what it is for, ready to splice.
pub struct Opened {
    pub id: u64,
    pub node: String,
    pub target: String,
    pub stream: EdgeStream,
}

/// Takes the routing decision for a client connection, finds the route's edge session,
/// on this replica or on the replica that holds it, and opens a stream there; the edge has connected to the target when this returns Ok.
/// Failures, routing ones included, are counted and logged here, once.
pub async fn open(cloud: &Cloud, routed: Result<Route, RouteError>, client: &Client<'_>) -> Result<Opened, ProxyError> {
    cloud.metrics.connections.get_or_create(&EntryLabel { entry: client.entry }).inc();
    let result = match routed {
        Ok(route) => open_inner(cloud, &route, client).await,
        Err(e) => Err(e.into()),
    };
    if let Err(e) = &result {
        cloud.metrics.dial_failures.get_or_create(&ReasonLabel { reason: e.reason() }).inc();
        match e {
            ProxyError::Open { source: OpenError::Tunnel(_), .. } | ProxyError::Forwarded { source: OpenError::Tunnel(_), .. } => warn!(error = %e, client = client.addr, "connection failed"),
            _ => info!(error = %e, client = client.addr, "connection refused"),
        }
    }
    result
}

async fn open_inner(cloud: &Cloud, route: &Route, client: &Client<'_>) -> Result<Opened, ProxyError> {
    let id = cloud.next_connection_id.fetch_add(1, Ordering::Relaxed);
    let mut request = DialRequest {
        target: route.target.clone(),
        connection_id: id,
        client: client.addr.to_string(),
        node: String::new(),
        tls: route.tls,
    };
    let started = Instant::now();
    let session = match &route.node {
        Some(node) => {
            let local = cloud.registry.get(node);
            let local_since = local.as_ref().map(|s| super::peer::unix_ms(s.connected_at));
            if let Some(link) = cloud.peers.holder(node, local_since) {
                request.node = node.clone();
                debug!(id, node = %node, replica = %link.replica(), "forwarding to the replica that holds the node");
                cloud.metrics.peer_forwards.inc();
                let stream = link.open(&cloud.peers, &request).await.map_err(|source| ProxyError::Forwarded {
                    node: node.clone(),
                    replica: link.replica(),
                    source,
                })?;
                cloud.metrics.dial_seconds.observe(started.elapsed().as_secs_f64());
                return Ok(Opened { id, node: node.clone(), target: route.target.clone(), stream });
            }
            local.ok_or_else(|| ProxyError::NotConnected(node.clone()))?
        }
        None => cloud.registry.first().ok_or(ProxyError::NoEdges)?,
    };
    let stream = session
        .open(&request)
        .await
        .map_err(|source| ProxyError::Open { node: session.node.clone(), source })?;
    cloud.metrics.dial_seconds.observe(started.elapsed().as_secs_f64());
    Ok(Opened { id, node: session.node.clone(), target: route.target.clone(), stream })
}

/// Carries the connection until it ends, and logs how it ended.
pub async fn run<S: Socket>(cloud: &Cloud, opened: Opened, client: &Client<'_>, socket: S, first: Bytes) {
    let Opened { id, node, target, stream } = opened;
    let tracked = cloud.connections.track(Connection {
        id,
        entry: client.entry,
        client: client.addr.to_string(),
        target,
        node,
        started: SystemTime::now(),
        meter: Meter::new(cloud.metrics.bytes.clone()),
    });
    let conn = &tracked.conn;
    let (send, recv, open_guard) = stream.into_parts();
    let end = splice::splice(socket, send, recv, first, cloud.transport.chunk_size, &conn.meter).await;
    drop(open_guard);
    let (to_edge, from_edge) = (conn.meter.to_tunnel(), conn.meter.from_tunnel());
    match &end {
        SpliceEnd::Closed => debug!(id, node = %conn.node, to_edge, from_edge, "connection closed"),
        SpliceEnd::SocketAborted(why) => debug!(id, node = %conn.node, to_edge, from_edge, %why, "client aborted"),
        SpliceEnd::TunnelAborted(why) => {
            info!(id, node = %conn.node, to_edge, from_edge, %why, "connection aborted from the edge side")
        }
    }
}
