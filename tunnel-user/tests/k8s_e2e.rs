//! End to end against a real kube-apiserver (the envtest convention: KUBEBUILDER_ASSETS
//! names a directory holding `kube-apiserver`; etcd from there or Debian's etcd-server).
//! kubectl talks to the API server, the API server to a kubelet stand-in on an edge
//! node address that only the tunnel reaches, and the cloud learns that address from
//! the Node watcher against the same API server.

mod common;
mod k8s;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::netns::EdgeNetns;
use common::privileged::{self, TestCgroup};
use common::{merge, path_str, write_toml};
use k8s::apiserver::{ApiServer, ApiServerOpts, Credential, Daemon, write_kubeconfig};
use k8s::checks::{
    NODE, admin_kubectl, assert_reached_stand_in, create_node_and_pod, kubectl_checks,
    prerequisites, wait_log,
};
use k8s::kubelet::Kubelet;
use rcgen::ExtendedKeyUsagePurpose;
use std::net::SocketAddr;
use toml::Table;

const TOKEN: &str = "edge-one-token";

/// A tunnel process (cloud or edge) with its log in `dir`.
fn tunnel(name: &'static str, dir: &Path, mut cmd: Command) -> Daemon {
    cmd.env("RUST_LOG", "info,tunnel_user=debug")
        .env_remove("NODE_NAME");
    Daemon::start(name, dir, cmd)
}

