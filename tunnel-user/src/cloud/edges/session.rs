//! One edge's session on the cloud: the gRPC client side of the edge's TLS connection
//! (service `Edge`) and its control plane: registration on the Control call, the
//! heartbeat, drains, fresh credentials and edge-to-cloud requests. The calls of proxied
//! connections open on its channel through `call::open`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use futures::{Stream, StreamExt};
use proto::edge_client::EdgeClient;
use proto::{Chunk, Control, DialResult, DialStatus, Hello, HelloReply, OpenReverse, control};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::mpsc;
// Tokio's clock, which a test's paused runtime moves (tests/common/inproc.rs).
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, DropGuard};
use tonic::{Status, Streaming};
use tracing::{Instrument, debug, info, warn};

use crate::addr::NodeName;
use crate::call;
use crate::call::copy;
use crate::call::count::OpenCount;
use crate::call::open::{Call, Method, ReverseStream};
use crate::call::outcome::DialFailure;
use crate::call::request::Request;
use crate::config::{Identity, TransportConfig};
use crate::io::transport::{self, Channel, Outgoing};

pub(crate) struct EdgeSession {
    /// The node name, or the cluster name for a cluster identity.
    pub(crate) node: NodeName,
    /// A node or a cluster (`Hello.identity_kind`).
    pub(crate) kind: Identity,
    /// How the edge proved it is the node: a weaker proof never takes its place.
    pub(crate) proof: Proof,
    pub(crate) id: u64,
    pub(crate) remote: SocketAddr,
    pub(crate) connected_at: SystemTime,
    /// The token-file token the edge uses now, when a token was all it had: checked
    /// again when the token file changes. Never logged.
    token: std::sync::Mutex<Option<String>>,
    /// Fresh tokens and renewed certificates the edge sends (`Reauth`), to
    /// `reauth::watch`.
    fresh_tokens: mpsc::Sender<Box<proto::Reauth>>,
    /// The connection's channel, for the byte-stream calls (`proto::chunk_call`).
    channel: Channel,
    rtt_us: AtomicU64,
    /// When the client certificate the session stands on expires, in Unix seconds; 0
    /// for a token's session. `reauth::watch` moves it on with each renewal.
    certificate_expiry: AtomicU64,
    open_streams: Arc<OpenCount>,
    /// Cancelled when the session is over; dropping the HTTP/2 connection then ends
    /// every call on it.
    closed: CancellationToken,
    /// Cancelled to send the edge a Drain on the control call.
    draining: CancellationToken,
    dial_timeout: Duration,
    /// OpenReverse requests from the edge, to `reverse::serve`.
    reverse_requests: mpsc::Sender<Box<OpenReverse>>,
    /// `transport.max_streams_per_edge`: beyond it a new call fails at once instead of
    /// queueing behind HTTP/2's concurrency limit.
    max_streams: usize,
}

/// How many Control messages may wait to be sent to the edge.
const CONTROL_QUEUE: usize = 16;

