//! kubectl logs, exec and port-forward reach the stand-in behind the edge on each path
//! kube-apiserver can take to the kubelet.

use std::time::{Duration, Instant};

use crate::k8s::checks::{NODE, wait_log};

use crate::cluster::{Cluster, Path_};

/// The transparent path: kube-apiserver (in a child cgroup with the eBPF redirect
/// attached) dials the Node's InternalIP:10250 as it would a kubelet, and lands on the
/// stand-in through tunnel-cloud and tunnel-edge, TLS verified end to end.
#[test]
fn kubectl_through_the_transparent_redirect() {
    let started = Instant::now();
    let Some(cluster) = Cluster::start(Path_::Redirect) else {
        return;
    };
    cluster.check("redirect");
    eprintln!("transparent path e2e: {:?}", started.elapsed());
}

/// The transparent path to a node whose InternalIP is IPv6 (a ULA that exists only in
/// the edge's namespace): kube-apiserver dials `[fd00:7e57:e2e::…]:10250`, connect6
/// sends it to the cloud's IPv6 redirect listener, and kubectl logs/exec/port-forward
/// reach the stand-in, TLS verified against the IPv6 SAN.
#[test]
fn kubectl_through_the_transparent_redirect_to_an_ipv6_node() {
    let started = Instant::now();
    let Some(cluster) = Cluster::start(Path_::Redirect6) else {
        return;
    };
    cluster.check("redirect");
    let log = cluster.cloud.log_text();
    assert!(
        log.contains("original_dst=[fd00:7e57:e2e:"),
        "no IPv6 original destination in the cloud's log:\n{}",
        cluster.cloud.log_tail(40)
    );
    eprintln!(
        "transparent path to an IPv6 node e2e: {:?}",
        started.elapsed()
    );
}

/// The egress-selector path: no eBPF; kube-apiserver sends its kubelet connections as
/// HTTP CONNECT over the cloud's unix socket, by the shipped example configuration.
#[test]
fn kubectl_through_the_egress_selector() {
    let started = Instant::now();
    let Some(cluster) = Cluster::start(Path_::EgressSelector) else {
        return;
    };
    cluster.check("connect-unix");
    eprintln!("egress-selector path e2e: {:?}", started.elapsed());
}

/// Two replicas through the real API: they find each other from the peer
/// EndpointSlices, and kubectl through the replica that does not hold the edge (the
/// API server's egress selector points at it) reaches the stand-in via the other.
#[test]
fn kubectl_through_the_replica_without_the_edge() {
    let started = Instant::now();
    let Some(cluster) = Cluster::start(Path_::Replicas) else {
        return;
    };
    // The first connection may race the route update from the holder: bounded retries
    // of a CONNECT on the entry replica until it reaches the edge.
    let deadline = Instant::now() + Duration::from_secs(10);
    let sock = cluster.dir.path().join("connect.sock");
    loop {
        let routed = std::os::unix::net::UnixStream::connect(&sock).and_then(|mut s| {
            use std::io::{Read, Write};
            s.set_read_timeout(Some(Duration::from_secs(5)))?;
            write!(
                s,
                "CONNECT {NODE}:10250 HTTP/1.1\r\nHost: {NODE}:10250\r\n\r\n"
            )?;
            let mut head = [0u8; 12];
            s.read_exact(&mut head)?;
            Ok(head.starts_with(b"HTTP/1.1 200"))
        });
        if routed.is_ok_and(|ok| ok) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "replica b never routed {NODE}:\n{}",
            cluster.cloud.log_tail(30)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    cluster.check("connect-unix");
    let holder = cluster.holder.as_ref().expect("the holding replica");
    wait_log(
        &cluster.cloud,
        "forwarding to the replica that holds the node",
        Duration::from_secs(1),
    );
    wait_log(holder, "forwarded connection ended", Duration::from_secs(5));
    eprintln!("two replicas e2e: {:?}", started.elapsed());
}
