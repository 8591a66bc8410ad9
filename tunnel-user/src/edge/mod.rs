//! `tunnel edge`: dials out to the cloud, registers, and serves the cloud's streams by
//! dialling allowed targets on this side. Reconnects with backoff whenever the session
//! ends.

pub mod dial;
pub mod hooks;
pub mod proxy;
pub mod reverse;
pub mod session;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use proto::Hello;
use rand::Rng;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::config::EdgeConfig;
use crate::io::read_ahead::ReadAhead;
use crate::ops::metrics::EdgeMetrics;
use dial::Allowlist;

pub struct Edge {
    pub config: EdgeConfig,
    pub allow: Allowlist,
    pub metrics: EdgeMetrics,
    /// TLS toward targets the cloud asks to reach over TLS (SuperEdge's HTTPS module).
    pub target_tls: TlsConnector,
    /// Edge-to-cloud connections waiting for their stream.
    pub reverse: reverse::Reverse,
}

impl Edge {
    /// Registered with the cloud right now.
    pub fn is_registered(&self) -> bool {
        self.metrics.registered.get() == 1
    }
}

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

/// Exponential backoff with jitter: the first retry comes within a second, later ones
/// spread out up to about 30 s so a fleet does not reconnect in lockstep.
/// A cloud of protocol 1 (before gRPC) refuses our ALPN during the TLS handshake.
fn older_cloud_hint(e: &std::io::Error) -> &'static str {
    if e.to_string().contains("NoApplicationProtocol") {
        " (the cloud does not speak protocol 2, gRPC: is it an older tunnel-cloud?)"
    } else {
        ""
    }
}

pub struct Backoff {
    attempt: u32,
}

impl Backoff {
    const BASE: Duration = Duration::from_millis(500);
    const CAP: Duration = Duration::from_secs(30);

    pub fn new() -> Self {
        Self { attempt: 0 }
    }

    pub fn reset(&mut self) {
        self.attempt = 0;
    }

