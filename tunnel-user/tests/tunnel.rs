//! The core tunnel end to end: real `tunnel cloud` and `tunnel edge` processes on
//! loopback with real TLS, driven by real clients.

#![expect(
    clippy::unwrap_used,
    reason = "a panic with its message is how a test reports failure"
)]
mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use common::servers::{self, hash_reader, send_pattern};
use common::{EdgeOpts, Setup, allow, connect_via};
use toml::Table;

const TOKENS: &str = "edge-1:token-one\nedge-2:token-two\n";

fn edge_opts<'a>(node: &'a str, token: &'a str, targets: &[SocketAddr]) -> EdgeOpts<'a> {
    EdgeOpts {
        extra: allow(targets),
        ..EdgeOpts::new(node, token)
    }
}

#[test]
fn curl_through_http_connect_reaches_python_http_server() {
    let mut s = Setup::new(TOKENS);
    let www = s.path().join("www");
    std::fs::create_dir(&www).unwrap();
    std::fs::write(www.join("hello.txt"), "hello through the tunnel\n").unwrap();
    // 127.1.0.5 plays the edge node's own address.
    let (_http, http) = common::python_http_server("127.1.0.5", &www);
    let port = http.port();
    let _cloud = s.start_cloud(toml::toml! {
        [[node]]
        name = "edge-1"
        addresses = ["127.1.0.5"]
    });
    let extra = toml::toml! {
        [allow]
        targets = []
        node_addresses = ["127.1.0.5"]
        ports = [port]
    };
    let _edge = s.start_ready_edge(EdgeOpts {
        extra,
        ..EdgeOpts::new("edge-1", "token-one")
    });
    assert!(
        common::wait_http_ok(
            &format!("http://127.1.0.5:{port}/hello.txt"),
            Duration::from_secs(10)
        ),
        "http.server did not start"
    );

    for host in ["edge-1", "127.1.0.5"] {
        let out = Command::new("curl")
            .args([
                "-sS",
                "--max-time",
                "10",
                "-p",
                "-x",
                &format!("http://{}", s.connect),
            ])
            .arg(format!("http://{host}:{port}/hello.txt"))
            .output()
            .expect("curl");
        assert!(
            out.status.success(),
            "curl via {host} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "hello through the tunnel\n",
            "via {host}"
        );
    }
}

#[test]
fn bulk_256_mib_each_way_arrives_intact() {
    const LEN: u64 = 256 << 20;
    let mut s = Setup::new(TOKENS);
    let sink = servers::sink("127.0.0.1:0");
    let source = servers::source("127.0.0.1:0");
    let _cloud = s.start_cloud(Table::new());
    let _edge = s.start_ready_edge(edge_opts("edge-1", "token-one", &[sink, source]));

    // Upstream: the client's bytes reach the target, hashed there after our FIN.
    let mut up =
        connect_via(s.connect, &format!("edge-1:{}", sink.port())).expect("CONNECT to sink");
    let started = Instant::now();
    let sent_hash = send_pattern(Some(&mut up), 11, LEN).expect("send 256 MiB");
    up.shutdown(Shutdown::Write).expect("FIN");
    let mut answer = String::new();
    BufReader::new(&up)
        .read_line(&mut answer)
        .expect("sink answer");
    assert_eq!(
        answer.trim(),
        format!("{LEN} {sent_hash}"),
        "upstream bytes differ"
    );
    let up_secs = started.elapsed().as_secs_f64();

    // Downstream: the target's bytes reach the client.
    let mut down =
        connect_via(s.connect, &format!("edge-1:{}", source.port())).expect("CONNECT to source");
    let started = Instant::now();
    writeln!(down, "22 {LEN}").expect("request");
    let (n, got) = hash_reader(&mut down).expect("read 256 MiB");
    let want = send_pattern(None, 22, LEN).expect("hash");
    assert_eq!((n, got), (LEN, want), "downstream bytes differ");
    eprintln!(
        "256 MiB up in {up_secs:.2}s ({:.0} MiB/s), down in {:.2}s",
        256.0 / up_secs,
        started.elapsed().as_secs_f64()
    );
}

