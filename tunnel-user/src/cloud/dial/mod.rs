//! The dial call of one connection, and its answer, the far end's or why it failed
//! (`stream::outcome::DialFailure`): what a session opens (`edges`), what a replica
//! forwards (`peer`) and what the connection path waits on (`conn`). A ground floor of
//! the cloud: it names none of them.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use proto::DialStatus;
use proto::chunk_call::IncomingChunks;
use tonic::Status;

use crate::stream::copy::OutboundHandle;
use crate::stream::outcome::DialFailure;

/// Keeps a call counted as open on its session.
pub struct OpenGuard(Arc<AtomicUsize>);

impl OpenGuard {
    pub(crate) fn count(counter: &Arc<AtomicUsize>) -> Self {
        counter.fetch_add(1, Ordering::Relaxed);
        Self(counter.clone())
    }
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The dial call of one proxied connection, whose request goes to the edge (directly,
/// or through the replica that holds the edge) once its answer is first awaited. Bytes
/// sent into it before the answer wait in the stream's window until the edge has
/// connected and reads them; an edge that refuses the dial never reads them, and they
/// go with the call. Counts as open on its session until dropped.
pub struct DialCall {
    pub outbound: OutboundHandle,
    pub answer: DialAnswer,
    pub open: OpenGuard,
}

type CallFuture = Pin<Box<dyn Future<Output = Result<IncomingChunks, Status>> + Send + 'static>>;

/// The far end's answer to a dial call, still to come.
pub struct DialAnswer {
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
    pub async fn wait(self) -> Result<IncomingChunks, DialFailure> {
        let answer = tokio::time::timeout_at(self.deadline, self.call)
            .await
            .map_err(|_| DialFailure::new(DialStatus::Timeout, ""))?;
        answer.map_err(|status| DialFailure::from_status(&status))
    }
}
