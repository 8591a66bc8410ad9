//! Names and layouts of the maps shared by `tunnel-ebpf` (the kernel side) and the
//! loader in `tunnel-user` (`intercept`).
//!
//! Every type is `#[repr(C)]` with fixed-width fields and explicit padding: the kernel
//! compares map keys byte by byte, so an uninitialised padding byte would make two equal
//! keys differ. All addresses and ports are stored in **host byte order**; the eBPF side
//! converts at the kernel boundary (`user_ip4`/`user_port` are network order,
//! `sock_ops.local_port` is already host order), so userspace uses `u32::from(Ipv4Addr)`
//! and plain `u16` ports. The one exception is an IPv6 address ([`Endpoint6::ip`]): its
//! 16 bytes stay in network order, as the kernel's `in6_addr` and `Ipv6Addr::octets()`
//! both hold them, so neither side swaps anything.
//!
//! IPv4 and IPv6 have maps of their own rather than one map with a family-tagged key:
//! connect4, which runs on every IPv4 connect() in the cgroup, keeps its 8-byte key, and
//! the IPv4 maps keep the layout pinned by earlier releases, so an upgrade adopts them.
#![no_std]

/// Map names, as the ELF symbols of the `#[map]` statics in `tunnel-ebpf`.
/// Kept under 16 bytes: the kernel truncates object names to `BPF_OBJ_NAME_LEN - 1`,
/// and the truncated name is what `bpftool map` shows.
pub mod maps {
    /// `HashMap<Endpoint, u32>`: edge targets (ip × port) to redirect, each with its
    /// [`crate::EdgeState`].
    pub const EDGES: &str = "EDGES";
    /// `HashMap<Endpoint6, u32>`: the IPv6 edge targets, as [`EDGES`].
    pub const EDGES6: &str = "EDGES6";
    /// `LruHashMap<u64 socket cookie, Endpoint>`: original destination per client socket,
    /// written by connect4, read by sock_ops and getpeername4.
    pub const ORIG_BY_COOKIE: &str = "ORIG_BY_COOKIE";
    /// `LruHashMap<Endpoint client local addr, Endpoint>`: original destination keyed by
    /// what the redirect listener sees as the accepted socket's peer address.
    pub const ORIG_BY_PEER: &str = "ORIG_BY_PEER";
    /// `LruHashMap<u64 socket cookie, Endpoint6>`: as [`ORIG_BY_COOKIE`], for IPv6
    /// destinations (written by connect6, read by sock_ops and getpeername6).
    pub const ORIG6_BY_COOKIE: &str = "ORIG6_BY_COOKIE";
    /// `LruHashMap<Endpoint6 client local addr, Endpoint6>`: as [`ORIG_BY_PEER`], for
    /// IPv6 clients.
    pub const ORIG6_BY_PEER: &str = "ORIG6_BY_PEER";
    /// `Array<Config>` with one entry.
    pub const CONFIG: &str = "CONFIG";
    /// `PerCpuArray<u64>` indexed by [`crate::Counter`].
    pub const COUNTERS: &str = "COUNTERS";
    /// `Array<u64>` with one entry: the `CLOCK_MONOTONIC` time in nanoseconds (what
    /// `bpf_ktime_get_ns` reads) until which the programs redirect. The cloud that owns
    /// them pushes it forward while it runs; past it (the cloud crashed, or was removed
    /// without uninstalling) connects go where they were dialled. 0 = never set: no
    /// redirect. One process's, like the config, so an upgrade may change it.
    pub const ALIVE_UNTIL: &str = "ALIVE_UNTIL";
}

/// Capacity of each edge map (ip × port pairs) as the object declares it; the loader
/// sets the real one from `redirect.edge_map_entries` before it makes the maps.
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

/// An IPv6 address (network order, see the crate docs) and TCP port (host order).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Endpoint6 {
    /// The address's 16 bytes as the kernel's `user_ip6` words: each `u32` holds 4
    /// bytes in network order, so this is `Ipv6Addr::octets()` read as native words.
    pub ip: [u32; 4],
    pub port: u16,
    /// Explicit padding, always zero (see the crate docs).
    pub _pad: u16,
}

impl Endpoint6 {
    pub const fn new(ip: [u32; 4], port: u16) -> Self {
        Self { ip, port, _pad: 0 }
    }

