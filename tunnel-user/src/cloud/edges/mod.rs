//! The edges: their admission (TLS, Hello, authentication), the credentials that let
//! them in and keep them in, their certificates through CSRs, and the sessions this
//! replica holds.

pub mod admission;
pub mod authenticator;
pub mod csr;
pub mod limit;
pub mod reauth;
pub mod registry;
pub mod session;
pub mod token_review;
