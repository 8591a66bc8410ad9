//! The addresses a connection is known by on its way through the cloud, each its own
//! type so that a node name, a client's address and a redirected connection's original
//! destination cannot be mixed up: [`NodeName`] (which edge session), [`ClientAddr`]
//! (who connected to an entry), [`OrigDst`] (where a redirected connection was going),
//! [`Target`] (the `host:port` a connection reaches behind an edge); and [`Cidr`], a
//! range of addresses (a Service CIDR, a node's pod CIDR).

use std::fmt;
use std::net::{IpAddr, SocketAddr};

/// The name of a node (or of a cluster identity) that passed [`check_node_name`]: what
/// an admitted edge session is known by. Made where a name comes in from the network
/// (`Hello.node_name`); it reads as a `&str` (and keys maps looked up by `&str`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeName(String);

impl NodeName {
    /// Checks `name` with [`check_node_name`].
    pub(crate) fn new(name: String) -> Result<Self, String> {
        check_node_name(&name)?;
        Ok(NodeName(name))
    }

    pub(crate) fn as_str(&self) -> &str {
        &self.0
    }
}

/// Node names follow Kubernetes object names (RFC 1123 subdomain).
pub fn check_node_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 253
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphanumeric())
        && name
            .bytes()
            .last()
            .is_some_and(|b| b.is_ascii_alphanumeric());
    if ok {
        Ok(())
    } else {
        Err(format!(
            "`{name}` is not a valid node name (lower-case letters, digits, '-' and '.')"
        ))
    }
}

impl std::ops::Deref for NodeName {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl std::borrow::Borrow<str> for NodeName {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for NodeName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<NodeName> for String {
    fn from(name: NodeName) -> String {
        name.0
    }
}

/// Who connected to an entry: a TCP peer, or a client on the CONNECT entry's unix socket
/// (which has no address worth naming).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ClientAddr {
    Tcp(SocketAddr),
    Unix,
}

impl fmt::Display for ClientAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClientAddr::Tcp(addr) => addr.fmt(f),
            ClientAddr::Unix => f.write_str("unix"),
        }
    }
}

/// Where an eBPF-redirected connection was going before it was bent to the cloud: the
/// node address the edge dials.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OrigDst(pub(crate) SocketAddr);

impl fmt::Display for OrigDst {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// The `host:port` a connection is to reach: what the edge dials (the cloud sends it in
/// the dial call), or the cloud for an edge-to-cloud connection. Checked once where it
/// comes in (a config file, a CONNECT request, a dial call), so every hop after knows it
/// is well formed. It shows as the text it was parsed from, which is what logs, metrics
/// and the wire carry.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Target {
    /// Every open connection holds its target, so it is kept as small as the `String`
    /// it replaced: the host and the address are read back from the checked text when
    /// asked, a few times per connection, beside a dial. (Stored parsed, they made the
    /// cloud's idle connection 33 bytes larger.)
    text: Box<str>,
    port: u16,
}

