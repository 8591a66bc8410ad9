//! Edge-to-cloud connections, cluster identities and edge hooks, end to end on loopback
//! with real TLS: the cloud and its edges in the test's runtime ([`common::inproc`]), or
//! a `tunnel edge` process where its exit code is what is tested.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::inproc::{self, InProcess, Side};
use common::{EdgeOpts, Setup};
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

#[tokio::test]
async fn curl_on_the_edge_reaches_a_cloud_side_http_server_and_unlisted_targets_are_refused() {
    let s = Setup::new("edge-1:token-one\n");
    // 8 MiB: many stream windows' worth of frames, so flow control is exercised.
    let body: Vec<u8> = (0..8u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let http = HttpServer::start(&www(&s, &body));
    // A live server that is not in the allowlist: a refusal can only be the allowlist's.
    let unlisted = HttpServer::start(&s.path().join("www"));
    let config = s.cloud_config(toml::toml! {
        [reverse.allow]
        "edge-1" = [(http.addr.to_string())]
    });
    let mut t = InProcess::start_with(s, config).await;
    let edge = t
        .start_ready_edge(EdgeOpts {
            extra: toml::toml! {
                [[reverse.forward]]
                listen = "127.0.0.1:0"
                target = (http.addr.to_string())

                [[reverse.forward]]
                listen = "127.0.0.1:0"
                target = (unlisted.addr.to_string())
            },
            ..EdgeOpts::new("edge-1", "token-one")
        })
        .await;
    let ready = edge.ready().await;
    let (listed, refused) = (
        ready.addr("reverse.forward[0].listen"),
        ready.addr("reverse.forward[1].listen"),
    );

    inproc::blocking(move || {
        let out = curl(&[&format!("http://{listed}/hello.txt")]);
        assert!(
            out.status.success(),
            "curl through the edge listener failed: {}",
            String::from_utf8_lossy(&out.stderr)
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
    })
    .await;
    let line = t
        .wait_log(
            Side::Cloud,
            "refused an edge-to-cloud target outside reverse.allow",
            Duration::from_secs(5),
        )
        .await;
    assert!(
        line.contains("edge-1") && line.contains(&unlisted.addr.to_string()),
        "refusal not attributed to node and target: {line}"
    );
    t.wait_log(
        Side::Edge,
        "cloud refused a target outside its allowlist",
        Duration::from_secs(5),
    )
    .await;

    let (cloud_admin, edge_admin) = (t.s.cloud_admin, edge.admin().await);
    inproc::blocking(move || {
        let m = common::scrape(cloud_admin);
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
    })
    .await;
}

#[tokio::test]
async fn edge_listener_without_a_session_closes_its_client_promptly() {
    let mut t = InProcess::start("edge-1:token-one\n", Table::new()).await;
    // No cloud where the edge dials (nothing listens there): the connection must not
    // hang until some long timeout.
    let no_cloud = common::ClosedPort::new();
    t.s.tunnel = no_cloud.addr;
    let edge = t.start_edge(EdgeOpts {
        extra: toml::toml! {
            [reverse]
            open_timeout = "20s"

            [[reverse.forward]]
            listen = "127.0.0.1:0"
            target = "127.0.0.1:9"
        },
        ..EdgeOpts::new("edge-1", "token-one")
    });
    let listen = edge.ready().await.addr("reverse.forward[0].listen");
    let (out, took) = inproc::blocking(move || {
        let started = Instant::now();
        (curl(&[&format!("http://{listen}/")]), started.elapsed())
    })
    .await;
    assert!(!out.status.success());
    assert!(took < Duration::from_secs(5), "took {took:?}");
    t.wait_log(
        Side::Edge,
        "not registered with the cloud",
        Duration::from_secs(5),
    )
    .await;
}

/// The config of an edge registering as cluster `name` with the cloud of `s`.
fn cluster_edge_config(s: &Setup, name: &str, token: &str, allow: &str) -> Table {
    toml::toml! {
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
    }
}

#[tokio::test]
async fn a_cluster_edge_serves_its_apiserver_by_cluster_name() {
    let s = Setup::new("prod-eu:cluster-token\nedge-1:token-one\n");
    // A plain HTTP server stands in for the managed cluster's apiserver (:6443).
    let apiserver = HttpServer::start(&www(&s, b""));
    let config = s.cloud_config(toml::toml! {
        [[node]]
        name = "edge-1"
        addresses = ["127.1.0.5"]
    });
    let mut t = InProcess::start_with(s, config).await;
    let config = cluster_edge_config(
        &t.s,
        "prod-eu",
        "cluster-token",
        &apiserver.addr.to_string(),
    );
    // NODE_NAME is never used for a cluster identity.
    let edge = t.start_edge_with("prod-eu", config);
    let admin = edge.admin().await;
    let (connect, cloud_admin, port) = (t.s.connect, t.s.cloud_admin, apiserver.addr.port());
    inproc::blocking(move || {
        assert!(
            common::wait_http_ok(&format!("http://{admin}/readyz"), Duration::from_secs(10)),
            "cluster edge not ready"
        );
        let out = curl(&[
            "-p",
            "-x",
            &format!("http://{connect}"),
            &format!("http://prod-eu:{port}/hello.txt"),
        ]);
        assert!(
            out.status.success(),
            "CONNECT prod-eu:{port} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "hello from the cloud side\n"
        );
        let edges =
            String::from_utf8_lossy(&curl(&[&format!("http://{cloud_admin}/debug/edges")]).stdout)
                .into_owned();
        assert!(
            edges.replace(" ", "").contains("\"kind\":\"cluster\"") && edges.contains("prod-eu"),
            "debug listing: {edges}"
        );
    })
    .await;

    // A cluster cannot take the name of a node in the node table, even with a valid token.
    let config = cluster_edge_config(&t.s, "edge-1", "token-one", "127.0.0.1:6443");
    let _squatter = t.start_edge_with("edge-1", config);
    let squatting = "has the name of a node in the node table";
    t.wait_log(Side::Edge, squatting, Duration::from_secs(10))
        .await;
    t.wait_log(Side::Cloud, squatting, Duration::from_secs(5))
        .await;
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

#[tokio::test]
async fn hooks_run_in_order_with_the_documented_environment() {
    let mut t = InProcess::start("edge-1:token-one\n", Table::new()).await;
    let dir = t.path().to_owned();
    let _edge = t
        .start_ready_edge(EdgeOpts {
            extra: toml::toml! {
                [hooks]
                pre_start = (recording_hook(&dir, "pre"))
                post_start = (recording_hook(&dir, "post"))
                timeout = "10s"
            },
            ..EdgeOpts::new("edge-1", "token-one")
        })
        .await;
    t.logs
        .wait(
            Side::Edge,
            &["hook succeeded", "post_start"],
            Duration::from_secs(10),
        )
        .await;
    let tunnel = t.s.tunnel;
    let post = dir.join("post.env");

    let order = std::fs::read_to_string(dir.join("order")).expect("order");
    assert_eq!(order, "pre\npost\n");
    let pre = std::fs::read_to_string(dir.join("pre.env")).expect("pre.env");
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
        pre.contains(&format!("TUNNEL_CLOUD_ADDRESS={tunnel}")),
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
        post.contains(&format!("TUNNEL_CLOUD_ADDRESS={tunnel}")),
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
#[tokio::test]
async fn edge_http_proxy_reaches_cloud_side_tls_server_within_the_cloud_allowlist() {
    let s = Setup::new("edge-1:token-one\n");
    let tls = TlsServer::start(&s);
    let unlisted = TlsServer::start(&s);
    let closed = common::ClosedPort::new();
    let (closed, _held) = (closed.addr, closed);
    let config = s.cloud_config(toml::toml! {
        [reverse.allow]
        "edge-1" = [(tls.addr.to_string()), (closed.to_string())]
    });
    let mut t = InProcess::start_with(s, config).await;
    let edge = t
        .start_ready_edge(EdgeOpts {
            extra: toml::toml! {
                [proxy]
                listen = "127.0.0.1:0"
            },
            ..EdgeOpts::new("edge-1", "token-one")
        })
        .await;
    let ready = edge.ready().await;
    let (proxy, edge_admin) = (ready.addr("proxy.listen"), ready.addr("admin.listen"));
    let (cloud_admin, ca) = (t.s.cloud_admin, t.path().join("ca.crt"));
    inproc::blocking(move || {
        through_the_edge_proxy(proxy, &ca, tls.addr, unlisted.addr, closed);
        proxy_metrics(edge_admin, cloud_admin);
    })
    .await;
}

/// The clients of [`edge_http_proxy_reaches_cloud_side_tls_server_within_the_cloud_allowlist`]:
/// curl through the edge's proxy at `proxy` to the listed TLS server `listed` (its
/// certificate checked against `ca`), to `unlisted`, and to `closed`.
fn through_the_edge_proxy(
    proxy: SocketAddr,
    ca: &Path,
    listed: SocketAddr,
    unlisted: SocketAddr,
    closed: SocketAddr,
) {
    let ca = ca.to_str().expect("utf-8 path");
    let url = format!("https://{listed}/");

    let out = curl(&["--cacert", ca, "-x", &format!("http://{proxy}"), &url]);
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("s_server"),
        "curl -x through the edge proxy failed: {}",
        String::from_utf8_lossy(&out.stderr)
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
    assert_eq!(connect_status(unlisted), "403");
    assert_eq!(connect_status(closed), "502");
}

/// What the edge at `edge_admin` counted of [`through_the_edge_proxy`]'s requests, and
/// the session at the cloud at `cloud_admin` still up.
fn proxy_metrics(edge_admin: SocketAddr, cloud_admin: SocketAddr) {
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
