//! Edge-to-cloud connections: an edge asks, on its control stream, for a cloud-side
//! target; this replica dials it only if `reverse.allow` lists it for that node (or
//! cluster), then opens an `Edge.Reverse` call carrying the result, and copies both ways.
//!
//! Data flow: control stream (`session`) -> `serve` -> allowlist -> `io::net::connect` ->
//! `EdgeSession::open_reverse` (`call::open::open_reverse`) -> `call::copy`.

use std::sync::Arc;
use std::time::{Instant, SystemTime};

use bytes::Bytes;
use futures::future::BoxFuture;
use proto::{DialResult, DialStatus, OpenReverse};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tracing::{Instrument, debug, info, warn};

use super::connections::{Connection, Connections};
use crate::addr::Target;
use crate::call::copy::Meter;
use crate::call::open::ReverseStream;
use crate::call::outcome::DialFailure;
use crate::cloud::edges::admission::ServeReverse;
use crate::cloud::edges::session::EdgeSession;
use crate::config::{ReverseConfig, TransportConfig};
use crate::io::net::{ConnectError, connect};
use crate::ops::metrics::{CloudMetrics, EntryLabel, ReasonLabel};

/// Dials the cloud-side targets edges ask for, within `reverse.allow`, and carries them.
pub(crate) struct ReverseDialer {
    /// Which cloud-side targets each edge may reach (`reverse.allow`).
    allow: ReverseConfig,
    transport: TransportConfig,
    connections: Arc<Connections>,
    metrics: Arc<CloudMetrics>,
}

impl ReverseDialer {
    pub(crate) fn new(
        allow: ReverseConfig,
        transport: TransportConfig,
        connections: Arc<Connections>,
        metrics: Arc<CloudMetrics>,
    ) -> Self {
        Self {
            allow,
            transport,
            connections,
            metrics,
        }
    }
}

impl ServeReverse for ReverseDialer {
    /// Serves the OpenReverse requests of one session until it ends. At most `in_flight`
    /// are being dialled and opened at once; the rest wait in the bounded channel, and
    /// beyond it the session drops them (the edge's own wait times out), so a flood of
    /// requests cannot grow memory or dials here.
    fn serve(
        self: Arc<Self>,
        session: Arc<EdgeSession>,
        requests: mpsc::Receiver<Box<OpenReverse>>,
        in_flight: usize,
    ) -> BoxFuture<'static, ()> {
        Box::pin(serve(self, session, requests, in_flight))
    }
}

async fn serve(
    dialer: Arc<ReverseDialer>,
    session: Arc<EdgeSession>,
    mut requests: mpsc::Receiver<Box<OpenReverse>>,
    in_flight: usize,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(in_flight));
    loop {
        let slot = tokio::select! {
            s = slots.clone().acquire_owned() => match s {
                Ok(s) => s,
                Err(_) => return,
            },
            () = session.wait_closed() => return,
        };
        let request = tokio::select! {
            r = requests.recv() => match r {
                Some(r) => r,
                None => return,
            },
            () = session.wait_closed() => return,
        };
        let id = dialer.connections.next_id();
        let span = tracing::info_span!("reverse", node = %session.node, id, edge_id = request.id, target = %request.target, client = %request.client);
        let (dialer, session) = (dialer.clone(), session.clone());
        tokio::spawn(
            async move {
                // Held until the stream is open (or refused): the copy is bounded by
                // the session's stream limit instead.
                connection(dialer, session, *request, id, slot).await
            }
            .instrument(span),
        );
    }
}

