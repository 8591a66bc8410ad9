//! What an operator sees and does: metrics, debug listings, config checks, reloads and
//! drains, against real processes.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::Shutdown;
use std::process::Command;
use std::time::Duration;

use common::config::allow;
use common::servers;
use common::{EdgeOpts, Setup, connect_via, sample};
use toml::Table;

const TOKENS: &str = "edge-1:token-one\n";

fn get(url: &str) -> String {
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "5", url])
        .output()
        .expect("curl");
    assert!(
        out.status.success(),
        "GET {url}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).to_string()
}

#[test]
fn metrics_move_as_traffic_flows() {
    let mut s = Setup::new(TOKENS);
    let sink = servers::sink("127.0.0.1:0");
    let _cloud = s.start_cloud(Table::new());
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
    let url = format!("http://{}/metrics", s.cloud_admin);
    let before = get(&url);
    assert_eq!(sample(&before, "tunnel_edges_connected"), 1.0, "{before}");

    let mut conn = connect_via(s.connect, &format!("edge-1:{}", sink.port())).expect("CONNECT");
    conn.write_all(&vec![7u8; 100_000]).unwrap();
    conn.shutdown(Shutdown::Write).unwrap();
    let mut answer = String::new();
    conn.read_to_string(&mut answer).unwrap();
    let _ = connect_via(s.connect, &format!("edge-1:{}", 1)).expect_err("forbidden target");

    let after = get(&url);
    let to_edge = sample(&after, "tunnel_bytes_total{direction=\"to_edge\"}")
        - sample(&before, "tunnel_bytes_total{direction=\"to_edge\"}");
    assert_eq!(to_edge, 100_000.0, "{after}");
    assert!(sample(&after, "tunnel_bytes_total{direction=\"from_edge\"}") >= answer.len() as f64);
    assert_eq!(
        sample(&after, "tunnel_connections_total{entry=\"connect\"}")
            - sample(&before, "tunnel_connections_total{entry=\"connect\"}"),
        2.0
    );
    assert_eq!(
        sample(&after, "tunnel_dial_failures_total{reason=\"forbidden\"}"),
        1.0,
        "{after}"
    );
    assert!(
        sample(&after, "tunnel_dial_duration_seconds_count") >= 1.0,
        "{after}"
    );
    assert!(
        after.contains("tunnel_heartbeat_rtt_seconds{node=\"edge-1\"}"),
        "{after}"
    );

    let edge_scrape = get(&format!("http://{edge_admin}/metrics"));
    assert_eq!(
        sample(&edge_scrape, "tunnel_edge_registered"),
        1.0,
        "{edge_scrape}"
    );
    assert_eq!(
        sample(&edge_scrape, "tunnel_edge_dials_total{reason=\"ok\"}"),
        1.0,
        "{edge_scrape}"
    );
    assert_eq!(
        sample(
            &edge_scrape,
            "tunnel_edge_dials_total{reason=\"forbidden\"}"
        ),
        1.0,
        "{edge_scrape}"
    );
    assert_eq!(
        sample(&edge_scrape, "tunnel_bytes_total{direction=\"from_cloud\"}"),
        100_000.0,
        "{edge_scrape}"
    );
}

