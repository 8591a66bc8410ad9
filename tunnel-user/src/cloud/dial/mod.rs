//! The dial call of one connection, and its answer, the far end's or why it failed
//! (`stream::outcome::DialFailure`): what a session opens (`edges`), what a replica
//! forwards (`peer`) and what the connection path waits on (`conn`). A ground floor of
//! the cloud: it names none of them.

use std::pin::Pin;
use std::sync::Arc;

use proto::DialStatus;
use proto::chunk_call::IncomingChunks;
use tokio::sync::watch;
use tonic::Status;

use crate::stream::copy::OutboundHandle;
use crate::stream::outcome::DialFailure;

/// How many calls are open on a session or a peer link. Whoever waits for it to reach
/// 0 (a retired session, the drain) is woken then, and only then.
pub(crate) struct OpenCount(watch::Sender<usize>);

impl Default for OpenCount {
    fn default() -> Self {
        Self(watch::Sender::new(0))
    }
}

impl OpenCount {
    pub(crate) fn get(&self) -> usize {
        *self.0.borrow()
    }

    /// Returns once no call is open.
    pub(crate) async fn idle(&self) {
        // The sender is `self`: the wait cannot fail.
        let _ = self.0.subscribe().wait_for(|open| *open == 0).await;
    }
}

/// Keeps a call counted as open on its session.
pub(crate) struct OpenGuard(Arc<OpenCount>);

impl OpenGuard {
    pub(crate) fn count(counter: &Arc<OpenCount>) -> Self {
        counter.0.send_if_modified(|open| {
            *open += 1;
            false
        });
        Self(counter.clone())
    }
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.0.send_if_modified(|open| {
            *open -= 1;
            *open == 0
        });
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
