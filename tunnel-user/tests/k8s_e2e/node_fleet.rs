//! The Node watch at fleet size: a real API server holding `TUNNEL_FLEET_NODES` edge
//! Nodes (default 5,000; the fleet figures of docs/benchmarks.md ran 100,000), made by
//! the test with concurrent POSTs and nothing else on them. A cloud started against them
//! takes its first list in pages and is ready with every edge in its node table; what
//! that costs in time and memory is printed, and the memory held per Node is bounded.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, PostParams};

use crate::common::Setup;
use crate::k8s::apiserver::{ApiServer, ApiServerOpts};
use crate::k8s::checks::prerequisites;

/// What the cloud may hold per watched Node, past its footprint without any: the
/// node table's entry and the watch's (name, addresses, edge or not), with the
/// allocator's slack (1.57 KiB measured at 5,000 Nodes, 0.76 at 100,000).
const KIB_PER_NODE_MAX: f64 = 3.0;

fn rss_kib(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS")
}

/// Node `i` of a fleet: an edge at `ip`.
pub(crate) fn fleet_node(i: u32, ip: Ipv4Addr) -> Node {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": fleet_name(i), "labels": {"node-role.kubernetes.io/edge": ""}},
        "status": {"addresses": [{"type": "InternalIP", "address": ip.to_string()}]}
    }))
    .expect("node")
}

pub(crate) fn fleet_name(i: u32) -> String {
    format!("fleet-{i:06}")
}

/// Makes Nodes `node(0)` to `node(n - 1)`, 64 at a time.
pub(crate) async fn create_nodes(kubeconfig: &std::path::Path, n: u32, node: impl Fn(u32) -> Node) {
    let kubeconfig = kube::config::Kubeconfig::read_from(kubeconfig).expect("kubeconfig");
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .expect("client config");
    let client = kube::Client::try_from(config).expect("client");
    let nodes: Api<Node> = Api::all(client);
    let results: Vec<_> = futures::stream::iter(0..n)
        .map(|i| {
            let (nodes, node) = (nodes.clone(), node(i));
            async move { nodes.create(&PostParams::default(), &node).await }
        })
        .buffer_unordered(64)
        .collect()
        .await;
    let failed: Vec<_> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(
        failed.is_empty(),
        "{} creates failed, first: {:?}",
        failed.len(),
        failed.first()
    );
}

#[test]
fn a_cloud_lists_a_fleet_of_edge_nodes_in_pages_and_holds_little_of_each() {
    let Some((assets, _kubectls)) = prerequisites(false) else {
        return;
    };
    let n: u32 = std::env::var("TUNNEL_FLEET_NODES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5_000);
    let mut s = Setup::new("");
    let api = ApiServer::start(&assets, s.path(), &ApiServerOpts::default());
    let kubeconfig = format!("KUBECONFIG={}", api.admin_kubeconfig.display());
    let config = || {
        toml::toml! {
            [kubernetes]
            enabled = true
        }
    };

    // The cloud's footprint with no Node at all.
    let mut empty = s.spawn_cloud(config(), &["env", &kubeconfig]);
    s.cloud_ready(&mut empty);
    empty.wait_log(
        "watch (re)listed what=\"nodes\" objects=0",
        Duration::from_secs(20),
    );
    std::thread::sleep(Duration::from_secs(1));
    let rss_empty = rss_kib(empty.pid());
    drop(empty);

    let made = Instant::now();
    tokio::runtime::Runtime::new()
        .expect("runtime")
        .block_on(create_nodes(&api.admin_kubeconfig, n, |i| {
            // One InternalIP each, 10.0.0.1 + i.
            fleet_node(i, Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 0, 0, 1)) + i))
        }));
    println!("{n} Nodes created in {:.1?}", made.elapsed());

    let started = Instant::now();
    let mut cloud = s.spawn_cloud(config(), &["env", &kubeconfig]);
    cloud.wait_log(
        &format!("edge_nodes={n} nodes={n}\n"),
        Duration::from_secs(60 + u64::from(n) / 500),
    );
    let listed = started.elapsed();
    s.cloud_ready(&mut cloud);
    std::thread::sleep(Duration::from_secs(1));
    let rss = rss_kib(cloud.pid());
    let per_node = rss.saturating_sub(rss_empty) as f64 / f64::from(n);
    println!(
        "cloud with {n} edge Nodes: node table complete {listed:.2?} after start; RSS {rss} KiB \
         ({rss_empty} KiB with none): {per_node:.2} KiB per Node"
    );
    assert!(
        per_node <= KIB_PER_NODE_MAX,
        "{per_node:.2} KiB per Node, more than {KIB_PER_NODE_MAX}"
    );
}