/// An edge's connection before its registration is decided: HTTP/2 is up, the Control
/// call is open and the edge's Hello has come. Dropped, it closes the connection.
pub(crate) struct Handshake {
    channel: Channel,
    control_tx: mpsc::Sender<Box<Control>>,
    control_rx: Streaming<Control>,
    closed: CancellationToken,
    close_on_drop: DropGuard,
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum HandshakeError {
    #[error("HTTP/2 handshake failed: {0}")]
    Http2(h2::Error),
    #[error("the Control call failed: {0}")]
    Control(String),
    #[error("the edge's first message was not a Hello: {0}")]
    NoHello(String),
}

impl Handshake {
    /// Runs the HTTP/2 handshake on an edge's connection, opens the Control call and
    /// reads the edge's Hello. The caller bounds the time it takes.
    pub(crate) async fn begin<T>(
        io: T,
        transport: &TransportConfig,
    ) -> Result<(Self, Hello), HandshakeError>
    where
        T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let (channel, connection) = transport::client_handshake(transport, io)
            .await
            .map_err(HandshakeError::Http2)?;
        let closed = CancellationToken::new();
        let close_on_drop = closed.clone().drop_guard();
        let conn_closed = closed.clone();
        // The edge's span is given to the lines this task logs rather than entered on
        // every poll: the task is polled for every message of every connection through
        // the edge, and entering an enabled span costs each poll a trip through the
        // subscriber. The connection is boxed before the task takes it: a future an
        // async block captures and then awaits is stored twice in the block's state, and
        // this task lives as long as the session.
        let span = tracing::Span::current();
        let connection = Box::pin(connection);
        tokio::spawn(async move {
            tokio::select! {
                r = connection => match r {
                    Ok(()) => info!(parent: &span, "edge connection closed"),
                    Err(e) => info!(parent: &span, error = %e, "edge connection failed"),
                },
                () = conn_closed.cancelled() => {}
            }
            // Dropping the connection here fails every call still open on it, so
            // their client connections end now rather than at some timeout.
            conn_closed.cancel();
        });
        let mut client =
            EdgeClient::new(channel.clone()).max_decoding_message_size(proto::MAX_MESSAGE_LEN);
        // Boxed messages, as in every channel a session keeps: a channel allocates a
        // block of 32 message slots, whatever its bound, when it is made.
        let (control_tx, outgoing) = mpsc::channel::<Box<Control>>(CONTROL_QUEUE);
        let mut control_rx = client
            .control(Outgoing(outgoing).map(|m| *m))
            .await
            .map_err(|s| HandshakeError::Control(copy::describe(&s)))?
            .into_inner();
        let hello = match control_rx.message().await {
            Ok(Some(Control {
                msg: Some(control::Msg::Hello(hello)),
            })) => hello,
            Ok(Some(other)) => return Err(HandshakeError::NoHello(format!("{other:?}"))),
            Ok(None) => return Err(HandshakeError::NoHello("the call ended".into())),
            Err(s) => return Err(HandshakeError::Control(copy::describe(&s))),
        };
        Ok((
            Self {
                channel,
                control_tx,
                control_rx,
                closed,
                close_on_drop,
            },
            hello,
        ))
    }

    /// Tells the edge why it may not register, then closes the connection once the
    /// edge has ended the call, or after a second.
    pub(crate) async fn reject(mut self, reject: proto::Reject) {
        let reply = Control {
            msg: Some(control::Msg::HelloReply(HelloReply {
                result: Some(proto::hello_reply::Result::Reject(reject)),
            })),
        };
        if self.control_tx.send(Box::new(reply)).await.is_ok() {
            let _ = tokio::time::timeout(Duration::from_secs(1), self.control_rx.message()).await;
        }
    }

    /// Welcomes the edge and starts the session: its heartbeat runs on the Control call.
    pub(crate) fn welcome(
        self,
        welcome: proto::Welcome,
        session: SessionInfo,
        transport: &TransportConfig,
    ) -> Arc<EdgeSession> {
        let Handshake {
            channel,
            control_tx,
            control_rx,
            closed,
            close_on_drop,
        } = self;
        close_on_drop.disarm();
        let reply = Control {
            msg: Some(control::Msg::HelloReply(HelloReply {
                result: Some(proto::hello_reply::Result::Welcome(welcome)),
            })),
        };
        // The queue is empty: this is the first message.
        let _ = control_tx.try_send(Box::new(reply));
        let session = Arc::new(EdgeSession {
            node: session.node,
            kind: session.kind,
            proof: session.proof,
            reverse_requests: session.reverse_requests,
            id: session.id,
            remote: session.remote,
            connected_at: SystemTime::now(),
            token: std::sync::Mutex::new(session.token),
            fresh_tokens: session.fresh_tokens,
            channel,
            rtt_us: AtomicU64::new(0),
            certificate_expiry: AtomicU64::new(0),
            open_streams: Arc::default(),
            closed,
            draining: CancellationToken::new(),
            dial_timeout: transport.dial_timeout,
            max_streams: transport.max_streams_per_edge as usize,
        });
        let span = tracing::info_span!("edge", node = %session.node, kind = session.kind.as_str(), session = session.id);
        let heartbeat = heartbeat(
            session.clone(),
            control_tx,
            control_rx,
            transport.heartbeat_interval,
            transport.heartbeat_timeout,
        );
        tokio::spawn(heartbeat.instrument(span));
        session
    }
}

/// How an edge proved that it is its node, as far as taking the node's session goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Proof {
    /// A token of the token file: a secret the file shares with whoever was given it
    /// (with a `default` line, one secret for every node).
    TokenFile,
    /// A client certificate naming the node, signed by the client CA.
    Certificate,
    /// A service account token the API server found bound to a pod on the node.
    ServiceAccount,
}

