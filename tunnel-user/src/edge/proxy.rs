//! `[proxy]`: an HTTP CONNECT proxy on the edge for add-ons that take `HTTPS_PROXY`
//! (a metrics agent pushing to the cloud, an image puller). Each request becomes an
//! edge-to-cloud connection (`reverse::open`), so the cloud's `[reverse] allow` list for
//! this node decides, and the client gets the answer as an HTTP status: 403 outside the
//! list, 502 when the target refused, 504 when it did not answer in time.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tokio::net::{TcpListener, TcpStream};
use tracing::{Instrument, debug, info};

use super::reverse::{self, Reverse};
use crate::io::accept::{self, Incoming};
use crate::io::http_connect::read_head;
use crate::io::http_head::respond;
use crate::ops::metrics::ReasonLabel;

/// What the proxy needs: the edge-to-cloud side it opens connections through, the
/// bound on a request head, and where its results are counted.
pub(crate) struct Proxy {
    reverse: Arc<Reverse>,
    /// Bound on reading a request head (`transport.handshake_timeout`).
    head_timeout: Duration,
    /// Requests by result (the `proxy_requests` metric).
    requests: Family<ReasonLabel, Counter>,
}

impl Proxy {
    pub(crate) fn new(
        reverse: Arc<Reverse>,
        head_timeout: Duration,
        requests: Family<ReasonLabel, Counter>,
    ) -> Self {
        Self {
            reverse,
            head_timeout,
            requests,
        }
    }
}

/// Serves the proxy listener until shutdown.
pub(crate) async fn serve(proxy: Arc<Proxy>, mut incoming: Incoming<TcpListener>) {
    while let Some((tcp, client, permit)) = incoming.next().await {
        crate::io::net::tune(&tcp);
        let span = tracing::debug_span!("proxy", node = %proxy.reverse.node(), client = %client);
        let request = request(proxy.clone(), tcp, client).instrument(span);
        tokio::spawn(accept::hold(permit, request));
    }
}

async fn request(proxy: Arc<Proxy>, tcp: TcpStream, client: SocketAddr) {
    let result = answer(&proxy, tcp, client).await;
    proxy
        .requests
        .get_or_create(&ReasonLabel { reason: result })
        .inc();
}

/// Answers one request and relays its connection; gives the result's metric label.
async fn answer(proxy: &Proxy, mut tcp: TcpStream, client: SocketAddr) -> &'static str {
    // The head is bounded in size and, like the cloud's CONNECT entry, in time.
    let head = match tokio::time::timeout(proxy.head_timeout, read_head(&mut tcp)).await {
        Ok(Ok(head)) => head,
        Ok(Err(e)) => {
            info!(error = %e, "bad proxy request");
            let (status, reason) = e.status();
            respond(&mut tcp, status, reason, &e.to_string()).await;
            return "bad_request";
        }
        Err(_) => {
            info!("proxy request head not received in time");
            respond(&mut tcp, 408, "Request Timeout", "").await;
            return "head_timeout";
        }
    };
    let target = head.authority;
    match reverse::open(&proxy.reverse, client, &target).await {
        Ok(opened) => {
            debug!(%target, "proxy connection opened");
            respond(&mut tcp, 200, "Connection established", "").await;
            reverse::relay(&proxy.reverse, tcp, opened, head.rest).await;
            "ok"
        }
        Err(e) => {
            info!(%target, error = %e, "proxy request refused");
            let (status, reason) = e.http_status();
            respond(&mut tcp, status, reason, &e.to_string()).await;
            e.label()
        }
    }
}
