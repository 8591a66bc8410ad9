//! Which edges register, as which node, and what a client gets when its node has no
//! session or its target is not allowed.

use super::*;

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

/// In process: each refused edge is stopped before the next starts, so the edges' lines
/// (which do not name their node) are told apart by count.
#[tokio::test]
async fn edges_with_bad_credentials_are_rejected() {
    let mut t = InProcess::start(TOKENS, Table::new()).await;
    let refused = "registration refused";
    // Wrong token.
    let bad_token = t.start_edge(EdgeOpts::new("edge-1", "not-the-token"));
    t.logs
        .wait_count(Side::Edge, &[refused], 1, Duration::from_secs(10))
        .await;
    let admin = bad_token.admin().await;
    let ready = inproc::blocking(move || {
        common::wait_http_ok(
            &format!("http://{admin}/readyz"),
            Duration::from_millis(300),
        )
    })
    .await;
    assert!(!ready);
    let _ = bad_token.stop().await;
    // Another node's token: a node can only register as itself.
    let seen = t.logs.count(Side::Edge, &[refused]);
    let impostor = t.start_edge(EdgeOpts::new("edge-2", "token-one"));
    t.logs
        .wait_count(Side::Edge, &[refused], seen + 1, Duration::from_secs(10))
        .await;
    let _ = impostor.stop().await;
    // A CA that did not sign the cloud's certificate.
    let other = tempfile::tempdir().unwrap();
    common::Pki::new(other.path());
    let other_ca = other.path().join("ca.crt");
    let _wrong_ca = t.start_edge(EdgeOpts {
        ca: other_ca.to_str().unwrap(),
        ..EdgeOpts::new("edge-1", "token-one")
    });
    t.wait_log(
        Side::Edge,
        "TLS handshake with the cloud failed",
        Duration::from_secs(10),
    )
    .await;
    t.wait_log(
        Side::Cloud,
        "edge registration failed",
        Duration::from_secs(5),
    )
    .await;
    let log = t.logs.lines(Side::Cloud).join("\n");
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

#[tokio::test]
async fn client_certificate_identifies_the_node_and_cannot_claim_another() {
    let mut t = InProcess::start("", Table::new()).await;
    t.s.pki.client_cert("edge-1");
    let _edge = t
        .start_ready_edge(EdgeOpts {
            cert: Some("edge-edge-1"),
            ..EdgeOpts::new("edge-1", "")
        })
        .await;
    let _impostor = t.start_edge(EdgeOpts {
        cert: Some("edge-edge-1"),
        ..EdgeOpts::new("edge-2", "")
    });
    t.wait_log(Side::Edge, "registration refused", Duration::from_secs(10))
        .await;
    t.wait_log(
        Side::Cloud,
        "client certificate is for node `edge-1`",
        Duration::from_secs(5),
    )
    .await;
}

#[tokio::test]
async fn targets_outside_the_allowlist_are_refused() {
    let mut t = InProcess::start(TOKENS, Table::new()).await;
    let sink = servers::sink("127.0.0.1:0");
    let forbidden = servers::sink("127.0.0.1:0");
    let _edge = t
        .start_ready_edge(edge_opts("edge-1", "token-one", &[sink]))
        .await;
    let (allowed, _) = inproc::connect(t.s.connect, &format!("edge-1:{}", sink.port())).await;
    assert!(allowed.starts_with("HTTP/1.1 200"), "{allowed}");
    let (refused, _) = inproc::connect(t.s.connect, &format!("edge-1:{}", forbidden.port())).await;
    assert!(refused.starts_with("HTTP/1.1 403"), "{refused}");
    t.wait_log(
        Side::Edge,
        "refused a target outside the allowlist",
        Duration::from_secs(5),
    )
    .await;
}

#[tokio::test]
async fn unknown_and_disconnected_nodes_fail_at_once() {
    let t = InProcess::start(
        TOKENS,
        toml::toml! {
            [[node]]
            name = "edge-9"
            addresses = ["127.1.0.9"]
        },
    )
    .await;
    let started = tokio::time::Instant::now();
    let (unknown, _) = inproc::connect(t.s.connect, "no-such-node:10250").await;
    assert!(unknown.starts_with("HTTP/1.1 404"), "{unknown}");
    let (offline, _) = inproc::connect(t.s.connect, "127.1.0.9:10250").await;
    assert!(offline.starts_with("HTTP/1.1 502"), "{offline}");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "refusals took {:?}",
        started.elapsed()
    );
    t.wait_log(
        Side::Cloud,
        "node `edge-9` has no connected edge",
        Duration::from_secs(2),
    )
    .await;
    t.wait_log(
        Side::Cloud,
        "`no-such-node` is neither a node name nor a node address",
        Duration::from_secs(2),
    )
    .await;
}

