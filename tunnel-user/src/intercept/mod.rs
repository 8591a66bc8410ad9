//! Transparent interception of `connect()` to edge targets (the eBPF side is
//! `tunnel-ebpf`; the shared map layouts are `tunnel-common`).
//!
//! [`Interceptor::attach`] loads the embedded object, attaches `cgroup/connect4`,
//! `sockops` and `cgroup/getpeername4` (and their v6 twins, which handle IPv6 edges, sent
//! to the IPv6 redirect listener, and IPv4 edges dialled as `::ffff:a.b.c.d` from
//! AF_INET6 sockets) to a cgroup v2 directory
//! (normally its root, so every process on the master is covered), and keeps them
//! attached until it is dropped. The redirect listener calls
//! [`Interceptor::take_original_dst`] with each accepted socket's peer address to learn
//! where the client meant to go.
//!
//! [`Interceptor::set_no_tunnel`] marks the edge addresses whose node no replica holds a
//! tunnel to: connects to them fail at once with "host is down" instead of being
//! redirected to a cloud that could only reset them (on Linux 5.18+, where the programs
//! can set the errno; older kernels get programs that redirect them as before).
//!
//! Which clients are left alone: anything not dialling an edge (ip, port) from
//! [`Interceptor::set_edges`], non-TCP sockets, and every process in the exempt cgroup
//! (by default the loader's own cgroup, so tunnel-cloud's own dials are never looped
//! back into itself). The exemption is by cgroup id rather than by tgid because the
//! eBPF side sees tgids of the initial pid namespace, which a containerised
//! tunnel-cloud cannot learn about itself, while a cgroup id is the same from
//! everywhere; and a cgroup holds only tunnel-cloud in a Kubernetes pod or a systemd
//! unit. The cost: other processes sharing that cgroup are exempt too.

mod cgroup;
mod ebpf_log;
mod kernel;
mod pin;
mod programs;
pub use pin::{is_bpffs, mount_bpffs};
pub(crate) use programs::Programs;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::error::Error as StdError;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::AsFd as _;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use aya::maps::{Array, HashMap as BpfHashMap, IterableMap as _, MapData, MapError, PerCpuArray};
use aya::programs::{CgroupAttachMode, CgroupSockAddr, ProgramError, SockOps};
use aya::{Ebpf, EbpfLoader};
use tunnel_common::{
    COUNTERS_LEN, Config, Counter, EDGES_MAX, EdgeState, Endpoint, Endpoint6, maps,
};

pub(crate) use cgroup::{attach_cgroup, own_cgroup};
pub use cgroup::{cgroup_id, detect_cgroup_root};

/// The eBPF object built from tunnel-ebpf by `build.rs`.
static OBJECT: &[u8] = aya::include_bytes_aligned!(env!("TUNNEL_EBPF_OBJECT"));

/// kubelet's port: what the control plane dials on edge nodes.
pub(crate) const DEFAULT_PORTS: [u16; 1] = [10250];

/// Program names in the object (the function names in tunnel-ebpf).
const PROG_CONNECT4: &str = "connect4";
const PROG_CONNECT6: &str = "connect6";
/// connect4/6 for kernels without `bpf_set_retval` (before 5.18): they redirect an edge
/// without a tunnel instead of refusing it. Linked under the same pins as connect4/6.
const PROG_CONNECT4_RESET: &str = "connect4_reset";
const PROG_CONNECT6_RESET: &str = "connect6_reset";
const PROG_GETPEERNAME4: &str = "getpeername4";
const PROG_GETPEERNAME6: &str = "getpeername6";
const PROG_SOCKOPS: &str = "sockops_handoff";

/// Every program linked, as the kernel names them (the attach order is in
/// [`Interceptor::attach`]); on a kernel before 5.18 connect4/6 are `connect4_reset` and
/// `connect6_reset`, whose names hold theirs.
pub const PROGRAM_NAMES: [&str; 5] = [
    PROG_SOCKOPS,
    PROG_GETPEERNAME4,
    PROG_GETPEERNAME6,
    PROG_CONNECT4,
    PROG_CONNECT6,
];

#[derive(Debug, Clone)]
pub struct InterceptConfig {
    /// cgroup v2 directory to attach to; `None` = the root of the hierarchy
    /// ([`detect_cgroup_root`]), which covers every process on the node. In a container
    /// with its own cgroup namespace `/sys/fs/cgroup` is the container's own cgroup:
    /// mount the host's cgroup2 (a hostPath volume) and name it here.
    pub cgroup: Option<PathBuf>,
    /// Redirect listener for clients in the loader's network namespace (loopback).
    pub redirect_to: SocketAddrV4,
    /// Redirect listener for clients in other network namespaces (pods), which cannot
    /// reach the host's loopback: in production the node IP. `None` = pods' connects
    /// to edges go ahead unchanged (and count as errors).
    pub pod_redirect_to: Option<SocketAddrV4>,
    /// As `redirect_to`, for IPv6 edge addresses: an IPv6 listener (`[::1]` in
    /// production). `None` = connects to IPv6 edges go ahead unchanged (and count as
    /// errors).
    pub redirect6_to: Option<SocketAddrV6>,
    /// As `pod_redirect_to`, for IPv6 edge addresses.
    pub pod_redirect6_to: Option<SocketAddrV6>,
    /// Edge ports to intercept on every edge IP.
    pub ports: Vec<u16>,
    /// Entries of each edge map (IPv4, IPv6): addresses × `ports` it can hold. A map a
    /// predecessor pinned keeps the size it was made with ([`Interceptor::edge_map_capacity`]).
    pub edge_map_entries: u32,
    /// cgroup v2 directory whose processes are never redirected; `None` = the loader's
    /// own cgroup.
    pub exempt_cgroup: Option<PathBuf>,
    /// bpffs directory where the links and shared maps are pinned, so the programs stay
    /// attached after this process exits and the next one adopts them; `None` = nothing
    /// is pinned and dropping the [`Interceptor`] detaches everything.
    pub pin_dir: Option<PathBuf>,
    /// How long the programs keep redirecting after the last [`Interceptor::keep_alive`]:
    /// past it they let connects go where they were dialled (the cloud is gone for good).
    /// `None` = they redirect for as long as they are attached.
    pub fail_open_after: Option<std::time::Duration>,
}