/// Why a text is not a [`Target`]; says the text and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{text}` is not host:port: {problem}")]
pub struct TargetError {
    text: String,
    problem: TargetProblem,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum TargetProblem {
    #[error("it has no port")]
    NoPort,
    #[error("the host is empty")]
    EmptyHost,
    #[error("`{0}` is not a port number (1 to 65535)")]
    BadPort(String),
    #[error("port 0 cannot be dialled")]
    ZeroPort,
    #[error("it contains whitespace or a control character")]
    Whitespace,
    #[error("an IPv6 address goes in brackets, as in [::1]:443")]
    UnbracketedIpv6,
    #[error("`{0}` in brackets is not an IPv6 address")]
    BadBrackets(String),
}

impl Target {
    /// Parses `host:port`: a DNS name, an IPv4 address, or an IPv6 address in brackets,
    /// and a port from 1 to 65535.
    pub fn parse(text: &str) -> Result<Self, TargetError> {
        let bad = |problem| TargetError {
            text: text.to_string(),
            problem,
        };
        if text.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(bad(TargetProblem::Whitespace));
        }
        let (host, port) = match text.rsplit_once(':') {
            // `[::1]` splits inside the brackets.
            Some(_) if text.starts_with('[') && text.ends_with(']') => {
                return Err(bad(TargetProblem::NoPort));
            }
            Some(split) => split,
            None => return Err(bad(TargetProblem::NoPort)),
        };
        if port.is_empty() {
            return Err(bad(TargetProblem::NoPort));
        }
        // Digits only: `u16::from_str` would take a sign.
        let digits = port.bytes().all(|b| b.is_ascii_digit());
        let port = match port.parse::<u16>() {
            Ok(0) => return Err(bad(TargetProblem::ZeroPort)),
            Ok(number) if digits => number,
            _ => return Err(bad(TargetProblem::BadPort(port.to_string()))),
        };
        match host.strip_prefix('[') {
            Some(inner) => {
                let inner = inner.strip_suffix(']').unwrap_or(inner);
                if !text.parse::<SocketAddr>().is_ok_and(|a| a.is_ipv6()) {
                    return Err(bad(TargetProblem::BadBrackets(inner.to_string())));
                }
            }
            None if host.is_empty() => return Err(bad(TargetProblem::EmptyHost)),
            None if host.contains(':') => return Err(bad(TargetProblem::UnbracketedIpv6)),
            None => {}
        }
        Ok(Self {
            text: text.into(),
            port,
        })
    }

    /// The host: a name, or an IP address (without brackets).
    pub(crate) fn host(&self) -> &str {
        // `parse` checked the text: the port follows the last colon, and an IPv6 host
        // is in brackets.
        let host = self.text.rsplit_once(':').map_or("", |(host, _)| host);
        host.strip_prefix('[')
            .and_then(|inner| inner.strip_suffix(']'))
            .unwrap_or(host)
    }

    pub(crate) fn port(&self) -> u16 {
        self.port
    }

    /// The address, when the host is an IP address rather than a name.
    pub fn socket_addr(&self) -> Option<SocketAddr> {
        self.text.parse().ok()
    }

    /// The text it was parsed from.
    pub(crate) fn as_str(&self) -> &str {
        &self.text
    }
}

impl From<SocketAddr> for Target {
    fn from(addr: SocketAddr) -> Self {
        Self {
            // `a.b.c.d:port` or `[v6]:port`, which `parse` takes.
            text: addr.to_string().into(),
            port: addr.port(),
        }
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// The environment variable that names this node's addresses, comma-separated, as the
/// downward API gives `status.hostIPs` (deploy/'s DaemonSets set it from
/// `status.hostIP`): the edge's own addresses when `allow.node_addresses` lists none,
/// and where a cloud's `redirect.pod_port` listens.
pub const NODE_IPS: &str = "NODE_IPS";

/// A `NODE_IPS` that does not parse.
#[derive(Debug, thiserror::Error)]
#[error(
    "{NODE_IPS}: `{0}` is not an IP address ({NODE_IPS} lists this node's addresses, comma-separated)"
)]
pub struct NodeIpsError(String);

/// The addresses in a `NODE_IPS` value.
pub fn parse_node_ips(value: &str) -> Result<Vec<IpAddr>, NodeIpsError> {
    value
        .split(',')
        .map(str::trim)
        .map(|a| a.parse().map_err(|_| NodeIpsError(a.to_string())))
        .collect()
}

