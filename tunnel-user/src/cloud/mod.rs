//! `tunnel cloud`: accepts edges, and carries cloud-side connections to them.
//!
//! Data flow: an entry (`entry::forward`, `entry::connect`, `entry::redirect`) accepts
//! a client -> `route` picks node and target -> `registry` finds the node's session ->
//! `session` opens a stream and the edge dials -> `stream::copy` copies both ways.

pub mod admission;
pub mod auth;
pub mod connections;
pub mod entry;
pub mod handover;
pub mod kubernetes;
pub mod limit;
pub mod observe;
pub mod peer;
pub mod proxy;
pub mod reauth;
pub mod redirect_owner;
pub mod registry;
pub mod reload;
pub mod reverse;
pub mod route;
pub mod session;
pub mod token_review;

use std::os::fd::AsFd as _;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, RwLock};

use anyhow::Context;
use tokio::net::{TcpListener, UnixListener};
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::cloud::auth::TokenFile;
use crate::config::{CloudConfig, TransportConfig};
use crate::intercept::{InterceptConfig, Interceptor};
use crate::ops::metrics::CloudMetrics;
use connections::Connections;
use registry::Registry;
use route::NodeTable;

/// State shared by every task of a cloud replica.
pub struct Cloud {
    /// This replica's name.
    pub id: String,
    pub transport: TransportConfig,
    pub registry: Registry,
    nodes: RwLock<Arc<NodeTable>>,
    tokens: RwLock<Option<Arc<TokenFile>>>,
    /// The edges' TLS server config; replaced when the certificate files change.
    tls: RwLock<Arc<rustls::ServerConfig>>,
    pub next_session_id: AtomicU64,
    pub next_connection_id: AtomicU64,
    pub metrics: CloudMetrics,
    pub connections: Connections,
    /// The eBPF redirect, when enabled; dropping it detaches the programs.
    pub intercept: Option<Interceptor>,
    /// The other replicas, and which nodes they hold.
    pub peers: Arc<peer::Peers>,
    /// Which cloud-side targets each edge may reach (`reverse.allow`).
    pub reverse: crate::config::ReverseConfig,
    /// How often live sessions' service account tokens are reviewed again.
    pub reauth_interval: std::time::Duration,
    /// Service account tokens checked with TokenReview (`kubernetes.token_review`).
    pub token_review: Option<token_review::TokenReviewer>,
    /// Failed registrations per source address.
    pub auth_limiter: limit::AuthLimiter,
    /// Log lines for failed registrations.
    pub register_log: limit::LogBudget,
}

impl Cloud {
    pub fn nodes(&self) -> Arc<NodeTable> {
        self.nodes.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn tokens(&self) -> Option<Arc<TokenFile>> {
        self.tokens
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub fn set_tokens(&self, tokens: Arc<TokenFile>) {
        *self.tokens.write().unwrap_or_else(|e| e.into_inner()) = Some(tokens);
    }

    /// The acceptor for the next edge connection, with the current certificate.
    pub fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.tls.read().unwrap_or_else(|e| e.into_inner()).clone())
    }

    pub fn set_tls(&self, tls: Arc<rustls::ServerConfig>) {
        *self.tls.write().unwrap_or_else(|e| e.into_inner()) = tls;
    }

    /// Called whenever an edge registers or goes away: the other replicas learn it.
    pub fn on_edges_changed(&self) {
        self.peers.local_edges_changed();
    }

    /// Whether some replica, this one or another, holds an edge session for `node`.
    pub fn is_connected(&self, node: &str) -> bool {
        self.registry.contains(node) || self.peers.holder(node, None).is_some()
    }

    /// Replaces the node table and brings the eBPF edge map in line with it.
    pub fn set_nodes(&self, nodes: NodeTable) {
        let nodes = Arc::new(nodes);
        *self.nodes.write().unwrap_or_else(|e| e.into_inner()) = nodes.clone();
        if let Some(intercept) = &self.intercept
            && let Err(e) = intercept.set_edges(&entry::redirect::edge_ips(&nodes))
        {
            tracing::error!(error = %e, "cannot update the eBPF edge map");
        }
    }
}

async fn bind(addr: std::net::SocketAddr, key: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr} ({key})"))
}

/// Where the listeners come from: taken from the cloud still running on this host
/// (`handover`), or bound here. With `handover.socket` each is offered to the next one.
/// Each is recorded for the ready file (`--ready-file`) too.
struct Listeners {
    taken: Option<handover::Taken>,
    offer: Option<handover::Offer>,
    bound: crate::ops::ready::Bound,
}

