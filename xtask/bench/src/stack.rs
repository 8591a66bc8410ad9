//! Everything the bench runs on loopback: the target servers (what sits behind the
//! edge), and the three ways to reach them: direct, through the tunnel (cloud + edge,
//! TLS), through rathole (server + client, plain TCP or TLS).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};

use super::delay::DelayProxy;
use super::procs::{Proc, echo_ok, free_port, http_ok, wait_listening, wait_until};
use super::setup::{EDGE_NODE, Pki};

/// The services behind the edge, by name.
pub const IPERF: &str = "iperf";
pub const HTTP: &str = "http";
pub const TWO_WRITE: &str = "two_write";
pub const ECHO: &str = "echo";
pub const SOURCE: &str = "source";
/// The cloud's HTTP CONNECT listener (only when `TunnelTuning::connect` asks for it).
pub const CONNECT: &str = "connect";

/// How one path reaches each service.
pub type Endpoints = BTreeMap<&'static str, SocketAddr>;

/// Path of the small file nginx serves.
pub const SMALL_FILE: &str = "/small.txt";

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

pub struct Servers {
    pub direct: Endpoints,
    _procs: Vec<Proc>,
}

impl Servers {
    pub fn start(dir: &Path, bench_bin: &Path) -> Result<Self> {
        let mut direct = Endpoints::new();
        for name in [IPERF, HTTP, TWO_WRITE, ECHO, SOURCE] {
            direct.insert(name, loopback(free_port()?));
        }
        let mut procs = Vec::new();

        let iperf = super::setup::which("iperf3").context("iperf3 not found")?;
        let port = direct[IPERF].port().to_string();
        procs.push(Proc::start(
            "iperf3-server",
            dir,
            &iperf,
            &args(&["-s", "-B", "127.0.0.1", "-p", &port]),
            &[],
        )?);

        let www = dir.join("www");
        std::fs::create_dir_all(&www)?;
        std::fs::create_dir_all(dir.join("nginx-tmp"))?;
        // A small response: the size of a typical API object.
        std::fs::write(
            www.join(SMALL_FILE.trim_start_matches('/')),
            "x".repeat(1024),
        )?;
        let conf = dir.join("nginx.conf");
        std::fs::write(&conf, nginx_conf(dir, direct[HTTP]))?;
        let nginx = super::setup::which("nginx").context("nginx not found")?;
        let nginx_args = vec![
            "-p".into(),
            path_str(dir)?,
            "-c".into(),
            path_str(&conf)?,
            "-e".into(),
            path_str(&dir.join("nginx-error.log"))?,
        ];
        procs.push(Proc::start("nginx", dir, &nginx, &nginx_args, &[])?);

        let helper_args = vec![
            "bench-helper".into(),
            "servers".into(),
            "--two-write".into(),
            direct[TWO_WRITE].to_string(),
            "--echo".into(),
            direct[ECHO].to_string(),
            "--source".into(),
            direct[SOURCE].to_string(),
        ];
        procs.push(Proc::start("servers", dir, bench_bin, &helper_args, &[])?);

        for addr in direct.values() {
            wait_listening(*addr, Duration::from_secs(10))
                .with_context(|| format!("target servers: {}", procs_logs(&procs)))?;
        }
        Ok(Self {
            direct,
            _procs: procs,
        })
    }
}

fn procs_logs(procs: &[Proc]) -> String {
    procs
        .iter()
        .map(|p| format!("{}: {}", p.name, p.log.display()))
        .collect::<Vec<_>>()
        .join(", ")
}

