//! What an operator sees and does: metrics, debug listings, config checks, reloads and
//! drains; real processes where the process is the subject (the ready file, `tunnel
//! check`, signals, the open-file limit), the rest in process ([`common::inproc`]).

#![expect(
    clippy::unwrap_used,
    reason = "a panic with its message is how a test reports failure"
)]
mod common;
#[path = "../../xtask/bench/src/simedge.rs"]
#[expect(
    dead_code,
    reason = "the bench's simulated edges: this test's present tokens, not certificates"
)]
mod simedge;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr};
use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::config::allow;
use common::inproc::{self, InProcess, Side};
use common::servers;
use common::{EdgeOpts, Setup, connect_via, sample};
use nix::sys::resource::{Resource, getrlimit, setrlimit};
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

#[tokio::test]
async fn metrics_move_as_traffic_flows() {
    let mut t = InProcess::start(TOKENS, Table::new()).await;
    let sink = servers::sink("127.0.0.1:0");
    let edge = t
        .start_ready_edge(EdgeOpts {
            extra: allow(&[sink]),
            ..EdgeOpts::new("edge-1", "token-one")
        })
        .await;
    let (connect, cloud_admin, edge_admin) = (t.s.connect, t.s.cloud_admin, edge.admin().await);
    inproc::blocking(move || metrics_move(connect, cloud_admin, edge_admin, sink)).await;
}

