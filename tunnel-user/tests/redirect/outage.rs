//! An edge without a tunnel: a connect from the redirected cgroup to its address fails
//! at once with EHOSTDOWN ("host is down", the cause in the client's own error) instead
//! of reaching the cloud and being reset; it is redirected again once the edge
//! registers; and a cloud gone for good past `fail_open_after` denies nothing.

use super::*;

/// A connect to `ip:10250` from the test cgroup: `connected`, or the errno's name and
/// text; then the seconds connect() took.
const CONNECT_PY: &str = "import errno,socket,sys,time
s = socket.socket()
t = time.monotonic()
try:
    s.connect((sys.argv[1], 10250))
    print('connected')
except OSError as e:
    print(errno.errorcode.get(e.errno), e.strerror)
print(f'{time.monotonic() - t:.4f}')";

/// What a connect from the cgroup got, and how long it took.
pub(super) async fn connect(cg: &TestCgroup, ip: &str) -> (String, Duration) {
    let out = cg
        .run(&["python3", "-c", CONNECT_PY, ip], Duration::from_secs(15))
        .await
        .expect("python connect");
    let mut lines = out.lines();
    let outcome = lines.next().unwrap_or_default().to_string();
    let secs: f64 = lines
        .next()
        .and_then(|l| l.parse().ok())
        .expect("connect time");
    (outcome, Duration::from_secs_f64(secs))
}

