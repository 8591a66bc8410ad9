//! From a routed cloud-side connection to a stream on the node's edge session, and the
//! splice that carries it. Every entry (forward, HTTP CONNECT, eBPF redirect) ends here.

use std::sync::atomic::Ordering;

use bytes::Bytes;
use proto::DialRequest;
use tracing::{debug, info, warn};

use super::Cloud;
use super::route::{Route, RouteError};
use super::session::{EdgeStream, OpenError};
use crate::splice::{self, Socket, SpliceEnd};

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
}

/// An opened stream and what it is for, ready to splice.
pub struct Opened {
    pub node: String,
    pub stream: EdgeStream,
}

/// Finds the route's edge session, on this replica or on the replica that holds it,
/// and opens a stream there; the edge has connected to the target when this returns Ok.
pub async fn open(cloud: &Cloud, route: &Route, client: &str) -> Result<Opened, ProxyError> {
    let mut request = DialRequest {
        target: route.target.clone(),
        connection_id: cloud.next_connection_id.fetch_add(1, Ordering::Relaxed),
        client: client.to_string(),
        node: String::new(),
    };
    let session = match &route.node {
        Some(node) => {
            let local = cloud.registry.get(node);
            let local_since = local.as_ref().map(|s| super::peer::unix_ms(s.connected_at));
            if let Some(link) = cloud.peers.holder(node, local_since) {
                request.node = node.clone();
                debug!(node = %node, replica = %link.replica(), "forwarding to the replica that holds the node");
                let stream = link.open(&cloud.peers, &request).await.map_err(|source| ProxyError::Forwarded {
                    node: node.clone(),
                    replica: link.replica(),
                    source,
                })?;
                return Ok(Opened { node: node.clone(), stream });
            }
            local.ok_or_else(|| ProxyError::NotConnected(node.clone()))?
        }
        None => cloud.registry.first().ok_or(ProxyError::NoEdges)?,
    };
    let stream = session
        .open(&request)
        .await
        .map_err(|source| ProxyError::Open { node: session.node.clone(), source })?;
    Ok(Opened { node: session.node.clone(), stream })
}

/// Carries the connection until it ends, and logs how it ended.
pub async fn run<S: Socket>(cloud: &Cloud, opened: Opened, socket: S, first: Bytes) {
    let Opened { node, stream } = opened;
    let (send, recv, guard) = stream.into_parts();
    let report = splice::splice(socket, send, recv, first, cloud.transport.chunk_size).await;
    drop(guard);
    match &report.end {
        SpliceEnd::Closed => {
            debug!(node = %node, to_edge = report.to_tunnel, from_edge = report.from_tunnel, "connection closed")
        }
        SpliceEnd::SocketAborted(why) => {
            debug!(node = %node, to_edge = report.to_tunnel, from_edge = report.from_tunnel, %why, "client aborted")
        }
        SpliceEnd::TunnelAborted(why) => {
            info!(node = %node, to_edge = report.to_tunnel, from_edge = report.from_tunnel, %why, "connection aborted from the edge side")
        }
    }
}

/// Logs a connection that could not be opened, once, at the level it deserves.
pub fn log_refused(err: &ProxyError) {
    match err {
        ProxyError::Open { source: OpenError::Tunnel(_), .. } | ProxyError::Forwarded { source: OpenError::Tunnel(_), .. } => warn!(error = %err, "connection failed"),
        _ => info!(error = %err, "connection refused"),
    }
}
