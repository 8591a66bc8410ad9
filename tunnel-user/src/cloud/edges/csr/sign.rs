//! Signing an approved request with the tunnel CA: the certificate names the node, or
//! the relay on it (CN)
//! and this signer (OU, how the cloud tells its own certificates from `tunnel certs`
//! ones), is for client auth only, says outright that it is no CA (`basicConstraints`
//! `CA:FALSE`, critical), and lives at most the signer's maximum.

use std::path::Path;
use std::time::{Duration, SystemTime};

use rcgen::{
    CertificateSigningRequestParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SerialNumber,
};

use crate::config::CloudConfig;

/// Certificates start a little in the past, for edges whose clock lags: a tenth of the
/// lifetime, at most five minutes (Kubernetes' own signer backdates five minutes).
const MAX_BACKDATE: Duration = Duration::from_secs(300);

pub(crate) struct Signer {
    issuer: Issuer<'static, KeyPair>,
    /// The CA's own notAfter: no certificate outlives it.
    ca_not_after: SystemTime,
    signer_name: String,
    max_lifetime: Duration,
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum SignError {
    #[error("{path}: {problem}")]
    Ca { path: String, problem: String },
    #[error("cannot sign: {0}")]
    Sign(#[from] rcgen::Error),
}

impl Signer {
    /// The CA of `ca_cert` with its key `ca_key` (PEM files).
    pub(crate) fn load(
        ca_cert: &Path,
        ca_key: &Path,
        signer_name: &str,
        max_lifetime: Duration,
    ) -> Result<Self, SignError> {
        let (issuer, ca_not_after) = load_ca(ca_cert, ca_key)?;
        Ok(Self {
            issuer,
            ca_not_after,
            signer_name: signer_name.to_string(),
            max_lifetime,
        })
    }

    /// The certificate (PEM) for `common_name` (`review::Subject::common_name`) with
    /// the key of `request`, valid for what was asked (`expiration`, if any) capped at
    /// the maximum.
    pub(crate) fn sign(
        &self,
        common_name: &str,
        request: &CertificateSigningRequestParams,
        expiration: Option<Duration>,
    ) -> Result<String, SignError> {
        let lifetime = expiration.map_or(self.max_lifetime, |e| e.min(self.max_lifetime));
        let now = SystemTime::now();
        let mut params = rcgen::CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        params
            .distinguished_name
            .push(DnType::OrganizationalUnitName, self.signer_name.as_str());
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        // Without the extension a verifier that skips the key usage would take a leaf
        // signed by the cluster's tunnel CA as a CA of its own (RFC 5280 4.2.1.9).
        params.is_ca = IsCa::ExplicitNoCa;
        params.use_authority_key_identifier_extension = true;
        params.serial_number = Some(SerialNumber::from_slice(&rand::random::<[u8; 16]>()));
        params.not_before = (now - (lifetime / 10).min(MAX_BACKDATE)).into();
        params.not_after = (now + lifetime).min(self.ca_not_after).into();
        let cert = params.signed_by(&request.public_key, &self.issuer)?;
        Ok(cert.pem())
    }
}

/// The CA files the cloud signs with, edges' certificates (`csr.enabled`) and its own
/// serving one (`csr.serving`): `tunnel.client_ca` and `csr.ca_key`, which validation
/// requires for `feature`.
pub(crate) fn ca_files<'a>(
    config: &'a CloudConfig,
    feature: &str,
) -> anyhow::Result<(&'a Path, &'a Path)> {
    let ca_cert = config.tunnel.client_ca.as_deref();
    let ca_cert = ca_cert.ok_or_else(|| anyhow::anyhow!("{feature} needs tunnel.client_ca"))?;
    let ca_key = config.csr.ca_key.as_deref();
    let ca_key = ca_key.ok_or_else(|| anyhow::anyhow!("{feature} needs csr.ca_key"))?;
    Ok((ca_cert, ca_key))
}

/// The CA of `ca_cert` with its key `ca_key` (PEM files), and the CA's notAfter, which
/// no certificate it signs outlives.
pub(crate) fn load_ca(
    ca_cert: &Path,
    ca_key: &Path,
) -> Result<(Issuer<'static, KeyPair>, SystemTime), SignError> {
    let read = |path: &Path| {
        std::fs::read_to_string(path).map_err(|e| SignError::Ca {
            path: path.display().to_string(),
            problem: e.to_string(),
        })
    };
    let bad = |path: &Path, problem: String| SignError::Ca {
        path: path.display().to_string(),
        problem,
    };
    let cert_pem = read(ca_cert)?;
    let key = KeyPair::from_pem(&read(ca_key)?)
        .map_err(|e| bad(ca_key, format!("not a PEM private key: {e}")))?;
    let ca_not_after =
        ca_not_after(&cert_pem).ok_or_else(|| bad(ca_cert, "not a PEM certificate".into()))?;
    let issuer = Issuer::from_ca_cert_pem(&cert_pem, key)
        .map_err(|e| bad(ca_cert, format!("cannot sign with it: {e}")))?;
    Ok((issuer, ca_not_after))
}

fn ca_not_after(pem: &str) -> Option<SystemTime> {
    use rustls_pki_types::CertificateDer;
    use rustls_pki_types::pem::PemObject as _;
    let der = CertificateDer::from_pem_slice(pem.as_bytes()).ok()?;
    crate::io::x509::cert_not_after(der.as_ref())
}

/// Whether `der` (a client certificate) was issued by the signer `signer_name`: its
/// subject carries the signer's name as OU.
pub(crate) fn issued_by(der: &[u8], signer_name: &str) -> bool {
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else {
        return false;
    };
    cert.subject()
        .iter_organizational_unit()
        .any(|ou| ou.as_str() == Ok(signer_name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signs_for_the_node_capped_marked_and_never_a_ca() {
        let dir = tempfile::tempdir().expect("dir");
        let mut args = crate::certs::CertsArgs::new(dir.path());
        args.cloud_names = vec!["tunnel-cloud".into()];
        crate::certs::generate(&args).expect("CA");
        let signer = Signer::load(
            &dir.path().join("ca.crt"),
            &dir.path().join("ca.key"),
            "tunnel.io/edge-client",
            Duration::from_secs(120),
        )
        .expect("signer");
        let key = KeyPair::generate().expect("key");
        let mut params = rcgen::CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, "edge-1");
        let csr = params.serialize_request(&key).expect("csr");
        let request = CertificateSigningRequestParams::from_der(csr.der()).expect("parse");
        let pem = signer
            .sign("edge-1", &request, Some(Duration::from_secs(3600)))
            .expect("sign");
        let der = rustls_pki_types::CertificateDer::from_pem_slice(pem.as_bytes()).expect("pem");
        use rustls_pki_types::pem::PemObject as _;
        assert_eq!(
            crate::io::x509::node_name_from_cert(der.as_ref()).as_deref(),
            Some("edge-1")
        );
        assert!(issued_by(der.as_ref(), "tunnel.io/edge-client"));
        assert!(!issued_by(der.as_ref(), "tunnel.io/other"));
        let left = crate::io::x509::cert_not_after(der.as_ref())
            .expect("not after")
            .duration_since(SystemTime::now())
            .expect("in the future");
        assert!(left <= Duration::from_secs(120), "capped: {left:?}");
        let (_, cert) = x509_parser::parse_x509_certificate(der.as_ref()).expect("parse");
        assert_eq!(
            cert.public_key().raw,
            rcgen::PublicKeyData::subject_public_key_info(&key).as_slice(),
            "the requester's key"
        );
        let constraints = cert
            .basic_constraints()
            .expect("one basicConstraints")
            .expect("basicConstraints present");
        assert!(
            !constraints.value.ca && constraints.critical,
            "basicConstraints CA:FALSE, critical: {constraints:?}"
        );
    }
}
