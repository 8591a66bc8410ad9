//! The loaded programs as the cloud shares them: the redirect entry takes original
//! destinations from them, the node table keeps their edge map in line, the metrics read
//! their counters, and shutdown detaches them.

use std::net::{IpAddr, SocketAddr};
use std::sync::RwLock;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::{Counters, Interceptor};
use crate::addr::OrigDst;

/// The eBPF programs that send connections here, while the redirect is on: what the
/// redirect entry, the node table (the edge map) and the metrics use of them.
#[derive(Default)]
pub(crate) struct Programs {
    /// None without `redirect.enabled`, and after `detach`.
    loaded: RwLock<Option<Interceptor>>,
}

impl Programs {
    pub(crate) fn new(loaded: Option<Interceptor>) -> Self {
        Self {
            loaded: RwLock::new(loaded),
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Option<Interceptor>> {
        self.loaded.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Where a connection from `peer` was going (sock_ops recorded it under the client's
    /// address); taken, so it is found once.
    pub(crate) fn take_original_dst(&self, peer: SocketAddr) -> Option<OrigDst> {
        self.read().as_ref()?.take_original_dst(peer).map(OrigDst)
    }

    /// How much is left of the window after taking over from a predecessor.
    pub(crate) fn takeover_left(&self) -> Option<Duration> {
        self.read().as_ref()?.takeover_left()
    }

    /// Makes the eBPF edge map `ips` (the node table's addresses, both families); how
    /// many addresses a full map could not take (0 without the redirect).
    pub(crate) fn set_edges(&self, ips: &[IpAddr]) -> usize {
        match self.read().as_ref().map(|programs| programs.set_edges(ips)) {
            None => 0,
            Some(Ok(left_out)) => left_out,
            Some(Err(e)) => {
                tracing::error!(error = %e, "cannot update the eBPF edge map");
                0
            }
        }
    }

    /// Takes the addresses `gone` out of the eBPF edge map and puts those that `came` in,
    /// writing only their entries; false when that cannot keep the map in line (a full
    /// map, or one that would be, takes the table's order: `set_edges` then), or a write
    /// failed. True without the redirect.
    pub(crate) fn change_edges(&self, gone: &[IpAddr], came: &[IpAddr]) -> bool {
        match self
            .read()
            .as_ref()
            .map(|programs| programs.change_edges(gone, came))
        {
            None | Some(Ok(true)) => true,
            Some(Ok(false)) => false,
            Some(Err(e)) => {
                tracing::warn!(error = %e, "cannot change the eBPF edge map entry by entry; setting it whole");
                false
            }
        }
    }

    /// Makes `ips` the edge addresses whose node no replica holds a tunnel to: connects
    /// to them fail at once (see `Interceptor::set_no_tunnel`).
    pub(crate) fn set_no_tunnel(&self, ips: &[IpAddr]) {
        if let Some(programs) = self.read().as_ref()
            && let Err(e) = programs.set_no_tunnel(ips)
        {
            tracing::error!(error = %e, "cannot mark the edge addresses without a tunnel in the eBPF edge map");
        }
    }

    /// Marks the addresses `down` as without a tunnel and `up` as with one again,
    /// writing only their entries (see `Interceptor::change_no_tunnel`).
    pub(crate) fn change_no_tunnel(&self, down: &[IpAddr], up: &[IpAddr]) {
        if let Some(programs) = self.read().as_ref()
            && let Err(e) = programs.change_no_tunnel(down, up)
        {
            tracing::error!(error = %e, "cannot mark the edge addresses without a tunnel in the eBPF edge map");
        }
    }

    /// Whether the programs fail a connect to an address without a tunnel ("host is
    /// down"), rather than redirect it; false without the redirect.
    pub(crate) fn refuses_without_tunnel(&self) -> bool {
        self.read()
            .as_ref()
            .is_some_and(Interceptor::refuses_without_tunnel)
    }

    /// Entries each eBPF edge map holds (addresses × redirected ports); None without the
    /// redirect.
    pub(crate) fn edge_map_capacity(&self) -> Option<usize> {
        self.read().as_ref().map(Interceptor::edge_map_capacity)
    }

    /// Keeps the programs redirecting for another `redirect.fail_open_after`.
    pub(crate) fn keep_alive(&self) {
        if let Some(programs) = self.read().as_ref()
            && let Err(e) = programs.keep_alive()
        {
            tracing::error!(error = %e, "cannot push the eBPF redirect's deadline forward");
        }
    }

    /// Until `shutdown`: [`Programs::keep_alive`] four times per `fail_open_after`, so a
    /// late tick or two never lets the redirect lapse under a running cloud. The first
    /// comes a period in: linking the programs has just renewed it.
    pub(crate) async fn keep_alive_until(
        &self,
        fail_open_after: Duration,
        shutdown: CancellationToken,
    ) {
        let period = fail_open_after / 4;
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => self.keep_alive(),
                () = shutdown.cancelled() => return,
            }
        }
    }

    pub(crate) fn counters(&self) -> Option<Counters> {
        self.read().as_ref().map(Interceptor::counters)
    }

    /// Detaches the programs now (at shutdown), not at some later drop.
    pub(crate) fn detach(&self) {
        let programs = self
            .loaded
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        drop(programs);
    }
}
