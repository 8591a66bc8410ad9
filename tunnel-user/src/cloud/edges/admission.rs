//! Admission of edges connecting in: TLS, the Hello exchange, authentication (by the
//! `Authenticator`), then a session in the `Registry`, with its edge-to-cloud requests
//! (`reverse`) and its credential's watch (`reauth`). Every step is bounded by the
//! handshake timeout.
//!
//! Only a client's fault counts against its source address (`limit::AuthLimiter`): a
//! credential refused, a Hello or TLS record that is garbage. A handshake that timed out
//! or a connection the edge dropped may be the replica's own load in a storm, and an
//! address shared by a NAT'd site must not be locked out for it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::future::BoxFuture;
use proto::{OpenReverse, Reject, RejectReason, Welcome};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tracing::{Instrument, info, warn};

use super::authenticator::{Admitted, Authenticator, Credential};
use super::limit::{Budget, LogBudget};
use super::registry::{Refused, Registry, Slot};
use super::session::{EdgeSession, Handshake, HandshakeError, SessionInfo};
use crate::addr::NodeName;
use crate::config::{Identity, TransportConfig};
use crate::io::accept::{self, Incoming};
use crate::io::read_ahead::ReadAhead;
use crate::ops::metrics::CloudMetrics;

#[derive(Debug, thiserror::Error)]
enum AdmissionError {
    #[error("TLS handshake failed: {0}")]
    Tls(std::io::Error),
    #[error("handshake timed out")]
    Timeout,
    #[error(transparent)]
    Handshake(#[from] HandshakeError),
    #[error("rejected: {0}")]
    Rejected(String),
    #[error(
        "the edge speaks protocol 1 (before gRPC); this cloud speaks protocol {}: upgrade the edge",
        proto::PROTOCOL_VERSION
    )]
    Legacy,
    #[error("rate limited: too many failed registrations from this address")]
    RateLimited,
    /// The edge proved who it is, but this replica has no room for it: its node has as
    /// many sessions as it may, or the replica is at its edge cap (the edge goes to
    /// another). Not a failure of the address.
    #[error("node `{node}`: {refused}")]
    NoRoom { node: NodeName, refused: Refused },
}

impl AdmissionError {
    /// Whether the client is to blame, so that its source address is charged: not for
    /// what the replica's load may have caused (a timeout, a connection the edge gave
    /// up on while it waited) nor for refusals that are not failures.
    fn client_fault(&self) -> bool {
        match self {
            AdmissionError::Tls(e) => e.kind() == std::io::ErrorKind::InvalidData,
            AdmissionError::Handshake(HandshakeError::Http2(e)) => !e.is_io(),
            AdmissionError::Handshake(_) | AdmissionError::Rejected(_) | AdmissionError::Legacy => {
                true
            }
            AdmissionError::Timeout
            | AdmissionError::RateLimited
            | AdmissionError::NoRoom { .. } => false,
        }
    }
}

/// Edge-to-cloud requests of one session waiting to be served, and being dialled at once.
const REVERSE_QUEUE: usize = 64;

/// Serves the edge-to-cloud requests of one session until it ends, at most `in_flight`
/// at once: `conn::reverse::ReverseDialer`, which dials on the connection path, a floor
/// above the sessions.
pub(crate) trait ServeReverse: Send + Sync {
    fn serve(
        self: Arc<Self>,
        session: Arc<EdgeSession>,
        requests: tokio::sync::mpsc::Receiver<Box<OpenReverse>>,
        in_flight: usize,
    ) -> BoxFuture<'static, ()>;
}

/// Admits edges into the registry: what an accepted edge connection needs.
pub(crate) struct Admission {
    auth: Arc<Authenticator>,
    registry: Arc<Registry>,
    /// Serves each session's edge-to-cloud requests.
    reverse: Arc<dyn ServeReverse>,
    metrics: Arc<CloudMetrics>,
    /// This replica's name, told to every edge.
    cloud_id: String,
    transport: TransportConfig,
    /// How often live sessions' service account tokens are reviewed again.
    reauth_interval: Duration,
    next_session_id: AtomicU64,
    /// Log lines for registrations refused at the cap: a storm of them says so once
    /// in a while.
    full_log: LogBudget,
}

impl Admission {
    pub(crate) fn new(
        auth: Arc<Authenticator>,
        registry: Arc<Registry>,
        reverse: Arc<dyn ServeReverse>,
        metrics: Arc<CloudMetrics>,
        cloud_id: String,
        transport: TransportConfig,
        reauth_interval: Duration,
    ) -> Self {
        Self {
            auth,
            registry,
            reverse,
            metrics,
            cloud_id,
            transport,
            reauth_interval,
            next_session_id: AtomicU64::new(1),
            full_log: LogBudget::new(1, Duration::from_secs(60)),
        }
    }
}

