//! The edge side of a test: a network namespace with a veth pair to the host (the edge
//! dials the cloud over it) and an edge node address on the namespace's own loopback,
//! which nothing outside the namespace can reach except through the tunnel.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

pub struct EdgeNetns {
    pub name: String,
    host_if: String,
    /// The host's end of the veth: the cloud's tunnel listener binds here.
    pub host_ip: Ipv4Addr,
    /// The edge node's address (its Node InternalIP): on the namespace's loopback. The
    /// same address in the host's namespace is an unused loopback address, so a
    /// connection that bypasses the tunnel is refused rather than reaching the kubelet.
    pub edge_ip: Ipv4Addr,
    /// The host's `unreachable` routes for the addresses [`Self::add_edge_ip6`] and
    /// [`Self::add_node_ip`] added.
    unreachable: Vec<String>,
}

/// Runs `ip <args>`; the error says what failed.
pub fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip {args:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

static SEQ: AtomicU32 = AtomicU32::new(0);

impl EdgeNetns {
    pub fn new() -> Result<Self, String> {
        let pid = std::process::id();
        let n = SEQ.fetch_add(1, Ordering::Relaxed);
        // A /30 per (process, namespace) in 169.254.100-220.x: link-local, and clear of
        // 169.254.169.x (169.254.169.254 is cloud metadata) so no route to it is shadowed.
        let third = match 100 + (pid % 120) as u8 {
            169 => 220,
            third => third,
        };
        let fourth = (n % 64) as u8 * 4;
        let host_ip = Ipv4Addr::new(169, 254, third, fourth + 1);
        let peer_ip = Ipv4Addr::new(169, 254, third, fourth + 2);
        let edge_ip = Ipv4Addr::new(127, 77 + (n % 100) as u8, (pid >> 8) as u8, pid as u8);
        let ns = Self {
            name: format!("tunnel-e2e-{pid}-{n}"),
            host_if: format!("te{pid}x{n}h"),
            host_ip,
            edge_ip,
            unreachable: Vec::new(),
        };
        let peer_if = format!("te{pid}x{n}p");
        ip(&["netns", "add", &ns.name])?;
        ip(&[
            "link",
            "add",
            &ns.host_if,
            "type",
            "veth",
            "peer",
            "name",
            &peer_if,
        ])?;
        ip(&["link", "set", &peer_if, "netns", &ns.name])?;
        ip(&["addr", "add", &format!("{host_ip}/30"), "dev", &ns.host_if])?;
        ip(&["link", "set", &ns.host_if, "up"])?;
        let inside = |args: &[&str]| {
            let mut all = vec!["netns", "exec", &ns.name, "ip"];
            all.extend_from_slice(args);
            ip(&all)
        };
        inside(&["addr", "add", &format!("{peer_ip}/30"), "dev", &peer_if])?;
        inside(&["link", "set", &peer_if, "up"])?;
        inside(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// An address for the host side that the API server accepts in an EndpointSlice
    /// (which refuses loopback and link-local ones): 198.19.x.y/32 (the benchmarking
    /// range, never routed) on this namespace's host-side veth, so it goes with it.
    pub fn add_host_address(&self) -> Result<Ipv4Addr, String> {
        let pid = std::process::id();
        let addr = Ipv4Addr::new(198, 19, (pid >> 8) as u8, pid as u8);
        ip(&["addr", "add", &format!("{addr}/32"), "dev", &self.host_if])?;
        Ok(addr)
    }

    /// An IPv6 edge node address (ULA, fd00:7e57:e2e::/64) on the namespace's loopback,
    /// for a node with an IPv6 InternalIP. The host has an IPv6 default route here, so
    /// the address is made `unreachable` on the host while the namespace lives: a
    /// connection that bypasses the tunnel fails at once instead of leaving the machine.
    pub fn add_edge_ip6(&mut self) -> Result<IpAddr, String> {
        let n = SEQ.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let addr = Ipv6Addr::new(
            0xfd00,
            0x7e57,
            0xe2e,
            0,
            0,
            (pid >> 16) as u16,
            pid as u16,
            n as u16 + 1,
        );
        let route = format!("{addr}/128");
        ip(&["-6", "route", "replace", "unreachable", &route])?;
        self.unreachable.push(route);
        ip(&[
            "-n",
            &self.name,
            "addr",
            "add",
            &format!("{addr}/128"),
            "dev",
            "lo",
        ])?;
        Ok(IpAddr::V6(addr))
    }

    /// An edge node address for a real kubelet, which refuses a loopback one ("nodeIP
    /// can't be loopback address"): 198.18.x.y/32 (the benchmarking range, never routed)
    /// on the namespace's loopback, made `unreachable` on the host while the namespace
    /// lives, so that the master reaches it only through the tunnel and a connection
    /// that bypasses the tunnel fails at once instead of leaving the machine.
    pub fn add_node_ip(&mut self) -> Result<Ipv4Addr, String> {
        let n = SEQ.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let addr = Ipv4Addr::new(198, 18, pid as u8, n as u8);
        let route = format!("{addr}/32");
        ip(&["route", "replace", "unreachable", &route])?;
        self.unreachable.push(route.clone());
        ip(&["-n", &self.name, "addr", "add", &route, "dev", "lo"])?;
        Ok(addr)
    }

    /// Takes the host's end of the veth down or up: the namespace's uplink, cut and back.
    pub fn set_uplink(&self, up: bool) -> Result<(), String> {
        ip(&["link", "set", &self.host_if, if up { "up" } else { "down" }])
    }

    /// The argv prefix that runs what follows inside the namespace.
    pub fn exec(&self) -> [&str; 4] {
        ["ip", "netns", "exec", &self.name]
    }

    /// A command that runs `program` inside the namespace.
    pub fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name, program]);
        cmd
    }
}

impl Drop for EdgeNetns {
    fn drop(&mut self) {
        // Deleting the namespace destroys its veth end and with it the host end; the
        // explicit delete covers a setup that failed before the move.
        let _ = ip(&["netns", "del", &self.name]);
        let _ = ip(&["link", "del", &self.host_if]);
        for route in &self.unreachable {
            let _ = ip(&["route", "del", "unreachable", route]);
        }
    }
}
