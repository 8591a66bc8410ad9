//! Hostile and broken input: each gets a clear refusal and one log line naming the peer,
//! and a connection already open through the same cloud (a checksummed canary) keeps
//! working throughout. In process ([`common::inproc`]), but for the flood of bad tokens,
//! which measures the cloud process's memory.

#![expect(
    clippy::unwrap_used,
    reason = "a panic with its message is how a test reports failure"
)]
mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use common::config::{allow, https_front, merge};
use common::inproc::{self, InProcess, Side};
use common::probe::{self, Canary, count_lines, hello_frame, round_trip, tls_send};
use common::servers;
use common::{EdgeOpts, Proc, Setup, connect_via};
use toml::Table;

const TOKENS: &str = "edge-1:token-one\nedge-2:token-two\n";

/// A cloud (`cloud_extra` merged into its config) with one edge in front of a sink, and
/// a canary open through them.
fn setup(cloud_extra: Table) -> (Setup, Proc, Proc, SocketAddr, Canary) {
    let mut s = Setup::new(TOKENS);
    let sink = servers::sink("127.0.0.1:0");
    let cloud = s.start_cloud(cloud_extra);
    let edge = s.start_ready_edge(EdgeOpts {
        extra: allow(&[sink]),
        ..EdgeOpts::new("edge-1", "token-one")
    });
    let mut canary = Canary::open(s.connect, &format!("edge-1:{}", sink.port()));
    canary.feed(64 * 1024);
    (s, cloud, edge, sink, canary)
}

/// [`setup`] in process: the cloud and the edge in the test's runtime.
async fn start(cloud_extra: Table) -> (InProcess, inproc::Edge, SocketAddr, Canary) {
    let mut t = InProcess::start(TOKENS, cloud_extra).await;
    let sink = servers::sink("127.0.0.1:0");
    let edge = t
        .start_ready_edge(EdgeOpts {
            extra: allow(&[sink]),
            ..EdgeOpts::new("edge-1", "token-one")
        })
        .await;
    let connect = t.s.connect;
    let canary = inproc::blocking(move || {
        let mut canary = Canary::open(connect, &format!("edge-1:{}", sink.port()));
        canary.feed(64 * 1024);
        canary
    })
    .await;
    (t, edge, sink, canary)
}

/// Feeds `len` bytes to `canary` from the blocking pool.
async fn feed(mut canary: Canary, len: usize) -> Canary {
    inproc::blocking(move || {
        canary.feed(len);
        canary
    })
    .await
}

/// Waits until the cloud has logged a line with every one of `needles`, then expects
/// exactly one.
async fn one_line(t: &InProcess, needles: &[&str]) {
    t.logs
        .wait(Side::Cloud, needles, Duration::from_secs(3))
        .await;
    let log = t.logs.lines(Side::Cloud).join("\n");
    assert_eq!(count_lines(&log, needles), 1, "{needles:?}:\n{log}");
}

/// Whether the far end closes `s` (EOF or reset) within `bound`.
fn closed_within(s: &mut TcpStream, bound: Duration) -> Option<Duration> {
    let started = Instant::now();
    s.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut buf = [0u8; 4096];
    while started.elapsed() < bound {
        match s.read(&mut buf) {
            Ok(0) => return Some(started.elapsed()),
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return Some(started.elapsed()),
        }
    }
    None
}

