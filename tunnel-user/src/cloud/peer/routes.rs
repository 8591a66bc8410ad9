//! What replicas tell each other about the edge sessions they hold: the updates that
//! carry it, how they are applied, and which replica a connection goes to when more
//! than one claims its node.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use proto::{NodeClaim, RouteUpdate};
use tokio::sync::mpsc;
use tracing::debug;

use super::Peers;
use crate::addr::check_node_name;
use crate::cloud::edges::registry::Registry;

/// Claims per `RouteUpdate`: node names are at most 253 bytes, so an update stays well
/// under the 64 KiB message bound.
const CLAIMS_PER_UPDATE: usize = 200;
/// Most nodes one replica may claim: bounds what a peer can make us store.
pub const MAX_NODES_PER_PEER: usize = 200_000;

/// The shortest time between two diffs of the registry. Each diff lists every session
/// this replica holds, so one per registration made a registration storm quadratic: at
/// 25,000 edges over five replicas (5,000 each) the fleet bench took 428.6 s to register
/// them all, against 27.2 s at 10,000. A change after a quiet spell is announced at once;
/// only changes that follow one another closer than this wait, and gather.
const ANNOUNCE_BATCH: std::time::Duration = std::time::Duration::from_millis(100);

/// Which replica a connection for a node goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Choice {
    Local,
    /// Index into the claims given to `choose`.
    Peer(usize),
}

/// The newest session wins; a tie goes to the local one (no hop).
pub(crate) fn choose(local: Option<u64>, claims: &[u64]) -> Option<Choice> {
    let best_peer = claims
        .iter()
        .enumerate()
        .max_by_key(|(i, since)| (**since, std::cmp::Reverse(*i)));
    match (local, best_peer) {
        (Some(l), Some((i, p))) if *p > l => Some(Choice::Peer(i)),
        (Some(_), _) => Some(Choice::Local),
        (None, Some((i, _))) => Some(Choice::Peer(i)),
        (None, None) => None,
    }
}

/// The updates that take a peer from `sent` to `now`: everything when `reset`, else
/// only what changed, in messages of bounded size. Empty when nothing changed.
pub fn route_updates(
    sent: &HashMap<String, u64>,
    now: &HashMap<String, u64>,
    reset: bool,
) -> Vec<RouteUpdate> {
    let mut held: Vec<NodeClaim> = now
        .iter()
        .filter(|(node, since)| reset || sent.get(*node) != Some(*since))
        .map(|(node, since)| NodeClaim {
            node: node.clone(),
            connected_at_ms: *since,
        })
        .collect();
    held.sort_by(|a, b| a.node.cmp(&b.node));
    let mut released: Vec<String> = if reset {
        Vec::new()
    } else {
        sent.keys()
            .filter(|n| !now.contains_key(*n))
            .cloned()
            .collect()
    };
    released.sort();
    let mut updates: Vec<RouteUpdate> = held
        .chunks(CLAIMS_PER_UPDATE)
        .map(|c| RouteUpdate {
            held: c.to_vec(),
            ..Default::default()
        })
        .chain(released.chunks(CLAIMS_PER_UPDATE).map(|c| RouteUpdate {
            released: c.to_vec(),
            ..Default::default()
        }))
        .collect();
    if reset {
        match updates.first_mut() {
            Some(first) => first.reset = true,
            None => updates.push(RouteUpdate {
                reset: true,
                ..Default::default()
            }),
        }
    }
    updates
}

/// Applies an update from a peer to what it claims; says whether anything changed.
/// Claims with invalid names, or beyond the bound, are dropped.
pub fn apply_update(nodes: &mut HashMap<String, u64>, update: RouteUpdate) -> bool {
    let mut changed = update.reset && !nodes.is_empty();
    if update.reset {
        nodes.clear();
    }
    for claim in update.held {
        if check_node_name(&claim.node).is_err()
            || (nodes.len() >= MAX_NODES_PER_PEER && !nodes.contains_key(&claim.node))
        {
            continue;
        }
        changed |= nodes.insert(claim.node, claim.connected_at_ms) != Some(claim.connected_at_ms);
    }
    for node in update.released {
        changed |= nodes.remove(&node).is_some();
    }
    changed
}

pub(crate) fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// This replica's own live sessions, as claims.
fn local_claims(registry: &Registry) -> HashMap<String, u64> {
    registry
        .list()
        .into_iter()
        .filter(|s| !s.is_closed())
        .map(|s| (s.node.to_string(), unix_ms(s.connected_at)))
        .collect()
}

