//! `tunnel cloud`: accepts edges, and carries cloud-side connections to them.
//!
//! Its folders follow the design doc: `conn` is the per-connection path (an entry
//! accepts a client -> `Router::route` says where it goes: a session in the `Registry`,
//! or a replica that holds the node (`peer`) -> `Opener::open` opens a call on that
//! session and the edge dials -> `Opener::carry` copies both ways); `edges` is the edges'
//! admission, authentication and sessions; `lifecycle` is the process around them
//! (listeners, handover, reload, serving certificate, what operators see). `kubernetes`
//! watches the API for the node table and the peer list. Beneath them all: `nodes` (the
//! node table) and `watch` (a watch's snapshot); below the cloud, `crate::call` (a
//! connection carried as a call, which the edge uses too).
//!
//! The folders stack in floors, and each uses only those below it: the ground (`nodes`,
//! `watch`), then `edges`, `peer`, `conn`, `lifecycle`, and this module with
//! `kubernetes` on top (`docs/design.md`, "The cloud's components";
//! `xtask/tests/module_cycles.rs` fails on an import back up).
//!
//! `run` wires these components; none reaches into another: each task is handed the
//! few it uses.

pub mod conn;
pub(crate) mod edges;
pub(crate) mod kubernetes;
pub(crate) mod lifecycle;
pub mod nodes;
pub mod peer;
#[cfg(test)]
mod tests;
pub(crate) mod watch;

use std::sync::Arc;

use anyhow::Context;
use prometheus_client::metrics::counter::Counter;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::token_file::{Beside, TokenFile};
use crate::config::{CloudConfig, OptimisticOk, Role};
use crate::intercept::Programs;
use crate::io::accept::Incoming;
use crate::io::unix;
use crate::ops::metrics::CloudMetrics;
use conn::connections::Connections;
use conn::proxy::Opener;
use conn::reached::Reached;
use conn::reverse::ReverseDialer;
use conn::router::Router;
use edges::admission::Admission;
use edges::authenticator::Authenticator;
use edges::capacity::EdgeCap;
use edges::registry::Registry;
pub use lifecycle::capabilities::Capabilities;
pub(crate) use lifecycle::listeners::Bound;
use lifecycle::listeners::{Binder, REDIRECT_FAILED};
use nodes::Nodes;
use peer::Peers;

/// Runs a cloud replica until `shutdown` is cancelled. With `ready_file`, reports the
/// address of every listener there once all serve ([`crate::ops::ready`]). With
/// [`Capabilities::DropAfterStart`], the process keeps only the capabilities serving
/// needs from then on ([`lifecycle::capabilities`]).
pub async fn run(
    mut config: CloudConfig,
    ready_file: Option<std::path::PathBuf>,
    shutdown: CancellationToken,
    capabilities: Capabilities,
) -> anyhow::Result<()> {
    // First: a relay would otherwise wait for its certificate before saying so.
    if config.redirect.enabled {
        let node_ips = std::env::var(crate::addr::NODE_IPS).ok();
        let own = crate::addr::interface_addresses();
        config
            .redirect
            .resolve_pod_port(node_ips.as_deref(), &own)
            .map_err(anyhow::Error::msg)?;
    }
    let Some(loaded) = Loaded::load(&config, &shutdown).await? else {
        return Ok(());
    };
    // Bind everything before serving anything, so a taken port fails the start. Or take
    // it all from the cloud running on this host, which keeps accepting until it stops.
    let mut binder = Binder::new(&config, ready_file)?;
    let mut bound = binder.bind_all(&config).await?;
    // Which socket file is ours, so the one a later process bound there is left alone.
    let connect_unix_file = config.connect.unix.as_deref().and_then(unix::file_id);
    if !binder.stand_by(&config, &shutdown).await {
        return Ok(());
    }
    // Only now, so a predecessor keeps its own programs until it stops accepting (and
    // when this process is stopped while standing by, they stay).
    if let Some(programs) = &mut bound.programs {
        programs.link().context(REDIRECT_FAILED)?;
    }
    let handover = binder.offer(&config, &shutdown)?;
    if capabilities == Capabilities::DropAfterStart {
        lifecycle::capabilities::drop_after_start(bound.programs.is_some())?;
    }
    serve_loaded(&config, loaded, bound, shutdown).await?;
    let successors = match handover {
        Some(h) => h.await.unwrap_or(0),
        None => 0,
    };
    // A successor serves the same socket at that path now, or another process bound a
    // new one there.
    if let Some(path) = &config.connect.unix
        && successors == 0
        && unix::file_id(path) == connect_unix_file
    {
        let _ = std::fs::remove_file(path);
    }
    info!("tunnel cloud stopped");
    Ok(())
}

