//! The I/O layer, beneath both ends of the tunnel: what happens on a socket before and
//! around the gRPC stream.
//!
//! - [`accept`]: the accept loop of every listener, with its connection limit.
//! - [`net`]: socket options every hop sets (TCP_NODELAY, keepalive, abort with RST),
//!   and the connection to a target both ends' dialers make (`connect`).
//! - [`tls`]: rustls configurations (edge to cloud, replica to replica, HTTPS targets).
//! - [`read_ahead`]: large reads from the TCP socket under TLS.
//! - [`transport`]: the HTTP/2 settings under gRPC, and the channel the cloud's tonic
//!   clients call through on a connection the edge dialled.
//! - [`http_head`]: reading an HTTP request head within bounds, and answering it with an
//!   error (the cloud's CONNECT and HTTPS entries, the edge's proxy).
//! - [`http_connect`]: the head of an HTTP CONNECT request (the cloud's CONNECT entry and
//!   the edge's proxy).
//! - [`unix`]: Unix socket files, bound in place of a stale one.
//! - [`socket_owner`]: the user and cgroup of a loopback client's socket (`sock_diag`).
//! - [`x509`]: what is read from certificates (node name, expiry, DNS names).

pub(crate) mod accept;
pub mod http_connect;
pub mod http_head;
pub(crate) mod net;
pub(crate) mod read_ahead;
pub(crate) mod socket_owner;
pub mod tls;
pub mod transport;
pub(crate) mod unix;
pub mod x509;