/// A second registration of a node (a rolling update's new edge pod) takes the node's
/// new connections. The replaced session keeps carrying the connection it had open, and
/// stays, unused, until its edge leaves: closed once idle, its edge would reconnect and
/// take the node back, and the two would replace each other in turn. On the real clock:
/// a paused one ran the first edge's stop out of time under load, while the kernel still
/// carried its GOAWAY.
#[tokio::test]
async fn a_second_registration_replaces_the_first() {
    let mut t = InProcess::start(TOKENS, Table::new()).await;
    let sink = servers::sink("127.0.0.1:0");
    let echo = inproc::echo_server().await;
    let first = t
        .start_ready_edge(edge_opts("edge-1", "token-one", &[sink, echo]))
        .await;
    let (status, mut held) = inproc::connect(t.s.connect, &format!("edge-1:{}", echo.port())).await;
    assert!(status.starts_with("HTTP/1.1 200"), "{status}");
    let _second = t.start_edge(edge_opts("edge-1", "token-one", &[sink, echo]));
    t.wait_log(
        Side::Cloud,
        "replacing its previous session",
        Duration::from_secs(5),
    )
    .await;

    tokio::time::sleep(Duration::from_millis(1_050)).await;
    assert!(
        !t.logs.text().contains("replaced session closed"),
        "the replaced session closed under an open connection"
    );
    inproc::echoes(&mut held, b"still carried by the replaced session").await;
    drop(held);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let logs = t.logs.text();
    assert!(
        !logs.contains("replaced session closed"),
        "the replaced session closed once idle"
    );
    assert_eq!(
        logs.matches("replacing its previous session").count(),
        1,
        "the edges replaced each other in turn"
    );
    first.stop().await.expect("the first edge stops");
    t.wait_log(
        Side::Cloud,
        "replaced session closed",
        Duration::from_secs(5),
    )
    .await;

    let connect = t.s.connect;
    let answer = inproc::blocking(move || {
        let mut conn = connect_via(connect, &format!("edge-1:{}", sink.port()))
            .expect("CONNECT after replacement");
        conn.shutdown(Shutdown::Write).unwrap();
        let mut answer = String::new();
        conn.read_to_string(&mut answer).unwrap();
        answer
    })
    .await;
    assert!(answer.starts_with("0 "), "{answer}");
}

