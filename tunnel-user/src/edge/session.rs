//! One session of the edge with the cloud: the HTTP/2 server side of the edge's TLS
//! connection. The cloud opens the streams: one control stream, and one per proxied
//! connection.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use h2::RecvStream;
use h2::server::SendResponse;
use http::{Request, Response, StatusCode};
use proto::{Control, DialRequest, DialResult, DialStatus, FrameDecoder, control};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, warn};

use super::Edge;
use crate::metrics::ReasonLabel;
use crate::splice::Meter;
use crate::transport;

/// How a session ended without failing.
#[derive(Debug, PartialEq, Eq)]
pub enum Ended {
    /// The cloud closed the connection, or we are shutting down.
    Closed,
    /// The cloud asked us to move to another replica. Its connection keeps carrying the
    /// streams already open on it, in the background, until the cloud closes it.
    Drained,
}

/// What the tasks of one session share.
struct SessionState {
    started: Instant,
    /// Milliseconds since `started` of the last heartbeat from the cloud.
    last_ping: AtomicU64,
    drained: tokio::sync::Notify,
}

/// Serves the session until the connection ends, the cloud stops sending heartbeats for
/// `heartbeat_timeout`, the cloud drains it, or `shutdown`. Returns why it ended.
pub async fn serve<T>(
    edge: &Arc<Edge>,
    io: T,
    heartbeat_timeout: Duration,
    shutdown: &CancellationToken,
) -> Result<Ended, String>
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let mut conn = transport::server_builder(&edge.config.transport)
        .handshake::<_, Bytes>(io)
        .await
        .map_err(|e| e.to_string())?;
    let state = Arc::new(SessionState {
        started: Instant::now(),
        last_ping: AtomicU64::new(0),
        drained: tokio::sync::Notify::new(),
    });
    let mut watchdog = tokio::time::interval(heartbeat_timeout / 4);
    loop {
        tokio::select! {
            accepted = conn.accept() => match accepted {
                None => return Ok(Ended::Closed),
                Some(Err(e)) => return Err(e.to_string()),
                Some(Ok((req, respond))) => dispatch(edge, req, respond, &state),
            },
            _ = watchdog.tick() => {
                let since = state.started.elapsed().saturating_sub(Duration::from_millis(state.last_ping.load(Ordering::Relaxed)));
                if since > heartbeat_timeout {
                    return Err(format!("no heartbeat from the cloud for {since:?}"));
                }
            }
            () = state.drained.notified() => {
                // The connection must still be driven for its open streams to move.
                let (edge, state) = (edge.clone(), state.clone());
                tokio::spawn(async move {
                    while let Some(Ok((req, respond))) = conn.accept().await {
                        dispatch(&edge, req, respond, &state);
                    }
                    info!("drained session closed");
                });
                return Ok(Ended::Drained);
            }
            () = shutdown.cancelled() => {
                conn.graceful_shutdown();
                // Let the GOAWAY reach the cloud; the streams end with the process.
                let _ = tokio::time::timeout(Duration::from_secs(1), std::future::poll_fn(|cx| conn.poll_closed(cx))).await;
                return Ok(Ended::Closed);
            }
        }
    }
}

fn dispatch(
    edge: &Arc<Edge>,
    req: Request<RecvStream>,
    mut respond: SendResponse<Bytes>,
    state: &Arc<SessionState>,
) {
    match req.uri().path() {
        proto::CONTROL_PATH => {
            tokio::spawn(control(
                edge.clone(),
                req.into_body(),
                respond,
                state.clone(),
            ));
        }
        proto::DIAL_PATH => {
            let edge = edge.clone();
            tokio::spawn(dial(edge, req, respond));
        }
        proto::REVERSE_PATH => super::reverse::accept_stream(edge, req, respond),
        path => {
            warn!(path, "unknown stream path from the cloud");
            let mut resp = Response::new(());
            *resp.status_mut() = StatusCode::NOT_FOUND;
            let _ = respond.send_response(resp, true);
        }
    }
}

