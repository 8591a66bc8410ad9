//! HTTP CONNECT proxy on TCP and on a unix socket: `CONNECT host:port`, where host is a
//! node name or a node address. This is what kube-apiserver's
//! EgressSelectorConfiguration `HTTPConnect` sends, and what `curl -x` sends.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, UnixListener};
use tracing::{Instrument, info};

use super::Accepted;
use crate::addr::ClientAddr;
use crate::call::copy::Socket;
use crate::cloud::conn::proxy::{Opener, Start};
use crate::cloud::conn::router::{Ask, Router};
use crate::cloud::conn::shares::Who;
use crate::config::OptimisticOk;
use crate::io::accept::{self, Incoming};
use crate::io::http_connect::read_head;
use crate::io::http_head::respond;

/// How the CONNECT entries answer, from `[connect]` and `[transport]`.
#[derive(Clone, Copy)]
pub(crate) struct Answer {
    /// `connect.optimistic_ok`: when the 200 comes before the edge's dial result.
    pub(crate) optimistic: OptimisticOk,
    /// The request head is bounded by the handshake timeout (10 s unless configured).
    pub(crate) head_timeout: Duration,
}

pub(crate) async fn serve_tcp(
    router: Arc<Router>,
    opener: Arc<Opener>,
    mut incoming: Incoming<TcpListener>,
    answer: Answer,
) {
    while let Some((tcp, peer, permit)) = incoming.next().await {
        crate::io::net::tune(&tcp);
        let (router, opener) = (router.clone(), opener.clone());
        let span = tracing::debug_span!("conn", entry = "connect", client = %peer);
        let accepted = Accepted::new(tcp, ClientAddr::Tcp(peer));
        let who = Who::Address(peer.ip());
        let conn = handle(router, opener, accepted, who, "connect", answer).instrument(span);
        tokio::spawn(accept::hold(permit, conn));
    }
}

pub(crate) async fn serve_unix(
    router: Arc<Router>,
    opener: Arc<Opener>,
    mut incoming: Incoming<UnixListener>,
    answer: Answer,
) {
    while let Some((stream, _, permit)) = incoming.next().await {
        let (router, opener) = (router.clone(), opener.clone());
        let span = tracing::debug_span!("conn", entry = "connect-unix");
        // Only root (the socket is 0600) connects here; the user still tells clients
        // apart where a config opens the socket wider.
        let who = Who::User(stream.peer_cred().map_or(u32::MAX, |c| c.uid()));
        let accepted = Accepted::new(stream, ClientAddr::Unix);
        let conn = handle(router, opener, accepted, who, "connect-unix", answer).instrument(span);
        tokio::spawn(accept::hold(permit, conn));
    }
}

/// Reads the CONNECT head, then answers it: 200 and the copy, or the error's status.
async fn handle<S>(
    router: Arc<Router>,
    opener: Arc<Opener>,
    conn: Accepted<S>,
    who: Who,
    entry: &'static str,
    answer: Answer,
) where
    S: Socket + AsyncRead + AsyncWrite + Unpin,
{
    let Accepted {
        mut socket, client, ..
    } = conn;
    let head = match tokio::time::timeout(answer.head_timeout, read_head(&mut socket)).await {
        Ok(Ok(head)) => head,
        Ok(Err(e)) => {
            info!(%client, error = %e, "bad CONNECT request");
            let (status, reason) = e.status();
            respond(&mut socket, status, reason, &e.to_string()).await;
            return;
        }
        Err(_) => {
            info!(%client, "CONNECT request head not received in time");
            respond(&mut socket, 408, "Request Timeout", "").await;
            return;
        }
    };
    // Optimistic: the dial is routed and prepared, answered now, and the bytes the
    // client sends after the 200 go with the dial request as a forward's do. A refusal
    // by the edge then resets the client; the 200 has already been sent.
    let start = match answer.optimistic {
        OptimisticOk::Never => Start::Answered,
        OptimisticOk::Recent => Start::EarlyIfRecent,
        OptimisticOk::Always => Start::Early,
    };
    let routed = router.route(Ask::Connect(&head.authority)).await;
    match opener.open(routed, entry, client, who, start).await {
        Ok(dial) => {
            respond(&mut socket, 200, "Connection established", "").await;
            opener.carry(dial, socket, head.rest).await;
        }
        Err(e) => {
            let (status, reason) = e.http_status();
            respond(&mut socket, status, reason, &e.to_string()).await;
        }
    }
}