impl InterceptConfig {
    /// Attach at the cgroup root, intercept [`DEFAULT_PORTS`], exempt our own cgroup.
    pub fn new(redirect_to: SocketAddrV4) -> Self {
        Self {
            cgroup: None,
            redirect_to,
            pod_redirect_to: None,
            redirect6_to: None,
            pod_redirect6_to: None,
            ports: DEFAULT_PORTS.to_vec(),
            edge_map_entries: EDGES_MAX,
            exempt_cgroup: None,
            pin_dir: None,
            fail_open_after: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum InterceptError {
    #[error(
        "not privileged to load eBPF programs: run as root or with CAP_BPF, CAP_NET_ADMIN \
         and CAP_SYS_ADMIN ({context})"
    )]
    NotPrivileged { context: String },
    #[error(
        "no cgroup v2 hierarchy at {path}: mount cgroup2 there or configure the cgroup \
         path (hybrid hosts have it at /sys/fs/cgroup/unified); a host with cgroup v1 \
         only cannot use the eBPF redirect: {FALLBACK}",
        path = path.display()
    )]
    NoCgroupV2 { path: PathBuf },
    #[error("Linux {release} lacks {what}, which the eBPF redirect needs: {FALLBACK}")]
    KernelFeature { release: String, what: String },
    #[error(
        "Linux {release} is too old for the eBPF redirect: it needs {feature} (Linux \
         {}.{}+): {FALLBACK}", need.0, need.1
    )]
    KernelTooOld {
        release: String,
        feature: &'static str,
        need: (u32, u32),
    },
    #[error(
        "no cgroup2 mount of this process's own cgroup namespace shows its cgroup \
         ({cgroup}), so the exemption of our own connections cannot be set: mount the \
         host's hierarchy at a path of its own (e.g. /run/tunnel/cgroup), not over \
         /sys/fs/cgroup"
    )]
    OwnCgroupHidden { cgroup: String },
    #[error("cannot use cgroup {path} as the exempt cgroup: {source}", path = path.display())]
    ExemptCgroup { path: PathBuf, source: io::Error },
    #[error("loading the eBPF {what} failed: {source}")]
    Load {
        what: String,
        source: Box<dyn StdError + Send + Sync>,
    },
    #[error("pinning in {path} failed (is it on a bpffs?): {source}", path = path.display())]
    Pin { path: PathBuf, source: io::Error },
    #[error(
        "the pin directory {path} is not on a bpffs: mount one (`mount -t bpf bpffs \
         /sys/fs/bpf`, or `tunnel mount-bpffs /sys/fs/bpf` as the DaemonSet's init \
         container does) or unset redirect.pin_dir",
        path = path.display()
    )]
    NotBpffs { path: PathBuf },
    #[error("updating eBPF map {map} failed: {source}")]
    Map { map: &'static str, source: MapError },
}

/// What to use instead of the redirect where it cannot run.
const FALLBACK: &str = "leave [redirect] off and send kube-apiserver's traffic to edges \
     through the HTTP CONNECT entry ([connect], kube-apiserver's egress selector)";

/// Refuses, before loading anything, a kernel that lacks what the programs and the
/// loader need (an old kernel would otherwise answer with a verifier log): the release
/// first, then aya's feature probes ([`kernel`]).
fn check_kernel() -> Result<(), InterceptError> {
    let release = kernel::release();
    if kernel::parse_release(&release).is_none() {
        tracing::warn!(%release, "cannot parse the kernel release; relying on the feature probes");
    }
    let probed = kernel::probe();
    tracing::debug!(%release, ?probed, "kernel feature probes");
    kernel::verdict(&release, &probed)
}

/// Totals over all CPUs since [`Interceptor::attach`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// connect() calls rewritten to a redirect listener.
    pub redirected: u64,
    /// connect() calls left alone (not an edge target, not TCP, exempt).
    pub passed: u64,
    /// Edge connects that could not be redirected and went ahead unchanged, and
    /// original destinations that could not be recorded.
    pub errors: u64,
    /// Edge connects failed at once with "host is down": no replica held the node's
    /// tunnel ([`Interceptor::set_no_tunnel`]).
    pub no_tunnel: u64,
}

struct Maps {
    /// Entries each edge map holds: the smaller of the two, as the kernel made them.
    edge_capacity: usize,
    edges: EdgeMap<Endpoint>,
    edges6: EdgeMap<Endpoint6>,
    /// Addresses (canonical) whose node has no tunnel: their entries hold
    /// [`EdgeState::NoTunnel`].
    no_tunnel: HashSet<IpAddr>,
    /// The addresses asked for (canonical), each with its place in the order a full map
    /// takes them in ([`Interceptor::set_edges`]); how many of each family; and whether
    /// the map could not hold them all: then a change of `no_tunnel` changes which it
    /// holds.
    wanted: HashMap<IpAddr, u32>,
    wanted4: usize,
    wanted6: usize,
    full: bool,
}

/// The original destinations sock_ops records, which every redirected connection takes
/// once: under a lock of their own, so that no change of the edge maps (a pass over
/// every entry when the "no tunnel" marks change) delays an accept.
struct Originals {
    v4: BpfHashMap<MapData, Endpoint, Endpoint>,
    v6: BpfHashMap<MapData, Endpoint6, Endpoint6>,
}

/// An edge map and what it holds, so that marking addresses writes only the entries
/// that change, without reading the whole map back each time.
struct EdgeMap<K> {
    map: BpfHashMap<MapData, K, u32>,
    name: &'static str,
    /// The map's entries as last read or written.
    held: HashMap<K, u32>,
}

impl<K: aya::Pod + Eq + std::hash::Hash> EdgeMap<K> {
    fn new(map: BpfHashMap<MapData, K, u32>, name: &'static str) -> Result<Self, InterceptError> {
        let mut edge_map = Self {
            map,
            name,
            held: HashMap::new(),
        };
        edge_map.read()?;
        Ok(edge_map)
    }

    fn map_err(&self, source: MapError) -> InterceptError {
        InterceptError::Map {
            map: self.name,
            source,
        }
    }

    /// Reads the entries back: a predecessor's (pinned), or another process's written
    /// since (the one handing over, until it stops).
    fn read(&mut self) -> Result<(), InterceptError> {
        self.held = self
            .map
            .iter()
            .collect::<Result<_, _>>()
            .map_err(|e| self.map_err(e))?;
        Ok(())
    }