#[test]
fn a_cloud_on_port_zero_reports_where_it_listens_and_serves_there() {
    let mut s = Setup::new(TOKENS);
    let sink = servers::sink("127.0.0.1:0");
    let unix = s.path().join("zero.sock");
    let config = s.path().join("zero.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[tunnel]
listen = "127.0.0.1:0"
cert = "cloud.crt"
key = "cloud.key"
token_file = "tokens"

[admin]
listen = "127.0.0.1:0"

[connect]
listen = "127.0.0.1:0"
unix = "{unix}"

[[node]]
name = "edge-1"

[[forward]]
listen = "127.0.0.1:0"
node = "edge-1"
target = "{sink}"
"#,
            unix = unix.display()
        ),
    )
    .unwrap();
    let mut cloud = common::Proc::start(
        "cloud-zero",
        s.path(),
        &["cloud", "--config", config.to_str().unwrap()],
    );
    let ready = cloud.wait_ready(Duration::from_secs(10));
    let keys = [
        "tunnel.listen",
        "forward[0].listen",
        "connect.listen",
        "admin.listen",
    ];
    for key in keys {
        assert_ne!(ready.addr(key).port(), 0, "{key}: {ready:?}");
    }
    assert_eq!(ready.0["connect.unix"], unix.display().to_string());
    assert_eq!(ready.0.len(), keys.len() + 1, "{ready:?}");

    // Each reported address is the one that serves: the admin listener answers, an edge
    // registers at the edge listener, and the forward and CONNECT carry bytes to it.
    assert!(common::wait_http_ok(
        &format!("http://{}/healthz", ready.addr("admin.listen")),
        Duration::from_secs(10)
    ));
    (s.tunnel, s.cloud_admin) = (ready.addr("tunnel.listen"), ready.addr("admin.listen"));
    let _edge = s.start_ready_edge(EdgeOpts {
        extra: allow(&[sink]),
        ..EdgeOpts::new("edge-1", "token-one")
    });
    let through_forward = std::net::TcpStream::connect(ready.addr("forward[0].listen")).unwrap();
    let through_connect = connect_via(
        ready.addr("connect.listen"),
        &format!("edge-1:{}", sink.port()),
    )
    .unwrap();
    for mut conn in [through_forward, through_connect] {
        conn.write_all(b"hello").unwrap();
        conn.shutdown(Shutdown::Write).unwrap();
        let mut answer = String::new();
        conn.read_to_string(&mut answer).unwrap();
        assert!(answer.starts_with("5 "), "{answer}");
    }
}

#[test]
fn debug_listing_shows_edges_and_live_connections_without_secrets() {
    let mut s = Setup::new(TOKENS);
    let source = servers::source("127.0.0.1:0");
    let _cloud = s.start_cloud(Table::new());
    let _edge = s.start_ready_edge(EdgeOpts {
        extra: allow(&[source]),
        ..EdgeOpts::new("edge-1", "token-one")
    });
    let mut conn = connect_via(s.connect, &format!("edge-1:{}", source.port())).expect("CONNECT");
    writeln!(conn, "3 65536").unwrap();
    let mut buf = vec![0u8; 65536];
    conn.read_exact(&mut buf).unwrap();

    let edges: serde_json::Value =
        serde_json::from_str(&get(&format!("http://{}/debug/edges", s.cloud_admin))).unwrap();
    assert_eq!(edges[0]["node"], "edge-1", "{edges}");
    assert_eq!(edges[0]["open_streams"], 1, "{edges}");
    assert!(
        edges[0]["remote"]
            .as_str()
            .unwrap()
            .starts_with("127.0.0.1:"),
        "{edges}"
    );
    let conns_text = get(&format!("http://{}/debug/connections", s.cloud_admin));
    let conns: serde_json::Value = serde_json::from_str(&conns_text).unwrap();
    assert_eq!(conns[0]["node"], "edge-1", "{conns}");
    assert_eq!(conns[0]["target"], source.to_string(), "{conns}");
    assert_eq!(conns[0]["bytes_from_edge"], 65536, "{conns}");
    assert_eq!(conns[0]["entry"], "connect", "{conns}");
    for listing in [edges.to_string(), conns_text] {
        assert!(
            !listing.contains("token-one"),
            "secret in listing: {listing}"
        );
    }
    drop(BufReader::new(conn).lines());
}

fn tunnel_check(config: &std::path::Path) -> std::process::Output {
    Command::new(common::BIN)
        .args(["check", "--config"])
        .arg(config)
        .env("NODE_NAME", "edge-1")
        .output()
        .expect("tunnel check")
}

