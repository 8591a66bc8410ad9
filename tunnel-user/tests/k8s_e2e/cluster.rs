//! One cluster per kubectl test: the API server, a kubelet stand-in behind an edge, and
//! tunnel cloud (or two replicas) on the path a test names.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::config::{merge, path_str, write_toml};
use crate::common::netns::EdgeNetns;
use crate::common::privileged::{self, TestCgroup};
use crate::common::{self};
use crate::k8s::apiserver::{ApiServer, ApiServerOpts, Daemon};
use crate::k8s::checks::{
    NODE, admin_kubectl, assert_reached_stand_in, create_node_and_pod, kubectl_checks,
    prerequisites, wait_log,
};
use crate::k8s::kubelet::Kubelet;
use crate::{TOKEN, tunnel};
use rcgen::ExtendedKeyUsagePurpose;
use std::net::SocketAddr;
use toml::Table;

/// How kube-apiserver's connections to the kubelet reach the tunnel.
#[derive(Clone, Copy, PartialEq)]
pub enum Path_ {
    /// The eBPF redirect, attached to a child cgroup holding kube-apiserver only.
    Redirect,
    /// The same to a node whose InternalIP is IPv6 (connect6, the IPv6 maps and the
    /// cloud's IPv6 redirect listener).
    Redirect6,
    /// kube-apiserver's egress selector: HTTP CONNECT over the cloud's unix socket,
    /// configured by the shipped deploy/examples/egress-selector.yaml.
    EgressSelector,
    /// The egress selector to replica `b`, while the edge is held by replica `a`; the
    /// replicas find each other through the peer Service's EndpointSlices.
    Replicas,
}

/// Everything one e2e test runs, stopped in field order (PIDs, then the network
/// namespace and the cgroup, then the files).
pub struct Cluster {
    pub edge: Daemon,
    pub cloud: Daemon,
    /// The replica holding the edge, when it is not `cloud` (Path_::Replicas).
    pub holder: Option<Daemon>,
    pub kubelet: Kubelet,
    pub api: ApiServer,
    pub cloud_admin: std::net::SocketAddr,
    pub kubectls: Vec<PathBuf>,
    pub _netns: EdgeNetns,
    pub _cgroup: Option<TestCgroup>,
    pub dir: tempfile::TempDir,
}