    /// Makes `wanted` the whole map. Removes first, so the map never holds more than
    /// max(old, new) entries; one syscall per entry removed, added or changed.
    fn sync(&mut self, wanted: HashMap<K, u32>) -> Result<(), InterceptError> {
        let stale: Vec<K> = self
            .held
            .keys()
            .filter(|k| !wanted.contains_key(k))
            .copied()
            .collect();
        for key in stale {
            self.remove(key)?;
        }
        for (key, value) in wanted {
            self.insert(key, value)?;
        }
        Ok(())
    }

    /// Takes `key` out, if it holds it.
    fn remove(&mut self, key: K) -> Result<(), InterceptError> {
        if self.held.remove(&key).is_none() {
            return Ok(());
        }
        match self.map.remove(&key) {
            Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
            // Gone already: the process handing over took it out.
            Err(MapError::SyscallError(e)) if e.io_error.kind() == io::ErrorKind::NotFound => {
                Ok(())
            }
            Err(e) => Err(self.map_err(e)),
        }
    }

    /// Puts `key` in with `value`, unless it holds that already.
    fn insert(&mut self, key: K, value: u32) -> Result<(), InterceptError> {
        if self.held.get(&key) != Some(&value) {
            self.map
                .insert(key, value, 0)
                .map_err(|e| self.map_err(e))?;
            self.held.insert(key, value);
        }
        Ok(())
    }

    /// Gives `key` the state `value`, if the map holds it.
    fn restate_held(&mut self, key: K, value: u32) -> Result<(), InterceptError> {
        if self.held.contains_key(&key) {
            self.insert(key, value)?;
        }
        Ok(())
    }

    /// The same keys, each with the state `state` gives it.
    fn restate(&mut self, state: impl Fn(&K) -> u32) -> Result<(), InterceptError> {
        let wanted = self.held.keys().map(|k| (*k, state(k))).collect();
        self.sync(wanted)
    }
}

/// The count of the wanted addresses of `ip`'s family.
fn family_count(maps: &mut Maps, ip: IpAddr) -> &mut usize {
    if ip.to_canonical().is_ipv4() {
        &mut maps.wanted4
    } else {
        &mut maps.wanted6
    }
}

/// The value of an edge map entry for `ip`.
fn edge_state(no_tunnel: &HashSet<IpAddr>, ip: IpAddr) -> u32 {
    let state = if no_tunnel.contains(&ip.to_canonical()) {
        EdgeState::NoTunnel
    } else {
        EdgeState::Redirect
    };
    state as u32
}

impl Maps {
    /// Makes `wanted` the addresses asked for, ranked in the order given.
    fn want(&mut self, wanted: impl IntoIterator<Item = IpAddr>) {
        self.wanted.clear();
        for ip in wanted {
            let rank = u32::try_from(self.wanted.len()).unwrap_or(u32::MAX);
            self.wanted.entry(ip.to_canonical()).or_insert(rank);
        }
        self.wanted4 = self.wanted.keys().filter(|ip| ip.is_ipv4()).count();
        self.wanted6 = self.wanted.len() - self.wanted4;
    }

    /// The addresses asked for, in the order a full map takes them.
    fn ordered(&self) -> Vec<IpAddr> {
        let mut ranked: Vec<(u32, IpAddr)> = self.wanted.iter().map(|(ip, r)| (*r, *ip)).collect();
        ranked.sort_unstable();
        ranked.into_iter().map(|(_, ip)| ip).collect()
    }

    fn take(ebpf: &mut Ebpf) -> Result<Self, InterceptError> {
        let edges: BpfHashMap<MapData, Endpoint, u32> = take_map(ebpf, maps::EDGES)?;
        let edges6: BpfHashMap<MapData, Endpoint6, u32> = take_map(ebpf, maps::EDGES6)?;
        let capacity = |map: &MapData, name| {
            map.info()
                .map(|info| info.max_entries() as usize)
                .map_err(|source| InterceptError::Map { map: name, source })
        };
        let edge_capacity =
            capacity(edges.map(), maps::EDGES)?.min(capacity(edges6.map(), maps::EDGES6)?);
        Ok(Self {
            edge_capacity,
            edges: EdgeMap::new(edges, maps::EDGES)?,
            edges6: EdgeMap::new(edges6, maps::EDGES6)?,
            no_tunnel: HashSet::new(),
            wanted: HashMap::new(),
            wanted4: 0,
            wanted6: 0,
            full: false,
        })
    }
}

impl Originals {
    fn take(ebpf: &mut Ebpf) -> Result<Self, InterceptError> {
        Ok(Self {
            v4: take_map(ebpf, maps::ORIG_BY_PEER)?,
            v6: take_map(ebpf, maps::ORIG6_BY_PEER)?,
        })
    }
}

/// Loaded and attached programs. Without a pin directory, dropping it detaches them (the
/// kernel links are owned by file descriptors inside `ebpf`) and frees the maps; with
/// one, the pinned links and maps stay for the next process ([`uninstall`] removes them).
pub struct Interceptor {
    maps: Mutex<Maps>,
    originals: Mutex<Originals>,
    /// Until when the programs redirect: a lock of its own too, so that no change of the
    /// edge maps delays the renewal.
    alive_until: Mutex<Array<MapData, u64>>,
    counters: PerCpuArray<MapData, u64>,
    ports: Vec<u16>,
    fail_open_after: Option<std::time::Duration>,
    /// Forwards the programs' log records and keeps their log level in step with the
    /// filter; it holds the config map, so it is the only writer of the config.
    log_forwarder: tokio::task::JoinHandle<()>,
    /// When this process took over pinned programs from a predecessor, when it did:
    /// edges are reconnecting then ([`Interceptor::takeover_left`]).
    adopted_at: Option<std::time::Instant>,
    /// Whether connect4/6 refuse a target without a tunnel (Linux 5.18+), or redirect it.
    refuses: bool,
    /// Loaded but not linked yet ([`Interceptor::load`]): what [`Interceptor::link`]
    /// needs.
    pending: Option<Pending>,
    /// Owns the loaded programs and their cgroup links.
    ebpf: Ebpf,
}