#[test]
fn half_close_still_delivers_the_full_response() {
    let mut s = Setup::new(TOKENS);
    let sink = servers::sink("127.0.0.1:0");
    let _cloud = s.start_cloud(Table::new());
    let _edge = s.start_ready_edge(edge_opts("edge-1", "token-one", &[sink]));
    let mut conn = connect_via(s.connect, &format!("edge-1:{}", sink.port())).expect("CONNECT");
    conn.write_all(b"request body").unwrap();
    conn.shutdown(Shutdown::Write).unwrap();
    let mut response = String::new();
    conn.read_to_string(&mut response)
        .expect("response after our FIN");
    let expected_hash = servers::hex(&sha2_of(b"request body"));
    assert_eq!(response, format!("12 {expected_hash}\n"));
}

fn sha2_of(data: &[u8]) -> Vec<u8> {
    use sha2::Digest;
    sha2::Sha256::digest(data).to_vec()
}

#[test]
fn a_stalled_reader_does_not_slow_its_neighbour() {
    const NEIGHBOUR: u64 = 128 << 20;
    let mut s = Setup::new(TOKENS);
    let source = servers::source("127.0.0.1:0");
    let _cloud = s.start_cloud(Table::new());
    let _edge = s.start_ready_edge(edge_opts("edge-1", "token-one", &[source]));

    // The stalled connection asks for far more than any window and then reads nothing.
    let mut stalled =
        connect_via(s.connect, &format!("edge-1:{}", source.port())).expect("CONNECT stalled");
    writeln!(stalled, "5 {}", 64u64 << 20).unwrap();
    // Stalled for real once its windows are full: the bytes the cloud received hold still.
    let buffered = common::settled(Duration::from_millis(300), Duration::from_secs(10), || {
        common::metric(
            s.cloud_admin,
            r#"tunnel_bytes_total{direction="from_edge"}"#,
        )
    });
    assert!(
        buffered > 0.0,
        "the stalled stream should have filled its window"
    );

    let mut busy =
        connect_via(s.connect, &format!("edge-1:{}", source.port())).expect("CONNECT neighbour");
    let started = Instant::now();
    writeln!(busy, "6 {NEIGHBOUR}").unwrap();
    let (n, got) = hash_reader(&mut busy).expect("neighbour transfer");
    let took = started.elapsed();
    assert_eq!(
        (n, got),
        (NEIGHBOUR, send_pattern(None, 6, NEIGHBOUR).unwrap())
    );
    assert!(
        took < Duration::from_secs(5),
        "neighbour took {took:?} while the other stream was stalled"
    );
    eprintln!("neighbour moved 128 MiB in {took:?} beside a stalled stream");

    // The stalled stream lost nothing while it waited.
    std::thread::sleep(Duration::from_secs(5).saturating_sub(took));
    let (n, got) = hash_reader(&mut stalled).expect("stalled transfer resumes");
    assert_eq!(
        (n, got),
        (64 << 20, send_pattern(None, 5, 64 << 20).unwrap())
    );
}

#[test]
fn killing_the_edge_ends_client_connections_quickly() {
    let mut s = Setup::new(TOKENS);
    let source = servers::source("127.0.0.1:0");
    let sink = servers::sink("127.0.0.1:0");
    let _cloud = s.start_cloud(Table::new());
    let mut edge = s.start_ready_edge(edge_opts("edge-1", "token-one", &[source, sink]));
    // Idle connections beside the busy one: every one of them must end too.
    let mut idle: Vec<TcpStream> = (0..3)
        .map(|_| connect_via(s.connect, &format!("edge-1:{}", sink.port())).expect("CONNECT"))
        .collect();
    let mut conn = connect_via(s.connect, &format!("edge-1:{}", source.port())).expect("CONNECT");
    writeln!(conn, "9 {}", 1u64 << 40).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    conn.read_exact(&mut buf).expect("transfer under way");
    edge.kill9();
    let killed = Instant::now();
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut got = 0u64;
    let ended = loop {
        match conn.read(&mut buf) {
            Ok(0) => break "EOF",
            Ok(n) => got += n as u64,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                panic!("client still hanging 10 s after the edge died")
            }
            Err(_) => break "error",
        }
    };
    let took = killed.elapsed();
    assert_eq!(
        ended, "error",
        "an edge death must reach the client as an abort, not a clean EOF"
    );
    assert!(
        took < Duration::from_secs(2),
        "client saw the edge die only after {took:?} ({got} more bytes)"
    );
    for (i, c) in idle.iter_mut().enumerate() {
        c.set_read_timeout(Some(
            Duration::from_secs(2)
                .saturating_sub(killed.elapsed())
                .max(Duration::from_millis(100)),
        ))
        .unwrap();
        let ended =
            !matches!(c.read(&mut buf), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
        assert!(
            ended,
            "idle connection {i} still open {:?} after the edge died",
            killed.elapsed()
        );
    }
}

