//! Ways into the tunnel on the cloud side. Each turns a client connection into an
//! [`Accepted`] (the socket and what is known of it), asks the `Router` where it goes
//! (one call), and hands it to the `Opener` (`proxy`): open, then carry.

pub mod connect;
pub mod forward;
pub mod https;
pub mod redirect;

use std::time::Duration;

use tokio_util::sync::CancellationToken;

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

/// The next connection from an accept loop, or None once `shutdown` is cancelled. An
/// accept error (EMFILE and the like) is logged and retried after a short pause, so the
/// loop does not spin.
pub(crate) async fn next_conn<T, F, Fut>(
    mut accept: F,
    shutdown: &CancellationToken,
    listener: &str,
) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = std::io::Result<T>>,
{
    loop {
        let accepted = tokio::select! {
            r = accept() => r,
            () = shutdown.cancelled() => return None,
        };
        match accepted {
            Ok(conn) => return Some(conn),
            Err(e) => {
                tracing::warn!(error = %e, listener, "accept failed");
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_millis(100)) => {}
                    () = shutdown.cancelled() => return None,
                }
            }
        }
    }
}
