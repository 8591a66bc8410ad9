//! A connect to an edge whose node no replica holds a tunnel to fails at once with "host
//! is down" (EHOSTDOWN), set by the eBPF program, instead of being redirected here to be
//! reset: TLS runs end to end between the client and the kubelet, so nothing this cloud
//! could send on the connection reaches the user as text, but the errno of `connect()`
//! does (`dial tcp 10.0.0.5:10250: connect: host is down` in kube-apiserver's answer).
//!
//! The programs deny only what this replica knows: the node table listed from the API,
//! the routes of every other replica in its list in, and not while it takes over from a
//! predecessor (the edges are reconnecting then). Otherwise every edge address is
//! redirected as before, and a connection without a tunnel is reset. The same marks
//! tell a full edge map which addresses to keep: those of nodes with a tunnel.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

use super::router::{RouteVersion, Router};
use crate::addr::NodeName;
use crate::cloud::nodes::journal::Noted;
use crate::intercept::Programs;

/// How long changes gather before the edge map is marked again when more came in while
/// it was marked: at most this often through a registration storm. A change in a quiet
/// spell goes through at once, so an edge that registers is redirected to before a
/// client can learn it is there.
const MARK_BATCH: Duration = Duration::from_millis(100);

/// Nodes named in one log line about nodes whose tunnel went or came back.
const NODES_LOGGED: usize = 5;

/// Keeps the eBPF edge map's "no tunnel" marks in line with the router until
/// `shutdown`. `listed`: cancelled once the API has listed the nodes and the replicas
/// (at once without the API). Stops at shutdown, before the sessions close, so it never
/// marks the edges a successor is taking over.
pub(crate) async fn mark_without_tunnel(
    router: Arc<Router>,
    programs: Arc<Programs>,
    listed: CancellationToken,
    shutdown: CancellationToken,
) {
    // Without `bpf_set_retval` the programs redirect a marked address all the same, but
    // the marks still decide which addresses a full edge map keeps.
    let refuses = programs.refuses_without_tunnel();
    let mut changes = router.changes();
    let mut outage = Outage::default();
    loop {
        router.note_moves_ended();
        changes.mark_seen();
        let takeover_left = programs.takeover_left();
        let known = listed.is_cancelled() && router.routes_known() && takeover_left.is_none();
        // On the blocking pool, off the thread that serves edges: the first pass, and
        // one after a change that may reach every node, go over the whole table.
        let (r, p) = (router.clone(), programs.clone());
        let marking = tokio::task::spawn_blocking(move || {
            let started = std::time::Instant::now();
            let pass = outage.pass(&r, known);
            match &pass.write {
                Write::Whole(ips) => p.set_no_tunnel(ips),
                Write::Change { down, up } => p.change_no_tunnel(down, up),
            }
            debug!(
                examined = pass.examined,
                marked = outage.marks.nodes.len(),
                took = ?started.elapsed(),
                "outage marks set"
            );
            (outage, pass)
        });
        let Ok((kept, pass)) = marking.await else {
            return;
        };
        outage = kept;
        // A node moving between replicas is marked once it has not come back in time.
        let moving_ends = router.moving_ends();
        if refuses {
            log_marks(&pass.down, &pass.up, known);
        }
        if changes.pending() {
            tokio::select! {
                () = tokio::time::sleep(MARK_BATCH) => {}
                () = shutdown.cancelled() => return,
            }
        }
        tokio::select! {
            () = changes.changed() => {}
            () = listed.cancelled(), if !listed.is_cancelled() => {}
            () = tokio::time::sleep(takeover_left.unwrap_or_default()), if takeover_left.is_some() => {}
            () = tokio::time::sleep_until(moving_ends.unwrap_or_else(tokio::time::Instant::now)), if moving_ends.is_some() => {}
            () = shutdown.cancelled() => return,
        }
    }
}

/// The marks as the last pass left them, and what that pass had seen: each pass redoes
/// the nodes whose sessions, routes or table entries changed since
/// ([`Router::changed_nodes`]), so a fleet of edges without a tunnel costs a pass only
/// the few that changed, through a Node churn or a registration storm alike.
#[derive(Default)]
struct Outage {
    marks: Marks,
    /// The version the last pass read, and whether it was sure of the routes then.
    seen: Option<(RouteVersion, bool)>,
}

/// The nodes marked without a tunnel, with the addresses marked for each.
#[derive(Default)]
struct Marks {
    nodes: HashMap<NodeName, Vec<IpAddr>>,
}

/// What a pass changed.
struct Pass {
    /// Nodes whose tunnel went, and came back.
    down: Vec<NodeName>,
    up: Vec<NodeName>,
    /// The nodes it redid: those noted, or in a pass over the whole table every node
    /// marked before it or after.
    examined: usize,
    write: Write,
}