#[test]
fn edges_with_bad_credentials_are_rejected() {
    let mut s = Setup::new(TOKENS);
    let cloud = s.start_cloud(Table::new());
    // Wrong token.
    let (bad_token, admin) = s.start_edge(EdgeOpts::new("edge-1", "not-the-token"));
    bad_token.wait_log("registration refused", Duration::from_secs(10));
    assert!(!common::wait_http_ok(
        &format!("http://{admin}/readyz"),
        Duration::from_millis(300)
    ));
    // Another node's token: a node can only register as itself.
    let (impostor, _) = s.start_edge(EdgeOpts::new("edge-2", "token-one"));
    impostor.wait_log("registration refused", Duration::from_secs(10));
    // A CA that did not sign the cloud's certificate.
    let other = tempfile::tempdir().unwrap();
    common::Pki::new(other.path());
    let other_ca = other.path().join("ca.crt");
    let (wrong_ca, _) = s.start_edge(EdgeOpts {
        ca: other_ca.to_str().unwrap(),
        ..EdgeOpts::new("edge-1", "token-one")
    });
    wrong_ca.wait_log(
        "TLS handshake with the cloud failed",
        Duration::from_secs(10),
    );
    cloud.wait_log("edge registration failed", Duration::from_secs(5));
    let log = cloud.log_text();
    assert!(
        log.contains("node `edge-1`: invalid token"),
        "cloud log:\n{log}"
    );
    assert!(
        log.contains("node `edge-2`: invalid token"),
        "cloud log:\n{log}"
    );
    assert!(!log.contains("edge registered"), "cloud log:\n{log}");
}

#[test]
fn client_certificate_identifies_the_node_and_cannot_claim_another() {
    let mut s = Setup::new("");
    s.pki.client_cert("edge-1");
    let cloud = s.start_cloud(Table::new());
    let _edge = s.start_ready_edge(EdgeOpts {
        cert: Some("edge-edge-1"),
        ..EdgeOpts::new("edge-1", "")
    });
    let (impostor, _) = s.start_edge(EdgeOpts {
        cert: Some("edge-edge-1"),
        ..EdgeOpts::new("edge-2", "")
    });
    impostor.wait_log("registration refused", Duration::from_secs(10));
    let log = cloud.log_text();
    assert!(
        log.contains("client certificate is for node `edge-1`"),
        "cloud log:\n{log}"
    );
}

#[test]
fn targets_outside_the_allowlist_are_refused() {
    let mut s = Setup::new(TOKENS);
    let sink = servers::sink("127.0.0.1:0");
    let forbidden = servers::sink("127.0.0.1:0");
    let _cloud = s.start_cloud(Table::new());
    let edge = s.start_ready_edge(edge_opts("edge-1", "token-one", &[sink]));
    assert!(connect_via(s.connect, &format!("edge-1:{}", sink.port())).is_ok());
    let refused = connect_via(s.connect, &format!("edge-1:{}", forbidden.port()))
        .expect_err("must be refused");
    assert!(refused.starts_with("HTTP/1.1 403"), "{refused}");
    edge.wait_log(
        "refused a target outside the allowlist",
        Duration::from_secs(5),
    );
}

#[test]
fn unknown_and_disconnected_nodes_fail_at_once() {
    let mut s = Setup::new(TOKENS);
    let cloud = s.start_cloud(toml::toml! {
        [[node]]
        name = "edge-9"
        addresses = ["127.1.0.9"]
    });
    let started = Instant::now();
    let unknown = connect_via(s.connect, "no-such-node:10250").expect_err("unknown node");
    assert!(unknown.starts_with("HTTP/1.1 404"), "{unknown}");
    let offline = connect_via(s.connect, "127.1.0.9:10250").expect_err("offline node");
    assert!(offline.starts_with("HTTP/1.1 502"), "{offline}");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "refusals took {:?}",
        started.elapsed()
    );
    cloud.wait_log(
        "node `edge-9` has no connected edge",
        Duration::from_secs(2),
    );
    cloud.wait_log(
        "`no-such-node` is neither a node name nor a node address",
        Duration::from_secs(2),
    );
}

