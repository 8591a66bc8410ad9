//! Forwarded dials as they were before gRPC, ALPN `tunnel-peer/1`: HTTP/2 with the
//! PeerHello and the DialRequest in base64 headers. Links still use it for forwarded
//! dials until those move to `Peer` too.

use std::sync::Arc;

use bytes::Bytes;
use h2::RecvStream;
use h2::server::SendResponse;
use http::{Request, Response};
use proto::{DialRequest, DialStatus, PeerHello};
use tokio::net::TcpStream;
use tokio_rustls::server::TlsStream;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, warn};

use crate::cloud::Cloud;
use crate::cloud::session::OpenError;
use crate::{splice_h2, transport};

/// Serves one replica's `tunnel-peer/1` connection (TLS done, certificate checked).
pub(super) async fn serve_link(
    cloud: Arc<Cloud>,
    tls: TlsStream<TcpStream>,
    shutdown: CancellationToken,
) -> Result<(), h2::Error> {
    let mut conn = transport::server_builder(&cloud.transport)
        .handshake::<_, Bytes>(tls)
        .await?;
    loop {
        tokio::select! {
            accepted = conn.accept() => match accepted {
                None => return Ok(()),
                Some(Err(e)) => return Err(e),
                Some(Ok((req, respond))) => dispatch(&cloud, req, respond),
            },
            () = shutdown.cancelled() => return Ok(()),
        }
    }
}

fn dispatch(cloud: &Arc<Cloud>, req: Request<RecvStream>, mut respond: SendResponse<Bytes>) {
    let from = transport::decode_header::<PeerHello>(req.headers().get(proto::PEER_HELLO_HEADER))
        .map(|h| h.replica_id)
        .unwrap_or_else(|_| "?".into());
    match req.uri().path() {
        proto::PEER_DIAL_PATH => {
            tokio::spawn(forwarded(cloud.clone(), req, respond, from));
        }
        path => {
            warn!(path, %from, "unknown stream path from a replica");
            let mut resp = Response::new(());
            *resp.status_mut() = http::StatusCode::NOT_FOUND;
            let _ = respond.send_response(resp, true);
        }
    }
}

/// A connection another replica forwarded here: served from this replica's own
/// session for the node, or refused at once; never forwarded again.
async fn forwarded(
    cloud: Arc<Cloud>,
    req: Request<RecvStream>,
    mut respond: SendResponse<Bytes>,
    from: String,
) {
    let request: DialRequest =
        match transport::decode_header(req.headers().get(proto::DIAL_REQUEST_HEADER)) {
            Ok(r) => r,
            Err(e) => {
                warn!(%from, error = %e, "bad forwarded dial request");
                let result = proto::DialResult {
                    status: DialStatus::BadRequest as i32,
                    message: format!("dial request {e}"),
                };
                let _ = respond.send_response(transport::dial_response(&result), true);
                return;
            }
        };
    cloud
        .metrics
        .connections
        .get_or_create(&crate::metrics::EntryLabel { entry: "peer" })
        .inc();
    let span = tracing::debug_span!("forwarded", id = request.connection_id, node = %request.node, target = %request.target, from = %from);
    async move {
        let Some(session) = cloud.registry.get(&request.node) else {
            let message = format!(
                "replica `{}` holds no edge session for node `{}` (forwarded connections are never forwarded again)",
                cloud.peers.replica_id, request.node
            );
            info!("forwarded connection refused: node not held here");
            let result = proto::DialResult { status: DialStatus::NotHeld as i32, message };
            let _ = respond.send_response(transport::dial_response(&result), true);
            return;
        };
        let dialing = match session.dial(&request).await {
            Ok(dialing) => dialing,
            Err(e) => {
                info!(error = %e, "forwarded connection failed");
                let _ = respond.send_response(transport::dial_response(&e.dial_result()), true);
                return;
            }
        };
        // The forwarding replica's bytes go on to the edge at once, right behind the
        // dial request (the client may be one that waits for nothing); the edge's answer
        // goes back to the forwarding replica when it comes.
        let (edge_send, answer, guard) = dialing.into_parts();
        let answer = async move {
            match answer.wait().await {
                Ok(edge_recv) => {
                    let ok = proto::DialResult { status: DialStatus::Ok as i32, message: String::new() };
                    let send = respond
                        .send_response(transport::dial_response(&ok), false)
                        .map_err(|e| OpenError::Tunnel(format!("the forwarding replica went away: {e}")))?;
                    Ok((edge_recv, send))
                }
                Err(e) => {
                    let _ = respond.send_response(transport::dial_response(&e.dial_result()), true);
                    Err(e)
                }
            }
        };
        let report = splice_h2::relay_dialing(req.into_body(), edge_send, answer).await;
        drop(guard);
        match &report.refused {
            Some(e) => info!(error = %e, "forwarded connection failed"),
            None => debug!(to_edge = report.a_to_b, from_edge = report.b_to_a, aborted = ?report.aborted, "forwarded connection ended"),
        }
    }
    .instrument(span)
    .await
}
