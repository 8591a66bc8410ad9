//! The node table: which edge node has which addresses, from the config or the Node
//! watch, with only the addresses that are one edge's and no other node's; and the
//! [`Book`] of every node's claims it is kept from, so that a change of a few nodes
//! recomputes the entries of the edges it can touch, not the whole table.

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

/// A node's claim as the [`Book`] keeps it, by the node's name.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Claimed {
    pub(crate) edge: bool,
    /// In the order the node lists them.
    pub(crate) addresses: Vec<IpAddr>,
    pub(crate) over_cap: bool,
    pub(crate) pod_cidrs: Vec<Cidr>,
}

impl From<Claim<'_>> for Claimed {
    fn from(c: Claim<'_>) -> Self {
        Self {
            edge: c.edge,
            addresses: c.addresses.to_vec(),
            over_cap: c.over_cap,
            pod_cidrs: c.pod_cidrs.to_vec(),
        }
    }
}

impl Claimed {
    /// Its addresses, canonical, each once.
    fn canonical(&self) -> BTreeSet<IpAddr> {
        self.addresses.iter().map(|ip| ip.to_canonical()).collect()
    }
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
/// compared with every range. Each range counts the nodes that list it.
#[derive(Default)]
struct Ranges {
    /// (IPv6, prefix) of every range, with the ranges of that length.
    lengths: BTreeMap<(bool, u8), usize>,
    ranges: HashMap<Cidr, usize>,
}

impl Ranges {
    /// Counts `range` once more; whether it is new.
    fn add(&mut self, range: Cidr) -> bool {
        let count = self.ranges.entry(range).or_default();
        *count += 1;
        if *count > 1 {
            return false;
        }
        *self
            .lengths
            .entry((range.is_ipv6(), range.prefix()))
            .or_default() += 1;
        true
    }

    /// Counts `range` once less; whether it is gone.
    fn remove(&mut self, range: Cidr) -> bool {
        let Some(count) = self.ranges.get_mut(&range) else {
            return false;
        };
        *count -= 1;
        if *count > 0 {
            return false;
        }
        self.ranges.remove(&range);
        let length = (range.is_ipv6(), range.prefix());
        if let Some(n) = self.lengths.get_mut(&length) {
            *n -= 1;
            if *n == 0 {
                self.lengths.remove(&length);
            }
        }
        true
    }

    fn contains(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        self.lengths
            .keys()
            .filter(|(v6, _)| *v6 == ip.is_ipv6())
            .filter_map(|(_, prefix)| Cidr::containing(ip, *prefix))
            .any(|range| self.ranges.contains_key(&range))
    }
}

/// Every node's claim, and what the table's rules read of them all: which nodes list an
/// address, the pod CIDRs of the nodes that are no edge, the Service CIDRs. A change to
/// one node recomputes the entries of the edges it can touch ([`Book::entries`]).
#[derive(Default)]
pub(crate) struct Book {
    claims: HashMap<String, Claimed>,
    /// Nodes of the config: a watched Node of the same name is left out.
    configured: HashSet<String>,
    /// Canonical address -> the nodes that list it (one, unless it is in conflict).
    claimants: HashMap<IpAddr, Vec<String>>,
    /// The pod CIDRs of the nodes that are no edge.
    pods: Ranges,
    services: Ranges,
    /// What each edge claimed and did not get (only the edges with something dropped).
    dropped: HashMap<String, BTreeSet<Dropped>>,
    /// The nodes in `claims` that are edges (the config's among them): counted as they
    /// change, since a fleet's are too many to count at each change.
    edges: usize,
}

/// What changes made since the last [`Book::entries`] can alter.
#[derive(Default)]
pub(crate) struct Touched {
    nodes: HashSet<String>,
    /// Canonical: whoever lists one is recomputed.
    addresses: HashSet<IpAddr>,
    /// Ranges that came or went: whoever lists an address in one is recomputed.
    ranges: Vec<Cidr>,
    /// The Service CIDRs changed: every edge is recomputed.
    all: bool,
}

impl Touched {
    pub(crate) fn is_empty(&self) -> bool {
        self.nodes.is_empty() && self.addresses.is_empty() && self.ranges.is_empty() && !self.all
    }
}

/// An edge's entry in the table, recomputed; `None`: it has none (gone, or no edge).
pub(crate) struct Entry {
    name: String,
    kept: Option<(NodeName, Vec<IpAddr>)>,
}

impl Entry {
    /// The node's name (as the source states it: maybe no valid node name).
    pub(crate) fn name(&self) -> &str {
        &self.name
    }
}

impl Book {
    /// The `[[node]]`s of the config, edges all, which the watch cannot change.
    pub(crate) fn new(configured: &[NodeConfig], touched: &mut Touched) -> Self {
        let mut book = Self::default();
        for node in configured {
            let claim = Claimed {
                edge: true,
                addresses: node.addresses.clone(),
                ..Claimed::default()
            };
            book.set(&node.name, Some(claim), touched);
            book.configured.insert(node.name.clone());
        }
        book
    }