/// What a cloud reads before it serves, so that a file that does not load or an API it
/// cannot reach fails the start.
struct Loaded {
    tls: Arc<rustls::ServerConfig>,
    tokens: Option<Arc<TokenFile>>,
    peer_tls: Option<peer::PeerTls>,
    kube: Option<kube::Client>,
    /// The CSR signer (`csr.enabled`) and the certificates it stands behind.
    csr: Option<(Arc<edges::csr::CsrSigner>, Arc<edges::csr::Issued>)>,
    /// With `csr.serving`: the issuer of this replica's serving certificate, and when the
    /// one issued at start expires.
    serving: Option<SelfIssued>,
    /// With `[relay.csr]`: the relay's client certificate from the cluster, renewed.
    client_cert: Option<ClientCerts>,
    /// Failed renewals of this process's certificate (`tunnel_certificate_renewals_failed`),
    /// counted from before the metrics exist.
    certificate_renewals_failed: Counter,
    /// With `csr.ca_config_map`: what keeps the CA published there.
    ca_guard: Option<lifecycle::ca::Guard>,
}

/// The issuer of a replica's own serving certificate, and when the one issued at start
/// expires.
type SelfIssued = (Arc<lifecycle::serving::SelfIssuer>, std::time::SystemTime);

/// A relay's client certificate from the cluster (`[relay.csr]`), renewed under it.
type ClientCerts = tokio::sync::watch::Receiver<Arc<crate::csr::ClientCert>>;

impl Loaded {
    /// None when `shutdown` came while a relay waited for its CA or its certificate.
    async fn load(
        config: &CloudConfig,
        shutdown: &CancellationToken,
    ) -> anyhow::Result<Option<Self>> {
        let t = &config.tunnel;
        let kube = match config.kubernetes.enabled {
            true => Some(
                ::kube::Client::try_default()
                    .await
                    .context("kubernetes.enabled: cannot set up the Kubernetes client")?,
            ),
            false => None,
        };
        // The CA files everything below loads may come from the cluster.
        let ca_guard = match &kube {
            Some(client) => lifecycle::ca::bootstrap(config, client).await?,
            None => None,
        };
        // A relay's links check the replicas against the CA the cloud publishes, which a
        // relay started first on a fresh install waits for rather than exits.
        if let Some(ca) = config.peers.ca(t).filter(|_| config.relay.wait_for_ca)
            && !crate::io::tls::wait_for_ca(ca, shutdown).await
        {
            return Ok(None);
        }
        let certificate_renewals_failed = Counter::default();
        let (identity, serving, client_cert) = match config.relay.csr.enabled {
            true => match relay_certificate(config, certificate_renewals_failed.clone(), shutdown)
                .await?
            {
                Some(certs) => {
                    let identity = certs.borrow().identity();
                    (identity, None, Some(certs))
                }
                None => return Ok(None),
            },
            false => {
                let (identity, serving) = serving_identity(config)?;
                (identity, serving, None)
            }
        };
        let tls = crate::io::tls::server_config_with(&identity, t.client_ca.as_deref())?;
        let tokens = match &t.token_file {
            Some(path) => Some(Arc::new(TokenFile::load(path, Beside::of(config))?)),
            None => None,
        };
        // A relay links to the replicas with its own certificate; it listens for none.
        let links = config.peers.listen.is_some() || config.role == Role::Relay;
        let peer_tls = match links {
            true => Some(peer::PeerTls::build(config, &identity)?),
            false => None,
        };
        let csr = match (&kube, config.csr.enabled) {
            (Some(client), true) => {
                let issued = Arc::new(edges::csr::Issued::new(&config.csr.signer_name));
                let signer = edges::csr::CsrSigner::new(client.clone(), config, issued.clone())
                    .context("csr: cannot load the signer's CA")?;
                Some((Arc::new(signer), issued))
            }
            _ => None,
        };
        Ok(Some(Self {
            tls,
            tokens,
            peer_tls,
            kube,
            csr,
            serving,
            client_cert,
            certificate_renewals_failed,
            ca_guard,
        }))
    }
}

