//! `cargo xtask bench`: the tunnel measured against a direct connection, against
//! rathole and, through HTTP CONNECT on a unix socket, against Konnectivity, side by
//! side, on loopback, in one run. See docs/benchmarks.md.
//!
//! Its own crate, not a module of xtask: the simulated edges reuse tunnel-user's
//! HTTP/2 settings, TLS loading and gRPC service, and a dependency on tunnel-user in
//! xtask would make every `cargo xtask` command (`build-ebpf` first) compile the whole
//! tunnel. xtask runs this crate with `cargo run --release`, so the load the bench
//! generates itself (new connections, idle connections, simulated edges) comes from
//! optimised code. `bench` installs the tools, builds `tunnel` in release and measures;
//! `bench-run` only measures. Both start every process, measure in interleaved runs
//! (direct, tunnel, rathole, tunnel CONNECT, Konnectivity, then again), print the
//! table and write JSON.

// How to start cargo, shared with xtask (see there).
#[expect(
    dead_code,
    reason = "cargo_own_toolchain is for xtask's nightly builds"
)]
#[path = "../../src/cargo_env.rs"]
mod cargo_env;
mod clients;
mod delay;
mod fleet;
mod helper;
mod konnectivity;
mod procs;
mod report;
mod setup;
#[path = "../../src/shipped.rs"]
mod shipped;
mod simedge;
mod stack;
mod tools;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand, ValueEnum};

use konnectivity::{ConnectFront, Konnectivity};
use procs::Proc;
use report::{DIRECT, KONNECTIVITY, RATHOLE, RATHOLE_TLS, Results, TUNNEL, TUNNEL_CONNECT};
use stack::{
    CONNECT, ECHO, Endpoints, HTTP, IPERF, Rathole, RatholeTls, SMALL_FILE, SOURCE, Servers,
    TWO_WRITE, Tunnel, TunnelTuning,
};

const GIB: f64 = (1u64 << 30) as f64;

#[derive(Args, Clone, Debug)]
pub struct BenchArgs {
    /// A few seconds per metric, small counts: checks that the bench still works (for
    /// CI). Fails only on breakage, never on performance.
    #[arg(long)]
    pub smoke: bool,
    /// Interleaved runs per figure [default: 3; smoke: 1].
    #[arg(long)]
    pub runs: Option<usize>,
    /// Seconds per throughput/HTTP measurement [default: 3; smoke: 1].
    #[arg(long)]
    pub secs: Option<u64>,
    /// Only these groups (comma-separated).
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<Group>,
    /// Do not install missing tools (apt-get, cargo install).
    #[arg(long)]
    pub skip_install: bool,
    /// Leave rathole out.
    #[arg(long)]
    pub no_rathole: bool,
    /// Leave rathole over TLS out.
    #[arg(long)]
    pub no_rathole_tls: bool,
    /// Leave Konnectivity out (found through $KONNECTIVITY_DIR or
    /// ../shared/konnectivity; left out with a note when it is in neither).
    #[arg(long)]
    pub no_konnectivity: bool,
    /// Idle connections held through one edge [default: 10000; smoke: 200].
    #[arg(long)]
    pub idle: Option<usize>,
    /// Simulated edge counts for the scale test [default: 1000,10000; smoke: 50].
    #[arg(long, value_delimiter = ',')]
    pub edges: Vec<usize>,
    /// Simulated edge counts for the fleet figures, each spread over `--replicas`
    /// [default: 10000; smoke: 100].
    #[arg(long, value_delimiter = ',')]
    pub fleet_edges: Vec<usize>,
    /// Cloud replicas of the fleet figures.
    #[arg(long, default_value_t = 8)]
    pub replicas: usize,
    /// Memory limit of each fleet replica's cgroup, MiB: its edge cap derives from it.
    #[arg(long, default_value_t = 640)]
    pub replica_memory: u64,
    /// Leave the fleet replicas' `[redirect]` off (it is on as root).
    #[arg(long)]
    pub no_redirect: bool,
    /// Moves of the real edge between replicas in the fleet figures [default: 200;
    /// smoke: 5].
    #[arg(long)]
    pub fleet_moves: Option<usize>,
    /// Tokio worker threads of cloud and edge (`runtime.worker_threads`: 0 one per core);
    /// without it, the shipped default, which is what the figures are about.
    #[arg(long)]
    pub worker_threads: Option<usize>,
    /// Extra `[transport]` setting for cloud and edge, e.g. `chunk_size=65536`.
    #[arg(long = "transport", value_name = "KEY=VALUE")]
    pub transport: Vec<String>,
    /// Where to write the JSON results [default: target/bench/results.json].
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Start everything, print the endpoints and PIDs, keep it up this many seconds, and
    /// measure nothing: for profiling (`perf record -p PID`) and manual probing.
    #[arg(long, value_name = "SECS")]
    pub serve: Option<u64>,
    /// `bench-run`: the directory holding the `tunnel` to measure [default: the shipped
    /// (musl) release build's directory]; `bench` measures the `tunnel` it builds.
    #[arg(long)]
    pub bin_dir: Option<PathBuf>,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Group {
    Bulk,
    Http,
    Newconn,
    Isolation,
    Rtt,
    Idle,
    Scale,
    Startup,
    Fleet,
    /// A relay's idle RSS and connections with the fleet's edges known.
    Relay,
}

#[derive(Parser)]
#[command(
    name = "xtask-bench",
    about = "The tunnel's benchmark (run by `cargo xtask bench`)"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install the tools, build `tunnel` in release, then measure.
    Bench(BenchArgs),
    /// Measure only, with the `tunnel` in `--bin-dir`.
    BenchRun(BenchArgs),
    /// Servers and load generators the benchmark starts as separate processes.
    #[command(hide = true)]
    BenchHelper(helper::HelperArgs),
}

fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Cmd::Bench(args) => bench(&args),
        Cmd::BenchRun(args) => {
            let bin_dir = match &args.bin_dir {
                Some(dir) => dir.clone(),
                None => shipped::bin_dir(&setup::workspace_root()),
            };
            run(&args, &bin_dir)
        }
        Cmd::BenchHelper(args) => helper::main(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Set up, then measure with the `tunnel` just built.
fn bench(args: &BenchArgs) -> Result<()> {
    let root = setup::workspace_root();
    if !args.skip_install {
        setup::install_tools(!args.no_rathole)?;
    }
    let bin_dir = setup::build_tunnel(&root)?;
    run(args, &bin_dir)
}

struct Settings {
    smoke: bool,
    runs: usize,
    dur: Duration,
    idle: usize,
    edges: Vec<usize>,
    fleet_edges: Vec<usize>,
    fleet_replicas: usize,
    fleet_memory: u64,
    fleet_redirect: bool,
    fleet_moves: usize,
    heartbeat_window: Duration,
}

/// The bench proper, with `tunnel` from `bin_dir`.
fn run(args: &BenchArgs, bin_dir: &Path) -> Result<()> {
    procs::install_interrupt_handler();
    let nofile = procs::raise_nofile();
    let root = setup::workspace_root();
    let tunnel_bin = bin_dir.join("tunnel");
    let bench_bin = std::env::current_exe()?;
    let s = Settings {
        smoke: args.smoke,
        runs: args.runs.unwrap_or(if args.smoke { 1 } else { 3 }).max(1),
        dur: Duration::from_secs(args.secs.unwrap_or(if args.smoke { 1 } else { 3 }).max(1)),
        idle: args.idle.unwrap_or(if args.smoke { 200 } else { 10_000 }),
        edges: if args.edges.is_empty() {
            if args.smoke {
                vec![50]
            } else {
                vec![1000, 10_000]
            }
        } else {
            args.edges.clone()
        },
        fleet_edges: if args.fleet_edges.is_empty() {
            vec![if args.smoke { 100 } else { 10_000 }]
        } else {
            args.fleet_edges.clone()
        },
        fleet_replicas: args.replicas,
        fleet_memory: args.replica_memory << 20,
        fleet_redirect: !args.no_redirect,
        fleet_moves: args
            .fleet_moves
            .unwrap_or(if args.smoke { 5 } else { 200 })
            .max(1),
        heartbeat_window: Duration::from_secs(if args.smoke { 2 } else { 10 }),
    };
    let want = |g: Group| args.only.is_empty() || args.only.contains(&g);

    let out_dir = root.join("target/bench");
    let work = out_dir.join("run");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work)?;
    let started = Instant::now();
    let mut results = Results::default();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    eprintln!(
        "bench: load average {}",
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    if load
        .split_whitespace()
        .next()
        .and_then(|l| l.parse::<f64>().ok())
        .is_some_and(|l| l > 1.5)
    {
        eprintln!(
            "bench: WARNING: the machine is busy; absolute figures will be low, ratios noisier"
        );
    }
    for (k, v) in [
        (
            "mode",
            if s.smoke {
                "smoke".to_string()
            } else {
                "full".into()
            },
        ),
        ("runs", s.runs.to_string()),
        ("secs_per_measurement", s.dur.as_secs().to_string()),
        ("loadavg_at_start", load.trim().to_string()),
        ("nofile_limit", nofile.to_string()),
        ("git_commit", git_commit(&root)),
        (
            "worker_threads",
            match args.worker_threads {
                None => "shipped default".into(),
                Some(n) => n.to_string(),
            },
        ),
        ("transport_overrides", args.transport.join(" ")),
    ] {
        results.settings.insert(k.into(), v);
    }

    // The fleet's simulated edges present certificates; only the scale figures' tokens.
    let sim_edges = if want(Group::Scale) {
        s.edges.iter().copied().max().unwrap_or(0)
    } else {
        0
    };
    let pki = setup::certs(&tunnel_bin, &work.join("certs"), sim_edges)?;
    let tuning = TunnelTuning {
        transport: args
            .transport
            .iter()
            .map(|kv| toml_setting(kv))
            .collect::<Result<_>>()?,
        worker_threads: args.worker_threads,
        link_delay: None,
        connect_tcp: false,
        connect_unix: false,
        optimistic_ok: None,
        sim_edges: false,
    };
    let rathole_bin = if args.no_rathole {
        None
    } else {
        setup::which("rathole")
    };
    if rathole_bin.is_none() && !args.no_rathole {
        let note =
            "rathole not found: its columns are empty (run without --skip-install to install it)"
                .to_string();
        eprintln!("bench: WARNING: {note}");
        results.notes.push(note);
    }
    let rathole_tls = match (&rathole_bin, args.no_rathole_tls) {
        (Some(_), false) => match setup::pkcs12(&pki) {
            Ok(pkcs12) => Some(RatholeTls {
                pkcs12,
                ca: pki.dir.join("ca.crt"),
            }),
            Err(why) => {
                let note = format!("rathole over TLS skipped: {why}");
                eprintln!("bench: WARNING: {note}");
                results.notes.push(note);
                None
            }
        },
        _ => None,
    };

    let konnectivity_bins = if args.no_konnectivity {
        None
    } else {
        match konnectivity::find(&root, &out_dir.join("konnectivity")) {
            Ok(bins) => Some(bins),
            Err(why) => {
                let note = format!("Konnectivity skipped, its column is left out: {why}");
                eprintln!("bench: {note}");
                results.notes.push(note);
                None
            }
        }
    };

    let servers = Servers::start(&work, &bench_bin)?;
    let mut bench = Bench {
        s: &s,
        results: &mut results,
        pids: BTreeMap::new(),
        bench_bin: &bench_bin,
        konnectivity: konnectivity_bins.as_ref(),
    };

    let needs_main = args.serve.is_some()
        || [Group::Bulk, Group::Http, Group::Newconn, Group::Isolation]
            .into_iter()
            .any(want);
    if needs_main {
        // The main stack has the CONNECT entry on a unix socket too, the tunnel's side
        // of the Konnectivity comparison; forwards and rathole ignore it.
        let main_tuning = TunnelTuning {
            connect_unix: true,
            ..tuning.clone()
        };
        let mut tunnel = Tunnel::start(
            &tunnel_bin,
            &pki,
            &work,
            "tunnel",
            &servers.direct,
            &main_tuning,
        )?;
        let mut tunnel_front = ConnectFront::start(
            &bench_bin,
            &work,
            "tunnel-connect",
            tunnel.connect_socket.as_deref().context("connect socket")?,
            &servers.direct,
            konnectivity::tunnel_authority,
        )?;
        tunnel_front.wait_echo("the tunnel's CONNECT")?;
        let mut konn = match &konnectivity_bins {
            Some(bins) => {
                let r = (|| -> Result<(Konnectivity, ConnectFront)> {
                    let k = Konnectivity::start(bins, &pki, &work, "konnectivity", None)?;
                    let mut front = ConnectFront::start(
                        &bench_bin,
                        &work,
                        "konnectivity",
                        &k.socket,
                        &servers.direct,
                        konnectivity::konnectivity_authority,
                    )?;
                    front.wait_echo("Konnectivity")?;
                    front.check_alive()?;
                    Ok((k, front))
                })();
                bench.outcome("Konnectivity did not start", r)?
            }
            None => None,
        };
        let mut rathole = match &rathole_bin {
            Some(bin) => Some(Rathole::start(
                bin,
                &work,
                "rathole",
                &servers.direct,
                None,
            )?),
            None => None,
        };
        let mut rathole_tls_stack = match (&rathole_bin, &rathole_tls) {
            (Some(bin), Some(tls)) => {
                match Rathole::start(bin, &work, "rathole-tls", &servers.direct, Some(tls)) {
                    Ok(r) => Some(r),
                    Err(e) => {
                        let note = format!("rathole over TLS did not start, skipped: {e:#}");
                        eprintln!("bench: WARNING: {note}");
                        bench.results.notes.push(note);
                        None
                    }
                }
            }
            _ => None,
        };
        bench.pids.insert(
            TUNNEL,
            [
                Some(tunnel.cloud.pid()),
                tunnel.edge.as_ref().map(Proc::pid),
            ]
            .into_iter()
            .flatten()
            .collect(),
        );
        for (path, r) in [(RATHOLE, &rathole), (RATHOLE_TLS, &rathole_tls_stack)] {
            if let Some(r) = r {
                bench
                    .pids
                    .insert(path, vec![r.server.pid(), r.client.pid()]);
            }
        }
        // The same cloud and edge as the forwards; the front is not the relay's.
        bench
            .pids
            .insert(TUNNEL_CONNECT, bench.pids[TUNNEL].clone());
        if let Some((k, _)) = &konn {
            bench
                .pids
                .insert(KONNECTIVITY, vec![k.server.pid(), k.agent.pid()]);
        }
        let mut paths: Vec<(&'static str, Endpoints)> = vec![
            (DIRECT, servers.direct.clone()),
            (TUNNEL, tunnel.endpoints.clone()),
        ];
        if let Some(r) = &rathole {
            paths.push((RATHOLE, r.endpoints.clone()));
        }
        if let Some(r) = &rathole_tls_stack {
            paths.push((RATHOLE_TLS, r.endpoints.clone()));
        }
        paths.push((TUNNEL_CONNECT, tunnel_front.endpoints.clone()));
        if let Some((_, front)) = &konn {
            paths.push((KONNECTIVITY, front.endpoints.clone()));
        }
        if let Some(secs) = args.serve {
            println!(
                "cloud pid {}, edge pid {}",
                tunnel.cloud.pid(),
                tunnel.edge.as_ref().map(|e| e.pid()).unwrap_or(0)
            );
            if let Some((k, _)) = &konn {
                println!(
                    "Konnectivity proxy-server pid {}, proxy-agent pid {}",
                    k.server.pid(),
                    k.agent.pid()
                );
            }
            for (path, ep) in &paths {
                println!("{path}: {ep:?}");
            }
            println!("serving for {secs} s (ctrl-c stops)");
            std::thread::sleep(Duration::from_secs(secs));
            return Ok(());
        }
        let mut alive = || -> Result<()> {
            tunnel.check_alive()?;
            if let Some(r) = &mut rathole {
                r.check_alive()?;
            }
            if let Some(r) = &mut rathole_tls_stack {
                r.check_alive()?;
            }
            tunnel_front.check_alive()?;
            if let Some((k, front)) = &mut konn {
                k.check_alive()?;
                front.check_alive()?;
            }
            Ok(())
        };
        if want(Group::Bulk) {
            bench.bulk(&paths)?;
            alive()?;
        }
        if want(Group::Http) {
            bench.http(&paths)?;
            alive()?;
        }
        if want(Group::Newconn) {
            bench.new_connections(&paths)?;
            alive()?;
        }
        if want(Group::Isolation) {
            bench.isolation(&paths)?;
            alive()?;
        }
    }
    if want(Group::Rtt) {
        bench.round_trips(
            &tunnel_bin,
            &pki,
            &work,
            &servers,
            &tuning,
            rathole_bin.as_deref(),
        )?;
    }
    if want(Group::Idle) {
        bench.idle(
            &tunnel_bin,
            &pki,
            &work,
            &servers,
            &tuning,
            rathole_bin.as_deref(),
            rathole_tls.as_ref(),
        )?;
    }
    if want(Group::Scale) {
        bench.scale(&tunnel_bin, &bench_bin, &pki, &work, &tuning)?;
    }
    if want(Group::Fleet) {
        // One API server for every fleet size, its Nodes made as the sizes grow.
        let mut cluster =
            match fleet::Cluster::start(&root, &work.join("cluster"), setup::EDGE_NODE) {
                Ok(c) => Some(c),
                Err(e) => {
                    let note = format!("the fleet runs without [kubernetes] and [csr]: {e:#}");
                    eprintln!("bench: WARNING: {note}");
                    bench.results.notes.push(note);
                    None
                }
            };
        for &n in &s.fleet_edges {
            eprintln!(
                "bench: fleet: {n} simulated edges over {} replicas",
                s.fleet_replicas
            );
            let r = fleet::run(
                &fleet::Plan {
                    tunnel_bin: &tunnel_bin,
                    bench_bin: &bench_bin,
                    pki: &pki,
                    work: &work,
                    edges: n,
                    replicas: s.fleet_replicas,
                    memory_limit: s.fleet_memory,
                    redirect: s.fleet_redirect,
                },
                cluster.as_mut(),
                s.fleet_moves,
                s.heartbeat_window,
            );
            if let Some(figures) = bench.outcome(&format!("fleet of {n} edges"), r)? {
                fleet::report(bench.results, &figures);
            }
            let map = match fleet::edge_map(n) {
                Ok(line) => line,
                Err(e) => {
                    format!("eBPF edge map at {n} addresses not measured (it needs root): {e:#}")
                }
            };
            println!("  {map}");
            bench.results.notes.push(map);
        }
    }
    if want(Group::Relay) {
        for &n in &s.fleet_edges {
            eprintln!("bench: relay: {n} edges known");
            let r = fleet::relay(&fleet::Plan {
                tunnel_bin: &tunnel_bin,
                bench_bin: &bench_bin,
                pki: &pki,
                work: &work,
                edges: n,
                replicas: fleet::RELAY_REPLICAS,
                memory_limit: s.fleet_memory,
                // The relay's figures do not depend on the replicas' redirect.
                redirect: false,
            });
            if let Some(figures) = bench.outcome(&format!("relay with {n} edges known"), r)? {
                fleet::report_relay(bench.results, &figures);
            }
        }
    }
    if want(Group::Startup) {
        bench.startup(
            &tunnel_bin,
            &pki,
            &work,
            &servers,
            &tuning,
            rathole_bin.as_deref(),
        )?;
    }
    drop(servers);

    results.settings.insert(
        "elapsed_s".into(),
        format!("{:.0}", started.elapsed().as_secs_f64()),
    );
    results.check_targets();
    let table = results.table();
    println!("\n{table}");
    println!(
        "Targets (issues 5, 13 and 25), from this run's medians:\n{}",
        results.targets_text()
    );
    for n in &results.notes {
        println!("note: {n}");
    }
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| out_dir.join("results.json"));
    if let Some(parent) = out.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(&out, serde_json::to_string_pretty(&results)?)?;
    std::fs::write(out.with_extension("md"), &table)?;
    println!(
        "results: {} (table: {}); logs: {}",
        out.display(),
        out.with_extension("md").display(),
        work.display()
    );
    println!("elapsed: {:.0} s", started.elapsed().as_secs_f64());
    if !results.errors.is_empty() {
        for e in &results.errors {
            eprintln!("error: {e}");
        }
        bail!("{} measurement(s) failed", results.errors.len());
    }
    Ok(())
}

