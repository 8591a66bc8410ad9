//! The generic entry: an accepted socket whose original destination is known (the eBPF
//! redirect recovers it). The destination names the node and is what the edge dials.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::cloud::{Cloud, proxy, route};

/// Accepts connections the eBPF program redirected here and recovers where each was
/// going from the peer address (sock_ops recorded it under the client's address).
pub async fn serve(cloud: Arc<Cloud>, listener: TcpListener, shutdown: CancellationToken) {
    while let Some((tcp, peer)) =
        super::next_conn(|| listener.accept(), &shutdown, "redirect").await
    {
        let original = cloud
            .intercept
            .as_ref()
            .and_then(|i| i.take_original_dst(peer));
        let Some(original_dst) = original else {
            // Someone dialled the listener directly, or the entry expired: there is no
            // destination to go to.
            tracing::warn!(client = %peer, "connection on the redirect listener without an original destination");
            crate::io::net::abort_on_close(&tcp);
            continue;
        };
        let cloud = cloud.clone();
        let span = tracing::debug_span!("conn", entry = "redirect", client = %peer, %original_dst);
        tokio::spawn(async move { handle(&cloud, tcp, original_dst).await }.instrument(span));
    }
}

/// Right after this process took over the redirect from a predecessor, the node's edge
/// is reconnecting: wait for it (bounded by the takeover window) rather than reset a
/// connection that a moment later would go through.
async fn wait_for_edge(cloud: &Cloud, node: &str, left: std::time::Duration) {
    let deadline = tokio::time::Instant::now() + left;
    while !cloud.registry.contains(node) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// The addresses of the node table (both families), for the eBPF edge maps.
pub fn edge_ips(nodes: &route::NodeTable) -> Vec<std::net::IpAddr> {
    let mut ips: Vec<_> = nodes.all_addresses().collect();
    ips.sort();
    ips
}

/// Proxies `tcp`, which was on its way to `original_dst`, through that node's edge. A
/// destination that is no node, or a node without a live edge, gets a reset at once.
pub async fn handle(cloud: &Cloud, tcp: TcpStream, original_dst: SocketAddr) {
    crate::io::net::tune(&tcp);
    let addr = tcp.peer_addr().map(|a| a.to_string()).unwrap_or_default();
    let client = proxy::Client {
        entry: "redirect",
        addr: &addr,
    };
    let routed = route::route_address(&cloud.nodes(), original_dst);
    if let Ok(route::Route {
        node: Some(node), ..
    }) = &routed
        && let Some(left) = cloud.intercept.as_ref().and_then(|i| i.takeover_left())
    {
        wait_for_edge(cloud, node, left).await;
    }
    // The kernel completed the client's handshake with us, so it sends at once and waits
    // for nothing: its bytes may follow the dial request right away.
    match proxy::open_early(cloud, routed, &client).await {
        Ok(dialing) => proxy::run_early(cloud, dialing, &client, tcp).await,
        Err(_) => crate::io::net::abort_on_close(&tcp),
    }
}
