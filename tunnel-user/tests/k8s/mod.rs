//! Support for the end-to-end tests against a real kube-apiserver: the API server and
//! its etcd, a kubelet stand-in, what the tests check through them, and a real node
//! (containerd, kubelet, controllers). The edge's network namespace is
//! `common::netns`.
#![expect(dead_code, reason = "each e2e test file uses its own part")]

pub mod apiserver;
pub mod checks;
pub mod kubelet;
pub mod node;
pub mod spdy;
