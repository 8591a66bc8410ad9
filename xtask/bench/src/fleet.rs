//! The fleet figures (`--only fleet`): five cloud replicas on this machine, found by
//! each other through a static peer list as in production, with simulated edges spread
//! over them (`simedge`, as many processes as the descriptor limit needs) and one real
//! `tunnel edge` that moves between them. Measures registration from cold and after a
//! replica is killed (the storm), memory per edge and heartbeat CPU of each replica,
//! how fast an edge that moves is reachable through every replica, and what a
//! connection through a replica that does not hold the edge costs (the forward hop).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use super::procs::{Proc, free_port, http_ok, wait_listening, wait_until};
use super::report::{Results, TUNNEL, TargetCheck};
use super::setup::{EDGE_NODE, Pki, RELAY_NODE};
use super::simedge;

pub const REPLICAS: usize = 5;

/// Simulated edges per simulator process: one descriptor each, well inside the 20,000
/// a process may hold here.
const EDGES_PER_SIMULATOR: usize = 10_000;

/// Descriptors a replica may hold: set for the replicas when the storm would take one
/// past the 20,000 of this machine (the bench runs as root; production pods get their
/// runtime's limit, containerd's 1,048,576 by default).
const REPLICA_NOFILE: u64 = 65_536;

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

struct Replica {
    name: String,
    proc: Option<Proc>,
    tunnel: SocketAddr,
    connect: SocketAddr,
    peer: SocketAddr,
}

