//! Operability, in both processes: what an operator reads and sets at runtime.
//!
//! - [`admin`]: the admin HTTP listener (health, readiness, log level, metrics, debug
//!   listings).
//! - [`metrics`]: the Prometheus metrics.
//! - [`logging`]: tracing set-up, with a filter the admin listener can change.
//! - [`ready`]: `--ready-file`, where each listener is bound once all serve.
//! - [`limits`]: the open-file limit, raised at start.

pub(crate) mod admin;
pub mod limits;
pub mod logging;
pub(crate) mod metrics;
pub(crate) mod ready;
