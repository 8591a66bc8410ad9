//! Many short connections through the tunnel, every one checksummed: open fds and async
//! tasks of cloud and edge return to baseline, RSS stays within 10% (plus a little) of
//! its baseline after warm-up, and none fails. `TUNNEL_SOAK=1` runs 100k connections.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::config::allow;
use common::probe::{self, round_trip};
use common::{EdgeOpts, Proc, Setup, metric, servers};
use toml::Table;

/// A cloud and a ready edge `edge-1` allowed to reach a sink: the set-up, the cloud, the
/// edge, the edge's admin address and the CONNECT authority of the sink.
fn sink_behind_edge() -> (Setup, Proc, Proc, std::net::SocketAddr, String) {
    let mut s = Setup::new("edge-1:token-one\n");
    let sink = servers::sink("127.0.0.1:0");
    let authority = format!("edge-1:{}", sink.port());
    let cloud = s.start_cloud(Table::new());
    let (edge, edge_admin) = s.start_edge(EdgeOpts {
        extra: allow(&[sink]),
        ..EdgeOpts::new("edge-1", "token-one")
    });
    assert!(
        common::wait_http_ok(
            &format!("http://{edge_admin}/readyz"),
            Duration::from_secs(10)
        ),
        "{}",
        edge.log_text()
    );
    (s, cloud, edge, edge_admin, authority)
}

#[test]
fn short_connections_leak_no_fds_or_memory_and_none_fails() {
    let total: u64 = if std::env::var_os("TUNNEL_SOAK").is_some() {
        100_000
    } else {
        5_000
    };
    let (s, cloud, edge, edge_admin, authority) = sink_behind_edge();
    let tasks = || {
        (
            metric(s.cloud_admin, "tunnel_tasks_alive"),
            metric(edge_admin, "tunnel_tasks_alive"),
        )
    };
    let run = |n: u64| -> (u64, Vec<String>) {
        let next = AtomicU64::new(0);
        let failures = std::sync::Mutex::new(Vec::new());
        std::thread::scope(|sc| {
            for _ in 0..8 {
                sc.spawn(|| {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= n {
                            return;
                        }
                        if let Err(e) = round_trip(s.connect, &authority, i, 1024) {
                            failures.lock().unwrap().push(format!("#{i}: {e}"));
                        }
                    }
                });
            }
        });
        (n, failures.into_inner().unwrap())
    };
    // Warm-up, then the baseline.
    let (_, warm_fail) = run(500);
    assert!(warm_fail.is_empty(), "warm-up failures: {warm_fail:?}");
    let (c, e) = (cloud.pid(), edge.pid());
    // The warm-up's connections are wound down once descriptors and tasks hold still.
    common::settled(Duration::from_millis(300), Duration::from_secs(10), || {
        (probe::fds(c), probe::fds(e), tasks())
    });
    let base = (
        probe::fds(c),
        probe::fds(e),
        probe::rss_kib(c),
        probe::rss_kib(e),
    );
    let base_tasks = tasks();
    assert!(
        base_tasks.0 > 0.0 && base_tasks.1 > 0.0,
        "tunnel_tasks_alive missing from /metrics: {base_tasks:?}"
    );
    let started = Instant::now();
    let (n, failures) = run(total);
    let secs = started.elapsed().as_secs_f64();
    let settled = probe::eventually(Duration::from_secs(10), || {
        probe::fds(c) <= base.0 + 2 && probe::fds(e) <= base.1 + 2
    });
    let tasks_settled = probe::eventually(Duration::from_secs(10), || {
        let now = tasks();
        now.0 <= base_tasks.0 && now.1 <= base_tasks.1
    });
    let now = (
        probe::fds(c),
        probe::fds(e),
        probe::rss_kib(c),
        probe::rss_kib(e),
    );
    let now_tasks = tasks();
    println!(
        "{n} checksummed connections in {secs:.1}s ({:.0}/s), {} failed; fds cloud {} -> {}, edge {} -> {}; tasks cloud {} -> {}, edge {} -> {}; RSS cloud {} -> {} KiB, edge {} -> {} KiB",
        n as f64 / secs,
        failures.len(),
        base.0,
        now.0,
        base.1,
        now.1,
        base_tasks.0,
        now_tasks.0,
        base_tasks.1,
        now_tasks.1,
        base.2,
        now.2,
        base.3,
        now.3
    );
    assert!(
        failures.is_empty(),
        "{} of {n} connections failed, first: {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    assert!(
        settled,
        "fds did not return to baseline: cloud {} -> {}, edge {} -> {}",
        base.0, now.0, base.1, now.1
    );
    assert!(
        tasks_settled,
        "tasks did not return to baseline: cloud {} -> {}, edge {} -> {}",
        base_tasks.0, now_tasks.0, base_tasks.1, now_tasks.1
    );
    assert!(
        now.2 <= base.2 + base.2 / 10 + 4096,
        "cloud RSS {} -> {} KiB",
        base.2,
        now.2
    );
    assert!(
        now.3 <= base.3 + base.3 / 10 + 4096,
        "edge RSS {} -> {} KiB",
        base.3,
        now.3
    );
}

