//! The `tunnel` binary's library: `tunnel cloud`, `tunnel edge` and `tunnel certs`.

pub mod config;
