//! Edge-to-cloud connections. The edge is the gRPC server of its session, so it cannot
//! make a call: a local client's connection waits here while the edge asks the cloud
//! (OpenReverse on the Control call) to make an `Edge.Reverse` call for it; the call
//! carries the connection's id back, and the cloud's dial result.
//!
//! Data flow: `serve_forward` accepts -> `open` asks the cloud and waits (bounded in
//! count and time) -> `accept_call` hands the cloud's call over -> `call::copy`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use h2::RecvStream;
use h2::server::SendResponse;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use proto::chunk_call::IncomingChunks;
use proto::{Control, DialRequest, DialResult, DialStatus, OpenReverse, control};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tonic::Status;
use tonic::metadata::MetadataMap;
use tracing::{Instrument, debug, info, warn};

use crate::call;
use crate::call::copy::{Meter, Outbound, OutboundHandle, Totals};
use crate::call::outcome::{DialFailure, says};
use crate::config::{EdgeConfig, EdgeForwardConfig, EdgeReverseConfig};
use crate::io::accept::{self, Incoming};
use crate::io::transport::RecvBody;
use crate::ops::metrics::{EdgeMetrics, ReasonLabel};

/// The cloud's stream for a waiting connection, with the cloud's dial result.
pub(super) struct ReverseCall {
    result: DialResult,
    /// The call, when the cloud's dial succeeded.
    call: Option<(OutboundHandle, IncomingChunks)>,
}

/// The edge's side of edge-to-cloud connections: those waiting for their stream, the
/// way to the current control stream, and the bounds and counters they run under. The
/// `[[reverse.forward]]` listeners and the `[proxy]` open connections through it; the
/// session attaches its control stream and hands the cloud's calls in.
pub(crate) struct Reverse {
    next_id: AtomicU64,
    pending: Mutex<HashMap<u64, oneshot::Sender<ReverseCall>>>,
    control: Mutex<Option<mpsc::Sender<Control>>>,
    /// The name this edge registers as, for the connections' log spans.
    node: String,
    limits: EdgeReverseConfig,
    chunk_size: usize,
    bytes: Totals,
    /// Opened connections by outcome (the `reverse` metric).
    outcomes: Family<ReasonLabel, Counter>,
}

impl Reverse {
    pub(crate) fn new(config: &EdgeConfig, metrics: &EdgeMetrics) -> Self {
        Self {
            next_id: AtomicU64::new(0),
            pending: Mutex::default(),
            control: Mutex::default(),
            node: config.node().to_string(),
            limits: config.reverse.clone(),
            chunk_size: config.transport.chunk_size,
            bytes: metrics.bytes.clone(),
            outcomes: metrics.reverse.clone(),
        }
    }

    /// The name this edge registers as.
    pub(super) fn node(&self) -> &str {
        &self.node
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, HashMap<u64, oneshot::Sender<ReverseCall>>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn control(&self) -> std::sync::MutexGuard<'_, Option<mpsc::Sender<Control>>> {
        self.control.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The session's control stream is up: OpenReverse requests go out on `sender`.
    pub(crate) fn attach(&self, sender: mpsc::Sender<Control>) {
        *self.control() = Some(sender);
    }

    /// The control stream that owned `sender` ended; a newer one may have replaced it.
    pub(crate) fn detach(&self, sender: &mpsc::Sender<Control>) {
        let mut current = self.control();
        if current.as_ref().is_some_and(|c| c.same_channel(sender)) {
            *current = None;
        }
    }
}

/// Removes a waiting connection's entry however its wait ends.
struct PendingGuard<'a> {
    reverse: &'a Reverse,
    id: u64,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        self.reverse.pending().remove(&self.id);
    }
}

/// Why a connection could not be opened; also its metric label.
#[derive(Debug, thiserror::Error)]
pub(super) enum ReverseError {
    #[error("too many connections waiting for the cloud")]
    Overloaded,
    #[error("not registered with the cloud")]
    NoSession,
    #[error("the cloud did not open the stream in time")]
    Timeout,
    #[error("the cloud refused: {:?} {}", .0.status, .0.message)]
    Cloud(DialFailure),
}

impl ReverseError {
    /// The `reason` label of `tunnel_edge_reverse_connections`: the edge's own, or the
    /// cloud's refusal's by the table (`call::outcome::says`).
    pub(super) fn label(&self) -> &'static str {
        match self {
            ReverseError::Overloaded => "overloaded",
            ReverseError::NoSession => "no_session",
            ReverseError::Timeout => "timeout",
            ReverseError::Cloud(failure) => failure.says().edge_reverse,
        }
    }

    /// The answer to an HTTP proxy client: the edge's own, or the cloud's refusal's by
    /// the table.
    pub(super) fn http_status(&self) -> (u16, &'static str) {
        match self {
            ReverseError::Timeout => (504, "Gateway Timeout"),
            ReverseError::Overloaded | ReverseError::NoSession => (503, "Service Unavailable"),
            ReverseError::Cloud(failure) => failure.says().edge_proxy_http,
        }
    }
}

/// Serves one `[[forward]]` listener until shutdown.
pub(crate) async fn serve_forward(
    reverse: Arc<Reverse>,
    mut incoming: Incoming<TcpListener>,
    forward: EdgeForwardConfig,
) {
    while let Some((tcp, client, permit)) = incoming.next().await {
        crate::io::net::tune(&tcp);
        let span = tracing::debug_span!("reverse", node = %reverse.node(), client = %client, target = %forward.target);
        let connection = connection(reverse.clone(), tcp, client, forward.target.clone());
        tokio::spawn(accept::hold(permit, connection.instrument(span)));
    }
}

