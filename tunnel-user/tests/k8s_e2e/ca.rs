//! The tunnel CA kept in the cluster (deploy/'s `csr.ca_secret`, `csr.ca_config_map`),
//! against the real API server with deploy/ applied: the clouds run with a token of
//! its tunnel-cloud ServiceAccount, so the RBAC exercised is deploy/'s, narrowed to the
//! CA's Secret and ConfigMap by name.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::common::config::{path_str, write_toml};
use crate::common::{self};
use crate::k8s::apiserver::{ApiServer, ApiServerOpts, Credential, Daemon, write_kubeconfig};
use crate::k8s::checks::{admin_kubectl, prerequisites, wait_log};
use crate::{create_token, tunnel};

const SECRET: &str = "tunnel-cloud-tls";
const CONFIG_MAP: &str = "tunnel-ca.crt";

/// The API server with deploy/ applied, as a user installs it.
struct CaCluster {
    api: ApiServer,
    kubectl: PathBuf,
    cloud_kubeconfig: PathBuf,
    dir: tempfile::TempDir,
}

impl CaCluster {
    fn start() -> Option<Self> {
        let (assets, kubectls) = prerequisites(false)?;
        let kubectl = admin_kubectl(&kubectls).to_path_buf();
        let dir = tempfile::tempdir().expect("tempdir");
        let api = ApiServer::start(&assets, dir.path(), &ApiServerOpts::default());
        let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
        api.kubectl_ok(&kubectl, &["create", "namespace", "tunnel-system"]);
        api.kubectl_ok(&kubectl, &["apply", "-k", deploy.to_str().expect("utf-8")]);
        let token = create_token(&api, &kubectl, "tunnel-system", "tunnel-cloud", &[]);
        let cloud_kubeconfig = dir.path().join("tunnel-cloud.kubeconfig");
        write_kubeconfig(
            &cloud_kubeconfig,
            &api.url,
            &api.pki,
            Credential::Token(&token),
        );
        Some(Self {
            api,
            kubectl,
            cloud_kubeconfig,
            dir,
        })
    }

    /// A cloud as deploy/ configures its CA (config/cloud.toml's [csr]), the CA files
    /// in a directory of its own; its edge listener's address.
    fn cloud(&self, name: &'static str, listen: SocketAddr) -> Daemon {
        let dir = self.dir.path().join(name);
        std::fs::create_dir_all(dir.join("ca")).expect("dir");
        let config = dir.join("cloud.toml");
        write_toml(
            &config,
            &toml::toml! {
                [tunnel]
                listen = (listen.to_string())
                client_ca = "ca/ca.crt"

                [kubernetes]
                enabled = true

                [csr]
                ca_key = "ca/ca.key"
                ca_secret = SECRET
                ca_config_map = CONFIG_MAP
                serving = true
            },
        );
        let mut cmd = Command::new(common::BIN);
        cmd.args(["cloud", "--config"])
            .arg(&config)
            .env("KUBECONFIG", &self.cloud_kubeconfig)
            .env("POD_NAMESPACE", "tunnel-system");
        tunnel(name, &dir, cmd)
    }

    /// A data key of the CA's Secret (decoded) or ConfigMap, and the object's
    /// resourceVersion.
    fn read(&self, kind: &str, name: &str, key: &str) -> (Option<String>, String) {
        let out = self.api.kubectl_ok(
            &self.kubectl,
            &["-n", "tunnel-system", "get", kind, name, "-o", "json"],
        );
        let o: serde_json::Value = serde_json::from_str(&out).expect("json");
        let value = o["data"][key].as_str().map(|v| match kind {
            "secret" => {
                use base64::Engine as _;
                let bytes = base64::engine::general_purpose::STANDARD
                    .decode(v)
                    .expect("base64");
                String::from_utf8(bytes).expect("PEM")
            }
            _ => v.to_string(),
        });
        let version = o["metadata"]["resourceVersion"]
            .as_str()
            .expect("resourceVersion")
            .to_string();
        (value, version)
    }

    /// Fills the Secret with the CA in `ca_dir` (ca.crt, ca.key), as the operator's
    /// overlay does; its resourceVersion.
    fn bring_own_ca(&self, ca_dir: &Path) -> String {
        let yaml = self.api.kubectl_ok(
            &self.kubectl,
            &[
                "-n",
                "tunnel-system",
                "create",
                "secret",
                "generic",
                SECRET,
                &format!("--from-file={}", path_str(&ca_dir.join("ca.crt"))),
                &format!("--from-file={}", path_str(&ca_dir.join("ca.key"))),
                "--dry-run=client",
                "-o",
                "yaml",
            ],
        );
        self.api.apply(&self.kubectl, &yaml);
        self.read("secret", SECRET, "ca.crt").1
    }
}

