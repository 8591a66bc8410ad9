//! The replica set of the fleet figures: `tunnel cloud` replicas on 127.0.0.1 as deploy/
//! runs them, each in a memory cgroup of its own with a limit (its edge cap derives from
//! it, and its usage, the kernel's socket memory included, is what a pod's limit counts),
//! linked by a static peer list, with `[kubernetes]` and `[csr]` on against the bench's
//! API server and `[redirect]` attached to an empty child cgroup of its own (as root).

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};

use super::super::procs::{
    Proc, cgroup_made, cgroup_removed, free_port, remove_cgroup, wait_listening,
};
use super::super::setup::Pki;

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// A cgroup directory the bench made, removed when dropped (once empty).
struct Cgroup(PathBuf);

impl Cgroup {
    fn create(dir: PathBuf) -> Result<Self> {
        std::fs::create_dir(&dir).with_context(|| format!("mkdir {}", dir.display()))?;
        cgroup_made(&dir);
        Ok(Self(dir))
    }

    fn read(&self, file: &str) -> Result<u64> {
        let path = self.0.join(file);
        std::fs::read_to_string(&path)
            .with_context(|| format!("read {}", path.display()))?
            .trim()
            .parse()
            .with_context(|| format!("{}: not a number", path.display()))
    }

    fn write(&self, file: &str, value: &str) -> Result<()> {
        let path = self.0.join(file);
        std::fs::write(&path, value).with_context(|| format!("write {value} to {}", path.display()))
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        // The killed process leaves its cgroup a moment after the kill returns.
        if remove_cgroup(&self.0) {
            cgroup_removed(&self.0);
        } else {
            eprintln!("bench: WARNING: could not remove {}", self.0.display());
        }
    }
}

/// A replica's memory cgroup: cgroup v1's memory controller where it is mounted (a
/// hybrid host, like this one), else v2's. Made under the bench's own cgroup.
struct Memory {
    cgroup: Cgroup,
    v1: bool,
}

impl Memory {
    fn create(name: &str, limit: u64) -> Result<Self> {
        let own = std::fs::read_to_string("/proc/self/cgroup")?;
        let v1 = own.lines().find_map(|l| {
            let (_, rest) = l.split_once(':')?;
            let (controllers, path) = rest.split_once(':')?;
            controllers
                .split(',')
                .any(|c| c == "memory")
                .then_some(path)
        });
        match v1 {
            Some(path) => {
                let dir = Path::new("/sys/fs/cgroup/memory")
                    .join(path.trim_start_matches('/'))
                    .join(name);
                let cgroup = Cgroup::create(dir)?;
                cgroup.write("memory.limit_in_bytes", &limit.to_string())?;
                // v1 charges socket buffers to a cgroup only once its TCP limit is set
                // (and then apart from memory.usage_in_bytes); v2 always, in memory.current.
                cgroup.write("memory.kmem.tcp.limit_in_bytes", "-1")?;
                Ok(Self { cgroup, v1: true })
            }
            None => {
                let path = own
                    .lines()
                    .find_map(|l| l.strip_prefix("0::"))
                    .context("no cgroup in /proc/self/cgroup")?;
                let dir = Path::new("/sys/fs/cgroup")
                    .join(path.trim_start_matches('/'))
                    .join(name);
                let cgroup = Cgroup::create(dir)?;
                cgroup
                    .write("memory.max", &limit.to_string())
                    .context("the bench's cgroup does not delegate the memory controller")?;
                Ok(Self { cgroup, v1: false })
            }
        }
    }

    /// Bytes charged: user memory, kernel objects (sockets among them) and socket buffers.
    fn usage(&self) -> Result<u64> {
        if self.v1 {
            Ok(self.cgroup.read("memory.usage_in_bytes")?
                + self.cgroup.read("memory.kmem.tcp.usage_in_bytes")?)
        } else {
            self.cgroup.read("memory.current")
        }
    }

    fn procs(&self) -> PathBuf {
        self.cgroup.0.join("cgroup.procs")
    }
}

pub struct Replica {
    pub name: String,
    proc: Option<Proc>,
    pub tunnel: SocketAddr,
    pub connect: SocketAddr,
    /// Its peer listener, where the other replicas and relays link.
    pub peer: SocketAddr,
    admin: SocketAddr,
    memory: Option<Memory>,
    /// The empty cgroup its redirect attaches to.
    _redirect: Option<Cgroup>,
}

/// What the replicas are started with, beyond their listeners.
pub struct Options<'a> {
    pub tunnel_bin: &'a Path,
    pub pki: &'a Pki,
    pub work: &'a Path,
    /// The memory limit of each replica's cgroup.
    pub memory_limit: u64,
    /// The API server's kubeconfig: `[kubernetes]` and `[csr]` on.
    pub kubeconfig: Option<&'a Path>,
    /// `[redirect]` on, each replica attached to an empty child cgroup of this cgroup v2
    /// directory.
    pub redirect_root: Option<&'a Path>,
}

/// Started together and linked by a static peer list (each skips itself); killed when
/// dropped.
pub struct ReplicaSet {
    pub replicas: Vec<Replica>,
}

