//! Who may register as which node: the edges' TLS (the server certificate, and the
//! client CA that checks edge certificates), the token file, TokenReview for service
//! account tokens, and the bounds on what failed registrations cost (`limit`). The token
//! file and the TLS files are replaced on reload (`reload`), each through its setter.

use std::net::IpAddr;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant, SystemTime};

use proto::{Hello, Reject, RejectReason};
use rustls::pki_types::CertificateDer;

use super::csr::Issued;
use super::limit::{AuthLimiter, Budget, LogBudget};
use super::session::Proof;
use super::token_review::{ReviewError, TokenReviewer};
use crate::addr::NodeName;
use crate::cloud::nodes::Nodes;
use crate::config::Identity;
use crate::config::token_file::TokenFile;
use crate::io::x509;

pub(crate) struct Authenticator {
    /// The edges' TLS server config; replaced when the certificate files change.
    tls: RwLock<Arc<rustls::ServerConfig>>,
    tokens: RwLock<Option<Arc<TokenFile>>>,
    /// Service account tokens checked with TokenReview (`kubernetes.token_review`).
    token_review: Option<TokenReviewer>,
    /// The node table: a cluster may not take the name of a node in it.
    nodes: Arc<Nodes>,
    /// With the Node watch on (`kubernetes.enabled`), the edge selector: a node
    /// registers only when the node table holds it, so when its Node carries the
    /// selector's label (or the config names it). A kubelet can get a certificate for
    /// its own name; that makes no master or worker an edge.
    edge_selector: Option<String>,
    /// Failed registrations per source address.
    limiter: AuthLimiter,
    /// Log lines for failed registrations.
    log: LogBudget,
    /// The certificates the cloud's CSR signer issued and still stand behind
    /// (`csr.enabled`): one whose CSR is gone is revoked.
    issued: Option<Arc<Issued>>,
    /// Checks a renewed client certificate an edge sends on its session (the client
    /// CA's); replaced with the TLS files.
    renewal_verifier: RwLock<Option<Arc<ClientCertVerifier>>>,
}

/// How a client certificate is checked against the client CA.
type ClientCertVerifier = dyn rustls::server::danger::ClientCertVerifier;

/// A Hello that may register: how it proved who it is, as what, and the name.
pub(crate) struct Admitted {
    pub(crate) credential: Credential,
    pub(crate) kind: Identity,
    pub(crate) node: NodeName,
}

/// What an edge registered with, as far as it must be checked again.
pub(crate) enum Credential {
    /// A line of the token file: the token the edge registered with (the session keeps
    /// the one it uses now, for the reload check).
    TokenFile(String),
    /// A service account token, reviewed by the API server.
    ServiceAccount(String),
    /// A client certificate.
    Certificate(CertCredential),
}

impl Credential {
    pub(crate) fn proof(&self) -> Proof {
        match self {
            Credential::TokenFile(_) => Proof::TokenFile,
            Credential::ServiceAccount(_) => Proof::ServiceAccount,
            Credential::Certificate(_) => Proof::Certificate,
        }
    }
}

/// The client certificate a session stands on, replaced when the edge renews it.
pub(crate) struct CertCredential {
    pub(crate) not_after: Option<SystemTime>,
    /// The certificate (DER), to look up whether it was revoked.
    pub(crate) der: Vec<u8>,
    /// This connection's keying material a renewal's proof signs
    /// (`io::tls::renewal_exporter`).
    pub(crate) exporter: Option<[u8; 32]>,
}

impl Authenticator {
    pub(crate) fn new(
        tls: Arc<rustls::ServerConfig>,
        tokens: Option<Arc<TokenFile>>,
        token_review: Option<TokenReviewer>,
        nodes: Arc<Nodes>,
        edge_selector: Option<String>,
        issued: Option<Arc<Issued>>,
    ) -> Self {
        Self {
            tls: RwLock::new(tls),
            tokens: RwLock::new(tokens),
            token_review,
            nodes,
            edge_selector,
            limiter: AuthLimiter::default(),
            log: LogBudget::new(20, Duration::from_secs(10)),
            issued,
            renewal_verifier: RwLock::new(None),
        }
    }