/// A relay's client certificate from the cluster (`[relay.csr]`): the one on disk, or
/// one asked for by CSR and waited for; renewed from then on. None when `shutdown`
/// came first.
async fn relay_certificate(
    config: &CloudConfig,
    renewals_failed: Counter,
    shutdown: &CancellationToken,
) -> anyhow::Result<Option<ClientCerts>> {
    let node = config
        .relay
        .node_name
        .clone()
        .or_else(|| std::env::var("NODE_NAME").ok().filter(|n| !n.is_empty()));
    let node = node.context(
        "[relay.csr]: relay.node_name is not set, and NODE_NAME is not in the environment",
    )?;
    crate::addr::check_node_name(&node)
        .map_err(|p| anyhow::anyhow!("[relay.csr]: NODE_NAME `{node}`: {p}"))?;
    let c = &config.relay.csr;
    let params = crate::csr::Params {
        role: crate::csr::Role::Relay,
        node,
        dir: config.relay_csr_dir(),
        signer_name: c.signer_name.clone(),
        lifetime: c.lifetime,
    };
    crate::csr::start(params, renewals_failed, shutdown).await
}

/// The serving certificate at start: self-issued (`csr.serving`) or from the files.
fn serving_identity(
    config: &CloudConfig,
) -> anyhow::Result<(crate::io::tls::Identity, Option<SelfIssued>)> {
    let t = &config.tunnel;
    if !config.csr.serving {
        let (cert, key) = t
            .cert
            .as_deref()
            .zip(t.key.as_deref())
            .context("tunnel.cert and tunnel.key are required without csr.serving")?;
        return Ok((crate::io::tls::Identity::load(cert, key)?, None));
    }
    let issuer = Arc::new(
        lifecycle::serving::SelfIssuer::load(config).context("csr.serving: cannot load the CA")?,
    );
    let issued = issuer.issue().context("csr.serving: cannot issue")?;
    lifecycle::serving::log_issued(&issued, "issued");
    Ok((issued.identity, Some((issuer, issued.not_after))))
}