pub(crate) async fn serve(admission: Arc<Admission>, mut incoming: Incoming<TcpListener>) {
    while let Some((tcp, peer, permit)) = incoming.next().await {
        crate::io::net::tune(&tcp);
        let admission = admission.clone();
        let acceptor = admission.auth.acceptor();
        tokio::spawn(accept::hold(
            permit,
            async move {
                if let Err(e) = admit(&admission, tcp, peer, acceptor).await {
                    if let AdmissionError::NoRoom { refused, .. } = &e {
                        match refused {
                            Refused::TooManySessions { log: true, .. } => warn!(error = %e, "edge registration refused (counted in tunnel_registrations_rejected_total{{reason=\"too_many_sessions\"}}; logged once a minute per node)"),
                            Refused::Full { .. } => {
                                if let Budget::Log(n) = admission.full_log.take(std::time::Instant::now()) {
                                    warn!(error = %e, not_logged = n, "edge registration refused: this replica is full, the edge goes to another replica (counted in tunnel_registrations_rejected_total{{reason=\"replica_full\"}}; logged once a minute)");
                                }
                            }
                            _ => {}
                        }
                        return;
                    }
                    // A flood of failures must not fill the disk: a budget of lines,
                    // and a count of those left out.
                    match admission.auth.failed(peer.ip(), e.client_fault()) {
                        Budget::Log(0) => warn!(error = %e, "edge registration failed"),
                        Budget::Log(n) => warn!(error = %e, not_logged = n, "edge registration failed (and {n} more not logged)"),
                        Budget::FirstLeftOut => {
                            warn!("many edge registrations are failing; further registration failures are counted, not logged, until the next window")
                        }
                        Budget::Quiet => {}
                    }
                }
            }
            .instrument(tracing::info_span!("register", peer = %peer)),
        ));
    }
}

async fn admit(
    admission: &Admission,
    tcp: TcpStream,
    peer: SocketAddr,
    acceptor: TlsAcceptor,
) -> Result<(), AdmissionError> {
    let transport = &admission.transport;
    let (handshake, node, kind, credential, slot) = tokio::time::timeout(
        transport.handshake_timeout,
        handshake(admission, tcp, peer, acceptor),
    )
    .await
    .map_err(|_| AdmissionError::Timeout)??;
    let id = admission.next_session_id.fetch_add(1, Ordering::Relaxed);
    // Edge-to-cloud requests queued for dialling; as deep as an edge's default number of
    // waiting connections, and bounded whatever the edge sends. Both channels carry
    // their messages boxed: a channel allocates a block of 32 message slots, whatever
    // its bound, when it is made, and the session keeps them for its whole life.
    let (reverse_tx, reverse_rx) = tokio::sync::mpsc::channel(REVERSE_QUEUE);
    // One fresh token checked at a time; the edge sends one per interval.
    let (fresh_tx, fresh_rx) = tokio::sync::mpsc::channel(1);
    let token = match &credential {
        Credential::TokenFile(token) => Some(token.clone()),
        Credential::ServiceAccount(_) | Credential::Certificate(_) => None,
    };
    let welcome = Welcome {
        protocol_version: proto::PROTOCOL_VERSION,
        cloud_id: admission.cloud_id.clone(),
        heartbeat_interval_ms: transport.heartbeat_interval.as_millis() as u32,
    };
    let session = handshake.welcome(
        welcome,
        SessionInfo {
            node: node.clone(),
            kind,
            proof: credential.proof(),
            token,
            fresh_tokens: fresh_tx,
            reverse_requests: reverse_tx,
            id,
            remote: peer,
        },
        transport,
    );
    // The other replicas learn of every change to the registry.
    match admission.registry.insert(session.clone(), slot) {
        Ok(Some(old)) => {
            info!(node = %node, old_session = old.id, "edge re-registered; replacing its previous session");
            old.retire();
        }
        Ok(None) => {}
        Err(Refused::Held(held)) => {
            // A stronger session of the node came in during this one's handshake.
            session.close();
            return Err(AdmissionError::Rejected(format!("node `{node}`: {held}")));
        }
        Err(refused) => {
            // Another registration of the node, or the edges in flight, came in during
            // this one's handshake.
            session.close();
            admission.metrics.registration_rejected(refused.label());
            return Err(AdmissionError::NoRoom { node, refused });
        }
    }
    tokio::spawn(
        admission
            .reverse
            .clone()
            .serve(session.clone(), reverse_rx, REVERSE_QUEUE),
    );
    info!(node = %node, kind = kind.as_str(), session = id, "edge registered");
    tokio::spawn(super::reauth::watch(
        admission.auth.clone(),
        admission.metrics.clone(),
        session.clone(),
        credential,
        fresh_rx,
        admission.reauth_interval,
    ));
    let registry = admission.registry.clone();
    tokio::spawn(async move {
        session.wait_closed().await;
        if registry.remove(&session) {
            info!(node = %session.node, session = session.id, "edge disconnected");
        }
    });
    Ok(())
}

