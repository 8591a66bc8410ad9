//! Bringing the nodes up: what a node test needs on this machine, the control plane,
//! each node's containerd and kubelet, and what the tests read back from them (the
//! DaemonSets' pods, a container's process and cgroup, the edge container's log).

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use rcgen::ExtendedKeyUsagePurpose;

use crate::common::netns::EdgeNetns;
use crate::common::privileged::{self, TestCgroup};
use crate::k8s::apiserver::{ApiServer, ApiServerOpts, Assets, ControllerManager, Daemon};
use crate::k8s::checks::{NODE, admin_kubectl, create_node_and_pod, prerequisites};
use crate::k8s::node::{
    Binaries, Containerd, HostChanges, Kubelet, NodeNamespaces, Scheduler, busybox_image,
    pause_image,
};
use crate::{CLOUD_SELECTOR, EDGE, MASTER, NAMESPACE, figure, wait_for};

/// What deploy/config/cloud.toml binds on the master's network: edges, peers, admin,
/// HTTP CONNECT and the redirect listener.
const CLOUD_PORTS: [u16; 5] = [9000, 9002, 9101, 251, 250];
pub const BPFFS: &str = "/sys/fs/bpf";

/// The archive `cargo xtask image` leaves (what deploy/README.md has users import).
pub fn image_archive() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(format!(
        "../target/image/tunnel-{}.oci.tar",
        env!("CARGO_PKG_VERSION")
    ))
}

pub fn is_bpffs(path: &str) -> bool {
    tunnel_user::intercept::is_bpffs(Path::new(path)).unwrap_or(false)
}

/// The Kubernetes binaries and kubectls a node test runs, once its prerequisites hold.
pub struct Kube {
    pub assets: Assets,
    pub kubectls: Vec<PathBuf>,
    /// The kubectl the test administers the cluster with.
    pub kubectl: PathBuf,
}

impl Kube {
    /// The binaries, or `None` after saying loudly why the test cannot run (it fails
    /// instead when `CI` is set).
    pub fn find() -> Option<Self> {
        let (assets, kubectls) = prerequisites(true)?;
        if let Err(why) = node_prerequisites() {
            privileged::cannot_run(&why);
            return None;
        }
        let kubectl = admin_kubectl(&kubectls).to_path_buf();
        figure(&assets.version());
        Some(Self {
            assets,
            kubectls,
            kubectl,
        })
    }
}

/// What the node test needs beyond the API server's own prerequisites, or why not.
fn node_prerequisites() -> Result<(), String> {
    for tool in ["containerd", "ctr", "podman", "bpftool"] {
        if Command::new(tool).arg("--version").output().is_err() {
            return Err(format!(
                "{tool} is not installed (scripts/setup.sh installs it)"
            ));
        }
    }
    let image = image_archive();
    if !image.is_file() {
        return Err(format!(
            "{} is missing: `cargo xtask image` builds it (scripts/test.sh does)",
            image.display()
        ));
    }
    if is_bpffs(BPFFS) {
        return Err(format!(
            "{BPFFS} is a bpffs already: this test shows the cloud on a host without one"
        ));
    }
    for port in CLOUD_PORTS {
        if std::net::TcpListener::bind(("0.0.0.0", port)).is_err() {
            return Err(format!(
                "port {port} is taken on this host: the cloud pod binds it on the host network"
            ));
        }
    }
    Ok(())
}

/// Whether `node` has registered.
pub fn registered(api: &ApiServer, kubectl: &Path, node: &str) -> bool {
    api.kubectl(kubectl, &["get", "node", node])
        .status
        .success()
}

/// Labels `node` with `role` and lifts the not-ready taint: no CNI runs here, so every
/// node stays NotReady with the taint it registered with; every pod of these tests uses
/// the host network and needs none.
pub fn label_and_untaint(api: &ApiServer, kubectl: &Path, node: &str, role: &str) {
    api.kubectl_ok(kubectl, &["label", "node", node, role]);
    let _ = api.kubectl(
        kubectl,
        &[
            "taint",
            "node",
            node,
            "node.kubernetes.io/not-ready:NoSchedule-",
        ],
    );
}