/// Where loaded programs go when they are linked, and what to log then.
struct Pending {
    cgroup_path: PathBuf,
    cgroup_fd: std::fs::File,
    pin_dir: Option<PathBuf>,
    exempt_path: PathBuf,
    exempt_cgroup_id: u64,
    redirect_to: SocketAddrV4,
    pod_redirect_to: Option<SocketAddrV4>,
    redirect6_to: Option<SocketAddrV6>,
    pod_redirect6_to: Option<SocketAddrV6>,
}

/// How long after taking over from a predecessor a redirected connection waits for its
/// node's edge to reconnect, instead of failing at once: long enough for an edge to
/// notice the old process is gone and register again (a few hundred milliseconds
/// measured in tests/redirect/), short enough that kube-apiserver's own dial timeout
/// is not reached.
pub(crate) const TAKEOVER_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

impl Drop for Interceptor {
    fn drop(&mut self) {
        self.log_forwarder.abort();
    }
}

impl Interceptor {
    /// [`Interceptor::load`], then [`Interceptor::link`].
    pub fn attach(cfg: &InterceptConfig) -> Result<Self, InterceptError> {
        let mut interceptor = Self::load(cfg)?;
        interceptor.link()?;
        Ok(interceptor)
    }

    /// Checks the kernel, loads the programs (through the verifier) against the maps
    /// (the pinned ones when a predecessor left them) and sets their config, without
    /// attaching anything: a process standing by for a predecessor (`cloud::lifecycle::handover`)
    /// fails here, while the predecessor still serves with its own programs.
    pub(crate) fn load(cfg: &InterceptConfig) -> Result<Self, InterceptError> {
        check_kernel()?;
        let cgroup_path = attach_cgroup(cfg.cgroup.as_deref())?;
        let (exempt_path, exempt_cgroup_id) = exempt_cgroup(cfg)?;
        let config = Config {
            host_netns_cookie: own_netns_cookie()?,
            exempt_cgroup_id,
            redirect: endpoint(cfg.redirect_to),
            pod_redirect: cfg.pod_redirect_to.map(endpoint).unwrap_or_default(),
            redirect6: cfg.redirect6_to.map(endpoint6).unwrap_or_default(),
            pod_redirect6: cfg.pod_redirect6_to.map(endpoint6).unwrap_or_default(),
            log_level: ebpf_log::wanted_level() as u32,
            _pad: 0,
        };
        let pin_dir = match &cfg.pin_dir {
            Some(d) => Some(pin_dir_for(d, &cgroup_path)?),
            None => None,
        };
        let mut ebpf = load_object(pin_dir.as_deref(), cfg.edge_map_entries)?;
        let mut config_map: Array<_, Config> = take_map(&mut ebpf, maps::CONFIG)?;
        config_map
            .set(0, config, 0)
            .map_err(|source| InterceptError::Map {
                map: maps::CONFIG,
                source,
            })?;
        let redirect_maps = Maps::take(&mut ebpf)?;
        let originals = Originals::take(&mut ebpf)?;
        let alive_until = take_map(&mut ebpf, maps::ALIVE_UNTIL)?;
        if redirect_maps.edge_capacity != cfg.edge_map_entries as usize {
            tracing::warn!(
                pinned = redirect_maps.edge_capacity,
                configured = cfg.edge_map_entries,
                "the pinned eBPF edge maps keep the size they were made with; to resize them, \
                 stop the cloud, run `tunnel cloud --uninstall-redirect` and start it again"
            );
        }
        let counters = take_map(&mut ebpf, maps::COUNTERS)?;
        let logger = ebpf_log::take_logger(&mut ebpf).map_err(|e| InterceptError::Load {
            what: "log ring buffer".into(),
            source: Box::new(e),
        })?;

        let cgroup_fd =
            std::fs::File::open(&cgroup_path).map_err(|_| InterceptError::NoCgroupV2 {
                path: cgroup_path.clone(),
            })?;
        let refuses = kernel::can_refuse();
        load_programs(&mut ebpf, refuses)?;
        let log_forwarder = ebpf_log::spawn_forwarder(logger, config_map, config).map_err(|e| {
            InterceptError::Load {
                what: "log ring buffer reader".into(),
                source: Box::new(e),
            }
        })?;
        Ok(Self {
            maps: Mutex::new(redirect_maps),
            originals: Mutex::new(originals),
            alive_until: Mutex::new(alive_until),
            counters,
            ports: cfg.ports.clone(),
            fail_open_after: cfg.fail_open_after,
            log_forwarder,
            adopted_at: None,
            refuses,
            pending: Some(Pending {
                cgroup_path,
                cgroup_fd,
                pin_dir,
                exempt_path,
                exempt_cgroup_id,
                redirect_to: cfg.redirect_to,
                pod_redirect_to: cfg.pod_redirect_to,
                redirect6_to: cfg.redirect6_to,
                pod_redirect6_to: cfg.pod_redirect6_to,
            }),
            ebpf,
        })
    }