fn git_commit(root: &Path) -> String {
    Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(root)
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// `key=value` as a TOML line; numbers stay numbers, anything else becomes a string.
fn toml_setting(kv: &str) -> Result<String> {
    let (k, v) = kv
        .split_once('=')
        .with_context(|| format!("--transport {kv}: expected KEY=VALUE"))?;
    let v = v.trim();
    Ok(if v.parse::<f64>().is_ok() {
        format!("{} = {v}", k.trim())
    } else {
        format!("{} = \"{v}\"", k.trim())
    })
}

/// rathole over TLS is measured where the issue quotes it (memory) and where TLS itself
/// shows (single-stream bulk, new connections); leaving it out of the rest keeps a full
/// run near ten minutes.
struct Bench<'a> {
    s: &'a Settings,
    results: &'a mut Results,
    /// The relay's processes of each path (cloud and edge, rathole server and client),
    /// whose CPU time the efficiency figures count; none for direct.
    pids: BTreeMap<&'static str, Vec<u32>>,
    /// This binary, which also runs the helpers (the CONNECT front).
    bench_bin: &'a Path,
    /// Konnectivity's binaries, when found.
    konnectivity: Option<&'a konnectivity::Bins>,
}

impl Bench<'_> {
    /// CPU time (user + system, /proc/<pid>/stat) used so far by the relay's processes
    /// of `path`; None for direct, which has none.
    fn relay_cpu(&self, path: &str) -> Result<Option<Duration>> {
        let Some(pids) = self.pids.get(path) else {
            return Ok(None);
        };
        let mut sum = Duration::ZERO;
        for pid in pids {
            sum += procs::cpu_time(*pid)?;
        }
        Ok(Some(sum))
    }

    /// CPU time the relay of `path` used since `before`.
    fn relay_cpu_since(&self, path: &str, before: Option<Duration>) -> Result<Option<Duration>> {
        Ok(match (before, self.relay_cpu(path)?) {
            (Some(b), Some(a)) => Some(a.saturating_sub(b)),
            _ => None,
        })
    }

    /// Keeps a failed measurement from ending a full run (it is reported at the end);
    /// in smoke mode any failure is breakage and ends the run.
    fn outcome<T>(&mut self, what: &str, r: Result<T>) -> Result<Option<T>> {
        match r {
            Ok(v) => Ok(Some(v)),
            Err(e) if self.s.smoke => Err(e.context(what.to_string())),
            Err(e) => {
                let msg = format!("{what}: {e:#}");
                eprintln!("bench: FAILED {msg}");
                self.results.errors.push(msg);
                Ok(None)
            }
        }
    }

    fn bulk(&mut self, paths: &[(&'static str, Endpoints)]) -> Result<()> {
        let variants = [
            (1, false, "bulk_1_up", "bulk, 1 stream, cloud->edge"),
            (1, true, "bulk_1_down", "bulk, 1 stream, edge->cloud"),
            (8, false, "bulk_8_up", "bulk, 8 streams, cloud->edge"),
            (8, true, "bulk_8_down", "bulk, 8 streams, edge->cloud"),
        ];
        for run in 0..self.s.runs {
            for (streams, reverse, key, name) in variants {
                for (path, ep) in paths
                    .iter()
                    .filter(|(p, _)| streams == 1 || *p != RATHOLE_TLS)
                {
                    eprintln!("bench: run {}/{} {name} via {path}", run + 1, self.s.runs);
                    let cpu0 = self.relay_cpu(path)?;
                    let r = tools::iperf3(ep[IPERF], self.s.dur.as_secs(), streams, reverse);
                    let cpu = self.relay_cpu_since(path, cpu0)?;
                    if let Some(v) = self.outcome(&format!("{name} via {path}"), r)? {
                        self.results.add(key, name, "Gbit/s", true, path, v.gbps);
                        if let Some(cpu) = cpu {
                            self.results.add(
                                &format!("{key}_cpu"),
                                &format!("{name}: CPU per GiB"),
                                "ms/GiB",
                                false,
                                path,
                                cpu.as_secs_f64() * 1e3 / (v.bytes / GIB),
                            );
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn http(&mut self, paths: &[(&'static str, Endpoints)]) -> Result<()> {
        let variants = [
            (HTTP, SMALL_FILE, 1, "http_c1", "HTTP 1 KiB, 1 conn"),
            (HTTP, SMALL_FILE, 50, "http_c50", "HTTP 1 KiB, 50 conns"),
            (
                TWO_WRITE,
                "/",
                1,
                "two_write_c1",
                "two-write response, 1 conn",
            ),
            (
                TWO_WRITE,
                "/",
                50,
                "two_write_c50",
                "two-write response, 50 conns",
            ),
        ];
        for run in 0..self.s.runs {
            for (service, url, conns, key, name) in variants {
                for (path, ep) in paths.iter().filter(|(p, _)| *p != RATHOLE_TLS) {
                    eprintln!("bench: run {}/{} {name} via {path}", run + 1, self.s.runs);
                    let cpu0 = self.relay_cpu(path)?;
                    let r = tools::wrk(ep[service], url, conns, self.s.dur.as_secs());
                    let cpu = self.relay_cpu_since(path, cpu0)?;
                    if let Some(w) = self.outcome(&format!("{name} via {path}"), r)? {
                        // Per request at 50 connections, where the relay is busiest (the
                        // issue's efficiency figure).
                        if let (Some(cpu), true) = (cpu, key == "http_c50") {
                            self.results.add(
                                &format!("{key}_cpu"),
                                &format!("{name}: CPU per request"),
                                "us/req",
                                false,
                                path,
                                cpu.as_secs_f64() * 1e6 / w.requests,
                            );
                        }
                        self.results.add(
                            &format!("{key}_rps"),
                            &format!("{name}: req/s"),
                            "req/s",
                            true,
                            path,
                            w.rps,
                        );
                        self.results.add(
                            &format!("{key}_p50"),
                            &format!("{name}: p50"),
                            "us",
                            false,
                            path,
                            w.p50_us,
                        );
                        self.results.add(
                            &format!("{key}_p99"),
                            &format!("{name}: p99"),
                            "us",
                            false,
                            path,
                            w.p99_us,
                        );
                    }
                }
            }
        }
        Ok(())
    }

    fn new_connections(&mut self, paths: &[(&'static str, Endpoints)]) -> Result<()> {
        let rt = clients::runtime()?;
        for run in 0..self.s.runs {
            for (path, ep) in paths {
                eprintln!(
                    "bench: run {}/{} new connections via {path}",
                    run + 1,
                    self.s.runs
                );
                let addr = ep[HTTP];
                // Rate: 8 clients in parallel; latency: one client, one connection at a time.
                let rate = rt.block_on(clients::new_connections(addr, SMALL_FILE, self.s.dur, 8));
                let seq = rt.block_on(clients::new_connections(addr, SMALL_FILE, self.s.dur, 1));
                let r = if rate.completed == 0 || seq.completed == 0 {
                    Err(anyhow::anyhow!(
                        "no connection completed ({} and {} failed)",
                        rate.failed,
                        seq.failed
                    ))
                } else {
                    Ok((rate, seq))
                };
                if let Some((rate, mut seq)) =
                    self.outcome(&format!("new connections via {path}"), r)?
                {
                    let per_s = rate.completed as f64 / rate.elapsed.as_secs_f64();
                    self.results.add(
                        "newconn_rate",
                        "new conn + 1 request, 8 parallel: rate",
                        "conn/s",
                        true,
                        path,
                        per_s,
                    );
                    let p50 = report::percentile(&mut seq.latencies_us, 0.5).unwrap_or(f64::NAN);
                    let p99 = report::percentile(&mut seq.latencies_us, 0.99).unwrap_or(f64::NAN);
                    self.results.add(
                        "newconn_p50",
                        "new conn + 1 request, sequential: p50",
                        "us",
                        false,
                        path,
                        p50,
                    );
                    self.results.add(
                        "newconn_p99",
                        "new conn + 1 request, sequential: p99",
                        "us",
                        false,
                        path,
                        p99,
                    );
                    if rate.failed + seq.failed > 0 {
                        self.results.notes.push(format!(
                            "new connections via {path}: {} failed",
                            rate.failed + seq.failed
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    fn isolation(&mut self, paths: &[(&'static str, Endpoints)]) -> Result<()> {
        let rt = clients::runtime()?;
        for run in 0..self.s.runs {
            for (path, ep) in paths {
                if *path == RATHOLE_TLS {
                    continue;
                }
                eprintln!(
                    "bench: run {}/{} isolation via {path}",
                    run + 1,
                    self.s.runs
                );
                // Alternate which goes first, so drift in the machine's load favours neither.
                // Konnectivity closing the connection is one of its figures.
                let closed_ends = *path == KONNECTIVITY;
                let closed = std::cell::Cell::new(false);
                let r = (|| -> Result<(f64, f64)> {
                    let measure = |stalled| -> Result<f64> {
                        let n = rt.block_on(clients::neighbour_throughput(
                            ep[SOURCE],
                            self.s.dur,
                            stalled,
                            closed_ends,
                        ))?;
                        closed.set(closed.get() || n.closed);
                        Ok(n.gbps)
                    };
                    if run % 2 == 0 {
                        let alone = measure(false)?;
                        Ok((alone, measure(true)?))
                    } else {
                        let stalled = measure(true)?;
                        Ok((measure(false)?, stalled))
                    }
                })();
                if closed.get() {
                    let note = format!(
                        "isolation via {path}, run {}: the relay closed the measured connection; what arrived before counts",
                        run + 1
                    );
                    eprintln!("bench: {note}");
                    self.results.notes.push(note);
                }
                if let Some((alone, stalled)) = self.outcome(&format!("isolation via {path}"), r)? {
                    self.results.add(
                        "isolation_alone",
                        "download, 1 conn, alone",
                        "Gbit/s",
                        true,
                        path,
                        alone,
                    );
                    self.results.add(
                        "isolation_stalled",
                        "download, 1 conn, neighbour stalled",
                        "Gbit/s",
                        true,
                        path,
                        stalled,
                    );
                    self.results.add(
                        "isolation_ratio",
                        "isolation: stalled / alone",
                        "ratio",
                        true,
                        path,
                        stalled / alone,
                    );
                }
            }
        }
        Ok(())
    }

    /// Round trips to the first response byte of a new connection, with a proxy
    /// delaying each way by `RTT_ONE_WAY` between edge and cloud (and, for direct,
    /// between client and target, handshake included): a forward, HTTP CONNECT as shipped
    /// (`optimistic_ok = "recent"`: only the first connection to the target waits for
    /// the edge's dial), and HTTP CONNECT with `optimistic_ok = "never"`.
    fn round_trips(
        &mut self,
        tunnel_bin: &Path,
        pki: &setup::Pki,
        work: &Path,
        servers: &Servers,
        tuning: &TunnelTuning,
        rathole_bin: Option<&Path>,
    ) -> Result<()> {
        const RTT_ONE_WAY: Duration = Duration::from_millis(25);
        const PER_RUN: usize = 5;
        let rtt = 2 * RTT_ONE_WAY;
        let target = servers.direct[HTTP];
        let http: Endpoints = [(HTTP, target)].into_iter().collect();
        let direct = delay::DelayProxy::start(target, RTT_ONE_WAY, true)?;
        let with = |optimistic_ok| TunnelTuning {
            link_delay: Some(RTT_ONE_WAY),
            connect_tcp: true,
            optimistic_ok,
            ..tuning.clone()
        };
        // The shipped one has the unix socket entry too, for the CONNECT column.
        let shipped_tuning = TunnelTuning {
            connect_unix: true,
            ..with(None)
        };
        let shipped = Tunnel::start(tunnel_bin, pki, work, "rtt", &http, &shipped_tuning)?;
        let shipped_front = ConnectFront::start(
            self.bench_bin,
            work,
            "rtt",
            shipped
                .connect_socket
                .as_deref()
                .context("connect socket")?,
            &http,
            konnectivity::tunnel_authority,
        )?;
        // Konnectivity with the same delay between agent and server.
        let konn = match self.konnectivity {
            Some(bins) => {
                let r = (|| -> Result<(Konnectivity, ConnectFront)> {
                    let name = "rtt-konnectivity";
                    let k = Konnectivity::start(bins, pki, work, name, Some(RTT_ONE_WAY))?;
                    let f = ConnectFront::start(
                        self.bench_bin,
                        work,
                        name,
                        &k.socket,
                        &http,
                        konnectivity::konnectivity_authority,
                    )?;
                    Ok((k, f))
                })();
                self.outcome("Konnectivity for round trips did not start", r)?
            }
            None => None,
        };
        let strict = Tunnel::start(
            tunnel_bin,
            pki,
            work,
            "rtt-strict",
            &http,
            &with(Some("\"never\"")),
        )?;
        let rathole = match rathole_bin {
            Some(bin) => Some(Rathole::start_linked(
                bin,
                work,
                "rtt-rathole",
                &http,
                None,
                Some(RTT_ONE_WAY),
            )?),
            None => None,
        };
        let authority = format!("{}:{}", setup::EDGE_NODE, target.port());
        let rt = clients::runtime()?;
        let note = "eBPF redirect not measured here: it needs root, a child cgroup holding \
            the client and an edge node address the edge can reach (tunnel-user/tests/redirect/reach.rs \
            does that in a network namespace); a redirected connection is opened as a forward's \
            (proxy::Opener::open with Start::Early), so it takes the forward's round trips";
        eprintln!("bench: {note}");
        self.results.notes.push(note.into());
        let cases: [(&str, &str, SocketAddr, Option<&str>); 3] = [
            ("rtt_forward", "forward", shipped.endpoints[HTTP], None),
            (
                "rtt_connect",
                "HTTP CONNECT",
                shipped.endpoints[CONNECT],
                Some(&authority),
            ),
            (
                "rtt_connect_never",
                "HTTP CONNECT, optimistic_ok = never",
                strict.endpoints[CONNECT],
                Some(&authority),
            ),
        ];
        let measure = |addr: SocketAddr, connect: Option<&str>| -> Result<f64> {
            let mut v = Vec::with_capacity(PER_RUN);
            for _ in 0..PER_RUN {
                let t = rt.block_on(clients::first_response(addr, connect))?;
                v.push(t.as_secs_f64() / rtt.as_secs_f64());
            }
            report::median(&v).context("no samples")
        };
        for run in 0..self.s.runs {
            eprintln!(
                "bench: run {}/{} round trips, link {RTT_ONE_WAY:?} each way",
                run + 1,
                self.s.runs
            );
            let d = measure(direct.addr, None);
            let Some(d) = self.outcome("round trips via direct", d)? else {
                continue;
            };
            for (key, what, addr, connect) in cases {
                let r = measure(addr, connect);
                if let Some(v) = self.outcome(&format!("round trips via {what}"), r)? {
                    let name = format!(
                        "first response byte, new conn, link {} ms each way: {what}",
                        RTT_ONE_WAY.as_millis()
                    );
                    self.results.add(key, &name, "RTT", false, DIRECT, d);
                    self.results.add(key, &name, "RTT", false, TUNNEL, v);
                    // rathole (plain TCP) has forwards only.
                    if let (Some(r), "rtt_forward") = (&rathole, key) {
                        let r = measure(r.endpoints[HTTP], None);
                        if let Some(v) = self.outcome("round trips via rathole", r)? {
                            self.results.add(key, &name, "RTT", false, RATHOLE, v);
                        }
                    }
                    // The unix socket CONNECT paths, through their fronts, which CONNECT
                    // for the client.
                    if key == "rtt_connect" {
                        let mut fronts = vec![(TUNNEL_CONNECT, &shipped_front)];
                        if let Some((_, f)) = &konn {
                            fronts.push((KONNECTIVITY, f));
                        }
                        for (path, front) in fronts {
                            let r = measure(front.endpoints[HTTP], None);
                            if let Some(v) = self.outcome(&format!("round trips via {path}"), r)? {
                                self.results.add(key, &name, "RTT", false, path, v);
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }

    #[expect(
        clippy::too_many_arguments,
        reason = "each figure of the idle test is its own argument; one call site"
    )]
    fn idle(
        &mut self,
        tunnel_bin: &Path,
        pki: &setup::Pki,
        work: &Path,
        servers: &Servers,
        tuning: &TunnelTuning,
        rathole_bin: Option<&Path>,
        rathole_tls: Option<&RatholeTls>,
    ) -> Result<()> {
        let echo: Endpoints = [(ECHO, servers.direct[ECHO])].into_iter().collect();
        let rt = clients::runtime()?;
        // rathole holds two descriptors per connection in each process (client socket
        // and data channel); stay under the per-process limit of 20,000.
        let rathole_n = self.s.idle.min(9000);
        if rathole_n < self.s.idle && rathole_bin.is_some() {
            self.results.notes.push(format!(
                "idle connections: rathole measured with {rathole_n} connections (two descriptors per connection per process; the limit is 20,000)"
            ));
        }
        // The CONNECT front holds two descriptors per connection too.
        let connect_n = self.s.idle.min(9000);
        if connect_n < self.s.idle {
            self.results.notes.push(format!(
                "idle connections: the CONNECT paths (tunnel CONNECT, Konnectivity) measured with {connect_n} connections (the front holds two descriptors per connection; the limit is 20,000)"
            ));
        }
        for run in 0..self.s.runs {
            let mut kinds: Vec<&'static str> = vec![TUNNEL];
            if rathole_bin.is_some() {
                kinds.push(RATHOLE);
            }
            if rathole_tls.is_some() {
                kinds.push(RATHOLE_TLS);
            }
            kinds.push(TUNNEL_CONNECT);
            if self.konnectivity.is_some() {
                kinds.push(KONNECTIVITY);
            }
            for kind in kinds {
                eprintln!(
                    "bench: run {}/{} idle connections via {kind}",
                    run + 1,
                    self.s.runs
                );
                // Fresh processes: memory freed by earlier tests would hide the cost.
                let r = (|| -> Result<(usize, u64, u64)> {
                    // The CONNECT paths' front, which must outlive the measurement.
                    let mut front = None;
                    let (stack, addr, n) = match kind {
                        TUNNEL => {
                            let t =
                                Tunnel::start(tunnel_bin, pki, work, "idle-tunnel", &echo, tuning)?;
                            let addr = t.endpoints[ECHO];
                            (Stack::Tunnel(t), addr, self.s.idle)
                        }
                        TUNNEL_CONNECT => {
                            let with_connect = TunnelTuning {
                                connect_unix: true,
                                ..tuning.clone()
                            };
                            let name = "idle-tunnel-connect";
                            let t =
                                Tunnel::start(tunnel_bin, pki, work, name, &echo, &with_connect)?;
                            let mut f = ConnectFront::start(
                                self.bench_bin,
                                work,
                                name,
                                t.connect_socket.as_deref().context("connect socket")?,
                                &echo,
                                konnectivity::tunnel_authority,
                            )?;
                            f.wait_echo("the tunnel's CONNECT")?;
                            let addr = f.endpoints[ECHO];
                            front = Some(f);
                            (Stack::Tunnel(t), addr, connect_n)
                        }
                        KONNECTIVITY => {
                            let bins = self.konnectivity.context("Konnectivity")?;
                            let name = "idle-konnectivity";
                            let k = Konnectivity::start(bins, pki, work, name, None)?;
                            let mut f = ConnectFront::start(
                                self.bench_bin,
                                work,
                                name,
                                &k.socket,
                                &echo,
                                konnectivity::konnectivity_authority,
                            )?;
                            f.wait_echo("Konnectivity")?;
                            let addr = f.endpoints[ECHO];
                            front = Some(f);
                            (Stack::Konnectivity(k), addr, connect_n)
                        }
                        _ => {
                            let bin = rathole_bin.context("rathole")?;
                            let tls = if kind == RATHOLE_TLS {
                                rathole_tls
                            } else {
                                None
                            };
                            let r = Rathole::start(bin, work, &format!("idle-{kind}"), &echo, tls)?;
                            let addr = r.endpoints[ECHO];
                            (Stack::Rathole(r), addr, rathole_n)
                        }
                    };
                    let (a, b) = stack.sides()?;
                    std::thread::sleep(Duration::from_millis(300));
                    let (a0, b0) = (a.rss_kib()?, b.rss_kib()?);
                    let mut held =
                        rt.block_on(clients::open_idle(addr, n, 64, Duration::from_secs(120)))?;
                    std::thread::sleep(Duration::from_secs(1));
                    let (a1, b1) = (a.rss_kib()?, b.rss_kib()?);
                    rt.block_on(clients::check_idle(&mut held, 100))?;
                    if let Some(f) = &mut front {
                        f.check_alive()?;
                    }
                    drop(held);
                    Ok((n, a1.saturating_sub(a0), b1.saturating_sub(b0)))
                })();
                if let Some((n, da, db)) =
                    self.outcome(&format!("idle connections via {kind}"), r)?
                {
                    let (ka, kb) = (da as f64 / n as f64, db as f64 / n as f64);
                    self.results.add(
                        "idle_held",
                        "idle connections held",
                        "conns",
                        true,
                        kind,
                        n as f64,
                    );
                    self.results.add(
                        "idle_cloud_kib",
                        "idle conn RSS, cloud (rathole server)",
                        "KiB/conn",
                        false,
                        kind,
                        ka,
                    );
                    self.results.add(
                        "idle_edge_kib",
                        "idle conn RSS, edge (rathole client)",
                        "KiB/conn",
                        false,
                        kind,
                        kb,
                    );
                    self.results.add(
                        "idle_total_kib",
                        "idle conn RSS, both sides",
                        "KiB/conn",
                        false,
                        kind,
                        ka + kb,
                    );
                }
            }
        }
        Ok(())
    }

    /// Start-up (issue 13): cloud and edge (rathole server and client) spawned back to
    /// back with the main stack's configs and the echo server as the forward's target;
    /// the time from just before the first spawn to the first byte echoed through the
    /// forward, then each process's RSS once idle with its one edge registered. Fresh
    /// processes every run, killed when the run's stack drops.
    fn startup(
        &mut self,
        tunnel_bin: &Path,
        pki: &setup::Pki,
        work: &Path,
        servers: &Servers,
        tuning: &TunnelTuning,
        rathole_bin: Option<&Path>,
    ) -> Result<()> {
        const FIRST_BYTE_BOUND: Duration = Duration::from_secs(10);
        // Past start-up's bursts (handshakes, registration, the probe's connection),
        // short enough to keep the group well under a minute.
        const SETTLE: Duration = Duration::from_secs(1);
        const KIB_PER_MIB: f64 = 1024.0;
        let echo: Endpoints = [(ECHO, servers.direct[ECHO])].into_iter().collect();
        for run in 0..self.s.runs {
            let mut kinds: Vec<&'static str> = vec![TUNNEL];
            if rathole_bin.is_some() {
                kinds.push(RATHOLE);
            }
            if self.konnectivity.is_some() {
                kinds.push(KONNECTIVITY);
            }
            for kind in kinds {
                eprintln!("bench: run {}/{} start-up via {kind}", run + 1, self.s.runs);
                let r = (|| -> Result<(Duration, u64, u64)> {
                    // Konnectivity is reached through the CONNECT front, which is up
                    // before the clock starts, as kube-apiserver would be.
                    let mut front = None;
                    let mut stack = match kind {
                        TUNNEL => Stack::Tunnel(Tunnel::start_unready(
                            tunnel_bin,
                            pki,
                            work,
                            "startup-tunnel",
                            &echo,
                            tuning,
                        )?),
                        KONNECTIVITY => {
                            let name = "startup-konnectivity";
                            front = Some(ConnectFront::start(
                                self.bench_bin,
                                work,
                                name,
                                &Konnectivity::socket(work, name)?,
                                &echo,
                                konnectivity::konnectivity_authority,
                            )?);
                            let bins = self.konnectivity.context("Konnectivity")?;
                            Stack::Konnectivity(Konnectivity::start_unready(bins, pki, work, name)?)
                        }
                        _ => Stack::Rathole(Rathole::start_unready(
                            rathole_bin.context("rathole")?,
                            work,
                            "startup-rathole",
                            &echo,
                        )?),
                    };
                    let forward = match (&stack, &front) {
                        (_, Some(f)) => f.endpoints[ECHO],
                        (Stack::Tunnel(t), None) => t.endpoints[ECHO],
                        (Stack::Rathole(r), None) => r.endpoints[ECHO],
                        (Stack::Konnectivity(_), None) => bail!("Konnectivity without its front"),
                    };
                    let first_spawn = stack.sides()?.0.spawned_at;
                    let first_byte =
                        procs::first_echo(forward, first_spawn, FIRST_BYTE_BOUND, || {
                            stack.check_alive()
                        })?;
                    std::thread::sleep(SETTLE);
                    stack.check_alive()?;
                    if let Some(f) = &mut front {
                        f.check_alive()?;
                    }
                    let (cloud, edge) = stack.sides()?;
                    Ok((first_byte, cloud.rss_kib()?, edge.rss_kib()?))
                })();
                if let Some((first_byte, cloud_kib, edge_kib)) =
                    self.outcome(&format!("start-up via {kind}"), r)?
                {
                    self.results.add(
                        "startup_first_byte",
                        "first proxied byte after start",
                        "ms",
                        false,
                        kind,
                        first_byte.as_secs_f64() * 1e3,
                    );
                    self.results.add(
                        "startup_cloud_rss",
                        "idle RSS, cloud (rathole server)",
                        "MiB",
                        false,
                        kind,
                        cloud_kib as f64 / KIB_PER_MIB,
                    );
                    self.results.add(
                        "startup_edge_rss",
                        "idle RSS, edge (rathole client)",
                        "MiB",
                        false,
                        kind,
                        edge_kib as f64 / KIB_PER_MIB,
                    );
                }
            }
        }
        Ok(())
    }

    fn scale(
        &mut self,
        tunnel_bin: &Path,
        bench_bin: &Path,
        pki: &setup::Pki,
        work: &Path,
        tuning: &TunnelTuning,
    ) -> Result<()> {
        let none = Endpoints::new();
        for run in 0..self.s.runs {
            for &n in &self.s.edges {
                eprintln!(
                    "bench: run {}/{} scale: {n} simulated edges",
                    run + 1,
                    self.s.runs
                );
                let r = (|| -> Result<(f64, f64, f64, f64)> {
                    let tuning = TunnelTuning {
                        sim_edges: true,
                        ..tuning.clone()
                    };
                    let cloud = Tunnel::start(
                        tunnel_bin,
                        pki,
                        work,
                        &format!("scale-{n}"),
                        &none,
                        &tuning,
                    )?;
                    std::thread::sleep(Duration::from_millis(300));
                    let rss0 = cloud.cloud.rss_kib()?;
                    let args: Vec<String> = [
                        "bench-helper",
                        "sim-edges",
                        "--cloud",
                        &cloud.tunnel_addr.to_string(),
                        "--ca",
                        &pki.dir.join("ca.crt").display().to_string(),
                        "--token",
                        &pki.sim_token,
                        "--n",
                        &n.to_string(),
                        "--max-secs",
                        "400",
                    ]
                    .iter()
                    .map(|s| s.to_string())
                    .collect();
                    let mut sim =
                        Proc::start_piped(&format!("sim-edges-{n}"), work, bench_bin, &args, &[])?;
                    let ms: f64 = sim.wait_line(Duration::from_secs(300), |l| {
                        l.strip_prefix("registered ")
                            .and_then(|r| r.split_whitespace().nth(1))
                            .and_then(|v| v.parse().ok())
                    })?;
                    // Let the first heartbeats and any registration buffers settle.
                    std::thread::sleep(Duration::from_secs(2));
                    let rss1 = cloud.cloud.rss_kib()?;
                    let pings = |sim: &mut Proc| -> Result<f64> {
                        sim.latest_line(Duration::from_secs(5), |l| {
                            l.strip_prefix("pings ")
                                .and_then(|r| r.split_whitespace().next())
                                .and_then(|v| v.parse().ok())
                        })
                    };
                    let p0 = pings(&mut sim)?;
                    let c0 = cloud.cloud.cpu_time()?;
                    let t0 = Instant::now();
                    std::thread::sleep(self.s.heartbeat_window);
                    let c1 = cloud.cloud.cpu_time()?;
                    let window = t0.elapsed();
                    let p1 = pings(&mut sim)?;
                    sim.check_alive()?;
                    let cpu = (c1 - c0).as_secs_f64();
                    let per_beat_us = if p1 > p0 {
                        cpu * 1e6 / (p1 - p0)
                    } else {
                        f64::NAN
                    };
                    Ok((
                        (rss1.saturating_sub(rss0)) as f64 / n as f64,
                        ms / 1e3,
                        cpu / window.as_secs_f64() * 100.0,
                        per_beat_us,
                    ))
                })();
                if let Some((rss, secs, cpu_pct, per_beat)) =
                    self.outcome(&format!("scale with {n} edges"), r)?
                {
                    let k = format!("scale_{n}");
                    self.results.add(
                        &format!("{k}_rss_kib"),
                        &format!("{n} edges: cloud RSS per edge"),
                        "KiB/edge",
                        false,
                        TUNNEL,
                        rss,
                    );
                    self.results.add(
                        &format!("{k}_register_s"),
                        &format!("{n} edges: time to register all"),
                        "s",
                        false,
                        TUNNEL,
                        secs,
                    );
                    self.results.add(
                        &format!("{k}_cpu_pct"),
                        &format!("{n} edges: cloud CPU, heartbeats only"),
                        "% of a core",
                        false,
                        TUNNEL,
                        cpu_pct,
                    );
                    self.results.add(
                        &format!("{k}_cpu_per_beat"),
                        &format!("{n} edges: cloud CPU per heartbeat"),
                        "us",
                        false,
                        TUNNEL,
                        per_beat,
                    );
                }
            }
        }
        Ok(())
    }
}

/// The relay under test in the idle-connection and start-up tests: its cloud-side and
/// edge-side process.
enum Stack {
    Tunnel(Tunnel),
    Rathole(Rathole),
    Konnectivity(Konnectivity),
}

impl Stack {
    /// The cloud-side and the edge-side process (rathole: server and client;
    /// Konnectivity: proxy-server and proxy-agent).
    fn sides(&self) -> Result<(&Proc, &Proc)> {
        Ok(match self {
            Stack::Tunnel(t) => (&t.cloud, t.edge.as_ref().context("edge")?),
            Stack::Rathole(r) => (&r.server, &r.client),
            Stack::Konnectivity(k) => (&k.server, &k.agent),
        })
    }

    fn check_alive(&mut self) -> Result<()> {
        match self {
            Stack::Tunnel(t) => t.check_alive(),
            Stack::Rathole(r) => r.check_alive(),
            Stack::Konnectivity(k) => k.check_alive(),
        }
    }
}
