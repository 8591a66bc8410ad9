//! The edge sessions this replica holds, by node name, and a signal when they change
//! (the other replicas learn it, `peer::announce`).
//!
//! A node has at most two sessions here: the live one, which takes its new connections,
//! and the one it replaced, draining, which keeps the connections already open on it
//! (a rolling update's old edge pod, until it exits). Whatever a client holding the
//! node's credential does, it cannot make the cloud keep more: a third registration
//! closes the draining session if no call is open on it, and is refused otherwise.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::session::{EdgeSession, Proof};
use crate::addr::NodeName;

pub(crate) struct Registry {
    sessions: RwLock<Sessions>,
    /// Bumped whenever a live session is added or removed.
    version: watch::Sender<u64>,
}

#[derive(Default)]
struct Sessions {
    live: HashMap<NodeName, Arc<EdgeSession>>,
    /// Sessions a newer one of their node replaced, until they close.
    draining: HashMap<NodeName, Arc<EdgeSession>>,
    /// When a refused registration of the node was last logged: once per
    /// `REFUSAL_LOG_INTERVAL`, however fast a client retries. Cleared with the node's
    /// draining session.
    refusal_logged: HashMap<NodeName, Instant>,
}

/// How often a node's refused registrations are logged (each is counted).
const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(60);

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

/// Why a registration may not take its node's session.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Refused {
    #[error(transparent)]
    Held(#[from] Held),
    /// The node has a live session and a draining one with calls still open on it.
    #[error(
        "the node already has two sessions here (live {live}, draining {draining} with {open} open connection(s)); retry once the draining one ends"
    )]
    TooManySessions {
        live: u64,
        draining: u64,
        open: usize,
        /// Whether this refusal is the one of its interval to log.
        log: bool,
    },
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

impl Sessions {
    /// Refuses a newcomer for `node` as `Registry::may_take` says; `Ok(Some(draining))`
    /// when it may come in once the node's idle draining session is closed.
    fn check(
        &mut self,
        node: &NodeName,
        newcomer: Proof,
    ) -> Result<Option<Arc<EdgeSession>>, Refused> {
        let live = self.live.get(node).filter(|s| !s.is_closed());
        Held::check(live, newcomer)?;
        let Some(live) = live else { return Ok(None) };
        let Some(draining) = self.draining.get(node).filter(|s| !s.is_closed()) else {
            return Ok(None);
        };
        let open = draining.open_streams();
        if open == 0 {
            return Ok(Some(draining.clone()));
        }
        let now = Instant::now();
        let log = match self.refusal_logged.get(node) {
            Some(at) => now.saturating_duration_since(*at) >= REFUSAL_LOG_INTERVAL,
            None => true,
        };
        let refused = Refused::TooManySessions {
            live: live.id,
            draining: draining.id,
            open,
            log,
        };
        if log {
            self.refusal_logged.insert(node.clone(), now);
        }
        Err(refused)
    }
}

impl Registry {
    /// Whether an edge that proved itself with `newcomer` may take `node`'s session: not
    /// over a stronger proof (`Held`), and not while the node has a live session and a
    /// draining one with calls open (`TooManySessions`).
    pub(crate) fn may_take(&self, node: &NodeName, newcomer: Proof) -> Result<(), Refused> {
        self.write().check(node, newcomer).map(drop)
    }

    /// Makes `session` the node's live session and returns the one it replaces, if
    /// any, which drains from then on (an idle session that drained before it is closed
    /// to make room); refuses as `may_take` does (checked again here: another
    /// registration of the node may have come in since).
    pub(crate) fn insert(
        &self,
        session: Arc<EdgeSession>,
    ) -> Result<Option<Arc<EdgeSession>>, Refused> {
        let mut sessions = self.write();
        if let Some(idle) = sessions.check(&session.node, session.proof)? {
            tracing::info!(node = %session.node, session = idle.id, "closing the node's idle draining session: a node keeps at most two");
            idle.close();
        }
        let node = session.node.clone();
        let old = sessions.live.insert(node.clone(), session);
        if let Some(old) = old.as_ref().filter(|s| !s.is_closed()) {
            sessions.draining.insert(node, old.clone());
        }
        drop(sessions);
        self.changed();
        Ok(old)
    }

    /// Removes `session`, the node's live or draining one (a replaced session that ends
    /// later must not remove its successor). True when it was the live one.
    pub(crate) fn remove(&self, session: &EdgeSession) -> bool {
        let mut sessions = self.write();
        let node = &session.node;
        if sessions
            .draining
            .get(node)
            .is_some_and(|s| s.id == session.id)
        {
            sessions.draining.remove(node);
            sessions.refusal_logged.remove(node);
        }
        if sessions.live.get(node).is_some_and(|s| s.id == session.id) {
            sessions.live.remove(node);
            drop(sessions);
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
        self.read()
            .live
            .get(node)
            .filter(|s| !s.is_closed())
            .cloned()
    }

    pub(crate) fn contains(&self, node: &str) -> bool {
        self.get(node).is_some()
    }

    /// The longest-connected live session (SuperEdge's "first edge" for its tcp module).
    pub(crate) fn first(&self) -> Option<Arc<EdgeSession>> {
        self.read()
            .live
            .values()
            .filter(|s| !s.is_closed())
            .min_by_key(|s| (s.connected_at, s.id))
            .cloned()
    }

    /// The live sessions.
    pub(crate) fn list(&self) -> Vec<Arc<EdgeSession>> {
        self.read().live.values().cloned().collect()
    }

    // A poisoned lock only means another thread panicked mid-insert; the maps
    // themselves are still consistent, so keep serving.
    fn read(&self) -> std::sync::RwLockReadGuard<'_, Sessions> {
        self.sessions.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Sessions> {
        self.sessions.write().unwrap_or_else(|e| e.into_inner())
    }
}
