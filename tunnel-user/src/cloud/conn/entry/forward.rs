//! Fixed TCP forwards: every connection to a listener goes to one node's target
//! (SuperEdge's tcp module, with the node named).

use std::sync::Arc;

use tokio::net::TcpListener;
use tracing::Instrument;

use crate::cloud::conn::proxy::{self, Opener};
use crate::cloud::conn::route::Route;
use crate::cloud::conn::router::Router;
use crate::config::ForwardConfig;
use crate::io::accept::{self, Incoming};

pub async fn serve(
    router: Arc<Router>,
    opener: Arc<Opener>,
    mut incoming: Incoming<TcpListener>,
    forward: ForwardConfig,
) {
    let route = Route {
        node: forward.node.clone(),
        target: forward.target.clone(),
        tls: false,
    };
    while let Some((tcp, peer, permit)) = incoming.next().await {
        crate::io::net::tune(&tcp);
        let (router, opener) = (router.clone(), opener.clone());
        let route = route.clone();
        let span =
            tracing::debug_span!("conn", entry = "forward", client = %peer, target = %route.target);
        tokio::spawn(accept::hold(
            permit,
            async move {
                let addr = peer.to_string();
                let client = proxy::Client {
                    entry: "forward",
                    addr: &addr,
                };
                // The client waits for no answer, so its bytes may follow the dial request
                // at once.
                match opener.open_early(router.locate(Ok(route)), &client) {
                    Ok(dialing) => opener.run_early(dialing, &client, tcp).await,
                    // The client sees a reset at once rather than a silent close.
                    Err(_) => crate::io::net::abort_on_close(&tcp),
                }
            }
            .instrument(span),
        ));
    }
}
