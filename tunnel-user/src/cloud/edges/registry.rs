//! The edge sessions this replica holds, by node name, and a signal when they change
//! (the other replicas learn it, `peer::announce`).

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use tokio::sync::watch;

use super::session::{EdgeSession, Proof};
use crate::addr::NodeName;

pub(crate) struct Registry {
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

/// Why a registration may not take its node's session: a weaker credential never
/// replaces a stronger one, or whoever holds a shared token could take the node from
/// the edge that proved itself with a certificate.
#[derive(Debug, thiserror::Error)]
#[error(
    "the node is connected (session {session}) with {}; {} does not replace that session",
    .held.as_str(),
    .newcomer.as_str()
)]
pub(crate) struct Held {
    pub(crate) session: u64,
    pub(crate) held: Proof,
    pub(crate) newcomer: Proof,
}

impl Held {
    /// Refuses `newcomer` when `live`, the node's session, stands on a stronger proof.
    fn check(live: Option<&Arc<EdgeSession>>, newcomer: Proof) -> Result<(), Held> {
        match live {
            Some(live) if !live.is_closed() && live.proof.bound() && !newcomer.bound() => {
                Err(Held {
                    session: live.id,
                    held: live.proof,
                    newcomer,
                })
            }
            _ => Ok(()),
        }
    }
}

impl Registry {
    /// Whether an edge that proved itself with `newcomer` may take `node`'s session.
    pub(crate) fn may_take(&self, node: &str, newcomer: Proof) -> Result<(), Held> {
        Held::check(self.read().get(node), newcomer)
    }

    /// Makes `session` the node's session and returns the one it replaces, if any;
    /// refuses as `may_take` does (checked again here: another registration of the node
    /// may have come in since).
    pub(crate) fn insert(
        &self,
        session: Arc<EdgeSession>,
    ) -> Result<Option<Arc<EdgeSession>>, Held> {
        let mut map = self.write();
        Held::check(map.get(&session.node), session.proof)?;
        let old = map.insert(session.node.clone(), session);
        drop(map);
        self.changed();
        Ok(old)
    }

    /// Removes `session` if it is still the node's current one (a replaced session that
    /// ends later must not remove its successor).
    pub(crate) fn remove(&self, session: &EdgeSession) -> bool {
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
    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.version.subscribe()
    }

    fn changed(&self) {
        self.version.send_modify(|v| *v = v.wrapping_add(1));
    }

    pub(crate) fn get(&self, node: &str) -> Option<Arc<EdgeSession>> {
        self.read().get(node).filter(|s| !s.is_closed()).cloned()
    }

    pub(crate) fn contains(&self, node: &str) -> bool {
        self.get(node).is_some()
    }

    /// The longest-connected live session (SuperEdge's "first edge" for its tcp module).
    pub(crate) fn first(&self) -> Option<Arc<EdgeSession>> {
        self.read()
            .values()
            .filter(|s| !s.is_closed())
            .min_by_key(|s| (s.connected_at, s.id))
            .cloned()
    }

    pub(crate) fn list(&self) -> Vec<Arc<EdgeSession>> {
        self.read().values().cloned().collect()
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