impl Listeners {
    fn new(config: &CloudConfig, ready_file: Option<std::path::PathBuf>) -> anyhow::Result<Self> {
        let socket = config.handover.socket.as_deref();
        Ok(Self {
            taken: socket.map(handover::take).transpose()?.flatten(),
            offer: socket.map(|_| handover::Offer::default()),
            bound: crate::ops::ready::Bound::new(ready_file),
        })
    }

    async fn tcp(&mut self, addr: std::net::SocketAddr, key: &str) -> anyhow::Result<TcpListener> {
        let listener = match self.taken.as_mut().and_then(|t| t.tcp(key, addr)) {
            Some(l) => l
                .set_nonblocking(true)
                .and_then(|()| TcpListener::from_std(l))
                .with_context(|| format!("cannot use the {key} listener handed over"))?,
            None => bind(addr, key).await?,
        };
        if let Some(offer) = &mut self.offer {
            offer.add(key, listener.as_fd())?;
        }
        self.bound.tcp(key, &listener)?;
        Ok(listener)
    }

    fn unix(&mut self, path: &std::path::Path, key: &str) -> anyhow::Result<UnixListener> {
        let listener = match self.taken.as_mut().and_then(|t| t.unix(key, path)) {
            Some(l) => l
                .set_nonblocking(true)
                .and_then(|()| UnixListener::from_std(l))
                .with_context(|| format!("cannot use the {key} listener handed over"))?,
            None => bind_unix(path, key)?,
        };
        if let Some(offer) = &mut self.offer {
            offer.add(key, listener.as_fd())?;
        }
        self.bound.unix(key, path);
        Ok(listener)
    }
}

