//! One edge's session on the cloud: the HTTP/2 client side of the edge's TLS
//! connection, its heartbeat, and the opening of one stream per proxied connection.

use std::future::poll_fn;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use h2::client::SendRequest;
use h2::{RecvStream, SendStream};
use proto::{Control, DialRequest, DialResult, DialStatus, FrameDecoder, OpenReverse, control};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, warn};

use crate::config::TransportConfig;
use crate::transport;

/// Why a stream to the edge could not be opened; the entries map these to what their
/// clients understand (an HTTP status, a reset).
#[derive(Debug, Clone, thiserror::Error)]
pub enum OpenError {
    #[error("edge refused target: {0}")]
    Forbidden(String),
    #[error("edge could not connect to target: {0}")]
    Refused(String),
    #[error("edge timed out connecting to target")]
    Timeout,
    #[error("edge is at its connection limit")]
    Overloaded,
    #[error("edge rejected the request: {0}")]
    BadRequest(String),
    #[error("tunnel to edge failed: {0}")]
    Tunnel(String),
    /// From a replica a connection was forwarded to: it holds no session for the node.
    #[error("{0}")]
    NotHeld(String),
}

pub struct EdgeSession {
    /// The node name, or the cluster name for a cluster identity.
    pub node: String,
    /// "node" or "cluster" (`Hello.identity_kind`).
    pub kind: &'static str,
    pub id: u64,
    pub remote: SocketAddr,
    pub connected_at: SystemTime,
    /// The token-file token the edge uses now, when a token was all it had: checked
    /// again when the token file changes. Never logged.
    token: std::sync::Mutex<Option<String>>,
    /// Fresh tokens the edge sends (`Reauth`), to `reauth::watch`.
    fresh_tokens: tokio::sync::mpsc::Sender<String>,
    sender: SendRequest<Bytes>,
    rtt_us: AtomicU64,
    open_streams: Arc<AtomicUsize>,
    /// Cancelled when the session is over; dropping the HTTP/2 connection then ends
    /// every stream on it.
    closed: CancellationToken,
    /// Cancelled to send the edge a Drain on the control stream.
    draining: CancellationToken,
    dial_timeout: Duration,
    /// OpenReverse requests from the edge, to `reverse::serve`.
    reverse_requests: tokio::sync::mpsc::Sender<OpenReverse>,
    /// `transport.max_streams_per_edge`: beyond it a new stream fails at once instead
    /// of queueing behind HTTP/2's concurrency limit.
    max_streams: usize,
}

/// An open stream to the edge for one proxied connection. Counts as open until dropped.
pub struct EdgeStream {
    pub send: SendStream<Bytes>,
    pub recv: RecvStream,
    _open: OpenGuard,
}

/// Keeps a stream counted as open on its session.
pub struct OpenGuard(Arc<AtomicUsize>);

impl OpenGuard {
    pub(crate) fn count(counter: &Arc<AtomicUsize>) -> Self {
        counter.fetch_add(1, Ordering::Relaxed);
        Self(counter.clone())
    }
}