/// A master node (control plane, containerd, kubelet) and, behind a `tunnel edge`
/// process in a network namespace, the kubelet stand-in of the stand-in's Node. Field
/// order is drop order: what started last stops first, the host put back last.
pub struct MasterWithStandIn {
    pub stand_in: crate::k8s::kubelet::Kubelet,
    pub kubelet: Kubelet,
    pub containerd: Containerd,
    _scheduler: Scheduler,
    _controller_manager: ControllerManager,
    pub api: ApiServer,
    pub netns: EdgeNetns,
    pub apiserver_cgroup: TestCgroup,
    _host: HostChanges,
    pub edge_ip: IpAddr,
    pub dir: tempfile::TempDir,
}

impl MasterWithStandIn {
    pub fn start(kube: &Kube) -> Self {
        let kubectl = &kube.kubectl;
        let dir = tempfile::tempdir().expect("tempdir");
        let bins = Binaries::unpack(&kube.assets, dir.path()).expect("unpack the node's binaries");
        let host = HostChanges::record().expect("host state");
        let cgroup_root = tunnel_user::intercept::detect_cgroup_root().expect("cgroup v2");
        let apiserver_cgroup = TestCgroup::new(&cgroup_root).expect("kube-apiserver's cgroup");
        let netns = EdgeNetns::new().expect("edge network namespace");
        let node_ip = netns.add_host_address().expect("the master's address");
        let api = ApiServer::start(
            &kube.assets,
            dir.path(),
            &ApiServerOpts {
                cgroup: Some(apiserver_cgroup.path.clone()),
                ..ApiServerOpts::default()
            },
        );
        let controller_manager = ControllerManager::start(&kube.assets, &api, dir.path(), kubectl)
            .expect("kube-controller-manager");
        let scheduler = Scheduler::start(&bins, &api, dir.path());
        let containerd = Containerd::start(dir.path(), None, None).expect("containerd");
        let pause = pause_image(&bins.pause, dir.path()).expect("the sandbox image");
        containerd.import(&pause).expect("import the sandbox image");
        containerd
            .import(&image_archive())
            .expect("import the tunnel image");
        let kubelet = Kubelet::start(
            &bins.kubelet,
            api.endpoint(),
            &containerd,
            MASTER,
            node_ip,
            dir.path(),
            None,
        )
        .expect("kubelet");
        let registered = wait_for(Duration::from_secs(60), "the master registered", || {
            registered(&api, kubectl, MASTER)
        });
        eprintln!(
            "control plane, containerd and kubelet up; {MASTER} registered after {registered:?}"
        );
        label_and_untaint(
            &api,
            kubectl,
            MASTER,
            "node-role.kubernetes.io/control-plane=",
        );

        // The edge side: its Node, and the stand-in behind it.
        let edge_ip = IpAddr::from(netns.edge_ip);
        create_node_and_pod(&api, kubectl, &edge_ip.to_string());
        api.pki.issue(
            "kubelet",
            NODE,
            None,
            &[&edge_ip.to_string()],
            ExtendedKeyUsagePurpose::ServerAuth,
        );
        let stand_in = crate::k8s::kubelet::Kubelet::start(
            &netns.name,
            SocketAddr::new(edge_ip, 10250),
            &api.pki,
            "kubelet",
        );
        Self {
            stand_in,
            kubelet,
            containerd,
            _scheduler: scheduler,
            _controller_manager: controller_manager,
            api,
            netns,
            apiserver_cgroup,
            _host: host,
            edge_ip,
            dir,
        }
    }
}

/// A master node and the edge node `edge-1` with a real kubelet and its own containerd
/// in a network namespace behind NAT. Field order is drop order.
pub struct MasterAndEdge {
    pub edge_kubelet: Kubelet,
    _kubelet: Kubelet,
    pub edge_containerd: Containerd,
    _edge_node: NodeNamespaces,
    pub containerd: Containerd,
    _scheduler: Scheduler,
    _controller_manager: ControllerManager,
    pub api: ApiServer,
    pub netns: EdgeNetns,
    pub apiserver_cgroup: TestCgroup,
    _host: HostChanges,
    pub edge_ip: IpAddr,
    pub edge_dir: PathBuf,
    pub dir: tempfile::TempDir,
}

