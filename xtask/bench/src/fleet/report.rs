//! What one fleet run measured, printed, added to the results (table and JSON), and
//! checked against issue 46's targets.

use super::super::report::{Results, TUNNEL, TargetCheck};

/// What one fleet run printed.
pub struct Figures {
    pub edges: usize,
    pub replicas: usize,
    pub memory_limit_mib: u64,
    /// The API server's version, when the replicas watched one.
    pub kubernetes: Option<String>,
    pub redirect: bool,
    /// Seconds to create the Nodes this fleet added.
    pub nodes_s: Option<f64>,
    /// Seconds for the simulators to issue their certificates.
    pub issue_s: f64,
    pub register_s: f64,
    /// Edges each replica held once all registered, and its cap (`tunnel_edges_max`).
    pub held: Vec<u64>,
    pub caps: Vec<u64>,
    pub storm_edges: u64,
    pub storm_s: f64,
    /// Registrations a full replica refused during the storm.
    pub refused_full: u64,
    /// The most edges each survivor held during the storm (replica-1 on).
    pub peak: Vec<u64>,
    pub rss_kib_per_edge: Vec<f64>,
    /// The replica's cgroup, sockets included.
    pub cgroup_kib_per_edge: Vec<f64>,
    pub heartbeat_cpu_pct: Vec<f64>,
    pub move_p50_ms: f64,
    pub move_p99_ms: f64,
    pub moves: usize,
    /// New connections through the holder or another replica that failed.
    pub connects_failed: usize,
    pub holder_ms: f64,
    pub forward_ms: f64,
    pub sims_rss_kib_per_edge: f64,
    pub sims_register_cpu_s: f64,
    pub sims_heartbeat_cpu_pct: f64,
}

fn max(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::NAN, f64::max)
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

fn list<T: std::fmt::Display>(v: &[T]) -> String {
    v.iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(" / ")
}

fn list_1(v: &[f64]) -> String {
    v.iter()
        .map(|x| format!("{x:.1}"))
        .collect::<Vec<_>>()
        .join(" / ")
}

