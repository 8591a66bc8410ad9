//! The `tunnel` binary's library: `tunnel cloud`, `tunnel edge` and `tunnel certs`.
//!
//! A connection from a client on a master to a target behind an edge, hop by hop (the
//! "Data flow" section of `docs/design.md` says the same in more words):
//!
//! | hop | module | layer |
//! |---|---|---|
//! | `connect()` bent to the cloud by eBPF | [`intercept`] (programs in `tunnel-ebpf`) | interception |
//! | accept: redirect, CONNECT, forward, https | [`cloud::entry`], [`http_connect`] | cloud |
//! | node and target for the connection | [`cloud::route`] (pure), [`cloud::kubernetes`] | cloud |
//! | the node's session, or the replica that holds it | [`cloud::registry`], [`cloud::peer`] | cloud |
//! | one `Edge.Dial` call per connection | [`cloud::proxy`], [`cloud::session`] | cloud |
//! | the allowlist and the dial on the edge | [`edge::dial`], [`edge::session`] | edge |
//! | bytes both ways as the call's messages | [`splice`] | stream |
//!
//! Beneath them: the edge's TLS connection out and its admission by the cloud
//! ([`edge`]'s reconnect loop, [`cloud::admission`]), the HTTP/2 settings and channel
//! ([`transport`]), rustls set-up ([`tls`]), socket options ([`net`]) and large TLS
//! reads ([`read_ahead`]) in the I/O layer. Edge-to-cloud connections run the same call
//! and copy the other way ([`edge::reverse`], [`edge::proxy`], [`cloud::reverse`]).
//! Beside them: [`config`], [`auth`] (token file, certificate node names), [`certs`]
//! (the CLI), [`admin`], [`metrics`] and [`logging`].

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