/// Whether the certificate served at `addr` chains to the CA in `ca` and names
/// tunnel-cloud, as an edge checks it (openssl's verdict).
fn verifies_with(addr: SocketAddr, ca: &Path) -> Result<(), String> {
    let out = Command::new("openssl")
        .args(["s_client", "-connect", &addr.to_string()])
        .args([
            "-servername",
            "tunnel-cloud",
            "-verify_hostname",
            "tunnel-cloud",
        ])
        .arg("-CAfile")
        .arg(ca)
        .arg("-verify_return_error")
        .stdin(std::process::Stdio::null())
        .output()
        .expect("openssl");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    match text.contains("Verify return code: 0 (ok)") {
        true => Ok(()),
        false => Err(format!("{text}\n{}", String::from_utf8_lossy(&out.stderr))),
    }
}

/// Two replicas starting at once against deploy/'s empty Secret: one CA is made and
/// stored, both serve certificates chaining to it, and the ConfigMap holds it.
#[test]
fn ca_two_clouds_starting_at_once_make_one_ca_and_publish_it() {
    let Some(cluster) = CaCluster::start() else {
        return;
    };
    assert_eq!(
        cluster.read("secret", SECRET, "ca.crt").0,
        None,
        "deploy/ ships the CA's Secret empty"
    );
    // deploy/'s RBAC: the CA's two objects by name, nothing else of their kinds.
    let as_cloud = "--as=system:serviceaccount:tunnel-system:tunnel-cloud";
    for (verb, what, allowed) in [
        ("get", "secret/tunnel-cloud-tls", "yes"),
        ("update", "secret/tunnel-cloud-tls", "yes"),
        ("update", "configmap/tunnel-ca.crt", "yes"),
        ("watch", "configmap/tunnel-ca.crt", "yes"),
        ("watch", "configmap/another", "no"),
        ("get", "secret/another", "no"),
        ("update", "configmap/another", "no"),
        ("create", "secrets", "no"),
        ("create", "configmaps", "no"),
    ] {
        let out = cluster.api.kubectl(
            &cluster.kubectl,
            &["auth", "can-i", verb, what, "-n", "tunnel-system", as_cloud],
        );
        let said = String::from_utf8_lossy(&out.stdout).trim().to_string();
        assert_eq!(said, allowed, "tunnel-cloud may {verb} {what}");
    }
    let ports = common::reserve_ports::<2>();
    let [a_addr, b_addr] = ports.each_ref().map(|p| p.addr);
    drop(ports);
    // Both start before either has read the Secret.
    let a = cluster.cloud("tunnel-cloud-a", a_addr);
    let b = cluster.cloud("tunnel-cloud-b", b_addr);
    for cloud in [&a, &b] {
        wait_log(cloud, "tunnel cloud started", Duration::from_secs(30));
    }
    let (ca, _) = cluster.read("secret", SECRET, "ca.crt");
    let ca = ca.expect("the Secret holds a CA");
    let (key, _) = cluster.read("secret", SECRET, "ca.key");
    assert!(
        key.expect("the Secret holds its key")
            .contains("PRIVATE KEY")
    );
    let made = [&a, &b]
        .iter()
        .filter(|c| c.log_text().contains("made a new tunnel CA"))
        .count();
    let lost = [&a, &b]
        .iter()
        .filter(|c| {
            let log = c.log_text();
            log.contains("another replica stored a CA first")
                || log.contains("using the tunnel CA the Secret holds")
        })
        .count();
    let conflicts = [&a, &b]
        .iter()
        .filter(|c| c.log_text().contains("another replica stored a CA first"))
        .count();
    println!(
        "CA bootstrap: {made} replica made the CA, {lost} used the one stored first ({conflicts} after its own write was refused with 409)"
    );
    assert_eq!((made, lost), (1, 1), "one CA, made once");
    let (published, _) = cluster.read("configmap", CONFIG_MAP, "ca.crt");
    assert_eq!(
        published.as_deref(),
        Some(ca.as_str()),
        "the edges' ConfigMap holds it"
    );
    let ca_file = cluster.dir.path().join("published-ca.crt");
    std::fs::write(&ca_file, &ca).expect("write");
    for (cloud, addr) in [(&a, a_addr), (&b, b_addr)] {
        verifies_with(addr, &ca_file).unwrap_or_else(|e| {
            panic!(
                "{}'s certificate does not chain to the stored CA: {e}\n{}",
                cloud.name,
                cloud.log_tail(20)
            )
        });
        println!(
            "{}: serves a certificate for tunnel-cloud from the stored CA",
            cloud.name
        );
    }
}