    /// Makes `services` the Service CIDRs, whose addresses are no edge's.
    pub(crate) fn set_services(&mut self, services: &[Cidr], touched: &mut Touched) {
        self.services = Ranges::default();
        for range in services {
            self.services.add(*range);
        }
        touched.all = true;
    }

    /// What the node `name` claims now (`None`: it is gone). A node of the config is left
    /// as the config says; a claim equal to the one kept changes nothing.
    pub(crate) fn set(&mut self, name: &str, claim: Option<Claimed>, touched: &mut Touched) {
        if self.configured.contains(name) || self.claims.get(name) == claim.as_ref() {
            return;
        }
        if let Some(old) = self.claims.remove(name) {
            self.edges -= usize::from(old.edge);
            self.index(name, &old, false, touched);
        }
        if let Some(new) = claim {
            self.edges += usize::from(new.edge);
            self.index(name, &new, true, touched);
            self.claims.insert(name.to_string(), new);
        }
        touched.nodes.insert(name.to_string());
    }

    /// A relist: `listed` is every watched node now; the others are gone.
    pub(crate) fn replace(&mut self, mut listed: HashMap<String, Claimed>, touched: &mut Touched) {
        let gone: Vec<String> = self
            .claims
            .keys()
            .filter(|n| !listed.contains_key(*n) && !self.configured.contains(*n))
            .cloned()
            .collect();
        for name in gone {
            self.set(&name, None, touched);
        }
        for (name, claim) in listed.drain() {
            self.set(&name, Some(claim), touched);
        }
    }

    /// Adds (`add`) or removes what `claim` puts in the indexes.
    fn index(&mut self, name: &str, claim: &Claimed, add: bool, touched: &mut Touched) {
        for address in claim.canonical() {
            touched.addresses.insert(address);
            if add {
                self.claimants
                    .entry(address)
                    .or_default()
                    .push(name.to_string());
            } else if let Some(names) = self.claimants.get_mut(&address) {
                names.retain(|n| n != name);
                if names.is_empty() {
                    self.claimants.remove(&address);
                }
            }
        }
        if !claim.edge {
            for range in &claim.pod_cidrs {
                let changed = if add {
                    self.pods.add(*range)
                } else {
                    self.pods.remove(*range)
                };
                if changed {
                    touched.ranges.push(*range);
                }
            }
        }
    }

    /// The entries of the edges `touched` can alter, recomputed; `touched` is emptied.
    pub(crate) fn entries(&mut self, touched: &mut Touched) -> Vec<Entry> {
        let Touched {
            mut nodes,
            mut addresses,
            ranges,
            all,
        } = std::mem::take(touched);
        if all {
            nodes.extend(self.claims.keys().cloned());
        }
        if !ranges.is_empty() {
            // Seldom: a node that is no edge came, went or changed its pod CIDRs.
            addresses.extend(
                self.claimants
                    .keys()
                    .filter(|ip| ranges.iter().any(|r| r.contains(**ip))),
            );
        }
        for address in &addresses {
            if let Some(names) = self.claimants.get(address) {
                nodes.extend(names.iter().cloned());
            }
        }
        nodes
            .into_iter()
            .map(|name| {
                let kept = self.entry(&name);
                Entry { name, kept }
            })
            .collect()
    }