/// A stolen edge certificate run many times (any kubelet can get one for its own name):
/// the cloud keeps at most the node's live session and the draining one it replaced.
/// While a connection is open on the draining one, every further registration is refused
/// with the reason, counted, and logged once; the open connection keeps working. Once
/// it ends, the next registration closes the idle draining session to make room.
#[tokio::test]
async fn a_stolen_certificate_cannot_make_the_cloud_keep_more_than_two_sessions() {
    let mut t = InProcess::start(TOKENS, Table::new()).await;
    t.s.pki.client_cert("edge-1");
    let echo = inproc::echo_server().await;
    let opts = || EdgeOpts {
        cert: Some("edge-edge-1"),
        ..edge_opts("edge-1", "", &[echo])
    };
    let _honest = t.start_ready_edge(opts()).await;
    let (status, mut held) = inproc::connect(t.s.connect, &format!("edge-1:{}", echo.port())).await;
    assert!(status.starts_with("HTTP/1.1 200"), "{status}");

    let thieves: Vec<_> = (0..8).map(|_| t.start_edge(opts())).collect();
    let refused = [
        "registration refused",
        "the node already has two sessions here",
    ];
    t.logs
        .wait_count(Side::Edge, &refused, 7, Duration::from_secs(20))
        .await;
    let registered = t
        .logs
        .count(Side::Cloud, &["edge registered", "node=edge-1"]);
    assert_eq!(
        registered,
        2,
        "the honest session and one thief's, no more:\n{}",
        t.logs.lines(Side::Cloud).join("\n")
    );
    inproc::echoes(&mut held, b"still carried by the draining session").await;
    let admin = t.s.cloud_admin;
    let series = r#"tunnel_registrations_rejected_total{reason="too_many_sessions"}"#;
    let counted = inproc::blocking(move || common::metric(admin, series)).await;
    assert!(counted >= 7.0, "{series} = {counted}");
    let logged = t
        .logs
        .count(Side::Cloud, &["edge registration refused", "node `edge-1`"]);
    assert_eq!(logged, 1, "refusals of one node are logged once a minute");

    drop(held);
    t.wait_log(
        Side::Cloud,
        "closing the node's idle draining session",
        Duration::from_secs(20),
    )
    .await;
    for thief in thieves {
        thief.stop().await.expect("the edge stops");
    }
}

/// One client cannot take every call to an edge (kubelets keep idle connections for
/// hours): a client holds at most its share, `transport.client_share` of
/// `max_streams_per_edge`, and its next connection is refused with 503, counted as
/// `reason="over_share"`; another client's connection still answers. Two clients of the
/// CONNECT entry, told apart by their addresses.
#[tokio::test]
async fn one_client_holds_its_share_of_an_edge_and_another_client_still_gets_through() {
    let mut t = InProcess::start(
        TOKENS,
        toml::toml! {
            [transport]
            max_streams_per_edge = 8
            client_share = 0.5
        },
    )
    .await;
    let echo = inproc::echo_server().await;
    let _edge = t
        .start_ready_edge(edge_opts("edge-1", "token-one", &[echo]))
        .await;
    let authority = format!("edge-1:{}", echo.port());
    let greedy: std::net::IpAddr = "127.0.0.1".parse().unwrap();
    let mut held = Vec::new();
    for _ in 0..4 {
        let (status, conn) = inproc::connect_from(greedy, t.s.connect, &authority).await;
        assert!(status.starts_with("HTTP/1.1 200"), "{status}");
        held.push(conn);
    }
    let (status, _) = inproc::connect_from(greedy, t.s.connect, &authority).await;
    assert!(
        status.starts_with("HTTP/1.1 503"),
        "the fifth connection of one client: {status}"
    );
    let other = "127.0.0.2".parse().unwrap();
    let (status, mut conn) = inproc::connect_from(other, t.s.connect, &authority).await;
    assert!(
        status.starts_with("HTTP/1.1 200"),
        "another client: {status}"
    );
    inproc::echoes(&mut conn, b"another client's call answers").await;
    for conn in &mut held {
        inproc::echoes(conn, b"the share's calls still answer").await;
    }
    let admin = t.s.cloud_admin;
    let series = r#"tunnel_dial_failures_total{reason="over_share"}"#;
    let refused = inproc::blocking(move || common::metric(admin, series)).await;
    assert_eq!(refused, 1.0, "{series}");
}

