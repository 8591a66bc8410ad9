//! Opening a routed connection's call on the edge session that carries it, and the copy
//! over it. Every cloud-to-edge entry ends here, in two calls: `Opener::open` (the dial
//! call, prepared or answered) and `Opener::carry` (the copy, listed and metered).

use std::sync::Arc;
use std::time::{Instant, SystemTime};

use bytes::Bytes;
use proto::DialStatus;
use tracing::{debug, info, warn};

use super::connections::{Connection, Connections};
use super::reached::Reached;
use super::route::{Route, RouteError};
use super::router::{Destination, RouteVersion, Router, Unroutable, Via};
use super::shares::{OverShare, ShareGuard, Shares, Who};
use crate::addr::{ClientAddr, NodeName};
use crate::call::copy::{self, CopyEnd, Dialing, Meter, OutboundHandle, Redial, Socket};
use crate::call::count::OpenGuard;
use crate::call::open::Call;
use crate::call::outcome::DialFailure;
use crate::call::request::{Client, Request};
use crate::config::TransportConfig;
use crate::ops::metrics::{CloudMetrics, EntryLabel, ReasonLabel};

#[derive(Debug, thiserror::Error)]
pub(crate) enum ProxyError {
    #[error(transparent)]
    Unroutable(#[from] Unroutable),
    #[error("node `{node}`: {source}")]
    Open { node: NodeName, source: DialFailure },
    #[error("node `{node}` via replica `{replica}`: {source}")]
    Forwarded {
        node: NodeName,
        replica: String,
        source: DialFailure,
    },
    #[error("node `{node}`: {source}")]
    OverShare { node: NodeName, source: OverShare },
}

impl ProxyError {
    /// The failure of a call to `node`, opened here or on `replica`.
    fn open(node: NodeName, replica: Option<String>, source: DialFailure) -> Self {
        match replica {
            Some(replica) => ProxyError::Forwarded {
                node,
                replica,
                source,
            },
            None => ProxyError::Open { node, source },
        }
    }

    /// The HTTP status an HTTP client (CONNECT, the HTTPS entry) gets for this error:
    /// a failed dial's by the table (`call::outcome::says`), routing failures their
    /// own.
    pub(crate) fn http_status(&self) -> (u16, &'static str) {
        match self {
            ProxyError::Unroutable(Unroutable::Route(RouteError::BadAuthority(_))) => {
                (400, "Bad Request")
            }
            ProxyError::Unroutable(Unroutable::Route(RouteError::UnknownHost(_))) => {
                (404, "Not Found")
            }
            ProxyError::Unroutable(Unroutable::NotConnected(_) | Unroutable::NoEdges) => {
                (502, "Bad Gateway")
            }
            ProxyError::Open { source, .. } | ProxyError::Forwarded { source, .. } => {
                source.says().http
            }
            ProxyError::OverShare { .. } => (503, "Service Unavailable"),
        }
    }

    /// Whether the call ended before the edge saw it: the replica it was forwarded to
    /// holds the node no longer, or the session or the link it went out on closed
    /// (`TunnelFailed` is never the edge's own answer).
    fn edge_never_saw(&self) -> bool {
        match self {
            ProxyError::Open { source, .. } | ProxyError::Forwarded { source, .. } => matches!(
                source.status,
                DialStatus::NotHeld | DialStatus::TunnelFailed
            ),
            _ => false,
        }
    }

    /// The `reason` label of the dial-failure metric: a failed dial's by the table,
    /// routing failures their own.
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            ProxyError::Unroutable(Unroutable::Route(RouteError::BadAuthority(_))) => "bad_request",
            ProxyError::Unroutable(Unroutable::Route(RouteError::UnknownHost(_))) => "unknown_node",
            ProxyError::Unroutable(Unroutable::NotConnected(_) | Unroutable::NoEdges) => {
                "not_connected"
            }
            ProxyError::Open { source, .. } | ProxyError::Forwarded { source, .. } => {
                source.says().cloud_dials
            }
            ProxyError::OverShare { .. } => "over_share",
        }
    }
}

