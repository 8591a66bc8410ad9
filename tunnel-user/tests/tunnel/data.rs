//! Bytes through the tunnel arrive intact and in time: bulk both ways, half-closes,
//! a stalled neighbour, split responses, and resets in both directions.

use super::*;

#[tokio::test]
async fn curl_through_http_connect_reaches_python_http_server() {
    let mut t = InProcess::start(
        TOKENS,
        toml::toml! {
            [[node]]
            name = "edge-1"
            addresses = ["127.1.0.5"]
        },
    )
    .await;
    let www = t.path().join("www");
    std::fs::create_dir(&www).unwrap();
    std::fs::write(www.join("hello.txt"), "hello through the tunnel\n").unwrap();
    // 127.1.0.5 plays the edge node's own address.
    let (_http, http) = common::python_http_server("127.1.0.5", &www);
    let port = http.port();
    let extra = toml::toml! {
        [allow]
        targets = []
        node_addresses = ["127.1.0.5"]
        ports = [port]
    };
    let _edge = t
        .start_ready_edge(EdgeOpts {
            extra,
            ..EdgeOpts::new("edge-1", "token-one")
        })
        .await;
    let connect = t.s.connect;
    inproc::blocking(move || {
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
                    &format!("http://{connect}"),
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
    })
    .await;
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

#[tokio::test]
async fn half_close_still_delivers_the_full_response() {
    let mut t = InProcess::start(TOKENS, Table::new()).await;
    let sink = servers::sink("127.0.0.1:0");
    let _edge = t
        .start_ready_edge(edge_opts("edge-1", "token-one", &[sink]))
        .await;
    let connect = t.s.connect;
    let response = inproc::blocking(move || {
        let mut conn = connect_via(connect, &format!("edge-1:{}", sink.port())).expect("CONNECT");
        conn.write_all(b"request body").unwrap();
        conn.shutdown(Shutdown::Write).unwrap();
        let mut response = String::new();
        conn.read_to_string(&mut response)
            .expect("response after our FIN");
        response
    })
    .await;
    let expected_hash = servers::hex(&sha2_of(b"request body"));
    assert_eq!(response, format!("12 {expected_hash}\n"));
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

#[tokio::test]
async fn responses_written_in_two_writes_do_not_stall() {
    let mut t = InProcess::start(TOKENS, Table::new()).await;
    let server = servers::two_writes("127.0.0.1:0");
    let _edge = t
        .start_ready_edge(edge_opts("edge-1", "token-one", &[server]))
        .await;
    let connect = t.s.connect;
    let mut times = inproc::blocking(move || {
        let conn = connect_via(connect, &format!("edge-1:{}", server.port())).expect("CONNECT");
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
        times
    })
    .await;
    times.sort();
    let median = times[times.len() / 2];
    // A Nagle plus delayed-ACK stall costs 40 ms per request; healthy is well under 5 ms.
    assert!(
        median < Duration::from_millis(20),
        "median request took {median:?}: {times:?}"
    );
}

/// A client that resets its connection is logged as gone away itself ("client
/// aborted"), never as an abort from the edge side. The cloud resets the call when the
/// client's socket fails, and that reset and the socket's error reach the copy in
/// either order (the bench logged wrk's resets as the edge's, about one in five).
#[tokio::test]
async fn a_client_reset_is_logged_as_the_clients() {
    use std::sync::mpsc;
    const CLIENTS: usize = 20;
    // Every 200 after the edge's answer, so a client's bytes reaching the target say the
    // whole path is connected. (A reset before the answer of an early 200: the next
    // test.)
    let mut t = InProcess::start(TOKENS, toml::toml! { [connect] optimistic_ok = "never" }).await;
    // A target that says when a client's first bytes arrived, and then never answers.
    let target = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let target_addr = target.local_addr().unwrap();
    let (reached_tx, reached_rx) = mpsc::channel();
    std::thread::spawn(move || {
        for mut c in target.incoming().flatten() {
            let reached = reached_tx.clone();
            std::thread::spawn(move || {
                let mut b = [0u8; 5];
                if c.read_exact(&mut b).is_ok() {
                    let _ = reached.send(());
                }
                while c.read(&mut b).is_ok_and(|n| n > 0) {}
            });
        }
    });
    let _edge = t
        .start_ready_edge(edge_opts("edge-1", "token-one", &[target_addr]))
        .await;
    let connect = t.s.connect;
    inproc::blocking(move || {
        for _ in 0..CLIENTS {
            let mut conn =
                connect_via(connect, &format!("edge-1:{}", target_addr.port())).expect("CONNECT");
            conn.write_all(b"hello").unwrap();
            // The path connected and the call waiting for the target, which never answers.
            reached_rx
                .recv_timeout(Duration::from_secs(5))
                .expect("the client's bytes reach the target");
            common::close_with_reset(conn);
        }
    })
    .await;
    let log = client_aborts_logged(&t, CLIENTS).await;
    assert!(
        !log.contains("connection aborted from the edge side"),
        "a client's reset logged as the edge's:\n{log}"
    );
}

/// With the early 200 (`optimistic_ok = "recent"`, the default), a client may reset
/// while the edge is still dialing for it: that too is the client's abort, never a
/// failed connection. The reset of the call and the answer it turns into a failure come
/// after the socket's error; the copy reports the socket's.
#[tokio::test]
async fn a_client_reset_before_the_dial_is_answered_is_logged_as_the_clients() {
    const CLIENTS: usize = 20;
    let mut t = InProcess::start(TOKENS, Table::new()).await;
    // 100 ms each way between edge and cloud: every dial is still under way at the edge
    // when its client, which had its 200 at once, resets.
    let link = inproc::DelayProxy::start(t.s.tunnel, Duration::from_millis(100)).await;
    t.s.tunnel = link.addr;
    let target = inproc::echo_server().await;
    let _edge = t
        .start_ready_edge(edge_opts("edge-1", "token-one", &[target]))
        .await;
    let authority = format!("edge-1:{}", target.port());
    // Reached once, so the next CONNECTs get their 200 before the edge has dialled.
    let (status, mut first) = inproc::connect(t.s.connect, &authority).await;
    assert!(status.starts_with("HTTP/1.1 200"), "{status}");
    inproc::echoes(&mut first, b"reached").await;
    drop(first);
    for _ in 0..CLIENTS {
        let (status, conn) = inproc::connect(t.s.connect, &authority).await;
        assert!(status.starts_with("HTTP/1.1 200"), "{status}");
        common::close_with_reset(conn.into_inner());
    }
    let log = client_aborts_logged(&t, CLIENTS).await;
    assert!(
        !log.contains("connection failed") && !log.contains("connection refused"),
        "a client's reset during the dial logged as a failed dial:\n{log}"
    );
}

/// The cloud's log once it has logged `clients` client aborts.
async fn client_aborts_logged(t: &InProcess, clients: usize) -> String {
    t.logs
        .wait_count(
            Side::Cloud,
            &["client aborted"],
            clients,
            Duration::from_secs(10),
        )
        .await;
    t.logs.lines(Side::Cloud).join("\n")
}

#[tokio::test]
async fn resets_travel_both_ways() {
    use std::sync::mpsc;
    let mut t = InProcess::start(TOKENS, Table::new()).await;
    // A target that resets after reading five bytes.
    let resetter = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let resetter_addr = resetter.local_addr().unwrap();
    std::thread::spawn(move || {
        for mut c in resetter.incoming().flatten() {
            let mut b = [0u8; 5];
            let _ = c.read_exact(&mut b);
            common::close_with_reset(c);
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
    let _edge = t
        .start_ready_edge(edge_opts(
            "edge-1",
            "token-one",
            &[resetter_addr, watcher_addr],
        ))
        .await;
    let connect = t.s.connect;
    inproc::blocking(move || {
        clients_and_targets_reset_each_other(connect, resetter_addr, watcher_addr, seen_rx)
    })
    .await;
}

/// Through the CONNECT proxy at `connect`: a reset by the target at `resetter` reaches
/// the client, and a client's reset reaches the target at `watcher`, which reports what
/// it saw on `seen_rx`.
fn clients_and_targets_reset_each_other(
    connect: SocketAddr,
    resetter_addr: SocketAddr,
    watcher_addr: SocketAddr,
    seen_rx: std::sync::mpsc::Receiver<String>,
) {
    // Target RST -> client RST.
    let mut conn =
        connect_via(connect, &format!("edge-1:{}", resetter_addr.port())).expect("CONNECT");
    conn.write_all(b"12345").unwrap();
    let mut b = [0u8; 16];
    let got = conn.read(&mut b);
    assert!(
        matches!(&got, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
        "client should see the target's reset, got {got:?}"
    );

    // Client RST -> target RST.
    let mut conn =
        connect_via(connect, &format!("edge-1:{}", watcher_addr.port())).expect("CONNECT");
    conn.write_all(b"hello").unwrap();
    // The reset must find the whole path connected: wait until the target has the bytes.
    let first = seen_rx
        .recv_timeout(Duration::from_secs(5))
        .expect("target saw nothing");
    assert_eq!(
        first, "data",
        "the target should read the client's bytes first"
    );
    common::close_with_reset(conn);
    let end = seen_rx
        .recv_timeout(Duration::from_secs(5))
        .expect("target saw no end");
    assert_eq!(
        end, "ConnectionReset",
        "target should see the client's reset"
    );
}
