//! The transparent redirect end to end (privileged): a client in a child cgroup dials an
//! edge node's IP:10250 and lands, through tunnel-cloud and tunnel-edge, on the
//! "kubelet" behind the edge, with TLS verified end to end. Each test makes its own
//! child cgroup and edge address; nothing attaches to the root cgroup.
//!
//! One test binary (one link) with a module per subject: reaching the kubelet (IPv4,
//! IPv6, the programs' log records), an edge without a tunnel, the cloud in a pod's
//! cgroup namespace, and pinned programs that outlive the process.

#[path = "../common/mod.rs"]
mod common;

mod outage;
mod pinned;
mod pod_cgroup;
mod privileges;
mod reach;
mod relay;
mod shares;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::config::{merge, path_str, write_toml};
use common::netns::EdgeNetns;
use common::privileged::{TestCgroup, cannot_run, test_cgroup};
use common::servers::hex;
use common::{ChildGuard, EdgeOpts, Proc, Setup, metric, probe};
use rcgen::ExtendedKeyUsagePurpose;
use toml::Table;

const TOKENS: &str = "edge-1:token-one\n";

/// Why these tests need root, for the loud skip.
const NEEDS: &str = "eBPF redirect tests";

/// An HTTPS server standing in for the kubelet on `ip:10250`, inside `netns` if given,
/// requiring a client certificate (the "apiserver" one it issues alongside).
fn start_kubelet(s: &Setup, ip: &str, netns: Option<&EdgeNetns>) -> ChildGuard {
    s.pki.issue(
        "kubelet",
        &[ip],
        "kubelet",
        ExtendedKeyUsagePurpose::ServerAuth,
    );
    s.pki.issue(
        "apiserver",
        &["apiserver"],
        "apiserver",
        ExtendedKeyUsagePurpose::ClientAuth,
    );
    let ip_addr: std::net::IpAddr = ip.parse().expect("an IP address");
    let accept = std::net::SocketAddr::from((ip_addr, 10250)).to_string();
    let inside: Vec<&str> = netns.map(|n| n.exec().to_vec()).unwrap_or_default();
    let mut argv = inside.clone();
    argv.extend([
        "openssl",
        "s_server",
        "-quiet",
        "-www",
        "-Verify",
        "1",
        "-CAfile",
        "ca.crt",
        "-cert",
        "kubelet.crt",
        "-key",
        "kubelet.key",
        "-accept",
        &accept,
    ]);
    let kubelet = ChildGuard(
        Command::new(argv[0])
            .current_dir(s.path())
            .args(&argv[1..])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("openssl s_server"),
    );
    // Probed from where it listens: the host cannot reach a namespace's loopback.
    let probe = format!("import socket; socket.create_connection(('{ip}', 10250), timeout=1)");
    let mut argv = inside;
    argv.extend(["python3", "-c", &probe]);
    let started = probe::eventually(Duration::from_secs(10), || {
        Command::new(argv[0])
            .args(&argv[1..])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    });
    assert!(started, "openssl s_server did not start");
    kubelet
}

fn curl_args(s: &Setup, url: &str) -> Vec<String> {
    let p = |f: &str| s.path().join(f).to_string_lossy().to_string();
    [
        "curl",
        "-sS",
        "--max-time",
        "10",
        "--cacert",
        &p("ca.crt"),
        "--cert",
        &p("apiserver.crt"),
        "--key",
        &p("apiserver.key"),
        url,
    ]
    .iter()
    .map(|a| a.to_string())
    .collect()
}

fn redirected(s: &Setup) -> f64 {
    metric(
        s.cloud_admin,
        "tunnel_connections_total{entry=\"redirect\"}",
    )
}

/// Waits (bounded) for the redirect count to reach `n`; the cloud counts a connection
/// when it accepts it, which can trail the client's exit.
fn wait_redirected(s: &Setup, n: f64) -> f64 {
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let got = redirected(s);
        if got >= n || Instant::now() > deadline {
            return got;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The cloud config for node `edge-1` at `ip`, with connects from `cgroup` to its port
/// 10250 redirected.
fn redirect_to(ip: &str, cgroup: &Path) -> Table {
    toml::toml! {
        [[node]]
        name = "edge-1"
        addresses = [ip]

        [redirect]
        enabled = true
        listen = "127.0.0.1:0"
        cgroup = (path_str(cgroup))
        ports = [10250]
    }
}

/// The edge's allowlist: its own node address `ip`, port 10250 (the kubelet).
fn allow_kubelet(ip: &str) -> Table {
    toml::toml! {
        [allow]
        targets = []
        node_addresses = [ip]
        ports = [10250]
    }
}

fn start(s: &mut Setup, cg: &TestCgroup, ip: &str) -> (Proc, Proc) {
    let cloud = s.start_cloud(redirect_to(ip, &cg.path));
    let edge = s.start_ready_edge(EdgeOpts {
        extra: allow_kubelet(ip),
        ..EdgeOpts::new("edge-1", "token-one")
    });
    (cloud, edge)
}

fn bpftool_show(cg: &TestCgroup) -> String {
    let out = Command::new("bpftool")
        .args(["cgroup", "show"])
        .arg(&cg.path)
        .output()
        .expect("bpftool");
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// The ids of the programs attached to the test cgroup: which process's programs.
fn attached_ids(cg: &TestCgroup) -> Vec<String> {
    let mut ids: Vec<String> = bpftool_show(cg)
        .lines()
        .filter(|l| l.contains("multi"))
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect();
    ids.sort();
    ids
}
