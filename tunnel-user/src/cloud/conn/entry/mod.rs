//! Ways into the tunnel on the cloud side. Each accepts a client connection (from
//! `io::accept`, within its listener's connection limit), decides its route, and hands it
//! to `proxy`.

pub mod connect;
pub mod forward;
pub mod https;
pub mod redirect;
