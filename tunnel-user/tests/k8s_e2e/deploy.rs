//! What deploy/ grants and how it uninstalls, against the real API server.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::config::{path_str, write_toml};
use crate::common::privileged::TestCgroup;
use crate::common::{self};
use crate::k8s::apiserver::{ApiServer, ApiServerOpts, Credential, write_kubeconfig};
use crate::k8s::checks::{NODE, admin_kubectl, prerequisites, wait_log};
use crate::{create_token, sigterm_and_wait, tunnel};

/// What deploy/ grants, against the real API server: the manifests are accepted; the
/// relays' ServiceAccount may do what a relay does and none of the cloud's; the
/// cloud, with a token of the tunnel-cloud ServiceAccount as its only credential,
/// watches Nodes and its peer EndpointSlices and reviews edge tokens; edges presenting
/// a token of another ServiceAccount are refused with the reason, and a tunnel-edge
/// token bound to a pod on `edge-1` is refused on 1.28, which names no node in it, while
/// 1.30+ names the pod's node: it lets the edge in as `edge-1` and refuses it as another.
#[test]
fn deploy_rbac_against_the_real_api_server() {
    let Some((assets, kubectls)) = prerequisites(false) else {
        return;
    };
    let started = Instant::now();
    let kubectl = admin_kubectl(&kubectls);
    let dir = tempfile::tempdir().expect("tempdir");
    let api = ApiServer::start(&assets, dir.path(), &ApiServerOpts::default());
    let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
    let deploy = deploy.to_str().expect("utf-8 path");
    // Namespaced objects are only checked against a namespace that exists.
    api.kubectl_ok(kubectl, &["create", "namespace", "tunnel-system"]);
    let dry = api.kubectl_ok(kubectl, &["apply", "--dry-run=server", "-k", deploy]);
    eprintln!("kubectl apply --dry-run=server -k deploy/:\n{dry}");
    api.kubectl_ok(kubectl, &["apply", "-k", deploy]);

    // The relay's ServiceAccount (relay.yaml) may do what a relay does, and nothing of
    // what the cloud does: no Secret, no Pod, no TokenReview, no approval.
    let as_relay = "--as=system:serviceaccount:tunnel-system:tunnel-relay";
    // An API server that does not serve ServiceCIDRs (1.28) answers "no" whatever the
    // role grants; the relay then takes kubernetes.service_cidrs.
    let networking = api.kubectl_ok(
        kubectl,
        &[
            "api-resources",
            "--api-group=networking.k8s.io",
            "-o",
            "name",
        ],
    );
    let servicecidrs_served = if networking.lines().any(|l| l.starts_with("servicecidrs.")) {
        "yes"
    } else {
        eprintln!("this API server serves no ServiceCIDRs: the relay may not list them");
        "no"
    };
    for (verb, what, allowed) in [
        ("watch", "nodes", "yes"),
        (
            "list",
            "servicecidrs.networking.k8s.io",
            servicecidrs_served,
        ),
        (
            "create",
            "certificatesigningrequests.certificates.k8s.io",
            "yes",
        ),
        (
            "watch",
            "certificatesigningrequests.certificates.k8s.io",
            "yes",
        ),
        ("watch", "endpointslices.discovery.k8s.io", "yes"),
        ("get", "daemonsets.apps/tunnel-relay", "yes"),
        ("get", "daemonsets.apps/tunnel-cloud", "no"),
        ("get", "pods", "no"),
        ("get", "secrets/tunnel-cloud-tls", "no"),
        ("create", "tokenreviews.authentication.k8s.io", "no"),
        ("approve", "signers.certificates.k8s.io/tunnel.io", "no"),
        (
            "update",
            "certificatesigningrequests.certificates.k8s.io",
            "no",
        ),
    ] {
        let out = api.kubectl(
            kubectl,
            &["auth", "can-i", verb, what, "-n", "tunnel-system", as_relay],
        );
        let said = String::from_utf8_lossy(&out.stdout).trim().to_string();
        assert_eq!(said, allowed, "tunnel-relay may {verb} {what}");
    }

    // The API server's own audience (the default): the cloud's credential for the API.
    let token = create_token(&api, kubectl, "tunnel-system", "tunnel-cloud", &[]);
    let kubeconfig = dir.path().join("tunnel-cloud.kubeconfig");
    write_kubeconfig(&kubeconfig, &api.url, &api.pki, Credential::Token(&token));

    let tunnel_dir = dir.path().join("tunnel");
    std::fs::create_dir(&tunnel_dir).expect("tunnel dir");
    let _tunnel_pki = common::Pki::new(&tunnel_dir);
    let reserved = common::reserve_ports::<3>();
    let [tunnel_addr, peers, admin] = reserved.each_ref().map(|p| p.addr);
    let cloud_config = tunnel_dir.join("cloud.toml");
    // The [kubernetes] table of the shipped deploy/config/cloud.toml.
    write_toml(
        &cloud_config,
        &toml::toml! {
            [tunnel]
            listen = (tunnel_addr.to_string())
            cert = "cloud.crt"
            key = "cloud.key"
            client_ca = "ca.crt"

            [admin]
            listen = (admin.to_string())

            [peers]
            listen = (peers.to_string())

            [kubernetes]
            enabled = true
            edge_selector = "node-role.kubernetes.io/edge"
            peer_service = "tunnel-cloud-peers"
            token_review = true
            token_audience = "tunnel-cloud"
            edge_service_account = "tunnel-system:tunnel-edge"
        },
    );
    let mut cloud_cmd = Command::new(common::BIN);
    cloud_cmd
        .args(["cloud", "--config"])
        .arg(&cloud_config)
        .env("KUBECONFIG", &kubeconfig)
        .env("POD_NAMESPACE", "tunnel-system");
    let cloud = tunnel("tunnel-cloud", &tunnel_dir, cloud_cmd);
    wait_log(
        &cloud,
        "node table updated from the API",
        Duration::from_secs(20),
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cloud
        .log_text()
        .lines()
        .any(|l| l.contains("watch (re)listed") && l.contains("peer endpointslices"))
    {
        assert!(
            Instant::now() < deadline,
            "the peer EndpointSlices were never listed:\n{}",
            cloud.log_tail(30)
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    // An edge is refused unless its token is the edges' ServiceAccount's, bound to a node.
    api.kubectl_ok(
        kubectl,
        &[
            "create",
            "serviceaccount",
            "intruder",
            "-n",
            "tunnel-system",
        ],
    );
    let intruder = create_token(
        &api,
        kubectl,
        "tunnel-system",
        "intruder",
        &["--audience", "tunnel-cloud"],
    );
    // The edge's Node, labelled as deploy/ selects edges: only such a node registers.
    api.apply(
        kubectl,
        &format!(
            "apiVersion: v1\nkind: Node\nmetadata:\n  name: {NODE}\n  labels:\n    node-role.kubernetes.io/edge: \"\"\n"
        ),
    );
    // A pod-bound token of tunnel-edge, as the DaemonSet's projected volume gets: 1.28
    // binds it to the pod but names no node; 1.30+ names the pod's node.
    api.apply(
        kubectl,
        &format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: tunnel-edge-e2e\n  namespace: tunnel-system\nspec:\n  nodeName: {NODE}\n  serviceAccountName: tunnel-edge\n  automountServiceAccountToken: false\n  containers:\n  - name: tunnel-edge\n    image: tunnel:0.1.0\n"
        ),
    );
    let edge_token = create_token(
        &api,
        kubectl,
        "tunnel-system",
        "tunnel-edge",
        &[
            "--audience",
            "tunnel-cloud",
            "--bound-object-kind",
            "Pod",
            "--bound-object-name",
            "tunnel-edge-e2e",
        ],
    );
    let binds_node = assets.minor() >= 30;
    eprintln!(
        "{}: pod-bound tokens name the node: {binds_node}",
        assets.version()
    );
    let mut refused = vec![(
        NODE,
        intruder.as_str(),
        "the token is `system:serviceaccount:tunnel-system:intruder`'s, not the edges' service account",
    )];
    if binds_node {
        refused.push((
            "edge-2",
            edge_token.as_str(),
            "the token is bound to node `edge-1`",
        ));
    } else {
        refused.push((
            NODE,
            edge_token.as_str(),
            "the token is not bound to a node (use a projected service account token; Kubernetes 1.30+ binds it)",
        ));
    }
    let edge = |i: usize, node: &str, token: &str| {
        let edge_config = tunnel_dir.join(format!("edge-{i}.toml"));
        write_toml(
            &edge_config,
            &toml::toml! {
                node_name = node

                [cloud]
                address = (tunnel_addr.to_string())
                server_name = "tunnel-cloud"
                ca = "ca.crt"
                token = token

                [admin]
                listen = "127.0.0.1:0"
            },
        );
        let mut edge_cmd = Command::new(common::BIN);
        edge_cmd.args(["edge", "--config"]).arg(&edge_config);
        tunnel("tunnel-edge", &tunnel_dir, edge_cmd)
    };
    for (i, (node, token, reason)) in refused.iter().enumerate() {
        let edge = edge(i, node, token);
        wait_log(&edge, reason, Duration::from_secs(20));
        assert!(
            !cloud.log_text().contains("edge registered"),
            "an edge was let in:\n{}",
            cloud.log_tail(30)
        );
        eprintln!("edge refused as {node}: {reason}");
        drop(edge);
    }
    if binds_node {
        let edge = edge(refused.len(), NODE, &edge_token);
        wait_log(&edge, "registered with the cloud", Duration::from_secs(20));
        assert!(
            cloud
                .log_text()
                .contains(&format!("edge registered node={NODE}")),
            "{}",
            cloud.log_tail(30)
        );
        eprintln!("edge let in as {NODE} with a token bound to a pod on {NODE}");
    }
    let log = cloud.log_text();
    assert!(
        !log.to_ascii_lowercase().contains("forbidden"),
        "the cloud's ServiceAccount was refused something:\n{log}"
    );
    eprintln!("deploy RBAC e2e: {:?}", started.elapsed());
}

/// `redirect.uninstall_with_daemonset` against the real API server, with deploy/'s RBAC
/// and the cloud's ServiceAccount token: a cloud stopped while its DaemonSet stays keeps
/// the pinned redirect (a rolling update); after `kubectl delete daemonset`, the next
/// cloud to stop unpins everything and `bpftool cgroup show` lists nothing.
#[test]
fn deleting_the_daemonset_uninstalls_the_pinned_redirect() {
    uninstall_with_daemonset(Role::Replica);
}

/// The same for a relay (deploy/relay.yaml): its pins and programs go with the
/// `tunnel-relay` DaemonSet, with the relay's ServiceAccount token and deploy/'s RBAC
/// for it (its Node watch and the `get` on its DaemonSet refused nothing).
#[test]
fn deleting_the_relay_daemonset_uninstalls_its_pinned_redirect() {
    uninstall_with_daemonset(Role::Relay);
}

#[derive(Clone, Copy, PartialEq)]
enum Role {
    Replica,
    Relay,
}

fn uninstall_with_daemonset(role: Role) {
    let Some((assets, kubectls)) = prerequisites(true) else {
        return;
    };
    let (account, daemonset) = match role {
        Role::Replica => ("tunnel-cloud", "tunnel-cloud"),
        Role::Relay => ("tunnel-relay", "tunnel-relay"),
    };
    let kubectl = admin_kubectl(&kubectls);
    let dir = tempfile::tempdir().expect("tempdir");
    let api = ApiServer::start(&assets, dir.path(), &ApiServerOpts::default());
    let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
    api.kubectl_ok(kubectl, &["create", "namespace", "tunnel-system"]);
    api.kubectl_ok(kubectl, &["apply", "-k", deploy.to_str().expect("utf-8")]);
    let token = create_token(&api, kubectl, "tunnel-system", account, &[]);
    let kubeconfig = dir.path().join(format!("{account}.kubeconfig"));
    write_kubeconfig(&kubeconfig, &api.url, &api.pki, Credential::Token(&token));

    let root = tunnel_user::intercept::detect_cgroup_root().expect("cgroup v2");
    let cgroup = TestCgroup::new(&root).expect("test cgroup");
    let tunnel_dir = dir.path().join("tunnel");
    std::fs::create_dir(&tunnel_dir).expect("tunnel dir");
    let _tunnel_pki = common::Pki::new(&tunnel_dir);
    let bpffs = tunnel_dir.join("bpffs");
    std::fs::create_dir(&bpffs).expect("bpffs dir");
    let mounted = Command::new("mount")
        .args(["-t", "bpf", "bpf"])
        .arg(&bpffs)
        .status()
        .expect("mount");
    assert!(mounted.success(), "mount -t bpf");
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(bpffs.clone());
    let pin_dir = bpffs.join("tunnel");
    let reserved = common::reserve_ports::<2>();
    let [tunnel_addr, admin] = reserved.each_ref().map(|p| p.addr);
    // Below 1024, as the config asks with pins.
    let redirect_port = common::ClosedPort::privileged([127, 0, 0, 1].into());
    let redirect = redirect_port.addr;
    let redirect_table = toml::toml! {
        enabled = true
        listen = (redirect.to_string())
        cgroup = (path_str(&cgroup.path))
        pin_dir = (path_str(&pin_dir))
        uninstall_with_daemonset = daemonset
    };
    let mut config = match role {
        Role::Replica => toml::toml! {
            [tunnel]
            listen = (tunnel_addr.to_string())
            cert = "cloud.crt"
            key = "cloud.key"
            client_ca = "ca.crt"

            [admin]
            listen = (admin.to_string())

            [kubernetes]
            enabled = true
            edge_selector = "node-role.kubernetes.io/edge"
        },
        Role::Relay => {
            _tunnel_pki.issue(
                "relay",
                &[],
                "system:tunnel-relay:worker-1",
                rcgen::ExtendedKeyUsagePurpose::ClientAuth,
            );
            // No replica to link to: the uninstall does not need one.
            toml::toml! {
                role = "relay"

                [tunnel]
                cert = "relay.crt"
                key = "relay.key"

                [peers]
                static = [(tunnel_addr.to_string())]
                ca = "ca.crt"

                [admin]
                listen = (admin.to_string())

                [kubernetes]
                enabled = true
                edge_selector = "node-role.kubernetes.io/edge"
            }
        }
    };
    // The redirect's table, the same for both.
    config.insert("redirect".into(), toml::Value::Table(redirect_table));
    let cloud_config = tunnel_dir.join("cloud.toml");
    write_toml(&cloud_config, &config);
    let start = || {
        let mut cmd = Command::new(common::BIN);
        cmd.args(["cloud", "--config"])
            .arg(&cloud_config)
            .env("KUBECONFIG", &kubeconfig)
            .env("POD_NAMESPACE", "tunnel-system");
        let cloud = tunnel("tunnel-cloud", &tunnel_dir, cmd);
        wait_log(&cloud, "tunnel cloud started", Duration::from_secs(20));
        cloud
    };
    let attached = || {
        let out = Command::new("bpftool")
            .args(["cgroup", "show"])
            .arg(&cgroup.path)
            .output()
            .expect("bpftool");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| l.contains("multi"))
            .count()
    };

    let mut cloud = start();
    sigterm_and_wait(&mut cloud);
    assert!(
        cloud.log_text().contains("DaemonSet stays"),
        "{}",
        cloud.log_tail(30)
    );
    assert_eq!(
        attached(),
        5,
        "a stop while the DaemonSet stays keeps the programs"
    );
    drop(cloud);

    let mut cloud = start();
    api.kubectl_ok(
        kubectl,
        &["delete", "daemonset", daemonset, "-n", "tunnel-system"],
    );
    sigterm_and_wait(&mut cloud);
    assert!(
        cloud.log_text().contains("eBPF redirect uninstalled"),
        "{}",
        cloud.log_tail(30)
    );
    assert_eq!(
        attached(),
        0,
        "programs left after the DaemonSet's deletion"
    );
    assert!(!pin_dir.exists(), "pins left in {}", pin_dir.display());
    assert!(
        !cloud.log_text().to_ascii_lowercase().contains("forbidden"),
        "deploy/'s RBAC refused {account} something:\n{}",
        cloud.log_tail(30)
    );
}
