//! A client in the cgroup reaches the kubelet behind the edge by its node address, IPv4
//! and IPv6, and the programs' log records follow the runtime log filter.

use super::*;

#[tokio::test]
async fn kubelet_behind_the_edge_is_reached_transparently_with_tls_end_to_end() {
    let Some(cg) = test_cgroup(NEEDS) else { return };
    let ip = "127.1.0.5";
    let mut s = Setup::new(TOKENS);
    let _kubelet = start_kubelet(&s, ip, None);
    let (mut cloud, edge) = start(&mut s, &cg, ip);
    let args = curl_args(&s, &format!("https://{ip}:10250/"));
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();

    // In the cgroup: redirected through the tunnel; curl verifies the kubelet's
    // certificate for 127.1.0.5, so TLS was not terminated anywhere on the way.
    let page = cg
        .run(&argv, Duration::from_secs(15))
        .await
        .expect("curl in the cgroup");
    assert!(page.contains("s_server"), "unexpected page: {page}");
    assert_eq!(
        wait_redirected(&s, 1.0),
        1.0,
        "the connection did not go through the tunnel"
    );

    // The client sees the address it dialled.
    // The client then sends bytes that are not TLS and waits for the kubelet to hang up:
    // a client that closed at once could be gone before the cloud accepted it, and its
    // original destination with it.
    let script = format!(
        "import socket; s = socket.create_connection(('{ip}', 10250)); print(s.getpeername()); \
         s.settimeout(5); s.sendall(b'GET / HTTP/1.0\\r\\n\\r\\n'); s.recv(1)"
    );
    let peer = cg
        .run(&["python3", "-c", &script], Duration::from_secs(10))
        .await
        .expect("python getpeername");
    assert_eq!(peer.trim(), format!("('{ip}', 10250)"));
    assert_eq!(wait_redirected(&s, 2.0), 2.0);

    // Outside the cgroup: straight to the kubelet, not through the tunnel.
    let out = Command::new(argv[0])
        .args(&argv[1..])
        .output()
        .expect("curl outside");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A non-edge port from inside the cgroup is left alone too.
    let other = std::net::TcpListener::bind(format!("{ip}:0")).expect("bind other port");
    let script = format!(
        "import socket; socket.create_connection(('{ip}', {}))",
        other.local_addr().unwrap().port()
    );
    cg.run(&["python3", "-c", &script], Duration::from_secs(10))
        .await
        .expect("non-edge port");
    other.set_nonblocking(true).unwrap();
    assert!(
        other.accept().is_ok(),
        "the non-edge connection should have reached its own listener"
    );
    // Nothing more is counted: the count holds still.
    assert_eq!(
        common::settled(Duration::from_millis(300), Duration::from_secs(10), || {
            redirected(&s)
        }),
        2.0,
        "outside-cgroup or non-edge connections went through the tunnel"
    );

    // A stopped edge fails at once, not after a timeout.
    drop(edge);
    // Once the cloud knows it is gone (polled, not a fixed sleep): the bound below is
    // on the failure itself.
    assert!(
        common::probe::eventually(Duration::from_secs(10), || {
            common::metric(s.cloud_admin, "tunnel_edges_connected") == 0.0
        }),
        "the cloud still lists the stopped edge"
    );
    let started = Instant::now();
    let failed = cg.run(&argv, Duration::from_secs(15)).await;
    assert!(failed.is_err(), "curl succeeded with the edge stopped");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "failure took {:?}",
        started.elapsed()
    );
    // The cloud marked the node: connects fail in the eBPF program ("host is down",
    // tests/redirect/outage.rs), not at the cloud.
    cloud.wait_log(
        "no replica holds a tunnel to these nodes",
        Duration::from_secs(5),
    );

    // After shutdown no program is left attached, as the kernel reports it.
    let before = bpftool_show(&cg);
    assert!(
        before.contains("connect4"),
        "programs not attached while running: {before}"
    );
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(cloud.pid()),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    assert_eq!(
        cloud.wait_exit(Duration::from_secs(10)),
        Some(0),
        "cloud did not stop on SIGTERM"
    );
    let after = bpftool_show(&cg);
    assert!(
        !after.contains("connect4") && !after.contains("sock_ops"),
        "programs still attached: {after}"
    );
}