/// When the client's bytes may flow, which is when `Opener::open` returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Start {
    /// After the edge has connected to the target: `open` waits for its answer, for
    /// entries whose client must hear the outcome first (CONNECT's status, the HTTPS
    /// entry's error page).
    Answered,
    /// At once (fixed forwards, eBPF redirects, optimistic CONNECT: the client waits for
    /// nothing): `open` returns the prepared call, and `carry` sends the dial request
    /// with the client's first bytes behind it, in one write: one round trip to the
    /// edge less per new connection. An edge's refusal then resets the client.
    Early,
    /// `Early` for a target the node's edge connected to lately with no failure since
    /// (`reached::Reached`), `Answered` for any other (CONNECT's `optimistic_ok =
    /// "recent"`).
    EarlyIfRecent,
}

/// The edge's answer to a connection's dial: the call's incoming messages once the edge
/// has connected, or why not (counted in the dial time when it comes).
type Answer = Dialing<'static, ProxyError>;

/// How many times one connection's call is opened again ([`Reroute`]): a move of its
/// edge costs one (the replica that held it answers not-held, or its link closes), a
/// route that had not caught up with it a second.
const REROUTES: u32 = 2;

/// One connection between its entry and its copy: its entry, what its call's request
/// said (the call opened on the node's session here or on the replica that holds it),
/// and the call, with where the routes stood when it was opened (a call opened again
/// goes where they stand after a change, [`Reroute`]).
pub(crate) struct Opened {
    request: Request,
    entry: &'static str,
    routes: RouteVersion,
    outbound: OutboundHandle,
    answer: Answer,
    /// Counts the call as open on its session until the copy ends.
    open: OpenGuard,
    /// Counts the call in its client's share of the node until the copy ends.
    share: ShareGuard,
}

/// Opens a stream to the session a `Router` picked, here or on the replica that holds
/// the node, and carries the connection on it: counted, listed and metered.
pub(crate) struct Opener {
    /// Where a call that ended before the edge answered is opened again.
    router: Arc<Router>,
    connections: Arc<Connections>,
    metrics: Arc<CloudMetrics>,
    chunk_size: usize,
    /// Every dial's outcome, for `Start::EarlyIfRecent`; kept only where an entry asks
    /// (`None`: nothing to record on the dial's path).
    reached: Option<Arc<Reached>>,
    shares: Arc<Shares>,
}

impl Opener {
    pub(crate) fn new(
        router: Arc<Router>,
        connections: Arc<Connections>,
        metrics: Arc<CloudMetrics>,
        transport: &TransportConfig,
        reached: Option<Reached>,
    ) -> Self {
        Self {
            router,
            connections,
            metrics,
            chunk_size: transport.chunk_size,
            reached: reached.map(Arc::new),
            shares: Shares::new(transport.max_streams_per_edge, transport.client_share),
        }
    }

    /// Opens the call of a connection from `client` (`who`, for its share of the node)
    /// on `entry` to where the router sent it; with `Start::Answered`, waits for the
    /// edge's answer too. Failures, routing ones included, are counted and logged here,
    /// once.
    pub(crate) async fn open(
        &self,
        routed: Result<Destination, Unroutable>,
        entry: &'static str,
        client: ClientAddr,
        who: Who,
        start: Start,
    ) -> Result<Opened, ProxyError> {
        self.metrics
            .connections
            .get_or_create(&EntryLabel { entry })
            .inc();
        let prepared = match routed {
            Ok(destination) => self.prepare(destination, entry, client, who),
            Err(e) => Err(e.into()),
        };
        let result = match (prepared, start) {
            (Ok(opened), Start::Answered) => opened.answered().await,
            (Ok(opened), Start::EarlyIfRecent) => {
                let recent = |r: &Arc<Reached>| {
                    let node = opened.request.node.as_ref();
                    node.is_some_and(|node| r.recently(node, opened.request.target.as_str()))
                };
                if self.reached.as_ref().is_some_and(recent) {
                    debug!(id = opened.request.id, target = %opened.request.target, "the edge reached this target lately: the client goes on before its answer");
                    Ok(opened)
                } else {
                    opened.answered().await
                }
            }
            (prepared, _) => prepared,
        };
        if let Err(e) = &result {
            self.refused(e, client);
        }
        result
    }