impl Proof {
    /// Whether the node's name is bound to the credential by a CA or the API server.
    pub(crate) fn bound(self) -> bool {
        !matches!(self, Proof::TokenFile)
    }

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Proof::TokenFile => "a token-file token",
            Proof::Certificate => "a client certificate",
            Proof::ServiceAccount => "a reviewed service account token",
        }
    }
}

/// What the registration decided about a session.
pub(crate) struct SessionInfo {
    pub(crate) node: NodeName,
    pub(crate) kind: Identity,
    pub(crate) proof: Proof,
    pub(crate) token: Option<String>,
    pub(crate) fresh_tokens: mpsc::Sender<Box<proto::Reauth>>,
    pub(crate) reverse_requests: mpsc::Sender<Box<OpenReverse>>,
    pub(crate) id: u64,
    pub(crate) remote: SocketAddr,
}

impl EdgeSession {
    pub(crate) fn token(&self) -> Option<String> {
        self.lock_token().clone()
    }

    /// The edge now uses `token` (checked by `reauth`); only a token-file session keeps it.
    pub(crate) fn set_token(&self, token: String) {
        let mut current = self.lock_token();
        if current.is_some() {
            *current = Some(token);
        }
    }

    fn lock_token(&self) -> std::sync::MutexGuard<'_, Option<String>> {
        self.token.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.closed.is_cancelled()
    }

    /// Asks the edge to open a session to another replica; this one keeps carrying the
    /// connections already open on it.
    pub(crate) fn drain(&self) {
        self.draining.cancel();
    }

    /// Ends the session now: every call on it fails.
    pub(crate) fn close(&self) {
        self.closed.cancel();
    }

    pub(crate) async fn wait_closed(&self) {
        self.closed.cancelled().await
    }

    pub(crate) fn rtt(&self) -> Duration {
        Duration::from_micros(self.rtt_us.load(Ordering::Relaxed))
    }

    /// When the session's client certificate expires (Unix seconds), if it stands on one.
    pub(crate) fn certificate_expiry(&self) -> Option<u64> {
        Some(self.certificate_expiry.load(Ordering::Relaxed)).filter(|&t| t != 0)
    }

    pub(crate) fn set_certificate_expiry(&self, not_after: Option<SystemTime>) {
        let secs = not_after
            .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_secs());
        self.certificate_expiry.store(secs, Ordering::Relaxed);
    }

    pub(crate) fn open_streams(&self) -> usize {
        self.open_streams.get()
    }

    /// Returns once no call is open on this session.
    pub(crate) async fn idle(&self) {
        self.open_streams.idle().await
    }

    /// Opens the `Edge.Dial` call of one proxied connection on this session, with
    /// `messages` as its outgoing messages (`call::open`), unless the session is at its
    /// stream limit or over.
    pub(crate) fn open_call<M>(&self, request: &Request, messages: M) -> Result<Call, DialFailure>
    where
        M: Stream<Item = Chunk> + Send + Unpin + 'static,
    {
        if self.open_streams() >= self.max_streams {
            return Err(DialFailure::new(DialStatus::Overloaded, ""));
        }
        if self.is_closed() {
            return Err(DialFailure::new(
                DialStatus::TunnelFailed,
                "the session has ended",
            ));
        }
        // A little longer than the edge's own dial timeout, so its answer wins the race.
        let answer_within = self.dial_timeout + Duration::from_secs(2);
        let channel = self.channel.clone();
        Ok(call::open::open(
            channel,
            Method::EdgeDial,
            request,
            messages,
            &self.open_streams,
            answer_within,
        ))
    }

    /// Opens on this session the `Edge.Reverse` call the edge asked for with `asked`,
    /// carrying the cloud's dial `result` (`call::open::open_reverse`).
    pub(crate) async fn open_reverse(
        &self,
        asked: &OpenReverse,
        result: &DialResult,
    ) -> Result<Option<ReverseStream>, DialFailure> {
        let channel = self.channel.clone();
        let count = &self.open_streams;
        call::open::open_reverse(channel, asked, result, count, self.dial_timeout).await
    }
}

