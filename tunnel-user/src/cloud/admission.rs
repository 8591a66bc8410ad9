//! Admission of edges connecting in: TLS, the Hello exchange, authentication, then a
//! session in the registry. Every step is bounded by the handshake timeout.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use proto::{Hello, Reject, RejectReason, Welcome};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info, warn};

use super::Cloud;
use super::limit::Budget;
use super::reauth::Credential;
use super::session::{Handshake, HandshakeError, SessionInfo};
use super::token_review::ReviewError;
use crate::cloud::auth;
use crate::config::{Identity, NodeName};
use crate::io::read_ahead::ReadAhead;

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
}

/// Edge-to-cloud requests of one session waiting to be served, and being dialled at once.
const REVERSE_QUEUE: usize = 64;

pub async fn serve(cloud: Arc<Cloud>, listener: TcpListener, shutdown: CancellationToken) {
    loop {
        let (tcp, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(conn) => conn,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    warn!(error = %e, "accepting edge connection failed");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = shutdown.cancelled() => return,
        };
        crate::io::net::tune(&tcp);
        let cloud = cloud.clone();
        let acceptor = cloud.acceptor();
        tokio::spawn(
            async move {
                if let Err(e) = admit(&cloud, tcp, peer, acceptor).await {
                    let now = std::time::Instant::now();
                    if !matches!(e, AdmissionError::RateLimited) {
                        cloud.auth_limiter.failed(peer.ip(), now);
                    }
                    // A flood of failures must not fill the disk: a budget of lines,
                    // and a count of those left out.
                    match cloud.register_log.take(now) {
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
        );
    }
}

async fn admit(
    cloud: &Arc<Cloud>,
    tcp: TcpStream,
    peer: SocketAddr,
    acceptor: TlsAcceptor,
) -> Result<(), AdmissionError> {
    let timeout = cloud.transport.handshake_timeout;
    let (handshake, node, kind, credential) =
        tokio::time::timeout(timeout, handshake(cloud, tcp, peer, acceptor))
            .await
            .map_err(|_| AdmissionError::Timeout)??;
    let id = cloud.next_session_id.fetch_add(1, Ordering::Relaxed);
    // Edge-to-cloud requests queued for dialling; as deep as an edge's default number of
    // waiting connections, and bounded whatever the edge sends.
    let (reverse_tx, reverse_rx) = tokio::sync::mpsc::channel(REVERSE_QUEUE);
    // One fresh token checked at a time; the edge sends one per interval.
    let (fresh_tx, fresh_rx) = tokio::sync::mpsc::channel(1);
    let token = match &credential {
        Credential::TokenFile(token) => Some(token.clone()),
        Credential::ServiceAccount(_) | Credential::Certificate { .. } => None,
    };
    let welcome = Welcome {
        protocol_version: proto::PROTOCOL_VERSION,
        cloud_id: cloud.id.clone(),
        heartbeat_interval_ms: cloud.transport.heartbeat_interval.as_millis() as u32,
    };
    let session = handshake.welcome(
        welcome,
        SessionInfo {
            node: node.clone(),
            kind,
            token,
            fresh_tokens: fresh_tx,
            reverse_requests: reverse_tx,
            id,
            remote: peer,
        },
        &cloud.transport,
    );
    tokio::spawn(super::reverse::serve(
        cloud.clone(),
        session.clone(),
        reverse_rx,
        REVERSE_QUEUE,
    ));
    if let Some(old) = cloud.registry.insert(session.clone()) {
        info!(node = %node, old_session = old.id, "edge re-registered; replacing its previous session");
        old.retire();
    }
    info!(node = %node, kind = kind.as_str(), session = id, "edge registered");
    cloud.on_edges_changed();
    tokio::spawn(super::reauth::watch(
        cloud.clone(),
        session.clone(),
        credential,
        fresh_rx,
        cloud.reauth_interval,
    ));
    let cloud = cloud.clone();
    tokio::spawn(async move {
        session.wait_closed().await;
        if cloud.registry.remove(&session) {
            info!(node = %session.node, session = session.id, "edge disconnected");
            cloud.on_edges_changed();
        }
    });
    Ok(())
}

async fn handshake(
    cloud: &Cloud,
    tcp: TcpStream,
    peer: SocketAddr,
    acceptor: TlsAcceptor,
) -> Result<(Handshake, NodeName, Identity, Credential), AdmissionError> {
    let mut tls = acceptor
        .accept(ReadAhead::new(tcp))
        .await
        .map_err(AdmissionError::Tls)?;
    if tls.get_ref().1.alpn_protocol() == Some(proto::LEGACY_ALPN) {
        reject_legacy(&mut tls).await;
        return Err(AdmissionError::Legacy);
    }
    let client_cert = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|certs| certs.first())
        .map(|cert| cert.clone().into_owned());
    let (handshake, hello) = Handshake::begin(tls, &cloud.transport).await?;
    if !cloud
        .auth_limiter
        .allowed(peer.ip(), std::time::Instant::now())
    {
        // Refused before the credentials are looked at: no guessing at speed.
        let reject = Reject {
            reason: RejectReason::RateLimited as i32,
            message: "too many failed registrations; retry later".into(),
        };
        handshake.reject(reject).await;
        return Err(AdmissionError::RateLimited);
    }
    let cert_node = client_cert
        .as_ref()
        .map(|cert| auth::node_name_from_cert(cert.as_ref()));
    let cert_not_after = client_cert
        .as_ref()
        .and_then(|cert| auth::cert_not_after(cert.as_ref()));
    let mut verdict = check_hello(cloud, &hello, cert_node.clone(), false);
    // The TLS handshake checked the certificate's validity, but a resumed TLS session
    // carries the certificate of its first handshake without checking it again.
    if let (Ok(_), Some(not_after)) = (&verdict, cert_not_after)
        && not_after <= std::time::SystemTime::now()
    {
        verdict = Err(Reject {
            reason: RejectReason::BadCredentials as i32,
            message: "the client certificate expired".into(),
        });
    }
    // A token the token file does not know may still be a service account token.
    if let (Err(r), Some(reviewer)) = (&verdict, &cloud.token_review)
        && r.reason() == RejectReason::BadCredentials
        && !hello.token.is_empty()
    {
        verdict = match reviewer.review(&hello.token, &hello.node_name).await {
            Ok(()) => check_hello(cloud, &hello, cert_node, true),
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
    match verdict {
        Ok((auth, kind, node)) => {
            let credential = match auth {
                AuthBy::Token => Credential::TokenFile(hello.token),
                AuthBy::ServiceAccount => Credential::ServiceAccount(hello.token),
                AuthBy::Certificate => Credential::Certificate {
                    not_after: cert_not_after,
                },
            };
            Ok((handshake, node, kind, credential))
        }
        Err(reject) => {
            let reason = match reject.reason() {
                RejectReason::BadVersion => "bad_version",
                RejectReason::BadCredentials => "bad_credentials",
                RejectReason::WrongNode => "wrong_node",
                RejectReason::RateLimited => "rate_limited",
                RejectReason::Draining => "draining",
                RejectReason::Unspecified => "unspecified",
            };
            cloud
                .metrics
                .registrations_rejected
                .get_or_create(&crate::ops::metrics::ReasonLabel { reason })
                .inc();
            let message = format!("node `{}`: {}", hello.node_name, reject.message);
            // Best effort: the edge learns why; the connection closes either way.
            handshake.reject(reject).await;
            Err(AdmissionError::Rejected(message))
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

/// How an edge proved who it is.
enum AuthBy {
    Certificate,
    /// Only by token: the session ends if the token is revoked.
    Token,
    /// By a service account token, through TokenReview; the token file has no say.
    ServiceAccount,
}

/// `Hello.identity_kind` -> the session's kind. A cluster may not take the name of a
/// node in the node table: CONNECT and forwards address both by name, so they share one
/// name space.
fn identity_kind(cloud: &Cloud, hello: &Hello) -> Result<Identity, KindError> {
    match Identity::from_hello(&hello.identity_kind) {
        Some(Identity::Cluster) if cloud.nodes().addresses(&hello.node_name).is_some() => {
            Err(KindError::ClusterNamedLikeNode(hello.node_name.clone()))
        }
        Some(kind) => Ok(kind),
        None => Err(KindError::Unknown(hello.identity_kind.clone())),
    }
}

/// Why a Hello's identity kind is refused (a `WrongNode` reject with this text).
#[derive(Debug, thiserror::Error)]
enum KindError {
    #[error("cluster `{0}` has the name of a node in the node table")]
    ClusterNamedLikeNode(String),
    #[error("unknown identity kind `{0}` (node or cluster)")]
    Unknown(String),
}

/// Decides whether a Hello may register. `cert_node` is `Some(name)` when the edge
/// presented a client certificate (`name` is `None` if it names no node);
/// `token_reviewed` when a TokenReview found its token bound to its node.
fn check_hello(
    cloud: &Cloud,
    hello: &Hello,
    cert_node: Option<Option<String>>,
    token_reviewed: bool,
) -> Result<(AuthBy, Identity, NodeName), Reject> {
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
    let kind =
        identity_kind(cloud, hello).map_err(|e| reject(RejectReason::WrongNode, e.to_string()))?;
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
    let token_ok = !hello.token.is_empty()
        && cloud
            .tokens()
            .is_some_and(|t| t.verify(&hello.node_name, &hello.token));
    if cert_ok {
        Ok((AuthBy::Certificate, kind, node))
    } else if token_ok {
        Ok((AuthBy::Token, kind, node))
    } else if token_reviewed {
        Ok((AuthBy::ServiceAccount, kind, node))
    } else {
        Err(reject(
            RejectReason::BadCredentials,
            "invalid token or missing client certificate".into(),
        ))
    }
}
