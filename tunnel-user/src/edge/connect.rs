//! The edge's way to the cloud: dial out, TLS, the Hello on the Control call, and the
//! reconnect loop around it (the counterpart of the cloud's `cloud::edges::admission`).
//!
//! Data flow: `Connector::run` picks a cloud address -> `connect` dials TCP, TLS and
//! registers (`session::register`) -> the session serves until it ends -> the next
//! address at once after a drain or a failure (a replica full of edges among them:
//! REPLICA_FULL), with backoff once every address failed,
//! and after a drain that came before the session had settled (`SETTLED`): a cloud that
//! welcomes and drains every session gets ever slower reconnects, not a tight loop. Of
//! the drained sessions, whose connections carry their open calls in the background,
//! only the latest is kept: the edge holds at most two connections to the cloud.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use proto::Hello;
use rand::Rng;
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio::sync::watch;
// Tokio's clock, which a test's paused runtime moves (tests/common/inproc.rs).
use tokio::time::Instant;
use tokio_rustls::TlsConnector;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::hooks::Hooks;
use super::{Edge, session, token};
use crate::config::{CloudClientConfig, EdgeConfig, Identity};
use crate::csr::ClientCert;
use crate::io::read_ahead::ReadAhead;

#[derive(Debug, thiserror::Error)]
enum ConnectError {
    #[error("cannot connect to {0}: {1}")]
    Tcp(String, std::io::Error),
    #[error("TLS handshake with the cloud failed: {0}{hint}", hint = older_cloud_hint(.0))]
    Tls(std::io::Error),
    #[error(transparent)]
    Register(#[from] session::RegisterError),
    #[error("handshake timed out")]
    Timeout,
}

/// A cloud of protocol 1 (before gRPC) refuses our ALPN during the TLS handshake.
fn older_cloud_hint(e: &std::io::Error) -> &'static str {
    if e.to_string().contains("NoApplicationProtocol") {
        " (the cloud does not speak protocol 2, gRPC: is it an older tunnel-cloud?)"
    } else {
        ""
    }
}

/// Exponential backoff with jitter: the first retry comes within 100 ms (an edge started
/// beside its cloud, or one whose cloud just restarted, is back almost at once), later
/// ones spread out up to about 30 s so a fleet does not reconnect in lockstep.
pub(crate) struct Backoff {
    attempt: u32,
}

impl Backoff {
    const BASE: Duration = Duration::from_millis(100);
    const CAP: Duration = Duration::from_secs(30);

    pub(crate) fn new() -> Self {
        Self { attempt: 0 }
    }

    pub(crate) fn reset(&mut self) {
        self.attempt = 0;
    }

    pub(crate) fn next_delay(&mut self) -> Duration {
        let full = Self::BASE
            .saturating_mul(1 << self.attempt.min(10))
            .min(Self::CAP);
        self.attempt += 1;
        full.mul_f64(rand::rng().random_range(0.5..=1.0))
    }
}

impl Default for Backoff {
    fn default() -> Self {
        Self::new()
    }
}

/// How long a session must have served for a drain to send the edge to the next
/// replica at once. A drain any sooner is followed by the backoff, which then goes on
/// growing rather than being reset by the next registration.
const SETTLED: Duration = Duration::from_secs(10);

/// Which of the cloud addresses the edge dials next, and when: after a failed attempt
/// the next address at once, and the backoff only once every address failed in a row.
/// The bench's simulated edges reconnect by it too, so a storm they make is the one a
/// fleet of real edges would.
pub struct Reconnect {
    addresses: usize,
    current: usize,
    /// Addresses that failed in a row.
    failed_in_a_row: usize,
    backoff: Backoff,
}

impl Reconnect {
    /// Starts at the first of `addresses` (at least one).
    pub fn new(addresses: usize) -> Self {
        Self {
            addresses: addresses.max(1),
            current: 0,
            failed_in_a_row: 0,
            backoff: Backoff::new(),
        }
    }

    /// The index of the address to dial now.
    pub fn current(&self) -> usize {
        self.current
    }

