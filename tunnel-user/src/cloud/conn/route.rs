//! Routing: which node, and which target on it, a cloud-side connection goes to.
//! Pure functions over the node table (`cloud::nodes::table`); no I/O.

use std::net::{IpAddr, SocketAddr};

use crate::addr::{NodeName, Target, TargetError};
use crate::cloud::nodes::table::NodeTable;

/// Where a connection goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// `None`: the first connected edge (SuperEdge's tcp module).
    pub node: Option<NodeName>,
    /// What the edge dials.
    pub target: Target,
    /// The edge wraps its connection to the target in TLS (SuperEdge's HTTPS module).
    pub tls: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    #[error("`{0}` is neither a node name nor a node address")]
    UnknownHost(String),
    #[error(transparent)]
    BadAuthority(#[from] TargetError),
}

/// Routes `CONNECT host:port`: host is a node address (the edge dials it as given) or a
/// node name (the edge dials the node's first address, or its loopback when the table
/// has none). `connected` says whether a node name has a live edge session, so edges
/// missing from the table are reachable by name.
pub fn route_connect(
    table: &NodeTable,
    authority: &str,
    connected: impl Fn(&str) -> bool,
) -> Result<Route, RouteError> {
    let target = Target::parse(authority)?;
    if let Some(addr) = target.socket_addr() {
        return route_address(table, addr);
    }
    let host = target.host().trim_end_matches('.').to_ascii_lowercase();
    let addrs = match table.addresses(&host) {
        Some(addrs) => addrs,
        None if connected(&host) => &[],
        None => return Err(RouteError::UnknownHost(host)),
    };
    let ip = addrs
        .first()
        .copied()
        .unwrap_or(IpAddr::from([127, 0, 0, 1]));
    // A name in the table or of a live session passed the same check.
    let node = NodeName::new(host.clone()).map_err(|_| RouteError::UnknownHost(host))?;
    Ok(Route {
        node: Some(node),
        target: SocketAddr::new(ip, target.port()).into(),
        tls: false,
    })
}

