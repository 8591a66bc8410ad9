//! Five real nodes on this machine, as users run a cluster with edges: two masters,
//! each with its own kube-apiserver (on one etcd) and, once deploy/ is applied, its own
//! tunnel-cloud replica; a worker; and two edges, each in its own network namespace
//! behind NAT, whose kubelets the masters reach only through the tunnel. The edges
//! reach the masters through one address (a load balancer of the test's on the host's
//! LAN address), for the API and the tunnel alike.
//!
//! Every node is a containerd and a kubelet in a network and a mount namespace of its
//! own (`k8s::node::NodeNamespaces`): the two clouds bind the same host-network ports,
//! mount a bpffs at the same `/sys/fs/bpf` and share the same `/run/tunnel` socket
//! directory, each on its own node. Each master's redirect attaches to its own
//! kube-apiserver's cgroup: the one cgroup path deploy/'s config names,
//! [`FiveNodes::redirected`], is in each master's mount namespace a bind mount of that
//! master's own cgroup, never the root cgroup.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::common::netns::EdgeNetns;
use crate::common::netns::ip;
use crate::common::privileged::TestCgroup;
use crate::k8s::apiserver::{ApiServer, ApiServerOpts, ControllerManager, Endpoint};
use crate::k8s::node::{
    Binaries, Containerd, HostChanges, Kubelet, NodeNamespaces, PodNetwork, Scheduler,
    busybox_image, pause_image, run,
};
use crate::network::{Lan, LanNode, LoadBalancer};
use crate::nodes::{Kube, image_archive, label_and_untaint, registered};
use crate::{figure, wait_for};

pub const MASTERS: [&str; 2] = ["master-1", "master-2"];
pub const WORKER: &str = "worker-1";
pub const EDGES: [&str; 2] = ["edge-1", "edge-2"];

/// A node: its own namespaces, containerd and kubelet. Field order is drop order.
pub struct Node {
    pub name: &'static str,
    /// Its network namespace (`/run/netns/<netns>`).
    pub netns: String,
    /// `None` while the node is down (the test stopped its kubelet).
    pub kubelet: Option<Kubelet>,
    pub containerd: Containerd,
    pub namespaces: NodeNamespaces,
    pub ip: Ipv4Addr,
    /// Its pods' own network (the masters' and the worker's); `None` on an edge, whose
    /// pods use the host network.
    pub pods: Option<PodNetwork>,
    pub dir: PathBuf,
}

impl Node {
    /// A node `name` with address `ip` in network namespace `netns`: its containerd with
    /// `images` imported, its pods on `pod_subnet` when given, and its kubelet
    /// registering with `api`.
    fn start(
        cluster: &Setup,
        name: &'static str,
        (netns, ip): (&str, Ipv4Addr),
        pod_subnet: Option<&str>,
        images: &[&Path],
        api: Endpoint<'_>,
    ) -> Self {
        let dir = cluster.dir.join(name);
        let namespaces =
            NodeNamespaces::new(netns, &dir).unwrap_or_else(|e| panic!("{name}'s namespaces: {e}"));
        let pods = pod_subnet.map(|subnet| {
            PodNetwork::write(&dir, subnet).unwrap_or_else(|e| panic!("{name}'s CNI: {e}"))
        });
        let containerd = Containerd::start(&dir, Some(&namespaces), pods.as_ref())
            .unwrap_or_else(|e| panic!("{name}'s containerd: {e}"));
        for image in images {
            containerd
                .import(image)
                .unwrap_or_else(|e| panic!("{name}: import {}: {e}", image.display()));
        }
        let mut node = Self {
            name,
            netns: netns.to_string(),
            kubelet: None,
            containerd,
            namespaces,
            ip,
            pods,
            dir,
        };
        node.start_kubelet(&cluster.bins, api);
        node
    }

    /// Starts (again) the node's kubelet, registering with `api`.
    pub fn start_kubelet(&mut self, bins: &Binaries, api: Endpoint<'_>) {
        let kubelet = Kubelet::start(
            &bins.kubelet,
            api,
            &self.containerd,
            self.name,
            self.ip,
            &self.dir,
            Some(&self.namespaces),
        )
        .unwrap_or_else(|e| panic!("{}'s kubelet: {e}", self.name));
        self.kubelet = Some(kubelet);
    }