    /// The edge registered. `reset`: the backoff starts afresh (not after a session
    /// drained before it settled, when it goes on growing).
    pub fn registered(&mut self, reset: bool) {
        self.failed_in_a_row = 0;
        if reset {
            self.backoff.reset();
        }
    }

    /// A session that served `served` ended: one that settled starts the backoff afresh,
    /// even one that registered while it was growing.
    pub fn session_ended(&mut self, served: Duration) {
        if served >= SETTLED {
            self.backoff.reset();
        }
    }

    /// Moves to the next address (the session there was drained).
    pub fn next_address(&mut self) {
        self.current = (self.current + 1) % self.addresses;
    }

    /// An attempt failed: moves to the next address. True once every address failed in
    /// a row: the edge then waits [`Self::delay`] before the next attempt.
    pub fn failed(&mut self) -> bool {
        self.next_address();
        self.failed_in_a_row += 1;
        if self.failed_in_a_row < self.addresses {
            return false;
        }
        self.failed_in_a_row = 0;
        true
    }

    /// How long to wait before the next attempt.
    pub fn delay(&mut self) -> Duration {
        self.backoff.next_delay()
    }
}

/// Everything the reconnect loop needs, and only that: where the cloud is, how to
/// reach it, who this edge says it is, and what to count.
pub(super) struct Connector {
    tls: TlsConnector,
    /// The client certificate from the cluster (`[csr]`), renewed under us: new
    /// connections use the latest, and the open session is told about it.
    certs: Option<watch::Receiver<Arc<ClientCert>>>,
    server_name: ServerName<'static>,
    addresses: Vec<String>,
    cloud: CloudClientConfig,
    /// The last token read; a token file is read again for every attempt.
    token: String,
    node: String,
    identity: Identity,
    handshake_timeout: Duration,
    heartbeat_timeout: Duration,
    sessions: Counter,
    registered: Registered,
    hooks: Arc<Hooks>,
}

/// Whether the edge is registered: the `tunnel_edge_registered` gauge (what `/readyz`
/// answers), and the file of `--registered-file`, which exists while it is. The admin
/// port answers for whichever edge process on the node the kernel hands the probe to
/// (a rolling update runs two, sharing it: `SO_REUSEPORT`); the file is this pod's own.
pub(super) struct Registered {
    gauge: Gauge,
    file: Option<std::path::PathBuf>,
}

impl Registered {
    /// Starts unregistered: a file left by this pod's previous container goes.
    pub(super) fn new(gauge: Gauge, file: Option<std::path::PathBuf>) -> anyhow::Result<Self> {
        let registered = Self { gauge, file };
        registered
            .set(false)
            .with_context(|| format!("cannot remove {:?} (--registered-file)", registered.file))?;
        Ok(registered)
    }

    fn set(&self, registered: bool) -> std::io::Result<()> {
        self.gauge.set(registered as i64);
        let Some(file) = &self.file else {
            return Ok(());
        };
        match registered {
            true => std::fs::write(file, b""),
            false => match std::fs::remove_file(file) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
                _ => Ok(()),
            },
        }
    }

    /// As `set`, and a file that cannot be written is logged: readiness then lags.
    fn mark(&self, registered: bool) {
        if let Err(e) = self.set(registered) {
            warn!(error = %e, file = ?self.file, "cannot record the registration in --registered-file");
        }
    }
}

