//! Faults between and inside the processes: the cloud killed and restarted, a
//! partition between cloud and edge (a black-holing TCP proxy), an edge that flaps
//! (1,000 times with `TUNNEL_SOAK=1`), targets and clouds that accept but never answer.
//! Every transfer is checksummed.

#![expect(
    clippy::unwrap_used,
    reason = "a panic with its message is how a test reports failure"
)]
mod common;

use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use common::config::{allow, https_front};
use common::inproc::{self, InProcess, Side};
use common::probe::{self, FaultProxy, round_trip};
use common::{EdgeOpts, Setup, connect_via, servers};
use toml::Table;

const TOKENS: &str = "edge-1:token-one\n";

/// Whether `s` is ended by the far side within `bound`.
fn ends_within(s: &mut TcpStream, bound: Duration) -> bool {
    let started = Instant::now();
    s.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut buf = [0u8; 4096];
    while started.elapsed() < bound {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return true,
        }
    }
    false
}

#[test]
fn a_killed_cloud_restarted_on_the_same_ports_serves_again_within_3s() {
    let mut s = Setup::new(TOKENS);
    let sink = servers::sink("127.0.0.1:0");
    let authority = format!("edge-1:{}", sink.port());
    // The same ports on purpose: reserved for the whole test, the restart included.
    let _ports = s.reserve_cloud_ports();
    let mut cloud = s.start_cloud(Table::new());
    let _edge = s.start_ready_edge(EdgeOpts {
        extra: allow(&[sink]),
        ..EdgeOpts::new("edge-1", "token-one")
    });
    round_trip(s.connect, &authority, 1, 1 << 20).expect("before the kill");
    let mut open = connect_via(s.connect, &authority).expect("open connection");
    cloud.kill9();
    assert!(
        ends_within(&mut open, Duration::from_secs(2)),
        "a client connection outlived the cloud"
    );
    // Let the edge go through a few backoff steps before the cloud comes back. Not
    // longer: by 1 s the edge's delays (edge::connect::Backoff, 50-100 ms doubling) have
    // reached 0.8-1.6 s, and a second more would let the next one pass the 3 s bound.
    std::thread::sleep(Duration::from_secs(1));
    let _cloud = s.start_cloud(Table::new());
    let restarted = Instant::now();
    let ok = probe::eventually(Duration::from_secs(3), || {
        round_trip(s.connect, &authority, 2, 1 << 20).is_ok()
    });
    let took = restarted.elapsed();
    println!("cloud kill -9 + restart: first checksummed connection {took:?} after the restart");
    assert!(
        ok,
        "no working connection within 3 s of the cloud's restart"
    );
}

