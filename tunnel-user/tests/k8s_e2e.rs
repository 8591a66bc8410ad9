//! End to end against a real kube-apiserver (the envtest convention: KUBEBUILDER_ASSETS
//! names a directory holding `kube-apiserver`; etcd from there or Debian's etcd-server).
//! kubectl talks to the API server, the API server to a kubelet stand-in on an edge
//! node address that only the tunnel reaches, and the cloud learns that address from
//! the Node watcher against the same API server.

mod common;
mod k8s;
#[expect(
    dead_code,
    reason = "the e2e tests start processes in cgroups themselves"
)]
mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use k8s::apiserver::{ApiServer, ApiServerOpts, Assets, Daemon};
use k8s::kubelet::{Kubelet, LOG_TEXT};
use k8s::netns::EdgeNetns;
use rcgen::ExtendedKeyUsagePurpose;
use support::TestCgroup;

const NODE: &str = "edge-1";
const TOKEN: &str = "edge-one-token";
const POD: &str = "standin";

/// The kubectl clients to check with: 1.28 (SPDY for exec and port-forward) and 1.32
/// (websocket first, SPDY fallback). A missing one is said loudly.
fn kubectls() -> Vec<PathBuf> {
    let mut found = Vec::new();
    for path in [
        "/usr/lib/google-cloud-sdk/bin/kubectl.1.28",
        "/usr/lib/google-cloud-sdk/bin/kubectl.1.32",
    ] {
        if Path::new(path).is_file() {
            found.push(PathBuf::from(path));
        } else {
            support::cannot_run(&format!("{path} is absent: not checked with it"));
        }
    }
    found
}

/// The API server's assets, root and kubectl, or None after saying loudly what is
/// missing.
fn prerequisites() -> Option<(Assets, Vec<PathBuf>)> {
    let assets = match Assets::find() {
        Ok(a) => a,
        Err(why) => {
            support::cannot_run(&format!("no real kube-apiserver: {why}"));
            return None;
        }
    };
    if !support::is_root() {
        support::cannot_run("the e2e tests need root (eBPF, cgroups, network namespaces)");
        return None;
    }
    let kubectls = kubectls();
    if kubectls.is_empty() {
        support::cannot_run("no kubectl 1.28 or 1.32");
        return None;
    }
    Some((assets, kubectls))
}

/// The admin kubectl for setting up objects (any version does).
fn admin_kubectl(kubectls: &[PathBuf]) -> &Path {
    &kubectls[kubectls.len() - 1]
}

