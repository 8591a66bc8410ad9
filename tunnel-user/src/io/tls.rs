//! rustls configurations for the edge's connection to the cloud, for the replicas'
//! connections to each other, and for SuperEdge's HTTPS module on both ends.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio_util::sync::CancellationToken;
use tracing::info;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{path}: cannot read certificates: {source}")]
    Certs {
        path: String,
        source: rustls::pki_types::pem::Error,
    },
    #[error("{path}: no certificate in file")]
    NoCerts { path: String },
    #[error("{path}: cannot read private key: {source}")]
    Key {
        path: String,
        source: rustls::pki_types::pem::Error,
    },
    #[error("{path}: {source}")]
    Invalid { path: String, source: rustls::Error },
    #[error("invalid TLS server name `{0}`")]
    ServerName(String),
    #[error("client CA {path}: {message}")]
    ClientCa { path: String, message: String },
}

/// Sealed records rustls may hold for the socket (its default is 64 KiB).
const TUNNEL_SEND_BUFFER: usize = 256 * 1024;

/// Sets up a tunnel connection, an edge's or a replica's, once its handshake is done.
/// Bulk data reaches TLS a chunk at a time (`transport.chunk_size`, 256 KiB by
/// default), and rustls takes plaintext only while it holds less than its limit of
/// sealed records: with room for a whole chunk, the chunk's records leave in one
/// `writev`, not four. They are held only until the socket takes them.
pub(crate) fn tune_tunnel<C, D>(conn: &mut C)
where
    C: std::ops::DerefMut<Target = rustls::ConnectionCommon<D>>,
{
    conn.set_buffer_limit(Some(TUNNEL_SEND_BUFFER));
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

pub(crate) fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let shown = path.display().to_string();
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|source| TlsError::Certs {
            path: shown.clone(),
            source,
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCerts { path: shown });
    }
    Ok(certs)
}

pub(crate) fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|source| TlsError::Key {
        path: path.display().to_string(),
        source,
    })
}

fn roots(path: &Path) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in load_certs(path)? {
        roots.add(cert).map_err(|source| TlsError::Invalid {
            path: path.display().to_string(),
            source,
        })?;
    }
    Ok(roots)
}

/// Waits until the tunnel CA's certificate exists at `path` (the edge's
/// `cloud.wait_for_ca`, a relay's `relay.wait_for_ca`): the cloud publishes it on its
/// first start, and the kubelet brings it into the pod's volume up to a minute or two
/// later, so a pod started first waits rather than exits. `false` when `shutdown` came
/// first.
pub(crate) async fn wait_for_ca(path: &Path, shutdown: &CancellationToken) -> bool {
    /// How often the file is looked for, and how often the wait is logged again.
    const POLL: Duration = Duration::from_secs(1);
    const LOG_EVERY: u32 = 30;
    let mut polls = 0u32;
    while !path.exists() {
        if polls.is_multiple_of(LOG_EVERY) {
            info!(
                ca = %path.display(),
                "waiting for the cloud's CA certificate: tunnel-cloud publishes it in its ConfigMap (csr.ca_config_map) on its first start, and the kubelet updates the mounted volume within a minute or two"
            );
        }
        polls = polls.wrapping_add(1);
        tokio::select! {
            () = tokio::time::sleep(POLL) => {}
            () = shutdown.cancelled() => return false,
        }
    }
    if polls > 0 {
        info!(ca = %path.display(), "the cloud's CA certificate is here");
    }
    true
}

/// A certificate chain and its private key: read from files, or made in memory by a
/// cloud replica that issues its own serving certificate (`cloud::lifecycle::serving`).
pub(crate) struct Identity {
    pub(crate) certs: Vec<CertificateDer<'static>>,
    pub(crate) key: PrivateKeyDer<'static>,
    /// What error messages name: the certificate file, or where it was made.
    pub(crate) source: String,
}

impl Clone for Identity {
    fn clone(&self) -> Self {
        Self {
            certs: self.certs.clone(),
            key: self.key.clone_key(),
            source: self.source.clone(),
        }
    }
}