    /// Prepares the dial call on the session the router picked, here or on another
    /// replica; its request leaves when the answer is first awaited.
    fn prepare(
        &self,
        destination: Destination,
        entry: &'static str,
        client: ClientAddr,
        who: Who,
    ) -> Result<Opened, ProxyError> {
        let routes = self.router.version();
        let share = match self.shares.take(&destination.node, who) {
            Ok(share) => share,
            Err(source) => {
                let node = destination.node;
                return Err(ProxyError::OverShare { node, source });
            }
        };
        let request = Request {
            id: self.connections.next_id(),
            node: Some(destination.node.clone()),
            target: destination.target.clone(),
            client: Some(client),
            tls: destination.tls,
        };
        let (outbound, answer, open) = self.call(destination, &request)?;
        Ok(Opened {
            request,
            entry,
            routes,
            outbound,
            answer,
            open,
            share,
        })
    }

    /// Opens the call of `request` on the session of `destination`, here or on another
    /// replica: the handle of its outgoing messages, its answer, and its count as open.
    fn call(
        &self,
        destination: Destination,
        request: &Request,
    ) -> Result<(OutboundHandle, Answer, OpenGuard), ProxyError> {
        let node = destination.node;
        let (outbound, handle) = copy::outbound();
        let (replica, call) = match destination.via {
            Via::Replica(link) => {
                debug!(id = request.id, %node, replica = %link.replica(), "forwarding to the replica that holds the node");
                self.metrics.peer_forwards.inc();
                (Some(link.replica()), link.open_call(request, outbound))
            }
            Via::Session(session) => (None, session.open_call(request, outbound)),
        };
        let started = Instant::now();
        let Call { answer, open } =
            call.map_err(|source| ProxyError::open(node.clone(), replica.clone(), source))?;
        let reached = self.reached.clone().map(|r| (r, request.target.clone()));
        let dial_seconds = self.metrics.dial_seconds.clone();
        let answer = Box::pin(async move {
            match answer.wait().await {
                Ok(inbound) => {
                    dial_seconds.observe(started.elapsed().as_secs_f64());
                    if let Some((reached, target)) = reached {
                        reached.connected(&node, target.as_str());
                    }
                    Ok(inbound)
                }
                Err(source) => {
                    if let Some((reached, target)) = reached {
                        reached.failed(&node, target.as_str());
                    }
                    Err(ProxyError::open(node, replica, source))
                }
            }
        });
        Ok((handle, answer, open))
    }

    /// Carries the connection until it ends, and logs how it ended. With `Start::Early`
    /// the dial may still be under way at the edge: the client's bytes (`first`, what the
    /// entry already read, then the socket's) wait in the call until the edge has
    /// connected; a refusal resets the client, counted and logged like `open`'s.
    pub(crate) async fn carry<S: Socket>(&self, opened: Opened, socket: S, first: Bytes) {
        let Opened {
            request,
            entry,
            routes,
            outbound,
            answer,
            open,
            share,
        } = opened;
        let id = request.id;
        let client = Client(request.client);
        let node = request.node.clone().map(String::from).unwrap_or_default();
        let tracked = self.connections.track(Connection {
            id,
            entry,
            client: client.to_string(),
            target: request.target.clone(),
            node: node.clone(),
            started: SystemTime::now(),
            meter: Meter::new(self.metrics.bytes.clone()),
        });
        let meter = &tracked.conn.meter;
        let reroute = Reroute {
            opener: self,
            request,
            routes,
            open,
            left: REROUTES,
        };
        let chunk = self.chunk_size;
        let end = copy::copy_dialing(socket, outbound, answer, first, chunk, meter, reroute).await;
        drop(share);
        let (to_edge, from_edge) = (meter.to_tunnel(), meter.from_tunnel());
        match &end {
            CopyEnd::Closed => debug!(id, %node, to_edge, from_edge, "connection closed"),
            CopyEnd::SocketAborted(why) => {
                debug!(id, %node, to_edge, from_edge, %why, "client aborted")
            }
            CopyEnd::TunnelAborted(why) => {
                info!(id, %node, to_edge, from_edge, %why, "connection aborted from the edge side")
            }
            CopyEnd::Refused(e) => self.refused(e, client),
        }
    }

