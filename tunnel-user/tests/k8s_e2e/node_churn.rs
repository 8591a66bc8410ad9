//! Node churn at fleet size: a real API server holding `TUNNEL_CHURN_NODES` edge Nodes
//! (default 2,000; issue 46's figure is at 100,000) beside the kubectl cluster's edge,
//! and the cloud with the eBPF redirect (in the test's child cgroup, which holds
//! kube-apiserver). New connections through the redirect to the edge's kubelet (a TLS
//! handshake, end to end) are timed while nothing changes, then while
//! `TUNNEL_CHURN_RATE` Node status updates a second (default 100), each moving one
//! Node to a new InternalIP, run for `TUNNEL_CHURN_SECONDS` (default 10). Then the time
//! until the edge map holds the last address moved, read from the kernel, and the whole
//! map is checked against every Node's address, waiting at most `TUNNEL_CHURN_WAIT`
//! seconds (default 600). Figures are printed, not judged: the test fails only on a
//! failed connection or update, or a map that does not match in that time.

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddr};
use std::process::Command;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};

use crate::cluster::{Cluster, Path_};
use crate::k8s::checks::wait_log;
use crate::node_fleet::{create_nodes, fleet_name, fleet_node};

/// The first fleet Node's address; Node `i` starts at this plus `i`, and the `k`th
/// update moves its Node to this plus the fleet's size plus `k` (never in use before).
/// Loopback: a connect to one the map does not hold goes nowhere.
const FIRST: Ipv4Addr = Ipv4Addr::new(127, 2, 0, 0);

fn address(offset: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(FIRST) + offset)
}

fn env_or(name: &str, default: u32) -> u32 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Opens `count` connections, one every `every` seconds, to argv[1]:argv[2] and times
/// each to the end of its TLS handshake with the kubelet behind the tunnel (no
/// certificate checked: only the round trips count). Prints `ms N` per connection, or
/// `failed WHY`.
const PROBE_PY: &str = r#"
import socket, ssl, sys, time
host, port, count, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
ctx.check_hostname = False
ctx.verify_mode = ssl.CERT_NONE
start = time.monotonic()
for i in range(count):
    wait = start + i * every - time.monotonic()
    if wait > 0:
        time.sleep(wait)
    t0 = time.perf_counter()
    try:
        with socket.create_connection((host, port), timeout=10) as s:
            with ctx.wrap_socket(s) as t:
                pass
        print("ms %.3f" % ((time.perf_counter() - t0) * 1e3), flush=True)
    except ssl.SSLError as e:
        # The kubelet wants a client certificate: the handshake came back all the same.
        print("ms %.3f" % ((time.perf_counter() - t0) * 1e3), flush=True)
    except OSError as e:
        print("failed %s" % e, flush=True)
"#;

/// Connections a second the probe opens: enough for a p99, few enough not to be load.
const PROBES_PER_SECOND: u32 = 20;

/// The latencies (ms) the probe printed, and the connections that failed.
fn latencies(output: &str) -> (Vec<f64>, Vec<&str>) {
    let failed: Vec<&str> = output.lines().filter(|l| l.starts_with("failed")).collect();
    let mut ms: Vec<f64> = output
        .lines()
        .filter_map(|l| l.strip_prefix("ms ")?.parse().ok())
        .collect();
    ms.sort_by(f64::total_cmp);
    (ms, failed)
}

/// NaN of none (every connection failed).
fn quantile(sorted: &[f64], q: f64) -> f64 {
    let i = ((sorted.len().saturating_sub(1)) as f64 * q).round() as usize;
    sorted.get(i).copied().unwrap_or(f64::NAN)
}

/// The CPU time process `pid` has used, user and system (`/proc/PID/stat`, in ticks of
/// 1/100 s, as on every Linux this runs on).
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    // Fields after the command (which may hold spaces), from its closing parenthesis.
    let fields: Vec<&str> = stat[stat.rfind(')').expect("comm") + 2..]
        .split_whitespace()
        .collect();
    let ticks: u64 =
        fields[11].parse::<u64>().expect("utime") + fields[12].parse::<u64>().expect("stime");
    ticks as f64 / 100.0
}

