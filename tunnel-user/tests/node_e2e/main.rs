//! The DaemonSets of deploy/ on real nodes, as a user installs them: a real control
//! plane (kube-apiserver, kube-controller-manager, kube-scheduler), containerd and a
//! kubelet per node run the image `cargo xtask image` built, applied with `kubectl
//! apply -k` of an overlay that changes only what a test must (credentials, the API
//! server's address, the cgroup to attach to, the host directory of the sockets). The
//! redirect attaches to a child cgroup holding kube-apiserver, never the root cgroup;
//! an edge runs in a network namespace of its own, reached only through the tunnel.
//!
//! Read it as a story, one module per chapter: [`nodes`] brings one master and an edge
//! up, [`cluster`] five nodes (two masters, a worker, two edges) on a [`network`] of
//! their own,
//! [`install`] applies deploy/ and checks what the cloud pod did, [`verbs`] is what a
//! user runs with kubectl against a pod on the edge, [`monitoring`] what metrics-server
//! and Prometheus read through the master, [`worker`] the same from a worker through
//! its relay, [`outage`] the edge's uplink cut, [`rollout`] the DaemonSets restarted
//! under load, and [`teardown`] `kubectl delete -k`.
//!
//! Needs root, containerd, podman and the image; without them it fails in CI and skips
//! loudly elsewhere. Everything it starts is stopped by PID and what it changed on the
//! host is put back (`k8s::node`).

#[path = "../common/mod.rs"]
mod common;
#[path = "../k8s/mod.rs"]
mod k8s;

mod cluster;
mod install;
mod monitoring;
mod network;
mod nodes;
mod outage;
mod rollout;
mod teardown;
mod verbs;
mod worker;

use std::path::Path;
use std::time::{Duration, Instant};

use k8s::checks::{assert_reached_stand_in, kubectl_checks, wait_log};

const MASTER: &str = "master-1";
/// The real edge node (the stand-in's Node has the same name in the other test).
const EDGE: &str = "edge-1";
const NAMESPACE: &str = "tunnel-system";
const CLOUD_SELECTOR: &str = "app.kubernetes.io/name=tunnel-cloud";
const EDGE_SELECTOR: &str = "app.kubernetes.io/name=tunnel-edge";

/// A figure of the run, printed even when the test passes (straight to fd 2: the test
/// harness captures `eprintln!` of a passing test).
fn figure(line: &str) {
    let line = format!("node e2e figure: {line}\n");
    let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
}