    /// Counts and logs a connection that could not be opened.
    fn refused(&self, e: &ProxyError, client: impl std::fmt::Display) {
        self.metrics
            .dial_failures
            .get_or_create(&ReasonLabel { reason: e.reason() })
            .inc();
        match e {
            ProxyError::Open { source, .. } | ProxyError::Forwarded { source, .. }
                if source.status == DialStatus::TunnelFailed =>
            {
                warn!(error = %e, %client, "connection failed")
            }
            _ => info!(error = %e, %client, "connection refused"),
        }
    }
}

/// Opens a connection's call again when the one it went out on ended before the edge
/// answered, for a reason that says the edge never saw it (`ProxyError::edge_never_saw`):
/// on the route the router gives once the routes have changed since the failed call was
/// opened (waited for, at most `ROUTE_WAIT`; none, no new call), with the client's bytes
/// so far replayed
/// (`copy::copy_dialing`). Holds the open call's count.
struct Reroute<'a> {
    opener: &'a Opener,
    request: Request,
    routes: RouteVersion,
    open: OpenGuard,
    left: u32,
}

impl Redial<ProxyError> for Reroute<'_> {
    fn may_redial(&self, e: &ProxyError) -> bool {
        self.left > 0 && e.edge_never_saw()
    }

    async fn redial(&mut self, e: ProxyError) -> Result<(OutboundHandle, Answer), ProxyError> {
        self.left -= 1;
        let Some(node) = self.request.node.clone() else {
            return Err(e);
        };
        let router = &self.opener.router;
        // Unchanged, the routes would send it where it failed.
        if !router.changed_since(self.routes).await {
            return Err(e);
        }
        self.routes = router.version();
        let route = Route {
            node: Some(node),
            target: self.request.target.clone(),
            tls: self.request.tls,
        };
        let Ok(destination) = router.locate_waiting(route, true).await else {
            return Err(e);
        };
        let id = self.request.id;
        debug!(id, error = %e, "the call ended before the edge answered: opened again where the node is now, the client's bytes replayed");
        self.opener.metrics.calls_rerouted.inc();
        let (outbound, answer, open) = self.opener.call(destination, &self.request)?;
        self.open = open;
        Ok((outbound, answer))
    }
}

impl Opened {
    /// Waits for the edge's answer: Ok once the edge has connected to the target.
    async fn answered(self) -> Result<Self, ProxyError> {
        let inbound = self.answer.await?;
        Ok(Opened {
            answer: Box::pin(std::future::ready(Ok(inbound))),
            ..self
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The answers and labels dashboards and clients know, through the table.
    #[test]
    fn edge_refusals_keep_their_http_status_and_label() {
        let node = NodeName::new("edge-1".into()).expect("valid");
        for (status, http, reason) in [
            (DialStatus::Forbidden, 403, "forbidden"),
            (DialStatus::Refused, 502, "refused"),
            (DialStatus::Timeout, 504, "timeout"),
            (DialStatus::Overloaded, 503, "overloaded"),
            (DialStatus::BadRequest, 502, "bad_request"),
            (DialStatus::TunnelFailed, 502, "tunnel"),
            (DialStatus::NotHeld, 502, "not_held"),
        ] {
            let source = DialFailure::new(status, "");
            for replica in [None, Some("r2".to_string())] {
                let e = ProxyError::open(node.clone(), replica, source.clone());
                assert_eq!((e.http_status().0, e.reason()), (http, reason), "{e}");
            }
        }
        let unknown = ProxyError::from(Unroutable::Route(RouteError::UnknownHost("x".into())));
        assert_eq!(
            (unknown.http_status().0, unknown.reason()),
            (404, "unknown_node")
        );
    }
}
