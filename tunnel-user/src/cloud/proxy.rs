//! From a routed cloud-side connection to a stream on the node's edge session, and the
//! splice that carries it. Every entry (forward, HTTP CONNECT, eBPF redirect) ends here.

use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use proto::DialRequest;
use tracing::{debug, info, warn};

use super::Cloud;
use super::route::{Route, RouteError};
use super::session::{EarlyStream, EdgeStream, OpenError};
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
}

impl ProxyError {
    /// The HTTP status an HTTP CONNECT client gets for this error.
    pub fn http_status(&self) -> (u16, &'static str) {
        match self {
            ProxyError::Route(RouteError::BadAuthority(_)) => (400, "Bad Request"),
            ProxyError::Route(RouteError::UnknownHost(_)) => (404, "Not Found"),
            ProxyError::NotConnected(_) | ProxyError::NoEdges => (502, "Bad Gateway"),
            ProxyError::Open { source, .. } => match source {
                OpenError::Forbidden(_) => (403, "Forbidden"),
                OpenError::Refused(_) | OpenError::Tunnel(_) | OpenError::BadRequest(_) => (502, "Bad Gateway"),
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

/// Finds the route's edge session and opens a stream there; the edge has connected to
/// the target when this returns Ok.
pub async fn open(cloud: &Cloud, route: &Route, client: &str) -> Result<Opened, ProxyError> {
    let session = match &route.node {
        Some(node) => cloud.registry.get(node).ok_or_else(|| ProxyError::NotConnected(node.clone()))?,
        None => cloud.registry.first().ok_or(ProxyError::NoEdges)?,
    };
    let request = DialRequest {
        target: route.target.clone(),
        connection_id: cloud.next_connection_id.fetch_add(1, Ordering::Relaxed),
        client: client.to_string(),
    };
    let stream = session
        .open(&request)
        .await
        .map_err(|source| ProxyError::Open { node: session.node.clone(), source })?;
    Ok(Opened { node: session.node.clone(), stream })
}

/// Like `open`, but returns as soon as the dial request is sent: for entries whose
/// client needs no answer before its bytes flow (forwards, redirects), this saves a
/// round trip to the edge per connection. `run_early` carries it.
pub async fn open_early(cloud: &Cloud, route: &Route, client: &str) -> Result<OpenedEarly, ProxyError> {
    let session = match &route.node {
        Some(node) => cloud.registry.get(node).ok_or_else(|| ProxyError::NotConnected(node.clone()))?,
        None => cloud.registry.first().ok_or(ProxyError::NoEdges)?,
    };
    let request = DialRequest {
        target: route.target.clone(),
        connection_id: cloud.next_connection_id.fetch_add(1, Ordering::Relaxed),
        client: client.to_string(),
    };
    let stream = session
        .open_early(&request)
        .await
        .map_err(|source| ProxyError::Open { node: session.node.clone(), source })?;
    Ok(OpenedEarly { node: session.node.clone(), stream })
}

/// A stream whose dial is still under way at the edge.
pub struct OpenedEarly {
    pub node: String,
    pub stream: EarlyStream,
}

/// Carries the connection until it ends, and logs how it ended.
pub async fn run<S: Socket>(cloud: &Cloud, opened: Opened, socket: S, first: Bytes) {
    let Opened { node, stream } = opened;
    let (send, recv, guard) = stream.into_parts();
    let report = splice::splice(socket, send, recv, first, cloud.transport.chunk_size).await;
    drop(guard);
    log_end(&node, &report);
}

/// Carries an early-opened connection: the client's bytes flow at once; if the edge
/// then fails to dial, the client gets a reset.
pub async fn run_early<S: Socket>(cloud: &Cloud, opened: OpenedEarly, socket: S) {
    let OpenedEarly { node, stream } = opened;
    let (send, pending, guard) = stream.into_parts();
    // A failed dial is logged as a refusal, once, not again as an aborted connection.
    let refused = AtomicBool::new(false);
    let recv = async {
        pending.result().await.map_err(|source| {
            let e = ProxyError::Open { node: node.clone(), source };
            log_refused(&e);
            refused.store(true, Ordering::Relaxed);
            e.to_string()
        })
    };
    let report = splice::splice_early(socket, send, recv, Bytes::new(), cloud.transport.chunk_size).await;
    drop(guard);
    if !refused.load(Ordering::Relaxed) {
        log_end(&node, &report);
    }
}

fn log_end(node: &str, report: &splice::SpliceReport) {
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
        ProxyError::Open { source: OpenError::Tunnel(_), .. } => warn!(error = %err, "connection failed"),
        _ => info!(error = %err, "connection refused"),
    }
}
