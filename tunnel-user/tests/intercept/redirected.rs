//! What is redirected: IPv4, IPv6 and v4-mapped connects from the cgroup to an edge,
//! and a client in another network namespace to the pod's redirect.

use super::*;

#[tokio::test]
async fn edge_connect_in_cgroup_is_redirected_and_original_recovered() {
    let redirect = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let redirect_addr = redirect.local_addr().expect("addr");
    let Some((cgroup, interceptor)) = setup(|cg| config(cg, redirect_addr, vec![EDGE_PORT])) else {
        return;
    };
    interceptor.set_edges(&[EDGE]).expect("set edges");
    let before = interceptor.counters();

    let (client, server) = tokio::join!(
        python_client(&cgroup, "127.1.0.5", EDGE_PORT),
        serve_one(&redirect, Some(&interceptor)),
    );

    assert_eq!(
        server, "orig 127.1.0.5:10250",
        "listener recovers the dialled address"
    );
    assert!(
        client.contains("peer 127.1.0.5:10250"),
        "getpeername shows the dialled address: {client}"
    );
    assert!(
        client.contains("server orig 127.1.0.5:10250"),
        "client reached the listener: {client}"
    );
    let after = interceptor.counters();
    assert_eq!(
        after.redirected,
        before.redirected + 1,
        "{before:?} -> {after:?}"
    );
    assert_eq!(after.errors, before.errors, "{before:?} -> {after:?}");
    // Handed out once.
    assert_eq!(
        interceptor.take_original_dst(SocketAddrV4::new(EDGE, EDGE_PORT)),
        None
    );
}

/// The IPv6 listener, or `None` (after failing in CI / printing why) on a host without
/// IPv6 loopback.
async fn bind_v6_loopback() -> Option<TcpListener> {
    match TcpListener::bind("[::1]:0").await {
        Ok(l) => Some(l),
        Err(e) => {
            cannot_run(&format!("no IPv6 loopback to listen on: {e}"));
            None
        }
    }
}

#[tokio::test]
async fn ipv6_edge_connect_goes_to_the_ipv6_listener_and_original_recovered() {
    let redirect = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let redirect_addr = redirect.local_addr().expect("addr");
    let Some(redirect6) = bind_v6_loopback().await else {
        return;
    };
    let Some(_unreachable) = Unreachable6::add(EDGE6_NET) else {
        return;
    };
    let SocketAddr::V6(redirect6_addr) = redirect6.local_addr().expect("addr") else {
        panic!("v6 listener")
    };
    let Some((cgroup, interceptor)) = setup(|cg| InterceptConfig {
        redirect6_to: Some(redirect6_addr),
        ..config(cg, redirect_addr, vec![EDGE_PORT])
    }) else {
        return;
    };
    interceptor
        .set_edges(&[IpAddr::V4(EDGE), IpAddr::V6(EDGE6)])
        .expect("set edges");
    let before = interceptor.counters();

    let edge6 = EDGE6.to_string();
    let (client, server) = tokio::join!(
        python_client(&cgroup, &edge6, EDGE_PORT),
        serve_one(&redirect6, Some(&interceptor)),
    );
    assert_eq!(
        server, "orig [fd00:7e57:0:1::5]:10250",
        "the IPv6 listener recovers the dialled address: {client}"
    );
    assert!(
        client.contains("peer fd00:7e57:0:1::5:10250"),
        "getpeername shows the dialled address: {client}"
    );
    assert!(
        client.contains("server orig [fd00:7e57:0:1::5]:10250"),
        "{client}"
    );
    // The IPv4 edge, in the same maps' IPv4 half, still goes to the IPv4 listener.
    let (client, server) = tokio::join!(
        python_client(&cgroup, "127.1.0.5", EDGE_PORT),
        serve_one(&redirect, Some(&interceptor)),
    );
    assert_eq!(server, "orig 127.1.0.5:10250", "{client}");
    let after = interceptor.counters();
    assert_eq!(
        after.redirected,
        before.redirected + 2,
        "{before:?} -> {after:?}"
    );
    assert_eq!(after.errors, before.errors, "{before:?} -> {after:?}");
    assert_eq!(
        interceptor.take_original_dst(SocketAddr::from((EDGE6, EDGE_PORT))),
        None,
        "handed out once"
    );

    // set_edges replaces both halves: without the IPv6 edge the connect goes ahead
    // unchanged, into the unreachable route.
    interceptor.set_edges(&[EDGE]).expect("set edges");
    let failed = python_client_result(&cgroup, &edge6, EDGE_PORT).await;
    assert!(
        failed.is_err(),
        "nothing should answer at [{EDGE6}]: {failed:?}"
    );
    assert_eq!(interceptor.counters().redirected, after.redirected);
}