/// This node's addresses, from its interfaces.
pub fn interface_addresses() -> Vec<IpAddr> {
    let Ok(addrs) = nix::ifaddrs::getifaddrs() else {
        return Vec::new();
    };
    let mut out: Vec<IpAddr> = addrs
        .filter_map(|a| a.address)
        .filter_map(|s| {
            s.as_sockaddr_in()
                .map(|v4| IpAddr::V4(v4.ip()))
                .or_else(|| s.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip())))
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    #[test]
    fn node_ips_parse_as_the_downward_api_lists_them_and_name_a_bad_one() {
        let ips = parse_node_ips("192.0.2.7,fd00:7e57::5").expect("parses");
        assert_eq!(
            ips,
            [
                IpAddr::from([192, 0, 2, 7]),
                "fd00:7e57::5".parse::<IpAddr>().expect("ip")
            ]
        );
        assert_eq!(
            parse_node_ips(" 192.0.2.7 ").expect("spaces"),
            [IpAddr::from([192, 0, 2, 7])]
        );
        let bad = parse_node_ips("192.0.2.7,node-1")
            .expect_err("not an address")
            .to_string();
        assert!(
            bad.contains("NODE_IPS") && bad.contains("`node-1`"),
            "{bad}"
        );
    }

    #[test]
    fn detected_addresses_include_ipv6_ones() {
        // Where this host has IPv6 loopback, detection must report it (and with it any
        // other IPv6 address of the node's interfaces).
        if std::net::TcpListener::bind("[::1]:0").is_ok() {
            let found = interface_addresses();
            assert!(
                found.contains(&IpAddr::from(std::net::Ipv6Addr::LOCALHOST)),
                "{found:?}"
            );
        }
    }

    #[test]
    fn a_cidr_holds_its_range_of_its_family_only() {
        let cidr: Cidr = "10.244.0.0/24".parse().expect("cidr");
        assert!(cidr.contains("10.244.0.5".parse().unwrap()));
        assert!(cidr.contains("::ffff:10.244.0.255".parse().unwrap()));
        assert!(!cidr.contains("10.244.1.0".parse().unwrap()));
        let all: Cidr = "0.0.0.0/0".parse().expect("cidr");
        assert!(all.contains("192.0.2.1".parse().unwrap()));
        assert!(!all.contains("fd00::1".parse().unwrap()));
        let v6: Cidr = "fd00:10::/108".parse().expect("cidr");
        assert!(v6.contains("fd00:10::a".parse().unwrap()));
        assert!(!v6.contains("fd00:11::a".parse().unwrap()));
        for bad in [
            "10.0.0.0",
            "10.0.0.0/33",
            "fd00::/129",
            "x/8",
            "10.0.0.0/-1",
        ] {
            assert!(bad.parse::<Cidr>().is_err(), "{bad}");
        }
    }

    #[test]
    fn a_node_name_is_checked_once_and_reads_as_str() {
        assert!(NodeName::new("Edge_1".into()).is_err());
        assert!(NodeName::new(String::new()).is_err());
        let name = NodeName::new("edge-1.example".into()).expect("valid");
        assert_eq!(name.to_string(), "edge-1.example");
        // Maps keyed by NodeName are looked up with the &str a connection carries.
        let map = HashMap::from([(name, 7)]);
        assert_eq!(map.get("edge-1.example"), Some(&7));
    }

    /// What `Target::parse` makes of `text`: host, port and address, or its error's text.
    fn parsed(text: &str) -> Result<(String, u16, Option<SocketAddr>), String> {
        Target::parse(text)
            .map(|t| {
                assert_eq!(t.to_string(), text, "shows as parsed");
                (t.host().to_string(), t.port(), t.socket_addr())
            })
            .map_err(|e| e.to_string())
    }

    #[test]
    fn a_target_is_parsed_into_host_and_port() {
        let v4: SocketAddr = "10.0.0.7:10250".parse().expect("literal");
        assert_eq!(
            parsed("10.0.0.7:10250"),
            Ok(("10.0.0.7".into(), 10250, Some(v4)))
        );
        let v6: SocketAddr = "[fd00:7e57::5]:443".parse().expect("literal");
        assert_eq!(
            parsed("[fd00:7e57::5]:443"),
            Ok(("fd00:7e57::5".into(), 443, Some(v6)))
        );
        assert_eq!(
            parsed("Registry.Local:5000"),
            Ok(("Registry.Local".into(), 5000, None)),
            "a name keeps its spelling"
        );
        assert_eq!(parsed("kubelet:65535"), Ok(("kubelet".into(), 65535, None)));
        // One made from an address reads as the one parsed from its text.
        for addr in [v4, v6] {
            let made = Target::from(addr);
            assert_eq!(Ok(made.clone()), Target::parse(&addr.to_string()));
            assert_eq!(made.host(), addr.ip().to_string());
        }
    }

    #[test]
    fn a_bad_target_names_what_is_wrong() {
        for (text, error) in [
            ("10.0.0.7", "`10.0.0.7` is not host:port: it has no port"),
            ("edge-1:", "`edge-1:` is not host:port: it has no port"),
            ("[::1]", "`[::1]` is not host:port: it has no port"),
            (
                "edge-1:0",
                "`edge-1:0` is not host:port: port 0 cannot be dialled",
            ),
            (
                "edge-1:65536",
                "`edge-1:65536` is not host:port: `65536` is not a port number (1 to 65535)",
            ),
            (
                "edge-1:+80",
                "`edge-1:+80` is not host:port: `+80` is not a port number (1 to 65535)",
            ),
            (
                "edge-1:http",
                "`edge-1:http` is not host:port: `http` is not a port number (1 to 65535)",
            ),
            (":80", "`:80` is not host:port: the host is empty"),
            (
                "edge 1:80",
                "`edge 1:80` is not host:port: it contains whitespace or a control character",
            ),
            (
                " edge-1:80",
                "` edge-1:80` is not host:port: it contains whitespace or a control character",
            ),
            (
                "edge-1:80\n",
                "`edge-1:80\n` is not host:port: it contains whitespace or a control character",
            ),
            (
                "fd00::5:443",
                "`fd00::5:443` is not host:port: an IPv6 address goes in brackets, as in [::1]:443",
            ),
            (
                "[edge-1]:80",
                "`[edge-1]:80` is not host:port: `edge-1` in brackets is not an IPv6 address",
            ),
            (
                "[10.0.0.7]:80",
                "`[10.0.0.7]:80` is not host:port: `10.0.0.7` in brackets is not an IPv6 address",
            ),
            ("", "`` is not host:port: it has no port"),
        ] {
            assert_eq!(parsed(text), Err(error.to_string()), "{text:?}");
        }
    }
}