    /// Renewed client certificates are checked with `verifier` (the client CA's).
    pub(crate) fn set_renewal_verifier(&self, verifier: Arc<ClientCertVerifier>) {
        *self
            .renewal_verifier
            .write()
            .unwrap_or_else(|e| e.into_inner()) = Some(verifier);
    }

    /// Whether `der` is a certificate of the cloud's CSR signer whose CSR is gone.
    pub(crate) fn revoked(&self, der: &[u8]) -> bool {
        self.issued.as_ref().is_some_and(|i| i.revoked(der))
    }

    /// Wakes whenever the CSR watch's certificates change; `None` without the CSR signer.
    pub(crate) fn csr_updates(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        self.issued.as_ref().map(|i| i.subscribe())
    }

    /// Checks a renewed certificate an edge sent on its session (`Reauth`): signed by
    /// the client CA, valid now, for `node`, not revoked, and its key proven on this
    /// connection by a signature over `exporter`. Its notAfter when it passes.
    pub(crate) fn check_renewal(
        &self,
        node: &str,
        exporter: Option<&[u8; 32]>,
        reauth: &proto::Reauth,
    ) -> Result<Option<SystemTime>, Refused> {
        let exporter =
            exporter.ok_or("the connection has no keying material to prove the key with")?;
        let verifier = self
            .renewal_verifier
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or("no client CA to check certificates with")?;
        let der = CertificateDer::from(reauth.certificate.as_slice());
        verifier
            .verify_client_cert(&der, &[], rustls::pki_types::UnixTime::now())
            .map_err(|e| format!("the certificate does not verify: {e}"))?;
        match x509::node_name_from_cert(&reauth.certificate) {
            Some(n) if n == node => {}
            other => {
                return Err(Refused::Bad(format!(
                    "the certificate is for {other:?}, not node `{node}`"
                )));
            }
        }
        crate::io::tls::verify_proof(
            &reauth.certificate,
            exporter,
            reauth.signature_scheme,
            &reauth.signature,
        )?;
        if self.revoked(&reauth.certificate) {
            return Err(Refused::NotIssued);
        }
        Ok(x509::cert_not_after(&reauth.certificate))
    }

