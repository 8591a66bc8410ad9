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

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

use super::router::Router;
use crate::addr::NodeName;
use crate::intercept::Programs;

/// How long changes gather before the edge map is marked again when more came in while
/// it was marked: at most this often through a registration storm (each marking reads
/// every node of the table). A change in a quiet spell goes through at once, so an edge
/// that registers is redirected to before a client can learn it is there.
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
    let mut marked: BTreeSet<NodeName> = BTreeSet::new();
    loop {
        changes.mark_seen();
        let takeover_left = programs.takeover_left();
        let known = listed.is_cancelled() && router.routes_known() && takeover_left.is_none();
        // A pass over every node of the table, and an edge map entry for each address
        // that changes: on the blocking pool, off the thread that serves edges.
        let (r, p) = (router.clone(), programs.clone());
        let marking = tokio::task::spawn_blocking(move || {
            let without = if known {
                r.without_tunnel()
            } else {
                BTreeMap::new()
            };
            let ips: Vec<IpAddr> = without.values().flatten().copied().collect();
            p.set_no_tunnel(&ips);
            without.into_keys().collect::<BTreeSet<NodeName>>()
        });
        let Ok(now) = marking.await else {
            return;
        };
        if refuses {
            log_marks(&marked, &now, known);
        }
        marked = now;
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
            () = shutdown.cancelled() => return,
        }
    }
}

/// Says which nodes' connects now fail with "host is down" and which are redirected again.
fn log_marks(before: &BTreeSet<NodeName>, now: &BTreeSet<NodeName>, known: bool) {
    let names = |nodes: Vec<&NodeName>| {
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
    let down: Vec<&NodeName> = now.difference(before).collect();
    if !down.is_empty() {
        info!(
            count = down.len(),
            nodes = %names(down),
            "no replica holds a tunnel to these nodes: connects to their addresses fail with \"host is down\""
        );
    }
    let back: Vec<&NodeName> = before.difference(now).collect();
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
