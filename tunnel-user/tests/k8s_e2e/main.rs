//! End to end against a real kube-apiserver (the envtest convention: KUBEBUILDER_ASSETS
//! names a directory holding `kube-apiserver`; etcd from there or Debian's etcd-server).
//! kubectl talks to the API server, the API server to a kubelet stand-in on an edge
//! node address that only the tunnel reaches, and the cloud learns that address from
//! the Node watcher against the same API server.
//!
//! One test binary (one link) with a module per subject: the kubectl paths through a
//! [`cluster::Cluster`], what deploy/ grants and uninstalls, edge certificates by CSR,
//! a compromised edge claiming other nodes' addresses, a node without the edge label
//! registering with its own certificate, and the node list deploy/monitoring/ scrapes.

#[path = "../common/mod.rs"]
mod common;
#[path = "../k8s/mod.rs"]
mod k8s;

mod ca;
mod cluster;
mod csr;
mod csr_fleet;
mod deploy;
mod kubectl;
mod monitoring;
mod node_addresses;
mod node_churn;
mod node_fleet;
mod registration;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use k8s::apiserver::{ApiServer, Daemon};

const TOKEN: &str = "edge-one-token";

/// A tunnel process (cloud or edge) with its log in `dir`.
fn tunnel(name: &'static str, dir: &Path, mut cmd: Command) -> Daemon {
    cmd.env("RUST_LOG", "info,tunnel_user=debug")
        .env_remove("NODE_NAME");
    Daemon::start(name, dir, cmd)
}

/// A token of service account `namespace/name` (`kubectl create token`, plus `extra`).
fn create_token(
    api: &ApiServer,
    kubectl: &Path,
    namespace: &str,
    name: &str,
    extra: &[&str],
) -> String {
    let mut args = vec!["create", "token", name, "-n", namespace];
    args.extend_from_slice(extra);
    api.kubectl_ok(kubectl, &args).trim().to_string()
}

/// Stops a tunnel with SIGTERM and waits (bounded) for it to exit.
fn sigterm_and_wait(daemon: &mut Daemon) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(daemon.child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("SIGTERM");
    let deadline = Instant::now() + Duration::from_secs(20);
    while daemon.child.try_wait().expect("wait").is_none() {
        assert!(
            Instant::now() < deadline,
            "{} did not stop:\n{}",
            daemon.name,
            daemon.log_tail(30)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