async fn connection(reverse: Arc<Reverse>, tcp: TcpStream, client: SocketAddr, target: String) {
    let opened = open(&reverse, client, &target).await;
    let opened = match opened {
        Ok(o) => o,
        Err(
            e @ ReverseError::Cloud(DialFailure {
                status: DialStatus::Forbidden,
                ..
            }),
        ) => {
            // Closing is all a plain TCP client understands; the log says why.
            warn!(error = %e, "cloud refused a target outside its allowlist for this edge");
            return;
        }
        Err(e) => {
            info!(error = %e, "edge-to-cloud connection not opened");
            return;
        }
    };
    relay(&reverse, tcp, opened, Bytes::new()).await;
}

/// Copies the connection both ways over the cloud's stream; `early` are bytes the
/// client sent before the stream was there.
pub(super) async fn relay(reverse: &Reverse, tcp: TcpStream, opened: ReverseCall, early: Bytes) {
    let Some((outbound, inbound)) = opened.call else {
        return;
    };
    let meter = Meter::new(reverse.bytes.clone());
    let end = call::copy::copy(tcp, outbound, inbound, early, reverse.chunk_size, &meter).await;
    debug!(
        to_cloud = meter.to_tunnel(),
        from_cloud = meter.from_tunnel(),
        ?end,
        "connection ended"
    );
}

pub(super) async fn open(
    reverse: &Reverse,
    client: SocketAddr,
    target: &str,
) -> Result<ReverseCall, ReverseError> {
    let opened = open_uncounted(reverse, client, target).await;
    reverse
        .outcomes
        .get_or_create(&ReasonLabel {
            reason: opened
                .as_ref()
                .map_or_else(ReverseError::label, |_| says(DialStatus::Ok).edge_reverse),
        })
        .inc();
    opened
}

async fn open_uncounted(
    reverse: &Reverse,
    client: SocketAddr,
    target: &str,
) -> Result<ReverseCall, ReverseError> {
    let limits = &reverse.limits;
    let id = reverse.next_id.fetch_add(1, Ordering::Relaxed);
    let (tx, rx) = oneshot::channel();
    {
        let mut pending = reverse.pending();
        if pending.len() >= limits.max_pending {
            return Err(ReverseError::Overloaded);
        }
        pending.insert(id, tx);
    }
    let _guard = PendingGuard { reverse, id };
    let request = Control {
        msg: Some(control::Msg::OpenReverse(OpenReverse {
            id,
            target: target.to_string(),
            client: client.to_string(),
        })),
    };
    let control = reverse.control().clone().ok_or(ReverseError::NoSession)?;
    // The channel holds as many messages as connections may wait, so a full one means
    // the control stream is stuck; waiting on it would only hold the client longer.
    control
        .try_send(request)
        .map_err(|_| ReverseError::NoSession)?;
    debug!(id, "asked the cloud for an edge-to-cloud stream");
    let opened = tokio::time::timeout(limits.open_timeout, rx)
        .await
        .map_err(|_| ReverseError::Timeout)?
        .map_err(|_| ReverseError::NoSession)?;
    match opened.result.status() {
        DialStatus::Ok => Ok(opened),
        _ => Err(ReverseError::Cloud(opened.result.clone().into())),
    }
}

/// Serves one `Edge.Reverse` call from the cloud: hands it to the connection waiting
/// for it (which copies from its socket), then sends that socket's bytes on the call.
pub(crate) async fn serve_call(
    reverse: Arc<Reverse>,
    request: http::Request<RecvStream>,
    respond: SendResponse<Bytes>,
) {
    // Not kept across the answer, which lasts as long as the connection.
    let accepted = {
        let (head, recv) = request.into_parts();
        let metadata = MetadataMap::from_headers(head.headers);
        let inbound = IncomingChunks::request(RecvBody::request(recv));
        accept_call(&reverse, &metadata, inbound)
    };
    call::serve::answer(respond, accepted).await;
}

/// Serves the cloud's `Edge.Reverse` call (its `metadata`, its incoming messages):
/// hands it to the connection waiting for it, or refuses it when none is (it gave up
/// already). Returns the messages to answer with: the connection's bytes.
fn accept_call(
    reverse: &Reverse,
    metadata: &MetadataMap,
    inbound: IncomingChunks,
) -> Result<Outbound, Status> {
    let parsed = proto::from_metadata::<DialRequest>(metadata, proto::DIAL_REQUEST_METADATA)
        .and_then(|r| {
            Ok((
                r,
                proto::from_metadata::<DialResult>(metadata, proto::DIAL_RESULT_METADATA)?,
            ))
        });
    let (dial_request, result) = match parsed {
        Ok(p) => p,
        Err(e) => {
            warn!(error = %e, "bad reverse call from the cloud");
            return Err(Status::invalid_argument(e));
        }
    };
    let Some(waiting) = reverse.pending().remove(&dial_request.connection_id) else {
        debug!(
            id = dial_request.connection_id,
            "reverse call for a connection that stopped waiting"
        );
        return Err(Status::not_found("the connection stopped waiting"));
    };
    if result.status() != DialStatus::Ok {
        let status = result.clone().into_status();
        let _ = waiting.send(ReverseCall { result, call: None });
        return Err(status);
    }
    let (outbound, handle) = call::copy::outbound();
    let opened = ReverseCall {
        result,
        call: Some((handle, inbound)),
    };
    if waiting.send(opened).is_err() {
        return Err(Status::not_found("the connection stopped waiting"));
    }
    Ok(outbound)
}