/// How long a starting cloud waits for the API's first list of nodes and replicas
/// before its entries accept without them.
const FIRST_LIST_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Builds the components, serves until `shutdown`, then drains and stops.
async fn serve_loaded(
    config: &CloudConfig,
    mut loaded: Loaded,
    mut bound: Bound,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let mut metrics_registry = prometheus_client::registry::Registry::default();
    let id = config.tunnel.cloud_id.clone().unwrap_or_else(hostname);
    let programs = bound.programs.take();
    let (c, admission) = Components::build(
        config,
        &mut loaded,
        programs,
        &id,
        &mut metrics_registry,
        &shutdown,
    )?;
    log_started(config, &id, &c.registry);

    let mut tasks = JoinSet::new();
    let stop = || shutdown.clone();
    let max_connections = config.transport.max_connections_per_listener;
    let incoming = |l, name: &str| Incoming::new(l, name, max_connections, stop());
    let identity = (loaded.serving.take(), loaded.client_cert.take());
    spawn_reloads(&mut tasks, config, &c, identity, &shutdown);
    if let Some(l) = bound.peers.take() {
        let name = config.peers.server_name.clone();
        let (weak, metrics) = (Arc::downgrade(&c.registry), c.metrics.clone());
        let l = incoming(l, "peers");
        tasks.spawn(peer::serve(c.peers.clone(), weak, metrics, l, name, stop()));
    }
    c.peers
        .set_addresses(&config.peers.static_peers.iter().cloned().collect());
    // Cancelled once the API has listed the nodes and the replicas (at once without the
    // API): until then the table and the peer list are the config's.
    let listed = CancellationToken::new();
    match loaded.kube.clone() {
        Some(client) => {
            let (nodes, peers) = (c.nodes.clone(), c.peers.clone());
            let first_list =
                kubernetes::start(client, config, nodes, peers, &mut tasks, &shutdown)?;
            let (done, stop) = (listed.clone(), stop());
            tasks.spawn(async move {
                tokio::select! {
                    () = first_list => done.cancel(),
                    () = stop.cancelled() => {}
                }
            });
            // The entries (and edges) are accepted only once the API has listed the
            // nodes and the replicas: a redirected connection to a node the first list
            // has not brought yet would be refused, and a cloud taking over from
            // another on its host serves at once. Clients wait in the listeners'
            // backlogs meanwhile.
            tokio::select! {
                () = listed.cancelled() => {}
                () = tokio::time::sleep(FIRST_LIST_WAIT) => warn!(
                    "the Kubernetes API has not listed the nodes and replicas within {FIRST_LIST_WAIT:?}; serving with the config's until it does"
                ),
                () = shutdown.cancelled() => {}
            }
        }
        None => listed.cancel(),
    }
    spawn_entries(
        &mut tasks,
        &mut bound,
        (&c.router, &c.opener, &c.programs),
        config,
        &shutdown,
    );
    if let Some(l) = bound.edges.take() {
        // Held only while an edge connection is admitted: the handshakes at once.
        let handshakes = config.tunnel.max_handshakes.min(max_connections);
        let edges = Incoming::new(l, "edges", handshakes, stop());
        tasks.spawn(edges::admission::serve(Arc::new(admission), edges));
    }
    if let Some((signer, _)) = loaded.csr.take() {
        tasks.spawn(edges::csr::run(signer, c.peers.clone(), stop()));
    }
    if let Some(guard) = loaded.ca_guard.take() {
        tasks.spawn(guard.run(stop()));
    }
    if let Some(l) = bound.admin {
        tasks.spawn(crate::ops::admin::serve(
            incoming(l, "admin"),
            admin_handlers(metrics_registry, &c.registry, &c.connections),
        ));
    }
    if config.redirect.enabled {
        let (programs, after, until) =
            (c.programs.clone(), config.redirect.fail_open_after, stop());
        tasks.spawn(async move { programs.keep_alive_until(after, until).await });
        let (router, programs) = (c.router.clone(), c.programs.clone());
        tasks.spawn(conn::outage::mark_without_tunnel(
            router,
            programs,
            listed,
            stop(),
        ));
    }
    bound.ready.report()?;
    shutdown.cancelled().await;
    c.stop(config, loaded.kube, tasks).await;
    Ok(())
}

/// The cloud's components (docs/design.md, "The cloud's components"), built once at
/// start; `serve_loaded` hands each task the few it uses.
struct Components {
    metrics: Arc<CloudMetrics>,
    programs: Arc<Programs>,
    nodes: Arc<Nodes>,
    registry: Arc<Registry>,
    connections: Arc<Connections>,
    auth: Arc<Authenticator>,
    peers: Arc<Peers>,
    router: Arc<Router>,
    opener: Arc<Opener>,
}