#[tokio::test]
async fn garbage_handshake_and_oversized_hello_get_one_line_each_and_disturb_nothing() {
    let (t, _edge, sink, canary) = start(Table::new()).await;
    let authority = format!("edge-1:{}", sink.port());
    let (tunnel, ca) = (t.s.tunnel, t.path().join("ca.crt"));

    // Plain-text garbage where a TLS ClientHello belongs.
    let raw_peer = inproc::blocking(move || {
        let mut raw = TcpStream::connect(tunnel).unwrap();
        let raw_peer = raw.local_addr().unwrap().to_string();
        raw.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n\x00\xff\x16\x03garbage")
            .unwrap();
        assert!(
            closed_within(&mut raw, Duration::from_secs(5)).is_some(),
            "garbage handshake not closed"
        );
        raw_peer
    })
    .await;
    one_line(&t, &[&format!("peer={raw_peer}"), "TLS handshake failed"]).await;
    let canary = feed(canary, 4096).await;

    // A TLS client whose Hello claims 16 MiB: refused at the length prefix.
    let mut frame = vec![0];
    frame.extend_from_slice(&((16u32 << 20) + 1).to_be_bytes());
    frame.extend_from_slice(&[0x41; 1024]);
    let c = ca.clone();
    let r = inproc::blocking(move || tls_send(tunnel, &c, "127.0.0.3", &frame)).await;
    assert!(r.is_err(), "an oversized Hello got a reply: {r:?}");
    one_line(
        &t,
        &["peer=127.0.0.3", "the Control call failed", "too large"],
    )
    .await;

    // A Hello of the right size that is not protobuf.
    let mut frame = vec![0];
    frame.extend_from_slice(&16u32.to_be_bytes());
    frame.extend_from_slice(&[0xff; 16]);
    let c = ca.clone();
    let r = inproc::blocking(move || tls_send(tunnel, &c, "127.0.0.4", &frame)).await;
    assert!(r.is_err(), "a garbage Hello got a reply: {r:?}");
    one_line(&t, &["peer=127.0.0.4", "the Control call failed"]).await;

    // An edge registering as another node (edge-1's token, edge-2's name).
    let reply = inproc::blocking(move || {
        tls_send(
            tunnel,
            &ca,
            "127.0.0.5",
            &hello_frame("edge-2", "token-one"),
        )
    })
    .await
    .expect("a reply");
    match reply.result {
        Some(proto::hello_reply::Result::Reject(r)) => {
            assert_eq!(r.reason(), proto::RejectReason::BadCredentials)
        }
        other => panic!("impersonation not rejected: {other:?}"),
    }
    one_line(
        &t,
        &["peer=127.0.0.5", "edge registration failed", "edge-2"],
    )
    .await;

    let canary = feed(canary, 4096).await;
    let connect = t.s.connect;
    inproc::blocking(move || {
        round_trip(connect, &authority, 3, 1 << 20).expect("a new connection after the bad input");
        canary.finish();
    })
    .await;
    assert!(!t.logs.text().contains("panicked"), "{}", t.logs.text());
}

#[tokio::test]
async fn streams_beyond_the_per_edge_limit_fail_at_once_and_the_others_keep_working() {
    const LIMIT: usize = 4;
    // The canary takes one of the LIMIT streams. Every client here is one (127.0.0.1),
    // so its share is the whole edge: the edge's limit is what this test reaches.
    let (t, _edge, sink, canary) = start(toml::toml! {
        [transport]
        max_streams_per_edge = LIMIT
        client_share = 1.0
    })
    .await;
    let (connect, authority) = (t.s.connect, format!("edge-1:{}", sink.port()));
    inproc::blocking(move || streams_beyond_the_limit(connect, &authority, LIMIT, canary)).await;
}

/// The body of [`streams_beyond_the_per_edge_limit_fail_at_once_and_the_others_keep_working`],
/// a client of the CONNECT proxy at `connect`.
fn streams_beyond_the_limit(
    connect: SocketAddr,
    authority: &str,
    limit: usize,
    mut canary: Canary,
) {
    let mut held: Vec<TcpStream> = (1..limit)
        .map(|_| connect_via(connect, authority).expect("within the limit"))
        .collect();
    for _ in 0..4 {
        let started = Instant::now();
        let refused = connect_via(connect, authority)
            .map(|_| ())
            .expect_err("beyond the limit must fail");
        assert!(
            refused.contains("503") || refused.contains("502"),
            "{refused}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "refusal took {:?}",
            started.elapsed()
        );
    }
    // The held streams still carry bytes intact, and once one ends a new one opens.
    let last = held.pop().unwrap();
    drop(last);
    assert!(
        probe::eventually(Duration::from_secs(5), || round_trip(
            connect,
            authority,
            9,
            256 * 1024
        )
        .is_ok()),
        "no new stream after one ended"
    );
    for (i, h) in held.iter_mut().enumerate() {
        let hash = servers::send_pattern(Some(h), i as u64 + 100, 128 * 1024).unwrap();
        h.shutdown(std::net::Shutdown::Write).unwrap();
        let mut answer = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(&*h), &mut answer).unwrap();
        assert_eq!(answer.trim(), format!("{} {hash}", 128 * 1024));
    }
    canary.feed(1024);
    canary.finish();
}

