//! What a relay costs (`--only relay`): `tunnel cloud` as a relay (`role = "relay"`)
//! beside a fleet registered as `--only fleet` starts it (without an API server or the
//! replicas' redirect, which the relay's figures do not depend on).

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};

use super::super::procs::{Proc, wait_until};
use super::super::report::{Results, TUNNEL, TargetCheck};
use super::super::setup::RELAY_NODE;
use super::super::simedge;
use super::{Plan, Registered};

/// The replicas of `--only relay`, whatever `--replicas` says: its figures are for five.
pub const RELAY_REPLICAS: usize = 5;

/// What a relay costs (`--only relay`) with the fleet's edges known.
pub struct RelayFigures {
    pub edges: usize,
    pub replicas: usize,
    /// Its RSS once linked to every replica, their routes received, and idle.
    pub rss_kib: u64,
    /// The TCP connections it holds (`ss`): one link to each replica.
    pub connections: usize,
}

/// The relay beside a fleet of `plan.edges` simulated edges over `plan.replicas`
/// replicas: its node table lists the edges
/// (an address each, in its eBPF map too) and the replicas' links bring the routes to
/// them. Its redirect is attached to a child cgroup made for it (never the host's
/// root), which holds no process and is removed after; needs root, and says so without
/// it.
pub fn relay(plan: &Plan<'_>) -> Result<RelayFigures> {
    use tunnel_user::intercept::detect_cgroup_root;
    let fleet = Registered::start(plan, None)?;
    let root = detect_cgroup_root()?;
    let cgroup = root.join(format!("tunnel-bench-relay-{}", std::process::id()));
    std::fs::create_dir(&cgroup).with_context(|| format!("mkdir {}", cgroup.display()))?;
    let measured = measure_relay(plan, &fleet, &cgroup);
    let _ = std::fs::remove_dir(&cgroup);
    measured
}

fn measure_relay(plan: &Plan<'_>, fleet: &Registered, cgroup: &Path) -> Result<RelayFigures> {
    let n = plan.edges;
    let peers: Vec<String> = fleet
        .set
        .replicas
        .iter()
        .map(|r| format!("\"{}\"", r.peer))
        .collect();
    let mut cfg = format!(
        r#"role = "relay"

[tunnel]
cert = "{certs}/relay-{RELAY_NODE}.crt"
key = "{certs}/relay-{RELAY_NODE}.key"

[peers]
static = [{peers}]
ca = "{certs}/ca.crt"

[admin]
listen = "127.0.0.1:0"

[redirect]
enabled = true
listen = "127.0.0.1:0"
cgroup = "{cgroup}"
"#,
        certs = plan.pki.dir.display(),
        peers = peers.join(", "),
        cgroup = cgroup.display(),
    );
    let first = u32::from(std::net::Ipv4Addr::new(10, 0, 0, 1));
    for i in 0..n {
        let addr = std::net::Ipv4Addr::from(first + i as u32);
        let name = simedge::node_name(i);
        cfg.push_str(&format!(
            "\n[[node]]\nname = \"{name}\"\naddresses = [\"{addr}\"]\n"
        ));
    }
    let path = fleet.work.join("relay.toml");
    std::fs::write(&path, cfg)?;
    let relay = Proc::start(
        "relay",
        &fleet.work,
        plan.tunnel_bin,
        &[
            "cloud".into(),
            "--config".into(),
            path.to_str().context("non-UTF-8 path")?.into(),
        ],
        &[("RUST_LOG", "info")],
    )?;
    wait_until(
        "the relay linked to every replica",
        Duration::from_secs(60),
        || {
            let log = std::fs::read_to_string(&relay.log).unwrap_or_default();
            log.matches("linked to replica").count() >= plan.replicas
        },
    )
    .with_context(|| format!("relay log:\n{}", relay.log_tail()))?;
    // The routes follow each link at once; then nothing happens but heartbeats.
    std::thread::sleep(Duration::from_secs(5));
    let rss_kib = relay.rss_kib()?;
    let out = std::process::Command::new("ss")
        .args(["-Htnp", "state", "established"])
        .output()
        .context("ss")?;
    let owner = format!("pid={},", relay.pid());
    let connections = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains(&owner))
        .count();
    Ok(RelayFigures {
        edges: n,
        replicas: plan.replicas,
        rss_kib,
        connections,
    })
}

/// The relay's figures into `results` and the issue's bound on it.
pub fn report_relay(results: &mut Results, f: &RelayFigures) {
    let (n, replicas) = (f.edges, f.replicas);
    results.add(
        &format!("relay_{n}_rss_mib"),
        &format!("relay, {n} edges known over {replicas} replicas: idle RSS"),
        "MiB",
        false,
        TUNNEL,
        f.rss_kib as f64 / 1024.0,
    );
    results.add(
        &format!("relay_{n}_connections"),
        &format!("relay, {n} edges known over {replicas} replicas: TCP connections held"),
        "connections",
        false,
        TUNNEL,
        f.connections as f64,
    );
    println!(
        "relay with {n} edges known over {replicas} replicas: idle RSS {:.1} MiB, {} TCP connections held (one link per replica)",
        f.rss_kib as f64 / 1024.0,
        f.connections
    );
    results.targets.push(TargetCheck {
        target: format!("relay, {n} edges known: one connection per replica, no edge session"),
        value: format!("{} connections to {replicas} replicas", f.connections),
        met: Some(f.connections == replicas),
    });
}
