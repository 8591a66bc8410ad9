//! `tunnel edge`: dials out to the cloud, registers, and serves the cloud's streams by
//! dialling allowed targets on this side. Reconnects with backoff whenever the session
//! ends.
//!
//! Components, wired by `run`: `connect` (dial-out, TLS, Hello, the reconnect loop),
//! `session` (the gRPC server side of each connection and its Control call; a Dial call
//! goes to `crate::call::serve`, a Reverse call to `reverse`), `dial` (the edge's
//! `Callee`: the allowlist, the connection and TLS to the target, the dial metrics),
//! `reverse` (edge-to-cloud connections) with its two
//! entries, the `[[reverse.forward]]` listeners and `proxy`, and `hooks`. `token` reads
//! the token the edge proves itself with.

pub(crate) mod connect;
pub mod dial;
pub(crate) mod hooks;
pub(crate) mod proxy;
pub(crate) mod reverse;
pub(crate) mod session;
pub(crate) mod token;

pub use connect::Reconnect;

use std::sync::Arc;

use prometheus_client::metrics::gauge::Gauge;
use tokio::net::TcpListener;
use tokio_rustls::TlsConnector;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::call::copy::Totals;
use crate::config::{CloudClientConfig, EdgeConfig, EdgeForwardConfig, TransportConfig};
use crate::io::accept::Incoming;
use crate::io::net::listen_error;
use crate::ops::admin::Handlers;
use crate::ops::metrics::EdgeMetrics;
use dial::{Allowlist, Dialer};
use proxy::Proxy;
use reverse::Reverse;

/// What a session with the cloud serves the cloud's calls with, each part made in `run`
/// from the config: the dials for `Edge.Dial`, the edge-to-cloud side for `Edge.Reverse`
/// and OpenReverse, and what the Control call and the copy need. Only `session` reads
/// it, and `call::serve` through the `Callee` it is (`dial`); the other components get
/// their own parts in `run` too.
pub(crate) struct Edge {
    /// `Edge.Dial`: the allowlist, the connection and TLS to targets, the dial metrics.
    dialer: Dialer,
    /// Edge-to-cloud connections waiting for their stream.
    reverse: Arc<Reverse>,
    /// The HTTP/2 settings of the connection to the cloud, and the copy's chunk size.
    transport: TransportConfig,
    /// Control messages that may wait to go out: as many as edge-to-cloud connections
    /// may wait (`reverse.max_pending`, at least 8), so a burst of them never finds the
    /// queue full while the call is healthy.
    control_queue: usize,
    /// The token the Control call sends again every `reauth_interval` when it comes
    /// from `token_file`.
    cloud: CloudClientConfig,
    /// The heartbeat round trip the cloud measured (`tunnel_edge_heartbeat_rtt_us`).
    heartbeat_rtt_us: Gauge,
    /// The bytes the edge's side of cloud-to-edge connections copied.
    bytes: Totals,
}

/// The edge's listeners, bound before anything runs, so that a port in use fails the
/// start. Each is recorded for the ready file (`--ready-file`) too.
struct Listeners {
    admin: Option<TcpListener>,
    forwards: Vec<(TcpListener, EdgeForwardConfig)>,
    proxy: Option<TcpListener>,
    ready: crate::ops::ready::ReadyFile,
    /// `transport.max_connections_per_listener`.
    max_connections: usize,
}

impl Listeners {
    async fn bind(
        config: &EdgeConfig,
        ready_file: Option<std::path::PathBuf>,
    ) -> anyhow::Result<Self> {
        let mut ready = crate::ops::ready::ReadyFile::new(ready_file);
        let admin = match config.admin.listen {
            Some(addr) => {
                let l = shared_listener(addr).map_err(|e| listen_error(addr, "admin.listen", e))?;
                ready.tcp("admin.listen", &l)?;
                Some(l)
            }
            None => None,
        };
        let mut forwards = Vec::new();
        for (i, f) in config.reverse.forwards.iter().enumerate() {
            let key = format!("reverse.forward[{i}].listen");
            let listener = TcpListener::bind(f.listen)
                .await
                .map_err(|e| listen_error(f.listen, &key, e))?;
            ready.tcp(&key, &listener)?;
            forwards.push((listener, f.clone()));
        }
        let proxy = match &config.proxy {
            Some(p) => {
                if !p.listen.ip().is_loopback() {
                    warn!(listen = %p.listen, "the HTTP proxy listens beyond loopback: anyone who reaches it gets this node's edge-to-cloud access");
                }
                let l = TcpListener::bind(p.listen)
                    .await
                    .map_err(|e| listen_error(p.listen, "proxy.listen", e))?;
                ready.tcp("proxy.listen", &l)?;
                Some(l)
            }
            None => None,
        };
        Ok(Self {
            admin,
            forwards,
            proxy,
            ready,
            max_connections: config.transport.max_connections_per_listener,
        })
    }

