//! Hot reload of the token file and the TLS certificate, key and client CA (for the edge
//! listener and the links between replicas): Kubernetes
//! updates a mounted Secret or ConfigMap by swapping a symlink, so the files are polled
//! (through the symlink) rather than watched. A file that fails to load leaves the
//! previous version in force and is logged; sessions whose token was revoked are closed.
//! The self-issued serving certificate (`csr.serving`) is renewed through the same
//! setters (`renew_serving`), and so is a relay's client certificate from the cluster
//! (`[relay.csr]`, `follow_client_cert`).

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::Context as _;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::serving::{self, SelfIssuer};
use crate::cloud::edges::authenticator::Authenticator;
use crate::cloud::edges::registry::Registry;
use crate::cloud::peer::{PeerTls, Peers};
use crate::config::CloudConfig;
use crate::config::token_file::{Beside, TokenFile};
use crate::csr::ClientCert;
use crate::io::tls::Identity;
use crate::ops::metrics::CloudMetrics;

/// How often the files are checked: a rotated Secret reaches the pod's volume within
/// about a minute anyway, so this adds little delay at negligible cost.
const POLL: Duration = Duration::from_secs(2);

/// A failed renewal of the serving certificate is retried this often while the current
/// one still serves.
const RETRY: Duration = Duration::from_secs(5);

/// What identifies a version of a file: it changes when the file is rewritten or its
/// symlink is swapped.
type Stamp = Option<(SystemTime, u64, u64)>;

fn stamp(path: &Path) -> Stamp {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len(), m.ino()))
}

fn stamps(paths: &[&Path]) -> Vec<Stamp> {
    paths.iter().map(|p| stamp(p)).collect()
}

/// What a reload replaces, each through its setter: the edges' TLS and the token file
/// (`Authenticator`), the links' TLS (`Peers`); and the sessions a revoked token closes.
#[derive(Clone)]
pub(crate) struct Reloaded {
    pub(crate) auth: Arc<Authenticator>,
    pub(crate) peers: Arc<Peers>,
    pub(crate) registry: Arc<Registry>,
    pub(crate) metrics: Arc<CloudMetrics>,
    /// With `csr.serving`, the certificate in force is in memory, not in `tunnel.cert`.
    pub(crate) serving: Option<Arc<SelfIssuer>>,
    /// With `[relay.csr]`, the certificate in force is the latest from the cluster.
    pub(crate) client_cert: Option<watch::Receiver<Arc<ClientCert>>>,
}

pub(crate) async fn watch(to: Reloaded, config: CloudConfig, shutdown: CancellationToken) {
    let t = &config.tunnel;
    // The peer links present the same certificate, checked against their own CA.
    let peer_ca = if to.peers.enabled() {
        config.peers.ca(t)
    } else {
        None
    };
    let tls_files: Vec<&Path> = [
        t.cert.as_deref(),
        t.key.as_deref(),
        t.client_ca.as_deref(),
        peer_ca,
    ]
    .into_iter()
    .flatten()
    .collect();
    let mut tls_seen = stamps(&tls_files);
    let mut tokens_seen = t.token_file.as_deref().map(stamp);
    loop {
        tokio::select! {
            () = tokio::time::sleep(POLL) => {}
            () = shutdown.cancelled() => return,
        }
        if let Some(path) = &t.token_file {
            let now = Some(stamp(path));
            if now != tokens_seen {
                tokens_seen = now;
                reload_tokens(&to, path, Beside::of(&config));
            }
        }
        let now = stamps(&tls_files);
        if now != tls_seen {
            tls_seen = now;
            reload_tls(&to, &config);
        }
    }
}

/// The certificate files changed, or a CA file did: everything is built again, from the
/// files or from the self-issued certificate in force.
fn reload_tls(to: &Reloaded, config: &CloudConfig) {
    let t = &config.tunnel;
    let identity = match (&to.serving, &to.client_cert, &t.cert, &t.key) {
        (Some(serving), _, _, _) => serving.current().context("no serving certificate yet"),
        (None, Some(client_cert), _, _) => Ok(client_cert.borrow().identity()),
        (None, None, Some(cert), Some(key)) => Identity::load(cert, key).map_err(Into::into),
        (None, None, _, _) => Err(anyhow::anyhow!("tunnel.cert and tunnel.key are not set")),
    };
    match identity.and_then(|identity| apply_tls(to, config, &identity)) {
        Ok(()) => info!("TLS certificate reloaded; new connections use it"),
        Err(e) => {
            error!(error = %format!("{e:#}"), "TLS files changed but do not load; keeping the previous certificate")
        }
    }
}

