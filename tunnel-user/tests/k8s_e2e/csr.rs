//! Edge certificates from CertificateSigningRequests, against the real API server and
//! kube-controller-manager (its own signer, approver and CSR cleaner run beside the
//! cloud's signer and must leave tunnel.io/edge-client alone). The cloud runs with a
//! token of deploy/'s tunnel-cloud ServiceAccount, the edge with a token of tunnel-edge
//! bound to a pod on its node, as in a cluster: the RBAC exercised is deploy/'s.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::config::{path_str, write_toml};
use crate::common::privileged;
use crate::common::{self};
use crate::k8s::apiserver::{ApiServer, ApiServerOpts, Credential, Daemon, write_kubeconfig};
use crate::k8s::checks::{NODE, admin_kubectl, prerequisites, wait_log};
use crate::{create_token, k8s, sigterm_and_wait, tunnel};
use rcgen::ExtendedKeyUsagePurpose;

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
    /// The cloud's admin listener (its metrics).
    admin: std::net::SocketAddr,
    /// The replica's peer listener, where relays link.
    peers: std::net::SocketAddr,
    /// The edge pod's service account token (audience: the API server), bound to the pod.
    edge_kubeconfig: PathBuf,
    _ports: [common::ClosedPort; 4],
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
        let ports = common::reserve_ports::<4>();
        let [tunnel_addr, connect, admin, peers] = ports.each_ref().map(|p| p.addr);
        let config = tunnel_dir.join("cloud.toml");
        write_toml(
            &config,
            &toml::toml! {
                [tunnel]
                listen = (tunnel_addr.to_string())
                cert = "cloud.crt"
                key = "cloud.key"
                client_ca = "ca.crt"
                reauth_interval = "2s"

                [admin]
                listen = (admin.to_string())

                [connect]
                listen = (connect.to_string())

                [peers]
                listen = (peers.to_string())

                [kubernetes]
                enabled = true
                edge_service_account = "tunnel-system:tunnel-edge"
                relay_service_account = "tunnel-system:tunnel-relay"

                [csr]
                enabled = true
                signer_name = SIGNER
                ca_key = "ca.key"
                max_lifetime = (max_lifetime.to_string())
            },
        );
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
            admin,
            peers,
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
        write_toml(
            &config,
            &toml::toml! {
                node_name = NODE

                [cloud]
                address = (self.tunnel_addr.to_string())
                server_name = "tunnel-cloud"
                ca = "ca.crt"

                [csr]
                enabled = true
                dir = (path_str(&self.edge_state()))
                signer_name = SIGNER
                lifetime = "10m"

                [admin]
                listen = "127.0.0.1:0"

                [allow]
                targets = [(target.to_string())]
            },
        );
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

    /// A certificate request for `CN=<cn>` with a new key (`key_args`, openssl's
    /// `-newkey ...`) in `<name>.key`, as the base64 of its PEM that a CSR's
    /// `spec.request` holds.
    fn request(&self, name: &str, cn: &str, key_args: &[&str]) -> String {
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
        base64::engine::general_purpose::STANDARD.encode(std::fs::read(&csr).expect("csr"))
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
        let request = self.request(name, cn, key_args);
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

    /// Files `count` CSRs for `cn` (`<prefix>-<i>`, one request) with `kubeconfig`'s
    /// credentials, in one `kubectl create`.
    fn file_flood(&self, kubeconfig: &Path, prefix: &str, count: usize, cn: &str) {
        let request = self.request(
            prefix,
            cn,
            &["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"],
        );
        let items: Vec<serde_json::Value> = (0..count)
            .map(|i| {
                serde_json::json!({
                    "apiVersion": "certificates.k8s.io/v1",
                    "kind": "CertificateSigningRequest",
                    "metadata": {"name": format!("{prefix}-{i}")},
                    "spec": {
                        "request": request,
                        "signerName": SIGNER,
                        "usages": ["digital signature", "client auth"],
                    },
                })
            })
            .collect();
        let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": items});
        let out = self.api.kubectl_as(
            &self.kubectl,
            kubeconfig,
            &["create", "-f", "-"],
            Some(list.to_string().as_bytes()),
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

/// With the cloud capping certificates at two minutes, the edge renews at 60-85% of the
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
    let expiry_metric =
        format!("tunnel_edge_certificate_expiry_timestamp_seconds{{node=\"{NODE}\"}}");
    let unix = |t: std::time::SystemTime| {
        t.duration_since(std::time::UNIX_EPOCH)
            .expect("after 1970")
            .as_secs() as f64
    };
    assert_eq!(
        common::metric(cluster.admin, &expiry_metric),
        unix(first_expiry)
    );
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
    // What Prometheus reads of the session moved on with it (TunnelEdgeCertificateNotRenewed).
    assert_eq!(
        common::metric(cluster.admin, &expiry_metric),
        unix(latest_expiry)
    );
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

/// A node's credentials for `node` (a kubelet's: `system:node:<node>`), as a kubeconfig.
fn node_kubeconfig(cluster: &CsrCluster, node: &str) -> PathBuf {
    let name = format!("node-{node}");
    cluster.api.pki.issue(
        &name,
        &format!("system:node:{node}"),
        Some("system:nodes"),
        &[],
        ExtendedKeyUsagePurpose::ClientAuth,
    );
    let kubeconfig = cluster.dir.path().join(format!("{name}.kubeconfig"));
    write_kubeconfig(
        &kubeconfig,
        &cluster.api.url,
        &cluster.api.pki,
        Credential::Cert(&name),
    );
    kubeconfig
}

/// When `daemon` first logged `needle`, by the line's own timestamp.
fn logged_at(daemon: &Daemon, needle: &str) -> k8s_openapi::jiff::Timestamp {
    let log = daemon.log_text();
    let line = log
        .lines()
        .find(|l| l.contains(needle))
        .unwrap_or_else(|| panic!("`{needle}` not logged:\n{log}"));
    line.split_whitespace()
        .next()
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("no timestamp: {line}"))
}

/// Waits (bounded) for `needle` in `daemon`'s log; how long it took.
fn time_to_log(daemon: &Daemon, needle: &str, bound: Duration) -> Duration {
    let started = Instant::now();
    wait_log(daemon, needle, bound);
    started.elapsed()
}

/// Any kubelet may file CSRs. A flood from one node (edge-2's own credentials) is
/// charged to that node: a fresh edge's CSR, filed behind it, is issued within seconds,
/// and deleting the edge's CSR during a second flood still revokes its certificate at
/// the next re-check (the watch applies deletions without waiting for reviews).
#[test]
fn csr_flood_from_another_node_stalls_neither_issuance_nor_revocation() {
    let Some(cluster) = CsrCluster::start("1h") else {
        return;
    };
    const FLOOD: usize = 300;
    let flooder = node_kubeconfig(&cluster, "edge-2");
    let started = Instant::now();
    cluster.file_flood(&flooder, "flood-a", FLOOD, "edge-2");
    eprintln!(
        "csr flood: {FLOOD} CSRs filed by system:node:edge-2 in {:?}",
        started.elapsed()
    );

    let sink = common::servers::sink("127.0.0.1:0");
    let edge = cluster.start_edge("tunnel-edge", sink);
    wait_log(&edge, "client certificate issued", Duration::from_secs(60));
    let waited = logged_at(&edge, "client certificate issued")
        .duration_since(logged_at(&edge, "CertificateSigningRequest filed"));
    let waited = Duration::try_from(waited).expect("issued after filed");
    wait_log(&cluster.cloud, "edge registered", Duration::from_secs(10));
    let floods = |log: &str| common::probe::count_lines(log, &["TooManyRequests"]);
    eprintln!(
        "csr flood: the edge's CSR was issued {waited:?} after it was filed, behind {FLOOD} CSRs of another node ({} of them denied as a flood by then)",
        floods(&cluster.cloud.log_text())
    );
    assert!(
        waited < Duration::from_secs(10),
        "the edge waited {waited:?} for its certificate behind another node's flood"
    );

    // A second flood, all beyond edge-2's budget, then the edge's CSR is deleted.
    cluster.file_flood(&flooder, "flood-b", FLOOD, "edge-2");
    let name = cluster
        .csrs()
        .iter()
        .find(|c| c["spec"]["username"] == "system:serviceaccount:tunnel-system:tunnel-edge")
        .and_then(|c| c["metadata"]["name"].as_str().map(str::to_string))
        .expect("the edge's CSR");
    cluster
        .api
        .kubectl_ok(&cluster.kubectl, &["delete", "csr", &name]);
    let revoked = time_to_log(
        &cluster.cloud,
        "its CertificateSigningRequest is gone",
        Duration::from_secs(20),
    );
    eprintln!(
        "csr flood: deleting the edge's CSR during a second flood ended its session {revoked:?} later (re-check every 2s)"
    );
    assert!(
        revoked < Duration::from_secs(8),
        "revocation waited {revoked:?} behind the flood"
    );
    // Every flood CSR is answered: approved within the node's budget, denied beyond it.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let csrs = cluster.csrs();
        let unanswered = csrs
            .iter()
            .filter(|c| {
                c["status"]["conditions"]
                    .as_array()
                    .is_none_or(|c| c.is_empty())
            })
            .count();
        if unanswered == 0 {
            let denied = csrs
                .iter()
                .filter(|c| c["status"]["conditions"][0]["reason"] == "TooManyRequests")
                .count();
            assert!(denied >= 2 * FLOOD - 10, "{denied} denied as a flood");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{unanswered} CSRs never answered"
        );
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// The cloud's pod lookup for an edge's CSR fails (deploy/'s binding to the pods role is
/// gone for a while): the CSR stays pending, and once the shipped RBAC is back, the
/// retry (a list, which the shipped ClusterRole grants; it does not grant get) approves
/// it and the edge registers.
#[test]
fn csr_pending_after_a_failed_pod_lookup_is_approved_on_retry() {
    let Some(cluster) = CsrCluster::start("1h") else {
        return;
    };
    cluster.api.kubectl_ok(
        &cluster.kubectl,
        &[
            "delete",
            "rolebinding",
            "tunnel-cloud-peers",
            "-n",
            "tunnel-system",
        ],
    );
    let sink = common::servers::sink("127.0.0.1:0");
    let edge = cluster.start_edge("tunnel-edge", sink);
    wait_log(
        &cluster.cloud,
        "cannot look up the requester's pod; the CSR stays pending",
        Duration::from_secs(30),
    );
    let pending = cluster.csrs();
    assert_eq!(pending.len(), 1, "{pending:#?}");
    assert!(pending[0]["status"]["conditions"].is_null(), "{pending:#?}");

    let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
    cluster.api.kubectl_ok(
        &cluster.kubectl,
        &["apply", "-k", deploy.to_str().expect("utf-8")],
    );
    let waited = time_to_log(&edge, "client certificate issued", Duration::from_secs(120));
    wait_log(&cluster.cloud, "edge registered", Duration::from_secs(10));
    let csr = &cluster.csrs()[0];
    assert_eq!(csr["status"]["conditions"][0]["type"], "Approved", "{csr}");
    assert_eq!(
        csr["status"]["conditions"][0]["reason"], "EdgeNode",
        "{csr}"
    );
    eprintln!("csr: approved on retry {waited:?} after deploy/'s RBAC was back");
    common::probe::round_trip(
        cluster.connect,
        &format!("{NODE}:{}", sink.port()),
        27,
        1 << 20,
    )
    .expect("a transfer through the edge");
}

const RELAY_POD: &str = "tunnel-relay-e2e";

/// A pod `name` of service account `account` on `node`, and a kubeconfig with a token
/// bound to it, as the pod's mounted one is.
fn pod_kubeconfig(cluster: &CsrCluster, name: &str, account: &str, node: &str) -> PathBuf {
    cluster.api.apply(
        &cluster.kubectl,
        &format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: tunnel-system\nspec:\n  nodeName: {node}\n  serviceAccountName: {account}\n  containers:\n  - name: c\n    image: tunnel:0.1.0\n"
        ),
    );
    let token = create_token(
        &cluster.api,
        &cluster.kubectl,
        "tunnel-system",
        account,
        &["--bound-object-kind", "Pod", "--bound-object-name", name],
    );
    let kubeconfig = cluster.dir.path().join(format!("{name}.kubeconfig"));
    write_kubeconfig(
        &kubeconfig,
        &cluster.api.url,
        &cluster.api.pki,
        Credential::Token(&token),
    );
    kubeconfig
}

/// A relay's certificate (CN `system:tunnel-relay:<node>`) goes only to a pod of the
/// relays' service account running on that node. Denied with the reason: the relay pod
/// on worker-1 asking for worker-2's relay name; an edge pod asking for its own node's
/// relay name; a pod of another service account on worker-1; worker-1's own node
/// credentials; and the relay pod asking for an edge name. Then `tunnel cloud` as a
/// relay with nothing on disk files its CSR with the relay pod's token, is approved
/// (RelayNode) and links to the replica with the certificate, which the replica takes
/// as worker-1's relay. Without the checks (a signer that approves whatever a
/// requester asks), the five denials would be approvals.
#[test]
fn csr_relay_gets_only_its_own_node_s_relay_certificate() {
    let Some(cluster) = CsrCluster::start("1h") else {
        return;
    };
    for node in ["worker-1", "worker-2"] {
        cluster.api.apply(
            &cluster.kubectl,
            &format!("apiVersion: v1\nkind: Node\nmetadata:\n  name: {node}\n"),
        );
    }
    cluster.api.apply(
        &cluster.kubectl,
        "apiVersion: v1\nkind: ServiceAccount\nmetadata:\n  name: not-the-relay\n  namespace: tunnel-system\n",
    );
    // Granted the relay's ClusterRole: it may file CSRs, but it is not the relay.
    cluster.api.apply(
        &cluster.kubectl,
        "apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\nmetadata:\n  name: not-the-relay\nroleRef:\n  apiGroup: rbac.authorization.k8s.io\n  kind: ClusterRole\n  name: tunnel-relay\nsubjects:\n- kind: ServiceAccount\n  name: not-the-relay\n  namespace: tunnel-system\n",
    );
    let relay = pod_kubeconfig(&cluster, RELAY_POD, "tunnel-relay", "worker-1");
    let other = pod_kubeconfig(&cluster, "other-e2e", "not-the-relay", "worker-1");
    let node = node_kubeconfig(&cluster, "worker-1");
    const EC: &[&str] = &["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"];
    let usages = &["digital signature", "client auth"];
    let cases: [(&str, &Path, &str, &str); 5] = [
        (
            "relay-for-another-node",
            &relay,
            "system:tunnel-relay:worker-2",
            "requester may not speak for the relay on node `worker-2`: its pod tunnel-system/tunnel-relay-e2e runs on node `worker-1`",
        ),
        (
            "edge-for-a-relay-name",
            &cluster.edge_kubeconfig,
            "system:tunnel-relay:edge-1",
            "pod tunnel-system/tunnel-edge-e2e is not a pod of the relays' service account `tunnel-system:tunnel-relay`",
        ),
        (
            "other-account",
            &other,
            "system:tunnel-relay:worker-1",
            "`system:serviceaccount:tunnel-system:not-the-relay` is not a pod of the relays' service account",
        ),
        (
            "node-for-its-relay-name",
            &node,
            "system:tunnel-relay:worker-1",
            "node worker-1 is not a pod of the relays' service account",
        ),
        (
            "relay-for-an-edge-name",
            &relay,
            "worker-1",
            "pod tunnel-system/tunnel-relay-e2e is neither that node nor a pod of the edges' service account",
        ),
    ];
    for (name, kubeconfig, cn, _) in &cases {
        cluster.file_by_hand(kubeconfig, name, cn, EC, usages);
    }
    for (name, _, _, message) in &cases {
        let csr = cluster.answered(name);
        let conditions = csr["status"]["conditions"].as_array().expect("conditions");
        assert_eq!(conditions[0]["type"], "Denied", "{name}: {conditions:?}");
        assert_eq!(conditions[0]["reason"], "NotThisNode", "{name}");
        let said = conditions[0]["message"].as_str().unwrap_or_default();
        assert!(said.contains(message), "{name}: {said}");
        assert!(csr["status"]["certificate"].is_null(), "{name}");
        eprintln!("csr {name}: denied: {said}");
    }
    assert!(cluster.issued().is_empty(), "nothing issued");

    // The relay itself: its redirect needs eBPF on a cgroup of the test's own.
    let Some(cgroup) = privileged::test_cgroup("the relay's redirect") else {
        return;
    };
    let state = cluster.dir.path().join("relay-state");
    let config = cluster.tunnel_dir.join("relay.toml");
    write_toml(
        &config,
        &toml::toml! {
            role = "relay"

            [tunnel]

            [relay]
            node_name = "worker-1"

            [relay.csr]
            enabled = true
            dir = (path_str(&state))
            signer_name = SIGNER
            lifetime = "10m"

            [peers]
            static = [(cluster.peers.to_string())]
            ca = "ca.crt"

            [admin]
            listen = "127.0.0.1:0"

            [redirect]
            enabled = true
            listen = "127.0.0.1:0"
            cgroup = (path_str(&cgroup.path))
        },
    );
    let mut cmd = Command::new(common::BIN);
    cmd.args(["cloud", "--config"])
        .arg(&config)
        .env("KUBECONFIG", &relay);
    let mut relay_process = tunnel("tunnel-relay", &cluster.tunnel_dir, cmd);
    wait_log(&cluster.cloud, "relay connected", Duration::from_secs(60));
    let linked = cluster.cloud.log_text();
    assert!(
        linked
            .lines()
            .any(|l| l.contains("relay connected") && l.contains("worker-1")),
        "the replica takes the link as worker-1's relay:\n{}",
        cluster.cloud.log_tail(20)
    );
    let csrs = cluster.csrs();
    let approved: Vec<&serde_json::Value> = csrs
        .iter()
        .filter(|c| c["status"]["conditions"][0]["type"] == "Approved")
        .collect();
    assert_eq!(approved.len(), 1, "{csrs:#?}");
    assert_eq!(
        approved[0]["status"]["conditions"][0]["reason"],
        "RelayNode"
    );
    assert!(
        approved[0]["metadata"]["name"]
            .as_str()
            .is_some_and(|n| n.starts_with("tunnel-relay-worker-1-")),
        "{}",
        approved[0]["metadata"]["name"]
    );
    let (cn, _) = subject_and_expiry(&cluster.issued()[0]);
    assert_eq!(cn, "system:tunnel-relay:worker-1");
    assert_eq!(mode(&state.join("client-current.pem")), 0o600);
    sigterm_and_wait(&mut relay_process);
    eprintln!("csr: the relay on worker-1 got its certificate by CSR and linked to the replica");
}
