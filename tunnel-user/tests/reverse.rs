//! Edge-to-cloud connections, cluster identities and edge hooks, end to end: real
//! `tunnel cloud` and `tunnel edge` processes on loopback with real TLS.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{EdgeOpts, Proc, Setup};
use toml::Table;

/// `python3 -m http.server` on 127.0.0.1, killed (by PID) when dropped.
struct HttpServer {
    _child: common::ChildGuard,
    addr: SocketAddr,
}

impl HttpServer {
    fn start(dir: &Path) -> Self {
        let (_child, addr) = common::python_http_server("127.0.0.1", dir);
        let server = Self { _child, addr };
        assert!(
            common::wait_http_ok(&format!("http://{addr}/hello.txt"), Duration::from_secs(10)),
            "http.server did not start"
        );
        server
    }
}

fn www(s: &Setup, body: &[u8]) -> std::path::PathBuf {
    let www = s.path().join("www");
    std::fs::create_dir_all(&www).expect("www");
    std::fs::write(www.join("hello.txt"), "hello from the cloud side\n").expect("hello.txt");
    std::fs::write(www.join("big.bin"), body).expect("big.bin");
    www
}

fn curl(args: &[&str]) -> std::process::Output {
    Command::new("curl")
        .args(["-sS", "--max-time", "15"])
        .args(args)
        .output()
        .expect("curl")
}

#[test]
fn curl_on_the_edge_reaches_a_cloud_side_http_server_and_unlisted_targets_are_refused() {
    let mut s = Setup::new("edge-1:token-one\n");
    // 8 MiB: many stream windows' worth of frames, so flow control is exercised.
    let body: Vec<u8> = (0..8u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let http = HttpServer::start(&www(&s, &body));
    // A live server that is not in the allowlist: a refusal can only be the allowlist's.
    let unlisted = HttpServer::start(&s.path().join("www"));
    let cloud = s.start_cloud(toml::toml! {
        [reverse.allow]
        "edge-1" = [(http.addr.to_string())]
    });
    let (edge, edge_admin) = s.start_edge(EdgeOpts {
        extra: toml::toml! {
            [[reverse.forward]]
            listen = "127.0.0.1:0"
            target = (http.addr.to_string())

            [[reverse.forward]]
            listen = "127.0.0.1:0"
            target = (unlisted.addr.to_string())
        },
        ..EdgeOpts::new("edge-1", "token-one")
    });
    assert!(
        common::wait_http_ok(
            &format!("http://{edge_admin}/readyz"),
            Duration::from_secs(10)
        ),
        "edge not ready:\n{}",
        edge.log_text()
    );
    let ready = edge.ready();
    let (listed, refused) = (
        ready.addr("reverse.forward[0].listen"),
        ready.addr("reverse.forward[1].listen"),
    );

    let out = curl(&[&format!("http://{listed}/hello.txt")]);
    assert!(
        out.status.success(),
        "curl through the edge listener failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        edge.log_text()
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "hello from the cloud side\n"
    );
    let out = curl(&[&format!("http://{listed}/big.bin")]);
    assert!(
        out.status.success(),
        "big download failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.stdout == body,
        "8 MiB body differs ({} bytes arrived)",
        out.stdout.len()
    );

    let out = curl(&[&format!("http://{refused}/hello.txt")]);
    assert!(
        !out.status.success(),
        "a target outside reverse.allow was reached: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    cloud.wait_log(
        "refused an edge-to-cloud target outside reverse.allow",
        Duration::from_secs(5),
    );
    let line = cloud
        .log_text()
        .lines()
        .find(|l| l.contains("refused an edge-to-cloud target"))
        .unwrap_or_default()
        .to_string();
    assert!(
        line.contains("edge-1") && line.contains(&unlisted.addr.to_string()),
        "refusal not attributed to node and target: {line}"
    );
    edge.wait_log(
        "cloud refused a target outside its allowlist",
        Duration::from_secs(5),
    );

    let m = common::scrape(s.cloud_admin);
    assert!(
        m.contains("tunnel_connections_total{entry=\"reverse\"} 3"),
        "cloud metrics:\n{m}"
    );
    let m = common::scrape(edge_admin);
    assert!(
        m.contains("tunnel_edge_reverse_connections_total{reason=\"ok\"} 2"),
        "edge metrics:\n{m}"
    );
    assert!(
        m.contains("tunnel_edge_reverse_connections_total{reason=\"forbidden\"} 1"),
        "edge metrics:\n{m}"
    );
}

#[test]
fn edge_listener_without_a_session_closes_its_client_promptly() {
    let mut s = Setup::new("edge-1:token-one\n");
    // No cloud at all (nothing listens where the edge dials): the connection must not
    // hang until some long timeout.
    let no_cloud = common::ClosedPort::new();
    s.tunnel = no_cloud.addr;
    let (edge, _admin) = s.start_edge(EdgeOpts {
        extra: toml::toml! {
            [reverse]
            open_timeout = "20s"

            [[reverse.forward]]
            listen = "127.0.0.1:0"
            target = "127.0.0.1:9"
        },
        ..EdgeOpts::new("edge-1", "token-one")
    });
    // start_edge waited for the listeners to serve.
    let listen = edge.ready().addr("reverse.forward[0].listen");
    let started = Instant::now();
    let out = curl(&[&format!("http://{listen}/")]);
    assert!(!out.status.success());
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );
    edge.wait_log("not registered with the cloud", Duration::from_secs(5));
}