#[test]
fn fixed_forward_reaches_its_node_target() {
    let mut s = Setup::new(TOKENS);
    let sink = servers::sink("127.0.0.1:0");
    let cloud = s.start_cloud(common::forwards("edge-1", &[sink]));
    let listen = cloud.ready().addr("forward[0].listen");
    let _edge = s.start_ready_edge(edge_opts("edge-1", "token-one", &[sink]));
    let mut conn = TcpStream::connect(listen).unwrap();
    conn.write_all(b"abc").unwrap();
    conn.shutdown(Shutdown::Write).unwrap();
    let mut answer = String::new();
    conn.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("3 "), "{answer}");
}

#[test]
fn a_second_registration_replaces_the_first() {
    let mut s = Setup::new(TOKENS);
    let sink = servers::sink("127.0.0.1:0");
    let cloud = s.start_cloud(Table::new());
    let _first = s.start_ready_edge(edge_opts("edge-1", "token-one", &[sink]));
    let _second = s.start_ready_edge(edge_opts("edge-1", "token-one", &[sink]));
    cloud.wait_log("replacing its previous session", Duration::from_secs(5));
    cloud.wait_log("replaced session closed", Duration::from_secs(5));
    let mut conn = connect_via(s.connect, &format!("edge-1:{}", sink.port()))
        .expect("CONNECT after replacement");
    conn.shutdown(Shutdown::Write).unwrap();
    let mut answer = String::new();
    conn.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("0 "), "{answer}");
}

#[test]
fn responses_written_in_two_writes_do_not_stall() {
    let mut s = Setup::new(TOKENS);
    let server = servers::two_writes("127.0.0.1:0");
    let _cloud = s.start_cloud(Table::new());
    let _edge = s.start_ready_edge(edge_opts("edge-1", "token-one", &[server]));
    let conn = connect_via(s.connect, &format!("edge-1:{}", server.port())).expect("CONNECT");
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut writer = conn;
    let mut times = Vec::new();
    for _ in 0..40 {
        let started = Instant::now();
        writer
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut line = String::new();
        loop {
            line.clear();
            reader.read_line(&mut line).unwrap();
            if line == "\r\n" {
                break;
            }
        }
        let mut body = [0u8; 22];
        reader.read_exact(&mut body).unwrap();
        times.push(started.elapsed());
    }
    times.sort();
    let median = times[times.len() / 2];
    // A Nagle plus delayed-ACK stall costs 40 ms per request; healthy is well under 5 ms.
    assert!(
        median < Duration::from_millis(20),
        "median request took {median:?}: {times:?}"
    );
}

#[test]
fn log_level_changes_at_runtime_superedge_style() {
    let mut s = Setup::new(TOKENS);
    let _cloud = s.start_cloud(Table::new());
    let url = format!("http://{}/debug/flags/v", s.cloud_admin);
    let out = Command::new("curl")
        .args(["-sS", "-X", "PUT", &url, "-d", "8"])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "trace");
    let out = Command::new("curl").args(["-sS", &url]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "trace");
    let out = Command::new("curl")
        .args([
            "-sS",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "-X",
            "PUT",
            &url,
            "-d",
            "info,[[[",
        ])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "400");
}

#[test]
fn invalid_config_exits_2_naming_file_and_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cloud.toml");
    std::fs::write(&path, "[tunnel]\nlisten = \"127.0.0.1:1\"\ncert = \"c\"\nkey = \"k\"\ntoken_file = \"t\"\n[[forward]]\nlisten = \"127.0.0.1:2\"\nnode = \"ghost\"\ntarget = \"127.0.0.1:3\"\n").unwrap();
    let mut p = common::Proc::start(
        "bad-config",
        dir.path(),
        &["cloud", "--config", path.to_str().unwrap()],
    );
    assert_eq!(p.wait_exit(Duration::from_secs(10)), Some(2));
    let log = p.log_text();
    assert!(
        log.contains("cloud.toml")
            && log.contains("forward[0].node")
            && log.contains("unknown node `ghost`"),
        "{log}"
    );
}

