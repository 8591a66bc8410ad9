//! A client certificate from the cluster, an edge's (`[csr]`) or a relay's
//! (`[relay.csr]`): the key is made here and never leaves the node; a
//! `certificates.k8s.io/v1` CertificateSigningRequest (CN = the node name for an edge,
//! `system:tunnel-relay:<node>` for a relay; client auth only, the project's signer
//! name, the lifetime asked for) is filed with the Kubernetes credentials the process
//! runs with, and the certificate the cloud's signer writes into it is kept beside the
//! key and renewed at 60-85% of its lifetime.
//!
//! Which credentials file the CSR: in a pod, its service account token (the DaemonSets
//! mount one bound to the pod); KUBECONFIG otherwise. The cloud approves a CSR when
//! that requester may speak for the node: for an edge, the node itself
//! (`system:node:<name>`) or a pod of the edges' service account running on that node;
//! for a relay, a pod of the relays' service account running on that node. The API
//! server records the pod in the CSR (`authentication.kubernetes.io/pod-name`/`pod-uid`)
//! and the cloud looks it up.
//!
//! On disk (`dir`, mode 0700, files 0600): `client-current.pem`, the certificate
//! and its key in one file written by rename, so a reader never sees one without the
//! other; `client-pending.key`, the key of a CSR in flight. A CSR's name follows from
//! its key, so a process restarted while waiting finds its CSR again instead of filing
//! another; one restarted with a valid certificate files none.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::Context as _;
use k8s_openapi::ByteString;
use k8s_openapi::api::certificates::v1::{
    CertificateSigningRequest, CertificateSigningRequestSpec,
};
use kube::Api;
use kube::api::{ObjectMeta, PostParams};
use prometheus_client::metrics::counter::Counter;
use rand::Rng as _;
use rcgen::PublicKeyData as _;
use rustls_pki_types::pem::PemObject as _;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use sha2::{Digest as _, Sha256};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

const CURRENT: &str = "client-current.pem";
const PENDING_KEY: &str = "client-pending.key";
/// How long one wait for the CSR's answer lasts before it is logged and resumed.
const WAIT_ROUND: Duration = Duration::from_secs(60);
/// Times a CSR deleted while pending is filed again before giving up.
const MAX_REFILES: u32 = 5;
/// Where in a certificate's lifetime it is renewed, at random. A fleet whose
/// certificates were issued together (a bootstrap, a signer back after an outage)
/// renews spread over a quarter of the lifetime; the mean, 72.5%, sets the signers'
/// load (100,000 edges on one-hour certificates: 38 CSRs a second), and the last 15%
/// (9 minutes of an hour) is the margin for a signer with a backlog.
const RENEW_WITHIN: std::ops::Range<f64> = 0.60..0.85;
/// After a failed renewal, the next attempt: 15-45 s, so a fleet refused together
/// does not come back together.
const RENEW_RETRY: Duration = Duration::from_secs(30);

/// Whose certificate this is: what its CN says and what its CSRs are called.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// An edge: CN = the node name.
    Edge,
    /// A relay on a worker: CN = `system:tunnel-relay:<node>` (`io::x509::RELAY_CN_PREFIX`).
    Relay,
}

impl Role {
    /// The CN a certificate of this role for `node` carries.
    pub(crate) fn common_name(self, node: &str) -> String {
        match self {
            Role::Edge => node.to_string(),
            Role::Relay => format!("{}{node}", crate::io::x509::RELAY_CN_PREFIX),
        }
    }

    /// The node a certificate (DER) of this role names, if it is one of this role.
    fn node_of(self, der: &[u8]) -> Option<String> {
        match self {
            Role::Edge => crate::io::x509::node_name_from_cert(der),
            Role::Relay => crate::io::x509::relay_node_from_cert(der),
        }
    }

    fn csr_prefix(self) -> &'static str {
        match self {
            Role::Edge => "tunnel-edge",
            Role::Relay => "tunnel-relay",
        }
    }
}

/// What to ask for, and where to keep it.
pub(crate) struct Params {
    pub(crate) role: Role,
    pub(crate) node: String,
    /// Where the key and certificate are kept (made 0700 here).
    pub(crate) dir: PathBuf,
    pub(crate) signer_name: String,
    /// The lifetime asked for (expirationSeconds).
    pub(crate) lifetime: Duration,
}

