//! The cloud's listeners, every one bound before anything serves, so a taken port fails
//! the start; or taken from the cloud still running on this host (`handover`), which
//! keeps accepting until this one serves. `Bound` is what `serve_loaded` takes: a test binds
//! its own on port 0 and hands them in.

use std::os::fd::AsFd as _;
use std::path::{Path, PathBuf};

use anyhow::Context;
use tokio::net::{TcpListener, UnixListener};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tracing::info;

use super::handover;
use crate::config::{CloudConfig, ForwardConfig, HttpsEntryConfig};
use crate::intercept::{InterceptConfig, Interceptor};
use crate::io::unix;

/// Every listener of a cloud, bound, and the eBPF programs that send connections to the
/// redirect listeners (loaded; `run` links them once this cloud serves).
pub(crate) struct Bound {
    /// `tunnel.listen`: edges connect here (none on a relay).
    pub(crate) edges: Option<TcpListener>,
    pub(crate) forwards: Vec<(TcpListener, ForwardConfig)>,
    pub(crate) https: Vec<(TcpListener, TlsAcceptor, HttpsEntryConfig)>,
    pub(crate) connect_tcp: Option<TcpListener>,
    pub(crate) connect_unix: Option<UnixListener>,
    pub(crate) admin: Option<TcpListener>,
    pub(crate) peers: Option<TcpListener>,
    pub(crate) redirect: Vec<TcpListener>,
    pub(crate) programs: Option<Interceptor>,
    /// What is reported in the ready file (`--ready-file`) once everything serves.
    pub(crate) ready: crate::ops::ready::ReadyFile,
}

impl Bound {
    /// The edges' listener and nothing else; the other fields are for the caller to fill.
    pub(crate) fn edges(edges: Option<TcpListener>) -> Self {
        Self {
            edges,
            forwards: Vec::new(),
            https: Vec::new(),
            connect_tcp: None,
            connect_unix: None,
            admin: None,
            peers: None,
            redirect: Vec::new(),
            programs: None,
            ready: crate::ops::ready::ReadyFile::default(),
        }
    }
}

pub(in crate::cloud) const REDIRECT_FAILED: &str = "cannot enable the eBPF redirect (set redirect.enabled = false to run without it; HTTP CONNECT and forwards still work)";

/// Binds the cloud's listeners, or takes them from the cloud still running on this host
/// (`handover`). With `handover.socket` each is offered to the next one.
/// Each is recorded for the ready file (`--ready-file`) too.
pub(in crate::cloud) struct Binder {
    taken: Option<handover::Taken>,
    offer: Option<handover::Offer>,
    ready: crate::ops::ready::ReadyFile,
}

impl Binder {
    pub(in crate::cloud) fn new(
        config: &CloudConfig,
        ready_file: Option<PathBuf>,
    ) -> anyhow::Result<Self> {
        let socket = config.handover.socket.as_deref();
        Ok(Self {
            taken: socket.map(handover::take).transpose()?.flatten(),
            offer: socket.map(|_| handover::Offer::default()),
            ready: crate::ops::ready::ReadyFile::new(ready_file),
        })
    }

    /// Every listener `config` asks for, and the eBPF programs (loaded, not linked).
    pub(in crate::cloud) async fn bind_all(
        &mut self,
        config: &CloudConfig,
    ) -> anyhow::Result<Bound> {
        let edges = match config.tunnel.listen {
            Some(addr) => Some(self.tcp(addr, "tunnel.listen").await?),
            None => None,
        };
        let mut bound = Bound::edges(edges);
        for (i, f) in config.forwards.iter().enumerate() {
            let key = format!("forward[{i}].listen");
            bound
                .forwards
                .push((self.tcp(f.listen, &key).await?, f.clone()));
        }
        for (i, h) in config.https.iter().enumerate() {
            let client_ca = h.client_ca.as_deref().with_context(|| {
                format!("https[{i}].client_ca is required: who may act as kube-apiserver on the edges' kubelets")
            })?;
            let tls = crate::io::tls::https_entry_server_config(&h.cert, &h.key, client_ca)?;
            let acceptor = TlsAcceptor::from(tls);
            let key = format!("https[{i}].listen");
            bound
                .https
                .push((self.tcp(h.listen, &key).await?, acceptor, h.clone()));
        }
        if let Some(addr) = config.connect.listen {
            warn_beyond_loopback(
                "connect.listen",
                addr,
                "anyone who reaches it can open connections to every edge's targets",
            );
            bound.connect_tcp = Some(self.tcp(addr, "connect.listen").await?);
        }
        if let Some(path) = &config.connect.unix {
            bound.connect_unix = Some(self.unix(path, "connect.unix")?);
        }
        if let Some(addr) = config.admin.listen {
            // Said, not warned: deploy/ binds it so for Prometheus, and what it answers
            // beyond this host is what a scrape and a probe read.
            if !addr.ip().to_canonical().is_loopback() {
                tracing::info!(key = "admin.listen", %addr, "admin.listen listens beyond loopback: /metrics and the probes answer anyone who reaches it, /debug/ this host's clients only");
            }
            bound.admin = Some(self.tcp(addr, "admin.listen").await?);
        }
        if let Some(addr) = config.peers.listen {
            bound.peers = Some(self.tcp(addr, "peers.listen").await?);
        }
        if config.redirect.enabled {
            let (listeners, programs) = self.bind_redirect(config).await?;
            bound.redirect = listeners;
            bound.programs = Some(programs);
        }
        bound.ready = std::mem::take(&mut self.ready);
        Ok(bound)
    }

