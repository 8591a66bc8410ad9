//! Ways into the tunnel on the cloud side. Each takes a client connection from
//! `io::accept` (within its listener's connection limit), turns it into an [`Accepted`]
//! (the socket and what is known of it), asks the `Router` where it goes (one call), and
//! hands it to the `Opener` (`proxy`): open, then carry.

pub(crate) mod connect;
pub(crate) mod forward;
pub mod https;
pub(crate) mod redirect;

use crate::addr::ClientAddr;

/// A client connection an entry accepted: its socket, who connected, and `M`, what the
/// entry knows of it besides (the eBPF redirect: its `OrigDst`).
pub(crate) struct Accepted<S, M = ()> {
    pub(crate) socket: S,
    pub(crate) client: ClientAddr,
    pub(crate) meta: M,
}

impl<S> Accepted<S> {
    pub(crate) fn new(socket: S, client: ClientAddr) -> Self {
        Self {
            socket,
            client,
            meta: (),
        }
    }
}
