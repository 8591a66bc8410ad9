//! The edge sessions this replica holds, by node name, and a signal when they change
//! (the other replicas learn it, `peer::announce`).
//!
//! A node has at most two sessions here: the live one, which takes its new connections,
//! and the one it replaced, draining, which keeps the connections already open on it
//! (a rolling update's old edge pod, until it exits). Whatever a client holding the
//! node's credential does, it cannot make the cloud keep more: a third registration
//! closes the draining session if no call is open on it, and is refused otherwise.
//!
//! The live sessions are bounded by the replica's edge cap (`capacity`): a registration
//! takes a slot when its credential is checked and fills it once welcomed, so the
//! registrations in flight cannot all pass the check and overshoot together.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::capacity::{EdgeCap, Load};
use super::session::{EdgeSession, Proof};
use crate::addr::NodeName;
use crate::cloud::nodes::journal::Journal;

pub(crate) struct Registry {
    sessions: RwLock<Sessions>,
    /// The nodes whose live session was added or removed.
    journal: Journal,
    /// Slots taken by registrations not yet welcomed (`Slot`). Raised only under the
    /// sessions' write lock, with the cap checked; a slot dropped lowers it.
    reserved: Arc<AtomicUsize>,
    /// How many live sessions there may be.
    cap: EdgeCap,
}

/// A place among the replica's edges for a registration in flight, given back when
/// dropped unless the registration's session took it (`Registry::insert`).
#[must_use]
pub(crate) struct Slot(Option<Arc<AtomicUsize>>);

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(reserved) = self.0.take() {
            reserved.fetch_sub(1, Ordering::AcqRel);
        }
    }
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
        Self::new(EdgeCap::Unlimited)
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
    /// The replica holds as many edges as it may: the edge tries another replica.
    #[error(
        "this replica holds its maximum of {max} edges (tunnel.max_edges); try another replica"
    )]
    Full { max: usize },
}

impl Refused {
    /// What the edge is told.
    pub(crate) fn reject_reason(&self) -> proto::RejectReason {
        match self {
            Refused::Held(_) => proto::RejectReason::WrongNode,
            Refused::TooManySessions { .. } => proto::RejectReason::TooManySessions,
            Refused::Full { .. } => proto::RejectReason::ReplicaFull,
        }
    }

    /// The `reason` label of `tunnel_registrations_rejected`.
    pub(crate) fn label(&self) -> &'static str {
        match self {
            Refused::Held(_) => "wrong_node",
            Refused::TooManySessions { .. } => "too_many_sessions",
            Refused::Full { .. } => "replica_full",
        }
    }
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
    /// A registry of at most `cap` live sessions.
    pub(crate) fn new(cap: EdgeCap) -> Self {
        Self {
            sessions: RwLock::default(),
            journal: Journal::default(),
            reserved: Arc::default(),
            cap,
        }
    }

    /// The edges this replica may hold now; None without a cap.
    pub(crate) fn max_edges(&self) -> Option<usize> {
        self.cap.max_edges()
    }

    /// How near the replica is to its cap.
    pub(crate) fn load(&self) -> Load {
        self.cap.load(self.len())
    }

    /// Where the cap comes from, for the start line.
    pub(crate) fn describe_cap(&self) -> String {
        self.cap.describe()
    }

    /// Whether an edge that proved itself with `newcomer` may take `node`'s session: not
    /// over a stronger proof (`Held`), not while the node has a live session and a
    /// draining one with calls open (`TooManySessions`), and not as a new edge when the
    /// replica is at its cap (`Full`; a node live here replaces its session, and adds no
    /// edge). The slot is held until the session is inserted.
    pub(crate) fn may_take(&self, node: &NodeName, newcomer: Proof) -> Result<Slot, Refused> {
        let max_edges = self.max_edges();
        let mut sessions = self.write();
        sessions.check(node, newcomer)?;
        let Some(max) = max_edges else {
            return Ok(Slot(None));
        };
        if sessions.live.contains_key(node) {
            return Ok(Slot(None));
        }
        if sessions.live.len() + self.reserved.load(Ordering::Acquire) >= max {
            return Err(Refused::Full { max });
        }
        self.reserved.fetch_add(1, Ordering::AcqRel);
        Ok(Slot(Some(self.reserved.clone())))
    }

    /// Makes `session` the node's live session and returns the one it replaces, if
    /// any, which drains from then on (an idle session that drained before it is closed
    /// to make room); refuses as `may_take` does (checked again here: another
    /// registration of the node may have come in since). `slot` is the one `may_take`
    /// gave: a node that had no slot (it was live here) and is no longer live takes one
    /// now, if there is room under the cap.
    pub(crate) fn insert(
        &self,
        session: Arc<EdgeSession>,
        mut slot: Slot,
    ) -> Result<Option<Arc<EdgeSession>>, Refused> {
        let max_edges = self.max_edges();
        let mut sessions = self.write();
        let idle = sessions.check(&session.node, session.proof)?;
        if let (None, Some(max)) = (&slot.0, max_edges)
            && !sessions.live.contains_key(&session.node)
            && sessions.live.len() + self.reserved.load(Ordering::Acquire) >= max
        {
            return Err(Refused::Full { max });
        }
        // The session fills the slot: the live map counts it from here on.
        if let Some(reserved) = slot.0.take() {
            reserved.fetch_sub(1, Ordering::AcqRel);
        }
        if let Some(idle) = idle {
            tracing::info!(node = %session.node, session = idle.id, "closing the node's idle draining session: a node keeps at most two");
            idle.close();
        }
        let node = session.node.clone();
        let old = sessions.live.insert(node.clone(), session);
        if let Some(old) = old.as_ref().filter(|s| !s.is_closed()) {
            sessions.draining.insert(node.clone(), old.clone());
        }
        drop(sessions);
        self.journal.note([node]);
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
            self.journal.note([node.clone()]);
            return true;
        }
        false
    }

    /// Wakes whenever the set of sessions changes.
    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.journal.subscribe()
    }

    /// The nodes whose live session was added or removed.
    pub(crate) fn journal(&self) -> &Journal {
        &self.journal
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

    /// How many live sessions there are: the replica's edges.
    pub(crate) fn len(&self) -> usize {
        self.read().live.len()
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
