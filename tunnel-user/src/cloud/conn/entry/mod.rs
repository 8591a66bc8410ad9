//! Ways into the tunnel on the cloud side. Each takes a client connection from
//! `io::accept` (within its listener's connection limit), turns it into an [`Accepted`]
//! (the socket and what is known of it), asks the `Router` where it goes (one call), and
//! hands it to the `Opener` (`proxy`): open, then carry.

pub mod connect;
pub mod forward;
pub mod https;
pub mod redirect;

use crate::addr::ClientAddr;

/// A client connection an entry accepted: its socket, who connected, and `M`, what the
/// entry knows of it besides (the eBPF redirect: its `OrigDst`).
pub struct Accepted<S, M = ()> {
    pub socket: S,
    pub client: ClientAddr,
    pub meta: M,
}

impl<S> Accepted<S> {
    pub fn new(socket: S, client: ClientAddr) -> Self {
        Self {
            socket,
            client,
            meta: (),
        }
    }
}
