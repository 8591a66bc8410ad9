//! Which nodes a component changed, and when: the node table, this replica's sessions and
//! the other replicas' routes each keep one, so that what follows them (the outage
//! marks, `conn::outage`) redoes the nodes that changed since it last looked, not every
//! node of a fleet at each change.

use std::collections::{BTreeSet, VecDeque};
use std::sync::Mutex;

use tokio::sync::watch;

use crate::addr::NodeName;

/// Names a journal keeps. Past them the oldest go, and a follower that had not read them
/// goes over every node once, as it would with no journal: through a storm of changes a
/// few thousand names cost about what one pass over the fleet does, and the follower
/// reads them at least every `conn::outage::MARK_BATCH`.
const KEPT: usize = 4096;

/// The nodes noted since a version ([`Journal::since`]).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Noted {
    Nodes(BTreeSet<NodeName>),
    /// The journal no longer holds them all (or a change reached every node): look at
    /// every node.
    Everything,
}

impl Noted {
    /// Adds what `other` names.
    pub(crate) fn merge(&mut self, other: Noted) {
        match (&mut *self, other) {
            (Noted::Nodes(these), Noted::Nodes(those)) => these.extend(those),
            (_, Noted::Everything) => *self = Noted::Everything,
            (Noted::Everything, Noted::Nodes(_)) => {}
        }
    }
}

/// A component's changes, each a version, with the nodes it touched; the version wakes
/// whoever waits for a change ([`Journal::subscribe`]).
pub(crate) struct Journal {
    version: watch::Sender<u64>,
    log: Mutex<Log>,
}

#[derive(Default)]
struct Log {
    /// Each node noted, with the version that noted it, oldest first.
    names: VecDeque<(u64, NodeName)>,
    /// The changes up to this version are not all in `names`.
    floor: u64,
    version: u64,
}

impl Default for Journal {
    fn default() -> Self {
        Self {
            version: watch::Sender::new(0),
            log: Mutex::default(),
        }
    }
}

impl Journal {
    /// Wakes at each change.
    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.version.subscribe()
    }

    /// A change of `nodes`, a new version.
    pub(crate) fn note(&self, nodes: impl IntoIterator<Item = NodeName>) {
        let mut log = self.lock();
        log.version += 1;
        let version = log.version;
        log.names.extend(nodes.into_iter().map(|n| (version, n)));
        while log.names.len() > KEPT {
            if let Some((dropped, _)) = log.names.pop_front() {
                log.floor = dropped;
            }
        }
        // Under the log's lock: the versions go out in the order they were noted.
        self.version.send_replace(version);
    }

    /// A change that may touch every node (a replica's routes gone whole).
    pub(crate) fn note_everything(&self) {
        let mut log = self.lock();
        log.version += 1;
        log.floor = log.version;
        log.names.clear();
        self.version.send_replace(log.version);
    }

    /// The version now, and the nodes noted after version `seen`.
    pub(crate) fn since(&self, seen: u64) -> (u64, Noted) {
        let log = self.lock();
        if seen < log.floor {
            return (log.version, Noted::Everything);
        }
        let nodes = log
            .names
            .iter()
            .rev()
            .take_while(|(version, _)| *version > seen)
            .map(|(_, node)| node.clone())
            .collect();
        (log.version, Noted::Nodes(nodes))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Log> {
        self.log.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(i: usize) -> NodeName {
        NodeName::new(format!("edge-{i}")).expect("name")
    }

    fn nodes(range: std::ops::Range<usize>) -> Noted {
        Noted::Nodes(range.map(node).collect())
    }

    #[test]
    fn a_follower_reads_what_came_after_it_looked_or_everything_once_it_fell_behind() {
        let journal = Journal::default();
        let (start, noted) = journal.since(0);
        assert_eq!((start, noted), (0, nodes(0..0)));
        journal.note([node(1), node(2)]);
        let (seen, noted) = journal.since(start);
        assert_eq!(noted, nodes(1..3));
        journal.note([node(3)]);
        assert_eq!(
            journal.since(seen).1,
            nodes(3..4),
            "not what it read before"
        );
        assert_eq!(journal.since(start).1, nodes(1..4));
        assert_eq!(*journal.subscribe().borrow(), 2);

        // More names than the journal keeps: a follower from before goes over everything.
        let (seen, _) = journal.since(0);
        journal.note((0..KEPT).map(node));
        assert_eq!(journal.since(seen).1, nodes(0..KEPT), "all kept");
        journal.note([node(KEPT)]);
        assert_eq!(journal.since(seen).1, Noted::Everything);
        let (now, _) = journal.since(0);
        journal.note([node(7)]);
        assert_eq!(journal.since(now).1, nodes(7..8));

        journal.note_everything();
        assert_eq!(journal.since(now).1, Noted::Everything);
        let (now, noted) = journal.since(0);
        assert_eq!(noted, Noted::Everything);
        assert_eq!(journal.since(now).1, nodes(0..0));
    }
}