/// Writes an edge config registering as cluster `name` and starts it.
fn start_cluster_edge(s: &Setup, name: &str, token: &str, allow: &str) -> (Proc, SocketAddr) {
    let file = s.path().join(format!("cluster-{name}.toml"));
    common::config::write_toml(
        &file,
        &toml::toml! {
            identity = "cluster"
            cluster_name = name

            [cloud]
            address = (s.tunnel.to_string())
            server_name = "tunnel-cloud"
            ca = "ca.crt"
            token = token

            [admin]
            listen = "127.0.0.1:0"

            [allow]
            targets = [allow]

            [transport]
            heartbeat_interval = "1s"
            heartbeat_timeout = "3s"
        },
    );
    let mut edge = Proc::start(
        &format!("cluster-{name}"),
        s.path(),
        &["edge", "--config", file.to_str().expect("utf-8")],
    );
    let admin = edge
        .wait_ready(Duration::from_secs(10))
        .addr("admin.listen");
    (edge, admin)
}

#[test]
fn a_cluster_edge_serves_its_apiserver_by_cluster_name() {
    let mut s = Setup::new("prod-eu:cluster-token\nedge-1:token-one\n");
    // A plain HTTP server stands in for the managed cluster's apiserver (:6443).
    let apiserver = HttpServer::start(&www(&s, b""));
    let cloud = s.start_cloud(toml::toml! {
        [[node]]
        name = "edge-1"
        addresses = ["127.1.0.5"]
    });
    let (edge, admin) =
        start_cluster_edge(&s, "prod-eu", "cluster-token", &apiserver.addr.to_string());
    // NODE_NAME is never used for a cluster identity.
    assert!(
        common::wait_http_ok(&format!("http://{admin}/readyz"), Duration::from_secs(10)),
        "cluster edge not ready:\n{}",
        edge.log_text()
    );

    let port = apiserver.addr.port();
    let out = curl(&[
        "-p",
        "-x",
        &format!("http://{}", s.connect),
        &format!("http://prod-eu:{port}/hello.txt"),
    ]);
    assert!(
        out.status.success(),
        "CONNECT prod-eu:{port} failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        cloud.log_text()
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "hello from the cloud side\n"
    );
    let edges =
        String::from_utf8_lossy(&curl(&[&format!("http://{}/debug/edges", s.cloud_admin)]).stdout)
            .into_owned();
    assert!(
        edges.replace(" ", "").contains("\"kind\":\"cluster\"") && edges.contains("prod-eu"),
        "debug listing: {edges}"
    );

    // A cluster cannot take the name of a node in the node table, even with a valid token.
    let (squatter, _) = start_cluster_edge(&s, "edge-1", "token-one", "127.0.0.1:6443");
    squatter.wait_log(
        "has the name of a node in the node table",
        Duration::from_secs(10),
    );
    cloud.wait_log(
        "has the name of a node in the node table",
        Duration::from_secs(5),
    );
}