/// An address range as Kubernetes writes it (`10.96.0.0/12`, `fd00:10::/108`): a
/// Service CIDR, a node's pod CIDR. Host bits are cleared (a config may carry them), so
/// equal ranges are equal values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Cidr {
    network: IpAddr,
    prefix: u8,
}

impl Cidr {
    /// The range of `prefix` bits that holds `ip`; None past the family's width.
    pub fn containing(ip: IpAddr, prefix: u8) -> Option<Self> {
        let network = match ip {
            IpAddr::V4(ip) => {
                let host = 32u32.checked_sub(u32::from(prefix))?;
                let mask = u32::MAX.checked_shl(host).unwrap_or(0);
                IpAddr::from(std::net::Ipv4Addr::from(u32::from(ip) & mask))
            }
            IpAddr::V6(ip) => {
                let host = 128u32.checked_sub(u32::from(prefix))?;
                let mask = u128::MAX.checked_shl(host).unwrap_or(0);
                IpAddr::from(std::net::Ipv6Addr::from(u128::from(ip) & mask))
            }
        };
        Some(Self { network, prefix })
    }

    /// Whether `ip` (an IPv4-mapped IPv6 address as IPv4) is in the range.
    pub fn contains(&self, ip: IpAddr) -> bool {
        Self::containing(ip.to_canonical(), self.prefix).as_ref() == Some(self)
    }

    /// Whether it is an IPv6 range.
    pub fn is_ipv6(&self) -> bool {
        self.network.is_ipv6()
    }

    pub fn prefix(&self) -> u8 {
        self.prefix
    }
}

impl std::str::FromStr for Cidr {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let bad = || format!("`{text}` is not an address range like 10.96.0.0/12");
        let (ip, prefix) = text.split_once('/').ok_or_else(bad)?;
        let network: IpAddr = ip.parse().map_err(|_| bad())?;
        let prefix: u8 = prefix.parse().map_err(|_| bad())?;
        Self::containing(network, prefix).ok_or_else(bad)
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix)
    }
}

impl<'de> serde::Deserialize<'de> for Cidr {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}
