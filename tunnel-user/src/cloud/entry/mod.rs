//! Ways into the tunnel on the cloud side. Each accepts a client connection, decides its
//! route, and hands it to `proxy`.

pub mod connect;
pub mod forward;
pub mod https;
pub mod redirect;

use std::time::Duration;

/// Unwraps an accept result; on error (EMFILE and the like) logs and backs off briefly so
/// the accept loop does not spin.
pub(crate) async fn accepted<T>(result: std::io::Result<T>, listener: &str) -> Option<T> {
    match result {
        Ok(conn) => Some(conn),
        Err(e) => {
            tracing::warn!(error = %e, listener, "accept failed");
            tokio::time::sleep(Duration::from_millis(100)).await;
            None
        }
    }
}
