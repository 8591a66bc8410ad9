//! The `tunnel` binary's library: `tunnel cloud`, `tunnel edge` and `tunnel certs`.

pub mod admin;
pub mod auth;
pub mod certs;
pub mod cloud;
pub mod config;
pub mod edge;
pub mod http_connect;
pub mod intercept;
pub mod logging;
pub mod metrics;
pub mod net;
pub mod read_ahead;
pub mod splice;
pub mod tls;
pub mod transport;
