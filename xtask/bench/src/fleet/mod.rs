//! The fleet figures (`--only fleet`): a fleet as production runs it. Cloud replicas
//! (`replicas`: memory cgroups with a limit, `[kubernetes]`, `[csr]` and `[redirect]`
//! on) against a real API server holding an edge Node for every edge (`cluster`), and
//! simulated edges (`simedge`, in helper processes of 2,500 each) with a client
//! certificate each, behind many NAT addresses, reconnecting as the real edge does; and
//! one real `tunnel edge` that moves between the replicas. Measures registration from
//! cold, memory per edge of each replica (its cgroup's, socket memory included, and its
//! RSS), heartbeat CPU, the storm after a replica is killed (until its edges are
//! registered elsewhere, and whether a replica passed its cap), how fast a moved edge is
//! reachable through every replica, what the forward hop costs, and what the simulators
//! themselves used. `report` prints it and checks issue 46's targets.

mod cluster;
mod relay;
mod replicas;
mod report;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use super::procs::{Proc, free_port, http_ok, wait_until};
use super::setup::{EDGE_NODE, Pki};
pub use cluster::Cluster;
pub use relay::{RELAY_REPLICAS, relay, report_relay};
use replicas::{Options, ReplicaSet};
pub use report::{Figures, report};

/// Simulated edges per simulator process (one descriptor each). Kept small because
/// a simulator answers its edges' heartbeats on one thread: with 10,000 each and the
/// machine at load 25 from other work, five simulators got 5% of a core each, below
/// what 10,000 edges' heartbeats take (8%), and the replicas dropped 28,198 sessions in
/// a minute for no heartbeat answer at 50,000 edges.
const EDGES_PER_SIMULATOR: usize = 2_500;

/// Registrations a simulator has in flight at once (`simedge::Fleet::start`).
const REGISTERING_PER_SIMULATOR: usize = 32;

/// The real edge's node address (its Node's InternalIP), where its echo target
/// listens: a CONNECT to the node by name goes to this address. Outside 127.0.0.0/16,
/// which a node table refuses.
const REAL_EDGE_ADDRESS: std::net::Ipv4Addr = std::net::Ipv4Addr::new(127, 1, 0, 46);

/// Descriptors a process may hold on this machine, which the bench cannot raise
/// (`prlimit` needs CAP_SYS_RESOURCE, which this container lacks).
fn nofile_limit() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit with a valid pointer to a local struct.
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
    lim.rlim_max
}

/// What one fleet run is.
pub struct Plan<'a> {
    pub tunnel_bin: &'a Path,
    pub bench_bin: &'a Path,
    pub pki: &'a Pki,
    pub work: &'a Path,
    pub edges: usize,
    pub replicas: usize,
    /// Each replica's memory limit, bytes.
    pub memory_limit: u64,
    /// `[redirect]` on (as root only).
    pub redirect: bool,
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

/// An echo server behind the real edge, on its node address, on its own thread: what
/// comes in goes back.
fn echo_server() -> Result<SocketAddr> {
    let listener = std::net::TcpListener::bind((REAL_EDGE_ADDRESS, 0))?;
    let addr = listener.local_addr()?;
    std::thread::spawn(move || {
        for conn in listener.incoming().map_while(std::result::Result::ok) {
            std::thread::spawn(move || {
                let mut conn = conn;
                let mut buf = [0u8; 512];
                while let Ok(n) = conn.read(&mut buf) {
                    if n == 0 || conn.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            });
        }
    });
    Ok(addr)
}

/// A new connection through the CONNECT listener `proxy` to `node:port`, and one byte
/// echoed back: the time it took, or why it failed.
fn connect_echo(proxy: SocketAddr, node: &str, port: u16) -> Result<Duration> {
    let started = Instant::now();
    let mut conn = TcpStream::connect_timeout(&proxy, Duration::from_secs(2))?;
    conn.set_read_timeout(Some(Duration::from_secs(2)))?;
    conn.set_nodelay(true)?;
    write!(
        conn,
        "CONNECT {node}:{port} HTTP/1.1\r\nHost: {node}:{port}\r\n\r\n"
    )?;
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if conn.read(&mut byte)? == 0 || head.len() > 4096 {
            bail!("CONNECT answer cut short");
        }
        head.push(byte[0]);
    }
    if !head.starts_with(b"HTTP/1.1 200") {
        bail!("CONNECT answered {}", String::from_utf8_lossy(&head).trim());
    }
    conn.write_all(b"x")?;
    if conn.read(&mut byte)? != 1 {
        bail!("no echo");
    }
    Ok(started.elapsed())
}

