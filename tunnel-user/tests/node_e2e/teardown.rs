//! `kubectl delete -k`: what is left of ours on the nodes afterwards (nothing: no pod,
//! no container, no program attached, nothing pinned), and kube-apiserver reaching
//! edge addresses directly again.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::cluster::{EDGES, FiveNodes, Node};
use crate::install::overlay_arg;
use crate::k8s::apiserver::ApiServer;
use crate::k8s::checks::{POD, port_forward};
use crate::k8s::node::{Containerd, PodNetwork, run};
use crate::nodes::{MasterAndEdge, MasterWithStandIn, cloud_pods};
use crate::verbs::{WORKLOAD, edge_pod};
use crate::{EDGE, figure, wait_for};

const PIN_DIR: &str = "/sys/fs/bpf/tunnel";

/// Whatever of ours is left after an uninstall: program names attached to `cgroup`,
/// and files pinned under the pin directory.
pub fn left_behind(cgroup: &Path) -> (Vec<String>, Vec<PathBuf>) {
    let show = run(Command::new("bpftool").args(["cgroup", "show"]).arg(cgroup))
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    let programs = show
        .lines()
        .filter(|l| {
            tunnel_user::intercept::PROGRAM_NAMES
                .iter()
                .any(|p| l.contains(&p[..p.len().min(15)]))
        })
        .map(str::to_string)
        .collect();
    let mut pins = Vec::new();
    let mut stack = vec![PathBuf::from(PIN_DIR)];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(e.path());
            } else {
                pins.push(e.path());
            }
        }
    }
    (programs, pins)
}

/// Echoes a line through `conn`, so it is open end to end through the tunnel, and
/// leaves it open.
fn hold_open(conn: &std::net::TcpStream) {
    use std::io::{Read, Write};
    let mut c = conn;
    c.write_all(b"held\n").expect("send through the tunnel");
    let mut back = [0u8; 5];
    c.read_exact(&mut back).expect("echo through the tunnel");
    assert_eq!(&back, b"held\n");
}

/// Uninstall: nothing attached, nothing pinned; the pins go at once, while a
/// connection held open through the tunnel keeps the pod draining (up to
/// tunnel.drain_timeout, 30 s).
pub fn uninstall_while_a_connection_drains(
    node: &MasterWithStandIn,
    kubectl: &Path,
    overlay: &Path,
) {
    let (api, attach_cgroup) = (&node.api, &node.apiserver_cgroup.path);
    let held = port_forward(api, kubectl);
    hold_open(&held.1);
    let deleted = Instant::now();
    run(Command::new("timeout")
        .arg("150")
        .arg(kubectl)
        .arg("--kubeconfig")
        .arg(&api.admin_kubeconfig)
        // The Namespace goes first and takes what is in it along, so kubectl may find
        // a namespaced object gone already (a NotFound, and exit status 1, without it).
        .args([
            "delete",
            "-k",
            overlay_arg(overlay),
            "--wait=false",
            "--ignore-not-found",
        ]))
    .expect("kubectl delete -k");
    let unpinned = wait_for(Duration::from_secs(20), "the pins removed", || {
        left_behind(attach_cgroup).1.is_empty()
    });
    let draining = !cloud_pods(api, kubectl).is_empty();
    figure(&format!(
        "pins removed {:.1} s after kubectl delete -k, the pod still draining an open connection: {draining}",
        unpinned.as_secs_f64()
    ));
    assert!(
        draining,
        "the pod was gone before the pins: the drain was not waited out"
    );
    wait_for(Duration::from_secs(120), "the cloud pods gone", || {
        cloud_pods(api, kubectl).is_empty()
    });
    drop(held);
    figure(&format!(
        "kubectl delete -k and the cloud pod gone in {:.1} s",
        deleted.elapsed().as_secs_f64()
    ));
    let (programs, pins) = left_behind(attach_cgroup);
    figure(&format!(
        "after kubectl delete -k: programs attached {}, pins left {}",
        programs.len(),
        pins.len()
    ));
    assert!(programs.is_empty(), "still attached: {programs:?}");
    assert!(pins.is_empty(), "still pinned: {pins:?}");
}