impl Components {
    /// The components, and the edges' `Admission` over them; the metrics are registered
    /// in `metrics_registry`. Takes the peer links' TLS out of `loaded`.
    fn build(
        config: &CloudConfig,
        loaded: &mut Loaded,
        programs: Option<crate::intercept::Interceptor>,
        id: &str,
        metrics_registry: &mut prometheus_client::registry::Registry,
        shutdown: &CancellationToken,
    ) -> anyhow::Result<(Self, Admission)> {
        let renewals_failed = loaded.certificate_renewals_failed.clone();
        let metrics = Arc::new(CloudMetrics::new(metrics_registry, renewals_failed));
        crate::ops::metrics::RuntimeCollector::register(metrics_registry);
        let programs = Arc::new(Programs::new(programs));
        let nodes = Arc::new(Nodes::new(
            &config.nodes,
            &config.kubernetes.service_cidrs,
            programs.clone(),
            metrics.node_addresses_dropped.clone(),
            config.kubernetes.enabled,
        ));
        let cap = EdgeCap::new(config.tunnel.max_edges, nodes.clone());
        let registry = Arc::new(Registry::new(cap));
        let connections = Arc::new(Connections::default());
        let t = &config.transport;
        let auth = authenticator(config, loaded, nodes.clone())?;
        let peer_tls = loaded.peer_tls.take();
        let peers = Peers::new(id.to_string(), peer_tls, t.clone(), shutdown.clone());
        let router = Arc::new(Router::new(nodes.clone(), registry.clone(), peers.clone()));
        let opener = Arc::new(Opener::new(
            router.clone(),
            connections.clone(),
            metrics.clone(),
            t,
            recent_targets(config),
        ));
        let reverse = ReverseDialer::new(
            config.reverse.clone(),
            t.clone(),
            connections.clone(),
            metrics.clone(),
        );
        let admission = Admission::new(
            auth.clone(),
            registry.clone(),
            Arc::new(reverse),
            metrics.clone(),
            id.to_string(),
            t.clone(),
            config.tunnel.reauth_interval,
        );
        metrics_registry.register_collector(Box::new(lifecycle::observe::EdgeCollector {
            registry: Arc::downgrade(&registry),
            router: Arc::downgrade(&router),
            programs: programs.clone(),
        }));
        let components = Self {
            metrics,
            programs,
            nodes,
            registry,
            connections,
            auth,
            peers,
            router,
            opener,
        };
        Ok((components, admission))
    }

    /// After `shutdown`: the redirect's pins go if its DaemonSet was deleted, the live
    /// connections drain, then the sessions close, the tasks stop and the eBPF programs
    /// detach.
    async fn stop(&self, config: &CloudConfig, kube: Option<kube::Client>, mut tasks: JoinSet<()>) {
        // Before the drain, which may last until the kubelet's SIGKILL: the pins go now,
        // and the programs they held stay attached until this process exits.
        if let (Some(ds), Some(client), Some(pin_dir)) = (
            &config.redirect.uninstall_with_daemonset,
            kube,
            &config.redirect.pin_dir,
        ) {
            let cgroup = config.redirect.cgroup.as_deref();
            lifecycle::redirect_owner::uninstall_if_deleted(client, ds, pin_dir, cgroup).await;
        }
        // The listeners stopped with `shutdown`; now let the live connections finish.
        drain(
            &self.registry,
            &self.connections,
            config.tunnel.drain_timeout,
        )
        .await;
        for session in self.registry.list() {
            session.close();
        }
        tasks.shutdown().await;
        // The eBPF programs detach here, not at some later drop.
        self.programs.detach();
    }
}

