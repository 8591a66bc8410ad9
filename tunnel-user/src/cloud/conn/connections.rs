//! The proxied connections open right now, for the debug listing and the drain, and
//! their ids (one sequence for both directions).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use crate::stream::copy::Meter;

/// One proxied connection while it is open.
#[derive(Debug)]
pub struct Connection {
    pub id: u64,
    pub entry: &'static str,
    pub client: String,
    /// What the edge dialled: the original destination for redirected connections.
    pub target: String,
    pub node: String,
    pub started: SystemTime,
    pub meter: Arc<Meter>,
}

pub struct Connections {
    open: Mutex<HashMap<u64, Arc<Connection>>>,
    next_id: AtomicU64,
}

impl Default for Connections {
    fn default() -> Self {
        Self {
            open: Mutex::default(),
            next_id: AtomicU64::new(1),
        }
    }
}

/// Removes its connection from the listing when dropped.
pub struct Tracked<'a> {
    connections: &'a Connections,
    pub conn: Arc<Connection>,
}

impl Drop for Tracked<'_> {
    fn drop(&mut self) {
        self.connections.lock().remove(&self.conn.id);
    }
}

impl Connections {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Connection>>> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The id of the next connection, cloud-to-edge or edge-to-cloud.
    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    pub fn track(&self, conn: Connection) -> Tracked<'_> {
        let conn = Arc::new(conn);
        self.lock().insert(conn.id, conn.clone());
        Tracked {
            connections: self,
            conn,
        }
    }

    pub fn snapshot(&self) -> Vec<Arc<Connection>> {
        let mut all: Vec<_> = self.lock().values().cloned().collect();
        all.sort_by_key(|c| c.id);
        all
    }
}
