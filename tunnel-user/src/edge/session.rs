//! One session of the edge with the cloud: the gRPC server side (service `Edge`) of the
//! edge's TLS connection, and its control plane. The cloud makes the calls: Control
//! first (registration, then heartbeats, drains, renewals), which this module serves,
//! then one Dial per cloud-to-edge connection and one Reverse per edge-to-cloud
//! connection, which `call::serve::Calls` serves.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use h2::server::Connection;
use proto::edge_server::{Edge as EdgeService, EdgeServer};
use proto::{Control, Hello, HelloReply, Welcome, control};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{mpsc, oneshot, watch};
// Tokio's clock, which a test's paused runtime moves (tests/common/inproc.rs).
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};
use tracing::{Instrument, debug, info, warn};

use super::Edge;
use crate::call::serve::Calls;
use crate::csr::ClientCert;
use crate::io::transport::{self, Outgoing};

/// How a session ended without failing.
#[derive(Debug)]
pub(crate) enum Ended {
    /// The cloud closed the connection, or we are shutting down.
    Closed,
    /// The cloud asked us to move to another replica. Its connection keeps carrying the
    /// calls already open on it, in the background, until the cloud closes it or the
    /// [`Draining`] is dropped.
    Drained(Draining),
}

/// The connection of a drained session, served in the background for the calls still
/// open on it. Dropping it closes the connection, and the calls with it.
#[derive(Debug)]
pub(crate) struct Draining(tokio::task::JoinHandle<()>);

impl Draining {
    /// Whether the cloud has not closed the connection yet.
    pub(crate) fn is_open(&self) -> bool {
        !self.0.is_finished()
    }
}

impl Drop for Draining {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Why registering on a connection failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RegisterError {
    #[error("the cloud rejected this edge ({reason:?}): {message}")]
    Rejected {
        reason: proto::RejectReason,
        message: String,
    },
    #[error("the cloud answered the hello with nothing")]
    EmptyReply,
    #[error("the connection ended before the cloud answered the hello: {0}")]
    Closed(String),
}

/// What the tasks of one session share.
struct SessionState {
    started: Instant,
    /// Milliseconds since `started` of the last heartbeat from the cloud.
    last_ping: AtomicU64,
    drained: tokio::sync::Notify,
    /// The Hello and where the cloud's answer goes, until the Control call takes them,
    /// with what a certificate renewal needs on this session.
    registration: std::sync::Mutex<Option<Registration>>,
}

type Registration = (Hello, oneshot::Sender<HelloReply>, Option<Renewal>);

/// The client certificate from the cluster as it is renewed, and this connection's
/// keying material (`io::tls::renewal_exporter`): each renewed certificate goes to the
/// cloud on the Control call with a signature over it by the new key.
pub(crate) struct Renewal {
    pub(crate) certs: watch::Receiver<Arc<ClientCert>>,
    pub(crate) exporter: [u8; 32],
}

/// A registered session: the connection, served until it ends.
pub(crate) struct Session<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> {
    conn: Connection<T, Bytes>,
    /// Control through tonic's generated server, the byte streams by `call::serve`.
    calls: Calls<EdgeServer<Service>, Edge>,
    state: Arc<SessionState>,
}

/// Serves the gRPC side of a fresh connection to the cloud until the cloud has answered
/// `hello` on the Control call; returns the session and the cloud's welcome. The caller
/// bounds the time it takes.
pub(crate) async fn register<T>(
    edge: &Arc<Edge>,
    io: T,
    hello: Hello,
    renewal: Option<Renewal>,
) -> Result<(Session<T>, Welcome), RegisterError>
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (reply_tx, reply_rx) = oneshot::channel();
    let state = Arc::new(SessionState {
        started: Instant::now(),
        last_ping: AtomicU64::new(0),
        drained: tokio::sync::Notify::new(),
        registration: std::sync::Mutex::new(Some((hello, reply_tx, renewal))),
    });
    let service = Service {
        edge: edge.clone(),
        state: state.clone(),
    };
    let control = EdgeServer::new(service).max_decoding_message_size(proto::MAX_MESSAGE_LEN);
    let calls = Calls::new(control, edge.clone());
    let mut conn = transport::server_handshake(&edge.transport, io)
        .await
        .map_err(|e| RegisterError::Closed(e.to_string()))?;
    let reply = tokio::select! {
        r = calls.serve(&mut conn) => return Err(RegisterError::Closed(match r {
            Ok(()) => "closed".into(),
            Err(e) => e.to_string(),
        })),
        reply = reply_rx => reply.map_err(|_| RegisterError::Closed("the Control call ended".into()))?,
    };
    match reply.result {
        Some(proto::hello_reply::Result::Welcome(w)) => Ok((Session { conn, calls, state }, w)),
        Some(proto::hello_reply::Result::Reject(r)) => Err(RegisterError::Rejected {
            reason: r.reason(),
            message: r.message,
        }),
        None => Err(RegisterError::EmptyReply),
    }
}

