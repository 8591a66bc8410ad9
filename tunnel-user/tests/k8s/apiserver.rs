//! etcd and a real kube-apiserver on loopback, by the envtest convention: the binaries
//! come from `KUBEBUILDER_ASSETS` (etcd from there or from PATH), with a throwaway PKI;
//! or, for a cluster of two masters, each in a network namespace of its own, the second
//! API server on the first one's etcd and PKI.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    SanType,
};

/// The binaries a real API server needs, or why they are not here.
pub struct Assets {
    pub apiserver: PathBuf,
    pub etcd: PathBuf,
    /// The directory itself: other components (kube-controller-manager.gz) are here.
    pub dir: PathBuf,
}

impl Assets {
    pub fn find() -> Result<Self, String> {
        let dir = std::env::var_os("KUBEBUILDER_ASSETS")
            .ok_or("KUBEBUILDER_ASSETS is not set (it names a directory with kube-apiserver)")?;
        let dir = PathBuf::from(dir);
        let apiserver = dir.join("kube-apiserver");
        if !apiserver.is_file() {
            return Err(format!("{} does not exist", apiserver.display()));
        }
        let etcd = [dir.join("etcd"), PathBuf::from("/usr/bin/etcd")]
            .into_iter()
            .find(|p| p.is_file())
            .ok_or("no etcd in KUBEBUILDER_ASSETS nor /usr/bin/etcd (Debian etcd-server)")?;
        Ok(Self {
            apiserver,
            etcd,
            dir,
        })
    }

    /// What `kube-apiserver --version` says ("Kubernetes v1.36.2"), for the figures.
    pub fn version(&self) -> String {
        Command::new(&self.apiserver)
            .arg("--version")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_else(|e| format!("unknown version ({e})"))
    }

    /// The minor version (28 for v1.28.7), where a test asserts what differs by version.
    pub fn minor(&self) -> u32 {
        let version = self.version();
        version
            .split('.')
            .nth(1)
            .and_then(|m| m.parse().ok())
            .unwrap_or_else(|| panic!("no minor version in {version:?}"))
    }

    /// `<name>.gz` of the assets, unpacked into `into` as an executable `<name>`.
    pub fn unpack(&self, name: &str, into: &Path) -> Result<PathBuf, String> {
        let gz = self.dir.join(format!("{name}.gz"));
        if !gz.is_file() {
            return Err(format!("{} does not exist", gz.display()));
        }
        let bin = into.join(name);
        let unpacked = Command::new("sh")
            .arg("-c")
            .arg(r#"gunzip -c "$0" > "$1" && chmod +x "$1""#)
            .arg(&gz)
            .arg(&bin)
            .output()
            .map_err(|e| format!("gunzip: {e}"))?;
        if !unpacked.status.success() {
            // A full disk is the likely cause, and gunzip says so.
            return Err(format!(
                "cannot unpack {} into {}: {}",
                gz.display(),
                into.display(),
                String::from_utf8_lossy(&unpacked.stderr).trim()
            ));
        }
        Ok(bin)
    }
}

/// A CA and the certificates the API server, its clients and the kubelet use.
pub struct KubePki {
    pub dir: PathBuf,
    ca_key: KeyPair,
    ca_params: CertificateParams,
}

impl KubePki {
    pub fn new(dir: &Path) -> Self {
        std::fs::create_dir_all(dir).expect("pki dir");
        let ca_key = KeyPair::generate().expect("key");
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("params");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "kubernetes test ca");
        let ca = ca_params.self_signed(&ca_key).expect("ca");
        std::fs::write(dir.join("ca.crt"), ca.pem()).expect("write ca");
        // kube-controller-manager's own signer (kubernetes.io/*) signs with it.
        std::fs::write(dir.join("ca.key"), ca_key.serialize_pem()).expect("write ca key");
        Self {
            dir: dir.to_path_buf(),
            ca_key,
            ca_params,
        }
    }

    pub fn path(&self, file: &str) -> String {
        self.dir.join(file).to_string_lossy().into_owned()
    }

