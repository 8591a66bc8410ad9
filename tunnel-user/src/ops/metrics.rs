//! Prometheus metrics of each process, served at `/metrics` on the admin listener.
//! Per-connection hot paths only touch atomic counters; per-edge figures (sessions,
//! open streams, RTT) are read from the live registry at scrape time, so there is no
//! second copy of that state to keep in step.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::call::copy::Totals;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct EntryLabel {
    pub(crate) entry: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ReasonLabel {
    pub(crate) reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct HookLabel {
    pub(crate) hook: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct DirectionLabel {
    pub(crate) direction: &'static str,
}

/// Dial latency buckets: loopback dials take well under a millisecond, WAN edges tens
/// to hundreds of milliseconds, timeouts seconds.
fn dial_buckets() -> Histogram {
    Histogram::new([
        0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    ])
}

fn byte_totals(registry: &mut Registry, outbound: &'static str, inbound: &'static str) -> Totals {
    let bytes = Family::<DirectionLabel, Counter>::default();
    registry.register(
        "tunnel_bytes",
        "Bytes carried through the tunnel, by direction",
        bytes.clone(),
    );
    // One statement each: `get_or_create` returns a read guard, and a second call while
    // it lives would wait for the write lock forever.
    let to_tunnel = bytes
        .get_or_create(&DirectionLabel {
            direction: outbound,
        })
        .clone();
    let from_tunnel = bytes
        .get_or_create(&DirectionLabel { direction: inbound })
        .clone();
    Totals {
        to_tunnel,
        from_tunnel,
    }
}

pub(crate) struct CloudMetrics {
    /// Client connections accepted, by entry (forward, connect, redirect, peer, and
    /// reverse for edge-to-cloud connections).
    pub(crate) connections: Family<EntryLabel, Counter>,
    pub(crate) bytes: Totals,
    /// Time from asking the edge to dial until it answered.
    pub(crate) dial_seconds: Histogram,
    pub(crate) dial_failures: Family<ReasonLabel, Counter>,
    pub(crate) registrations_rejected: Family<ReasonLabel, Counter>,
    /// Sessions ended because their credential stopped being valid, by reason.
    pub(crate) sessions_revoked: Family<ReasonLabel, Counter>,
    /// Connections sent on to the replica that holds the node's edge.
    pub(crate) peer_forwards: Counter,
    /// Renewals of the self-issued serving certificate, or of a relay's client
    /// certificate, that failed (the current one stays, and the renewal is retried).
    pub(crate) certificate_renewals_failed: Counter,
    /// Calls opened again where the node is now: the session or replica they went out
    /// on ended before the edge answered (`conn::proxy::Reroute`).
    pub(crate) calls_rerouted: Counter,
    /// Edge node addresses not routed (conflict, reserved) or not redirected
    /// (edge_map_full) at present, and edge nodes listing too many (too_many).
    pub(crate) node_addresses_dropped: Family<ReasonLabel, Gauge>,
}

impl CloudMetrics {
    /// Counts an edge registration refused for `reason`.
    pub(crate) fn registration_rejected(&self, reason: &'static str) {
        self.registrations_rejected
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }

    /// The metrics, registered in `registry`; `certificate_renewals_failed` is the
    /// counter a relay's certificate client was handed before they existed.
    pub(crate) fn new(registry: &mut Registry, certificate_renewals_failed: Counter) -> Self {
        let m = Self {
            connections: Family::default(),
            bytes: byte_totals(registry, "to_edge", "from_edge"),
            dial_seconds: dial_buckets(),
            dial_failures: Family::default(),
            registrations_rejected: Family::default(),
            sessions_revoked: Family::default(),
            peer_forwards: Counter::default(),
            certificate_renewals_failed,
            calls_rerouted: Counter::default(),
            node_addresses_dropped: Family::default(),
        };
        registry.register(
            "tunnel_connections",
            "Client connections accepted, by entry",
            m.connections.clone(),
        );
        registry.register(
            "tunnel_dial_duration_seconds",
            "Time for the edge to dial a target",
            m.dial_seconds.clone(),
        );
        registry.register(
            "tunnel_dial_failures",
            "Connections that could not be opened, by reason",
            m.dial_failures.clone(),
        );
        registry.register(
            "tunnel_registrations_rejected",
            "Edge registrations refused, by reason",
            m.registrations_rejected.clone(),
        );
        registry.register(
            "tunnel_sessions_revoked",
            "Edge sessions ended because their credential stopped being valid, by reason",
            m.sessions_revoked.clone(),
        );
        registry.register(
            "tunnel_peer_forwards",
            "Connections forwarded to the replica holding the node",
            m.peer_forwards.clone(),
        );
        registry.register(
            "tunnel_certificate_renewals_failed",
            "Renewals of this process's own certificate that failed: a replica's serving certificate, a relay's client certificate",
            m.certificate_renewals_failed.clone(),
        );
        registry.register(
            "tunnel_calls_rerouted",
            "Calls opened again where the node is now, their first bytes replayed, after the session or replica they went out on ended before the edge answered",
            m.calls_rerouted.clone(),
        );
        registry.register(
            "tunnel_node_addresses_dropped",
            "Edge node addresses left out: not routed (conflict: more than one node lists it; reserved: loopback, link-local, a Service or pod address, ...) or not redirected (edge_map_full); too_many: edge nodes listing more addresses of a family than a node has, by reason",
            m.node_addresses_dropped.clone(),
        );
        m
    }
}

pub(crate) struct EdgeMetrics {
    pub(crate) bytes: Totals,
    pub(crate) dial_seconds: Histogram,
    /// Dials by outcome (ok, forbidden, refused, timeout, ...).
    pub(crate) dials: Family<ReasonLabel, Counter>,
    pub(crate) registered: Gauge,
    /// Edge-to-cloud connections by outcome (ok, forbidden, timeout, ...).
    pub(crate) reverse: Family<ReasonLabel, Counter>,
    /// `[proxy]` requests by result (ok, bad_request, and the reverse outcomes).
    pub(crate) proxy_requests: Family<ReasonLabel, Counter>,
    /// Hook runs that failed, by hook (pre_start, post_start).
    pub(crate) hook_failures: Family<HookLabel, Counter>,
    /// Heartbeat round trip the cloud last measured, in microseconds.
    pub(crate) heartbeat_rtt_us: Gauge,
    pub(crate) sessions: Counter,
    /// Renewals of the client certificate from the cluster (`[csr]`) that failed.
    pub(crate) certificate_renewals_failed: Counter,
}

impl EdgeMetrics {
    pub(crate) fn new(registry: &mut Registry) -> Self {
        let m = Self {
            bytes: byte_totals(registry, "to_cloud", "from_cloud"),
            dial_seconds: dial_buckets(),
            dials: Family::default(),
            registered: Gauge::default(),
            reverse: Family::default(),
            proxy_requests: Family::default(),
            hook_failures: Family::default(),
            heartbeat_rtt_us: Gauge::default(),
            sessions: Counter::default(),
            certificate_renewals_failed: Counter::default(),
        };
        registry.register(
            "tunnel_edge_dial_duration_seconds",
            "Time to connect to a target",
            m.dial_seconds.clone(),
        );
        registry.register(
            "tunnel_edge_dials",
            "Dials asked by the cloud, by outcome",
            m.dials.clone(),
        );
        registry.register(
            "tunnel_edge_reverse_connections",
            "Edge-to-cloud connections, by outcome",
            m.reverse.clone(),
        );
        registry.register(
            "tunnel_edge_proxy_requests",
            "HTTP proxy requests, by result",
            m.proxy_requests.clone(),
        );
        registry.register(
            "tunnel_edge_hook_failures",
            "Hook runs that failed, by hook",
            m.hook_failures.clone(),
        );
        registry.register(
            "tunnel_edge_registered",
            "1 while registered with the cloud",
            m.registered.clone(),
        );
        registry.register(
            "tunnel_edge_heartbeat_rtt_microseconds",
            "Heartbeat round trip last measured by the cloud",
            m.heartbeat_rtt_us.clone(),
        );
        registry.register(
            "tunnel_edge_sessions",
            "Sessions established with the cloud",
            m.sessions.clone(),
        );
        registry.register(
            "tunnel_edge_certificate_renewals_failed",
            "Renewals of the client certificate from the cluster that failed",
            m.certificate_renewals_failed.clone(),
        );
        m
    }
}

/// Tasks alive in the process's tokio runtime. Every connection, session and listener is
/// a task, so a count that does not return to its baseline after load is a leak even
/// when fds and memory look fine (a task parked forever on a dead peer).
#[derive(Debug)]
pub(crate) struct RuntimeCollector(tokio::runtime::Handle);

impl RuntimeCollector {
    /// Registers the collector for the runtime it is called from.
    pub(crate) fn register(registry: &mut Registry) {
        registry.register_collector(Box::new(Self(tokio::runtime::Handle::current())));
    }
}

impl Collector for RuntimeCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let tasks = ConstGauge::new(self.0.metrics().num_alive_tasks() as i64);
        tasks.encode(encoder.encode_descriptor(
            "tunnel_tasks_alive",
            "Tasks alive in the async runtime",
            None,
            tasks.metric_type(),
        )?)
    }
}

pub(crate) fn encode(registry: &Registry) -> String {
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, registry);
    out
}