/// The reload of the token and TLS files, with `csr.serving` the renewal of this
/// replica's serving certificate, and with `[relay.csr]` the relay's renewed client
/// certificate: each puts what changed in force through the setters `Reloaded` holds.
fn spawn_reloads(
    tasks: &mut JoinSet<()>,
    config: &CloudConfig,
    c: &Components,
    (serving, client_cert): (Option<SelfIssued>, Option<ClientCerts>),
    shutdown: &CancellationToken,
) {
    let reloaded = lifecycle::reload::Reloaded {
        auth: c.auth.clone(),
        peers: c.peers.clone(),
        registry: c.registry.clone(),
        metrics: c.metrics.clone(),
        serving: serving.as_ref().map(|(issuer, _)| issuer.clone()),
        client_cert: client_cert.clone(),
    };
    if let Some(renewed) = client_cert {
        let (to, config) = (reloaded.clone(), config.clone());
        tasks.spawn(lifecycle::reload::follow_client_cert(
            renewed,
            to,
            config,
            shutdown.clone(),
        ));
    }
    if let Some((issuer, first)) = serving {
        let (to, config) = (reloaded.clone(), config.clone());
        tasks.spawn(lifecycle::reload::renew_serving(
            issuer,
            to,
            config,
            first,
            shutdown.clone(),
        ));
    }
    tasks.spawn(lifecycle::reload::watch(
        reloaded,
        config.clone(),
        shutdown.clone(),
    ));
}

/// One task per entry listener in `bound` (taken out of it): each gets the router, the
/// opener, and what its kind of entry needs besides.
fn spawn_entries(
    tasks: &mut JoinSet<()>,
    bound: &mut Bound,
    (router, opener, programs): (&Arc<Router>, &Arc<Opener>, &Arc<Programs>),
    config: &CloudConfig,
    shutdown: &CancellationToken,
) {
    let (r, o) = (router, opener);
    let max = config.transport.max_connections_per_listener;
    let incoming = |l, name: String| Incoming::new(l, name, max, shutdown.clone());
    let head_timeout = config.transport.handshake_timeout;
    for (l, forward) in std::mem::take(&mut bound.forwards) {
        let l = incoming(l, format!("forward {}", forward.listen));
        tasks.spawn(conn::entry::forward::serve(
            r.clone(),
            o.clone(),
            l,
            forward,
        ));
    }
    let answer = conn::entry::connect::Answer {
        optimistic: config.connect.optimistic_ok,
        head_timeout,
    };
    if let Some(l) = bound.connect_tcp.take() {
        let l = incoming(l, "connect".into());
        tasks.spawn(conn::entry::connect::serve_tcp(
            r.clone(),
            o.clone(),
            l,
            answer,
        ));
    }
    for (l, acceptor, https) in std::mem::take(&mut bound.https) {
        let l = incoming(l, format!("https {}", https.listen));
        let serve =
            conn::entry::https::serve(r.clone(), o.clone(), l, acceptor, https, head_timeout);
        tasks.spawn(serve);
    }
    for l in std::mem::take(&mut bound.redirect) {
        let l = incoming(l, "redirect".into());
        tasks.spawn(conn::entry::redirect::serve(
            r.clone(),
            o.clone(),
            programs.clone(),
            l,
        ));
    }
    if let Some(l) = bound.connect_unix.take() {
        let l = Incoming::new(l, "connect-unix", max, shutdown.clone());
        tasks.spawn(conn::entry::connect::serve_unix(
            r.clone(),
            o.clone(),
            l,
            answer,
        ));
    }
}

fn log_started(config: &CloudConfig, id: &str, registry: &Registry) {
    info!(
        cloud_id = %id,
        role = ?config.role,
        edges = ?config.tunnel.listen,
        max_edges = %registry.describe_cap(),
        max_handshakes = config.tunnel.max_handshakes,
        auth = %auth_mode(config),
        nodes = config.nodes.len(),
        forwards = config.forwards.len(),
        https = config.https.len(),
        connect = ?config.connect.listen,
        connect_unix = ?config.connect.unix,
        admin = ?config.admin.listen,
        redirect = %redirect_summary(config),
        peers = ?config.peers.listen,
        static_peers = config.peers.static_peers.len(),
        "tunnel cloud started"
    );
}

/// The list of recently reached targets, for an HTTP CONNECT entry that answers them
/// early (`connect.optimistic_ok = "recent"`); none without one.
fn recent_targets(config: &CloudConfig) -> Option<Reached> {
    let connect = &config.connect;
    let asks = connect.optimistic_ok == OptimisticOk::Recent
        && (connect.listen.is_some() || connect.unix.is_some());
    asks.then(|| Reached::new(OptimisticOk::RECENT))
}

