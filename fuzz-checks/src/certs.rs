//! Client certificates (DER), as an edge or a replica presents them:
//! `tunnel_user::io::x509::node_name_from_cert` (which node an edge may register as) and
//! `cert_has_dns_name` (whether a client is a replica). rustls has verified the chain
//! by then, but the fields are still the peer's.
//!
//! Properties: a node name taken from a certificate is always a valid node name with
//! the kubelet prefix removed, and it comes from a certificate that parses completely;
//! neither function panics.

use tunnel_user::addr::check_node_name;
use tunnel_user::io::x509::{cert_has_dns_name, node_name_from_cert};

/// Input: the certificate's DER.
pub fn check(data: &[u8]) {
    if let Some(name) = node_name_from_cert(data) {
        assert!(
            check_node_name(&name).is_ok(),
            "node name {name:?} from a certificate is not a valid node name"
        );
        assert!(
            !name.starts_with("system:"),
            "{name:?} kept the kubelet prefix"
        );
    }
    let _ = cert_has_dns_name(data, "tunnel-cloud");
    let _ = cert_has_dns_name(data, "");
}