    /// Writes `<name>.crt` / `<name>.key`: subject CN `cn`, O `org` (a group to the API
    /// server), the given DNS names or IP addresses.
    pub fn issue(
        &self,
        name: &str,
        cn: &str,
        org: Option<&str>,
        sans: &[&str],
        usage: ExtendedKeyUsagePurpose,
    ) {
        let key = KeyPair::generate().expect("key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params.subject_alt_names = sans
            .iter()
            .map(|s| match s.parse() {
                Ok(ip) => SanType::IpAddress(ip),
                Err(_) => SanType::DnsName((*s).try_into().expect("dns name")),
            })
            .collect();
        params.distinguished_name.push(DnType::CommonName, cn);
        if let Some(org) = org {
            params
                .distinguished_name
                .push(DnType::OrganizationName, org);
        }
        params.extended_key_usages = vec![usage];
        let issuer = Issuer::from_params(&self.ca_params, &self.ca_key);
        let cert = params.signed_by(&key, &issuer).expect("sign");
        std::fs::write(self.dir.join(format!("{name}.crt")), cert.pem()).expect("write cert");
        std::fs::write(self.dir.join(format!("{name}.key")), key.serialize_pem())
            .expect("write key");
    }
}

/// A child process killed by its PID when dropped; its output goes to `log`.
pub struct Daemon {
    pub name: &'static str,
    pub child: Child,
    pub log: PathBuf,
}

impl Daemon {
    pub fn start(name: &'static str, dir: &Path, mut cmd: Command) -> Self {
        let log = dir.join(format!("{name}.log"));
        let file = std::fs::File::create(&log).expect("log file");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(file.try_clone().expect("dup"))
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| panic!("start {name}: {e}"));
        Self { name, child, log }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last `n` lines of the log, for failure messages.
    pub fn log_tail(&self, n: usize) -> String {
        let text = self.log_text();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!(
                "----- {} log (tail) -----\n{}",
                self.name,
                self.log_tail(40)
            );
        }
    }
}

/// etcd and kube-apiserver, stopped (by PID) when dropped, and an admin kubeconfig.
pub struct ApiServer {
    // Held to be stopped on drop; field order is drop order: the API server first.
    _apiserver: Daemon,
    /// `None` for a second API server on another one's etcd ([`Self::another`]).
    _etcd: Option<Daemon>,
    etcd_url: String,
    /// Shared with a second API server, which serves and trusts the same certificates.
    pub pki: Arc<KubePki>,
    pub url: String,
    /// A kubeconfig with a system:masters client certificate.
    pub admin_kubeconfig: PathBuf,
}

/// How kube-apiserver is started, beyond the loopback basics.
#[derive(Default)]
pub struct ApiServerOpts {
    /// Put the API server in this cgroup (its `cgroup.procs`) before it execs.
    pub cgroup: Option<PathBuf>,
    /// Extra flags (e.g. `--egress-selector-config-file=...`).
    pub extra_args: Vec<String>,
    /// The address to serve on instead of 127.0.0.1: a host address that a node in a
    /// network namespace reaches (the host's end of its veth).
    pub bind: Option<Ipv4Addr>,
    /// Run etcd and the API server in this network namespace (`/run/netns/<name>`), a
    /// master of its own: etcd then serves on `bind` too, for a second master's API
    /// server ([`ApiServer::another`]).
    pub netns: Option<String>,
    /// More addresses in the serving certificate: a second API server's, which serves
    /// the same one, and a load balancer's in front of both.
    pub sans: Vec<String>,
}

/// Where a client of the API goes: its URL, and the PKI whose CA it trusts and whose
/// certificates it holds.
#[derive(Clone, Copy)]
pub struct Endpoint<'a> {
    pub url: &'a str,
    pub pki: &'a KubePki,
}

/// `program`, in network namespace `netns` when there is one.
fn in_netns(netns: Option<&str>, program: &Path) -> Command {
    match netns {
        Some(ns) => {
            let mut cmd = Command::new("nsenter");
            cmd.arg(format!("--net=/run/netns/{ns}"))
                .arg("--")
                .arg(program);
            cmd
        }
        None => Command::new(program),
    }
}

/// `N` loopback ports free a moment ago, all different (the listeners are held
/// together). etcd and kube-apiserver take no inherited sockets, so a port can still be
/// taken between this and their bind; a start that loses the race is retried.
pub fn free_ports<const N: usize>() -> [u16; N] {
    let held: Vec<std::net::TcpListener> = (0..N)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("bind"))
        .collect();
    std::array::from_fn(|i| held[i].local_addr().expect("addr").port())
}

