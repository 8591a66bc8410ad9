//! deploy/monitoring/ is real: its alerting rules pass their promtool unit tests, and a
//! real Prometheus (Debian's, the one deploy/monitoring/'s image holds) run with its
//! scrape configuration scrapes a cloud and its edges in this process while calls
//! go through, loads its rules, and answers every query of its dashboard with data.

#![expect(
    clippy::unwrap_used,
    reason = "a panic with its message is how a test reports failure"
)]
mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, SystemTime};

use common::config::allow;
use common::inproc::{self, InProcess};
use common::monitoring::{
    NEEDS_CLUSTER, PROMETHEUS, PROMTOOL, Prometheus, check_dashboard, check_rules,
    dashboard_panels, prometheus_image, shipped_alerts, shipped_dir,
};
use common::{EdgeOpts, connect_via};

const TOKENS: &str = "edge-1:token-one\nedge-3:token-three\n";

/// Whether Debian's Prometheus is installed; when not, says so: a failure in CI (where
/// scripts/setup.sh installed it), a loud skip elsewhere.
fn prometheus_installed() -> bool {
    if Path::new(PROMETHEUS).exists() && Path::new(PROMTOOL).exists() {
        return true;
    }
    let why = format!(
        "{PROMETHEUS} and {PROMTOOL} (Debian's prometheus package) are missing: scripts/setup.sh installs them"
    );
    assert!(!common::privileged::in_ci(), "{why}");
    common::privileged::cannot_run(&why);
    false
}

#[test]
fn the_alerting_rules_pass_their_unit_tests_and_each_alert_has_one() {
    if !prometheus_installed() {
        return;
    }
    let dir = shipped_dir();
    for args in [
        &["check", "rules", "rules.yml"][..],
        &["test", "rules", "rules_test.yml"][..],
    ] {
        let out = Command::new(PROMTOOL)
            .current_dir(&dir)
            .args(args)
            .output()
            .unwrap();
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        println!("promtool {}:\n{said}", args.join(" "));
        assert!(out.status.success(), "promtool {args:?}: {said}");
    }
    let tests = std::fs::read_to_string(dir.join("rules_test.yml")).unwrap();
    let alerts = shipped_alerts();
    assert!(alerts.len() >= 5, "{alerts:?}");
    for alert in alerts {
        assert!(
            tests.contains(&format!(
                "alertname: {alert}\n        exp_alerts:\n          - "
            )),
            "rules_test.yml has no case where {alert} fires"
        );
    }
}

#[tokio::test]
async fn the_dashboard_and_the_rules_evaluate_against_a_real_prometheus() {
    if !prometheus_installed() {
        return;
    }
    let mut t = InProcess::start(
        TOKENS,
        toml::toml! {
            [tunnel]
            max_edges = 10

            [[node]]
            name = "edge-1"

            [[node]]
            name = "edge-2"

            [[node]]
            name = "edge-3"
        },
    )
    .await;
    let dir = t.path().join("prometheus");
    let prometheus = inproc::blocking(move || Prometheus::start(&dir))
        .await
        .unwrap();
    prometheus.targets("tunnel-cloud", "host", &[("master-1", t.s.cloud_admin)]);

    // edge-1 carries the calls; edge-2's client certificate lives 12 s, so its session
    // shows the expiry, then ends with it; edge-3's token is wrong: it is refused, and
    // its node is left without a tunnel.
    let echo = inproc::echo_server().await;
    let edge_1 = t
        .start_ready_edge(EdgeOpts {
            extra: allow(&[echo]),
            ..EdgeOpts::new("edge-1", "token-one")
        })
        .await;
    prometheus.targets("tunnel-edge", "host", &[("edge-1", edge_1.admin().await)]);
    t.s.pki
        .client_cert_expiring("edge-2", Duration::from_secs(12));
    let certificate_ends = SystemTime::now() + Duration::from_secs(12);
    let _edge_2 = t
        .start_ready_edge(EdgeOpts {
            cert: Some("edge-edge-2"),
            ..EdgeOpts::new("edge-2", "")
        })
        .await;
    let edge_3 = t.start_edge(EdgeOpts::new("edge-3", "not-the-token"));

    let connect = t.s.connect;
    let url = prometheus.url.clone();
    let carried = inproc::blocking(move || carry_calls(connect, echo, &url)).await;
    println!("calls carried: {carried}");
    let refused = prometheus
        .wait_for(
            "tunnel_registrations_rejected_total",
            Duration::from_secs(20),
        )
        .unwrap();
    println!("registrations refused: {refused:?}");
    edge_3.stop().await.unwrap();

    inproc::blocking(move || evaluate(&prometheus, certificate_ends)).await;
}

