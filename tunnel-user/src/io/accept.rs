//! The accept loop every listener runs (the cloud's entries, edge and peer listeners,
//! the edge's forwards and proxy, the admin and handover sockets), with the bound on the
//! connections it has open at once.
//!
//! As in mini-redis's listener, a permit is taken before `accept()` and the connection's
//! task holds it until it ends: at the limit, new connections wait in the kernel's accept
//! queue (and are refused by the kernel once that is full) instead of each costing a file
//! descriptor and a task here.

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Pause after a failed `accept()` (EMFILE and the like), so the loop does not spin.
const ERROR_PAUSE: Duration = Duration::from_millis(100);

/// A listener at its limit says so at most this often.
const AT_LIMIT_LOG_INTERVAL: Duration = Duration::from_secs(60);

/// A socket that accepts connections: TCP or unix.
pub(crate) trait Listener {
    type Stream;
    type Addr;
    fn accept(&self) -> impl Future<Output = std::io::Result<(Self::Stream, Self::Addr)>>;
}

impl Listener for TcpListener {
    type Stream = TcpStream;
    type Addr = std::net::SocketAddr;
    fn accept(&self) -> impl Future<Output = std::io::Result<(TcpStream, Self::Addr)>> {
        TcpListener::accept(self)
    }
}

impl Listener for UnixListener {
    type Stream = UnixStream;
    type Addr = tokio::net::unix::SocketAddr;
    fn accept(&self) -> impl Future<Output = std::io::Result<(UnixStream, Self::Addr)>> {
        UnixListener::accept(self)
    }
}

/// Held by a connection's task while the connection is open; dropping it lets the
/// listener accept one more.
pub(crate) type Permit = OwnedSemaphorePermit;

/// `connection`, holding `guard` (a listener's [`Permit`], an open-call count's guard)
/// until it ends (or its task is aborted). Neither an `async fn` nor an `async` block:
/// either would hold `connection`'s parts twice in its state (as the captured arguments
/// and as the future it awaits), and every connection's task would be that much larger.
pub(crate) fn hold<G, F: Future>(guard: G, connection: F) -> impl Future<Output = F::Output> {
    connection.map(move |output| {
        drop(guard);
        output
    })
}

/// The connections of one listener, at most `max_connections` open at once, until
/// `shutdown`.
pub(crate) struct Incoming<L> {
    listener: L,
    /// The listener in logs (`forward 127.0.0.1:8080`, `edges`, ...).
    name: String,
    permits: Arc<Semaphore>,
    max_connections: usize,
    shutdown: CancellationToken,
    /// When this listener last logged that it is at its limit.
    logged_at_limit: Option<Instant>,
}

impl<L: Listener> Incoming<L> {
    pub(crate) fn new(
        listener: L,
        name: impl Into<String>,
        max_connections: usize,
        shutdown: CancellationToken,
    ) -> Self {
        // No permits would never accept; more than MAX_PERMITS panics.
        let max_connections = max_connections.clamp(1, Semaphore::MAX_PERMITS);
        Self {
            listener,
            name: name.into(),
            permits: Arc::new(Semaphore::new(max_connections)),
            max_connections,
            shutdown,
            logged_at_limit: None,
        }
    }

    /// The next connection with its permit, or None once `shutdown` is cancelled. An
    /// accept error is logged and retried after a short pause.
    pub(crate) async fn next(&mut self) -> Option<(L::Stream, L::Addr, Permit)> {
        let permit = self.permit().await?;
        loop {
            let accepted = tokio::select! {
                r = self.listener.accept() => r,
                () = self.shutdown.cancelled() => return None,
            };
            match accepted {
                Ok((stream, addr)) => return Some((stream, addr, permit)),
                Err(e) => {
                    tracing::warn!(error = %e, listener = %self.name, "accept failed");
                    tokio::select! {
                        () = tokio::time::sleep(ERROR_PAUSE) => {}
                        () = self.shutdown.cancelled() => return None,
                    }
                }
            }
        }
    }

    /// A free slot, waiting for one (and saying so) at the limit.
    async fn permit(&mut self) -> Option<Permit> {
        if let Ok(permit) = self.permits.clone().try_acquire_owned() {
            return Some(permit);
        }
        if self
            .logged_at_limit
            .is_none_or(|at| at.elapsed() >= AT_LIMIT_LOG_INTERVAL)
        {
            self.logged_at_limit = Some(Instant::now());
            tracing::warn!(
                listener = %self.name,
                max_connections = self.max_connections,
                "listener at its connection limit (transport.max_connections_per_listener): new connections wait in the accept queue"
            );
        }
        tokio::select! {
            // The semaphore is never closed.
            permit = self.permits.clone().acquire_owned() => permit.ok(),
            () = self.shutdown.cancelled() => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn at_the_limit_the_next_connection_waits_for_a_permit() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let mut incoming = Incoming::new(listener, "test", 1, shutdown.clone());
        let _clients = [
            TcpStream::connect(addr).await.unwrap(),
            TcpStream::connect(addr).await.unwrap(),
        ];
        let (_, _, first) = incoming.next().await.unwrap();
        let waiting = tokio::time::timeout(Duration::from_millis(200), incoming.next()).await;
        assert!(waiting.is_err(), "a second connection beyond the limit");
        drop(first);
        let second = tokio::time::timeout(Duration::from_secs(5), incoming.next()).await;
        assert!(
            matches!(second, Ok(Some(_))),
            "the second once the first ended"
        );
        shutdown.cancel();
        assert!(incoming.next().await.is_none(), "nothing after shutdown");
    }
}