impl ApiServer {
    pub fn start(assets: &Assets, dir: &Path, opts: &ApiServerOpts) -> Self {
        let pki = KubePki::new(&dir.join("pki"));
        let bind = opts.bind.map(|ip| ip.to_string());
        let mut sans = vec!["127.0.0.1", "localhost", "kubernetes", "10.0.0.1"];
        sans.extend(bind.as_deref());
        sans.extend(opts.sans.iter().map(String::as_str));
        pki.issue(
            "apiserver",
            "kube-apiserver",
            None,
            &sans,
            ExtendedKeyUsagePurpose::ServerAuth,
        );
        pki.issue(
            "kubelet-client",
            "kube-apiserver-kubelet-client",
            Some("system:masters"),
            &[],
            ExtendedKeyUsagePurpose::ClientAuth,
        );
        pki.issue(
            "admin",
            "admin",
            Some("system:masters"),
            &[],
            ExtendedKeyUsagePurpose::ClientAuth,
        );
        let sa = KeyPair::generate().expect("sa key");
        std::fs::write(pki.dir.join("sa.key"), sa.serialize_pem()).expect("sa.key");
        std::fs::write(pki.dir.join("sa.pub"), sa.public_key_pem()).expect("sa.pub");

        let pki = Arc::new(pki);
        let mut last_error = String::new();
        for _attempt in 0..3 {
            let [client, peer, secure] = free_ports();
            // On a master of its own, etcd serves the other master's API server too.
            let etcd_ip = match opts.netns {
                Some(_) => opts.bind.unwrap_or(Ipv4Addr::LOCALHOST),
                None => Ipv4Addr::LOCALHOST,
            };
            let etcd_url = format!("http://{etcd_ip}:{client}");
            let data = dir.join(format!("etcd-{client}"));
            let mut etcd = in_netns(opts.netns.as_deref(), &assets.etcd);
            etcd.arg("--data-dir")
                .arg(&data)
                .args(["--name", "e2e"])
                .arg(format!("--listen-client-urls={etcd_url}"))
                .arg(format!("--advertise-client-urls={etcd_url}"))
                .arg(format!("--listen-peer-urls=http://127.0.0.1:{peer}"))
                .arg(format!(
                    "--initial-advertise-peer-urls=http://127.0.0.1:{peer}"
                ))
                .arg(format!("--initial-cluster=e2e=http://127.0.0.1:{peer}"))
                .args(["--unsafe-no-fsync", "--log-level", "warn"]);
            let etcd = Daemon::start("etcd", dir, etcd);
            match Self::try_start(assets, dir, pki.clone(), opts, &etcd_url, secure) {
                Ok(mut api) => {
                    api._etcd = Some(etcd);
                    return api;
                }
                // etcd goes with this attempt.
                Err(e) => last_error = format!("{e}\netcd: {}", etcd.log_tail(10)),
            }
        }
        panic!("kube-apiserver did not start (3 attempts): {last_error}");
    }

    /// A second kube-apiserver on this one's etcd, serving and trusting the same
    /// certificates (a second master), started with `opts` and its files in `dir`.
    pub fn another(&self, assets: &Assets, dir: &Path, opts: &ApiServerOpts) -> Self {
        let [secure] = free_ports();
        Self::try_start(assets, dir, self.pki.clone(), opts, &self.etcd_url, secure)
            .unwrap_or_else(|e| panic!("the second kube-apiserver did not start: {e}"))
    }

