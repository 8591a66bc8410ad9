//! Fixed TCP forwards: every connection to a listener goes to one node's target
//! (SuperEdge's tcp module, with the node named).

use std::sync::Arc;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::cloud::route::Route;
use crate::cloud::{Cloud, proxy};
use crate::config::ForwardConfig;

pub async fn serve(
    cloud: Arc<Cloud>,
    listener: TcpListener,
    forward: ForwardConfig,
    shutdown: CancellationToken,
) {
    let route = Route {
        node: forward.node.clone(),
        target: forward.target.clone(),
        tls: false,
    };
    let name = format!("forward {}", forward.listen);
    while let Some((tcp, peer)) = super::next_conn(|| listener.accept(), &shutdown, &name).await {
        crate::io::net::tune(&tcp);
        let cloud = cloud.clone();
        let route = route.clone();
        let span =
            tracing::debug_span!("conn", entry = "forward", client = %peer, target = %route.target);
        tokio::spawn(
            async move {
                let addr = peer.to_string();
                let client = proxy::Client {
                    entry: "forward",
                    addr: &addr,
                };
                // The client waits for no answer, so its bytes may follow the dial request
                // at once.
                match proxy::open_early(&cloud, Ok(route), &client).await {
                    Ok(dialing) => proxy::run_early(&cloud, dialing, &client, tcp).await,
                    // The client sees a reset at once rather than a silent close.
                    Err(_) => crate::io::net::abort_on_close(&tcp),
                }
            }
            .instrument(span),
        );
    }
}
