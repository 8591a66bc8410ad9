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