impl EdgeStream {
    pub fn into_parts(self) -> (SendStream<Bytes>, RecvStream, OpenGuard) {
        (self.send, self.recv, self._open)
    }
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl EdgeSession {
    /// Runs the HTTP/2 handshake on a registered edge's connection and starts the
    /// connection and heartbeat tasks.
    #[expect(
        clippy::too_many_arguments,
        reason = "one call site, each argument distinct"
    )]
    pub async fn start<T>(
        io: T,
        node: String,
        kind: &'static str,
        token: Option<String>,
        fresh_tokens: tokio::sync::mpsc::Sender<String>,
        reverse_requests: tokio::sync::mpsc::Sender<OpenReverse>,
        id: u64,
        remote: SocketAddr,
        transport: &TransportConfig,
    ) -> Result<Arc<Self>, h2::Error>
    where
        T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let (sender, connection) = transport::client_builder(transport)
            .handshake::<_, Bytes>(io)
            .await?;
        let session = Arc::new(Self {
            node,
            kind,
            reverse_requests,
            id,
            remote,
            connected_at: SystemTime::now(),
            token: std::sync::Mutex::new(token),
            fresh_tokens,
            sender,
            rtt_us: AtomicU64::new(0),
            open_streams: Arc::new(AtomicUsize::new(0)),
            closed: CancellationToken::new(),
            draining: CancellationToken::new(),
            dial_timeout: transport.dial_timeout,
            max_streams: transport.max_streams_per_edge as usize,
        });
        let span = tracing::info_span!("edge", node = %session.node, kind, session = id);
        let closed = session.closed.clone();
        tokio::spawn(
            async move {
                tokio::select! {
                    r = connection => match r {
                        Ok(()) => info!("edge connection closed"),
                        Err(e) => info!(error = %e, "edge connection failed"),
                    },
                    () = closed.cancelled() => {}
                }
                // Dropping the connection here fails every stream still open on it, so
                // their client connections end now rather than at some timeout.
                closed.cancel();
            }
            .instrument(span.clone()),
        );
        let heartbeat = heartbeat(
            session.clone(),
            transport.heartbeat_interval,
            transport.heartbeat_timeout,
        );
        tokio::spawn(heartbeat.instrument(span));
        Ok(session)
    }

    pub fn token(&self) -> Option<String> {
        self.lock_token().clone()
    }

    /// The edge now uses `token` (checked by `reauth`); only a token-file session keeps it.
    pub fn set_token(&self, token: String) {
        let mut current = self.lock_token();
        if current.is_some() {
            *current = Some(token);
        }
    }

    fn lock_token(&self) -> std::sync::MutexGuard<'_, Option<String>> {
        self.token.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn is_closed(&self) -> bool {
        self.closed.is_cancelled()
    }

    /// Asks the edge to open a session to another replica; this one keeps carrying the
    /// connections already open on it.
    pub fn drain(&self) {
        self.draining.cancel();
    }

    /// Ends the session now: every stream on it fails.
    pub fn close(&self) {
        self.closed.cancel();
    }

    pub async fn wait_closed(&self) {
        self.closed.cancelled().await
    }

    pub fn rtt(&self) -> Duration {
        Duration::from_micros(self.rtt_us.load(Ordering::Relaxed))
    }

    pub fn open_streams(&self) -> usize {
        self.open_streams.load(Ordering::Relaxed)
    }

    /// Opens a stream and asks the edge to dial the request's target; returns as soon as
    /// the request is on its way, with the edge's answer still to come.
    pub async fn dial(&self, request: &DialRequest) -> Result<DialingStream, OpenError> {
        // A little longer than the edge's own dial timeout, so its answer wins the race.
        let deadline = tokio::time::Instant::now() + self.dial_timeout + Duration::from_secs(2);
        let guard = OpenGuard::count(&self.open_streams);
        if self.open_streams() > self.max_streams {
            return Err(OpenError::Overloaded);
        }
        let (send, answer) =
            send_dial(&self.sender, proto::DIAL_PATH, request, None, deadline).await?;
        Ok(DialingStream {
            send,
            answer,
            open: guard,
        })
    }

    /// Opens the `/tunnel.v1/reverse` stream an edge asked for, carrying the cloud's
    /// dial `result`. A failed result ends the stream at once (`Ok(None)`); otherwise
    /// returns the stream once the edge has taken it.
    pub async fn open_reverse(
        &self,
        request: &DialRequest,
        result: &DialResult,
    ) -> Result<Option<EdgeStream>, OpenError> {
        let ok = result.status() == DialStatus::Ok;
        let guard = OpenGuard::count(&self.open_streams);
        let tunnel_err = |e: h2::Error| OpenError::Tunnel(e.to_string());
        let open = async {
            let mut sender = self.sender.clone().ready().await.map_err(tunnel_err)?;
            let req = http::Request::post(format!("http://tunnel{}", proto::REVERSE_PATH))
                .header(
                    proto::DIAL_REQUEST_HEADER,
                    transport::encode_header(request),
                )
                .header(proto::DIAL_RESULT_HEADER, transport::encode_header(result))
                .body(())
                .map_err(|e| OpenError::Tunnel(e.to_string()))?;
            let (response, send) = sender.send_request(req, !ok).map_err(tunnel_err)?;
            if !ok {
                return Ok(None);
            }
            let response = response.await.map_err(tunnel_err)?;
            if response.status() != http::StatusCode::OK {
                return Err(OpenError::Tunnel(format!(
                    "edge answered the reverse stream with {}",
                    response.status()
                )));
            }
            Ok::<_, OpenError>(Some(EdgeStream {
                send,
                recv: response.into_body(),
                _open: guard,
            }))
        };
        tokio::time::timeout(self.dial_timeout, open)
            .await
            .unwrap_or(Err(OpenError::Timeout))
    }
}