/// A client certificate (with its chain) and its key.
pub(crate) struct ClientCert {
    pub(crate) certs: Vec<CertificateDer<'static>>,
    pub(crate) key: PrivateKeyDer<'static>,
    pub(crate) not_before: SystemTime,
    pub(crate) not_after: SystemTime,
}

impl ClientCert {
    /// Parses `pem` (certificates and a key); an error unless the key is the leaf's,
    /// the leaf names `node` as a certificate of `role` and is still valid.
    fn parse(pem: &[u8], role: Role, node: &str) -> Result<Self, String> {
        let certs = CertificateDer::pem_slice_iter(pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?;
        let leaf = certs.first().ok_or("no certificate")?;
        let key = PrivateKeyDer::from_pem_slice(pem).map_err(|e| format!("no key: {e}"))?;
        let key_pair = rcgen::KeyPair::try_from(&key).map_err(|e| e.to_string())?;
        let (_, parsed) =
            x509_parser::parse_x509_certificate(leaf.as_ref()).map_err(|e| e.to_string())?;
        if parsed.public_key().raw != key_pair.subject_public_key_info().as_slice() {
            return Err("the key is not the certificate's".into());
        }
        if role.node_of(leaf.as_ref()).as_deref() != Some(node) {
            let cn = role.common_name(node);
            return Err(format!("the certificate is not for `{cn}`"));
        }
        let at = |t: x509_parser::time::ASN1Time| {
            SystemTime::UNIX_EPOCH + Duration::from_secs(u64::try_from(t.timestamp()).unwrap_or(0))
        };
        let (not_before, not_after) = (
            at(parsed.validity().not_before),
            at(parsed.validity().not_after),
        );
        if not_after <= SystemTime::now() {
            return Err("the certificate expired".into());
        }
        Ok(Self {
            certs,
            key,
            not_before,
            not_after,
        })
    }

    /// The chain and key as a TLS identity (a relay's, for its links to the replicas).
    pub(crate) fn identity(&self) -> crate::io::tls::Identity {
        crate::io::tls::Identity {
            certs: self.certs.clone(),
            key: self.key.clone_key(),
            source: "the client certificate from the cluster".into(),
        }
    }

    /// The leaf certificate (DER).
    pub(crate) fn leaf(&self) -> &[u8] {
        self.certs.first().map(|c| c.as_ref()).unwrap_or_default()
    }

    /// When to renew: at a random point of `RENEW_WITHIN` of the lifetime.
    fn renew_at(&self) -> SystemTime {
        let lifetime = self
            .not_after
            .duration_since(self.not_before)
            .unwrap_or_default();
        self.not_before + lifetime.mul_f64(rand::rng().random_range(RENEW_WITHIN))
    }
}

/// Files the CSRs and keeps the files.
struct Requests {
    api: Api<CertificateSigningRequest>,
    params: Params,
}

/// Gets the certificate to start with (the valid one on disk, or a new one from the
/// cluster), and renews it in a task of its own until `shutdown`, counting the renewals
/// that failed in `renewals_failed`. The receiver always holds the current certificate;
/// None when `shutdown` came first.
pub(crate) async fn start(
    params: Params,
    renewals_failed: Counter,
    shutdown: &CancellationToken,
) -> anyhow::Result<Option<watch::Receiver<Arc<ClientCert>>>> {
    let client = kube::Client::try_default().await.context(
        "csr: cannot set up the Kubernetes client (in-cluster credentials or KUBECONFIG)",
    )?;
    prepare_dir(&params.dir)?;
    let requests = Requests {
        api: Api::all(client),
        params,
    };
    let current = match requests.on_disk() {
        Some(cert) => cert,
        None => {
            let p = &requests.params;
            info!(cn = %p.role.common_name(&p.node), signer = %p.signer_name, "no valid client certificate on disk; asking the cluster for one");
            tokio::select! {
                cert = requests.obtain() => cert?,
                () = shutdown.cancelled() => return Ok(None),
            }
        }
    };
    let (tx, rx) = watch::channel(Arc::new(current));
    tokio::spawn(requests.renew(tx, renewals_failed, shutdown.clone()));
    Ok(Some(rx))
}

fn prepare_dir(dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::create_dir_all(dir)
        .with_context(|| format!("csr dir {}: cannot create", dir.display()))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("csr dir {}: cannot make it private (0700)", dir.display()))
}