    pub fn next_delay(&mut self) -> Duration {
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

fn load_token(config: &EdgeConfig) -> anyhow::Result<String> {
    match (&config.cloud.token, &config.cloud.token_file) {
        (Some(t), _) => Ok(t.clone()),
        (None, Some(path)) => Ok(std::fs::read_to_string(path)
            .with_context(|| format!("cannot read cloud.token_file {}", path.display()))?
            .trim()
            .to_string()),
        (None, None) => Ok(String::new()),
    }
}

/// Runs the pre-start hook; its failure stops the edge or is logged, as configured.
async fn pre_start(edge: &Edge) -> anyhow::Result<()> {
    let c = &edge.config;
    let env = hooks::HookEnv {
        node: c.node(),
        identity: c.identity,
        cloud_address: &c.cloud.address,
        cloud_id: "",
        state: "starting",
        session_count: 0,
    };
    match hooks::run("pre_start", &c.hooks.pre_start, &env, c.hooks.timeout).await {
        Ok(()) => Ok(()),
        Err(e) => {
            edge.metrics
                .hook_failures
                .get_or_create(&crate::ops::metrics::HookLabel { hook: "pre_start" })
                .inc();
            match c.hooks.failure {
                crate::config::HookFailure::Abort => Err(anyhow::Error::new(e)
                    .context("pre_start hook failed (hooks.failure = \"abort\")")),
                crate::config::HookFailure::Warn => {
                    warn!(error = %e, "pre_start hook failed; starting anyway (hooks.failure = \"warn\")");
                    Ok(())
                }
            }
        }
    }
}

/// Runs the post-start hook beside the session that just registered: the session must
/// keep answering heartbeats meanwhile, and a failure is only logged.
async fn post_start(edge: Arc<Edge>, cloud_address: String, cloud_id: String) {
    let c = &edge.config;
    let env = hooks::HookEnv {
        node: c.node(),
        identity: c.identity,
        cloud_address: &cloud_address,
        cloud_id: &cloud_id,
        state: "registered",
        session_count: edge.metrics.sessions.get(),
    };
    if let Err(e) = hooks::run("post_start", &c.hooks.post_start, &env, c.hooks.timeout).await {
        edge.metrics
            .hook_failures
            .get_or_create(&crate::ops::metrics::HookLabel { hook: "post_start" })
            .inc();
        warn!(error = %e, "post_start hook failed");
    }
}

/// Runs the edge until `shutdown` is cancelled.
pub async fn run(config: EdgeConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    let client = match (&config.cloud.cert, &config.cloud.key) {
        (Some(c), Some(k)) => Some((c.as_path(), k.as_path())),
        _ => None,
    };
    let tls = TlsConnector::from(crate::io::tls::client_config(&config.cloud.ca, client)?);
    let server_name = crate::io::tls::server_name(&config.cloud.server_name)?;
    // Read now so that a missing file fails the start; read again for every attempt.
    let mut token = load_token(&config)?;
    let https_client = config
        .https
        .as_ref()
        .map(|h| (h.cert.as_path(), h.key.as_path()));
    let target_tls = TlsConnector::from(crate::io::tls::target_client_config(https_client)?);
    let allow = Allowlist::new(&config.allow, dial::interface_addresses);
    let admin = match config.admin.listen {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot listen on {addr} (admin.listen)"))?,
        ),
        None => None,
    };
    let mut forwards = Vec::new();
    for (i, f) in config.reverse.forwards.iter().enumerate() {
        let listener = tokio::net::TcpListener::bind(f.listen)
            .await
            .with_context(|| {
                format!(
                    "cannot listen on {} (reverse.forward[{i}].listen)",
                    f.listen
                )
            })?;
        forwards.push((listener, f.clone()));
    }
    let proxy = match &config.proxy {
        Some(p) => {
            if !p.listen.ip().is_loopback() {
                warn!(listen = %p.listen, "the HTTP proxy listens beyond loopback: anyone who reaches it gets this node's edge-to-cloud access");
            }
            Some(
                tokio::net::TcpListener::bind(p.listen)
                    .await
                    .with_context(|| format!("cannot listen on {} (proxy.listen)", p.listen))?,
            )
        }
        None => None,
    };
    if allow.allows_any() {
        warn!(
            "no allowlist is set: this edge dials any target the cloud names (SuperEdge behaviour)"
        );
    }
    let edge_proxy_listen = config.proxy.as_ref().map(|p| p.listen);
    info!(node = %config.node(), identity = config.identity.as_str(), forwards = forwards.len(), proxy = ?edge_proxy_listen, cloud = %config.cloud.address, more_clouds = ?config.cloud.addresses, allow = %allow.describe(), admin = ?config.admin.listen, "tunnel edge started");
    let mut metrics_registry = prometheus_client::registry::Registry::default();
    let metrics = EdgeMetrics::new(&mut metrics_registry);
    crate::ops::metrics::RuntimeCollector::register(&mut metrics_registry);
    let edge = Arc::new(Edge {
        config,
        allow,
        metrics,
        target_tls,
        reverse: reverse::Reverse::default(),
    });
    pre_start(&edge).await?;
    for (listener, forward) in forwards {
        tokio::spawn(reverse::serve_forward(
            edge.clone(),
            listener,
            forward,
            shutdown.clone(),
        ));
    }
    if let Some(listener) = proxy {
        tokio::spawn(proxy::serve(edge.clone(), listener, shutdown.clone()));
    }
    if let Some(listener) = admin {
        let e = edge.clone();
        let handlers = crate::ops::admin::Handlers {
            ready: Arc::new(move || e.is_registered()),
            metrics: Arc::new(metrics_registry),
            debug: Arc::new(|_| None),
        };
        tokio::spawn(crate::ops::admin::serve(
            listener,
            handlers,
            shutdown.clone(),
        ));
    }

    let addresses: Vec<String> = edge.config.cloud_addresses().map(str::to_string).collect();
    let mut current = 0;
    // Addresses that failed in a row: another replica is tried at once, and the backoff
    // only starts once every address failed.
    let mut failed_in_a_row = 0;
    let mut backoff = Backoff::new();
    while !shutdown.is_cancelled() {
        let t = &edge.config.transport;
        let address = &addresses[current];
        // A projected service account token is rotated by the kubelet: the file holds
        // the current one. If it cannot be read now, the last one read is tried.
        if edge.config.cloud.token_file.is_some() {
            match load_token(&edge.config) {
                Ok(t) => token = t,
                Err(e) => {
                    warn!(error = %e, "cannot read the token file again; using the token read before")
                }
            }
        }
        let attempt = tokio::select! {
            r = tokio::time::timeout(t.handshake_timeout, connect(&edge, address, &tls, server_name.clone(), &token)) => r.unwrap_or(Err(ConnectError::Timeout)),
            () = shutdown.cancelled() => break,
        };
        match attempt {
            Ok((session, heartbeat_interval, cloud_id)) => {
                backoff.reset();
                failed_in_a_row = 0;
                edge.metrics.sessions.inc();
                edge.metrics.registered.set(1);
                info!(cloud = %address, cloud_id = %cloud_id, "registered with the cloud");
                tokio::spawn(post_start(edge.clone(), address.clone(), cloud_id));
                // Miss three heartbeats, or our own bound if that is longer, before giving up.
                let timeout = t.heartbeat_timeout.max(heartbeat_interval * 3);
                let ended = session.serve(timeout, &shutdown).await;
                edge.metrics.registered.set(0);
                match ended {
                    Ok(session::Ended::Drained) => {
                        // Straight to the next replica: the old session keeps carrying its
                        // connections meanwhile.
                        current = (current + 1) % addresses.len();
                        continue;
                    }
                    Ok(session::Ended::Closed) => {
                        info!(cloud = %address, "session with the cloud ended")
                    }
                    Err(why) => warn!(cloud = %address, %why, "session with the cloud failed"),
                }
            }
            Err(e) => {
                match e {
                    ConnectError::Register(session::RegisterError::Rejected { .. }) => {
                        error!(cloud = %address, error = %e, "registration refused")
                    }
                    _ => warn!(cloud = %address, error = %e, "cannot reach the cloud"),
                }
                current = (current + 1) % addresses.len();
                failed_in_a_row += 1;
                if failed_in_a_row < addresses.len() {
                    continue;
                }
                failed_in_a_row = 0;
            }
        }
        let delay = backoff.next_delay();
        info!(delay_ms = delay.as_millis() as u64, "reconnecting");
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = shutdown.cancelled() => break,
        }
    }
    info!("tunnel edge stopped");
    Ok(())
}

