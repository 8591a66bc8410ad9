//! A real master node on this machine, beside the API server and kube-controller-manager
//! of [`super::apiserver`]: kube-scheduler, containerd and a kubelet, of the version in
//! `KUBEBUILDER_ASSETS`, 1.28 or 1.36 (the `.gz` ones unpacked into the test's directory).
//!
//! Everything keeps its state under the test's directory, and what it had to change on
//! the host is put back when dropped: containerd's root, state and socket are the test's;
//! the kubelet's pods run under a cgroup root of the test's own, whose processes are
//! killed and whose cgroups are removed at the end; its root directory and every mount
//! below the test's directory are unmounted; the kernel tunables the kubelet sets are
//! restored.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use rcgen::ExtendedKeyUsagePurpose;

use super::apiserver::{
    ApiServer, Assets, Credential, Daemon, Endpoint, free_ports, write_kubeconfig,
};

/// The sandbox image the containerd config names: built here from the static `pause`.
const PAUSE_IMAGE: &str = "registry.k8s.io/pause:3.9";

/// The kernel tunables a kubelet sets when `protectKernelDefaults` is false (the
/// default): read before it starts and written back when the node goes.
const KUBELET_SYSCTLS: [&str; 6] = [
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
];

/// Runs `cmd`; its output, or why it failed.
pub fn run(cmd: &mut Command) -> Result<Output, String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{cmd:?}: {e}"))?;
    if out.status.success() {
        Ok(out)
    } else {
        Err(format!(
            "{cmd:?} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// The node's gzip-compressed binaries of `KUBEBUILDER_ASSETS`, unpacked into `dir`.
pub struct Binaries {
    pub scheduler: PathBuf,
    pub kubelet: PathBuf,
    pub pause: PathBuf,
}

impl Binaries {
    pub fn unpack(assets: &Assets, dir: &Path) -> Result<Self, String> {
        Ok(Self {
            scheduler: assets.unpack("kube-scheduler", dir)?,
            kubelet: assets.unpack("kubelet", dir)?,
            pause: assets.unpack("pause", dir)?,
        })
    }
}

/// Waits until `https://127.0.0.1:<port>/healthz` answers ok, or panics with the log.
fn wait_healthz(daemon: &Daemon, port: u16) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let url = format!("https://127.0.0.1:{port}/healthz");
    loop {
        let ok = Command::new("curl")
            .args(["-skf", "--max-time", "2", &url])
            .output()
            .is_ok_and(|o| o.status.success());
        if ok {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{} not healthy in 60 s:\n{}",
            daemon.name,
            daemon.log_tail(30)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// kube-scheduler against `api`, as the admin: it binds the DaemonSet's pods.
pub struct Scheduler {
    _daemon: Daemon,
}

impl Scheduler {
    pub fn start(bins: &Binaries, api: &ApiServer, dir: &Path) -> Self {
        let admin = api.admin_kubeconfig.display().to_string();
        let [port] = free_ports();
        let mut cmd = Command::new(&bins.scheduler);
        cmd.arg(format!("--kubeconfig={admin}"))
            .arg(format!("--authentication-kubeconfig={admin}"))
            .arg(format!("--authorization-kubeconfig={admin}"))
            .args(["--leader-elect=false", "--bind-address=127.0.0.1"])
            .arg(format!("--secure-port={port}"));
        let daemon = Daemon::start("kube-scheduler", dir, cmd);
        wait_healthz(&daemon, port);
        Self { _daemon: daemon }
    }
}

/// Host settings the node changes, put back when dropped: the kernel tunables the
/// kubelet sets, `/sys` made a shared mount (as systemd makes every mount, so that the
/// cloud's init container can mount the host's bpffs through mount propagation), and
/// that bpffs at `/sys/fs/bpf`.
pub struct HostChanges {
    sysctls: Vec<(&'static str, String)>,
    sys_made_shared: bool,
}

impl HostChanges {
    /// Takes note of the host as it is, then makes `/sys` shared if it is not.
    pub fn record() -> Result<Self, String> {
        let sysctls = KUBELET_SYSCTLS
            .iter()
            .map(|k| {
                let v = std::fs::read_to_string(Path::new("/proc/sys").join(k))
                    .map_err(|e| format!("/proc/sys/{k}: {e}"))?;
                Ok((*k, v.trim().to_string()))
            })
            .collect::<Result<_, String>>()?;
        let sys_made_shared = !mount_is_shared("/sys")?;
        if sys_made_shared {
            run(Command::new("mount").args(["--make-shared", "/sys"]))?;
        }
        Ok(Self {
            sysctls,
            sys_made_shared,
        })
    }
}

impl Drop for HostChanges {
    fn drop(&mut self) {
        for (k, v) in &self.sysctls {
            let _ = std::fs::write(Path::new("/proc/sys").join(k), v);
        }
        // The bpffs the cloud's init container mounted (the test checked there was none).
        let _ = Command::new("umount").arg("/sys/fs/bpf").status();
        if self.sys_made_shared {
            let _ = Command::new("mount")
                .args(["--make-private", "/sys"])
                .status();
        }
    }
}

/// Whether the mount at exactly `target` is in a shared peer group.
fn mount_is_shared(target: &str) -> Result<bool, String> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").map_err(|e| e.to_string())?;
    info.lines()
        .find(|l| l.split(' ').nth(4) == Some(target))
        .map(|l| l.split(" - ").next().unwrap_or("").contains(" shared:"))
        .ok_or_else(|| format!("{target} is not a mount point"))
}

/// Unmounts every mount point under `dir`, deepest first.
fn unmount_below(dir: &Path) {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut points: Vec<PathBuf> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(PathBuf::from)
        .filter(|p| p.starts_with(dir))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for p in points {
        let _ = nix::mount::umount2(&p, nix::mount::MntFlags::MNT_DETACH);
    }
}

/// A second node's own view of this machine: its network namespace, and a mount
/// namespace where `/var/log`, `/var/lib/kubelet` and `/var/lib/cni` (the CNI plugins'
/// address leases and containerd's cache of their results) are directories of the
/// test's (two
/// kubelets on one host share `/var/log/pods`, where each removes the other's pods'
/// logs as orphans, and the device plugin socket, which `--root-dir` does not move:
/// the second to bind it stops with "address already in use"). Its `/sys` is shared
/// within the node and a slave of the host's: a master's cloud mounts the node's own
/// bpffs at `/sys/fs/bpf` by Bidirectional propagation, which the kubelet allows only on
/// a shared mount, and that bpffs stays on the node. Entered
/// with `nsenter`: `ip netns exec` also remounts `/sys`, where the kubelet then finds no
/// cgroups. Mounts made inside (the node's volumes, container root filesystems) go with
/// the namespace.
pub struct NodeNamespaces {
    netns: PathBuf,
    /// A private bind mount of a directory of the test's, holding `mnt`, the mount
    /// namespace kept by a bind mount of its nsfs file.
    holder: PathBuf,
}

impl NodeNamespaces {
    pub fn new(netns: &str, dir: &Path) -> Result<Self, String> {
        let holder = dir.join("mount-namespace");
        let var_log = dir.join("var-log");
        let var_lib_kubelet = dir.join("var-lib-kubelet");
        let var_lib_cni = dir.join("var-lib-cni");
        // The mount points (the host's own kubelet and CNI plugins make them too).
        let kubelet_dir = Path::new("/var/lib/kubelet");
        let cni_dir = Path::new("/var/lib/cni");
        for d in [
            &holder,
            &var_log,
            &var_lib_kubelet,
            &var_lib_cni,
            kubelet_dir,
            cni_dir,
        ] {
            std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
        }
        run(Command::new("mount")
            .arg("--bind")
            .arg(&holder)
            .arg(&holder))?;
        let ns = Self {
            netns: Path::new("/run/netns").join(netns),
            holder,
        };
        // A namespace file may only be bind-mounted below a private mount.
        run(Command::new("mount").arg("--make-private").arg(&ns.holder))?;
        let mnt = ns.holder.join("mnt");
        std::fs::write(&mnt, "").map_err(|e| format!("{}: {e}", mnt.display()))?;
        // A slave: the host's mounts still reach it, its own never reach the host.
        run(Command::new("unshare")
            .arg(format!("--mount={}", mnt.display()))
            .args(["--propagation", "slave", "sh", "-c"])
            .arg(r#"mount --bind "$0" /var/log && mount --bind "$1" /var/lib/kubelet && mount --bind "$2" /var/lib/cni && mount --make-shared /sys"#)
            .arg(&var_log)
            .arg(&var_lib_kubelet)
            .arg(&var_lib_cni))?;
        Ok(ns)
    }

    /// A command that runs `program` on this node.
    pub fn command(&self, program: &Path) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--mount={}", self.holder.join("mnt").display()))
            .arg(format!("--net={}", self.netns.display()))
            .arg("--")
            .arg(program);
        cmd
    }
}

impl Drop for NodeNamespaces {
    fn drop(&mut self) {
        // The namespace goes when its last process has (the kubelet's and containerd's
        // drops kill them first) and this last reference is unmounted.
        let _ = nix::mount::umount2(&self.holder.join("mnt"), nix::mount::MntFlags::MNT_DETACH);
        let _ = nix::mount::umount2(&self.holder, nix::mount::MntFlags::MNT_DETACH);
    }
}

/// A command for `program`, on the host or on `node`.
fn command_on(node: Option<&NodeNamespaces>, program: &Path) -> Command {
    match node {
        Some(node) => node.command(program),
        None => Command::new(program),
    }
}

/// containerd with its root, state, config and socket in `dir`.
pub struct Containerd {
    daemon: Daemon,
    pub socket: PathBuf,
    dir: PathBuf,
}

impl Containerd {
    /// On the host, or on `node`; with `pod_network`, the CRI plugin gives pods their
    /// own network namespace through it.
    pub fn start(
        dir: &Path,
        node: Option<&NodeNamespaces>,
        pod_network: Option<&PodNetwork>,
    ) -> Result<Self, String> {
        let dir = dir.join("containerd");
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let socket = dir.join("containerd.sock");
        let default = run(Command::new("containerd").args(["config", "default"]))?;
        let mut config = String::from_utf8_lossy(&default.stdout).into_owned();
        let under = |name: &str| format!("\"{}\"", dir.join(name).display());
        let cni = pod_network.map(|n| {
            [
                (
                    "bin_dir = \"/opt/cni/bin\"",
                    format!("bin_dir = \"{CNI_PLUGINS}\""),
                ),
                (
                    "conf_dir = \"/etc/cni/net.d\"",
                    format!("conf_dir = \"{}\"", n.conf_dir.display()),
                ),
                // The pods' network namespaces are pinned under the state directory
                // above, not in the host's /run/netns.
                (
                    "netns_mounts_under_state_dir = false",
                    "netns_mounts_under_state_dir = true".to_string(),
                ),
            ]
        });
        for (from, to) in cni.into_iter().flatten().chain([
            (
                "root = \"/var/lib/containerd\"",
                format!("root = {}", under("root")),
            ),
            (
                "state = \"/run/containerd\"",
                format!("state = {}", under("state")),
            ),
            (
                "address = \"/run/containerd/containerd.sock\"",
                format!("address = \"{}\"", socket.display()),
            ),
            (
                "path = \"/opt/containerd\"",
                format!("path = {}", under("opt")),
            ),
            (
                "sandbox_image = \"registry.k8s.io/pause:3.6\"",
                format!("sandbox_image = \"{PAUSE_IMAGE}\""),
            ),
            // Without it every sandbox fails here: this machine refuses writes to
            // /proc/self/oom_score_adj below the current value.
            (
                "restrict_oom_score_adj = false",
                "restrict_oom_score_adj = true".to_string(),
            ),
        ]) {
            if !config.contains(from) {
                return Err(format!("containerd's default config has no `{from}`"));
            }
            config = config.replacen(from, &to, 1);
        }
        let path = dir.join("config.toml");
        std::fs::write(&path, config).map_err(|e| e.to_string())?;
        let mut cmd = command_on(node, Path::new("containerd"));
        cmd.arg("--config").arg(&path);
        let daemon = Daemon::start("containerd", &dir, cmd);
        let containerd = Self {
            daemon,
            socket,
            dir,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while containerd.ctr(&["version"]).is_err() {
            if Instant::now() > deadline {
                return Err(format!(
                    "containerd did not answer in 30 s:\n{}",
                    containerd.daemon.log_tail(20)
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(containerd)
    }

    /// `ctr -n k8s.io` (the CRI's namespace) against this containerd.
    pub fn ctr(&self, args: &[&str]) -> Result<Output, String> {
        run(Command::new("ctr")
            .arg("--address")
            .arg(&self.socket)
            .args(["-n", "k8s.io"])
            .args(args))
    }

    /// Imports an OCI archive into the CRI's image store, under the name it carries.
    pub fn import(&self, archive: &Path) -> Result<(), String> {
        let archive = archive.to_str().ok_or("non-utf-8 path")?;
        self.ctr(&["images", "import", archive]).map(drop)
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        // The pods' processes are killed with their cgroup root (Kubelet's drop, first);
        // the shims this containerd started go with their tasks.
        if let Ok(tasks) = self.ctr(&["tasks", "ls", "-q"]) {
            for id in String::from_utf8_lossy(&tasks.stdout).lines() {
                let _ = self.ctr(&["tasks", "delete", "-f", id]);
            }
        }
        let socket = self.socket.display().to_string();
        let _ = self.daemon.child.kill();
        let _ = self.daemon.child.wait();
        for pid in processes_mentioning(&socket) {
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        }
        unmount_below(&self.dir);
    }
}

/// Where Debian's containernetworking-plugins installs the CNI plugins.
const CNI_PLUGINS: &str = "/usr/lib/cni";

/// A node's pod network, as a simple CNI (flannel's host-gw, kubenet) makes it: the
/// `bridge` plugin puts each pod on a bridge in the node's network namespace, which is
/// the pods' gateway, with an address from `host-local` in the node's `subnet`; other
/// nodes route the subnet to the node's address. No masquerade (`ipMasq` false: no
/// iptables rule anywhere), so a pod's connections leave with the pod's own address.
/// Its config is a file under the node's directory.
pub struct PodNetwork {
    pub subnet: String,
    /// The bridge, in the node's network namespace.
    pub bridge: &'static str,
    conf_dir: PathBuf,
}

impl PodNetwork {
    /// The network name in the config, and the directory of its leases under
    /// `/var/lib/cni/networks` (the node's own, [`NodeNamespaces`]).
    pub const NAME: &'static str = "tunnel-e2e";

    pub fn write(dir: &Path, subnet: &str) -> Result<Self, String> {
        let conf_dir = dir.join("cni");
        std::fs::create_dir_all(&conf_dir).map_err(|e| e.to_string())?;
        let network = Self {
            subnet: subnet.to_string(),
            bridge: "cni0",
            conf_dir,
        };
        let conf = serde_json::json!({
            "cniVersion": "0.4.0",
            "name": Self::NAME,
            "plugins": [{
                "type": "bridge",
                "bridge": network.bridge,
                "isGateway": true,
                "ipMasq": false,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": subnet}]],
                    "routes": [{"dst": "0.0.0.0/0"}]
                }
            }]
        });
        let path = network.conf_dir.join("10-tunnel-e2e.conflist");
        std::fs::write(&path, conf.to_string()).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(network)
    }
}

/// PIDs of the processes whose command line contains `needle` (this containerd's shims
/// name its socket).
fn processes_mentioning(needle: &str) -> Vec<nix::unistd::Pid> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(needle))
        })
        .map(nix::unistd::Pid::from_raw)
        .collect()
}

/// Builds the sandbox image from the static `pause` with podman (`FROM scratch`, no
/// registry) and returns its OCI archive.
pub fn pause_image(pause: &Path, dir: &Path) -> Result<PathBuf, String> {
    let context = dir.join("pause-image");
    std::fs::create_dir_all(&context).map_err(|e| e.to_string())?;
    std::fs::copy(pause, context.join("pause")).map_err(|e| e.to_string())?;
    std::fs::write(
        context.join("Containerfile"),
        "FROM scratch\nCOPY pause /pause\nENTRYPOINT [\"/pause\"]\n",
    )
    .map_err(|e| e.to_string())?;
    run(Command::new("podman")
        .args(["build", "--quiet", "--tag", PAUSE_IMAGE, "--file"])
        .arg(context.join("Containerfile"))
        .arg(&context))?;
    let archive = dir.join("pause.oci.tar");
    let saved = run(Command::new("podman")
        .args(["save", "--format", "oci-archive", "--output"])
        .arg(&archive)
        .arg(PAUSE_IMAGE));
    // Out of podman's store again, whether or not the save worked.
    let _ = Command::new("podman").args(["rmi", PAUSE_IMAGE]).output();
    saved.map(|_| archive)
}

/// The workload image of the node tests, `docker.io/library/busybox-e2e:1` to containerd.
pub const WORKLOAD_IMAGE: &str = "busybox-e2e:1";
const BUSYBOX: &str = "/bin/busybox";
/// The host's curl, with the libraries it loads, for the clients of the kubelets that
/// run in pods (what metrics-server reads).
const CURL: &str = "/usr/bin/curl";

/// The workload image: Debian's static busybox `FROM scratch` (a shell, `tar` for
/// `kubectl cp`, `httpd`, `sha256sum`) and the host's curl with the shared libraries
/// `ldd` lists, built with podman without a registry; its OCI archive.
pub fn busybox_image(dir: &Path) -> Result<PathBuf, String> {
    let context = dir.join("busybox-image");
    let rootfs = context.join("rootfs");
    let bin = rootfs.join("bin");
    for d in [&bin, &rootfs.join("tmp")] {
        std::fs::create_dir_all(d).map_err(|e| e.to_string())?;
    }
    std::fs::copy(BUSYBOX, bin.join("busybox"))
        .map_err(|e| format!("{BUSYBOX} (Debian's busybox-static): {e}"))?;
    // "libc.so.6 => /lib/.../libc.so.6 (0x..)" and the loader, "/lib64/ld-linux... (0x..)".
    let libraries = run(Command::new("ldd").arg(CURL))?;
    let libraries = String::from_utf8_lossy(&libraries.stdout).into_owned();
    let files = libraries
        .lines()
        .filter_map(|l| l.split_whitespace().find(|w| w.starts_with('/')));
    for file in files.chain([CURL]) {
        let to = rootfs.join(file.trim_start_matches('/'));
        std::fs::create_dir_all(to.parent().expect("a parent")).map_err(|e| e.to_string())?;
        // Through symlinks: the image holds the files themselves.
        std::fs::copy(file, &to).map_err(|e| format!("{file}: {e}"))?;
    }
    let applets = run(Command::new(BUSYBOX).arg("--list"))?;
    for applet in String::from_utf8_lossy(&applets.stdout).lines() {
        if applet != "busybox" {
            std::os::unix::fs::symlink("busybox", bin.join(applet)).map_err(|e| e.to_string())?;
        }
    }
    std::fs::write(
        context.join("Containerfile"),
        "FROM scratch\nCOPY rootfs /\n",
    )
    .map_err(|e| e.to_string())?;
    let tag = format!("docker.io/library/{WORKLOAD_IMAGE}");
    run(Command::new("podman")
        .args(["build", "--quiet", "--tag", &tag, "--file"])
        .arg(context.join("Containerfile"))
        .arg(&context))?;
    let archive = dir.join("busybox.oci.tar");
    let saved = run(Command::new("podman")
        .args(["save", "--format", "oci-archive", "--output"])
        .arg(&archive)
        .arg(&tag));
    // Out of podman's store again, whether or not the save worked.
    let _ = Command::new("podman").args(["rmi", &tag]).output();
    saved.map(|_| archive)
}

/// A kubelet registering node `name` at `ip`, running its pods through `containerd`
/// under a cgroup root named after it, on the host or on `node`.
pub struct Kubelet {
    daemon: Daemon,
    cgroup_root: String,
    root_dir: PathBuf,
}

impl Kubelet {
    pub fn start(
        bin: &Path,
        api: Endpoint<'_>,
        containerd: &Containerd,
        name: &str,
        ip: Ipv4Addr,
        dir: &Path,
        node: Option<&NodeNamespaces>,
    ) -> Result<Self, String> {
        let dir = dir.join(format!("kubelet-{name}"));
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let cgroup_root = format!("tunnel-e2e-{name}-{}", std::process::id());
        for hierarchy in cgroup_hierarchies() {
            let path = hierarchy.join(&cgroup_root);
            std::fs::create_dir_all(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            // A v1 cpuset cgroup takes no process until it has CPUs and memory nodes.
            for file in ["cpuset.cpus", "cpuset.mems"] {
                if let Ok(v) = std::fs::read_to_string(hierarchy.join(file)) {
                    let _ = std::fs::write(path.join(file), v.trim());
                }
            }
        }
        let pki = api.pki;
        let client = format!("kubelet-{name}");
        pki.issue(
            &client,
            &format!("system:node:{name}"),
            Some("system:nodes"),
            &[],
            ExtendedKeyUsagePurpose::ClientAuth,
        );
        let serving = format!("kubelet-serving-{name}");
        pki.issue(
            &serving,
            name,
            None,
            &[&ip.to_string()],
            ExtendedKeyUsagePurpose::ServerAuth,
        );
        let kubeconfig = dir.join("kubeconfig");
        write_kubeconfig(&kubeconfig, api.url, pki, Credential::Cert(&client));
        let config = dir.join("config.yaml");
        // Evictions and image GC off: a busy CI disk must not take the node's pods away
        // (0% turns a threshold off; even 1% of a big disk shared with builds is too
        // much: under DiskPressure the kubelet admits no pod).
        // failCgroupV1 false: 1.35+ refuses to start on a host with cgroup v1 controllers
        // (these machines mount them beside the v2 hierarchy); 1.28 ignores the key.
        // Webhook authentication and authorization, as kubeadm configures kubelets: a
        // pod's ServiceAccount token (metrics-server's, Prometheus') is checked with the
        // API server, and what it may read is its RBAC (the API server's own client
        // certificate is in system:masters).
        let yaml = format!(
            "apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: {ip}
port: 10250
readOnlyPort: 0
healthzPort: 0
cgroupDriver: cgroupfs
cgroupRoot: /{cgroup_root}
containerRuntimeEndpoint: unix://{socket}
failSwapOn: false
failCgroupV1: false
makeIPTablesUtilChains: false
tlsCertFile: {cert}
tlsPrivateKeyFile: {key}
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: true}}
  x509: {{clientCAFile: {ca}}}
authorization: {{mode: Webhook}}
evictionHard: {{memory.available: 1Mi, nodefs.available: '0%', imagefs.available: '0%'}}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
",
            socket = containerd.socket.display(),
            cert = pki.path(&format!("{serving}.crt")),
            key = pki.path(&format!("{serving}.key")),
            ca = pki.path("ca.crt"),
        );
        std::fs::write(&config, yaml).map_err(|e| e.to_string())?;
        let root_dir = dir.join("root");
        let mut cmd = command_on(node, bin);
        cmd.arg("--config")
            .arg(&config)
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .arg(format!("--hostname-override={name}"))
            .arg(format!("--node-ip={ip}"))
            .arg("--root-dir")
            .arg(&root_dir)
            .arg("--cert-dir")
            .arg(dir.join("pki"))
            .arg("--v=1");
        let daemon = Daemon::start("kubelet", &dir, cmd);
        Ok(Self {
            daemon,
            cgroup_root,
            root_dir,
        })
    }

    pub fn log_tail(&self, n: usize) -> String {
        self.daemon.log_tail(n)
    }

    /// The cgroup its pods run under, as `cgroup_root` (the v2 hierarchy) names it.
    pub fn pods_cgroup(&self, cgroup_root: &Path) -> PathBuf {
        cgroup_root.join(&self.cgroup_root)
    }
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        let _ = self.daemon.child.kill();
        let _ = self.daemon.child.wait();
        // Every process of every pod, then the cgroups, deepest first.
        let hierarchies = cgroup_hierarchies();
        for _round in 0..20 {
            let mut left = 0;
            for h in &hierarchies {
                for cg in cgroups_below(&h.join(&self.cgroup_root)) {
                    let procs =
                        std::fs::read_to_string(cg.join("cgroup.procs")).unwrap_or_default();
                    for pid in procs.lines().filter_map(|p| p.parse::<i32>().ok()) {
                        left += 1;
                        let _ = nix::sys::signal::kill(
                            nix::unistd::Pid::from_raw(pid),
                            nix::sys::signal::Signal::SIGKILL,
                        );
                    }
                }
            }
            if left == 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        unmount_below(&self.root_dir);
        for h in &hierarchies {
            for cg in cgroups_below(&h.join(&self.cgroup_root)) {
                let _ = std::fs::remove_dir(&cg);
            }
        }
        // Log directories of the test's pods (the kubelet keeps them under /var/log).
        for logs in ["/var/log/pods", "/var/log/containers"] {
            if let Ok(entries) = std::fs::read_dir(logs) {
                for e in entries.flatten() {
                    if e.file_name().to_string_lossy().contains("tunnel-system") {
                        let _ = std::fs::remove_dir_all(e.path());
                        let _ = std::fs::remove_file(e.path());
                    }
                }
            }
        }
    }
}

/// The mounted cgroup hierarchies: each v1 controller's and the v2 (unified) one.
fn cgroup_hierarchies() -> Vec<PathBuf> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    info.lines()
        .filter(|l| {
            let fs = l.split(" - ").nth(1).unwrap_or("");
            fs.starts_with("cgroup ") || fs.starts_with("cgroup2 ")
        })
        .filter_map(|l| l.split(' ').nth(4))
        .map(PathBuf::from)
        .collect()
}

/// `dir` and every cgroup below it, deepest first.
fn cgroups_below(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        if let Ok(entries) = std::fs::read_dir(&d) {
            for e in entries.flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    stack.push(e.path());
                }
            }
            found.push(d);
        }
    }
    found.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    found
}