/// An IPv6 node address: a client in the cgroup dials `https://[<ULA>]:10250/`,
/// connect6 sends it to the cloud's IPv6 redirect listener (`[::1]`, the default), the
/// cloud recovers the original destination by the client's address and the edge, inside
/// the node's namespace, dials it. TLS is verified end to end against the IP SAN, and
/// the client's getpeername shows the address it dialled. The address answers nowhere
/// on the host, so nothing but the tunnel can have carried the connection.
#[tokio::test]
async fn kubelet_on_an_ipv6_node_address_is_reached_through_the_tunnel() {
    let Some(cg) = test_cgroup(NEEDS) else { return };
    if std::net::TcpListener::bind("[::1]:0").is_err() {
        cannot_run("no IPv6 loopback for the IPv6 redirect listener");
        return;
    }
    // The node's address answers nowhere on the host (an `unreachable` route), so a
    // connect there that is not redirected fails at once.
    let (node, edge6) = match EdgeNetns::new().and_then(|mut n| Ok((n.add_edge_ip6()?, n))) {
        Ok((edge6, n)) => (n, edge6.to_string()),
        Err(e) => {
            cannot_run(&format!("cannot create the IPv6 node's namespace: {e}"));
            return;
        }
    };
    let mut s = Setup::new(TOKENS);
    // The edge, inside the namespace, reaches the cloud over the veth.
    s.tunnel = std::net::SocketAddr::from((node.host_ip, 0));
    let kubelet = start_kubelet(&s, &edge6, Some(&node));

    let cloud = s.start_cloud(redirect_to(&edge6, &cg.path));
    let edge_config = s.path().join("edge-v6.toml");
    let mut config = toml::toml! {
        node_name = "edge-1"

        [cloud]
        address = (s.tunnel.to_string())
        server_name = "tunnel-cloud"
        ca = "ca.crt"
        token = "token-one"
    };
    merge(&mut config, allow_kubelet(&edge6));
    write_toml(&edge_config, &config);
    let edge = Proc::start_via(
        "edge-v6",
        s.path(),
        &node.exec(),
        &[
            "edge",
            "--config",
            edge_config.to_str().expect("utf-8 path"),
        ],
    );
    cloud.wait_log("edge registered", Duration::from_secs(15));

    // Nothing on the host answers at the address: only the redirect can reach it.
    let mut args = curl_args(&s, &format!("https://[{edge6}]:10250/"));
    // -g: the brackets are an IPv6 literal, not a glob.
    args.insert(1, "-g".into());
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let outside = Command::new(argv[0])
        .args(&argv[1..])
        .output()
        .expect("curl outside");
    assert!(
        !outside.status.success(),
        "the IPv6 node address answered on the host"
    );
    eprintln!(
        "outside the cgroup: {}",
        String::from_utf8_lossy(&outside.stderr).trim()
    );

    // In the cgroup: through the tunnel, with curl verifying the kubelet's certificate
    // for its address.
    let page = cg
        .run(&argv, Duration::from_secs(15))
        .await
        .unwrap_or_else(|e| {
            panic!(
                "curl in the cgroup: {e}\ncloud log:\n{}\nedge log:\n{}",
                cloud.log_text(),
                edge.log_text()
            )
        });
    assert!(page.contains("s_server"), "unexpected page: {page}");
    eprintln!(
        "in the cgroup: curl https://[{edge6}]:10250/ -> {}",
        page.lines().next().unwrap_or_default()
    );
    assert_eq!(
        wait_redirected(&s, 1.0),
        1.0,
        "the connection did not go through the tunnel"
    );

    // The client sees the address it dialled (see the IPv4 test for why it waits).
    let script = format!(
        "import socket; s = socket.create_connection(('{edge6}', 10250)); print(s.getpeername()); \
         s.settimeout(5); s.sendall(b'GET / HTTP/1.0\\r\\n\\r\\n'); s.recv(1)"
    );
    let peer = cg
        .run(&["python3", "-c", &script], Duration::from_secs(10))
        .await
        .expect("python getpeername");
    eprintln!("in the cgroup: getpeername() = {}", peer.trim());
    assert_eq!(peer.trim(), format!("('{edge6}', 10250, 0, 0)"));
    assert_eq!(wait_redirected(&s, 2.0), 2.0);
    let log = cloud.log_text();
    let routed = format!("original_dst=[{edge6}]:10250");
    assert!(
        log.contains(&routed),
        "no {routed} in the cloud log:\n{log}"
    );

    // HTTP CONNECT with `[<ULA>]:10250` as the authority (curl -x sends it so),
    // from outside the cgroup: the same kubelet, TLS verified again.
    let mut args = args.clone();
    args.splice(1..1, ["-x".to_string(), format!("http://{}", s.connect)]);
    let via_connect = Command::new(&args[0])
        .args(&args[1..])
        .output()
        .expect("curl -x");
    let page = String::from_utf8_lossy(&via_connect.stdout);
    assert!(
        via_connect.status.success() && page.contains("s_server"),
        "CONNECT [{edge6}]:10250: {page} {}",
        String::from_utf8_lossy(&via_connect.stderr)
    );
    eprintln!(
        "curl -x http://{} https://[{edge6}]:10250/ -> {}",
        s.connect,
        page.lines().next().unwrap_or_default()
    );
    drop(kubelet);
}