impl MasterAndEdge {
    pub fn start(kube: &Kube) -> Self {
        let kubectl = &kube.kubectl;
        let dir = tempfile::tempdir().expect("tempdir");
        let bins = Binaries::unpack(&kube.assets, dir.path()).expect("unpack the node's binaries");
        let host = HostChanges::record().expect("host state");
        let cgroup_root = tunnel_user::intercept::detect_cgroup_root().expect("cgroup v2");
        let apiserver_cgroup = TestCgroup::new(&cgroup_root).expect("kube-apiserver's cgroup");
        let mut netns = EdgeNetns::new().expect("edge network namespace");
        let master_ip = netns.add_host_address().expect("the master's address");
        let edge_ip = netns.add_node_ip().expect("the edge's address");
        // On the master's end of the edge's veth, so that the edge node reaches it.
        let api = ApiServer::start(
            &kube.assets,
            dir.path(),
            &ApiServerOpts {
                cgroup: Some(apiserver_cgroup.path.clone()),
                bind: Some(netns.host_ip),
                // Its proxy logs each upgrade to a kubelet with the headers: which
                // protocol (SPDY or WebSocket) each streaming call used.
                extra_args: vec!["--vmodule=upgradeaware=6".into()],
                ..ApiServerOpts::default()
            },
        );
        let controller_manager = ControllerManager::start(&kube.assets, &api, dir.path(), kubectl)
            .expect("kube-controller-manager");
        let scheduler = Scheduler::start(&bins, &api, dir.path());
        let pause = pause_image(&bins.pause, dir.path()).expect("the sandbox image");
        let containerd = Containerd::start(dir.path(), None, None).expect("containerd");
        let edge_dir = dir.path().join(EDGE);
        let edge_node = NodeNamespaces::new(&netns.name, &edge_dir).expect("the edge's namespaces");
        let edge_containerd =
            Containerd::start(&edge_dir, Some(&edge_node), None).expect("the edge's containerd");
        for c in [&containerd, &edge_containerd] {
            c.import(&pause).expect("import the sandbox image");
            c.import(&image_archive()).expect("import the tunnel image");
        }
        let workload = busybox_image(dir.path()).expect("the workload image");
        edge_containerd
            .import(&workload)
            .expect("import the workload image");
        let kubelet = Kubelet::start(
            &bins.kubelet,
            api.endpoint(),
            &containerd,
            MASTER,
            master_ip,
            dir.path(),
            None,
        )
        .expect("kubelet");
        let edge_kubelet = Kubelet::start(
            &bins.kubelet,
            api.endpoint(),
            &edge_containerd,
            EDGE,
            edge_ip,
            &edge_dir,
            Some(&edge_node),
        )
        .expect("the edge's kubelet");
        let up = wait_for(Duration::from_secs(60), "both nodes registered", || {
            registered(&api, kubectl, MASTER) && registered(&api, kubectl, EDGE)
        });
        figure(&format!(
            "{MASTER} and {EDGE} (in network namespace {}, node address {edge_ip}) registered after {:.1} s",
            netns.name,
            up.as_secs_f64()
        ));
        label_and_untaint(
            &api,
            kubectl,
            MASTER,
            "node-role.kubernetes.io/control-plane=",
        );
        label_and_untaint(&api, kubectl, EDGE, "node-role.kubernetes.io/edge=");
        Self {
            edge_kubelet,
            _kubelet: kubelet,
            edge_containerd,
            _edge_node: edge_node,
            containerd,
            _scheduler: scheduler,
            _controller_manager: controller_manager,
            api,
            netns,
            apiserver_cgroup,
            _host: host,
            edge_ip: edge_ip.into(),
            edge_dir,
            dir,
        }
    }

    /// For a failure message: the tunnel-edge container's log and the edge kubelet's.
    pub fn context(&self) -> String {
        format!(
            "tunnel-edge's log:\n{}\nthe edge's kubelet:\n{}",
            edge_container_log(&self.edge_dir),
            self.edge_kubelet.log_tail(20)
        )
    }
}

/// `tunnel edge` for the stand-in's Node, in its network namespace, dialling the
/// master's edge port over the veth with a client certificate naming the node.
pub fn start_edge(netns: &EdgeNetns, overlay: &Path, edge_ip: IpAddr) -> Daemon {
    let config = overlay.join("edge.toml");
    let (cert, key) = (format!("{NODE}.crt"), format!("{NODE}.key"));
    crate::common::config::write_toml(
        &config,
        &toml::toml! {
            node_name = NODE

            [cloud]
            address = (format!("{}:9000", netns.host_ip))
            server_name = "tunnel-cloud"
            ca = "ca.crt"
            cert = cert
            key = key

            [allow]
            targets = []
            node_addresses = [(edge_ip.to_string())]
            ports = [10250]
        },
    );
    let mut cmd = netns.command(crate::common::BIN);
    cmd.args(["edge", "--config"])
        .arg(&config)
        .env("RUST_LOG", "info")
        .env_remove("NODE_NAME");
    Daemon::start("tunnel-edge", overlay, cmd)
}

