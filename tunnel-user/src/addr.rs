//! The addresses a connection is known by on its way through the cloud, each its own
//! type so that a node name, a client's address and a redirected connection's original
//! destination cannot be mixed up: [`NodeName`] (which edge session), [`ClientAddr`]
//! (who connected to an entry), [`OrigDst`] (where a redirected connection was going).

use std::fmt;
use std::net::SocketAddr;

/// The name of a node (or of a cluster identity) that passed [`check_node_name`]: what
/// an admitted edge session is known by. Made where a name comes in from the network
/// (`Hello.node_name`); it reads as a `&str` (and keys maps looked up by `&str`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeName(String);

impl NodeName {
    /// Checks `name` with [`check_node_name`].
    pub(crate) fn new(name: String) -> Result<Self, String> {
        check_node_name(&name)?;
        Ok(NodeName(name))
    }

    pub(crate) fn as_str(&self) -> &str {
        &self.0
    }
}

/// Node names follow Kubernetes object names (RFC 1123 subdomain).
pub fn check_node_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 253
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphanumeric())
        && name
            .bytes()
            .last()
            .is_some_and(|b| b.is_ascii_alphanumeric());
    if ok {
        Ok(())
    } else {
        Err(format!(
            "`{name}` is not a valid node name (lower-case letters, digits, '-' and '.')"
        ))
    }
}

impl std::ops::Deref for NodeName {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl std::borrow::Borrow<str> for NodeName {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for NodeName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<NodeName> for String {
    fn from(name: NodeName) -> String {
        name.0
    }
}

/// Who connected to an entry: a TCP peer, or a client on the CONNECT entry's unix socket
/// (which has no address worth naming).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ClientAddr {
    Tcp(SocketAddr),
    Unix,
}

impl fmt::Display for ClientAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClientAddr::Tcp(addr) => addr.fmt(f),
            ClientAddr::Unix => f.write_str("unix"),
        }
    }
}

/// Where an eBPF-redirected connection was going before it was bent to the cloud: the
/// node address the edge dials.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OrigDst(pub(crate) SocketAddr);

impl fmt::Display for OrigDst {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    #[test]
    fn a_node_name_is_checked_once_and_reads_as_str() {
        assert!(NodeName::new("Edge_1".into()).is_err());
        assert!(NodeName::new(String::new()).is_err());
        let name = NodeName::new("edge-1.example".into()).expect("valid");
        assert_eq!(name.to_string(), "edge-1.example");
        // Maps keyed by NodeName are looked up with the &str a connection carries.
        let map = HashMap::from([(name, 7)]);
        assert_eq!(map.get("edge-1.example"), Some(&7));
    }
}