    /// Attaches the loaded programs: through the pinned links, whose programs are
    /// swapped for ours (a predecessor's until now), or through new links. Does nothing
    /// the second time.
    pub(crate) fn link(&mut self) -> Result<(), InterceptError> {
        let Some(p) = self.pending.take() else {
            return Ok(());
        };
        let adopted = p.pin_dir.as_deref().is_some_and(pin::adopting);
        // A predecessor's "no tunnel" marks go before our programs run on them: which
        // nodes have a tunnel is not known until the edges have reconnected.
        self.set_no_tunnel::<IpAddr>(&[])?;
        // Before any link runs them, or the programs would fail open from the start.
        self.keep_alive()?;
        // The hand-off programs go first: once connect4 redirects, sock_ops must
        // already be there to record the client's address before accept() returns.
        let pins = p.pin_dir.as_deref();
        link_sockops(&mut self.ebpf, &p.cgroup_fd, pins)?;
        let (connect4, connect6) = connect_programs(self.refuses);
        for (name, pin_name, attach_type) in [
            (
                PROG_GETPEERNAME4,
                PROG_GETPEERNAME4,
                pin::ATTACH_INET4_GETPEERNAME,
            ),
            (
                PROG_GETPEERNAME6,
                PROG_GETPEERNAME6,
                pin::ATTACH_INET6_GETPEERNAME,
            ),
            (connect4, PROG_CONNECT4, pin::ATTACH_INET4_CONNECT),
            (connect6, PROG_CONNECT6, pin::ATTACH_INET6_CONNECT),
        ] {
            let pins = pins.map(|dir| (dir, pin_name));
            link_sock_addr(&mut self.ebpf, name, &p.cgroup_fd, pins, attach_type)?;
        }
        if !self.refuses {
            tracing::warn!(
                release = %kernel::release(),
                "this kernel lacks bpf_set_retval (Linux 5.18+): a connect to an edge whose tunnel is down is redirected and reset, not failed with \"host is down\""
            );
        }
        // E.g. tunnel-cloud started by hand in the root cgroup: then every other process
        // sitting directly in that cgroup is exempt too.
        if cgroup_id(&p.cgroup_path).ok() == Some(p.exempt_cgroup_id) {
            tracing::warn!(
                cgroup = %p.exempt_path.display(),
                "the exempt cgroup is the attach cgroup itself: processes directly in it are never redirected"
            );
        }
        tracing::info!(
            cgroup = %p.cgroup_path.display(),
            cgroup_id = cgroup_id(&p.cgroup_path).unwrap_or_default(),
            redirect_to = %p.redirect_to,
            pod_redirect_to = ?p.pod_redirect_to,
            redirect6_to = ?p.redirect6_to,
            pod_redirect6_to = ?p.pod_redirect6_to,
            exempt = %p.exempt_path.display(),
            exempt_cgroup_id = p.exempt_cgroup_id,
            pinned = ?p.pin_dir,
            adopted,
            refuses_without_tunnel = self.refuses,
            "intercept attached"
        );
        self.adopted_at = adopted.then(std::time::Instant::now);
        Ok(())
    }

    /// Pushes the time until which the programs redirect to `fail_open_after` from now.
    /// The owner calls it more often than that while it serves.
    pub fn keep_alive(&self) -> Result<(), InterceptError> {
        let until = match self.fail_open_after {
            Some(after) => {
                let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
                    .map(std::time::Duration::from)
                    .unwrap_or_default();
                u64::try_from((now + after).as_nanos()).unwrap_or(u64::MAX)
            }
            None => u64::MAX,
        };
        let mut alive_until = self.alive_until.lock().unwrap_or_else(|e| e.into_inner());
        alive_until
            .set(0, until, 0)
            .map_err(|source| InterceptError::Map {
                map: maps::ALIVE_UNTIL,
                source,
            })
    }

    /// While this process is taking over from a predecessor (the first [`TAKEOVER_WAIT`]
    /// after adopting pinned programs), how much of that window is left.
    pub(crate) fn takeover_left(&self) -> Option<std::time::Duration> {
        let left = TAKEOVER_WAIT.checked_sub(self.adopted_at?.elapsed())?;
        (!left.is_zero()).then_some(left)
    }

    /// Entries each edge map holds (addresses × ports), as the kernel made it.
    pub fn edge_map_capacity(&self) -> usize {
        self.maps
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .edge_capacity
    }

    /// Makes `ips × ports` the whole set of intercepted targets: new pairs are added,
    /// pairs no longer wanted are removed. IPv4 and IPv6 addresses go to their own maps;
    /// an IPv4-mapped IPv6 address counts as IPv4 (connect6 looks those up there). A map
    /// that cannot hold every address takes them in the order given, the addresses of
    /// nodes without a tunnel last ([`fit_edges`]); the count of those left out is
    /// returned.
    pub fn set_edges<I: Into<IpAddr> + Copy>(&self, ips: &[I]) -> Result<usize, InterceptError> {
        let mut guard = self
            .maps
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        guard.want(ips.iter().map(|ip| (*ip).into()));
        self.sync_edges(&mut guard)
    }

    /// Takes the addresses `gone` out of the edge maps and puts those that `came` in
    /// (each with every port), writing only their entries; false, writing nothing, when
    /// the maps are full or would be: which addresses a full map holds depends on the
    /// order of all ([`Interceptor::set_edges`]).
    pub fn change_edges(&self, gone: &[IpAddr], came: &[IpAddr]) -> Result<bool, InterceptError> {
        let mut guard = self.maps.lock().unwrap_or_else(|e| e.into_inner());
        let maps = &mut *guard;
        if maps.full {
            return Ok(false);
        }
        for ip in gone {
            if maps.wanted.remove(&ip.to_canonical()).is_some() {
                *family_count(maps, *ip) -= 1;
            }
        }
        for ip in came {
            // Last in the order: it matters only to a full map, set whole.
            if maps.wanted.insert(ip.to_canonical(), u32::MAX).is_none() {
                *family_count(maps, *ip) += 1;
            }
        }
        let per_family = maps
            .edge_capacity
            .checked_div(self.ports.len())
            .unwrap_or(usize::MAX);
        if maps.wanted4 > per_family || maps.wanted6 > per_family {
            return Ok(false);
        }
        let no_tunnel = &maps.no_tunnel;
        for ip in gone.iter().map(IpAddr::to_canonical) {
            if maps.wanted.contains_key(&ip) {
                continue;
            }
            for &port in &self.ports {
                match ip {
                    IpAddr::V4(v4) => maps.edges.remove(endpoint(SocketAddrV4::new(v4, port)))?,
                    IpAddr::V6(v6) => maps
                        .edges6
                        .remove(endpoint6(SocketAddrV6::new(v6, port, 0, 0)))?,
                }
            }
        }
        for ip in came.iter().map(IpAddr::to_canonical) {
            let state = edge_state(no_tunnel, ip);
            for &port in &self.ports {
                match ip {
                    IpAddr::V4(v4) => maps
                        .edges
                        .insert(endpoint(SocketAddrV4::new(v4, port)), state)?,
                    IpAddr::V6(v6) => maps
                        .edges6
                        .insert(endpoint6(SocketAddrV6::new(v6, port, 0, 0)), state)?,
                }
            }
        }
        Ok(true)
    }

    /// The targets the edge maps hold, read back from the kernel.
    pub fn edge_targets(&self) -> Result<BTreeSet<SocketAddr>, InterceptError> {
        let maps = self.maps.lock().unwrap_or_else(|e| e.into_inner());
        let mut targets = BTreeSet::new();
        for key in maps.edges.map.keys() {
            let e = key.map_err(|e| maps.edges.map_err(e))?;
            targets.insert(SocketAddrV4::new(Ipv4Addr::from(e.ip), e.port).into());
        }
        for key in maps.edges6.map.keys() {
            let e = key.map_err(|e| maps.edges6.map_err(e))?;
            targets.insert(SocketAddrV6::new(Ipv6Addr::from(e.octets()), e.port, 0, 0).into());
        }
        Ok(targets)
    }