#[test]
fn a_flood_of_bad_tokens_is_rate_limited_logged_sparingly_and_costs_no_memory() {
    let (s, cloud, _edge, sink, mut canary) = setup(Table::new());
    let authority = format!("edge-1:{}", sink.port());
    let ca = s.path().join("ca.crt");
    let frame = hello_frame("edge-2", "not-the-token");
    let flood = |n: usize| -> (usize, usize, usize) {
        let (mut bad, mut limited, mut other) = (0, 0, 0);
        let results: Vec<_> = std::thread::scope(|sc| {
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    sc.spawn(|| {
                        (0..n / 4)
                            .map(|_| tls_send(s.tunnel, &ca, "127.0.0.9", &frame))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().unwrap())
                .collect()
        });
        for r in results {
            match r.ok().and_then(|r| r.result) {
                Some(proto::hello_reply::Result::Reject(r))
                    if r.reason() == proto::RejectReason::BadCredentials =>
                {
                    bad += 1
                }
                Some(proto::hello_reply::Result::Reject(r))
                    if r.reason() == proto::RejectReason::RateLimited =>
                {
                    limited += 1
                }
                _ => other += 1,
            }
        }
        (bad, limited, other)
    };
    // Warm-up: allocator and TLS session state settle.
    let flood_started = Instant::now();
    let _ = flood(200);
    let rss_before = probe::rss_kib(cloud.pid());
    let started = Instant::now();
    let (bad, limited, other) = flood(2000);
    let secs = started.elapsed().as_secs_f64();
    let rss_after = probe::rss_kib(cloud.pid());
    let lines = count_lines(&cloud.log_text(), &["edge registration failed"]);
    println!(
        "bad-token flood: 2000 attempts in {secs:.1}s ({:.0}/s): {bad} bad credentials, {limited} rate limited, {other} other; \
         cloud RSS {rss_before} -> {rss_after} KiB; {lines} log lines",
        2000.0 / secs
    );
    assert_eq!(other, 0, "every attempt gets a Reject");
    assert!(
        limited >= 1900,
        "the flood was not rate limited: {bad} bad credentials, {limited} limited"
    );
    assert!(
        rss_after <= rss_before + rss_before / 10 + 4096,
        "RSS grew {rss_before} -> {rss_after} KiB"
    );
    assert!(
        lines < 200,
        "{lines} log lines for 2200 failures: the log is not rate limited"
    );
    // One notice per 10 s window of the log budget the flood reached into.
    let windows = flood_started.elapsed().as_secs() / 10 + 1;
    let notices = count_lines(
        &cloud.log_text(),
        &["further registration failures are counted, not logged"],
    );
    assert!(
        (1..=windows as usize).contains(&notices),
        "{notices} notices of the lines left out over {windows} log window(s)"
    );
    // Other addresses are not locked out: a valid edge registers from 127.0.0.1.
    let reply = tls_send(
        s.tunnel,
        &ca,
        "127.0.0.1",
        &hello_frame("edge-2", "token-two"),
    )
    .expect("valid hello");
    assert!(
        matches!(reply.result, Some(proto::hello_reply::Result::Welcome(_))),
        "{reply:?}"
    );
    canary.feed(4096);
    round_trip(s.connect, &authority, 5, 1 << 20).expect("a new connection after the flood");
    canary.finish();
}

#[tokio::test]
async fn connect_to_unknown_hosts_and_disallowed_ports_is_refused_clearly() {
    let (t, _edge, sink, canary) = start(Table::new()).await;
    let cases = [
        ("nobody:10250", "404"),
        ("10.9.9.9:10250", "404"),
        ("edge-1:1", "403"),
        ("edge-1:22", "403"),
        ("edge-1:notaport", "400"),
    ];
    for (authority, status) in cases {
        let (err, _) = inproc::connect(t.s.connect, authority).await;
        assert!(
            err.contains(status),
            "CONNECT {authority}: got `{err}`, want {status}"
        );
    }
    // One line each, naming the client.
    let log = t.logs.lines(Side::Cloud).join("\n");
    assert!(
        count_lines(&log, &["client=127.0.0.1"]) >= cases.len(),
        "{log}"
    );
    let canary = feed(canary, 4096).await;
    let connect = t.s.connect;
    inproc::blocking(move || {
        round_trip(connect, &format!("edge-1:{}", sink.port()), 6, 1 << 20).unwrap();
        canary.finish();
    })
    .await;
}

/// Sends `request` from `source` to the CONNECT listener, half-closes if asked, and
/// returns the status line of the answer.
fn raw_connect(source: &str, to: SocketAddr, request: &[u8], half_close: bool) -> String {
    let mut s = probe::tcp_from(source, to).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(request).unwrap();
    if half_close {
        s.shutdown(std::net::Shutdown::Write).unwrap();
    }
    let mut answer = String::new();
    let _ = s.read_to_string(&mut answer);
    answer.lines().next().unwrap_or_default().to_string()
}

#[tokio::test]
async fn malformed_and_oversized_connect_requests_get_a_4xx_and_one_line_each() {
    let (t, _edge, sink, canary) = start(Table::new()).await;
    let connect = t.s.connect;
    // Exactly the 8 KiB bound and no end of head: the cloud reads it all before it
    // answers, so its close is a clean FIN and the 431 reaches us.
    let mut oversized = b"CONNECT edge-1:80 HTTP/1.1\r\nX-Pad: ".to_vec();
    oversized.resize(8 * 1024, b'a');
    let many_headers: String = std::iter::once("CONNECT edge-1:80 HTTP/1.1\r\n".to_string())
        .chain((0..40).map(|i| format!("X-H{i}: v\r\n")))
        .chain(std::iter::once("\r\n".to_string()))
        .collect();
    let cases: [(&str, &[u8], bool, &str); 5] = [
        ("127.0.3.1", &oversized, false, "431"),
        // A TLS ClientHello sent to the plain CONNECT port.
        (
            "127.0.3.2",
            b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
            false,
            "400",
        ),
        (
            "127.0.3.3",
            b"GET / HTTP/1.1\r\nHost: edge-1\r\n\r\n",
            false,
            "405",
        ),
        ("127.0.3.4", many_headers.as_bytes(), false, "400"),
        ("127.0.3.5", b"CONNECT edge-1:80 HTTP/1.1\r\n", true, "400"),
    ];
    let sources = cases.map(|(source, ..)| source);
    let cases = cases.map(|(source, request, half_close, status)| {
        (source, request.to_vec(), half_close, status)
    });
    inproc::blocking(move || {
        for (source, request, half_close, status) in cases {
            let line = raw_connect(source, connect, &request, half_close);
            println!("bad CONNECT from {source}: {line}");
            assert!(
                line.starts_with("HTTP/1.1 ") && line.contains(status),
                "from {source}: got `{line}`, want {status}"
            );
        }
    })
    .await;
    // The line for each may come a moment after its answer.
    t.logs
        .wait_count(
            Side::Cloud,
            &["bad CONNECT request"],
            sources.len(),
            Duration::from_secs(3),
        )
        .await;
    let log = t.logs.lines(Side::Cloud).join("\n");
    for source in sources {
        assert_eq!(
            count_lines(&log, &["bad CONNECT request", &format!("client={source}:")]),
            1,
            "one line for {source}:\n{log}"
        );
    }
    let canary = feed(canary, 4096).await;
    inproc::blocking(move || {
        round_trip(connect, &format!("edge-1:{}", sink.port()), 9, 1 << 20).unwrap();
        canary.finish();
    })
    .await;
}

/// Registers as `node` like a real edge (TLS, the gRPC server side, the Hello on the
/// Control call), then sends `payload` on the Control call, and returns how long the
/// cloud then took to close the connection (None: it did not within 10 s).
async fn edge_sending_control(
    s: &Setup,
    node: &str,
    token: &str,
    payload: Vec<u8>,
) -> Option<Duration> {
    let ca = s.path().join("ca.crt");
    let (reply, mut edge) = probe::fake_edge(s.tunnel, &ca, "127.0.0.1", hello_frame(node, token))
        .await
        .unwrap();
    assert!(
        matches!(reply.result, Some(proto::hello_reply::Result::Welcome(_))),
        "{reply:?}"
    );
    edge.control.send_data(payload.into(), false).unwrap();
    edge.drive(Duration::from_secs(10)).await
}

#[tokio::test]
async fn oversized_or_malformed_control_messages_from_a_registered_edge_end_only_its_session() {
    let (t, _edge, sink, mut canary) = start(Table::new()).await;
    // A gRPC length prefix one byte over the bound; the body never needs to follow.
    let mut oversized = vec![0];
    oversized.extend_from_slice(&((proto::MAX_CHUNK_MESSAGE + 1) as u32).to_be_bytes());
    // A well-framed message that is not a Control message (an invalid wire type).
    let mut malformed = vec![0];
    malformed.extend_from_slice(&3u32.to_be_bytes());
    malformed.extend_from_slice(&[0x0f, 0xff, 0xff]);
    for (what, payload) in [("oversized", oversized), ("malformed", malformed)] {
        let took = edge_sending_control(&t.s, "edge-2", "token-two", payload).await;
        println!("{what} control message from a registered edge: session closed after {took:?}");
        let took = took.unwrap_or_else(|| {
            panic!("the cloud kept a session that sent a {what} control message")
        });
        assert!(
            took < Duration::from_secs(5),
            "{what}: closed after {took:?}"
        );
        canary = feed(canary, 4096).await;
    }
    let log = t.logs.lines(Side::Cloud).join("\n");
    let lines = count_lines(&log, &["edge heartbeat failed", "edge-2"]);
    assert_eq!(
        lines, 2,
        "one line per bad session, naming the node:\n{log}"
    );
    assert!(log.contains("too large"), "{log}");
    let connect = t.s.connect;
    inproc::blocking(move || {
        round_trip(connect, &format!("edge-1:{}", sink.port()), 10, 1 << 20).unwrap();
        canary.finish();
    })
    .await;
}

/// Sends `first` and then nothing; returns how long the server took to cut it off, on
/// the runtime's clock.
async fn slowloris(addr: SocketAddr, first: &[u8], bound: Duration) -> Option<Duration> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(first).await.unwrap();
    let started = tokio::time::Instant::now();
    let mut buf = [0u8; 4096];
    let end = async { while s.read(&mut buf).await.is_ok_and(|n| n > 0) {} };
    tokio::time::timeout(bound, end)
        .await
        .ok()
        .map(|()| started.elapsed())
}