/// Answers every Ping with a Pong and notes when it came; passes a Drain on; sends the
/// edge-to-cloud connections' OpenReverse requests.
async fn control(
    edge: Arc<Edge>,
    recv: RecvStream,
    mut respond: SendResponse<Bytes>,
    state: Arc<SessionState>,
) {
    let Ok(send) = respond.send_response(Response::new(()), false) else {
        return;
    };
    // As deep as the number of connections that may wait, so a burst of them never
    // finds it full while the stream is healthy.
    let (tx, rx) = tokio::sync::mpsc::channel(edge.config.reverse.max_pending);
    edge.reverse.attach(tx.clone());
    control_loop(&edge, recv, send, rx, &state).await;
    edge.reverse.detach(&tx);
}

async fn control_loop(
    edge: &Edge,
    mut recv: RecvStream,
    mut send: h2::SendStream<Bytes>,
    mut outgoing: tokio::sync::mpsc::Receiver<Control>,
    state: &SessionState,
) {
    let mut decoder = FrameDecoder::default();
    // Only a token file changes under us (the kubelet rotates projected tokens); the
    // cloud re-checks the token it has on its own as well.
    let rotating = edge.config.cloud.token_file.is_some();
    let mut reauth = tokio::time::interval_at(
        tokio::time::Instant::now() + edge.config.cloud.reauth_interval,
        edge.config.cloud.reauth_interval,
    );
    loop {
        let data = tokio::select! {
            data = recv.data() => data,
            Some(msg) = outgoing.recv() => {
                if send.send_data(proto::encode_frame(&msg), false).is_err() {
                    return;
                }
                continue;
            }
            _ = reauth.tick(), if rotating => {
                match super::load_token(&edge.config) {
                    Ok(token) => {
                        let msg = Control { msg: Some(control::Msg::Reauth(proto::Reauth { token })) };
                        if send.send_data(proto::encode_frame(&msg), false).is_err() {
                            return;
                        }
                        debug!("sent the current token to the cloud");
                    }
                    // The cloud keeps checking the token it has; it ends the session
                    // if that one stops being valid.
                    Err(e) => warn!(error = %e, "cannot re-read the token to send it to the cloud"),
                }
                continue;
            }
        };
        let Some(data) = data else { return };
        let Ok(data) = data else { return };
        let _ = recv.flow_control().release_capacity(data.len());
        decoder.push(&data);
        loop {
            let msg = match decoder.next_message::<Control>() {
                Ok(Some(msg)) => msg,
                Ok(None) => break,
                Err(e) => {
                    warn!(error = %e, "malformed control message from the cloud");
                    send.send_reset(h2::Reason::PROTOCOL_ERROR);
                    return;
                }
            };
            match msg.msg {
                Some(control::Msg::Ping(p)) => {
                    state.last_ping.store(
                        state.started.elapsed().as_millis() as u64,
                        Ordering::Relaxed,
                    );
                    edge.metrics.heartbeat_rtt_us.set(p.last_rtt_us as i64);
                    debug!(rtt_us = p.last_rtt_us, "heartbeat");
                    let pong = Control {
                        msg: Some(control::Msg::Pong(proto::Pong {
                            sequence: p.sequence,
                        })),
                    };
                    if send.send_data(proto::encode_frame(&pong), false).is_err() {
                        return;
                    }
                }
                Some(control::Msg::Drain(d)) => {
                    info!(reason = %d.reason, "cloud asked this edge to move to another replica");
                    state.drained.notify_one();
                }
                Some(control::Msg::Error(e)) => {
                    warn!(message = %e.message, "cloud reported an error")
                }
                other => debug!(?other, "unexpected control message from the cloud"),
            }
        }
    }
}

/// The connection to a target: plain, or TLS the edge originated.
enum Target {
    Tcp(tokio::net::TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>),
}