/// A partition between edge and cloud (bytes vanish, nothing closes) is detected by the
/// heartbeat, ends the connections it carried, and heals. In process, paused: the
/// heartbeat's timeout and the edge's backoff take no wall time.
#[tokio::test(start_paused = true)]
async fn a_partition_is_detected_by_heartbeat_ends_connections_and_heals() {
    let mut t = InProcess::start(TOKENS, Table::new()).await;
    let sink = servers::sink("127.0.0.1:0");
    let authority = format!("edge-1:{}", sink.port());
    let proxy = inproc::FaultProxy::start(t.s.tunnel).await;
    t.s.tunnel = proxy.addr; // the edge dials the cloud through the proxy
    let _edge = t
        .start_ready_edge(EdgeOpts {
            extra: allow(&[sink]),
            ..EdgeOpts::new("edge-1", "token-one")
        })
        .await;
    let (connect, a) = (t.s.connect, authority.clone());
    inproc::blocking(move || round_trip(connect, &a, 1, 1 << 20))
        .await
        .expect("before the partition");
    let mut open = Vec::new();
    for _ in 0..3 {
        let (status, conn) = inproc::connect(t.s.connect, &authority).await;
        assert!(status.starts_with("HTTP/1.1 200"), "{status}");
        open.push(conn);
    }

    proxy.partition(true);
    let started = tokio::time::Instant::now();
    // heartbeat_interval 1 s, heartbeat_timeout 3 s (Setup): detected within ~4 s.
    // Logged whichever way the session ends (heartbeat or connection failure).
    t.wait_log(Side::Cloud, "edge disconnected", Duration::from_secs(12))
        .await;
    let detected = started.elapsed();
    for (i, c) in open.iter_mut().enumerate() {
        assert!(
            inproc::ends_within(c, Duration::from_secs(5)).await,
            "client connection {i} outlived the partition"
        );
    }
    let ended = started.elapsed();
    assert!(
        detected < Duration::from_secs(10),
        "detection took {detected:?} (bound: 3 s timeout + 1 s interval)"
    );

    let registrations = t.logs.count(Side::Cloud, &["edge registered"]);
    proxy.partition(false);
    let healed = tokio::time::Instant::now();
    t.logs
        .wait_count(
            Side::Cloud,
            &["edge registered"],
            registrations + 1,
            Duration::from_secs(20),
        )
        .await;
    let (connect, a) = (t.s.connect, authority.clone());
    inproc::blocking(move || round_trip(connect, &a, 3, 1 << 20))
        .await
        .expect("service did not recover after the partition healed");
    println!(
        "partition: detected after {detected:?}, all client connections ended after {ended:?}, service back {:?} after healing",
        healed.elapsed()
    );
}

