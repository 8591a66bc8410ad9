//! The edge's side of a proxied connection: is the target allowed, then connect to it.
//! A compromised cloud must not get an open proxy into the edge network.

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use proto::DialStatus;
use tokio::net::TcpStream;
use tracing::warn;

use crate::config::AllowConfig;
use crate::io::net::{ConnectError, connect};

/// Targets this edge agrees to dial.
#[derive(Debug, Clone)]
pub struct Allowlist {
    /// Exact targets that are addresses.
    addresses: HashSet<SocketAddr>,
    /// Exact targets that are host names and ports, lower-cased.
    names: HashSet<String>,
    node_addresses: HashSet<IpAddr>,
    ports: HashSet<u16>,
    any: bool,
}

impl Allowlist {
    /// `default_node_addresses` are this node's addresses when the config lists none
    /// ([`default_node_addresses`]).
    pub fn new(config: &AllowConfig, default_node_addresses: impl FnOnce() -> Vec<IpAddr>) -> Self {
        let node_addresses = if config.node_addresses.is_empty() {
            default_node_addresses()
        } else {
            config.node_addresses.clone()
        };
        let (mut addresses, mut names) = (HashSet::new(), HashSet::new());
        for target in &config.targets {
            match target.parse::<SocketAddr>() {
                Ok(addr) => addresses.insert(addr),
                Err(_) => names.insert(target.to_ascii_lowercase()),
            };
        }
        Self {
            addresses,
            names,
            node_addresses: node_addresses.into_iter().collect(),
            ports: config.ports.iter().copied().collect(),
            any: config.any,
        }
    }

    pub fn allows_any(&self) -> bool {
        self.any
    }

    pub fn describe(&self) -> String {
        if self.any {
            return "any target (SuperEdge mode)".into();
        }
        let mut targets: Vec<_> = self
            .addresses
            .iter()
            .map(|a| a.to_string())
            .chain(self.names.iter().cloned())
            .collect();
        targets.sort();
        let mut addrs: Vec<_> = self.node_addresses.iter().map(|a| a.to_string()).collect();
        addrs.sort();
        let mut ports: Vec<_> = self.ports.iter().copied().collect();
        ports.sort();
        format!("targets {targets:?}; node addresses {addrs:?} on ports {ports:?}")
    }

    /// Whether `target` may be dialled (an address matches in any spelling, parsed,
    /// not formatted for the comparison).
    pub fn check(&self, target: &str) -> Result<(), DialError> {
        let addr = target.parse::<SocketAddr>().ok();
        let allowed = self.any
            || match addr {
                Some(addr) => {
                    self.addresses.contains(&addr)
                        || (self.node_addresses.contains(&addr.ip())
                            && self.ports.contains(&addr.port()))
                }
                None => self.names.contains(&target.to_ascii_lowercase()),
            };
        if allowed {
            Ok(())
        } else {
            Err(DialError::NotAllowed(target.to_string()))
        }
    }
}

/// The environment variable that names this node's addresses when
/// `allow.node_addresses` lists none: comma-separated, as the downward API gives
/// `status.hostIPs` (deploy/edge.yaml sets it from `status.hostIP`).
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

