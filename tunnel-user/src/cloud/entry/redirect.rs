//! The generic entry: an accepted socket whose original destination is known (the eBPF
//! redirect recovers it). The destination names the node and is what the edge dials.

use std::net::SocketAddr;

use tokio::net::TcpStream;

use crate::cloud::{Cloud, proxy, route};

/// Proxies `tcp`, which was on its way to `original_dst`, through that node's edge. A
/// destination that is no node, or a node without a live edge, gets a reset at once.
pub async fn handle(cloud: &Cloud, tcp: TcpStream, original_dst: SocketAddr) {
    crate::net::tune(&tcp);
    let client = tcp.peer_addr().map(|a| a.to_string()).unwrap_or_default();
    let result = match route::route_address(&cloud.nodes(), original_dst) {
        Ok(route) => proxy::open_early(cloud, &route, &client).await,
        Err(e) => Err(e.into()),
    };
    match result {
        Ok(opened) => proxy::run_early(cloud, opened, tcp).await,
        Err(e) => {
            tracing::info!(error = %e, %original_dst, %client, "redirected connection refused");
            crate::net::abort_on_close(&tcp);
        }
    }
}