/// Waits until `daemon`'s log contains `needle`.
fn wait_log(daemon: &Daemon, needle: &str, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while !daemon.log_text().contains(needle) {
        assert!(
            Instant::now() < deadline,
            "{}: `{needle}` not logged within {timeout:?}:\n{}",
            daemon.name,
            daemon.log_tail(40)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The edge Node (status: its InternalIP and kubelet port) and a pod bound to it.
fn create_node_and_pod(api: &ApiServer, kubectl: &Path, edge_ip: &str) {
    api.apply(
        kubectl,
        &format!(
            "apiVersion: v1\nkind: Node\nmetadata:\n  name: {NODE}\n  labels:\n    node-role.kubernetes.io/edge: \"\"\n"
        ),
    );
    api.kubectl_ok(
        kubectl,
        &[
            "patch",
            "node",
            NODE,
            "--subresource=status",
            "--type=merge",
            "-p",
            &format!(
                r#"{{"status":{{"addresses":[{{"type":"InternalIP","address":"{edge_ip}"}}],"daemonEndpoints":{{"kubeletEndpoint":{{"Port":10250}}}}}}}}"#
            ),
        ],
    );
    // No controller-manager runs: the default service account is made by hand (the
    // ServiceAccount admission plugin looks it up).
    api.apply(
        kubectl,
        &format!(
            "apiVersion: v1\nkind: ServiceAccount\nmetadata:\n  name: default\n---\napiVersion: v1\nkind: Pod\nmetadata:\n  name: {POD}\nspec:\n  nodeName: {NODE}\n  automountServiceAccountToken: false\n  containers:\n  - name: main\n    image: standin\n"
        ),
    );
}

/// A tunnel process (cloud or edge) with its log in `dir`.
fn tunnel(name: &'static str, dir: &Path, mut cmd: Command) -> Daemon {
    cmd.env("RUST_LOG", "info,tunnel_user=debug")
        .env_remove("NODE_NAME");
    Daemon::start(name, dir, cmd)
}

/// The transparent path: kube-apiserver (in a child cgroup with the eBPF redirect
/// attached) dials the Node's InternalIP:10250 as it would a kubelet, and lands on the
/// stand-in through tunnel-cloud and tunnel-edge, TLS verified end to end.
#[test]
fn kubectl_through_the_transparent_redirect() {
    let Some((assets, kubectls)) = prerequisites() else {
        return;
    };
    let cgroup_root = match tunnel_user::intercept::detect_cgroup_root() {
        Ok(root) => root,
        Err(e) => {
            support::cannot_run(&format!("no cgroup v2: {e}"));
            return;
        }
    };
    let started = Instant::now();
    let dir = tempfile::tempdir().expect("tempdir");
    let cgroup = TestCgroup::new(&cgroup_root).expect("test cgroup");
    let netns = EdgeNetns::new().expect("edge network namespace");
    let edge_ip = netns.edge_ip.to_string();

    let api = ApiServer::start(
        &assets,
        dir.path(),
        &ApiServerOpts {
            cgroup: Some(cgroup.path.clone()),
            ..ApiServerOpts::default()
        },
    );
    eprintln!("kube-apiserver ready in {:?}", started.elapsed());
    let kubectl = admin_kubectl(&kubectls);
    create_node_and_pod(&api, kubectl, &edge_ip);

    api.pki.issue(
        "kubelet",
        NODE,
        None,
        &[&edge_ip],
        ExtendedKeyUsagePurpose::ServerAuth,
    );
    let kubelet = Kubelet::start(
        &netns.name,
        format!("{edge_ip}:10250").parse().expect("addr"),
        &api.pki,
        "kubelet",
    );

    // The tunnel's own PKI and token, in a directory of their own.
    let tunnel_dir = dir.path().join("tunnel");
    std::fs::create_dir(&tunnel_dir).expect("tunnel dir");
    let _tunnel_pki = common::Pki::new(&tunnel_dir);
    std::fs::write(tunnel_dir.join("tokens"), format!("{NODE}:{TOKEN}\n")).expect("tokens");
    let [redirect, admin] = common::free_addrs();
    let tunnel_port = common::free_port();
    let tunnel_listen = format!("{}:{tunnel_port}", netns.host_ip);
    let cloud_config = tunnel_dir.join("cloud.toml");
    std::fs::write(
        &cloud_config,
        format!(
            r#"[tunnel]
listen = "{tunnel_listen}"
cert = "cloud.crt"
key = "cloud.key"
token_file = "tokens"

[admin]
listen = "{admin}"

[redirect]
enabled = true
listen = "{redirect}"
cgroup = "{cgroup}"
ports = [10250]

[kubernetes]
enabled = true
"#,
            cgroup = cgroup.path.display()
        ),
    )
    .expect("cloud.toml");
    let mut cloud_cmd = Command::new(common::BIN);
    cloud_cmd
        .args(["cloud", "--config"])
        .arg(&cloud_config)
        .env("KUBECONFIG", &api.admin_kubeconfig);
    let cloud = tunnel("tunnel-cloud", &tunnel_dir, cloud_cmd);
    wait_log(&cloud, "edge_nodes=1", Duration::from_secs(20));

    let edge_config = tunnel_dir.join("edge.toml");
    std::fs::write(
        &edge_config,
        format!(
            r#"node_name = "{NODE}"

[cloud]
address = "{tunnel_listen}"
server_name = "tunnel-cloud"
ca = "ca.crt"
token = "{TOKEN}"

[admin]
listen = "127.0.0.1:9102"

[allow]
targets = []
node_addresses = ["{edge_ip}"]
ports = [10250]
"#
        ),
    )
    .expect("edge.toml");
    let mut edge_cmd = netns.command(common::BIN);
    edge_cmd.args(["edge", "--config"]).arg(&edge_config);
    let edge = tunnel("tunnel-edge", &tunnel_dir, edge_cmd);
    wait_log(&cloud, "edge registered", Duration::from_secs(20));

    // Without the tunnel the address is a dead end on this side.
    assert!(
        std::net::TcpStream::connect_timeout(
            &format!("{edge_ip}:10250").parse().expect("addr"),
            Duration::from_secs(2)
        )
        .is_err(),
        "{edge_ip}:10250 must not be reachable outside the tunnel"
    );

    for bin in &kubectls {
        let out = api.kubectl(bin, &["logs", POD]);
        assert!(
            out.status.success(),
            "{} logs failed: {}\nkubelet saw {:?}\ncloud:\n{}\nedge:\n{}",
            bin.display(),
            String::from_utf8_lossy(&out.stderr),
            kubelet.requests(),
            cloud.log_tail(20),
            edge.log_tail(20)
        );
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            LOG_TEXT,
            "{}",
            bin.display()
        );
        eprintln!("{}: kubectl logs through the redirect: ok", bin.display());
    }
    let seen = kubelet.requests();
    assert!(
        seen.iter()
            .filter(|r| r.starts_with(&format!("GET /containerLogs/default/{POD}/main")))
            .count()
            >= kubectls.len(),
        "kubelet saw {seen:?}"
    );
    let redirected = common::metric(admin, "tunnel_connections_total{entry=\"redirect\"}");
    assert!(
        redirected >= kubectls.len() as f64,
        "the cloud counted {redirected} redirected connections"
    );
    eprintln!("transparent path e2e: {:?}", started.elapsed());
}