fn bpftool_json(args: &[&str]) -> serde_json::Value {
    let out = Command::new("bpftool")
        .arg("-j")
        .args(args)
        .output()
        .expect("bpftool");
    assert!(out.status.success(), "bpftool {args:?}: {out:?}");
    serde_json::from_slice(&out.stdout).expect("bpftool json")
}

/// The id of the IPv4 edge map of the programs attached to `cgroup` (the test's own).
fn edge_map_id(cgroup: &std::path::Path) -> u64 {
    let attached = bpftool_json(&["cgroup", "show", &cgroup.display().to_string()]);
    let connect4 = attached
        .as_array()
        .expect("programs")
        .iter()
        .find(|p| p["attach_type"] == "cgroup_inet4_connect")
        .and_then(|p| p["id"].as_u64())
        .expect("connect4 attached to the test cgroup");
    let prog = bpftool_json(&["prog", "show", "id", &connect4.to_string()]);
    prog["map_ids"]
        .as_array()
        .expect("map ids")
        .iter()
        .filter_map(|id| id.as_u64())
        .find(|id| bpftool_json(&["map", "show", "id", &id.to_string()])["name"] == "EDGES")
        .expect("the EDGES map")
}

/// The key bytes of `ip:port` in the IPv4 edge map (`tunnel_common::Endpoint`).
fn key(ip: Ipv4Addr, port: u16) -> Vec<String> {
    let mut bytes = u32::from(ip).to_ne_bytes().to_vec();
    bytes.extend(port.to_ne_bytes());
    bytes.extend([0, 0]);
    bytes.iter().map(|b| b.to_string()).collect()
}

fn holds(map: u64, ip: Ipv4Addr, port: u16) -> bool {
    let id = map.to_string();
    let mut args = vec!["map", "lookup", "id", &id, "key"];
    let key = key(ip, port);
    args.extend(key.iter().map(String::as_str));
    Command::new("bpftool")
        .args(&args)
        .output()
        .expect("bpftool")
        .status
        .success()
}

/// Every target the IPv4 edge map holds.
fn dump(map: u64) -> BTreeSet<SocketAddr> {
    let entries = bpftool_json(&["map", "dump", "id", &map.to_string()]);
    let byte = |v: &serde_json::Value| {
        let text = v.as_str().expect("hex byte");
        u8::from_str_radix(text.trim_start_matches("0x"), 16).expect("hex")
    };
    entries
        .as_array()
        .expect("entries")
        .iter()
        .map(|e| {
            let k: Vec<u8> = e["key"].as_array().expect("key").iter().map(byte).collect();
            let ip = u32::from_ne_bytes(k[..4].try_into().expect("4"));
            let port = u16::from_ne_bytes(k[4..6].try_into().expect("2"));
            SocketAddr::from((Ipv4Addr::from(ip), port))
        })
        .collect()
}