/// The real edge for `EDGE_NODE`, dialling `cloud`, its echo target allowed; returns
/// once its admin says it is registered.
fn start_edge(
    tunnel_bin: &Path,
    pki: &Pki,
    work: &Path,
    cloud: SocketAddr,
    target: SocketAddr,
) -> Result<Proc> {
    let admin = SocketAddr::from(([127, 0, 0, 1], free_port()?));
    let cfg = format!(
        r#"node_name = "{EDGE_NODE}"

[cloud]
address = "{cloud}"
server_name = "tunnel-cloud"
ca = "{certs}/ca.crt"
cert = "{certs}/edge-{EDGE_NODE}.crt"
key = "{certs}/edge-{EDGE_NODE}.key"

[admin]
listen = "{admin}"

[allow]
targets = ["{target}"]
"#,
        certs = pki.dir.display(),
    );
    let path = work.join("fleet-edge.toml");
    std::fs::write(&path, cfg)?;
    let edge = Proc::start(
        "fleet-edge",
        work,
        tunnel_bin,
        &[
            "edge".into(),
            "--config".into(),
            path.to_str().context("non-UTF-8 path")?.into(),
        ],
        &[("RUST_LOG", "info")],
    )?;
    wait_until(
        "the moving edge registered",
        Duration::from_secs(20),
        || http_ok(admin, "/readyz"),
    )
    .with_context(|| format!("edge log:\n{}", edge.log_tail()))?;
    Ok(edge)
}

/// The simulators' counters, summed: re-registrations, the latest one's unix ms,
/// refusals by a full replica.
fn sim_counters(sims: &mut [Proc]) -> Result<(u64, u64, u64)> {
    let mut total = (0, 0, 0);
    for sim in sims.iter_mut() {
        let (count, last, full) = sim.latest_line(Duration::from_secs(5), |l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            match w.as_slice() {
                ["pings", _, "failed", _, "rereg", c, "last", t, "full", f] => Some((
                    c.parse::<u64>().ok()?,
                    t.parse::<u64>().ok()?,
                    f.parse::<u64>().ok()?,
                )),
                _ => None,
            }
        })?;
        total = (total.0 + count, total.1.max(last), total.2 + full);
    }
    Ok(total)
}

fn unix_ms() -> Result<u64> {
    Ok(std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis() as u64)
}

/// Which side is busy while the fleet registers or storms, printed at intervals: the CPU
/// each simulator and each replica used since the last line, the edges each replica
/// holds, and the machine's load average (other sessions share it). When a size stalls,
/// this says whether the simulators or the replicas gave way.
struct Watch {
    at: Instant,
    sims: Vec<Duration>,
    replicas: Vec<Duration>,
}

impl Watch {
    fn new(set: &ReplicaSet, sims: &[Proc]) -> Self {
        Self {
            at: Instant::now(),
            sims: sims
                .iter()
                .map(|s| s.cpu_time().unwrap_or_default())
                .collect(),
            replicas: set
                .replicas
                .iter()
                .map(|r| r.cpu_time().unwrap_or_default())
                .collect(),
        }
    }

    /// Prints `what` and the figures when `interval` has passed since the last line.
    fn every(&mut self, interval: Duration, what: &str, set: &ReplicaSet, sims: &[Proc]) {
        let window = self.at.elapsed();
        if window < interval {
            return;
        }
        let now = Self::new(set, sims);
        let pct = |after: &[Duration], before: &[Duration]| -> String {
            after
                .iter()
                .zip(before)
                .map(|(a, b)| {
                    format!(
                        "{:.0}",
                        a.saturating_sub(*b).as_secs_f64() / window.as_secs_f64() * 100.0
                    )
                })
                .collect::<Vec<_>>()
                .join("/")
        };
        // A killed replica answers nothing.
        let held: Vec<String> = set
            .replicas
            .iter()
            .map(|r| r.edges().map_or("-".into(), |(e, _)| e.to_string()))
            .collect();
        let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
        eprintln!(
            "bench: fleet: {what}; CPU % of a core, simulators {}, replicas {}; edges held {}; load {}",
            pct(&now.sims, &self.sims),
            pct(&now.replicas, &self.replicas),
            held.join("/"),
            load.split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" "),
        );
        *self = now;
    }
}