    /// The entry of the edge `name` (`None` if there is none), with what it drops noted.
    fn entry(&mut self, name: &str) -> Option<(NodeName, Vec<IpAddr>)> {
        self.dropped.remove(name);
        let claim = self.claims.get(name).filter(|c| c.edge)?;
        let node = NodeName::new(name.to_string()).ok()?;
        let mut dropped = BTreeSet::new();
        if claim.over_cap {
            dropped.insert(Dropped::TooMany {
                node: name.to_string(),
            });
        }
        let mut kept: Vec<IpAddr> = Vec::new();
        for ip in &claim.addresses {
            let address = ip.to_canonical();
            let others = self.claimants.get(&address).map_or(&[][..], Vec::as_slice);
            if let Some(why) = self.barred(address) {
                dropped.insert(Dropped::Reserved {
                    address,
                    node: name.to_string(),
                    why,
                });
            } else if others.len() > 1 {
                let mut nodes = others.to_vec();
                nodes.sort();
                dropped.insert(Dropped::Conflict { address, nodes });
            } else if !kept.contains(ip) {
                kept.push(*ip);
            }
        }
        if !dropped.is_empty() {
            self.dropped.insert(name.to_string(), dropped);
        }
        Some((node, kept))
    }

    /// Why `address` is no edge's, if it is not.
    fn barred(&self, address: IpAddr) -> Option<&'static str> {
        if let Some(why) = reserved_address(address) {
            Some(why)
        } else if self.services.contains(address) {
            Some("Service ClusterIP (in the Service CIDR)")
        } else if self.pods.contains(address) {
            Some("pod (in the pod CIDR of a node that is no edge)")
        } else {
            None
        }
    }

    /// The watched nodes (not the config's, all edges, which the watch cannot change)
    /// that are edges, and all of them.
    pub(crate) fn watched(&self) -> (usize, usize) {
        let configured = self.configured.len();
        (self.edges - configured, self.claims.len() - configured)
    }

    /// What the edges claimed and did not get, sorted.
    pub(crate) fn dropped(&self) -> Vec<Dropped> {
        let all: BTreeSet<&Dropped> = self.dropped.values().flatten().collect();
        all.into_iter().cloned().collect()
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

/// The addresses (canonical) an [`NodeTable::apply`] took out of the table and put in.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct AddressChange {
    pub(crate) gone: Vec<IpAddr>,
    pub(crate) came: Vec<IpAddr>,
}

impl NodeTable {
    /// The table of the edges among `claims`: each edge gets the addresses it lists
    /// that no other claim lists (an address two nodes list, or a non-edge node and an
    /// edge, is dropped for both) and that are not [`reserved_address`], in one of
    /// `services` (the cluster's Service CIDRs) or in a non-edge node's pod CIDR. An edge
    /// whose name is no valid node name is left out: no edge can register by it (the
    /// config and Kubernetes both check names first, so none comes in practice).
    pub fn new<'a>(claims: impl IntoIterator<Item = Claim<'a>>, services: &[Cidr]) -> Self {
        let mut touched = Touched::default();
        let mut book = Book::default();
        book.set_services(services, &mut touched);
        for claim in claims {
            book.set(claim.name, Some(claim.into()), &mut touched);
        }
        let mut table = Self::default();
        table.apply(book.entries(&mut touched), book.dropped());
        table
    }