/// The body of [`metrics_move_as_traffic_flows`], a client of the cloud's CONNECT proxy
/// at `connect` and of the admin listeners.
fn metrics_move(
    connect: SocketAddr,
    cloud_admin: SocketAddr,
    edge_admin: SocketAddr,
    sink: SocketAddr,
) {
    let url = format!("http://{cloud_admin}/metrics");
    let before = get(&url);
    assert_eq!(sample(&before, "tunnel_edges_connected"), 1.0, "{before}");

    let mut conn = connect_via(connect, &format!("edge-1:{}", sink.port())).expect("CONNECT");
    conn.write_all(&vec![7u8; 100_000]).unwrap();
    conn.shutdown(Shutdown::Write).unwrap();
    let mut answer = String::new();
    conn.read_to_string(&mut answer).unwrap();
    let _ = connect_via(connect, &format!("edge-1:{}", 1)).expect_err("forbidden target");

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

/// Starts a process at a soft open-file limit of 1024 under the hard limit this process
/// has, as containerd 2 starts a container: prlimit sets the soft limit, then execs the
/// process (same pid).
const AT_1024: &[&str] = &["prlimit", "--nofile=1024:", "--"];

/// `process` logged that it raised its soft open-file limit from 1024 to `hard`, and has.
fn assert_raised_to(process: &common::Proc, hard: u64) {
    process.wait_log("open-file limit", Duration::from_secs(10));
    let log = process.log_text();
    assert!(
        log.contains(&format!("soft_was=1024 soft={hard} hard={hard}")),
        "{log}"
    );
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", process.pid())).unwrap();
    let open_files = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    assert_eq!(
        open_files.split_whitespace().collect::<Vec<_>>()[3..5],
        [hard.to_string(), hard.to_string()],
        "{open_files}"
    );
}

/// An edge holds a descriptor per proxied connection: it raises its limit as the cloud
/// does.
#[test]
fn an_edge_started_at_1024_descriptors_raises_its_limit() {
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    assert!(
        hard > 1024,
        "cannot run: the hard open-file limit is {hard}"
    );
    let mut s = Setup::new(TOKENS);
    // No cloud there: the edge raises its limit before it dials.
    let no_cloud = common::ClosedPort::new();
    s.tunnel = no_cloud.addr;
    let config = s.path().join("edge.toml");
    common::config::write_toml(
        &config,
        &s.edge_config(&EdgeOpts::new("edge-1", "token-one")),
    );
    let edge = common::Proc::start_via(
        "edge",
        s.path(),
        AT_1024,
        &["edge", "--config", config.to_str().unwrap()],
    );
    assert_raised_to(&edge, hard);
    assert!(
        edge.log_text().contains("room for about"),
        "{}",
        edge.log_text()
    );
}

/// containerd 2 starts a container at a soft limit of 1024 descriptors, one per edge on
/// a replica: the cloud raises its soft limit to the hard one at start, says so, and
/// holds more than 1,000 edges. A process: the limit is the process's.
#[test]
fn a_cloud_started_at_1024_descriptors_raises_its_limit_and_holds_1100_edges() {
    const EDGES: usize = 1_100;
    // The simulated edges' sockets are this process's: its own soft limit goes up too.
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    assert!(
        hard >= EDGES as u64 + 200,
        "cannot run: the hard open-file limit is {hard}, below the {EDGES} edges and this test's own descriptors"
    );
    setrlimit(Resource::RLIMIT_NOFILE, hard, hard).unwrap();
    let tokens: String = (0..EDGES)
        .map(|i| format!("{}:token-sim\n", simedge::node_name(i)))
        .collect();
    let mut s = Setup::new(&tokens);
    let mut cloud = s.spawn_cloud(Table::new(), AT_1024);
    s.cloud_ready(&mut cloud);
    assert_raised_to(&cloud, hard);

    // Edges run on the runtime's worker while this thread waits on what the cloud says.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let ca = s.path().join("ca.crt");
    let deadline = Instant::now() + Duration::from_secs(120);
    let stuck = |what: String| -> ! {
        let log = cloud.log_text();
        let tail: Vec<&str> = log.lines().rev().take(20).collect();
        let connected = common::metric(s.cloud_admin, "tunnel_edges_connected");
        panic!(
            "after 120 s, {what}; tunnel_edges_connected reads {connected} (0: the admin listener did not answer); the cloud's log ends:\n{}",
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        )
    };
    // Returns once the last edge has a registration slot (32 at a time): it hangs while
    // the cloud accepts no more.
    let spawned = rt.block_on(async {
        let clouds = [s.tunnel];
        let token = simedge::Credential::Token("token-sim".into());
        let edges = simedge::Fleet::new(&clouds, 0, &ca, &token, EDGES)
            .unwrap()
            .start(32);
        tokio::time::timeout_at(deadline.into(), edges).await
    });
    let Ok(stats) = spawned else {
        stuck(format!("the {EDGES} edges were not all started"))
    };
    let stats = stats.unwrap();
    loop {
        let registered = stats.registered.load(Ordering::Relaxed);
        let connected = common::metric(s.cloud_admin, "tunnel_edges_connected");
        if registered == EDGES as u64 && connected == EDGES as f64 {
            break;
        }
        if Instant::now() > deadline {
            stuck(format!(
                "{registered} of {EDGES} edges were welcomed, {} connections failed",
                stats.failed.load(Ordering::Relaxed)
            ));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(stats.failed.load(Ordering::Relaxed), 0);
}

#[tokio::test]
async fn debug_listing_shows_edges_and_live_connections_without_secrets() {
    let mut t = InProcess::start(TOKENS, Table::new()).await;
    let source = servers::source("127.0.0.1:0");
    let _edge = t
        .start_ready_edge(EdgeOpts {
            extra: allow(&[source]),
            ..EdgeOpts::new("edge-1", "token-one")
        })
        .await;
    let (connect, cloud_admin) = (t.s.connect, t.s.cloud_admin);
    inproc::blocking(move || debug_listing(connect, cloud_admin, source)).await;
}

/// The body of [`debug_listing_shows_edges_and_live_connections_without_secrets`].
fn debug_listing(connect: SocketAddr, cloud_admin: SocketAddr, source: SocketAddr) {
    let mut conn = connect_via(connect, &format!("edge-1:{}", source.port())).expect("CONNECT");
    writeln!(conn, "3 65536").unwrap();
    let mut buf = vec![0u8; 65536];
    conn.read_exact(&mut buf).unwrap();

    let edges: serde_json::Value =
        serde_json::from_str(&get(&format!("http://{cloud_admin}/debug/edges"))).unwrap();
    assert_eq!(edges[0]["node"], "edge-1", "{edges}");
    assert_eq!(edges[0]["open_streams"], 1, "{edges}");
    assert!(
        edges[0]["remote"]
            .as_str()
            .unwrap()
            .starts_with("127.0.0.1:"),
        "{edges}"
    );
    let conns_text = get(&format!("http://{cloud_admin}/debug/connections"));
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

#[tokio::test(start_paused = true)]
async fn a_revoked_token_is_refused_after_the_reload_and_its_session_ends() {
    let mut t = InProcess::start(TOKENS, Table::new()).await;
    let edge = t
        .start_ready_edge(EdgeOpts::new("edge-1", "token-one"))
        .await;
    std::fs::write(t.path().join("tokens"), "edge-1:a-new-token\n").unwrap();
    t.wait_log(Side::Cloud, "token file reloaded", Duration::from_secs(10))
        .await;
    t.wait_log(
        Side::Cloud,
        "token revoked; closing the edge's session",
        Duration::from_secs(5),
    )
    .await;
    // The edge reconnects with its old token and is refused.
    t.wait_log(Side::Edge, "registration refused", Duration::from_secs(10))
        .await;
    let admin = edge.admin().await;
    let ready = inproc::blocking(move || {
        common::wait_http_ok(
            &format!("http://{admin}/readyz"),
            Duration::from_millis(500),
        )
    })
    .await;
    assert!(!ready);
    // A new edge with the new token gets in.
    let _new = t
        .start_ready_edge(EdgeOpts::new("edge-1", "a-new-token"))
        .await;
}

/// An edge with a token file sends its current token every `reauth_interval`: while
/// it is the cloud's token for the node the session holds; once the edge's token is one
/// the cloud does not know (a rotation gone wrong, a stale or stolen token) the session
/// ends within the interval.
#[tokio::test(start_paused = true)]
async fn the_edge_s_token_is_checked_again_while_the_session_lives() {
    let mut t = InProcess::start(TOKENS, Table::new()).await;
    let token_file = t.path().join("edge-token");
    std::fs::write(&token_file, "token-one\n").unwrap();
    let _edge = t
        .start_ready_edge(EdgeOpts {
            extra: toml::toml! {
                [cloud]
                token_file = (common::config::path_str(&token_file))
                reauth_interval = "1s"
            },
            ..EdgeOpts::new("edge-1", "")
        })
        .await;
    let session_ended = "session no longer authorised";
    let cloud_admin = t.s.cloud_admin;

    // Two rounds of a valid token after the first: the session holds. Counted in the
    // edge's log (three tokens sent), not a fixed sleep.
    t.logs
        .wait_count(
            Side::Edge,
            &["sent the current token to the cloud"],
            3,
            Duration::from_secs(10),
        )
        .await;
    let log = t.logs.lines(Side::Cloud).join("\n");
    assert!(
        !log.contains(session_ended),
        "the session ended although its token is valid:\n{log}"
    );
    let connected =
        inproc::blocking(move || common::metric(cloud_admin, "tunnel_edges_connected")).await;
    assert_eq!(connected, 1.0);

    std::fs::write(&token_file, "stolen-or-stale\n").unwrap();
    t.wait_log(
        Side::Cloud,
        "reason=the token is no longer in the token file",
        Duration::from_secs(5),
    )
    .await;
    assert!(t.logs.text().contains(session_ended));
    let revoked = inproc::blocking(move || {
        common::metric(
            cloud_admin,
            "tunnel_sessions_revoked_total{reason=\"token_revoked\"}",
        )
    })
    .await;
    assert_eq!(revoked, 1.0);
}

/// A session admitted by a client certificate ends when the certificate expires. On the
/// real clock: a certificate expires by the wall clock, which paused time does not move.
#[tokio::test]
async fn a_session_ends_when_its_client_certificate_expires() {
    let mut t = InProcess::start(TOKENS, Table::new()).await;
    t.s.pki
        .client_cert_expiring("edge-1", Duration::from_secs(4));
    let edge = t
        .start_ready_edge(EdgeOpts {
            cert: Some("edge-edge-1"),
            ..EdgeOpts::new("edge-1", "")
        })
        .await;
    let ended = "reason=the client certificate expired";
    assert_eq!(
        t.logs.count(Side::Cloud, &[ended]),
        0,
        "ended before the certificate expired"
    );
    t.wait_log(Side::Cloud, ended, Duration::from_secs(8)).await;
    let (cloud_admin, edge_admin) = (t.s.cloud_admin, edge.admin().await);
    let revoked = inproc::blocking(move || {
        common::metric(
            cloud_admin,
            "tunnel_sessions_revoked_total{reason=\"certificate_expired\"}",
        )
    })
    .await;
    assert_eq!(revoked, 1.0);
    // And the expired certificate does not get it back in, not even by resuming the
    // TLS session its first handshake left.
    t.wait_log(
        Side::Edge,
        "the client certificate expired",
        Duration::from_secs(10),
    )
    .await;
    let (ready_again, connected) = inproc::blocking(move || {
        let ready_again = common::wait_http_ok(
            &format!("http://{edge_admin}/readyz"),
            Duration::from_millis(500),
        );
        (
            ready_again,
            common::metric(cloud_admin, "tunnel_edges_connected"),
        )
    })
    .await;
    assert!(!ready_again);
    assert_eq!(connected, 0.0);
}

#[tokio::test(start_paused = true)]
async fn a_rotated_certificate_is_served_to_new_connections() {
    let mut t = InProcess::start(TOKENS, Table::new()).await;
    let (tunnel, cert) = (t.s.tunnel, t.path().join("cloud.crt"));
    let served = move || inproc::blocking(move || common::served_fingerprint(tunnel));
    let old = served().await;
    assert_eq!(old, common::file_fingerprint(&cert));
    t.s.pki.issue(
        "cloud",
        &["tunnel-cloud", "127.0.0.1"],
        "tunnel-cloud",
        rcgen::ExtendedKeyUsagePurpose::ServerAuth,
    );
    t.wait_log(
        Side::Cloud,
        "TLS certificate reloaded",
        Duration::from_secs(10),
    )
    .await;
    let new = served().await;
    assert_ne!(new, old, "still serving the old certificate");
    assert_eq!(new, common::file_fingerprint(&cert));
    // Edges verify and register against the new certificate.
    let _edge = t
        .start_ready_edge(EdgeOpts::new("edge-1", "token-one"))
        .await;
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
#[tokio::test(start_paused = true)]
async fn a_self_issued_serving_certificate_renews_under_an_open_connection() {
    let s = Setup::new("edge-1:token-one\nedge-2:token-two\n");
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
    // Nothing to fall back to: the files are gone.
    std::fs::remove_file(s.path().join("cloud.crt")).unwrap();
    std::fs::remove_file(s.path().join("cloud.key")).unwrap();
    let mut t = InProcess::start_with(s, config).await;
    let (tunnel, dir) = (t.s.tunnel, t.path().to_owned());
    let served = move || {
        let dir = dir.clone();
        inproc::blocking(move || served_serial(tunnel, &dir))
    };
    let first = served().await;
    assert!(
        common::probe::count_lines(
            &t.logs.text(),
            &[
                "serving certificate issued",
                &format!("serial={first}"),
                "expires="
            ]
        ) == 1,
        "the issue is logged with its serial and expiry:\n{}",
        t.logs.text()
    );
    let allow = allow(&[sink]);
    let _edge = t
        .start_ready_edge(EdgeOpts {
            extra: allow.clone(),
            ..EdgeOpts::new("edge-1", "token-one")
        })
        .await;
    let (connect, authority) = (t.s.connect, format!("edge-1:{}", sink.port()));
    let mut canary = inproc::blocking(move || {
        let mut canary = common::probe::Canary::open(connect, &authority);
        canary.feed(64 << 10);
        canary
    })
    .await;

    t.wait_log(
        Side::Cloud,
        "serving certificate renewed",
        Duration::from_secs(20),
    )
    .await;
    let second = served().await;
    assert_ne!(
        second, first,
        "a fresh handshake still gets the first certificate"
    );
    assert_eq!(
        common::probe::count_lines(
            &t.logs.text(),
            &["serving certificate renewed", &format!("serial={second}")]
        ),
        1,
        "{}",
        t.logs.text()
    );
    inproc::blocking(move || {
        canary.feed(64 << 10);
        canary.finish();
    })
    .await;
    assert_eq!(
        common::probe::count_lines(&t.logs.text(), &["edge registered", "edge-1"]),
        1,
        "the renewal cut the edge's session:\n{}",
        t.logs.text()
    );
    // A new edge verifies the renewed certificate and registers.
    let _edge2 = t
        .start_ready_edge(EdgeOpts {
            extra: allow,
            ..EdgeOpts::new("edge-2", "token-two")
        })
        .await;
}

/// `transport.max_connections_per_listener`: a client beyond the limit waits unserved in
/// the accept queue, the listener says it is at its limit, and the client is served as
/// soon as one of those before it closes.
/// In paused time: the third client's wait is on the runtime's clock.
#[tokio::test(start_paused = true)]
async fn a_client_beyond_the_connection_limit_waits_until_one_closes() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    let mut t = InProcess::start(
        TOKENS,
        toml::toml! { [transport] max_connections_per_listener = 2 },
    )
    .await;
    // In this runtime: a client's close ends its connection with no other thread's
    // help, before the paused clock can move on.
    let echo = inproc::echo_server().await;
    let _edge = t
        .start_ready_edge(EdgeOpts {
            extra: allow(&[echo]),
            ..EdgeOpts::new("edge-1", "token-one")
        })
        .await;
    let authority = format!("edge-1:{}", echo.port());
    let (status, first) = inproc::connect(t.s.connect, &authority).await;
    assert!(
        status.starts_with("HTTP/1.1 200"),
        "first CONNECT: {status}"
    );
    let (status, _second) = inproc::connect(t.s.connect, &authority).await;
    assert!(
        status.starts_with("HTTP/1.1 200"),
        "second CONNECT: {status}"
    );
    t.wait_log(Side::Any, "listener=connect", Duration::from_secs(5))
        .await;
    assert!(
        common::probe::count_lines(
            &t.logs.text(),
            &["at its connection limit", "listener=connect"]
        ) == 1,
        "{}",
        t.logs.text()
    );

    let mut third = tokio::net::TcpStream::connect(t.s.connect)
        .await
        .expect("the kernel queues the third");
    third
        .write_all(format!("CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut status = [0u8; 12];
    match tokio::time::timeout(Duration::from_millis(1500), third.read(&mut status)).await {
        Err(_elapsed) => {}
        Ok(other) => panic!("a third client was served at the limit of 2: {other:?}"),
    }

    drop(first);
    tokio::time::timeout(Duration::from_secs(10), third.read_exact(&mut status))
        .await
        .expect("the third is served once the first closed")
        .unwrap();
    assert_eq!(&status, b"HTTP/1.1 200");
}

/// The admin listener bound on a node address (as deploy/ binds it, for a Prometheus on
/// another node) serves `/metrics` and the probes to a client from elsewhere, but not
/// `/debug/`: the log level, the edges and the connections stay for clients on this
/// host. The client is in a network namespace of the test's own, over a veth.
#[tokio::test]
async fn the_admin_listener_serves_metrics_beyond_this_host_but_not_debug() {
    if !common::privileged::is_root() {
        common::privileged::cannot_run("a network namespace for the remote client: needs root");
        return;
    }
    let ns = common::netns::EdgeNetns::new().expect("network namespace");
    let admin = SocketAddr::new(ns.host_ip.into(), 0);
    let t = InProcess::start(
        TOKENS,
        toml::toml! {
            [admin]
            listen = (admin.to_string())
        },
    )
    .await;
    let admin = t.s.cloud_admin;
    let remote = move |args: &[&str], path: &str| {
        let out = ns
            .command("curl")
            .args(["-sS", "-m", "10", "-o", "/dev/null", "-w", "%{http_code}"])
            .args(args)
            .arg(format!("http://{admin}{path}"))
            .output()
            .expect("curl");
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let answers = inproc::blocking(move || {
        [
            ("/metrics", &[][..]),
            ("/healthz", &[][..]),
            ("/readyz", &[][..]),
            ("/debug/edges", &[][..]),
            ("/debug/connections", &[][..]),
            ("/debug/flags/v", &[][..]),
            ("/debug/flags/v", &["-X", "PUT", "-d", "trace"][..]),
        ]
        .map(|(path, args)| (path, args.is_empty(), remote(args, path)))
    })
    .await;
    for (path, get, status) in answers {
        println!(
            "from another host: {} {path}: {status}",
            if get { "GET" } else { "PUT" }
        );
        let expected = if path.starts_with("/debug/") {
            "403"
        } else {
            "200"
        };
        assert_eq!(status, expected, "{path}");
    }
}