/// New connections paced at 1,000/s for 8 s (60 s with `TUNNEL_SOAK=1`): none may fail.
#[test]
fn a_thousand_new_connections_a_second_with_none_failed() {
    let secs: u64 = if std::env::var_os("TUNNEL_SOAK").is_some() {
        60
    } else {
        8
    };
    let (s, _cloud, _edge, _, authority) = sink_behind_edge();
    let started = Instant::now();
    let next = AtomicU64::new(0);
    let (done, failed) = (AtomicU64::new(0), AtomicU64::new(0));
    std::thread::scope(|sc| {
        for _ in 0..8 {
            sc.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    // Connection i starts no earlier than i ms after the start.
                    let at = Duration::from_millis(i);
                    if at >= Duration::from_secs(secs) {
                        return;
                    }
                    if let Some(wait) = at.checked_sub(started.elapsed()) {
                        std::thread::sleep(wait);
                    }
                    match round_trip(s.connect, &authority, i, 512) {
                        Ok(()) => done.fetch_add(1, Ordering::Relaxed),
                        Err(_) => failed.fetch_add(1, Ordering::Relaxed),
                    };
                }
            });
        }
    });
    let took = started.elapsed().as_secs_f64();
    let (done, failed) = (done.into_inner(), failed.into_inner());
    println!(
        "load: {done} checksummed connections in {took:.1}s ({:.0}/s, target 1000/s), {failed} failed",
        done as f64 / took
    );
    assert_eq!(failed, 0, "{failed} connections failed under load");
    assert!(
        done as f64 / took > 500.0,
        "only {:.0} connections/s",
        done as f64 / took
    );
}