/// Sends a Ping every `interval` on the control call and ends the session when no Pong
/// has come back for `timeout`. The RTT of each Pong is kept for metrics and listings.
async fn heartbeat(
    session: Arc<EdgeSession>,
    send: mpsc::Sender<Box<Control>>,
    mut recv: Streaming<Control>,
    interval: Duration,
    timeout: Duration,
) {
    // The loop borrows the call: moved into it, the call would be stored twice in this
    // task, which lives as long as the session.
    let result = tokio::select! {
        r = heartbeat_loop(&session, &send, &mut recv, interval, timeout) => r,
        () = session.closed.cancelled() => return,
    };
    match result {
        Ok(()) => info!("edge closed its control call"),
        Err(why) => warn!(%why, "edge heartbeat failed; dropping session"),
    }
    session.close();
}

/// Why the cloud dropped an edge's session from the Control call.
#[derive(Debug, thiserror::Error)]
enum HeartbeatError {
    /// A full queue means the edge does not read its Control call: as good as gone.
    #[error("cannot send on the control call: no available capacity")]
    QueueFull,
    #[error("cannot send on the control call: channel closed")]
    Closed,
    #[error("no heartbeat answer for {0:?}")]
    NoAnswer(Duration),
    /// The Control call failed.
    #[error("{}", copy::describe(.0))]
    Call(Box<Status>),
}

async fn heartbeat_loop(
    session: &EdgeSession,
    send: &mpsc::Sender<Box<Control>>,
    recv: &mut Streaming<Control>,
    interval: Duration,
    timeout: Duration,
) -> Result<(), HeartbeatError> {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut sequence = 0u64;
    let mut sent_at = Instant::now();
    let mut last_pong = Instant::now();
    let mut drain_sent = false;
    let push = |msg: control::Msg| {
        send.try_send(Box::new(Control { msg: Some(msg) }))
            .map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => HeartbeatError::QueueFull,
                mpsc::error::TrySendError::Closed(_) => HeartbeatError::Closed,
            })
    };
    loop {
        tokio::select! {
            () = session.draining.cancelled(), if !drain_sent => {
                drain_sent = true;
                push(control::Msg::Drain(proto::Drain { reason: "tunnel-cloud is shutting down".into() }))?;
                info!("told the edge to move to another replica");
            }
            _ = ticker.tick() => {
                if last_pong.elapsed() > timeout {
                    return Err(HeartbeatError::NoAnswer(last_pong.elapsed()));
                }
                sequence += 1;
                sent_at = Instant::now();
                push(control::Msg::Ping(proto::Ping { sequence, last_rtt_us: session.rtt_us.load(Ordering::Relaxed) }))?;
            }
            msg = recv.message() => {
                let Some(msg) = msg.map_err(|s| HeartbeatError::Call(Box::new(s)))? else { return Ok(()) };
                match msg.msg {
                    Some(control::Msg::Pong(p)) if p.sequence == sequence => {
                        let rtt = sent_at.elapsed();
                        session.rtt_us.store(rtt.as_micros() as u64, Ordering::Relaxed);
                        last_pong = Instant::now();
                        debug!(rtt_us = rtt.as_micros() as u64, "heartbeat");
                    }
                    Some(control::Msg::Pong(_)) => last_pong = Instant::now(),
                    Some(control::Msg::Error(e)) => warn!(message = %e.message, "edge reported an error"),
                    Some(control::Msg::Reauth(r)) => {
                        // One check at a time: a token sent while one is under review
                        // waits for the edge's next interval.
                        if session.fresh_tokens.try_send(Box::new(r)).is_err() {
                            debug!("a fresh token is already being checked; dropping this one");
                        }
                    }
                    Some(control::Msg::OpenReverse(r)) => {
                        // Bounded: beyond the channel's depth a request is dropped, and
                        // the edge's own wait for it times out.
                        if session.reverse_requests.try_send(Box::new(r)).is_err() {
                            warn!("too many edge-to-cloud requests waiting; dropping one");
                        }
                    }
                    other => debug!(?other, "unexpected control message from edge"),
                }
            }
        }
    }
}

impl EdgeSession {
    /// Called when a newer session of the same node took over routing: no new
    /// connection comes to this one, and those open on it finish. It stays until its
    /// edge leaves (or its heartbeat fails), rather than closing once idle: an edge whose
    /// session the cloud closes reconnects and takes the node back, and two edge
    /// processes of one node (a rolling update's old and new pods) would then replace
    /// each other in turn. The old one's connection ends when its process does.
    pub(crate) fn retire(self: &Arc<Self>) {
        let session = self.clone();
        tokio::spawn(async move {
            session.wait_closed().await;
            info!(node = %session.node, session = session.id, "replaced session closed");
        });
    }
}