/// Runs a cloud replica until `shutdown` is cancelled. With `ready_file`, reports the
/// address of every listener there once all serve ([`crate::ops::ready`]).
pub async fn run(
    config: CloudConfig,
    ready_file: Option<std::path::PathBuf>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let tls = crate::io::tls::server_config(
        &config.tunnel.cert,
        &config.tunnel.key,
        config.tunnel.client_ca.as_deref(),
    )?;
    let tokens = match &config.tunnel.token_file {
        Some(path) => Some(Arc::new(TokenFile::load(path)?)),
        None => None,
    };
    let id = config.tunnel.cloud_id.clone().unwrap_or_else(hostname);
    // Bind everything before serving anything, so a taken port fails the start. Or take
    // it all from the cloud running on this host, which keeps accepting until it stops.
    let mut listeners = Listeners::new(&config, ready_file)?;
    let edges = listeners.tcp(config.tunnel.listen, "tunnel.listen").await?;
    let mut forwards = Vec::new();
    for (i, f) in config.forwards.iter().enumerate() {
        forwards.push((
            listeners
                .tcp(f.listen, &format!("forward[{i}].listen"))
                .await?,
            f.clone(),
        ));
    }
    let mut https = Vec::new();
    for (i, h) in config.https.iter().enumerate() {
        let acceptor =
            tokio_rustls::TlsAcceptor::from(crate::io::tls::plain_server_config(&h.cert, &h.key)?);
        https.push((
            listeners
                .tcp(h.listen, &format!("https[{i}].listen"))
                .await?,
            acceptor,
            h.clone(),
        ));
    }
    let connect_tcp = match config.connect.listen {
        Some(addr) => Some(listeners.tcp(addr, "connect.listen").await?),
        None => None,
    };
    let connect_unix = match &config.connect.unix {
        Some(path) => Some(listeners.unix(path, "connect.unix")?),
        None => None,
    };
    // Which socket file is ours, so the one a later process bound there is left alone.
    let connect_unix_file = config.connect.unix.as_deref().and_then(file_id);
    let admin = match config.admin.listen {
        Some(addr) => Some(listeners.tcp(addr, "admin.listen").await?),
        None => None,
    };
    let peer_listener = match config.peers.listen {
        Some(addr) => Some(listeners.tcp(addr, "peers.listen").await?),
        None => None,
    };
    let peer_tls = match config.peers.listen {
        Some(_) => Some(peer::PeerTls::load(&config)?),
        None => None,
    };
    // Credentials first, so a cloud that cannot reach the API fails at start.
    let kube_client = if config.kubernetes.enabled {
        Some(
            ::kube::Client::try_default()
                .await
                .context("kubernetes.enabled: cannot set up the Kubernetes client")?,
        )
    } else {
        None
    };
    let redirect = if config.redirect.enabled {
        Some(bind_redirect(&config, &mut listeners).await?)
    } else {
        None
    };
    let (redirect_listeners, mut intercept) = match redirect {
        Some((listeners, intercept)) => (listeners, Some(intercept)),
        None => (Vec::new(), None),
    };
    if let Some(taken) = listeners.taken.take() {
        info!(
            listeners = taken.used(),
            not_used = taken.unused(),
            socket = ?config.handover.socket,
            "took the listeners from the tunnel cloud running on this host; standing by until it stops accepting"
        );
        tokio::select! {
            () = taken.predecessor_stopped() => {}
            () = shutdown.cancelled() => {
                info!("stopped while standing by; the running cloud keeps serving");
                return Ok(());
            }
        }
        info!("the previous tunnel cloud stopped accepting: this one serves now");
    }
    // Only now, so a predecessor keeps its own programs until it stops accepting (and
    // when this process is stopped while standing by, they stay).
    if let Some(intercept) = &mut intercept {
        intercept.link().context(REDIRECT_FAILED)?;
    }
    let handover = match (&config.handover.socket, listeners.offer) {
        (Some(path), Some(offer)) => Some(tokio::spawn(handover::serve(
            handover::bind(path)?,
            path.clone(),
            offer,
            shutdown.clone(),
        ))),
        _ => None,
    };

    let mut metrics_registry = prometheus_client::registry::Registry::default();
    let metrics = CloudMetrics::new(&mut metrics_registry);
    crate::ops::metrics::RuntimeCollector::register(&mut metrics_registry);
    let peers = peer::Peers::new(
        id.clone(),
        peer_tls,
        config.transport.clone(),
        shutdown.clone(),
    );
    let cloud = Arc::new(Cloud {
        id: id.clone(),
        transport: config.transport.clone(),
        registry: Registry::default(),
        nodes: RwLock::new(Arc::new(NodeTable::default())),
        tokens: RwLock::new(tokens),
        tls: RwLock::new(tls),
        next_session_id: AtomicU64::new(1),
        next_connection_id: AtomicU64::new(1),
        metrics,
        connections: Connections::default(),
        intercept,
        peers: peers.clone(),
        reverse: config.reverse.clone(),
        reauth_interval: config.tunnel.reauth_interval,
        token_review: match (&kube_client, config.kubernetes.token_review) {
            (Some(client), true) => {
                let k = &config.kubernetes;
                Some(token_review::TokenReviewer::new(
                    client.clone(),
                    &k.token_audience,
                    &k.edge_service_account,
                    k.token_review_rate,
                    k.token_review_cache,
                ))
            }
            _ => None,
        },
        auth_limiter: limit::AuthLimiter::default(),
        register_log: limit::LogBudget::new(20, std::time::Duration::from_secs(10)),
    });
    cloud.set_nodes(NodeTable::from_config(&config.nodes));
    metrics_registry.register_collector(Box::new(observe::EdgeCollector(Arc::downgrade(&cloud))));

    info!(
        cloud_id = %id,
        edges = %config.tunnel.listen,
        auth = %auth_mode(&config),
        nodes = config.nodes.len(),
        forwards = config.forwards.len(),
        https = config.https.len(),
        connect = ?config.connect.listen,
        connect_unix = ?config.connect.unix,
        admin = ?config.admin.listen,
        redirect = %redirect_summary(&config),
        peers = ?config.peers.listen,
        static_peers = config.peers.static_peers.len(),
        "tunnel cloud started"
    );

    let mut tasks = tokio::task::JoinSet::new();
    tasks.spawn(admission::serve(cloud.clone(), edges, shutdown.clone()));
    tasks.spawn(reload::watch(
        cloud.clone(),
        config.clone(),
        shutdown.clone(),
    ));
    for (listener, forward) in forwards {
        tasks.spawn(entry::forward::serve(
            cloud.clone(),
            listener,
            forward,
            shutdown.clone(),
        ));
    }
    if let Some(l) = connect_tcp {
        tasks.spawn(entry::connect::serve_tcp(
            cloud.clone(),
            l,
            config.connect.optimistic_ok,
            shutdown.clone(),
        ));
    }
    for (listener, acceptor, entry) in https {
        tasks.spawn(entry::https::serve(
            cloud.clone(),
            listener,
            acceptor,
            entry,
            shutdown.clone(),
        ));
    }
    for l in redirect_listeners {
        tasks.spawn(entry::redirect::serve(cloud.clone(), l, shutdown.clone()));
    }
    if let Some(l) = connect_unix {
        tasks.spawn(entry::connect::serve_unix(
            cloud.clone(),
            l,
            config.connect.optimistic_ok,
            shutdown.clone(),
        ));
    }
    if let Some(l) = peer_listener {
        tasks.spawn(peer::serve(
            cloud.clone(),
            l,
            config.peers.server_name.clone(),
            shutdown.clone(),
        ));
        peers.set_addresses(
            &config
                .peers
                .static_peers
                .iter()
                .cloned()
                .collect::<std::collections::BTreeSet<_>>(),
        );
    }
    let owner_check = match (&config.redirect.uninstall_with_daemonset, &kube_client) {
        (Some(ds), Some(client)) => Some((client.clone(), ds.clone())),
        _ => None,
    };
    if let Some(client) = kube_client {
        let (nodes, static_peers) = (config.nodes.clone(), config.peers.static_peers.clone());
        kubernetes::start(
            &cloud,
            client,
            &config.kubernetes,
            nodes,
            static_peers,
            &mut tasks,
            &shutdown,
        );
    }
    if let Some(l) = admin {
        let weak = Arc::downgrade(&cloud);
        let handlers = crate::ops::admin::Handlers {
            // Every listener is bound and serving by now.
            ready: Arc::new(|| true),
            metrics: Arc::new(metrics_registry),
            debug: Arc::new(move |path| {
                weak.upgrade()
                    .and_then(|c| observe::debug_listing(&c, path))
            }),
        };
        tasks.spawn(crate::ops::admin::serve(l, handlers, shutdown.clone()));
    }
    listeners.bound.report()?;
    shutdown.cancelled().await;
    // The listeners stopped with `shutdown`; now let the live connections finish.
    drain(&cloud, config.tunnel.drain_timeout).await;
    if let (Some((client, ds)), Some(pin_dir)) = (owner_check, &config.redirect.pin_dir) {
        redirect_owner::uninstall_if_deleted(
            client,
            &ds,
            pin_dir,
            config.redirect.cgroup.as_deref(),
        )
        .await;
    }
    for session in cloud.registry.list() {
        session.close();
    }
    tasks.shutdown().await;
    // The last reference: the eBPF programs detach here, not at some later drop.
    match Arc::try_unwrap(cloud) {
        Ok(cloud) => drop(cloud),
        Err(_) => {
            tracing::warn!("cloud state still referenced at shutdown; eBPF programs detach at exit")
        }
    }
    let successors = match handover {
        Some(h) => h.await.unwrap_or(0),
        None => 0,
    };
    // A successor serves the same socket at that path now, or another process bound a
    // new one there.
    if let Some(path) = &config.connect.unix
        && successors == 0
        && file_id(path) == connect_unix_file
    {
        let _ = std::fs::remove_file(path);
    }
    info!("tunnel cloud stopped");
    Ok(())
}

