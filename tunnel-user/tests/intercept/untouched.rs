//! What is left alone: other cgroups, other ports, the exempt cgroup; and what fails
//! open: a redirect whose owner stopped, or one with no listener for the family.

use super::*;

#[tokio::test]
async fn outside_the_cgroup_and_other_ports_pass_untouched() {
    let redirect = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let redirect_addr = redirect.local_addr().expect("addr");
    // A real listener on an intercepted edge port: whoever is not redirected lands here.
    let edge_listener = TcpListener::bind((EDGE, 0)).await.expect("bind edge");
    let edge_port = edge_listener.local_addr().expect("addr").port();
    // And one on a port that is not intercepted.
    let other = TcpListener::bind((EDGE, 0)).await.expect("bind other");
    let other_port = other.local_addr().expect("addr").port();
    let Some((cgroup, interceptor)) =
        setup(|cg| config(cg, redirect_addr, vec![EDGE_PORT, edge_port]))
    else {
        return;
    };
    interceptor.set_edges(&[EDGE]).expect("set edges");
    let before = interceptor.counters();

    // This test process is outside the cgroup: it reaches the edge port directly.
    let (conn, server) = tokio::join!(
        tokio::net::TcpStream::connect((EDGE, edge_port)),
        serve_one(&edge_listener, None),
    );
    let mut conn = conn.expect("direct connect from outside the cgroup");
    let mut line = String::new();
    tokio::time::timeout(LIMIT, conn.read_to_string(&mut line))
        .await
        .ok();
    assert_eq!(server, "direct");
    assert_eq!(
        conn.peer_addr().expect("peer"),
        SocketAddr::from((EDGE, edge_port))
    );

    // In the cgroup, a port that is not intercepted goes straight to its listener.
    let (client, server) = tokio::join!(
        python_client(&cgroup, "127.1.0.5", other_port),
        serve_one(&other, None),
    );
    assert_eq!(server, "direct");
    assert!(
        client.contains(&format!("peer 127.1.0.5:{other_port}")),
        "{client}"
    );
    assert!(client.contains("server direct"), "{client}");

    let after = interceptor.counters();
    assert_eq!(
        after.redirected, before.redirected,
        "nothing redirected: {after:?}"
    );
    assert!(
        after.passed > before.passed,
        "the cgroup client's connect passed: {after:?}"
    );
    // The redirect listener saw nothing at all.
    assert!(
        tokio::time::timeout(Duration::from_millis(200), redirect.accept())
            .await
            .is_err(),
        "a connection reached the redirect listener"
    );
}

#[tokio::test]
async fn exempt_cgroup_is_not_redirected_and_stale_edges_go() {
    let redirect = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let redirect_addr = redirect.local_addr().expect("addr");
    let edge_listener = TcpListener::bind((EDGE, 0)).await.expect("bind edge");
    let edge_port = edge_listener.local_addr().expect("addr").port();
    // The exempt cgroup is a child of the attached one, so the programs do run for its
    // processes (cgroup programs are inherited) and must choose to leave them alone.
    let Some(root) = cgroup_root(NEEDS) else {
        return;
    };
    let cgroup = TestCgroup::new(&root).expect("test cgroup");
    // Declared after its parent, so it is removed first.
    let exempt = TestCgroup::new(&cgroup.path).expect("exempt cgroup");
    let Some(interceptor) = attach(&InterceptConfig {
        exempt_cgroup: Some(exempt.path.clone()),
        ..config(&cgroup, redirect_addr, vec![edge_port])
    }) else {
        return;
    };
    interceptor.set_edges(&[EDGE]).expect("set edges");

    let (client, server) = tokio::join!(
        python_client(&exempt, "127.1.0.5", edge_port),
        serve_one(&edge_listener, None),
    );
    assert_eq!(server, "direct", "{client}");

    // set_edges replaces the whole set: once the edge is gone, the (non-exempt)
    // cgroup's client goes direct too.
    interceptor
        .set_edges(&[Ipv4Addr::new(127, 1, 0, 6)])
        .expect("replace edges");
    let (client, server) = tokio::join!(
        python_client(&cgroup, "127.1.0.5", edge_port),
        serve_one(&edge_listener, None),
    );
    assert_eq!(server, "direct", "{client}");
    assert_eq!(interceptor.counters().redirected, 0);
}

