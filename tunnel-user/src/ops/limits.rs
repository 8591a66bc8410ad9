//! The open-file limit, raised at start by both processes.
//!
//! A replica holds a descriptor for each edge, and both processes one for each proxied
//! connection, so the soft `RLIMIT_NOFILE` bounds what they carry. containerd 2 no longer
//! sets `LimitNOFILE`, so a container starts at the soft limit of 1024 under a far higher
//! hard one: a replica there stops accepting edges near 1,000. Raising the soft limit up
//! to the hard one needs no privilege (Go programs do it at start for the same reason).
//! We never call `select()`, whose descriptor sets end at 1024, the reason the default
//! soft limit is that low.

use nix::sys::resource::{Resource, getrlimit, setrlimit};
use tracing::{info, warn};

/// Descriptors a process holds whatever it carries: listeners, peer links, the API
/// server's connections, eBPF maps and programs, the runtime's epoll and eventfds: the
/// margin docs/benchmarks.md sizes a replica with ("What one replica holds").
const RESERVED: u64 = 100;

/// Below this many descriptors, the limit and not memory caps a replica's edges: at the
/// sizes docs/benchmarks.md gives (1 GiB holds about 41,000 edges), a replica holds fewer
/// edges than 65,536 descriptors would allow.
const CLOUD_WARN_BELOW: u64 = 65_536;

/// Which process raises its limit: what it says the limit leaves room for.
#[derive(Clone, Copy, Debug)]
pub enum Holder {
    /// Room for edges (one descriptor each, and one per proxied connection).
    Cloud,
    /// Room for proxied connections (one descriptor each, to the target).
    Edge,
}

/// Raises this process's soft `RLIMIT_NOFILE` to its hard limit and logs both, with the
/// room that leaves (a warning from the cloud when that room is small).
pub fn raise_open_files(holder: Holder) {
    let (soft_was, hard) = match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok(limits) => limits,
        Err(e) => {
            warn!(error = %e, "cannot read the open-file limit (RLIMIT_NOFILE)");
            return;
        }
    };
    let soft = if soft_was < hard {
        match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => hard,
            Err(e) => {
                warn!(soft = soft_was, hard, error = %e, "cannot raise the open-file limit");
                soft_was
            }
        }
    } else {
        soft_was
    };
    let room = soft.saturating_sub(RESERVED);
    match holder {
        Holder::Cloud if soft < CLOUD_WARN_BELOW => warn!(
            soft_was,
            soft,
            hard,
            edges = room,
            "open-file limit: room for only about {room} edges on this replica; raise the hard limit (the unit's LimitNOFILE, the container runtime's rlimits)"
        ),
        Holder::Cloud => info!(
            soft_was,
            soft,
            hard,
            edges = room,
            "open-file limit: room for about {room} edges, fewer while proxied connections are open"
        ),
        Holder::Edge => info!(
            soft_was,
            soft,
            hard,
            connections = room,
            "open-file limit: room for about {room} proxied connections"
        ),
    }
}