/// Bring your own CA: a Secret the operator filled is used as it is, never written;
/// the cloud serves from that CA and publishes it.
#[test]
fn ca_a_filled_secret_is_used_untouched() {
    let Some(cluster) = CaCluster::start() else {
        return;
    };
    let own = cluster.dir.path().join("own");
    std::fs::create_dir(&own).expect("dir");
    let _pki = common::Pki::new(&own);
    let version = cluster.bring_own_ca(&own);
    let ports = common::reserve_ports::<1>();
    let addr = ports[0].addr;
    drop(ports);
    let cloud = cluster.cloud("tunnel-cloud", addr);
    wait_log(&cloud, "tunnel cloud started", Duration::from_secs(30));
    assert!(
        cloud
            .log_text()
            .contains("using the tunnel CA the Secret holds"),
        "{}",
        cloud.log_tail(20)
    );
    let own_ca = std::fs::read_to_string(own.join("ca.crt")).expect("ca.crt");
    let (ca, now) = cluster.read("secret", SECRET, "ca.crt");
    assert_eq!(ca.as_deref(), Some(own_ca.as_str()));
    assert_eq!(now, version, "the Secret was not written");
    let (published, _) = cluster.read("configmap", CONFIG_MAP, "ca.crt");
    assert_eq!(published.as_deref(), Some(own_ca.as_str()));
    verifies_with(addr, &own.join("ca.crt"))
        .unwrap_or_else(|e| panic!("not served from the operator's CA: {e}"));
    println!("bring your own CA: Secret resourceVersion {version} unchanged, served and published");
}

/// Someone who may update ConfigMaps in the namespace, and nothing else, appends a CA of
/// their own to the one the edges trust (the edges would trust it at their next
/// renewal): the cloud puts its CA back within seconds, with a warning naming the change.
#[test]
fn ca_a_ca_added_to_the_edges_config_map_is_put_back_with_a_warning() {
    let Some(cluster) = CaCluster::start() else {
        return;
    };
    let ports = common::reserve_ports::<1>();
    let addr = ports[0].addr;
    drop(ports);
    let cloud = cluster.cloud("tunnel-cloud", addr);
    wait_log(&cloud, "tunnel cloud started", Duration::from_secs(30));
    let (ca, _) = cluster.read("configmap", CONFIG_MAP, "ca.crt");
    let ca = ca.expect("the cloud published its CA");

    // The intruder: update on ConfigMaps in tunnel-system, nothing more.
    let admin = |args: &[&str]| cluster.api.kubectl_ok(&cluster.kubectl, args);
    admin(&[
        "-n",
        "tunnel-system",
        "create",
        "role",
        "configmap-editor",
        "--verb=get,update",
        "--resource=configmaps",
    ]);
    admin(&[
        "-n",
        "tunnel-system",
        "create",
        "rolebinding",
        "configmap-editor",
        "--role=configmap-editor",
        "--user=intruder",
    ]);
    let as_intruder = "--as=intruder";
    let can = |verb: &str, what: &str| {
        let out = cluster.api.kubectl(
            &cluster.kubectl,
            &[
                "auth",
                "can-i",
                verb,
                what,
                "-n",
                "tunnel-system",
                as_intruder,
            ],
        );
        String::from_utf8_lossy(&out.stdout).trim() == "yes"
    };
    assert!(can("update", "configmap/tunnel-ca.crt"));
    assert!(
        !can("get", "secret/tunnel-cloud-tls"),
        "the intruder holds no CA key"
    );

    let own = cluster.dir.path().join("intruder");
    std::fs::create_dir(&own).expect("dir");
    let _pki = common::Pki::new(&own);
    let theirs = std::fs::read_to_string(own.join("ca.crt")).expect("ca.crt");
    let both = cluster.dir.path().join("both.crt");
    std::fs::write(&both, format!("{ca}{theirs}")).expect("write");
    let yaml = admin(&[
        "-n",
        "tunnel-system",
        "create",
        "configmap",
        CONFIG_MAP,
        &format!("--from-file=ca.crt={}", path_str(&both)),
        "--dry-run=client",
        "-o",
        "yaml",
    ]);
    let out = cluster.api.kubectl_as(
        &cluster.kubectl,
        &cluster.api.admin_kubeconfig,
        &["replace", "-f", "-", as_intruder],
        Some(yaml.as_bytes()),
    );
    assert!(
        out.status.success(),
        "the intruder's update: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The update went in (the cloud may have put the CA back by the time it is read).
    let edited = std::time::Instant::now();

    // What an edge mounts, once the cloud has answered.
    let deadline = edited + Duration::from_secs(15);
    loop {
        let (now, _) = cluster.read("configmap", CONFIG_MAP, "ca.crt");
        if now.as_deref() == Some(ca.as_str()) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the ConfigMap still holds the intruder's CA after 15 s:\n{}",
            cloud.log_tail(20)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    println!(
        "the tunnel CA alone is back in {CONFIG_MAP} {:?} after the edit",
        edited.elapsed()
    );
    let log = cloud.log_text();
    let warning = log
        .lines()
        .find(|l| l.contains("the CA certificate the edges trust was changed"))
        .unwrap_or_else(|| panic!("no warning:\n{}", cloud.log_tail(20)));
    println!("the cloud said: {warning}");
    assert!(
        warning.contains("WARN")
            && warning.contains("ca.crt holds 2 certificate(s), the tunnel CA among them")
            && warning.contains("by=\"kubectl-replace\""),
        "{warning}"
    );
}