    /// kube-apiserver on `etcd_url`, serving on `secure`, with its admin kubeconfig.
    fn try_start(
        assets: &Assets,
        dir: &Path,
        pki: Arc<KubePki>,
        opts: &ApiServerOpts,
        etcd_url: &str,
        secure: u16,
    ) -> Result<Self, String> {
        let p = |f: &str| pki.path(f);
        let bind = IpAddr::V4(opts.bind.unwrap_or(Ipv4Addr::LOCALHOST));
        let mut args: Vec<String> = vec![
            format!("--etcd-servers={etcd_url}"),
            format!("--bind-address={bind}"),
            format!("--secure-port={secure}"),
            "--advertise-address=127.0.0.1".into(),
            "--endpoint-reconciler-type=none".into(),
            format!("--tls-cert-file={}", p("apiserver.crt")),
            format!("--tls-private-key-file={}", p("apiserver.key")),
            format!("--client-ca-file={}", p("ca.crt")),
            format!("--service-account-key-file={}", p("sa.pub")),
            format!("--service-account-signing-key-file={}", p("sa.key")),
            "--service-account-issuer=https://kubernetes.default.svc".into(),
            "--service-cluster-ip-range=10.0.0.0/24".into(),
            "--authorization-mode=Node,RBAC".into(),
            format!("--kubelet-client-certificate={}", p("kubelet-client.crt")),
            format!("--kubelet-client-key={}", p("kubelet-client.key")),
            format!("--kubelet-certificate-authority={}", p("ca.crt")),
            "--kubelet-preferred-address-types=InternalIP".into(),
            // As kubeadm and every distribution set it: the cloud's init container is
            // privileged (Bidirectional mount propagation).
            "--allow-privileged=true".into(),
            format!("--cert-dir={}", dir.join("apiserver-certs").display()),
        ];
        args.extend(opts.extra_args.iter().cloned());
        let netns = opts.netns.as_deref();
        let cmd = match &opts.cgroup {
            // The shell moves itself into the cgroup, then becomes kube-apiserver, so
            // only the API server (and nothing the test runs) is in it.
            Some(cgroup) => {
                let mut sh = in_netns(netns, Path::new("sh"));
                sh.arg("-c")
                    .arg(r#"echo $$ > "$0" && exec "$@""#)
                    .arg(cgroup.join("cgroup.procs"))
                    .arg(&assets.apiserver)
                    .args(&args);
                sh
            }
            None => {
                let mut cmd = in_netns(netns, &assets.apiserver);
                cmd.args(&args);
                cmd
            }
        };
        let mut apiserver = Daemon::start("kube-apiserver", dir, cmd);
        let ready = SocketAddr::new(bind, secure);
        let url = format!("https://{ready}");
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(Some(status)) = apiserver.child.try_wait() {
                return Err(format!(
                    "kube-apiserver exited ({status}): {}",
                    apiserver.log_tail(20),
                ));
            }
            if readyz(&pki, ready) {
                let admin_kubeconfig = dir.join("admin.kubeconfig");
                write_kubeconfig(&admin_kubeconfig, &url, &pki, Credential::Cert("admin"));
                return Ok(Self {
                    _apiserver: apiserver,
                    _etcd: None,
                    etcd_url: etcd_url.to_string(),
                    pki,
                    url,
                    admin_kubeconfig,
                });
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "kube-apiserver not ready in 60 s: {}",
                    apiserver.log_tail(20)
                ));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Where clients reach this API server.
    pub fn endpoint(&self) -> Endpoint<'_> {
        Endpoint {
            url: &self.url,
            pki: &self.pki,
        }
    }

    /// The address it serves on.
    pub fn address(&self) -> SocketAddr {
        self.url
            .trim_start_matches("https://")
            .parse()
            .expect("the API server's address")
    }

    /// kube-apiserver's log so far.
    pub fn log_text(&self) -> String {
        self._apiserver.log_text()
    }

    /// kubectl (`bin`) against this API server as admin, with `args`; its output.
    pub fn kubectl(&self, bin: &Path, args: &[&str]) -> std::process::Output {
        self.kubectl_as(bin, &self.admin_kubeconfig, args, None)
    }

    /// kubectl with the given kubeconfig and optional stdin, bounded to 30 s.
    pub fn kubectl_as(
        &self,
        bin: &Path,
        kubeconfig: &Path,
        args: &[&str],
        stdin: Option<&[u8]>,
    ) -> std::process::Output {
        let mut cmd = Command::new("timeout");
        cmd.arg("30")
            .arg(bin)
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args(args)
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("kubectl");
        if let Some(input) = stdin {
            use std::io::Write;
            let mut pipe = child.stdin.take().expect("stdin");
            pipe.write_all(input).expect("write stdin");
        }
        child.wait_with_output().expect("kubectl output")
    }