/// Dials the cloud at `address` and registers: TLS, then the gRPC side of the
/// connection, whose Control call carries our Hello and the cloud's answer.
async fn connect(
    edge: &Arc<Edge>,
    address: &str,
    tls: &TlsConnector,
    server_name: rustls::pki_types::ServerName<'static>,
    token: &str,
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
    let stream = tls
        .connect(server_name, ReadAhead::new(tcp))
        .await
        .map_err(ConnectError::Tls)?;
    let hello = Hello {
        protocol_version: proto::PROTOCOL_VERSION,
        node_name: edge.config.node().to_string(),
        token: token.to_string(),
        identity_kind: edge.config.identity.as_str().into(),
        agent_version: env!("CARGO_PKG_VERSION").into(),
    };
    let (session, welcome) = session::register(edge, stream, hello).await?;
    Ok((
        session,
        Duration::from_millis(welcome.heartbeat_interval_ms.max(100) as u64),
        welcome.cloud_id,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_starts_under_a_second_and_caps_near_thirty() {
        let mut b = Backoff::new();
        let first = b.next_delay();
        assert!(
            first < Duration::from_secs(1) && first >= Duration::from_millis(250),
            "{first:?}"
        );
        for _ in 0..20 {
            assert!(b.next_delay() <= Backoff::CAP);
        }
        assert!(b.next_delay() >= Backoff::CAP / 2);
        b.reset();
        assert!(b.next_delay() < Duration::from_secs(1));
    }
}