/// What a pass writes to the edge map.
#[derive(Debug)]
enum Write {
    /// Every address without a tunnel.
    Whole(Vec<IpAddr>),
    /// Addresses that lost their tunnel, and addresses that have one again.
    Change { down: Vec<IpAddr>, up: Vec<IpAddr> },
}

impl Outage {
    /// Brings the marks in line with `router`; `known`: whether this replica knows
    /// which replica holds which node (otherwise nothing is marked).
    fn pass(&mut self, router: &Router, known: bool) -> Pass {
        let seen = self.seen.map(|(version, _)| version).unwrap_or_default();
        let (version, mut noted) = router.changed_nodes(seen);
        if self.seen.is_none_or(|(_, was_known)| was_known != known) {
            noted = Noted::Everything;
        }
        self.seen = Some((version, known));
        let now = match (&noted, known) {
            (_, false) => BTreeMap::new(),
            (Noted::Everything, true) => router.without_tunnel(),
            (Noted::Nodes(nodes), true) => router.without_tunnel_among(nodes),
        };
        self.marks.update(&noted, now)
    }
}

impl Marks {
    /// Makes `now` the marks of the nodes `among` (the others keep theirs).
    fn update(&mut self, among: &Noted, now: BTreeMap<NodeName, Vec<IpAddr>>) -> Pass {
        let before: HashMap<NodeName, Vec<IpAddr>> = match among {
            Noted::Everything => std::mem::take(&mut self.nodes),
            Noted::Nodes(nodes) => nodes
                .iter()
                .filter_map(|n| self.nodes.remove_entry(n))
                .collect(),
        };
        let examined = match among {
            Noted::Everything => before.len().max(now.len()),
            Noted::Nodes(nodes) => nodes.len(),
        };
        let down = now
            .keys()
            .filter(|n| !before.contains_key(*n))
            .cloned()
            .collect();
        let mut up: Vec<NodeName> = before
            .keys()
            .filter(|n| !now.contains_key(*n))
            .cloned()
            .collect();
        up.sort();
        let ips_before: HashSet<IpAddr> = before
            .values()
            .flatten()
            .map(IpAddr::to_canonical)
            .collect();
        let ips_now: HashSet<IpAddr> = now.values().flatten().map(IpAddr::to_canonical).collect();
        self.nodes.extend(now);
        let write = match among {
            Noted::Everything => Write::Whole(ips_now.into_iter().collect()),
            Noted::Nodes(_) => Write::Change {
                down: ips_now.difference(&ips_before).copied().collect(),
                up: ips_before.difference(&ips_now).copied().collect(),
            },
        };
        Pass {
            down,
            up,
            examined,
            write,
        }
    }
}