#[derive(Debug, thiserror::Error)]
enum ObtainError {
    #[error("CSR {name} was denied: {message}")]
    Denied { name: String, message: String },
    #[error("CSR {0} kept being deleted before it was answered")]
    Deleted(String),
    #[error("{0}")]
    Api(#[from] kube::Error),
    #[error("{0}")]
    Files(String),
}

impl Requests {
    /// The certificate on disk, if it is whole, this node's and valid.
    fn on_disk(&self) -> Option<ClientCert> {
        let path = self.params.dir.join(CURRENT);
        let pem = match std::fs::read(&path) {
            Ok(pem) => pem,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
            Err(e) => {
                warn!(file = %path.display(), error = %e, "cannot read the client certificate; asking for a new one");
                return None;
            }
        };
        match ClientCert::parse(&pem, self.params.role, &self.params.node) {
            Ok(cert) => {
                info!(file = %path.display(), valid_until = ?cert.not_after, "reusing the client certificate on disk");
                Some(cert)
            }
            Err(why) => {
                warn!(file = %path.display(), %why, "not using the client certificate on disk; asking for a new one");
                None
            }
        }
    }

    /// The key of the CSR in flight: the one on disk (a restart while waiting), or new.
    fn pending_key(&self) -> Result<rcgen::KeyPair, ObtainError> {
        let path = self.params.dir.join(PENDING_KEY);
        if let Ok(pem) = std::fs::read_to_string(&path)
            && let Ok(key) = rcgen::KeyPair::from_pem(&pem)
        {
            return Ok(key);
        }
        let key = rcgen::KeyPair::generate().map_err(|e| ObtainError::Files(e.to_string()))?;
        crate::certs::write_file(&path, key.serialize_pem().as_bytes(), true)
            .map_err(|e| ObtainError::Files(e.to_string()))?;
        Ok(key)
    }

    /// Files a CSR (or finds the one filed before a restart) and waits for its answer;
    /// the issued certificate is written to disk before it is returned.
    async fn obtain(&self) -> Result<ClientCert, ObtainError> {
        let key = self.pending_key()?;
        let p = &self.params;
        let name = csr_name(p.role, &p.node, &key);
        for _ in 0..MAX_REFILES {
            self.file(&name, &key).await?;
            if let Some(cert_pem) = self.wait(&name).await? {
                let mut pem = cert_pem;
                pem.push_str(&key.serialize_pem());
                let path = p.dir.join(CURRENT);
                crate::certs::write_file(&path, pem.as_bytes(), true)
                    .map_err(|e| ObtainError::Files(e.to_string()))?;
                let _ = std::fs::remove_file(p.dir.join(PENDING_KEY));
                let cert = ClientCert::parse(pem.as_bytes(), p.role, &p.node).map_err(|why| {
                    ObtainError::Files(format!(
                        "CSR {name}: the issued certificate is unusable: {why}"
                    ))
                })?;
                info!(csr = %name, valid_until = ?cert.not_after, "client certificate issued");
                return Ok(cert);
            }
            warn!(csr = %name, "the CSR was deleted before it was answered; filing it again");
        }
        Err(ObtainError::Deleted(name))
    }

    async fn file(&self, name: &str, key: &rcgen::KeyPair) -> Result<(), ObtainError> {
        let p = &self.params;
        let request = request_params(&p.role.common_name(&p.node))
            .serialize_request(key)
            .and_then(|r| r.pem())
            .map_err(|e| ObtainError::Files(e.to_string()))?;
        let csr = CertificateSigningRequest {
            metadata: ObjectMeta {
                name: Some(name.to_string()),
                ..Default::default()
            },
            spec: CertificateSigningRequestSpec {
                request: ByteString(request.into_bytes()),
                signer_name: p.signer_name.clone(),
                usages: Some(vec!["digital signature".into(), "client auth".into()]),
                expiration_seconds: i32::try_from(p.lifetime.as_secs()).ok(),
                ..Default::default()
            },
            status: None,
        };
        match self.api.create(&PostParams::default(), &csr).await {
            Ok(_) => {
                info!(csr = %name, signer = %p.signer_name, "CertificateSigningRequest filed")
            }
            Err(kube::Error::Api(s)) if s.code == 409 => {
                info!(csr = %name, "CertificateSigningRequest filed before; waiting for its answer")
            }
            Err(e) => return Err(e.into()),
        }
        Ok(())
    }