/// Streams this replica's own sessions into `updates`: all of them (the first update has
/// `reset` set), then each change, and an empty update when nothing changed for a
/// heartbeat interval (a keepalive). Ends when the receiver goes away or at shutdown.
pub(super) async fn announce(
    registry: Arc<Registry>,
    peers: Arc<Peers>,
    updates: mpsc::Sender<RouteUpdate>,
) {
    let mut changes = registry.subscribe();
    let mut sent = HashMap::new();
    let mut reset = true;
    let mut keepalive = tokio::time::interval(peers.transport.heartbeat_interval);
    keepalive.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first tick is immediate; the snapshot below is the first message anyway.
    keepalive.tick().await;
    loop {
        // Mark the version seen before reading the registry, so a change in between
        // wakes us again rather than being lost.
        changes.borrow_and_update();
        let diffed_at = tokio::time::Instant::now();
        let now = local_claims(&registry);
        for update in route_updates(&sent, &now, reset) {
            if updates.send(update).await.is_err() {
                debug!("route stream to replica ended");
                return;
            }
        }
        sent = now;
        reset = false;
        // Until the registry changes: keepalives only. A keepalive is no reason to diff
        // the registry again, nor to hold back the change that follows it.
        loop {
            tokio::select! {
                r = changes.changed() => {
                    if r.is_err() {
                        return;
                    }
                    break;
                }
                _ = keepalive.tick() => {
                    if updates.send(RouteUpdate::default()).await.is_err() {
                        return;
                    }
                }
                () = updates.closed() => return,
                // Shutdown must not wait for the peer to hang up.
                () = peers.shutdown.cancelled() => return,
            }
        }
        tokio::select! {
            () = tokio::time::sleep_until(diffed_at + ANNOUNCE_BATCH) => {}
            () = peers.shutdown.cancelled() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(entries: &[(&str, u64)]) -> HashMap<String, u64> {
        entries.iter().map(|(n, t)| (n.to_string(), *t)).collect()
    }

    #[test]
    fn newest_session_wins_and_ties_stay_local() {
        assert_eq!(choose(None, &[]), None);
        assert_eq!(choose(Some(5), &[]), Some(Choice::Local));
        assert_eq!(choose(None, &[3, 9, 4]), Some(Choice::Peer(1)));
        assert_eq!(choose(Some(10), &[3, 9]), Some(Choice::Local));
        assert_eq!(choose(Some(10), &[3, 11]), Some(Choice::Peer(1)));
        assert_eq!(choose(Some(10), &[10]), Some(Choice::Local));
    }

    #[test]
    fn first_update_resets_then_only_changes_travel() {
        let empty = HashMap::new();
        let first = route_updates(&empty, &empty, true);
        assert_eq!(
            first,
            vec![RouteUpdate {
                reset: true,
                ..Default::default()
            }]
        );
        assert!(route_updates(&empty, &empty, false).is_empty());

        let before = map(&[("edge-a", 1), ("edge-b", 2)]);
        let after = map(&[("edge-b", 2), ("edge-c", 3), ("edge-a", 4)]);
        let updates = route_updates(&before, &after, false);
        let held: Vec<_> = updates
            .iter()
            .flat_map(|u| u.held.iter().map(|c| (c.node.as_str(), c.connected_at_ms)))
            .collect();
        assert_eq!(held, vec![("edge-a", 4), ("edge-c", 3)]);
        assert!(updates.iter().all(|u| !u.reset && u.released.is_empty()));
        let gone = route_updates(&after, &map(&[("edge-c", 3)]), false);
        let released: Vec<_> = gone.iter().flat_map(|u| u.released.clone()).collect();
        assert_eq!(released, vec!["edge-a", "edge-b"]);
    }

    #[test]
    fn large_snapshots_are_split_below_the_message_bound() {
        let now: HashMap<String, u64> = (0..1000)
            .map(|i| (format!("{}-{i}", "n".repeat(240)), i))
            .collect();
        let updates = route_updates(&HashMap::new(), &now, true);
        assert_eq!(updates.len(), 5);
        assert!(updates[0].reset && updates[1..].iter().all(|u| !u.reset));
        for u in &updates {
            let len = prost::Message::encoded_len(u);
            assert!(len < proto::MAX_MESSAGE_LEN, "{len}");
        }
        let mut got = HashMap::new();
        for u in updates {
            apply_update(&mut got, u);
        }
        assert_eq!(got, now);
    }

    #[test]
    fn applying_updates_tracks_the_peer_and_drops_bad_names() {
        let mut nodes = map(&[("stale", 1)]);
        let reset = RouteUpdate {
            reset: true,
            held: vec![
                NodeClaim {
                    node: "edge-a".into(),
                    connected_at_ms: 7,
                },
                NodeClaim {
                    node: "Bad_Name".into(),
                    connected_at_ms: 7,
                },
            ],
            released: vec![],
        };
        assert!(apply_update(&mut nodes, reset));
        assert_eq!(nodes, map(&[("edge-a", 7)]));
        assert!(
            !apply_update(&mut nodes, RouteUpdate::default()),
            "a keepalive changes nothing"
        );
        assert!(apply_update(
            &mut nodes,
            RouteUpdate {
                released: vec!["edge-a".into()],
                ..Default::default()
            }
        ));
        assert!(nodes.is_empty());
    }
}