/// Says which nodes' connects now fail with "host is down" and which are redirected again.
fn log_marks(down: &[NodeName], back: &[NodeName], known: bool) {
    let names = |nodes: &[NodeName]| {
        let mut text: Vec<String> = nodes
            .iter()
            .take(NODES_LOGGED)
            .map(|n| n.to_string())
            .collect();
        if nodes.len() > NODES_LOGGED {
            text.push(format!("and {} more", nodes.len() - NODES_LOGGED));
        }
        text.join(", ")
    };
    if !down.is_empty() {
        info!(
            count = down.len(),
            nodes = %names(down),
            "no replica holds a tunnel to these nodes: connects to their addresses fail with \"host is down\""
        );
    }
    if !back.is_empty() {
        let why = if known {
            "a replica holds a tunnel to these nodes again"
        } else {
            "not sure which replica holds which node"
        };
        info!(count = back.len(), nodes = %names(back), why, "connects to these nodes' addresses are redirected again");
    } else if !known {
        debug!("not sure which replica holds which node: every edge address is redirected");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::family::Family;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    use tokio_util::sync::CancellationToken;

    use crate::cloud::edges::capacity::EdgeCap;
    use crate::cloud::edges::registry::Registry;
    use crate::cloud::nodes::table::Claimed;
    use crate::cloud::nodes::{NodeChange, Nodes};
    use crate::cloud::peer::Peers;
    use crate::config::TransportConfig;

    /// Nodes of the fleet; a batch also adds nodes beyond them.
    const FLEET: u32 = 200;

    fn router() -> (Router, Arc<Nodes>) {
        let programs = Arc::new(Programs::new(None));
        let nodes = Arc::new(Nodes::new(&[], &[], programs, Family::default(), true));
        let registry = Arc::new(Registry::new(EdgeCap::Set(10)));
        let peers = Peers::new(
            "replica".into(),
            None,
            TransportConfig::default(),
            CancellationToken::new(),
        );
        (Router::new(nodes.clone(), registry, peers), nodes)
    }

    fn set(i: u32, addresses: &[u32]) -> NodeChange {
        let claim = Claimed {
            edge: true,
            addresses: addresses.iter().map(|a| address(*a)).collect(),
            ..Claimed::default()
        };
        NodeChange::Set(format!("edge-{i}"), claim)
    }

    fn address(a: u32) -> IpAddr {
        std::net::Ipv4Addr::from(0x0a01_0000 + a).into()
    }

    /// The edge map's marks, as the passes' writes leave them.
    fn write(map: &mut HashSet<IpAddr>, write: Write) {
        match write {
            Write::Whole(ips) => *map = ips.into_iter().collect(),
            Write::Change { down, up } => {
                for ip in up {
                    assert!(map.remove(&ip), "{ip} was not marked");
                }
                for ip in down {
                    assert!(map.insert(ip), "{ip} was marked");
                }
            }
        }
    }

    /// A fleet of edges without a tunnel, then random batches of Nodes added, moved
    /// (onto another's address too), removed and relisted, and a pass after each: it
    /// looks at the nodes the batch touched, not the fleet, and leaves the marks, and
    /// the addresses marked in the edge map, as a pass over the whole table makes them.
    #[test]
    fn a_pass_redoes_the_nodes_that_changed_and_marks_what_a_whole_pass_marks() {
        for seed in 0..20u64 {
            let mut rng = StdRng::seed_from_u64(seed);
            let (router, nodes) = router();
            let mut outage = Outage::default();
            let mut map = HashSet::new();
            nodes.change((0..FLEET).map(|i| set(i, &[i])).collect());
            let first = outage.pass(&router, true);
            assert_eq!(first.examined, FLEET as usize, "the first pass: every node");
            assert_eq!(first.down.len(), FLEET as usize);
            write(&mut map, first.write);

            // One node moves to an address no one has: that node's marks alone.
            nodes.change(vec![set(7, &[10_000])]);
            let moved = outage.pass(&router, true);
            assert_eq!(moved.examined, 1, "seed {seed}");
            assert!(moved.down.is_empty() && moved.up.is_empty(), "still down");
            assert!(
                matches!(&moved.write, Write::Change { down, up } if down == &[address(10_000)] && up == &[address(7)]),
                "{:?}",
                moved.write
            );
            write(&mut map, moved.write);

            for step in 0..30 {
                let mut batch = Vec::new();
                let mut relisted = false;
                for _ in 0..rng.random_range(1..6) {
                    let i = rng.random_range(0..FLEET + 20);
                    match rng.random_range(0..10) {
                        0 => batch.push(NodeChange::Gone(format!("edge-{i}"))),
                        1 => {
                            let listed = (0..FLEET)
                                .filter(|_| rng.random_bool(0.9))
                                .map(|i| {
                                    (
                                        format!("edge-{i}"),
                                        Claimed {
                                            edge: true,
                                            addresses: vec![address(i)],
                                            ..Claimed::default()
                                        },
                                    )
                                })
                                .collect();
                            batch.push(NodeChange::Listed(listed));
                            relisted = true;
                        }
                        _ => {
                            batch.push(set(i, &[rng.random_range(0..FLEET + 40)]));
                        }
                    }
                }
                nodes.change(batch);
                let pass = outage.pass(&router, true);
                // A node moved onto another's address touches that one too (both
                // lose it), and any that claimed its old one: a few each, not the fleet.
                assert!(
                    relisted || pass.examined <= 25,
                    "seed {seed} step {step}: {} examined",
                    pass.examined
                );
                write(&mut map, pass.write);
                let whole = router.without_tunnel();
                let marked: BTreeMap<NodeName, Vec<IpAddr>> = outage
                    .marks
                    .nodes
                    .iter()
                    .map(|(n, ips)| (n.clone(), ips.clone()))
                    .collect();
                assert_eq!(marked, whole, "seed {seed} step {step}");
                let addresses: HashSet<IpAddr> = whole.values().flatten().copied().collect();
                assert_eq!(map, addresses, "seed {seed} step {step}");
            }

            // Not sure of the routes: nothing marked, and everything again once sure.
            let before = outage.marks.nodes.len();
            let unsure = outage.pass(&router, false);
            assert_eq!(unsure.up.len(), before);
            write(&mut map, unsure.write);
            assert!(map.is_empty() && outage.marks.nodes.is_empty());
            let sure = outage.pass(&router, true);
            write(&mut map, sure.write);
            assert_eq!(
                map.len(),
                router.without_tunnel().values().flatten().count()
            );
        }
    }
}