/// One pod of a DaemonSet of ours, as `kubectl get pods` reports it.
#[derive(Debug)]
pub struct DaemonPod {
    pub name: String,
    pub ready: bool,
    /// containerd's id of the pod's container, once it runs.
    pub container: Option<String>,
    /// The node it is on.
    pub node: String,
}

pub fn cloud_pods(api: &ApiServer, kubectl: &Path) -> Vec<DaemonPod> {
    daemon_pods(api, kubectl, CLOUD_SELECTOR)
}

/// The pods of the DaemonSet `selector` picks.
pub fn daemon_pods(api: &ApiServer, kubectl: &Path, selector: &str) -> Vec<DaemonPod> {
    let template = r#"{range .items[*]}{.metadata.name}|{.status.conditions[?(@.type=="Ready")].status}|{.status.containerStatuses[0].containerID}|{.spec.nodeName}{"\n"}{end}"#;
    let out = api.kubectl_ok(
        kubectl,
        &[
            "get",
            "pods",
            "-n",
            NAMESPACE,
            "-l",
            selector,
            "-o",
            &format!("jsonpath={template}"),
        ],
    );
    out.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split('|').collect();
            let [name, ready, container, node] = f[..] else {
                return None;
            };
            Some(DaemonPod {
                name: name.to_string(),
                ready: ready == "True",
                container: container.strip_prefix("containerd://").map(str::to_string),
                node: node.to_string(),
            })
        })
        .collect()
}

/// The host pid of a container's task.
pub fn container_pid(containerd: &Containerd, container: &str) -> String {
    let tasks = containerd.ctr(&["tasks", "ls"]).expect("ctr tasks ls");
    let tasks = String::from_utf8_lossy(&tasks.stdout);
    tasks
        .lines()
        .find_map(|l| {
            let mut f = l.split_whitespace();
            (f.next() == Some(container)).then(|| f.next())?
        })
        .unwrap_or_else(|| panic!("no task for container {container}:\n{tasks}"))
        .to_string()
}

/// The cgroup id of a container, found by its task's PID on the host.
pub fn container_cgroup_id(containerd: &Containerd, container: &str) -> u64 {
    let pid = container_pid(containerd, container);
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("cgroup");
    let path = cgroups
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .expect("a cgroup v2 line");
    let root = tunnel_user::intercept::detect_cgroup_root().expect("cgroup root");
    tunnel_user::intercept::cgroup_id(&root.join(path.trim_start_matches('/')))
        .expect("container cgroup id")
}

/// `kubectl logs` of a cloud pod.
pub fn cloud_log(api: &ApiServer, kubectl: &Path, pod: &str) -> String {
    api.kubectl_ok(kubectl, &["logs", "-n", NAMESPACE, pod])
}

/// `kubectl logs` of a cloud pod that may be gone by the time they are asked for (an old
/// pod with nothing left to drain exits within a second of its SIGTERM), or kubectl's
/// answer when it is.
pub fn cloud_log_if_there(api: &ApiServer, kubectl: &Path, pod: &str) -> String {
    let out = api.kubectl(kubectl, &["logs", "-n", NAMESPACE, pod]);
    match out.status.success() {
        true => String::from_utf8_lossy(&out.stdout).into_owned(),
        false => format!("(no logs: {})", String::from_utf8_lossy(&out.stderr).trim()),
    }
}

/// The tunnel-edge container's log on the edge node, read from its disk (kubectl logs
/// needs the tunnel this container is).
pub fn edge_container_log(edge_dir: &Path) -> String {
    let pods = edge_dir.join("var-log/pods");
    let mut text = String::new();
    for pod in std::fs::read_dir(&pods).into_iter().flatten().flatten() {
        if !pod.file_name().to_string_lossy().contains("tunnel-edge") {
            continue;
        }
        for log in std::fs::read_dir(pod.path().join("tunnel-edge"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let all = std::fs::read_to_string(log.path()).unwrap_or_default();
            let lines: Vec<&str> = all.lines().collect();
            text += &format!("--- {}\n", log.path().display());
            text += &lines[lines.len().saturating_sub(30)..].join("\n");
            text += "\n";
        }
    }
    text
}