/// Why a session failed (rather than ended: see [`Ended`]).
#[derive(Debug, thiserror::Error)]
pub(crate) enum SessionError {
    /// The HTTP/2 connection to the cloud failed.
    #[error("{0}")]
    Connection(h2::Error),
    #[error("no heartbeat from the cloud for {0:?}")]
    NoHeartbeat(Duration),
}

impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> Session<T> {
    /// Serves the session until the connection ends, the cloud stops sending heartbeats
    /// for `heartbeat_timeout`, the cloud drains it, or `shutdown`. Returns why it ended.
    pub(crate) async fn serve(
        self,
        heartbeat_timeout: Duration,
        shutdown: &CancellationToken,
    ) -> Result<Ended, SessionError> {
        let Session {
            mut conn,
            calls,
            state,
        } = self;
        let mut watchdog = tokio::time::interval(heartbeat_timeout / 4);
        loop {
            tokio::select! {
                r = calls.serve(&mut conn) => return match r {
                    Ok(()) => Ok(Ended::Closed),
                    Err(e) => Err(SessionError::Connection(e)),
                },
                _ = watchdog.tick() => {
                    let since = state.started.elapsed().saturating_sub(Duration::from_millis(state.last_ping.load(Ordering::Relaxed)));
                    if since > heartbeat_timeout {
                        return Err(SessionError::NoHeartbeat(since));
                    }
                }
                () = state.drained.notified() => {
                    // The connection must still be driven for its open calls to move.
                    let draining = tokio::spawn(async move {
                        let _ = calls.serve(&mut conn).await;
                        info!("drained session closed");
                    }.in_current_span());
                    return Ok(Ended::Drained(Draining(draining)));
                }
                () = shutdown.cancelled() => {
                    // No new calls (GOAWAY); those open finish first. In a rolling update
                    // the new pod's edge has registered by now (its readiness), and the
                    // cloud sends the node's new connections to the newest session.
                    conn.graceful_shutdown();
                    let open = calls.open().clone();
                    let finished = async {
                        // At least one round, for the GOAWAY to reach the cloud.
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        open.idle().await;
                    };
                    let drained = tokio::time::timeout(SHUTDOWN_DRAIN, async {
                        tokio::select! {
                            _ = calls.serve(&mut conn) => {}
                            () = finished => {}
                        }
                    });
                    if drained.await.is_err() {
                        warn!(open = calls.open().get(), "calls still open after {SHUTDOWN_DRAIN:?}; closing them");
                    }
                    return Ok(Ended::Closed);
                }
            }
        }
    }
}

/// How long a stopping edge lets its open calls finish: under the 30 s Kubernetes gives
/// a pod to leave (`terminationGracePeriodSeconds`) before it kills it.
const SHUTDOWN_DRAIN: Duration = Duration::from_secs(25);

/// The `Edge` service of one session: the Control call.
pub(crate) struct Service {
    edge: Arc<Edge>,
    state: Arc<SessionState>,
}

type ControlStream =
    futures::stream::Map<Outgoing<Control>, fn(Control) -> Result<Control, Status>>;

#[tonic::async_trait]
impl EdgeService for Service {
    type ControlStream = ControlStream;

    async fn control(
        &self,
        request: Request<Streaming<Control>>,
    ) -> Result<Response<ControlStream>, Status> {
        let Some((hello, reply, renewal)) = self
            .state
            .registration
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        else {
            warn!("the cloud opened a second Control call on a session");
            return Err(Status::failed_precondition(
                "this session's Control call is open already",
            ));
        };
        let (tx, rx) = mpsc::channel(self.edge.control_queue);
        let _ = tx.try_send(Control {
            msg: Some(control::Msg::Hello(hello)),
        });
        tokio::spawn(
            control(
                self.edge.clone(),
                request.into_inner(),
                tx,
                (reply, renewal),
                self.state.clone(),
            )
            .in_current_span(),
        );
        Ok(Response::new(
            Outgoing(rx).map(Ok as fn(Control) -> Result<Control, Status>),
        ))
    }
}