#[test]
fn an_edge_flapping_through_many_reconnects_leaks_nothing() {
    let cycles: usize = if std::env::var_os("TUNNEL_SOAK").is_some() {
        1000
    } else {
        100
    };
    let mut s = Setup::new(TOKENS);
    let sink = servers::sink("127.0.0.1:0");
    let authority = format!("edge-1:{}", sink.port());
    let cloud = s.start_cloud(Table::new());
    let proxy = FaultProxy::start(s.tunnel);
    s.tunnel = proxy.addr;
    let (edge, edge_admin) = s.start_edge(EdgeOpts {
        extra: allow(&[sink]),
        ..EdgeOpts::new("edge-1", "token-one")
    });
    assert!(common::wait_http_ok(
        &format!("http://{edge_admin}/readyz"),
        Duration::from_secs(10)
    ));
    let ready = || {
        common::wait_http_ok(
            &format!("http://{edge_admin}/readyz"),
            Duration::from_millis(100),
        )
    };
    // One flap: cut every link, wait for the edge to be back, move 1 MiB checksummed.
    let flap = |i: usize| {
        let before = proxy.accepted.load(std::sync::atomic::Ordering::Relaxed);
        proxy.cut_all();
        assert!(
            probe::eventually(Duration::from_secs(30), || proxy
                .accepted
                .load(std::sync::atomic::Ordering::Relaxed)
                > before
                && ready()),
            "edge did not come back after cut {i}"
        );
        assert!(
            probe::eventually(Duration::from_secs(10), || round_trip(
                s.connect,
                &authority,
                i as u64,
                1 << 20
            )
            .is_ok()),
            "no checksummed transfer after cut {i}"
        );
    };
    let (c, e) = (cloud.pid(), edge.pid());
    let tasks = || {
        (
            common::metric(s.cloud_admin, "tunnel_tasks_alive"),
            common::metric(edge_admin, "tunnel_tasks_alive"),
        )
    };
    // RSS at rest: the allocator hands freed pages back after a short delay.
    let rss = || {
        std::thread::sleep(Duration::from_millis(300));
        (probe::rss_kib(c), probe::rss_kib(e))
    };
    // Warm-up. Measured on this box: RSS climbs over the first few sessions that carry
    // data, then moves within a band without a trend (the edge between 43 and 58 MiB
    // over 1,000 flaps, in steps of 2 and 4 MiB: mimalloc commits the pages of large
    // buffers, the 256 KiB relay chunks and up-to-1 MiB HTTP/2 frames, in such steps).
    // The baseline is the top of the band as the warm-up saw it, and slack on top of 10%
    // keeps allocator noise from failing the test; a leak climbs out of it. With gRPC
    // (tonic copies chunks through its own buffers, hyper spawns per-call tasks) the
    // cloud's band is wider: a 1,000-reconnect soak (TUNNEL_SOAK=1) read 62.8, 63.7, 65.1,
    // 60.2, 64.3, 58.0, 62.2, 51.8, 64.1, 67.0 MiB every 100, no trend, while single
    // 100-reconnect runs read up to 78 MiB over a 58 MiB warm-up high: six steps of
    // slack, not two.
    let mut warm = Vec::new();
    for i in 0..10 {
        flap(i);
        warm.push(rss());
    }
    let rss0 = (
        warm.iter().map(|r| r.0).max().unwrap_or(0),
        warm.iter().map(|r| r.1).max().unwrap_or(0),
    );
    let (fds0, tasks0) = ((probe::fds(c), probe::fds(e)), tasks());
    let started = Instant::now();
    for i in 0..cycles {
        flap(i);
        if (i + 1) % 100 == 0 {
            // Growth that flattens out is the allocator; growth that keeps climbing is a leak.
            println!(
                "  after {} reconnects: RSS (cloud, edge) {:?} KiB",
                i + 1,
                rss()
            );
        }
    }
    let secs = started.elapsed().as_secs_f64();
    assert!(probe::eventually(
        Duration::from_secs(10),
        || common::metric(s.cloud_admin, "tunnel_edges_connected") == 1.0
    ));
    let fds_settled = probe::eventually(Duration::from_secs(10), || {
        probe::fds(c) <= fds0.0 + 2 && probe::fds(e) <= fds0.1 + 2
    });
    let tasks_settled = probe::eventually(Duration::from_secs(10), || {
        let now = tasks();
        now.0 <= tasks0.0 && now.1 <= tasks0.1
    });
    const STEPS: u64 = 24 * 1024;
    let within = |now: (u64, u64)| {
        now.0 <= rss0.0 + rss0.0 / 10 + STEPS && now.1 <= rss0.1 + rss0.1 / 10 + STEPS
    };
    let rss_settled = probe::eventually(Duration::from_secs(10), || within(rss()));
    let (fds1, rss1, tasks1) = ((probe::fds(c), probe::fds(e)), rss(), tasks());
    println!(
        "flapping edge: {cycles} reconnects in {secs:.1}s; fds cloud {} -> {}, edge {} -> {}; tasks cloud {} -> {}, edge {} -> {}; RSS at rest (warm-up high -> now) cloud {} -> {} KiB, edge {} -> {} KiB",
        fds0.0,
        fds1.0,
        fds0.1,
        fds1.1,
        tasks0.0,
        tasks1.0,
        tasks0.1,
        tasks1.1,
        rss0.0,
        rss1.0,
        rss0.1,
        rss1.1
    );
    assert!(
        fds_settled,
        "fds (cloud, edge) did not return to baseline after {cycles} reconnects: {fds0:?} -> {fds1:?}"
    );
    assert!(
        tasks_settled,
        "tasks (cloud, edge) did not return to baseline after {cycles} reconnects: {tasks0:?} -> {tasks1:?}"
    );
    assert!(
        rss_settled,
        "RSS (cloud, edge) {rss0:?} -> {rss1:?} KiB after {cycles} reconnects: more than 10% + 24 MiB up"
    );
}

