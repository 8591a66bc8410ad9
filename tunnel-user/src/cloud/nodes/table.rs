//! The node table: which edge node has which addresses, from the config or the Node
//! watch, with only the addresses that are one edge's and no other node's.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::IpAddr;

use crate::addr::{Cidr, NodeName};
use crate::config::{NodeConfig, reserved_address};

/// One node's addresses as a source states them: a `[[node]]` of the config, or a Node
/// object (whose kubelet writes its status, so a compromised edge can state anything).
#[derive(Debug, Clone, Copy)]
pub struct Claim<'a> {
    pub name: &'a str,
    pub addresses: &'a [IpAddr],
    /// An edge's addresses enter the table; any other node's only keep an edge from
    /// taking them.
    pub edge: bool,
    /// The node's pod CIDRs (`spec.podCIDRs`). A non-edge node's are no edge's
    /// addresses: its pods (metrics-server, which kube-apiserver dials by pod IP) are
    /// its own. An edge's are not used: its kubelet may set its own podCIDR once where
    /// no controller allocates them, and a wide one would bar every other edge.
    pub pod_cidrs: &'a [Cidr],
    /// The node listed more than [`ADDRESSES_PER_FAMILY`] addresses of a family, and
    /// `addresses` holds the first of each.
    pub over_cap: bool,
}

/// The addresses of each family an edge's Node may list for the table: a real node lists
/// one or two (InternalIP, ExternalIP), a few more with several interfaces. The rest of
/// a longer list (a compromised kubelet's status patch of thousands) is left out whole,
/// so that neither each address nor each patch of them costs a log line or a new table.
pub const ADDRESSES_PER_FAMILY: usize = 8;

/// An address an edge claimed that the table leaves out, and why.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Dropped {
    /// More than one node (edge or not) lists it: it is nobody's. `nodes` is sorted.
    Conflict { address: IpAddr, nodes: Vec<String> },
    /// The master's own or no one host's (see [`reserved_address`]), a Service's
    /// ClusterIP, or a pod's address on a node that is no edge.
    Reserved {
        address: IpAddr,
        node: String,
        why: &'static str,
    },
    /// The node listed more than [`ADDRESSES_PER_FAMILY`] addresses of a family.
    TooMany { node: String },
}

impl Dropped {
    /// The `reason` label of `tunnel_node_addresses_dropped`.
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            Dropped::Conflict { .. } => "conflict",
            Dropped::Reserved { .. } => "reserved",
            Dropped::TooMany { .. } => "too_many",
        }
    }
}

/// Address ranges, looked up by prefix length: a cluster's thousands of pod CIDRs come in
/// one or two lengths, so an address is cut to each length in use and looked up, not
/// compared with every range.
struct Ranges {
    /// (IPv6, prefix) of every range.
    lengths: BTreeSet<(bool, u8)>,
    ranges: HashSet<Cidr>,
}

impl Ranges {
    fn new<'a>(ranges: impl IntoIterator<Item = &'a Cidr>) -> Self {
        let ranges: HashSet<Cidr> = ranges.into_iter().copied().collect();
        let lengths = ranges.iter().map(|r| (r.is_ipv6(), r.prefix())).collect();
        Self { lengths, ranges }
    }

    fn contains(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        self.lengths
            .iter()
            .filter(|(v6, _)| *v6 == ip.is_ipv6())
            .filter_map(|(_, prefix)| Cidr::containing(ip, *prefix))
            .any(|range| self.ranges.contains(&range))
    }
}

/// Edge node name -> addresses, and the reverse, from the config or Kubernetes; only
/// addresses that are one edge's and no other node's.
#[derive(Debug, Default, Clone)]
pub struct NodeTable {
    by_name: HashMap<NodeName, Vec<IpAddr>>,
    /// Keyed by the canonical address (an IPv4-mapped IPv6 address as IPv4).
    by_ip: HashMap<IpAddr, NodeName>,
    /// What the edges claimed and did not get, sorted.
    dropped: Vec<Dropped>,
}