/// How kube-apiserver's connections to the kubelet reach the tunnel.
#[derive(Clone, Copy, PartialEq)]
enum Path_ {
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
struct Cluster {
    edge: Daemon,
    cloud: Daemon,
    /// The replica holding the edge, when it is not `cloud` (Path_::Replicas).
    holder: Option<Daemon>,
    kubelet: Kubelet,
    api: ApiServer,
    cloud_admin: std::net::SocketAddr,
    kubectls: Vec<PathBuf>,
    _netns: EdgeNetns,
    _cgroup: Option<TestCgroup>,
    dir: tempfile::TempDir,
}

impl Cluster {
    /// The API server, the edge Node and a pod on it, the stand-in, and tunnel cloud
    /// and edge with the cloud's node table from the API; None when it cannot run
    /// here (said loudly).
    fn start(path: Path_) -> Option<Self> {
        let (assets, kubectls) = prerequisites(true)?;
        let cgroup = match path {
            Path_::Redirect | Path_::Redirect6 => {
                match tunnel_user::intercept::detect_cgroup_root() {
                    Ok(root) => Some(TestCgroup::new(&root).expect("test cgroup")),
                    Err(e) => {
                        privileged::cannot_run(&format!("no cgroup v2: {e}"));
                        return None;
                    }
                }
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
            let shipped = std::fs::read_to_string(
                std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("../deploy/examples/egress-selector.yaml"),
            )
            .expect("deploy/examples/egress-selector.yaml");
            let shipped_sock = "/run/tunnel/connect.sock";
            assert!(shipped.contains(shipped_sock), "{shipped}");
            let config = dir.path().join("egress-selector.yaml");
            std::fs::write(
                &config,
                shipped.replace(shipped_sock, &connect_sock.to_string_lossy()),
            )
            .expect("egress selector config");
            opts.extra_args.push(format!(
                "--egress-selector-config-file={}",
                config.display()
            ));
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
    fn check(&self, entry: &str) {
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

/// The transparent path: kube-apiserver (in a child cgroup with the eBPF redirect
/// attached) dials the Node's InternalIP:10250 as it would a kubelet, and lands on the
/// stand-in through tunnel-cloud and tunnel-edge, TLS verified end to end.
#[test]
fn kubectl_through_the_transparent_redirect() {
    let started = Instant::now();
    let Some(cluster) = Cluster::start(Path_::Redirect) else {
        return;
    };
    cluster.check("redirect");
    eprintln!("transparent path e2e: {:?}", started.elapsed());
}

/// The transparent path to a node whose InternalIP is IPv6 (a ULA that exists only in
/// the edge's namespace): kube-apiserver dials `[fd00:7e57:e2e::…]:10250`, connect6
/// sends it to the cloud's IPv6 redirect listener, and kubectl logs/exec/port-forward
/// reach the stand-in, TLS verified against the IPv6 SAN.
#[test]
fn kubectl_through_the_transparent_redirect_to_an_ipv6_node() {
    let started = Instant::now();
    let Some(cluster) = Cluster::start(Path_::Redirect6) else {
        return;
    };
    cluster.check("redirect");
    let log = cluster.cloud.log_text();
    assert!(
        log.contains("original_dst=[fd00:7e57:e2e:"),
        "no IPv6 original destination in the cloud's log:\n{}",
        cluster.cloud.log_tail(40)
    );
    eprintln!(
        "transparent path to an IPv6 node e2e: {:?}",
        started.elapsed()
    );
}

/// The egress-selector path: no eBPF; kube-apiserver sends its kubelet connections as
/// HTTP CONNECT over the cloud's unix socket, by the shipped example configuration.
#[test]
fn kubectl_through_the_egress_selector() {
    let started = Instant::now();
    let Some(cluster) = Cluster::start(Path_::EgressSelector) else {
        return;
    };
    cluster.check("connect-unix");
    eprintln!("egress-selector path e2e: {:?}", started.elapsed());
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

/// What deploy/ grants, against the real API server: the manifests are accepted; the
/// cloud, with a token of the tunnel-cloud ServiceAccount as its only credential,
/// watches Nodes and its peer EndpointSlices and reviews edge tokens; edges presenting
/// a token of another ServiceAccount, or (on 1.28) a tunnel-edge token without a node
/// name, are refused with the reason.
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
    std::fs::write(
        &cloud_config,
        format!(
            "[tunnel]\nlisten = \"{tunnel_addr}\"\ncert = \"cloud.crt\"\nkey = \"cloud.key\"\nclient_ca = \"ca.crt\"\n\n[admin]\nlisten = \"{admin}\"\n\n[peers]\nlisten = \"{peers}\"\n\n[kubernetes]\nenabled = true\nedge_selector = \"node-role.kubernetes.io/edge\"\npeer_service = \"tunnel-cloud-peers\"\ntoken_review = true\ntoken_audience = \"tunnel-cloud\"\nedge_service_account = \"tunnel-system:tunnel-edge\"\n"
        ),
    )
    .expect("cloud.toml");
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
    // A pod-bound token of tunnel-edge, as the DaemonSet's projected volume gets: 1.28
    // binds it to the pod but names no node.
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
    let cases = [
        (
            intruder.as_str(),
            "the token is `system:serviceaccount:tunnel-system:intruder`'s, not the edges' service account",
        ),
        (
            edge_token.as_str(),
            "the token is not bound to a node (use a projected service account token; Kubernetes 1.30+ binds it)",
        ),
    ];
    for (i, (token, reason)) in cases.iter().enumerate() {
        let edge_config = tunnel_dir.join(format!("edge-{i}.toml"));
        std::fs::write(
            &edge_config,
            format!(
                "node_name = \"{NODE}\"\n\n[cloud]\naddress = \"{tunnel_addr}\"\nserver_name = \"tunnel-cloud\"\nca = \"ca.crt\"\ntoken = \"{token}\"\n\n[admin]\nlisten = \"127.0.0.1:0\"\n"
            ),
        )
        .expect("edge config");
        let mut edge_cmd = Command::new(common::BIN);
        edge_cmd.args(["edge", "--config"]).arg(&edge_config);
        let edge = tunnel("tunnel-edge", &tunnel_dir, edge_cmd);
        wait_log(&edge, reason, Duration::from_secs(20));
        assert!(
            !cloud.log_text().contains("edge registered"),
            "an edge was let in:\n{}",
            cloud.log_tail(30)
        );
        eprintln!("edge refused: {reason}");
        drop(edge);
    }
    let log = cloud.log_text();
    assert!(
        !log.to_ascii_lowercase().contains("forbidden"),
        "the cloud's ServiceAccount was refused something:\n{log}"
    );
    eprintln!("deploy RBAC e2e: {:?}", started.elapsed());
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

/// `redirect.uninstall_with_daemonset` against the real API server, with deploy/'s RBAC
/// and the cloud's ServiceAccount token: a cloud stopped while its DaemonSet stays keeps
/// the pinned redirect (a rolling update); after `kubectl delete daemonset`, the next
/// cloud to stop unpins everything and `bpftool cgroup show` lists nothing.
#[test]
fn deleting_the_daemonset_uninstalls_the_pinned_redirect() {
    let Some((assets, kubectls)) = prerequisites(true) else {
        return;
    };
    let kubectl = admin_kubectl(&kubectls);
    let dir = tempfile::tempdir().expect("tempdir");
    let api = ApiServer::start(&assets, dir.path(), &ApiServerOpts::default());
    let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
    api.kubectl_ok(kubectl, &["create", "namespace", "tunnel-system"]);
    api.kubectl_ok(kubectl, &["apply", "-k", deploy.to_str().expect("utf-8")]);
    let token = create_token(&api, kubectl, "tunnel-system", "tunnel-cloud", &[]);
    let kubeconfig = dir.path().join("tunnel-cloud.kubeconfig");
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
    let reserved = common::reserve_ports::<3>();
    let [tunnel_addr, admin, redirect] = reserved.each_ref().map(|p| p.addr);
    let cloud_config = tunnel_dir.join("cloud.toml");
    std::fs::write(
        &cloud_config,
        format!(
            "[tunnel]\nlisten = \"{tunnel_addr}\"\ncert = \"cloud.crt\"\nkey = \"cloud.key\"\nclient_ca = \"ca.crt\"\n\n[admin]\nlisten = \"{admin}\"\n\n[redirect]\nenabled = true\nlisten = \"{redirect}\"\ncgroup = \"{}\"\npin_dir = \"{}\"\nuninstall_with_daemonset = \"tunnel-cloud\"\n\n[kubernetes]\nenabled = true\nedge_selector = \"node-role.kubernetes.io/edge\"\n",
            cgroup.path.display(),
            pin_dir.display()
        ),
    )
    .expect("cloud.toml");
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
        &["delete", "daemonset", "tunnel-cloud", "-n", "tunnel-system"],
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
}

/// Two replicas through the real API: they find each other from the peer
/// EndpointSlices, and kubectl through the replica that does not hold the edge (the
/// API server's egress selector points at it) reaches the stand-in via the other.
#[test]
fn kubectl_through_the_replica_without_the_edge() {
    let started = Instant::now();
    let Some(cluster) = Cluster::start(Path_::Replicas) else {
        return;
    };
    // The first connection may race the route update from the holder: bounded retries
    // of a CONNECT on the entry replica until it reaches the edge.
    let deadline = Instant::now() + Duration::from_secs(10);
    let sock = cluster.dir.path().join("connect.sock");
    loop {
        let routed = std::os::unix::net::UnixStream::connect(&sock).and_then(|mut s| {
            use std::io::{Read, Write};
            s.set_read_timeout(Some(Duration::from_secs(5)))?;
            write!(
                s,
                "CONNECT {NODE}:10250 HTTP/1.1\r\nHost: {NODE}:10250\r\n\r\n"
            )?;
            let mut head = [0u8; 12];
            s.read_exact(&mut head)?;
            Ok(head.starts_with(b"HTTP/1.1 200"))
        });
        if routed.is_ok_and(|ok| ok) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "replica b never routed {NODE}:\n{}",
            cluster.cloud.log_tail(30)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    cluster.check("connect-unix");
    let holder = cluster.holder.as_ref().expect("the holding replica");
    wait_log(
        &cluster.cloud,
        "forwarding to the replica that holds the node",
        Duration::from_secs(1),
    );
    wait_log(holder, "forwarded connection ended", Duration::from_secs(5));
    eprintln!("two replicas e2e: {:?}", started.elapsed());
}

// ---------------------------------------------------------------------------------
// Edge certificates from CertificateSigningRequests, against the real API server and
// kube-controller-manager (its own signer, approver and CSR cleaner run beside the
// cloud's signer and must leave tunnel.io/edge-client alone). The cloud runs with a
// token of deploy/'s tunnel-cloud ServiceAccount, the edge with a token of tunnel-edge
// bound to a pod on its node, as in a cluster: the RBAC exercised is deploy/'s.

/// The CSR tests, one at a time: each runs an API server and a controller manager, and
/// the renewal test's timing should not depend on the others' load.
static CSR_TESTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

const SIGNER: &str = "tunnel.io/edge-client";
const EDGE_POD: &str = "tunnel-edge-e2e";

/// The API server, kube-controller-manager, deploy/ applied, the edge Node (and a
/// second one) with the edge's pod on it, and tunnel cloud signing CSRs.
struct CsrCluster {
    cloud: Daemon,
    _controller_manager: k8s::apiserver::ControllerManager,
    api: ApiServer,
    kubectl: PathBuf,
    tunnel_dir: PathBuf,
    tunnel_addr: std::net::SocketAddr,
    connect: std::net::SocketAddr,
    /// The edge pod's service account token (audience: the API server), bound to the pod.
    edge_kubeconfig: PathBuf,
    _ports: [common::ClosedPort; 3],
    _guard: std::sync::MutexGuard<'static, ()>,
    dir: tempfile::TempDir,
}

impl CsrCluster {
    /// None (said loudly) when the assets are missing; `max_lifetime` is the cloud's cap.
    fn start(max_lifetime: &str) -> Option<Self> {
        let guard = CSR_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        let (assets, kubectls) = prerequisites(false)?;
        let kubectl = admin_kubectl(&kubectls).to_path_buf();
        let dir = tempfile::tempdir().expect("tempdir");
        let api = ApiServer::start(&assets, dir.path(), &ApiServerOpts::default());
        let controller_manager =
            match k8s::apiserver::ControllerManager::start(&assets, &api, dir.path(), &kubectl) {
                Ok(c) => c,
                Err(why) => {
                    privileged::cannot_run(&format!("no kube-controller-manager: {why}"));
                    return None;
                }
            };
        let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
        api.kubectl_ok(&kubectl, &["create", "namespace", "tunnel-system"]);
        api.kubectl_ok(&kubectl, &["apply", "-k", deploy.to_str().expect("utf-8")]);
        for node in [NODE, "edge-2"] {
            api.apply(
                &kubectl,
                &format!("apiVersion: v1\nkind: Node\nmetadata:\n  name: {node}\n  labels:\n    node-role.kubernetes.io/edge: \"\"\n"),
            );
        }
        api.apply(
            &kubectl,
            &format!(
                "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {EDGE_POD}\n  namespace: tunnel-system\nspec:\n  nodeName: {NODE}\n  serviceAccountName: tunnel-edge\n  containers:\n  - name: tunnel-edge\n    image: tunnel:0.1.0\n"
            ),
        );
        // What the pod's mounted token is: the API server's audience, bound to the pod.
        let edge_token = create_token(
            &api,
            &kubectl,
            "tunnel-system",
            "tunnel-edge",
            &[
                "--bound-object-kind",
                "Pod",
                "--bound-object-name",
                EDGE_POD,
            ],
        );
        let edge_kubeconfig = dir.path().join("tunnel-edge.kubeconfig");
        write_kubeconfig(
            &edge_kubeconfig,
            &api.url,
            &api.pki,
            Credential::Token(&edge_token),
        );
        let cloud_token = create_token(&api, &kubectl, "tunnel-system", "tunnel-cloud", &[]);
        let cloud_kubeconfig = dir.path().join("tunnel-cloud.kubeconfig");
        write_kubeconfig(
            &cloud_kubeconfig,
            &api.url,
            &api.pki,
            Credential::Token(&cloud_token),
        );

        let tunnel_dir = dir.path().join("tunnel");
        std::fs::create_dir(&tunnel_dir).expect("tunnel dir");
        let _pki = common::Pki::new(&tunnel_dir);
        let ports = common::reserve_ports::<3>();
        let [tunnel_addr, connect, admin] = ports.each_ref().map(|p| p.addr);
        let config = tunnel_dir.join("cloud.toml");
        std::fs::write(
            &config,
            format!(
                "[tunnel]\nlisten = \"{tunnel_addr}\"\ncert = \"cloud.crt\"\nkey = \"cloud.key\"\nclient_ca = \"ca.crt\"\nreauth_interval = \"2s\"\n\n[admin]\nlisten = \"{admin}\"\n\n[connect]\nlisten = \"{connect}\"\n\n[kubernetes]\nenabled = true\nedge_service_account = \"tunnel-system:tunnel-edge\"\n\n[csr]\nenabled = true\nsigner_name = \"{SIGNER}\"\nca_key = \"ca.key\"\nmax_lifetime = \"{max_lifetime}\"\n"
            ),
        )
        .expect("cloud.toml");
        let mut cmd = Command::new(common::BIN);
        cmd.args(["cloud", "--config"])
            .arg(&config)
            .env("KUBECONFIG", &cloud_kubeconfig)
            .env("POD_NAMESPACE", "tunnel-system");
        let cloud = tunnel("tunnel-cloud", &tunnel_dir, cmd);
        wait_log(&cloud, "edge_nodes=2", Duration::from_secs(30));
        wait_log(&cloud, "signing the edges' CSRs", Duration::from_secs(30));
        Some(Self {
            cloud,
            _controller_manager: controller_manager,
            api,
            kubectl,
            tunnel_dir,
            tunnel_addr,
            connect,
            edge_kubeconfig,
            _ports: ports,
            _guard: guard,
            dir,
        })
    }

    /// The edge's state directory (key and certificate).
    fn edge_state(&self) -> PathBuf {
        self.dir.path().join("edge-state")
    }

    /// tunnel edge for `NODE` with `[csr]`, allowed to dial `target`; its log is `name`.
    fn start_edge(&self, name: &'static str, target: std::net::SocketAddr) -> Daemon {
        let config = self.tunnel_dir.join("edge.toml");
        std::fs::write(
            &config,
            format!(
                "node_name = \"{NODE}\"\n\n[cloud]\naddress = \"{}\"\nserver_name = \"tunnel-cloud\"\nca = \"ca.crt\"\n\n[csr]\nenabled = true\ndir = \"{}\"\nsigner_name = \"{SIGNER}\"\nlifetime = \"10m\"\n\n[admin]\nlisten = \"127.0.0.1:0\"\n\n[allow]\ntargets = [\"{target}\"]\n",
                self.tunnel_addr,
                self.edge_state().display()
            ),
        )
        .expect("edge.toml");
        let mut cmd = Command::new(common::BIN);
        cmd.args(["edge", "--config"])
            .arg(&config)
            .env("KUBECONFIG", &self.edge_kubeconfig);
        tunnel(name, &self.tunnel_dir, cmd)
    }

    /// The CSRs of the cloud's signer, as the API returns them.
    fn csrs(&self) -> Vec<serde_json::Value> {
        let out = self
            .api
            .kubectl_ok(&self.kubectl, &["get", "csr", "-o", "json"]);
        let list: serde_json::Value = serde_json::from_str(&out).expect("csr list");
        list["items"]
            .as_array()
            .expect("items")
            .iter()
            .filter(|c| c["spec"]["signerName"] == SIGNER)
            .cloned()
            .collect()
    }

    /// The issued certificates (DER) of the signer's CSRs, oldest first.
    fn issued(&self) -> Vec<Vec<u8>> {
        let mut csrs = self.csrs();
        csrs.sort_by_key(|c| {
            c["metadata"]["creationTimestamp"]
                .as_str()
                .map(str::to_string)
        });
        csrs.iter()
            .filter_map(|c| c["status"]["certificate"].as_str())
            .map(|b64| {
                use base64::Engine as _;
                use rustls_pki_types::pem::PemObject as _;
                let pem = base64::engine::general_purpose::STANDARD
                    .decode(b64)
                    .expect("base64");
                rustls_pki_types::CertificateDer::from_pem_slice(&pem)
                    .expect("PEM certificate")
                    .to_vec()
            })
            .collect()
    }

    /// Files a CSR with `kubeconfig`'s credentials, named `name`; `key_args` are
    /// openssl's for the key (`-newkey ...`).
    fn file_by_hand(
        &self,
        kubeconfig: &Path,
        name: &str,
        cn: &str,
        key_args: &[&str],
        usages: &[&str],
    ) {
        let csr = self.dir.path().join(format!("{name}.csr"));
        let out = Command::new("openssl")
            .args(["req", "-new", "-nodes", "-subj", &format!("/CN={cn}")])
            .args(key_args)
            .arg("-keyout")
            .arg(self.dir.path().join(format!("{name}.key")))
            .arg("-out")
            .arg(&csr)
            .output()
            .expect("openssl");
        assert!(
            out.status.success(),
            "openssl req: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        use base64::Engine as _;
        let request =
            base64::engine::general_purpose::STANDARD.encode(std::fs::read(&csr).expect("csr"));
        let yaml = format!(
            "apiVersion: certificates.k8s.io/v1\nkind: CertificateSigningRequest\nmetadata:\n  name: {name}\nspec:\n  request: {request}\n  signerName: {SIGNER}\n  expirationSeconds: 600\n  usages: [{}]\n",
            usages
                .iter()
                .map(|u| format!("\"{u}\""))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let out = self.api.kubectl_as(
            &self.kubectl,
            kubeconfig,
            &["create", "-f", "-"],
            Some(yaml.as_bytes()),
        );
        assert!(
            out.status.success(),
            "the requester may file CSRs: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// The CSR `name` once it has a condition (bounded wait).
    fn answered(&self, name: &str) -> serde_json::Value {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let out = self
                .api
                .kubectl_ok(&self.kubectl, &["get", "csr", name, "-o", "json"]);
            let csr: serde_json::Value = serde_json::from_str(&out).expect("csr");
            if csr["status"]["conditions"]
                .as_array()
                .is_some_and(|c| !c.is_empty())
            {
                return csr;
            }
            assert!(
                Instant::now() < deadline,
                "CSR {name} was never answered:\n{}",
                self.cloud.log_tail(30)
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// The CN of a certificate (DER), and its notAfter.
fn subject_and_expiry(der: &[u8]) -> (String, std::time::SystemTime) {
    let (_, cert) = x509_parser::parse_x509_certificate(der).expect("certificate");
    let cn = cert
        .subject()
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .unwrap_or_default()
        .to_string();
    let secs = u64::try_from(cert.validity().not_after.timestamp()).expect("after 1970");
    (cn, std::time::UNIX_EPOCH + Duration::from_secs(secs))
}

fn mode(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .permissions()
        .mode()
        & 0o777
}

/// An edge with nothing on disk files a CSR with its pod's token; the cloud approves it
/// (the pod runs on the node the CSR names: 1.28 records the pod, not the node, and the
/// cloud looks it up) and signs it with the tunnel CA; the edge registers with mTLS and
/// carries a transfer.
#[test]
fn csr_edge_without_a_certificate_gets_one_and_carries_a_transfer() {
    let Some(cluster) = CsrCluster::start("1h") else {
        return;
    };
    let sink = common::servers::sink("127.0.0.1:0");
    assert!(
        !cluster.edge_state().exists(),
        "nothing on disk to start with"
    );
    let edge = cluster.start_edge("tunnel-edge", sink);
    wait_log(&cluster.cloud, "edge registered", Duration::from_secs(60));
    wait_log(
        &edge,
        "CertificateSigningRequest filed",
        Duration::from_secs(1),
    );

    let csrs = cluster.csrs();
    assert_eq!(csrs.len(), 1, "{csrs:#?}");
    let spec = &csrs[0]["spec"];
    assert_eq!(
        spec["username"],
        "system:serviceaccount:tunnel-system:tunnel-edge"
    );
    assert_eq!(
        spec["extra"]["authentication.kubernetes.io/pod-name"],
        serde_json::json!([EDGE_POD]),
        "the API server records the requesting pod"
    );
    assert_eq!(
        spec["usages"],
        serde_json::json!(["digital signature", "client auth"])
    );
    let conditions = &csrs[0]["status"]["conditions"];
    assert_eq!(conditions[0]["type"], "Approved", "{conditions}");
    assert_eq!(
        conditions[0]["reason"], "EdgeNode",
        "approved by the cloud: {conditions}"
    );
    let issued = cluster.issued();
    let (cn, not_after) = subject_and_expiry(&issued[0]);
    assert_eq!(cn, NODE);
    let lifetime = not_after
        .duration_since(std::time::SystemTime::now())
        .expect("valid");
    assert!(
        lifetime <= Duration::from_secs(600),
        "asked for 10m: {lifetime:?}"
    );
    // The tunnel CA signed it, not kube-controller-manager's cluster signer.
    let pem = cluster.edge_state().join("client-current.pem");
    let verified = Command::new("openssl")
        .args(["verify", "-purpose", "sslclient", "-CAfile"])
        .arg(cluster.tunnel_dir.join("ca.crt"))
        .arg(&pem)
        .output()
        .expect("openssl verify");
    assert!(
        verified.status.success(),
        "{}",
        String::from_utf8_lossy(&verified.stdout)
    );
    assert_eq!(mode(&cluster.edge_state()), 0o700);
    assert_eq!(mode(&pem), 0o600);
    assert!(
        !cluster.edge_state().join("client-pending.key").exists(),
        "the pending key became the current one"
    );

    common::probe::round_trip(
        cluster.connect,
        &format!("{NODE}:{}", sink.port()),
        24,
        8 << 20,
    )
    .expect("8 MiB through the tunnel");
    assert!(
        !cluster.cloud.log_text().contains("Forbidden"),
        "deploy/'s RBAC refused the cloud something:\n{}",
        cluster.cloud.log_tail(30)
    );
    eprintln!("csr: edge got its certificate by CSR and carried 8 MiB");
}

/// With the cloud capping certificates at two minutes, the edge renews at 70-80% of the
/// lifetime and presents the new certificate on its open session: a stream opened
/// before keeps carrying bytes past the first certificate's expiry, and the edge never
/// registers again.
#[test]
fn csr_certificate_renews_while_a_long_lived_stream_carries_bytes() {
    let Some(cluster) = CsrCluster::start("2m") else {
        return;
    };
    let sink = common::servers::sink("127.0.0.1:0");
    let edge = cluster.start_edge("tunnel-edge", sink);
    wait_log(&cluster.cloud, "edge registered", Duration::from_secs(60));
    let first = cluster.issued();
    assert_eq!(first.len(), 1);
    let (_, first_expiry) = subject_and_expiry(&first[0]);
    let mut canary =
        common::probe::Canary::open(cluster.connect, &format!("{NODE}:{}", sink.port()));
    // Fed every half second until well past the first certificate's expiry.
    let until = first_expiry + Duration::from_secs(10);
    let mut fed = 0;
    while std::time::SystemTime::now() < until {
        canary.feed(64 << 10);
        fed += 1;
        std::thread::sleep(Duration::from_millis(500));
    }
    wait_log(&edge, "client certificate renewed", Duration::from_secs(1));
    wait_log(
        &cluster.cloud,
        "renewed client certificate accepted on the open session",
        Duration::from_secs(1),
    );
    let issued = cluster.issued();
    assert!(issued.len() >= 2, "renewed: {} certificates", issued.len());
    let (_, latest_expiry) = subject_and_expiry(&issued[issued.len() - 1]);
    assert!(latest_expiry > first_expiry + Duration::from_secs(60));
    canary.feed(64 << 10);
    canary.finish();
    let log = cluster.cloud.log_text();
    assert_eq!(
        common::probe::count_lines(&log, &["edge registered"]),
        1,
        "the edge kept its one session:\n{}",
        cluster.cloud.log_tail(30)
    );
    assert!(
        !log.contains("session no longer authorised"),
        "{}",
        cluster.cloud.log_tail(30)
    );
    common::probe::round_trip(
        cluster.connect,
        &format!("{NODE}:{}", sink.port()),
        25,
        1 << 20,
    )
    .expect("a new connection after the renewal");
    eprintln!(
        "csr: renewed under a stream fed {fed} times over {:?} past the first certificate",
        Duration::from_secs(10)
    );
}

/// CSRs for another node's name, for server usage, with a weak key, or from someone
/// who is neither the node nor an edge pod are denied with the reason in the Denied
/// condition, and no certificate is issued; the node itself may ask for its own name.
#[test]
fn csr_for_another_node_or_server_usage_is_denied_with_the_reason() {
    let Some(cluster) = CsrCluster::start("1h") else {
        return;
    };
    struct Bad {
        name: &'static str,
        cn: &'static str,
        key: &'static [&'static str],
        usages: &'static [&'static str],
        reason: &'static str,
        message: &'static str,
    }
    const EC: &[&str] = &["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"];
    let cases = [
        Bad {
            name: "other-node",
            cn: "edge-2",
            key: EC,
            usages: &["digital signature", "client auth"],
            reason: "NotThisNode",
            message: "requester may not speak for node `edge-2`: its pod tunnel-system/tunnel-edge-e2e runs on node `edge-1`",
        },
        Bad {
            name: "server-usage",
            cn: NODE,
            key: EC,
            usages: &["client auth", "server auth"],
            reason: "ExtraUsages",
            message: "server auth",
        },
        Bad {
            name: "weak-key",
            cn: NODE,
            key: &["-newkey", "rsa:1024"],
            usages: &["client auth"],
            reason: "WeakKey",
            message: "RSA 1024 bits",
        },
    ];
    for c in &cases {
        cluster.file_by_hand(&cluster.edge_kubeconfig, c.name, c.cn, c.key, c.usages);
    }
    // Someone who is neither the node nor an edge pod (the admin) is refused too.
    cluster.file_by_hand(
        &cluster.api.admin_kubeconfig,
        "admin-for-edge",
        NODE,
        EC,
        &["client auth"],
    );
    let admin = Bad {
        name: "admin-for-edge",
        cn: NODE,
        key: EC,
        usages: &[],
        reason: "NotThisNode",
        message: "`admin` is neither that node nor a pod of the edges' service account",
    };
    for c in cases.iter().chain([&admin]) {
        let name = c.name;
        let csr = cluster.answered(name);
        let conditions = csr["status"]["conditions"].as_array().expect("conditions");
        assert_eq!(conditions.len(), 1, "{name}: {conditions:?}");
        assert_eq!(conditions[0]["type"], "Denied", "{name}: {conditions:?}");
        assert_eq!(conditions[0]["reason"], c.reason, "{name}");
        let said = conditions[0]["message"].as_str().unwrap_or_default();
        assert!(said.contains(c.message), "{name}: {said}");
        assert!(
            csr["status"]["certificate"].is_null(),
            "{name}: no certificate issued"
        );
        eprintln!("csr {name}: denied: {said}");
    }
    assert!(cluster.issued().is_empty());

    // The node itself (a kubelet's credentials) may ask for its own name.
    cluster.api.pki.issue(
        "node-edge-1",
        &format!("system:node:{NODE}"),
        Some("system:nodes"),
        &[],
        ExtendedKeyUsagePurpose::ClientAuth,
    );
    let node_kubeconfig = cluster.dir.path().join("node.kubeconfig");
    write_kubeconfig(
        &node_kubeconfig,
        &cluster.api.url,
        &cluster.api.pki,
        Credential::Cert("node-edge-1"),
    );
    cluster.file_by_hand(&node_kubeconfig, "by-the-node", NODE, EC, &["client auth"]);
    let csr = cluster.answered("by-the-node");
    assert_eq!(csr["status"]["conditions"][0]["type"], "Approved", "{csr}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while cluster.issued().is_empty() {
        assert!(
            Instant::now() < deadline,
            "the node's own CSR was not signed"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("csr by-the-node: approved and signed");
}

/// An edge restarted while its certificate is valid reuses it and files no CSR; and
/// deleting its CSR revokes it: the session ends at the cloud's next re-check.
#[test]
fn csr_restarted_edge_reuses_its_valid_certificate() {
    let Some(cluster) = CsrCluster::start("1h") else {
        return;
    };
    let sink = common::servers::sink("127.0.0.1:0");
    let mut edge = cluster.start_edge("tunnel-edge", sink);
    wait_log(&cluster.cloud, "edge registered", Duration::from_secs(60));
    assert_eq!(cluster.csrs().len(), 1);
    sigterm_and_wait(&mut edge);
    drop(edge);
    wait_log(&cluster.cloud, "edge disconnected", Duration::from_secs(20));

    let edge = cluster.start_edge("tunnel-edge-restarted", sink);
    let deadline = Instant::now() + Duration::from_secs(30);
    while common::probe::count_lines(&cluster.cloud.log_text(), &["edge registered"]) < 2 {
        assert!(
            Instant::now() < deadline,
            "the restarted edge did not register:\n{}",
            edge.log_tail(30)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    wait_log(
        &edge,
        "reusing the client certificate on disk",
        Duration::from_secs(1),
    );
    assert!(!edge.log_text().contains("CertificateSigningRequest filed"));
    assert_eq!(cluster.csrs().len(), 1, "no new CSR");
    common::probe::round_trip(
        cluster.connect,
        &format!("{NODE}:{}", sink.port()),
        26,
        1 << 20,
    )
    .expect("a transfer after the restart");

    let name = cluster.csrs()[0]["metadata"]["name"]
        .as_str()
        .expect("name")
        .to_string();
    cluster
        .api
        .kubectl_ok(&cluster.kubectl, &["delete", "csr", &name]);
    wait_log(
        &cluster.cloud,
        "its CertificateSigningRequest is gone",
        Duration::from_secs(10),
    );
    eprintln!("csr: restarted edge reused its certificate; deleting its CSR revoked it");
}