/// Originates TLS to the target with the `[https]` client certificate, bounded by what
/// is left of the dial timeout (one bound for TCP plus TLS, so the cloud hears the
/// edge's answer before its own bound on the dial).
async fn tls_to_target(
    edge: &Edge,
    tcp: tokio::net::TcpStream,
    target: &str,
    budget: Duration,
) -> Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>, (DialStatus, String)> {
    let host = target
        .rsplit_once(':')
        .map(|(h, _)| h.trim_start_matches('[').trim_end_matches(']'))
        .unwrap_or(target);
    let name =
        crate::tls::server_name(host).map_err(|e| (DialStatus::BadRequest, e.to_string()))?;
    tokio::time::timeout(budget, edge.target_tls.connect(name, tcp))
        .await
        .map_err(|_| {
            (
                DialStatus::Timeout,
                format!(
                    "TLS handshake with {target} timed out (the dial's bound is {:?})",
                    edge.config.transport.dial_timeout
                ),
            )
        })?
        .map_err(|e| {
            (
                DialStatus::Refused,
                format!("TLS handshake with {target}: {e}"),
            )
        })
}

fn status_label(status: DialStatus) -> &'static str {
    match status {
        DialStatus::Ok => "ok",
        DialStatus::Forbidden => "forbidden",
        DialStatus::Refused => "refused",
        DialStatus::Timeout => "timeout",
        DialStatus::BadRequest => "bad_request",
        DialStatus::Overloaded => "overloaded",
        // Cloud-to-cloud answers; an edge never gives them.
        DialStatus::NotHeld => "not_held",
        DialStatus::TunnelFailed => "tunnel_failed",
        DialStatus::Unspecified => "unspecified",
    }
}

fn result_response(status: DialStatus, message: String) -> Response<()> {
    transport::dial_response(&DialResult {
        status: status as i32,
        message,
    })
}

async fn dial(edge: Arc<Edge>, req: Request<RecvStream>, mut respond: SendResponse<Bytes>) {
    let request: DialRequest =
        match transport::decode_header(req.headers().get(proto::DIAL_REQUEST_HEADER)) {
            Ok(r) => r,
            Err(e) => {
                warn!(error = %e, "bad dial request from the cloud");
                let _ = respond.send_response(
                    result_response(DialStatus::BadRequest, format!("dial request {e}")),
                    true,
                );
                return;
            }
        };
    let span = tracing::debug_span!("conn", id = request.connection_id, target = %request.target, client = %request.client);
    async move {
        let t = &edge.config.transport;
        let started = Instant::now();
        let dialed = match super::dial::dial(&edge.allow, &request.target, t.dial_timeout).await {
            Ok(tcp) if request.tls => {
                let budget = t.dial_timeout.saturating_sub(started.elapsed());
                tls_to_target(&edge, tcp, &request.target, budget)
                    .await
                    .map(|tls| Target::Tls(Box::new(tls)))
            }
            Ok(tcp) => Ok(Target::Tcp(tcp)),
            Err(e) => Err(e),
        };
        let outcome = match &dialed {
            Ok(_) => DialStatus::Ok,
            Err((status, _)) => *status,
        };
        edge.metrics
            .dials
            .get_or_create(&ReasonLabel {
                reason: status_label(outcome),
            })
            .inc();
        let target = match dialed {
            Ok(target) => target,
            Err((status, message)) => {
                match status {
                    DialStatus::Forbidden => {
                        warn!(%message, "refused a target outside the allowlist")
                    }
                    _ => info!(%message, "dial failed"),
                }
                let _ = respond.send_response(result_response(status, message), true);
                return;
            }
        };
        edge.metrics
            .dial_seconds
            .observe(started.elapsed().as_secs_f64());
        let Ok(send) = respond.send_response(result_response(DialStatus::Ok, String::new()), false)
        else {
            return;
        };
        let meter = Meter::new(edge.metrics.bytes.clone());
        let (recv, chunk) = (req.into_body(), t.chunk_size);
        let end = match target {
            Target::Tcp(tcp) => {
                crate::splice::splice(tcp, send, recv, Bytes::new(), chunk, &meter).await
            }
            Target::Tls(tls) => {
                crate::splice::splice(*tls, send, recv, Bytes::new(), chunk, &meter).await
            }
        };
        debug!(
            to_cloud = meter.to_tunnel(),
            from_cloud = meter.from_tunnel(),
            ?end,
            "connection ended"
        );
    }
    .instrument(span)
    .await
}
