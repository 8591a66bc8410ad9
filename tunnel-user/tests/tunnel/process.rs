//! The process itself: a bad config exits 2 naming file and key; the log level changes
//! at runtime, by PUT only; local listeners bound wider are warned about at start.

use super::*;

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
fn the_log_level_takes_put_but_refuses_post_which_a_web_page_can_send() {
    let mut s = Setup::new(TOKENS);
    let _cloud = s.start_cloud(Table::new());
    let url = format!("http://{}/debug/flags/v", s.cloud_admin);
    let level = || {
        let out = Command::new("curl").args(["-sS", &url]).output().unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    let before = level();
    // What a cross-origin form sends: a POST with a simple content type.
    let out = Command::new("curl")
        .args(["-sS", "-i", "-X", "POST", &url, "-d", "8"])
        .args(["-H", "Content-Type: application/x-www-form-urlencoded"])
        .output()
        .unwrap();
    let response = String::from_utf8_lossy(&out.stdout).to_ascii_lowercase();
    assert!(
        response.starts_with("http/1.1 405") && response.contains("\r\nallow: get, put\r\n"),
        "{response}"
    );
    assert_eq!(level(), before, "a refused POST changed the level");
    let out = Command::new("curl")
        .args(["-sS", "-X", "PUT", &url, "-d", "8"])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "trace");
    assert_eq!(level(), "trace");
}

#[test]
fn connect_and_admin_listeners_beyond_loopback_are_warned_about_at_start() {
    if !common::privileged::is_root() {
        common::privileged::cannot_run(
            "the cloud binds all addresses in a network namespace of its own: needs root",
        );
        return;
    }
    let s = Setup::new(TOKENS);
    // All addresses, in a network namespace nobody else is in: nothing outside reaches
    // these listeners.
    let mut cloud = s.spawn_cloud(
        toml::toml! {
            [connect]
            listen = "0.0.0.0:0"

            [admin]
            listen = "0.0.0.0:0"
        },
        &["unshare", "--net"],
    );
    cloud.wait_ready(Duration::from_secs(10));
    let log = cloud.log_text();
    for key in ["connect.listen", "admin.listen"] {
        let line = log
            .lines()
            .find(|l| l.contains(&format!("{key} listens beyond loopback")))
            .unwrap_or_else(|| panic!("no warning for {key}:\n{log}"));
        assert!(
            line.contains("WARN") && line.contains("addr=0.0.0.0:0"),
            "{line}"
        );
    }
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

/// A stopped cloud drains: it waits for its open connections and returns the moment
/// the last one ends (in paused time: not at some later check), with Ok.
#[tokio::test(start_paused = true)]
async fn a_stopped_cloud_returns_as_its_last_connection_ends() {
    let mut t = InProcess::start(TOKENS, toml::toml! { [tunnel] drain_timeout = "10s" }).await;
    let echo = inproc::echo_server().await;
    let _edge = t
        .start_ready_edge(edge_opts("edge-1", "token-one", &[echo]))
        .await;
    let (status, mut conn) = inproc::connect(t.s.connect, &format!("edge-1:{}", echo.port())).await;
    assert!(status.starts_with("HTTP/1.1 200"), "{status}");
    inproc::echoes(&mut conn, b"before the stop").await;

    let mut cloud = t.stop_cloud();
    tokio::time::sleep(Duration::from_millis(1_050)).await;
    assert!(
        !cloud.is_finished(),
        "the cloud stopped under an open connection"
    );
    // Still carried while the cloud drains.
    inproc::echoes(&mut conn, b"during the drain").await;
    let ended = tokio::time::Instant::now();
    drop(conn);
    tokio::time::timeout(Duration::from_secs(20), &mut cloud)
        .await
        .expect("the cloud stops")
        .unwrap()
        .expect("the cloud's serve");
    let took = ended.elapsed();
    assert!(
        took < Duration::from_millis(50),
        "the cloud stopped {took:?} after its last connection ended"
    );
    let log = t.logs.lines(Side::Cloud).join("\n");
    assert!(
        log.contains("draining") && log.contains("drained: no connection left"),
        "{log}"
    );
}

/// A connection that outlives the drain bound does not hold the cloud: it stops at the
/// bound, saying how many it closed.
#[tokio::test(start_paused = true)]
async fn a_stopped_cloud_closes_what_is_left_at_the_drain_bound() {
    let mut t = InProcess::start(TOKENS, toml::toml! { [tunnel] drain_timeout = "10s" }).await;
    let echo = inproc::echo_server().await;
    let _edge = t
        .start_ready_edge(edge_opts("edge-1", "token-one", &[echo]))
        .await;
    let (status, mut conn) = inproc::connect(t.s.connect, &format!("edge-1:{}", echo.port())).await;
    assert!(status.starts_with("HTTP/1.1 200"), "{status}");
    inproc::echoes(&mut conn, b"held past the bound").await;

    let started = tokio::time::Instant::now();
    tokio::time::timeout(Duration::from_secs(20), t.stop_cloud())
        .await
        .expect("the cloud stops")
        .unwrap()
        .expect("the cloud's serve");
    let took = started.elapsed();
    assert!(
        took >= Duration::from_secs(10) && took < Duration::from_millis(10_050),
        "stopped {took:?} after the stop (drain bound 10 s)"
    );
    assert!(
        t.logs
            .lines(Side::Cloud)
            .iter()
            // The client's connection, and its stream on the edge's session.
            .any(|l| l.contains("drain bound reached") && l.contains("open=2")),
        "{}",
        t.logs.text()
    );
}