/// `tunnel check --config F | head -1`: the reader closes the pipe after the first line,
/// and the check still exits 0, without a panic about the broken pipe.
#[test]
fn tunnel_check_into_a_pipe_closed_early_exits_cleanly() {
    let examples = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let mut child = Command::new(common::BIN)
        .args(["check", "--config"])
        .arg(examples.join("cloud.toml"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("tunnel check");
    // Closed before the check writes a byte.
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("tunnel check");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn tunnel_check_accepts_every_shipped_config_and_names_the_broken_key() {
    let examples = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let mut checked = 0;
    for entry in std::fs::read_dir(&examples).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let out = tunnel_check(&path);
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert_eq!(
                out.status.code(),
                Some(0),
                "{}: {stdout}{}",
                path.display(),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(
                stdout.contains(": ok")
                    && (stdout.contains("tunnel cloud") || stdout.contains("tunnel edge")),
                "{stdout}"
            );
            checked += 1;
        }
    }
    assert!(
        checked >= 4,
        "only {checked} example configs found in {}",
        examples.display()
    );

    let dir = tempfile::tempdir().unwrap();
    for (name, text, key) in [
        (
            "typo.toml",
            "node_name = \"e\"\n[cloud]\naddress = \"a:1\"\nserver_name = \"s\"\nca = \"c\"\ntoken = \"t\"\n[allow]\ntargetz = []\n",
            "targetz",
        ),
        (
            "bad-addr.toml",
            "[tunnel]\nlisten = \"nope\"\ncert = \"c\"\nkey = \"k\"\ntoken_file = \"t\"\n",
            "listen",
        ),
        ("what.toml", "[something]\nx = 1\n", "cannot tell whether"),
    ] {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        let out = tunnel_check(&path);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{name}: {stderr}");
        assert!(
            stderr.contains(name) && stderr.contains(key),
            "{name}: {stderr}"
        );
    }
}

#[test]
fn a_revoked_token_is_refused_after_the_reload_and_its_session_ends() {
    let mut s = Setup::new(TOKENS);
    let cloud = s.start_cloud(Table::new());
    let (edge, admin) = s.start_edge(EdgeOpts::new("edge-1", "token-one"));
    assert!(
        common::wait_http_ok(&format!("http://{admin}/readyz"), Duration::from_secs(10)),
        "{}",
        edge.log_text()
    );
    std::fs::write(s.path().join("tokens"), "edge-1:a-new-token\n").unwrap();
    cloud.wait_log("token file reloaded", Duration::from_secs(10));
    cloud.wait_log(
        "token revoked; closing the edge's session",
        Duration::from_secs(5),
    );
    // The edge reconnects with its old token and is refused.
    edge.wait_log("registration refused", Duration::from_secs(10));
    assert!(!common::wait_http_ok(
        &format!("http://{admin}/readyz"),
        Duration::from_millis(500)
    ));
    // A new edge with the new token gets in.
    let _new = s.start_ready_edge(EdgeOpts::new("edge-1", "a-new-token"));
}

/// An edge with a token file sends its current token every `reauth_interval`: while
/// it is the cloud's token for the node the session holds; once the edge's token is one
/// the cloud does not know (a rotation gone wrong, a stale or stolen token) the session
/// ends within the interval.
#[test]
fn the_edge_s_token_is_checked_again_while_the_session_lives() {
    let mut s = Setup::new(TOKENS);
    let cloud = s.start_cloud(Table::new());
    let token_file = s.path().join("edge-token");
    std::fs::write(&token_file, "token-one\n").unwrap();
    let edge = s.start_ready_edge(EdgeOpts {
        extra: toml::toml! {
            [cloud]
            token_file = (common::config::path_str(&token_file))
            reauth_interval = "1s"
        },
        ..EdgeOpts::new("edge-1", "")
    });
    let session_ended = "session no longer authorised";

    // Two rounds of a valid token after the first: the session holds. Counted in the
    // edge's log (three tokens sent), not a fixed sleep.
    edge.wait_log_count(
        "sent the current token to the cloud",
        3,
        Duration::from_secs(10),
    );
    assert!(
        !cloud.log_text().contains(session_ended),
        "the session ended although its token is valid:\n{}",
        cloud.log_text()
    );
    assert_eq!(common::metric(s.cloud_admin, "tunnel_edges_connected"), 1.0);

    std::fs::write(&token_file, "stolen-or-stale\n").unwrap();
    cloud.wait_log(
        "reason=the token is no longer in the token file",
        Duration::from_secs(5),
    );
    assert!(cloud.log_text().contains(session_ended));
    assert_eq!(
        common::metric(
            s.cloud_admin,
            "tunnel_sessions_revoked_total{reason=\"token_revoked\"}"
        ),
        1.0
    );
}

/// A session admitted by a client certificate ends when the certificate expires.
#[test]
fn a_session_ends_when_its_client_certificate_expires() {
    let mut s = Setup::new(TOKENS);
    let cloud = s.start_cloud(Table::new());
    s.pki.client_cert_expiring("edge-1", Duration::from_secs(4));
    let (edge, edge_admin) = s.start_edge(EdgeOpts {
        cert: Some("edge-edge-1"),
        ..EdgeOpts::new("edge-1", "")
    });
    assert!(
        common::wait_http_ok(
            &format!("http://{edge_admin}/readyz"),
            Duration::from_secs(10)
        ),
        "{}",
        edge.log_text()
    );
    let ended = "reason=the client certificate expired";
    assert!(
        !cloud.log_text().contains(ended),
        "ended before the certificate expired"
    );
    cloud.wait_log(ended, Duration::from_secs(8));
    assert_eq!(
        common::metric(
            s.cloud_admin,
            "tunnel_sessions_revoked_total{reason=\"certificate_expired\"}"
        ),
        1.0
    );
    // And the expired certificate does not get it back in, not even by resuming the
    // TLS session its first handshake left.
    edge.wait_log("the client certificate expired", Duration::from_secs(10));
    assert!(!common::wait_http_ok(
        &format!("http://{}/readyz", edge_admin),
        Duration::from_millis(500)
    ));
    assert_eq!(common::metric(s.cloud_admin, "tunnel_edges_connected"), 0.0);
}

#[test]
fn a_rotated_certificate_is_served_to_new_connections() {
    let mut s = Setup::new(TOKENS);
    let cloud = s.start_cloud(Table::new());
    let old = common::served_fingerprint(s.tunnel);
    assert_eq!(old, common::file_fingerprint(&s.path().join("cloud.crt")));
    s.pki.issue(
        "cloud",
        &["tunnel-cloud", "127.0.0.1"],
        "tunnel-cloud",
        rcgen::ExtendedKeyUsagePurpose::ServerAuth,
    );
    cloud.wait_log("TLS certificate reloaded", Duration::from_secs(10));
    let new = common::served_fingerprint(s.tunnel);
    assert_ne!(new, old, "still serving the old certificate");
    assert_eq!(new, common::file_fingerprint(&s.path().join("cloud.crt")));
    // Edges verify and register against the new certificate.
    let _edge = s.start_ready_edge(EdgeOpts::new("edge-1", "token-one"));
}

#[test]
fn a_drain_during_a_long_transfer_loses_no_bytes_and_the_edge_moves_first() {
    const LEN: u64 = 48 << 20;
    let mut s = Setup::new(TOKENS);
    let source = servers::source("127.0.0.1:0");
    let mut cloud_a = s.start_cloud(toml::toml! {
        [[node]]
        name = "edge-1"
    });
    // A second, independent replica the edge can move to.
    let b_config = s.path().join("cloud-b.toml");
    std::fs::write(
        &b_config,
        "[tunnel]\nlisten = \"127.0.0.1:0\"\ncert = \"cloud.crt\"\nkey = \"cloud.key\"\ntoken_file = \"tokens\"\ncloud_id = \"b\"\n\n[connect]\nlisten = \"127.0.0.1:0\"\n\n[[node]]\nname = \"edge-1\"\n",
    )
    .unwrap();
    let mut cloud_b = common::Proc::start(
        "cloud-b",
        s.path(),
        &["cloud", "--config", b_config.to_str().unwrap()],
    );
    let b = cloud_b.wait_ready(Duration::from_secs(10));
    let (b_tunnel, b_connect) = (b.addr("tunnel.listen"), b.addr("connect.listen"));
    let edge_config = s.path().join("edge-drain.toml");
    std::fs::write(
        &edge_config,
        format!(
            "node_name = \"edge-1\"\n\n[cloud]\naddress = \"{}\"\naddresses = [\"{b_tunnel}\"]\nserver_name = \"tunnel-cloud\"\nca = \"ca.crt\"\ntoken = \"token-one\"\n\n[admin]\nlisten = \"127.0.0.1:0\"\n\n[allow]\ntargets = [\"{source}\"]\n",
            s.tunnel
        ),
    )
    .unwrap();
    let mut edge = common::Proc::start(
        "edge-drain",
        s.path(),
        &["edge", "--config", edge_config.to_str().unwrap()],
    );
    let edge_admin = edge
        .wait_ready(Duration::from_secs(10))
        .addr("admin.listen");
    assert!(
        common::wait_http_ok(
            &format!("http://{edge_admin}/readyz"),
            Duration::from_secs(10)
        ),
        "{}",
        edge.log_text()
    );
    cloud_a.wait_log("edge registered", Duration::from_secs(5));

    // A transfer through A that the client reads slowly, so it outlives the SIGTERM.
    let mut conn =
        connect_via(s.connect, &format!("edge-1:{}", source.port())).expect("CONNECT via A");
    writeln!(conn, "77 {LEN}").unwrap();
    let mut hasher_input = Vec::with_capacity(LEN as usize);
    let mut buf = vec![0u8; 256 * 1024];
    let mut signalled = false;
    loop {
        let n = conn
            .read(&mut buf)
            .expect("transfer through the draining cloud");
        if n == 0 {
            break;
        }
        hasher_input.extend_from_slice(&buf[..n]);
        if !signalled && hasher_input.len() > (4 << 20) {
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(cloud_a.pid()),
                nix::sys::signal::Signal::SIGTERM,
            )
            .unwrap();
            signalled = true;
            // The edge opens its session to B while A still carries this transfer.
            edge.wait_log(
                "cloud asked this edge to move to another replica",
                Duration::from_secs(5),
            );
            cloud_b.wait_log("edge registered", Duration::from_secs(5));
            let mut via_b = connect_via(b_connect, &format!("edge-1:{}", source.port()))
                .expect("new connection via B during the drain");
            writeln!(via_b, "1 1000").unwrap();
            let mut small = Vec::new();
            via_b.read_to_end(&mut small).unwrap();
            assert_eq!(small.len(), 1000);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(signalled);
    // The target has finished; our close ends the connection, and with it A's drain.
    drop(conn);
    let (n, got) = servers::hash_reader(&mut hasher_input.as_slice()).unwrap();
    assert_eq!(
        (n, got),
        (LEN, servers::send_pattern(None, 77, LEN).unwrap()),
        "bytes lost or changed in the drain"
    );
    assert_eq!(
        cloud_a.wait_exit(Duration::from_secs(10)),
        Some(0),
        "A did not exit after draining"
    );
    let log = cloud_a.log_text();
    assert!(
        log.contains("draining") && log.contains("drained: no connection left"),
        "{log}"
    );
}

/// The serial (lowercase hex) of the certificate the listener at `addr` serves now, if
/// it verifies against the CA in `dir` for `tunnel-cloud`: what a fresh handshake gets.
fn served_serial(addr: std::net::SocketAddr, dir: &std::path::Path) -> String {
    let script = format!(
        "openssl s_client -connect {addr} -servername tunnel-cloud -verify_hostname tunnel-cloud -CAfile {ca} -verify_return_error </dev/null 2>/dev/null | openssl x509 -noout -serial",
        ca = dir.join("ca.crt").display()
    );
    let out = Command::new("sh")
        .args(["-c", &script])
        .output()
        .expect("openssl");
    let text = String::from_utf8_lossy(&out.stdout).trim().to_lowercase();
    let serial = text.strip_prefix("serial=").unwrap_or_default();
    assert!(!serial.is_empty(), "no verified certificate served: {text}");
    serial.to_string()
}

/// `csr.serving`: with no certificate files at all the replica serves one it signed
/// itself; an edge that only knows the CA registers and carries bytes, and a renewal
/// (every 8 s with a 12 s lifetime) reaches new handshakes while a proxied connection
/// opened before it keeps carrying bytes and the edge's session is not cut.
#[test]
fn a_self_issued_serving_certificate_renews_under_an_open_connection() {
    let mut s = Setup::new("edge-1:token-one\nedge-2:token-two\n");
    let sink = servers::sink("127.0.0.1:0");
    let mut config = s.cloud_config(toml::toml! {
        [csr]
        serving = true
        ca_key = "ca.key"
        serving_names = ["127.0.0.1"]
        serving_lifetime = "12s"
    });
    let tunnel = config["tunnel"].as_table_mut().unwrap();
    tunnel.remove("cert");
    tunnel.remove("key");
    let path = s.path().join("cloud.toml");
    common::config::write_toml(&path, &config);
    // Nothing to fall back to: the files are gone.
    std::fs::remove_file(s.path().join("cloud.crt")).unwrap();
    std::fs::remove_file(s.path().join("cloud.key")).unwrap();
    let mut cloud = common::Proc::start(
        "cloud",
        s.path(),
        &["cloud", "--config", path.to_str().unwrap()],
    );
    s.cloud_ready(&mut cloud);
    let first = served_serial(s.tunnel, s.path());
    assert!(
        common::probe::count_lines(
            &cloud.log_text(),
            &[
                "serving certificate issued",
                &format!("serial={first}"),
                "expires="
            ]
        ) == 1,
        "the issue is logged with its serial and expiry:\n{}",
        cloud.log_text()
    );
    let allow = allow(&[sink]);
    let _edge = s.start_ready_edge(EdgeOpts {
        extra: allow.clone(),
        ..EdgeOpts::new("edge-1", "token-one")
    });
    let mut canary = common::probe::Canary::open(s.connect, &format!("edge-1:{}", sink.port()));
    canary.feed(64 << 10);

    cloud.wait_log("serving certificate renewed", Duration::from_secs(20));
    let second = served_serial(s.tunnel, s.path());
    assert_ne!(
        second, first,
        "a fresh handshake still gets the first certificate"
    );
    assert_eq!(
        common::probe::count_lines(
            &cloud.log_text(),
            &["serving certificate renewed", &format!("serial={second}")]
        ),
        1,
        "{}",
        cloud.log_text()
    );
    canary.feed(64 << 10);
    canary.finish();
    assert_eq!(
        common::probe::count_lines(&cloud.log_text(), &["edge registered", "edge-1"]),
        1,
        "the renewal cut the edge's session:\n{}",
        cloud.log_text()
    );
    // A new edge verifies the renewed certificate and registers.
    let _edge2 = s.start_ready_edge(EdgeOpts {
        extra: allow,
        ..EdgeOpts::new("edge-2", "token-two")
    });
}

/// `transport.max_connections_per_listener`: a client beyond the limit waits unserved in
/// the accept queue, the listener says it is at its limit, and the client is served as
/// soon as one of those before it closes.
#[test]
fn a_client_beyond_the_connection_limit_waits_until_one_closes() {
    use std::net::TcpStream;

    let mut s = Setup::new(TOKENS);
    let sink = servers::sink("127.0.0.1:0");
    let cloud = s.start_cloud(toml::toml! { [transport] max_connections_per_listener = 2 });
    let _edge = s.start_ready_edge(EdgeOpts {
        extra: allow(&[sink]),
        ..EdgeOpts::new("edge-1", "token-one")
    });
    let authority = format!("edge-1:{}", sink.port());
    let first = connect_via(s.connect, &authority).expect("first CONNECT");
    let _second = connect_via(s.connect, &authority).expect("second CONNECT");
    cloud.wait_log("listener=connect", Duration::from_secs(5));
    assert!(
        common::probe::count_lines(
            &cloud.log_text(),
            &["at its connection limit", "listener=connect"]
        ) == 1,
        "{}",
        cloud.log_text()
    );

    let mut third = TcpStream::connect(s.connect).expect("the kernel queues the third");
    write!(
        third,
        "CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n"
    )
    .unwrap();
    third
        .set_read_timeout(Some(Duration::from_millis(1500)))
        .unwrap();
    let mut status = [0u8; 12];
    match third.read(&mut status) {
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) => {}
        other => panic!("a third client was served at the limit of 2: {other:?}"),
    }

    drop(first);
    third
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    third
        .read_exact(&mut status)
        .expect("the third is served once the first closed");
    assert_eq!(&status, b"HTTP/1.1 200");
}
