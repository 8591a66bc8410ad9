//! Outages: an edge's uplink down for longer than the heartbeat timeout, and in the
//! five-node cluster a master lost.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::cluster::{EDGES, FiveNodes, MASTERS, Node};
use crate::nodes::{MasterAndEdge, cloud_pods};
use crate::rollout::{CallLoop, Calls, kubectl_call};
use crate::verbs::{WORKLOAD, edge_pod};
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

/// Which replica holds each edge: the edges each master's cloud lists at its
/// `/debug/edges` (its admin listener, on the master's own loopback); none for a master
/// whose cloud does not answer.
pub fn holders(nodes: &FiveNodes) -> Vec<(&'static str, Vec<String>)> {
    nodes
        .masters
        .iter()
        .map(|m| {
            let listed = m
                .node
                .namespaces
                .command(Path::new("curl"))
                .args([
                    "-sSf",
                    "--max-time",
                    "5",
                    "http://127.0.0.1:9101/debug/edges",
                ])
                .output()
                .ok()
                .filter(|o| o.status.success())
                .and_then(|o| serde_json::from_slice::<Vec<serde_json::Value>>(&o.stdout).ok())
                .unwrap_or_default();
            let edges = listed
                .iter()
                .filter_map(|s| s["node"].as_str().map(str::to_string))
                .collect();
            (m.node.name, edges)
        })
        .collect()
}

/// [`holders`] for a figure: `master-1 ["edge-1"], master-2 ["edge-2"]`.
pub fn describe_holders(nodes: &FiveNodes) -> String {
    holders(nodes)
        .iter()
        .map(|(m, edges)| format!("{m} {edges:?}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `kubectl exec` through master `kept`'s API server to the pod on each edge, in a loop.
fn calls_through(nodes: &FiveNodes, kept: usize, kubectl: &Path) -> CallLoop {
    let kubeconfig = &nodes.api(kept).admin_kubeconfig;
    CallLoop::start(
        EDGES
            .iter()
            .map(|e| {
                let call = kubectl_call(
                    kubectl,
                    kubeconfig,
                    &["exec", &edge_pod(e), "--", "echo", "ok"],
                );
                (call, "ok\n".to_string())
            })
            .collect(),
    )
}

/// Waits until the calls of `calls` have worked for 5 s on end (both edges answer
/// again), then stops them: the figure of `what`, from `lost` on.
fn every_edge_answers_again(calls: CallLoop, lost: Instant, what: &str, nodes: &FiveNodes) {
    wait_for(Duration::from_secs(120), what, || {
        let since = calls.last_failure().map_or(lost, |t| t.max(lost));
        since.elapsed() > Duration::from_secs(5)
    });
    let Calls {
        made,
        failed,
        last_failure,
        ..
    } = calls.finish();
    let answers = match last_failure {
        Some(t) => format!(
            "every edge answers again {:.1} s after",
            t.saturating_duration_since(lost).as_secs_f64()
        ),
        None => "no call failed".to_string(),
    };
    figure(&format!(
        "{what}: through the other master's API server {answers}; kubectl exec calls made {made}, failed {}; the replicas hold: {}",
        failed.len(),
        describe_holders(nodes)
    ));
    for f in failed.iter().take(5) {
        figure(&format!("  failed: {}", f.trim()));
    }
}

/// A master lost, the one holding more edges (master-1 on a tie): its tunnel-cloud
/// container killed first, then its whole kubelet stopped. kubectl through the other
/// master keeps reaching both edges, and the edges that were on the lost one come back
/// on the other. Prints the time until every edge answers again and the calls that
/// failed; then the lost master's kubelet starts again and its replica comes back.
pub fn a_master_lost(nodes: &mut FiveNodes, kubectl: &Path) {
    wait_for(Duration::from_secs(60), "both edges held", || {
        holders(nodes).iter().map(|(_, e)| e.len()).sum::<usize>() == EDGES.len()
    });
    let held = holders(nodes);
    let lost = usize::from(held[1].1.len() > held[0].1.len());
    let kept = 1 - lost;
    let (name, moving) = (MASTERS[lost], held[lost].1.clone());
    figure(&format!(
        "before {name} is lost, the replicas hold: {}",
        describe_holders(nodes)
    ));

    // Its container killed: the kubelet starts it again.
    let calls = calls_through(nodes, kept, kubectl);
    std::thread::sleep(Duration::from_secs(2));
    let pod = cloud_pods(nodes.api(kept), kubectl)
        .into_iter()
        .find(|p| p.node == name)
        .expect("the lost master's tunnel-cloud pod");
    let container = pod.container.expect("the cloud container's id");
    let killed = Instant::now();
    nodes.masters[lost]
        .node
        .containerd
        .ctr(&["tasks", "kill", "--signal", "SIGKILL", &container])
        .expect("kill the lost master's tunnel-cloud");
    let what = format!("{name}'s tunnel-cloud container killed");
    every_edge_answers_again(calls, killed, &what, nodes);

    // Its whole kubelet stopped, and with it every pod on it.
    let calls = calls_through(nodes, kept, kubectl);
    std::thread::sleep(Duration::from_secs(2));
    let stopped = Instant::now();
    nodes.masters[lost].node.kubelet = None;
    let what = format!("{name}'s kubelet stopped");
    every_edge_answers_again(calls, stopped, &what, nodes);
    wait_for(
        Duration::from_secs(60),
        "both edges held by the other master",
        || {
            let held = holders(nodes);
            held[lost].1.is_empty() && EDGES.iter().all(|e| held[kept].1.iter().any(|h| h == e))
        },
    );
    figure(&format!(
        "{} holds both edges, {moving:?} from {name} among them, {:.1} s after {name}'s kubelet stopped: {}",
        MASTERS[kept],
        stopped.elapsed().as_secs_f64(),
        describe_holders(nodes)
    ));

    // Back: its kubelet starts its replica again (the pod's status in the API still says
    // Ready from before: its /readyz on the master is what tells).
    let back = Instant::now();
    let m = &mut nodes.masters[lost];
    m.node.start_kubelet(&nodes.bins, m.api.endpoint());
    let serving = wait_for(
        Duration::from_secs(150),
        "the lost replica ready again",
        || replica_ready(&nodes.masters[lost].node),
    );
    let api = nodes.api(lost);
    wait_for(
        Duration::from_secs(60),
        "every edge through its API server",
        || {
            EDGES.iter().all(|e| {
                let out = api.kubectl(kubectl, &["exec", &edge_pod(e), "--", "echo", "ok"]);
                out.status.success() && out.stdout == b"ok\n"
            })
        },
    );
    figure(&format!(
        "{name}'s kubelet started again: its replica ready in {:.1} s, every edge through its API server in {:.1} s; the replicas hold: {}",
        serving.as_secs_f64(),
        back.elapsed().as_secs_f64(),
        describe_holders(nodes)
    ));
}

/// Whether the replica on `node` answers its `/readyz` (its admin listener, on the
/// node's own loopback).
fn replica_ready(node: &Node) -> bool {
    node.namespaces
        .command(Path::new("curl"))
        .args(["-sf", "--max-time", "2", "http://127.0.0.1:9101/readyz"])
        .output()
        .is_ok_and(|o| o.status.success())
}
