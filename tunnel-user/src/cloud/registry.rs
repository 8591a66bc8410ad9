//! The edge sessions this replica holds, by node name.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use super::session::EdgeSession;
use crate::config::NodeName;

#[derive(Default)]
pub struct Registry {
    sessions: RwLock<HashMap<NodeName, Arc<EdgeSession>>>,
}

impl Registry {
    /// Makes `session` the node's session and returns the one it replaces, if any.
    pub fn insert(&self, session: Arc<EdgeSession>) -> Option<Arc<EdgeSession>> {
        self.write().insert(session.node.clone(), session)
    }

    /// Removes `session` if it is still the node's current one (a replaced session that
    /// ends later must not remove its successor).
    pub fn remove(&self, session: &EdgeSession) -> bool {
        let mut map = self.write();
        if map.get(&session.node).is_some_and(|s| s.id == session.id) {
            map.remove(&session.node);
            return true;
        }
        false
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
