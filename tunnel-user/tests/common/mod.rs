//! Test harness: real `tunnel` processes on loopback with real TLS, started and stopped
//! by PID, with their logs kept for assertions and for failure messages; or, for a test
//! that needs no process, the cloud and its edges in the test's runtime ([`inproc`]).
#![expect(dead_code, reason = "each test file uses its own part of the harness")]
#![expect(
    clippy::unwrap_used,
    reason = "a panic with its message is how a test reports failure"
)]

pub mod config;
pub mod inproc;
pub mod monitoring;
pub mod netns;
pub mod privileged;
pub mod probe;
pub mod servers;

use std::io::Read;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use config::{merge, path_str, write_toml};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
};
use toml::Table;

pub const BIN: &str = env!("CARGO_BIN_EXE_tunnel");

/// A loopback address where nothing listens, for as long as this value lives: the port
/// is bound (not listening) here, so no one else can take it, and a connect to it is
/// refused. Also how a test reserves a port for a process it starts (and restarts) on
/// purpose on a fixed port: with SO_REUSEADDR on both sides (tokio sets it on its
/// listeners) the process binds and listens beside this socket, which never listens,
/// while the kernel hands the port to no one else (neither `bind(:0)`, which skips ports
/// in use, nor `connect`), not even between a kill and the restart.
pub struct ClosedPort {
    pub addr: SocketAddr,
    _socket: socket2::Socket,
}

impl ClosedPort {
    pub fn new() -> Self {
        Self::hold(SocketAddr::from(([127, 0, 0, 1], 0)))
    }

    /// Holds `addr` (port 0: one the kernel picks) as [`Self::new`] does.
    pub fn try_hold(addr: SocketAddr) -> std::io::Result<Self> {
        use socket2::{Domain, Socket, Type};
        let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
        socket.set_reuse_address(true)?;
        socket.bind(&addr.into())?;
        let addr = socket.local_addr()?.as_socket().expect("inet");
        Ok(Self {
            addr,
            _socket: socket,
        })
    }

    pub fn hold(addr: SocketAddr) -> Self {
        Self::try_hold(addr).unwrap_or_else(|e| panic!("hold {addr}: {e}"))
    }

    /// A port of `ip` below 1024 held as [`Self::new`] holds one: the redirect's, which
    /// the cloud's config refuses above 1023 with `redirect.pin_dir`. Binding one needs
    /// root. Ports 300 to 499 (below those rresvport takes), from one that depends on
    /// the process so that tests starting at once seldom try the same first; a port is
    /// taken only where a bind without SO_REUSEADDR succeeds, which fails while any
    /// socket (another test's hold included) has it.
    pub fn try_privileged(ip: std::net::IpAddr) -> std::io::Result<Self> {
        use socket2::{Domain, Socket, Type};
        const FIRST: u16 = 300;
        const COUNT: u16 = 200;
        let start = (std::process::id() % u32::from(COUNT)) as u16;
        let mut last = None;
        for i in 0..COUNT {
            let addr = SocketAddr::new(ip, FIRST + (start + i) % COUNT);
            let probe = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
            match probe.bind(&addr.into()) {
                Ok(()) => {
                    drop(probe);
                    return Self::try_hold(addr);
                }
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| std::io::Error::other("no port")))
    }

    pub fn privileged(ip: std::net::IpAddr) -> Self {
        Self::try_privileged(ip).unwrap_or_else(|e| panic!("hold a port of {ip} below 1024: {e}"))
    }
}

impl Default for ClosedPort {
    fn default() -> Self {
        Self::new()
    }
}

/// `N` loopback ports reserved ([`ClosedPort`]) for processes the test configures before
/// it can ask them where they listen (the daemons of the k8s_e2e tests, replicas that
/// list each other): fixed ports, but never re-picked ones.
pub fn reserve_ports<const N: usize>() -> [ClosedPort; N] {
    std::array::from_fn(|_| ClosedPort::new())
}

/// `127.0.0.1:0`: the kernel picks the port, the process reports it (`--ready-file`).
pub const ANY_PORT: SocketAddr = SocketAddr::V4(std::net::SocketAddrV4::new(
    std::net::Ipv4Addr::LOCALHOST,
    0,
));

/// A CA, a cloud certificate for `tunnel-cloud` / 127.0.0.1, and client certificates.
pub struct Pki {
    pub dir: PathBuf,
    ca_key: KeyPair,
    ca_params: CertificateParams,
}

