//! The monitoring paths to the edge's kubelet: what metrics-server, `kubectl top` and
//! Prometheus read, through the API server's node proxy and from a process on the
//! master that is not the API server.

use std::process::Command;

use crate::nodes::MasterAndEdge;
use crate::verbs::{User, WORKLOAD};
use crate::{EDGE, figure};

/// `kubectl get --raw` of the node's `/metrics/resource`, `/stats/summary` and
/// `/metrics/cadvisor`, each parsed.
pub fn node_proxy_paths(user: &User) {
    let raw = |path: &str| user.ok(&["get", "--raw", path]);
    let resource = raw(&format!("/api/v1/nodes/{EDGE}/proxy/metrics/resource"));
    assert!(
        resource
            .lines()
            .any(|l| l.starts_with("node_cpu_usage_seconds_total ")),
        "{resource}"
    );
    let workload_cpu = resource
        .lines()
        .find(|l| {
            l.starts_with("container_cpu_usage_seconds_total{")
                && l.contains(&format!("pod=\"{WORKLOAD}\""))
        })
        .unwrap_or_else(|| panic!("no CPU of the workload in /metrics/resource:\n{resource}"));
    user.figure(&format!(
        "kubectl get --raw .../metrics/resource: ok, {} bytes; {workload_cpu}",
        resource.len()
    ));
    let summary = raw(&format!("/api/v1/nodes/{EDGE}/proxy/stats/summary"));
    let summary: serde_json::Value = serde_json::from_str(&summary).expect("stats/summary is JSON");
    assert_eq!(summary["node"]["nodeName"], EDGE);
    let pods: Vec<&str> = summary["pods"]
        .as_array()
        .expect("pods")
        .iter()
        .filter_map(|p| p["podRef"]["name"].as_str())
        .collect();
    assert!(pods.contains(&WORKLOAD), "{pods:?}");
    user.figure(&format!(
        "kubectl get --raw .../stats/summary: ok, node {EDGE} memory working set {} bytes, pods {pods:?}",
        summary["node"]["memory"]["workingSetBytes"]
    ));
    let cadvisor = raw(&format!("/api/v1/nodes/{EDGE}/proxy/metrics/cadvisor"));
    let series = cadvisor.lines().filter(|l| !l.starts_with('#')).count();
    assert!(
        cadvisor.contains("container_memory_working_set_bytes{"),
        "{}",
        &cadvisor[..cadvisor.len().min(2000)]
    );
    user.figure(&format!(
        "kubectl get --raw .../metrics/cadvisor: ok, {} bytes, {series} series",
        cadvisor.len()
    ));
}

/// A scrape of the edge kubelet's /metrics from a process on the master that is not
/// the API server (Prometheus, say), in the redirected cgroup, with a client
/// certificate the kubelet accepts.
pub fn scrape_from_the_masters_redirected_cgroup(
    nodes: &MasterAndEdge,
    context: &dyn Fn() -> String,
) {
    let pki = nodes.dir.path().join("pki");
    let edge_ip = nodes.edge_ip;
    let scrape = Command::new("sh")
        .arg("-c")
        .arg(r#"echo $$ > "$0" && exec "$@""#)
        .arg(nodes.apiserver_cgroup.path.join("cgroup.procs"))
        .args(["curl", "-sS", "--fail", "--max-time", "20", "--cacert"])
        .arg(pki.join("ca.crt"))
        .arg("--cert")
        .arg(pki.join("kubelet-client.crt"))
        .arg("--key")
        .arg(pki.join("kubelet-client.key"))
        .arg(format!("https://{edge_ip}:10250/metrics"))
        .output()
        .expect("curl");
    let metrics = String::from_utf8_lossy(&scrape.stdout);
    let samples = metrics
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .count();
    figure(&format!(
        "curl https://{edge_ip}:10250/metrics from the master's redirected cgroup: {}, {} bytes, {samples} samples",
        scrape.status,
        metrics.len()
    ));
    assert!(
        scrape.status.success() && metrics.contains("kubelet_running_pods"),
        "{}\n{}",
        String::from_utf8_lossy(&scrape.stderr),
        context()
    );
}