    /// Puts the recomputed `entries` in, with `dropped` (the [`Book`]'s); says which
    /// addresses left the table and which came in.
    pub(crate) fn apply(&mut self, entries: Vec<Entry>, dropped: Vec<Dropped>) -> AddressChange {
        let mut gone = HashSet::new();
        // Every old entry out first: an address may pass from one entry to another.
        for entry in &entries {
            for ip in self.by_name.remove(entry.name.as_str()).unwrap_or_default() {
                let ip = ip.to_canonical();
                self.by_ip.remove(&ip);
                gone.insert(ip);
            }
        }
        let mut came = HashSet::new();
        for (name, kept) in entries.into_iter().filter_map(|e| e.kept) {
            for ip in &kept {
                let ip = ip.to_canonical();
                // Listed twice (as IPv4 and IPv4-mapped IPv6): one address.
                if self.by_ip.insert(ip, name.clone()).is_none() && !gone.remove(&ip) {
                    came.insert(ip);
                }
            }
            self.by_name.insert(name, kept);
        }
        self.dropped = dropped;
        AddressChange {
            gone: gone.into_iter().collect(),
            came: came.into_iter().collect(),
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// The table as the whole-table rebuild made it before changes were applied as
    /// differences (its rules exactly): the oracle the differences are checked against.
    fn rebuilt(
        claims: &[(String, Claimed)],
        services: &[Cidr],
    ) -> (BTreeMap<String, Vec<IpAddr>>, Vec<Dropped>) {
        let in_any = |ranges: &[Cidr], ip: IpAddr| ranges.iter().any(|r| r.contains(ip));
        let pods: Vec<Cidr> = claims
            .iter()
            .filter(|(_, c)| !c.edge)
            .flat_map(|(_, c)| c.pod_cidrs.iter().copied())
            .collect();
        let barred = |address: IpAddr| {
            if let Some(why) = reserved_address(address) {
                Some(why)
            } else if in_any(services, address) {
                Some("Service ClusterIP (in the Service CIDR)")
            } else if in_any(&pods, address) {
                Some("pod (in the pod CIDR of a node that is no edge)")
            } else {
                None
            }
        };
        let mut claimants: BTreeMap<IpAddr, BTreeSet<&str>> = BTreeMap::new();
        for (name, claim) in claims {
            for ip in &claim.addresses {
                claimants.entry(ip.to_canonical()).or_default().insert(name);
            }
        }
        let mut by_name = BTreeMap::new();
        let mut dropped = BTreeSet::new();
        for (name, claim) in claims.iter().filter(|(_, c)| c.edge) {
            if NodeName::new(name.clone()).is_err() {
                continue;
            }
            if claim.over_cap {
                dropped.insert(Dropped::TooMany { node: name.clone() });
            }
            let mut kept: Vec<IpAddr> = Vec::new();
            for ip in &claim.addresses {
                let address = ip.to_canonical();
                let others = &claimants[&address];
                if let Some(why) = barred(address) {
                    dropped.insert(Dropped::Reserved {
                        address,
                        node: name.clone(),
                        why,
                    });
                } else if others.len() > 1 {
                    dropped.insert(Dropped::Conflict {
                        address,
                        nodes: others.iter().map(|n| n.to_string()).collect(),
                    });
                } else if !kept.contains(ip) {
                    kept.push(*ip);
                }
            }
            by_name.insert(name.clone(), kept);
        }
        (by_name, dropped.into_iter().collect())
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().expect("ip")
    }

    /// Addresses that collide: the same address twice (also as IPv4-mapped IPv6), in a
    /// pod CIDR, a Service CIDR, the master's loopback.
    const ADDRESSES: [&str; 12] = [
        "10.0.0.1",
        "10.0.0.2",
        "::ffff:10.0.0.2",
        "10.0.0.5",
        "10.0.0.6",
        "10.244.0.7",
        "10.96.0.10",
        "192.0.2.1",
        "192.0.2.2",
        "fd00::1",
        "fd00::2",
        "127.0.0.1",
    ];
    const POD_CIDRS: [&str; 3] = ["10.0.0.4/30", "10.244.0.0/24", "fd00::/126"];
    /// `conf` is the config's (a watched Node of that name is left out); the last is no
    /// valid node name.
    const NAMES: [&str; 8] = ["a", "b", "c", "d", "e", "f", "conf", "Not_A_Node"];

    fn random_claim(rng: &mut StdRng) -> Claimed {
        let mut addresses = Vec::new();
        for _ in 0..rng.random_range(0..4) {
            addresses.push(ip(ADDRESSES[rng.random_range(0..ADDRESSES.len())]));
        }
        let mut pod_cidrs = Vec::new();
        if rng.random_bool(0.3) {
            pod_cidrs.push(
                POD_CIDRS[rng.random_range(0..POD_CIDRS.len())]
                    .parse()
                    .expect("cidr"),
            );
        }
        Claimed {
            edge: rng.random_bool(0.7),
            addresses,
            over_cap: rng.random_bool(0.1),
            pod_cidrs,
        }
    }

    /// Random sequences of batches of added, changed and removed nodes, relists and a
    /// change of the Service CIDRs, applied as differences: after each batch the table
    /// is the one a rebuild from every claim makes, and the addresses the differences
    /// took out and put in, applied to a set (as to the edge map), are the table's.
    #[test]
    fn differences_applied_make_the_table_a_rebuild_makes() {
        let configured = [NodeConfig {
            name: "conf".into(),
            addresses: vec![ip("10.0.0.1"), ip("192.0.2.9")],
        }];
        for seed in 0..200u64 {
            let mut rng = StdRng::seed_from_u64(seed);
            let mut touched = Touched::default();
            let mut book = Book::new(&configured, &mut touched);
            let mut services: Vec<Cidr> = Vec::new();
            book.set_services(&services, &mut touched);
            let mut table = NodeTable::default();
            let mut map: HashSet<IpAddr> = HashSet::new();
            let mut watched: BTreeMap<String, Claimed> = BTreeMap::new();
            for step in 0..40 {
                for _ in 0..rng.random_range(1..5) {
                    let name = NAMES[rng.random_range(0..NAMES.len())].to_string();
                    match rng.random_range(0..20) {
                        0 => {
                            let mut listed: HashMap<String, Claimed> = HashMap::new();
                            for n in NAMES {
                                if rng.random_bool(0.5) {
                                    listed.insert(n.to_string(), random_claim(&mut rng));
                                }
                            }
                            watched = listed.clone().into_iter().collect();
                            book.replace(listed, &mut touched);
                        }
                        1 => {
                            services = if services.is_empty() {
                                vec!["10.96.0.0/12".parse().expect("cidr")]
                            } else {
                                Vec::new()
                            };
                            book.set_services(&services, &mut touched);
                        }
                        2..=6 => {
                            watched.remove(&name);
                            book.set(&name, None, &mut touched);
                        }
                        _ => {
                            let claim = random_claim(&mut rng);
                            watched.insert(name.clone(), claim.clone());
                            book.set(&name, Some(claim), &mut touched);
                        }
                    }
                }
                let change = table.apply(book.entries(&mut touched), book.dropped());
                for gone in &change.gone {
                    assert!(
                        map.remove(gone),
                        "seed {seed} step {step}: {gone} was not in"
                    );
                }
                for came in &change.came {
                    assert!(map.insert(*came), "seed {seed} step {step}: {came} was in");
                }

                let mut all: Vec<(String, Claimed)> = configured
                    .iter()
                    .map(|n| {
                        let claim = Claimed {
                            edge: true,
                            addresses: n.addresses.clone(),
                            ..Claimed::default()
                        };
                        (n.name.clone(), claim)
                    })
                    .collect();
                all.extend(
                    watched
                        .iter()
                        .filter(|(n, _)| n.as_str() != "conf")
                        .map(|(n, c)| (n.clone(), c.clone())),
                );
                let (by_name, dropped) = rebuilt(&all, &services);
                let held: BTreeMap<String, Vec<IpAddr>> = table
                    .nodes()
                    .map(|(n, ips)| (n.to_string(), ips.to_vec()))
                    .collect();
                assert_eq!(held, by_name, "seed {seed} step {step}");
                assert_eq!(table.dropped(), dropped, "seed {seed} step {step}");
                let addresses: HashSet<IpAddr> = table.all_addresses().into_iter().collect();
                assert_eq!(map, addresses, "seed {seed} step {step}");
                for (name, ips) in &by_name {
                    for ip in ips {
                        assert_eq!(
                            table.node_for_ip(*ip).map(|n| n.as_str()),
                            Some(name.as_str()),
                            "seed {seed} step {step}"
                        );
                    }
                }
                assert_eq!(table.by_ip.len(), map.len(), "seed {seed} step {step}");
                let outside: Vec<&Claimed> = watched
                    .iter()
                    .filter(|(n, _)| n.as_str() != "conf")
                    .map(|(_, c)| c)
                    .collect();
                let edges = outside.iter().filter(|c| c.edge).count();
                assert_eq!(
                    book.watched(),
                    (edges, outside.len()),
                    "seed {seed} step {step}"
                );
            }
        }
    }
}
