//! The targets each node's edge connected to lately, for HTTP CONNECT's
//! `optimistic_ok = "recent"`: a target the edge reached a moment ago will most likely
//! be reached again, so its client may have the 200 before the edge's answer.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::addr::NodeName;

/// Targets remembered across all nodes (about 80 bytes each); a cloud with more recent
/// targets than this answers the rest after the dial, as it would without the list.
const CAPACITY: usize = 16384;

/// Per node, per target (as the dial request names it): when a dial there last
/// connected, forgotten when one fails.
pub(crate) struct Reached {
    recent_for: Duration,
    targets: Mutex<Targets>,
}

struct Targets {
    by_node: HashMap<NodeName, HashMap<String, Instant>>,
    held: usize,
    /// When expired targets were last dropped: a full list is swept at most once per
    /// quarter of `recent_for`, so a busy cloud does not scan it on every dial.
    swept: Instant,
}

impl Reached {
    pub(crate) fn new(recent_for: Duration) -> Self {
        Self {
            recent_for,
            targets: Mutex::new(Targets {
                by_node: HashMap::new(),
                held: 0,
                swept: Instant::now(),
            }),
        }
    }

    /// The list, even after a panic while it was held: it holds only hints, so the worst
    /// a half-done update leaves is one client answered after its dial instead of before.
    fn lock(&self) -> MutexGuard<'_, Targets> {
        self.targets.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the node's edge connected to `target` within `recent_for`, with no
    /// failed dial there since.
    pub(crate) fn recently(&self, node: &NodeName, target: &str) -> bool {
        let targets = self.lock();
        targets
            .by_node
            .get(node)
            .and_then(|t| t.get(target))
            .is_some_and(|at| at.elapsed() < self.recent_for)
    }

    /// A dial to `target` connected.
    pub(crate) fn connected(&self, node: &NodeName, target: &str) {
        let now = Instant::now();
        let mut targets = self.lock();
        let targets = &mut *targets;
        if let Some(at) = targets
            .by_node
            .get_mut(node)
            .and_then(|t| t.get_mut(target))
        {
            *at = now;
            return;
        }
        if targets.held >= CAPACITY && now - targets.swept >= self.recent_for / 4 {
            for t in targets.by_node.values_mut() {
                t.retain(|_, at| now - *at < self.recent_for);
            }
            targets.by_node.retain(|_, t| !t.is_empty());
            targets.held = targets.by_node.values().map(HashMap::len).sum();
            targets.swept = now;
        }
        if targets.held < CAPACITY {
            targets
                .by_node
                .entry(node.clone())
                .or_default()
                .insert(target.to_string(), now);
            targets.held += 1;
        }
    }

    /// A dial to `target` failed: its next client waits for the edge's answer.
    pub(crate) fn failed(&self, node: &NodeName, target: &str) {
        let mut targets = self.lock();
        let Some(t) = targets.by_node.get_mut(node) else {
            return;
        };
        if t.remove(target).is_some() {
            if t.is_empty() {
                targets.by_node.remove(node);
            }
            targets.held = targets.held.saturating_sub(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str) -> NodeName {
        NodeName::new(name.into()).expect("valid")
    }

    #[test]
    fn a_connected_target_is_recent_until_a_failure_or_the_time_is_up() {
        let reached = Reached::new(Duration::from_millis(200));
        let (a, b) = (node("edge-a"), node("edge-b"));
        assert!(
            !reached.recently(&a, "127.0.0.1:10250"),
            "nothing known yet"
        );
        reached.connected(&a, "127.0.0.1:10250");
        assert!(reached.recently(&a, "127.0.0.1:10250"));
        assert!(!reached.recently(&a, "127.0.0.1:80"), "another target");
        assert!(!reached.recently(&b, "127.0.0.1:10250"), "another node");
        reached.failed(&a, "127.0.0.1:10250");
        assert!(
            !reached.recently(&a, "127.0.0.1:10250"),
            "a failure forgets"
        );
        reached.connected(&a, "127.0.0.1:10250");
        std::thread::sleep(Duration::from_millis(250));
        assert!(!reached.recently(&a, "127.0.0.1:10250"), "too long ago");
    }

    #[test]
    fn a_full_list_makes_room_from_expired_targets_only() {
        // Long enough for filling the list in a debug build to stay well inside it.
        let reached = Reached::new(Duration::from_secs(2));
        let a = node("edge-a");
        for port in 0..CAPACITY {
            reached.connected(&a, &format!("10.0.0.1:{port}"));
        }
        reached.failed(&a, "10.0.0.1:0");
        reached.connected(&a, "10.0.0.2:1");
        assert!(reached.recently(&a, "10.0.0.2:1"), "a failure made room");
        reached.connected(&a, "10.0.0.2:2");
        assert!(!reached.recently(&a, "10.0.0.2:2"), "full: not remembered");
        assert!(
            reached.recently(&a, "10.0.0.1:1"),
            "the list kept what it had"
        );
        std::thread::sleep(Duration::from_millis(2100));
        reached.connected(&a, "10.0.0.2:2");
        assert!(
            reached.recently(&a, "10.0.0.2:2"),
            "room made from expired ones"
        );
        let targets = reached.targets.lock().unwrap();
        assert_eq!(targets.held, 1, "the expired targets were dropped");
        assert_eq!(targets.by_node[&a].len(), 1);
    }

    #[test]
    fn a_panic_while_the_list_was_held_leaves_it_working() {
        let reached = std::sync::Arc::new(Reached::new(Duration::from_secs(60)));
        let a = node("edge-a");
        reached.connected(&a, "127.0.0.1:10250");
        let holder = reached.clone();
        std::thread::spawn(move || {
            let _held = holder.targets.lock();
            panic!("a panic with the lock held, to poison it");
        })
        .join()
        .expect_err("the thread panicked");
        assert!(reached.targets.is_poisoned());
        assert!(reached.recently(&a, "127.0.0.1:10250"));
        reached.failed(&a, "127.0.0.1:10250");
        reached.connected(&a, "127.0.0.1:80");
        assert!(!reached.recently(&a, "127.0.0.1:10250"));
        assert!(reached.recently(&a, "127.0.0.1:80"));
    }
}
