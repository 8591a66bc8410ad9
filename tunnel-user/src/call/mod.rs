//! A connection carried as a call: one proxied connection is one gRPC call, one HTTP/2
//! stream, on an edge's session or on the link to the replica that holds it. Below both
//! `cloud` and `edge`, which each use it for their side of the call, and it uses
//! neither:
//!
//! - [`request`]: what the call asks of its far end ([`request::Request`]: node, target,
//!   client, TLS), converted to and from the wire's `DialRequest` once, in the call's
//!   metadata;
//! - [`open`]: the caller's side: [`open::open`] opens a call on an HTTP/2 channel (an
//!   edge session's, a peer link's) with its request, deadline and open count, and the
//!   far end's [`open::Answer`] to come;
//! - [`serve`]: the edge's side: [`serve::serve`] answers an `Edge.Dial` call with what
//!   the edge's [`serve::Callee`] dials, or its refusal, and copies;
//! - [`copy`]: the byte copy between a socket and the call, both ways;
//! - [`outcome`]: how a dial ended ([`outcome::DialFailure`]), and the one table of what
//!   clients, metrics and logs say of it;
//! - [`count`]: how many calls are open on a session or a link ([`count::OpenCount`]).

pub(crate) mod copy;
pub(crate) mod count;
pub(crate) mod open;
pub(crate) mod outcome;
pub(crate) mod request;
pub(crate) mod serve;
