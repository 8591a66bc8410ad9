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

/// DNS rebinding: a web page from attacker.example, loaded in a browser on this host,
/// has the name resolve to 127.0.0.1 and is then same-origin with the admin listener. Its
/// requests name attacker.example as Host: refused, so it neither reads `/debug/edges`
/// nor sets the log level. The listener's own names still serve.
#[test]
fn the_admin_listener_refuses_a_host_name_that_is_not_its_own() {
    let mut s = Setup::new(TOKENS);
    let cloud = s.start_cloud(Table::new());
    let admin = s.cloud_admin;
    let curl = |name: &str, args: &[&str], path: &str| {
        let out = Command::new("curl")
            .args(["-sS", "-m", "10", "-i"])
            .args([
                "--resolve",
                &format!("{name}:{}:{}", admin.port(), admin.ip()),
            ])
            .args(args)
            .arg(format!("http://{name}:{}{path}", admin.port()))
            .output()
            .expect("curl");
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let level = |name: &str| curl(name, &[], "/debug/flags/v");
    let before = level("localhost");
    assert!(before.starts_with("HTTP/1.1 200"), "{before}");
    for (what, args, path) in [
        (
            "PUT the log level",
            &["-X", "PUT", "-d", "trace"][..],
            "/debug/flags/v",
        ),
        ("read the edges", &[][..], "/debug/edges"),
        ("read the metrics", &[][..], "/metrics"),
    ] {
        let response = curl("attacker.example", args, path);
        println!(
            "attacker.example: {what}: {}",
            response.lines().next().unwrap_or("")
        );
        assert!(
            response.starts_with("HTTP/1.1 421")
                && response.contains("\"attacker.example:")
                && response.contains("is not this listener"),
            "{what}: {response}"
        );
    }
    assert_eq!(
        level("localhost").lines().last(),
        before.lines().last(),
        "the refused PUT changed the level"
    );
    let log = cloud.log_text();
    assert!(
        log.lines().any(|l| l.contains("WARN")
            && l.contains("admin request for another host refused")
            && l.contains("attacker.example")),
        "{log}"
    );
    // Its own names: the address, localhost, the host's name.
    let hostname = nix::unistd::gethostname().expect("hostname");
    let hostname = hostname.to_str().expect("utf-8");
    for name in [&admin.ip().to_string(), "localhost", hostname] {
        let response = curl(name, &[], "/debug/edges");
        assert!(response.starts_with("HTTP/1.1 200"), "{name}: {response}");
    }
}

/// The edge's admin listener takes SO_REUSEPORT (a rolling update runs two edges on the
/// port), which the kernel extends to any socket of the same UID: a process of that UID
/// listening beside it receives some of the probes and scrapes. deploy/ runs the edge
/// under a UID of its own, so user nobody (65534, what many host-network pods run as)
/// cannot. And a listener that cannot bind because another user holds its port says
/// who: an edge started as root on that port fails naming the port and the UID.
#[test]
fn the_edges_admin_port_is_shared_with_no_other_user_and_a_taken_port_names_its_holder() {
    const NOBODY: u32 = 65534;
    let deploy = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/edge.yaml");
    let text = std::fs::read_to_string(&deploy).expect("deploy/edge.yaml");
    let uid: u32 = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("runAsUser:"))
        .expect("deploy/edge.yaml sets runAsUser")
        .trim()
        .parse()
        .expect("a numeric runAsUser");
    // 65532: the image's own user (Containerfile), which other images use too.
    assert!(
        ![0, NOBODY, 65532].contains(&uid),
        "deploy/edge.yaml runs the edge as uid {uid}, which other processes share"
    );
    if !common::privileged::is_root() {
        common::privileged::cannot_run("running processes as other users needs root");
        return;
    }
    // The edge as deploy/ runs it: its files readable by its UID.
    let s = Setup::new(TOKENS);
    let dir = s.path().join("edge-uid");
    std::fs::create_dir(&dir).expect("dir");
    for d in [s.path(), dir.as_path()] {
        std::fs::set_permissions(d, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .expect("chmod");
    }
    let _pki = common::Pki::new(&dir);
    let nobody_home = common::ClosedPort::new();
    let admin = common::ClosedPort::new();
    let config = dir.join("edge.toml");
    common::config::write_toml(
        &config,
        &toml::toml! {
            node_name = "edge-1"

            [cloud]
            address = (nobody_home.addr.to_string())
            server_name = "tunnel-cloud"
            ca = "ca.crt"
            token = "token-one"

            [admin]
            listen = (admin.addr.to_string())
        },
    );
    let log = dir.join("edge.log");
    let file = std::fs::File::create(&log).expect("log");
    let child = std::os::unix::process::CommandExt::uid(
        std::os::unix::process::CommandExt::gid(&mut Command::new(common::BIN), uid),
        uid,
    )
    .args(["edge", "--config", config.to_str().expect("utf-8")])
    .env_remove("NODE_NAME")
    .stdin(std::process::Stdio::null())
    .stdout(file.try_clone().expect("dup"))
    .stderr(file)
    .spawn()
    .expect("start the edge");
    let _edge = common::ChildGuard(child);
    let healthz = format!("http://{}/healthz", admin.addr);
    assert!(
        common::wait_http_ok(&healthz, Duration::from_secs(10)),
        "the edge (uid {uid}) never served its admin port:\n{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    // The attack: another process listening on the port beside the edge.
    let errno = common::privileged::listen_as(NOBODY, admin.addr, true);
    println!("user nobody listening on the edge's admin port with SO_REUSEPORT: errno {errno}");
    assert_eq!(
        errno,
        libc::EADDRINUSE,
        "user nobody shares the edge's admin port"
    );
    // What it would have got under the edge's own UID: why the UID must be its own.
    assert_eq!(
        common::privileged::listen_as(uid, admin.addr, true),
        0,
        "a process of the edge's UID shares the port"
    );

    // A second edge, as root, on the port the first one holds.
    let mut second = Proc::start(
        "edge-root",
        &dir,
        &["edge", "--config", config.to_str().expect("utf-8")],
    );
    assert_ne!(second.wait_exit(Duration::from_secs(10)), Some(0));
    let said = second.log_text();
    println!(
        "the second edge said: {}",
        said.lines().last().unwrap_or("")
    );
    assert!(
        said.contains(&format!(
            "cannot listen on {} (admin.listen): port {} is held by uid {uid} (this process runs as uid 0)",
            admin.addr,
            admin.addr.port()
        )),
        "{said}"
    );
}

#[test]
fn connect_and_admin_listeners_beyond_loopback_are_named_at_start() {
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
    // The CONNECT listener opens every edge's targets: a warning. The admin listener
    // shows the network only /metrics and the probes (deploy/ binds it so): said.
    for (key, level) in [("connect.listen", "WARN"), ("admin.listen", "INFO")] {
        let line = log
            .lines()
            .find(|l| l.contains(&format!("{key} listens beyond loopback")))
            .unwrap_or_else(|| panic!("nothing said for {key}:\n{log}"));
        assert!(
            line.contains(level) && line.contains("addr=0.0.0.0:0"),
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
