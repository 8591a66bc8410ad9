//! Installing deploy/ as a user does (`kubectl apply -k` of an overlay), and what the
//! install leaves on the nodes: the cloud pod Ready with its bpffs and programs, its own
//! container exempt from the redirect, no CAP_SYS_ADMIN left, the CA made and
//! published, the edge's certificate by CSR, and the edge's kubelet reached only
//! through the tunnel.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rcgen::ExtendedKeyUsagePurpose;

use crate::k8s::apiserver::ApiServer;
use crate::k8s::checks::NODE;
use crate::nodes::{
    BPFFS, DaemonPod, MasterWithStandIn, cloud_log, cloud_pods, container_cgroup_id, container_pid,
    daemon_pods, is_bpffs,
};
use crate::teardown::left_behind;
use crate::{CLOUD_SELECTOR, EDGE, EDGE_SELECTOR, NAMESPACE, figure, wait_for};

/// How the tunnel CA comes to be, as a user chooses.
#[derive(Clone, Copy, PartialEq)]
pub enum Ca {
    /// The cloud makes it on its first start (deploy/ as shipped).
    MadeByTheCloud,
    /// The operator's own (the test's `common::Pki`, with a client certificate for
    /// [`NODE`] beside it), put in the cloud's Secret by the overlay, as deploy/README.md
    /// shows.
    BroughtByTheOperator,
}

/// The overlay of a test with one master: the edges dial the master's end of the
/// edge's veth (no kube-proxy serves the NodePort), the pods reach the API server at its
/// own address, and the cloud's sockets are in a host directory under the test's own.
pub fn write_overlay(
    dir: &Path,
    api: &ApiServer,
    attach_cgroup: &Path,
    cloud: IpAddr,
    ca: Ca,
) -> PathBuf {
    Overlay {
        api: api.address(),
        attach_cgroup,
        // No worker here: no relay runs, and none would attach beyond the test's cgroup.
        relay_cgroup: attach_cgroup,
        cloud: SocketAddr::new(cloud, 9000),
        run_dir: &dir.join("run-tunnel"),
        ca,
    }
    .write(dir)
}

/// The overlay a test applies: deploy/ with the address the edges dial, which is all a
/// user sets, and what only the test needs: the API's real address (no kube-proxy runs
/// here), the test cgroups to attach to (never the root cgroup deploy/ names), the
/// sockets' host directory, and with [`Ca::BroughtByTheOperator`] the operator's CA.
pub struct Overlay<'a> {
    /// Where the pods reach the API (KUBERNETES_SERVICE_HOST and _PORT).
    pub api: SocketAddr,
    /// The cgroup the cloud's redirect attaches to, as the host names it.
    pub attach_cgroup: &'a Path,
    /// The cgroup a relay's redirect attaches to (a worker's pods), as the host names it.
    pub relay_cgroup: &'a Path,
    /// The address the edges dial.
    pub cloud: SocketAddr,
    /// The host directory of the cloud's sockets (`/run/tunnel` in the pod).
    pub run_dir: &'a Path,
    pub ca: Ca,
}

