//! Names and layouts of the maps shared by `tunnel-ebpf` (the kernel side) and the
//! loader in `tunnel-user` (`intercept`).
//!
//! Every type is `#[repr(C)]` with fixed-width fields and explicit padding: the kernel
//! compares map keys byte by byte, so an uninitialised padding byte would make two equal
//! keys differ. All addresses and ports are stored in **host byte order**; the eBPF side
//! converts at the kernel boundary (`user_ip4`/`user_port` are network order,
//! `sock_ops.local_port` is already host order), so userspace uses `u32::from(Ipv4Addr)`
//! and plain `u16` ports.
#![no_std]

/// Map names, as the ELF symbols of the `#[map]` statics in `tunnel-ebpf`.
/// Kept under 16 bytes: the kernel truncates object names to `BPF_OBJ_NAME_LEN - 1`,
/// and the truncated name is what `bpftool map` shows.
pub mod maps {
    /// `HashMap<Endpoint, u32>`: edge targets (ip × port) to redirect. Value unused (1).
    pub const EDGES: &str = "EDGES";
    /// `LruHashMap<u64 socket cookie, Endpoint>`: original destination per client socket,
    /// written by connect4, read by sock_ops and getpeername4.
    pub const ORIG_BY_COOKIE: &str = "ORIG_BY_COOKIE";
    /// `LruHashMap<Endpoint client local addr, Endpoint>`: original destination keyed by
    /// what the redirect listener sees as the accepted socket's peer address.
    pub const ORIG_BY_PEER: &str = "ORIG_BY_PEER";
    /// `Array<Config>` with one entry.
    pub const CONFIG: &str = "CONFIG";
    /// `PerCpuArray<u64>` indexed by [`crate::Counter`].
    pub const COUNTERS: &str = "COUNTERS";
}

/// Capacity of the edge set (ip × port pairs).
pub const EDGES_MAX: u32 = 16 * 1024;
/// Capacity of the two original-destination maps. LRU, so under pressure the oldest
/// not-yet-claimed entries go first rather than new connects failing to record.
pub const ORIG_MAX: u32 = 64 * 1024;

/// An IPv4 address and TCP port, both in host byte order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Endpoint {
    pub ip: u32,
    pub port: u16,
    /// Explicit padding, always zero (see the crate docs).
    pub _pad: u16,
}

impl Endpoint {
    pub const fn new(ip: u32, port: u16) -> Self {
        Self { ip, port, _pad: 0 }
    }

    /// `0.0.0.0:0` means "not configured" in [`Config`].
    pub const fn is_unset(&self) -> bool {
        self.ip == 0 && self.port == 0
    }
}

/// The loader's settings, entry 0 of [`maps::CONFIG`]. An all-zero config (the state
/// before the loader writes it) redirects nothing.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Config {
    /// Netns cookie of the redirect listener's network namespace: clients there can
    /// reach `redirect` (loopback); clients elsewhere (pods) go to `pod_redirect`.
    pub host_netns_cookie: u64,
    /// cgroup v2 id whose processes are never redirected (tunnel-cloud's own cgroup),
    /// 0 = none.
    pub exempt_cgroup_id: u64,
    /// Redirect target for clients in the host netns.
    pub redirect: Endpoint,
    /// Redirect target for clients in other netns; unset = leave them alone.
    pub pod_redirect: Endpoint,
    /// The most verbose [`LogLevel`] the programs emit records at (`aya-log`); the loader
    /// follows the runtime log filter, and [`LogLevel::Off`] costs one compare.
    pub log_level: u32,
    /// Explicit padding, always zero (see the crate docs).
    pub _pad: u32,
}

/// How much the programs log, in [`Config::log_level`]: each level includes the ones
/// before it.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum LogLevel {
    Off = 0,
    /// Error paths: a connect that went ahead unchanged, a destination not recorded.
    Warn = 1,
    /// Every decision worth seeing when debugging: each redirect, with where it went.
    Debug = 2,
}

/// Indexes into [`maps::COUNTERS`].
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counter {
    /// connect() rewritten to a redirect listener.
    Redirected = 0,
    /// connect() left alone: not an edge target, not TCP, or exempt.
    Passed = 1,
    /// An edge-target connect() that could not be redirected (map full, no redirect
    /// address for the client's netns) or an original destination that could not be
    /// handed over; the connect went ahead unchanged (fail open).
    Errors = 2,
}

/// Number of entries in [`maps::COUNTERS`].
pub const COUNTERS_LEN: u32 = 3;

#[cfg(feature = "user")]
mod user {
    // SAFETY: plain `repr(C)` structs of integers with explicit padding fields, so every
    // byte pattern is a valid value and there are no implicit padding bytes.
    unsafe impl aya::Pod for super::Endpoint {}
    // SAFETY: as above; 8+8+8+8+4+4 bytes, 8-aligned, no implicit padding.
    unsafe impl aya::Pod for super::Config {}
}

// Layout checks: the eBPF side and userspace must agree without implicit padding.
const _: () = assert!(core::mem::size_of::<Endpoint>() == 8);
const _: () = assert!(core::mem::size_of::<Config>() == 40);