#[test]
fn node_churn_reaches_the_edge_map_and_leaves_new_connections_alone() {
    let n = env_or("TUNNEL_CHURN_NODES", 2_000);
    let rate = env_or("TUNNEL_CHURN_RATE", 100);
    let seconds = env_or("TUNNEL_CHURN_SECONDS", 10);
    let Some(cluster) = Cluster::start(Path_::Redirect) else {
        return;
    };
    let cgroup = cluster._cgroup.as_ref().expect("the redirect's cgroup");
    let kubelet = cluster._netns.edge_ip.to_string();
    let rt = tokio::runtime::Runtime::new().expect("runtime");

    let made = Instant::now();
    rt.block_on(create_nodes(&cluster.api.admin_kubeconfig, n, |i| {
        fleet_node(i, address(i))
    }));
    println!("{n} Nodes created in {:.1?}", made.elapsed());
    let all = n + 1; // and the kubectl cluster's edge
    wait_log(
        &cluster.cloud,
        &format!("edge_nodes={all} nodes={all}\n"),
        Duration::from_secs(60 + u64::from(n) / 500),
    );
    let map = edge_map_id(&cgroup.path);
    let probe = |seconds: u32| {
        let kubelet = kubelet.clone();
        async move {
            let count = (seconds * PROBES_PER_SECOND).to_string();
            let every = (1.0 / f64::from(PROBES_PER_SECOND)).to_string();
            let argv = ["python3", "-c", PROBE_PY, &kubelet, "10250", &count, &every];
            let limit = Duration::from_secs(u64::from(seconds) * 2 + 30);
            cgroup.run(&argv, limit).await.expect("probe")
        }
    };

    let cloud = cluster.cloud.child.id();
    let cpu_before = cpu_seconds(cloud);
    let quiet = rt.block_on(probe(seconds));
    let cpu_quiet = cpu_seconds(cloud) - cpu_before;

    // The churn: update `k` moves Node `k % n` to a new address, `rate` a second.
    let updates = rate * seconds;
    let churned = rt.block_on(async {
        let kubeconfig =
            kube::config::Kubeconfig::read_from(&cluster.api.admin_kubeconfig).expect("kubeconfig");
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
            .await
            .expect("client config");
        let nodes: Api<Node> = Api::all(kube::Client::try_from(config).expect("client"));
        let patches = async {
            let mut tick = tokio::time::interval(Duration::from_secs(1) / rate);
            let mut sent = tokio::task::JoinSet::new();
            for k in 0..updates {
                tick.tick().await;
                let nodes = nodes.clone();
                sent.spawn(async move {
                    let ip = address(n + k).to_string();
                    let status = serde_json::json!({"status": {"addresses": [
                        {"type": "InternalIP", "address": ip}]}});
                    let params = PatchParams::default();
                    nodes
                        .patch_status(&fleet_name(k % n), &params, &Patch::Merge(&status))
                        .await
                        .map(drop)
                });
            }
            sent.join_all().await
        };
        let (results, during) = tokio::join!(patches, probe(seconds));
        let failed: Vec<_> = results.iter().filter_map(|r| r.as_ref().err()).collect();
        assert!(
            failed.is_empty(),
            "{} updates failed: {:?}",
            failed.len(),
            failed.first()
        );
        during
    });
    let written = Instant::now();
    let cpu_churn = cpu_seconds(cloud) - cpu_before - cpu_quiet;
    let (quiet, quiet_failed) = latencies(&quiet);
    let (churned, churn_failed) = latencies(&churned);
    let (q50, q99) = (quantile(&quiet, 0.5), quantile(&quiet, 0.99));
    let (c50, c99) = (quantile(&churned, 0.5), quantile(&churned, 0.99));
    println!(
        "figure: node churn, {n} Nodes, {rate} address updates/s for {seconds} s: new connection \
         (redirect, TLS handshake with the kubelet) p50 / p99 quiet {q50:.2} / {q99:.2} ms, \
         during the churn {c50:.2} / {c99:.2} ms ({:.2}x p99), failed {} / {}; the cloud's CPU \
         {:.0}% quiet, {:.0}% during the churn",
        c99 / q99,
        quiet_failed.len(),
        churn_failed.len(),
        cpu_quiet * 100.0 / f64::from(seconds),
        cpu_churn * 100.0 / f64::from(seconds),
    );
    assert!(quiet_failed.is_empty(), "{quiet_failed:?}");
    assert!(churn_failed.is_empty(), "{churn_failed:?}");

    // The last update's address: how long after the API took it the map holds it.
    let last = address(n + updates - 1);
    let wait = Duration::from_secs(env_or("TUNNEL_CHURN_WAIT", 600).into());
    let deadline = written + wait;
    while !holds(map, last, 10250) {
        assert!(
            Instant::now() < deadline,
            "{last} not in the edge map after {wait:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let last_in = written.elapsed();
    let mut moved: Vec<Ipv4Addr> = (0..n).map(address).collect();
    for k in 0..updates {
        moved[(k % n) as usize] = address(n + k);
    }
    let mut expected: BTreeSet<SocketAddr> = moved
        .into_iter()
        .map(|ip| SocketAddr::from((ip, 10250)))
        .collect();
    expected.insert(SocketAddr::from((cluster._netns.edge_ip, 10250)));
    let mut held = dump(map);
    while held != expected {
        assert!(
            Instant::now() < deadline,
            "the edge map does not match: {} held, {} expected, {} missing",
            held.len(),
            expected.len(),
            expected.difference(&held).count()
        );
        std::thread::sleep(Duration::from_millis(100));
        held = dump(map);
    }
    let matched = written.elapsed();
    println!(
        "figure: node churn, {n} Nodes: the last update in the edge map {:.0} ms after the API \
         took it, the whole map matching after {matched:.1?}",
        last_in.as_secs_f64() * 1e3,
    );
}
