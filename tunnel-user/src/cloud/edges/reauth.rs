//! Sessions stay authorised while they live, not only when they start: a client
//! certificate ends its session when it expires; a service account token is reviewed
//! again every `tunnel.reauth_interval` (through the same cached, rate-limited
//! TokenReview as at registration), and whenever the edge sends a fresh one (the kubelet
//! rotates projected tokens); a token from the token file is checked again when the edge
//! sends a fresh one, and on every reload of the file (`reload.rs`). A stolen token is
//! then good only for as long as the API server still accepts it.
//!
//! A certificate of the cloud's CSR signer is also checked every interval against the
//! CSRs that exist (deleting its CSR revokes it), and an edge that renewed it sends the
//! new one on the session with a proof that it holds the new key on this connection:
//! the session then lives on to the new certificate's expiry, so renewal cuts nothing.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use super::authenticator::{Authenticator, CertCredential, Credential, Refused};
use super::session::EdgeSession;
use super::token_review::{ReviewError, TokenReviewer};
use crate::ops::metrics::{CloudMetrics, ReasonLabel};

/// Why a session stopped being authorised; also its metric label.
#[derive(Debug, thiserror::Error)]
enum Revoked {
    #[error("the token is no longer in the token file")]
    TokenFile,
    #[error("{0}")]
    Review(ReviewError),
    #[error("the client certificate expired")]
    CertificateExpired,
    #[error("the client certificate was revoked (its CertificateSigningRequest is gone)")]
    CertificateWithdrawn,
}

impl Revoked {
    fn label(&self) -> &'static str {
        match self {
            Revoked::TokenFile => "token_revoked",
            Revoked::Review(_) => "token_review",
            Revoked::CertificateExpired => "certificate_expired",
            Revoked::CertificateWithdrawn => "certificate_revoked",
        }
    }
}

/// Watches one session's credential until the session ends, and ends the session when
/// the credential fails. `fresh` carries what the edge sends (`Reauth`): tokens, or a
/// renewed certificate.
pub(crate) async fn watch(
    auth: Arc<Authenticator>,
    metrics: Arc<CloudMetrics>,
    session: Arc<EdgeSession>,
    mut credential: Credential,
    mut fresh: mpsc::Receiver<Box<proto::Reauth>>,
    interval: Duration,
) {
    if let Credential::Certificate(c) = &credential {
        session.set_certificate_expiry(c.not_after);
    }
    let rechecked = matches!(
        credential,
        Credential::ServiceAccount(_) | Credential::Certificate(_)
    );
    let mut review = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
    review.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The checks are boxed: this task lives as long as the session, and the token
    // review's future (an API call) would otherwise be part of it when it is idle.
    let revoked = loop {
        let outcome = tokio::select! {
            () = session.wait_closed() => return,
            () = sleep_until(expiry(&credential)) => Err(Revoked::CertificateExpired),
            offered = fresh.recv() => {
                let Some(offered) = offered else { return };
                Box::pin(offer(&auth, &session, &mut credential, *offered)).await
            }
            _ = review.tick(), if rechecked => Box::pin(recheck(&auth, &session, &credential)).await,
        };
        if let Err(revoked) = outcome {
            break revoked;
        }
    };
    warn!(node = %session.node, session = session.id, reason = %revoked, "session no longer authorised; closing it");
    metrics
        .sessions_revoked
        .get_or_create(&ReasonLabel {
            reason: revoked.label(),
        })
        .inc();
    session.close();
}

/// When a certificate session's certificate expires.
fn expiry(credential: &Credential) -> Option<tokio::time::Instant> {
    match credential {
        Credential::Certificate(CertCredential {
            not_after: Some(t), ..
        }) => {
            let left = t.duration_since(SystemTime::now()).unwrap_or_default();
            Some(tokio::time::Instant::now() + left)
        }
        _ => None,
    }
}

/// The check every interval: the API server reviews a service account token again; a
/// certificate of the cloud's signer must still have its CSR.
async fn recheck(
    auth: &Authenticator,
    session: &EdgeSession,
    credential: &Credential,
) -> Result<(), Revoked> {
    match credential {
        Credential::ServiceAccount(current) => {
            review_token(auth.token_reviewer(), &session.node, current)
                .await
                .map(drop)
        }
        Credential::Certificate(c) if auth.revoked(&c.der) => Err(Revoked::CertificateWithdrawn),
        Credential::TokenFile(_) | Credential::Certificate(_) => Ok(()),
    }
}