async fn handshake(
    admission: &Admission,
    tcp: TcpStream,
    peer: SocketAddr,
    acceptor: TlsAcceptor,
) -> Result<(Handshake, NodeName, Identity, Credential, Slot), AdmissionError> {
    let mut tls = acceptor
        .accept(ReadAhead::new(tcp))
        .await
        .map_err(AdmissionError::Tls)?;
    crate::io::tls::tune_tunnel(tls.get_mut().1);
    if tls.get_ref().1.alpn_protocol() == Some(proto::LEGACY_ALPN) {
        reject_legacy(&mut tls).await;
        return Err(AdmissionError::Legacy);
    }
    let exporter = crate::io::tls::renewal_exporter(&**tls.get_ref().1);
    let client_cert = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|certs| certs.first())
        .map(|cert| cert.clone().into_owned());
    let (handshake, hello) = Handshake::begin(tls, &admission.transport).await?;
    if !admission.auth.allowed(peer.ip()) {
        // Refused before the credentials are looked at: no guessing at speed.
        let reject = Reject {
            reason: RejectReason::RateLimited as i32,
            message: "too many failed registrations; retry later".into(),
        };
        handshake.reject(reject).await;
        return Err(AdmissionError::RateLimited);
    }
    let mut refusal = None;
    let verdict = admission
        .auth
        .authenticate(&hello, client_cert.as_ref())
        .await
        .and_then(|admitted| {
            let proof = admitted.credential.proof();
            match admission.registry.may_take(&admitted.node, proof) {
                Ok(slot) => Ok((admitted, slot)),
                Err(Refused::Held(held)) => Err(Reject {
                    reason: RejectReason::WrongNode as i32,
                    message: held.to_string(),
                }),
                Err(refused) => {
                    let reject = Reject {
                        reason: refused.reject_reason() as i32,
                        message: refused.to_string(),
                    };
                    refusal = Some(AdmissionError::NoRoom {
                        node: admitted.node,
                        refused,
                    });
                    Err(reject)
                }
            }
        });
    match verdict {
        Ok((
            Admitted {
                mut credential,
                kind,
                node,
            },
            slot,
        )) => {
            if let Credential::Certificate(c) = &mut credential {
                c.exporter = exporter;
            }
            Ok((handshake, node, kind, credential, slot))
        }
        Err(reject) => {
            let reason = match reject.reason() {
                RejectReason::BadVersion => "bad_version",
                RejectReason::BadCredentials => "bad_credentials",
                RejectReason::WrongNode => "wrong_node",
                RejectReason::RateLimited => "rate_limited",
                RejectReason::Draining => "draining",
                RejectReason::TooManySessions => "too_many_sessions",
                RejectReason::ReplicaFull => "replica_full",
                RejectReason::Unspecified => "unspecified",
            };
            admission.metrics.registration_rejected(reason);
            let message = format!("node `{}`: {}", hello.node_name, reject.message);
            // Best effort: the edge learns why; the connection closes either way.
            handshake.reject(reject).await;
            Err(refusal.unwrap_or(AdmissionError::Rejected(message)))
        }
    }
}

/// Answers an edge of protocol 1 the way it reads an answer (a 4-byte length, then a
/// `HelloReply`): a `Reject` that tells its operator what to do.
async fn reject_legacy<T: tokio::io::AsyncWrite + Unpin>(tls: &mut T) {
    use tokio::io::AsyncWriteExt;
    let reply = proto::HelloReply {
        result: Some(proto::hello_reply::Result::Reject(Reject {
            reason: RejectReason::BadVersion as i32,
            message: AdmissionError::Legacy.to_string(),
        })),
    };
    let body = prost::Message::encode_to_vec(&reply);
    let mut frame = (body.len() as u32).to_be_bytes().to_vec();
    frame.extend(body);
    // Best effort: the connection closes either way.
    let _ = tls.write_all(&frame).await;
    let _ = tls.flush().await;
}
