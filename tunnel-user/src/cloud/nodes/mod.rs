//! The node table in force (replaced when the Kubernetes watch sees the Nodes change),
//! which every routed connection reads, and the eBPF edge map kept in line with it.
//! A ground floor of the cloud: the Node watch sets it, the router and the authenticator
//! read it.

pub mod table;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, RwLock};

use tokio::sync::watch;

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use tracing::{info, warn};

use crate::intercept::Programs;
use crate::ops::metrics::ReasonLabel;
use table::{Dropped, NodeTable};

/// The node table in force; replacing it brings the eBPF edge map in line.
pub(crate) struct Nodes {
    table: RwLock<Arc<NodeTable>>,
    programs: Arc<Programs>,
    /// What the last `set` left out, so that a conflict that lasts is said once, not on
    /// every watch event.
    left_out: Mutex<LeftOut>,
    /// `tunnel_node_addresses_dropped{reason}`.
    dropped_gauge: Family<ReasonLabel, Gauge>,
    /// Bumped whenever a table is put in force.
    version: watch::Sender<u64>,
}

#[derive(Default)]
struct LeftOut {
    dropped: BTreeSet<Dropped>,
    /// Addresses the full eBPF edge map could not take.
    map_full: usize,
}

impl Nodes {
    /// `table` in force, and the eBPF edge map with it, unless `listing_to_come`: the Node
    /// watcher's first listing completes the table, and until it sets both the edge map
    /// keeps what a predecessor left pinned. Clearing it here would send connects to the
    /// edges' own addresses, past the tunnel, for the moment a restart or an update takes.
    pub(crate) fn new(
        table: NodeTable,
        programs: Arc<Programs>,
        dropped_gauge: Family<ReasonLabel, Gauge>,
        listing_to_come: bool,
    ) -> Self {
        let nodes = Self {
            table: RwLock::default(),
            programs,
            left_out: Mutex::default(),
            dropped_gauge,
            version: watch::Sender::new(0),
        };
        if listing_to_come {
            *nodes.table.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(table);
        } else {
            nodes.set(table);
        }
        nodes
    }

    /// Wakes whenever a new table is in force.
    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.version.subscribe()
    }

    pub(crate) fn get(&self) -> Arc<NodeTable> {
        self.table.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Replaces the node table and the eBPF edge map with it, and says what either left
    /// out that the previous one did not.
    pub(crate) fn set(&self, table: NodeTable) {
        let table = Arc::new(table);
        *self.table.write().unwrap_or_else(|e| e.into_inner()) = table.clone();
        let map_full = self.programs.set_edges(&table.all_addresses());
        let mut last = self.left_out.lock().unwrap_or_else(|e| e.into_inner());
        let dropped: BTreeSet<Dropped> = table.dropped().iter().cloned().collect();
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
        drop(last);
        self.version.send_modify(|v| *v = v.wrapping_add(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::IpAddr;
    use table::Claim;

    fn gauge(family: &Family<ReasonLabel, Gauge>, reason: &'static str) -> i64 {
        family.get_or_create(&ReasonLabel { reason }).get()
    }

    fn ips(list: &[&str]) -> Vec<IpAddr> {
        list.iter().map(|ip| ip.parse().expect("ip")).collect()
    }

    /// `edge-evil` listing `evil`, beside `master-1` (no edge) listing `master`.
    fn table(evil: &[IpAddr], master: &[IpAddr]) -> NodeTable {
        let claims = [
            Claim {
                name: "edge-evil",
                addresses: evil,
                edge: true,
                pod_cidrs: &[],
                over_cap: false,
            },
            Claim {
                name: "master-1",
                addresses: master,
                edge: false,
                pod_cidrs: &[],
                over_cap: false,
            },
        ];
        NodeTable::new(claims, &[])
    }

    #[test]
    fn the_gauge_counts_what_the_table_in_force_leaves_out() {
        let family = Family::<ReasonLabel, Gauge>::default();
        let nodes = Nodes::new(
            NodeTable::default(),
            Arc::new(Programs::new(None)),
            family.clone(),
            false,
        );
        let (claims, master) = (ips(&["192.0.2.1", "127.0.0.1", "::1"]), ips(&["192.0.2.1"]));
        nodes.set(table(&claims, &master));
        assert_eq!(gauge(&family, "conflict"), 1);
        assert_eq!(gauge(&family, "reserved"), 2);
        assert_eq!(gauge(&family, "edge_map_full"), 0, "no redirect, no map");
        // The same again (another watch event): the same counts, not twice them.
        nodes.set(table(&claims, &master));
        assert_eq!(gauge(&family, "conflict"), 1);
        // The edge drops its claims.
        nodes.set(table(&ips(&["192.0.2.20"]), &master));
        assert_eq!(gauge(&family, "conflict"), 0);
        assert_eq!(gauge(&family, "reserved"), 0);
        assert!(
            nodes
                .get()
                .node_for_ip("192.0.2.20".parse().expect("ip"))
                .is_some()
        );
    }
}
