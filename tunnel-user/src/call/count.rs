//! How many calls are open on an edge session, a peer link or the edge's side of a
//! session: whoever waits for the last one to end (a retired session, the drain) is
//! woken then.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Notify;

/// How many calls are open on a session or a peer link. Whoever waits for it to reach
/// 0 (a retired session, the drain) is woken then, and only then. An atomic and one
/// `Notify` rather than a `watch` channel: every session has one, and a watch channel's
/// shared state holds nine `Notify`s (0.3 KiB per idle edge, the scale bench).
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

/// Keeps a call counted as open on its session or link.
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