/// Opens a dial stream at `path` on an HTTP/2 connection we are the client of (an edge
/// session, or a link to the replica that holds the edge) and sends the request, but does
/// not wait for the `DialResult`: that is the returned `DialAnswer`, bounded by
/// `deadline` like the wait for the connection's readiness here. `hello` rides along on
/// cloud-to-cloud streams.
pub(crate) async fn send_dial(
    sender: &SendRequest<Bytes>,
    path: &str,
    request: &DialRequest,
    hello: Option<&http::HeaderValue>,
    deadline: tokio::time::Instant,
) -> Result<(SendStream<Bytes>, DialAnswer), OpenError> {
    let tunnel_err = |e: h2::Error| OpenError::Tunnel(e.to_string());
    let ready = tokio::time::timeout_at(deadline, sender.clone().ready())
        .await
        .map_err(|_| OpenError::Timeout)?;
    let mut sender = ready.map_err(tunnel_err)?;
    let mut req = http::Request::post(format!("http://tunnel{path}"))
        .header(
            proto::DIAL_REQUEST_HEADER,
            transport::encode_header(request),
        )
        .body(())
        .map_err(|e| OpenError::Tunnel(e.to_string()))?;
    if let Some(hello) = hello {
        req.headers_mut()
            .insert(proto::PEER_HELLO_HEADER, hello.clone());
    }
    let (response, send) = sender.send_request(req, false).map_err(tunnel_err)?;
    Ok((send, DialAnswer { response, deadline }))
}

/// A stream whose dial request is on its way to the edge (directly, or through the
/// replica that holds the edge). Bytes sent into it before the answer wait in the
/// stream's window until the edge has connected and reads them; an edge that refuses
/// the dial never reads them, and they go with the stream.
pub struct DialingStream {
    send: SendStream<Bytes>,
    answer: DialAnswer,
    open: OpenGuard,
}

impl DialingStream {
    pub(crate) fn new(send: SendStream<Bytes>, answer: DialAnswer, open: OpenGuard) -> Self {
        Self { send, answer, open }
    }

    /// Waits for the edge's answer: the stream, once the edge has connected to the target.
    pub async fn established(self) -> Result<EdgeStream, OpenError> {
        let recv = self.answer.wait().await?;
        Ok(EdgeStream {
            send: self.send,
            recv,
            _open: self.open,
        })
    }

    pub fn into_parts(self) -> (SendStream<Bytes>, DialAnswer, OpenGuard) {
        (self.send, self.answer, self.open)
    }
}

/// The edge's answer to a dial request, still to come.
pub struct DialAnswer {
    response: h2::client::ResponseFuture,
    deadline: tokio::time::Instant,
}

impl DialAnswer {
    /// The stream's receiving half once the edge has connected to the target, or why it
    /// did not (the edge's own refusal, or no answer by the deadline).
    pub async fn wait(self) -> Result<RecvStream, OpenError> {
        let response = tokio::time::timeout_at(self.deadline, self.response)
            .await
            .map_err(|_| OpenError::Timeout)?
            .map_err(|e| OpenError::Tunnel(e.to_string()))?;
        let result: DialResult =
            transport::decode_header(response.headers().get(proto::DIAL_RESULT_HEADER))
                .map_err(|e| OpenError::Tunnel(format!("dial result {e}")))?;
        match result.status() {
            DialStatus::Ok => Ok(response.into_body()),
            DialStatus::Forbidden => Err(OpenError::Forbidden(result.message)),
            DialStatus::Refused => Err(OpenError::Refused(result.message)),
            DialStatus::Timeout => Err(OpenError::Timeout),
            DialStatus::Overloaded => Err(OpenError::Overloaded),
            DialStatus::NotHeld => Err(OpenError::NotHeld(result.message)),
            DialStatus::TunnelFailed => Err(OpenError::Tunnel(result.message)),
            DialStatus::BadRequest | DialStatus::Unspecified => {
                Err(OpenError::BadRequest(result.message))
            }
        }
    }
}