/// Programs whose owner stopped vouching for them (no `keep_alive` for
/// `fail_open_after`) let connects go where they were dialled; a `keep_alive` brings the
/// redirect back.
#[tokio::test]
async fn the_redirect_fails_open_once_its_owner_stops_keeping_it_alive() {
    const FAIL_OPEN_AFTER: Duration = Duration::from_secs(1);
    let redirect = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let redirect_addr = redirect.local_addr().expect("addr");
    let edge_listener = TcpListener::bind((EDGE, 0)).await.expect("bind edge");
    let edge_port = edge_listener.local_addr().expect("addr").port();
    let Some((cgroup, interceptor)) = setup(|cg| InterceptConfig {
        fail_open_after: Some(FAIL_OPEN_AFTER),
        ..config(cg, redirect_addr, vec![edge_port])
    }) else {
        return;
    };
    interceptor.set_edges(&[EDGE]).expect("set edges");
    let attached = std::time::Instant::now();
    let (client, server) = tokio::join!(
        python_client(&cgroup, "127.1.0.5", edge_port),
        serve_one(&redirect, Some(&interceptor)),
    );
    assert!(
        attached.elapsed() < FAIL_OPEN_AFTER,
        "the first connect took too long to tell anything"
    );
    assert_eq!(server, format!("orig 127.1.0.5:{edge_port}"), "{client}");

    tokio::time::sleep(FAIL_OPEN_AFTER).await;
    let (client, server) = tokio::join!(
        python_client(&cgroup, "127.1.0.5", edge_port),
        serve_one(&edge_listener, None),
    );
    assert_eq!(server, "direct", "past fail_open_after: {client}");

    interceptor.keep_alive().expect("keep alive");
    let (client, server) = tokio::join!(
        python_client(&cgroup, "127.1.0.5", edge_port),
        serve_one(&redirect, Some(&interceptor)),
    );
    assert_eq!(server, format!("orig 127.1.0.5:{edge_port}"), "{client}");
    assert_eq!(interceptor.counters().redirected, 2);
}

#[tokio::test]
async fn pod_without_pod_redirect_fails_open_and_counts_an_error() {
    let redirect = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let redirect_addr = redirect.local_addr().expect("addr");
    let Some(netns) = test_netns() else { return };
    let Some((cgroup, interceptor)) = setup(|cg| config(cg, redirect_addr, vec![EDGE_PORT])) else {
        return;
    };
    interceptor.set_edges(&[EDGE]).expect("set edges");
    // Unchanged, the connect goes to the namespace's own loopback, where nothing listens.
    let probe = r#"
import socket
try:
    socket.create_connection(("127.1.0.5", 10250), timeout=5)
    print("connected")
except ConnectionRefusedError:
    print("refused")
"#;
    let out = cgroup
        .run(
            &["ip", "netns", "exec", &netns.name, "python3", "-c", probe],
            LIMIT,
        )
        .await
        .expect("probe");
    assert_eq!(out.trim(), "refused");
    let c = interceptor.counters();
    assert_eq!((c.redirected, c.errors), (0, 1), "{c:?}");
}

#[tokio::test]
async fn ipv6_edge_without_an_ipv6_redirect_fails_open_and_counts_an_error() {
    let redirect = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let redirect_addr = redirect.local_addr().expect("addr");
    // The client dials from the test's namespace, whose only IPv6 route is its loopback:
    // the connect that goes ahead unchanged fails there and goes nowhere else.
    let Some(netns) = test_netns() else { return };
    let Some((cgroup, interceptor)) = setup(|cg| config(cg, redirect_addr, vec![EDGE_PORT])) else {
        return;
    };
    interceptor.set_edges(&[EDGE6]).expect("set edges");
    let probe = format!(
        r#"
import socket
try:
    socket.create_connection(("{EDGE6}", {EDGE_PORT}), timeout=5)
    print("connected")
except OSError as e:
    print("failed", e.errno)
"#
    );
    let out = cgroup
        .run(
            &["ip", "netns", "exec", &netns.name, "python3", "-c", &probe],
            LIMIT,
        )
        .await
        .expect("probe");
    assert!(out.starts_with("failed"), "{out}");
    let c = interceptor.counters();
    assert_eq!((c.redirected, c.errors), (0, 1), "{c:?}");
    assert!(
        tokio::time::timeout(Duration::from_millis(200), redirect.accept())
            .await
            .is_err(),
        "an IPv6 connect reached the IPv4 listener"
    );
}