/// Forwards send the client's bytes before the edge has answered the dial. Many short
/// connections of each kind: checksummed ones, ones the edge refuses (a target outside
/// its allowlist, a closed port), and clients that reset before the answer: each refused
/// one ends in a reset, and fds and tasks of cloud and edge return to baseline.
#[test]
fn early_forwards_refused_or_aborted_leak_no_fds_or_tasks() {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::net::{Shutdown, SocketAddr, TcpStream};
    const EACH: u64 = 300;
    let mut s = Setup::new("edge-1:token-one\n");
    let sink = servers::sink("127.0.0.1:0");
    // Held, never listening: nothing answers there and no one else can take them.
    let (forbidden, closed) = (common::ClosedPort::new(), common::ClosedPort::new());
    let (forbidden, closed, _held) = (forbidden.addr, closed.addr, [forbidden, closed]);
    let cloud = s.start_cloud(common::config::forwards(
        "edge-1",
        &[sink, forbidden, closed],
    ));
    let ready = cloud.ready();
    let (to_sink, to_forbidden, to_closed) = (
        ready.addr("forward[0].listen"),
        ready.addr("forward[1].listen"),
        ready.addr("forward[2].listen"),
    );
    let (edge, edge_admin) = s.start_edge(EdgeOpts {
        extra: allow(&[sink, closed]),
        ..EdgeOpts::new("edge-1", "token-one")
    });
    assert!(
        common::wait_http_ok(
            &format!("http://{edge_admin}/readyz"),
            Duration::from_secs(10)
        ),
        "{}",
        edge.log_text()
    );

    let checksummed = |i: u64| -> Result<(), String> {
        let mut conn = TcpStream::connect(to_sink).map_err(|e| e.to_string())?;
        conn.set_read_timeout(Some(Duration::from_secs(10)))
            .map_err(|e| e.to_string())?;
        let hash = servers::send_pattern(Some(&mut conn), i, 1024).map_err(|e| e.to_string())?;
        conn.shutdown(Shutdown::Write).map_err(|e| e.to_string())?;
        let mut answer = String::new();
        BufReader::new(&conn)
            .read_line(&mut answer)
            .map_err(|e| e.to_string())?;
        if answer.trim() == format!("1024 {hash}") {
            Ok(())
        } else {
            Err(format!("sink saw `{}`", answer.trim()))
        }
    };
    let reset = |listen: SocketAddr| -> Result<(), String> {
        let mut conn = TcpStream::connect(listen).map_err(|e| e.to_string())?;
        conn.set_read_timeout(Some(Duration::from_secs(10)))
            .map_err(|e| e.to_string())?;
        let mut buf = [0u8; 16];
        match conn
            .write_all(b"early bytes")
            .and_then(|()| conn.read(&mut buf))
        {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => Ok(()),
            other => Err(format!("expected a reset, got {other:?}")),
        }
    };
    let abort = || -> Result<(), String> {
        let mut conn = TcpStream::connect(to_sink).map_err(|e| e.to_string())?;
        conn.write_all(b"gone before the answer")
            .map_err(|e| e.to_string())?;
        socket2::SockRef::from(&conn)
            .set_linger(Some(Duration::ZERO))
            .map_err(|e| e.to_string())?;
        Ok(())
    };
    let run = |each: u64| -> Vec<String> {
        let next = AtomicU64::new(0);
        let failures = std::sync::Mutex::new(Vec::new());
        std::thread::scope(|sc| {
            for _ in 0..8 {
                sc.spawn(|| {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= 4 * each {
                            return;
                        }
                        let r = match i % 4 {
                            0 => checksummed(i),
                            1 => reset(to_forbidden),
                            2 => reset(to_closed),
                            _ => abort(),
                        };
                        if let Err(e) = r {
                            failures.lock().unwrap().push(format!("#{i}: {e}"));
                        }
                    }
                });
            }
        });
        failures.into_inner().unwrap()
    };
    let warm = run(25);
    assert!(warm.is_empty(), "warm-up failures: {warm:?}");
    let tasks = || {
        (
            metric(s.cloud_admin, "tunnel_tasks_alive"),
            metric(edge_admin, "tunnel_tasks_alive"),
        )
    };
    let (c, e) = (cloud.pid(), edge.pid());
    // The warm-up's connections are wound down once descriptors and tasks hold still.
    let (fds0, tasks0) =
        common::settled(Duration::from_millis(300), Duration::from_secs(10), || {
            ((probe::fds(c), probe::fds(e)), tasks())
        });
    let started = Instant::now();
    let failures = run(EACH);
    let secs = started.elapsed().as_secs_f64();
    let fds_settled = probe::eventually(Duration::from_secs(10), || {
        probe::fds(c) <= fds0.0 + 2 && probe::fds(e) <= fds0.1 + 2
    });
    let tasks_settled = probe::eventually(Duration::from_secs(10), || {
        let now = tasks();
        now.0 <= tasks0.0 && now.1 <= tasks0.1
    });
    let (fds1, tasks1) = ((probe::fds(c), probe::fds(e)), tasks());
    println!(
        "{} early forwards in {secs:.1}s ({EACH} each: checksummed, forbidden, refused, client reset), {} failed; fds cloud {} -> {}, edge {} -> {}; tasks cloud {} -> {}, edge {} -> {}",
        4 * EACH,
        failures.len(),
        fds0.0,
        fds1.0,
        fds0.1,
        fds1.1,
        tasks0.0,
        tasks1.0,
        tasks0.1,
        tasks1.1
    );
    assert!(
        failures.is_empty(),
        "{} failed, first: {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    assert!(
        fds_settled,
        "fds did not return to baseline: cloud {} -> {}, edge {} -> {}",
        fds0.0, fds1.0, fds0.1, fds1.1
    );
    assert!(
        tasks_settled,
        "tasks did not return to baseline: cloud {} -> {}, edge {} -> {}",
        tasks0.0, tasks1.0, tasks0.1, tasks1.1
    );
    let scrape = common::scrape(s.cloud_admin);
    for reason in ["forbidden", "refused"] {
        assert_eq!(
            common::sample(
                &scrape,
                &format!("tunnel_dial_failures_total{{reason=\"{reason}\"}}")
            ),
            (EACH + 25) as f64,
            "{reason}: {scrape}"
        );
    }
    let listed = std::process::Command::new("curl")
        .args(["-sS", "--max-time", "5"])
        .arg(format!("http://{}/debug/connections", s.cloud_admin))
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&listed.stdout).trim(),
        "[]",
        "connections still listed"
    );
}

