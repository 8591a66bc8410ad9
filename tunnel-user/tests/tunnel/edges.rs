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

/// A second registration of a node (a rolling update's new edge pod) takes the node's
/// new connections. The replaced session keeps carrying the connection it had open, and
/// stays, unused, until its edge leaves: closed once idle, its edge would reconnect and
/// take the node back, and the two would replace each other in turn.
#[tokio::test(start_paused = true)]
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

/// A token from the token file never takes the session of a node that proved itself
/// with its certificate: a second edge holding the node's token is refused with the
/// reason, and the certificate edge keeps its session and carries traffic.
#[test]
fn a_token_never_replaces_a_certificate_session() {
    let mut s = Setup::new(TOKENS);
    s.pki.client_cert("edge-1");
    let sink = servers::sink("127.0.0.1:0");
    let cloud = s.start_cloud(Table::new());
    let _certified = s.start_ready_edge(EdgeOpts {
        cert: Some("edge-edge-1"),
        ..edge_opts("edge-1", "", &[sink])
    });
    let session = |listing: Vec<serde_json::Value>| {
        let edge = listing.iter().find(|e| e["node"] == "edge-1").cloned();
        edge.map(|e| e["session"].clone())
    };
    let held = session(common::debug_edges(s.cloud_admin).unwrap()).expect("listed");

    let (token_edge, token_admin) = s.start_edge(edge_opts("edge-1", "token-one", &[sink]));
    token_edge.wait_log("registration refused", Duration::from_secs(10));
    let reason = format!(
        "the node is connected (session {held}) with a client certificate; a token-file token does not replace that session"
    );
    let said = token_edge.log_text();
    assert!(said.contains(&reason), "the edge is told why:\n{said}");
    cloud.wait_log(&format!("node `edge-1`: {reason}"), Duration::from_secs(5));
    assert!(!common::wait_http_ok(
        &format!("http://{token_admin}/readyz"),
        Duration::from_millis(300)
    ));
    // The certificate session is the one listed, and it carries a connection.
    assert_eq!(
        session(common::debug_edges(s.cloud_admin).unwrap()),
        Some(held)
    );
    let mut conn = connect_via(s.connect, &format!("edge-1:{}", sink.port()))
        .expect("CONNECT through the certificate edge");
    conn.write_all(&[7u8; 4096]).unwrap();
    conn.shutdown(Shutdown::Write).unwrap();
    let mut answer = String::new();
    conn.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("4096 "), "{answer}");
    let log = cloud.log_text();
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