/// The run's figures into `results` (table and JSON) and the issue's fleet targets.
pub fn report(results: &mut Results, f: &Figures) {
    let (n, r) = (f.edges, f.replicas);
    let k = format!("fleet_{n}");
    let past_cap = f
        .peak
        .iter()
        .zip(&f.caps[1..])
        .filter(|(peak, cap)| **cap > 0 && peak > cap)
        .count();
    for (key, name, unit, value) in [
        (
            "register_s",
            "time to register all from cold",
            "s",
            f.register_s,
        ),
        ("issue_s", "simulators' certificates issued", "s", f.issue_s),
        (
            "storm_s",
            "a killed replica's edges registered elsewhere",
            "s",
            f.storm_s,
        ),
        (
            "cgroup_kib",
            "replica cgroup memory per edge, sockets included (mean)",
            "KiB/edge",
            mean(&f.cgroup_kib_per_edge),
        ),
        (
            "cgroup_kib_max",
            "replica cgroup memory per edge, sockets included (largest)",
            "KiB/edge",
            max(&f.cgroup_kib_per_edge),
        ),
        (
            "rss_kib_max",
            "replica RSS per edge (largest)",
            "KiB/edge",
            max(&f.rss_kib_per_edge),
        ),
        (
            "cpu_pct_max",
            "replica CPU, heartbeats only (largest)",
            "% of a core",
            max(&f.heartbeat_cpu_pct),
        ),
        (
            "move_p50_ms",
            "moved edge reachable through all, p50",
            "ms",
            f.move_p50_ms,
        ),
        (
            "move_p99_ms",
            "moved edge reachable through all, p99",
            "ms",
            f.move_p99_ms,
        ),
        (
            "holder_ms",
            "new connection through the holder",
            "ms",
            f.holder_ms,
        ),
        (
            "forward_ms",
            "new connection through another replica",
            "ms",
            f.forward_ms,
        ),
        (
            "sims_rss_kib",
            "simulators' RSS per simulated edge",
            "KiB/edge",
            f.sims_rss_kib_per_edge,
        ),
        (
            "sims_register_cpu_s",
            "simulators' CPU while registering",
            "s",
            f.sims_register_cpu_s,
        ),
    ] {
        results.add(
            &format!("{k}_{key}"),
            &format!("fleet {n} edges / {r} replicas: {name}"),
            unit,
            false,
            TUNNEL,
            value,
        );
    }
    println!(
        "fleet {n} edges over {r} replicas ({} per replica), each in a {} MiB memory cgroup; {}; redirect {}:\n  \
         Nodes created: {}\n  \
         simulators' certificates issued (one per edge, by the tunnel CA): {:.1} s\n  \
         registration from cold: {:.1} s\n  \
         edges held per replica: {} (caps, tunnel_edges_max: {})\n  \
         memory per edge per replica, cgroup (sockets included): {} KiB; RSS: {} KiB\n  \
         heartbeat CPU per replica: {} % of a core\n  \
         moved edge reachable through every replica: p50 {:.0} ms, p99 {:.0} ms over {} moves\n  \
         new connection + echo: through the holder {:.2} ms, through another replica {:.2} ms (forward hop {:+.2} ms), {} of {} failed\n  \
         storm: replica-0 killed, {} edges registered elsewhere in {:.1} s; {} refusals by a full replica; \
         most held by each survivor: {} ({past_cap} past its cap)\n  \
         simulators: {:.1} KiB RSS per edge, {:.1} s CPU registering, {:.1}% of a core on heartbeats",
        n / r,
        f.memory_limit_mib,
        match &f.kubernetes {
            Some(v) => format!("[kubernetes] and [csr] on against {v}"),
            None => "no API server".into(),
        },
        if f.redirect {
            "maps on (child cgroups)"
        } else {
            "off"
        },
        f.nodes_s
            .map_or("none (no API server)".into(), |s| format!("{s:.1} s")),
        f.issue_s,
        f.register_s,
        list(&f.held),
        list(&f.caps),
        list_1(&f.cgroup_kib_per_edge),
        list_1(&f.rss_kib_per_edge),
        list_1(&f.heartbeat_cpu_pct),
        f.move_p50_ms,
        f.move_p99_ms,
        f.moves,
        f.holder_ms,
        f.forward_ms,
        f.forward_ms - f.holder_ms,
        f.connects_failed,
        f.moves * 6,
        f.storm_edges,
        f.storm_s,
        f.refused_full,
        list(&f.peak),
        f.sims_rss_kib_per_edge,
        f.sims_register_cpu_s,
        f.sims_heartbeat_cpu_pct,
    );
    let check = |target: String, value: String, met: bool| TargetCheck {
        target,
        value,
        met: Some(met),
    };
    let memory = max(&f.cgroup_kib_per_edge);
    let cpu = max(&f.heartbeat_cpu_pct);
    results.targets.extend([
        check(
            format!("fleet {n}: all edges registered over {r} replicas"),
            format!("{n} in {:.1} s", f.register_s),
            true,
        ),
        check(
            format!("fleet {n}: cloud memory <= 32 KiB per idle edge, kernel socket memory included"),
            format!("{memory:.1} KiB (largest replica's cgroup)"),
            memory <= 32.0,
        ),
        check(
            format!("fleet {n}: heartbeat CPU per replica < 20% of a core"),
            format!("{cpu:.1}% at {} edges (largest replica)", n / r),
            cpu < 20.0,
        ),
        check(
            format!("fleet {n}: a moved edge reachable through every replica within 2 s at p99 over {} moves", f.moves),
            format!("{:.0} ms", f.move_p99_ms),
            f.move_p99_ms <= 2000.0 && f.moves >= 200,
        ),
        check(
            format!("fleet {n}: a killed replica's edges all registered elsewhere within 30 s, no replica past its cap"),
            format!(
                "{} in {:.1} s, {past_cap} past the cap",
                f.storm_edges, f.storm_s
            ),
            f.storm_s <= 30.0 && past_cap == 0,
        ),
    ]);
}
