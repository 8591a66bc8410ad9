//! The node table in force (changed as the Kubernetes watch sees the Nodes change),
//! which every routed connection reads, and the eBPF edge map kept in line with it.
//! A ground floor of the cloud: the Node watch changes it, the router and the
//! authenticator read it.

pub(crate) mod journal;
pub mod table;

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard, TryLockError};
use std::time::Duration;

use tokio::sync::watch;

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use tracing::{info, warn};

use crate::addr::{Cidr, NodeName};
use crate::config::NodeConfig;
use crate::intercept::Programs;
use crate::ops::metrics::ReasonLabel;
use journal::Journal;
use table::{Book, Claimed, Dropped, NodeTable, Touched};

/// How long a change waits before it tries the table's lock again.
const WRITE_RETRY: Duration = Duration::from_micros(200);

/// The node table in force; changing it brings the eBPF edge map in line.
pub(crate) struct Nodes {
    /// Changed in place, by the entries a change recomputes: a write holds it for as
    /// long as those take, never for a rebuild of the whole table.
    table: RwLock<NodeTable>,
    /// The claims the table is made from, and whether the edge map follows it yet.
    book: Mutex<Kept>,
    programs: Arc<Programs>,
    /// What the last change left out, so that a conflict that lasts is said once, not on
    /// every watch event.
    left_out: Mutex<LeftOut>,
    /// `tunnel_node_addresses_dropped{reason}`.
    dropped_gauge: Family<ReasonLabel, Gauge>,
    /// The edges whose entries changed.
    journal: Journal,
}

struct Kept {
    book: Book,
    /// The edge map holds the table (set whole once): until then it keeps what a
    /// predecessor left pinned.
    map_follows: bool,
}

/// A change the Node watch saw.
#[derive(Debug)]
pub(crate) enum NodeChange {
    /// The cluster's Service CIDRs, whose addresses are no edge's.
    Services(Vec<Cidr>),
    /// A Node added or changed.
    Set(String, Claimed),
    /// A Node deleted.
    Gone(String),
    /// A (re)list: every Node there is.
    Listed(HashMap<String, Claimed>),
}

#[derive(Default)]
struct LeftOut {
    dropped: BTreeSet<Dropped>,
    /// Addresses the full eBPF edge map could not take.
    map_full: usize,
}

impl Nodes {
    /// The table of the `configured` nodes (`[[node]]`), with the eBPF edge map in line
    /// unless `listing_to_come`: the Node watcher's first listing completes the table,
    /// and until it does the edge map keeps what a predecessor left pinned. Clearing it
    /// here would send connects to the edges' own addresses, past the tunnel, for the
    /// moment a restart or an update takes.
    pub(crate) fn new(
        configured: &[NodeConfig],
        services: &[Cidr],
        programs: Arc<Programs>,
        dropped_gauge: Family<ReasonLabel, Gauge>,
        listing_to_come: bool,
    ) -> Self {
        let mut touched = Touched::default();
        let mut book = Book::new(configured, &mut touched);
        book.set_services(services, &mut touched);
        let nodes = Self {
            table: RwLock::default(),
            book: Mutex::new(Kept {
                book,
                map_follows: false,
            }),
            programs,
            left_out: Mutex::default(),
            dropped_gauge,
            journal: Journal::default(),
        };
        let mut kept = nodes.book.lock().unwrap_or_else(|e| e.into_inner());
        nodes.apply(&mut kept, touched, !listing_to_come);
        drop(kept);
        nodes
    }