impl Pki {
    pub fn new(dir: &Path) -> Self {
        let ca_key = KeyPair::generate().expect("key");
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("params");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "test ca");
        let ca = ca_params.self_signed(&ca_key).expect("ca");
        std::fs::write(dir.join("ca.crt"), ca.pem()).expect("write ca");
        // The cloud's CSR signer ([csr] ca_key) signs edge certificates with it.
        std::fs::write(dir.join("ca.key"), ca_key.serialize_pem()).expect("write ca key");
        let pki = Self {
            dir: dir.to_path_buf(),
            ca_key,
            ca_params,
        };
        // clientAuth too: replicas present the cloud certificate to each other.
        let usages = [
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        pki.issue_with(
            "cloud",
            &["tunnel-cloud", "127.0.0.1"],
            "tunnel-cloud",
            &usages,
        );
        pki
    }

    /// Writes `<name>.crt` / `<name>.key` signed by this CA.
    pub fn issue(&self, name: &str, sans: &[&str], cn: &str, usage: ExtendedKeyUsagePurpose) {
        self.issue_with(name, sans, cn, &[usage]);
    }

    /// `issue` with several extended key usages.
    pub fn issue_with(
        &self,
        name: &str,
        sans: &[&str],
        cn: &str,
        usages: &[ExtendedKeyUsagePurpose],
    ) {
        self.issue_valid_for(name, sans, cn, usages, None);
    }

    /// A client certificate for `node` that expires `valid_for` from now.
    pub fn client_cert_expiring(&self, node: &str, valid_for: Duration) {
        self.issue_valid_for(
            &format!("edge-{node}"),
            &[node],
            node,
            &[ExtendedKeyUsagePurpose::ClientAuth],
            Some(valid_for),
        );
    }

    fn issue_valid_for(
        &self,
        name: &str,
        sans: &[&str],
        cn: &str,
        usages: &[ExtendedKeyUsagePurpose],
        valid_for: Option<Duration>,
    ) {
        let key = KeyPair::generate().expect("key");
        let mut params =
            CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .expect("params");
        params.distinguished_name.push(DnType::CommonName, cn);
        params.extended_key_usages = usages.to_vec();
        if let Some(valid_for) = valid_for {
            let since_epoch = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .expect("clock after 1970");
            params.not_after = rcgen::date_time_ymd(1970, 1, 1) + since_epoch + valid_for;
        }
        let issuer = Issuer::from_params(&self.ca_params, &self.ca_key);
        let cert = params.signed_by(&key, &issuer).expect("sign");
        std::fs::write(self.dir.join(format!("{name}.crt")), cert.pem()).expect("write cert");
        std::fs::write(self.dir.join(format!("{name}.key")), key.serialize_pem())
            .expect("write key");
    }

    pub fn client_cert(&self, node: &str) {
        self.issue(
            &format!("edge-{node}"),
            &[node],
            node,
            ExtendedKeyUsagePurpose::ClientAuth,
        );
    }
}

/// A `tunnel` process, killed (by its PID) when dropped. Its stderr goes to a file.
pub struct Proc {
    pub child: Child,
    pub log: PathBuf,
    pub name: String,
    /// `tunnel cloud` and `tunnel edge` report their listeners here (`--ready-file`).
    pub ready_file: Option<PathBuf>,
}

/// The listeners a process reported in its ready file: config key to bound address.
#[derive(Debug, Clone)]
pub struct Ready(pub std::collections::BTreeMap<String, String>);

impl Ready {
    /// The TCP address bound for config key `key` (`tunnel.listen`, `admin.listen`, ...).
    pub fn addr(&self, key: &str) -> SocketAddr {
        self.0
            .get(key)
            .unwrap_or_else(|| panic!("no {key} in the ready file: {:?}", self.0))
            .parse()
            .unwrap_or_else(|e| panic!("{key} in the ready file: {e}"))
    }

    fn parse(text: &str) -> Self {
        Self(
            text.lines()
                .filter_map(|l| l.split_once(' '))
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
        )
    }
}

impl Proc {
    pub fn start(name: &str, dir: &Path, args: &[&str]) -> Self {
        Self::start_via(name, dir, &[], args)
    }

