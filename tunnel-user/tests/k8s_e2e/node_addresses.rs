//! A node's addresses are its own: a compromised edge, with nothing but its kubelet's
//! credentials (system:node:NAME, which NodeRestriction confines to its own Node),
//! writes its Node status to list a master's address and 127.0.0.1. In plain Kubernetes
//! that only misleads connections meant for the edge itself; through the cloud it
//! would take every master's connections to those addresses. The cloud routes neither
//! to it, says so once, and counts it, while the honest edge keeps its address.

use std::io::{Read, Write};
use std::time::Duration;

use rcgen::ExtendedKeyUsagePurpose;

use crate::common::config::allow;
use crate::common::{self, EdgeOpts, Setup, connect_via, servers};
use crate::k8s::apiserver::{ApiServer, ApiServerOpts};
use crate::k8s::checks::{admin_kubectl, prerequisites};

const MASTER_IP: &str = "192.0.2.1";
/// The compromised edge's own address: it keeps it (no edge runs for it, so nothing
/// is ever dialled there; a CONNECT to it finds the node without an edge).
const EVIL_IP: &str = "192.0.2.20";
/// The honest edge's address, on this host's loopback where its target listens (the
/// edge runs on this host); outside 127.0.0.0/16, which is the host's own.
const HONEST_IP: &str = "127.1.0.5";
const TOKEN: &str = "honest-token";

/// A Node with `labels` (YAML flow map) and `addresses` in its status, made as admin.
pub(crate) fn node(
    api: &ApiServer,
    kubectl: &std::path::Path,
    name: &str,
    labels: &str,
    ips: &[&str],
) {
    api.apply(
        kubectl,
        &format!("apiVersion: v1\nkind: Node\nmetadata:\n  name: {name}\n  labels: {labels}\n"),
    );
    api.kubectl_ok(
        kubectl,
        &[
            "patch",
            "node",
            name,
            "--subresource=status",
            "--type=merge",
            "-p",
            &status_patch(ips),
        ],
    );
}