    /// Writes the edge maps from `maps.wanted` and `maps.no_tunnel`.
    fn sync_edges(&self, maps: &mut Maps) -> Result<usize, InterceptError> {
        let (v4, v6, left_out) = fit_edges(
            &maps.ordered(),
            self.ports.len(),
            maps.edge_capacity,
            &maps.no_tunnel,
        );
        maps.full = left_out > 0;
        let state = |ip: IpAddr| edge_state(&maps.no_tunnel, ip);
        let mut wanted4 = HashMap::new();
        let mut wanted6 = HashMap::new();
        for &port in &self.ports {
            wanted4.extend(
                v4.iter()
                    .map(|ip| (endpoint(SocketAddrV4::new(*ip, port)), state((*ip).into()))),
            );
            wanted6.extend(v6.iter().map(|ip| {
                (
                    endpoint6(SocketAddrV6::new(*ip, port, 0, 0)),
                    state((*ip).into()),
                )
            }));
        }
        // Read back first: until the process handing over stops, it may have changed
        // the pinned maps since.
        maps.edges.read()?;
        maps.edges.sync(wanted4)?;
        maps.edges6.read()?;
        maps.edges6.sync(wanted6)?;
        Ok(left_out)
    }

    /// Makes `ips` the addresses whose node no replica holds a tunnel to: connects to
    /// them fail at once with "host is down" (where the programs can set the errno,
    /// [`Interceptor::refuses_without_tunnel`]); every other edge address is redirected.
    /// Addresses not in the edge map are kept for when [`Interceptor::set_edges`] adds
    /// them. Writes only the entries that change; a full map takes those of nodes with a
    /// tunnel first.
    pub fn set_no_tunnel<I: Into<IpAddr> + Copy>(&self, ips: &[I]) -> Result<(), InterceptError> {
        let mut guard = self.maps.lock().unwrap_or_else(|e| e.into_inner());
        let maps = &mut *guard;
        maps.no_tunnel = ips.iter().map(|ip| (*ip).into().to_canonical()).collect();
        if maps.full {
            return self.sync_edges(maps).map(drop);
        }
        let no_tunnel = &maps.no_tunnel;
        maps.edges
            .restate(|e| edge_state(no_tunnel, Ipv4Addr::from(e.ip).into()))?;
        maps.edges6
            .restate(|e| edge_state(no_tunnel, Ipv6Addr::from(e.octets()).into()))
    }

    /// As [`Interceptor::set_no_tunnel`] for the addresses `down` (their node has no
    /// tunnel now) and `up` (it has one again) alone: writes only their entries in the
    /// maps (one not in them takes its mark when it comes). A full map is set whole:
    /// which addresses it keeps depends on the marks.
    pub fn change_no_tunnel(&self, down: &[IpAddr], up: &[IpAddr]) -> Result<(), InterceptError> {
        let mut guard = self.maps.lock().unwrap_or_else(|e| e.into_inner());
        let maps = &mut *guard;
        for ip in up {
            maps.no_tunnel.remove(&ip.to_canonical());
        }
        maps.no_tunnel.extend(down.iter().map(IpAddr::to_canonical));
        if maps.full {
            return self.sync_edges(maps).map(drop);
        }
        for ip in down.iter().chain(up).map(IpAddr::to_canonical) {
            let state = edge_state(&maps.no_tunnel, ip);
            for &port in &self.ports {
                match ip {
                    IpAddr::V4(v4) => maps
                        .edges
                        .restate_held(endpoint(SocketAddrV4::new(v4, port)), state)?,
                    IpAddr::V6(v6) => maps
                        .edges6
                        .restate_held(endpoint6(SocketAddrV6::new(v6, port, 0, 0)), state)?,
                }
            }
        }
        Ok(())
    }

    /// Whether connect4/6 fail a connect to an address without a tunnel (Linux 5.18+,
    /// `bpf_set_retval`); without, they redirect it and the cloud resets it.
    pub(crate) fn refuses_without_tunnel(&self) -> bool {
        self.refuses
    }

    /// The address a redirected client dialled, found by the accepted socket's peer
    /// address, and forgotten: each original destination is handed out once.
    pub fn take_original_dst(&self, peer: impl Into<SocketAddr>) -> Option<SocketAddr> {
        let peer = peer.into();
        let mut guard = self
            .originals
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        match peer {
            SocketAddr::V4(p) => take(&mut guard.v4, &endpoint(p), &peer)
                .map(|o| SocketAddrV4::new(Ipv4Addr::from(o.ip), o.port).into()),
            SocketAddr::V6(p) => take(&mut guard.v6, &endpoint6(p), &peer)
                .map(|o| SocketAddrV6::new(Ipv6Addr::from(o.octets()), o.port, 0, 0).into()),
        }
    }

    /// Counter totals. A read failure (which would be a kernel bug) is logged and reads 0.
    pub fn counters(&self) -> Counters {
        let read = |c: Counter| match self.counters.get(&(c as u32), 0) {
            Ok(per_cpu) => per_cpu.iter().sum(),
            Err(e) => {
                tracing::warn!(counter = ?c, error = %e, "reading intercept counter failed");
                0
            }
        };
        Counters {
            redirected: read(Counter::Redirected),
            passed: read(Counter::Passed),
            errors: read(Counter::Errors),
            no_tunnel: read(Counter::NoTunnel),
        }
    }
}

const _: () = assert!(COUNTERS_LEN == 4, "Counters reads every counter");

/// The cgroup whose processes the programs leave alone (`exempt_cgroup`, else this
/// process's own), and its id.
fn exempt_cgroup(cfg: &InterceptConfig) -> Result<(PathBuf, u64), InterceptError> {
    let exempt_path = match &cfg.exempt_cgroup {
        Some(p) => p.clone(),
        None => own_cgroup()?,
    };
    let exempt_cgroup_id =
        cgroup_id(&exempt_path).map_err(|source| InterceptError::ExemptCgroup {
            path: exempt_path.clone(),
            source,
        })?;
    Ok((exempt_path, exempt_cgroup_id))
}