/// In paused time: the listeners' timeouts (10 s for admin) take no wall time.
#[tokio::test(start_paused = true)]
async fn slowloris_is_cut_off_on_every_listener_while_normal_clients_work() {
    use rcgen::ExtendedKeyUsagePurpose::ServerAuth;
    let s0 = Setup::new(TOKENS);
    s0.pki.issue("front", &["edge-1"], "edge-1", ServerAuth);
    let sink = servers::sink("127.0.0.1:0");
    let mut config = https_front(&sink.to_string());
    merge(
        &mut config,
        toml::toml! { [transport] handshake_timeout = "2s" },
    );
    let config = s0.cloud_config(config);
    let mut t = InProcess::start_with(s0, config).await;
    let front = t.ready.addr("https[0].listen");
    let _edge = t
        .start_ready_edge(EdgeOpts {
            extra: allow(&[sink]),
            ..EdgeOpts::new("edge-1", "token-one")
        })
        .await;
    let (connect, authority) = (t.s.connect, format!("edge-1:{}", sink.port()));
    let a = authority.clone();
    let canary = inproc::blocking(move || {
        let mut canary = Canary::open(connect, &a);
        canary.feed(1024);
        canary
    })
    .await;

    let bound = Duration::from_secs(2);
    let slack = Duration::from_secs(6);
    let listeners: [(&str, SocketAddr, &[u8]); 4] = [
        ("edge tunnel", t.s.tunnel, b"\x16\x03\x01"),
        ("CONNECT", t.s.connect, b"CONNECT edge-1:1"),
        ("https entry", front, b"\x16\x03\x01\x00"),
        ("admin", t.s.cloud_admin, b"GET /metrics HTTP/1.1\r\nHo"),
    ];
    let slow: Vec<_> = listeners
        .iter()
        .map(|&(name, addr, first)| {
            tokio::spawn(async move {
                let held = slowloris(addr, first, bound + slack + Duration::from_secs(10));
                (name, held.await)
            })
        })
        .collect();
    // Meanwhile normal clients get through.
    inproc::blocking(move || {
        for i in 0..5 {
            round_trip(connect, &authority, 40 + i, 64 * 1024)
                .expect("normal client during slowloris");
        }
    })
    .await;
    let mut results = Vec::new();
    for task in slow {
        results.push(task.await.unwrap());
    }
    for (name, took) in &results {
        println!("slowloris on {name}: cut off after {took:?}");
    }
    for (name, took) in results {
        let took = took.unwrap_or_else(|| panic!("slowloris on {name} never cut off"));
        // admin's bound is its own header timeout (10 s).
        let limit = if name == "admin" {
            Duration::from_secs(10) + slack
        } else {
            bound + slack
        };
        assert!(took <= limit, "slowloris on {name} held for {took:?}");
    }
    let log = t.logs.lines(Side::Cloud).join("\n");
    assert!(count_lines(&log, &["handshake timed out"]) == 1, "{log}");
    assert!(
        count_lines(&log, &["CONNECT request head not received in time"]) == 1,
        "{log}"
    );
    assert!(
        count_lines(&log, &["HTTPS entry: no request in time"]) == 1,
        "{log}"
    );
    let canary = feed(canary, 1024).await;
    inproc::blocking(move || canary.finish()).await;
}

