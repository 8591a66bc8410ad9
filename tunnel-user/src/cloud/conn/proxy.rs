//! From a routed cloud-side connection to a stream on the node's edge session, and the
//! copy that carries it. Every entry (forward, HTTP CONNECT, eBPF redirect) ends here:
//! the `Router` says where a connection goes, the `Opener` opens a stream there.

use futures::future::BoxFuture;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use bytes::Bytes;
use proto::DialRequest;
use tracing::{debug, info, warn};

use super::connections::{Connection, Connections};
use super::route::RouteError;
use super::router::{Destination, Unroutable, Via};
use crate::cloud::edges::session::{DialingStream, EdgeStream, OpenError, OpenGuard};
use crate::config::TransportConfig;
use crate::ops::metrics::{CloudMetrics, EntryLabel, ReasonLabel};
use crate::stream::copy::{self, CopyEnd, Meter, OutboundHandle, Socket};

#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error(transparent)]
    Unroutable(#[from] Unroutable),
    #[error("node `{node}`: {source}")]
    Open { node: String, source: OpenError },
    #[error("node `{node}` via replica `{replica}`: {source}")]
    Forwarded {
        node: String,
        replica: String,
        source: OpenError,
    },
}

impl ProxyError {
    /// The HTTP status an HTTP CONNECT client gets for this error.
    pub fn http_status(&self) -> (u16, &'static str) {
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
                match source {
                    OpenError::Forbidden(_) => (403, "Forbidden"),
                    OpenError::Refused(_)
                    | OpenError::Tunnel(_)
                    | OpenError::BadRequest(_)
                    | OpenError::NotHeld(_) => (502, "Bad Gateway"),
                    OpenError::Timeout => (504, "Gateway Timeout"),
                    OpenError::Overloaded => (503, "Service Unavailable"),
                }
            }
        }
    }

    /// The `reason` label of the dial-failure metric.
    pub fn reason(&self) -> &'static str {
        match self {
            ProxyError::Unroutable(Unroutable::Route(RouteError::BadAuthority(_))) => "bad_request",
            ProxyError::Unroutable(Unroutable::Route(RouteError::UnknownHost(_))) => "unknown_node",
            ProxyError::Unroutable(Unroutable::NotConnected(_) | Unroutable::NoEdges) => {
                "not_connected"
            }
            ProxyError::Open { source, .. } | ProxyError::Forwarded { source, .. } => {
                match source {
                    OpenError::Forbidden(_) => "forbidden",
                    OpenError::Refused(_) => "refused",
                    OpenError::Timeout => "timeout",
                    OpenError::Overloaded => "overloaded",
                    OpenError::BadRequest(_) => "bad_request",
                    OpenError::Tunnel(_) => "tunnel",
                    OpenError::NotHeld(_) => "not_held",
                }
            }
        }
    }
}

/// A client connection on its way in: which entry took it, and from where.
pub struct Client<'a> {
    pub entry: &'static str,
    pub addr: &'a str,
}

/// An opened stream and what it is for, ready to copy.
pub struct Opened {
    pub id: u64,
    pub node: String,
    pub target: String,
    pub stream: EdgeStream,
}

/// A stream whose dial request is ready to go, and what it is for.
pub struct Dialing {
    id: u64,
    holder: Holder,
    target: String,
    stream: DialingStream,
    started: Instant,
}

/// The node a stream goes to, and the replica that holds its edge session when it is
/// not this one.
struct Holder {
    node: String,
    replica: Option<String>,
}

impl Holder {
    fn error(&self, source: OpenError) -> ProxyError {
        let node = self.node.clone();
        match &self.replica {
            Some(replica) => ProxyError::Forwarded {
                node,
                replica: replica.clone(),
                source,
            },
            None => ProxyError::Open { node, source },
        }
    }
}

/// Opens a stream to the session a `Router` picked, here or on the replica that holds
/// the node, and carries the connection on it: counted, listed and metered.
pub struct Opener {
    connections: Arc<Connections>,
    metrics: Arc<CloudMetrics>,
    chunk_size: usize,
}

