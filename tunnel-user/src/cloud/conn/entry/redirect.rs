//! The generic entry: an accepted socket whose original destination is known (the eBPF
//! redirect recovers it). The destination names the node and is what the edge dials.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tracing::Instrument;

use crate::cloud::conn::proxy::{self, Opener};
use crate::cloud::conn::route;
use crate::cloud::conn::router::Router;
use crate::intercept::Programs;
use crate::io::accept::{self, Incoming};

/// Accepts connections the eBPF program redirected here and recovers where each was
/// going from the peer address (sock_ops recorded it under the client's address).
pub async fn serve(
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
        let takeover_left = programs.takeover_left();
        let span = tracing::debug_span!("conn", entry = "redirect", client = %peer, %original_dst);
        tokio::spawn(accept::hold(
            permit,
            async move { handle(&router, &opener, tcp, original_dst, takeover_left).await }
                .instrument(span),
        ));
    }
}

/// Right after this process took over the redirect from a predecessor, the node's edge
/// is reconnecting: wait for it (bounded by the takeover window) rather than reset a
/// connection that a moment later would go through.
async fn wait_for_edge(router: &Router, node: &str, left: Duration) {
    let deadline = tokio::time::Instant::now() + left;
    while !router.is_here(node) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Proxies `tcp`, which was on its way to `original_dst`, through that node's edge. A
/// destination that is no node, or a node without a live edge, gets a reset at once.
/// `takeover_left`: the rest of the window after taking over from a predecessor.
async fn handle(
    router: &Router,
    opener: &Opener,
    tcp: TcpStream,
    original_dst: SocketAddr,
    takeover_left: Option<Duration>,
) {
    crate::io::net::tune(&tcp);
    let addr = tcp.peer_addr().map(|a| a.to_string()).unwrap_or_default();
    let client = proxy::Client {
        entry: "redirect",
        addr: &addr,
    };
    let routed = router.address(original_dst);
    if let Ok(route::Route {
        node: Some(node), ..
    }) = &routed
        && let Some(left) = takeover_left
    {
        wait_for_edge(router, node, left).await;
    }
    // The kernel completed the client's handshake with us, so it sends at once and waits
    // for nothing: its bytes may follow the dial request right away.
    match opener.open_early(router.locate(routed), &client) {
        Ok(dialing) => opener.run_early(dialing, &client, tcp).await,
        Err(_) => crate::io::net::abort_on_close(&tcp),
    }
}
