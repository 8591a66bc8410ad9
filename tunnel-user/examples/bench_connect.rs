//! connect() latency to a non-edge loopback address from a process in a child cgroup,
//! with the intercept programs attached to that cgroup vs. a sibling cgroup without
//! them. Rounds interleave the two so drift (other load, CPU frequency) hits both.
//! Measured for 127.0.0.1 (connect4) and, where the host has IPv6, for [::1]
//! (connect6's IPv6 path), with IPv4 and IPv6 edges in the maps.
//!
//!     cargo xtask bench-connect [-- ROUNDS CONNECTS_PER_ROUND]
//!
//! Needs root. Traffic: 127.0.0.1 and ::1 only. Each measurement is one process started in the
//! cgroup (only that process is moved there) doing CONNECTS connects; the figure per
//! round is its median, and the result is the median over rounds.

#[path = "../tests/common/privileged.rs"]
#[expect(dead_code, reason = "the benchmark makes its cgroups itself")]
mod privileged;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, TcpListener};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use privileged::{TestCgroup, cannot_run, is_root};
use tunnel_user::intercept::{InterceptConfig, Interceptor, detect_cgroup_root};

const CLIENT_FLAG: &str = "--client";

fn median(v: &mut [u64]) -> u64 {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0)
}

/// Child mode: `n` connects to `addr`, prints the median connect() time in ns.
fn client(addr: SocketAddr, n: usize) -> std::io::Result<()> {
    let mut times = Vec::with_capacity(n);
    for _ in 0..n {
        let sock = socket2::Socket::new(
            socket2::Domain::for_address(addr),
            socket2::Type::STREAM,
            None,
        )?;
        // Close with RST: no TIME_WAIT pile-up over thousands of connects.
        sock.set_linger(Some(Duration::ZERO))?;
        let start = Instant::now();
        sock.connect(&addr.into())?;
        times.push(u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX));
    }
    println!("{}", median(&mut times));
    Ok(())
}

/// Accepts and drops connections until `stop`; the last connect in `main` wakes it.
fn sink(listener: TcpListener, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::Relaxed) {
        if listener.accept().is_err() {
            break;
        }
    }
}

async fn measure(cgroup: &TestCgroup, addr: SocketAddr, n: usize) -> anyhow::Result<u64> {
    let exe = std::env::current_exe()?;
    let exe = exe.to_string_lossy();
    let (addr, n) = (addr.to_string(), n.to_string());
    let out = cgroup
        .run(&[&exe, CLIENT_FLAG, &addr, &n], Duration::from_secs(60))
        .await?;
    Ok(out.trim().parse()?)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some(CLIENT_FLAG) {
        let addr = args
            .get(2)
            .ok_or_else(|| anyhow::anyhow!("address"))?
            .parse()?;
        let n = args
            .get(3)
            .ok_or_else(|| anyhow::anyhow!("count"))?
            .parse()?;
        return Ok(client(addr, n)?);
    }
    let rounds: usize = args.get(1).map(|s| s.parse()).transpose()?.unwrap_or(10);
    let n: usize = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(2000);
    if !is_root() {
        cannot_run("bench-connect needs root to attach eBPF programs");
        return Ok(());
    }

    let root = detect_cgroup_root()?;
    let with = TestCgroup::new(&root)?;
    let without = TestCgroup::new(&root)?;
    let interceptor = Interceptor::attach(&InterceptConfig {
        cgroup: Some(with.path.clone()),
        ..InterceptConfig::new(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 1))
    })?;
    // A realistic edge set, so the lookups are not into empty maps.
    let edges: Vec<IpAddr> = (0..1024u32)
        .flat_map(|i| {
            [
                IpAddr::from(Ipv4Addr::from(0x7f02_0000 + i)),
                IpAddr::from(Ipv6Addr::from(
                    0xfd00_0000_0000_0000_0000_0000_0000_0000 + u128::from(i),
                )),
            ]
        })
        .collect();
    interceptor.set_edges(&edges)?;

    for target in ["127.0.0.1:0", "[::1]:0"] {
        let listener = match TcpListener::bind(target) {
            Ok(l) => l,
            Err(e) if target.starts_with('[') => {
                println!("connect() to {target}: skipped, no IPv6 loopback ({e})");
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        let before = interceptor.counters();
        compare(&with, &without, listener, rounds, n).await?;
        let after = interceptor.counters();
        println!(
            "  counters: passed +{}, redirected +{}, errors +{}",
            after.passed - before.passed,
            after.redirected - before.redirected,
            after.errors - before.errors
        );
    }
    drop(interceptor);
    Ok(())
}

/// Interleaved rounds against `listener` from both cgroups; prints the medians.
async fn compare(
    with: &TestCgroup,
    without: &TestCgroup,
    listener: TcpListener,
    rounds: usize,
    n: usize,
) -> anyhow::Result<()> {
    let target = listener.local_addr()?;
    let stop = Arc::new(AtomicBool::new(false));
    let sink_thread = std::thread::spawn({
        let stop = stop.clone();
        move || sink(listener, stop)
    });
    let (mut attached, mut plain) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        // Alternate which goes first, so neither always runs on a warmer cache.
        if round % 2 == 0 {
            attached.push(measure(with, target, n).await?);
            plain.push(measure(without, target, n).await?);
        } else {
            plain.push(measure(without, target, n).await?);
            attached.push(measure(with, target, n).await?);
        }
    }
    stop.store(true, Ordering::Relaxed);
    let _ = std::net::TcpStream::connect(target);
    let _ = sink_thread.join();

    let (a, p) = (median(&mut attached), median(&mut plain));
    println!("connect() to {target}, {rounds} rounds x {n} connects, median of per-round medians:");
    println!("  without programs: {:>8.2} us", p as f64 / 1000.0);
    println!("  with programs:    {:>8.2} us", a as f64 / 1000.0);
    println!("  ratio with/without: {:.3}", a as f64 / p.max(1) as f64);
    Ok(())
}