impl Opener {
    pub fn new(
        connections: Arc<Connections>,
        metrics: Arc<CloudMetrics>,
        transport: &TransportConfig,
    ) -> Self {
        Self {
            connections,
            metrics,
            chunk_size: transport.chunk_size,
        }
    }

    /// Opens a stream to the session the router picked and waits for the edge's answer:
    /// the edge has connected to the target when this returns Ok. For entries whose
    /// client must hear the outcome (HTTP CONNECT's status).
    /// Failures, routing ones included, are counted and logged here, once.
    pub async fn open(
        &self,
        located: Result<Destination, Unroutable>,
        client: &Client<'_>,
    ) -> Result<Opened, ProxyError> {
        self.metrics
            .connections
            .get_or_create(&EntryLabel {
                entry: client.entry,
            })
            .inc();
        let result = async {
            let dialing = self.dial(located?, client)?;
            let Dialing {
                id,
                holder,
                target,
                stream,
                started,
            } = dialing;
            let stream = Box::pin(stream.established())
                .await
                .map_err(|source| holder.error(source))?;
            self.metrics
                .dial_seconds
                .observe(started.elapsed().as_secs_f64());
            Ok(Opened {
                id,
                node: holder.node,
                target,
                stream,
            })
        }
        .await;
        if let Err(e) = &result {
            self.refused(e, client);
        }
        result
    }

    /// `open` for entries whose client needs no answer before its bytes flow (fixed
    /// forwards, eBPF redirects: the kernel completed the client's handshake with us):
    /// returns the prepared call at once, and `run_early` sends the dial request with
    /// the client's first bytes behind it, in one write. That is one round trip to the
    /// edge less per new connection. Failures found before the answer are counted and
    /// logged here; `run_early` does the same for the edge's refusal.
    pub fn open_early(
        &self,
        located: Result<Destination, Unroutable>,
        client: &Client<'_>,
    ) -> Result<Dialing, ProxyError> {
        self.metrics
            .connections
            .get_or_create(&EntryLabel {
                entry: client.entry,
            })
            .inc();
        let result = match located {
            Ok(destination) => self.dial(destination, client),
            Err(e) => Err(e.into()),
        };
        if let Err(e) = &result {
            self.refused(e, client);
        }
        result
    }

    /// Counts and logs a connection that could not be opened.
    fn refused(&self, e: &ProxyError, client: &Client<'_>) {
        self.metrics
            .dial_failures
            .get_or_create(&ReasonLabel { reason: e.reason() })
            .inc();
        match e {
            ProxyError::Open {
                source: OpenError::Tunnel(_),
                ..
            }
            | ProxyError::Forwarded {
                source: OpenError::Tunnel(_),
                ..
            } => warn!(error = %e, client = client.addr, "connection failed"),
            _ => info!(error = %e, client = client.addr, "connection refused"),
        }
    }

    /// Prepares the dial call on the session the router picked, here or on another
    /// replica; its request leaves when the answer is first awaited (`Dialing`).
    fn dial(&self, destination: Destination, client: &Client<'_>) -> Result<Dialing, ProxyError> {
        let Destination {
            node,
            target,
            tls,
            via,
        } = destination;
        let id = self.connections.next_id();
        let mut request = DialRequest {
            target: target.clone(),
            connection_id: id,
            client: client.addr.to_string(),
            node: String::new(),
            tls,
        };
        let started = Instant::now();
        let (holder, stream) = match via {
            Via::Replica(link) => {
                request.node = node.clone();
                debug!(id, node = %node, replica = %link.replica(), "forwarding to the replica that holds the node");
                self.metrics.peer_forwards.inc();
                let holder = Holder {
                    node,
                    replica: Some(link.replica()),
                };
                let stream = link.dial(&request);
                (holder, stream)
            }
            Via::Session(session) => {
                let holder = Holder {
                    node,
                    replica: None,
                };
                let stream = session.dial(&request);
                (holder, stream)
            }
        };
        let stream = stream.map_err(|source| holder.error(source))?;
        Ok(Dialing {
            id,
            holder,
            target,
            stream,
            started,
        })
    }

