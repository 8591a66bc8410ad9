//! The DaemonSets of deploy/ on a real node, as a user installs them: a real control
//! plane (kube-apiserver, kube-controller-manager, kube-scheduler), containerd and a
//! kubelet for a master node run the image `cargo xtask image` built, applied with
//! `kubectl apply -k` of an overlay that changes only what a test must (credentials,
//! the API server's address, the cgroup to attach to, the host directory of the
//! sockets). The redirect attaches to a child cgroup holding kube-apiserver, never the
//! root cgroup; the edge runs as a process in a network namespace of its own, with the
//! kubelet stand-in that only the tunnel reaches.
//!
//! Needs root, containerd, podman and the image; without them it fails in CI and skips
//! loudly elsewhere. Everything it starts is stopped by PID and what it changed on the
//! host is put back (`k8s::node`).

mod common;
mod k8s;

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::netns::EdgeNetns;
use common::privileged::{self, TestCgroup};
use k8s::apiserver::{ApiServer, ApiServerOpts, ControllerManager, Daemon};
use k8s::checks::{
    NODE, POD, admin_kubectl, assert_reached_stand_in, create_node_and_pod, kubectl_checks,
    port_forward, prerequisites, wait_log,
};
use k8s::node::{
    Binaries, Containerd, HostChanges, Kubelet, NodeNamespaces, Scheduler, WORKLOAD_IMAGE,
    busybox_image, pause_image, run,
};
use rcgen::ExtendedKeyUsagePurpose;

const MASTER: &str = "master-1";
/// The real edge node (the stand-in's Node has the same name in the other test).
const EDGE: &str = "edge-1";
const NAMESPACE: &str = "tunnel-system";
const CLOUD_SELECTOR: &str = "app.kubernetes.io/name=tunnel-cloud";
const EDGE_SELECTOR: &str = "app.kubernetes.io/name=tunnel-edge";
/// What deploy/config/cloud.toml binds on the master's network: edges, peers, admin,
/// HTTP CONNECT and the redirect listener.
const CLOUD_PORTS: [u16; 5] = [9000, 9002, 9101, 251, 250];
const BPFFS: &str = "/sys/fs/bpf";
const PIN_DIR: &str = "/sys/fs/bpf/tunnel";

/// The archive `cargo xtask image` leaves (what deploy/README.md has users import).
fn image_archive() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(format!(
        "../target/image/tunnel-{}.oci.tar",
        env!("CARGO_PKG_VERSION")
    ))
}

/// A figure of the run, printed even when the test passes (straight to fd 2: the test
/// harness captures `eprintln!` of a passing test).
fn figure(line: &str) {
    let line = format!("node e2e figure: {line}\n");
    let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
}

fn is_bpffs(path: &str) -> bool {
    tunnel_user::intercept::is_bpffs(Path::new(path)).unwrap_or(false)
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

/// One pod of a DaemonSet of ours, as `kubectl get pods` reports it.
#[derive(Debug)]
struct DaemonPod {
    name: String,
    ready: bool,
    /// containerd's id of the cloud container, once it runs.
    container: Option<String>,
}

fn cloud_pods(api: &ApiServer, kubectl: &Path) -> Vec<DaemonPod> {
    daemon_pods(api, kubectl, CLOUD_SELECTOR)
}

/// The pods of the DaemonSet `selector` picks.
fn daemon_pods(api: &ApiServer, kubectl: &Path, selector: &str) -> Vec<DaemonPod> {
    let template = r#"{range .items[*]}{.metadata.name}|{.status.conditions[?(@.type=="Ready")].status}|{.status.containerStatuses[0].containerID}{"\n"}{end}"#;
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
            let [name, ready, container] = f[..] else {
                return None;
            };
            Some(DaemonPod {
                name: name.to_string(),
                ready: ready == "True",
                container: container.strip_prefix("containerd://").map(str::to_string),
            })
        })
        .collect()
}

