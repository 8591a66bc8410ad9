//! Edge authentication through Kubernetes: the edge presents a node-bound service
//! account token (a projected token, audience `tunnel-cloud`), and the cloud asks the
//! API server about it with a TokenReview. The token must belong to the edge service
//! account and be bound to a pod on the node the edge registers as: a node can only
//! register as itself.
//!
//! A fleet reconnecting at once must not flood the API server (Konnectivity's reviews
//! were throttled for 11 minutes in a 5k-node test): answers are cached by the token's
//! digest, rejections too (for less time), and reviews beyond a rate are refused with
//! RATE_LIMITED, which the edge meets with its backoff.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use kube::Api;
use kube::api::PostParams;
use sha2::{Digest, Sha256};

use crate::rate::Bucket;

/// The key Kubernetes (1.30+) puts the node of a node-bound token's pod under.
const NODE_NAME_EXTRA: &str = "authentication.kubernetes.io/node-name";
/// Most answers kept; at the bound, expired ones go first, then everything.
const MAX_CACHED: usize = 50_000;
/// How long a rejection is remembered: long enough to absorb a retry storm with a bad
/// token, short enough that a fixed token works soon.
const REJECTION_TTL: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ReviewError {
    #[error("token review rejected the token: {0}")]
    Rejected(String),
    #[error("the token is bound to node `{0}`")]
    WrongNode(String),
    #[error("too many token reviews; retry later")]
    RateLimited,
    #[error("token review failed: {0}")]
    Unavailable(String),
}

/// What a review said about a token: the node it is bound to, or why it is refused.
type Verdict = Result<String, String>;

struct Cached {
    verdict: Verdict,
    expires: Instant,
}

pub(crate) struct TokenReviewer {
    client: kube::Client,
    audience: String,
    /// `system:serviceaccount:<namespace>:<name>` of the edges.
    username: String,
    ttl: Duration,
    cache: Mutex<HashMap<[u8; 32], Cached>>,
    bucket: Mutex<Bucket>,
}

impl TokenReviewer {
    /// `service_account` is `namespace:name`; `rate` reviews per second, bursts of twice that.
    pub(crate) fn new(
        client: kube::Client,
        audience: &str,
        service_account: &str,
        rate: f64,
        ttl: Duration,
    ) -> Self {
        Self {
            client,
            audience: audience.to_string(),
            username: format!("system:serviceaccount:{service_account}"),
            ttl,
            cache: Mutex::new(HashMap::new()),
            bucket: Mutex::new(Bucket::new(rate, (rate * 2.0).max(1.0), Instant::now())),
        }
    }

    /// Whether `token` lets an edge register as `node`.
    pub(crate) async fn review(&self, token: &str, node: &str) -> Result<(), ReviewError> {
        let key: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let now = Instant::now();
        let cached = self
            .lock_cache()
            .get(&key)
            .filter(|c| c.expires > now)
            .map(|c| c.verdict.clone());
        let verdict = match cached {
            Some(v) => v,
            None => {
                if !self
                    .bucket
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .try_take(now)
                {
                    return Err(ReviewError::RateLimited);
                }
                // An API that cannot answer is not a verdict on the token: not cached.
                let verdict = self
                    .ask(token)
                    .await
                    .map_err(|e| ReviewError::Unavailable(e.to_string()))?;
                let ttl = if verdict.is_ok() {
                    self.ttl
                } else {
                    REJECTION_TTL
                };
                self.remember(key, verdict.clone(), now + ttl, now);
                verdict
            }
        };
        match verdict {
            Ok(bound) if bound == node => Ok(()),
            Ok(bound) => Err(ReviewError::WrongNode(bound)),
            Err(why) => Err(ReviewError::Rejected(why)),
        }
    }