async fn connection(
    dialer: Arc<ReverseDialer>,
    session: Arc<EdgeSession>,
    request: OpenReverse,
    id: u64,
    slot: tokio::sync::OwnedSemaphorePermit,
) {
    dialer
        .metrics
        .connections
        .get_or_create(&EntryLabel { entry: "reverse" })
        .inc();
    let started = Instant::now();
    let dialed = dialer.dial_for(&session, &request).await;
    let result = match &dialed {
        Ok(_) => DialResult {
            status: DialStatus::Ok as i32,
            message: String::new(),
        },
        Err(e) => dialer.refused(e),
    };
    let stream = session.open_reverse(&request, &result).await;
    let (target, tcp, stream) = match (dialed, stream) {
        (Ok((target, tcp)), Ok(Some(stream))) => (target, tcp, stream),
        (_, Err(e)) => {
            info!(error = %e, "cannot open the reverse call to the edge");
            return;
        }
        // The failure went to the edge on the stream itself.
        _ => return,
    };
    drop(slot);
    dialer
        .metrics
        .dial_seconds
        .observe(started.elapsed().as_secs_f64());
    info!("edge-to-cloud connection opened");
    dialer
        .carry(&session, &request, target, id, tcp, stream)
        .await;
}

impl ReverseDialer {
    /// Dials the target `request` asks for, if `reverse.allow` lists it for the node
    /// and the session has room for one more stream.
    async fn dial_for(
        &self,
        session: &EdgeSession,
        request: &OpenReverse,
    ) -> Result<(Target, TcpStream), ReverseDialError> {
        // Validation parsed every listed target, so a listed one parses here too.
        let listed = self.allow.allows(&session.node, &request.target);
        let Some(target) = listed
            .then(|| Target::parse(&request.target).ok())
            .flatten()
        else {
            warn!("refused an edge-to-cloud target outside reverse.allow for this node");
            return Err(ReverseDialError::NotAllowed {
                target: request.target.clone(),
                node: session.node.to_string(),
            });
        };
        if session.open_streams() >= self.transport.max_streams_per_edge as usize {
            return Err(ReverseDialError::Overloaded);
        }
        let tcp = connect(&target, self.transport.dial_timeout).await?;
        Ok((target, tcp))
    }

    /// Counts and logs a failed dial, and says what the edge is told.
    fn refused(&self, e: &ReverseDialError) -> DialResult {
        let failure = DialFailure::new(e.status(), e.to_string());
        self.metrics
            .dial_failures
            .get_or_create(&ReasonLabel {
                reason: failure.says().cloud_reverse,
            })
            .inc();
        if failure.status != DialStatus::Forbidden {
            info!(message = %failure.message, "edge-to-cloud dial failed");
        }
        failure.result()
    }

    /// Copies the connection both ways until it ends, listed and metered.
    async fn carry(
        &self,
        session: &EdgeSession,
        request: &OpenReverse,
        target: Target,
        id: u64,
        tcp: TcpStream,
        stream: ReverseStream,
    ) {
        let ReverseStream {
            outbound,
            inbound,
            open: _open,
        } = stream;
        let tracked = self.connections.track(Connection {
            id,
            entry: "reverse",
            client: request.client.clone(),
            target,
            node: session.node.to_string(),
            started: SystemTime::now(),
            meter: Meter::new(self.metrics.bytes.clone()),
        });
        let meter = &tracked.conn.meter;
        let chunk = self.transport.chunk_size;
        let end = crate::call::copy::copy(tcp, outbound, inbound, Bytes::new(), chunk, meter).await;
        debug!(
            to_edge = meter.to_tunnel(),
            from_edge = meter.from_tunnel(),
            ?end,
            "edge-to-cloud connection ended"
        );
    }
}

/// Why the cloud did not connect an edge's client to a cloud-side target; the edge is
/// told [`ReverseDialError::status`] and this text.
#[derive(Debug, thiserror::Error)]
enum ReverseDialError {
    /// `target` as the edge sent it: not listed, so not known to be `host:port`.
    #[error("{target} is not in reverse.allow for `{node}`")]
    NotAllowed { target: String, node: String },
    #[error("too many connections open for this edge")]
    Overloaded,
    #[error(transparent)]
    Connect(#[from] ConnectError),
}

impl ReverseDialError {
    fn status(&self) -> DialStatus {
        match self {
            ReverseDialError::NotAllowed { .. } => DialStatus::Forbidden,
            ReverseDialError::Overloaded => DialStatus::Overloaded,
            ReverseDialError::Connect(e) => e.status(),
        }
    }
}