/// RSS (KiB) and CPU time of the simulators, summed.
fn sims_usage(sims: &[Proc]) -> Result<(u64, Duration)> {
    let mut total = (0, Duration::ZERO);
    for sim in sims {
        total.0 += sim.rss_kib()?;
        total.1 += sim.cpu_time()?;
    }
    Ok(total)
}

/// A fleet registered from cold ([`Registered::start`]): the replicas, settled with their
/// node tables and caps, and the simulators, every edge welcomed; what it took.
struct Registered {
    work: PathBuf,
    set: ReplicaSet,
    sims: Vec<Proc>,
    /// Whether the replicas' `[redirect]` is on.
    redirect: bool,
    /// Seconds to create the Nodes this fleet added, when there is an API server.
    nodes_s: Option<f64>,
    /// Each replica's RSS (KiB) and cgroup charge (bytes) before the edges came.
    rss0: Vec<u64>,
    cgroup0: Vec<u64>,
    caps: Vec<u64>,
    issue_s: f64,
    register_s: f64,
    sims_register_cpu_s: f64,
}

impl Registered {
    /// The fleet of `plan` in `plan.work`/fleet-`n`, its Nodes made in `cluster` first.
    fn start(plan: &Plan<'_>, mut cluster: Option<&mut Cluster>) -> Result<Self> {
        let (n, count) = (plan.edges, plan.replicas);
        let work = plan.work.join(format!("fleet-{n}"));
        std::fs::create_dir_all(&work)?;
        let nodes_s = match cluster.as_deref_mut() {
            Some(c) => {
                let s = c.grow_to(n)?;
                eprintln!("bench: fleet {n}: Nodes in the API server up to {n} ({s:.1} s)");
                Some(s)
            }
            None => None,
        };
        let kubeconfig = cluster.as_deref().map(Cluster::kubeconfig);
        // Every Node the replicas list: the fleet's and the real edge's.
        let nodes = cluster.as_deref().map(|c| c.nodes + 1);
        // The redirect needs root; its maps then live in each replica's memory cgroup.
        let redirect_root = if plan.redirect && is_root() {
            Some(tunnel_user::intercept::detect_cgroup_root()?)
        } else {
            None
        };
        let set = ReplicaSet::start(
            count,
            &Options {
                tunnel_bin: plan.tunnel_bin,
                pki: plan.pki,
                work: &work,
                memory_limit: plan.memory_limit,
                kubeconfig: kubeconfig.as_deref(),
                redirect_root: redirect_root.as_deref(),
            },
        )?;
        // Settled: each has its node table (it answers the tunnel port before its watch
        // has listed) and its cap from it.
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            // 0 until its admin listener answers.
            let caps: Vec<u64> = set
                .replicas
                .iter()
                .map(|r| r.edges().map_or(0, |(_, max)| max))
                .collect();
            let listed = set.replicas.iter().all(|r| match nodes {
                Some(nodes) => std::fs::read_to_string(r.log())
                    .is_ok_and(|l| l.contains(&format!("edge_nodes={nodes} "))),
                None => true,
            });
            if caps.iter().all(|&c| c > 0) && listed {
                break;
            }
            if Instant::now() > deadline {
                bail!("the replicas did not list the {n} Nodes in 120 s (caps {caps:?})");
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        std::thread::sleep(Duration::from_secs(1));
        let rss0: Vec<u64> = set
            .replicas
            .iter()
            .map(|r| r.rss_kib())
            .collect::<Result<_>>()?;
        let cgroup0: Vec<u64> = set
            .replicas
            .iter()
            .map(|r| r.cgroup_bytes())
            .collect::<Result<_>>()?;
        let caps: Vec<u64> = set
            .replicas
            .iter()
            .map(|r| r.edges().map(|(_, max)| max))
            .collect::<Result<_>>()?;

        // The simulators issue their certificates, then dial at once.
        let clouds: Vec<String> = set.tunnels().iter().map(|t| t.to_string()).collect();
        let clouds = clouds.join(",");
        let start_file = work.join("start");
        let _ = std::fs::remove_file(&start_file);
        let mut sims = Vec::new();
        for (k, first) in (0..n).step_by(EDGES_PER_SIMULATOR).enumerate() {
            let args: Vec<String> = [
                "bench-helper",
                "sim-edges",
                "--cloud",
                &clouds,
                "--first",
                &first.to_string(),
                "--ca",
                &plan.pki.dir.join("ca.crt").display().to_string(),
                "--certs",
                &plan.pki.dir.display().to_string(),
                "--n",
                &EDGES_PER_SIMULATOR.min(n - first).to_string(),
                "--concurrency",
                &REGISTERING_PER_SIMULATOR.to_string(),
                "--start-file",
                &start_file.display().to_string(),
                "--max-secs",
                "3600",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            sims.push(Proc::start_piped(
                &format!("fleet-sim-{k}"),
                &work,
                plan.bench_bin,
                &args,
                &[],
            )?);
        }
        let issuing = Instant::now();
        for sim in &mut sims {
            sim.wait_line(Duration::from_secs(600), |l| {
                l.strip_prefix("issued ").map(|_| ())
            })?;
        }
        let issue_s = issuing.elapsed().as_secs_f64();
        let (_, sims_cpu0) = sims_usage(&sims)?;
        std::fs::write(&start_file, b"")?;
        let started = Instant::now();
        // Each simulator's edges welcomed and attempts failed, until it says all are.
        let mut progress = vec![(0u64, 0u64, false); sims.len()];
        let mut watch = Watch::new(&set, &sims);
        while progress.iter().any(|p| !p.2) {
            std::thread::sleep(Duration::from_millis(200));
            for (sim, p) in sims.iter_mut().zip(&mut progress) {
                sim.check_alive()?;
                for line in sim.lines_now() {
                    match line.split_whitespace().collect::<Vec<_>>().as_slice() {
                        ["registering", done, "failed", failed] => {
                            p.0 = done.parse().unwrap_or(p.0);
                            p.1 = failed.parse().unwrap_or(p.1);
                        }
                        ["registered", done, _] => {
                            p.0 = done.parse().unwrap_or(p.0);
                            p.2 = true;
                        }
                        _ => {}
                    }
                }
            }
            let (done, failed) = progress.iter().fold((0, 0), |(d, f), p| (d + p.0, f + p.1));
            let what = format!("registering, {done} of {n} welcomed, {failed} attempts failed");
            if started.elapsed() > Duration::from_secs(900) {
                bail!("fleet {n}: {what} after 900 s");
            }
            watch.every(Duration::from_secs(10), &what, &set, &sims);
        }
        let register_s = started.elapsed().as_secs_f64();
        let (_, sims_cpu1) = sims_usage(&sims)?;
        eprintln!("bench: fleet {n}: all registered in {register_s:.1} s");
        Ok(Self {
            work,
            set,
            sims,
            redirect: redirect_root.is_some(),
            nodes_s,
            rss0,
            cgroup0,
            caps,
            issue_s,
            register_s,
            sims_register_cpu_s: (sims_cpu1 - sims_cpu0).as_secs_f64(),
        })
    }
}

/// One fleet of `plan.edges` simulated edges over `plan.replicas` replicas, against
/// `cluster` when there is one; the real edge moves `moves` times.
pub fn run(
    plan: &Plan<'_>,
    cluster: Option<&mut Cluster>,
    moves: usize,
    heartbeat_window: Duration,
) -> Result<Figures> {
    let (n, count) = (plan.edges, plan.replicas);
    if count < 2 {
        bail!("the fleet needs at least 2 replicas (one is killed)");
    }
    // After the storm the survivors share the dead replica's edges; beside them a
    // replica holds its listeners, peer links and watches.
    let survivor = n.div_ceil(count - 1);
    let nofile = nofile_limit();
    if survivor as u64 + 500 > nofile {
        bail!(
            "{n} edges over {count} replicas leave {survivor} a survivor after the storm, past the \
             {nofile} descriptors a process may hold here: use more replicas (--replicas)"
        );
    }
    let kubernetes = cluster.as_deref().map(|c| c.version.clone());
    let Registered {
        work,
        mut set,
        mut sims,
        redirect,
        nodes_s,
        rss0,
        cgroup0,
        caps,
        issue_s,
        register_s,
        sims_register_cpu_s,
    } = Registered::start(plan, cluster)?;
    std::thread::sleep(Duration::from_secs(3));

    // Memory and heartbeat CPU of each replica, holding n / count edges.
    let mut held = Vec::new();
    let mut rss_kib_per_edge = Vec::new();
    let mut cgroup_kib_per_edge = Vec::new();
    for (i, r) in set.replicas.iter().enumerate() {
        let (edges, _) = r.edges()?;
        let per = edges.max(1) as f64;
        held.push(edges);
        rss_kib_per_edge.push(r.rss_kib()?.saturating_sub(rss0[i]) as f64 / per);
        cgroup_kib_per_edge
            .push(r.cgroup_bytes()?.saturating_sub(cgroup0[i]) as f64 / 1024.0 / per);
    }
    let cpu0: Vec<Duration> = set
        .replicas
        .iter()
        .map(|r| r.cpu_time())
        .collect::<Result<_>>()?;
    let (sims_rss_kib, sims_idle0) = sims_usage(&sims)?;
    let t0 = Instant::now();
    std::thread::sleep(heartbeat_window);
    let window = t0.elapsed().as_secs_f64();
    let mut heartbeat_cpu_pct = Vec::new();
    for (r, before) in set.replicas.iter().zip(&cpu0) {
        heartbeat_cpu_pct.push((r.cpu_time()? - *before).as_secs_f64() / window * 100.0);
    }
    let (_, sims_idle1) = sims_usage(&sims)?;

    // An edge that moves: registered on one replica, then on another; how long until a
    // new connection through every replica reaches it.
    let target = echo_server()?;
    let mut move_ms = Vec::new();
    let mut holder = Vec::new();
    let mut forward = Vec::new();
    // New connections that failed (a read past its 2 s bound on the loaded machine): a
    // figure of their own, not the end of the run.
    let mut connects_failed = 0;
    for m in 0..moves {
        let to = m % count;
        let connects: Vec<SocketAddr> = set.replicas.iter().map(|r| r.connect).collect();
        let edge = start_edge(
            plan.tunnel_bin,
            plan.pki,
            &work,
            set.replicas[to].tunnel,
            target,
        )?;
        let registered = Instant::now();
        let mut pending: Vec<usize> = (0..count).collect();
        while !pending.is_empty() {
            if registered.elapsed() > Duration::from_secs(30) {
                bail!("after a move, replicas {pending:?} did not reach the edge in 30 s");
            }
            pending.retain(|&r| connect_echo(connects[r], EDGE_NODE, target.port()).is_err());
            if !pending.is_empty() {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        move_ms.push(registered.elapsed().as_secs_f64() * 1e3);
        // The forward hop: new connections through the holder and through the next.
        for _ in 0..3 {
            let other = connects[(to + 1) % count];
            for (through, times) in [(connects[to], &mut holder), (other, &mut forward)] {
                match connect_echo(through, EDGE_NODE, target.port()) {
                    Ok(took) => times.push(took.as_secs_f64() * 1e3),
                    Err(e) => {
                        if connects_failed == 0 {
                            eprintln!(
                                "bench: fleet {n}: a new connection through {through} failed: {e:#}"
                            );
                        }
                        connects_failed += 1;
                    }
                }
            }
        }
        drop(edge);
    }

    // The storm: replica 0 is killed; its edges register with the others, which must
    // not pass their caps.
    let expected = held[0];
    let (before, _, full_before) = sim_counters(&mut sims)?;
    let killed_at = unix_ms()?;
    set.replicas[0].kill();
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut peak = vec![0u64; count];
    let mut last_poll = Instant::now() - Duration::from_secs(1);
    let mut watch = Watch::new(&set, &sims);
    let (storm_edges, storm_s, refused_full) = loop {
        std::thread::sleep(Duration::from_millis(250));
        if last_poll.elapsed() >= Duration::from_secs(1) {
            last_poll = Instant::now();
            for (i, r) in set.replicas.iter().enumerate().skip(1) {
                peak[i] = peak[i].max(r.edges()?.0);
            }
        }
        let (count_now, last, full) = sim_counters(&mut sims)?;
        watch.every(
            Duration::from_secs(10),
            &format!(
                "storm, {} of replica-0's {expected} edges welcomed elsewhere, {} refusals by a full replica",
                count_now - before,
                full - full_before
            ),
            &set,
            &sims,
        );
        if count_now - before >= expected {
            break (
                count_now - before,
                last.saturating_sub(killed_at) as f64 / 1e3,
                full - full_before,
            );
        }
        if Instant::now() > deadline {
            bail!(
                "after replica-0 was killed only {} of its {expected} edges registered elsewhere in 300 s",
                count_now - before
            );
        }
    };
    for (i, r) in set.replicas.iter().enumerate().skip(1) {
        peak[i] = peak[i].max(r.edges()?.0);
    }
    for sim in &mut sims {
        sim.check_alive()?;
    }
    let (sims_rss_after, _) = sims_usage(&sims)?;
    Ok(Figures {
        edges: n,
        replicas: count,
        memory_limit_mib: plan.memory_limit >> 20,
        kubernetes,
        redirect,
        nodes_s,
        issue_s,
        register_s,
        held,
        caps,
        storm_edges,
        storm_s,
        refused_full,
        peak: peak[1..].to_vec(),
        rss_kib_per_edge,
        cgroup_kib_per_edge,
        heartbeat_cpu_pct,
        move_p50_ms: percentile(&mut move_ms.clone(), 0.5),
        move_p99_ms: percentile(&mut move_ms, 0.99),
        moves,
        connects_failed,
        holder_ms: percentile(&mut holder, 0.5),
        forward_ms: percentile(&mut forward, 0.5),
        sims_rss_kib_per_edge: sims_rss_kib.max(sims_rss_after) as f64 / n as f64,
        sims_register_cpu_s,
        sims_heartbeat_cpu_pct: (sims_idle1 - sims_idle0).as_secs_f64() / window * 100.0,
    })
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// The eBPF edge maps at the default size given `n` edge addresses: whether they hold
/// them, one full update's time and one of 1% churn. Loaded into a child cgroup made
/// for it (never the host's root), which holds no process and is removed after; needs
/// root, and says so without it.
pub fn edge_map(n: usize) -> Result<String> {
    use tunnel_user::config::RedirectConfig;
    use tunnel_user::intercept::{InterceptConfig, Interceptor, detect_cgroup_root};
    let root = detect_cgroup_root()?;
    let cgroup = root.join(format!("tunnel-bench-fleet-{}", std::process::id()));
    std::fs::create_dir(&cgroup).with_context(|| format!("mkdir {}", cgroup.display()))?;
    let measured = tokio::runtime::Runtime::new()?.block_on(async {
        let entries = RedirectConfig::default().edge_map_entries();
        let interceptor = Interceptor::attach(&InterceptConfig {
            cgroup: Some(cgroup.clone()),
            edge_map_entries: entries,
            ..InterceptConfig::new("127.0.0.1:9".parse()?)
        })?;
        let first = u32::from(std::net::Ipv4Addr::new(10, 0, 0, 1));
        let addrs = |from: u32| -> Vec<std::net::Ipv4Addr> {
            (from..from + n as u32)
                .map(std::net::Ipv4Addr::from)
                .collect()
        };
        let started = Instant::now();
        let left_out = interceptor.set_edges(&addrs(first))?;
        let full = started.elapsed();
        let started = Instant::now();
        interceptor.set_edges(&addrs(first + (n as u32).div_ceil(100)))?;
        let churn = started.elapsed();
        anyhow::Ok(format!(
            "eBPF edge map ({entries} entries a family, the default): {} of {n} addresses held; \
             one update setting all {:.0} ms, one replacing 1% {:.0} ms",
            n - left_out,
            full.as_secs_f64() * 1e3,
            churn.as_secs_f64() * 1e3,
        ))
    });
    let _ = std::fs::remove_dir(&cgroup);
    measured
}