/// Polls `what` every 250 ms until it holds or `timeout` passes; how long it took.
fn wait_for(timeout: Duration, what: &str, mut holds: impl FnMut() -> bool) -> Duration {
    let started = Instant::now();
    while !holds() {
        assert!(
            started.elapsed() < timeout,
            "{what}: not within {timeout:?}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    started.elapsed()
}

/// One real-node test at a time: they bind the same host ports, and the cloud mounts
/// the host's bpffs.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static NODE_TESTS: std::sync::Mutex<()> = std::sync::Mutex::new(());
    NODE_TESTS.lock().unwrap_or_else(|e| e.into_inner())
}

/// The cloud DaemonSet on a master, with the kubelet stand-in behind a `tunnel edge`
/// process: the operator's own CA, a host without a bpffs, a rolling restart under
/// calls, and an uninstall while a connection is held open.
#[test]
fn deploy_on_a_real_node() {
    let _one = one_at_a_time();
    let Some(kube) = nodes::Kube::find() else {
        return;
    };
    let started = Instant::now();
    let node = nodes::MasterWithStandIn::start(&kube);
    let overlay = install::write_overlay(
        node.dir.path(),
        &node.api,
        &node.apiserver_cgroup.path,
        node.netns.host_ip.into(),
        install::Ca::BroughtByTheOperator,
    );

    // 1. Apply, on a host without a bpffs; 2. what the cloud pod did on its start.
    let pod = install::cloud_ready_on_a_host_without_bpffs(&node, &kube.kubectl, &overlay);
    install::cloud_exempts_its_own_container(&node, &kube.kubectl, &pod);
    install::serving_cloud_holds_no_cap_sys_admin(&node, &kube.kubectl, &pod);

    // 3. kubectl logs, exec and port-forward through the redirect the pod installed.
    let edge = nodes::start_edge(&node.netns, &overlay, node.edge_ip);
    wait_log(&edge, "registered with the cloud", Duration::from_secs(30));
    let context = || {
        format!(
            "edge:\n{}\nkubelet:\n{}",
            edge.log_tail(20),
            node.kubelet.log_tail(20)
        )
    };
    kubectl_checks(&node.api, &kube.kubectls, &node.stand_in, &context);
    assert_reached_stand_in(&node.stand_in, kube.kubectls.len());

    // 4. A rolling restart under a loop of calls through the tunnel.
    rollout::cloud_restart_under_calls(&node.api, &kube.kubectl);

    // 5. Uninstall while a connection is held open through the tunnel.
    teardown::uninstall_while_a_connection_drains(&node, &kube.kubectl, &overlay);
    teardown::edge_address_reached_directly(&node.api, &kube.kubectl, node.edge_ip);
    figure(&format!(
        "whole test {:.1} s",
        started.elapsed().as_secs_f64()
    ));
}

/// The edge node as users run one: a real kubelet with its own containerd for `edge-1`,
/// in a network namespace behind NAT (it reaches the master's addresses; its own
/// address the master reaches only through the tunnel), running the `tunnel-edge`
/// DaemonSet of deploy/, which gets its client certificate by a CSR filed with its
/// pod's token.
#[test]
fn edge_behind_nat_on_a_real_node() {
    let _one = one_at_a_time();
    let Some(kube) = nodes::Kube::find() else {
        return;
    };
    let started = Instant::now();
    let nodes = nodes::MasterAndEdge::start(&kube);
    let context = || nodes.context();

    // 1. Before the tunnel: kube-apiserver cannot reach the edge's kubelet.
    install::edge_kubelet_unreachable_before_the_tunnel(&nodes.api, &kube.kubectl, nodes.edge_ip);

    // 2. Install as a user does: the nodes labelled, the address the edges dial set,
    // kubectl apply -k. The cloud makes the CA and publishes it; the edge's pod waits
    // for it and gets its certificate by CSR.
    let overlay = install::write_overlay(
        nodes.dir.path(),
        &nodes.api,
        &nodes.apiserver_cgroup.path,
        nodes.netns.host_ip.into(),
        install::Ca::MadeByTheCloud,
    );
    install::both_daemonsets_ready(&nodes.api, &kube.kubectl, &overlay, &context);
    install::ca_made_by_the_cloud_is_published(&nodes.api, &kube.kubectl);
    install::edge_certificate_by_an_approved_csr(&nodes.api, &kube.kubectl, &context);

    // 3. Through the tunnel, the same request reaches the edge's kubelet.
    install::edge_kubelet_reached_through_the_tunnel(&nodes.api, &kube.kubectl, &context);

    // 4. A workload on the edge, and what a user does with it, through the tunnel, with
    // the oldest and the newest kubectl; then a scrape that is not the API server's.
    verbs::start_workload(&nodes.api, &kube.kubectl);
    verbs::each_kubectl_on_the_workload(&nodes.api, nodes.dir.path(), &context);
    monitoring::scrape_from_the_masters_redirected_cgroup(&nodes, &context);

    // 5. The edge's uplink down for longer than the heartbeat timeout, then back.
    outage::uplink_down_fails_fast_and_recovers(&nodes, &kube.kubectl);

    // 6. `kubectl rollout restart` of the edge's DaemonSet under a loop of kubectl exec.
    rollout::edge_restart_under_exec(&nodes.api, &kube.kubectl, &context);

    // 7. kubectl delete -k: nothing of ours left on either node.
    teardown::nothing_left_on_either_node(&nodes, &kube.kubectl, &overlay);
    figure(&format!(
        "whole test {:.1} s",
        started.elapsed().as_secs_f64()
    ));
}

/// Five nodes, as users run a cluster with edges: two masters, each with its own API
/// server and tunnel-cloud replica, a worker, and two edges behind NAT that dial the
/// masters through one address. kubectl reaches pods on both edges through either API
/// server; from the worker, through its relay, a pod with its own network (the
/// worker's CNI) reads the edge kubelets as metrics-server does and Prometheus scrapes
/// them; a rolling restart of both replicas
/// under calls and scrapes; a master lost (its cloud container killed, then its kubelet
/// stopped), the other carries both edges; `kubectl delete -k` leaves nothing on any
/// node.
#[test]
fn five_nodes_two_masters() {
    let _one = one_at_a_time();
    let Some(kube) = nodes::Kube::find() else {
        return;
    };
    let started = Instant::now();
    let kubectl = &kube.kubectl;
    let mut nodes = cluster::FiveNodes::start(&kube);
    let worker_pods = nodes.worker_pods_cgroup();
    let overlay = install::Overlay {
        api: nodes.api_lb.listen,
        attach_cgroup: &nodes.redirected.path,
        relay_cgroup: &worker_pods,
        cloud: nodes.tunnel_lb.listen,
        // Each node's own: /var/lib/kubelet is a directory of the node's (its mount
        // namespace), so each master's rolling update hands over on its own socket.
        run_dir: Path::new("/var/lib/kubelet/run-tunnel"),
        ca: install::Ca::MadeByTheCloud,
    }
    .write(nodes.dir.path());

    // 1. Installed as a user does; a pod on each edge, reached through either master.
    let context = || nodes.context();
    install::daemonsets_ready(nodes.api(0), kubectl, &overlay, (2, 2), &context);
    verbs::start_a_pod_on_each_edge(nodes.api(0), kubectl, &cluster::EDGES);
    verbs::logs_and_exec_through_either_api_server(&nodes, kubectl);

    // 2. The worker: the relay; what metrics-server and Prometheus read from there, in
    // pods with their own network; what such a pod is refused.
    worker::relay_on_the_worker(&nodes, kubectl);
    worker::metrics_server_reads_from_a_worker_pod(&nodes, kubectl);
    worker::what_a_pod_is_refused(&nodes, kubectl);
    let prometheus = worker::prometheus_on_the_worker(&nodes, kubectl);

    // 3. Both replicas restarted under calls through both API servers and scrapes; then
    // the dashboard and the rules over what Prometheus saw.
    rollout::cloud_restart_with_two_replicas(&nodes, kubectl, &prometheus);
    worker::dashboard_and_rules_evaluate(&prometheus);

    // 4. A master lost, then back.
    outage::a_master_lost(&mut nodes, kubectl);

    // 5. kubectl delete -k: nothing left on any of the five nodes.
    teardown::nothing_left_on_any_node(&nodes, kubectl, &overlay, &prometheus);
    figure(&format!(
        "whole test {:.1} s",
        started.elapsed().as_secs_f64()
    ));
}
