//! Support for the end-to-end tests against a real kube-apiserver: the API server and
//! its etcd, a kubelet stand-in, and a network namespace for the edge side.

pub mod apiserver;
pub mod kubelet;
pub mod netns;
pub mod spdy;