    /// The acceptor for the next edge connection, with the current certificate.
    pub(crate) fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.tls.read().unwrap_or_else(|e| e.into_inner()).clone())
    }

    /// New edge connections use `tls`.
    pub(crate) fn set_tls(&self, tls: Arc<rustls::ServerConfig>) {
        *self.tls.write().unwrap_or_else(|e| e.into_inner()) = tls;
    }

    /// Registrations, and tokens the edges send later, are checked against `tokens`.
    pub(crate) fn set_tokens(&self, tokens: Arc<TokenFile>) {
        *self.tokens.write().unwrap_or_else(|e| e.into_inner()) = Some(tokens);
    }

    /// Whether the token file in force gives `token` to `node`.
    pub(crate) fn token_file_allows(&self, node: &str, token: &str) -> bool {
        self.tokens
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .is_some_and(|t| t.verify(node, token))
    }

    pub(crate) fn token_reviewer(&self) -> Option<&TokenReviewer> {
        self.token_review.as_ref()
    }

    /// Whether `ip` may try to register now: an address with too many failures is
    /// refused before its credentials are looked at.
    pub(crate) fn allowed(&self, ip: IpAddr) -> bool {
        self.limiter.allowed(ip, Instant::now())
    }

    /// Records a failed registration from `ip`, charged to the address when it was the
    /// client's fault; says whether to log it (a flood of failures must not fill the
    /// disk).
    pub(crate) fn failed(&self, ip: IpAddr, client_fault: bool) -> Budget {
        let now = Instant::now();
        if client_fault {
            self.limiter.failed(ip, now);
        }
        self.log.take(now)
    }

    /// Decides whether `hello` may register, given the edge's client certificate.
    pub(crate) async fn authenticate(
        &self,
        hello: &Hello,
        client_cert: Option<&CertificateDer<'_>>,
    ) -> Result<Admitted, Reject> {
        let cert_node = client_cert.map(|cert| x509::node_name_from_cert(cert.as_ref()));
        let cert_not_after = client_cert.and_then(|cert| x509::cert_not_after(cert.as_ref()));
        let mut verdict = self.check_hello(hello, cert_node.clone(), false);
        // A certificate of the cloud's own signer counts only while its CSR exists.
        if let (Ok(_), Some(cert)) = (&verdict, client_cert)
            && self.revoked(cert.as_ref())
        {
            verdict = Err(Reject {
                reason: RejectReason::BadCredentials as i32,
                message:
                    "the client certificate was revoked (its CertificateSigningRequest is gone)"
                        .into(),
            });
        }
        // The TLS handshake checked the certificate's validity, but a resumed TLS session
        // carries the certificate of its first handshake without checking it again.
        if let (Ok(_), Some(not_after)) = (&verdict, cert_not_after)
            && not_after <= SystemTime::now()
        {
            verdict = Err(Reject {
                reason: RejectReason::BadCredentials as i32,
                message: "the client certificate expired".into(),
            });
        }
        // A token the token file does not know may still be a service account token.
        if let (Err(r), Some(reviewer)) = (&verdict, &self.token_review)
            && r.reason() == RejectReason::BadCredentials
            && !hello.token.is_empty()
        {
            verdict = match reviewer.review(&hello.token, &hello.node_name).await {
                Ok(()) => self.check_hello(hello, cert_node, true),
                Err(e @ ReviewError::RateLimited) => Err(Reject {
                    reason: RejectReason::RateLimited as i32,
                    message: e.to_string(),
                }),
                Err(e @ ReviewError::WrongNode(_)) => Err(Reject {
                    reason: RejectReason::WrongNode as i32,
                    message: e.to_string(),
                }),
                Err(e) => Err(Reject {
                    reason: RejectReason::BadCredentials as i32,
                    message: e.to_string(),
                }),
            };
        }
        let (by, kind, node) = verdict?;
        // Only once the credential holds: whether a node is an edge is not told to
        // whoever asks.
        if let (Identity::Node, Some(selector)) = (kind, &self.edge_selector)
            && !self.in_table(&node)
        {
            return Err(Reject {
                reason: RejectReason::WrongNode as i32,
                message: KindError::NotAnEdge {
                    node: node.to_string(),
                    selector: selector.clone(),
                }
                .to_string(),
            });
        }
        let credential = match by {
            Proof::TokenFile => Credential::TokenFile(hello.token.clone()),
            Proof::ServiceAccount => Credential::ServiceAccount(hello.token.clone()),
            Proof::Certificate => Credential::Certificate(CertCredential {
                not_after: cert_not_after,
                der: client_cert.map(|c| c.to_vec()).unwrap_or_default(),
                exporter: None,
            }),
        };
        Ok(Admitted {
            credential,
            kind,
            node,
        })
    }

    fn in_table(&self, node: &str) -> bool {
        self.nodes.get().addresses(node).is_some()
    }

    /// `Hello.identity_kind` -> the session's kind. A cluster may not take the name of a
    /// node in the node table: CONNECT and forwards address both by name, so they share
    /// one name space.
    fn identity_kind(&self, hello: &Hello) -> Result<Identity, KindError> {
        match Identity::from_hello(&hello.identity_kind) {
            Some(Identity::Cluster) if self.in_table(&hello.node_name) => {
                Err(KindError::ClusterNamedLikeNode(hello.node_name.clone()))
            }
            Some(kind) => Ok(kind),
            None => Err(KindError::Unknown(hello.identity_kind.clone())),
        }
    }

    /// Decides whether a Hello may register. `cert_node` is `Some(name)` when the edge
    /// presented a client certificate (`name` is `None` if it names no node);
    /// `token_reviewed` when a TokenReview found its token bound to its node.
    fn check_hello(
        &self,
        hello: &Hello,
        cert_node: Option<Option<String>>,
        token_reviewed: bool,
    ) -> Result<(Proof, Identity, NodeName), Reject> {
        let reject = |reason: RejectReason, message: String| Reject {
            reason: reason as i32,
            message,
        };
        if hello.protocol_version != proto::PROTOCOL_VERSION {
            return Err(reject(
                RejectReason::BadVersion,
                format!(
                    "protocol version {} is not supported (this cloud speaks {})",
                    hello.protocol_version,
                    proto::PROTOCOL_VERSION
                ),
            ));
        }
        let node = NodeName::new(hello.node_name.clone())
            .map_err(|problem| reject(RejectReason::WrongNode, problem))?;
        let kind = self
            .identity_kind(hello)
            .map_err(|e| reject(RejectReason::WrongNode, e.to_string()))?;
        // A certificate, when presented, must name this node: a node can only register
        // as itself, whatever token it also sends.
        let cert_ok = match cert_node {
            Some(Some(name)) if name == hello.node_name => true,
            Some(Some(name)) => {
                return Err(reject(
                    RejectReason::WrongNode,
                    format!("client certificate is for node `{name}`"),
                ));
            }
            Some(None) => {
                return Err(reject(
                    RejectReason::WrongNode,
                    "client certificate names no node".into(),
                ));
            }
            None => false,
        };
        let token_ok =
            !hello.token.is_empty() && self.token_file_allows(&hello.node_name, &hello.token);
        if cert_ok {
            Ok((Proof::Certificate, kind, node))
        } else if token_ok {
            Ok((Proof::TokenFile, kind, node))
        } else if token_reviewed {
            Ok((Proof::ServiceAccount, kind, node))
        } else {
            Err(reject(
                RejectReason::BadCredentials,
                "invalid token or missing client certificate".into(),
            ))
        }
    }
}