#[test]
fn superedge_https_module_routes_by_node_name_and_presents_the_edge_client_cert() {
    use rcgen::ExtendedKeyUsagePurpose::{ClientAuth, ServerAuth};
    let mut s = Setup::new(TOKENS);
    s.pki
        .issue("kubelet", &["127.0.0.1"], "kubelet", ServerAuth);
    s.pki.issue(
        "kubelet-client",
        &["apiserver-kubelet-client"],
        "apiserver-kubelet-client",
        ClientAuth,
    );
    s.pki.issue("front", &["edge-1"], "edge-1", ServerAuth);
    // The "kubelet" only talks to clients with a certificate from our CA. It says
    // `ACCEPT <address>` once it listens.
    let (_kubelet, kubelet) =
        common::spawn_announcing(Command::new("openssl").current_dir(s.path()).args([
            "s_server",
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
            "127.0.0.1:0",
        ]));
    let kubelet_port = kubelet.port();
    let kubelet_addr = format!("127.0.0.1:{kubelet_port}");
    let cloud = s.start_cloud(toml::toml! {
        [[node]]
        name = "edge-1"

        [[https]]
        listen = "127.0.0.1:0"
        cert = "front.crt"
        key = "front.key"
        target = (kubelet_addr.clone())
    });
    let front = cloud.ready().addr("https[0].listen");
    let _edge = s.start_ready_edge(EdgeOpts {
        extra: toml::toml! {
            [allow]
            targets = [(kubelet_addr.clone())]

            [https]
            cert = "kubelet-client.crt"
            key = "kubelet-client.key"
        },
        ..EdgeOpts::new("edge-1", "token-one")
    });
    let ca = s.path().join("ca.crt");
    // By node name (TLS SNI), as SuperEdge's DNS mode makes clients do.
    let by_name = Command::new("curl")
        .args(["-sS", "--max-time", "10", "--cacert", ca.to_str().unwrap()])
        .args(["--resolve", &format!("edge-1:{}:127.0.0.1", front.port())])
        .arg(format!("https://edge-1:{}/", front.port()))
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&by_name.stdout).contains("s_server"),
        "{}",
        String::from_utf8_lossy(&by_name.stderr)
    );
    // No SNI (an IP address): the Host header names the node.
    let by_host = Command::new("curl")
        .args(["-sS", "--max-time", "10", "-k", "-H", "Host: edge-1"])
        .arg(format!("https://{front}/"))
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&by_host.stdout).contains("s_server"),
        "{}",
        String::from_utf8_lossy(&by_host.stderr)
    );
    // An unknown node gets an HTTP error, not a hang.
    let unknown = Command::new("curl")
        .args([
            "-sS",
            "--max-time",
            "10",
            "-k",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "-H",
            "Host: nobody",
        ])
        .arg(format!("https://{front}/"))
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&unknown.stdout), "404");
}

#[test]
fn http_connect_over_the_unix_socket_like_the_apiserver_egress_selector() {
    use std::os::unix::net::UnixStream;
    let mut s = Setup::new(TOKENS);
    let sink = servers::sink("127.0.0.1:0");
    let _cloud = s.start_cloud(Table::new());
    let _edge = s.start_ready_edge(edge_opts("edge-1", "token-one", &[sink]));
    let mut conn = UnixStream::connect(&s.connect_unix).expect("connect to the unix socket");
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    // Early bytes right behind the request head must not be lost.
    write!(
        conn,
        "CONNECT edge-1:{} HTTP/1.1\r\nHost: edge-1:{}\r\n\r\nearly",
        sink.port(),
        sink.port()
    )
    .unwrap();
    conn.shutdown(Shutdown::Write).unwrap();
    let mut response = String::new();
    conn.read_to_string(&mut response).unwrap();
    let expected = format!("5 {}\n", servers::hex(&sha2_of(b"early")));
    assert!(
        response.starts_with("HTTP/1.1 200") && response.ends_with(&expected),
        "{response:?}"
    );
}

