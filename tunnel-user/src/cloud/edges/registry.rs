//! The edge sessions this replica holds, by node name, and a signal when they change
//! (the other replicas learn it, `peer::announce`).

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use tokio::sync::watch;

use super::session::EdgeSession;
use crate::addr::NodeName;

pub struct Registry {
    sessions: RwLock<HashMap<NodeName, Arc<EdgeSession>>>,
    /// Bumped whenever a session is added or removed.
    version: watch::Sender<u64>,
}

impl Default for Registry {
    fn default() -> Self {
        Self {
            sessions: RwLock::default(),
            version: watch::Sender::new(0),
        }
    }
}

impl Registry {
    /// Makes `session` the node's session and returns the one it replaces, if any.
    pub fn insert(&self, session: Arc<EdgeSession>) -> Option<Arc<EdgeSession>> {
        let old = self.write().insert(session.node.clone(), session);
        self.changed();
        old
    }

    /// Removes `session` if it is still the node's current one (a replaced session that
    /// ends later must not remove its successor).
    pub fn remove(&self, session: &EdgeSession) -> bool {
        let mut map = self.write();
        if map.get(&session.node).is_some_and(|s| s.id == session.id) {
            map.remove(&session.node);
            drop(map);
            self.changed();
            return true;
        }
        false
    }

    /// Wakes whenever the set of sessions changes.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.version.subscribe()
    }

    fn changed(&self) {
        self.version.send_modify(|v| *v = v.wrapping_add(1));
    }

    pub fn get(&self, node: &str) -> Option<Arc<EdgeSession>> {
        self.read().get(node).filter(|s| !s.is_closed()).cloned()
    }

    pub fn contains(&self, node: &str) -> bool {
        self.get(node).is_some()
    }

    /// The longest-connected live session (SuperEdge's "first edge" for its tcp module).
    pub fn first(&self) -> Option<Arc<EdgeSession>> {
        self.read()
            .values()
            .filter(|s| !s.is_closed())
            .min_by_key(|s| (s.connected_at, s.id))
            .cloned()
    }

    pub fn list(&self) -> Vec<Arc<EdgeSession>> {
        self.read().values().cloned().collect()
    }

    pub fn len(&self) -> usize {
        self.read().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    // A poisoned lock only means another thread panicked mid-insert; the map itself is
    // still consistent, so keep serving.
    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<NodeName, Arc<EdgeSession>>> {
        self.sessions.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<NodeName, Arc<EdgeSession>>> {
        self.sessions.write().unwrap_or_else(|e| e.into_inner())
    }
}