/// What one fleet run printed.
pub struct Figures {
    pub edges: usize,
    pub register_s: f64,
    pub storm_edges: u64,
    pub storm_s: f64,
    pub rss_kib_per_edge: Vec<f64>,
    pub heartbeat_cpu_pct: Vec<f64>,
    pub move_p50_ms: f64,
    pub move_p99_ms: f64,
    pub moves: usize,
    pub holder_ms: f64,
    pub forward_ms: f64,
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

/// An echo server behind the real edge, on its own thread: one line back per line in.
fn echo_server() -> Result<SocketAddr> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
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

fn start_replica(
    tunnel_bin: &Path,
    pki: &Pki,
    work: &Path,
    r: &Replica,
    peers: &[SocketAddr],
    nofile: Option<u64>,
) -> Result<Proc> {
    let name = &r.name;
    let peers: Vec<String> = peers.iter().map(|p| format!("\"{p}\"")).collect();
    let cfg = format!(
        r#"[tunnel]
listen = "{tunnel}"
cert = "{certs}/cloud.crt"
key = "{certs}/cloud.key"
token_file = "{certs}/tokens-sim"
client_ca = "{certs}/ca.crt"
cloud_id = "{name}"

[connect]
listen = "{connect}"

[peers]
listen = "{peer}"
static = [{peers}]
"#,
        tunnel = r.tunnel,
        connect = r.connect,
        peer = r.peer,
        certs = pki.dir.display(),
        peers = peers.join(", "),
    );
    let path = work.join(format!("{name}.toml"));
    std::fs::write(&path, cfg)?;
    let path = path.to_str().context("non-UTF-8 path")?.to_string();
    let tunnel = tunnel_bin.to_str().context("non-UTF-8 path")?.to_string();
    let env = [("RUST_LOG", "info")];
    let cloud = match nofile {
        Some(n) => Proc::start(
            name,
            work,
            Path::new("/usr/bin/prlimit"),
            &[
                format!("--nofile={n}:{n}"),
                tunnel,
                "cloud".into(),
                "--config".into(),
                path,
            ],
            &env,
        )?,
        None => Proc::start(
            name,
            work,
            tunnel_bin,
            &["cloud".into(), "--config".into(), path],
            &env,
        )?,
    };
    wait_listening(r.tunnel, Duration::from_secs(20))
        .with_context(|| format!("{name}: log {}", cloud.log.display()))?;
    Ok(cloud)
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
    let admin = loopback(free_port()?);
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

/// [`REPLICAS`] replicas linked to each other, with `n` simulated edges registered over
/// them (in `work`/fleet-`n`): the replicas, their RSS before the edges came, the
/// simulators, and how long the edges took to register from cold.
struct Fleet {
    work: std::path::PathBuf,
    replicas: Vec<Replica>,
    rss0: Vec<u64>,
    sims: Vec<Proc>,
    register_s: f64,
}

impl Fleet {
    fn start(
        tunnel_bin: &Path,
        bench_bin: &Path,
        pki: &Pki,
        work: &Path,
        n: usize,
    ) -> Result<Self> {
        let work = work.join(format!("fleet-{n}"));
        std::fs::create_dir_all(&work)?;
        let mut replicas = Vec::new();
        let mut peer_addrs = Vec::new();
        for i in 0..REPLICAS {
            let peer = loopback(free_port()?);
            replicas.push(Replica {
                name: format!("replica-{i}"),
                proc: None,
                tunnel: loopback(free_port()?),
                connect: loopback(free_port()?),
                peer,
            });
            peer_addrs.push(peer);
        }
        // After the storm the survivors share the dead replica's edges.
        let most = n / (REPLICAS - 1) + 100;
        let nofile = (most > 19_000).then_some(REPLICA_NOFILE);
        for r in &mut replicas {
            r.proc = Some(start_replica(
                tunnel_bin,
                pki,
                &work,
                r,
                &peer_addrs,
                nofile,
            )?);
        }
        std::thread::sleep(Duration::from_secs(1));
        let rss0: Vec<u64> = replicas
            .iter()
            .map(|r| r.proc.as_ref().map_or(Ok(0), Proc::rss_kib))
            .collect::<Result<_>>()?;

        // Cold registration: every simulator at once.
        let clouds: Vec<String> = replicas.iter().map(|r| r.tunnel.to_string()).collect();
        let clouds = clouds.join(",");
        let started = Instant::now();
        let mut sims = Vec::new();
        for (k, first) in (0..n).step_by(EDGES_PER_SIMULATOR).enumerate() {
            let count = EDGES_PER_SIMULATOR.min(n - first);
            // Edge i dials replica i % REPLICAS: a simulator's first edge is index `first`.
            let args: Vec<String> = [
                "bench-helper",
                "sim-edges",
                "--cloud",
                &clouds,
                "--first",
                &first.to_string(),
                "--ca",
                &pki.dir.join("ca.crt").display().to_string(),
                "--token",
                &pki.sim_token,
                "--n",
                &count.to_string(),
                "--max-secs",
                "1800",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            sims.push(Proc::start_piped(
                &format!("fleet-sim-{k}"),
                &work,
                bench_bin,
                &args,
                &[],
            )?);
        }
        for sim in &mut sims {
            sim.wait_line(Duration::from_secs(600), |l| {
                l.strip_prefix("registered ").map(|_| ())
            })?;
        }
        let register_s = started.elapsed().as_secs_f64();
        eprintln!("bench: fleet {n}: all registered in {register_s:.1} s");
        Ok(Self {
            work,
            replicas,
            rss0,
            sims,
            register_s,
        })
    }
}

/// One fleet of `n` simulated edges over [`REPLICAS`] replicas.
pub fn run(
    tunnel_bin: &Path,
    bench_bin: &Path,
    pki: &Pki,
    work: &Path,
    n: usize,
    moves: usize,
    heartbeat_window: Duration,
) -> Result<Figures> {
    let Fleet {
        work,
        mut replicas,
        rss0,
        mut sims,
        register_s,
    } = Fleet::start(tunnel_bin, bench_bin, pki, work, n)?;
    std::thread::sleep(Duration::from_secs(3));

    // Memory and heartbeat CPU of each replica, holding n / REPLICAS edges.
    let per_replica = (n / REPLICAS).max(1) as f64;
    let mut rss_kib_per_edge = Vec::new();
    for (r, before) in replicas.iter().zip(&rss0) {
        let rss = r.proc.as_ref().context("replica")?.rss_kib()?;
        rss_kib_per_edge.push(rss.saturating_sub(*before) as f64 / per_replica);
    }
    let cpu0: Vec<Duration> = replicas
        .iter()
        .map(|r| r.proc.as_ref().context("replica")?.cpu_time())
        .collect::<Result<_>>()?;
    let t0 = Instant::now();
    std::thread::sleep(heartbeat_window);
    let window = t0.elapsed().as_secs_f64();
    let mut heartbeat_cpu_pct = Vec::new();
    for (r, before) in replicas.iter().zip(&cpu0) {
        let cpu = r.proc.as_ref().context("replica")?.cpu_time()?;
        heartbeat_cpu_pct.push((cpu - *before).as_secs_f64() / window * 100.0);
    }

    // An edge that moves: registered on one replica, then on another; how long until a
    // new connection through every replica reaches it.
    let target = echo_server()?;
    let mut move_ms = Vec::new();
    let mut holder = Vec::new();
    let mut forward = Vec::new();
    for m in 0..moves {
        let to = m % REPLICAS;
        let edge = start_edge(tunnel_bin, pki, &work, replicas[to].tunnel, target)?;
        let registered = Instant::now();
        let mut pending: Vec<usize> = (0..REPLICAS).collect();
        while !pending.is_empty() {
            if registered.elapsed() > Duration::from_secs(30) {
                bail!("after a move, replicas {pending:?} did not reach the edge in 30 s");
            }
            pending
                .retain(|&r| connect_echo(replicas[r].connect, EDGE_NODE, target.port()).is_err());
            if !pending.is_empty() {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        move_ms.push(registered.elapsed().as_secs_f64() * 1e3);
        // The forward hop: new connections through the holder and through the next.
        for _ in 0..20 {
            holder.push(
                connect_echo(replicas[to].connect, EDGE_NODE, target.port())?.as_secs_f64() * 1e3,
            );
            let other = replicas[(to + 1) % REPLICAS].connect;
            forward.push(connect_echo(other, EDGE_NODE, target.port())?.as_secs_f64() * 1e3);
        }
        drop(edge);
    }

    // The storm: replica 0 is killed; its edges register with the others.
    let expected = n.div_ceil(REPLICAS) as u64;
    let rereg = |sims: &mut Vec<Proc>| -> Result<(u64, u64)> {
        let mut total = (0, 0);
        for sim in sims.iter_mut() {
            let (count, last) = sim.latest_line(Duration::from_secs(5), |l| {
                let w: Vec<&str> = l.split_whitespace().collect();
                match w.as_slice() {
                    ["pings", _, "failed", _, "rereg", c, "last", t] => {
                        Some((c.parse::<u64>().ok()?, t.parse::<u64>().ok()?))
                    }
                    _ => None,
                }
            })?;
            total = (total.0 + count, total.1.max(last));
        }
        Ok(total)
    };
    let (before, _) = rereg(&mut sims)?;
    let killed_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis() as u64;
    drop(replicas[0].proc.take());
    let deadline = Instant::now() + Duration::from_secs(300);
    let (storm_edges, storm_s) = loop {
        std::thread::sleep(Duration::from_millis(250));
        let (count, last) = rereg(&mut sims)?;
        if count - before >= expected {
            break (count - before, last.saturating_sub(killed_at) as f64 / 1e3);
        }
        if Instant::now() > deadline {
            bail!(
                "after replica-0 was killed only {} of its {expected} edges registered elsewhere in 300 s",
                count - before
            );
        }
    };
    for sim in &mut sims {
        sim.check_alive()?;
    }
    Ok(Figures {
        edges: n,
        register_s,
        storm_edges,
        storm_s,
        rss_kib_per_edge,
        heartbeat_cpu_pct,
        move_p50_ms: percentile(&mut move_ms.clone(), 0.5),
        move_p99_ms: percentile(&mut move_ms, 0.99),
        moves,
        holder_ms: percentile(&mut holder, 0.5),
        forward_ms: percentile(&mut forward, 0.5),
    })
}

fn max(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::NAN, f64::max)
}

/// The run's figures into `results` (table and JSON) and the issue's fleet targets.
pub fn report(results: &mut Results, f: &Figures) {
    let n = f.edges;
    let k = format!("fleet_{n}");
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    for (key, name, unit, value) in [
        (
            "register_s",
            "time to register all from cold",
            "s",
            f.register_s,
        ),
        (
            "storm_s",
            "a killed replica's edges registered elsewhere",
            "s",
            f.storm_s,
        ),
        (
            "rss_kib",
            "replica RSS per edge (mean of replicas)",
            "KiB/edge",
            mean(&f.rss_kib_per_edge),
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
    ] {
        results.add(
            &format!("{k}_{key}"),
            &format!("fleet {n} edges / {REPLICAS} replicas: {name}"),
            unit,
            false,
            TUNNEL,
            value,
        );
    }
    println!(
        "fleet {n} edges over {REPLICAS} replicas ({} per replica):\n  \
         registration from cold: {:.1} s\n  \
         storm: replica-0 killed, {} edges registered elsewhere in {:.1} s\n  \
         RSS per edge per replica: {} KiB\n  \
         heartbeat CPU per replica: {} % of a core\n  \
         moved edge reachable through every replica: p50 {:.0} ms, p99 {:.0} ms over {} moves\n  \
         new connection + echo: through the holder {:.2} ms, through another replica {:.2} ms (forward hop {:+.2} ms)",
        n / REPLICAS,
        f.register_s,
        f.storm_edges,
        f.storm_s,
        f.rss_kib_per_edge
            .iter()
            .map(|v| format!("{v:.1}"))
            .collect::<Vec<_>>()
            .join(" / "),
        f.heartbeat_cpu_pct
            .iter()
            .map(|v| format!("{v:.1}"))
            .collect::<Vec<_>>()
            .join(" / "),
        f.move_p50_ms,
        f.move_p99_ms,
        f.moves,
        f.holder_ms,
        f.forward_ms,
        f.forward_ms - f.holder_ms,
    );
    let check = |target: String, value: String, met: bool| TargetCheck {
        target,
        value,
        met: Some(met),
    };
    let rss = max(&f.rss_kib_per_edge);
    let cpu = max(&f.heartbeat_cpu_pct);
    results.targets.extend([
        check(
            format!("fleet {n}: all edges registered over {REPLICAS} replicas"),
            format!("{n} in {:.1} s", f.register_s),
            true,
        ),
        check(
            format!("fleet {n}: cloud memory <= 32 KiB per idle edge"),
            format!("{rss:.1} KiB (largest replica)"),
            rss <= 32.0,
        ),
        check(
            format!("fleet {n}: heartbeat CPU per replica < 20% of a core"),
            format!("{cpu:.1}% at {} edges (largest replica)", n / REPLICAS),
            cpu < 20.0,
        ),
        check(
            format!("fleet {n}: a moved edge reachable through every replica within 2 s at p99"),
            format!("{:.0} ms", f.move_p99_ms),
            f.move_p99_ms <= 2000.0,
        ),
        check(
            format!("fleet {n}: a killed replica's edges all registered elsewhere within 30 s"),
            format!("{} in {:.1} s", f.storm_edges, f.storm_s),
            f.storm_s <= 30.0,
        ),
    ]);
    // simedge names the nodes the token file lists.
    debug_assert_eq!(simedge::node_name(0), "sim-00000");
}

/// What a relay costs (`--only relay`) with the fleet's edges known.
pub struct RelayFigures {
    pub edges: usize,
    /// Its RSS once linked to every replica, their routes received, and idle.
    pub rss_kib: u64,
    /// The TCP connections it holds (`ss`): one link to each replica.
    pub connections: usize,
}

/// `tunnel cloud` as a relay (`role = "relay"`) beside a fleet of `n` simulated edges
/// over [`REPLICAS`] replicas: its node table lists the `n` edges (an address each, in
/// its eBPF map too) and the replicas' links bring the routes to them. Its redirect is
/// attached to a child cgroup made for it (never the host's root), which holds no
/// process and is removed after; needs root, and says so without it.
pub fn relay(
    tunnel_bin: &Path,
    bench_bin: &Path,
    pki: &Pki,
    work: &Path,
    n: usize,
) -> Result<RelayFigures> {
    use tunnel_user::intercept::detect_cgroup_root;
    let fleet = Fleet::start(tunnel_bin, bench_bin, pki, work, n)?;
    let root = detect_cgroup_root()?;
    let cgroup = root.join(format!("tunnel-bench-relay-{}", std::process::id()));
    std::fs::create_dir(&cgroup).with_context(|| format!("mkdir {}", cgroup.display()))?;
    let measured = measure_relay(tunnel_bin, pki, &fleet, &cgroup, n);
    let _ = std::fs::remove_dir(&cgroup);
    measured
}

fn measure_relay(
    tunnel_bin: &Path,
    pki: &Pki,
    fleet: &Fleet,
    cgroup: &Path,
    n: usize,
) -> Result<RelayFigures> {
    let peers: Vec<String> = fleet
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
        certs = pki.dir.display(),
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
        tunnel_bin,
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
            log.matches("linked to replica").count() >= REPLICAS
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
        rss_kib,
        connections,
    })
}

/// The relay's figures into `results` and the issue's bound on it.
pub fn report_relay(results: &mut Results, f: &RelayFigures) {
    let n = f.edges;
    results.add(
        &format!("relay_{n}_rss_mib"),
        &format!("relay, {n} edges known over {REPLICAS} replicas: idle RSS"),
        "MiB",
        false,
        TUNNEL,
        f.rss_kib as f64 / 1024.0,
    );
    results.add(
        &format!("relay_{n}_connections"),
        &format!("relay, {n} edges known over {REPLICAS} replicas: TCP connections held"),
        "connections",
        false,
        TUNNEL,
        f.connections as f64,
    );
    println!(
        "relay with {n} edges known over {REPLICAS} replicas: idle RSS {:.1} MiB, {} TCP connections held (one link per replica)",
        f.rss_kib as f64 / 1024.0,
        f.connections
    );
    results.targets.push(TargetCheck {
        target: format!("relay, {n} edges known: one connection per replica, no edge session"),
        value: format!("{} connections to {REPLICAS} replicas", f.connections),
        met: Some(f.connections == REPLICAS),
    });
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
