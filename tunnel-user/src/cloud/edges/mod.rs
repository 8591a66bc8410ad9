//! The edges: their admission (TLS, Hello, authentication), the credentials that let
//! them in and keep them in, their certificates through CSRs, and the sessions this
//! replica holds.

pub(crate) mod admission;
pub(crate) mod authenticator;
pub(crate) mod capacity;
pub(crate) mod csr;
pub(crate) mod limit;
pub(crate) mod reauth;
pub(crate) mod registry;
pub(crate) mod session;
pub(crate) mod token_review;