/// Puts `identity` in force for new handshakes: the edges' listener, and both ends of
/// new links between replicas; the links this process opened move to it
/// (`Peers::set_tls`). Other open connections keep what they began with. Nothing is
/// replaced unless everything loads, so edges and links never disagree.
pub(crate) fn apply_tls(
    to: &Reloaded,
    config: &CloudConfig,
    identity: &Identity,
) -> anyhow::Result<()> {
    let t = &config.tunnel;
    let tls = crate::io::tls::server_config_with(identity, t.client_ca.as_deref())?;
    let verifier = match &t.client_ca {
        Some(ca) => Some(crate::io::tls::client_cert_verifier(ca)?),
        None => None,
    };
    let peer = match to.peers.enabled() {
        true => Some(PeerTls::build(config, identity).context("peer TLS")?),
        false => None,
    };
    to.auth.set_tls(tls);
    if let Some(verifier) = verifier {
        to.auth.set_renewal_verifier(verifier);
    }
    if let Some(peer) = peer {
        to.peers.set_tls(peer);
        info!("peer TLS reloaded; new replica links use it and the open ones move to it");
    }
    Ok(())
}

/// Renews the self-issued serving certificate (`csr.serving`) before it expires, until `shutdown`. `first` is the expiry
/// of the certificate issued at start.
pub(crate) async fn renew_serving(
    issuer: Arc<SelfIssuer>,
    to: Reloaded,
    config: CloudConfig,
    first: SystemTime,
    shutdown: CancellationToken,
) {
    let mut wait = issuer.renew_in(first);
    loop {
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = shutdown.cancelled() => return,
        }
        wait = match issuer.issue() {
            Ok(issued) => match apply_tls(&to, &config, &issued.identity) {
                Ok(()) => {
                    serving::log_issued(&issued, "renewed");
                    issuer.renew_in(issued.not_after)
                }
                Err(e) => {
                    error!(error = %format!("{e:#}"), "renewed serving certificate does not load; keeping the previous one");
                    to.metrics.certificate_renewals_failed.inc();
                    RETRY
                }
            },
            Err(e) => {
                error!(error = %format!("{e:#}"), "cannot issue the serving certificate; keeping the previous one");
                to.metrics.certificate_renewals_failed.inc();
                RETRY
            }
        };
    }
}

/// Puts each renewal of a relay's client certificate (`[relay.csr]`, renewed by
/// `crate::csr`) in force for its links to the replicas, until `shutdown`.
pub(crate) async fn follow_client_cert(
    mut renewed: watch::Receiver<Arc<ClientCert>>,
    to: Reloaded,
    config: CloudConfig,
    shutdown: CancellationToken,
) {
    loop {
        tokio::select! {
            changed = renewed.changed() => if changed.is_err() { return },
            () = shutdown.cancelled() => return,
        }
        let identity = renewed.borrow_and_update().identity();
        match apply_tls(&to, &config, &identity) {
            Ok(()) => info!("client certificate renewed; the links to the replicas move to it"),
            Err(e) => {
                error!(error = %format!("{e:#}"), "renewed client certificate does not load; keeping the previous one")
            }
        }
    }
}

fn reload_tokens(to: &Reloaded, path: &Path, beside: Beside) {
    let tokens = match TokenFile::load(path, beside) {
        Ok(t) => Arc::new(t),
        Err(e) => {
            return error!(error = %e, "token file changed but does not load; keeping the previous tokens");
        }
    };
    to.auth.set_tokens(tokens.clone());
    info!(file = %path.display(), "token file reloaded");
    for session in to.registry.list() {
        if let Some(token) = session.token()
            && !tokens.verify(&session.node, &token)
        {
            warn!(node = %session.node, session = session.id, "token revoked; closing the edge's session");
            to.metrics
                .sessions_revoked
                .get_or_create(&crate::ops::metrics::ReasonLabel {
                    reason: "token_revoked",
                })
                .inc();
            session.close();
        }
    }
}