/// Connects until one gets `want` (bounded: the cloud marks the map as the change
/// reaches it, not before the test looks).
pub(super) async fn until_connect(cg: &TestCgroup, ip: &str, want: &str) -> (String, Duration) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let got = connect(cg, ip).await;
        if got.0.starts_with(want) || Instant::now() > deadline {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_connect_to_an_edge_without_a_tunnel_fails_at_once_with_host_down() {
    let Some(cg) = test_cgroup(NEEDS) else { return };
    let ip = "127.1.0.11";
    let mut s = Setup::new(TOKENS);
    // On the host's loopback: what a connect that is neither redirected nor denied
    // reaches.
    let _kubelet = start_kubelet(&s, ip, None);
    let bpffs = pinned::TestBpffs::mount(s.path().join("bpffs"));
    // Below 1024, as the config asks with pins.
    let redirect = common::ClosedPort::privileged([127, 0, 0, 1].into());
    let mut config = redirect_to(ip, &cg.path);
    merge(
        &mut config,
        toml::toml! {
            [redirect]
            listen = (redirect.addr.to_string())
            pin_dir = (path_str(&bpffs.0.join("tunnel")))
            fail_open_after = "2s"
        },
    );
    let mut cloud = s.start_cloud(config);

    // No edge has registered for edge-1: the connect fails in connect() itself.
    let (outcome, took) = until_connect(&cg, ip, "EHOSTDOWN").await;
    eprintln!("no tunnel: connect() -> {outcome} in {took:?}");
    assert_eq!(outcome, "EHOSTDOWN Host is down", "{}", cloud.log_text());
    assert!(took < Duration::from_millis(100), "took {took:?}");
    assert_eq!(redirected(&s), 0.0, "the cloud saw the connection");
    assert!(metric(s.cloud_admin, "tunnel_ebpf_no_tunnel_total") >= 1.0);
    cloud.wait_log(
        "no replica holds a tunnel to these nodes: connects to their addresses fail with \"host is down\" count=1 nodes=edge-1",
        Duration::from_secs(5),
    );

    // The edge registers: redirected through its tunnel, TLS verified end to end.
    let edge = s.start_ready_edge(EdgeOpts {
        extra: allow_kubelet(ip),
        ..EdgeOpts::new("edge-1", "token-one")
    });
    let (outcome, _) = until_connect(&cg, ip, "connected").await;
    assert_eq!(outcome, "connected");
    let args = curl_args(&s, &format!("https://{ip}:10250/"));
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let page = cg
        .run(&argv, Duration::from_secs(15))
        .await
        .expect("curl through the tunnel");
    assert!(page.contains("s_server"), "unexpected page: {page}");
    assert!(wait_redirected(&s, 2.0) >= 2.0, "not through the tunnel");

    // The edge goes: host is down again, once the cloud knows.
    drop(edge);
    let (outcome, took) = until_connect(&cg, ip, "EHOSTDOWN").await;
    eprintln!("edge stopped: connect() -> {outcome} in {took:?}");
    assert_eq!(outcome, "EHOSTDOWN Host is down");
    assert!(took < Duration::from_millis(100), "took {took:?}");

    // A successor adopts the pins with edge-1 marked. While it takes over (edges
    // reconnect then) it marks nothing, so the connect is redirected; once the window
    // has passed it knows again.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(cloud.pid()),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let _ = cloud.wait_exit(Duration::from_secs(10));
    let config_path = s.path().join("cloud.toml");
    let cloud_args = ["cloud", "--config", config_path.to_str().expect("utf-8")];
    let mut successor = Proc::start("cloud-successor", s.path(), &cloud_args);
    successor.wait_ready(Duration::from_secs(10));
    let (outcome, _) = connect(&cg, ip).await;
    assert_eq!(
        outcome,
        "connected",
        "refused while taking over\n{}",
        successor.log_text()
    );
    let (outcome, _) = until_connect(&cg, ip, "EHOSTDOWN").await;
    eprintln!("after the takeover window: connect() -> {outcome}");
    assert_eq!(outcome, "EHOSTDOWN Host is down");
    let mut cloud = successor;

    // The cloud dies and nobody takes over: the pinned programs stay attached, and
    // past fail_open_after deny nothing and redirect nothing.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(cloud.pid()),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let _ = cloud.wait_exit(Duration::from_secs(10));
    assert!(
        bpftool_show(&cg).contains("connect4"),
        "the pinned programs went with the cloud"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (outcome, _) = until_connect(&cg, ip, "connected").await;
    assert_eq!(outcome, "connected", "denied past fail_open_after");
    let page = cg
        .run(&argv, Duration::from_secs(15))
        .await
        .expect("curl straight to the kubelet");
    assert!(page.contains("s_server"), "unexpected page: {page}");
}

/// A replica marks only what it knows: a node whose edge another replica holds is
/// redirected (and forwarded there), and once the link to that replica is lost, which
/// may hold any node, nothing is marked until it is back.
#[tokio::test]
async fn a_node_held_by_another_replica_or_one_out_of_reach_is_never_refused() {
    let Some(cg) = test_cgroup(NEEDS) else { return };
    let ip = "127.1.0.12";
    let mut s = Setup::new(TOKENS);
    let _kubelet = start_kubelet(&s, ip, None);
    let (peer_a, peer_b) = (common::ClosedPort::new(), common::ClosedPort::new());
    let peers = |listen: &common::ClosedPort, other: &common::ClosedPort, id: &str| {
        toml::toml! {
            [tunnel]
            cloud_id = id

            [peers]
            listen = (listen.addr.to_string())
            static = [(other.addr.to_string())]
        }
    };
    // Replica B, without a redirect, holds the edge.
    let mut cloud_b = s.start_cloud(peers(&peer_b, &peer_a, "replica-b"));
    let _edge = s.start_ready_edge(EdgeOpts {
        extra: allow_kubelet(ip),
        ..EdgeOpts::new("edge-1", "token-one")
    });
    // Replica A redirects the test cgroup, on listeners of its own.
    let mut config_a = s.cloud_config(redirect_to(ip, &cg.path));
    merge(&mut config_a, peers(&peer_a, &peer_b, "replica-a"));
    merge(
        &mut config_a,
        toml::toml! {
            [tunnel]
            listen = "127.0.0.1:0"
            [admin]
            listen = "127.0.0.1:0"
            [connect]
            listen = "127.0.0.1:0"
            unix = (path_str(&s.path().join("connect-a.sock")))
        },
    );
    let config_path = s.path().join("cloud-a.toml");
    write_toml(&config_path, &config_a);
    let mut cloud_a = Proc::start(
        "cloud-a",
        s.path(),
        &[
            "cloud",
            "--config",
            config_path.to_str().expect("utf-8 path"),
        ],
    );
    let admin_a = cloud_a
        .wait_ready(Duration::from_secs(10))
        .addr("admin.listen");
    cloud_a.wait_log("linked to replica", Duration::from_secs(10));

    // A knows B holds edge-1: redirected, and forwarded to B.
    let args = curl_args(&s, &format!("https://{ip}:10250/"));
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    let page = loop {
        match cg.run(&argv, Duration::from_secs(15)).await {
            Ok(page) => break page,
            // B's routes may still be on their way.
            Err(e) if Instant::now() < deadline => {
                eprintln!("not yet through A: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("curl through replica A: {e}\n{}", cloud_a.log_text()),
        }
    };
    assert!(page.contains("s_server"), "unexpected page: {page}");
    assert!(metric(admin_a, "tunnel_peer_forwards_total") >= 1.0);
    assert_eq!(metric(admin_a, "tunnel_ebpf_no_tunnel_total"), 0.0);

    // B dies: nobody holds edge-1 now, but A cannot know that B's successor does not.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(cloud_b.pid()),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let _ = cloud_b.wait_exit(Duration::from_secs(10));
    cloud_a.wait_log("link to replica lost", Duration::from_secs(10));
    for _ in 0..5 {
        let (outcome, _) = connect(&cg, ip).await;
        assert_eq!(
            outcome,
            "connected",
            "refused with a replica out of reach\n{}",
            cloud_a.log_text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(metric(admin_a, "tunnel_ebpf_no_tunnel_total"), 0.0);
    assert!(
        !cloud_a.log_text().contains("no replica holds a tunnel"),
        "{}",
        cloud_a.log_text()
    );
}

/// Four compromised edges list the lowest addresses and keep no tunnel; the edge map has
/// room for four. The map keeps the honest edge, which holds a tunnel, and a client
/// dialling it goes through the tunnel (the old fill order kept the four lowest, and the
/// honest edge's connects went past the tunnel, straight to the address).
#[tokio::test]
async fn a_full_edge_map_keeps_the_nodes_with_a_tunnel_before_lower_addresses() {
    let Some(cg) = test_cgroup(NEEDS) else { return };
    let ip = "127.1.0.24";
    let mut s = Setup::new(TOKENS);
    let _kubelet = start_kubelet(&s, ip, None);
    let mut config = redirect_to(ip, &cg.path);
    let evil: Vec<toml::Value> = (1..=4)
        .map(|i| {
            let node = toml::toml! {
                name = (format!("edge-evil-{i}"))
                addresses = [(format!("127.1.0.{i}"))]
            };
            toml::Value::Table(node)
        })
        .collect();
    config["node"]
        .as_array_mut()
        .expect("[[node]]")
        .extend(evil);
    merge(
        &mut config,
        toml::toml! {
            [redirect]
            edge_map_entries = 4
        },
    );
    let cloud = s.start_cloud(config);
    let _edge = s.start_ready_edge(EdgeOpts {
        extra: allow_kubelet(ip),
        ..EdgeOpts::new("edge-1", "token-one")
    });
    cloud.wait_log("the eBPF edge map is full", Duration::from_secs(5));
    let (outcome, _) = until_connect(&cg, ip, "connected").await;
    assert_eq!(outcome, "connected");
    let args = curl_args(&s, &format!("https://{ip}:10250/"));
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let page = cg
        .run(&argv, Duration::from_secs(15))
        .await
        .expect("curl to the honest edge's kubelet");
    assert!(page.contains("s_server"), "unexpected page: {page}");
    assert!(
        wait_redirected(&s, 2.0) >= 2.0,
        "the honest edge's connects went past the tunnel: the full map kept the compromised edges' lower addresses\n{}",
        cloud.log_text()
    );
    assert_eq!(
        metric(
            s.cloud_admin,
            "tunnel_node_addresses_dropped{reason=\"edge_map_full\"}"
        ),
        1.0
    );
    // The evil edges' addresses without a tunnel: the one left out goes direct (here
    // nothing listens, refused), the others fail as a node without a tunnel does.
    let (outcome, _) = connect(&cg, "127.1.0.4").await;
    assert!(
        outcome.starts_with("ECONNREFUSED") || outcome.starts_with("EHOSTDOWN"),
        "{outcome}"
    );
}