impl Connector {
    /// The TLS set-up toward the cloud and the token, read now so that a bad file fails
    /// the start. `sessions` and `registered` are the edge's metrics the loop keeps;
    /// `hooks` run on every registration; `certs` is the certificate from the cluster.
    pub(super) fn new(
        config: &EdgeConfig,
        sessions: Counter,
        registered: Registered,
        hooks: Arc<Hooks>,
        mut certs: Option<watch::Receiver<Arc<ClientCert>>>,
    ) -> anyhow::Result<Self> {
        let tls = match &mut certs {
            Some(certs) => {
                let current = certs.borrow_and_update().clone();
                TlsConnector::from(with_cert(&config.cloud.ca, &current)?)
            }
            None => {
                let client = match (&config.cloud.cert, &config.cloud.key) {
                    (Some(c), Some(k)) => Some((c.as_path(), k.as_path())),
                    _ => None,
                };
                TlsConnector::from(crate::io::tls::client_config(&config.cloud.ca, client)?)
            }
        };
        let server_name = crate::io::tls::server_name(&config.cloud.server_name)?;
        // Read now so that a missing file fails the start; read again for every attempt.
        let token = token::load(&config.cloud)?;
        Ok(Self {
            tls,
            certs,
            server_name,
            addresses: config.cloud_addresses().map(str::to_string).collect(),
            cloud: config.cloud.clone(),
            token,
            node: config.node().to_string(),
            identity: config.identity,
            handshake_timeout: config.transport.handshake_timeout,
            heartbeat_timeout: config.transport.heartbeat_timeout,
            sessions,
            registered,
            hooks,
        })
    }

    /// Connects, registers and serves sessions with `edge` until `shutdown` is
    /// cancelled, moving to the next address and backing off as the module says.
    pub(super) async fn run(mut self, edge: Arc<Edge>, shutdown: CancellationToken) {
        let addresses = std::mem::take(&mut self.addresses);
        let mut reconnect = Reconnect::new(addresses.len());
        // Whether the last session was drained before it settled.
        let mut drained_early = false;
        // The connection of the last drained session, while it carries its open calls.
        let mut drained: Option<session::Draining> = None;
        while !shutdown.is_cancelled() {
            let address = &addresses[reconnect.current()];
            // A projected service account token is rotated by the kubelet: the file holds
            // the current one. If it cannot be read now, the last one read is tried.
            if self.cloud.token_file.is_some() {
                match token::load(&self.cloud) {
                    Ok(t) => self.token = t,
                    Err(e) => {
                        warn!(error = %e, "cannot read the token file again; using the token read before")
                    }
                }
            }
            self.refresh_tls();
            let attempt = tokio::select! {
                r = tokio::time::timeout(self.handshake_timeout, self.connect(&edge, address)) => r.unwrap_or(Err(ConnectError::Timeout)),
                () = shutdown.cancelled() => break,
            };
            match attempt {
                Ok((session, heartbeat_interval, cloud_id)) => {
                    reconnect.registered(!drained_early);
                    self.sessions.inc();
                    self.registered.mark(true);
                    info!(cloud = %address, cloud_id = %cloud_id, "registered with the cloud");
                    tokio::spawn(self.hooks.clone().post_start(
                        address.clone(),
                        cloud_id,
                        self.sessions.get(),
                    ));
                    // Miss three heartbeats, or our own bound if that is longer, before giving up.
                    let timeout = self.heartbeat_timeout.max(heartbeat_interval * 3);
                    let registered_at = Instant::now();
                    let ended = session.serve(timeout, &shutdown).await;
                    self.registered.mark(false);
                    let served = registered_at.elapsed();
                    reconnect.session_ended(served);
                    drained_early = false;
                    match ended {
                        Ok(session::Ended::Drained(draining)) => {
                            // The old session keeps carrying its connections meanwhile; an
                            // earlier drained one still open is closed now.
                            if let Some(earlier) = drained.replace(draining)
                                && earlier.is_open()
                            {
                                info!(
                                    "closing the connection of an earlier drained session: at most one is kept"
                                );
                            }
                            reconnect.next_address();
                            if served >= SETTLED {
                                continue;
                            }
                            drained_early = true;
                            warn!(cloud = %address, served_ms = served.as_millis() as u64, "the cloud drained this session before it settled; backing off before the next replica");
                        }
                        Ok(session::Ended::Closed) => {
                            info!(cloud = %address, "session with the cloud ended")
                        }
                        Err(why) => warn!(cloud = %address, %why, "session with the cloud failed"),
                    }
                }
                Err(e) => {
                    match e {
                        // Not this edge's fault: the next replica is tried at once.
                        ConnectError::Register(session::RegisterError::Rejected {
                            reason: proto::RejectReason::ReplicaFull,
                            ..
                        }) => {
                            warn!(cloud = %address, error = %e, "the replica is full; trying the next cloud address")
                        }
                        ConnectError::Register(session::RegisterError::Rejected { .. }) => {
                            error!(cloud = %address, error = %e, "registration refused")
                        }
                        _ => warn!(cloud = %address, error = %e, "cannot reach the cloud"),
                    }
                    if !reconnect.failed() {
                        continue;
                    }
                }
            }
            let delay = reconnect.delay();
            info!(delay_ms = delay.as_millis() as u64, "reconnecting");
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                () = shutdown.cancelled() => break,
            }
        }
    }

    /// New connections use the latest certificate from the cluster.
    fn refresh_tls(&mut self) {
        let Some(certs) = &mut self.certs else { return };
        if !certs.has_changed().unwrap_or(false) {
            return;
        }
        let current = certs.borrow_and_update().clone();
        match with_cert(&self.cloud.ca, &current) {
            Ok(config) => self.tls = TlsConnector::from(config),
            Err(e) => {
                warn!(error = %e, "the renewed client certificate does not load; connecting with the previous one")
            }
        }
    }

    /// Dials the cloud at `address` and registers: TLS, then the gRPC side of the
    /// connection, whose Control call carries our Hello and the cloud's answer.
    async fn connect(
        &self,
        edge: &Arc<Edge>,
        address: &str,
    ) -> Result<
        (
            session::Session<tokio_rustls::client::TlsStream<ReadAhead>>,
            Duration,
            String,
        ),
        ConnectError,
    > {
        let tcp = TcpStream::connect(address)
            .await
            .map_err(|e| ConnectError::Tcp(address.to_string(), e))?;
        crate::io::net::tune(&tcp);
        let mut stream = self
            .tls
            .connect(self.server_name.clone(), ReadAhead::new(tcp))
            .await
            .map_err(ConnectError::Tls)?;
        crate::io::tls::tune_tunnel(stream.get_mut().1);
        // A renewed certificate is proven on this connection with its keying material.
        let renewal = self.certs.as_ref().and_then(|certs| {
            let exporter = crate::io::tls::renewal_exporter(&**stream.get_ref().1)?;
            Some(session::Renewal {
                certs: certs.clone(),
                exporter,
            })
        });
        let hello = Hello {
            protocol_version: proto::PROTOCOL_VERSION,
            node_name: self.node.clone(),
            token: self.token.clone(),
            identity_kind: self.identity.as_str().into(),
            agent_version: env!("CARGO_PKG_VERSION").into(),
        };
        let (session, welcome) = session::register(edge, stream, hello, renewal).await?;
        Ok((
            session,
            Duration::from_millis(welcome.heartbeat_interval_ms.max(100) as u64),
            welcome.cloud_id,
        ))
    }
}