#[test]
fn resets_travel_both_ways() {
    use std::sync::mpsc;
    let mut s = Setup::new(TOKENS);
    // A target that resets after reading five bytes.
    let resetter = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let resetter_addr = resetter.local_addr().unwrap();
    std::thread::spawn(move || {
        for mut c in resetter.incoming().flatten() {
            let mut b = [0u8; 5];
            let _ = c.read_exact(&mut b);
            let _ = socket2::SockRef::from(&c).set_linger(Some(Duration::ZERO));
        }
    });
    // A target that says when its client's first bytes arrived, then how it went away.
    let watcher = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let watcher_addr = watcher.local_addr().unwrap();
    let (seen_tx, seen_rx) = mpsc::channel();
    std::thread::spawn(move || {
        if let Some(mut c) = watcher.incoming().flatten().next() {
            let mut b = [0u8; 1024];
            let mut read_any = false;
            let end = loop {
                match c.read(&mut b) {
                    Ok(0) => break "eof".to_string(),
                    Ok(_) => {
                        if !std::mem::replace(&mut read_any, true) {
                            let _ = seen_tx.send("data".to_string());
                        }
                    }
                    Err(e) => break format!("{:?}", e.kind()),
                }
            };
            let _ = seen_tx.send(end);
        }
    });
    let _cloud = s.start_cloud(Table::new());
    let _edge = s.start_ready_edge(edge_opts(
        "edge-1",
        "token-one",
        &[resetter_addr, watcher_addr],
    ));

    // Target RST -> client RST.
    let mut conn =
        connect_via(s.connect, &format!("edge-1:{}", resetter_addr.port())).expect("CONNECT");
    conn.write_all(b"12345").unwrap();
    let mut b = [0u8; 16];
    let got = conn.read(&mut b);
    assert!(
        matches!(&got, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
        "client should see the target's reset, got {got:?}"
    );

    // Client RST -> target RST.
    let mut conn =
        connect_via(s.connect, &format!("edge-1:{}", watcher_addr.port())).expect("CONNECT");
    conn.write_all(b"hello").unwrap();
    // The reset must find the whole path connected: wait until the target has the bytes.
    let first = seen_rx
        .recv_timeout(Duration::from_secs(5))
        .expect("target saw nothing");
    assert_eq!(
        first, "data",
        "the target should read the client's bytes first"
    );
    socket2::SockRef::from(&conn)
        .set_linger(Some(Duration::ZERO))
        .unwrap();
    drop(conn);
    let end = seen_rx
        .recv_timeout(Duration::from_secs(5))
        .expect("target saw no end");
    assert_eq!(
        end, "ConnectionReset",
        "target should see the client's reset"
    );
}

#[test]
fn a_forward_whose_target_refuses_resets_the_client() {
    // A failed dial must end in a reset, not a clean end of stream, and be logged once.
    let mut s = Setup::new(TOKENS);
    let closed = common::ClosedPort::new();
    let (closed, _held) = (closed.addr, closed);
    let cloud = s.start_cloud(common::forwards("edge-1", &[closed]));
    let listen = cloud.ready().addr("forward[0].listen");
    let _edge = s.start_ready_edge(edge_opts("edge-1", "token-one", &[closed]));
    let mut conn = TcpStream::connect(listen).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = [0u8; 16];
    // The reset may come before the write or after it.
    let outcome = conn
        .write_all(b"early bytes")
        .and_then(|()| conn.read(&mut buf).map(|n| eprintln!("read {n} bytes")));
    let err =
        outcome.expect_err("a refused dial must reset the client, not end the stream cleanly");
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset, "{err}");
    cloud.wait_log("edge could not connect to target", Duration::from_secs(2));
    assert_eq!(
        cloud
            .log_text()
            .matches("edge could not connect to target")
            .count(),
        1,
        "logged once"
    );
}

/// Time from `connect()` to the first byte of the answer to one HTTP request.
fn first_response(mut conn: TcpStream, started: Instant) -> Duration {
    conn.set_nodelay(true).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    conn.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut byte = [0u8; 1];
    conn.read_exact(&mut byte)
        .expect("first byte of the response");
    started.elapsed()
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

#[test]
fn a_forward_sends_the_clients_first_bytes_right_behind_the_dial_request() {
    // 100 ms each way between edge and cloud, as on a WAN link. A forward's client waits
    // for nothing, so its request rides right behind the dial request: its first answer
    // takes one link round trip plus the target's time. HTTP CONNECT's client must hear
    // the dial's outcome before it sends: two round trips. Both measured here, alternately.
    const ONE_WAY: Duration = Duration::from_millis(100);
    const RTT: Duration = Duration::from_millis(200);
    let mut s = Setup::new(TOKENS);
    let server = servers::two_writes("127.0.0.1:0");
    let cloud = s.start_cloud(common::forwards("edge-1", &[server]));
    let listen = cloud.ready().addr("forward[0].listen");
    let link = common::probe::DelayProxy::start(s.tunnel, ONE_WAY);
    s.tunnel = link.addr; // the edge's `cloud.address`
    let _edge = s.start_ready_edge(edge_opts("edge-1", "token-one", &[server]));
    let (mut forward, mut connect) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        let started = Instant::now();
        forward.push(first_response(TcpStream::connect(listen).unwrap(), started));
        let started = Instant::now();
        let conn = connect_via(s.connect, &format!("edge-1:{}", server.port())).expect("CONNECT");
        connect.push(first_response(conn, started));
    }
    eprintln!(
        "link RTT {RTT:?}; first response on a new connection: forward {forward:?}, HTTP CONNECT {connect:?}"
    );
    let (forward, connect) = (median(forward), median(connect));
    eprintln!(
        "medians: forward {forward:?} ({:.2} RTT), HTTP CONNECT {connect:?} ({:.2} RTT)",
        forward.as_secs_f64() / RTT.as_secs_f64(),
        connect.as_secs_f64() / RTT.as_secs_f64()
    );
    assert!(
        forward >= RTT && connect >= 2 * RTT,
        "faster than the link allows: is the delay in the path?"
    );
    assert!(
        forward < RTT * 3 / 2,
        "a forward's first response took {forward:?}: the client's bytes waited for the dial's answer (link RTT {RTT:?})"
    );
}