impl Identity {
    pub(crate) fn load(cert: &Path, key: &Path) -> Result<Self, TlsError> {
        Ok(Self {
            certs: load_certs(cert)?,
            key: load_key(key)?,
            source: cert.display().to_string(),
        })
    }
}

/// The cloud's listener for edges. With `client_ca`, edges may present a certificate
/// naming their node; it stays optional because token-only edges present none.
pub fn server_config(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
) -> Result<Arc<ServerConfig>, TlsError> {
    server_config_with(&Identity::load(cert, key)?, client_ca)
}

/// `server_config` with a certificate and key already in memory.
pub(crate) fn server_config_with(
    identity: &Identity,
    client_ca: Option<&Path>,
) -> Result<Arc<ServerConfig>, TlsError> {
    server(
        identity,
        client_ca.map(|ca| (ca, ClientAuth::Optional)),
        // Protocol 1 too, only to tell such an edge to upgrade (`cloud/edges/admission.rs`).
        &[proto::ALPN, proto::LEGACY_ALPN],
    )
}

/// The replicas' listener for each other: a client certificate signed by `ca` is
/// required (the caller then checks that it names a replica, not an edge). ALPN `h2`:
/// gRPC.
pub fn peer_server_config(
    cert: &Path,
    key: &Path,
    ca: &Path,
) -> Result<Arc<ServerConfig>, TlsError> {
    peer_server_config_with(&Identity::load(cert, key)?, ca)
}

/// `peer_server_config` with a certificate and key already in memory.
pub(crate) fn peer_server_config_with(
    identity: &Identity,
    ca: &Path,
) -> Result<Arc<ServerConfig>, TlsError> {
    server(identity, Some((ca, ClientAuth::Required)), &[b"h2"])
}

enum ClientAuth {
    Optional,
    Required,
}

/// A verifier that requires a client certificate signed by `ca`: how a renewed edge
/// certificate sent on an open session is checked (`cloud::edges::reauth`).
pub(crate) fn client_cert_verifier(
    ca: &Path,
) -> Result<Arc<dyn rustls::server::danger::ClientCertVerifier>, TlsError> {
    WebPkiClientVerifier::builder_with_provider(Arc::new(roots(ca)?), provider())
        .build()
        .map_err(|e| TlsError::ClientCa {
            path: ca.display().to_string(),
            message: e.to_string(),
        })
}

/// The label of the keying material (RFC 5705) a renewed certificate's proof signs.
const RENEWAL_EXPORTER_LABEL: &[u8] = b"EXPORTER-tunnel-certificate-renewal";

/// 32 bytes only this TLS connection's two ends can compute: what the edge signs with a
/// renewed certificate's key, to prove it holds it on this very connection.
pub(crate) fn renewal_exporter<D>(conn: &rustls::ConnectionCommon<D>) -> Option<[u8; 32]> {
    conn.export_keying_material([0u8; 32], RENEWAL_EXPORTER_LABEL, None)
        .ok()
}

/// Schemes a proof may use: TLS 1.3 ones for the key types an edge certificate has.
const PROOF_SCHEMES: [rustls::SignatureScheme; 4] = [
    rustls::SignatureScheme::ECDSA_NISTP256_SHA256,
    rustls::SignatureScheme::ECDSA_NISTP384_SHA384,
    rustls::SignatureScheme::ED25519,
    rustls::SignatureScheme::RSA_PSS_SHA256,
];

/// Signs `exporter` with `key`: the scheme (as the wire's u16) and the signature.
pub(crate) fn sign_proof(
    key: &PrivateKeyDer<'_>,
    exporter: &[u8],
) -> Result<(u16, Vec<u8>), String> {
    let key = provider()
        .key_provider
        .load_private_key(key.clone_key())
        .map_err(|e| e.to_string())?;
    let signer = key
        .choose_scheme(&PROOF_SCHEMES)
        .ok_or("the key suits none of the proof's signature schemes")?;
    let signature = signer.sign(exporter).map_err(|e| e.to_string())?;
    Ok((u16::from(signer.scheme()), signature))
}