    /// With listeners taken from a running cloud: waits until it stops accepting. False
    /// when `shutdown` came first (the running cloud keeps serving).
    pub(in crate::cloud) async fn stand_by(
        &mut self,
        config: &CloudConfig,
        shutdown: &CancellationToken,
    ) -> bool {
        let Some(taken) = self.taken.take() else {
            return true;
        };
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
                return false;
            }
        }
        info!("the previous tunnel cloud stopped accepting: this one serves now");
        true
    }

    /// Offers the listeners to the next cloud on this host (`handover.socket`) until
    /// `shutdown`; the task says how many took them.
    pub(in crate::cloud) fn offer(
        self,
        config: &CloudConfig,
        shutdown: &CancellationToken,
    ) -> anyhow::Result<Option<tokio::task::JoinHandle<usize>>> {
        Ok(match (&config.handover.socket, self.offer) {
            (Some(path), Some(offer)) => Some(tokio::spawn(handover::serve(
                handover::bind(path)?,
                path.clone(),
                offer,
                shutdown.clone(),
            ))),
            _ => None,
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
        self.ready.tcp(key, &listener)?;
        Ok(listener)
    }

    fn unix(&mut self, path: &Path, key: &str) -> anyhow::Result<UnixListener> {
        let listener = match self.taken.as_mut().and_then(|t| t.unix(key, path)) {
            Some(l) => l
                .set_nonblocking(true)
                .and_then(|()| UnixListener::from_std(l))
                .with_context(|| format!("cannot use the {key} listener handed over"))?,
            None => unix::bind(path, key)?,
        };
        if let Some(offer) = &mut self.offer {
            offer.add(key, listener.as_fd())?;
        }
        self.ready.unix(key, path);
        Ok(listener)
    }

    /// Binds the redirect listeners, then loads the eBPF programs that send connections
    /// to them; `run` links the programs later (after the listeners, so no redirected
    /// connect finds nobody listening; after a predecessor stopped accepting, when it
    /// stands by).
    async fn bind_redirect(
        &mut self,
        config: &CloudConfig,
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
        let mut listeners = vec![self.tcp(r.listen, "redirect.listen").await?];
        let redirect_to = v4(listeners[0].local_addr()?, "redirect.listen")?;
        let pod_redirect_to = match r.pod_listen {
            Some(addr) => {
                let l = self.tcp(addr, "redirect.pod_listen").await?;
                let a = v4(l.local_addr()?, "redirect.pod_listen")?;
                listeners.push(l);
                Some(a)
            }
            None => None,
        };
        let redirect6_to = match self.bind_redirect6(r).await? {
            Some(l) => {
                let a = v6(l.local_addr()?, "redirect.listen6")?;
                listeners.push(l);
                Some(a)
            }
            None => None,
        };
        let pod_redirect6_to = match r.pod_listen6 {
            Some(addr) => {
                let l = self.tcp(addr, "redirect.pod_listen6").await?;
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
            edge_map_entries: r.edge_map_entries(),
            exempt_cgroup: None,
            pin_dir: r.pin_dir.clone(),
            fail_open_after: Some(r.fail_open_after),
        })
        .context(REDIRECT_FAILED)?;
        Ok((listeners, intercept))
    }

    /// The IPv6 redirect listener: `listen6` when configured (failing the start if it
    /// cannot be bound), else `[::1]` on the port of `listen`, skipped with a warning on a
    /// host without IPv6, where no client can dial an IPv6 edge anyway.
    async fn bind_redirect6(
        &mut self,
        r: &crate::config::RedirectConfig,
    ) -> anyhow::Result<Option<TcpListener>> {
        if let Some(addr) = r.listen6 {
            return self.tcp(addr, "redirect.listen6").await.map(Some);
        }
        let addr = r.default_listen6();
        match self.tcp(addr, "redirect.listen6").await {
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
                Err(e
                    .context("redirect.listen6 is [::1] on the port of redirect.listen by default"))
            }
        }
    }
}

/// Listeners that need no one beyond this host: one bound wider is allowed (a probe from
/// elsewhere, a proxy for another host), but said at start.
fn warn_beyond_loopback(key: &str, addr: std::net::SocketAddr, exposes: &str) {
    if !addr.ip().to_canonical().is_loopback() {
        tracing::warn!(key, %addr, "{key} listens beyond loopback: {exposes}");
    }
}

async fn bind(addr: std::net::SocketAddr, key: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| crate::io::net::listen_error(addr, key, e))
}