/// This node's addresses when `allow.node_addresses` lists none: `node_ips` (from
/// `NODE_IPS`), the addresses that name the node, else every address of its interfaces,
/// which on a Kubernetes node are more than the node's own (cni0's and docker0's
/// gateways, kube-ipvs0's Service addresses), so that fallback is logged as a warning.
pub fn default_node_addresses(node_ips: Option<Vec<IpAddr>>) -> Vec<IpAddr> {
    if let Some(addresses) = node_ips {
        return addresses;
    }
    let found = interface_addresses();
    warn!(addresses = ?found, "neither allow.node_addresses nor {NODE_IPS} names this node's addresses: allowing every address of its interfaces on allow.ports, bridges' and kube-ipvs0's Service addresses included");
    found
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

/// Why the edge did not connect to a target. The cloud is answered with
/// [`DialError::status`] and this text (`DialResult`), and the `dials` metric counts
/// the status.
#[derive(Debug, thiserror::Error)]
pub enum DialError {
    #[error("target {0} is not in this edge's allowlist")]
    NotAllowed(String),
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// `[https]`: the target's host is no TLS server name.
    #[error(transparent)]
    ServerName(crate::io::tls::TlsError),
    /// `[https]`: the TLS handshake with the target overran what was left of the bound.
    #[error("TLS handshake with {target} timed out (the dial's bound is {bound:?})")]
    TlsTimeout { target: String, bound: Duration },
    #[error("TLS handshake with {target}: {error}")]
    Tls {
        target: String,
        error: std::io::Error,
    },
}

impl DialError {
    /// What the cloud is told.
    pub fn status(&self) -> DialStatus {
        match self {
            DialError::NotAllowed(_) => DialStatus::Forbidden,
            DialError::Connect(e) => e.status(),
            DialError::TlsTimeout { .. } => DialStatus::Timeout,
            DialError::ServerName(_) => DialStatus::BadRequest,
            DialError::Tls { .. } => DialStatus::Refused,
        }
    }
}

/// Dials `target` if allowed, within `timeout`: the edge's TCP connection to a target.
pub async fn dial_target(
    allow: &Allowlist,
    target: &str,
    timeout: Duration,
) -> Result<TcpStream, DialError> {
    allow.check(target)?;
    Ok(connect(target, timeout).await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allow(config: AllowConfig) -> Allowlist {
        Allowlist::new(&config, || vec![IpAddr::from([192, 0, 2, 7])])
    }

    #[test]
    fn default_allows_kubelet_and_own_addresses_on_configured_ports() {
        let a = allow(AllowConfig::default());
        assert!(a.check("127.0.0.1:10250").is_ok());
        assert!(a.check("192.0.2.7:10250").is_ok());
        assert!(a.check("192.0.2.7:22").is_err());
        assert!(a.check("127.0.0.1:22").is_err());
        assert!(a.check("192.0.2.8:10250").is_err());
        assert!(a.check("metadata.internal:80").is_err());
    }

    #[test]
    fn configured_addresses_replace_detected_ones() {
        let a = allow(AllowConfig {
            node_addresses: vec![IpAddr::from([127, 1, 0, 5])],
            ..AllowConfig::default()
        });
        assert!(a.check("127.1.0.5:10250").is_ok());
        assert!(a.check("192.0.2.7:10250").is_err());
    }

    #[test]
    fn ipv6_node_addresses_are_allowed_on_the_node_ports() {
        let a = Allowlist::new(&AllowConfig::default(), || {
            vec![
                IpAddr::from([192, 0, 2, 7]),
                "fd00:7e57::5".parse().expect("ip"),
            ]
        });
        assert!(a.check("[fd00:7e57::5]:10250").is_ok());
        assert!(a.check("[fd00:7e57:0:0::5]:10250").is_ok(), "any spelling");
        assert!(a.check("[fd00:7e57::5]:22").is_err());
        assert!(a.check("[fd00:7e57::6]:10250").is_err());
    }

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
    fn exact_targets_match_by_canonical_form() {
        let a = allow(AllowConfig {
            targets: vec!["[::1]:8080".into(), "Registry.Local:5000".into()],
            ..AllowConfig::default()
        });
        assert!(a.check("[0:0:0:0:0:0:0:1]:8080").is_ok());
        assert!(a.check("registry.local:5000").is_ok());
        assert!(a.check("registry.local:5001").is_err());
    }

    #[test]
    fn any_allows_everything() {
        let a = allow(AllowConfig {
            any: true,
            ..AllowConfig::default()
        });
        assert!(a.check("10.1.2.3:22").is_ok());
    }
}
