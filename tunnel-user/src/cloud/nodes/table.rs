//! The node table: which edge node has which addresses, from the config or the Node
//! watch, with only the addresses that are one edge's and no other node's.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;

use crate::addr::NodeName;
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
}

/// An address an edge claimed that the table leaves out, and why.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Dropped {
    /// More than one node (edge or not) lists it: it is nobody's. `nodes` is sorted.
    Conflict { address: IpAddr, nodes: Vec<String> },
    /// The master's own or no one host's (see [`reserved_address`]).
    Reserved {
        address: IpAddr,
        node: String,
        why: &'static str,
    },
}

impl Dropped {
    /// The `reason` label of `tunnel_node_addresses_dropped`.
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            Dropped::Conflict { .. } => "conflict",
            Dropped::Reserved { .. } => "reserved",
        }
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
    /// edge, is dropped for both) and that are not [`reserved_address`]. An edge whose name is
    /// no valid node name is left out: no edge can register by it (the config and
    /// Kubernetes both check names first, so none comes in practice).
    pub fn new<'a>(claims: impl IntoIterator<Item = Claim<'a>>) -> Self {
        let claims: Vec<Claim<'a>> = claims.into_iter().collect();
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
            let mut kept = Vec::new();
            for ip in claim.addresses {
                let address = ip.to_canonical();
                let others = &claimants[&address];
                if let Some(why) = reserved_address(address) {
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

    pub(crate) fn from_config(nodes: &[NodeConfig]) -> Self {
        Self::new(nodes.iter().map(|n| Claim {
            name: &n.name,
            addresses: &n.addresses,
            edge: true,
        }))
    }

    pub(crate) fn node_for_ip(&self, ip: IpAddr) -> Option<&NodeName> {
        self.by_ip.get(&ip.to_canonical())
    }

    pub fn addresses(&self, node: &str) -> Option<&[IpAddr]> {
        self.by_name.get(node).map(Vec::as_slice)
    }

    /// Every edge node with the addresses it has in the table.
    pub(crate) fn nodes(&self) -> impl Iterator<Item = (&NodeName, &[IpAddr])> + '_ {
        self.by_name
            .iter()
            .map(|(name, ips)| (name, ips.as_slice()))
    }

    /// Every address of every node, for the eBPF edge map.
    pub(crate) fn all_addresses(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.by_ip.keys().copied()
    }

    /// The addresses edges claimed and did not get, sorted.
    pub(crate) fn dropped(&self) -> &[Dropped] {
        &self.dropped
    }
}