    fn lock_cache(&self) -> std::sync::MutexGuard<'_, HashMap<[u8; 32], Cached>> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn remember(&self, key: [u8; 32], verdict: Verdict, expires: Instant, now: Instant) {
        let mut cache = self.lock_cache();
        if cache.len() >= MAX_CACHED {
            cache.retain(|_, c| c.expires > now);
            if cache.len() >= MAX_CACHED {
                cache.clear();
            }
        }
        cache.insert(key, Cached { verdict, expires });
    }

    async fn ask(&self, token: &str) -> Result<Verdict, kube::Error> {
        let api: Api<TokenReview> = Api::all(self.client.clone());
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_string()),
                audiences: Some(vec![self.audience.clone()]),
            },
            ..Default::default()
        };
        let status = api
            .create(&PostParams::default(), &review)
            .await?
            .status
            .unwrap_or_default();
        if status.authenticated != Some(true) {
            return Ok(Err(status
                .error
                .filter(|e| !e.is_empty())
                .unwrap_or_else(|| "not authenticated".into())));
        }
        // The answer names the audiences the token is good for among those asked. One
        // without ours comes from an authenticator that ignored the audience (a webhook,
        // or a token for the API server itself): it says nothing about tokens for us.
        let audiences = status.audiences.unwrap_or_default();
        if !audiences.contains(&self.audience) {
            return Ok(Err(format!(
                "the answer does not confirm audience `{}` (its audiences: {audiences:?}); the token may be meant for another audience",
                self.audience
            )));
        }
        let user = status.user.unwrap_or_default();
        let username = user.username.unwrap_or_default();
        if username != self.username {
            return Ok(Err(format!(
                "the token is `{username}`'s, not the edges' service account `{}`",
                self.username
            )));
        }
        let node = user
            .extra
            .as_ref()
            .and_then(|e| e.get(NODE_NAME_EXTRA))
            .and_then(|v| v.first())
            .cloned();
        Ok(node.ok_or_else(|| {
            "the token is not bound to a node (use a projected service account token; Kubernetes 1.30+ binds it)".to_string()
        }))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    use http::{Request, Response};
    use kube::client::Body;
    use serde_json::json;

    pub(crate) type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

    /// A reviewer for `tunnel-system:tunnel-edge` tokens of audience `tunnel-cloud`,
    /// `rate` reviews a second, over a client whose API answers through the handle.
    fn reviewer(rate: f64) -> (std::sync::Arc<TokenReviewer>, Handle) {
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = kube::Client::new(service, "default");
        let reviewer = TokenReviewer::new(
            client,
            "tunnel-cloud",
            "tunnel-system:tunnel-edge",
            rate,
            Duration::from_secs(300),
        );
        (std::sync::Arc::new(reviewer), handle)
    }

    /// Answers the next TokenReview with `status`, after checking what was asked.
    pub(crate) async fn answer(handle: &mut Handle, token: &str, status: serde_json::Value) {
        let (req, send) = tokio::time::timeout(Duration::from_secs(5), handle.next_request())
            .await
            .expect("no token review was sent")
            .expect("service dropped");
        assert_eq!(req.method(), http::Method::POST);
        assert_eq!(
            req.uri().path(),
            "/apis/authentication.k8s.io/v1/tokenreviews"
        );
        let body = http_body_util::BodyExt::collect(req.into_body())
            .await
            .expect("body")
            .to_bytes();
        let sent: serde_json::Value = serde_json::from_slice(&body).expect("json");
        assert_eq!(sent["spec"]["token"], token);
        assert_eq!(sent["spec"]["audiences"], json!(["tunnel-cloud"]));
        let review = json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {}, "status": status});
        send.send_response(
            Response::builder()
                .body(Body::from(serde_json::to_vec(&review).expect("json")))
                .expect("response"),
        );
    }

    pub(crate) fn bound_to(node: &str) -> serde_json::Value {
        json!({"authenticated": true, "audiences": ["tunnel-cloud"], "user": {
            "username": "system:serviceaccount:tunnel-system:tunnel-edge",
            "extra": {NODE_NAME_EXTRA: [node]},
        }})
    }

    async fn nothing_asked(handle: &mut Handle) {
        assert!(
            tokio::time::timeout(Duration::from_millis(100), handle.next_request())
                .await
                .is_err(),
            "the API was asked again"
        );
    }

    #[tokio::test]
    async fn reviews_bind_tokens_to_nodes_and_spare_the_api() {
        let (reviewer, mut handle) = reviewer(1.0);

        // A node-bound token of the edge service account lets its node in, once asked.
        let r = reviewer.clone();
        let first = tokio::spawn(async move { r.review("tok-edge-1", "edge-1").await });
        answer(&mut handle, "tok-edge-1", bound_to("edge-1")).await;
        assert_eq!(first.await.expect("join"), Ok(()));
        // The same token again, even for another node: from the cache, no API call.
        assert_eq!(reviewer.review("tok-edge-1", "edge-1").await, Ok(()));
        assert_eq!(
            reviewer.review("tok-edge-1", "edge-2").await,
            Err(ReviewError::WrongNode("edge-1".into()))
        );
        nothing_asked(&mut handle).await;

        // Over the rate (burst 2, one used): the next new token is refused unasked.
        let r = reviewer.clone();
        let second = tokio::spawn(async move { r.review("tok-other-sa", "edge-3").await });
        answer(&mut handle, "tok-other-sa", json!({"authenticated": true, "audiences": ["tunnel-cloud"], "user": {"username": "system:serviceaccount:default:builder"}})).await;
        let err = second
            .await
            .expect("join")
            .expect_err("another service account's token");
        assert!(
            matches!(&err, ReviewError::Rejected(m) if m.contains("not the edges' service account")),
            "{err}"
        );
        assert_eq!(
            reviewer.review("tok-new", "edge-4").await,
            Err(ReviewError::RateLimited)
        );
        nothing_asked(&mut handle).await;
        // The rejection is cached too: retrying a bad token costs the API nothing.
        assert!(matches!(
            reviewer.review("tok-other-sa", "edge-3").await,
            Err(ReviewError::Rejected(_))
        ));
        nothing_asked(&mut handle).await;
    }

    #[tokio::test]
    async fn unauthenticated_and_unbound_tokens_are_refused() {
        let (reviewer, mut handle) = reviewer(10.0);
        let r = reviewer.clone();
        let expired = tokio::spawn(async move { r.review("tok-expired", "edge-1").await });
        answer(
            &mut handle,
            "tok-expired",
            json!({"authenticated": false, "error": "token has expired"}),
        )
        .await;
        assert_eq!(
            expired.await.expect("join"),
            Err(ReviewError::Rejected("token has expired".into()))
        );
        let r = reviewer.clone();
        let unbound = tokio::spawn(async move { r.review("tok-unbound", "edge-1").await });
        answer(&mut handle, "tok-unbound", json!({"authenticated": true, "audiences": ["tunnel-cloud"], "user": {"username": "system:serviceaccount:tunnel-system:tunnel-edge"}})).await;
        let err = unbound
            .await
            .expect("join")
            .expect_err("a token without a node");
        assert!(err.to_string().contains("not bound to a node"), "{err}");
    }

    /// An answer must name our audience among those the token is good for: the API
    /// docs tell clients that set `spec.audiences` to check it. Without it (an
    /// authenticator that ignored the audience, or one that names only another), a
    /// token bound to the right node of the right account is still refused.
    #[tokio::test]
    async fn an_answer_without_our_audience_is_refused() {
        let (reviewer, mut handle) = reviewer(10.0);
        let cases = [
            ("tok-no-audiences", None, "its audiences: []"),
            (
                "tok-api-audience",
                Some(json!(["https://kubernetes.default.svc"])),
                "its audiences: [\"https://kubernetes.default.svc\"]",
            ),
        ];
        for (token, audiences, said) in cases {
            let mut status = bound_to("edge-1");
            match audiences {
                Some(a) => status["audiences"] = a,
                None => {
                    status.as_object_mut().expect("object").remove("audiences");
                }
            }
            let r = reviewer.clone();
            let review = tokio::spawn(async move { r.review(token, "edge-1").await });
            answer(&mut handle, token, status).await;
            let err = review.await.expect("join").expect_err(token);
            let ReviewError::Rejected(why) = &err else {
                panic!("{token}: {err:?}");
            };
            assert!(
                why.contains("does not confirm audience `tunnel-cloud`") && why.contains(said),
                "{token}: {why}"
            );
        }
        // The same token with our audience among others is let in.
        let r = reviewer.clone();
        let review = tokio::spawn(async move { r.review("tok-both", "edge-1").await });
        let mut status = bound_to("edge-1");
        status["audiences"] = json!(["https://kubernetes.default.svc", "tunnel-cloud"]);
        answer(&mut handle, "tok-both", status).await;
        assert_eq!(review.await.expect("join"), Ok(()));
    }
}