impl Cluster {
    /// The API server, the edge Node and a pod on it, the stand-in, and tunnel cloud
    /// and edge with the cloud's node table from the API; None when it cannot run
    /// here (said loudly).
    pub fn start(path: Path_) -> Option<Self> {
        let (assets, kubectls) = prerequisites(true)?;
        let cgroup = match path {
            Path_::Redirect | Path_::Redirect6 => {
                Some(privileged::test_cgroup("the redirect e2e tests")?)
            }
            Path_::EgressSelector | Path_::Replicas => None,
        };
        let started = Instant::now();
        let dir = tempfile::tempdir().expect("tempdir");
        let mut netns = EdgeNetns::new().expect("edge network namespace");
        let edge_addr = if path == Path_::Redirect6 {
            netns.add_edge_ip6().expect("IPv6 edge address")
        } else {
            netns.edge_ip.into()
        };
        let edge_ip = edge_addr.to_string();
        let kubelet_addr = std::net::SocketAddr::new(edge_addr, 10250);
        let connect_sock = dir.path().join("connect.sock");

        let mut opts = ApiServerOpts {
            cgroup: cgroup.as_ref().map(|c| c.path.clone()),
            ..ApiServerOpts::default()
        };
        if !matches!(path, Path_::Redirect | Path_::Redirect6) {
            opts.extra_args
                .push(egress_selector_to(&connect_sock, dir.path()));
        }
        let api = ApiServer::start(&assets, dir.path(), &opts);
        eprintln!("kube-apiserver ready in {:?}", started.elapsed());
        create_node_and_pod(&api, admin_kubectl(&kubectls), &edge_ip);

        api.pki.issue(
            "kubelet",
            NODE,
            None,
            &[&edge_ip],
            ExtendedKeyUsagePurpose::ServerAuth,
        );
        let kubelet = Kubelet::start(&netns.name, kubelet_addr, &api.pki, "kubelet");

        // The tunnel's own PKI and token, in a directory of their own.
        let tunnel_dir = dir.path().join("tunnel");
        std::fs::create_dir(&tunnel_dir).expect("tunnel dir");
        let _tunnel_pki = common::Pki::new(&tunnel_dir);
        std::fs::write(tunnel_dir.join("tokens"), format!("{NODE}:{TOKEN}\n")).expect("tokens");
        // Fixed before the daemons start (they are configured ahead and report nothing):
        // reserved by the test, not re-picked (common::ClosedPort).
        let reserved = common::reserve_ports::<3>();
        let [redirect, cloud_admin, holder_admin] = reserved.each_ref().map(|p| p.addr);
        let tunnel_port = common::ClosedPort::hold((netns.host_ip, 0).into());
        let tunnel_listen = tunnel_port.addr.to_string();
        let entry = match &cgroup {
            Some(cgroup) => toml::toml! {
                [redirect]
                enabled = true
                listen = (redirect.to_string())
                cgroup = (path_str(&cgroup.path))
                ports = [10250]
            },
            None => toml::toml! {
                [connect]
                unix = (path_str(&connect_sock))
            },
        };
        let start_cloud = |id: &str, tunnel_listen: &str, admin: SocketAddr, extra: Table| {
            let mut config = toml::toml! {
                [tunnel]
                listen = tunnel_listen
                cert = "cloud.crt"
                key = "cloud.key"
                token_file = "tokens"
                client_ca = "ca.crt"
                cloud_id = id

                [admin]
                listen = (admin.to_string())

                [kubernetes]
                enabled = true
            };
            if path == Path_::Replicas {
                merge(
                    &mut config,
                    toml::toml! { [kubernetes] peer_service = "tunnel-cloud-peers" },
                );
            }
            merge(&mut config, extra);
            let config_path = tunnel_dir.join(format!("cloud-{id}.toml"));
            write_toml(&config_path, &config);
            let config = config_path;
            let mut cmd = Command::new(common::BIN);
            cmd.args(["cloud", "--config"])
                .arg(&config)
                .env("KUBECONFIG", &api.admin_kubeconfig);
            // Log files are named after the daemon: one per replica.
            let name = if id == "a" {
                "tunnel-cloud-a"
            } else {
                "tunnel-cloud-b"
            };
            let cloud = tunnel(name, &tunnel_dir, cmd);
            // The node table comes from the Node watcher: the edge Node is in it.
            wait_log(&cloud, "edge_nodes=1", Duration::from_secs(20));
            cloud
        };
        let (cloud, holder) = if path == Path_::Replicas {
            let host = netns.add_host_address().expect("replica address");
            let peer_ports = [(host, 0), (host, 0)].map(|a| common::ClosedPort::hold(a.into()));
            let [peers_a, peers_b] = peer_ports.each_ref().map(|p| p.addr);
            // No controller-manager: the peer Service's EndpointSlices are made by hand,
            // one per replica (the ports differ on this one address).
            for (name, addr) in [("a", peers_a), ("b", peers_b)] {
                api.apply(
                    admin_kubectl(&kubectls),
                    &format!(
                        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: tunnel-cloud-peers-{name}\n  labels:\n    kubernetes.io/service-name: tunnel-cloud-peers\naddressType: IPv4\nendpoints:\n- addresses: [\"{}\"]\nports:\n- name: peers\n  port: {}\n  protocol: TCP\n",
                        addr.ip(),
                        addr.port()
                    ),
                );
            }
            let holder = start_cloud(
                "a",
                &tunnel_listen,
                holder_admin,
                toml::toml! { [peers] listen = (peers_a.to_string()) },
            );
            let cloud = start_cloud(
                "b",
                "127.0.0.1:0", // no edge dials B
                cloud_admin,
                {
                    let mut extra = entry;
                    merge(
                        &mut extra,
                        toml::toml! { [peers] listen = (peers_b.to_string()) },
                    );
                    extra
                },
            );
            wait_log(&cloud, "linked to replica", Duration::from_secs(20));
            wait_log(&holder, "linked to replica", Duration::from_secs(20));
            (cloud, Some(holder))
        } else {
            (start_cloud("a", &tunnel_listen, cloud_admin, entry), None)
        };
        let edge_cloud = holder.as_ref().unwrap_or(&cloud);

        let edge_config = tunnel_dir.join("edge.toml");
        write_toml(
            &edge_config,
            &toml::toml! {
                node_name = NODE

                [cloud]
                address = (tunnel_listen.clone())
                server_name = "tunnel-cloud"
                ca = "ca.crt"
                token = TOKEN

                [admin]
                listen = "127.0.0.1:9102"

                [allow]
                targets = []
                node_addresses = [(edge_ip.clone())]
                ports = [10250]
            },
        );
        let mut edge_cmd = netns.command(common::BIN);
        edge_cmd.args(["edge", "--config"]).arg(&edge_config);
        let edge = tunnel("tunnel-edge", &tunnel_dir, edge_cmd);
        wait_log(edge_cloud, "edge registered", Duration::from_secs(20));

        // Without the tunnel the address is a dead end on this side.
        assert!(
            std::net::TcpStream::connect_timeout(&kubelet_addr, Duration::from_secs(2)).is_err(),
            "{kubelet_addr} must not be reachable outside the tunnel"
        );
        Some(Self {
            edge,
            cloud,
            holder,
            kubelet,
            api,
            cloud_admin,
            kubectls,
            _netns: netns,
            _cgroup: cgroup,
            dir,
        })
    }

    /// Every kubectl check through this cluster; the cloud counted at least one
    /// connection per check on `entry`.
    pub fn check(&self, entry: &str) {
        kubectl_checks(&self.api, &self.kubectls, &self.kubelet, &|| {
            format!(
                "cloud:\n{}\nedge:\n{}",
                self.cloud.log_tail(20),
                self.edge.log_tail(20)
            )
        });
        assert_reached_stand_in(&self.kubelet, self.kubectls.len());
        let counted = common::metric(
            self.cloud_admin,
            &format!("tunnel_connections_total{{entry=\"{entry}\"}}"),
        );
        assert!(
            counted >= 3.0 * self.kubectls.len() as f64,
            "the cloud counted {counted} connections on entry {entry}"
        );
    }
}

/// kube-apiserver's flag for the shipped deploy/examples/egress-selector.yaml, written
/// to `dir` with the cloud's CONNECT socket at `socket`.
fn egress_selector_to(socket: &Path, dir: &Path) -> String {
    let shipped = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples/egress-selector.yaml"),
    )
    .expect("deploy/examples/egress-selector.yaml");
    let shipped_sock = "/run/tunnel/connect.sock";
    assert!(shipped.contains(shipped_sock), "{shipped}");
    let config = dir.join("egress-selector.yaml");
    std::fs::write(
        &config,
        shipped.replace(shipped_sock, &socket.to_string_lossy()),
    )
    .expect("egress selector config");
    format!("--egress-selector-config-file={}", config.display())
}