    pub fn log_tail(&self) -> String {
        match &self.kubelet {
            Some(k) => k.log_tail(20),
            None => "(kubelet stopped)".into(),
        }
    }
}

/// A master: its node, its kube-apiserver in its network namespace and cgroup.
pub struct Master {
    pub node: Node,
    pub api: ApiServer,
    /// kube-apiserver's cgroup: the redirect attaches here.
    pub cgroup: TestCgroup,
}

/// An edge: its node, in a network namespace behind NAT.
pub struct Edge {
    pub node: Node,
    pub netns: EdgeNetns,
}

impl Edge {
    /// Edge `name` in a network namespace of its own, whose only way out is its uplink to
    /// the host, routed to the load balancer's address.
    fn start(
        setup: &Setup,
        lan: &Lan,
        name: &'static str,
        images: &[&Path],
        api: Endpoint<'_>,
    ) -> Self {
        let mut netns = EdgeNetns::new().expect("an edge's network namespace");
        let ip = netns.add_node_ip().expect("the edge's address");
        lan.route_edge(&netns)
            .expect("the edge's route to the load balancer");
        let node = Node::start(setup, name, (&netns.name, ip), None, images, api);
        Self { node, netns }
    }
}

/// What the set-up shares while the nodes come up.
struct Setup {
    dir: PathBuf,
    bins: Binaries,
}

/// The five nodes. Field order is drop order: the nodes first, the host put back last.
pub struct FiveNodes {
    pub edges: Vec<Edge>,
    pub worker: Node,
    _scheduler: Scheduler,
    _controller_manager: ControllerManager,
    /// master-1's kube-apiserver runs the etcd both use.
    pub masters: Vec<Master>,
    /// The one address of the masters' tunnel port and of their API servers.
    pub tunnel_lb: LoadBalancer,
    pub api_lb: LoadBalancer,
    _lan: Lan,
    /// The cgroup path deploy/'s config names: in each master's mount namespace, a bind
    /// mount of that master's kube-apiserver cgroup.
    pub redirected: TestCgroup,
    pub bins: Binaries,
    _host: HostChanges,
    pub dir: tempfile::TempDir,
}

impl FiveNodes {
    pub fn start(kube: &Kube) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let host = HostChanges::record().expect("host state");
        let setup = Setup {
            dir: dir.path().to_path_buf(),
            bins: Binaries::unpack(&kube.assets, dir.path()).expect("unpack the node's binaries"),
        };
        let cgroup_root = tunnel_user::intercept::detect_cgroup_root().expect("cgroup v2");
        let redirected = TestCgroup::new(&cgroup_root).expect("the redirected cgroup's path");
        let lan = Lan::new().expect("the LAN");
        let lan_nodes: Vec<_> = (2..=4)
            .map(|n| lan.node(n).expect("a node on the LAN"))
            .collect();
        let [m1, m2, w] = &lan_nodes[..] else {
            unreachable!()
        };
        let masters_api = api_servers(kube, &setup.dir, &lan, [m1, m2], &cgroup_root);
        let api_backends = masters_api
            .iter()
            .map(|(a, _)| a.address())
            .collect::<Vec<_>>();
        let api_lb = LoadBalancer::start(SocketAddr::new(lan.host_ip().into(), 0), api_backends)
            .expect("the API's load balancer");
        let tunnel_lb = LoadBalancer::start(
            SocketAddr::new(lan.host_ip().into(), 0),
            [m1.ip, m2.ip]
                .iter()
                .map(|ip| SocketAddr::new((*ip).into(), 9000))
                .collect(),
        )
        .expect("the tunnel's load balancer");
        let first = &masters_api[0].0;
        let controller_manager =
            ControllerManager::start(&kube.assets, first, dir.path(), &kube.kubectl)
                .expect("kube-controller-manager");
        let scheduler = Scheduler::start(&setup.bins, first, dir.path());

