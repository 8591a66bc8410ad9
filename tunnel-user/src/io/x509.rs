//! What the tunnel reads from an X.509 certificate: the node a client certificate names
//! (the cloud's admission, the edge's CSR check), when it expires, and whether it carries
//! a DNS name.

use crate::addr::check_node_name;

/// The node a client certificate names: the subject's CN, or `<name>` from a
/// kubelet-style `system:node:<name>`. `None` when the certificate does not parse, has
/// no CN or more than one (ambiguous), or the name is not a valid node name.
pub fn node_name_from_cert(der: &[u8]) -> Option<String> {
    let cn = only_common_name(der)?;
    let name = cn.strip_prefix("system:node:").unwrap_or(&cn);
    check_node_name(name).ok()?;
    Some(name.to_string())
}

/// The subject's CN, when the certificate parses whole and has exactly one.
fn only_common_name(der: &[u8]) -> Option<String> {
    let (rest, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    if !rest.is_empty() {
        return None;
    }
    let mut names = cert.subject().iter_common_name();
    let cn = names.next()?.as_str().ok()?.to_string();
    names.next().is_none().then_some(cn)
}

/// The CN prefix of a relay's client certificate. A node name cannot hold `:`, so no
/// edge certificate (nor an edge CSR, whose CN must be a node name) can carry it.
pub const RELAY_CN_PREFIX: &str = "system:tunnel-relay:";

/// The node a relay's client certificate names: a single CN
/// `system:tunnel-relay:<node>` with a valid node name; `None` for anything else.
pub fn relay_node_from_cert(der: &[u8]) -> Option<String> {
    let cn = only_common_name(der)?;
    let node = cn.strip_prefix(RELAY_CN_PREFIX)?;
    check_node_name(node).ok()?;
    Some(node.to_string())
}

/// When a certificate stops being valid (its notAfter); None if it does not parse.
pub(crate) fn cert_not_after(der: &[u8]) -> Option<std::time::SystemTime> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let secs = u64::try_from(cert.validity().not_after.timestamp()).ok()?;
    Some(std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs))
}

/// A certificate's serial number in hex, as `openssl x509 -serial` prints it: which
/// certificate a peer presented, for logs; None if it does not parse.
pub(crate) fn cert_serial(der: &[u8]) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    Some(cert.raw_serial_as_string().replace(':', "").to_uppercase())
}

/// Whether a client certificate is a replica's: it carries `name` (the replicas'
/// shared DNS name) as a DNS subject alternative name. Edge certificates name their
/// node in the CN and carry no such SAN, so an edge cannot pose as a replica.
pub fn cert_has_dns_name(der: &[u8], name: &str) -> bool {
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else {
        return false;
    };
    let Ok(Some(san)) = cert.subject_alternative_name() else {
        return false;
    };
    san.value.general_names.iter().any(|n| matches!(n, x509_parser::extensions::GeneralName::DNSName(d) if d.eq_ignore_ascii_case(name)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert_with_cns(cns: &[&str]) -> Vec<u8> {
        let mut params = rcgen::CertificateParams::default();
        params.distinguished_name = rcgen::DistinguishedName::new();
        // rcgen keeps one value per attribute type; spelling the CN's OID (2.5.4.3) as a
        // custom type is how a second CN gets in.
        for (i, cn) in cns.iter().enumerate() {
            let ty = if i == 0 {
                rcgen::DnType::CommonName
            } else {
                rcgen::DnType::CustomDnType(vec![2, 5, 4, 3])
            };
            params.distinguished_name.push(ty, *cn);
        }
        let key = rcgen::KeyPair::generate().expect("key");
        params.self_signed(&key).expect("cert").der().to_vec()
    }

    #[test]
    fn a_relay_is_named_by_its_own_prefix_only() {
        let relay = cert_with_cns(&["system:tunnel-relay:worker-1"]);
        assert_eq!(relay_node_from_cert(&relay).as_deref(), Some("worker-1"));
        assert_eq!(node_name_from_cert(&relay), None, "not an edge's name");
        for not_relay in [
            &["worker-1"][..],
            &["system:node:worker-1"],
            &["system:tunnel-relay:"],
            &["system:tunnel-relay:Bad_Name"],
            &["system:tunnel-relay:a", "system:tunnel-relay:b"],
        ] {
            assert_eq!(
                relay_node_from_cert(&cert_with_cns(not_relay)),
                None,
                "{not_relay:?}"
            );
        }
    }

    #[test]
    fn node_name_from_cn() {
        assert_eq!(
            node_name_from_cert(&cert_with_cns(&["edge-1"])).as_deref(),
            Some("edge-1")
        );
        assert_eq!(
            node_name_from_cert(&cert_with_cns(&["system:node:edge-2"])).as_deref(),
            Some("edge-2")
        );
    }

    #[test]
    fn no_node_name_when_absent_ambiguous_or_invalid() {
        assert_eq!(node_name_from_cert(&cert_with_cns(&[])), None);
        let two = cert_with_cns(&["edge-1", "edge-2"]);
        let (_, parsed) = x509_parser::parse_x509_certificate(&two).expect("parses");
        assert_eq!(
            parsed.subject().iter_common_name().count(),
            2,
            "the test certificate has two CNs"
        );
        assert_eq!(node_name_from_cert(&two), None);
        assert_eq!(node_name_from_cert(&cert_with_cns(&["Tunnel Cloud"])), None);
        assert_eq!(node_name_from_cert(&cert_with_cns(&["system:node:"])), None);
        assert_eq!(node_name_from_cert(b"not a certificate"), None);
        let mut trailing = cert_with_cns(&["edge-1"]);
        trailing.push(0);
        assert_eq!(node_name_from_cert(&trailing), None);
    }
}