impl Overlay<'_> {
    /// Writes the overlay in `dir/overlay`; its path.
    pub fn write(&self, dir: &Path) -> PathBuf {
        let Self {
            api: url,
            attach_cgroup,
            relay_cgroup,
            cloud,
            run_dir,
            ca,
        } = *self;
        let overlay = dir.join("overlay");
        std::fs::create_dir_all(&overlay).expect("overlay dir");
        // The name the cloud's config reads (csr.ca_secret), without kustomize's hash.
        let own_ca = match ca {
            Ca::MadeByTheCloud => "",
            Ca::BroughtByTheOperator => {
                let pki = crate::common::Pki::new(&overlay);
                pki.issue(NODE, &[NODE], NODE, ExtendedKeyUsagePurpose::ClientAuth);
                "secretGenerator:
  - name: tunnel-cloud-tls
    behavior: replace
    files: [ca.crt, ca.key]
    options:
      disableNameSuffixHash: true
"
            }
        };
        let deploy = std::fs::canonicalize(Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy"))
            .expect("deploy/");
        let shipped = std::fs::read_to_string(deploy.join("config/cloud.toml"))
            .expect("deploy/config/cloud.toml");
        let attach = format!("cgroup = \"/host{}\"", attach_cgroup.display());
        let config = shipped.replacen("cgroup = \"/host/sys/fs/cgroup\"", &attach, 1);
        assert_ne!(
            config, shipped,
            "deploy/config/cloud.toml names redirect.cgroup"
        );
        std::fs::write(overlay.join("cloud.toml"), config).expect("cloud.toml");
        let shipped = std::fs::read_to_string(deploy.join("config/relay.toml"))
            .expect("deploy/config/relay.toml");
        let attach = format!("cgroup = \"/host{}\"", relay_cgroup.display());
        let config = shipped.replacen("cgroup = \"/host/sys/fs/cgroup\"", &attach, 1);
        assert_ne!(
            config, shipped,
            "deploy/config/relay.toml names redirect.cgroup"
        );
        std::fs::write(overlay.join("relay.toml"), config).expect("relay.toml");
        let shipped = std::fs::read_to_string(deploy.join("config/edge.toml"))
            .expect("deploy/config/edge.toml");
        let dial = format!("address = \"{cloud}\"");
        let config = shipped.replacen("address = \"tunnel.example.com:31000\"", &dial, 1);
        assert_ne!(
            config, shipped,
            "deploy/config/edge.toml names cloud.address"
        );
        std::fs::write(overlay.join("edge.toml"), config).expect("edge.toml");
        let api_env = format!(
            "          env:
            - name: KUBERNETES_SERVICE_HOST
              value: \"{}\"
            - name: KUBERNETES_SERVICE_PORT
              value: \"{}\"
",
            url.ip(),
            url.port()
        );
        std::fs::write(
            overlay.join("cloud-patch.yaml"),
            format!(
                "apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: tunnel-cloud
spec:
  template:
    spec:
      containers:
        - name: tunnel-cloud
{api_env}      volumes:
        - name: run
          hostPath:
            path: {}
            type: DirectoryOrCreate
",
                run_dir.display()
            ),
        )
        .expect("patch");
        // The relay files its CSR with the API; its handover socket in a directory of
        // its node's, beside the cloud's.
        std::fs::write(
            overlay.join("relay-patch.yaml"),
            format!(
                "apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: tunnel-relay
spec:
  template:
    spec:
      containers:
        - name: tunnel-relay
{api_env}      volumes:
        - name: run
          hostPath:
            path: {}-relay
            type: DirectoryOrCreate
",
                run_dir.display()
            ),
        )
        .expect("patch");
        // The edge files its CSR with the API (a strategic merge keeps its NODE_NAME).
        std::fs::write(
            overlay.join("edge-patch.yaml"),
            format!(
                "apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: tunnel-edge
spec:
  template:
    spec:
      containers:
        - name: tunnel-edge
{api_env}"
            ),
        )
        .expect("patch");
        // kustomize wants the base as a relative path.
        let up = overlay.components().count() - 1;
        let base = format!(
            "{}{}",
            "../".repeat(up),
            deploy.display().to_string().trim_start_matches('/')
        );
        std::fs::write(
            overlay.join("kustomization.yaml"),
            format!(
                "resources:
  - {base}
{own_ca}configMapGenerator:
  - name: tunnel-cloud-config
    behavior: replace
    files: [cloud.toml]
  - name: tunnel-edge-config
    behavior: replace
    files: [edge.toml]
  - name: tunnel-relay-config
    behavior: replace
    files: [relay.toml]
patches:
  - path: cloud-patch.yaml
  - path: edge-patch.yaml
  - path: relay-patch.yaml
"
            ),
        )
        .expect("kustomization");
        overlay
    }
}

/// The overlay as kubectl's `-k` argument.
pub fn overlay_arg(overlay: &Path) -> &str {
    overlay.to_str().expect("utf-8")
}