    /// From an address's 16 bytes in network order (`Ipv6Addr::octets()`).
    pub const fn from_octets(o: [u8; 16], port: u16) -> Self {
        let mut ip = [0u32; 4];
        let mut i = 0;
        while i < 4 {
            ip[i] = u32::from_ne_bytes([o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]]);
            i += 1;
        }
        Self::new(ip, port)
    }

    /// The address's 16 bytes in network order (for `Ipv6Addr::from`).
    pub const fn octets(&self) -> [u8; 16] {
        let mut o = [0u8; 16];
        let mut i = 0;
        while i < 4 {
            let b = self.ip[i].to_ne_bytes();
            o[4 * i] = b[0];
            o[4 * i + 1] = b[1];
            o[4 * i + 2] = b[2];
            o[4 * i + 3] = b[3];
            i += 1;
        }
        o
    }

    /// `[::]:0` means "not configured" in [`Config`].
    pub const fn is_unset(&self) -> bool {
        self.ip[0] == 0 && self.ip[1] == 0 && self.ip[2] == 0 && self.ip[3] == 0 && self.port == 0
    }
}

/// What connect4/6 do with a connect to an edge target: the value of its entry in
/// [`maps::EDGES`] / [`maps::EDGES6`]. Releases before this one wrote 1 and their
/// programs read only whether the key is there, so the pinned maps keep their layout and
/// either release's programs work on the other's entries: an old program redirects a
/// [`EdgeState::NoTunnel`] target as it always did, a new one redirects the old `1`s.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EdgeState {
    /// Redirect to the cloud: a replica holds the node's tunnel, or the cloud does not
    /// know (yet) that none does.
    Redirect = 1,
    /// No replica holds the node's tunnel, as the cloud knows for sure: the connect fails
    /// at once with [`NO_TUNNEL_ERRNO`], which names the cause in the client's error.
    NoTunnel = 2,
}

/// The errno a connect to an edge target without a tunnel fails with: `EHOSTDOWN`, "host
/// is down" in every libc and in Go. Not `EHOSTUNREACH` ("no route to host"): that is
/// what a master with no route to an edge's address says when a connect goes past the
/// tunnel, a different cause.
pub const NO_TUNNEL_ERRNO: i32 = 112;

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
    /// As `redirect`, for IPv6 edge targets (an IPv6 listener); unset = such connects
    /// go ahead unchanged and count as errors.
    pub redirect6: Endpoint6,
    /// As `pod_redirect`, for IPv6 edge targets.
    pub pod_redirect6: Endpoint6,
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
    /// connect() to an edge target failed at once: no replica holds its node's tunnel
    /// ([`EdgeState::NoTunnel`]).
    NoTunnel = 3,
}

/// Number of entries in [`maps::COUNTERS`].
pub const COUNTERS_LEN: u32 = 4;

#[cfg(feature = "user")]
mod user {
    // SAFETY: plain `repr(C)` structs of integers with explicit padding fields, so every
    // byte pattern is a valid value and there are no implicit padding bytes.
    unsafe impl aya::Pod for super::Endpoint {}
    // SAFETY: as above; 16+2+2 bytes, 4-aligned.
    unsafe impl aya::Pod for super::Endpoint6 {}
    // SAFETY: as above; 8+8+8+8+20+20+4+4 bytes, 8-aligned, no implicit padding.
    unsafe impl aya::Pod for super::Config {}
}

// Layout checks: the eBPF side and userspace must agree without implicit padding.
const _: () = assert!(core::mem::size_of::<Endpoint>() == 8);
const _: () = assert!(core::mem::size_of::<Endpoint6>() == 20);
const _: () = assert!(core::mem::size_of::<Config>() == 80);

#[cfg(test)]
mod tests {
    use super::Endpoint6;

    #[test]
    fn endpoint6_keeps_the_bytes_in_network_order() {
        let octets = [0xfd, 0, 0x7e, 0x57, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5];
        let e = Endpoint6::from_octets(octets, 10250);
        assert_eq!(e.octets(), octets);
        // What the kernel's user_ip6[0] holds for fd00:7e57::: the first 4 bytes as one
        // network-order word.
        assert_eq!(u32::from_be(e.ip[0]), 0xfd00_7e57);
        assert!(!e.is_unset());
        assert!(Endpoint6::default().is_unset());
    }
}
