//! The edge's side of a proxied connection: is the target allowed, then connect to it.
//! A compromised cloud must not get an open proxy into the edge network.

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use proto::DialStatus;
use tokio::net::TcpStream;

use crate::config::AllowConfig;

/// Targets this edge agrees to dial.
#[derive(Debug, Clone)]
pub struct Allowlist {
    /// Exact targets; addresses in canonical form, names lower-cased.
    targets: HashSet<String>,
    node_addresses: HashSet<IpAddr>,
    ports: HashSet<u16>,
    any: bool,
}

impl Allowlist {
    /// `detected` are this node's addresses found on its interfaces, used when the config
    /// lists none.
    pub fn new(config: &AllowConfig, detected: impl FnOnce() -> Vec<IpAddr>) -> Self {
        let node_addresses = if config.node_addresses.is_empty() {
            detected()
        } else {
            config.node_addresses.clone()
        };
        Self {
            targets: config.targets.iter().map(|t| canonical(t)).collect(),
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
        let mut targets: Vec<_> = self.targets.iter().cloned().collect();
        targets.sort();
        let mut addrs: Vec<_> = self.node_addresses.iter().map(|a| a.to_string()).collect();
        addrs.sort();
        let mut ports: Vec<_> = self.ports.iter().copied().collect();
        ports.sort();
        format!("targets {targets:?}; node addresses {addrs:?} on ports {ports:?}")
    }

    pub fn check(&self, target: &str) -> Result<(), String> {
        if self.any || self.targets.contains(&canonical(target)) {
            return Ok(());
        }
        if let Ok(addr) = target.parse::<SocketAddr>()
            && self.node_addresses.contains(&addr.ip())
            && self.ports.contains(&addr.port())
        {
            return Ok(());
        }
        Err(format!("target {target} is not in this edge's allowlist"))
    }
}

fn canonical(target: &str) -> String {
    match target.parse::<SocketAddr>() {
        Ok(addr) => addr.to_string(),
        Err(_) => target.to_ascii_lowercase(),
    }
}

/// This node's own addresses, from its interfaces.
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

/// Dials `target` if allowed, within `timeout`.
pub async fn dial(
    allow: &Allowlist,
    target: &str,
    timeout: Duration,
) -> Result<TcpStream, (DialStatus, String)> {
    allow
        .check(target)
        .map_err(|m| (DialStatus::Forbidden, m))?;
    let connect = async {
        let addrs: Vec<SocketAddr> = match target.parse::<SocketAddr>() {
            Ok(a) => vec![a],
            Err(_) => tokio::net::lookup_host(target)
                .await
                .map_err(|e| (DialStatus::Refused, format!("cannot resolve {target}: {e}")))?
                .collect(),
        };
        let mut last = format!("{target} resolved to no address");
        for addr in addrs {
            match TcpStream::connect(addr).await {
                Ok(tcp) => return Ok(tcp),
                Err(e) => last = format!("connect to {addr}: {e}"),
            }
        }
        Err((DialStatus::Refused, last))
    };
    let tcp = tokio::time::timeout(timeout, connect).await.map_err(|_| {
        (
            DialStatus::Timeout,
            format!("connect to {target} timed out after {timeout:?}"),
        )
    })??;
    crate::net::tune(&tcp);
    Ok(tcp)
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