/// Polls `what` every 250 ms until it holds or `timeout` passes; how long it took.
fn wait_for(timeout: Duration, what: &str, mut holds: impl FnMut() -> bool) -> Duration {
    let started = Instant::now();
    while !holds() {
        assert!(
            started.elapsed() < timeout,
            "{what}: not within {timeout:?}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    started.elapsed()
}

/// How the tunnel CA comes to be, as a user chooses.
#[derive(Clone, Copy, PartialEq)]
enum Ca {
    /// The cloud makes it on its first start (deploy/ as shipped).
    MadeByTheCloud,
    /// The operator's own (the test's `common::Pki`, with a client certificate for
    /// [`NODE`] beside it), put in the cloud's Secret by the overlay, as deploy/README.md
    /// shows.
    BroughtByTheOperator,
}

/// The overlay a test applies: deploy/ with the address the edges dial (the master's
/// end of the edge's veth: no kube-proxy serves the NodePort), which is all a user
/// sets, and what only the test needs: the API server's real address (no kube-proxy
/// runs here), the test cgroup to attach to, the sockets' host directory under the
/// test's own, and with [`Ca::BroughtByTheOperator`] the operator's CA.
fn write_overlay(
    dir: &Path,
    api: &ApiServer,
    attach_cgroup: &Path,
    cloud: IpAddr,
    ca: Ca,
) -> PathBuf {
    let overlay = dir.join("overlay");
    std::fs::create_dir_all(&overlay).expect("overlay dir");
    // The name the cloud's config reads (csr.ca_secret), without kustomize's hash.
    let own_ca = match ca {
        Ca::MadeByTheCloud => "",
        Ca::BroughtByTheOperator => {
            let pki = common::Pki::new(&overlay);
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
    let shipped =
        std::fs::read_to_string(deploy.join("config/edge.toml")).expect("deploy/config/edge.toml");
    let dial = format!("address = \"{}\"", SocketAddr::new(cloud, 9000));
    let config = shipped.replacen("address = \"tunnel.example.com:31000\"", &dial, 1);
    assert_ne!(
        config, shipped,
        "deploy/config/edge.toml names cloud.address"
    );
    std::fs::write(overlay.join("edge.toml"), config).expect("edge.toml");
    let url: SocketAddr = api
        .url
        .trim_start_matches("https://")
        .parse()
        .expect("API server address");
    let run_dir = dir.join("run-tunnel");
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
patches:
  - path: cloud-patch.yaml
  - path: edge-patch.yaml
"
        ),
    )
    .expect("kustomization");
    overlay
}

/// `tunnel edge` for the edge Node, in its network namespace, dialling the master's
/// edge port over the veth with a client certificate naming the node.
fn start_edge(netns: &EdgeNetns, overlay: &Path, edge_ip: IpAddr) -> Daemon {
    let config = overlay.join("edge.toml");
    let (cert, key) = (format!("{NODE}.crt"), format!("{NODE}.key"));
    common::config::write_toml(
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
    let mut cmd = netns.command(common::BIN);
    cmd.args(["edge", "--config"])
        .arg(&config)
        .env("RUST_LOG", "info")
        .env_remove("NODE_NAME");
    Daemon::start("tunnel-edge", overlay, cmd)
}

/// The cgroup id of the cloud container, found by its task's PID on the host.
/// The host pid of a container's task.
fn container_pid(containerd: &Containerd, container: &str) -> String {
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

fn container_cgroup_id(containerd: &Containerd, container: &str) -> u64 {
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
fn cloud_log(api: &ApiServer, kubectl: &Path, pod: &str) -> String {
    api.kubectl_ok(kubectl, &["logs", "-n", NAMESPACE, pod])
}

/// `kubectl logs` of a cloud pod that may be gone by the time they are asked for (an old
/// pod with nothing left to drain exits within a second of its SIGTERM), or kubectl's
/// answer when it is.
fn cloud_log_if_there(api: &ApiServer, kubectl: &Path, pod: &str) -> String {
    let out = api.kubectl(kubectl, &["logs", "-n", NAMESPACE, pod]);
    match out.status.success() {
        true => String::from_utf8_lossy(&out.stdout).into_owned(),
        false => format!("(no logs: {})", String::from_utf8_lossy(&out.stderr).trim()),
    }
}

/// Calls through the tunnel, made in a loop while the cloud DaemonSet is updated.
struct CallLoop {
    stop: Arc<AtomicBool>,
    calls: Arc<AtomicUsize>,
    failures: Arc<std::sync::Mutex<Vec<String>>>,
    thread: std::thread::JoinHandle<()>,
}

impl CallLoop {
    /// `kubectl logs` and `kubectl exec` of the stand-in's pod, one after the other.
    fn start(kubectl: PathBuf, kubeconfig: PathBuf) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let calls = Arc::new(AtomicUsize::new(0));
        let failures = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (s, c, f) = (stop.clone(), calls.clone(), failures.clone());
        let thread = std::thread::spawn(move || {
            let call = |args: &[&str], want: &str| {
                let out = Command::new("timeout")
                    .arg("20")
                    .arg(&kubectl)
                    .arg("--kubeconfig")
                    .arg(&kubeconfig)
                    .args(args)
                    .output()
                    .expect("kubectl");
                let stdout = String::from_utf8_lossy(&out.stdout);
                (out.status.success() && stdout == want)
                    .then_some(())
                    .ok_or_else(|| {
                        format!(
                            "kubectl {args:?}: {} {stdout:?} {}",
                            out.status,
                            String::from_utf8_lossy(&out.stderr)
                        )
                    })
            };
            // Bounded: at most 2,000 calls, whatever happens to `stop`.
            for i in 0..2000 {
                if s.load(Ordering::Relaxed) {
                    return;
                }
                let result = if i % 2 == 0 {
                    call(&["logs", POD], k8s::kubelet::LOG_TEXT)
                } else {
                    call(&["exec", POD, "--", "echo", "ok"], "ok\n")
                };
                c.fetch_add(1, Ordering::Relaxed);
                if let Err(e) = result {
                    f.lock().expect("failures").push(e);
                }
            }
        });
        Self {
            stop,
            calls,
            failures,
            thread,
        }
    }

    /// Stops the loop; the calls made and the failures.
    fn finish(self) -> (usize, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().expect("call loop");
        let failures = self.failures.lock().expect("failures").clone();
        (self.calls.load(Ordering::Relaxed), failures)
    }
}

/// Echoes a line through `conn`, so it is open end to end through the tunnel, and
/// leaves it open.
fn hold_open(conn: &std::net::TcpStream) {
    use std::io::{Read, Write};
    let mut c = conn;
    c.write_all(b"held\n").expect("send through the tunnel");
    let mut back = [0u8; 5];
    c.read_exact(&mut back).expect("echo through the tunnel");
    assert_eq!(&back, b"held\n");
}

/// Whatever of ours is left after an uninstall: program names attached to `cgroup`,
/// and files pinned under the pin directory.
fn left_behind(cgroup: &Path) -> (Vec<String>, Vec<PathBuf>) {
    let show = run(Command::new("bpftool").args(["cgroup", "show"]).arg(cgroup))
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    let programs = show
        .lines()
        .filter(|l| {
            tunnel_user::intercept::PROGRAM_NAMES
                .iter()
                .any(|p| l.contains(&p[..p.len().min(15)]))
        })
        .map(str::to_string)
        .collect();
    let mut pins = Vec::new();
    let mut stack = vec![PathBuf::from(PIN_DIR)];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(e.path());
            } else {
                pins.push(e.path());
            }
        }
    }
    (programs, pins)
}

/// One real-node test at a time: they bind the same host ports, and the cloud mounts
/// the host's bpffs.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static NODE_TESTS: std::sync::Mutex<()> = std::sync::Mutex::new(());
    NODE_TESTS.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn deploy_on_a_real_node() {
    let _one = one_at_a_time();
    let Some((assets, kubectls)) = prerequisites(true) else {
        return;
    };
    if let Err(why) = node_prerequisites() {
        privileged::cannot_run(&why);
        return;
    }
    let kubectl = admin_kubectl(&kubectls).to_path_buf();
    figure(&assets.version());
    let started = Instant::now();
    let dir = tempfile::tempdir().expect("tempdir");
    let bins = Binaries::unpack(&assets, dir.path()).expect("unpack the node's binaries");
    let _host = HostChanges::record().expect("host state");
    let cgroup_root = tunnel_user::intercept::detect_cgroup_root().expect("cgroup v2");
    let apiserver_cgroup = TestCgroup::new(&cgroup_root).expect("kube-apiserver's cgroup");
    let netns = EdgeNetns::new().expect("edge network namespace");
    let node_ip = netns.add_host_address().expect("the master's address");
    let api = ApiServer::start(
        &assets,
        dir.path(),
        &ApiServerOpts {
            cgroup: Some(apiserver_cgroup.path.clone()),
            ..ApiServerOpts::default()
        },
    );
    let _controller_manager = ControllerManager::start(&assets, &api, dir.path(), &kubectl)
        .expect("kube-controller-manager");
    let _scheduler = Scheduler::start(&bins, &api, dir.path());
    let containerd = Containerd::start(dir.path(), None).expect("containerd");
    let pause = pause_image(&bins.pause, dir.path()).expect("the sandbox image");
    containerd.import(&pause).expect("import the sandbox image");
    containerd
        .import(&image_archive())
        .expect("import the tunnel image");
    let kubelet = Kubelet::start(
        &bins.kubelet,
        &api,
        &containerd,
        MASTER,
        node_ip,
        dir.path(),
        None,
    )
    .expect("kubelet");
    let registered = wait_for(Duration::from_secs(60), "the master registered", || {
        api.kubectl(&kubectl, &["get", "node", MASTER])
            .status
            .success()
    });
    eprintln!("control plane, containerd and kubelet up; {MASTER} registered after {registered:?}");
    api.kubectl_ok(
        &kubectl,
        &[
            "label",
            "node",
            MASTER,
            "node-role.kubernetes.io/control-plane=",
        ],
    );
    // No CNI here, so the node stays NotReady, with the taint it registered with; the
    // cloud's pod uses the host network and needs none.
    let _ = api.kubectl(
        &kubectl,
        &[
            "taint",
            "node",
            MASTER,
            "node.kubernetes.io/not-ready:NoSchedule-",
        ],
    );

    // The edge side: its Node, the stand-in behind it, and tunnel edge.
    let edge_ip = IpAddr::from(netns.edge_ip);
    create_node_and_pod(&api, &kubectl, &edge_ip.to_string());
    api.pki.issue(
        "kubelet",
        NODE,
        None,
        &[&edge_ip.to_string()],
        ExtendedKeyUsagePurpose::ServerAuth,
    );
    let stand_in = k8s::kubelet::Kubelet::start(
        &netns.name,
        SocketAddr::new(edge_ip, 10250),
        &api.pki,
        "kubelet",
    );

    // 1. Apply, on a host without a bpffs.
    let attach_cgroup = apiserver_cgroup.path.clone();
    // The edge here is a process with a certificate from the operator's CA.
    let overlay = write_overlay(
        dir.path(),
        &api,
        &attach_cgroup,
        netns.host_ip.into(),
        Ca::BroughtByTheOperator,
    );
    let overlay_arg = overlay.to_str().expect("utf-8").to_string();
    assert!(!is_bpffs(BPFFS), "{BPFFS} had no bpffs before the apply");
    let applied = Instant::now();
    api.kubectl_ok(&kubectl, &["apply", "-k", &overlay_arg]);
    wait_for(Duration::from_secs(120), "the cloud pod Ready", || {
        cloud_pods(&api, &kubectl).iter().any(|p| p.ready)
    });
    let ready = applied.elapsed();
    let pods = cloud_pods(&api, &kubectl);
    let [pod] = &pods[..] else {
        panic!("one cloud pod expected: {pods:?}")
    };
    figure(&format!(
        "cloud pod Ready {:.1} s after kubectl apply -k, with no bpffs at {BPFFS} before",
        ready.as_secs_f64()
    ));
    assert!(
        is_bpffs(BPFFS),
        "the init container mounted a bpffs at {BPFFS}"
    );
    let (programs, pins) = left_behind(&attach_cgroup);
    figure(&format!(
        "after the start: {} programs attached to the test cgroup, {} pins:\n  {}",
        programs.len(),
        pins.len(),
        programs.join("\n  ")
    ));
    assert_eq!(programs.len(), 5, "{programs:?}");
    assert!(!pins.is_empty());

    // 2. The exempt cgroup the cloud logged is its own container's.
    let log = cloud_log(&api, &kubectl, &pod.name);
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
    let own = container_cgroup_id(&containerd, pod.container.as_deref().expect("container id"));
    figure(&format!(
        "exempt cgroup in the start log {exempt}, the cloud container's own cgroup {own}"
    ));
    assert_eq!(exempt, own, "{attached}");

    // The serving cloud holds no CAP_SYS_ADMIN, on any thread, in any set (it drops
    // every capability once it serves; deploy/ gives it SETPCAP for the bounding set).
    let pid = container_pid(&containerd, pod.container.as_deref().expect("container id"));
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

    // 3. kubectl logs, exec and port-forward through the redirect the pod installed.
    let edge = start_edge(&netns, &overlay, edge_ip);
    wait_log(&edge, "registered with the cloud", Duration::from_secs(30));
    let context = || {
        format!(
            "edge:\n{}\nkubelet:\n{}",
            edge.log_tail(20),
            kubelet.log_tail(20)
        )
    };
    kubectl_checks(&api, &kubectls, &stand_in, &context);
    assert_reached_stand_in(&stand_in, kubectls.len());

    // 4. A rolling restart under a loop of calls through the tunnel.
    let calls = CallLoop::start(kubectl.clone(), api.admin_kubeconfig.clone());
    std::thread::sleep(Duration::from_secs(2));
    let restarted = Instant::now();
    api.kubectl_ok(
        &kubectl,
        &[
            "rollout",
            "restart",
            "-n",
            NAMESPACE,
            "daemonset/tunnel-cloud",
        ],
    );
    let rolled = wait_for(Duration::from_secs(150), "the rollout complete", || {
        api.kubectl(
            &kubectl,
            &[
                "rollout",
                "status",
                "-n",
                NAMESPACE,
                "daemonset/tunnel-cloud",
                "--timeout=10s",
            ],
        )
        .status
        .success()
    });
    // Both pods' logs while the old one drains, for a failure message.
    let logs: Vec<String> = cloud_pods(&api, &kubectl)
        .iter()
        .map(|p| {
            format!(
                "--- {}:\n{}",
                p.name,
                cloud_log_if_there(&api, &kubectl, &p.name)
            )
        })
        .collect();
    // The old pod drains after the new one took over; calls go on until it is gone.
    wait_for(Duration::from_secs(60), "the old pod gone", || {
        cloud_pods(&api, &kubectl).len() == 1
    });
    let (made, failed) = calls.finish();
    figure(&format!(
        "kubectl rollout restart complete in {:.1} s; kubectl logs/exec calls made {made}, failed {}",
        rolled.as_secs_f64(),
        failed.len()
    ));
    assert!(
        failed.is_empty(),
        "calls failed during the rollout:\n{}\ncloud logs:\n{}",
        failed.join("\n"),
        logs.join("\n")
    );
    assert!(made >= 10, "only {made} calls during the rollout");
    let pods = cloud_pods(&api, &kubectl);
    let new_log = cloud_log(&api, &kubectl, &pods[0].name);
    assert!(
        new_log.contains("took the listeners"),
        "the new pod took the old one's listeners:\n{new_log}"
    );
    figure(&format!(
        "old pod gone {:.1} s after the restart (its drain included)",
        restarted.elapsed().as_secs_f64()
    ));

    // 5. Uninstall: nothing attached, nothing pinned, edge addresses reached directly;
    // the pins go at once, while a connection held open through the tunnel keeps the
    // pod draining (up to tunnel.drain_timeout, 30 s).
    let held = port_forward(&api, &kubectl);
    hold_open(&held.1);
    let deleted = Instant::now();
    run(Command::new("timeout")
        .arg("150")
        .arg(&kubectl)
        .arg("--kubeconfig")
        .arg(&api.admin_kubeconfig)
        // The Namespace goes first and takes what is in it along, so kubectl may find
        // a namespaced object gone already (a NotFound, and exit status 1, without it).
        .args(["delete", "-k", &overlay_arg, "--wait=false", "--ignore-not-found"]))
    .expect("kubectl delete -k");
    let unpinned = wait_for(Duration::from_secs(20), "the pins removed", || {
        left_behind(&attach_cgroup).1.is_empty()
    });
    let draining = !cloud_pods(&api, &kubectl).is_empty();
    figure(&format!(
        "pins removed {:.1} s after kubectl delete -k, the pod still draining an open connection: {draining}",
        unpinned.as_secs_f64()
    ));
    assert!(
        draining,
        "the pod was gone before the pins: the drain was not waited out"
    );
    wait_for(Duration::from_secs(120), "the cloud pods gone", || {
        cloud_pods(&api, &kubectl).is_empty()
    });
    drop(held);
    figure(&format!(
        "kubectl delete -k and the cloud pod gone in {:.1} s",
        deleted.elapsed().as_secs_f64()
    ));
    let (programs, pins) = left_behind(&attach_cgroup);
    figure(&format!(
        "after kubectl delete -k: programs attached {}, pins left {}",
        programs.len(),
        pins.len()
    ));
    assert!(programs.is_empty(), "still attached: {programs:?}");
    assert!(pins.is_empty(), "still pinned: {pins:?}");
    let direct = std::net::TcpListener::bind((edge_ip, 10250)).expect("bind the edge address");
    direct.set_nonblocking(true).expect("nonblocking");
    let out = api.kubectl(&kubectl, &["logs", POD]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("connection refused"),
        "kube-apiserver's connections to the edge address are still refused: {stderr}"
    );
    let reached = direct.accept().is_ok();
    figure(&format!(
        "after the uninstall kube-apiserver's connection to {edge_ip}:10250 refused: {}, reached the address itself: {reached}",
        stderr.contains("connection refused")
    ));
    assert!(
        reached,
        "kube-apiserver did not reach {edge_ip}:10250 directly"
    );
    figure(&format!(
        "whole test {:.1} s",
        started.elapsed().as_secs_f64()
    ));
}

/// Whether `node` has registered.
fn registered(api: &ApiServer, kubectl: &Path, node: &str) -> bool {
    api.kubectl(kubectl, &["get", "node", node])
        .status
        .success()
}

/// The edge node as users run one: a real kubelet with its own containerd for `edge-1`,
/// in a network namespace behind NAT (it reaches the master's addresses; its own
/// address the master reaches only through the tunnel), running the `tunnel-edge`
/// DaemonSet of deploy/, which gets its client certificate by a CSR filed with its
/// pod's token.
#[test]
fn edge_behind_nat_on_a_real_node() {
    let _one = one_at_a_time();
    let Some((assets, kubectls)) = prerequisites(true) else {
        return;
    };
    if let Err(why) = node_prerequisites() {
        privileged::cannot_run(&why);
        return;
    }
    let kubectl = admin_kubectl(&kubectls).to_path_buf();
    figure(&assets.version());
    let started = Instant::now();
    let dir = tempfile::tempdir().expect("tempdir");
    let bins = Binaries::unpack(&assets, dir.path()).expect("unpack the node's binaries");
    let _host = HostChanges::record().expect("host state");
    let cgroup_root = tunnel_user::intercept::detect_cgroup_root().expect("cgroup v2");
    let apiserver_cgroup = TestCgroup::new(&cgroup_root).expect("kube-apiserver's cgroup");
    let mut netns = EdgeNetns::new().expect("edge network namespace");
    let master_ip = netns.add_host_address().expect("the master's address");
    let edge_ip = netns.add_node_ip().expect("the edge's address");
    // On the master's end of the edge's veth, so that the edge node reaches it.
    let api = ApiServer::start(
        &assets,
        dir.path(),
        &ApiServerOpts {
            cgroup: Some(apiserver_cgroup.path.clone()),
            bind: Some(netns.host_ip),
            // Its proxy logs each upgrade to a kubelet with the headers: which protocol
            // (SPDY or WebSocket) each streaming call used.
            extra_args: vec!["--vmodule=upgradeaware=6".into()],
        },
    );
    let _controller_manager = ControllerManager::start(&assets, &api, dir.path(), &kubectl)
        .expect("kube-controller-manager");
    let _scheduler = Scheduler::start(&bins, &api, dir.path());
    let pause = pause_image(&bins.pause, dir.path()).expect("the sandbox image");
    let containerd = Containerd::start(dir.path(), None).expect("containerd");
    let edge_dir = dir.path().join(EDGE);
    let edge_node = NodeNamespaces::new(&netns.name, &edge_dir).expect("the edge's namespaces");
    let edge_containerd =
        Containerd::start(&edge_dir, Some(&edge_node)).expect("the edge's containerd");
    for c in [&containerd, &edge_containerd] {
        c.import(&pause).expect("import the sandbox image");
        c.import(&image_archive()).expect("import the tunnel image");
    }
    let workload = busybox_image(dir.path()).expect("the workload image");
    edge_containerd
        .import(&workload)
        .expect("import the workload image");
    let _kubelet = Kubelet::start(
        &bins.kubelet,
        &api,
        &containerd,
        MASTER,
        master_ip,
        dir.path(),
        None,
    )
    .expect("kubelet");
    let edge_kubelet = Kubelet::start(
        &bins.kubelet,
        &api,
        &edge_containerd,
        EDGE,
        edge_ip,
        &edge_dir,
        Some(&edge_node),
    )
    .expect("the edge's kubelet");
    let up = wait_for(Duration::from_secs(60), "both nodes registered", || {
        registered(&api, &kubectl, MASTER) && registered(&api, &kubectl, EDGE)
    });
    figure(&format!(
        "{MASTER} and {EDGE} (in network namespace {}, node address {edge_ip}) registered after {:.1} s",
        netns.name,
        up.as_secs_f64()
    ));
    for (node, role) in [
        (MASTER, "node-role.kubernetes.io/control-plane="),
        (EDGE, "node-role.kubernetes.io/edge="),
    ] {
        api.kubectl_ok(&kubectl, &["label", "node", node, role]);
        // No CNI here: both stay NotReady with the taint they registered with; every
        // pod of this test uses the host network and needs none.
        let _ = api.kubectl(
            &kubectl,
            &[
                "taint",
                "node",
                node,
                "node.kubernetes.io/not-ready:NoSchedule-",
            ],
        );
    }

    // 1. Before the tunnel: kube-apiserver cannot reach the edge's kubelet.
    let healthz = format!("/api/v1/nodes/{EDGE}/proxy/healthz");
    let direct = api.kubectl(&kubectl, &["get", "--raw", &healthz]);
    let refused = String::from_utf8_lossy(&direct.stderr).trim().to_string();
    figure(&format!(
        "before the tunnel, kubectl get --raw {healthz}: {refused}"
    ));
    assert!(
        !direct.status.success() && refused.contains(&edge_ip.to_string()),
        "kube-apiserver reached the edge's kubelet directly: {:?} {refused}",
        String::from_utf8_lossy(&direct.stdout)
    );

    // 2. Install as a user does: the nodes labelled (above), the address the edges dial
    // set, kubectl apply -k. The cloud makes the CA and publishes it; the edge's pod
    // waits for it and gets its certificate by CSR.
    let overlay = write_overlay(
        dir.path(),
        &api,
        &apiserver_cgroup.path,
        netns.host_ip.into(),
        Ca::MadeByTheCloud,
    );
    let overlay_arg = overlay.to_str().expect("utf-8").to_string();
    let applied = Instant::now();
    api.kubectl_ok(&kubectl, &["apply", "-k", &overlay_arg]);
    let edge_log = || edge_container_log(&edge_dir);
    let context = || {
        format!(
            "tunnel-edge's log:\n{}\nthe edge's kubelet:\n{}",
            edge_log(),
            edge_kubelet.log_tail(20)
        )
    };
    let ready = |selector: &str| {
        daemon_pods(&api, &kubectl, selector)
            .iter()
            .any(|p| p.ready)
    };
    while !(ready(CLOUD_SELECTOR) && ready(EDGE_SELECTOR)) {
        assert!(
            applied.elapsed() < Duration::from_secs(180),
            "both DaemonSets' pods not Ready within 180 s:\n{}",
            context()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    figure(&format!(
        "tunnel-cloud and tunnel-edge Ready {:.1} s after kubectl apply -k",
        applied.elapsed().as_secs_f64()
    ));
    // The CA the cloud made is the one it published for the edge.
    let ca_of = |kind: &str, name: &str| {
        api.kubectl_ok(
            &kubectl,
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
    let csrs = api.kubectl_ok(
        &kubectl,
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

    // 3. Through the tunnel, the same request reaches the edge's kubelet.
    let through = api.kubectl(&kubectl, &["get", "--raw", &healthz]);
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

    // 4. A workload on the edge, and what a user does with it, through the tunnel.
    api.apply(&kubectl, &workload_pod());
    wait_for(Duration::from_secs(60), "the workload running", || {
        api.kubectl(&kubectl, &["logs", WORKLOAD, "-c", "main"])
            .stdout
            .starts_with(b"tick 1\n")
    });
    // With the oldest and the newest kubectl here: 1.28 speaks SPDY to the API server,
    // 1.33 WebSockets; what the API server then speaks to the kubelet is in its log.
    let mut seen = kubelet_upgrades(&api.log_text());
    for client in edge_kubectls() {
        let version = kubectl_version(&client);
        workload_checks(&api, &client, &version, dir.path(), &context);
        let upgrades = kubelet_upgrades(&api.log_text());
        for (call, count) in &upgrades {
            let new = count - seen.get(call).copied().unwrap_or(0);
            // On 1.28 a WebSocket try reaches the kubelet, which refuses it, and the
            // API server then falls back to SPDY: both are listed.
            if new > 0 {
                figure(&format!(
                    "{version}: kube-apiserver -> kubelet: {call}, {new} upgrade requests"
                ));
            }
        }
        for call in ["exec", "attach", "portForward"] {
            assert!(
                upgrades
                    .iter()
                    .any(|(k, n)| k.starts_with(call) && seen.get(k).copied().unwrap_or(0) < *n),
                "{version}: no {call} upgrade in kube-apiserver's log: {upgrades:?}"
            );
        }
        seen = upgrades;
    }

    // A scrape of the edge kubelet's /metrics from a process on the master that is not
    // the API server (Prometheus, say), in the redirected cgroup, with a client
    // certificate the kubelet accepts.
    let pki = dir.path().join("pki");
    let scrape = Command::new("sh")
        .arg("-c")
        .arg(r#"echo $$ > "$0" && exec "$@""#)
        .arg(apiserver_cgroup.path.join("cgroup.procs"))
        .args(["curl", "-sS", "--fail", "--max-time", "20", "--cacert"])
        .arg(pki.join("ca.crt"))
        .arg("--cert")
        .arg(pki.join("kubelet-client.crt"))
        .arg("--key")
        .arg(pki.join("kubelet-client.key"))
        .arg(format!("https://{edge_ip}:10250/metrics"))
        .output()
        .expect("curl");
    let metrics = String::from_utf8_lossy(&scrape.stdout);
    let samples = metrics
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .count();
    figure(&format!(
        "curl https://{edge_ip}:10250/metrics from the master's redirected cgroup: {}, {} bytes, {samples} samples",
        scrape.status,
        metrics.len()
    ));
    assert!(
        scrape.status.success() && metrics.contains("kubelet_running_pods"),
        "{}\n{}",
        String::from_utf8_lossy(&scrape.stderr),
        context()
    );

    // 5. The edge's uplink down for longer than the heartbeat timeout (15 s): kubectl
    // fails fast and says why (the eBPF program fails kube-apiserver's connect to the
    // kubelet with EHOSTDOWN once no replica holds the edge's tunnel); after the link is
    // back, kubectl works again.
    netns.set_uplink(false).expect("uplink down");
    let down = Instant::now();
    std::thread::sleep(Duration::from_secs(20));
    let asked = Instant::now();
    let out = api.kubectl(&kubectl, &["logs", WORKLOAD, "-c", "main", "--tail=1"]);
    let failed_in = asked.elapsed();
    let why = String::from_utf8_lossy(&out.stderr).trim().to_string();
    figure(&format!(
        "uplink down {:.0} s: kubectl logs failed in {:.2} s: {why}",
        down.elapsed().as_secs_f64(),
        failed_in.as_secs_f64()
    ));
    assert!(
        !out.status.success(),
        "kubectl logs worked with the uplink down"
    );
    assert!(
        failed_in < Duration::from_secs(5),
        "kubectl logs hung {failed_in:?}: {why}"
    );
    assert!(
        why.contains("connect: host is down"),
        "kubectl's error does not name the cause: {why}\n{}",
        context()
    );
    netns.set_uplink(true).expect("uplink up");
    let recovered = wait_for(Duration::from_secs(120), "kubectl working again", || {
        let out = api.kubectl(
            &kubectl,
            &["exec", WORKLOAD, "-c", "main", "--", "echo", "back"],
        );
        out.status.success() && out.stdout == b"back\n"
    });
    figure(&format!(
        "uplink back: kubectl exec works again {:.1} s after the link came up",
        recovered.as_secs_f64()
    ));

    // 6. `kubectl rollout restart` of the edge's DaemonSet under a loop of kubectl
    // calls to the edge: the calls made and failed, and the longest gap without a
    // working one. The new pod starts beside the old (maxSurge), registers a second
    // session, takes the new calls, and the old one finishes its calls and leaves.
    let stop = Arc::new(AtomicBool::new(false));
    let looping = {
        let (stop, kubectl, kubeconfig) =
            (stop.clone(), kubectl.clone(), api.admin_kubeconfig.clone());
        std::thread::spawn(move || {
            let (mut made, mut failed, mut last_ok, mut gap) =
                (0, 0, Instant::now(), Duration::ZERO);
            // Bounded: at most 2,000 calls, whatever happens to `stop`.
            for _ in 0..2000 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let out = Command::new("timeout")
                    .arg("20")
                    .arg(&kubectl)
                    .arg("--kubeconfig")
                    .arg(&kubeconfig)
                    .args(["exec", WORKLOAD, "-c", "main", "--", "echo", "ok"])
                    .output()
                    .expect("kubectl");
                made += 1;
                if out.status.success() && out.stdout == b"ok\n" {
                    gap = gap.max(last_ok.elapsed());
                    last_ok = Instant::now();
                } else {
                    failed += 1;
                }
            }
            (made, failed, gap.max(last_ok.elapsed()))
        })
    };
    std::thread::sleep(Duration::from_secs(2));
    let old_pods: Vec<String> = daemon_pods(&api, &kubectl, EDGE_SELECTOR)
        .into_iter()
        .map(|p| p.name)
        .collect();
    api.kubectl_ok(
        &kubectl,
        &[
            "rollout",
            "restart",
            "-n",
            NAMESPACE,
            "daemonset/tunnel-edge",
        ],
    );
    // `kubectl rollout status` of a DaemonSet with maxSurge says complete once the new
    // pod is scheduled, while the old one still runs: the rollout is over when the old
    // pod is gone and the new one is Ready.
    let rolled = wait_for(
        Duration::from_secs(150),
        "the edge's rollout complete (the old pod gone, the new one Ready)",
        || match &daemon_pods(&api, &kubectl, EDGE_SELECTOR)[..] {
            [new] => new.ready && !old_pods.contains(&new.name),
            _ => false,
        },
    );
    // Until the new edge carries calls again, or 60 s.
    let _ = wait_for(
        Duration::from_secs(60),
        "a call through the new edge",
        || {
            api.kubectl(&kubectl, &["exec", WORKLOAD, "-c", "main", "--", "true"])
                .status
                .success()
        },
    );
    std::thread::sleep(Duration::from_secs(2));
    stop.store(true, Ordering::Relaxed);
    let (made, failed, gap) = looping.join().expect("call loop");
    figure(&format!(
        "kubectl rollout restart daemonset/tunnel-edge: old pod {old_pods:?} gone, new one Ready in {:.1} s; kubectl exec calls made {made}, failed {failed}, longest gap {:.1} s",
        rolled.as_secs_f64(),
        gap.as_secs_f64()
    ));
    assert!(made >= 5, "only {made} calls during the edge's rollout");
    assert_eq!(
        failed,
        0,
        "calls failed during the edge's rollout\n{}",
        context()
    );

    // 6. kubectl delete -k: nothing of ours left on either node.
    api.kubectl_ok(&kubectl, &["delete", "pod", WORKLOAD, "--wait=false"]);
    api.kubectl_ok(
        &kubectl,
        &[
            "delete",
            "-k",
            &overlay_arg,
            "--wait=false",
            "--ignore-not-found",
        ],
    );
    let gone = wait_for(Duration::from_secs(120), "every pod gone", || {
        api.kubectl_ok(&kubectl, &["get", "pods", "-A", "-o", "name"])
            .trim()
            .is_empty()
    });
    let tasks = |c: &Containerd| {
        let out = c.ctr(&["tasks", "ls", "-q"]).expect("ctr tasks ls");
        String::from_utf8_lossy(&out.stdout).lines().count()
    };
    let (master_tasks, edge_tasks) = (tasks(&containerd), tasks(&edge_containerd));
    let (programs, pins) = left_behind(&apiserver_cgroup.path);
    let after = api.kubectl(&kubectl, &["get", "--raw", &healthz]);
    figure(&format!(
        "kubectl delete -k: every pod gone in {:.1} s; containers left: master {master_tasks}, edge {edge_tasks}; programs attached {}, pins {}; kube-apiserver to the edge's kubelet again: {}",
        gone.as_secs_f64(),
        programs.len(),
        pins.len(),
        String::from_utf8_lossy(&after.stderr).trim()
    ));
    assert_eq!(
        (master_tasks, edge_tasks),
        (0, 0),
        "containers left running"
    );
    assert!(
        programs.is_empty() && pins.is_empty(),
        "{programs:?} {pins:?}"
    );
    assert!(
        !after.status.success(),
        "the edge's kubelet reached without a tunnel"
    );
    figure(&format!(
        "whole test {:.1} s",
        started.elapsed().as_secs_f64()
    ));
}

/// The tunnel-edge container's log on the edge node, read from its disk (kubectl logs
/// needs the tunnel this container is).
fn edge_container_log(edge_dir: &Path) -> String {
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

/// The workload pod on the edge.
const WORKLOAD: &str = "workload";
/// Where its `httpd` serves `/www` on the edge's loopback (host network).
const HTTP_PORT: u16 = 18080;

/// The workload: `main` writes a numbered line every 200 ms, serves `/www` over HTTP,
/// and exits when `/tmp/restart` appears (for `logs --previous`); `echo` answers each
/// line it reads on its stdin (for `attach`). Host network: no CNI runs here.
fn workload_pod() -> String {
    format!(
        "apiVersion: v1
kind: Pod
metadata:
  name: {WORKLOAD}
  namespace: default
spec:
  nodeName: {EDGE}
  hostNetwork: true
  automountServiceAccountToken: false
  tolerations: [{{operator: Exists}}]
  containers:
    - name: main
      image: {WORKLOAD_IMAGE}
      imagePullPolicy: Never
      command:
        - sh
        - -c
        - |
          mkdir -p /www && httpd -p 127.0.0.1:{HTTP_PORT} -h /www
          i=0
          while [ ! -e /tmp/restart ]; do i=$((i+1)); echo tick $i; sleep 0.2; done
          echo restarting; exit 1
    - name: echo
      image: {WORKLOAD_IMAGE}
      imagePullPolicy: Never
      stdin: true
      command: [sh, -c, 'while read l; do echo \"attached: $l\"; done']
"
    )
}

fn sha256_hex(data: &[u8]) -> String {
    use sha2::Digest;
    format!("{:x}", sha2::Sha256::digest(data))
}

/// The first field of `sha256sum` output run in the workload's `main`.
fn sha256_in_pod(api: &ApiServer, kubectl: &Path, file: &str) -> String {
    let out = api.kubectl_ok(
        kubectl,
        &["exec", WORKLOAD, "-c", "main", "--", "sha256sum", file],
    );
    out.split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string()
}

/// Lines of `child`'s stdout as they arrive, each with when it did.
fn timed_lines(stdout: std::process::ChildStdout) -> std::sync::mpsc::Receiver<(Instant, String)> {
    use std::io::BufRead;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            if tx.send((Instant::now(), line)).is_err() {
                return;
            }
        }
    });
    rx
}

/// kubectl with the admin kubeconfig, its stdout piped, killed when the guard drops.
fn kubectl_spawn(
    api: &ApiServer,
    kubectl: &Path,
    args: &[&str],
    stdin: bool,
) -> common::ChildGuard {
    let child = Command::new(kubectl)
        .arg("--kubeconfig")
        .arg(&api.admin_kubeconfig)
        .args(args)
        .stdin(if stdin {
            std::process::Stdio::piped()
        } else {
            std::process::Stdio::null()
        })
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("kubectl");
    common::ChildGuard(child)
}

/// The kubectls the edge's verbs are run with: the oldest here and the newest (1.33).
/// A missing one is said loudly.
fn edge_kubectls() -> Vec<PathBuf> {
    let mut found = Vec::new();
    for version in ["1.28", "1.33"] {
        let path = PathBuf::from(format!("/usr/lib/google-cloud-sdk/bin/kubectl.{version}"));
        if path.is_file() {
            found.push(path);
        } else {
            privileged::cannot_run(&format!(
                "{} is absent: not checked with it",
                path.display()
            ));
        }
    }
    assert!(!found.is_empty(), "no kubectl 1.28 or 1.33");
    found
}

/// `kubectl 1.33` for `.../kubectl.1.33`.
fn kubectl_version(kubectl: &Path) -> String {
    let name = kubectl.file_name().expect("name").to_string_lossy();
    format!("kubectl {}", name.trim_start_matches("kubectl."))
}

/// What a user runs against a pod on the edge with `kubectl` (`version` in each
/// figure), each asserted on what kubectl shows.
fn workload_checks(
    api: &ApiServer,
    kubectl: &Path,
    version: &str,
    dir: &Path,
    context: &dyn Fn() -> String,
) {
    use std::io::Write;
    let figure = |line: &str| figure(&format!("{version}: {line}"));
    let ok = |what: &str, out: std::process::Output| {
        assert!(
            out.status.success(),
            "kubectl {what}: {}: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr),
            context()
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let logs = ok(
        "logs",
        api.kubectl(kubectl, &["logs", WORKLOAD, "-c", "main"]),
    );
    figure(&format!(
        "kubectl logs: ok, {} lines from `tick 1`",
        logs.lines().count()
    ));

    // logs -f: lines arrive while the pod writes them.
    let mut follow = kubectl_spawn(
        api,
        kubectl,
        &["logs", "-f", "--tail=1", WORKLOAD, "-c", "main"],
        false,
    );
    let lines = timed_lines(follow.0.stdout.take().expect("stdout"));
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(15);
    while got.len() < 10 && Instant::now() < deadline {
        if let Ok(l) = lines.recv_timeout(Duration::from_secs(1)) {
            got.push(l);
        }
    }
    drop(follow);
    assert!(got.len() >= 10, "kubectl logs -f: {got:?}\n{}", context());
    let ticks: Vec<u64> = got
        .iter()
        .filter_map(|(_, l)| l.strip_prefix("tick ")?.parse().ok())
        .collect();
    assert!(
        ticks.len() == got.len() && ticks.windows(2).all(|w| w[1] == w[0] + 1),
        "kubectl logs -f: not consecutive ticks: {got:?}"
    );
    let spread = got[got.len() - 1].0 - got[0].0;
    assert!(
        spread >= Duration::from_secs(1),
        "kubectl logs -f: all at once ({spread:?})"
    );
    figure(&format!(
        "kubectl logs -f: ok, {} lines (tick {} to {}) arriving over {:.1} s",
        got.len(),
        ticks[0],
        ticks[ticks.len() - 1],
        spread.as_secs_f64()
    ));

    // exec: stdin, stdout, stderr and the exit code.
    let out = api.kubectl_as(
        kubectl,
        &api.admin_kubeconfig,
        &[
            "exec",
            "-i",
            WORKLOAD,
            "-c",
            "main",
            "--",
            "sh",
            "-c",
            "tr a-z A-Z; echo to-stderr >&2; exit 3",
        ],
        Some(b"through the tunnel\n"),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(3),
        "kubectl exec: {stderr}\n{}",
        context()
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "THROUGH THE TUNNEL\n");
    assert!(
        stderr.contains("to-stderr"),
        "kubectl exec stderr: {stderr}"
    );
    figure("kubectl exec -i: ok (stdin in, stdout upper-cased, stderr, exit code 3)");

    // exec -t: a TTY (kubectl needs a terminal of its own for it: `script` gives one,
    // sized 41x133, which kubectl sends as the TTY's first resize). The resize travels
    // beside the command's start, so the pod reads the size a moment later: at once it
    // may still be 0x0, which busybox's `stty size` reports as an error.
    let line = format!(
        "stty rows 41 cols 133; exec {} --kubeconfig {} exec -it {WORKLOAD} -c main -- sh -c 'tty; sleep 1; stty size 2>&1'",
        kubectl.display(),
        api.admin_kubeconfig.display()
    );
    let out = run(Command::new("timeout").args(["30", "script", "-qec", &line, "/dev/null"]))
        .unwrap_or_else(|e| panic!("kubectl exec -it: {e}\n{}", context()));
    // `^@`: the terminal's echo of the end of script's (empty) input.
    let shown = String::from_utf8_lossy(&out.stdout)
        .replace("^@", "")
        .replace("\r\n", " | ");
    assert!(
        shown.contains("/dev/pts/"),
        "kubectl exec -it: no TTY in the pod: {shown:?}"
    );
    assert!(
        shown.contains("41 133"),
        "kubectl exec -it: the pod's TTY is not the 41x133 kubectl's terminal has: {shown:?}"
    );
    figure(&format!(
        "kubectl exec -it: ok, in the pod `tty; stty size`: {shown}"
    ));

    // attach: to the `echo` container's stdin and stdout.
    let mut attach = kubectl_spawn(
        api,
        kubectl,
        &["attach", "-i", WORKLOAD, "-c", "echo"],
        true,
    );
    let lines = timed_lines(attach.0.stdout.take().expect("stdout"));
    let mut stdin = attach.0.stdin.take().expect("stdin");
    let deadline = Instant::now() + Duration::from_secs(20);
    let answer = loop {
        // kubectl attaches in the background; lines sent before are not lost to the
        // container but may precede the attach, so send until one comes back.
        let _ = stdin.write_all(b"hello through the tunnel\n");
        if let Ok((_, l)) = lines.recv_timeout(Duration::from_secs(1)) {
            break l;
        }
        assert!(
            Instant::now() < deadline,
            "kubectl attach: no answer\n{}",
            context()
        );
    };
    drop(stdin);
    drop(attach);
    assert_eq!(answer, "attached: hello through the tunnel");
    figure(&format!("kubectl attach -i: ok, {answer:?}"));

    // cp, both ways, checksummed.
    let mut data = vec![0u8; 4 << 20];
    std::io::Read::read_exact(
        &mut std::fs::File::open("/dev/urandom").expect("urandom"),
        &mut data,
    )
    .expect("random");
    let up = dir.join("cp-up");
    std::fs::write(&up, &data).expect("cp-up");
    let target = format!("{WORKLOAD}:/tmp/up");
    ok(
        "cp to the pod",
        api.kubectl(
            kubectl,
            &["cp", "-c", "main", up.to_str().expect("utf-8"), &target],
        ),
    );
    let in_pod = sha256_in_pod(api, kubectl, "/tmp/up");
    let down = dir.join("cp-down");
    ok(
        "cp from the pod",
        api.kubectl(
            kubectl,
            &["cp", "-c", "main", &target, down.to_str().expect("utf-8")],
        ),
    );
    let back = std::fs::read(&down).expect("cp-down");
    assert_eq!(in_pod, sha256_hex(&data), "kubectl cp to the pod");
    assert_eq!(
        sha256_hex(&back),
        sha256_hex(&data),
        "kubectl cp from the pod"
    );
    figure(&format!(
        "kubectl cp: ok both ways, 4 MiB, sha256 {}",
        &in_pod[..16]
    ));

    // port-forward: 64 MiB from the pod's HTTP server, checksummed.
    let made = ok(
        "exec (make the file)",
        api.kubectl(
            kubectl,
            &[
                "exec",
                WORKLOAD,
                "-c",
                "main",
                "--",
                "sh",
                "-c",
                "head -c 67108864 /dev/urandom > /www/big",
            ],
        ),
    );
    assert!(made.is_empty(), "{made}");
    let want = sha256_in_pod(api, kubectl, "/www/big");
    let mut forward = kubectl_spawn(
        api,
        kubectl,
        &[
            "port-forward",
            &format!("pod/{WORKLOAD}"),
            &format!(":{HTTP_PORT}"),
        ],
        false,
    );
    let lines = timed_lines(forward.0.stdout.take().expect("stdout"));
    let port = loop {
        let (_, l) = lines
            .recv_timeout(Duration::from_secs(15))
            .unwrap_or_else(|_| panic!("kubectl port-forward printed no port\n{}", context()));
        if let Some(rest) = l.strip_prefix("Forwarding from 127.0.0.1:") {
            break rest.split(' ').next().expect("port").to_string();
        }
    };
    let file = dir.join("forwarded");
    let started = Instant::now();
    run(Command::new("curl")
        .args(["-sf", "--max-time", "120", "-o"])
        .arg(&file)
        .arg(format!("http://127.0.0.1:{port}/big")))
    .unwrap_or_else(|e| panic!("through kubectl port-forward: {e}\n{}", context()));
    let took = started.elapsed();
    drop(forward);
    let got = std::fs::read(&file).expect("forwarded file");
    assert_eq!(got.len(), 64 << 20, "kubectl port-forward: size");
    assert_eq!(sha256_hex(&got), want, "kubectl port-forward: checksum");
    figure(&format!(
        "kubectl port-forward: ok, 64 MiB over HTTP in {:.1} s ({:.0} MiB/s), sha256 {}",
        took.as_secs_f64(),
        64.0 / took.as_secs_f64(),
        &want[..16]
    ));

    // The monitoring paths: what metrics-server, kubectl top and Prometheus read.
    let raw = |path: &str| {
        ok(
            &format!("get --raw {path}"),
            api.kubectl(kubectl, &["get", "--raw", path]),
        )
    };
    let resource = raw(&format!("/api/v1/nodes/{EDGE}/proxy/metrics/resource"));
    assert!(
        resource
            .lines()
            .any(|l| l.starts_with("node_cpu_usage_seconds_total ")),
        "{resource}"
    );
    let workload_cpu = resource
        .lines()
        .find(|l| {
            l.starts_with("container_cpu_usage_seconds_total{")
                && l.contains(&format!("pod=\"{WORKLOAD}\""))
        })
        .unwrap_or_else(|| panic!("no CPU of the workload in /metrics/resource:\n{resource}"));
    figure(&format!(
        "kubectl get --raw .../metrics/resource: ok, {} bytes; {workload_cpu}",
        resource.len()
    ));
    let summary = raw(&format!("/api/v1/nodes/{EDGE}/proxy/stats/summary"));
    let summary: serde_json::Value = serde_json::from_str(&summary).expect("stats/summary is JSON");
    assert_eq!(summary["node"]["nodeName"], EDGE);
    let pods: Vec<&str> = summary["pods"]
        .as_array()
        .expect("pods")
        .iter()
        .filter_map(|p| p["podRef"]["name"].as_str())
        .collect();
    assert!(pods.contains(&WORKLOAD), "{pods:?}");
    figure(&format!(
        "kubectl get --raw .../stats/summary: ok, node {EDGE} memory working set {} bytes, pods {pods:?}",
        summary["node"]["memory"]["workingSetBytes"]
    ));
    let cadvisor = raw(&format!("/api/v1/nodes/{EDGE}/proxy/metrics/cadvisor"));
    let series = cadvisor.lines().filter(|l| !l.starts_with('#')).count();
    assert!(
        cadvisor.contains("container_memory_working_set_bytes{"),
        "{}",
        &cadvisor[..cadvisor.len().min(2000)]
    );
    figure(&format!(
        "kubectl get --raw .../metrics/cadvisor: ok, {} bytes, {series} series",
        cadvisor.len()
    ));

    // logs --previous, after `main` exits and is restarted (again, for a second kubectl).
    let restarts = || {
        api.kubectl_ok(
            kubectl,
            &[
                "get",
                "pod",
                WORKLOAD,
                "-o",
                "jsonpath={.status.containerStatuses[?(@.name==\"main\")].restartCount}",
            ],
        )
        .trim()
        .parse::<u32>()
        .unwrap_or(0)
    };
    let restarts_before = restarts();
    ok(
        "exec touch",
        api.kubectl(
            kubectl,
            &[
                "exec",
                WORKLOAD,
                "-c",
                "main",
                "--",
                "touch",
                "/tmp/restart",
            ],
        ),
    );
    let restarted = wait_for(Duration::from_secs(90), "main restarted", || {
        restarts() > restarts_before
            && api
                .kubectl(kubectl, &["logs", WORKLOAD, "-c", "main"])
                .stdout
                .starts_with(b"tick 1\n")
            && api
                .kubectl(kubectl, &["logs", "--previous", WORKLOAD, "-c", "main"])
                .stdout
                .ends_with(b"restarting\n")
    });
    let previous = ok(
        "logs --previous",
        api.kubectl(kubectl, &["logs", "--previous", WORKLOAD, "-c", "main"]),
    );
    figure(&format!(
        "kubectl logs --previous: ok after {:.1} s, {} lines ending {:?}",
        restarted.as_secs_f64(),
        previous.lines().count(),
        previous.lines().last()
    ));
}

/// kube-apiserver's upgrades to a kubelet (its proxy's log at `--vmodule=upgradeaware=6`,
/// with the request's headers: 1.36 logs them as JSON on one line, 1.28 as a Go map on
/// the next): how many calls of each kind went with which protocol.
fn kubelet_upgrades(log: &str) -> std::collections::BTreeMap<String, usize> {
    let header = |text: &str, name: &str| {
        [format!("\"{name}\":[\""), format!("{name}:[")]
            .iter()
            .find_map(|start| {
                let rest = text.split(start.as_str()).nth(1)?;
                Some(rest.split([']', '"']).next()?.to_string())
            })
    };
    let mut calls = std::collections::BTreeMap::new();
    let mut lines = log.lines().peekable();
    while let Some(line) = lines.next() {
        let Some(at) = line.find("Connecting to backend proxy") else {
            continue;
        };
        let mut text = line[at..].to_string();
        while let Some(next) = lines.peek().filter(|l| l.starts_with(' ')) {
            text += next;
            lines.next();
        }
        let Some(call) = ["/exec/", "/attach/", "/portForward/"]
            .iter()
            .find(|c| text.contains(*c))
        else {
            continue;
        };
        let tty = if text.contains("tty=1") { " -t" } else { "" };
        let protocol = match header(&text, "Upgrade") {
            Some(u) if u.eq_ignore_ascii_case("websocket") => format!(
                "WebSocket ({})",
                header(&text, "Sec-Websocket-Protocol").unwrap_or_default()
            ),
            Some(u) => format!(
                "{u} ({})",
                header(&text, "X-Stream-Protocol-Version").unwrap_or_default()
            ),
            None => "no upgrade".to_string(),
        };
        *calls
            .entry(format!("{}{tty}: {protocol}", call.trim_matches('/')))
            .or_default() += 1;
    }
    calls
}
