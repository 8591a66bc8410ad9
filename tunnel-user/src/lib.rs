//! The `tunnel` binary's library: `tunnel cloud`, `tunnel edge` and `tunnel certs`.

pub mod auth;
pub mod certs;
pub mod config;
