//! The generic entry: an accepted socket whose original destination is known (the eBPF
//! redirect recovers it). The destination names the node and is what the edge dials.

use std::net::SocketAddr;

use bytes::Bytes;
use tokio::net::TcpStream;

use crate::cloud::{Cloud, proxy, route};

/// Proxies `tcp`, which was on its way to `original_dst`, through that node's edge. A
/// destination that is no node, or a node without a live edge, gets a reset at once.
pub async fn handle(cloud: &Cloud, tcp: TcpStream, original_dst: SocketAddr) {
    crate::net::tune(&tcp);
    let addr = tcp.peer_addr().map(|a| a.to_string()).unwrap_or_default();
    let client = proxy::Client { entry: "redirect", addr: &addr };
    let routed = route::route_address(&cloud.nodes(), original_dst);
    match proxy::open(cloud, routed, &client).await {
        Ok(opened) => proxy::run(cloud, opened, &client, tcp, Bytes::new()).await,
        Err(_) => crate::net::abort_on_close(&tcp),
    }
}
