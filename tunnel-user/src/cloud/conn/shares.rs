//! Each client's share of a node's calls. An edge carries at most
//! `transport.max_streams_per_edge` calls, and kubelets keep idle connections open for
//! hours: without a share, one client (a pod on a master, a local user) could hold every
//! call to an edge, and kube-apiserver's next `kubectl logs` would be refused as
//! overloaded. A client may hold `transport.client_share` of them through this replica's
//! entries; past it its new connections are refused, and everyone else's still go.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};

use crate::addr::NodeName;

/// Who a connection's client is, as far as shares go: what tells clients apart on the
/// entry it came in by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Who {
    /// A redirected connection: the cgroup of the connecting socket (a pod, or
    /// kube-apiserver's static pod), since every local client connects from loopback.
    Cgroup(u64),
    /// A connection on a unix socket entry: the peer's user.
    User(u32),
    /// A TCP entry (CONNECT, forwards, HTTPS): the peer's address.
    Address(IpAddr),
}

impl Who {
    /// The client of a redirected connection from `peer` to the redirect listener at
    /// `local`: its socket's cgroup (or, without one, its user), as the kernel knows
    /// the socket; its address where the kernel cannot say (every redirected client is
    /// on loopback, so they then share one).
    pub(crate) fn redirected(peer: SocketAddr, local: SocketAddr) -> Self {
        match crate::io::socket_owner::tcp_owner(peer, local) {
            Ok(Some(owner)) if owner.cgroup != 0 => Who::Cgroup(owner.cgroup),
            Ok(Some(owner)) => Who::User(owner.uid),
            Ok(None) => Who::Address(peer.ip()),
            Err(e) => {
                tracing::debug!(client = %peer, error = %e, "sock_diag cannot tell who the client is: it shares by its address");
                Who::Address(peer.ip())
            }
        }
    }
}

impl std::fmt::Display for Who {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Who::Cgroup(id) => write!(f, "cgroup {id}"),
            Who::User(uid) => write!(f, "uid {uid}"),
            Who::Address(ip) => write!(f, "{ip}"),
        }
    }
}

/// How many calls each client has open to each node, and how many it may.
pub(crate) struct Shares {
    per_client: usize,
    open: Mutex<HashMap<(NodeName, Who), usize>>,
}

/// A client at its share of a node's calls.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{client} holds {held} connections to this node, its share (transport.client_share)")]
pub(crate) struct OverShare {
    pub(crate) client: Who,
    pub(crate) held: usize,
}

/// One call counted in its client's share until dropped.
pub(crate) struct ShareGuard {
    shares: Arc<Shares>,
    key: (NodeName, Who),
}

impl Shares {
    /// Each client may hold `share` of `max_streams` calls to a node (at least one).
    pub(crate) fn new(max_streams: u32, share: f64) -> Arc<Self> {
        let per_client = ((f64::from(max_streams) * share).floor() as usize).max(1);
        Arc::new(Self {
            per_client,
            open: Mutex::default(),
        })
    }

    /// Counts one more call of `client` to `node`, unless it holds its share already.
    pub(crate) fn take(
        self: &Arc<Self>,
        node: &NodeName,
        client: Who,
    ) -> Result<ShareGuard, OverShare> {
        let key = (node.clone(), client);
        let mut open = self.lock();
        let held = open.entry(key.clone()).or_default();
        if *held >= self.per_client {
            return Err(OverShare {
                client,
                held: *held,
            });
        }
        *held += 1;
        Ok(ShareGuard {
            shares: self.clone(),
            key,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(NodeName, Who), usize>> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for ShareGuard {
    fn drop(&mut self) {
        let mut open = self.shares.lock();
        if let Some(held) = open.get_mut(&self.key) {
            *held -= 1;
            // Gone with its last call: the map holds only clients with calls open.
            if *held == 0 {
                open.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_holds_its_share_of_a_node_and_others_and_other_nodes_still_get_theirs() {
        let shares = Shares::new(8, 0.25);
        let (edge_1, edge_2) = (
            NodeName::new("edge-1".into()).unwrap(),
            NodeName::new("edge-2".into()).unwrap(),
        );
        let greedy = Who::Cgroup(7);
        let held: Vec<_> = (0..2)
            .map(|_| shares.take(&edge_1, greedy).expect("within its share"))
            .collect();
        let over = shares.take(&edge_1, greedy).err().expect("past its share");
        assert_eq!(over.held, 2);
        let _other = shares
            .take(&edge_1, Who::Cgroup(8))
            .expect("another client");
        let _elsewhere = shares.take(&edge_2, greedy).expect("another node");

        drop(held);
        assert_eq!(
            shares.lock().len(),
            2,
            "a client without calls is forgotten"
        );
        shares.take(&edge_1, greedy).expect("its calls ended");
    }

    #[test]
    fn a_share_is_at_least_one_call() {
        let shares = Shares::new(1, 0.1);
        let node = NodeName::new("edge-1".into()).unwrap();
        let _one = shares.take(&node, Who::User(0)).expect("one call");
        assert!(shares.take(&node, Who::User(0)).is_err());
    }
}
