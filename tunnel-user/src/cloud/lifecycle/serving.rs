//! A replica's own serving certificate (`csr.serving`): the replica already holds the
//! tunnel CA's key to sign edge certificates, so it makes its serving key in memory and
//! signs the certificate itself. A CSR for it would be approved by the replicas
//! themselves, adding an API round trip and no check; and no serving key sits in a
//! Secret or on disk. The certificate is renewed at two thirds of its lifetime
//! (`reload::renew_serving`) through the same setters as a reloaded file: new handshakes,
//! edges' and other replicas', get the new one, and open connections keep the one they
//! began with.

use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use rcgen::{
    CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, Issuer, KeyPair,
    KeyUsagePurpose, SanType, SerialNumber,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tracing::info;

use crate::cloud::edges::csr::sign;
use crate::config::CloudConfig;
use crate::io::tls::Identity;

/// The name every replica's certificate holds: edges check it, and so do the replicas
/// on each other's links (`peers.server_name` by default).
pub(crate) const CLOUD_NAME: &str = "tunnel-cloud";

/// What the replica signs its serving certificates with, and what they hold.
pub(crate) struct SelfIssuer {
    issuer: Issuer<'static, KeyPair>,
    /// The CA's own notAfter: no certificate outlives it.
    ca_not_after: SystemTime,
    names: Vec<String>,
    lifetime: Duration,
    /// The certificate in force, for a reload of the CA files (`reload::reload_tls`).
    current: Mutex<Option<Identity>>,
}

/// One issued certificate, for the log.
pub(crate) struct Issued {
    pub(crate) identity: Identity,
    pub(crate) serial: String,
    pub(crate) not_after: SystemTime,
}

impl SelfIssuer {
    pub(crate) fn load(config: &CloudConfig) -> anyhow::Result<Self> {
        let c = &config.csr;
        let (ca_cert, ca_key) = sign::ca_files(config, "csr.serving")?;
        let (issuer, ca_not_after) = sign::load_ca(ca_cert, ca_key)?;
        let mut names = vec![CLOUD_NAME.to_string(), config.peers.server_name.clone()];
        names.extend(c.serving_names.iter().cloned());
        // Each name once, in order: a repeated SAN is legal but confusing to read.
        let mut seen = std::collections::HashSet::new();
        names.retain(|n| seen.insert(n.clone()));
        Ok(Self {
            issuer,
            ca_not_after,
            names,
            lifetime: c.serving_lifetime,
            current: Mutex::new(None),
        })
    }

    /// A new key and certificate; it also becomes the one `current` returns.
    pub(crate) fn issue(&self) -> anyhow::Result<Issued> {
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
        let now = SystemTime::now();
        let mut serial: [u8; 16] = rand::random();
        // Positive and without a leading zero byte, so the logged hex is what openssl
        // and other clients print for it.
        serial[0] = serial[0] & 0x7f | 0x10;
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::CommonName, CLOUD_NAME);
        params.subject_alt_names = self.sans()?;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        // Client auth too: a replica presents it on its links to the others.
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        params.serial_number = Some(SerialNumber::from_slice(&serial));
        // Backdated a little for peers whose clock lags, as `csr::sign` does.
        params.not_before = (now - (self.lifetime / 10).min(Duration::from_secs(300))).into();
        let not_after = (now + self.lifetime).min(self.ca_not_after);
        params.not_after = not_after.into();
        let cert = params.signed_by(&key, &self.issuer)?;
        let identity = Identity {
            certs: vec![CertificateDer::from(cert.der().to_vec())],
            key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
            source: "the self-issued serving certificate".into(),
        };
        *self.current.lock().unwrap_or_else(|e| e.into_inner()) = Some(identity.clone());
        Ok(Issued {
            identity,
            serial: serial.iter().map(|b| format!("{b:02x}")).collect(),
            not_after,
        })
    }

    /// The certificate in force, if one was issued.
    pub(crate) fn current(&self) -> Option<Identity> {
        self.current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn sans(&self) -> anyhow::Result<Vec<SanType>> {
        self.names
            .iter()
            .map(|n| match n.parse::<IpAddr>() {
                Ok(ip) => Ok(SanType::IpAddress(ip)),
                Err(_) => Ok(SanType::DnsName(n.as_str().try_into()?)),
            })
            .collect()
    }

    /// How long until the certificate ending at `not_after` is renewed: two thirds into
    /// its life, leaving a third for retries.
    pub(crate) fn renew_in(&self, not_after: SystemTime) -> Duration {
        let left = not_after
            .duration_since(SystemTime::now())
            .unwrap_or_default();
        left.saturating_sub(self.lifetime.min(left) / 3)
    }
}

/// Logs an issued certificate: the serial and expiry are what an operator compares
/// with what a client saw.
pub(crate) fn log_issued(issued: &Issued, what: &str) {
    let expires = humantime_serde::re::humantime::format_rfc3339_seconds(issued.not_after);
    info!(serial = %issued.serial, %expires, "serving certificate {what}; new connections use it");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn issuer(lifetime: Duration) -> SelfIssuer {
        let key = KeyPair::generate().expect("key");
        let mut params = CertificateParams::default();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = params.self_signed(&key).expect("ca");
        let ca_not_after = SystemTime::now() + Duration::from_secs(3600);
        SelfIssuer {
            issuer: Issuer::from_ca_cert_der(ca.der(), key).expect("issuer"),
            ca_not_after,
            names: vec![CLOUD_NAME.into(), "10.0.0.10".into()],
            lifetime,
            current: Mutex::new(None),
        }
    }

    #[test]
    fn issues_for_tunnel_cloud_with_the_logged_serial_and_renews_at_two_thirds() {
        let issuer = issuer(Duration::from_secs(30));
        assert!(issuer.current().is_none());
        let issued = issuer.issue().expect("issue");
        let der = issued.identity.certs[0].as_ref();
        assert!(crate::io::x509::cert_has_dns_name(der, CLOUD_NAME));
        let (_, cert) = x509_parser::parse_x509_certificate(der).expect("parse");
        assert_eq!(cert.raw_serial_as_string().replace(':', ""), issued.serial);
        let san = cert.subject_alternative_name().expect("san").expect("san");
        assert!(san.value.general_names.iter().any(|n| matches!(
            n,
            x509_parser::extensions::GeneralName::IPAddress([10, 0, 0, 10])
        )));
        let renew = issuer.renew_in(issued.not_after).as_secs_f64();
        assert!((19.0..=20.5).contains(&renew), "renews in {renew}s");
        // A second one is another key and serial, and becomes the current one.
        let again = issuer.issue().expect("issue");
        assert_ne!(again.serial, issued.serial);
        let current = issuer.current().expect("current");
        assert_eq!(current.certs, again.identity.certs);
    }

    #[test]
    fn never_outlives_the_ca() {
        let mut issuer = issuer(Duration::from_secs(7200));
        issuer.ca_not_after = SystemTime::now() + Duration::from_secs(600);
        let issued = issuer.issue().expect("issue");
        assert!(issued.not_after <= issuer.ca_not_after);
    }
}