/// Tells every edge to open a session to another replica, then waits, at most `bound`,
/// for the proxied connections still open here to finish.
async fn drain(cloud: &Cloud, bound: std::time::Duration) {
    let sessions = cloud.registry.list();
    for session in &sessions {
        session.drain();
    }
    // Client connections of this replica, plus streams relayed for other replicas.
    let open = || {
        cloud.connections.snapshot().len()
            + sessions.iter().map(|s| s.open_streams()).sum::<usize>()
    };
    info!(edges = sessions.len(), open = open(), bound = ?bound, "draining");
    let deadline = tokio::time::Instant::now() + bound;
    while open() > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    match open() {
        0 => info!("drained: no connection left"),
        n => tracing::warn!(
            open = n,
            "drain bound reached; closing the remaining connections"
        ),
    }
}

const REDIRECT_FAILED: &str = "cannot enable the eBPF redirect (set redirect.enabled = false to run without it; HTTP CONNECT and forwards still work)";

/// Binds the redirect listeners, then loads the eBPF programs that send connections to
/// them; `run` links the programs later (after the listeners, so no redirected connect
/// finds nobody listening; after a predecessor stopped accepting, when it stands by).
async fn bind_redirect(
    config: &CloudConfig,
    bound: &mut Listeners,
) -> anyhow::Result<(Vec<TcpListener>, Interceptor)> {
    let r = &config.redirect;
    let v4 = |addr: std::net::SocketAddr, key: &str| match addr {
        std::net::SocketAddr::V4(a) => Ok(a),
        std::net::SocketAddr::V6(_) => Err(anyhow::anyhow!("{key} must be an IPv4 address")),
    };
    let v6 = |addr: std::net::SocketAddr, key: &str| match addr {
        std::net::SocketAddr::V6(a) => Ok(a),
        std::net::SocketAddr::V4(_) => Err(anyhow::anyhow!("{key} must be an IPv6 address")),
    };
    let mut listeners = vec![bound.tcp(r.listen, "redirect.listen").await?];
    let redirect_to = v4(listeners[0].local_addr()?, "redirect.listen")?;
    let pod_redirect_to = match r.pod_listen {
        Some(addr) => {
            let l = bound.tcp(addr, "redirect.pod_listen").await?;
            let a = v4(l.local_addr()?, "redirect.pod_listen")?;
            listeners.push(l);
            Some(a)
        }
        None => None,
    };
    let redirect6_to = match bind_redirect6(r, bound).await? {
        Some(l) => {
            let a = v6(l.local_addr()?, "redirect.listen6")?;
            listeners.push(l);
            Some(a)
        }
        None => None,
    };
    let pod_redirect6_to = match r.pod_listen6 {
        Some(addr) => {
            let l = bound.tcp(addr, "redirect.pod_listen6").await?;
            let a = v6(l.local_addr()?, "redirect.pod_listen6")?;
            listeners.push(l);
            Some(a)
        }
        None => None,
    };
    let intercept = Interceptor::load(&InterceptConfig {
        cgroup: r.cgroup.clone(),
        redirect_to,
        pod_redirect_to,
        redirect6_to,
        pod_redirect6_to,
        ports: r.ports.clone(),
        exempt_cgroup: None,
        pin_dir: r.pin_dir.clone(),
    })
    .context(REDIRECT_FAILED)?;
    Ok((listeners, intercept))
}