impl ReplicaSet {
    /// `count` replicas; waits until each accepts edges.
    pub fn start(count: usize, o: &Options<'_>) -> Result<Self> {
        let peers: Vec<SocketAddr> = (0..count)
            .map(|_| free_port().map(loopback))
            .collect::<Result<_>>()?;
        let static_peers: Vec<String> = peers.iter().map(|p| format!("\"{p}\"")).collect();
        let mut replicas = Vec::new();
        for (i, peer) in peers.iter().enumerate() {
            let name = format!("replica-{i}");
            let tag = format!("tunnel-bench-{}-{name}", std::process::id());
            let mut r = Replica {
                tunnel: loopback(free_port()?),
                connect: loopback(free_port()?),
                peer: *peer,
                admin: loopback(free_port()?),
                memory: Some(Memory::create(&tag, o.memory_limit).with_context(|| {
                    format!(
                        "{name}'s memory cgroup (the bench needs root and the memory controller)"
                    )
                })?),
                _redirect: o
                    .redirect_root
                    .map(|root| Cgroup::create(root.join(&tag)))
                    .transpose()?,
                proc: None,
                name,
            };
            let mut cfg = format!(
                r#"[tunnel]
listen = "{tunnel}"
cert = "{certs}/cloud.crt"
key = "{certs}/cloud.key"
client_ca = "{certs}/ca.crt"
cloud_id = "{name}"

[connect]
listen = "{connect}"

[admin]
listen = "{admin}"

[peers]
listen = "{peer}"
static = [{peers}]
"#,
                tunnel = r.tunnel,
                connect = r.connect,
                admin = r.admin,
                peer = r.peer,
                name = r.name,
                certs = o.pki.dir.display(),
                peers = static_peers.join(", "),
            );
            if o.kubeconfig.is_some() {
                cfg.push_str(&format!(
                    "\n[kubernetes]\nenabled = true\n\n[csr]\nenabled = true\nca_key = \"{}/ca.key\"\n",
                    o.pki.dir.display()
                ));
            }
            if let Some(cgroup) = &r._redirect {
                cfg.push_str(&format!(
                    "\n[redirect]\nenabled = true\ncgroup = \"{}\"\nlisten = \"{}\"\n",
                    cgroup.0.display(),
                    loopback(free_port()?),
                ));
            }
            let path = o.work.join(format!("{}.toml", r.name));
            std::fs::write(&path, cfg)?;
            let procs = r.memory.as_ref().context("memory cgroup")?.procs();
            // The shell moves itself into the replica's cgroup, then becomes the cloud.
            let args: Vec<String> = [
                "-c",
                r#"echo $$ > "$0" && exec "$@""#,
                &procs.display().to_string(),
                &o.tunnel_bin.display().to_string(),
                "cloud",
                "--config",
                &path.display().to_string(),
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            let kubeconfig = o.kubeconfig.map(|k| k.display().to_string());
            let mut env = vec![("RUST_LOG", "info")];
            if let Some(k) = &kubeconfig {
                env.push(("KUBECONFIG", k));
            }
            r.proc = Some(Proc::start(
                &r.name,
                o.work,
                Path::new("/bin/sh"),
                &args,
                &env,
            )?);
            replicas.push(r);
        }
        for r in &replicas {
            wait_listening(r.tunnel, Duration::from_secs(60))
                .with_context(|| format!("{}: log {}", r.name, r.log().display()))?;
        }
        Ok(Self { replicas })
    }

    pub fn tunnels(&self) -> Vec<SocketAddr> {
        self.replicas.iter().map(|r| r.tunnel).collect()
    }
}

impl Replica {
    fn proc(&self) -> Result<&Proc> {
        self.proc
            .as_ref()
            .with_context(|| format!("{} was killed", self.name))
    }

    pub fn log(&self) -> PathBuf {
        self.proc
            .as_ref()
            .map(|p| p.log.clone())
            .unwrap_or_default()
    }

    pub fn rss_kib(&self) -> Result<u64> {
        self.proc()?.rss_kib()
    }

    pub fn cpu_time(&self) -> Result<Duration> {
        self.proc()?.cpu_time()
    }

    /// Bytes its memory cgroup is charged, socket memory included.
    pub fn cgroup_bytes(&self) -> Result<u64> {
        self.memory.as_ref().context("no memory cgroup")?.usage()
    }

    /// SIGKILL, as an OOM kill or a lost master would end it.
    pub fn kill(&mut self) {
        drop(self.proc.take());
    }

    /// `tunnel_edges_connected` and `tunnel_edges_max` (0 without a cap) from its
    /// `/metrics`; tried three times, as a loaded replica may not answer within the
    /// bounds.
    pub fn edges(&self) -> Result<(u64, u64)> {
        let mut tries = 0;
        loop {
            match self.read_edges() {
                Err(e) if tries < 2 => {
                    tries += 1;
                    eprintln!("bench: {}: /metrics: {e:#}; again", self.name);
                }
                read => return read,
            }
        }
    }

    /// `edges`, once, read no further than those two.
    fn read_edges(&self) -> Result<(u64, u64)> {
        let mut conn = TcpStream::connect_timeout(&self.admin, Duration::from_secs(2))?;
        conn.set_read_timeout(Some(Duration::from_secs(5)))?;
        write!(
            conn,
            "GET /metrics HTTP/1.0\r\nHost: {}\r\n\r\n",
            self.admin
        )?;
        let (mut connected, mut max) = (None, None);
        for line in BufReader::new(conn).lines() {
            let line = line?;
            let mut w = line.split_whitespace();
            let value = |v: Option<&str>| v.and_then(|v| v.parse::<f64>().ok()).map(|v| v as u64);
            match w.next() {
                Some("tunnel_edges_connected") => connected = value(w.next()),
                Some("tunnel_edges_max") => max = value(w.next()),
                // The cap comes right after the count, when there is one.
                Some("tunnel_edges_near_cap") => break,
                _ => {}
            }
        }
        match connected {
            Some(c) => Ok((c, max.unwrap_or(0))),
            None => bail!("{}: no tunnel_edges_connected in /metrics", self.name),
        }
    }
}