/// The directory under the bpffs at `pin_dir` for the programs attached to the cgroup
/// at `cgroup_path`, made if missing.
fn pin_dir_for(pin_dir: &Path, cgroup_path: &Path) -> Result<PathBuf, InterceptError> {
    let id = cgroup_id(cgroup_path).map_err(|source| InterceptError::Pin {
        path: cgroup_path.to_path_buf(),
        source,
    })?;
    // Said plainly before mkdir fails in whatever (sysfs) is there instead.
    let existing = pin_dir.ancestors().find(|a| a.exists()).unwrap_or(pin_dir);
    if !pin::is_bpffs(existing).unwrap_or(false) {
        return Err(InterceptError::NotBpffs {
            path: pin_dir.to_path_buf(),
        });
    }
    let dir = pin::dir(pin_dir, id);
    std::fs::create_dir_all(&dir).map_err(|source| InterceptError::Pin {
        path: dir.clone(),
        source,
    })?;
    Ok(dir)
}

/// The eBPF object, through the verifier, with the maps a predecessor pinned in
/// `pin_dir` (or new ones pinned there), new edge maps of `edge_map_entries` each.
fn load_object(pin_dir: Option<&Path>, edge_map_entries: u32) -> Result<Ebpf, InterceptError> {
    let mut loader = EbpfLoader::new();
    loader
        .map_max_entries(maps::EDGES, edge_map_entries)
        .map_max_entries(maps::EDGES6, edge_map_entries);
    if let Some(dir) = pin_dir {
        for name in pin::PINNED_MAPS {
            loader.map_pin_path(name, pin::map_path(dir, name));
        }
    }
    loader.load(OBJECT).map_err(|e| classify("object", e))
}

/// The addresses of each family an edge map of `capacity` entries holds with `ports`
/// entries per address, and how many addresses it cannot hold. A full map takes them in
/// the order given (the node table's: each node's first listed before any node's
/// second), those of `no_tunnel` last: so the nodes that hold a live tunnel keep their
/// redirect, whatever addresses other edges list.
fn fit_edges(
    ips: &[IpAddr],
    ports: usize,
    capacity: usize,
    no_tunnel: &HashSet<IpAddr>,
) -> (Vec<Ipv4Addr>, Vec<Ipv6Addr>, usize) {
    let mut seen = HashSet::new();
    let mut ordered: Vec<IpAddr> = ips
        .iter()
        .map(|ip| ip.to_canonical())
        .filter(|ip| seen.insert(*ip))
        .collect();
    // Stable: the order given holds within each of the two groups.
    ordered.sort_by_key(|ip| no_tunnel.contains(ip));
    let mut v4 = Vec::new();
    let mut v6 = Vec::new();
    for ip in ordered {
        match ip {
            IpAddr::V4(ip) => v4.push(ip),
            IpAddr::V6(ip) => v6.push(ip),
        };
    }
    let per_family = capacity.checked_div(ports).unwrap_or(usize::MAX);
    let left_out = v4.len().saturating_sub(per_family) + v6.len().saturating_sub(per_family);
    v4.truncate(per_family);
    v6.truncate(per_family);
    (v4, v6, left_out)
}

fn endpoint(addr: SocketAddrV4) -> Endpoint {
    Endpoint::new(u32::from(*addr.ip()), addr.port())
}

fn endpoint6(addr: SocketAddrV6) -> Endpoint6 {
    Endpoint6::from_octets(addr.ip().octets(), addr.port())
}

/// Looks `key` up in an original-destination map and removes it.
fn take<K: aya::Pod, V: aya::Pod>(
    map: &mut BpfHashMap<MapData, K, V>,
    key: &K,
    peer: &SocketAddr,
) -> Option<V> {
    let orig = match map.get(key, 0) {
        Ok(orig) => orig,
        Err(MapError::KeyNotFound) => return None,
        Err(e) => {
            tracing::debug!(%peer, error = %e, "original destination lookup failed");
            return None;
        }
    };
    // Already gone means the client closed meanwhile (the eBPF side drops entries on
    // close); the answer is still right for this accepted socket.
    if let Err(e) = map.remove(key) {
        tracing::debug!(%peer, error = %e, "original destination already removed");
    }
    Some(orig)
}