/// A merge patch that makes `ips` the node's addresses (the first InternalIP, the
/// others ExternalIP, as clouds report them).
fn status_patch(ips: &[&str]) -> String {
    let addresses: Vec<String> = ips
        .iter()
        .enumerate()
        .map(|(i, ip)| {
            let kind = if i == 0 { "InternalIP" } else { "ExternalIP" };
            format!(r#"{{"type":"{kind}","address":"{ip}"}}"#)
        })
        .collect();
    format!(r#"{{"status":{{"addresses":[{}]}}}}"#, addresses.join(","))
}

/// PATCHes `node`'s status to list `ips`, as kubelet `kubelet` (its client certificate
/// from `api.pki`, named `<kubelet>-kubelet`) does: the HTTP status and the answer.
fn patch_as_kubelet(api: &ApiServer, kubelet: &str, node: &str, ips: &[&str]) -> (String, String) {
    // The patch goes in a file: thousands of addresses are past a command line's size.
    let body = api.pki.path(&format!("{kubelet}-patch.json"));
    std::fs::write(&body, status_patch(ips)).expect("patch body");
    let out = std::process::Command::new("curl")
        .args([
            "-sS",
            "--max-time",
            "10",
            "-o",
            "/dev/stderr",
            "-w",
            "%{http_code}",
        ])
        .args(["--cacert", &api.pki.path("ca.crt")])
        .args(["--cert", &api.pki.path(&format!("{kubelet}-kubelet.crt"))])
        .args(["--key", &api.pki.path(&format!("{kubelet}-kubelet.key"))])
        .args([
            "-X",
            "PATCH",
            "-H",
            "Content-Type: application/merge-patch+json",
        ])
        .args(["--data-binary", &format!("@{body}")])
        .arg(format!("{}/api/v1/nodes/{node}/status", api.url))
        .output()
        .expect("curl");
    let code = String::from_utf8_lossy(&out.stdout).to_string();
    (code, String::from_utf8_lossy(&out.stderr).to_string())
}

/// The status line a CONNECT to `authority` through the cloud gets, or "200" with the
/// stream.
fn connect_status(proxy: std::net::SocketAddr, authority: &str) -> String {
    match connect_via(proxy, authority) {
        Ok(_) => "200".into(),
        Err(line) => line,
    }
}

#[test]
fn an_edge_listing_another_nodes_address_or_loopback_gets_no_connection_to_it() {
    let Some((assets, kubectls)) = prerequisites(false) else {
        return;
    };
    let kubectl = admin_kubectl(&kubectls);
    let mut s = Setup::new(&format!("edge-honest:{TOKEN}\n"));
    let api = ApiServer::start(
        &assets,
        s.path(),
        &ApiServerOpts {
            // What a real cluster runs (kubeadm enables it): a node may write only its
            // own Node. The attack needs no more than that.
            extra_args: vec!["--enable-admission-plugins=NodeRestriction".into()],
            ..ApiServerOpts::default()
        },
    );
    let edge_label = r#"{"node-role.kubernetes.io/edge": ""}"#;
    node(
        &api,
        kubectl,
        "master-1",
        r#"{"node-role.kubernetes.io/control-plane": ""}"#,
        &[MASTER_IP],
    );
    node(&api, kubectl, "edge-honest", edge_label, &[HONEST_IP]);
    node(&api, kubectl, "edge-evil", edge_label, &[EVIL_IP]);

    let kubeconfig = format!("KUBECONFIG={}", api.admin_kubeconfig.display());
    let mut cloud = s.spawn_cloud(
        toml::toml! {
            [kubernetes]
            enabled = true
        },
        &["env", &kubeconfig],
    );
    s.cloud_ready(&mut cloud);
    cloud.wait_log("edge_nodes=2", Duration::from_secs(20));
    let target = servers::sink(&format!("{HONEST_IP}:0"));
    let mut opts = EdgeOpts::new("edge-honest", TOKEN);
    opts.extra = allow(&[target]);
    let _honest = s.start_ready_edge(opts);

    // The kubelet's own credentials: a client certificate for system:node:edge-evil in
    // group system:nodes.
    api.pki.issue(
        "edge-evil-kubelet",
        "system:node:edge-evil",
        Some("system:nodes"),
        &[],
        ExtendedKeyUsagePurpose::ClientAuth,
    );
    let patch_as_evil = |node: &str, ips: &[&str]| patch_as_kubelet(&api, "edge-evil", node, ips);
    let (code, body) = patch_as_evil("master-1", &[EVIL_IP]);
    assert_eq!(
        code, "403",
        "NodeRestriction must confine the node to its own Node: {body}"
    );
    let (code, body) = patch_as_evil("edge-evil", &[EVIL_IP, MASTER_IP, "127.0.0.1"]);
    assert_eq!(code, "200", "a node writes its own status: {body}");
    cloud.wait_log_count(
        "node table updated from the API",
        2,
        Duration::from_secs(20),
    );

    // What a client on a master (curl -x, kube-apiserver's egress selector) sees: the
    // claimed addresses are no node's, the edge's own address and the honest edge's
    // still are.
    for (authority, expected) in [
        (format!("{MASTER_IP}:10250"), "HTTP/1.1 404"),
        ("127.0.0.1:10250".to_string(), "HTTP/1.1 404"),
        (format!("{EVIL_IP}:10250"), "HTTP/1.1 502"),
    ] {
        let status = connect_status(s.connect, &authority);
        assert!(
            status.starts_with(expected),
            "CONNECT {authority}: {status}, expected {expected}; cloud log:\n{}",
            cloud.log_text()
        );
    }
    let mut honest = connect_via(s.connect, &target.to_string()).expect("the honest edge routes");
    honest.write_all(b"hello").expect("write");
    honest.shutdown(std::net::Shutdown::Write).expect("fin");
    let mut answer = String::new();
    honest.read_to_string(&mut answer).expect("read");
    assert!(answer.starts_with("5 "), "the sink got 5 bytes: {answer:?}");

    let dropped = |reason: &str| {
        common::metric(
            s.cloud_admin,
            &format!("tunnel_node_addresses_dropped{{reason=\"{reason}\"}}"),
        )
    };
    assert_eq!(dropped("conflict"), 1.0, "the master's address");
    assert_eq!(dropped("reserved"), 1.0, "127.0.0.1");
    let warned = |log: &str| {
        log.lines()
            .filter(|l| {
                l.contains("WARN") && l.contains(MASTER_IP) && l.contains("edge-evil, master-1")
            })
            .count()
    };
    assert_eq!(warned(&cloud.log_text()), 1, "{}", cloud.log_text());
    let said: Vec<String> = cloud
        .log_text()
        .lines()
        .filter(|l| l.contains("WARN"))
        .map(String::from)
        .collect();
    eprintln!("the cloud warned:\n{}", said.join("\n"));
    assert!(
        cloud.log_text().lines().any(|l| l.contains("WARN")
            && l.contains("127.0.0.1")
            && l.contains("edge-evil")
            && l.contains("loopback")),
        "{}",
        cloud.log_text()
    );

    // Another change to the table while the claim stands: said once, not again.
    api.kubectl_ok(
        kubectl,
        &[
            "patch",
            "node",
            "edge-honest",
            "--subresource=status",
            "--type=merge",
            "-p",
            &status_patch(&[HONEST_IP, "127.1.0.6"]),
        ],
    );
    cloud.wait_log_count(
        "node table updated from the API",
        3,
        Duration::from_secs(20),
    );
    assert_eq!(warned(&cloud.log_text()), 1, "{}", cloud.log_text());

    // The edge drops its claim: nothing is left out any more.
    assert_eq!(patch_as_evil("edge-evil", &[EVIL_IP]).0, "200");
    cloud.wait_log_count(
        "node table updated from the API",
        4,
        Duration::from_secs(20),
    );
    assert_eq!(dropped("conflict"), 0.0);
    assert_eq!(dropped("reserved"), 0.0);
    assert!(
        connect_status(s.connect, &format!("{MASTER_IP}:10250")).starts_with("HTTP/1.1 404"),
        "a master's address is never an edge's"
    );
}

/// A master's pod address (metrics-server's, which kube-apiserver dials with aggregator
/// routing) and a Service's ClusterIP, in a compromised edge's status patch beside
/// thousands of junk addresses: neither is routed to the edge, the junk costs one
/// warning and one metric, and a later patch that changes only the junk builds no new
/// node table.
#[test]
fn an_edge_listing_a_masters_pod_address_a_service_ip_and_thousands_more_gets_none_of_them() {
    let Some((assets, kubectls)) = prerequisites(false) else {
        return;
    };
    let kubectl = admin_kubectl(&kubectls);
    let mut s = Setup::new(&format!("edge-honest:{TOKEN}\n"));
    let api = ApiServer::start(
        &assets,
        s.path(),
        &ApiServerOpts {
            extra_args: vec!["--enable-admission-plugins=NodeRestriction".into()],
            ..ApiServerOpts::default()
        },
    );
    // The master's pods are in 10.244.0.0/24 (node IPAM sets a Node's podCIDR once).
    api.apply(
        kubectl,
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: master-1\n  labels: {\"node-role.kubernetes.io/control-plane\": \"\"}\nspec:\n  podCIDR: 10.244.0.0/24\n  podCIDRs: [10.244.0.0/24]\n",
    );
    let edge_label = r#"{"node-role.kubernetes.io/edge": ""}"#;
    node(&api, kubectl, "edge-honest", edge_label, &[HONEST_IP]);
    node(&api, kubectl, "edge-evil", edge_label, &[EVIL_IP]);
    // The API server's Service range is 10.0.0.0/24 (ApiServer). From 1.33 it lists it
    // as a ServiceCIDR; an older one needs it said in the config.
    let service_cidr_api = api
        .kubectl(kubectl, &["get", "servicecidrs"])
        .status
        .success();
    eprintln!("the API server lists ServiceCIDRs: {service_cidr_api}");
    let mut kubernetes = toml::toml! { enabled = true };
    if !service_cidr_api {
        kubernetes.insert(
            "service_cidrs".into(),
            toml::Value::from(vec!["10.0.0.0/24"]),
        );
    }
    let mut extra = toml::Table::new();
    extra.insert("kubernetes".into(), toml::Value::Table(kubernetes));
    let kubeconfig = format!("KUBECONFIG={}", api.admin_kubeconfig.display());
    let mut cloud = s.spawn_cloud(extra, &["env", &kubeconfig]);
    s.cloud_ready(&mut cloud);
    cloud.wait_log("edge_nodes=2", Duration::from_secs(20));
    let target = servers::sink(&format!("{HONEST_IP}:0"));
    let mut opts = EdgeOpts::new("edge-honest", TOKEN);
    opts.extra = allow(&[target]);
    let _honest = s.start_ready_edge(opts);

    api.pki.issue(
        "edge-evil-kubelet",
        "system:node:edge-evil",
        Some("system:nodes"),
        &[],
        ExtendedKeyUsagePurpose::ClientAuth,
    );
    // 3,000 addresses; past the first ten, `second` tells one patch's from another's.
    let junk = |second: u8| -> Vec<String> {
        (0..3000)
            .map(|i| match i {
                0..10 => format!("198.18.0.{}", i + 1),
                _ => format!("198.{second}.{}.{}", i / 250, i % 250 + 1),
            })
            .collect()
    };
    let claims = |junk: &[String]| -> Vec<String> {
        let mut ips: Vec<String> = [EVIL_IP, "10.244.0.5", "10.0.0.10"]
            .iter()
            .map(|ip| ip.to_string())
            .collect();
        ips.extend_from_slice(junk);
        ips
    };
    let first = claims(&junk(18));
    let refs: Vec<&str> = first.iter().map(String::as_str).collect();
    let (code, body) = patch_as_kubelet(&api, "edge-evil", "edge-evil", &refs);
    assert_eq!(
        code,
        "200",
        "a node writes its own status: {}",
        &body[..body.len().min(500)]
    );
    cloud.wait_log_count(
        "node table updated from the API",
        2,
        Duration::from_secs(20),
    );

    for (authority, expected) in [
        ("10.244.0.5:10250", "HTTP/1.1 404"),
        ("10.0.0.10:10250", "HTTP/1.1 404"),
        // Past the first 8 IPv4 addresses the node lists.
        ("198.18.10.100:10250", "HTTP/1.1 404"),
        (&format!("{EVIL_IP}:10250") as &str, "HTTP/1.1 502"),
    ] {
        let status = connect_status(s.connect, authority);
        assert!(
            status.starts_with(expected),
            "CONNECT {authority}: {status}, expected {expected}; cloud log:\n{}",
            cloud.log_text()
        );
    }
    let mut honest = connect_via(s.connect, &target.to_string()).expect("the honest edge routes");
    honest.write_all(b"hello").expect("write");
    honest.shutdown(std::net::Shutdown::Write).expect("fin");
    let mut answer = String::new();
    honest.read_to_string(&mut answer).expect("read");
    assert!(answer.starts_with("5 "), "the sink got 5 bytes: {answer:?}");

    let dropped = |reason: &str| {
        common::metric(
            s.cloud_admin,
            &format!("tunnel_node_addresses_dropped{{reason=\"{reason}\"}}"),
        )
    };
    assert_eq!(
        dropped("reserved"),
        2.0,
        "the pod address and the ClusterIP"
    );
    assert_eq!(dropped("too_many"), 1.0, "edge-evil");
    let warnings: Vec<String> = cloud
        .log_text()
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("edge-evil"))
        .map(String::from)
        .collect();
    eprintln!("the cloud warned:\n{}", warnings.join("\n"));
    assert_eq!(warnings.len(), 3, "a few lines, not one per address");

    // The junk changes, nothing else: no new table. Then a change to the honest edge
    // builds one, the only one since.
    let second = claims(&junk(19));
    let refs: Vec<&str> = second.iter().map(String::as_str).collect();
    assert_eq!(
        patch_as_kubelet(&api, "edge-evil", "edge-evil", &refs).0,
        "200"
    );
    api.kubectl_ok(
        kubectl,
        &[
            "patch",
            "node",
            "edge-honest",
            "--subresource=status",
            "--type=merge",
            "-p",
            &status_patch(&[HONEST_IP, "127.1.0.6"]),
        ],
    );
    cloud.wait_log_count(
        "node table updated from the API",
        3,
        Duration::from_secs(20),
    );
    assert_eq!(
        cloud
            .log_text()
            .matches("node table updated from the API")
            .count(),
        3,
        "the junk-only patch built a table\n{}",
        cloud.log_text()
    );
}