impl OpenError {
    /// The `DialResult` that tells a forwarding replica about this error.
    pub fn dial_result(&self) -> DialResult {
        let (status, message) = match self {
            OpenError::Forbidden(m) => (DialStatus::Forbidden, m.clone()),
            OpenError::Refused(m) => (DialStatus::Refused, m.clone()),
            OpenError::Timeout => (DialStatus::Timeout, String::new()),
            OpenError::Overloaded => (DialStatus::Overloaded, String::new()),
            OpenError::BadRequest(m) => (DialStatus::BadRequest, m.clone()),
            OpenError::NotHeld(m) => (DialStatus::NotHeld, m.clone()),
            OpenError::Tunnel(m) => (DialStatus::TunnelFailed, m.clone()),
        };
        DialResult {
            status: status as i32,
            message,
        }
    }
}

/// Sends a Ping every `interval` on the control stream and ends the session when no Pong
/// has come back for `timeout`. The RTT of each Pong is kept for metrics and listings.
async fn heartbeat(session: Arc<EdgeSession>, interval: Duration, timeout: Duration) {
    let result = tokio::select! {
        r = heartbeat_loop(&session, interval, timeout) => r,
        () = session.closed.cancelled() => return,
    };
    match result {
        Ok(()) => info!("edge closed its control stream"),
        Err(why) => warn!(%why, "edge heartbeat failed; dropping session"),
    }
    session.close();
}

async fn heartbeat_loop(
    session: &EdgeSession,
    interval: Duration,
    timeout: Duration,
) -> Result<(), String> {
    let mut sender = session
        .sender
        .clone()
        .ready()
        .await
        .map_err(|e| e.to_string())?;
    let req = http::Request::post(format!("http://tunnel{}", proto::CONTROL_PATH))
        .body(())
        .map_err(|e| e.to_string())?;
    let (response, mut send) = sender.send_request(req, false).map_err(|e| e.to_string())?;
    let mut recv = tokio::time::timeout(timeout, response)
        .await
        .map_err(|_| "no control stream answer".to_string())?
        .map_err(|e| e.to_string())?
        .into_body();
    let mut decoder = FrameDecoder::default();
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut sequence = 0u64;
    let mut sent_at = Instant::now();
    let mut last_pong = Instant::now();
    let mut drain_sent = false;
    loop {
        tokio::select! {
            () = session.draining.cancelled(), if !drain_sent => {
                drain_sent = true;
                let drain = Control { msg: Some(control::Msg::Drain(proto::Drain { reason: "tunnel-cloud is shutting down".into() })) };
                send.send_data(proto::encode_frame(&drain), false).map_err(|e| e.to_string())?;
                info!("told the edge to move to another replica");
            }
            _ = ticker.tick() => {
                if last_pong.elapsed() > timeout {
                    return Err(format!("no heartbeat answer for {:?}", last_pong.elapsed()));
                }
                sequence += 1;
                sent_at = Instant::now();
                let ping = Control { msg: Some(control::Msg::Ping(proto::Ping { sequence, last_rtt_us: session.rtt_us.load(Ordering::Relaxed) })) };
                send.send_data(proto::encode_frame(&ping), false).map_err(|e| e.to_string())?;
            }
            data = recv.data() => {
                let Some(data) = data else { return Ok(()) };
                let data = data.map_err(|e| e.to_string())?;
                let _ = recv.flow_control().release_capacity(data.len());
                decoder.push(&data);
                while let Some(msg) = decoder.next_message::<Control>().map_err(|e| e.to_string())? {
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
                            if session.fresh_tokens.try_send(r.token).is_err() {
                                debug!("a fresh token is already being checked; dropping this one");
                            }
                        }
                        Some(control::Msg::OpenReverse(r)) => {
                            // Bounded: beyond the channel's depth a request is dropped, and
                            // the edge's own wait for it times out.
                            if session.reverse_requests.try_send(r).is_err() {
                                warn!("too many edge-to-cloud requests waiting; dropping one");
                            }
                        }
                        other => debug!(?other, "unexpected control message from edge"),
                    }
                }
            }
            _ = poll_fn(|cx| send.poll_reset(cx)) => return Err("control stream reset".into()),
        }
    }
}

impl EdgeSession {
    /// Called when a newer session of the same node took over routing: connections
    /// already open on this one finish, then it closes.
    pub fn retire(self: &Arc<Self>) {
        let session = self.clone();
        tokio::spawn(async move {
            while session.open_streams() > 0 && !session.is_closed() {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            info!(node = %session.node, session = session.id, "replaced session closed");
            session.close();
        });
    }
}