/// A GET for node `edge-1` at the HTTPS entry `front` from this runtime, as
/// kube-apiserver sends it (its client certificate, `apiserver.crt` in `dir`); the status
/// code of the answer, and how long it took on the runtime's clock.
async fn https_status(dir: &Path, front: SocketAddr) -> (String, Duration) {
    use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _};
    let (cert, key) = (dir.join("apiserver.crt"), dir.join("apiserver.key"));
    let mut config =
        (*tunnel_user::io::tls::client_config(&dir.join("ca.crt"), Some((&cert, &key))).unwrap())
            .clone();
    // HTTP/1.1, as curl speaks to it.
    config.alpn_protocols = Vec::new();
    let started = tokio::time::Instant::now();
    let tcp = tokio::net::TcpStream::connect(front).await.unwrap();
    let name = tunnel_user::io::tls::server_name("edge-1").unwrap();
    let mut tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
        .connect(name, tcp)
        .await
        .expect("TLS with the HTTPS entry");
    tls.write_all(b"GET / HTTP/1.1\r\nHost: edge-1\r\n\r\n")
        .await
        .unwrap();
    let mut status = String::new();
    tokio::io::BufReader::new(tls)
        .read_line(&mut status)
        .await
        .expect("a status line");
    let code = status.split_whitespace().nth(1).unwrap_or_default();
    (code.to_owned(), started.elapsed())
}

/// A target whose accept queue is full (SYNs dropped): the edge's dial timeout fires, the
/// client gets 504, both sides log it, and the tunnel carries on. In process, paused:
/// the timeout takes no wall time.
#[tokio::test(start_paused = true)]
async fn a_target_that_never_accepts_times_out_the_dial_with_504() {
    let mut t = InProcess::start(TOKENS, Table::new()).await;
    let sink = servers::sink("127.0.0.1:0");
    let hole = servers::NeverAccepting::start();
    let edge = t
        .start_ready_edge(EdgeOpts {
            extra: toml::toml! {
                [transport]
                dial_timeout = "1s"

                [allow]
                targets = [(sink.to_string()), (hole.addr.to_string())]
            },
            ..EdgeOpts::new("edge-1", "token-one")
        })
        .await;

    let started = tokio::time::Instant::now();
    let (refusal, _) = inproc::connect(t.s.connect, &format!("edge-1:{}", hole.addr.port())).await;
    let took = started.elapsed();
    println!("never-accepting target: {refusal:?} after {took:?} (edge dial_timeout 1 s)");
    assert!(
        refusal.contains("504"),
        "expected 504 Gateway Timeout, got {refusal:?}"
    );
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(5),
        "504 after {took:?}"
    );
    t.wait_log(
        Side::Edge,
        &format!("connect to {} timed out", hole.addr),
        Duration::from_secs(2),
    )
    .await;
    let line = t
        .wait_log(Side::Cloud, "connection refused", Duration::from_secs(2))
        .await;
    assert!(
        line.contains("edge-1"),
        "the cloud's log line does not name the node: {line}"
    );
    let (edge_admin, cloud_admin, connect) = (edge.admin().await, t.s.cloud_admin, t.s.connect);
    inproc::blocking(move || {
        assert_eq!(
            common::metric(edge_admin, "tunnel_edge_dials_total{reason=\"timeout\"}"),
            1.0
        );
        assert_eq!(
            common::metric(
                cloud_admin,
                "tunnel_dial_failures_total{reason=\"timeout\"}"
            ),
            1.0
        );
        round_trip(connect, &format!("edge-1:{}", sink.port()), 7, 1 << 20)
            .expect("the tunnel after a timed-out dial");
    })
    .await;
}