/// The IPv6 redirect listener: `listen6` when configured (failing the start if it cannot
/// be bound), else `[::1]` on the port of `listen`, skipped with a warning on a host
/// without IPv6, where no client can dial an IPv6 edge anyway.
async fn bind_redirect6(
    r: &crate::config::RedirectConfig,
    bound: &mut Listeners,
) -> anyhow::Result<Option<TcpListener>> {
    if let Some(addr) = r.listen6 {
        return bound.tcp(addr, "redirect.listen6").await.map(Some);
    }
    let addr = r.default_listen6();
    match bound.tcp(addr, "redirect.listen6").await {
        Ok(l) => Ok(Some(l)),
        Err(e)
            if e.downcast_ref::<std::io::Error>().is_some_and(|io| {
                matches!(
                    io.raw_os_error(),
                    Some(libc::EADDRNOTAVAIL | libc::EAFNOSUPPORT)
                )
            }) =>
        {
            tracing::warn!(%addr, error = %e, "no IPv6 loopback: connects to IPv6 edge addresses are not redirected");
            Ok(None)
        }
        Err(e) => {
            Err(e.context("redirect.listen6 is [::1] on the port of redirect.listen by default"))
        }
    }
}

fn redirect_summary(config: &CloudConfig) -> String {
    let r = &config.redirect;
    if !r.enabled {
        return "off".into();
    }
    let cgroup = r
        .cgroup
        .as_ref()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| "cgroup root (detected)".into());
    format!(
        "eBPF on {cgroup}, ports {:?} -> {} and {}{}{}",
        r.ports,
        r.listen,
        r.listen6.unwrap_or_else(|| r.default_listen6()),
        r.pod_listen
            .map(|p| format!(", pods -> {p}"))
            .unwrap_or_default(),
        r.pod_listen6
            .map(|p| format!(", pods (IPv6) -> {p}"))
            .unwrap_or_default()
    )
}

fn bind_unix(path: &std::path::Path, key: &str) -> anyhow::Result<UnixListener> {
    // A socket file left by a previous run would make bind fail; it is ours to replace.
    if std::fs::symlink_metadata(path).is_ok_and(|m| {
        use std::os::unix::fs::FileTypeExt;
        m.file_type().is_socket()
    }) {
        std::fs::remove_file(path)
            .with_context(|| format!("cannot remove stale socket {}", path.display()))?;
    }
    UnixListener::bind(path).with_context(|| format!("cannot listen on {} ({key})", path.display()))
}

/// Device and inode of `path`, if it exists.
fn file_id(path: &std::path::Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

fn auth_mode(config: &CloudConfig) -> String {
    let modes = [
        (config.tunnel.token_file.is_some(), "token"),
        (config.tunnel.client_ca.is_some(), "client certificate"),
        (
            config.kubernetes.token_review,
            "service account token (TokenReview)",
        ),
    ];
    let on: Vec<&str> = modes
        .iter()
        .filter(|(on, _)| *on)
        .map(|(_, name)| *name)
        .collect();
    if on.is_empty() {
        "none".into()
    } else {
        on.join(" or ")
    }
}

pub fn hostname() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "tunnel-cloud".into())
}
