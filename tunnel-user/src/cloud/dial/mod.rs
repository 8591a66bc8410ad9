//! The dial call of one connection, and its answer, the far end's or why it failed
//! (`stream::outcome::DialFailure`): what a session opens (`edges`), what a replica
//! forwards (`peer`) and what the connection path waits on (`conn`). A ground floor of
//! the cloud: it names none of them.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use proto::DialStatus;
use proto::chunk_call::IncomingChunks;
use tokio::sync::Notify;
use tonic::Status;

use crate::stream::copy::OutboundHandle;
use crate::stream::outcome::DialFailure;

/// How many calls are open on a session or a peer link. Whoever waits for it to reach
/// 0 (a retired session, the drain) is woken then, and only then. An atomic and one
/// `Notify` rather than a `watch` channel: every session has one, and a watch channel's
/// shared state holds nine `Notify`s; with it the cloud held 23.3 KiB per idle edge at
/// 10,000 edges, with this 23.0 (the scale bench).
#[derive(Default)]
pub(crate) struct OpenCount {
    open: AtomicUsize,
    /// Woken when `open` falls to 0.
    emptied: Notify,
}

impl OpenCount {
    pub(crate) fn get(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    /// Returns once no call is open.
    pub(crate) async fn idle(&self) {
        loop {
            // Registered before the count is read, so a fall to 0 in between still
            // wakes this wait.
            let emptied = self.emptied.notified();
            let mut emptied = std::pin::pin!(emptied);
            emptied.as_mut().enable();
            if self.get() == 0 {
                return;
            }
            emptied.await;
        }
    }
}

/// Keeps a call counted as open on its session.
pub(crate) struct OpenGuard(Arc<OpenCount>);

impl OpenGuard {
    pub(crate) fn count(counter: &Arc<OpenCount>) -> Self {
        counter.open.fetch_add(1, Ordering::AcqRel);
        Self(counter.clone())
    }
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        if self.0.open.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.emptied.notify_waiters();
        }
    }
}

/// The dial call of one proxied connection, whose request goes to the edge (directly,
/// or through the replica that holds the edge) once its answer is first awaited. Bytes
/// sent into it before the answer wait in the stream's window until the edge has
/// connected and reads them; an edge that refuses the dial never reads them, and they
/// go with the call. Counts as open on its session until dropped.
pub(crate) struct DialCall {
    pub(crate) outbound: OutboundHandle,
    pub(crate) answer: DialAnswer,
    pub(crate) open: OpenGuard,
}

type CallFuture = Pin<Box<dyn Future<Output = Result<IncomingChunks, Status>> + Send + 'static>>;

/// The far end's answer to a dial call, still to come.
pub(crate) struct DialAnswer {
    /// Boxed even when the answer is in already, so that a connection's task carries a
    /// pointer, not an answer, while it waits (it holds this for the connection's
    /// whole life when the dial is still under way as its bytes start to flow).
    call: CallFuture,
    deadline: tokio::time::Instant,
}

impl DialAnswer {
    /// The answer of `call`, not sent yet: its request leaves when the answer is first
    /// awaited, which the copy does once it has handed the call the client's socket,
    /// so the client's first bytes leave with the request (bounded by `deadline`).
    pub(crate) fn new(call: CallFuture, deadline: tokio::time::Instant) -> Self {
        Self { call, deadline }
    }

    /// The call's incoming messages once the far end has connected to the target, or
    /// why it did not (its own refusal, or no answer by the deadline).
    pub(crate) async fn wait(self) -> Result<IncomingChunks, DialFailure> {
        let answer = tokio::time::timeout_at(self.deadline, self.call)
            .await
            .map_err(|_| DialFailure::new(DialStatus::Timeout, ""))?;
        answer.map_err(|status| DialFailure::from_status(&status))
    }
}

#[cfg(test)]
mod tests {
    use futures::FutureExt as _;

    use super::*;

    #[tokio::test]
    async fn idle_returns_when_the_last_open_call_ends_and_not_before() {
        let count = Arc::new(OpenCount::default());
        assert!(
            count.idle().now_or_never().is_some(),
            "nothing open: idle at once"
        );

        let first = OpenGuard::count(&count);
        let second = OpenGuard::count(&count);
        assert_eq!(count.get(), 2);
        let waiter = tokio::spawn({
            let count = count.clone();
            async move { count.idle().await }
        });
        tokio::task::yield_now().await;
        drop(first);
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "woken with a call still open");

        drop(second);
        tokio::time::timeout(std::time::Duration::from_secs(5), waiter)
            .await
            .expect("the fall to 0 wakes the wait")
            .unwrap();
        assert_eq!(count.get(), 0);
    }
}
