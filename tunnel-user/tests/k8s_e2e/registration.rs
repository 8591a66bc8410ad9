//! Only an edge node's edge registers. Any kubelet can get a client certificate for its
//! own name (by CSR); with the Node watch on, the cloud takes a node's registration only
//! when its Node carries the edge selector's label, so a worker or a master holding its
//! own certificate is refused with the reason, and no session of it is kept.

use std::time::Duration;

use crate::common::config::allow;
use crate::common::{EdgeOpts, Setup, debug_edges, servers};
use crate::k8s::apiserver::{ApiServer, ApiServerOpts};
use crate::k8s::checks::{admin_kubectl, prerequisites};

#[test]
fn a_node_without_the_edge_label_cannot_register_with_its_own_certificate() {
    let Some((assets, kubectls)) = prerequisites(false) else {
        return;
    };
    let kubectl = admin_kubectl(&kubectls);
    let mut s = Setup::new("unused:unused-token\n");
    let api = ApiServer::start(&assets, s.path(), &ApiServerOpts::default());
    for (name, labels) in [
        ("worker-1", r#"{"kubernetes.io/os": "linux"}"#),
        ("edge-1", r#"{"node-role.kubernetes.io/edge": ""}"#),
    ] {
        api.apply(
            kubectl,
            &format!("apiVersion: v1\nkind: Node\nmetadata:\n  name: {name}\n  labels: {labels}\n"),
        );
    }
    let kubeconfig = format!("KUBECONFIG={}", api.admin_kubeconfig.display());
    let mut cloud = s.spawn_cloud(
        toml::toml! {
            [kubernetes]
            enabled = true
        },
        &["env", &kubeconfig],
    );
    s.cloud_ready(&mut cloud);
    cloud.wait_log("edge_nodes=1", Duration::from_secs(20));
    let target = servers::sink("127.0.0.1:0");

    s.pki.client_cert("worker-1");
    let mut worker = EdgeOpts::new("worker-1", "");
    worker.cert = Some("edge-worker-1");
    worker.extra = allow(&[target]);
    let (worker, _) = s.start_edge(worker);
    let reason = "`worker-1` is not an edge node: no Node of that name matches the edge selector `node-role.kubernetes.io/edge`";
    worker.wait_log(reason, Duration::from_secs(20));
    cloud.wait_log(reason, Duration::from_secs(5));

    s.pki.client_cert("edge-1");
    let mut edge = EdgeOpts::new("edge-1", "");
    edge.cert = Some("edge-edge-1");
    edge.extra = allow(&[target]);
    let _edge = s.start_ready_edge(edge);
    let listed: Vec<String> = debug_edges(s.cloud_admin)
        .expect("listing")
        .iter()
        .map(|e| e["node"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(listed, ["edge-1"], "only the labelled node's edge is held");
}