/// The programs' aya-log records reach the cloud's log under `tunnel::ebpf`: none while
/// the filter says info, the redirect with its original destination once it says debug,
/// and none again after it goes back.
#[tokio::test]
async fn ebpf_redirect_records_follow_the_runtime_log_filter() {
    let Some(cg) = test_cgroup(NEEDS) else { return };
    // Not the other test's address: the tests run side by side, each with its kubelet.
    let ip = "127.1.0.6";
    let mut s = Setup::new(TOKENS);
    let _kubelet = start_kubelet(&s, ip, None);
    let (cloud, _edge) = start(&mut s, &cg, ip);
    let args = curl_args(&s, &format!("https://{ip}:10250/"));
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let record = format!("redirected {ip}:10250 to 127.0.0.1:");
    let records = || cloud.log_text().matches(&record).count();
    let fetch = || async {
        let page = cg
            .run(&argv, Duration::from_secs(15))
            .await
            .expect("curl in the cgroup");
        assert!(page.contains("s_server"), "unexpected page: {page}");
    };

    fetch().await;
    assert_eq!(wait_redirected(&s, 1.0), 1.0);
    assert_eq!(records(), 0, "an eBPF debug record at the info filter");

    set_log_filter(&s, "info,tunnel_user=debug,tunnel::ebpf=debug");
    fetch().await;
    cloud.wait_log(&record, Duration::from_secs(5));
    assert_eq!(records(), 1);
    // The same connection as the cloud routed it: to the node, by its original address.
    cloud.wait_log(
        &format!("original_dst={ip}:10250}}: connection closed id=2 node=edge-1"),
        Duration::from_secs(5),
    );

    set_log_filter(&s, "info");
    fetch().await;
    assert_eq!(wait_redirected(&s, 3.0), 3.0);
    assert_eq!(
        common::settled(Duration::from_millis(300), Duration::from_secs(10), || {
            records()
        }),
        1,
        "an eBPF debug record after the filter went back"
    );
}

fn set_log_filter(s: &Setup, filter: &str) {
    let out = Command::new("curl")
        .args(["-sSf", "-X", "PUT", "--data-binary", filter])
        .arg(format!("http://{}/debug/flags/v", s.cloud_admin))
        .output()
        .expect("curl PUT /debug/flags/v");
    assert!(
        out.status.success(),
        "PUT /debug/flags/v {filter}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
