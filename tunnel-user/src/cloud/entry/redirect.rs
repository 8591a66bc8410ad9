//! The generic entry: an accepted socket whose original destination is known (the eBPF
//! redirect recovers it). The destination names the node and is what the edge dials.

use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::cloud::proxy::{self, Opener};
use crate::cloud::route;
use crate::cloud::router::Router;
use crate::intercept::{Counters, Interceptor};

/// The eBPF programs that send connections here, while the redirect is on: what the
/// redirect entry, the node table (the edge map) and the metrics use of them.
#[derive(Default)]
pub struct Programs {
    /// None without `redirect.enabled`, and after `detach`.
    loaded: RwLock<Option<Interceptor>>,
}

impl Programs {
    pub fn new(loaded: Option<Interceptor>) -> Self {
        Self {
            loaded: RwLock::new(loaded),
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Option<Interceptor>> {
        self.loaded.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Where a connection from `peer` was going (sock_ops recorded it under the client's
    /// address); taken, so it is found once.
    pub fn take_original_dst(&self, peer: SocketAddr) -> Option<SocketAddr> {
        self.read().as_ref()?.take_original_dst(peer)
    }

    /// How much is left of the window after taking over from a predecessor.
    pub fn takeover_left(&self) -> Option<Duration> {
        self.read().as_ref()?.takeover_left()
    }

    /// Makes the eBPF edge map the addresses of `nodes`.
    pub fn set_edges(&self, nodes: &route::NodeTable) {
        if let Some(programs) = self.read().as_ref()
            && let Err(e) = programs.set_edges(&edge_ips(nodes))
        {
            tracing::error!(error = %e, "cannot update the eBPF edge map");
        }
    }

    /// Keeps the programs redirecting for another `redirect.fail_open_after`.
    pub fn keep_alive(&self) {
        if let Some(programs) = self.read().as_ref()
            && let Err(e) = programs.keep_alive()
        {
            tracing::error!(error = %e, "cannot push the eBPF redirect's deadline forward");
        }
    }

    /// Until `shutdown`: [`Programs::keep_alive`] four times per `fail_open_after`, so a
    /// late tick or two never lets the redirect lapse under a running cloud. The first
    /// comes a period in: linking the programs has just renewed it.
    pub async fn keep_alive_until(&self, fail_open_after: Duration, shutdown: CancellationToken) {
        let period = fail_open_after / 4;
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => self.keep_alive(),
                () = shutdown.cancelled() => return,
            }
        }
    }

    pub fn counters(&self) -> Option<Counters> {
        self.read().as_ref().map(Interceptor::counters)
    }

    /// Detaches the programs now (at shutdown), not at some later drop.
    pub fn detach(&self) {
        let programs = self
            .loaded
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        drop(programs);
    }
}

/// Accepts connections the eBPF program redirected here and recovers where each was
/// going from the peer address (sock_ops recorded it under the client's address).
pub async fn serve(
    router: Arc<Router>,
    opener: Arc<Opener>,
    programs: Arc<Programs>,
    listener: TcpListener,
    shutdown: CancellationToken,
) {
    while let Some((tcp, peer)) =
        super::next_conn(|| listener.accept(), &shutdown, "redirect").await
    {
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
        tokio::spawn(
            async move { handle(&router, &opener, tcp, original_dst, takeover_left).await }
                .instrument(span),
        );
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

/// The addresses of the node table (both families), for the eBPF edge maps.
pub fn edge_ips(nodes: &route::NodeTable) -> Vec<std::net::IpAddr> {
    let mut ips: Vec<_> = nodes.all_addresses().collect();
    ips.sort();
    ips
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
