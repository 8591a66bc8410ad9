//! The eBPF programs' `aya-log` records, forwarded into `tracing` under the target
//! `tunnel::ebpf`, and the programs' own log level kept in step with the log filter, so
//! that with the filter at info they write no records at all (one compare per connect).

use std::io;

use aya::maps::{Array, MapData};
use aya_log::EbpfLogger;
use tokio::io::unix::AsyncFd;
use tokio::task::JoinHandle;
use tunnel_common::{Config, LogLevel, maps};

/// `log::Log` that re-emits every record as a `tracing` event of the same level.
pub(crate) struct ToTracing;

impl log::Log for ToTracing {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        // Whether anyone wants the event is tracing's call, made in `log`.
        true
    }

    fn log(&self, record: &log::Record<'_>) {
        // tracing needs the level and target as constants at each call site.
        let message = record.args();
        match record.level() {
            log::Level::Error => tracing::error!(target: "tunnel::ebpf", "{message}"),
            log::Level::Warn => tracing::warn!(target: "tunnel::ebpf", "{message}"),
            log::Level::Info => tracing::info!(target: "tunnel::ebpf", "{message}"),
            log::Level::Debug => tracing::debug!(target: "tunnel::ebpf", "{message}"),
            log::Level::Trace => tracing::trace!(target: "tunnel::ebpf", "{message}"),
        }
    }

    fn flush(&self) {}
}

/// The most verbose level the programs should write now: what the current filter lets
/// through for `tunnel::ebpf`.
pub(crate) fn wanted_level() -> LogLevel {
    if tracing::enabled!(target: "tunnel::ebpf", tracing::Level::DEBUG) {
        LogLevel::Debug
    } else if tracing::enabled!(target: "tunnel::ebpf", tracing::Level::WARN) {
        LogLevel::Warn
    } else {
        LogLevel::Off
    }
}

/// Takes the programs' log ring buffer out of the loaded object.
pub(crate) fn take_logger(ebpf: &mut aya::Ebpf) -> Result<EbpfLogger<ToTracing>, aya_log::Error> {
    EbpfLogger::init_with_logger(ebpf, ToTracing)
}

/// Forwards records as they arrive and rewrites `config.log_level` in the programs'
/// config map whenever the log filter changes. Runs until aborted (the interceptor does
/// when it is dropped).
pub(crate) fn spawn_forwarder(
    logger: EbpfLogger<ToTracing>,
    mut config_map: Array<MapData, Config>,
    mut config: Config,
) -> io::Result<JoinHandle<()>> {
    // SAFETY: the logger owns the ring buffer's map fd, and the AsyncFd owns the logger
    // until both are dropped together; nothing else closes or replaces that fd.
    let mut records =
        unsafe { AsyncFd::register_with_interest(logger, tokio::io::Interest::READABLE) }
            .map_err(|e| io::Error::other(e.to_string()))?;
    let mut filter_changes = crate::ops::logging::filter_changes();
    Ok(tokio::spawn(async move {
        loop {
            tokio::select! {
                ready = records.readable_mut() => match ready {
                    Ok(mut guard) => {
                        guard.get_inner_mut().flush();
                        guard.clear_ready();
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "eBPF log records can no longer be read");
                        return;
                    }
                },
                changed = filter_changes.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    let level = wanted_level() as u32;
                    if level != config.log_level {
                        config.log_level = level;
                        if let Err(e) = config_map.set(0, config, 0) {
                            tracing::warn!(map = maps::CONFIG, error = %e, "setting the eBPF log level failed");
                        }
                    }
                }
            }
        }
    }))
}