/// After the uninstall kube-apiserver's connections to the edge address reach the
/// address itself (a listener the test holds there), not a refusing redirect.
pub fn edge_address_reached_directly(api: &ApiServer, kubectl: &Path, edge_ip: IpAddr) {
    let direct = std::net::TcpListener::bind((edge_ip, 10250)).expect("bind the edge address");
    direct.set_nonblocking(true).expect("nonblocking");
    let out = api.kubectl(kubectl, &["logs", POD]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("connection refused"),
        "kube-apiserver's connections to the edge address are still refused: {stderr}"
    );
    let reached = direct.accept().is_ok();
    figure(&format!(
        "after the uninstall kube-apiserver's connection to {edge_ip}:10250 refused: {}, reached the address itself: {reached}",
        stderr.contains("connection refused")
    ));
    assert!(
        reached,
        "kube-apiserver did not reach {edge_ip}:10250 directly"
    );
}

/// Running containers of `containerd`'s CRI namespace.
pub fn containers(containerd: &Containerd) -> usize {
    let out = containerd
        .ctr(&["tasks", "ls", "-q"])
        .expect("ctr tasks ls");
    String::from_utf8_lossy(&out.stdout).lines().count()
}

/// kubectl delete -k: no pod, no container on either node, no program attached, nothing
/// pinned, and the edge's kubelet unreachable again.
pub fn nothing_left_on_either_node(nodes: &MasterAndEdge, kubectl: &Path, overlay: &Path) {
    let api = &nodes.api;
    api.kubectl_ok(kubectl, &["delete", "pod", WORKLOAD, "--wait=false"]);
    let gone = delete_overlay_until_no_pod(api, kubectl, overlay, Duration::from_secs(120));
    let (master_tasks, edge_tasks) = (
        containers(&nodes.containerd),
        containers(&nodes.edge_containerd),
    );
    let (programs, pins) = left_behind(&nodes.apiserver_cgroup.path);
    let healthz = format!("/api/v1/nodes/{EDGE}/proxy/healthz");
    let after = api.kubectl(kubectl, &["get", "--raw", &healthz]);
    figure(&format!(
        "kubectl delete -k: every pod gone in {:.1} s; containers left: master {master_tasks}, edge {edge_tasks}; programs attached {}, pins {}; kube-apiserver to the edge's kubelet again: {}",
        gone.as_secs_f64(),
        programs.len(),
        pins.len(),
        String::from_utf8_lossy(&after.stderr).trim()
    ));
    assert_eq!(
        (master_tasks, edge_tasks),
        (0, 0),
        "containers left running"
    );
    assert!(
        programs.is_empty() && pins.is_empty(),
        "{programs:?} {pins:?}"
    );
    assert!(
        !after.status.success(),
        "the edge's kubelet reached without a tunnel"
    );
}

/// Files pinned in our pin directories of a node's own bpffs (in its mount namespace):
/// the cloud's on a master, the relay's on the worker (deploy/config/relay.toml). Not
/// the whole bpffs: a fresh one holds the kernel's own `maps.debug` and `progs.debug`.
fn pins_on(node: &Node) -> usize {
    let out = node
        .namespaces
        .command(Path::new("find"))
        .args([PIN_DIR, "/sys/fs/bpf/tunnel-relay", "-type", "f"])
        .output()
        .expect("find");
    String::from_utf8_lossy(&out.stdout).lines().count()
}