    /// kubectl as admin that must succeed; its stdout.
    pub fn kubectl_ok(&self, bin: &Path, args: &[&str]) -> String {
        let out = self.kubectl(bin, args);
        assert!(
            out.status.success(),
            "kubectl {args:?} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `kubectl apply -f -` of `yaml` as admin.
    pub fn apply(&self, bin: &Path, yaml: &str) {
        let out = self.kubectl_as(
            bin,
            &self.admin_kubeconfig,
            &["apply", "-f", "-"],
            Some(yaml.as_bytes()),
        );
        assert!(
            out.status.success(),
            "kubectl apply failed: {}\n{yaml}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// kube-controller-manager (from `kube-controller-manager.gz` in the assets, unpacked
/// into the test's directory), with its own CSR signer on the cluster CA, the CSR
/// approver and cleaner, service accounts and the rest; stopped by PID when dropped.
pub struct ControllerManager {
    _daemon: Daemon,
}

impl ControllerManager {
    /// Started and working (it made the `default` service account), or why not.
    pub fn start(
        assets: &Assets,
        api: &ApiServer,
        dir: &Path,
        kubectl: &Path,
    ) -> Result<Self, String> {
        let bin = assets.unpack("kube-controller-manager", dir)?;
        let [port] = free_ports();
        let admin = api.admin_kubeconfig.display().to_string();
        let p = |f: &str| api.pki.path(f);
        let mut cmd = Command::new(&bin);
        cmd.arg(format!("--kubeconfig={admin}"))
            .arg(format!("--authentication-kubeconfig={admin}"))
            .arg(format!("--authorization-kubeconfig={admin}"))
            .arg(format!(
                "--service-account-private-key-file={}",
                p("sa.key")
            ))
            .arg(format!("--root-ca-file={}", p("ca.crt")))
            .arg(format!("--cluster-signing-cert-file={}", p("ca.crt")))
            .arg(format!("--cluster-signing-key-file={}", p("ca.key")))
            // No node lifecycle: nothing taints or evicts an edge Node whose kubelet is a
            // stand-in that posts no status, nor the real node's NotReady master (no CNI).
            .arg("--controllers=*,-nodeipam,-service,-route,-cloud-node-lifecycle,-nodelifecycle")
            .arg("--leader-elect=false")
            .arg("--bind-address=127.0.0.1")
            .arg(format!("--secure-port={port}"));
        let mut daemon = Daemon::start("kube-controller-manager", dir, cmd);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(Some(status)) = daemon.child.try_wait() {
                return Err(format!(
                    "kube-controller-manager exited ({status}): {}",
                    daemon.log_tail(20)
                ));
            }
            if api
                .kubectl(
                    kubectl,
                    &["get", "serviceaccount", "default", "-n", "default"],
                )
                .status
                .success()
            {
                return Ok(Self { _daemon: daemon });
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "kube-controller-manager made no service account in 60 s: {}",
                    daemon.log_tail(20)
                ));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// Whether /readyz answers 200 (curl with the admin certificate).
fn readyz(pki: &KubePki, addr: SocketAddr) -> bool {
    Command::new("curl")
        .args(["-sf", "-o", "/dev/null", "--max-time", "2", "--cacert"])
        .arg(pki.path("ca.crt"))
        .arg("--cert")
        .arg(pki.path("admin.crt"))
        .arg("--key")
        .arg(pki.path("admin.key"))
        .arg(format!("https://{addr}/readyz"))
        .status()
        .is_ok_and(|s| s.success())
}

/// What a kubeconfig authenticates with.
pub enum Credential<'a> {
    /// `<name>.crt` / `<name>.key` of the PKI.
    Cert(&'a str),
    /// A bearer token (e.g. from `kubectl create token`), and nothing else.
    Token(&'a str),
}

/// A kubeconfig for `url`, trusting the PKI's CA.
pub fn write_kubeconfig(path: &Path, url: &str, pki: &KubePki, credential: Credential<'_>) {
    let user = match credential {
        Credential::Cert(name) => format!(
            "    client-certificate: {}\n    client-key: {}\n",
            pki.path(&format!("{name}.crt")),
            pki.path(&format!("{name}.key"))
        ),
        Credential::Token(token) => format!("    token: {token}\n"),
    };
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: e2e\n  cluster:\n    server: {url}\n    certificate-authority: {ca}\nusers:\n- name: e2e\n  user:\n{user}contexts:\n- name: e2e\n  context:\n    cluster: e2e\n    user: e2e\n    namespace: default\ncurrent-context: e2e\n",
        ca = pki.path("ca.crt"),
    );
    std::fs::write(path, text).expect("kubeconfig");
}