    /// Waits for the CSR's certificate (PEM); None when the CSR was deleted meanwhile.
    async fn wait(&self, name: &str) -> Result<Option<String>, ObtainError> {
        let answered =
            |csr: Option<&CertificateSigningRequest>| csr.is_none_or(|c| answer(c).is_some());
        loop {
            let found = kube::runtime::wait::await_condition(self.api.clone(), name, answered);
            match tokio::time::timeout(WAIT_ROUND, found).await {
                Err(_) => info!(csr = %name, "still waiting for the CSR to be approved and signed"),
                Ok(Err(e)) => {
                    warn!(csr = %name, error = %e, "cannot watch the CSR; retrying");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                Ok(Ok(None)) => return Ok(None),
                Ok(Ok(Some(csr))) => match answer(&csr) {
                    Some(Ok(pem)) => return Ok(Some(pem)),
                    Some(Err(message)) => {
                        // This key's CSR is answered for good: the next one gets a new key.
                        let _ = std::fs::remove_file(self.params.dir.join(PENDING_KEY));
                        return Err(ObtainError::Denied {
                            name: name.to_string(),
                            message,
                        });
                    }
                    None => return Ok(None),
                },
            }
        }
    }

    /// Renews the certificate within `RENEW_WITHIN` of its lifetime, until `shutdown`; a failed
    /// renewal is retried while the current certificate still serves.
    async fn renew(
        self,
        tx: watch::Sender<Arc<ClientCert>>,
        failed: Counter,
        shutdown: CancellationToken,
    ) {
        loop {
            let at = tx.borrow().renew_at();
            let wait = at.duration_since(SystemTime::now()).unwrap_or_default();
            info!(renew_in = ?wait, valid_until = ?tx.borrow().not_after, "client certificate in use");
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                () = shutdown.cancelled() => return,
            }
            loop {
                let renewed = tokio::select! {
                    r = self.obtain() => r,
                    () = shutdown.cancelled() => return,
                };
                match renewed {
                    Ok(cert) => {
                        info!(
                            "client certificate renewed; new sessions use it and the open one carries on with it"
                        );
                        tx.send_replace(Arc::new(cert));
                        break;
                    }
                    Err(e) => {
                        failed.inc();
                        let retry = RENEW_RETRY.mul_f64(rand::rng().random_range(0.5..1.5));
                        error!(error = %e, retry_in = ?retry, "cannot renew the client certificate; the current one serves until it expires");
                        tokio::select! {
                            () = tokio::time::sleep(retry) => {}
                            () = shutdown.cancelled() => return,
                        }
                    }
                }
            }
        }
    }
}

/// The CSR's outcome: its certificate, or why it was denied or failed; None while
/// pending.
fn answer(csr: &CertificateSigningRequest) -> Option<Result<String, String>> {
    let status = csr.status.as_ref()?;
    for c in status.conditions.iter().flatten() {
        if (c.type_ == "Denied" || c.type_ == "Failed") && c.status == "True" {
            let reason = c.reason.clone().unwrap_or_default();
            let message = c.message.clone().unwrap_or_default();
            return Some(Err(format!("{} ({reason}): {message}", c.type_)));
        }
    }
    let pem = status.certificate.as_ref()?;
    Some(String::from_utf8(pem.0.clone()).map_err(|_| "the certificate is not PEM text".into()))
}

/// What is asked to be certified: the CN (`Role::common_name`) as the subject and
/// nothing else (usages and lifetime are fields of the CSR object).
pub(crate) fn request_params(common_name: &str) -> rcgen::CertificateParams {
    let mut params = rcgen::CertificateParams::default();
    params.distinguished_name = rcgen::DistinguishedName::new();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, common_name);
    params
}

