//! The generic entry: an accepted socket whose original destination is known (the eBPF
//! redirect recovers it). The destination names the node and is what the edge dials.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::net::{TcpListener, TcpStream};
use tracing::Instrument;

use super::Accepted;
use crate::addr::{ClientAddr, OrigDst};
use crate::cloud::conn::proxy::{Opener, Start};
use crate::cloud::conn::router::{Ask, Router};
use crate::cloud::conn::shares::Who;
use crate::intercept::Programs;
use crate::io::accept::{self, Incoming};

/// Accepts connections the eBPF program redirected here and recovers where each was
/// going from the peer address (sock_ops recorded it under the client's address).
pub(crate) async fn serve(
    router: Arc<Router>,
    opener: Arc<Opener>,
    programs: Arc<Programs>,
    mut incoming: Incoming<TcpListener>,
) {
    while let Some((tcp, peer, permit)) = incoming.next().await {
        let Some(original_dst) = programs.take_original_dst(peer) else {
            // Someone dialled the listener directly, or the entry expired: there is no
            // destination to go to.
            tracing::warn!(client = %peer, "connection on the redirect listener without an original destination");
            crate::io::net::abort_on_close(&tcp);
            continue;
        };
        let (router, opener) = (router.clone(), opener.clone());
        let tcp_local = tcp.local_addr();
        let takeover_left = programs.takeover_left();
        let span = tracing::debug_span!("conn", entry = "redirect", client = %peer, %original_dst);
        let accepted = Accepted {
            socket: tcp,
            client: ClientAddr::Tcp(peer),
            meta: original_dst,
        };
        let who = match tcp_local {
            Ok(local) => Who::redirected(peer, local),
            Err(_) => Who::Address(peer.ip()),
        };
        let conn = handle(router, opener, accepted, who, takeover_left).instrument(span);
        tokio::spawn(accept::hold(permit, conn));
    }
}

/// Right after this process took over the redirect from a predecessor, the node's edge
/// is reconnecting: wait for it (bounded by the takeover window) rather than reset a
/// connection that a moment later would go through.
async fn wait_for_edge(router: &Router, dst: OrigDst, left: Duration) {
    let Some(node) = router.node_at(dst) else {
        return;
    };
    // The bound passing is the end of the wait, not an error: the connection is then
    // routed as it stands.
    let _ = tokio::time::timeout(left, router.until_here(&node)).await;
}

/// Proxies a connection that was on its way to its `OrigDst` through that node's edge.
/// A destination that is no node, or a node without a live edge, gets a reset at once.
/// `takeover_left`: the rest of the window after taking over from a predecessor.
async fn handle(
    router: Arc<Router>,
    opener: Arc<Opener>,
    conn: Accepted<TcpStream, OrigDst>,
    who: Who,
    takeover_left: Option<Duration>,
) {
    let Accepted {
        socket,
        client,
        meta: dst,
    } = conn;
    crate::io::net::tune(&socket);
    if let Some(left) = takeover_left {
        wait_for_edge(&router, dst, left).await;
    }
    // The kernel completed the client's handshake with us, so it sends at once and waits
    // for nothing: its bytes may follow the dial request right away.
    let routed = router.route(Ask::Redirect(dst)).await;
    match opener
        .open(routed, "redirect", client, who, Start::Early)
        .await
    {
        Ok(dial) => opener.carry(dial, socket, Bytes::new()).await,
        Err(_) => crate::io::net::abort_on_close(&socket),
    }
}
