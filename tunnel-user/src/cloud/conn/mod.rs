//! The per-connection path on the cloud: an entry accepts a client connection, the
//! router says where it goes, the opener opens a call on the edge session that carries
//! it, and the copy moves bytes both ways. Edge-to-cloud connections (`reverse`) run
//! the same call the other way.

pub mod connections;
pub mod entry;
pub mod nodes;
pub mod proxy;
pub mod reverse;
pub mod route;
pub mod router;
