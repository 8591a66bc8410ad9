//! Konnectivity (kubernetes-sigs/apiserver-network-proxy), the egress-selector backend
//! Kubernetes ships, in its production shape: proxy-server takes HTTP CONNECT on a unix
//! socket, proxy-agent dials out to it over mTLS and dials the targets. And the front
//! both CONNECT paths share: the load tools speak neither HTTP CONNECT nor unix sockets.

use std::io::Read as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};

use super::delay::DelayProxy;
use super::procs::{Proc, echo_ok, fixed_port, free_port, http_ok, socket_path, wait_until};
use super::setup::{EDGE_NODE, Pki};
use super::stack::{ECHO, Endpoints};

/// The variable naming the directory with `proxy-server` and `proxy-agent` (each
/// gzip-compressed, `.gz`, or not).
pub const DIR_VAR: &str = "KONNECTIVITY_DIR";

/// The two binaries, unpacked and executable.
pub struct Bins {
    pub server: PathBuf,
    pub agent: PathBuf,
}

/// Finds the binaries in `$KONNECTIVITY_DIR` or, when it is not set, in
/// `../shared/konnectivity` next to the checkout, and unpacks them into `into`.
/// Err: why the Konnectivity column is left out.
pub fn find(root: &Path, into: &Path) -> std::result::Result<Bins, String> {
    match std::env::var_os(DIR_VAR) {
        Some(dir) => find_in(Path::new(&dir), into).map_err(|e| format!("{DIR_VAR}: {e}")),
        None => find_in(&root.join("../shared/konnectivity"), into)
            .map_err(|e| format!("{e} (or set {DIR_VAR} to the directory holding them)")),
    }
}

/// `find` in `dir`.
fn find_in(dir: &Path, into: &Path) -> std::result::Result<Bins, String> {
    let from = |name: &str| -> std::result::Result<PathBuf, String> {
        [format!("{name}.gz"), name.to_string()]
            .iter()
            .map(|f| dir.join(f))
            .find(|p| p.is_file())
            .ok_or_else(|| format!("no {name} or {name}.gz in {}", dir.display()))
    };
    let (server, agent) = (from("proxy-server")?, from("proxy-agent")?);
    std::fs::create_dir_all(into).map_err(|e| format!("{}: {e}", into.display()))?;
    Ok(Bins {
        server: unpack(&server, &into.join("proxy-server"))
            .map_err(|e| format!("unpack {}: {e:#}", server.display()))?,
        agent: unpack(&agent, &into.join("proxy-agent"))
            .map_err(|e| format!("unpack {}: {e:#}", agent.display()))?,
    })
}

/// `from`, gunzipped when it ends in `.gz`, as the executable `to` (written beside it
/// and renamed, so a running copy is never overwritten in place).
fn unpack(from: &Path, to: &Path) -> Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt as _;
    let mut bytes = Vec::new();
    let file = std::fs::File::open(from)?;
    if from.extension().is_some_and(|e| e == "gz") {
        flate2::read::GzDecoder::new(file).read_to_end(&mut bytes)?;
    } else {
        std::io::BufReader::new(file).read_to_end(&mut bytes)?;
    }
    let tmp = to.with_extension("new");
    std::fs::write(&tmp, bytes)?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))?;
    std::fs::rename(&tmp, to)?;
    Ok(to.to_path_buf())
}

/// proxy-server and proxy-agent, connected.
pub struct Konnectivity {
    pub server: Proc,
    pub agent: Proc,
    /// The server's HTTP CONNECT socket.
    pub socket: PathBuf,
    /// The delaying proxy between agent and server, if any.
    _link: Option<DelayProxy>,
}

impl Konnectivity {
    /// Returns once the server counts the agent as connected.
    pub fn start(
        bins: &Bins,
        pki: &Pki,
        dir: &Path,
        name: &str,
        link_delay: Option<Duration>,
    ) -> Result<Self> {
        Self::launch(bins, pki, dir, name, link_delay, true)
    }

    /// `start`, but returning right after spawning server and agent back to back, for
    /// the start-up figures, which time readiness themselves.
    pub fn start_unready(bins: &Bins, pki: &Pki, dir: &Path, name: &str) -> Result<Self> {
        Self::launch(bins, pki, dir, name, None, false)
    }