    /// Wakes whenever the table changes.
    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.journal.subscribe()
    }

    /// The edges whose entries changed.
    pub(crate) fn journal(&self) -> &Journal {
        &self.journal
    }

    /// The table, read-locked: hold it no longer than a lookup (a change waits for it).
    pub(crate) fn get(&self) -> RwLockReadGuard<'_, NodeTable> {
        self.table.read().unwrap_or_else(|e| e.into_inner())
    }

    /// The watched nodes that are edges, and all the watched nodes.
    pub(crate) fn watched(&self) -> (usize, usize) {
        let kept = self.book.lock().unwrap_or_else(|e| e.into_inner());
        kept.book.watched()
    }

    /// Applies the watch's `changes` as one: the edges they can touch are recomputed,
    /// their entries and their edge map entries replaced, nothing else. A (re)list sets
    /// the edge map whole, so it holds exactly the table, whatever it held. Costs about
    /// as much as the changes are many: call it off the thread that serves edges. Says
    /// whether anything changed (a Node's update that changes nothing kept is nothing).
    pub(crate) fn change(&self, changes: Vec<NodeChange>) -> bool {
        let mut kept = self.book.lock().unwrap_or_else(|e| e.into_inner());
        let mut touched = Touched::default();
        let mut listed = false;
        for change in changes {
            match change {
                NodeChange::Services(services) => kept.book.set_services(&services, &mut touched),
                NodeChange::Set(name, claim) => kept.book.set(&name, Some(claim), &mut touched),
                NodeChange::Gone(name) => kept.book.set(&name, None, &mut touched),
                NodeChange::Listed(all) => {
                    kept.book.replace(all, &mut touched);
                    listed = true;
                }
            }
        }
        if touched.is_empty() && !listed {
            return false;
        }
        self.apply(&mut kept, touched, listed);
        true
    }

    /// The table, write-locked without queuing for it: a writer waiting on the lock holds
    /// back every reader that comes after (std's lock prefers writers), and a pass over
    /// the whole table (the outage marks, `Router::without_tunnel`) may hold it for a
    /// while; the readers that route connections must not wait for that pass.
    fn write(&self) -> RwLockWriteGuard<'_, NodeTable> {
        loop {
            match self.table.try_write() {
                Ok(table) => return table,
                Err(TryLockError::Poisoned(e)) => return e.into_inner(),
                Err(TryLockError::WouldBlock) => std::thread::sleep(WRITE_RETRY),
            }
        }
    }

    /// Puts what `touched` alters in force; `whole`: sets the edge map whole.
    fn apply(&self, kept: &mut Kept, mut touched: Touched, whole: bool) {
        let entries = kept.book.entries(&mut touched);
        let names: Vec<NodeName> = entries
            .iter()
            .filter_map(|e| NodeName::new(e.name().to_string()).ok())
            .collect();
        let dropped = kept.book.dropped();
        let change = self.write().apply(entries, dropped);
        let map_full = if whole || kept.map_follows {
            let by_difference = !whole && self.programs.change_edges(&change.gone, &change.came);
            kept.map_follows = true;
            if by_difference {
                0
            } else {
                // A full map takes the table's order (each node's first address before
                // any node's second), which only the whole table gives.
                let all = self.get().all_addresses();
                self.programs.set_edges(&all)
            }
        } else {
            0
        };
        let dropped = self.get().dropped().iter().cloned().collect();
        self.report(dropped, map_full);
        self.journal.note(names);
    }

    /// Says what the table or the edge map leaves out that they did not before, and
    /// sets the gauges.
    fn report(&self, dropped: BTreeSet<Dropped>, map_full: usize) {
        let mut last = self.left_out.lock().unwrap_or_else(|e| e.into_inner());
        for d in dropped.difference(&last.dropped) {
            match d {
                Dropped::Conflict { address, nodes } => warn!(
                    %address,
                    nodes = %nodes.join(", "),
                    "more than one node lists this address: it is routed to none of them"
                ),
                Dropped::Reserved { address, node, why } => warn!(
                    %address,
                    %node,
                    why,
                    "an edge node lists an address that is never an edge's: not routed"
                ),
                Dropped::TooMany { node } => warn!(
                    %node,
                    per_family = table::ADDRESSES_PER_FAMILY,
                    "an edge node lists more addresses than a node has: only the first of each family are routed"
                ),
            }
        }
        for d in last.dropped.difference(&dropped) {
            match d {
                Dropped::Conflict { address, .. } | Dropped::Reserved { address, .. } => {
                    info!(%address, "a node address dropped before is no longer claimed that way")
                }
                Dropped::TooMany { node } => {
                    info!(%node, "an edge node lists no more addresses than a node has again")
                }
            }
        }
        if map_full != last.map_full {
            if map_full > 0 {
                warn!(
                    left_out = map_full,
                    entries = self.programs.edge_map_capacity().unwrap_or_default(),
                    "the eBPF edge map is full: connections to the addresses left out (nodes without a tunnel first, then each node's last listed) are not redirected (CONNECT still routes them); raise redirect.edge_map_entries"
                );
            } else {
                info!("the eBPF edge map holds every node address again");
            }
        }
        for reason in ["conflict", "reserved", "too_many"] {
            let count = dropped.iter().filter(|d| d.reason() == reason).count();
            self.dropped_gauge
                .get_or_create(&ReasonLabel { reason })
                .set(i64::try_from(count).unwrap_or(i64::MAX));
        }
        self.dropped_gauge
            .get_or_create(&ReasonLabel {
                reason: "edge_map_full",
            })
            .set(i64::try_from(map_full).unwrap_or(i64::MAX));
        *last = LeftOut { dropped, map_full };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::IpAddr;

    fn gauge(family: &Family<ReasonLabel, Gauge>, reason: &'static str) -> i64 {
        family.get_or_create(&ReasonLabel { reason }).get()
    }

    fn ips(list: &[&str]) -> Vec<IpAddr> {
        list.iter().map(|ip| ip.parse().expect("ip")).collect()
    }

    fn claim(edge: bool, addresses: &[&str]) -> Claimed {
        Claimed {
            edge,
            addresses: ips(addresses),
            ..Claimed::default()
        }
    }

    fn set(name: &str, edge: bool, addresses: &[&str]) -> NodeChange {
        NodeChange::Set(name.to_string(), claim(edge, addresses))
    }

    fn nodes(family: &Family<ReasonLabel, Gauge>) -> Nodes {
        let programs = Arc::new(Programs::new(None));
        Nodes::new(&[], &[], programs, family.clone(), true)
    }

    /// The edges in the table, with their addresses.
    fn held(nodes: &Nodes) -> Vec<(String, Vec<IpAddr>)> {
        let mut held: Vec<(String, Vec<IpAddr>)> = nodes
            .get()
            .nodes()
            .map(|(n, ips)| (n.to_string(), ips.to_vec()))
            .collect();
        held.sort();
        held
    }

    #[test]
    fn the_gauge_counts_what_the_table_in_force_leaves_out() {
        let family = Family::<ReasonLabel, Gauge>::default();
        let nodes = nodes(&family);
        let evil = ["192.0.2.1", "127.0.0.1", "::1"];
        nodes.change(vec![
            set("edge-evil", true, &evil),
            set("master-1", false, &["192.0.2.1"]),
        ]);
        assert_eq!(gauge(&family, "conflict"), 1);
        assert_eq!(gauge(&family, "reserved"), 2);
        assert_eq!(gauge(&family, "edge_map_full"), 0, "no redirect, no map");
        // The same again (another watch event): the same counts, not twice them.
        nodes.change(vec![set("edge-evil", true, &evil)]);
        assert_eq!(gauge(&family, "conflict"), 1);
        // The edge drops its claims.
        nodes.change(vec![set("edge-evil", true, &["192.0.2.20"])]);
        assert_eq!(gauge(&family, "conflict"), 0);
        assert_eq!(gauge(&family, "reserved"), 0);
        assert!(
            nodes
                .get()
                .node_for_ip("192.0.2.20".parse().expect("ip"))
                .is_some()
        );
    }

    /// A relist is every Node there is: those it does not name go, those that changed
    /// while the watch was away change, and a master's address it lists bars an edge.
    #[test]
    fn a_relist_that_drops_nodes_removes_them() {
        let family = Family::<ReasonLabel, Gauge>::default();
        let nodes = nodes(&family);
        let listed = |entries: &[(&str, bool, &[&str])]| {
            let all = entries
                .iter()
                .map(|(name, edge, ips)| (name.to_string(), claim(*edge, ips)))
                .collect();
            NodeChange::Listed(all)
        };
        nodes.change(vec![listed(&[
            ("edge-1", true, &["192.0.2.1"]),
            ("edge-2", true, &["192.0.2.2"]),
            ("edge-3", true, &["192.0.2.3"]),
        ])]);
        assert_eq!(nodes.watched(), (3, 3));
        nodes.change(vec![
            set("edge-4", true, &["192.0.2.4"]),
            listed(&[
                ("edge-1", true, &["192.0.2.11"]),
                ("master-1", false, &["192.0.2.3"]),
                ("edge-3", true, &["192.0.2.3", "192.0.2.33"]),
            ]),
        ]);
        assert_eq!(
            held(&nodes),
            [
                ("edge-1".to_string(), ips(&["192.0.2.11"])),
                ("edge-3".to_string(), ips(&["192.0.2.33"])),
            ],
            "edge-2 and edge-4 are gone, 192.0.2.3 is the master's too"
        );
        assert_eq!(nodes.watched(), (2, 3));
        for gone in ["192.0.2.1", "192.0.2.2", "192.0.2.3", "192.0.2.4"] {
            let gone: IpAddr = gone.parse().expect("ip");
            assert!(nodes.get().node_for_ip(gone).is_none(), "{gone}");
        }
        assert_eq!(gauge(&family, "conflict"), 1);
    }
}
