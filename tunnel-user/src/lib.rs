//! The `tunnel` binary's library: `tunnel cloud`, `tunnel edge` and `tunnel certs`.
//!
//! A connection from a client on a master to a target behind an edge, hop by hop (the
//! "Data flow" section of `docs/design.md` says the same in more words):
//!
//! | hop | module | layer |
//! |---|---|---|
//! | `connect()` bent to the cloud by eBPF | [`intercept`] (programs in `tunnel-ebpf`) | interception |
//! | entry: accept (redirect, CONNECT, forward, https) into an `Accepted` with its [`addr`]esses | [`cloud::conn::entry`], [`io::http_connect`] | cloud |
//! | route: node and target (pure, [`cloud::conn::route`] over the node table, [`cloud::nodes`]), then the node's session or the replica that holds it, in one `Router::route` | [`cloud::conn::router`], [`cloud::edges::registry`], [`cloud::peer`] | cloud |
//! | open: one `Edge.Dial` call per connection (or `Peer.Dial` to the replica that holds the node) with its typed request, `Opener::open` | [`cloud::conn::proxy`], [`call::open`], [`call::request`] | cloud, call |
//! | the dial on the edge: the call served ([`call::serve`]) by the edge's `Callee`: allowlist, connect, TLS to the target, metrics | [`call::serve`], [`edge::dial`] | call, edge |
//! | copy: bytes both ways as the call's messages, `Opener::carry` | [`call::copy`] | call |
//! | a failed dial, on every hop, and what clients, metrics and logs say of it | [`call::outcome`] | call |
//!
//! Beneath them, the I/O layer ([`io`]): the accept loop of every listener, with its
//! connection limit ([`io::accept`]), bounded HTTP request heads ([`io::http_head`]), the
//! HTTP/2 settings and channel ([`io::transport`]), rustls set-up ([`io::tls`]), socket
//! options and the connection to a target ([`io::net`]), unix socket files ([`io::unix`]), certificate fields
//! ([`io::x509`]) and large TLS reads ([`io::read_ahead`]).
//!
//! The edge's TLS connection out and its admission by the cloud: [`edge::connect`]
//! (dial-out, Hello, reconnect loop, with the token from [`edge::token`]), and
//! [`cloud::edges::admission`], which asks [`cloud::edges::authenticator`] (with the
//! token file, [`config::token_file`], and certificate node names, [`io::x509`]).
//! Edge-to-cloud connections run the same call and copy the other way
//! ([`edge::reverse`], [`edge::proxy`], [`cloud::conn::reverse`]). Beside them: [`config`],
//! [`certs`] (the CLI), and [`ops`] (the admin listener, metrics, logging).
//!
//! The layers, top level only:
//!
//! - [`cloud`], [`edge`]: the two processes, which use nothing of each other. The cloud's
//!   folders stack in floors, each using only those below: [`cloud::nodes`],
//!   [`cloud::watch`] (the ground), [`cloud::edges`], [`cloud::peer`], [`cloud::conn`],
//!   [`cloud::lifecycle`], and `cloud` itself, which wires them. No top-level module
//!   uses one that uses it back (`xtask/tests/module_cycles.rs` checks both).
//! - [`call`]: one connection carried as one gRPC call, below both processes: the typed
//!   request, opening the call, serving it on the edge, the byte copy, the outcome table.
//! - [`io`]: sockets, TLS, read-ahead, HTTP/2 transport, the CONNECT head.
//! - [`intercept`]: the eBPF loader.
//! - [`addr`]: the address types a connection is known by (node name, client, original
//!   destination, target).
//! - [`config`]: the config files, resolved and validated.
//! - [`certs`]: `tunnel certs`.
//! - [`csr`]: a client certificate from the cluster by CertificateSigningRequest, an
//!   edge's or a relay's, kept on disk and renewed.
//! - [`heap`]: the global allocator.
//! - [`rate`]: a token bucket, the edges' rate limits.
//! - [`ops`]: admin listener, metrics, logging, the ready file.
//!
//! [`cloud::run`] wires the cloud's components (router, opener, authenticator,
//! registry, peers, ...) and hands each task the few it uses. `docs/design.md` ("The cloud's components")
//! lists what each owns and who receives it.

// Only what the binary, the tests, fuzz-checks and the bench use is `pub`; everything
// else is `pub(crate)` or less, so the compiler sees dead code and the surface stays small.
#![warn(unreachable_pub)]
#![allow(
    rustdoc::private_intra_doc_links,
    reason = "the map above is for readers of the code: its links to crate-private modules resolve under `cargo doc --document-private-items`"
)]

pub mod addr;
mod call;
pub mod certs;
pub mod cloud;
pub mod config;
mod csr;
pub mod edge;
pub mod heap;
pub mod intercept;
pub mod io;
pub mod ops;
mod rate;
