//! What the cloud shows its operators beyond counters: per-edge metrics read from the
//! registry at scrape time, and the JSON debug listing of edges and connections.

use std::sync::{Arc, Weak};
use std::time::SystemTime;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use serde_json::{Value, json};

use crate::cloud::conn::connections::Connections;
use crate::cloud::conn::router::Router;
use crate::cloud::edges::registry::Registry;
use crate::intercept::Programs;

/// Edges connected, open streams, heartbeat RTT and certificate expiry per node, the
/// edge nodes no replica holds, and the eBPF counters.
pub(crate) struct EdgeCollector {
    /// Weak: the metrics outlive the replica's sessions at shutdown.
    pub(crate) registry: Weak<Registry>,
    pub(crate) router: Weak<Router>,
    pub(crate) programs: Arc<Programs>,
}

impl std::fmt::Debug for EdgeCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EdgeCollector")
    }
}

impl Collector for EdgeCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(registry) = self.registry.upgrade() else {
            return Ok(());
        };
        let mut sessions = registry.list();
        sessions.sort_by(|a, b| a.node.cmp(&b.node));
        let connected = ConstGauge::new(sessions.len() as i64);
        connected.encode(encoder.encode_descriptor(
            "tunnel_edges_connected",
            "Edges with a live session",
            None,
            connected.metric_type(),
        )?)?;
        if let Some(max) = registry.max_edges() {
            let max = ConstGauge::new(max as i64);
            max.encode(encoder.encode_descriptor(
                "tunnel_edges_max",
                "Edges this replica holds at most (tunnel.max_edges, or derived from memory.max); past it new edges go to another replica",
                None,
                max.metric_type(),
            )?)?;
        }
        let near = !matches!(registry.load(), crate::cloud::edges::capacity::Load::Room);
        let near = ConstGauge::new(near as i64);
        near.encode(encoder.encode_descriptor(
            "tunnel_edges_near_cap",
            "1 while this replica holds 90% of its edge cap or more",
            None,
            near.metric_type(),
        )?)?;

        let mut family = encoder.encode_descriptor(
            "tunnel_streams_open",
            "Proxied connections open, per node",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for s in &sessions {
            ConstGauge::new(s.open_streams() as i64)
                .encode(family.encode_family(&[("node", s.node.as_str())])?)?;
        }
        let mut family = encoder.encode_descriptor(
            "tunnel_heartbeat_rtt_seconds",
            "Last heartbeat round trip, per node",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for s in &sessions {
            ConstGauge::new(s.rtt().as_secs_f64())
                .encode(family.encode_family(&[("node", s.node.as_str())])?)?;
        }
        let mut family = encoder.encode_descriptor(
            "tunnel_edge_certificate_expiry_timestamp_seconds",
            "When the client certificate of the node's session here expires (Unix time); renewals move it on",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for s in &sessions {
            if let Some(expiry) = s.certificate_expiry() {
                ConstGauge::new(expiry as i64)
                    .encode(family.encode_family(&[("node", s.node.as_str())])?)?;
            }
        }
        // Only once this replica knows what every other one holds: before that, a node
        // held elsewhere would look like one without a tunnel.
        let without = match self.router.upgrade() {
            Some(router) if router.routes_known() => router.without_tunnel(),
            _ => Default::default(),
        };
        let mut family = encoder.encode_descriptor(
            "tunnel_node_without_tunnel",
            "1 for each edge node of the node table that no replica holds a session for",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for node in without.keys() {
            ConstGauge::new(1).encode(family.encode_family(&[("node", node.as_str())])?)?;
        }
        if let Some(c) = self.programs.counters() {
            for (name, help, value) in [
                (
                    "tunnel_ebpf_redirected",
                    "connect() calls the eBPF program sent to tunnel-cloud",
                    c.redirected,
                ),
                (
                    "tunnel_ebpf_passed",
                    "connect() calls the eBPF program left alone",
                    c.passed,
                ),
                (
                    "tunnel_ebpf_errors",
                    "eBPF program errors (the connect went ahead unchanged)",
                    c.errors,
                ),
                (
                    "tunnel_ebpf_no_tunnel",
                    "connect() calls the eBPF program failed with EHOSTDOWN: no replica held the node's tunnel",
                    c.no_tunnel,
                ),
            ] {
                let counter = ConstCounter::new(value);
                counter.encode(encoder.encode_descriptor(
                    name,
                    help,
                    None,
                    counter.metric_type(),
                )?)?;
            }
        }
        Ok(())
    }
}

fn unix_secs(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
}

fn age_secs(t: SystemTime) -> f64 {
    t.elapsed().map(|d| d.as_secs_f64()).unwrap_or_default()
}

/// `/debug/edges` and `/debug/connections`. Never includes secrets: sessions hold none,
/// and connections carry only addresses and counts.
pub(crate) fn debug_listing(
    registry: &Registry,
    connections: &Connections,
    path: &str,
) -> Option<Value> {
    match path {
        "/debug/edges" => {
            let mut sessions = registry.list();
            sessions.sort_by(|a, b| a.node.cmp(&b.node));
            Some(Value::Array(
                sessions
                    .iter()
                    .map(|s| {
                        json!({
                            "node": s.node.as_str(),
                            "kind": s.kind.as_str(),
                            "session": s.id,
                            "remote": s.remote.to_string(),
                            "connected_since": unix_secs(s.connected_at),
                            "connected_seconds": age_secs(s.connected_at),
                            "rtt_ms": s.rtt().as_secs_f64() * 1000.0,
                            "open_streams": s.open_streams(),
                        })
                    })
                    .collect(),
            ))
        }
        "/debug/connections" => Some(Value::Array(
            connections
                .snapshot()
                .iter()
                .map(|c| {
                    json!({
                        "id": c.id,
                        "entry": c.entry,
                        "client": c.client,
                        "target": c.target.as_str(),
                        "node": c.node,
                        "bytes_to_edge": c.meter.to_tunnel(),
                        "bytes_from_edge": c.meter.from_tunnel(),
                        "age_seconds": age_secs(c.started),
                    })
                })
                .collect(),
        )),
        _ => None,
    }
}