/// Routes a connection to a node address (an eBPF-redirected connection's original
/// destination, or CONNECT to an IP): the edge dials exactly that address.
pub(crate) fn route_address(table: &NodeTable, dst: SocketAddr) -> Result<Route, RouteError> {
    let node = table
        .node_for_ip(dst.ip())
        .ok_or_else(|| RouteError::UnknownHost(dst.ip().to_string()))?;
    Ok(Route {
        node: Some(node.clone()),
        target: dst.into(),
        tls: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cloud::nodes::table::{Claim, Dropped};
    use crate::config::reserved_address;

    fn table() -> NodeTable {
        let a = [IpAddr::from([127, 1, 0, 5]), IpAddr::from([192, 0, 2, 5])];
        let b = [IpAddr::from([127, 1, 0, 6])];
        NodeTable::new([edge("edge-a", &a), edge("edge-b", &b)], &[])
    }

    fn edge<'a>(name: &'a str, addresses: &'a [IpAddr]) -> Claim<'a> {
        Claim {
            name,
            addresses,
            edge: true,
            pod_cidrs: &[],
            over_cap: false,
        }
    }

    fn ips(list: &[&str]) -> Vec<IpAddr> {
        list.iter().map(|ip| ip.parse().expect("ip")).collect()
    }

    fn name(n: &str) -> NodeName {
        NodeName::new(n.into()).expect("valid")
    }

    fn target(t: &str) -> Target {
        Target::parse(t).expect("valid")
    }

    fn nothing_connected(_: &str) -> bool {
        false
    }

    #[test]
    fn connect_to_node_ip_dials_that_ip() {
        let r = route_connect(&table(), "127.1.0.6:10250", nothing_connected).unwrap();
        assert_eq!(
            r,
            Route {
                node: Some(name("edge-b")),
                target: target("127.1.0.6:10250"),
                tls: false
            }
        );
    }

    #[test]
    fn connect_to_node_name_dials_first_address() {
        let r = route_connect(&table(), "Edge-A:10250", nothing_connected).unwrap();
        assert_eq!(
            r,
            Route {
                node: Some(name("edge-a")),
                target: target("127.1.0.5:10250"),
                tls: false
            }
        );
    }

    #[test]
    fn connected_node_missing_from_table_dials_its_loopback() {
        let r = route_connect(&table(), "edge-z:8080", |n| n == "edge-z").unwrap();
        assert_eq!(
            r,
            Route {
                node: Some(name("edge-z")),
                target: target("127.0.0.1:8080"),
                tls: false
            }
        );
    }

    #[test]
    fn unknown_hosts_and_bad_authorities_are_refused() {
        assert_eq!(
            route_connect(&table(), "10.9.9.9:10250", nothing_connected),
            Err(RouteError::UnknownHost("10.9.9.9".into()))
        );
        assert_eq!(
            route_connect(&table(), "nope:1", nothing_connected),
            Err(RouteError::UnknownHost("nope".into()))
        );
        for bad in ["edge-a", "edge-a:", "edge-a:0", ":80", "edge-a:99999"] {
            assert!(
                matches!(
                    route_connect(&table(), bad, nothing_connected),
                    Err(RouteError::BadAuthority(_))
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn connect_to_an_ipv6_node_address_dials_it_in_brackets() {
        let v6 = [IpAddr::from([0xfd00, 0x7e57, 0, 0, 0, 0, 0, 5])];
        let table = NodeTable::new([edge("edge-6", &v6)], &[]);
        let r = route_connect(&table, "[fd00:7e57::5]:10250", nothing_connected).unwrap();
        assert_eq!(r.node.as_deref(), Some("edge-6"));
        assert_eq!(r.target, target("[fd00:7e57::5]:10250"));
        // By name: the first address, which is IPv6 here.
        let r = route_connect(&table, "edge-6:10250", nothing_connected).unwrap();
        assert_eq!(r.target, target("[fd00:7e57::5]:10250"));
        assert_eq!(
            route_connect(&table, "[fd00:7e57::9]:10250", nothing_connected),
            Err(RouteError::UnknownHost("fd00:7e57::9".into()))
        );
    }

    #[test]
    fn original_destination_routes_by_address() {
        let dst: SocketAddr = "192.0.2.5:10255".parse().unwrap();
        assert_eq!(
            route_address(&table(), dst).unwrap().node.as_deref(),
            Some("edge-a")
        );
        assert!(route_address(&table(), "192.0.2.99:1".parse().unwrap()).is_err());
    }

    #[test]
    fn an_address_two_nodes_claim_is_nobodys() {
        let honest = ips(&["192.0.2.10", "192.0.2.11"]);
        // A compromised edge lists a master's address, the honest edge's second one,
        // and its own.
        let evil = ips(&["192.0.2.1", "192.0.2.11", "192.0.2.20"]);
        let master = ips(&["192.0.2.1"]);
        let table = NodeTable::new(
            [
                edge("edge-honest", &honest),
                edge("edge-evil", &evil),
                Claim {
                    name: "master-1",
                    addresses: &master,
                    edge: false,
                    pod_cidrs: &[],
                    over_cap: false,
                },
            ],
            &[],
        );
        let owner = |ip: &str| {
            table
                .node_for_ip(ip.parse().expect("ip"))
                .map(|n| n.to_string())
        };
        assert_eq!(owner("192.0.2.10").as_deref(), Some("edge-honest"));
        assert_eq!(owner("192.0.2.20").as_deref(), Some("edge-evil"));
        assert_eq!(owner("192.0.2.1"), None, "a master's address is no edge's");
        assert_eq!(
            owner("192.0.2.11"),
            None,
            "claimed by two edges: neither gets it"
        );
        assert_eq!(
            table.addresses("edge-honest"),
            Some(&ips(&["192.0.2.10"])[..])
        );
        assert_eq!(
            table.addresses("edge-evil"),
            Some(&ips(&["192.0.2.20"])[..])
        );
        assert_eq!(
            table.addresses("master-1"),
            None,
            "a non-edge node is not in the table"
        );
        assert_eq!(
            table.dropped(),
            [
                Dropped::Conflict {
                    address: "192.0.2.1".parse().expect("ip"),
                    nodes: vec!["edge-evil".into(), "master-1".into()],
                },
                Dropped::Conflict {
                    address: "192.0.2.11".parse().expect("ip"),
                    nodes: vec!["edge-evil".into(), "edge-honest".into()],
                },
            ]
        );
        let mut all: Vec<IpAddr> = table.all_addresses();
        all.sort();
        assert_eq!(
            all,
            ips(&["192.0.2.10", "192.0.2.20"]),
            "the edge map gets only these"
        );
    }

    #[test]
    fn an_edge_listing_an_address_twice_keeps_it() {
        // InternalIP and ExternalIP the same, once as IPv4-mapped IPv6.
        let a = ips(&["192.0.2.5", "192.0.2.5", "::ffff:192.0.2.5"]);
        let table = NodeTable::new([edge("edge-a", &a)], &[]);
        assert!(table.dropped().is_empty(), "{:?}", table.dropped());
        assert_eq!(
            table.addresses("edge-a"),
            Some(&ips(&["192.0.2.5", "::ffff:192.0.2.5"])[..])
        );
        assert_eq!(
            route_address(&table, "[::ffff:192.0.2.5]:10250".parse().expect("addr"))
                .expect("a mapped address routes as the IPv4 one")
                .node
                .as_deref(),
            Some("edge-a")
        );
    }

    #[test]
    fn reserved_addresses_are_never_an_edges() {
        for (ip, why) in [
            ("127.0.0.1", "loopback"),
            ("127.0.0.53", "loopback"),
            ("::1", "loopback"),
            ("::ffff:127.0.0.1", "loopback"),
            ("0.0.0.0", "unspecified"),
            ("::", "unspecified"),
            ("169.254.169.254", "link-local"),
            ("fe80::1", "link-local"),
            ("::ffff:169.254.1.1", "link-local"),
            ("224.0.0.1", "multicast"),
            ("ff02::1", "multicast"),
            ("255.255.255.255", "broadcast"),
        ] {
            let address: IpAddr = ip.parse().expect("ip");
            assert_eq!(reserved_address(address), Some(why), "{ip}");
            let claimed = [address, IpAddr::from([192, 0, 2, 5])];
            let table = NodeTable::new([edge("edge-a", &claimed)], &[]);
            assert_eq!(table.node_for_ip(address), None, "{ip} must not route");
            assert_eq!(
                table.dropped(),
                [Dropped::Reserved {
                    address: address.to_canonical(),
                    node: "edge-a".into(),
                    why
                }],
                "{ip}"
            );
            assert_eq!(table.all_addresses().len(), 1, "{ip}");
        }
        // Edge addresses of tests and demos on one machine, and ordinary ones.
        for ip in [
            "127.1.0.5",
            "127.77.1.2",
            "10.0.0.7",
            "192.0.2.5",
            "fd00:7e57::5",
            "2001:db8::1",
        ] {
            assert_eq!(reserved_address(ip.parse().expect("ip")), None, "{ip}");
        }
    }
}