/// What the edge sent: a token checked like the one it registered with, and kept when
/// good; a renewed certificate, which replaces the session's when it passes.
async fn offer(
    auth: &Authenticator,
    session: &EdgeSession,
    credential: &mut Credential,
    offered: proto::Reauth,
) -> Result<(), Revoked> {
    match credential {
        Credential::TokenFile(_) => {
            if auth.token_file_allows(&session.node, &offered.token) {
                // The reload check (`reload.rs`) follows the token the edge uses now.
                session.set_token(offered.token);
                Ok(())
            } else {
                Err(Revoked::TokenFile)
            }
        }
        Credential::ServiceAccount(current) => {
            if review_token(auth.token_reviewer(), &session.node, &offered.token).await? {
                debug!(node = %session.node, "fresh service account token accepted");
                *current = offered.token;
            }
            Ok(())
        }
        // A token beside a certificate has no say; a renewed certificate does.
        Credential::Certificate(_) if offered.certificate.is_empty() => Ok(()),
        Credential::Certificate(c) => {
            match check_renewal(auth, &session.node, c.exporter.as_ref(), &offered).await {
                Ok(not_after) => {
                    info!(node = %session.node, session = session.id, valid_until = ?not_after, "renewed client certificate accepted on the open session");
                    c.not_after = not_after;
                    c.der = offered.certificate;
                    session.set_certificate_expiry(not_after);
                }
                // The current certificate still stands until it expires.
                Err(why) => {
                    warn!(node = %session.node, session = session.id, %why, "renewed client certificate refused")
                }
            }
            Ok(())
        }
    }
}

/// How long a renewed certificate may wait for this replica's CSR watch to show its
/// CSR: the edge learns of the certificate from its own watch of the same update, and
/// may be faster, above all when another replica signed it.
const NOT_ISSUED_YET: Duration = Duration::from_secs(5);

async fn check_renewal(
    auth: &Authenticator,
    node: &str,
    exporter: Option<&[u8; 32]>,
    offered: &proto::Reauth,
) -> Result<Option<SystemTime>, Refused> {
    let deadline = tokio::time::Instant::now() + NOT_ISSUED_YET;
    // Subscribed before the first check, so an update between the two is not missed.
    let mut csr_updates = auth.csr_updates();
    loop {
        let verdict = auth.check_renewal(node, exporter, offered);
        if !matches!(verdict, Err(Refused::NotIssued)) {
            return verdict;
        }
        // Only the CSR signer's certificates can be not issued yet: then there is a watch.
        let Some(updates) = csr_updates.as_mut() else {
            return verdict;
        };
        match tokio::time::timeout_at(deadline, updates.changed()).await {
            Ok(Ok(())) => {}
            // The deadline passed, or the watch is gone.
            _ => return verdict,
        }
    }
}