    /// The flags of the shared folder's README: the server's client side on a unix
    /// socket and no TCP listener for clients, the agent identified by the node address
    /// (127.0.0.1 here), mTLS between them with the bench's certificates: the cloud's
    /// for the server, the edge's for the agent, one CA. Its own listeners must be
    /// outside the ephemeral range.
    fn launch(
        bins: &Bins,
        pki: &Pki,
        dir: &Path,
        name: &str,
        link_delay: Option<Duration>,
        wait_ready: bool,
    ) -> Result<Self> {
        let socket = Self::socket(dir, name)?;
        let agent_port = fixed_port()?;
        let health = fixed_port()?;
        let agent_addr = SocketAddr::from(([127, 0, 0, 1], agent_port));
        let link = match link_delay {
            Some(d) => Some(DelayProxy::start(agent_addr, d, true)?),
            None => None,
        };
        let agent_dials = link.as_ref().map_or(agent_addr, |l| l.addr);
        let certs = pki.dir.display();
        let server_args = vec![
            "--mode=http-connect".to_string(),
            format!("--uds-name={}", socket.display()),
            "--delete-existing-uds-file".into(),
            "--server-port=0".into(),
            format!("--agent-port={agent_port}"),
            "--agent-bind-address=127.0.0.1".into(),
            format!("--admin-port={}", fixed_port()?),
            format!("--health-port={health}"),
            "--health-bind-address=127.0.0.1".into(),
            format!("--cluster-cert={certs}/cloud.crt"),
            format!("--cluster-key={certs}/cloud.key"),
            format!("--cluster-ca-cert={certs}/ca.crt"),
            "--server-count=1".into(),
        ];
        let agent_args = vec![
            "--proxy-server-host=127.0.0.1".to_string(),
            format!("--proxy-server-port={}", agent_dials.port()),
            format!("--ca-cert={certs}/ca.crt"),
            format!("--agent-cert={certs}/edge-{EDGE_NODE}.crt"),
            format!("--agent-key={certs}/edge-{EDGE_NODE}.key"),
            format!("--admin-server-port={}", fixed_port()?),
            format!("--health-server-port={}", fixed_port()?),
            "--health-server-host=127.0.0.1".into(),
            "--agent-identifiers=ipv4=127.0.0.1".into(),
        ];
        let server = Proc::start(
            &format!("{name}-server"),
            dir,
            &bins.server,
            &server_args,
            &[],
        )?;
        if wait_ready {
            super::procs::wait_listening(agent_addr, Duration::from_secs(10))
                .with_context(|| format!("proxy-server log:\n{}", server.log_tail()))?;
        }
        let agent = Proc::start(&format!("{name}-agent"), dir, &bins.agent, &agent_args, &[])?;
        let mut me = Self {
            server,
            agent,
            socket,
            _link: link,
        };
        if !wait_ready {
            return Ok(me);
        }
        // The server is ready once it has a backend (a connected agent).
        let health = SocketAddr::from(([127, 0, 0, 1], health));
        wait_until(
            "Konnectivity agent connected",
            Duration::from_secs(15),
            || http_ok(health, "/readyz"),
        )
        .with_context(|| format!("proxy-agent log:\n{}", me.agent.log_tail()))?;
        me.check_alive()?;
        Ok(me)
    }

    /// The server's HTTP CONNECT socket for a stack called `name`, known before it starts.
    pub fn socket(dir: &Path, name: &str) -> Result<PathBuf> {
        socket_path(dir, &format!("{name}.sock"))
    }

    pub fn check_alive(&mut self) -> Result<()> {
        self.server.check_alive()?;
        self.agent.check_alive()
    }
}

/// A helper process with a TCP listener per target that carries each connection
/// through an HTTP CONNECT proxy's unix socket: what the load tools connect to on the
/// CONNECT paths. It is in both CONNECT columns and in neither of the others; its CPU
/// is not counted as the relay's.
pub struct ConnectFront {
    pub proc: Proc,
    pub endpoints: Endpoints,
}

impl ConnectFront {
    /// `authority`: what to CONNECT to for a target, e.g. `node:port`.
    pub fn start(
        bench_bin: &Path,
        dir: &Path,
        name: &str,
        socket: &Path,
        targets: &Endpoints,
        authority: impl Fn(SocketAddr) -> String,
    ) -> Result<Self> {
        let mut args = vec![
            "bench-helper".to_string(),
            "connect-front".into(),
            "--socket".into(),
            socket.to_str().context("non-UTF-8 socket path")?.into(),
        ];
        let mut endpoints = Endpoints::new();
        for (service, target) in targets {
            let listen = SocketAddr::from(([127, 0, 0, 1], free_port()?));
            args.push("--map".into());
            args.push(format!("{listen}={}", authority(*target)));
            endpoints.insert(*service, listen);
        }
        let mut proc = Proc::start_piped(&format!("{name}-front"), dir, bench_bin, &args, &[])?;
        proc.wait_line(Duration::from_secs(10), |l| (l == "ready").then_some(()))?;
        Ok(Self { proc, endpoints })
    }

    /// Waits for a byte echoed through `what`'s CONNECT, when the echo server is a target.
    pub fn wait_echo(&mut self, what: &str) -> Result<()> {
        if let Some(echo) = self.endpoints.get(ECHO).copied() {
            wait_until(
                &format!("echo through {what}"),
                Duration::from_secs(10),
                || echo_ok(echo),
            )?;
        }
        self.check_alive()
    }

    pub fn check_alive(&mut self) -> Result<()> {
        self.proc.check_alive()
    }
}

/// What the tunnel's CONNECT is asked for: the edge's node name and the target's port
/// (the edge dials its own loopback, where the targets are).
pub fn tunnel_authority(target: SocketAddr) -> String {
    format!("{EDGE_NODE}:{}", target.port())
}

/// What Konnectivity's CONNECT is asked for: the node address (the agent's identifier,
/// 127.0.0.1 here) and the port, as kube-apiserver asks for a kubelet.
pub fn konnectivity_authority(target: SocketAddr) -> String {
    target.to_string()
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use super::*;

    #[test]
    fn finds_and_unpacks_or_says_why_not() {
        let base = std::env::temp_dir().join(format!("bench-konn-test-{}", std::process::id()));
        let (dir, into) = (base.join("shared"), base.join("out"));
        std::fs::create_dir_all(&dir).unwrap();
        let why = find_in(&dir, &into).err().unwrap();
        assert!(
            why.contains("no proxy-server or proxy-server.gz in"),
            "{why}"
        );
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        gz.write_all(b"#!/bin/sh\n").unwrap();
        std::fs::write(dir.join("proxy-server.gz"), gz.finish().unwrap()).unwrap();
        let why = find_in(&dir, &into).err().unwrap();
        assert!(why.contains("no proxy-agent"), "{why}");
        std::fs::write(dir.join("proxy-agent"), "plain").unwrap();
        let bins = find_in(&dir, &into).unwrap();
        assert_eq!(std::fs::read(&bins.server).unwrap(), b"#!/bin/sh\n");
        assert_eq!(std::fs::read(&bins.agent).unwrap(), b"plain");
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(&bins.server)
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o111, 0o111);
        std::fs::remove_dir_all(&base).unwrap();
    }
}