    /// [`Self::start`] through `wrapper` (a command that ends by exec'ing its trailing
    /// arguments, so the pid stays the tunnel's).
    pub fn start_via(name: &str, dir: &Path, wrapper: &[&str], args: &[&str]) -> Self {
        let log = dir.join(format!("{name}.log"));
        let file = std::fs::File::create(&log).expect("log file");
        // A process that serves reports where it listens; a restart under the same name
        // must not find the file its predecessor wrote.
        let serves = matches!(args.first(), Some(&"cloud" | &"edge"))
            && !args.contains(&"--uninstall-redirect");
        let ready_file = serves.then(|| dir.join(format!("{name}.ready")));
        let ready_arg = ready_file.as_ref().map(|p| p.to_str().expect("utf-8 path"));
        if let Some(path) = &ready_file {
            let _ = std::fs::remove_file(path);
        }
        let mut argv = wrapper.to_vec();
        argv.push(BIN);
        argv.extend_from_slice(&args[..args.len().min(1)]);
        if let Some(path) = ready_arg {
            argv.extend_from_slice(&["--ready-file", path]);
        }
        argv.extend_from_slice(&args[args.len().min(1)..]);
        let child = Command::new(argv[0])
            .args(&argv[1..])
            .env("RUST_LOG", inproc::LOG_FILTER)
            .env_remove("NODE_NAME")
            .stdin(Stdio::null())
            .stdout(file.try_clone().expect("dup"))
            .stderr(file)
            .spawn()
            .expect("start tunnel binary");
        Self {
            child,
            log,
            name: name.to_string(),
            ready_file,
        }
    }

    /// Waits until every listener serves and returns where each one is bound; panics with
    /// the log after `timeout`, or at once if the process exited.
    pub fn wait_ready(&mut self, timeout: Duration) -> Ready {
        match self.try_wait_ready(timeout) {
            Some(ready) => ready,
            None => panic!(
                "{}: exited before it served; log:\n{}",
                self.name,
                self.log_text()
            ),
        }
    }

