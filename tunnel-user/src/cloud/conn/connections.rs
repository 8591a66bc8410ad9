//! The proxied connections open right now, for the debug listing and the drain, and
//! their ids (one sequence for both directions).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use crate::addr::Target;
use crate::call::copy::Meter;
use crate::call::count::{OpenCount, OpenGuard};

/// One proxied connection while it is open.
#[derive(Debug)]
pub(crate) struct Connection {
    pub(crate) id: u64,
    pub(crate) entry: &'static str,
    pub(crate) client: String,
    /// What the edge dialled: the original destination for redirected connections.
    pub(crate) target: Target,
    pub(crate) node: String,
    pub(crate) started: SystemTime,
    pub(crate) meter: Arc<Meter>,
}

pub(crate) struct Connections {
    open: Mutex<HashMap<u64, Arc<Connection>>>,
    /// How many are in `open`, for the drain to wait on.
    count: Arc<OpenCount>,
    next_id: AtomicU64,
}

impl Default for Connections {
    fn default() -> Self {
        Self {
            open: Mutex::default(),
            count: Arc::default(),
            next_id: AtomicU64::new(1),
        }
    }
}

/// Removes its connection from the listing when dropped.
pub(crate) struct Tracked<'a> {
    connections: &'a Connections,
    pub(crate) conn: Arc<Connection>,
    /// Dropped after the listing's entry is removed (`drop` runs before the fields').
    _counted: OpenGuard,
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
    pub(crate) fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn track(&self, conn: Connection) -> Tracked<'_> {
        let conn = Arc::new(conn);
        self.lock().insert(conn.id, conn.clone());
        Tracked {
            connections: self,
            conn,
            _counted: OpenGuard::count(&self.count),
        }
    }

    /// Returns once no connection is open.
    pub(crate) async fn idle(&self) {
        self.count.idle().await
    }

    pub(crate) fn snapshot(&self) -> Vec<Arc<Connection>> {
        let mut all: Vec<_> = self.lock().values().cloned().collect();
        all.sort_by_key(|c| c.id);
        all
    }
}