fn with_cert(
    ca: &std::path::Path,
    cert: &ClientCert,
) -> Result<Arc<rustls::ClientConfig>, crate::io::tls::TlsError> {
    crate::io::tls::client_config_with_key(ca, cert.certs.clone(), cert.key.clone_key())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_starts_within_100_ms_and_caps_near_thirty() {
        let mut b = Backoff::new();
        let first = b.next_delay();
        assert!(
            first <= Duration::from_millis(100) && first >= Duration::from_millis(50),
            "{first:?}"
        );
        for _ in 0..20 {
            assert!(b.next_delay() <= Backoff::CAP);
        }
        assert!(b.next_delay() >= Backoff::CAP / 2);
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }

    #[test]
    fn reconnect_tries_every_address_at_once_then_backs_off() {
        let mut r = Reconnect::new(3);
        assert_eq!(r.current(), 0);
        assert!(!r.failed(), "the second address is tried at once");
        assert!(!r.failed(), "and the third");
        assert_eq!(r.current(), 2);
        assert!(r.failed(), "every address failed: back off");
        assert_eq!(r.current(), 0);
        assert!(!r.failed(), "a new round starts");
        r.registered(true);
        assert!(
            !r.failed() && !r.failed(),
            "a registration starts the count afresh"
        );
        assert!(r.failed());
        assert_eq!(r.current(), 1);
        r.next_address();
        assert_eq!(r.current(), 2, "a drain moves on");
    }
}