/// `sh -c` that appends `tag` to `order` and writes the TUNNEL_* environment to `env`.
fn recording_hook(dir: &Path, tag: &str) -> Vec<String> {
    let script = format!(
        "echo {tag} >> {order}; env | grep ^TUNNEL_ | sort > {env}",
        order = dir.join("order").display(),
        env = dir.join(format!("{tag}.env")).display()
    );
    vec!["sh".into(), "-c".into(), script]
}

#[test]
fn hooks_run_in_order_with_the_documented_environment() {
    let mut s = Setup::new("edge-1:token-one\n");
    let _cloud = s.start_cloud(Table::new());
    let (edge, admin) = s.start_edge(EdgeOpts {
        extra: toml::toml! {
            [hooks]
            pre_start = (recording_hook(s.path(), "pre"))
            post_start = (recording_hook(s.path(), "post"))
            timeout = "10s"
        },
        ..EdgeOpts::new("edge-1", "token-one")
    });
    assert!(
        common::wait_http_ok(&format!("http://{admin}/readyz"), Duration::from_secs(10)),
        "edge not ready:\n{}",
        edge.log_text()
    );
    let post = s.path().join("post.env");
    assert!(
        common::probe::eventually(Duration::from_secs(10), || std::fs::read_to_string(&post)
            .is_ok_and(|t| !t.is_empty())),
        "post_start never ran:\n{}",
        edge.log_text()
    );

    let order = std::fs::read_to_string(s.path().join("order")).expect("order");
    assert_eq!(order, "pre\npost\n");
    let pre = std::fs::read_to_string(s.path().join("pre.env")).expect("pre.env");
    for want in [
        "TUNNEL_HOOK=pre_start",
        "TUNNEL_NODE_NAME=edge-1",
        "TUNNEL_IDENTITY=node",
        "TUNNEL_SESSION_STATE=starting",
        "TUNNEL_SESSION_COUNT=0",
        "TUNNEL_CLOUD_ID=\n",
    ] {
        assert!(pre.contains(want), "pre_start env lacks {want:?}:\n{pre}");
    }
    assert!(
        pre.contains(&format!("TUNNEL_CLOUD_ADDRESS={}", s.tunnel)),
        "{pre}"
    );
    let post = std::fs::read_to_string(&post).expect("post.env");
    for want in [
        "TUNNEL_HOOK=post_start",
        "TUNNEL_NODE_NAME=edge-1",
        "TUNNEL_SESSION_STATE=registered",
        "TUNNEL_SESSION_COUNT=1",
        "TUNNEL_CLOUD_ID=test-cloud",
    ] {
        assert!(
            post.contains(want),
            "post_start env lacks {want:?}:\n{post}"
        );
    }
    assert!(
        post.contains(&format!("TUNNEL_CLOUD_ADDRESS={}", s.tunnel)),
        "{post}"
    );
}

#[test]
fn a_failing_pre_start_hook_aborts_or_warns_as_configured() {
    let mut s = Setup::new("edge-1:token-one\n");
    let _cloud = s.start_cloud(Table::new());

    let (mut aborted, _) = s.start_edge(EdgeOpts {
        extra: toml::toml! {
            [hooks]
            pre_start = ["sh", "-c", "exit 7"]
            failure = "abort"
        },
        ..EdgeOpts::new("edge-1", "token-one")
    });
    assert_eq!(
        aborted.wait_exit(Duration::from_secs(10)),
        Some(1),
        "log:\n{}",
        aborted.log_text()
    );
    assert!(
        aborted.log_text().contains("pre_start hook failed"),
        "{}",
        aborted.log_text()
    );
    assert!(
        !aborted.log_text().contains("registered with the cloud"),
        "{}",
        aborted.log_text()
    );

    // An overrunning hook is killed at its timeout and counts as failed.
    let started = Instant::now();
    let (mut overran, _) = s.start_edge(EdgeOpts {
        extra: toml::toml! {
            [hooks]
            pre_start = ["sleep", "30"]
            timeout = "300ms"
        },
        ..EdgeOpts::new("edge-1", "token-one")
    });
    assert_eq!(
        overran.wait_exit(Duration::from_secs(10)),
        Some(1),
        "log:\n{}",
        overran.log_text()
    );
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "took {:?}",
        started.elapsed()
    );
    assert!(
        overran.log_text().contains("was killed"),
        "{}",
        overran.log_text()
    );

    let (warned, admin) = s.start_edge(EdgeOpts {
        extra: toml::toml! {
            [hooks]
            pre_start = ["sh", "-c", "exit 7"]
            failure = "warn"
        },
        ..EdgeOpts::new("edge-1", "token-one")
    });
    assert!(
        common::wait_http_ok(&format!("http://{admin}/readyz"), Duration::from_secs(10)),
        "warn edge not ready:\n{}",
        warned.log_text()
    );
    assert!(
        warned.log_text().contains("starting anyway"),
        "{}",
        warned.log_text()
    );
}