/// An edge answering into calls whose clients do not read (a hostile edge, or targets
/// streaming to clients that stalled) holds at most `transport.max_buffered_per_edge`
/// of the cloud's memory: past it the edge's streams wait. Here 16 MiB, with 24 stalled
/// clients each pulling 1 GiB through a 4 MiB stream window: the cloud grows by about
/// 25 MiB (the bound, and each connection's read buffer); without the bound it holds a
/// window per stream, and grew by 88 MiB.
#[test]
fn an_edge_answering_into_clients_that_do_not_read_holds_a_bounded_part_of_the_cloud_memory() {
    use std::io::Write as _;
    let mut s = Setup::new("edge-1:token-one\n");
    let source = servers::source("127.0.0.1:0");
    let cloud = s.start_cloud(toml::toml! {
        [transport]
        max_buffered_per_edge = 16777216
    });
    let _edge = s.start_ready_edge(EdgeOpts {
        extra: allow(&[source]),
        ..EdgeOpts::new("edge-1", "token-one")
    });
    let pid = cloud.pid();
    let base = probe::rss_kib(pid);
    let authority = format!("edge-1:{}", source.port());
    let stalled: Vec<_> = (0..24u64)
        .map(|seed| {
            let mut conn = common::connect_via(s.connect, &authority).expect("CONNECT");
            writeln!(conn, "{seed} {}", 1u64 << 30).expect("request");
            conn
        })
        .collect();
    // Everything waits once the bytes from the edge hold still.
    let from_edge = r#"tunnel_bytes_total{direction="from_edge"}"#;
    let carried = common::settled(Duration::from_secs(1), Duration::from_secs(60), || {
        metric(s.cloud_admin, from_edge)
    });
    let grew = probe::rss_kib(pid).saturating_sub(base);
    println!(
        "24 stalled clients: {:.0} MiB carried, cloud RSS {base} KiB + {grew} KiB",
        carried / f64::from(1 << 20)
    );
    assert!(
        grew < 40 << 10,
        "the cloud holds {grew} KiB more for 24 clients that do not read (bound: 16 MiB)"
    );
    drop(stalled);
}