/// SuperEdge's HTTPS module in front of a target that accepts TCP but never answers the
/// TLS handshake the edge originates: the dial's bound covers the handshake, the client
/// gets 504, and a second request meets the same bound (nothing piles up). In process,
/// paused: the bound takes no wall time, and is measured on the runtime's clock.
#[tokio::test(start_paused = true)]
async fn a_target_that_accepts_but_never_answers_tls_times_out_the_handshake_with_504() {
    use rcgen::ExtendedKeyUsagePurpose::{ClientAuth, ServerAuth};
    let s = Setup::new(TOKENS);
    s.pki.issue("front", &["edge-1"], "edge-1", ServerAuth);
    s.pki.issue(
        "kubelet-client",
        &["apiserver-kubelet-client"],
        "apiserver-kubelet-client",
        ClientAuth,
    );
    // What kube-apiserver presents to the HTTPS entry.
    s.pki.issue(
        "apiserver",
        &["kube-apiserver"],
        "kube-apiserver",
        ClientAuth,
    );
    let mute = servers::silent("127.0.0.1:0");
    let config = s.cloud_config(https_front(&mute.to_string()));
    let mut t = InProcess::start_with(s, config).await;
    let front = t.ready.addr("https[0].listen");
    let edge = t
        .start_ready_edge(EdgeOpts {
            extra: toml::toml! {
                [transport]
                dial_timeout = "1s"

                [allow]
                targets = [(mute.to_string())]

                [https]
                cert = "kubelet-client.crt"
                key = "kubelet-client.key"
            },
            ..EdgeOpts::new("edge-1", "token-one")
        })
        .await;
    let mut took = Vec::new();
    for _ in 0..2 {
        let (code, after) = https_status(t.path(), front).await;
        assert_eq!(code, "504", "answered {code} after {after:?}");
        assert!(
            after < Duration::from_secs(5),
            "answered 504 after {after:?}"
        );
        took.push(after);
    }
    let (first, second) = (took[0], took[1]);
    println!(
        "target silent after TCP accept: HTTPS entry answered 504 after {first:?}, then {second:?} (edge dial_timeout 1 s)"
    );
    assert!(
        first >= Duration::from_millis(900),
        "504 before the handshake bound: {first:?}"
    );
    t.wait_log(
        Side::Edge,
        &format!("TLS handshake with {mute} timed out"),
        Duration::from_secs(2),
    )
    .await;
    let edge_admin = edge.admin().await;
    let timeouts = inproc::blocking(move || {
        common::metric(edge_admin, "tunnel_edge_dials_total{reason=\"timeout\"}")
    })
    .await;
    assert_eq!(timeouts, 2.0);
}

/// The edge's first cloud address accepts TCP and never speaks TLS: the handshake
/// timeout fires, the edge logs it and registers through the next address. In process,
/// paused: the timeout takes no wall time.
#[tokio::test(start_paused = true)]
async fn an_edge_facing_a_cloud_that_never_answers_moves_on_after_the_handshake_timeout() {
    let mut t = InProcess::start(TOKENS, Table::new()).await;
    let sink = servers::sink("127.0.0.1:0");
    let real = t.s.tunnel;
    let mute = servers::silent("127.0.0.1:0");
    t.s.tunnel = mute; // the edge's `cloud.address`
    let started = tokio::time::Instant::now();
    let _edge = t
        .start_ready_edge(EdgeOpts {
            extra: toml::toml! {
                [cloud]
                addresses = [(real.to_string())]

                [transport]
                handshake_timeout = "1s"

                [allow]
                targets = [(sink.to_string())]
            },
            ..EdgeOpts::new("edge-1", "token-one")
        })
        .await;
    let took = started.elapsed();
    println!(
        "silent cloud address: registered through the next one {took:?} after start (handshake_timeout 1 s)"
    );
    let line = t
        .wait_log(Side::Edge, "cannot reach the cloud", Duration::ZERO)
        .await;
    assert!(
        line.contains(&mute.to_string()) && line.contains("handshake timed out"),
        "no log line naming the silent address: {}",
        t.logs.text()
    );
    assert!(
        took >= Duration::from_secs(1),
        "registered before the first address's handshake could time out: {took:?}"
    );
    let connect = t.s.connect;
    inproc::blocking(move || {
        round_trip(connect, &format!("edge-1:{}", sink.port()), 8, 1 << 20)
            .expect("through the second address")
    })
    .await;
}