/// Checks that `signature` over `exporter` was made with the key of `cert` (DER).
pub(crate) fn verify_proof(
    cert: &[u8],
    exporter: &[u8],
    scheme: u32,
    signature: &[u8],
) -> Result<(), String> {
    let scheme = u16::try_from(scheme)
        .map(rustls::SignatureScheme::from)
        .map_err(|_| format!("signature scheme {scheme} does not exist"))?;
    if !PROOF_SCHEMES.contains(&scheme) {
        return Err(format!("signature scheme {scheme:?} is not accepted"));
    }
    let algorithms = provider().signature_verification_algorithms;
    let alg = algorithms
        .mapping
        .iter()
        .find(|(s, _)| *s == scheme)
        .and_then(|(_, algs)| algs.first())
        .ok_or_else(|| format!("signature scheme {scheme:?} is not supported"))?;
    let (_, parsed) =
        x509_parser::parse_x509_certificate(cert).map_err(|e| format!("certificate: {e}"))?;
    let public_key = &parsed.public_key().subject_public_key.data;
    alg.verify_signature(public_key, exporter, signature)
        .map_err(|_| "the proof's signature does not match the certificate's key".to_string())
}

fn server(
    identity: &Identity,
    client_ca: Option<(&Path, ClientAuth)>,
    alpn: &[&[u8]],
) -> Result<Arc<ServerConfig>, TlsError> {
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions");
    let builder = match client_ca {
        Some((ca, auth)) => {
            let mut verifier =
                WebPkiClientVerifier::builder_with_provider(Arc::new(roots(ca)?), provider());
            if matches!(auth, ClientAuth::Optional) {
                verifier = verifier.allow_unauthenticated();
            }
            let verifier = verifier.build().map_err(|e| TlsError::ClientCa {
                path: ca.display().to_string(),
                message: e.to_string(),
            })?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(identity.certs.clone(), identity.key.clone_key())
        .map_err(|source| TlsError::Invalid {
            path: identity.source.clone(),
            source,
        })?;
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

/// The edge's connection to the cloud with a certificate chain and key in memory (from
/// a CertificateSigningRequest, `crate::csr`; the bench's simulated edges).
pub fn client_config_with_key(
    ca: &Path,
    certs: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<Arc<ClientConfig>, TlsError> {
    let mut config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
        .with_root_certificates(roots(ca)?)
        .with_client_auth_cert(certs, key)
        .map_err(|source| TlsError::Invalid {
            path: "the certificate from the cluster".into(),
            source,
        })?;
    config.alpn_protocols = vec![proto::ALPN.to_vec()];
    Ok(Arc::new(config))
}

/// The edge's connection to the cloud: the cloud must present a certificate for
/// `server_name` signed by `ca`; `client` is this node's certificate and key for mTLS.
pub fn client_config(
    ca: &Path,
    client: Option<(&Path, &Path)>,
) -> Result<Arc<ClientConfig>, TlsError> {
    client_with(ca, client, proto::ALPN)
}

/// A replica's connection to another: both present the cloud certificate. `alpn` is
/// `h2` for gRPC.
pub fn peer_client_config(
    ca: &Path,
    cert: &Path,
    key: &Path,
    alpn: &[u8],
) -> Result<Arc<ClientConfig>, TlsError> {
    peer_client_config_with(ca, &Identity::load(cert, key)?, alpn)
}

/// `peer_client_config` with a certificate and key already in memory.
pub(crate) fn peer_client_config_with(
    ca: &Path,
    identity: &Identity,
    alpn: &[u8],
) -> Result<Arc<ClientConfig>, TlsError> {
    let mut config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
        .with_root_certificates(roots(ca)?)
        .with_client_auth_cert(identity.certs.clone(), identity.key.clone_key())
        .map_err(|source| TlsError::Invalid {
            path: identity.source.clone(),
            source,
        })?;
    config.alpn_protocols = vec![alpn.to_vec()];
    Ok(Arc::new(config))
}

fn client_with(
    ca: &Path,
    client: Option<(&Path, &Path)>,
    alpn: &[u8],
) -> Result<Arc<ClientConfig>, TlsError> {
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
        .with_root_certificates(roots(ca)?);
    let mut config = match client {
        Some((cert, key)) => builder
            .with_client_auth_cert(load_certs(cert)?, load_key(key)?)
            .map_err(|source| TlsError::Invalid {
                path: cert.display().to_string(),
                source,
            })?,
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![alpn.to_vec()];
    Ok(Arc::new(config))
}

pub fn server_name(name: &str) -> Result<ServerName<'static>, TlsError> {
    ServerName::try_from(name.to_string()).map_err(|_| TlsError::ServerName(name.to_string()))
}

/// The edge's TLS client toward targets of SuperEdge's HTTPS module (the kubelet): it
/// presents the `[https]` client certificate and, as SuperEdge does, does not verify
/// the target's certificate, which names the node, not the loopback address dialled.
/// Handshake signatures are still checked.
pub(crate) fn target_client_config(
    client: Option<(&Path, &Path)>,
) -> Result<Arc<ClientConfig>, TlsError> {
    let provider = provider();
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyServerCert(provider)));
    let config = match client {
        Some((cert, key)) => builder
            .with_client_auth_cert(load_certs(cert)?, load_key(key)?)
            .map_err(|source| TlsError::Invalid {
                path: cert.display().to_string(),
                source,
            })?,
        None => builder.with_no_client_auth(),
    };
    Ok(Arc::new(config))
}

#[derive(Debug)]
struct AnyServerCert(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AnyServerCert {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// SuperEdge's HTTPS module listener: a client certificate signed by `client_ca` is
/// required. The edge presents its own kubelet client certificate to the target, so
/// whoever completes this handshake acts as kube-apiserver on every edge's kubelet.
pub(crate) fn https_entry_server_config(
    cert: &Path,
    key: &Path,
    client_ca: &Path,
) -> Result<Arc<ServerConfig>, TlsError> {
    server(
        &Identity::load(cert, key)?,
        Some((client_ca, ClientAuth::Required)),
        &[],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proof_verifies_with_its_key_only() {
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = rcgen::CertificateParams::new(vec!["edge-1".to_string()])
            .expect("params")
            .self_signed(&key)
            .expect("cert");
        let der = PrivateKeyDer::try_from(key.serialize_der()).expect("key der");
        let exporter = [7u8; 32];
        let (scheme, signature) = sign_proof(&der, &exporter).expect("sign");
        verify_proof(cert.der(), &exporter, u32::from(scheme), &signature).expect("verifies");
        assert!(verify_proof(cert.der(), &[8u8; 32], u32::from(scheme), &signature).is_err());
        let other = rcgen::KeyPair::generate().expect("key");
        let other = rcgen::CertificateParams::new(vec!["edge-1".to_string()])
            .expect("params")
            .self_signed(&other)
            .expect("cert");
        let e = verify_proof(other.der(), &exporter, u32::from(scheme), &signature)
            .expect_err("another key");
        assert!(e.contains("does not match"), "{e}");
        assert!(
            verify_proof(cert.der(), &exporter, 0x0401, &signature).is_err(),
            "PKCS#1 is not a TLS 1.3 scheme"
        );
    }

    /// A CA published after the start is waited for, polled each second; a shutdown
    /// meanwhile ends the wait.
    #[tokio::test(start_paused = true)]
    async fn the_ca_is_waited_for_until_it_appears_or_shutdown() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("ca.crt");
        let shutdown = CancellationToken::new();
        let waiting = tokio::spawn({
            let (path, shutdown) = (path.clone(), shutdown.clone());
            async move { wait_for_ca(&path, &shutdown).await }
        });
        tokio::time::sleep(Duration::from_secs(90)).await;
        assert!(!waiting.is_finished(), "returned with no CA there");
        std::fs::write(&path, "published").expect("write");
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(waiting.await.expect("task"), "the CA appeared");

        let absent = dir.path().join("never.crt");
        let waiting = tokio::spawn({
            let shutdown = shutdown.clone();
            async move { wait_for_ca(&absent, &shutdown).await }
        });
        tokio::time::sleep(Duration::from_secs(5)).await;
        shutdown.cancel();
        assert!(!waiting.await.expect("task"), "shutdown ends the wait");
    }
}
