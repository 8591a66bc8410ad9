//! The stream layer: one proxied connection as one gRPC call, on both sides of the
//! tunnel.
//!
//! - [`copy`]: the byte copy between a socket and the call. The socket's bytes are the
//!   call's outgoing `Chunk` messages ([`copy::Outbound`], [`copy::ResponseChunks`]),
//!   the incoming ones are written to the socket; half-closes and aborts
//!   ([`copy::CopyEnd`]) travel as the end of the messages or a cancelled call.
//! - [`outcome`]: how a dial ended ([`outcome::DialFailure`]), and the one table of what
//!   clients, metrics and logs say of it.

pub(crate) mod copy;
pub(crate) mod outcome;