/// `kubectl apply -k` on a host with no bpffs: the one cloud pod becomes Ready, its init
/// container mounted the bpffs, and the five programs are attached to the test cgroup.
pub fn cloud_ready_on_a_host_without_bpffs(
    node: &MasterWithStandIn,
    kubectl: &Path,
    overlay: &Path,
) -> DaemonPod {
    let api = &node.api;
    assert!(!is_bpffs(BPFFS), "{BPFFS} had no bpffs before the apply");
    let applied = Instant::now();
    api.kubectl_ok(kubectl, &["apply", "-k", overlay_arg(overlay)]);
    wait_for(Duration::from_secs(120), "the cloud pod Ready", || {
        cloud_pods(api, kubectl).iter().any(|p| p.ready)
    });
    let ready = applied.elapsed();
    let mut pods = cloud_pods(api, kubectl);
    assert_eq!(pods.len(), 1, "one cloud pod expected: {pods:?}");
    figure(&format!(
        "cloud pod Ready {:.1} s after kubectl apply -k, with no bpffs at {BPFFS} before",
        ready.as_secs_f64()
    ));
    assert!(
        is_bpffs(BPFFS),
        "the init container mounted a bpffs at {BPFFS}"
    );
    let (programs, pins) = left_behind(&node.apiserver_cgroup.path);
    figure(&format!(
        "after the start: {} programs attached to the test cgroup, {} pins:\n  {}",
        programs.len(),
        pins.len(),
        programs.join("\n  ")
    ));
    assert_eq!(programs.len(), 5, "{programs:?}");
    assert!(!pins.is_empty());
    pods.remove(0)
}

/// The exempt cgroup the cloud logged is its own container's.
pub fn cloud_exempts_its_own_container(node: &MasterWithStandIn, kubectl: &Path, pod: &DaemonPod) {
    let log = cloud_log(&node.api, kubectl, &pod.name);
    let attached = log
        .lines()
        .find(|l| l.contains("intercept attached"))
        .unwrap_or_else(|| panic!("no `intercept attached` in the cloud's log:\n{log}"));
    let exempt: u64 = attached
        .split("exempt_cgroup_id=")
        .nth(1)
        .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|id| id.parse().ok())
        .unwrap_or_else(|| panic!("no exempt_cgroup_id in: {attached}"));
    let own = container_cgroup_id(
        &node.containerd,
        pod.container.as_deref().expect("container id"),
    );
    figure(&format!(
        "exempt cgroup in the start log {exempt}, the cloud container's own cgroup {own}"
    ));
    assert_eq!(exempt, own, "{attached}");
}

/// The serving cloud holds no CAP_SYS_ADMIN, on any thread, in any set (it drops every
/// capability once it serves; deploy/ gives it SETPCAP for the bounding set).
pub fn serving_cloud_holds_no_cap_sys_admin(
    node: &MasterWithStandIn,
    kubectl: &Path,
    pod: &DaemonPod,
) {
    let log = crate::nodes::cloud_log(&node.api, kubectl, &pod.name);
    let pid = container_pid(
        &node.containerd,
        pod.container.as_deref().expect("container id"),
    );
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("the cloud's threads");
    for task in tasks {
        let status =
            std::fs::read_to_string(task.expect("task").path().join("status")).unwrap_or_default();
        for set in ["CapEff:", "CapPrm:", "CapBnd:"] {
            let Some(bits) = status.lines().find_map(|l| l.strip_prefix(set)) else {
                continue;
            };
            let bits = u64::from_str_radix(bits.trim(), 16).expect("hex");
            assert_eq!(
                bits & (1 << 21),
                0,
                "{set} {bits:016x} holds CAP_SYS_ADMIN\n{log}"
            );
        }
    }
    let dropped = log
        .lines()
        .find(|l| l.contains("capabilities dropped"))
        .unwrap_or_else(|| panic!("no `capabilities dropped` in the cloud's log:\n{log}"));
    figure(&format!("the serving cloud: {dropped}"));
}

/// The API server's path to the edge kubelet's healthz, through its node proxy.
fn edge_healthz() -> String {
    format!("/api/v1/nodes/{EDGE}/proxy/healthz")
}

/// Before the tunnel kube-apiserver cannot reach the edge's kubelet, and says where it
/// tried.
pub fn edge_kubelet_unreachable_before_the_tunnel(
    api: &ApiServer,
    kubectl: &Path,
    edge_ip: IpAddr,
) {
    let healthz = edge_healthz();
    let direct = api.kubectl(kubectl, &["get", "--raw", &healthz]);
    let refused = String::from_utf8_lossy(&direct.stderr).trim().to_string();
    figure(&format!(
        "before the tunnel, kubectl get --raw {healthz}: {refused}"
    ));
    assert!(
        !direct.status.success() && refused.contains(&edge_ip.to_string()),
        "kube-apiserver reached the edge's kubelet directly: {:?} {refused}",
        String::from_utf8_lossy(&direct.stdout)
    );
}

