//! The dial call of one connection, and why it failed: what a session opens (`edges`),
//! what a replica forwards (`peer`) and what the connection path waits on (`conn`). A
//! ground floor of the cloud: it names none of them.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use proto::chunk_call::IncomingChunks;
use proto::{DialResult, DialStatus};
use tonic::Status;

use crate::stream::copy::OutboundHandle;

/// Why a stream to the edge could not be opened; the entries map these to what their
/// clients understand (an HTTP status, a reset).
#[derive(Debug, Clone, thiserror::Error)]
pub enum OpenError {
    #[error("edge refused target: {0}")]
    Forbidden(String),
    #[error("edge could not connect to target: {0}")]
    Refused(String),
    #[error("edge timed out connecting to target")]
    Timeout,
    #[error("edge is at its connection limit")]
    Overloaded,
    #[error("edge rejected the request: {0}")]
    BadRequest(String),
    #[error("tunnel to edge failed: {0}")]
    Tunnel(String),
    /// From a replica a connection was forwarded to: it holds no session for the node.
    #[error("{0}")]
    NotHeld(String),
}

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
    pub async fn wait(self) -> Result<IncomingChunks, OpenError> {
        let answer = tokio::time::timeout_at(self.deadline, self.call)
            .await
            .map_err(|_| OpenError::Timeout)?;
        answer.map_err(|status| OpenError::from_result(DialResult::from_status(&status)))
    }
}

impl OpenError {
    /// The error a failed `DialResult` stands for.
    fn from_result(result: DialResult) -> Self {
        match result.status() {
            DialStatus::Forbidden => OpenError::Forbidden(result.message),
            DialStatus::Refused => OpenError::Refused(result.message),
            DialStatus::Timeout => OpenError::Timeout,
            DialStatus::Overloaded => OpenError::Overloaded,
            DialStatus::NotHeld => OpenError::NotHeld(result.message),
            DialStatus::TunnelFailed | DialStatus::Ok => OpenError::Tunnel(result.message),
            DialStatus::BadRequest | DialStatus::Unspecified => {
                OpenError::BadRequest(result.message)
            }
        }
    }

    /// The status this error stands for: what a forwarding replica is told, and what
    /// an entry's client and the metrics see (`DialStatus::http_status`, `label`).
    pub fn status(&self) -> DialStatus {
        match self {
            OpenError::Forbidden(_) => DialStatus::Forbidden,
            OpenError::Refused(_) => DialStatus::Refused,
            OpenError::Timeout => DialStatus::Timeout,
            OpenError::Overloaded => DialStatus::Overloaded,
            OpenError::BadRequest(_) => DialStatus::BadRequest,
            OpenError::NotHeld(_) => DialStatus::NotHeld,
            OpenError::Tunnel(_) => DialStatus::TunnelFailed,
        }
    }

    /// The `DialResult` that tells a forwarding replica about this error.
    pub fn dial_result(&self) -> DialResult {
        let message = match self {
            OpenError::Forbidden(m)
            | OpenError::Refused(m)
            | OpenError::BadRequest(m)
            | OpenError::NotHeld(m)
            | OpenError::Tunnel(m) => m.clone(),
            OpenError::Timeout | OpenError::Overloaded => String::new(),
        };
        DialResult {
            status: self.status() as i32,
            message,
        }
    }
}