        let pause = pause_image(&setup.bins.pause, dir.path()).expect("the sandbox image");
        let workload = busybox_image(dir.path()).expect("the workload image");
        let tunnel = image_archive();
        let through_lb = api_lb_url(&api_lb);
        let mut masters = Vec::new();
        for ((api, cgroup), (name, m)) in masters_api.into_iter().zip(MASTERS.iter().zip([m1, m2]))
        {
            // Each master's kubelet registers with its own API server, as kubeadm's do.
            let node = Node::start(
                &setup,
                name,
                (&m.netns, m.ip),
                Some(&pod_subnet(m)),
                &[&pause, &tunnel],
                api.endpoint(),
            );
            run(node
                .namespaces
                .command(Path::new("mount"))
                .arg("--bind")
                .arg(&cgroup.path)
                .arg(&redirected.path))
            .expect("bind the master's cgroup at the redirected path");
            masters.push(Master { node, api, cgroup });
        }
        let endpoint = Endpoint {
            url: &through_lb,
            pki: &masters[0].api.pki,
        };
        // The worker runs the relay, the metrics-server stand-in (curl in the workload
        // image) and Prometheus.
        let (_, prometheus) = crate::common::monitoring::prometheus_image();
        assert!(
            prometheus.exists(),
            "{}: run `cargo xtask image --prometheus` first (scripts/test.sh does)",
            prometheus.display()
        );
        let images: [&Path; 4] = [&pause, &tunnel, &workload, &prometheus];
        let worker = Node::start(
            &setup,
            WORKER,
            (&w.netns, w.ip),
            Some(&pod_subnet(w)),
            &images,
            endpoint,
        );
        route_pod_subnets(masters.iter().map(|m| &m.node).chain([&worker]));
        let edges = EDGES
            .into_iter()
            .map(|name| {
                let images: [&Path; 3] = [&pause, &tunnel, &workload];
                Edge::start(&setup, &lan, name, &images, endpoint)
            })
            .collect();
        let nodes = Self {
            edges,
            worker,
            _scheduler: scheduler,
            _controller_manager: controller_manager,
            masters,
            tunnel_lb,
            api_lb,
            _lan: lan,
            redirected,
            bins: setup.bins,
            _host: host,
            dir,
        };
        nodes.registered_and_labelled(&kube.kubectl);
        nodes
    }

    /// Waits for the five nodes to register, then labels them by role.
    fn registered_and_labelled(&self, kubectl: &Path) {
        let api = self.api(0);
        let names: Vec<&str> = MASTERS
            .iter()
            .chain([&WORKER])
            .chain(&EDGES)
            .copied()
            .collect();
        let up = wait_for(Duration::from_secs(90), "the five nodes registered", || {
            names.iter().all(|n| registered(api, kubectl, n))
        });
        figure(&format!(
            "five nodes registered after {:.1} s: {}",
            up.as_secs_f64(),
            self.describe()
        ));
        for m in MASTERS {
            label_and_untaint(api, kubectl, m, "node-role.kubernetes.io/control-plane=");
            // As kubeadm taints masters: ordinary pods (Prometheus) go to the worker.
            api.kubectl_ok(
                kubectl,
                &[
                    "taint",
                    "node",
                    m,
                    "node-role.kubernetes.io/control-plane:NoSchedule",
                ],
            );
        }
        label_and_untaint(api, kubectl, WORKER, "node-role.kubernetes.io/worker=");
        for e in EDGES {
            label_and_untaint(api, kubectl, e, "node-role.kubernetes.io/edge=");
        }
    }

    /// Who is where, for the figures.
    pub fn describe(&self) -> String {
        let pods = |n: &Node| match &n.pods {
            Some(p) => format!(", pods {} on {} by CNI", p.subnet, p.bridge),
            None => String::new(),
        };
        let masters = self.masters.iter().map(|m| {
            format!(
                "{} {} (API {}{})",
                m.node.name,
                m.node.ip,
                m.api.url,
                pods(&m.node)
            )
        });
        let edges = self.edges.iter().map(|e| {
            format!(
                "{} {} behind NAT in {}",
                e.node.name, e.node.ip, e.netns.name
            )
        });
        masters
            .chain([format!(
                "{} {} ({})",
                WORKER,
                self.worker.ip,
                pods(&self.worker).trim_start_matches(", ")
            )])
            .chain(edges)
            .chain([format!(
                "load balancer: tunnel {}, API {}",
                self.tunnel_lb.listen, self.api_lb.listen
            )])
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// The cgroup the worker's pods run under: the relay's redirect attaches there
    /// (deploy/ names the node's root cgroup, which a test never attaches to).
    pub fn worker_pods_cgroup(&self) -> PathBuf {
        let cgroup_root = tunnel_user::intercept::detect_cgroup_root().expect("cgroup v2");
        let kubelet = self.worker.kubelet.as_ref().expect("the worker's kubelet");
        kubelet.pods_cgroup(&cgroup_root)
    }

    /// master-`i`'s API server.
    pub fn api(&self, i: usize) -> &ApiServer {
        &self.masters[i].api
    }

    pub fn edge_ip(&self, i: usize) -> IpAddr {
        self.edges[i].node.ip.into()
    }

    /// For a failure message: each node's kubelet log.
    pub fn context(&self) -> String {
        let masters = self.masters.iter().map(|m| &m.node);
        let edges = self.edges.iter().map(|e| &e.node);
        masters
            .chain([&self.worker])
            .chain(edges)
            .map(|n| format!("--- {}'s kubelet:\n{}", n.name, n.log_tail()))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// The pods' subnet of LAN node `n`: 10.244.`n`.0/24 (as flannel's 10.244.0.0/16),
/// in the node's namespace only.
fn pod_subnet(node: &LanNode) -> String {
    format!("10.244.{}.0/24", node.ip.octets()[3])
}

/// Each node routes the other nodes' pod subnets to their LAN addresses, as flannel's
/// host-gw does: a pod's reply comes back to its own address (no masquerade). The
/// routes are in the nodes' namespaces and go with them.
fn route_pod_subnets<'a>(nodes: impl Iterator<Item = &'a Node> + Clone) {
    for node in nodes.clone() {
        for other in nodes.clone().filter(|o| o.name != node.name) {
            let subnet = &other.pods.as_ref().expect("a pod network").subnet;
            ip(&[
                "-n",
                &node.netns,
                "route",
                "add",
                subnet,
                "via",
                &other.ip.to_string(),
            ])
            .unwrap_or_else(|e| panic!("{}'s route to {}'s pods: {e}", node.name, other.name));
        }
    }
}

/// The API's URL through the load balancer.
fn api_lb_url(lb: &LoadBalancer) -> String {
    format!("https://{}", lb.listen)
}

/// Each master's kube-apiserver, in its network namespace and a cgroup of its own, the
/// second on the first one's etcd; with its cgroup.
fn api_servers(
    kube: &Kube,
    dir: &Path,
    lan: &Lan,
    [m1, m2]: [&LanNode; 2],
    cgroup_root: &Path,
) -> Vec<(ApiServer, TestCgroup)> {
    let mut masters_api: Vec<(ApiServer, TestCgroup)> = Vec::new();
    for (i, m) in [m1, m2].into_iter().enumerate() {
        let cgroup = TestCgroup::new(cgroup_root).expect("kube-apiserver's cgroup");
        let opts = ApiServerOpts {
            cgroup: Some(cgroup.path.clone()),
            bind: Some(m.ip),
            netns: Some(m.netns.clone()),
            // One serving certificate for both, valid at the load balancer too.
            sans: vec![
                m1.ip.to_string(),
                m2.ip.to_string(),
                lan.host_ip().to_string(),
            ],
            extra_args: Vec::new(),
        };
        let api_dir = dir.join(format!("{}-apiserver", MASTERS[i]));
        std::fs::create_dir_all(&api_dir).expect("apiserver dir");
        let api = match masters_api.first() {
            None => ApiServer::start(&kube.assets, &api_dir, &opts),
            Some((first, _)) => first.another(&kube.assets, &api_dir, &opts),
        };
        masters_api.push((api, cgroup));
    }
    masters_api
}
