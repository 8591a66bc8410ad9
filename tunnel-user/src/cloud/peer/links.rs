//! This replica's links to the others: one connection to each, kept up with backoff,
//! carrying the other replica's route updates and the connections forwarded to it.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::RwLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use h2::RecvStream;
use h2::client::SendRequest;
use http::Request;
use proto::{DialRequest, FrameDecoder, PeerHello, RouteUpdate};
use rand::Rng;
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

use super::Peers;
use super::routes::apply_update;
use crate::cloud::session::{DialingStream, OpenError, OpenGuard};
use crate::transport;

/// Reconnect delays of a link: replicas restart in seconds, so retry soon.
const LINK_RETRY_MIN: Duration = Duration::from_millis(200);
const LINK_RETRY_MAX: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
enum LinkError {
    #[error("cannot connect: {0}")]
    Tcp(std::io::Error),
    #[error("TLS handshake failed: {0}")]
    Tls(std::io::Error),
    #[error("HTTP/2 failed: {0}")]
    H2(#[from] h2::Error),
    #[error("timed out")]
    Timeout,
    #[error("bad answer: {0}")]
    Protocol(String),
    #[error("no route update for {0:?}")]
    Silent(Duration),
    #[error("the address is this replica's own")]
    Itself,
}

/// The link to one other replica, by address.
pub struct Link {
    pub addr: String,
    state: RwLock<LinkState>,
    stop: CancellationToken,
    /// Forwarded connections open on the link right now.
    open_streams: Arc<AtomicUsize>,
}

#[derive(Default)]
struct LinkState {
    /// The peer's replica id, once it answered.
    replica: String,
    /// `None` while the link is down.
    sender: Option<SendRequest<Bytes>>,
    /// Node -> when its session there was established (Unix ms).
    nodes: HashMap<String, u64>,
}

impl Link {
    pub(super) fn new(addr: String, stop: CancellationToken) -> Self {
        Self {
            addr,
            state: RwLock::default(),
            stop,
            open_streams: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// When the node's session on this replica was established, if the link is up and
    /// the replica claims the node.
    pub(super) fn claim(&self, node: &str) -> Option<u64> {
        let state = self.read();
        state.sender.as_ref()?;
        state.nodes.get(node).copied()
    }

    pub(super) fn stop(&self) {
        self.stop.cancel();
    }

    pub fn replica(&self) -> String {
        let s = self.read();
        if s.replica.is_empty() {
            self.addr.clone()
        } else {
            s.replica.clone()
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, LinkState> {
        self.state.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, LinkState> {
        self.state.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Forwards one connection to this replica: returns as soon as the dial request is
    /// on its way, with the answer (the edge's, relayed) still to come.
    pub async fn dial(
        &self,
        peers: &Peers,
        request: &DialRequest,
    ) -> Result<DialingStream, OpenError> {
        let sender = self
            .read()
            .sender
            .clone()
            .ok_or_else(|| OpenError::Tunnel("the link to the replica is down".into()))?;
        let guard = OpenGuard::count(&self.open_streams);
        // The far replica bounds its own edge dial; a little more lets its answer win.
        let deadline =
            tokio::time::Instant::now() + peers.transport.dial_timeout + Duration::from_secs(4);
        let (send, answer) = crate::cloud::session::send_dial(
            &sender,
            proto::PEER_DIAL_PATH,
            request,
            Some(&peers.hello),
            deadline,
        )
        .await?;
        Ok(DialingStream::new(send, answer, guard))
    }
}

/// Keeps the link to one replica up until it is stopped.
pub(super) async fn run_link(peers: Arc<Peers>, link: Arc<Link>) {
    let mut delay = LINK_RETRY_MIN;
    let mut failures = 0u32;
    loop {
        let result = tokio::select! {
            r = link_session(&peers, &link) => r,
            () = link.stop.cancelled() => Ok(()),
        };
        let lost = {
            let mut state = link.write();
            let had = state.sender.take().is_some();
            state.nodes.clear();
            had
        };
        if lost {
            info!(replica = %link.replica(), forwarded_open = link.open_streams.load(Ordering::Relaxed), "link to replica lost; its routes are dropped");
            delay = LINK_RETRY_MIN;
            failures = 0;
        }
        if link.stop.is_cancelled() {
            return;
        }
        match result {
            Err(LinkError::Itself) => {
                debug!("peer address is this replica; not linking to it");
                return;
            }
            Ok(()) => debug!("link closed"),
            // Replicas start in any order: the first failure is worth a line, a peer
            // that stays away is not worth one every few seconds.
            Err(e) if failures == 0 => info!(error = %e, "cannot link to replica; retrying"),
            Err(e) => debug!(error = %e, "cannot link to replica"),
        }
        failures += 1;
        let jittered = delay.mul_f64(rand::rng().random_range(0.5..=1.0));
        tokio::select! {
            () = tokio::time::sleep(jittered) => {}
            () = link.stop.cancelled() => return,
        }
        delay = (delay * 2).min(LINK_RETRY_MAX);
    }
}

/// One connection to a replica: connects, subscribes to its routes and applies them
/// until the link breaks or the replica goes silent.
async fn link_session(peers: &Peers, link: &Link) -> Result<(), LinkError> {
    let Some(tls) = peers.tls() else {
        return Ok(());
    };
    let t = &peers.transport;
    let connect = async {
        let tcp = TcpStream::connect(&link.addr)
            .await
            .map_err(LinkError::Tcp)?;
        crate::net::tune(&tcp);
        let stream = tls
            .connector
            .connect(tls.server_name.clone(), tcp)
            .await
            .map_err(LinkError::Tls)?;
        Ok::<_, LinkError>(
            transport::client_builder(t)
                .handshake::<_, Bytes>(stream)
                .await?,
        )
    };
    let (sender, mut connection) = tokio::time::timeout(t.handshake_timeout, connect)
        .await
        .map_err(|_| LinkError::Timeout)??;
    // The connection must be polled for anything on it to move, including the
    // subscription below.
    let subscribe = async {
        let mut ready = sender.clone().ready().await?;
        let req = Request::post(format!("http://tunnel{}", proto::PEER_ROUTES_PATH))
            .header(proto::PEER_HELLO_HEADER, peers.hello.clone())
            .body(())
            .map_err(|e| LinkError::Protocol(e.to_string()))?;
        let (response, _send) = ready.send_request(req, false)?;
        let response = response.await?;
        Ok::<_, LinkError>((response, _send))
    };
    let (response, _keep_open) = tokio::select! {
        r = tokio::time::timeout(t.handshake_timeout, subscribe) => r.map_err(|_| LinkError::Timeout)??,
        r = &mut connection => return r.map_err(LinkError::from),
    };
    let hello: PeerHello =
        transport::decode_header(response.headers().get(proto::PEER_HELLO_HEADER))
            .map_err(|e| LinkError::Protocol(format!("peer hello {e}")))?;
    if hello.instance == peers.instance {
        return Err(LinkError::Itself);
    }
    {
        let mut state = link.write();
        state.replica = hello.replica_id.clone();
        state.sender = Some(sender);
    }
    info!(replica = %hello.replica_id, "linked to replica");
    tokio::select! {
        r = receive_routes(link, response.into_body(), t.heartbeat_timeout) => r,
        r = &mut connection => r.map_err(LinkError::from),
    }
}

async fn receive_routes(
    link: &Link,
    mut body: RecvStream,
    silence: Duration,
) -> Result<(), LinkError> {
    let mut decoder = FrameDecoder::default();
    loop {
        let data = match tokio::time::timeout(silence, body.data()).await {
            Err(_) => return Err(LinkError::Silent(silence)),
            Ok(None) => return Ok(()),
            Ok(Some(data)) => data?,
        };
        let _ = body.flow_control().release_capacity(data.len());
        decoder.push(&data);
        while let Some(update) = decoder
            .next_message::<RouteUpdate>()
            .map_err(|e| LinkError::Protocol(e.to_string()))?
        {
            let (held, released) = (update.held.len(), update.released.len());
            let changed = apply_update(&mut link.write().nodes, update);
            if changed {
                debug!(
                    held,
                    released,
                    nodes = link.read().nodes.len(),
                    "routes from replica changed"
                );
            }
        }
    }
}