/// Calls through the CONNECT entry to `echo` behind edge-1, and to a port its
/// allowlist refuses, while the Prometheus at `url` scrapes: until it has seen both
/// counters move. Returns the calls made.
fn carry_calls(connect: SocketAddr, echo: SocketAddr, url: &str) -> usize {
    let mut calls = 0;
    for round in 0..100 {
        let mut conn = connect_via(connect, &format!("edge-1:{}", echo.port())).unwrap();
        conn.write_all(b"ping").unwrap();
        conn.shutdown(Shutdown::Write).unwrap();
        let mut answer = Vec::new();
        conn.read_to_end(&mut answer).unwrap();
        assert_eq!(answer, b"ping");
        connect_via(connect, "edge-1:1").expect_err("a port edge-1 does not allow");
        calls += 2;
        let moved = |expr: &str| {
            common::monitoring::query(url, expr)
                .unwrap()
                .first()
                .is_some_and(|s| s["value"][1] != "0")
        };
        // Seen move, not just seen: two scrapes apart.
        if round > 2
            && moved("sum(increase(tunnel_connections_total{job=\"tunnel-cloud\"}[1m]))")
            && moved("sum(increase(tunnel_dial_failures_total[1m]))")
        {
            return calls;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    panic!("Prometheus did not see the counters move after {calls} calls");
}

/// What Prometheus shows once the calls went through.
fn evaluate(prometheus: &Prometheus, certificate_ends: SystemTime) {
    let up = prometheus
        .wait_up(&["tunnel-cloud", "tunnel-edge"], 2, Duration::from_secs(20))
        .unwrap();
    for target in &up {
        println!(
            "target {} {}: {} in {:.4}s",
            target["labels"]["job"],
            target["scrapeUrl"],
            target["health"],
            target["lastScrapeDuration"]
        );
    }

    // The metrics this change added, as Prometheus got them.
    let expiry = prometheus
        .wait_for(
            "max_over_time(tunnel_edge_certificate_expiry_timestamp_seconds{node=\"edge-2\"}[5m])",
            Duration::from_secs(10),
        )
        .unwrap();
    let seen: f64 = expiry[0]["value"][1].as_str().unwrap().parse().unwrap();
    let issued = certificate_ends
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(
        (seen - issued).abs() < 5.0,
        "expiry {seen}, issued until {issued}"
    );
    let revoked = prometheus
        .wait_for(
            "tunnel_sessions_revoked_total{reason=\"certificate_expired\"}",
            Duration::from_secs(20),
        )
        .unwrap();
    println!("sessions revoked: {revoked:?}");
    let without = prometheus
        .wait_for(
            "tunnel_node_without_tunnel{node=\"edge-3\"}",
            Duration::from_secs(10),
        )
        .unwrap();
    assert_eq!(without[0]["value"][1], "1", "{without:?}");
    assert!(
        common::monitoring::query(
            &prometheus.url,
            "tunnel_node_without_tunnel{node=\"edge-1\"}"
        )
        .unwrap()
        .is_empty(),
        "edge-1 has its tunnel"
    );
    // Their alerts: the certificate's fired (no `for`), the missing tunnel's waits its
    // five minutes.
    prometheus
        .wait_for(
            "max_over_time(ALERTS{alertname=\"TunnelEdgeCertificateNotRenewed\", alertstate=\"firing\", node=\"edge-2\"}[5m])",
            Duration::from_secs(10),
        )
        .unwrap();
    prometheus
        .wait_for(
            "ALERTS{alertname=\"TunnelEdgeWithoutTunnel\", alertstate=\"pending\", node=\"edge-3\"}",
            Duration::from_secs(10),
        )
        .unwrap();
    for alert in prometheus.alerts().unwrap() {
        println!(
            "alert {} {}: {}",
            alert["labels"]["alertname"], alert["state"], alert["annotations"]["summary"]
        );
    }

    // Every rule loaded, every rule's query evaluates.
    let rules = check_rules(&prometheus.url).unwrap();
    println!("rules evaluated: {}: {rules:?}", rules.len());
    assert_eq!(rules.len(), shipped_alerts().len());

    // Every panel returns data, but those only a cluster feeds.
    let panels = dashboard_panels();
    for (title, why) in NEEDS_CLUSTER {
        assert!(
            panels.iter().any(|p| p.title == title),
            "NEEDS_CLUSTER names {title:?}, which dashboard.json does not have"
        );
        println!("panel {title:?}: left to a cluster test: {why}");
    }
    let skip: Vec<&str> = NEEDS_CLUSTER.iter().map(|(title, _)| *title).collect();
    // Each query once it has data (a rate needs two scrapes in its window), then all at
    // once.
    for panel in panels.iter().filter(|p| !skip.contains(&p.title.as_str())) {
        for expr in &panel.exprs {
            prometheus
                .wait_for(expr, Duration::from_secs(20))
                .unwrap_or_else(|e| panic!("panel {:?}: {e}", panel.title));
        }
    }
    let checked = check_dashboard(&prometheus.url, &skip).unwrap();
    for (title, samples) in &checked {
        println!("panel {title:?}: series per query {samples:?}");
    }
    assert_eq!(checked.len(), panels.len() - NEEDS_CLUSTER.len());
}

/// Every metric the cloud and the edge expose is in docs/operations.md's tables, with
/// the name Prometheus stores (`_total` on counters).
#[tokio::test]
async fn every_metric_exposed_is_documented() {
    let mut t = InProcess::start(TOKENS, toml::toml! { [tunnel] max_edges = 10 }).await;
    let echo = inproc::echo_server().await;
    let edge = t
        .start_ready_edge(EdgeOpts {
            extra: allow(&[echo]),
            ..EdgeOpts::new("edge-1", "token-one")
        })
        .await;
    let (cloud, edge) = (t.s.cloud_admin, edge.admin().await);
    let scrapes = inproc::blocking(move || [common::scrape(cloud), common::scrape(edge)]).await;
    let docs = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/operations.md"),
    )
    .unwrap();
    let mut names = Vec::new();
    for scrape in scrapes {
        for line in scrape.lines() {
            let Some(rest) = line.strip_prefix("# TYPE ") else {
                continue;
            };
            let mut words = rest.split_whitespace();
            let (Some(name), Some(kind)) = (words.next(), words.next()) else {
                continue;
            };
            let stored = match kind {
                "counter" => format!("{name}_total"),
                _ => name.to_owned(),
            };
            names.push(stored);
        }
    }
    assert!(names.len() > 10, "{names:?}");
    let missing: Vec<&String> = names
        .iter()
        .filter(|n| !docs.contains(&format!("`{n}`")) && !docs.contains(&format!("`{n}{{")))
        .collect();
    assert!(
        missing.is_empty(),
        "not in docs/operations.md's metrics tables: {missing:?}"
    );
}

/// The image `cargo xtask image --prometheus` builds runs deploy/monitoring/'s config as
/// prometheus.yaml runs it: as nobody, on a read-only root, its config, rules and
/// file_sd lists from read-only mounts (the ConfigMaps), its database on a writable
/// one (the emptyDir), no network. Run by podman; skipped loudly without the image.
#[test]
fn the_prometheus_image_runs_the_shipped_config_as_nobody() {
    let (tag, archive) = prometheus_image();
    let present = Command::new("podman")
        .args(["image", "exists", &tag])
        .status();
    match present {
        Err(e) => return common::privileged::cannot_run(&format!("podman is not installed: {e}")),
        Ok(s) if !s.success() => {
            return common::privileged::cannot_run(&format!(
                "no image {tag} in the local store; build it with `cargo xtask image --prometheus`"
            ));
        }
        Ok(_) => {}
    }
    let user = Command::new("podman")
        .args(["image", "inspect", "--format", "{{.Config.User}}", &tag])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&user.stdout).trim(), "65534:65534");
    let index = Command::new("tar")
        .arg("-xOf")
        .arg(&archive)
        .arg("index.json")
        .output()
        .unwrap();
    let index = String::from_utf8_lossy(&index.stdout);
    assert!(
        index.contains(&format!(
            "\"org.opencontainers.image.ref.name\":\"docker.io/library/{tag}\""
        )),
        "{}: {index}",
        archive.display()
    );

    let dir = tempfile::tempdir().unwrap();
    let targets = dir.path().join("targets");
    std::fs::create_dir(&targets).unwrap();
    std::fs::write(
        targets.join("tunnel-cloud.json"),
        r#"[{"targets": ["10.0.0.1:9101"], "labels": {"host": "master-1"}}]"#,
    )
    .unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    // The emptyDir is the pod's (fsGroup): here, nobody's.
    nix::unistd::chown(&data, Some(65534.into()), Some(65534.into())).unwrap();
    let name = format!("tunnel-prometheus-test-{}", std::process::id());
    let volume = |from: &Path, to: &str, mode: &str| format!("{}:{to}:{mode}", from.display());
    let started = Command::new("podman")
        .args([
            "--runtime",
            "runc",
            "run",
            "-d",
            "--name",
            &name,
            "--network",
            "none",
        ])
        .args([
            "--ulimit",
            "nofile=1024:1024",
            "--ulimit",
            "nproc=1024:1024",
        ])
        .arg("--read-only")
        .args([
            "--volume",
            &volume(
                &shipped_dir().join("prometheus.yml"),
                "/etc/prometheus/prometheus.yml",
                "ro",
            ),
        ])
        .args([
            "--volume",
            &volume(
                &shipped_dir().join("rules.yml"),
                "/etc/prometheus/rules.yml",
                "ro",
            ),
        ])
        .args([
            "--volume",
            &volume(&targets, "/etc/prometheus/targets", "ro"),
        ])
        .args(["--volume", &volume(&data, "/prometheus", "rw")])
        .arg(&tag)
        .output()
        .unwrap();
    let _container = Removed(name.clone());
    let said = String::from_utf8_lossy(&started.stderr);
    if !started.status.success() && (said.contains("OCI runtime") || said.contains("runc")) {
        return common::privileged::cannot_run(&format!(
            "podman cannot run containers here: {said}"
        ));
    }
    assert!(started.status.success(), "podman run {tag}: {said}");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let log = loop {
        let logs = Command::new("podman")
            .args(["logs", &name])
            .output()
            .unwrap();
        let log = String::from_utf8_lossy(&logs.stderr).to_string();
        if log.contains("Server is ready to receive web requests") {
            break log;
        }
        assert!(
            std::time::Instant::now() < deadline && !log.contains("level=error"),
            "{tag} did not start:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    for line in log.lines().filter(|l| {
        l.contains("Completed loading of configuration file") || l.contains("Server is ready")
    }) {
        println!("{tag}: {line}");
    }
    assert!(
        log.contains("Completed loading of configuration file"),
        "{log}"
    );
}