#[test]
fn optimistic_connect_answers_before_the_edge_and_resets_a_refused_dial() {
    // `connect.optimistic_ok`: the 200 comes before the edge's dial result, the request
    // rides right behind the dial request (one link round trip to the first response,
    // as a forward), and a dial the edge refuses becomes a reset after the 200.
    const ONE_WAY: Duration = Duration::from_millis(100);
    const RTT: Duration = Duration::from_millis(200);
    let mut s = Setup::new(TOKENS);
    let server = servers::two_writes("127.0.0.1:0");
    // Outside the edge's allowlist: nothing may ever connect to it.
    let forbidden = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    forbidden.set_nonblocking(true).unwrap();
    let forbidden_addr = forbidden.local_addr().unwrap();
    let cloud = s.start_cloud(toml::toml! {
        [connect]
        optimistic_ok = true

        [[node]]
        name = "edge-1"
    });
    let link = common::probe::DelayProxy::start(s.tunnel, ONE_WAY);
    s.tunnel = link.addr; // the edge's `cloud.address`
    let edge = s.start_ready_edge(edge_opts("edge-1", "token-one", &[server]));
    let (mut ok_at, mut first) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        let started = Instant::now();
        let conn = connect_via(s.connect, &format!("edge-1:{}", server.port())).expect("CONNECT");
        ok_at.push(started.elapsed());
        first.push(first_response(conn, started));
    }
    eprintln!("link RTT {RTT:?}; 200 after {ok_at:?}, first response after {first:?}");
    let (ok_at, first) = (median(ok_at), median(first));
    assert!(
        ok_at < RTT / 2,
        "the 200 took {ok_at:?}: it waited for the edge (link RTT {RTT:?})"
    );
    assert!(
        first >= RTT,
        "faster than the link allows: is the delay in the path?"
    );
    assert!(
        first < RTT * 3 / 2,
        "first response after {first:?}: the client's bytes waited for the dial's answer (link RTT {RTT:?})"
    );

    // A target the edge refuses: 200 first, then a reset instead of 403.
    let mut conn = connect_via(s.connect, &format!("edge-1:{}", forbidden_addr.port()))
        .expect("the 200 comes before the edge's refusal");
    let mut buf = [0u8; 16];
    // The reset may come before the write or after it.
    let outcome = conn
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .and_then(|()| conn.read(&mut buf).map(|n| eprintln!("read {n} bytes")));
    let err = outcome.expect_err("a refused dial must reset the client");
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset, "{err}");
    edge.wait_log(
        "refused a target outside the allowlist",
        Duration::from_secs(5),
    );
    assert!(
        matches!(forbidden.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "the edge connected to a target outside its allowlist"
    );
    // A refusal known on the cloud still gets its status.
    let unknown = connect_via(s.connect, "no-such-node:80").expect_err("unknown node");
    assert!(!unknown.starts_with("HTTP/1.1 200"), "{unknown}");
    drop(cloud);
}