/// `openssl s_server -www` on 127.0.0.1 with a certificate from the test CA, killed (by
/// PID) when dropped: a TLS service on the cloud side.
struct TlsServer {
    _child: common::ChildGuard,
    addr: SocketAddr,
}

impl TlsServer {
    fn start(s: &Setup) -> Self {
        s.pki.issue(
            "target",
            &["127.0.0.1"],
            "target",
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
        );
        // It says `ACCEPT <address>` once it listens.
        let (_child, addr) = common::spawn_announcing(
            Command::new("openssl")
                .current_dir(s.path())
                .args(["s_server", "-www", "-cert", "target.crt", "-key"])
                .args(["target.key", "-accept", "127.0.0.1:0"]),
        );
        Self { _child, addr }
    }
}

/// The edge's `[proxy]`: curl on the edge side reaches a TLS server on the cloud side
/// with `-x` and with `HTTPS_PROXY`, the certificate verified end to end; a target the
/// cloud does not list for the node gets 403, a listed one that refuses gets 502.
#[test]
fn edge_http_proxy_reaches_cloud_side_tls_server_within_the_cloud_allowlist() {
    let mut s = Setup::new("edge-1:token-one\n");
    let tls = TlsServer::start(&s);
    let unlisted = TlsServer::start(&s);
    let closed = common::ClosedPort::new();
    let (closed, _held) = (closed.addr, closed);
    let _cloud = s.start_cloud(toml::toml! {
        [reverse.allow]
        "edge-1" = [(tls.addr.to_string()), (closed.to_string())]
    });
    let cloud_admin = s.cloud_admin;
    let (edge, edge_admin) = s.start_edge(EdgeOpts {
        extra: toml::toml! {
            [proxy]
            listen = "127.0.0.1:0"
        },
        ..EdgeOpts::new("edge-1", "token-one")
    });
    assert!(
        common::wait_http_ok(
            &format!("http://{edge_admin}/readyz"),
            Duration::from_secs(10)
        ),
        "edge not ready:\n{}",
        edge.log_text()
    );
    let proxy = edge.ready().addr("proxy.listen");
    let ca = s.path().join("ca.crt");
    let ca = ca.to_str().expect("utf-8 path");
    let url = format!("https://{}/", tls.addr);

    let out = curl(&["--cacert", ca, "-x", &format!("http://{proxy}"), &url]);
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("s_server"),
        "curl -x through the edge proxy failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        edge.log_text()
    );

    let out = Command::new("curl")
        .args(["-sS", "--max-time", "15", "--cacert", ca, &url])
        .env("HTTPS_PROXY", format!("http://{proxy}"))
        .env_remove("NO_PROXY")
        .env_remove("no_proxy")
        .output()
        .expect("curl");
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("s_server"),
        "curl with HTTPS_PROXY failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    // The status of the proxy's answer to CONNECT, as curl saw it.
    let connect_status = |target: SocketAddr| {
        let out = curl(&[
            "--cacert",
            ca,
            "-o",
            "/dev/null",
            "-w",
            "%{http_connect}",
            "-x",
            &format!("http://{proxy}"),
            &format!("https://{target}/"),
        ]);
        assert!(!out.status.success(), "curl to {target} succeeded");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert_eq!(connect_status(unlisted.addr), "403");
    assert_eq!(connect_status(closed), "502");

    let scrape = common::scrape(edge_admin);
    for (reason, n) in [("ok", 2.0), ("forbidden", 1.0), ("refused", 1.0)] {
        assert_eq!(
            common::sample(
                &scrape,
                &format!("tunnel_edge_proxy_requests_total{{reason=\"{reason}\"}}")
            ),
            n,
            "proxy requests with result {reason}:\n{scrape}"
        );
    }
    assert!(
        common::metric(cloud_admin, "tunnel_edges_connected") == 1.0,
        "the session survived the refusals"
    );
}