/// An `unreachable` route for a test prefix in the host's table, removed on drop: a
/// connect there fails at once rather than leaving through a default route. Added with
/// `replace`, so one left by a killed run is taken over instead of failing the test.
struct Unreachable6(&'static str);

impl Unreachable6 {
    fn add(prefix: &'static str) -> Option<Self> {
        match ip(&["-6", "route", "replace", "unreachable", prefix]) {
            Ok(()) => Some(Self(prefix)),
            Err(e) => {
                cannot_run(&format!("cannot make {prefix} unreachable: {e}"));
                None
            }
        }
    }
}

impl Drop for Unreachable6 {
    fn drop(&mut self) {
        let _ = ip(&["-6", "route", "del", "unreachable", self.0]);
    }
}

#[tokio::test]
async fn dual_stack_socket_dialling_v4_mapped_edge_is_redirected() {
    let redirect = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let redirect_addr = redirect.local_addr().expect("addr");
    let Some((cgroup, interceptor)) = setup(|cg| config(cg, redirect_addr, vec![EDGE_PORT])) else {
        return;
    };
    interceptor.set_edges(&[EDGE]).expect("set edges");

    let (client, server) = tokio::join!(
        python_client(&cgroup, "::ffff:127.1.0.5", EDGE_PORT),
        serve_one(&redirect, Some(&interceptor)),
    );
    assert_eq!(server, "orig 127.1.0.5:10250", "{client}");
    assert!(client.contains("peer ::ffff:127.1.0.5:10250"), "{client}");
    assert_eq!(interceptor.counters().redirected, 1);
}

#[tokio::test]
async fn client_in_another_netns_goes_to_pod_redirect() {
    let redirect = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let redirect_addr = redirect.local_addr().expect("addr");
    let Some(netns) = test_netns() else { return };
    let pod_listener = TcpListener::bind((netns.host_ip, 0))
        .await
        .expect("bind pod listener");
    let SocketAddr::V4(pod_addr) = pod_listener.local_addr().expect("addr") else {
        panic!("v4")
    };
    let Some((cgroup, interceptor)) = setup(|cg| InterceptConfig {
        pod_redirect_to: Some(pod_addr),
        ..config(cg, redirect_addr, vec![EDGE_PORT])
    }) else {
        return;
    };
    interceptor.set_edges(&[EDGE]).expect("set edges");

    // The client joins the cgroup first, then the netns (`ip netns exec` remounts /sys,
    // so cgroup.procs is out of reach from inside).
    let port = EDGE_PORT.to_string();
    let argv = [
        "ip",
        "netns",
        "exec",
        &netns.name,
        "python3",
        "-c",
        CLIENT_PY,
        "127.1.0.5",
        &port,
    ];
    let (client, server) = tokio::join!(
        cgroup.run(&argv, LIMIT),
        serve_one(&pod_listener, Some(&interceptor)),
    );
    let client = client.expect("pod client");
    assert_eq!(server, "orig 127.1.0.5:10250", "{client}");
    assert!(client.contains("peer 127.1.0.5:10250"), "{client}");
    assert!(
        tokio::time::timeout(Duration::from_millis(200), redirect.accept())
            .await
            .is_err(),
        "a pod client must not be sent to the host loopback listener"
    );
    assert_eq!(interceptor.counters().redirected, 1);
}