fn args(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

fn path_str(p: &Path) -> Result<String> {
    p.to_str().map(str::to_string).context("non-UTF-8 path")
}

fn nginx_conf(dir: &Path, listen: SocketAddr) -> String {
    let tmp = dir.join("nginx-tmp");
    let tmp = tmp.display();
    // One process (no master): it dies with a SIGKILL like any other child, and it gets
    // the same single core a tunnel process gets.
    format!(
        r#"daemon off;
master_process off;
worker_processes 1;
pid {pid};
worker_rlimit_nofile 20000;
events {{ worker_connections 19000; }}
http {{
    access_log off;
    keepalive_requests 10000000;
    keepalive_timeout 120s;
    client_body_temp_path {tmp};
    proxy_temp_path {tmp};
    fastcgi_temp_path {tmp};
    uwsgi_temp_path {tmp};
    scgi_temp_path {tmp};
    server {{
        listen {listen} backlog=4096;
        root {www};
    }}
}}
"#,
        pid = dir.join("nginx.pid").display(),
        www = dir.join("www").display(),
    )
}

/// Tunnel knobs the bench may override (TOML lines for `[transport]`, worker count).
#[derive(Clone, Debug, Default)]
pub struct TunnelTuning {
    pub transport: Vec<String>,
    pub worker_threads: Option<usize>,
    /// The edge reaches the cloud through a proxy delaying each way by this much.
    pub link_delay: Option<Duration>,
    /// An HTTP CONNECT listener on TCP (endpoint `CONNECT`).
    pub connect_tcp: bool,
    /// An HTTP CONNECT listener on a unix socket (`connect.unix`, `Tunnel::connect_socket`),
    /// as kube-apiserver's egress selector uses it.
    pub connect_unix: bool,
    /// `connect.optimistic_ok` as TOML writes it (`"never"`); the shipped default
    /// without it.
    pub optimistic_ok: Option<&'static str>,
    /// The cloud loads `tokens-sim`, which has a line for each simulated edge
    /// (`setup::certs`), instead of `tokens`.
    pub sim_edges: bool,
}

impl TunnelTuning {
    fn sections(&self) -> String {
        // The bench's clients are all one client (127.0.0.1), and its idle figure holds
        // 10,000 connections to one edge: past one client's share of the edge
        // (`transport.client_share`, a policy, not a cost), so that one holds the whole.
        let mut s = String::from("[transport]\nclient_share = 1.0\n");
        for line in &self.transport {
            let _ = writeln!(s, "{line}");
        }
        if let Some(w) = self.worker_threads {
            let _ = write!(s, "\n[runtime]\nworker_threads = {w}\n");
        }
        s
    }
}

/// A tunnel cloud with one edge, and a fixed forward per service.
pub struct Tunnel {
    pub cloud: Proc,
    pub edge: Option<Proc>,
    pub endpoints: Endpoints,
    pub tunnel_addr: SocketAddr,
    /// The cloud's HTTP CONNECT unix socket, with `TunnelTuning::connect_unix`.
    pub connect_socket: Option<PathBuf>,
    /// The delaying proxy between edge and cloud, if any.
    _link: Option<DelayProxy>,
}

impl Tunnel {
    /// `targets`: services the edge reaches. Empty: a cloud alone (for simulated edges).
    /// Returns once the edge is registered and an echo (if a target) comes through.
    pub fn start(
        bin: &Path,
        pki: &Pki,
        dir: &Path,
        name: &str,
        targets: &Endpoints,
        tuning: &TunnelTuning,
    ) -> Result<Self> {
        Self::launch(bin, pki, dir, name, targets, tuning, true)
    }

    /// `start`, but returning right after spawning cloud and edge back to back, for the
    /// start-up figures, which time readiness themselves.
    pub fn start_unready(
        bin: &Path,
        pki: &Pki,
        dir: &Path,
        name: &str,
        targets: &Endpoints,
        tuning: &TunnelTuning,
    ) -> Result<Self> {
        Self::launch(bin, pki, dir, name, targets, tuning, false)
    }

    /// Both configs are written before the cloud is spawned, so that nothing but the
    /// processes themselves lies between the two spawns when `wait_ready` is off.
    fn launch(
        bin: &Path,
        pki: &Pki,
        dir: &Path,
        name: &str,
        targets: &Endpoints,
        tuning: &TunnelTuning,
        wait_ready: bool,
    ) -> Result<Self> {
        let tunnel_addr = loopback(free_port()?);
        let mut cloud_cfg = format!(
            r#"[tunnel]
listen = "{tunnel_addr}"
cert = "{certs}/cloud.crt"
key = "{certs}/cloud.key"
token_file = "{certs}/{tokens}"
client_ca = "{certs}/ca.crt"
cloud_id = "bench"

[[node]]
name = "{EDGE_NODE}"
"#,
            certs = pki.dir.display(),
            tokens = if tuning.sim_edges {
                "tokens-sim"
            } else {
                "tokens"
            },
        );
        let mut endpoints = Endpoints::new();
        for (service, target) in targets {
            let listen = loopback(free_port()?);
            let _ = write!(
                cloud_cfg,
                "\n[[forward]]\nlisten = \"{listen}\"\nnode = \"{EDGE_NODE}\"\ntarget = \"{target}\"\n"
            );
            endpoints.insert(*service, listen);
        }
        let connect_socket = tuning
            .connect_unix
            .then(|| super::procs::socket_path(dir, &format!("{name}-connect.sock")))
            .transpose()?;
        if tuning.connect_tcp || connect_socket.is_some() {
            cloud_cfg.push_str("\n[connect]\n");
            if let Some(optimistic_ok) = tuning.optimistic_ok {
                let _ = writeln!(cloud_cfg, "optimistic_ok = {optimistic_ok}");
            }
            if tuning.connect_tcp {
                let listen = loopback(free_port()?);
                let _ = writeln!(cloud_cfg, "listen = \"{listen}\"");
                endpoints.insert(CONNECT, listen);
            }
            if let Some(socket) = &connect_socket {
                let _ = writeln!(cloud_cfg, "unix = \"{}\"", socket.display());
            }
        }
        cloud_cfg.push('\n');
        cloud_cfg.push_str(&tuning.sections());
        let cloud_path = dir.join(format!("{name}-cloud.toml"));
        std::fs::write(&cloud_path, cloud_cfg)?;
        // The edge's config, its admin address (readiness) and its link, when it has
        // targets; a cloud alone has no edge.
        let edge_setup = if targets.is_empty() {
            None
        } else {
            let link = match tuning.link_delay {
                // Every new connection over the link pays its handshake: the tunnel's one,
                // at registration; rathole's, per data channel.
                Some(d) => Some(DelayProxy::start(tunnel_addr, d, true)?),
                None => None,
            };
            let edge_dials = link.as_ref().map_or(tunnel_addr, |l| l.addr);
            let admin = loopback(free_port()?);
            let allow: Vec<String> = targets.values().map(|t| format!("\"{t}\"")).collect();
            let edge_cfg = format!(
                r#"node_name = "{EDGE_NODE}"

[cloud]
address = "{edge_dials}"
server_name = "tunnel-cloud"
ca = "{certs}/ca.crt"
cert = "{certs}/edge-{EDGE_NODE}.crt"
key = "{certs}/edge-{EDGE_NODE}.key"

[admin]
listen = "{admin}"

[allow]
targets = [{allow}]

{sections}"#,
                certs = pki.dir.display(),
                allow = allow.join(", "),
                sections = tuning.sections(),
            );
            let edge_path = dir.join(format!("{name}-edge.toml"));
            std::fs::write(&edge_path, edge_cfg)?;
            Some((edge_path, admin, link))
        };
        let env = [("RUST_LOG", "info")];
        let cloud = Proc::start(
            &format!("{name}-cloud"),
            dir,
            bin,
            &["cloud".into(), "--config".into(), path_str(&cloud_path)?],
            &env,
        )?;
        if wait_ready {
            wait_listening(tunnel_addr, Duration::from_secs(10))
                .with_context(|| format!("cloud log {}", cloud.log.display()))?;
        }
        let Some((edge_path, admin, link)) = edge_setup else {
            return Ok(Self {
                cloud,
                edge: None,
                endpoints,
                tunnel_addr,
                connect_socket,
                _link: None,
            });
        };
        let edge = Proc::start(
            &format!("{name}-edge"),
            dir,
            bin,
            &["edge".into(), "--config".into(), path_str(&edge_path)?],
            &env,
        )?;
        let mut me = Self {
            cloud,
            edge: Some(edge),
            endpoints,
            tunnel_addr,
            connect_socket,
            _link: link,
        };
        if !wait_ready {
            return Ok(me);
        }
        wait_until("tunnel edge registered", Duration::from_secs(15), || {
            http_ok(admin, "/readyz")
        })
        .with_context(|| {
            format!(
                "edge log:\n{}",
                me.edge.as_ref().map(|e| e.log_tail()).unwrap_or_default()
            )
        })?;
        me.check_alive()?;
        if let Some(echo) = me.endpoints.get(ECHO).copied() {
            wait_until("echo through the tunnel", Duration::from_secs(10), || {
                echo_ok(echo)
            })?;
        }
        if let Some(socket) = &me.connect_socket {
            wait_until(
                "the cloud's CONNECT socket",
                Duration::from_secs(10),
                || socket.exists(),
            )?;
        }
        Ok(me)
    }

    pub fn check_alive(&mut self) -> Result<()> {
        self.cloud.check_alive()?;
        if let Some(e) = &mut self.edge {
            e.check_alive()?;
        }
        Ok(())
    }
}

/// rathole server + client with one service per target.
pub struct Rathole {
    pub server: Proc,
    pub client: Proc,
    pub endpoints: Endpoints,
    /// The delaying proxy between client and server, if any.
    _link: Option<DelayProxy>,
}

/// rathole's TLS transport: the server's PKCS#12 identity and the CA the client trusts.
pub struct RatholeTls {
    pub pkcs12: PathBuf,
    pub ca: PathBuf,
}

impl Rathole {
    pub fn start(
        bin: &Path,
        dir: &Path,
        name: &str,
        targets: &Endpoints,
        tls: Option<&RatholeTls>,
    ) -> Result<Self> {
        Self::start_linked(bin, dir, name, targets, tls, None)
    }

    /// `start`, with the client reaching the server through a proxy delaying each way
    /// by `link_delay`.
    pub fn start_linked(
        bin: &Path,
        dir: &Path,
        name: &str,
        targets: &Endpoints,
        tls: Option<&RatholeTls>,
        link_delay: Option<Duration>,
    ) -> Result<Self> {
        Self::launch(bin, dir, name, targets, tls, link_delay, true)
    }

    /// `start` (plain TCP), but returning right after spawning server and client back to
    /// back, for the start-up figures, which time readiness themselves.
    pub fn start_unready(bin: &Path, dir: &Path, name: &str, targets: &Endpoints) -> Result<Self> {
        Self::launch(bin, dir, name, targets, None, None, false)
    }

    fn launch(
        bin: &Path,
        dir: &Path,
        name: &str,
        targets: &Endpoints,
        tls: Option<&RatholeTls>,
        link_delay: Option<Duration>,
        wait_ready: bool,
    ) -> Result<Self> {
        let control = loopback(free_port()?);
        let link = match link_delay {
            Some(d) => Some(DelayProxy::start(control, d, true)?),
            None => None,
        };
        let client_dials = link.as_ref().map_or(control, |l| l.addr);
        let kind = if tls.is_some() { "tls" } else { "tcp" };
        let mut server = format!(
            "[server]\nbind_addr = \"{control}\"\ndefault_token = \"bench\"\n\n[server.transport]\ntype = \"{kind}\"\n[server.transport.tcp]\nnodelay = true\n"
        );
        let mut client = format!(
            "[client]\nremote_addr = \"{client_dials}\"\ndefault_token = \"bench\"\n\n[client.transport]\ntype = \"{kind}\"\n[client.transport.tcp]\nnodelay = true\n"
        );
        if let Some(tls) = tls {
            let _ = write!(
                server,
                "[server.transport.tls]\npkcs12 = \"{}\"\npkcs12_password = \"bench\"\n",
                tls.pkcs12.display()
            );
            let _ = write!(
                client,
                "[client.transport.tls]\ntrusted_root = \"{}\"\nhostname = \"tunnel-cloud\"\n",
                tls.ca.display()
            );
        }
        let mut endpoints = Endpoints::new();
        for (service, target) in targets {
            let listen = loopback(free_port()?);
            let _ = write!(
                server,
                "\n[server.services.{service}]\nbind_addr = \"{listen}\"\nnodelay = true\n"
            );
            let _ = write!(
                client,
                "\n[client.services.{service}]\nlocal_addr = \"{target}\"\nnodelay = true\n"
            );
            endpoints.insert(*service, listen);
        }
        let server_path = dir.join(format!("{name}-server.toml"));
        let client_path = dir.join(format!("{name}-client.toml"));
        std::fs::write(&server_path, server)?;
        std::fs::write(&client_path, client)?;
        let env = [("RUST_LOG", "warn")];
        let server = Proc::start(
            &format!("{name}-server"),
            dir,
            bin,
            &["--server".into(), path_str(&server_path)?],
            &env,
        )?;
        if wait_ready {
            wait_listening(control, Duration::from_secs(10))
                .with_context(|| format!("rathole server log:\n{}", server.log_tail()))?;
        }
        let client = Proc::start(
            &format!("{name}-client"),
            dir,
            bin,
            &["--client".into(), path_str(&client_path)?],
            &env,
        )?;
        let mut me = Self {
            server,
            client,
            endpoints,
            _link: link,
        };
        if !wait_ready {
            return Ok(me);
        }
        // A service's port opens once its control channel is up; the echo round trip
        // proves the data path too.
        let ready = me.endpoints.values().copied().collect::<Vec<_>>();
        for addr in ready {
            super::procs::wait_bound(addr, Duration::from_secs(15)).with_context(|| {
                format!(
                    "rathole service {addr}; client log:\n{}",
                    me.client.log_tail()
                )
            })?;
        }
        if let Some(echo) = me.endpoints.get(ECHO).copied() {
            wait_until("echo through rathole", Duration::from_secs(10), || {
                echo_ok(echo)
            })?;
        }
        me.check_alive()?;
        Ok(me)
    }

    pub fn check_alive(&mut self) -> Result<()> {
        self.server.check_alive()?;
        self.client.check_alive()
    }
}