impl NodeTable {
    /// The table of the edges among `claims`: each edge gets the addresses it lists
    /// that no other claim lists (an address two nodes list, or a non-edge node and an
    /// edge, is dropped for both) and that are not [`reserved_address`], in one of
    /// `services` (the cluster's Service CIDRs) or in a non-edge node's pod CIDR. An edge
    /// whose name is no valid node name is left out: no edge can register by it (the
    /// config and Kubernetes both check names first, so none comes in practice).
    pub fn new<'a>(claims: impl IntoIterator<Item = Claim<'a>>, services: &[Cidr]) -> Self {
        let claims: Vec<Claim<'a>> = claims.into_iter().collect();
        let pods = Ranges::new(claims.iter().filter(|c| !c.edge).flat_map(|c| c.pod_cidrs));
        let services = Ranges::new(services);
        let barred = |address: IpAddr| {
            if let Some(why) = reserved_address(address) {
                Some(why)
            } else if services.contains(address) {
                Some("Service ClusterIP (in the Service CIDR)")
            } else if pods.contains(address) {
                Some("pod (in the pod CIDR of a node that is no edge)")
            } else {
                None
            }
        };
        let mut claimants: BTreeMap<IpAddr, BTreeSet<&str>> = BTreeMap::new();
        for claim in &claims {
            for ip in claim.addresses {
                claimants
                    .entry(ip.to_canonical())
                    .or_default()
                    .insert(claim.name);
            }
        }
        let mut table = Self::default();
        let mut dropped = BTreeSet::new();
        for claim in claims.iter().filter(|c| c.edge) {
            let Ok(name) = NodeName::new(claim.name.to_string()) else {
                continue;
            };
            if claim.over_cap {
                dropped.insert(Dropped::TooMany {
                    node: claim.name.to_string(),
                });
            }
            let mut kept = Vec::new();
            for ip in claim.addresses {
                let address = ip.to_canonical();
                let others = &claimants[&address];
                if let Some(why) = barred(address) {
                    dropped.insert(Dropped::Reserved {
                        address,
                        node: claim.name.to_string(),
                        why,
                    });
                } else if others.len() > 1 {
                    dropped.insert(Dropped::Conflict {
                        address,
                        nodes: others.iter().map(|n| n.to_string()).collect(),
                    });
                } else if !kept.contains(ip) {
                    kept.push(*ip);
                    table.by_ip.insert(address, name.clone());
                }
            }
            table.by_name.insert(name, kept);
        }
        table.dropped = dropped.into_iter().collect();
        table
    }

    pub(crate) fn from_config(nodes: &[NodeConfig], services: &[Cidr]) -> Self {
        let claims = nodes.iter().map(|n| Claim {
            name: &n.name,
            addresses: &n.addresses,
            edge: true,
            pod_cidrs: &[],
            over_cap: false,
        });
        Self::new(claims, services)
    }

    pub(crate) fn node_for_ip(&self, ip: IpAddr) -> Option<&NodeName> {
        self.by_ip.get(&ip.to_canonical())
    }

    pub fn addresses(&self, node: &str) -> Option<&[IpAddr]> {
        self.by_name.get(node).map(Vec::as_slice)
    }

    /// The nodes in the table.
    pub(crate) fn len(&self) -> usize {
        self.by_name.len()
    }

    /// Every edge node with the addresses it has in the table.
    pub(crate) fn nodes(&self) -> impl Iterator<Item = (&NodeName, &[IpAddr])> + '_ {
        self.by_name
            .iter()
            .map(|(name, ips)| (name, ips.as_slice()))
    }

    /// Every address of every node, for the eBPF edge map: each node's first listed
    /// ones before any node's second (so a full map keeps every node's InternalIP before
    /// another's extra addresses), the lower address first among equals.
    pub(crate) fn all_addresses(&self) -> Vec<IpAddr> {
        let mut ranked: Vec<(usize, IpAddr)> = self
            .by_name
            .values()
            .flat_map(|ips| ips.iter().enumerate().map(|(i, ip)| (i, ip.to_canonical())))
            .collect();
        ranked.sort_unstable();
        ranked.into_iter().map(|(_, ip)| ip).collect()
    }

    /// The addresses edges claimed and did not get, sorted.
    pub(crate) fn dropped(&self) -> &[Dropped] {
        &self.dropped
    }
}
