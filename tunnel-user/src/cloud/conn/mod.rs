//! The per-connection path on the cloud, one pipeline that each entry's `handle` spells
//! out:
//!
//! 1. entry (`entry`): the accepted socket with its addresses (`entry::Accepted`);
//! 2. route (`router::Router::route`): the node and target, decided over the node table
//!    (`nodes`) by the pure `route`, then the session that carries it (here, or the
//!    replica that holds it);
//! 3. open (`proxy::Opener::open`): the connection's call on that session
//!    (`call::open`), a `proxy::Opened`, answered first or with the client's bytes
//!    following at once;
//! 4. copy (`proxy::Opener::carry`): listed (`connections`), metered, and copied both
//!    ways by `call::copy`.
//!
//! Edge-to-cloud connections (`reverse`) run the same call the other way.

pub(crate) mod connections;
pub mod entry;
pub(crate) mod outage;
pub(crate) mod proxy;
pub(crate) mod reached;
pub(crate) mod reverse;
pub mod route;
pub(crate) mod router;
pub(crate) mod shares;