/// Reviews a service account token for `node`: `Ok(true)` valid, `Ok(false)` no verdict
/// now (the API is rate-limited or unreachable: the session keeps its standing and the
/// next review tries again), `Err` when the API server rejects it.
async fn review_token(
    reviewer: Option<&TokenReviewer>,
    node: &str,
    token: &str,
) -> Result<bool, Revoked> {
    let Some(reviewer) = reviewer else {
        return Ok(false);
    };
    match reviewer.review(token, node).await {
        Ok(()) => Ok(true),
        Err(e @ (ReviewError::Rejected(_) | ReviewError::WrongNode(_))) => Err(Revoked::Review(e)),
        Err(e @ (ReviewError::RateLimited | ReviewError::Unavailable(_))) => {
            info!(%node, error = %e, "token review not possible now; the session keeps its standing");
            Ok(false)
        }
    }
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use http::{Request, Response};
    use kube::client::Body;
    use serde_json::json;

    use crate::cloud::edges::token_review::tests::{answer, bound_to};

    /// A token the API server accepted at registration and starts rejecting (expired,
    /// its pod or service account deleted) is revoked at the next review; an API that
    /// cannot answer leaves the session standing.
    #[tokio::test]
    async fn a_token_the_api_starts_rejecting_is_revoked() {
        let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = kube::Client::new(service, "default");
        // Answers cached for a moment only, so each review below asks the API.
        let reviewer = Arc::new(TokenReviewer::new(
            client,
            "tunnel-cloud",
            "tunnel-system:tunnel-edge",
            100.0,
            Duration::from_millis(1),
        ));

        let r = reviewer.clone();
        let first = tokio::spawn(async move { review_token(Some(&r), "edge-1", "tok").await });
        answer(&mut handle, "tok", bound_to("edge-1")).await;
        assert!(matches!(first.await.expect("join"), Ok(true)));

        tokio::time::sleep(Duration::from_millis(5)).await;
        let r = reviewer.clone();
        let second = tokio::spawn(async move { review_token(Some(&r), "edge-1", "tok").await });
        answer(
            &mut handle,
            "tok",
            json!({"authenticated": false, "error": "token has expired"}),
        )
        .await;
        let revoked = second.await.expect("join").expect_err("a rejected token");
        assert_eq!(revoked.label(), "token_review");
        assert!(
            revoked.to_string().contains("token has expired"),
            "{revoked}"
        );

        // No API at all: no verdict, the session keeps its standing.
        assert!(matches!(
            review_token(None, "edge-1", "tok").await,
            Ok(false)
        ));
    }

    /// An edge-1 renewal offered to a replica whose CSR watch has listed without its CSR.
    struct Renewal {
        issued: Arc<crate::cloud::edges::csr::Issued>,
        auth: Authenticator,
        exporter: [u8; 32],
        cert: Vec<u8>,
        offered: proto::Reauth,
    }

    fn renewal_not_yet_shown(dir: &std::path::Path) -> Renewal {
        use crate::cloud::edges::authenticator::tests::{SIGNER, authenticator, reauth, signed};
        use crate::cloud::edges::csr::Issued;

        let issued = Arc::new(Issued::new(SIGNER));
        let auth = authenticator(dir, issued.clone());
        let exporter = [3u8; 32];
        let (cert, key) = signed(dir, "edge-1");
        let offered = reauth(&cert, &key, &exporter);
        issued.set(&std::collections::HashMap::new());
        Renewal {
            issued,
            auth,
            exporter,
            cert,
            offered,
        }
    }

    /// A renewal that reaches this replica before its CSR watch shows the CSR is
    /// accepted the moment the watch's update comes, not at the next check of a poll.
    #[tokio::test(start_paused = true)]
    async fn a_renewal_waiting_for_its_csr_is_accepted_when_the_watch_shows_it() {
        use crate::cloud::edges::csr::{Seen, fingerprint};

        let dir = tempfile::tempdir().expect("dir");
        let Renewal {
            issued,
            auth,
            exporter,
            cert,
            offered,
        } = renewal_not_yet_shown(dir.path());

        let start = tokio::time::Instant::now();
        let check = tokio::spawn(async move {
            let verdict = check_renewal(&auth, "edge-1", Some(&exporter), &offered).await;
            (verdict, start.elapsed())
        });
        let shown_after = Duration::from_millis(1_050);
        tokio::time::sleep(shown_after).await;
        issued.set(&[("csr".to_string(), Seen::issued(fingerprint(&cert)))].into());
        let (verdict, waited) = check.await.expect("the check");
        assert!(
            matches!(verdict, Ok(Some(_))),
            "accepted once issued: {verdict:?}"
        );
        assert_eq!(waited, shown_after, "accepted as the watch showed the CSR");
    }

    /// A renewal whose CSR never shows is refused at the bound, not before.
    #[tokio::test(start_paused = true)]
    async fn a_renewal_whose_csr_never_shows_is_refused_at_the_bound() {
        let dir = tempfile::tempdir().expect("dir");
        let Renewal {
            auth,
            exporter,
            offered,
            ..
        } = renewal_not_yet_shown(dir.path());

        let start = tokio::time::Instant::now();
        let verdict = check_renewal(&auth, "edge-1", Some(&exporter), &offered).await;
        assert!(matches!(verdict, Err(Refused::NotIssued)), "{verdict:?}");
        assert_eq!(start.elapsed(), NOT_ISSUED_YET);
    }
}