/// Why a renewed certificate is refused.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Refused {
    /// No CSR of the cloud's signer holds it: revoked, or so new that this replica's
    /// watch has not seen its CSR yet.
    #[error("no CertificateSigningRequest holds the certificate")]
    NotIssued,
    #[error("{0}")]
    Bad(String),
}

impl From<String> for Refused {
    fn from(why: String) -> Self {
        Refused::Bad(why)
    }
}

impl From<&str> for Refused {
    fn from(why: &str) -> Self {
        Refused::Bad(why.to_string())
    }
}

/// Why a Hello's identity kind is refused (a `WrongNode` reject with this text).
#[derive(Debug, thiserror::Error)]
enum KindError {
    #[error("cluster `{0}` has the name of a node in the node table")]
    ClusterNamedLikeNode(String),
    #[error(
        "`{node}` is not an edge node: no Node of that name matches the edge selector `{selector}` (kubernetes.edge_selector); label it to let its edge register"
    )]
    NotAnEdge { node: String, selector: String },
    #[error("unknown identity kind `{0}` (node or cluster)")]
    Unknown(String),
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    use crate::intercept::Programs;

    pub(crate) const SIGNER: &str = "tunnel.io/edge-client";

    /// A cloud's authenticator over a fresh `tunnel certs` CA, signing with `issued`.
    pub(crate) fn authenticator(dir: &std::path::Path, issued: Arc<Issued>) -> Authenticator {
        let mut args = crate::certs::CertsArgs::new(dir);
        args.edges = vec!["edge-2".into()];
        crate::certs::generate(&args).expect("certs");
        let ca = dir.join("ca.crt");
        let tls = crate::io::tls::server_config(
            &dir.join("cloud.crt"),
            &dir.join("cloud.key"),
            Some(&ca),
        )
        .expect("tls");
        let nodes = Arc::new(Nodes::new(
            &[],
            &[],
            Arc::new(Programs::new(None)),
            Default::default(),
            false,
        ));
        let auth = Authenticator::new(tls, None, None, nodes, None, Some(issued));
        auth.set_renewal_verifier(crate::io::tls::client_cert_verifier(&ca).expect("verifier"));
        auth
    }

    /// A certificate of the signer for `node`, and its key.
    pub(crate) fn signed(
        dir: &std::path::Path,
        node: &str,
    ) -> (Vec<u8>, rustls::pki_types::PrivateKeyDer<'static>) {
        let signer = crate::cloud::edges::csr::sign::Signer::load(
            &dir.join("ca.crt"),
            &dir.join("ca.key"),
            SIGNER,
            Duration::from_secs(600),
        )
        .expect("signer");
        let key = rcgen::KeyPair::generate().expect("key");
        let csr = crate::csr::request_params(node)
            .serialize_request(&key)
            .expect("csr");
        let request = rcgen::CertificateSigningRequestParams::from_der(csr.der()).expect("csr");
        let name = NodeName::new(node.into()).expect("name");
        let pem = signer.sign(&name, &request, None).expect("sign");
        use rustls::pki_types::pem::PemObject as _;
        let der = CertificateDer::from_pem_slice(pem.as_bytes()).expect("pem");
        let key = rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der()).expect("key");
        (der.to_vec(), key)
    }

    pub(crate) fn reauth(
        cert: &[u8],
        key: &rustls::pki_types::PrivateKeyDer<'_>,
        exporter: &[u8],
    ) -> proto::Reauth {
        let (scheme, signature) = crate::io::tls::sign_proof(key, exporter).expect("proof");
        proto::Reauth {
            token: String::new(),
            certificate: cert.to_vec(),
            signature,
            signature_scheme: u32::from(scheme),
        }
    }

    #[test]
    fn a_renewal_needs_the_ca_the_node_the_key_and_its_csr() {
        let dir = tempfile::tempdir().expect("dir");
        let issued = Arc::new(Issued::new(SIGNER));
        let auth = authenticator(dir.path(), issued.clone());
        let exporter = [3u8; 32];
        let (cert, key) = signed(dir.path(), "edge-1");
        let good = reauth(&cert, &key, &exporter);

        // Before the CSR watch has listed, nothing counts as revoked.
        assert!(auth.check_renewal("edge-1", Some(&exporter), &good).is_ok());
        issued.set(&std::collections::HashMap::new());
        assert!(matches!(
            auth.check_renewal("edge-1", Some(&exporter), &good),
            Err(Refused::NotIssued)
        ));
        let held =
            crate::cloud::edges::csr::Seen::issued(crate::cloud::edges::csr::fingerprint(&cert));
        issued.set(&[("csr".to_string(), held)].into());
        let not_after = auth
            .check_renewal("edge-1", Some(&exporter), &good)
            .expect("a renewal")
            .expect("an expiry");
        assert!(not_after > SystemTime::now());

        let refused = |node: &str, exporter: Option<&[u8; 32]>, r: &proto::Reauth| match auth
            .check_renewal(node, exporter, r)
        {
            Err(Refused::Bad(why)) => why,
            other => panic!("expected a refusal, got {other:?}"),
        };
        assert!(refused("edge-2", Some(&exporter), &good).contains("not node `edge-2`"));
        assert!(refused("edge-1", None, &good).contains("keying material"));
        let replayed = refused("edge-1", Some(&[4u8; 32]), &good);
        assert!(
            replayed.contains("does not match"),
            "another connection: {replayed}"
        );
        let other = rcgen::KeyPair::generate().expect("key");
        let other = rustls::pki_types::PrivateKeyDer::try_from(other.serialize_der()).expect("key");
        let stolen = reauth(&cert, &other, &exporter);
        assert!(refused("edge-1", Some(&exporter), &stolen).contains("does not match"));
        let foreign = rcgen::KeyPair::generate().expect("key");
        let self_signed = rcgen::CertificateParams::new(vec!["edge-1".to_string()])
            .expect("params")
            .self_signed(&foreign)
            .expect("cert");
        let foreign =
            rustls::pki_types::PrivateKeyDer::try_from(foreign.serialize_der()).expect("key");
        let forged = reauth(self_signed.der(), &foreign, &exporter);
        assert!(refused("edge-1", Some(&exporter), &forged).contains("does not verify"));
    }
}
