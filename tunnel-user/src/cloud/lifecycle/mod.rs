//! The cloud process around its connections: listeners bound (or handed over by a
//! predecessor), the capabilities it keeps once they are, the CA kept in the cluster, its own serving certificate, hot reload, what operators see, and
//! whether a stopping process takes the eBPF redirect with it.

pub(crate) mod ca;
pub(crate) mod capabilities;
pub(crate) mod handover;
pub(crate) mod listeners;
pub(crate) mod observe;
pub(crate) mod redirect_owner;
pub(crate) mod reload;
pub(crate) mod serving;