fn take_map<M>(ebpf: &mut Ebpf, name: &'static str) -> Result<M, InterceptError>
where
    M: TryFrom<aya::maps::Map, Error = MapError>,
{
    let map = ebpf.take_map(name).ok_or_else(|| InterceptError::Load {
        what: format!("map {name}"),
        source: "missing from the embedded object".into(),
    })?;
    M::try_from(map).map_err(|source| InterceptError::Map { map: name, source })
}

/// The connect4 and connect6 programs to load: the ones that refuse a target without a
/// tunnel, or (`refuses` false) the ones that redirect it.
fn connect_programs(refuses: bool) -> (&'static str, &'static str) {
    if refuses {
        (PROG_CONNECT4, PROG_CONNECT6)
    } else {
        (PROG_CONNECT4_RESET, PROG_CONNECT6_RESET)
    }
}

/// Loads every program into the kernel (the verifier runs here), attaching none.
fn load_programs(ebpf: &mut Ebpf, refuses: bool) -> Result<(), InterceptError> {
    let prog: &mut SockOps = program(ebpf, PROG_SOCKOPS)?;
    prog.load().map_err(|e| classify_program(PROG_SOCKOPS, e))?;
    let (connect4, connect6) = connect_programs(refuses);
    for name in [PROG_GETPEERNAME4, PROG_GETPEERNAME6, connect4, connect6] {
        let prog: &mut CgroupSockAddr = program(ebpf, name)?;
        prog.load().map_err(|e| classify_program(name, e))?;
    }
    Ok(())
}

/// `pins`: the pin directory and the name the link is pinned under (connect4's for
/// either connect4 program, so a successor finds the link whichever its predecessor ran).
fn link_sock_addr(
    ebpf: &mut Ebpf,
    name: &'static str,
    cgroup: &std::fs::File,
    pins: Option<(&std::path::Path, &str)>,
    attach_type: u32,
) -> Result<(), InterceptError> {
    let prog: &mut CgroupSockAddr = program(ebpf, name)?;
    match pins {
        Some((dir, pin_name)) => {
            let fd = prog.fd().map_err(|e| classify_program(name, e))?;
            pin_link(dir, pin_name, fd.as_fd(), cgroup, attach_type)
        }
        None => prog
            .attach(cgroup, CgroupAttachMode::Single)
            .map(drop)
            .map_err(|e| classify_program(name, e)),
    }
}

fn link_sockops(
    ebpf: &mut Ebpf,
    cgroup: &std::fs::File,
    pins: Option<&std::path::Path>,
) -> Result<(), InterceptError> {
    let prog: &mut SockOps = program(ebpf, PROG_SOCKOPS)?;
    match pins {
        Some(dir) => {
            let fd = prog.fd().map_err(|e| classify_program(PROG_SOCKOPS, e))?;
            pin_link(dir, PROG_SOCKOPS, fd.as_fd(), cgroup, pin::ATTACH_SOCK_OPS)
        }
        None => prog
            .attach(cgroup, CgroupAttachMode::Single)
            .map(drop)
            .map_err(|e| classify_program(PROG_SOCKOPS, e)),
    }
}

fn pin_link(
    dir: &std::path::Path,
    name: &str,
    prog: std::os::fd::BorrowedFd<'_>,
    cgroup: &std::fs::File,
    attach_type: u32,
) -> Result<(), InterceptError> {
    pin::attach(dir, name, prog, cgroup.as_fd(), attach_type).map_err(|e| {
        if e.raw_os_error() == Some(libc::EPERM) {
            InterceptError::NotPrivileged {
                context: format!("linking {name}: {e}"),
            }
        } else {
            InterceptError::Pin {
                path: dir.to_path_buf(),
                source: e,
            }
        }
    })
}

/// Detaches and unpins everything a cloud with `pin_dir` left attached to `cgroup`
/// (`None` = the detected hierarchy root), for `tunnel cloud --uninstall-redirect`.
/// Returns the pins removed (none if nothing was installed).
pub fn uninstall(
    pin_dir: &std::path::Path,
    cgroup: Option<&std::path::Path>,
) -> Result<Vec<PathBuf>, InterceptError> {
    let cgroup_path = attach_cgroup(cgroup)?;
    let id = cgroup_id(&cgroup_path).map_err(|source| InterceptError::Pin {
        path: cgroup_path.clone(),
        source,
    })?;
    pin::uninstall(pin_dir, id).map_err(|source| InterceptError::Pin {
        path: pin::dir(pin_dir, id),
        source,
    })
}

fn program<'a, P>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut P, InterceptError>
where
    &'a mut P: TryFrom<&'a mut aya::programs::Program, Error = ProgramError>,
{
    let prog = ebpf.program_mut(name).ok_or_else(|| InterceptError::Load {
        what: format!("program {name}"),
        source: "missing from the embedded object".into(),
    })?;
    prog.try_into().map_err(|e| classify_program(name, e))
}

/// Program errors: an EINVAL without a verifier log means the kernel does not know the
/// program or attach type at all (too old); with a log it is a real rejection.
fn classify_program(name: &'static str, e: ProgramError) -> InterceptError {
    if let ProgramError::LoadError {
        io_error,
        verifier_log,
    } = &e
        && io_error.raw_os_error() == Some(libc::EINVAL)
        && verifier_log.to_string().trim().is_empty()
    {
        return InterceptError::KernelFeature {
            release: kernel::release(),
            what: format!("the {name} program type (cgroup sock_addr / sock_ops, Linux 5.8+)"),
        };
    }
    classify(&format!("program {name}"), e)
}

/// EPERM anywhere in the chain is a privilege problem; everything else is a load error.
fn classify<E: StdError + Send + Sync + 'static>(what: &str, e: E) -> InterceptError {
    let mut cause: Option<&(dyn StdError + 'static)> = Some(&e);
    while let Some(c) = cause {
        if let Some(io) = c.downcast_ref::<io::Error>()
            && io.raw_os_error() == Some(libc::EPERM)
        {
            return InterceptError::NotPrivileged {
                context: format!("{what}: {e}"),
            };
        }
        cause = c.source();
    }
    InterceptError::Load {
        what: what.to_string(),
        source: Box::new(e),
    }
}

/// The netns cookie of our own network namespace: connect4 compares a client's netns
/// cookie with it to tell host clients (can reach our loopback listener) from pods.
fn own_netns_cookie() -> Result<u64, InterceptError> {
    kernel::netns_cookie().map_err(|err| {
        if err.raw_os_error() == Some(libc::ENOPROTOOPT) {
            InterceptError::KernelFeature {
                release: kernel::release(),
                what: "SO_NETNS_COOKIE (Linux 5.14+)".into(),
            }
        } else {
            classify("SO_NETNS_COOKIE", err)
        }
    })
}

// tunnel-cloud shares one Interceptor between its accept loop and the node watcher.
const _: fn() = || {
    fn shared<T: Send + Sync>() {}
    shared::<Interceptor>();
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_edge_map_keeps_the_order_given_with_nodes_without_a_tunnel_last() {
        let ip = |text: &str| text.parse::<IpAddr>().expect("ip");
        let ips: Vec<IpAddr> = [
            "10.0.0.3",
            "10.0.0.1",
            "::ffff:10.0.0.2",
            "fd00::2",
            "fd00::1",
            "10.0.0.1",
        ]
        .map(ip)
        .to_vec();
        let none = HashSet::new();
        // Two ports per address in a map of five entries: two addresses per family.
        let (v4, v6, left_out) = fit_edges(&ips, 2, 5, &none);
        assert_eq!(v4, [Ipv4Addr::new(10, 0, 0, 3), Ipv4Addr::new(10, 0, 0, 1)]);
        assert_eq!(v6.len(), 2);
        assert_eq!(
            left_out, 1,
            "10.0.0.2 left out; the mapped address counts as IPv4"
        );
        // 10.0.0.3's node has no tunnel: it goes last, and out.
        let down = HashSet::from([ip("10.0.0.3")]);
        let (v4, _, left_out) = fit_edges(&ips, 2, 5, &down);
        assert_eq!(v4, [Ipv4Addr::new(10, 0, 0, 1), Ipv4Addr::new(10, 0, 0, 2)]);
        assert_eq!(left_out, 1);
        // Room for all: nothing left out.
        let (v4, v6, left_out) = fit_edges(&ips, 2, 6, &down);
        assert_eq!((v4.len(), v6.len(), left_out), (3, 2, 0));
    }
}