/// `tunnel-edge-<node>-<hash of the key>` (`tunnel-relay-` for a relay): the same key
/// always has the same CSR.
fn csr_name(role: Role, node: &str, key: &rcgen::KeyPair) -> String {
    let digest = Sha256::digest(key.subject_public_key_info());
    let hash: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    // Object names are at most 253 characters.
    let node = node[..node.len().min(200)].trim_end_matches(['.', '-']);
    format!("{}-{node}-{hash}", role.csr_prefix())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn issued(node: &str, valid: Duration) -> (String, rcgen::KeyPair) {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params = request_params(node);
        let now = SystemTime::now();
        params.not_before = (now - Duration::from_secs(10)).into();
        params.not_after = (now + valid).into();
        let cert = params.self_signed(&key).expect("cert");
        (cert.pem(), key)
    }

    #[test]
    fn a_relay_asks_for_and_keeps_only_its_relay_name() {
        assert_eq!(
            Role::Relay.common_name("worker-1"),
            "system:tunnel-relay:worker-1"
        );
        let (cert, key) = issued(
            &Role::Relay.common_name("worker-1"),
            Duration::from_secs(100),
        );
        let pem = format!("{cert}{}", key.serialize_pem());
        ClientCert::parse(pem.as_bytes(), Role::Relay, "worker-1").expect("valid");
        for (role, node) in [(Role::Relay, "worker-2"), (Role::Edge, "worker-1")] {
            assert!(
                ClientCert::parse(pem.as_bytes(), role, node).is_err(),
                "{role:?} {node}"
            );
        }
    }

    #[test]
    fn a_stored_certificate_is_used_only_whole_and_for_this_node() {
        let (cert, key) = issued("edge-1", Duration::from_secs(100));
        let pem = format!("{cert}{}", key.serialize_pem());
        ClientCert::parse(pem.as_bytes(), Role::Edge, "edge-1").expect("valid");
        let e = ClientCert::parse(pem.as_bytes(), Role::Edge, "edge-2")
            .err()
            .expect("other node");
        assert!(e.contains("not for `edge-2`"), "{e}");
        let e = ClientCert::parse(pem.as_bytes(), Role::Relay, "edge-1")
            .err()
            .expect("an edge's certificate is no relay's");
        assert!(e.contains("not for `system:tunnel-relay:edge-1`"), "{e}");
        let other = rcgen::KeyPair::generate().expect("key");
        let mixed = format!("{cert}{}", other.serialize_pem());
        let e = ClientCert::parse(mixed.as_bytes(), Role::Edge, "edge-1")
            .err()
            .expect("other key");
        assert!(e.contains("not the certificate's"), "{e}");
        assert!(
            ClientCert::parse(cert.as_bytes(), Role::Edge, "edge-1").is_err(),
            "no key"
        );
    }

    /// Renewals of certificates issued together spread over 60-85% of the lifetime.
    #[test]
    fn renewals_spread_over_a_quarter_of_the_lifetime() {
        let (cert, key) = issued("edge-1", Duration::from_secs(990));
        let pem = format!("{cert}{}", key.serialize_pem());
        let parsed = ClientCert::parse(pem.as_bytes(), Role::Edge, "edge-1").expect("valid");
        // 1,000 s from notBefore (10 s back) to notAfter: a second is a tenth of a percent.
        let at: Vec<u64> = (0..2000)
            .map(|_| {
                let after = parsed.renew_at().duration_since(parsed.not_before);
                after.expect("after start").as_secs()
            })
            .collect();
        let (first, last) = (at.iter().min().copied(), at.iter().max().copied());
        assert!(
            at.iter().all(|s| (600..850).contains(s)),
            "{first:?}..{last:?}"
        );
        assert!(
            first < Some(620) && last > Some(830),
            "spread over 60-85%: {first:?}..{last:?}"
        );
    }

    #[test]
    fn csr_names_follow_the_key() {
        let key = rcgen::KeyPair::generate().expect("key");
        let name = csr_name(Role::Edge, "edge-1", &key);
        assert_eq!(name, csr_name(Role::Edge, "edge-1", &key));
        assert!(
            name.starts_with("tunnel-edge-edge-1-") && name.len() == 35,
            "{name}"
        );
        let other = rcgen::KeyPair::generate().expect("key");
        assert_ne!(name, csr_name(Role::Edge, "edge-1", &other));
        let long = format!("{}.{}", "a".repeat(199), "b".repeat(40));
        assert!(csr_name(Role::Edge, &long, &key).len() <= 253);
        let relay = csr_name(Role::Relay, "worker-1", &key);
        assert!(relay.starts_with("tunnel-relay-worker-1-"), "{relay}");
    }
}
