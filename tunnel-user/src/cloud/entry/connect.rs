//! HTTP CONNECT proxy on TCP and on a unix socket: `CONNECT host:port`, where host is a
//! node name or a node address. This is what kube-apiserver's
//! EgressSelectorConfiguration `HTTPConnect` sends, and what `curl -x` sends.

use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, UnixListener};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info};

use crate::cloud::{Cloud, proxy, route};
use crate::io::http_connect::{read_head, respond};
use crate::stream::copy::Socket;

/// `optimistic`: `connect.optimistic_ok`, 200 before the edge's dial result.
pub async fn serve_tcp(
    cloud: Arc<Cloud>,
    listener: TcpListener,
    optimistic: bool,
    shutdown: CancellationToken,
) {
    while let Some((tcp, peer)) = super::next_conn(|| listener.accept(), &shutdown, "connect").await
    {
        crate::io::net::tune(&tcp);
        let cloud = cloud.clone();
        let span = tracing::debug_span!("conn", entry = "connect", client = %peer);
        tokio::spawn(
            async move { handle(&cloud, tcp, "connect", peer.to_string(), optimistic).await }
                .instrument(span),
        );
    }
}

pub async fn serve_unix(
    cloud: Arc<Cloud>,
    listener: UnixListener,
    optimistic: bool,
    shutdown: CancellationToken,
) {
    while let Some((stream, _)) =
        super::next_conn(|| listener.accept(), &shutdown, "connect-unix").await
    {
        let cloud = cloud.clone();
        let span = tracing::debug_span!("conn", entry = "connect-unix");
        tokio::spawn(
            async move { handle(&cloud, stream, "connect-unix", "unix".into(), optimistic).await }
                .instrument(span),
        );
    }
}

async fn handle<S>(
    cloud: &Cloud,
    mut stream: S,
    entry: &'static str,
    client: String,
    optimistic: bool,
) where
    S: Socket + AsyncRead + AsyncWrite + Unpin,
{
    // The head is bounded by the handshake timeout (10 s unless configured).
    let head = match tokio::time::timeout(cloud.transport.handshake_timeout, read_head(&mut stream))
        .await
    {
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
    let routed = route::route_connect(&cloud.nodes(), &head.authority, |n| cloud.is_connected(n));
    let client = proxy::Client {
        entry,
        addr: &client,
    };
    if optimistic {
        // The dial request is on its way: answer now, and let the bytes the client sends
        // after the 200 follow it as a forward's do. A refusal by the edge resets the
        // client; the 200 has already been sent.
        match proxy::open_early(cloud, routed, &client).await {
            Ok(dialing) => {
                respond(&mut stream, 200, "Connection established", "").await;
                proxy::run_early_after(cloud, dialing, &client, stream, head.rest).await;
            }
            Err(e) => {
                let (status, reason) = e.http_status();
                respond(&mut stream, status, reason, &e.to_string()).await;
            }
        }
        return;
    }
    match proxy::open(cloud, routed, &client).await {
        Ok(opened) => {
            respond(&mut stream, 200, "Connection established", "").await;
            proxy::run(cloud, opened, &client, stream, head.rest).await;
        }
        Err(e) => {
            let (status, reason) = e.http_status();
            respond(&mut stream, status, reason, &e.to_string()).await;
        }
    }
}
