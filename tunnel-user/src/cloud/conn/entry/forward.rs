//! Fixed TCP forwards: every connection to a listener goes to one node's target
//! (SuperEdge's tcp module, with the node named).

use std::sync::Arc;

use bytes::Bytes;
use tokio::net::{TcpListener, TcpStream};
use tracing::Instrument;

use super::Accepted;
use crate::addr::{ClientAddr, NodeName, Target};
use crate::cloud::conn::proxy::{Opener, Start};
use crate::cloud::conn::route::Route;
use crate::cloud::conn::router::{Ask, Router};
use crate::cloud::conn::shares::Who;
use crate::config::ForwardConfig;
use crate::io::accept::{self, Incoming};

pub(crate) async fn serve(
    router: Arc<Router>,
    opener: Arc<Opener>,
    mut incoming: Incoming<TcpListener>,
    forward: ForwardConfig,
) {
    // Validation checked a forward's node among the [[node]] names, and its target:
    // these never fail.
    let node = match forward.node.clone().map(NodeName::new).transpose() {
        Ok(node) => node,
        Err(e) => return tracing::error!(error = %e, "forward to an invalid node name"),
    };
    let target = match Target::parse(&forward.target) {
        Ok(target) => target,
        Err(e) => return tracing::error!(error = %e, "forward to an invalid target"),
    };
    let route = Route {
        node,
        target,
        tls: false,
    };
    while let Some((tcp, peer, permit)) = incoming.next().await {
        let (router, opener) = (router.clone(), opener.clone());
        let route = route.clone();
        let span =
            tracing::debug_span!("conn", entry = "forward", client = %peer, target = %route.target);
        let accepted = Accepted::new(tcp, ClientAddr::Tcp(peer));
        let who = Who::Address(peer.ip());
        let conn = handle(router, opener, accepted, who, route).instrument(span);
        tokio::spawn(accept::hold(permit, conn));
    }
}

/// Proxies one connection to the forward's node and target.
async fn handle(
    router: Arc<Router>,
    opener: Arc<Opener>,
    conn: Accepted<TcpStream>,
    who: Who,
    route: Route,
) {
    crate::io::net::tune(&conn.socket);
    // The client waits for no answer, so its bytes may follow the dial request at once.
    let routed = router.route(Ask::Forward(&route)).await;
    match opener
        .open(routed, "forward", conn.client, who, Start::Early)
        .await
    {
        Ok(dial) => opener.carry(dial, conn.socket, Bytes::new()).await,
        // The client sees a reset at once rather than a silent close.
        Err(_) => crate::io::net::abort_on_close(&conn.socket),
    }
}