#[test]
fn a_forward_the_edge_refuses_resets_the_client_and_its_early_bytes_reach_nothing() {
    let mut s = Setup::new(TOKENS);
    let sink = servers::sink("127.0.0.1:0");
    // Outside the edge's allowlist: nothing may ever connect to it.
    let forbidden = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    forbidden.set_nonblocking(true).unwrap();
    let forbidden_addr = forbidden.local_addr().unwrap();
    let hole = servers::NeverAccepting::start();
    let cloud = s.start_cloud(common::forwards(
        "edge-1",
        &[forbidden_addr, hole.addr, sink],
    ));
    let ready = cloud.ready();
    let (to_forbidden, to_hole, to_sink) = (
        ready.addr("forward[0].listen"),
        ready.addr("forward[1].listen"),
        ready.addr("forward[2].listen"),
    );
    let mut extra = allow(&[sink, hole.addr]);
    common::merge(&mut extra, toml::toml! { [transport] dial_timeout = "1s" });
    let (edge, edge_admin) = s.start_edge(EdgeOpts {
        extra,
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

    // The client sends at once, as forwarded clients do; the edge refuses, or its dial
    // times out: either way the client sees a reset, not a clean end of stream.
    let reset_after = |listen: SocketAddr| -> Duration {
        let started = Instant::now();
        let mut conn = TcpStream::connect(listen).unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut buf = [0u8; 16];
        // The reset may come before the write or after it.
        let outcome = conn
            .write_all(b"early secret bytes")
            .and_then(|()| conn.read(&mut buf).map(|n| eprintln!("read {n} bytes")));
        let err =
            outcome.expect_err("a refused dial must reset the client, not end the stream cleanly");
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset, "{err}");
        started.elapsed()
    };
    let forbidden_took = reset_after(to_forbidden);
    let timeout_took = reset_after(to_hole);
    eprintln!(
        "client reset after {forbidden_took:?} (forbidden target), {timeout_took:?} (dial timeout 1 s)"
    );
    assert!(
        forbidden_took < Duration::from_secs(1),
        "reset for a forbidden target took {forbidden_took:?}"
    );
    assert!(
        timeout_took >= Duration::from_millis(900) && timeout_took < Duration::from_secs(5),
        "reset after {timeout_took:?}"
    );

    // The next connection on the same edge carries its own bytes and nothing else.
    let mut conn = TcpStream::connect(to_sink).unwrap();
    conn.write_all(b"abc").unwrap();
    conn.shutdown(Shutdown::Write).unwrap();
    let mut answer = String::new();
    conn.read_to_string(&mut answer).unwrap();
    assert_eq!(answer, format!("3 {}\n", servers::hex(&sha2_of(b"abc"))));

    // Nothing reached the forbidden target, and no target got the refused bytes.
    assert!(
        matches!(forbidden.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "the edge connected to a target outside its allowlist"
    );
    let edge_scrape = common::scrape(edge_admin);
    assert_eq!(
        common::sample(&edge_scrape, "tunnel_bytes_total{direction=\"from_cloud\"}"),
        3.0,
        "{edge_scrape}"
    );
    for (reason, n) in [("ok", 1.0), ("forbidden", 1.0), ("timeout", 1.0)] {
        assert_eq!(
            common::sample(
                &edge_scrape,
                &format!("tunnel_edge_dials_total{{reason=\"{reason}\"}}")
            ),
            n,
            "{reason}: {edge_scrape}"
        );
    }
    // Counted and logged once each, with node and target.
    let cloud_scrape = common::scrape(s.cloud_admin);
    assert_eq!(
        common::sample(&cloud_scrape, "tunnel_connections_total{entry=\"forward\"}"),
        3.0,
        "{cloud_scrape}"
    );
    for reason in ["forbidden", "timeout"] {
        assert_eq!(
            common::sample(
                &cloud_scrape,
                &format!("tunnel_dial_failures_total{{reason=\"{reason}\"}}")
            ),
            1.0,
            "{reason}: {cloud_scrape}"
        );
    }
    let log = cloud.log_text();
    let refusals: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("connection refused"))
        .collect();
    assert_eq!(
        refusals.len(),
        2,
        "one line per refused connection: {refusals:#?}"
    );
    for (line, target, why) in [
        (refusals[0], forbidden_addr, "not in this edge's allowlist"),
        (refusals[1], hole.addr, "timed out"),
    ] {
        assert!(
            line.contains("edge-1") && line.contains(&target.to_string()) && line.contains(why),
            "{line}"
        );
    }
    assert!(
        !log.contains("connection aborted from the edge side"),
        "a refusal logged again as an abort:\n{log}"
    );
    let conns = std::process::Command::new("curl")
        .args(["-sS", "--max-time", "5"])
        .arg(format!("http://{}/debug/connections", s.cloud_admin))
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&conns.stdout).trim(),
        "[]",
        "connections still listed"
    );
}