/// Answers the cloud's HelloReply, then every Ping with a Pong (noting when it came);
/// passes a Drain on; sends the token again every `cloud.reauth_interval` when it comes
/// from a file. The edge-to-cloud connections' OpenReverse requests go out on `send`
/// from `reverse`.
async fn control(
    edge: Arc<Edge>,
    mut recv: Streaming<Control>,
    send: mpsc::Sender<Control>,
    (reply, renewal): (oneshot::Sender<HelloReply>, Option<Renewal>),
    state: Arc<SessionState>,
) {
    match recv.message().await {
        Ok(Some(Control {
            msg: Some(control::Msg::HelloReply(r)),
        })) => {
            let welcomed = matches!(r.result, Some(proto::hello_reply::Result::Welcome(_)));
            let _ = reply.send(r);
            if !welcomed {
                return;
            }
        }
        other => {
            warn!(first = ?other, "the cloud's first Control message was not a HelloReply");
            return;
        }
    }
    edge.reverse.attach(send.clone());
    control_loop(&edge, recv, &send, &state, renewal).await;
    edge.reverse.detach(&send);
}

async fn control_loop(
    edge: &Edge,
    mut recv: Streaming<Control>,
    send: &mpsc::Sender<Control>,
    state: &SessionState,
    mut renewal: Option<Renewal>,
) {
    // Only a token file changes under us (the kubelet rotates projected tokens); the
    // cloud re-checks the token it has on its own as well.
    let rotating = edge.cloud.token_file.is_some();
    let mut reauth = tokio::time::interval_at(
        tokio::time::Instant::now() + edge.cloud.reauth_interval,
        edge.cloud.reauth_interval,
    );
    loop {
        let msg = tokio::select! {
            msg = recv.message() => msg,
            _ = reauth.tick(), if rotating => {
                match super::token::load(&edge.cloud) {
                    Ok(token) => {
                        let msg = Control { msg: Some(control::Msg::Reauth(proto::Reauth { token, ..Default::default() })) };
                        if send.send(msg).await.is_err() {
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
            renewed = next_renewal(&mut renewal) => {
                if let Some(msg) = renewed
                    && send.send(msg).await.is_err()
                {
                    return;
                }
                continue;
            }
        };
        let msg = match msg {
            Ok(Some(msg)) => msg,
            Ok(None) => return,
            Err(status) => {
                if status.code() == tonic::Code::Internal {
                    warn!(error = %crate::call::copy::describe(&status), "malformed control message from the cloud");
                }
                return;
            }
        };
        match msg.msg {
            Some(control::Msg::Ping(p)) => {
                state.last_ping.store(
                    state.started.elapsed().as_millis() as u64,
                    Ordering::Relaxed,
                );
                edge.heartbeat_rtt_us.set(p.last_rtt_us as i64);
                debug!(rtt_us = p.last_rtt_us, "heartbeat");
                let pong = Control {
                    msg: Some(control::Msg::Pong(proto::Pong {
                        sequence: p.sequence,
                    })),
                };
                if send.send(pong).await.is_err() {
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

/// The next renewed certificate, as the Reauth that presents it on this connection;
/// never when there is nothing to renew.
async fn next_renewal(renewal: &mut Option<Renewal>) -> Option<Control> {
    let Some(r) = renewal else {
        return std::future::pending().await;
    };
    if r.certs.changed().await.is_err() {
        // The renewing task is gone (shutdown): nothing more comes.
        *renewal = None;
        return None;
    }
    let cert = r.certs.borrow_and_update().clone();
    match crate::io::tls::sign_proof(&cert.key, &r.exporter) {
        Ok((scheme, signature)) => {
            info!("presenting the renewed client certificate on the open session");
            Some(Control {
                msg: Some(control::Msg::Reauth(proto::Reauth {
                    token: String::new(),
                    certificate: cert.leaf().to_vec(),
                    signature,
                    signature_scheme: u32::from(scheme),
                })),
            })
        }
        Err(e) => {
            warn!(error = %e, "cannot sign the renewal proof; the session ends when the old certificate expires");
            None
        }
    }
}
