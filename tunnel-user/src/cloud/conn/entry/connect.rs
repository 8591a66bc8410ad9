//! HTTP CONNECT proxy on TCP and on a unix socket: `CONNECT host:port`, where host is a
//! node name or a node address. This is what kube-apiserver's
//! EgressSelectorConfiguration `HTTPConnect` sends, and what `curl -x` sends.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, UnixListener};
use tracing::{Instrument, info};

use crate::cloud::conn::proxy::{self, Opener};
use crate::cloud::conn::router::Router;
use crate::io::accept::{self, Incoming};
use crate::io::http_connect::read_head;
use crate::io::http_head::respond;
use crate::stream::copy::Socket;

/// How the CONNECT entries answer, from `[connect]` and `[transport]`.
#[derive(Clone, Copy)]
pub struct Answer {
    /// `connect.optimistic_ok`: 200 before the edge's dial result.
    pub optimistic: bool,
    /// The request head is bounded by the handshake timeout (10 s unless configured).
    pub head_timeout: Duration,
}

pub async fn serve_tcp(
    router: Arc<Router>,
    opener: Arc<Opener>,
    mut incoming: Incoming<TcpListener>,
    answer: Answer,
) {
    while let Some((tcp, peer, permit)) = incoming.next().await {
        crate::io::net::tune(&tcp);
        let (router, opener) = (router.clone(), opener.clone());
        let span = tracing::debug_span!("conn", entry = "connect", client = %peer);
        tokio::spawn(accept::hold(
            permit,
            async move {
                let client = peer.to_string();
                handle(&router, &opener, tcp, "connect", client, answer).await
            }
            .instrument(span),
        ));
    }
}

pub async fn serve_unix(
    router: Arc<Router>,
    opener: Arc<Opener>,
    mut incoming: Incoming<UnixListener>,
    answer: Answer,
) {
    while let Some((stream, _, permit)) = incoming.next().await {
        let (router, opener) = (router.clone(), opener.clone());
        let span = tracing::debug_span!("conn", entry = "connect-unix");
        tokio::spawn(accept::hold(
            permit,
            async move {
                let client = "unix".to_string();
                handle(&router, &opener, stream, "connect-unix", client, answer).await
            }
            .instrument(span),
        ));
    }
}

async fn handle<S>(
    router: &Router,
    opener: &Opener,
    mut stream: S,
    entry: &'static str,
    client: String,
    answer: Answer,
) where
    S: Socket + AsyncRead + AsyncWrite + Unpin,
{
    let head = match tokio::time::timeout(answer.head_timeout, read_head(&mut stream)).await {
        Ok(Ok(head)) => head,
        Ok(Err(e)) => {
            info!(%client, error = %e, "bad CONNECT request");
            let (status, reason) = e.status();
            respond(&mut stream, status, reason, &e.to_string()).await;
            return;
        }
        Err(_) => {
            info!(%client, "CONNECT request head not received in time");
            respond(&mut stream, 408, "Request Timeout", "").await;
            return;
        }
    };
    let located = router.locate(router.connect(&head.authority));
    let client = proxy::Client {
        entry,
        addr: &client,
    };
    if answer.optimistic {
        // The dial is routed and prepared: answer now, and let the bytes the client
        // sends after the 200 go with the dial request as a forward's do. A refusal by
        // the edge resets the client; the 200 has already been sent.
        match opener.open_early(located, &client) {
            Ok(dialing) => {
                respond(&mut stream, 200, "Connection established", "").await;
                opener
                    .run_early_after(dialing, &client, stream, head.rest)
                    .await;
            }
            Err(e) => {
                let (status, reason) = e.http_status();
                respond(&mut stream, status, reason, &e.to_string()).await;
            }
        }
        return;
    }
    match opener.open(located, &client).await {
        Ok(opened) => {
            respond(&mut stream, 200, "Connection established", "").await;
            opener.run(opened, &client, stream, head.rest).await;
        }
        Err(e) => {
            let (status, reason) = e.http_status();
            respond(&mut stream, status, reason, &e.to_string()).await;
        }
    }
}
