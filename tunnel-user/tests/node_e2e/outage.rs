//! Outages: an edge's uplink down for longer than the heartbeat timeout.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::nodes::MasterAndEdge;
use crate::verbs::WORKLOAD;
use crate::{figure, wait_for};

/// The edge's uplink down for longer than the heartbeat timeout (15 s): kubectl fails
/// fast and says why (the eBPF program fails kube-apiserver's connect to the kubelet
/// with EHOSTDOWN once no replica holds the edge's tunnel); after the link is back,
/// kubectl works again.
pub fn uplink_down_fails_fast_and_recovers(nodes: &MasterAndEdge, kubectl: &Path) {
    let api = &nodes.api;
    nodes.netns.set_uplink(false).expect("uplink down");
    let down = Instant::now();
    std::thread::sleep(Duration::from_secs(20));
    let asked = Instant::now();
    let out = api.kubectl(kubectl, &["logs", WORKLOAD, "-c", "main", "--tail=1"]);
    let failed_in = asked.elapsed();
    let why = String::from_utf8_lossy(&out.stderr).trim().to_string();
    figure(&format!(
        "uplink down {:.0} s: kubectl logs failed in {:.2} s: {why}",
        down.elapsed().as_secs_f64(),
        failed_in.as_secs_f64()
    ));
    assert!(
        !out.status.success(),
        "kubectl logs worked with the uplink down"
    );
    assert!(
        failed_in < Duration::from_secs(5),
        "kubectl logs hung {failed_in:?}: {why}"
    );
    assert!(
        why.contains("connect: host is down"),
        "kubectl's error does not name the cause: {why}\n{}",
        nodes.context()
    );
    nodes.netns.set_uplink(true).expect("uplink up");
    let recovered = wait_for(Duration::from_secs(120), "kubectl working again", || {
        let out = api.kubectl(
            kubectl,
            &["exec", WORKLOAD, "-c", "main", "--", "echo", "back"],
        );
        out.status.success() && out.stdout == b"back\n"
    });
    figure(&format!(
        "uplink back: kubectl exec works again {:.1} s after the link came up",
        recovered.as_secs_f64()
    ));
}