    /// [`Self::wait_ready`], but None if the process exited before it served.
    pub fn try_wait_ready(&mut self, timeout: Duration) -> Option<Ready> {
        let path = self
            .ready_file
            .clone()
            .unwrap_or_else(|| panic!("{}: not a cloud or edge process", self.name));
        let deadline = Instant::now() + timeout;
        loop {
            // Renamed into place whole: once it exists, it is complete.
            if let Ok(text) = std::fs::read_to_string(&path) {
                return Some(Ready::parse(&text));
            }
            if let Ok(Some(_)) = self.child.try_wait() {
                return None;
            }
            assert!(
                Instant::now() < deadline,
                "{}: no ready file within {timeout:?}; log:\n{}",
                self.name,
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn log_text(&self) -> String {
        let mut s = String::new();
        if let Ok(mut f) = std::fs::File::open(&self.log) {
            let _ = f.read_to_string(&mut s);
        }
        s
    }

    /// Waits until the log contains `needle`; panics with the log after `timeout`.
    pub fn wait_log(&self, needle: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if self.log_text().contains(needle) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!(
            "{}: `{needle}` not logged within {timeout:?}; log:\n{}",
            self.name,
            self.log_text()
        );
    }

    /// What the process reported in its ready file; call after [`Self::wait_ready`].
    pub fn ready(&self) -> Ready {
        let path = self.ready_file.as_ref().expect("a cloud or edge process");
        Ready::parse(&std::fs::read_to_string(path).expect("the process is ready"))
    }

    /// Waits until the log contains `needle` `times` times; panics with the log after
    /// `timeout`.
    pub fn wait_log_count(&self, needle: &str, times: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while self.log_text().matches(needle).count() < times {
            assert!(
                Instant::now() < deadline,
                "{}: `{needle}` not logged {times} times within {timeout:?}; log:\n{}",
                self.name,
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Waits for the process to exit by itself and returns its exit code.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<i32> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
        if std::thread::panicking() {
            eprintln!("----- {} log -----\n{}", self.name, self.log_text());
        }
    }
}

/// A helper process (a target server) killed by its PID when the test ends, pass or fail.
pub struct ChildGuard(pub Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Polls `url` until it answers 200 or `timeout` passes.
pub fn wait_http_ok(url: &str, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        let out = Command::new("curl")
            .args([
                "-s",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "--max-time",
                "1",
                url,
            ])
            .output();
        if out.is_ok_and(|o| o.stdout == b"200") {
            return true;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    false
}

/// The cloud's `/debug/edges` listing at `admin`; None if nothing answers there.
pub fn debug_edges(admin: SocketAddr) -> Option<Vec<serde_json::Value>> {
    let out = Command::new("curl")
        .args(["-sSf", "--max-time", "5"])
        .arg(format!("http://{admin}/debug/edges"))
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    Some(serde_json::from_slice(&out.stdout).expect("/debug/edges is a JSON array"))
}

/// The Prometheus text of the admin listener at `admin` (empty if it does not answer).
pub fn scrape(admin: SocketAddr) -> String {
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "5"])
        .arg(format!("http://{admin}/metrics"))
        .output();
    out.map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

/// The value of the sample line `series value` in a scrape (`series` includes any
/// labels, `name{k="v"}`); 0 when absent, as a counter not yet created reads.
pub fn sample(scrape: &str, series: &str) -> f64 {
    scrape
        .lines()
        .find_map(|l| {
            l.strip_prefix(series)
                .and_then(|rest| rest.strip_prefix(' '))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(0.0)
}

/// One sample scraped from `admin` now.
pub fn metric(admin: SocketAddr, series: &str) -> f64 {
    sample(&scrape(admin), series)
}

/// SHA-256 fingerprint of the certificate a TLS listener at `addr` serves now.
pub fn served_fingerprint(addr: SocketAddr) -> String {
    let script = format!(
        "openssl s_client -connect {addr} -servername tunnel-cloud </dev/null 2>/dev/null | openssl x509 -noout -fingerprint -sha256"
    );
    let out = Command::new("sh")
        .args(["-c", &script])
        .output()
        .expect("openssl");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// SHA-256 fingerprint of the certificate in the PEM file at `path`.
pub fn file_fingerprint(path: &Path) -> String {
    let out = Command::new("openssl")
        .args(["x509", "-noout", "-fingerprint", "-sha256", "-in"])
        .arg(path)
        .output()
        .expect("openssl");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// One cloud and any number of edges, configured in a temp dir. The cloud's addresses
/// start on port 0 and hold the ports it bound once it serves ([`Setup::start_cloud`]);
/// a cloud started again binds those same ports.
pub struct Setup {
    pub dir: tempfile::TempDir,
    pub pki: Pki,
    /// Where the cloud listens for edges, and where the edges dial.
    pub tunnel: SocketAddr,
    pub connect: SocketAddr,
    /// The CONNECT proxy's unix socket (kube-apiserver's egress selector path).
    pub connect_unix: PathBuf,
    pub cloud_admin: SocketAddr,
}

pub struct EdgeOpts<'a> {
    pub node: &'a str,
    pub token: &'a str,
    /// Merged into the edge config ([`merge`]): an `[allow]` table, more `[cloud]`
    /// keys, ...
    pub extra: Table,
    pub cert: Option<&'a str>,
    pub ca: &'a str,
}

impl<'a> EdgeOpts<'a> {
    pub fn new(node: &'a str, token: &'a str) -> Self {
        Self {
            node,
            token,
            extra: Table::new(),
            cert: None,
            ca: "ca.crt",
        }
    }
}

impl Setup {
    /// `tokens` is the token file.
    pub fn new(tokens: &str) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let pki = Pki::new(dir.path());
        std::fs::write(dir.path().join("tokens"), tokens).expect("tokens");
        let connect_unix = dir.path().join("connect.sock");
        Self {
            pki,
            tunnel: ANY_PORT,
            connect: ANY_PORT,
            connect_unix,
            cloud_admin: ANY_PORT,
            dir,
        }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Starts a cloud and waits until it serves; this setup's addresses are then the ones
    /// it bound.
    pub fn start_cloud(&mut self, extra: Table) -> Proc {
        let mut cloud = self.spawn_cloud(extra, &[]);
        self.cloud_ready(&mut cloud);
        cloud
    }

    /// Waits until `cloud` (this setup's, [`Self::spawn_cloud`]) serves and takes its
    /// addresses.
    pub fn cloud_ready(&mut self, cloud: &mut Proc) {
        let ready = cloud.wait_ready(Duration::from_secs(10));
        self.tunnel = ready.addr("tunnel.listen");
        self.connect = ready.addr("connect.listen");
        self.cloud_admin = ready.addr("admin.listen");
    }

    /// Fixed ports for the cloud, for a test that restarts it on the same ports on
    /// purpose: reserved ([`ClosedPort`]) for as long as the returned value lives.
    pub fn reserve_cloud_ports(&mut self) -> [ClosedPort; 3] {
        let held = [ClosedPort::new(), ClosedPort::new(), ClosedPort::new()];
        (self.tunnel, self.connect, self.cloud_admin) = (held[0].addr, held[1].addr, held[2].addr);
        held
    }

    /// Starts a cloud through `wrapper` ([`Proc::start_via`]) without waiting for it.
    pub fn spawn_cloud(&self, extra: Table, wrapper: &[&str]) -> Proc {
        let path = self.write_cloud_config(extra);
        Proc::start_via(
            "cloud",
            self.path(),
            wrapper,
            &["cloud", "--config", path.to_str().expect("utf-8 path")],
        )
    }

    /// Writes `cloud.toml` ([`Self::cloud_config`]); returns its path.
    pub fn write_cloud_config(&self, extra: Table) -> PathBuf {
        let path = self.path().join("cloud.toml");
        write_toml(&path, &self.cloud_config(extra));
        path
    }

    /// A cloud config with this setup's addresses and `extra` merged in ([`merge`]).
    pub fn cloud_config(&self, extra: Table) -> Table {
        let mut config = toml::toml! {
            [tunnel]
            listen = (self.tunnel.to_string())
            cert = "cloud.crt"
            key = "cloud.key"
            token_file = "tokens"
            client_ca = "ca.crt"
            cloud_id = "test-cloud"

            [admin]
            listen = (self.cloud_admin.to_string())

            [connect]
            listen = (self.connect.to_string())
            unix = (path_str(&self.connect_unix))

            [transport]
            heartbeat_interval = "1s"
            heartbeat_timeout = "3s"
        };
        merge(&mut config, extra);
        config
    }

    /// The config of an edge that dials this setup's cloud, as `opts` says.
    pub fn edge_config(&self, opts: &EdgeOpts<'_>) -> Table {
        let mut config = toml::toml! {
            node_name = (opts.node)

            [cloud]
            address = (self.tunnel.to_string())
            server_name = "tunnel-cloud"
            ca = (opts.ca)

            [admin]
            listen = (ANY_PORT.to_string())

            [transport]
            heartbeat_interval = "1s"
            heartbeat_timeout = "3s"
        };
        if !opts.token.is_empty() {
            merge(&mut config, toml::toml! { [cloud] token = (opts.token) });
        }
        if let Some(cert) = opts.cert {
            let (cert_file, key_file) = (format!("{cert}.crt"), format!("{cert}.key"));
            merge(
                &mut config,
                toml::toml! { [cloud] cert = cert_file key = key_file },
            );
        }
        merge(&mut config, opts.extra.clone());
        config
    }

    /// Starts an edge and waits until its listeners serve (not until it registers);
    /// returns it with its admin address (port 0 if it exited before it served).
    pub fn start_edge(&self, opts: EdgeOpts<'_>) -> (Proc, SocketAddr) {
        static EDGES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = EDGES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("edge-{}-{n}", opts.node);
        let path = self.path().join(format!("{name}.toml"));
        write_toml(&path, &self.edge_config(&opts));
        let mut edge = Proc::start(
            &name,
            self.path(),
            &["edge", "--config", path.to_str().expect("utf-8 path")],
        );
        let admin = match edge.try_wait_ready(Duration::from_secs(10)) {
            Some(ready) => ready.addr("admin.listen"),
            None => ANY_PORT,
        };
        (edge, admin)
    }

    /// Starts an edge and waits until it is registered: ready on its side and, when this
    /// setup's cloud is the one running, listed by the cloud too (the edge learns of its
    /// welcome a moment before the cloud's registry holds the session).
    pub fn start_ready_edge(&self, opts: EdgeOpts<'_>) -> Proc {
        let node = opts.node.to_owned();
        let (edge, admin) = self.start_edge(opts);
        assert!(
            wait_http_ok(&format!("http://{admin}/readyz"), Duration::from_secs(10)),
            "edge never became ready; log:\n{}",
            edge.log_text()
        );
        // No listing at all: this setup's cloud is not running (the edge registered with
        // another), so there is nothing more to wait for.
        let deadline = Instant::now() + Duration::from_secs(10);
        while let Some(listing) = debug_edges(self.cloud_admin) {
            if listing.iter().any(|e| e["node"] == node.as_str()) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the cloud never listed the ready edge; edge log:\n{}",
                edge.log_text()
            );
            std::thread::sleep(Duration::from_millis(25));
        }
        edge
    }
}

/// Writes `bytes` on `conn` and reads, expecting a reset: how a client of a forward,
/// a redirect or an early CONNECT learns that the edge refused its dial. The reset may
/// come before the write or after it.
pub fn assert_reset(conn: &mut std::net::TcpStream, bytes: &[u8]) {
    use std::io::Write;
    let mut buf = [0u8; 16];
    let outcome = conn
        .write_all(bytes)
        .and_then(|()| conn.read(&mut buf).map(|n| eprintln!("read {n} bytes")));
    let err =
        outcome.expect_err("a refused dial must reset the client, not end the stream cleanly");
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset, "{err}");
}

/// Closes `conn` with a reset instead of a FIN: a zero linger (which never blocks, as
/// nothing is left unsent by the time a test drops its client).
pub fn close_with_reset(conn: impl std::os::fd::AsFd) {
    socket2::SockRef::from(&conn)
        .set_linger(Some(Duration::ZERO))
        .expect("SO_LINGER");
}

/// Opens a tunnel through the HTTP CONNECT proxy at `proxy`; returns the stream after
/// the 200, or the status line of the refusal.
pub fn connect_via(proxy: SocketAddr, authority: &str) -> Result<std::net::TcpStream, String> {
    use std::io::Write;
    let mut s = std::net::TcpStream::connect(proxy).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(15)))
        .map_err(|e| e.to_string())?;
    write!(
        s,
        "CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    // Read the response head byte by byte so nothing after it is consumed.
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match s.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            Ok(_) => {
                return Err(format!(
                    "proxy closed after {:?}",
                    String::from_utf8_lossy(&head)
                ));
            }
            Err(e) => return Err(e.to_string()),
        }
        if head.len() > 4096 {
            return Err("response head too long".into());
        }
    }
    let head = String::from_utf8_lossy(&head).to_string();
    if head.starts_with("HTTP/1.1 200") {
        s.set_nodelay(true).map_err(|e| e.to_string())?;
        Ok(s)
    } else {
        Err(head.lines().next().unwrap_or_default().to_string())
    }
}

/// Starts a helper server (not the process under test) that binds port 0 and prints where
/// it listens on stdout, as the last word of a line (`ACCEPT 127.0.0.1:40123` from
/// `openssl s_server` without `-quiet`, or a bare address); returns it with that address.
/// Its further output is drained, so it never blocks on a full pipe.
pub fn spawn_announcing(cmd: &mut Command) -> (ChildGuard, SocketAddr) {
    use std::io::BufRead;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    let stdout = child.stdout.take().expect("piped stdout");
    let guard = ChildGuard(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            let addr: Option<SocketAddr> =
                line.split_whitespace().last().and_then(|w| w.parse().ok());
            if let (Some(addr), Some(sender)) = (addr, &tx) {
                let _ = sender.send(addr);
                tx = None;
            }
        }
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("{cmd:?} did not say where it listens: {e}"));
    (guard, addr)
}

/// `python3 -m http.server` for `dir` on `ip`, port 0.
pub fn python_http_server(ip: &str, dir: &Path) -> (ChildGuard, SocketAddr) {
    const SERVE: &str = "import functools, http.server, sys
handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=sys.argv[2])
server = http.server.ThreadingHTTPServer((sys.argv[1], 0), handler)
print('%s:%d' % server.server_address[:2], flush=True)
server.serve_forever()";
    spawn_announcing(Command::new("python3").args(["-c", SERVE, ip]).arg(dir))
}

/// Polls `read` until it returned the same value for `quiet` in a row, and returns it
/// (panics if it is still moving after `bound`): "nothing more happens" asserted on a
/// state that held still, not on a guess after a fixed sleep.
pub fn settled<T: PartialEq + std::fmt::Debug>(
    quiet: Duration,
    bound: Duration,
    mut read: impl FnMut() -> T,
) -> T {
    let deadline = Instant::now() + bound;
    let mut last = read();
    let mut since = Instant::now();
    loop {
        std::thread::sleep(Duration::from_millis(25));
        let now = read();
        if now != last {
            (last, since) = (now, Instant::now());
        } else if since.elapsed() >= quiet {
            return last;
        }
        assert!(
            Instant::now() < deadline,
            "still changing after {bound:?}: {last:?}"
        );
    }
}