    /// Carries the connection until it ends, and logs how it ended.
    pub async fn run<S: Socket>(
        &self,
        opened: Opened,
        client: &Client<'_>,
        socket: S,
        first: Bytes,
    ) {
        let Opened {
            id,
            node,
            target,
            stream,
        } = opened;
        let EdgeStream {
            outbound,
            inbound,
            open,
        } = stream;
        let answer = Box::pin(std::future::ready(Ok::<_, ProxyError>(inbound)));
        self.carry(
            Carried {
                id,
                node,
                target,
                outbound,
                open,
            },
            answer,
            client,
            socket,
            first,
        )
        .await;
    }

    /// Carries a connection whose dial is still under way at the edge: the client's
    /// bytes flow at once and wait in the stream until the edge has connected. A
    /// refused dial resets the client (the bytes it sent go with the stream, read by
    /// nobody), counted and logged once, like `open`'s refusals.
    pub async fn run_early<S: Socket>(&self, dialing: Dialing, client: &Client<'_>, socket: S) {
        self.run_early_after(dialing, client, socket, Bytes::new())
            .await;
    }

    /// `run_early` with bytes the entry has already read from the client (HTTP
    /// CONNECT's bytes behind the request head), sent first.
    pub async fn run_early_after<S: Socket>(
        &self,
        dialing: Dialing,
        client: &Client<'_>,
        socket: S,
        first: Bytes,
    ) {
        let Dialing {
            id,
            holder,
            target,
            stream,
            started,
        } = dialing;
        let DialingStream {
            outbound,
            answer,
            open,
        } = stream;
        let node = holder.node.clone();
        let answer = Box::pin(async move {
            let inbound = answer.wait().await.map_err(|source| holder.error(source))?;
            self.metrics
                .dial_seconds
                .observe(started.elapsed().as_secs_f64());
            Ok(inbound)
        });
        self.carry(
            Carried {
                id,
                node,
                target,
                outbound,
                open,
            },
            answer,
            client,
            socket,
            first,
        )
        .await;
    }

    async fn carry<S: Socket>(
        &self,
        carried: Carried,
        answer: BoxFuture<'_, Result<tonic::Streaming<proto::Chunk>, ProxyError>>,
        client: &Client<'_>,
        socket: S,
        first: Bytes,
    ) {
        let Carried {
            id,
            node,
            target,
            outbound,
            open,
        } = carried;
        let tracked = self.connections.track(Connection {
            id,
            entry: client.entry,
            client: client.addr.to_string(),
            target,
            node,
            started: SystemTime::now(),
            meter: Meter::new(self.metrics.bytes.clone()),
        });
        let conn = &tracked.conn;
        let end = copy::copy_dialing(
            socket,
            outbound,
            answer,
            first,
            self.chunk_size,
            &conn.meter,
        )
        .await;
        drop(open);
        let (to_edge, from_edge) = (conn.meter.to_tunnel(), conn.meter.from_tunnel());
        match &end {
            CopyEnd::Closed => {
                debug!(id, node = %conn.node, to_edge, from_edge, "connection closed")
            }
            CopyEnd::SocketAborted(why) => {
                debug!(id, node = %conn.node, to_edge, from_edge, %why, "client aborted")
            }
            CopyEnd::TunnelAborted(why) => {
                info!(id, node = %conn.node, to_edge, from_edge, %why, "connection aborted from the edge side")
            }
            CopyEnd::Refused(e) => self.refused(e, client),
        }
    }
}

/// A call and what it is for, its incoming messages aside.
struct Carried {
    id: u64,
    node: String,
    target: String,
    outbound: OutboundHandle,
    open: OpenGuard,
}