/// Who may register: the TLS and tokens loaded, TokenReview, the CSR signer's
/// certificates, and the client CA that renewed certificates are checked against.
fn authenticator(
    config: &CloudConfig,
    loaded: &Loaded,
    nodes: Arc<Nodes>,
) -> anyhow::Result<Arc<Authenticator>> {
    let auth = Authenticator::new(
        loaded.tls.clone(),
        loaded.tokens.clone(),
        token_reviewer(config, loaded.kube.as_ref()),
        nodes,
        config
            .kubernetes
            .enabled
            .then(|| config.kubernetes.edge_selector.clone()),
        loaded.csr.as_ref().map(|(_, issued)| issued.clone()),
    );
    if let Some(ca) = &config.tunnel.client_ca {
        auth.set_renewal_verifier(crate::io::tls::client_cert_verifier(ca)?);
    }
    Ok(Arc::new(auth))
}

fn token_reviewer(
    config: &CloudConfig,
    client: Option<&kube::Client>,
) -> Option<edges::token_review::TokenReviewer> {
    let k = &config.kubernetes;
    match (client, k.token_review) {
        (Some(client), true) => Some(edges::token_review::TokenReviewer::new(
            client.clone(),
            &k.token_audience,
            &k.edge_service_account,
            k.token_review_rate,
            k.token_review_cache,
        )),
        _ => None,
    }
}

/// `/readyz`, `/metrics` and the `/debug` listings of the admin listener.
fn admin_handlers(
    metrics: prometheus_client::registry::Registry,
    registry: &Arc<Registry>,
    connections: &Arc<Connections>,
) -> crate::ops::admin::Handlers {
    let (registry, connections) = (Arc::downgrade(registry), Arc::downgrade(connections));
    let edges = registry.clone();
    crate::ops::admin::Handlers {
        // Every listener is bound and serving by now. A full replica stays ready: it
        // serves its edges and the connections to them, and sends new edges elsewhere.
        ready: Arc::new(move || {
            Ok(edges
                .upgrade()
                .map_or_else(|| "ready".into(), |r| r.load().to_string()))
        }),
        metrics: Arc::new(metrics),
        debug: Arc::new(move |path| {
            let (registry, connections) = (registry.upgrade()?, connections.upgrade()?);
            lifecycle::observe::debug_listing(&registry, &connections, path)
        }),
    }
}

/// Tells every edge to open a session to another replica, then waits, at most `bound`,
/// for the proxied connections still open here to finish.
async fn drain(registry: &Registry, connections: &Connections, bound: std::time::Duration) {
    let sessions = registry.list();
    for session in &sessions {
        session.drain();
    }
    // Client connections of this replica, plus streams relayed for other replicas.
    let open =
        || connections.snapshot().len() + sessions.iter().map(|s| s.open_streams()).sum::<usize>();
    info!(edges = sessions.len(), open = open(), bound = ?bound, "draining");
    let all_closed = async {
        // Woken as each count reaches 0; checked again after, as a relayed stream may
        // have opened on a session meanwhile.
        while open() > 0 {
            connections.idle().await;
            for session in &sessions {
                session.idle().await;
            }
        }
    };
    match tokio::time::timeout(bound, all_closed).await {
        Ok(()) => info!("drained: no connection left"),
        Err(_) => warn!(
            open = open(),
            "drain bound reached; closing the remaining connections"
        ),
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

fn auth_mode(config: &CloudConfig) -> String {
    if config.role == Role::Relay {
        return "none: a relay admits no edge".into();
    }
    let modes = [
        (config.tunnel.token_file.is_some(), "token"),
        (
            config.tunnel.client_ca.is_some() && !config.csr.enabled,
            "client certificate",
        ),
        (
            config.csr.enabled,
            "client certificate (signed here from CertificateSigningRequests)",
        ),
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

pub(crate) fn hostname() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "tunnel-cloud".into())
}