/// A container removed (with its anonymous state) when the test ends, pass or fail.
struct Removed(String);

impl Drop for Removed {
    fn drop(&mut self) {
        let _ = Command::new("podman").args(["rm", "-f", &self.0]).output();
    }
}

/// docs/operations.md's picture of the dashboard, from real data: a cloud with four
/// edges behind a 15 ms (one way) link, calls at a rate that rises and falls for three
/// minutes, a few to a port the allowlist refuses, edge-4 gone for the middle minute,
/// an edge with a wrong token; then scripts/dashboard-svg.py draws every panel from
/// this Prometheus. Writes `TUNNEL_DASHBOARD_SVG` (default: target/dashboard.svg).
/// `cargo test -p tunnel-user --test monitoring the_dashboard_picture -- --ignored`.
#[tokio::test]
#[ignore = "three minutes of load for a picture, not a check"]
async fn the_dashboard_picture() {
    const MINUTES: u64 = 3;
    let tokens = "edge-1:t1\nedge-2:t2\nedge-3:t3\nedge-4:t4\n";
    let mut t = InProcess::start(
        tokens,
        toml::toml! {
            [tunnel]
            max_edges = 10

            [[node]]
            name = "edge-1"
            [[node]]
            name = "edge-2"
            [[node]]
            name = "edge-3"
            [[node]]
            name = "edge-4"
        },
    )
    .await;
    let dir = t.path().join("prometheus");
    let prometheus = inproc::blocking(move || Prometheus::start(&dir))
        .await
        .unwrap();
    prometheus.targets("tunnel-cloud", "host", &[("master-1", t.s.cloud_admin)]);
    let wan = inproc::DelayProxy::start(t.s.tunnel, Duration::from_millis(15)).await;
    let echo = inproc::echo_server().await;
    let edge_opts = |node: &'static str, token: &'static str| {
        let mut extra = allow(&[echo]);
        common::config::merge(
            &mut extra,
            toml::toml! { [cloud] address = (wan.addr.to_string()) },
        );
        EdgeOpts {
            extra,
            ..EdgeOpts::new(node, token)
        }
    };
    let mut edges = Vec::new();
    for (node, token) in [
        ("edge-1", "t1"),
        ("edge-2", "t2"),
        ("edge-3", "t3"),
        ("edge-4", "t4"),
    ] {
        edges.push(Some(t.start_ready_edge(edge_opts(node, token)).await));
    }
    let start = std::time::Instant::now();
    let mut second = 0u64;
    while second < MINUTES * 60 {
        match second {
            60 => edges[3].take().unwrap().stop().await.unwrap(),
            90 => {
                let wrong = t.start_edge(edge_opts("edge-2", "not-the-token"));
                tokio::time::sleep(Duration::from_secs(2)).await;
                wrong.stop().await.unwrap();
            }
            120 => edges[3] = Some(t.start_ready_edge(edge_opts("edge-4", "t4")).await),
            _ => {}
        }
        // Calls this second: 2 to 20, a sine over the run; each 16 KiB each way.
        let phase = second as f64 / (MINUTES * 60) as f64 * std::f64::consts::TAU;
        let calls = (11.0 + 9.0 * phase.sin()) as usize;
        let live: Vec<&str> = ["edge-1", "edge-2", "edge-3", "edge-4"]
            .into_iter()
            .zip(&edges)
            .filter_map(|(node, e)| e.as_ref().map(|_| node))
            .collect();
        let connect = t.s.connect;
        let refused = (40..100).contains(&second) && second.is_multiple_of(3);
        inproc::blocking(move || {
            for i in 0..calls {
                let node = live[i % live.len()];
                let Ok(mut conn) = connect_via(connect, &format!("{node}:{}", echo.port())) else {
                    continue;
                };
                let _ = conn.write_all(&[7u8; 16 * 1024]);
                let _ = conn.shutdown(Shutdown::Write);
                let _ = std::io::copy(&mut conn, &mut std::io::sink());
            }
            if refused {
                let _ = connect_via(connect, &format!("{}:1", live[0]));
            }
        })
        .await;
        second += 1;
        let next = start + Duration::from_secs(second);
        tokio::time::sleep_until(next.into()).await;
    }
    let out = std::env::var("TUNNEL_DASHBOARD_SVG")
        .unwrap_or_else(|_| format!("{}/../target/dashboard.svg", env!("CARGO_MANIFEST_DIR")));
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/dashboard-svg.py");
    let url = prometheus.url.clone();
    let drawn = inproc::blocking(move || {
        Command::new("python3")
            .arg(script)
            .args([&url, &out, &MINUTES.to_string()])
            .output()
            .unwrap()
    })
    .await;
    println!("{}", String::from_utf8_lossy(&drawn.stdout));
    assert!(
        drawn.status.success(),
        "{}",
        String::from_utf8_lossy(&drawn.stderr)
    );
}