    /// Serves each listener in a task of its own until `shutdown`, then reports them in
    /// the ready file.
    fn serve(
        self,
        reverse: &Arc<Reverse>,
        proxy: Proxy,
        admin: Handlers,
        shutdown: &CancellationToken,
    ) -> anyhow::Result<()> {
        let max = self.max_connections;
        let incoming = |l, name: String| Incoming::new(l, name, max, shutdown.clone());
        for (l, forward) in self.forwards {
            let incoming = incoming(l, format!("reverse.forward {}", forward.listen));
            tokio::spawn(reverse::serve_forward(reverse.clone(), incoming, forward));
        }
        if let Some(l) = self.proxy {
            tokio::spawn(proxy::serve(Arc::new(proxy), incoming(l, "proxy".into())));
        }
        if let Some(l) = self.admin {
            tokio::spawn(crate::ops::admin::serve(incoming(l, "admin".into()), admin));
        }
        self.ready.report()
    }
}

/// A listener other edge processes of this user may bind too (`SO_REUSEPORT`): a rolling
/// update starts the new edge pod beside the old one on the host network, and both serve
/// the admin port until the old one leaves; each probe or scrape reaches one of them.
/// The readiness of one pod is its `--registered-file`.
fn shared_listener(addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    let socket = match addr {
        std::net::SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        std::net::SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    socket.set_reuseport(true)?;
    socket.bind(addr)?;
    socket.listen(1024)
}

/// Runs the edge until `shutdown` is cancelled. With `ready_file`, reports the address of
/// every listener there once all serve ([`crate::ops::ready`]); `registered_file` exists
/// while the edge is registered (`connect::Registered`).
pub async fn run(
    config: EdgeConfig,
    ready_file: Option<std::path::PathBuf>,
    registered_file: Option<std::path::PathBuf>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let mut metrics_registry = prometheus_client::registry::Registry::default();
    let metrics = EdgeMetrics::new(&mut metrics_registry);
    crate::ops::metrics::RuntimeCollector::register(&mut metrics_registry);
    let hooks = Arc::new(hooks::Hooks::new(&config, metrics.hook_failures.clone()));
    let https_client = config
        .https
        .as_ref()
        .map(|h| (h.cert.as_path(), h.key.as_path()));
    let target_tls = TlsConnector::from(crate::io::tls::target_client_config(https_client)?);
    // Read only when the config lists no node addresses: then a bad value stops the start.
    let node_ips = match std::env::var(crate::addr::NODE_IPS) {
        Ok(v) if config.allow.node_addresses.is_empty() && !v.trim().is_empty() => {
            Some(crate::addr::parse_node_ips(&v)?)
        }
        _ => None,
    };
    let allow = Allowlist::new(&config.allow, || dial::default_node_addresses(node_ips));
    let listeners = Listeners::bind(&config, ready_file).await?;
    if allow.allows_any() {
        warn!(
            "no allowlist is set: this edge dials any target the cloud names (SuperEdge behaviour)"
        );
    }
    let edge_proxy_listen = config.proxy.as_ref().map(|p| p.listen);
    info!(node = %config.node(), identity = config.identity.as_str(), forwards = listeners.forwards.len(), proxy = ?edge_proxy_listen, cloud = %config.cloud.address, more_clouds = ?config.cloud.addresses, allow = %allow.describe(), admin = ?config.admin.listen, "tunnel edge started");
    let reverse = Arc::new(Reverse::new(&config, &metrics));
    hooks.pre_start().await?;
    let proxy = Proxy::new(
        reverse.clone(),
        config.transport.handshake_timeout,
        metrics.proxy_requests.clone(),
    );
    // Before the wait for a certificate: a file a previous container left goes now.
    let registration = connect::Registered::new(metrics.registered.clone(), registered_file)?;
    let registered = metrics.registered.clone();
    let admin = Handlers {
        ready: Arc::new(move || match registered.get() {
            1 => Ok("ready".into()),
            _ => Err("not ready".into()),
        }),
        metrics: Arc::new(metrics_registry),
        debug: Arc::new(|_| None),
    };
    listeners.serve(&reverse, proxy, admin, &shutdown)?;
    if config.cloud.wait_for_ca && !crate::io::tls::wait_for_ca(&config.cloud.ca, &shutdown).await {
        return Ok(());
    }
    // After the listeners: waiting for a certificate may take a while, and the probes
    // must be answered meanwhile.
    let certs = match config.csr.enabled {
        true => match crate::csr::start(
            csr_params(&config),
            metrics.certificate_renewals_failed.clone(),
            &shutdown,
        )
        .await?
        {
            Some(certs) => Some(certs),
            None => return Ok(()),
        },
        false => None,
    };
    let connector = connect::Connector::new(
        &config,
        metrics.sessions.clone(),
        registration,
        hooks.clone(),
        certs,
    )?;
    let edge = Arc::new(Edge {
        dialer: Dialer::new(allow, target_tls, config.transport.dial_timeout, &metrics),
        reverse,
        control_queue: config.reverse.max_pending.max(8),
        transport: config.transport,
        cloud: config.cloud,
        heartbeat_rtt_us: metrics.heartbeat_rtt_us,
        bytes: metrics.bytes,
    });
    connector.run(edge, shutdown).await;
    info!("tunnel edge stopped");
    Ok(())
}

/// What `[csr]` asks the cluster for: a certificate naming this node.
fn csr_params(config: &EdgeConfig) -> crate::csr::Params {
    crate::csr::Params {
        role: crate::csr::Role::Edge,
        node: config.node().to_string(),
        dir: config.csr_dir(),
        signer_name: config.csr.signer_name.clone(),
        lifetime: config.csr.lifetime,
    }
}
