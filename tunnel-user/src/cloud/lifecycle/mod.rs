//! The cloud process around its connections: listeners bound (or handed over by a
//! predecessor), the CA kept in the cluster, its own serving certificate, hot reload, what operators see, and
//! whether a stopping process takes the eBPF redirect with it.

pub mod ca;
pub mod handover;
pub mod listeners;
pub mod observe;
pub mod redirect_owner;
pub mod reload;
pub mod serving;
