//! The kustomize base in deploy/: it renders with `kubectl kustomize`, has the objects
//! the docs promise, every file a container is told to read is mounted from an object
//! that holds it, every config parses with the binary's own loader, and the pieces
//! agree with each other (ports, selectors, socket path, RBAC verbs).

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use tunnel_user::config::{CloudConfig, EdgeConfig};

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// kubectl, or `None` (outside CI) when it is not installed. In CI a missing kubectl
/// fails the test: the check must not silently stop running.
fn kubectl() -> Option<PathBuf> {
    let found = ["/usr/bin/kubectl", "/usr/local/bin/kubectl"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .or_else(|| {
            let out = Command::new("sh")
                .args(["-c", "command -v kubectl"])
                .output()
                .ok()?;
            let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
            (out.status.success() && !path.is_empty()).then(|| PathBuf::from(path))
        });
    if found.is_none() {
        if std::env::var_os("CI").is_some() {
            panic!(
                "kubectl is not installed: the deploy/ manifests cannot be rendered and checked (install kubectl, e.g. scripts/setup.sh)"
            );
        }
        eprintln!(
            "SKIPPED: kubectl is not installed, so deploy/ was not rendered (this fails under CI=1)"
        );
    }
    found
}

fn kustomize(kubectl: &Path, dir: &Path) -> Vec<Value> {
    let out = Command::new(kubectl)
        .arg("kustomize")
        .arg(dir)
        .output()
        .expect("run kubectl kustomize");
    assert!(
        out.status.success(),
        "kubectl kustomize {} failed:\n{}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("utf-8 output");
    serde_saphyr::from_multiple::<Value>(&text).expect("rendered YAML parses")
}

/// The rendered objects by (kind, name).
struct Rendered(Vec<Value>);

impl Rendered {
    fn kind_name(o: &Value) -> (String, String) {
        (
            o["kind"].as_str().unwrap_or_default().to_string(),
            o["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
        )
    }

    fn get(&self, kind: &str, name: &str) -> &Value {
        self.0
            .iter()
            .find(|o| Self::kind_name(o) == (kind.to_string(), name.to_string()))
            .unwrap_or_else(|| panic!("no {kind} {name} in the rendered manifests"))
    }

    /// A data key of a ConfigMap (as text) or a Secret (stringData or base64 data).
    fn file(&self, source: &Source, key: &str) -> Option<String> {
        let (kind, name) = match source {
            Source::ConfigMap(n) => ("ConfigMap", n),
            Source::Secret(n) => ("Secret", n),
            Source::HostPath(_) | Source::EmptyDir => return None,
            Source::ServiceAccountToken { path, audience } => {
                return (path == key).then(|| format!("<service account token for {audience}>"));
            }
        };
        let o = self.get(kind, name);
        if let Some(s) = o["data"][key].as_str() {
            if kind == "ConfigMap" {
                return Some(s.to_string());
            }
            use base64::Engine;
            // kustomize folds long values into lines.
            let compact: String = s.chars().filter(|c| !c.is_whitespace()).collect();
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(compact)
                .expect("secret data is base64");
            return Some(String::from_utf8_lossy(&bytes).to_string());
        }
        o["stringData"][key].as_str().map(str::to_string)
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Source {
    ConfigMap(String),
    Secret(String),
    HostPath(String),
    /// A directory of the pod's own.
    EmptyDir,
    /// A projected service account token at `path` in the volume.
    ServiceAccountToken {
        path: String,
        audience: String,
    },
}

/// mountPath -> where its files come from, for the first container of a DaemonSet.
fn mounts(ds: &Value) -> HashMap<String, Source> {
    let spec = &ds["spec"]["template"]["spec"];
    let volumes: HashMap<&str, Source> = spec["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .map(|v| {
            let name = v["name"].as_str().expect("volume name");
            let source = if let Some(n) = v["configMap"]["name"].as_str() {
                Source::ConfigMap(n.to_string())
            } else if let Some(n) = v["secret"]["secretName"].as_str() {
                Source::Secret(n.to_string())
            } else if let Some(p) = v["hostPath"]["path"].as_str() {
                Source::HostPath(p.to_string())
            } else if v.get("emptyDir").is_some() {
                Source::EmptyDir
            } else if let Some(t) = v["projected"]["sources"]
                .as_array()
                .and_then(|s| s.iter().find_map(|s| s.get("serviceAccountToken")))
            {
                let field = |f: &str| t[f].as_str().unwrap_or_default().to_string();
                Source::ServiceAccountToken {
                    path: field("path"),
                    audience: field("audience"),
                }
            } else {
                panic!("volume {name}: unexpected kind {v}")
            };
            (name, source)
        })
        .collect();
    spec["containers"][0]["volumeMounts"]
        .as_array()
        .expect("volumeMounts")
        .iter()
        .map(|m| {
            let name = m["name"].as_str().expect("mount name");
            let source = volumes
                .get(name)
                .unwrap_or_else(|| panic!("mount {name} has no volume"))
                .clone();
            (
                m["mountPath"].as_str().expect("mountPath").to_string(),
                source,
            )
        })
        .collect()
}

/// The content of `path` inside the container: the mount holding its directory must
/// come from an object with a key named like the file.
fn mounted_file(r: &Rendered, mounts: &HashMap<String, Source>, path: &Path) -> String {
    let dir = path
        .parent()
        .expect("dir")
        .to_str()
        .expect("utf-8")
        .to_string();
    let key = path
        .file_name()
        .expect("file name")
        .to_str()
        .expect("utf-8");
    let source = mounts
        .get(&dir)
        .unwrap_or_else(|| panic!("{}: nothing is mounted at {dir}", path.display()));
    r.file(source, key).unwrap_or_else(|| {
        panic!(
            "{}: {source:?} mounted at {dir} has no key {key}",
            path.display()
        )
    })
}

/// The `--config` argument of a DaemonSet's container.
fn config_arg(ds: &Value) -> PathBuf {
    let args: Vec<&str> = ds["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .expect("args")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let i = args
        .iter()
        .position(|a| *a == "--config")
        .expect("--config argument");
    PathBuf::from(args.get(i + 1).expect("--config value"))
}

fn service_account_of(ds: &Value) -> String {
    ds["spec"]["template"]["spec"]["serviceAccountName"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

fn probe_port(ds: &Value, probe: &str) -> u64 {
    ds["spec"]["template"]["spec"]["containers"][0][probe]["httpGet"]["port"]
        .as_u64()
        .unwrap_or_else(|| panic!("{probe} port"))
}

#[test]
fn the_base_renders_and_every_piece_fits() {
    let Some(kubectl) = kubectl() else { return };
    let r = Rendered(kustomize(&kubectl, &deploy_dir()));
    let tmp = tempfile::tempdir().expect("tempdir");
    the_objects_are_the_promised_ones(&r);
    every_container_runs_under_the_runtime_s_seccomp_filter(&r);
    let cloud = the_cloud_config_loads_with_its_files_mounted(&r, tmp.path());
    let socket = the_cloud_s_sockets_cgroup_and_pins_are_the_host_s(&r, &cloud);
    the_cloud_pod_rolls_over_without_a_gap(&r, "tunnel-cloud", &cloud);
    pods_land_on_the_node_s_own_address(&r, "tunnel-cloud", &cloud);
    the_services_lead_to_the_cloud_s_listeners(&r, &cloud);
    the_roles_grant_only_what_the_watchers_use(&r, &cloud);
    the_edge_fits_the_cloud(&r, &cloud, tmp.path());
    the_relay_fits_the_cloud(&r, &cloud, tmp.path());
    the_egress_selector_dials_the_cloud_s_socket(&socket);
}

/// The objects by kind and name, in the tunnel's namespace; generated ConfigMaps carry
/// a content hash.
fn the_objects_are_the_promised_ones(r: &Rendered) {
    let mut found: BTreeSet<(String, String)> = r.0.iter().map(Rendered::kind_name).collect();
    let config_maps: Vec<String> = found
        .iter()
        .filter(|(k, _)| k == "ConfigMap")
        .map(|(_, n)| n.clone())
        .collect();
    assert!(
        config_maps.iter().any(|n| n == "tunnel-ca.crt"),
        "{config_maps:?}"
    );
    for prefix in [
        "tunnel-cloud-config-",
        "tunnel-edge-config-",
        "tunnel-relay-config-",
    ] {
        assert!(
            config_maps.iter().any(|n| n.starts_with(prefix)),
            "no ConfigMap {prefix}*: {config_maps:?}"
        );
    }
    found.retain(|(k, _)| k != "ConfigMap");
    let want: BTreeSet<(String, String)> = [
        ("Namespace", "tunnel-system"),
        ("ServiceAccount", "tunnel-cloud"),
        ("ServiceAccount", "tunnel-edge"),
        ("ServiceAccount", "tunnel-relay"),
        ("ClusterRole", "tunnel-cloud"),
        ("ClusterRoleBinding", "tunnel-cloud"),
        ("ClusterRole", "tunnel-edge"),
        ("ClusterRoleBinding", "tunnel-edge"),
        ("ClusterRole", "tunnel-relay"),
        ("ClusterRoleBinding", "tunnel-relay"),
        ("Role", "tunnel-cloud-peers"),
        ("RoleBinding", "tunnel-cloud-peers"),
        ("Role", "tunnel-relay"),
        ("RoleBinding", "tunnel-relay"),
        ("Secret", "tunnel-cloud-tls"),
        ("Service", "tunnel-cloud"),
        ("Service", "tunnel-cloud-peers"),
        ("DaemonSet", "tunnel-cloud"),
        ("DaemonSet", "tunnel-edge"),
        ("DaemonSet", "tunnel-relay"),
    ]
    .iter()
    .map(|(k, n)| (k.to_string(), n.to_string()))
    .collect();
    assert_eq!(found, want);
    for o in &r.0 {
        let (kind, name) = Rendered::kind_name(o);
        if !matches!(
            kind.as_str(),
            "Namespace" | "ClusterRole" | "ClusterRoleBinding"
        ) {
            assert_eq!(
                o["metadata"]["namespace"].as_str(),
                Some("tunnel-system"),
                "{kind} {name}"
            );
        }
    }
}

/// Every container, init containers too, has the container runtime's default seccomp
/// filter, from its own securityContext or its pod's.
fn every_container_runs_under_the_runtime_s_seccomp_filter(r: &Rendered) {
    let mut checked = Vec::new();
    for o in &r.0 {
        let pod = &o["spec"]["template"]["spec"];
        if pod.is_null() {
            continue;
        }
        let pod_profile = &pod["securityContext"]["seccompProfile"]["type"];
        for list in ["initContainers", "containers"] {
            for c in pod[list].as_array().into_iter().flatten() {
                let own = &c["securityContext"]["seccompProfile"]["type"];
                let profile = if own.is_null() { pod_profile } else { own };
                let name = format!(
                    "{}/{}",
                    Rendered::kind_name(o).1,
                    c["name"].as_str().unwrap_or_default()
                );
                assert_eq!(
                    profile.as_str(),
                    Some("RuntimeDefault"),
                    "container {name}: seccompProfile"
                );
                checked.push(name);
            }
        }
    }
    // The cloud's and the relay's init containers and the three daemons.
    assert_eq!(checked.len(), 5, "{checked:?}");
}

/// The cloud's config comes from the mounted ConfigMap and parses; every file it names
/// is mounted, but the CA's, which the cloud writes from its Secret into a volume of
/// the pod's own, in memory. Nothing is to be filled in by hand: the CA's Secret and
/// ConfigMap ship empty, for the cloud to fill.
fn the_cloud_config_loads_with_its_files_mounted(r: &Rendered, tmp: &Path) -> CloudConfig {
    let cloud_ds = r.get("DaemonSet", "tunnel-cloud");
    let cloud_mounts = mounts(cloud_ds);
    let cloud_path = config_arg(cloud_ds);
    let text = mounted_file(r, &cloud_mounts, &cloud_path);
    let local = tmp.join("cloud.toml");
    std::fs::write(&local, text).expect("write");
    let cloud = CloudConfig::load(&local)
        .unwrap_or_else(|e| panic!("the cloud's config does not load: {e}"));
    let t = &cloud.tunnel;
    for file in [t.cert.as_ref(), t.key.as_ref(), t.token_file.as_ref()]
        .into_iter()
        .flatten()
    {
        mounted_file(r, &cloud_mounts, file);
    }
    let c = &cloud.csr;
    assert!(c.serving, "each replica issues its own serving certificate");
    let secret = c.ca_secret.as_deref().expect("the CA is kept in a Secret");
    for file in [t.client_ca.as_ref(), c.ca_key.as_ref()] {
        let file = file.expect("the CA's files");
        let dir = file.parent().and_then(Path::to_str).expect("dir");
        assert_eq!(
            cloud_mounts.get(dir),
            Some(&Source::EmptyDir),
            "{}",
            file.display()
        );
    }
    let pod = &cloud_ds["spec"]["template"]["spec"];
    let ca_dir = t
        .client_ca
        .as_ref()
        .and_then(|f| f.parent())
        .and_then(Path::to_str);
    let mount = pod["containers"][0]["volumeMounts"]
        .as_array()
        .expect("mounts")
        .iter()
        .find(|m| m["mountPath"].as_str() == ca_dir)
        .expect("the CA's mount");
    let volume = pod["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .find(|v| v["name"] == mount["name"])
        .expect("the CA's volume");
    assert_eq!(
        volume["emptyDir"]["medium"], "Memory",
        "the CA's key stays off disk"
    );
    let config_map = c.ca_config_map.as_deref().expect("the CA is published");
    for (kind, name) in [("Secret", secret), ("ConfigMap", config_map)] {
        let o = r.get(kind, name);
        assert!(
            o["data"].is_null() && o["stringData"].is_null(),
            "{kind} {name} ships empty, for the cloud to fill: {o}"
        );
    }
    cloud
}

/// The CONNECT socket's directory is the host's; the redirect attaches through the
/// host's cgroup hierarchy, mounted at a path of its own, and pins in the host's bpffs.
/// Returns the CONNECT socket's path.
fn the_cloud_s_sockets_cgroup_and_pins_are_the_host_s(
    r: &Rendered,
    cloud: &CloudConfig,
) -> PathBuf {
    let cloud_mounts = mounts(r.get("DaemonSet", "tunnel-cloud"));
    let socket = cloud
        .connect
        .unix
        .as_ref()
        .expect("the cloud serves HTTP CONNECT on a unix socket");
    let socket_dir = socket
        .parent()
        .expect("dir")
        .to_str()
        .expect("utf-8")
        .to_string();
    assert!(
        matches!(cloud_mounts.get(&socket_dir), Some(Source::HostPath(p)) if *p == socket_dir),
        "the socket's directory is the host's"
    );
    the_redirect_attaches_and_pins_on_the_host(&cloud_mounts, cloud);
    socket.clone()
}

/// The redirect attaches through the host's cgroup hierarchy, mounted at a path of its
/// own, and pins in the host's bpffs.
fn the_redirect_attaches_and_pins_on_the_host(
    cloud_mounts: &HashMap<String, Source>,
    cloud: &CloudConfig,
) {
    // The host's hierarchy at a path of its own, named by the config; the container's
    // own /sys/fs/cgroup (its cgroup namespace) left alone.
    let attach = cloud
        .redirect
        .cgroup
        .as_ref()
        .expect("the redirect names the host's cgroup hierarchy")
        .to_str()
        .expect("utf-8")
        .to_string();
    assert!(
        matches!(cloud_mounts.get(&attach), Some(Source::HostPath(p)) if p == "/sys/fs/cgroup"),
        "redirect.cgroup is the host's /sys/fs/cgroup"
    );
    assert!(
        !cloud_mounts.contains_key("/sys/fs/cgroup"),
        "nothing is mounted over the container's own /sys/fs/cgroup"
    );
    let pin_dir = cloud.redirect.pin_dir.as_ref().expect("redirect.pin_dir");
    assert!(
        matches!(cloud_mounts.get("/sys/fs/bpf"), Some(Source::HostPath(p)) if p == "/sys/fs/bpf")
            && pin_dir.starts_with("/sys/fs/bpf"),
        "the pins live in the host's bpffs"
    );
}

/// Pods in a network namespace of their own are redirected too, on every node with one
/// config: to the node's own address (`redirect.pod_port`), which the DaemonSet `ds`
/// gives its process from the downward API.
fn pods_land_on_the_node_s_own_address(r: &Rendered, ds: &str, config: &CloudConfig) {
    assert!(
        config.redirect.pod_port.is_some(),
        "{ds}: redirect.pod_port"
    );
    let env = &r.get("DaemonSet", ds)["spec"]["template"]["spec"]["containers"][0]["env"];
    let node_ips = env
        .as_array()
        .expect("env")
        .iter()
        .find(|e| e["name"] == tunnel_user::addr::NODE_IPS)
        .map(|e| e["valueFrom"]["fieldRef"]["fieldPath"].clone());
    assert_eq!(
        node_ips,
        Some(Value::from("status.hostIP")),
        "{ds}'s NODE_IPS"
    );
}

/// Probes on the admin port, the host network, and a rolling update in which the new
/// pod takes the old one's listeners over the handover socket before the old one goes;
/// the capabilities the start needs. For the DaemonSet `ds` running `cloud` (the
/// cloud's, or the relay's).
fn the_cloud_pod_rolls_over_without_a_gap(r: &Rendered, ds: &str, cloud: &CloudConfig) {
    let cloud_ds = r.get("DaemonSet", ds);
    let cloud_mounts = mounts(cloud_ds);
    let admin = cloud
        .admin
        .listen
        .expect("the cloud has an admin listener")
        .port() as u64;
    assert_eq!(
        (
            probe_port(cloud_ds, "livenessProbe"),
            probe_port(cloud_ds, "readinessProbe")
        ),
        (admin, admin)
    );
    let pod = &cloud_ds["spec"]["template"]["spec"];
    assert_eq!(pod["hostNetwork"], Value::Bool(true));
    // Rolling update: the new pod beside the old one, which hands its listeners over
    // the handover socket, in the host directory both pods mount.
    let rolling = &cloud_ds["spec"]["updateStrategy"];
    assert_eq!(rolling["type"].as_str(), Some("RollingUpdate"));
    assert_eq!(
        (
            rolling["rollingUpdate"]["maxSurge"].as_u64(),
            rolling["rollingUpdate"]["maxUnavailable"].as_u64()
        ),
        (Some(1), Some(0)),
        "surge, never a master without a cloud"
    );
    assert!(
        cloud_ds["spec"]["minReadySeconds"].is_null(),
        "with maxSurge, minReadySeconds can hang the update (the controller does not look again)"
    );
    assert!(
        pod["containers"][0]["readinessProbe"]["initialDelaySeconds"]
            .as_u64()
            .is_some_and(|s| s >= 5),
        "the old pod is deleted only after the new process had time to take the listeners"
    );
    let drain = cloud.tunnel.drain_timeout.as_secs();
    assert!(
        pod["terminationGracePeriodSeconds"]
            .as_u64()
            .is_some_and(|s| s > drain),
        "the kubelet's SIGKILL must not cut the drain ({drain} s) short"
    );
    let init = &pod["initContainers"][0];
    assert_eq!(init["command"][1].as_str(), Some("mount-bpffs"));
    assert_eq!(
        init["volumeMounts"][0]["mountPropagation"].as_str(),
        Some("Bidirectional"),
        "the bpffs the init container mounts must be the host's, to outlive the pod"
    );
    assert!(
        pod["containers"]
            .as_array()
            .expect("containers")
            .iter()
            .all(|c| c["ports"].is_null()),
        "a declared port becomes a hostPort on the host network and blocks the surge pod"
    );
    let handover = cloud
        .handover
        .socket
        .as_ref()
        .expect("the cloud hands its listeners to the next pod (handover.socket)");
    assert_ne!(Some(handover), cloud.connect.unix.as_ref());
    let handover_dir = handover.parent().expect("dir").to_str().expect("utf-8");
    assert!(
        matches!(cloud_mounts.get(handover_dir), Some(Source::HostPath(p)) if p == handover_dir),
        "the handover socket's directory is the host's, shared by the old and the new pod"
    );
    let caps: Vec<&str> = pod["containers"][0]["securityContext"]["capabilities"]["add"]
        .as_array()
        .expect("caps")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(
        caps,
        [
            "BPF",
            "NET_ADMIN",
            "SYS_ADMIN",
            "NET_BIND_SERVICE",
            "SETPCAP"
        ]
    );
    assert!(
        pod["containers"][0]["resources"]["limits"]["memory"].is_string()
            && pod["containers"][0]["resources"]["requests"]["cpu"].is_string()
    );
}

/// The edges' Service leads to the tunnel listener, the headless peer Service to the
/// peer listener.
fn the_services_lead_to_the_cloud_s_listeners(r: &Rendered, cloud: &CloudConfig) {
    let t = &cloud.tunnel;
    let edges_svc = r.get("Service", "tunnel-cloud");
    assert_eq!(edges_svc["spec"]["type"].as_str(), Some("NodePort"));
    assert_eq!(
        edges_svc["spec"]["ports"][0]["targetPort"].as_u64(),
        t.listen.map(|l| u64::from(l.port()))
    );
    assert!(cloud.kubernetes.enabled);
    let peers_svc = r.get(
        "Service",
        cloud
            .kubernetes
            .peer_service
            .as_deref()
            .expect("peer_service"),
    );
    assert_eq!(
        peers_svc["spec"]["clusterIP"].as_str(),
        Some("None"),
        "the peer Service is headless"
    );
    assert_eq!(
        peers_svc["spec"]["ports"][0]["name"].as_str(),
        Some("peers")
    );
    assert_eq!(
        peers_svc["spec"]["ports"][0]["targetPort"].as_u64(),
        cloud.peers.listen.map(|l| l.port() as u64)
    );
}

/// A role's rules as (API group, resource, verbs), one per resource.
fn rules(r: &Rendered, kind: &str, name: &str) -> Vec<(String, String, Vec<String>)> {
    r.get(kind, name)["rules"]
        .as_array()
        .expect("rules")
        .iter()
        .flat_map(|rule| {
            let verbs: Vec<String> = rule["verbs"]
                .as_array()
                .expect("verbs")
                .iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect();
            let group = rule["apiGroups"][0]
                .as_str()
                .unwrap_or_default()
                .to_string();
            rule["resources"]
                .as_array()
                .expect("resources")
                .iter()
                .map(move |res| {
                    (
                        group.clone(),
                        res.as_str().unwrap_or_default().to_string(),
                        verbs.clone(),
                    )
                })
        })
        .collect()
}

/// RBAC: only what the watchers use, signing only for the cloud's own signer name.
fn the_roles_grant_only_what_the_watchers_use(r: &Rendered, cloud: &CloudConfig) {
    let watch = vec!["list".to_string(), "watch".to_string()];
    let create = vec!["create".to_string()];
    let update = vec!["update".to_string()];
    let get_update = vec!["get".to_string(), "update".to_string()];
    let csrs = "certificates.k8s.io".to_string();
    assert_eq!(
        rules(r, "ClusterRole", "tunnel-cloud"),
        [
            (String::new(), "nodes".to_string(), watch.clone()),
            // Read once at start: a Service's address is never an edge's.
            (
                "networking.k8s.io".to_string(),
                "servicecidrs".to_string(),
                vec!["list".to_string()]
            ),
            (
                "authentication.k8s.io".to_string(),
                "tokenreviews".to_string(),
                create
            ),
            (
                csrs.clone(),
                "certificatesigningrequests".to_string(),
                watch.clone()
            ),
            (
                csrs.clone(),
                "certificatesigningrequests/approval".to_string(),
                update.clone()
            ),
            (
                csrs.clone(),
                "certificatesigningrequests/status".to_string(),
                update
            ),
            (
                csrs.clone(),
                "signers".to_string(),
                vec!["approve".to_string(), "sign".to_string()]
            ),
        ]
    );
    // Approving and signing only for the cloud's own signer name.
    let signers = r.get("ClusterRole", "tunnel-cloud")["rules"]
        .as_array()
        .expect("rules")
        .iter()
        .find(|rule| rule["resources"][0] == "signers")
        .expect("a signers rule")
        .clone();
    assert!(cloud.csr.enabled, "the cloud signs the edges' CSRs");
    assert_eq!(
        signers["resourceNames"],
        serde_json::json!([cloud.csr.signer_name])
    );
    assert!(
        cloud.kubernetes.token_review,
        "edges may authenticate with their service account token"
    );
    assert_eq!(
        rules(r, "Role", "tunnel-cloud-peers"),
        [
            (
                "discovery.k8s.io".to_string(),
                "endpointslices".to_string(),
                watch.clone()
            ),
            (
                "apps".to_string(),
                "daemonsets".to_string(),
                vec!["get".to_string()]
            ),
            (String::new(), "pods".to_string(), vec!["get".to_string()]),
            (String::new(), "secrets".to_string(), get_update.clone()),
            // Watched too (by name), so that a change is put back.
            (
                String::new(),
                "configmaps".to_string(),
                ["get", "update", "list", "watch"]
                    .map(String::from)
                    .to_vec()
            ),
        ]
    );
    // The CA's Secret and ConfigMap, by name only: the cloud reads and fills those two
    // and creates none (RBAC could not narrow `create` by name).
    let peers_role = &r.get("Role", "tunnel-cloud-peers")["rules"];
    for (resource, name) in [
        ("secrets", cloud.csr.ca_secret.as_deref()),
        ("configmaps", cloud.csr.ca_config_map.as_deref()),
    ] {
        let rule = peers_role
            .as_array()
            .expect("rules")
            .iter()
            .find(|rule| rule["resources"][0] == resource)
            .expect("a rule");
        assert_eq!(
            rule["resourceNames"],
            serde_json::json!([name.expect("named")]),
            "{resource}"
        );
    }
    let mut edge_csr = vec!["create".to_string(), "get".to_string()];
    edge_csr.extend(watch);
    assert_eq!(
        rules(r, "ClusterRole", "tunnel-edge"),
        [(csrs, "certificatesigningrequests".to_string(), edge_csr)]
    );
    assert_eq!(
        cloud.redirect.uninstall_with_daemonset.as_deref(),
        Some("tunnel-cloud"),
        "deleting the DaemonSet uninstalls the redirect"
    );
}

/// The edge's config parses with its files mounted, its certificate comes by CSR from
/// the cloud's signer, its service account is the one the cloud accepts, and its node
/// name and the node's address (what `[allow]` permits beside loopback) come from the
/// downward API.
fn the_edge_fits_the_cloud(r: &Rendered, cloud: &CloudConfig, tmp: &Path) {
    let edge_ds = r.get("DaemonSet", "tunnel-edge");
    let edge_mounts = mounts(edge_ds);
    let text = mounted_file(r, &edge_mounts, &config_arg(edge_ds));
    let local = tmp.join("edge.toml");
    std::fs::write(&local, text).expect("write");
    let edge = EdgeConfig::load(&local, Some("edge-node-1".into()))
        .unwrap_or_else(|e| panic!("the edge's config does not load: {e}"));
    let c = &edge.cloud;
    for file in [c.token_file.as_ref(), c.cert.as_ref(), c.key.as_ref()]
        .into_iter()
        .flatten()
    {
        mounted_file(r, &edge_mounts, file);
    }
    // The CA it trusts is the one the cloud publishes, which it waits for.
    let ca_dir = c.ca.parent().and_then(Path::to_str).expect("dir");
    assert_eq!(
        edge_mounts.get(ca_dir),
        cloud
            .csr
            .ca_config_map
            .clone()
            .map(Source::ConfigMap)
            .as_ref(),
        "{}: the cloud's published CA",
        c.ca.display()
    );
    assert_eq!(c.ca.file_name().and_then(|n| n.to_str()), Some("ca.crt"));
    assert!(
        c.wait_for_ca,
        "the edge waits for the cloud to publish its CA"
    );
    // The edge's certificate comes from a CSR the cloud signs, kept in a directory of
    // the pod's own.
    assert!(edge.csr.enabled, "the edge gets its certificate by CSR");
    assert_eq!(edge.csr.signer_name, cloud.csr.signer_name);
    let csr_mount = edge_mounts
        .iter()
        .filter(|(at, _)| edge.csr_dir().starts_with(at))
        .max_by_key(|(at, _)| at.len())
        .map(|(_, source)| source);
    assert_eq!(
        csr_mount,
        Some(&Source::EmptyDir),
        "the key and certificate stay on the node: {} lies in an emptyDir",
        edge.csr_dir().display()
    );
    let sa = format!(
        "{}:{}",
        r.get("ServiceAccount", "tunnel-edge")["metadata"]["namespace"]
            .as_str()
            .unwrap_or_default(),
        service_account_of(edge_ds)
    );
    assert_eq!(
        sa, cloud.kubernetes.edge_service_account,
        "the cloud accepts the edge DaemonSet's service account"
    );
    let epod = &edge_ds["spec"]["template"]["spec"];
    let env = &epod["containers"][0]["env"];
    let field = |name: &str| {
        env.as_array()
            .expect("env")
            .iter()
            .find(|e| e["name"] == name)
            .unwrap_or_else(|| panic!("no {name} env"))["valueFrom"]["fieldRef"]["fieldPath"]
            .as_str()
            .map(str::to_string)
    };
    assert_eq!(field("NODE_NAME").as_deref(), Some("spec.nodeName"));
    assert_eq!(
        field(tunnel_user::addr::NODE_IPS).as_deref(),
        Some("status.hostIP")
    );
    assert!(
        edge.allow.node_addresses.is_empty(),
        "NODE_IPS counts only when allow.node_addresses lists none"
    );
    assert!(
        epod["nodeSelector"]
            .get(&cloud.kubernetes.edge_selector)
            .is_some(),
        "the edge DaemonSet runs on the nodes the cloud treats as edges"
    );
    let admin = edge
        .admin
        .listen
        .expect("the edge has an admin listener")
        .port() as u64;
    assert_eq!(probe_port(edge_ds, "livenessProbe"), admin);
    // Two edge pods share the admin port in a rolling update (maxSurge): the readiness
    // of each is its own --registered-file, in its own emptyDir.
    let container = &epod["containers"][0];
    let args: Vec<&str> = container["args"]
        .as_array()
        .expect("args")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let file = args
        .iter()
        .position(|a| *a == "--registered-file")
        .and_then(|i| args.get(i + 1))
        .expect("--registered-file");
    assert_eq!(
        container["readinessProbe"]["exec"]["command"],
        serde_json::json!(["tunnel", "registered", file])
    );
    assert!(
        file.starts_with("/var/lib/tunnel-edge/"),
        "{file} is not in the pod's emptyDir"
    );
    assert_eq!(
        edge_ds["spec"]["updateStrategy"]["rollingUpdate"],
        serde_json::json!({"maxSurge": 1, "maxUnavailable": 0})
    );
    // The pod's own service account token files its CSR.
    assert_ne!(
        r.get("ServiceAccount", "tunnel-edge")["automountServiceAccountToken"],
        Value::Bool(false)
    );
    assert_ne!(epod["automountServiceAccountToken"], Value::Bool(false));
}

/// The relay's config parses with its files mounted; it runs as a relay with its
/// certificate by CSR from the cloud's signer under the service account the cloud
/// accepts for relays, on every node that is neither the cloud's nor an edge; it finds
/// the replicas and the edges as the cloud does, rolls over and uninstalls as the
/// cloud does, and its roles grant only what it uses.
fn the_relay_fits_the_cloud(r: &Rendered, cloud: &CloudConfig, tmp: &Path) {
    let relay_ds = r.get("DaemonSet", "tunnel-relay");
    let relay_mounts = mounts(relay_ds);
    let text = mounted_file(r, &relay_mounts, &config_arg(relay_ds));
    let local = tmp.join("relay.toml");
    std::fs::write(&local, text).expect("write");
    let relay = CloudConfig::load(&local)
        .unwrap_or_else(|e| panic!("the relay's config does not load: {e}"));
    assert_eq!(relay.role, tunnel_user::config::Role::Relay);
    // Its certificate by CSR, from the cloud's signer, kept in the pod's own directory.
    let csr = &relay.relay.csr;
    assert!(csr.enabled, "the relay gets its certificate by CSR");
    assert!(relay.tunnel.cert.is_none() && relay.tunnel.key.is_none());
    assert_eq!(csr.signer_name, cloud.csr.signer_name);
    let dir = relay.relay_csr_dir();
    let csr_mount = relay_mounts
        .iter()
        .filter(|(at, _)| dir.starts_with(at))
        .max_by_key(|(at, _)| at.len())
        .map(|(_, source)| source);
    assert_eq!(csr_mount, Some(&Source::EmptyDir), "{}", dir.display());
    let sa = format!(
        "{}:{}",
        r.get("ServiceAccount", "tunnel-relay")["metadata"]["namespace"]
            .as_str()
            .unwrap_or_default(),
        service_account_of(relay_ds)
    );
    assert_eq!(
        sa, cloud.kubernetes.relay_service_account,
        "the cloud signs relay certificates for the relay DaemonSet's service account"
    );
    assert_ne!(sa, cloud.kubernetes.edge_service_account);
    let pod = &relay_ds["spec"]["template"]["spec"];
    let node_name = pod["containers"][0]["env"]
        .as_array()
        .expect("env")
        .iter()
        .find(|e| e["name"] == "NODE_NAME")
        .map(|e| e["valueFrom"]["fieldRef"]["fieldPath"].clone());
    assert_eq!(node_name, Some(Value::from("spec.nodeName")));
    // The replicas' CA is the one the cloud publishes; the replicas are found where
    // the cloud's replicas find each other; the edges are the cloud's.
    let ca = relay.peers.ca.as_ref().expect("peers.ca");
    let ca_dir = ca.parent().and_then(Path::to_str).expect("dir");
    assert_eq!(
        relay_mounts.get(ca_dir),
        cloud
            .csr
            .ca_config_map
            .clone()
            .map(Source::ConfigMap)
            .as_ref()
    );
    assert!(
        relay.relay.wait_for_ca,
        "the relay waits for the cloud to publish its CA"
    );
    assert!(relay.kubernetes.enabled);
    assert_eq!(relay.kubernetes.peer_service, cloud.kubernetes.peer_service);
    assert_eq!(
        relay.kubernetes.edge_selector,
        cloud.kubernetes.edge_selector
    );
    // Every node but the cloud's and the edges'.
    let cloud_pod = &r.get("DaemonSet", "tunnel-cloud")["spec"]["template"]["spec"];
    let edge_pod = &r.get("DaemonSet", "tunnel-edge")["spec"]["template"]["spec"];
    let selected_by = |pod: &Value| -> Vec<String> {
        pod["nodeSelector"]
            .as_object()
            .expect("nodeSelector")
            .keys()
            .cloned()
            .collect()
    };
    let mut others = selected_by(cloud_pod);
    others.extend(selected_by(edge_pod));
    assert!(others.contains(&cloud.kubernetes.edge_selector));
    let terms = &pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        ["nodeSelectorTerms"];
    let expressions = terms[0]["matchExpressions"].as_array().expect("one term");
    assert_eq!(
        terms.as_array().map(Vec::len),
        Some(1),
        "one term: all must hold"
    );
    let excluded: Vec<String> = expressions
        .iter()
        .filter(|e| e["operator"] == "DoesNotExist")
        .filter_map(|e| e["key"].as_str().map(str::to_string))
        .collect();
    assert_eq!(excluded, others, "neither a master nor an edge");
    assert!(pod["nodeSelector"].is_null());
    // Its redirect attaches and pins on the host, rolls over and uninstalls as the
    // cloud's does.
    the_redirect_attaches_and_pins_on_the_host(&relay_mounts, &relay);
    the_cloud_pod_rolls_over_without_a_gap(r, "tunnel-relay", &relay);
    pods_land_on_the_node_s_own_address(r, "tunnel-relay", &relay);
    assert_eq!(
        relay.redirect.uninstall_with_daemonset.as_deref(),
        Some("tunnel-relay"),
        "deleting the DaemonSet uninstalls the relay's redirect"
    );
    assert_ne!(relay.redirect.pin_dir, cloud.redirect.pin_dir);
    // Scraped as the replicas are (deploy/monitoring/targets.sh: one port for both).
    assert_eq!(relay.admin.listen, cloud.admin.listen);
    let watch = vec!["list".to_string(), "watch".to_string()];
    assert_eq!(
        rules(r, "ClusterRole", "tunnel-relay"),
        [
            (String::new(), "nodes".to_string(), watch.clone()),
            (
                "networking.k8s.io".to_string(),
                "servicecidrs".to_string(),
                vec!["list".to_string()]
            ),
            (
                "certificates.k8s.io".to_string(),
                "certificatesigningrequests".to_string(),
                ["create", "get", "list", "watch"]
                    .map(String::from)
                    .to_vec()
            ),
        ]
    );
    assert_eq!(
        rules(r, "Role", "tunnel-relay"),
        [
            (
                "discovery.k8s.io".to_string(),
                "endpointslices".to_string(),
                watch
            ),
            (
                "apps".to_string(),
                "daemonsets".to_string(),
                vec!["get".to_string()]
            ),
        ]
    );
    let daemonsets = r.get("Role", "tunnel-relay")["rules"][1]["resourceNames"].clone();
    assert_eq!(daemonsets, serde_json::json!(["tunnel-relay"]));
}

/// The egress selector example dials the socket the cloud serves.
fn the_egress_selector_dials_the_cloud_s_socket(socket: &Path) {
    let egress = std::fs::read_to_string(deploy_dir().join("examples/egress-selector.yaml"))
        .expect("egress example");
    let egress: Value = serde_saphyr::from_str(&egress).expect("egress example parses");
    assert_eq!(egress["kind"].as_str(), Some("EgressSelectorConfiguration"));
    let connection = &egress["egressSelections"][0]["connection"];
    assert_eq!(connection["proxyProtocol"].as_str(), Some("HTTPConnect"));
    assert_eq!(
        connection["transport"]["uds"]["udsName"].as_str(),
        socket.to_str()
    );
}

#[test]
fn every_config_in_deploy_parses() {
    let mut loaded = Vec::new();
    let mut dirs = vec![deploy_dir()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read deploy/") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "toml") {
                continue;
            }
            let name = path
                .file_name()
                .expect("name")
                .to_string_lossy()
                .to_string();
            if name.contains("cloud") || name.contains("relay") {
                CloudConfig::load(&path).unwrap_or_else(|e| panic!("{e}"));
            } else if name.contains("edge") {
                EdgeConfig::load(&path, Some("edge-node-1".into()))
                    .unwrap_or_else(|e| panic!("{e}"));
            } else {
                panic!(
                    "{}: neither a cloud nor an edge config; name it so this test loads it",
                    path.display()
                );
            }
            loaded.push(name);
        }
    }
    loaded.sort();
    assert_eq!(loaded, ["cloud.toml", "edge.toml", "relay.toml"]);
}

/// Bring your own CA, deploy/README.md's way: an overlay whose secretGenerator fills
/// the CA's Secret with `tunnel certs` output, under the name the cloud's config reads
/// (no hash suffix: the config names it, as does the Role's resourceNames).
#[test]
fn an_overlay_brings_its_own_ca() {
    let Some(kubectl) = kubectl() else { return };
    let tmp = tempfile::tempdir().expect("tempdir");
    let overlay = tmp.path();
    tunnel_user::certs::generate(&tunnel_user::certs::CertsArgs::new(overlay.join("certs")))
        .expect("tunnel certs");
    // kustomize wants the base as a relative path.
    let base = std::fs::canonicalize(deploy_dir()).expect("deploy/");
    let up = std::fs::canonicalize(overlay)
        .expect("overlay")
        .components()
        .count()
        - 1;
    let base = format!(
        "{}{}",
        "../".repeat(up),
        base.display().to_string().trim_start_matches('/')
    );
    let kustomization = format!(
        r#"
resources:
  - {base}
secretGenerator:
  - name: tunnel-cloud-tls
    behavior: replace
    files: [certs/ca.crt, certs/ca.key]
    options:
      disableNameSuffixHash: true
"#,
    );
    std::fs::write(overlay.join("kustomization.yaml"), kustomization).expect("kustomization");
    let r = Rendered(kustomize(&kubectl, overlay));
    let cloud_ds = r.get("DaemonSet", "tunnel-cloud");
    let text = mounted_file(&r, &mounts(cloud_ds), &config_arg(cloud_ds));
    let local = tmp.path().join("cloud.toml");
    std::fs::write(&local, text).expect("write");
    let cloud = CloudConfig::load(&local).expect("cloud config");
    let secret = Source::Secret(cloud.csr.ca_secret.clone().expect("ca_secret"));
    for key in ["ca.crt", "ca.key"] {
        let want = std::fs::read_to_string(overlay.join("certs").join(key)).expect("file");
        assert_eq!(
            r.file(&secret, key).as_deref(),
            Some(want.as_str()),
            "{key}"
        );
    }
}

/// deploy/monitoring/, its own kustomize base: Prometheus runs as nobody on a read-only
/// root, reads the config and rules of its generated ConfigMap at the paths it is
/// told, the file_sd lists from the ConfigMap targets.sh writes (every list the config
/// names is one targets.sh writes), scrapes the replicas at deploy/'s admin port, and
/// its role grants the kubelets' metrics only.
#[test]
fn the_monitoring_base_renders_and_every_piece_fits() {
    let Some(kubectl) = kubectl() else { return };
    let dir = deploy_dir().join("monitoring");
    let r = Rendered(kustomize(&kubectl, &dir));
    let prometheus = r.get("Deployment", "prometheus");
    assert_eq!(prometheus["metadata"]["namespace"], "tunnel-monitoring");
    let pod = &prometheus["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(container["securityContext"]["readOnlyRootFilesystem"], true);
    let image = container["image"].as_str().expect("image");
    assert!(image.starts_with("tunnel-prometheus:"), "{image}");
    let args: Vec<&str> = container["args"]
        .as_array()
        .expect("args")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let arg = |flag: &str| {
        args.iter()
            .find_map(|a| a.strip_prefix(flag))
            .unwrap_or_else(|| panic!("no {flag} in {args:?}"))
    };
    let mounts = mounts(prometheus);
    let config = mounted_file(&r, &mounts, Path::new(arg("--config.file=")));
    assert_eq!(
        mounts.get(arg("--storage.tsdb.path=")),
        Some(&Source::EmptyDir),
        "{mounts:?}"
    );
    // Every file the config reads: the rules from the generated ConfigMap; the file_sd
    // lists from prometheus-targets, which targets.sh creates (so it is not rendered)
    // with a file of each name.
    let targets_sh = std::fs::read_to_string(dir.join("targets.sh")).expect("targets.sh");
    for line in config.lines().map(str::trim) {
        if let Some(rules) = line.strip_prefix("- /etc/prometheus/rules") {
            mounted_file(
                &r,
                &mounts,
                Path::new(&format!("/etc/prometheus/rules{rules}")),
            );
        }
        if let Some(list) = line.strip_prefix("- files: [/etc/prometheus/targets/") {
            let file = list.trim_end_matches(']');
            assert!(
                targets_sh.contains(&format!("\"$dir/{file}\"")),
                "targets.sh writes no {file}"
            );
        }
    }
    assert_eq!(
        mounts.get("/etc/prometheus/targets"),
        Some(&Source::ConfigMap("prometheus-targets".into()))
    );
    assert!(targets_sh.contains("create configmap prometheus-targets"));
    // The replicas' admin port, where the cloud config binds it beyond loopback.
    let cloud = CloudConfig::load(&deploy_dir().join("config/cloud.toml")).expect("cloud.toml");
    let admin = cloud.admin.listen.expect("deploy/ sets admin.listen");
    assert!(
        admin.ip().is_unspecified(),
        "{admin}: not reachable from another node"
    );
    assert!(
        targets_sh.contains(&format!("ADMIN_PORT:-{}", admin.port())),
        "targets.sh lists the replicas on another port than {admin}"
    );
    let role = r.get("ClusterRole", "tunnel-prometheus");
    assert_eq!(
        role["rules"],
        serde_json::json!([{"apiGroups": [""], "resources": ["nodes/metrics"], "verbs": ["get"]}])
    );
    let binding = r.get("ClusterRoleBinding", "tunnel-prometheus");
    assert_eq!(binding["subjects"][0]["name"], pod["serviceAccountName"]);
}
