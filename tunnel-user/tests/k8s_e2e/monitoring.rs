//! deploy/monitoring/targets.sh against a real API server: from the Nodes it lists,
//! the edge kubelets (by the edge label, IPv6 in brackets), the replicas (masters) and
//! the relays (the other nodes), each labelled with its node, in the ConfigMap
//! Prometheus mounts, or only in files with `--out`.

use std::path::Path;
use std::process::Command;

use serde_json::{Value, json};

use crate::common::monitoring::shipped_dir;
use crate::k8s::apiserver::{ApiServer, ApiServerOpts};
use crate::k8s::checks::{admin_kubectl, prerequisites};
use crate::node_addresses::node;

const EDGE: &str = "{node-role.kubernetes.io/edge: \"\"}";
const MASTER: &str = "{node-role.kubernetes.io/control-plane: \"\"}";

/// targets.sh with `args`, run with `kubectl` as admin of `api`; its stderr (the counts).
fn targets_sh(api: &ApiServer, kubectl: &Path, args: &[&str]) -> String {
    let out = Command::new("timeout")
        .arg("60")
        .arg(shipped_dir().join("targets.sh"))
        .args(args)
        .env("KUBECTL", kubectl)
        .env("KUBECONFIG", &api.admin_kubeconfig)
        .output()
        .expect("targets.sh");
    let said = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(
        out.status.success(),
        "targets.sh {args:?}: {said}{}",
        String::from_utf8_lossy(&out.stdout)
    );
    said
}

#[test]
fn targets_sh_lists_edge_kubelets_replicas_and_relays_from_the_nodes() {
    let Some((assets, kubectls)) = prerequisites(false) else {
        return;
    };
    let kubectl = admin_kubectl(&kubectls);
    let dir = tempfile::tempdir().expect("tempdir");
    let api = ApiServer::start(&assets, dir.path(), &ApiServerOpts::default());
    node(&api, kubectl, "master-1", MASTER, &["192.0.2.1"]);
    node(
        &api,
        kubectl,
        "edge-1",
        EDGE,
        &["192.0.2.11", "203.0.113.11"],
    );
    node(&api, kubectl, "edge-2", EDGE, &["fd00:7e57::2"]);
    node(&api, kubectl, "worker-1", "{}", &["192.0.2.31"]);

    let expected = [
        (
            "edge-kubelet.json",
            json!([
                {"targets": ["192.0.2.11:10250"], "labels": {"node": "edge-1"}},
                {"targets": ["[fd00:7e57::2]:10250"], "labels": {"node": "edge-2"}},
            ]),
        ),
        (
            "tunnel-cloud.json",
            json!([{"targets": ["192.0.2.1:9101"], "labels": {"host": "master-1"}}]),
        ),
        (
            "tunnel-relay.json",
            json!([{"targets": ["192.0.2.31:9101"], "labels": {"host": "worker-1"}}]),
        ),
        ("tunnel-edge.json", json!([])),
    ];
    let out = dir.path().join("targets");
    let said = targets_sh(&api, kubectl, &["--out", out.to_str().expect("utf-8")]);
    println!("targets.sh --out: {said}");
    for (file, want) in &expected {
        let text = std::fs::read_to_string(out.join(file)).expect(file);
        let got: Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{file}: {e}: {text}"));
        assert_eq!(&got, want, "{file}");
    }

    // Without --out: the ConfigMap in deploy/monitoring/'s namespace, made, then updated.
    api.kubectl_ok(kubectl, &["create", "namespace", "tunnel-monitoring"]);
    targets_sh(&api, kubectl, &[]);
    node(&api, kubectl, "edge-3", EDGE, &["192.0.2.13"]);
    targets_sh(&api, kubectl, &[]);
    let map: Value = serde_json::from_str(&api.kubectl_ok(
        kubectl,
        &[
            "-n",
            "tunnel-monitoring",
            "get",
            "configmap",
            "prometheus-targets",
            "-o",
            "json",
        ],
    ))
    .expect("ConfigMap JSON");
    for (file, want) in &expected {
        let got: Value = serde_json::from_str(map["data"][file].as_str().expect(file))
            .unwrap_or_else(|e| panic!("{file}: {e}"));
        match *file {
            "edge-kubelet.json" => {
                assert_eq!(got.as_array().map(Vec::len), Some(3), "{got}");
                assert_eq!(
                    got[2],
                    json!({"targets": ["192.0.2.13:10250"], "labels": {"node": "edge-3"}})
                );
            }
            _ => assert_eq!(&got, want, "{file}"),
        }
    }
}
