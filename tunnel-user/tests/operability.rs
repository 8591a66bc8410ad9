//! What an operator sees and does: metrics, debug listings, config checks, reloads and
//! drains, against real processes.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::Shutdown;
use std::process::Command;
use std::time::Duration;

use common::servers;
use common::{EdgeOpts, Setup, connect_via};

const TOKENS: &str = "edge-1:token-one\n";

fn get(url: &str) -> String {
    let out = Command::new("curl").args(["-sS", "--max-time", "5", url]).output().expect("curl");
    assert!(out.status.success(), "GET {url}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// The value of a sample line `name{labels} value` in a Prometheus text scrape.
fn sample(scrape: &str, series: &str) -> f64 {
    scrape
        .lines()
        .find_map(|l| l.strip_prefix(series).and_then(|rest| rest.strip_prefix(' ')).and_then(|v| v.trim().parse().ok()))
        .unwrap_or(0.0)
}

#[test]
fn metrics_move_as_traffic_flows() {
    let s = Setup::new(TOKENS);
    let sink = servers::sink("127.0.0.1:0");
    let _cloud = s.start_cloud("");
    let (edge, edge_admin) = s.start_edge(EdgeOpts { extra: format!("[allow]\ntargets = [\"{sink}\"]\n"), ..EdgeOpts::new("edge-1", "token-one") });
    assert!(common::wait_http_ok(&format!("http://{edge_admin}/readyz"), Duration::from_secs(10)), "{}", edge.log_text());
    let url = format!("http://{}/metrics", s.cloud_admin);
    let before = get(&url);
    assert_eq!(sample(&before, "tunnel_edges_connected"), 1.0, "{before}");

    let mut conn = connect_via(s.connect, &format!("edge-1:{}", sink.port())).expect("CONNECT");
    conn.write_all(&vec![7u8; 100_000]).unwrap();
    conn.shutdown(Shutdown::Write).unwrap();
    let mut answer = String::new();
    conn.read_to_string(&mut answer).unwrap();
    let _ = connect_via(s.connect, &format!("edge-1:{}", 1)).expect_err("forbidden target");

    let after = get(&url);
    let to_edge = sample(&after, "tunnel_bytes_total{direction=\"to_edge\"}") - sample(&before, "tunnel_bytes_total{direction=\"to_edge\"}");
    assert_eq!(to_edge, 100_000.0, "{after}");
    assert!(sample(&after, "tunnel_bytes_total{direction=\"from_edge\"}") >= answer.len() as f64);
    assert_eq!(sample(&after, "tunnel_connections_total{entry=\"connect\"}") - sample(&before, "tunnel_connections_total{entry=\"connect\"}"), 2.0);
    assert_eq!(sample(&after, "tunnel_dial_failures_total{reason=\"forbidden\"}"), 1.0, "{after}");
    assert!(sample(&after, "tunnel_dial_duration_seconds_count") >= 1.0, "{after}");
    assert!(after.contains("tunnel_heartbeat_rtt_seconds{node=\"edge-1\"}"), "{after}");

    let edge_scrape = get(&format!("http://{edge_admin}/metrics"));
    assert_eq!(sample(&edge_scrape, "tunnel_edge_registered"), 1.0, "{edge_scrape}");
    assert_eq!(sample(&edge_scrape, "tunnel_edge_dials_total{reason=\"ok\"}"), 1.0, "{edge_scrape}");
    assert_eq!(sample(&edge_scrape, "tunnel_edge_dials_total{reason=\"forbidden\"}"), 1.0, "{edge_scrape}");
    assert_eq!(sample(&edge_scrape, "tunnel_bytes_total{direction=\"from_cloud\"}"), 100_000.0, "{edge_scrape}");
}

#[test]
fn debug_listing_shows_edges_and_live_connections_without_secrets() {
    let s = Setup::new(TOKENS);
    let source = servers::source("127.0.0.1:0");
    let _cloud = s.start_cloud("");
    let _edge = s.start_ready_edge(EdgeOpts { extra: format!("[allow]\ntargets = [\"{source}\"]\n"), ..EdgeOpts::new("edge-1", "token-one") });
    let mut conn = connect_via(s.connect, &format!("edge-1:{}", source.port())).expect("CONNECT");
    writeln!(conn, "3 65536").unwrap();
    let mut buf = vec![0u8; 65536];
    conn.read_exact(&mut buf).unwrap();

    let edges: serde_json::Value = serde_json::from_str(&get(&format!("http://{}/debug/edges", s.cloud_admin))).unwrap();
    assert_eq!(edges[0]["node"], "edge-1", "{edges}");
    assert_eq!(edges[0]["open_streams"], 1, "{edges}");
    assert!(edges[0]["remote"].as_str().unwrap().starts_with("127.0.0.1:"), "{edges}");
    let conns_text = get(&format!("http://{}/debug/connections", s.cloud_admin));
    let conns: serde_json::Value = serde_json::from_str(&conns_text).unwrap();
    assert_eq!(conns[0]["node"], "edge-1", "{conns}");
    assert_eq!(conns[0]["target"], source.to_string(), "{conns}");
    assert_eq!(conns[0]["bytes_from_edge"], 65536, "{conns}");
    assert_eq!(conns[0]["entry"], "connect", "{conns}");
    for listing in [edges.to_string(), conns_text] {
        assert!(!listing.contains("token-one"), "secret in listing: {listing}");
    }
    drop(BufReader::new(conn).lines());
}