/// A token from the token file never takes the session of a node that proved itself
/// with its certificate: a second edge holding the node's token is refused with the
/// reason, and the certificate edge keeps its session and carries traffic.
#[tokio::test]
async fn a_token_never_replaces_a_certificate_session() {
    let mut t = InProcess::start(TOKENS, Table::new()).await;
    t.s.pki.client_cert("edge-1");
    let sink = servers::sink("127.0.0.1:0");
    let _certified = t
        .start_ready_edge(EdgeOpts {
            cert: Some("edge-edge-1"),
            ..edge_opts("edge-1", "", &[sink])
        })
        .await;
    let cloud_admin = t.s.cloud_admin;
    let session = move || {
        let listing = common::debug_edges(cloud_admin).unwrap();
        let edge = listing.iter().find(|e| e["node"] == "edge-1").cloned();
        edge.map(|e| e["session"].clone())
    };
    let held = inproc::blocking(session).await.expect("listed");

    let token_edge = t.start_edge(edge_opts("edge-1", "token-one", &[sink]));
    t.wait_log(Side::Edge, "registration refused", Duration::from_secs(10))
        .await;
    let said = t.logs.lines(Side::Edge).join("\n");
    let reason = format!(
        "the node is connected (session {held}) with a client certificate; a token-file token does not replace that session"
    );
    assert!(said.contains(&reason), "the edge is told why:\n{said}");
    t.wait_log(
        Side::Cloud,
        &format!("node `edge-1`: {reason}"),
        Duration::from_secs(5),
    )
    .await;
    let token_admin = token_edge.admin().await;
    let (connect, listed) = (t.s.connect, held.clone());
    inproc::blocking(move || {
        assert!(!common::wait_http_ok(
            &format!("http://{token_admin}/readyz"),
            Duration::from_millis(300)
        ));
        // The certificate session is the one listed, and it carries a connection.
        assert_eq!(session(), Some(listed));
        let mut conn = connect_via(connect, &format!("edge-1:{}", sink.port()))
            .expect("CONNECT through the certificate edge");
        conn.write_all(&[7u8; 4096]).unwrap();
        conn.shutdown(Shutdown::Write).unwrap();
        let mut answer = String::new();
        conn.read_to_string(&mut answer).unwrap();
        assert!(answer.starts_with("4096 "), "{answer}");
    })
    .await;
    let log = t.logs.lines(Side::Cloud).join("\n");
    assert!(
        !log.contains("replacing its previous session") && !log.contains("edge disconnected"),
        "the certificate session was disturbed:\n{log}"
    );
}

/// A `default:` token beside client certificates would let whoever holds it register as
/// any node: the cloud refuses to start, naming the file, the line and why. Alone, it
/// starts and warns.
#[test]
fn a_default_token_is_refused_beside_certificates_and_warned_about_alone() {
    let mut s = Setup::new("# the fleet\ndefault:shared-token\n");
    let mut refused = s.spawn_cloud(Table::new(), &[]);
    assert_eq!(refused.wait_exit(Duration::from_secs(10)), Some(1));
    let log = refused.log_text();
    let tokens = s.path().join("tokens");
    assert!(
        log.contains(&format!(
            "{}:2: a `default:` token lets any edge that holds it register as any node",
            tokens.display()
        )) && log.contains("client certificates (tunnel.client_ca)"),
        "{log}"
    );
    assert!(
        !log.contains("shared-token"),
        "the token is not echoed:\n{log}"
    );

    let mut config = s.cloud_config(Table::new());
    config["tunnel"].as_table_mut().unwrap().remove("client_ca");
    let path = s.path().join("cloud-tokens-only.toml");
    common::config::write_toml(&path, &config);
    let mut cloud = Proc::start(
        "cloud-tokens-only",
        s.path(),
        &["cloud", "--config", path.to_str().unwrap()],
    );
    s.cloud_ready(&mut cloud);
    cloud.wait_log(
        "the token file's `default:` token is the only way edges authenticate",
        Duration::from_secs(1),
    );
    s.start_ready_edge(EdgeOpts::new("any-node", "shared-token"));
}
