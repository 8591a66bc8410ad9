//! The node table in force (replaced when the Kubernetes watch sees the edge Nodes
//! change), which every routed connection reads, and the eBPF edge map kept in line
//! with it.

use std::sync::{Arc, RwLock};

use super::route::NodeTable;
use crate::intercept::Programs;

/// The node table in force; replacing it brings the eBPF edge map in line.
pub struct Nodes {
    table: RwLock<Arc<NodeTable>>,
    programs: Arc<Programs>,
}

impl Nodes {
    /// `table` in force, and the eBPF edge map with it, unless `listing_to_come`: the Node
    /// watcher's first listing completes the table, and until it sets both the edge map
    /// keeps what a predecessor left pinned. Clearing it here would send connects to the
    /// edges' own addresses, past the tunnel, for the moment a restart or an update takes.
    pub fn new(table: NodeTable, programs: Arc<Programs>, listing_to_come: bool) -> Self {
        let nodes = Self {
            table: RwLock::default(),
            programs,
        };
        if listing_to_come {
            *nodes.table.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(table);
        } else {
            nodes.set(table);
        }
        nodes
    }

    pub fn get(&self) -> Arc<NodeTable> {
        self.table.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Replaces the node table and the eBPF edge map with it.
    pub fn set(&self, table: NodeTable) {
        let table = Arc::new(table);
        *self.table.write().unwrap_or_else(|e| e.into_inner()) = table.clone();
        self.programs.set_edges(&edge_ips(&table));
    }
}

/// The addresses of the node table (both families), for the eBPF edge maps.
pub fn edge_ips(nodes: &NodeTable) -> Vec<std::net::IpAddr> {
    let mut ips: Vec<_> = nodes.all_addresses().collect();
    ips.sort();
    ips
}