/// An edge of protocol 1 (before gRPC: ALPN `tunnel/1`, a length-prefixed Hello) learns
/// in its own framing that it must be upgraded, and the cloud logs it once.
#[tokio::test]
async fn an_edge_of_the_protocol_before_grpc_is_told_to_upgrade() {
    let (t, _edge, sink, canary) = start(Table::new()).await;
    let (tunnel, ca) = (t.s.tunnel, t.path().join("ca.crt"));
    inproc::blocking(move || protocol_1_hello(tunnel, &ca)).await;
    one_line(&t, &["peer=127.0.0.6", "speaks protocol 1"]).await;
    let canary = feed(canary, 4096).await;
    let connect = t.s.connect;
    inproc::blocking(move || {
        round_trip(connect, &format!("edge-1:{}", sink.port()), 11, 1 << 20).unwrap();
        canary.finish();
    })
    .await;
}

/// Registers with the cloud's edge listener at `tunnel` as an edge of protocol 1 would,
/// and expects to be told, in protocol 1's framing, to upgrade.
fn protocol_1_hello(tunnel: SocketAddr, ca: &std::path::Path) {
    use std::io::Read;
    let mut config = (*tunnel_user::io::tls::client_config(ca, None).unwrap()).clone();
    config.alpn_protocols = vec![b"tunnel/1".to_vec()];
    let name = rustls_pki_types::ServerName::try_from("tunnel-cloud").unwrap();
    let conn = rustls::ClientConnection::new(std::sync::Arc::new(config), name).unwrap();
    let tcp = probe::tcp_from("127.0.0.6", tunnel).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    let hello = proto::Hello {
        protocol_version: 1,
        node_name: "edge-2".into(),
        token: "token-two".into(),
        ..Default::default()
    };
    let body = prost::Message::encode_to_vec(&hello);
    let mut frame = (body.len() as u32).to_be_bytes().to_vec();
    frame.extend(body);
    tls.write_all(&frame).unwrap();
    let mut len = [0u8; 4];
    tls.read_exact(&mut len)
        .expect("a reply in protocol 1's framing");
    let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
    tls.read_exact(&mut body).unwrap();
    let reply: proto::HelloReply = prost::Message::decode(body.as_slice()).unwrap();
    match reply.result {
        Some(proto::hello_reply::Result::Reject(r)) => {
            println!("protocol 1 edge told: {:?}: {}", r.reason(), r.message);
            assert_eq!(r.reason(), proto::RejectReason::BadVersion);
            assert!(r.message.contains("upgrade the edge"), "{}", r.message);
        }
        other => panic!("a protocol 1 edge got {other:?}"),
    }
}