/// `kubectl apply -k`, then both DaemonSets' pods Ready.
pub fn both_daemonsets_ready(
    api: &ApiServer,
    kubectl: &Path,
    overlay: &Path,
    context: &dyn Fn() -> String,
) {
    daemonsets_ready(api, kubectl, overlay, (1, 1), context);
}

/// `kubectl apply -k`, then `clouds` tunnel-cloud pods and `edges` tunnel-edge pods
/// Ready.
pub fn daemonsets_ready(
    api: &ApiServer,
    kubectl: &Path,
    overlay: &Path,
    (clouds, edges): (usize, usize),
    context: &dyn Fn() -> String,
) {
    let applied = Instant::now();
    api.kubectl_ok(kubectl, &["apply", "-k", overlay_arg(overlay)]);
    let ready = |selector: &str| {
        daemon_pods(api, kubectl, selector)
            .iter()
            .filter(|p| p.ready)
            .count()
    };
    while !(ready(CLOUD_SELECTOR) >= clouds && ready(EDGE_SELECTOR) >= edges) {
        assert!(
            applied.elapsed() < Duration::from_secs(180),
            "{clouds} tunnel-cloud and {edges} tunnel-edge pods not Ready within 180 s:\n{}",
            context()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    figure(&format!(
        "tunnel-cloud and tunnel-edge Ready {:.1} s after kubectl apply -k",
        applied.elapsed().as_secs_f64()
    ));
}

/// The CA the cloud made is the one it published for the edge.
pub fn ca_made_by_the_cloud_is_published(api: &ApiServer, kubectl: &Path) {
    let ca_of = |kind: &str, name: &str| {
        api.kubectl_ok(
            kubectl,
            &[
                "get",
                kind,
                name,
                "-n",
                NAMESPACE,
                "-o",
                "jsonpath={.data.ca\\.crt}",
            ],
        )
    };
    let published = ca_of("configmap", "tunnel-ca.crt");
    let stored = {
        use base64::Engine as _;
        let b64 = ca_of("secret", "tunnel-cloud-tls");
        let pem = base64::engine::general_purpose::STANDARD
            .decode(b64.trim())
            .expect("base64");
        String::from_utf8(pem).expect("PEM")
    };
    assert!(
        published.contains("BEGIN CERTIFICATE") && published == stored,
        "the ConfigMap holds the CA the cloud stored:\n{published}\n{stored}"
    );
    figure(&format!(
        "the cloud made the CA and published it in ConfigMap tunnel-ca.crt ({} bytes)",
        published.len()
    ));
}

/// The edge's pod filed a CSR with its ServiceAccount's token and it was approved.
pub fn edge_certificate_by_an_approved_csr(
    api: &ApiServer,
    kubectl: &Path,
    context: &dyn Fn() -> String,
) {
    let csrs = api.kubectl_ok(
        kubectl,
        &["get", "csr", "-o", "custom-columns=NAME:.metadata.name,SIGNER:.spec.signerName,REQUESTOR:.spec.username,CONDITION:.status.conditions[*].type"],
    );
    figure(&format!("certificate signing requests:\n{csrs}"));
    assert!(
        csrs.lines().any(|l| l.contains("tunnel.io/edge-client")
            && l.contains("system:serviceaccount:tunnel-system:tunnel-edge")
            && l.contains("Approved")),
        "no approved CSR of the edge's pod:\n{csrs}\n{}",
        context()
    );
}

/// Through the tunnel, the request that failed before the install reaches the edge's
/// kubelet.
pub fn edge_kubelet_reached_through_the_tunnel(
    api: &ApiServer,
    kubectl: &Path,
    context: &dyn Fn() -> String,
) {
    let healthz = edge_healthz();
    let through = api.kubectl(kubectl, &["get", "--raw", &healthz]);
    let answer = String::from_utf8_lossy(&through.stdout).trim().to_string();
    figure(&format!(
        "through the tunnel, kubectl get --raw {healthz}: {answer}"
    ));
    assert!(
        through.status.success() && answer == "ok",
        "{answer} {}\n{}",
        String::from_utf8_lossy(&through.stderr),
        context()
    );
}