/// The links on `node`'s pod bridge: one veth per pod with its own network, none once
/// the pods are gone (the bridge itself goes with the node's namespace).
fn pod_links_on(node: &Node) -> usize {
    let Some(pods) = &node.pods else {
        return 0;
    };
    let out = Command::new("ip")
        .args([
            "-n",
            &node.netns,
            "-o",
            "link",
            "show",
            "master",
            pods.bridge,
        ])
        .output()
        .expect("ip link");
    String::from_utf8_lossy(&out.stdout).lines().count()
}

/// kubectl delete -k of deploy/monitoring/ and deploy/ in the five-node cluster (the
/// worker's reader pod too): no pod, no container on any of the five nodes, no program
/// attached to either master's cgroup or the worker's pods' one, nothing pinned and no
/// pod's network link on any of the three, no lease of the pod network on the host, and
/// the edges' kubelets unreachable again through either API server.
pub fn nothing_left_on_any_node(
    nodes: &FiveNodes,
    kubectl: &Path,
    overlay: &Path,
    prometheus: &crate::worker::Prometheus,
) {
    let api = nodes.api(0);
    crate::worker::uninstall(api, kubectl, prometheus);
    for e in EDGES {
        api.kubectl_ok(kubectl, &["delete", "pod", &edge_pod(e), "--wait=false"]);
    }
    let gone = delete_overlay_until_no_pod(api, kubectl, overlay, Duration::from_secs(150));
    let mut left = 0;
    let mut seen = Vec::new();
    let worker_pods = nodes.worker_pods_cgroup();
    let redirected = nodes
        .masters
        .iter()
        .map(|m| (&m.node, m.cgroup.path.as_path()))
        .chain([(&nodes.worker, worker_pods.as_path())]);
    for (node, cgroup) in redirected {
        let (programs, _) = left_behind(cgroup);
        let (containers, pins) = (containers(&node.containerd), pins_on(node));
        let pod_links = pod_links_on(node);
        left += containers + programs.len() + pins + pod_links;
        seen.push(format!(
            "{} containers {containers}, programs attached {}, pins {pins}, pod network links {pod_links}",
            node.name,
            programs.len()
        ));
    }
    // The pod network's leases were the nodes' own (`NodeNamespaces`), none the host's.
    let host_leases = Path::new("/var/lib/cni/networks").join(PodNetwork::NAME);
    if host_leases.exists() {
        left += 1;
        seen.push(format!("the host's {}", host_leases.display()));
    }
    for node in nodes.edges.iter().map(|e| &e.node) {
        let containers = containers(&node.containerd);
        left += containers;
        seen.push(format!("{} containers {containers}", node.name));
    }
    let mut reached = Vec::new();
    for m in &nodes.masters {
        for e in EDGES {
            let healthz = format!("/api/v1/nodes/{e}/proxy/healthz");
            if m.api
                .kubectl(kubectl, &["get", "--raw", &healthz])
                .status
                .success()
            {
                reached.push(format!("{} -> {e}", m.node.name));
            }
        }
    }
    figure(&format!(
        "kubectl delete -k on five nodes: every pod gone in {:.1} s; left: {}; edge kubelets reached without a tunnel: {reached:?}",
        gone.as_secs_f64(),
        seen.join("; ")
    ));
    assert_eq!(left, 0, "left behind: {}", seen.join("; "));
    assert!(reached.is_empty(), "reached without a tunnel: {reached:?}");
}

/// `kubectl delete -k` of the overlay, then how long until no pod is left in any
/// namespace (the test's own pods were deleted before).
fn delete_overlay_until_no_pod(
    api: &ApiServer,
    kubectl: &Path,
    overlay: &Path,
    timeout: Duration,
) -> Duration {
    api.kubectl_ok(
        kubectl,
        &[
            "delete",
            "-k",
            overlay_arg(overlay),
            "--wait=false",
            "--ignore-not-found",
        ],
    );
    wait_for(timeout, "every pod gone", || {
        api.kubectl_ok(kubectl, &["get", "pods", "-A", "-o", "name"])
            .trim()
            .is_empty()
    })
}
