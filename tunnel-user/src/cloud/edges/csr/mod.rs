//! The edges' client certificates from the cluster: the cloud approves and signs the
//! CertificateSigningRequests of its own signer (`csr.signer_name`), and only those.
//!
//! Data flow: a watch on CSRs of that signer (field selector `spec.signerName`) -> a
//! pending CSR is reviewed (`review`: the request itself, then whether its requester may
//! speak for the node it names: for an edge's name, the node's own credentials or a
//! pod of the edges' service account that runs on that node; for a relay's,
//! `system:tunnel-relay:<node>`, a pod of the relays' service account on that node) ->
//! approved or denied with the reason in the condition -> an approved one is signed
//! (`sign`) into `status.certificate`.
//! Reviews are bounded per requester (a node, a pod, a user), charged as the watch
//! sees each CSR, and in total (`csr.rate`), spent only on what may be approved. The
//! watch never waits for a review: it hands CSRs to one worker (`Work`), so a flood
//! delays neither the deletions that revoke certificates nor other requesters' CSRs.
//!
//! Revocation: the same watch keeps the fingerprints of the certificates its CSRs hold
//! ([`Issued`]). A certificate of this signer whose CSR is gone (deleted) is refused at
//! registration and ends its session at the next re-check (`reauth`). Kubernetes'
//! CSR cleaner deletes an issued CSR an hour after its approval, which is why
//! `csr.max_lifetime` is at most an hour and edges renew at about three quarters of it.
//!
//! Every replica runs this and watches every CSR, but decides only its share ([`owner`]:
//! rendezvous hashing over the replicas its peer links reach). Where two replicas
//! still decide the same CSR (their views differ for a moment, a takeover), the API
//! server's resourceVersion check lets one write win; the other sees a conflict and
//! drops it.

pub(crate) mod review;
pub(crate) mod sign;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use k8s_openapi::ByteString;
use k8s_openapi::api::certificates::v1::{
    CertificateSigningRequest, CertificateSigningRequestCondition,
};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{ListParams, PostParams};
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, Event};
use kube::{Api, ResourceExt as _};
use sha2::{Digest as _, Sha256};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::cloud::watch::Snapshot;
use crate::config::CloudConfig;
use crate::rate::Bucket;
use review::{Accounts, Checked, Denial, Requester, Subject};
use sign::Signer;

/// CSRs one requester may file at once, and then one per this long.
const PER_REQUESTER_BURST: f64 = 5.0;
const PER_REQUESTER_EVERY: Duration = Duration::from_secs(60);
/// Requesters remembered for the flood bound; beyond, those with a full budget go.
const MAX_REQUESTERS: usize = 10_000;
/// Attempts at a review the API could not answer (a pod lookup), a second apart.
const API_ATTEMPTS: u32 = 3;
/// How often CSRs still pending are listed again: one whose review could not ask the
/// API (a pod lookup that failed) gets no new watch event by itself.
const RETRY_PENDING: Duration = Duration::from_secs(60);
/// How long a CSR waits before a retry takes it up: longer than any review takes.
const STUCK_AFTER: Duration = Duration::from_secs(30);
/// CSRs waiting in each of the worker's queues; beyond, a CSR waits for the next retry.
const QUEUED: usize = 1024;
/// CSRs a retry's list reads per request, and at most this many requests.
const LIST_PAGE: u32 = 500;
const LIST_PAGES: usize = 200;
/// How long a CSR another replica decides may wait before this one, with nothing of
/// its own to do, takes it up: that replica's link is up but it does not decide (its
/// watch or its API access broken). A replica that goes away leaves the others' view
/// at once, and its CSRs fall to them with the next retry.
const TAKEOVER_AFTER: Duration = Duration::from_secs(300);
/// CSRs this replica signed lately, by uid: the watch event of its own approval comes
/// after the signature and must not sign again.
const RECENTLY_SIGNED: usize = 1024;

/// The certificates this signer issued whose CSRs still exist, by SHA-256 of the
/// certificate; unknown until the watch has listed the CSRs once. Updated per watch
/// event (a fleet's CSRs are 100,000 and more; each event changes one).
pub(crate) struct Issued {
    signer_name: String,
    fingerprints: RwLock<Option<HashSet<[u8; 32]>>>,
    /// Bumped whenever `fingerprints` changes, for a renewal waiting to see its CSR.
    updated: tokio::sync::watch::Sender<u64>,
}

impl Issued {
    pub(crate) fn new(signer_name: &str) -> Self {
        Self {
            signer_name: signer_name.to_string(),
            fingerprints: RwLock::new(None),
            updated: tokio::sync::watch::Sender::new(0),
        }
    }

    /// Wakes whenever the certificates change (the watch listed, or this replica signed).
    pub(crate) fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.updated.subscribe()
    }

    fn changed(&self) {
        self.updated.send_modify(|v| *v = v.wrapping_add(1));
    }

    /// Whether `der` is a certificate of this signer whose CSR is gone (or never was):
    /// revoked. Certificates of other origins (`tunnel certs`) are not this check's.
    pub(crate) fn revoked(&self, der: &[u8]) -> bool {
        if !sign::issued_by(der, &self.signer_name) {
            return false;
        }
        let known = self.fingerprints.read().unwrap_or_else(|e| e.into_inner());
        known
            .as_ref()
            .is_some_and(|set| !set.contains(&fingerprint(der)))
    }

    /// The whole set, after the watch (re)listed the CSRs.
    pub(crate) fn set(&self, current: &HashMap<String, Seen>) {
        let set = current.values().filter_map(|s| s.issued).collect();
        *self.write() = Some(set);
        self.changed();
    }

    /// One CSR changed from holding `old` to holding `new`. Before the first list
    /// nothing is known, and a change alone does not make it known.
    fn update(&self, old: Option<[u8; 32]>, new: Option<[u8; 32]>) {
        if old == new {
            return;
        }
        if let Some(set) = self.write().as_mut() {
            if let Some(old) = old {
                set.remove(&old);
            }
            if let Some(new) = new {
                set.insert(new);
            }
        }
        self.changed();
    }

    fn insert(&self, fp: [u8; 32]) {
        self.update(None, Some(fp));
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Option<HashSet<[u8; 32]>>> {
        self.fingerprints.write().unwrap_or_else(|e| e.into_inner())
    }
}

pub(crate) fn fingerprint(der: &[u8]) -> [u8; 32] {
    Sha256::digest(der).into()
}

/// What the watch keeps of a CSR of this signer.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Seen {
    /// The fingerprint of the certificate it holds, if approved and issued (and not
    /// failed since).
    issued: Option<[u8; 32]>,
    /// Its creation, while it waits for a review or a signature.
    unsigned_since: Option<k8s_openapi::jiff::Timestamp>,
}

impl Seen {
    #[cfg(test)]
    pub(crate) fn issued(fingerprint: [u8; 32]) -> Self {
        Self {
            issued: Some(fingerprint),
            unsigned_since: None,
        }
    }
}

fn seen(csr: &CertificateSigningRequest) -> Seen {
    let signed = csr.status.as_ref().is_some_and(|s| s.certificate.is_some());
    let waiting = match state(csr) {
        State::Pending => true,
        State::Approved => !signed,
        State::Done => false,
    };
    Seen {
        issued: issued_certificate(csr),
        unsigned_since: waiting
            .then(|| csr.metadata.creation_timestamp.as_ref().map(|t| t.0))
            .flatten(),
    }
}

/// The certificate a CSR holds, if it was approved and issued (and not failed since).
fn issued_certificate(csr: &CertificateSigningRequest) -> Option<[u8; 32]> {
    use rustls_pki_types::CertificateDer;
    use rustls_pki_types::pem::PemObject as _;
    let status = csr.status.as_ref()?;
    if state(csr) != State::Approved {
        return None;
    }
    let pem = status.certificate.as_ref()?;
    let der = CertificateDer::from_pem_slice(&pem.0).ok()?;
    Some(fingerprint(der.as_ref()))
}

#[derive(Debug, PartialEq, Eq)]
enum State {
    Pending,
    Approved,
    /// Denied or failed: nothing more to do.
    Done,
}

fn state(csr: &CertificateSigningRequest) -> State {
    let conditions = csr
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_deref())
        .unwrap_or_default();
    let has = |t: &str| {
        conditions
            .iter()
            .any(|c| c.type_ == t && c.status == "True")
    };
    if has("Denied") || has("Failed") {
        State::Done
    } else if has("Approved") {
        State::Approved
    } else {
        State::Pending
    }
}

/// Approves, denies and signs; one per replica, driven by [`run`].
pub(crate) struct CsrSigner {
    api: Api<CertificateSigningRequest>,
    client: kube::Client,
    signer: Signer,
    signer_name: String,
    edge_service_account: String,
    relay_service_account: String,
    issued: Arc<Issued>,
    total: Mutex<Bucket>,
    rate: f64,
    /// What the watch handed the worker.
    work: Mutex<Work>,
    /// Wakes the worker when `work` has something.
    ready: Notify,
    signed: Mutex<VecDeque<String>>,
}

/// The flood bound per requester: a budget each, at most `MAX_REQUESTERS` remembered.
#[derive(Default)]
struct PerRequester(HashMap<String, Bucket>);

/// What a requester's budget says about one more CSR.
#[derive(Debug, PartialEq, Eq)]
enum Budget {
    Within,
    /// Spent: the CSR is a flood.
    Spent,
    /// `MAX_REQUESTERS` others are mid-burst, so this one cannot be remembered yet: a
    /// whole fleet bootstrapping at once, or many requesters flooding. The CSR waits
    /// for a later retry rather than being denied.
    Unknown,
}

impl PerRequester {
    /// Takes one from `requester`'s budget.
    fn take(&mut self, requester: &str, now: Instant) -> Budget {
        if !self.0.contains_key(requester) && self.0.len() >= MAX_REQUESTERS {
            self.0.retain(|_, b| !b.is_full(now));
            if self.0.len() >= MAX_REQUESTERS {
                return Budget::Unknown;
            }
        }
        let rate = 1.0 / PER_REQUESTER_EVERY.as_secs_f64();
        let within = self
            .0
            .entry(requester.to_string())
            .or_insert_with(|| Bucket::new(rate, PER_REQUESTER_BURST, now))
            .try_take(now);
        if within {
            Budget::Within
        } else {
            Budget::Spent
        }
    }
}

/// CSRs waiting for the worker, by name, in the order they came; a CSR seen again
/// while it waits keeps its place with its newest version.
#[derive(Default)]
struct Lane {
    order: VecDeque<String>,
    csrs: HashMap<String, CertificateSigningRequest>,
}

impl Lane {
    /// Replaces the waiting version of `name`; false when it is not waiting here.
    fn update(&mut self, name: &str, csr: &CertificateSigningRequest) -> bool {
        match self.csrs.get_mut(name) {
            Some(waiting) => {
                *waiting = csr.clone();
                true
            }
            None => false,
        }
    }

    /// Queues `csr`; false when the lane is full.
    fn push(&mut self, name: String, csr: CertificateSigningRequest) -> bool {
        if self.csrs.len() >= QUEUED {
            return false;
        }
        self.order.push_back(name.clone());
        self.csrs.insert(name, csr);
        true
    }

    fn pop(&mut self) -> Option<CertificateSigningRequest> {
        let name = self.order.pop_front()?;
        self.csrs.remove(&name)
    }

    fn remove(&mut self, name: &str) {
        if self.csrs.remove(name).is_some() {
            self.order.retain(|n| n != name);
        }
    }
}

/// What the watch hands the worker. A requester's own budget is charged as its CSR is
/// queued, so a CSR beyond it goes to `floods` and never spends the shared budget
/// (`csr.rate`) or waits for it; the worker takes `reviews` first.
#[derive(Default)]
struct Work {
    requesters: PerRequester,
    /// Pending CSRs within their requester's budget, and approved ones to sign.
    reviews: Lane,
    /// Pending CSRs beyond their requester's budget, to deny.
    floods: Lane,
    /// CSRs the watch has seen waiting longer than `STUCK_AFTER`, to list again.
    stuck: HashSet<String>,
}

/// The worker's next task.
enum Job {
    Review(CertificateSigningRequest),
    Flood(CertificateSigningRequest),
    Retry(HashSet<String>),
}

impl Work {
    /// Queues what `csr` (filed by `requester`, `Requester::key`) asks for, if `mine`
    /// (this replica decides it); says whether the worker has something new. Every
    /// replica charges the requester for every CSR it sees, so all of them keep the
    /// same account of a flood whichever replica decides.
    fn queue(
        &mut self,
        csr: CertificateSigningRequest,
        requester: &str,
        mine: bool,
        now: Instant,
    ) -> bool {
        let name = csr.name_any();
        if self.reviews.update(&name, &csr) || self.floods.update(&name, &csr) {
            return false;
        }
        let issued = csr.status.as_ref().is_some_and(|s| s.certificate.is_some());
        let lane = match state(&csr) {
            State::Pending => match self.requesters.take(requester, now) {
                _ if !mine => return false,
                Budget::Within => &mut self.reviews,
                Budget::Spent => &mut self.floods,
                Budget::Unknown => {
                    debug!(csr = %name, "too many requesters at once; the CSR waits for the next retry");
                    return false;
                }
            },
            State::Approved if !issued && mine => &mut self.reviews,
            State::Approved | State::Done => return false,
        };
        let queued = lane.push(name, csr);
        if !queued {
            debug!("the CSR queue is full; the CSR waits for the next retry");
        }
        queued
    }

    /// Whether the worker has no review or signature of its own to do.
    fn idle(&self) -> bool {
        self.reviews.csrs.is_empty()
    }

    /// A deleted CSR needs nothing more.
    fn forget(&mut self, name: &str) {
        self.reviews.remove(name);
        self.floods.remove(name);
    }

    fn next(&mut self) -> Option<Job> {
        if let Some(csr) = self.reviews.pop() {
            return Some(Job::Review(csr));
        }
        if !self.stuck.is_empty() {
            return Some(Job::Retry(std::mem::take(&mut self.stuck)));
        }
        self.floods.pop().map(Job::Flood)
    }
}

impl CsrSigner {
    /// The signer `config.csr` describes (its CA is `tunnel.client_ca`).
    pub(crate) fn new(
        client: kube::Client,
        config: &CloudConfig,
        issued: Arc<Issued>,
    ) -> anyhow::Result<Self> {
        let c = &config.csr;
        let (ca_cert, ca_key) = sign::ca_files(config, "csr.enabled")?;
        let signer = Signer::load(ca_cert, ca_key, &c.signer_name, c.max_lifetime)?;
        Ok(Self {
            api: Api::all(client.clone()),
            client,
            signer,
            signer_name: c.signer_name.clone(),
            edge_service_account: config.kubernetes.edge_service_account.clone(),
            relay_service_account: config.kubernetes.relay_service_account.clone(),
            issued,
            total: Mutex::new(Bucket::new(c.rate, c.rate * 2.0, Instant::now())),
            rate: c.rate,
            work: Mutex::new(Work::default()),
            ready: Notify::new(),
            signed: Mutex::new(VecDeque::with_capacity(RECENTLY_SIGNED)),
        })
    }

    /// Hands what `csr` asks for to the worker if `mine`, and charges its requester:
    /// called by the watch, which never waits.
    fn queue(&self, csr: CertificateSigningRequest, mine: bool) {
        let requester = self.requester(&csr).key();
        if self
            .lock_work()
            .queue(csr, &requester, mine, Instant::now())
        {
            self.ready.notify_one();
        }
    }

    fn accounts(&self) -> Accounts<'_> {
        Accounts {
            edges: &self.edge_service_account,
            relays: &self.relay_service_account,
        }
    }

    fn requester(&self, csr: &CertificateSigningRequest) -> Requester {
        Requester::of(&csr.spec, &self.accounts())
    }

    fn lock_work(&self) -> std::sync::MutexGuard<'_, Work> {
        self.work.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The worker: takes what the watch queued, one at a time, until `shutdown`.
    async fn work(&self, shutdown: CancellationToken) {
        loop {
            // `notify_one` keeps a wake-up for a worker that is not waiting yet.
            let next = self.lock_work().next();
            let Some(job) = next else {
                tokio::select! {
                    () = self.ready.notified() => continue,
                    () = shutdown.cancelled() => return,
                }
            };
            let done = async {
                match job {
                    Job::Review(csr) => self.handle(csr).await,
                    Job::Flood(csr) => self.deny_flood(csr).await,
                    Job::Retry(names) => self.retry(&names).await,
                }
            };
            tokio::select! {
                () = done => {}
                () = shutdown.cancelled() => return,
            }
        }
    }

    /// What a CSR within its requester's budget asks for now: a review if it is still
    /// pending, the signature if it was approved without a certificate.
    async fn handle(&self, csr: CertificateSigningRequest) {
        let issued = csr.status.as_ref().is_some_and(|s| s.certificate.is_some());
        match state(&csr) {
            State::Pending => self.review(csr).await,
            State::Approved if !issued && !self.signed_here(&csr) => self.sign(csr, None).await,
            State::Approved | State::Done => {}
        }
    }

    /// Denies a CSR beyond its requester's budget, if it is still pending.
    async fn deny_flood(&self, csr: CertificateSigningRequest) {
        if state(&csr) != State::Pending {
            return self.handle(csr).await;
        }
        let requester = self.requester(&csr);
        self.deny(csr, &requester, Denial::Flood(requester.to_string()))
            .await;
    }

    async fn review(&self, csr: CertificateSigningRequest) {
        let requester = self.requester(&csr);
        match self.decide(&csr, &requester).await {
            Some(Ok(checked)) => {
                let message = format!("{requester} may speak for {}", checked.subject);
                let reason = match checked.subject {
                    Subject::Edge(_) => "EdgeNode",
                    Subject::Relay(_) => "RelayNode",
                };
                if let Some(approved) = self
                    .write_condition(csr, "Approved", reason, &message)
                    .await
                {
                    self.sign(approved, Some(checked)).await;
                }
            }
            Some(Err(denial)) => self.deny(csr, &requester, denial).await,
            // Logged where it failed; the CSR stays pending for the next retry.
            None => {}
        }
    }

    async fn deny(&self, csr: CertificateSigningRequest, requester: &Requester, denial: Denial) {
        warn!(csr = %csr.name_any(), %requester, reason = denial.reason(), %denial, "CSR denied");
        let _ = self
            .write_condition(csr, "Denied", denial.reason(), &denial.to_string())
            .await;
    }

    /// The verdict on a pending CSR; None when the API could not be asked. What the
    /// request and the requester's name decide costs nothing; only what may be approved
    /// (a node's own, or a pod's of the right account once its node is looked up)
    /// waits for the shared budget.
    async fn decide(
        &self,
        csr: &CertificateSigningRequest,
        requester: &Requester,
    ) -> Option<Result<Checked, Denial>> {
        let checked = match review::check_request(&csr.spec) {
            Ok(c) => c,
            Err(denial) => return Some(Err(denial)),
        };
        let node = checked.subject.node().as_str();
        let other = |why: String| {
            Some(Err(Denial::OtherNode {
                subject: checked.subject.clone(),
                why,
            }))
        };
        let accounts = self.accounts();
        let pod = match review::may_ask(&checked.subject, requester, &accounts) {
            Ok(pod) => pod,
            Err(why) => return other(why),
        };
        self.wait_for_budget().await;
        if let Some(review::PodRef {
            namespace,
            name,
            uid,
        }) = pod
        {
            match self.pod_node(namespace, name, uid).await? {
                Ok(on) if on == node => {}
                Ok(on) => return other(format!("its pod {namespace}/{name} runs on node `{on}`")),
                Err(why) => return other(why),
            }
        }
        Some(Ok(checked))
    }

    /// The node the pod runs on, or why it does not count; None when the API failed.
    async fn pod_node(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
    ) -> Option<Result<String, String>> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        let mut last = None;
        for attempt in 0..API_ATTEMPTS {
            if attempt > 0 {
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            match pods.get_opt(name).await {
                Ok(None) => return Some(Err(format!("its pod {namespace}/{name} is gone"))),
                Ok(Some(pod)) if pod.uid().as_deref() != Some(uid) => {
                    return Some(Err(format!(
                        "its pod {namespace}/{name} was replaced since the token was issued"
                    )));
                }
                Ok(Some(pod)) if pod.metadata.deletion_timestamp.is_some() => {
                    return Some(Err(format!("its pod {namespace}/{name} is being deleted")));
                }
                Ok(Some(pod)) => {
                    let on = pod.spec.and_then(|s| s.node_name).unwrap_or_default();
                    return Some(Ok(on));
                }
                Err(e) => last = Some(e),
            }
        }
        if let Some(e) = last {
            warn!(pod = %format!("{namespace}/{name}"), error = %e, "cannot look up the requester's pod; the CSR stays pending");
        }
        None
    }

    /// Signs an approved CSR into its status. `checked` is the review's result when the
    /// CSR was just approved here; one approved elsewhere (another replica, `kubectl
    /// certificate approve`) is checked again: a signer signs only what it would issue.
    async fn sign(&self, csr: CertificateSigningRequest, checked: Option<Checked>) {
        let name = csr.name_any();
        let checked = match checked.map_or_else(|| review::check_request(&csr.spec), Ok) {
            Ok(c) => c,
            Err(denial) => {
                warn!(csr = %name, %denial, "approved CSR not signed");
                let _ = self
                    .write_condition(csr, "Failed", denial.reason(), &denial.to_string())
                    .await;
                return;
            }
        };
        let asked = csr
            .spec
            .expiration_seconds
            .and_then(|s| u64::try_from(s).ok())
            .map(Duration::from_secs);
        let cn = checked.subject.common_name();
        let pem = match self.signer.sign(&cn, &checked.request, asked) {
            Ok(pem) => pem,
            Err(e) => {
                warn!(csr = %name, error = %e, "cannot sign the CSR");
                let _ = self
                    .write_condition(csr, "Failed", "SignerError", &e.to_string())
                    .await;
                return;
            }
        };
        let mut signed = csr;
        signed
            .status
            .get_or_insert_with(Default::default)
            .certificate = Some(ByteString(pem.into_bytes()));
        match self
            .api
            .replace_status(&name, &PostParams::default(), &signed)
            .await
        {
            Ok(done) => {
                if let Some(fp) = issued_certificate(&done) {
                    self.issued.insert(fp);
                }
                if let Some(uid) = done.uid() {
                    let mut signed = self.signed.lock().unwrap_or_else(|e| e.into_inner());
                    if signed.len() == RECENTLY_SIGNED {
                        signed.pop_front();
                    }
                    signed.push_back(uid);
                }
                info!(csr = %name, %cn, "CSR approved and signed");
            }
            Err(e) => conflict_or_warn(&name, "sign", e),
        }
    }

    /// Adds a condition through the approval subresource (Approved, Denied) or the
    /// status (Failed); the updated CSR, or None when another writer came first.
    async fn write_condition(
        &self,
        mut csr: CertificateSigningRequest,
        type_: &str,
        reason: &str,
        message: &str,
    ) -> Option<CertificateSigningRequest> {
        let name = csr.name_any();
        let now = Time(k8s_openapi::jiff::Timestamp::now());
        let condition = CertificateSigningRequestCondition {
            type_: type_.into(),
            status: "True".into(),
            reason: Some(reason.into()),
            message: Some(message.into()),
            last_update_time: Some(now.clone()),
            last_transition_time: Some(now),
        };
        csr.status
            .get_or_insert_with(Default::default)
            .conditions
            .get_or_insert_with(Vec::new)
            .push(condition);
        let pp = PostParams::default();
        let written = if type_ == "Failed" {
            self.api.replace_status(&name, &pp, &csr).await
        } else {
            self.api
                .replace_subresource("approval", &name, &pp, &csr)
                .await
        };
        written.map_err(|e| conflict_or_warn(&name, type_, e)).ok()
    }

    /// Lists the signer's CSRs and queues again those of `names` still waiting. A list,
    /// not a read of each: the cloud's role may list and watch CSRs, not get them.
    async fn retry(&self, names: &HashSet<String>) {
        let fields = format!("spec.signerName={}", self.signer_name);
        let mut params = ListParams::default().fields(&fields).limit(LIST_PAGE);
        for _ in 0..LIST_PAGES {
            let page = match self.api.list(&params).await {
                Ok(page) => page,
                Err(e) => {
                    return warn!(error = %e, "cannot list the CSRs to retry those still pending");
                }
            };
            for csr in page.items {
                if names.contains(&csr.name_any()) {
                    debug!(csr = %csr.name_any(), "retrying a CSR still waiting");
                    self.queue(csr, true);
                }
            }
            match page.metadata.continue_ {
                Some(token) if !token.is_empty() => params = params.continue_token(&token),
                _ => return,
            }
        }
    }

    fn signed_here(&self, csr: &CertificateSigningRequest) -> bool {
        let uid = csr.uid().unwrap_or_default();
        let signed = self.signed.lock().unwrap_or_else(|e| e.into_inner());
        signed.iter().any(|u| *u == uid)
    }

    /// Waits for the total budget (`csr.rate`); what waits meanwhile is in `work`.
    async fn wait_for_budget(&self) {
        while !self
            .total
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .try_take(Instant::now())
        {
            tokio::time::sleep(Duration::from_secs_f64(1.0 / self.rate)).await;
        }
    }
}

fn conflict_or_warn(name: &str, what: &str, e: kube::Error) {
    match e {
        kube::Error::Api(s) if s.code == 409 => {
            debug!(csr = %name, what, "another writer (a replica) came first")
        }
        e => warn!(csr = %name, what, error = %e, "cannot update the CSR"),
    }
}

/// Watches the signer's CSRs until `shutdown`: keeps `issued` in line with the CSRs
/// that exist, and hands the worker what to review, deny and sign of the CSRs this
/// replica decides among the `replicas` up.
pub(crate) async fn run(
    signer: Arc<CsrSigner>,
    replicas: Arc<dyn Replicas>,
    shutdown: CancellationToken,
) {
    tokio::join!(
        watch(&signer, replicas.as_ref(), shutdown.clone()),
        signer.work(shutdown.clone())
    );
}

/// The replicas up, among which the CSRs are shared. `cloud::peer::Peers` knows them,
/// a floor above the sessions; `cloud::run` hands it in as this.
pub(crate) trait Replicas: Send + Sync {
    /// Every replica up by id, this one among them, sorted.
    fn live_replicas(&self) -> Vec<String>;
    /// This replica's id, as the others know it.
    fn replica_id(&self) -> &str;
}

/// The replica that decides the CSR `name`, of the replicas up (rendezvous hashing:
/// the highest hash of replica and name), so that replicas share the CSRs without
/// talking, and one that leaves moves only its own share. Replicas that see the
/// others differently for a moment may both decide a CSR: the API server takes the
/// first write at the resourceVersion read and refuses the other (409).
fn owner<'a>(replicas: &'a [String], name: &str) -> Option<&'a str> {
    let score = |replica: &str| {
        let mut h = Sha256::new();
        h.update(replica.as_bytes());
        h.update([0]);
        h.update(name.as_bytes());
        let d = h.finalize();
        u64::from_be_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]])
    };
    replicas
        .iter()
        .max_by_key(|r| (score(r), r.as_str()))
        .map(String::as_str)
}

/// The watch: each event is applied at once (a deleted CSR revokes its certificate
/// without waiting for any review), and every `RETRY_PENDING` the CSRs waiting longer
/// than `STUCK_AFTER` that this replica decides (and, when it has nothing of its own
/// to do, others' waiting longer than `TAKEOVER_AFTER`) are handed to the worker to
/// list again.
async fn watch(signer: &CsrSigner, replicas: &dyn Replicas, shutdown: CancellationToken) {
    let fields = format!("spec.signerName={}", signer.signer_name);
    let config = watcher::Config::default()
        .fields(&fields)
        .page_size(LIST_PAGE);
    let stream = watcher::watcher(signer.api.clone(), config).default_backoff();
    futures::pin_mut!(stream);
    let mut snapshot: Snapshot<Seen> = Snapshot::new();
    let mut failing = false;
    let mut retry =
        tokio::time::interval_at(tokio::time::Instant::now() + RETRY_PENDING, RETRY_PENDING);
    info!(signer = %signer.signer_name, "signing the edges' CSRs");
    loop {
        let event = tokio::select! {
            e = stream.next() => e,
            _ = retry.tick() => {
                let live = replicas.live_replicas();
                let idle = signer.lock_work().idle();
                let stuck = waiting(snapshot.current(), &live, replicas.replica_id(), idle);
                if !stuck.is_empty() {
                    signer.lock_work().stuck = stuck;
                    signer.ready.notify_one();
                }
                continue;
            }
            () = shutdown.cancelled() => return,
        };
        let event = match event {
            None => return,
            Some(Ok(event)) => {
                failing = false;
                event
            }
            Some(Err(e)) => {
                if !failing {
                    warn!(error = %e, "CSR watch failed; retrying with backoff");
                }
                failing = true;
                continue;
            }
        };
        let live = replicas.live_replicas();
        let mine = |csr: &CertificateSigningRequest| {
            owner(&live, &csr.name_any()) == Some(replicas.replica_id())
        };
        match &event {
            Event::Apply(csr) | Event::InitApply(csr) => signer.queue(csr.clone(), mine(csr)),
            Event::Delete(csr) => signer.lock_work().forget(&csr.name_any()),
            Event::Init | Event::InitDone => {}
        }
        apply(&mut snapshot, &signer.issued, event);
    }
}

/// Applies a watch event to what the watch keeps and to `issued`: the one CSR an event
/// names, and the whole set only when a (re)list completes.
fn apply(snapshot: &mut Snapshot<Seen>, issued: &Issued, event: Event<CertificateSigningRequest>) {
    let changed = match &event {
        Event::Apply(csr) | Event::Delete(csr) => Some((
            snapshot
                .current()
                .get(&csr.name_any())
                .and_then(|s| s.issued),
            matches!(event, Event::Apply(_))
                .then(|| issued_certificate(csr))
                .flatten(),
        )),
        Event::Init | Event::InitApply(_) | Event::InitDone => None,
    };
    let listed = matches!(event, Event::InitDone);
    snapshot.apply(event, seen);
    if listed {
        issued.set(snapshot.current());
    } else if let Some((old, new)) = changed {
        issued.update(old, new);
    }
}

/// The CSRs to list again: those this replica (`me`, among `live`) decides that have
/// waited longer than `STUCK_AFTER`, and, when it is `idle`, those of other replicas
/// that have waited longer than `TAKEOVER_AFTER`.
fn waiting(
    current: &HashMap<String, Seen>,
    live: &[String],
    me: &str,
    idle: bool,
) -> HashSet<String> {
    let now = k8s_openapi::jiff::Timestamp::now();
    current
        .iter()
        .filter(|(name, s)| {
            let Some(since) = s.unsigned_since else {
                return false;
            };
            let after = match owner(live, name) == Some(me) {
                true => STUCK_AFTER,
                false if idle => TAKEOVER_AFTER,
                false => return false,
            };
            since < now - after
        })
        .map(|(name, _)| name.clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_requester_gets_five_then_one_a_minute_and_others_are_not_held_back() {
        let t0 = Instant::now();
        let mut floods = PerRequester::default();
        assert!((0..5).all(|_| floods.take("pod/a", t0) == Budget::Within));
        assert_eq!(
            floods.take("pod/a", t0),
            Budget::Spent,
            "the sixth at once is a flood"
        );
        assert_eq!(
            floods.take("pod/b", t0),
            Budget::Within,
            "another requester has its own budget"
        );
        let later = |s| t0 + Duration::from_secs(s);
        assert_eq!(floods.take("pod/a", later(59)), Budget::Spent);
        assert_eq!(floods.take("pod/a", later(61)), Budget::Within);
    }

    /// A whole fleet bootstrapping at once: more requesters than are remembered file a
    /// CSR each within a minute. The ones beyond the bound are not floods: their CSRs
    /// wait (for the retry) instead of being denied, and a requester already
    /// remembered keeps its account.
    #[test]
    fn a_fleet_bootstrapping_at_once_waits_beyond_the_requesters_remembered_and_is_not_denied() {
        let t0 = Instant::now();
        let mut work = Work::default();
        for i in 0..MAX_REQUESTERS {
            work.queue(pending(&format!("csr-{i}")), &format!("pod/{i}"), false, t0);
        }
        assert!(
            !work.queue(pending("csr-new"), "pod/new", true, t0),
            "the bound is reached: the CSR waits"
        );
        assert!(work.floods.csrs.is_empty(), "nothing to deny");
        assert_eq!(work.requesters.take("pod/0", t0), Budget::Within);
        // A minute on, the budgets of those that filed one CSR are full and forgotten.
        assert!(work.queue(
            pending("csr-new"),
            "pod/new",
            true,
            t0 + Duration::from_secs(61)
        ));
        assert_eq!(names(&mut work), ["review csr-new"]);
        assert_eq!(work.requesters.0.len(), 2);
    }

    /// A CSR another replica decides is charged to its requester here too, so every
    /// replica denies the same flood, but this replica queues nothing for it.
    #[test]
    fn a_csr_another_replica_decides_is_charged_but_not_queued() {
        let t0 = Instant::now();
        let mut work = Work::default();
        for i in 0..5 {
            assert!(!work.queue(pending(&format!("theirs-{i}")), "node/edge-1", false, t0));
        }
        assert!(work.queue(pending("mine"), "node/edge-1", true, t0));
        assert_eq!(names(&mut work), ["flood mine"]);
    }

    /// Each CSR has one owner among the replicas up, the same whichever replica asks;
    /// the shares are even, and a replica leaving moves only its own share.
    #[test]
    fn replicas_share_the_csrs_and_one_leaving_moves_only_its_share() {
        let three: Vec<String> = ["cloud-a", "cloud-b", "cloud-c"].map(String::from).to_vec();
        let two: Vec<String> = ["cloud-a", "cloud-c"].map(String::from).to_vec();
        let names: Vec<String> = (0..3000)
            .map(|i| format!("tunnel-edge-edge-{i}-0123456789abcdef"))
            .collect();
        let mut shares = HashMap::<&str, usize>::new();
        for name in &names {
            let o = owner(&three, name).expect("an owner");
            *shares.entry(o).or_default() += 1;
            match owner(&two, name).expect("an owner") {
                moved if o == "cloud-b" => assert_ne!(moved, "cloud-b"),
                stays => assert_eq!(stays, o, "{name} moved without its owner leaving"),
            }
        }
        for (replica, n) in &shares {
            assert!((800..1200).contains(n), "{replica} decides {n} of 3000");
        }
        assert_eq!(owner(&["alone".to_string()], "x"), Some("alone"));
        assert_eq!(owner(&[], "x"), None);
    }

    fn csr_with_certificate(name: &str, der: &[u8]) -> CertificateSigningRequest {
        use base64::Engine as _;
        let b64 = base64::engine::general_purpose::STANDARD.encode(der);
        let pem = format!("-----BEGIN CERTIFICATE-----\n{b64}\n-----END CERTIFICATE-----\n");
        let mut csr = pending(name);
        csr.status = Some(
            k8s_openapi::api::certificates::v1::CertificateSigningRequestStatus {
                conditions: Some(vec![CertificateSigningRequestCondition {
                    type_: "Approved".into(),
                    status: "True".into(),
                    ..Default::default()
                }]),
                certificate: Some(ByteString(pem.into_bytes())),
            },
        );
        csr
    }

    /// The issued set follows each event for the CSR it names (a CSR holding a new
    /// certificate, one deleted) and is replaced whole only when a (re)list completes.
    #[test]
    fn the_issued_set_follows_each_event() {
        let issued = Issued::new("tunnel.io/edge-client");
        let mut snapshot = Snapshot::new();
        let (a, b, c) = (
            b"cert-a".as_slice(),
            b"cert-b".as_slice(),
            b"cert-c".as_slice(),
        );
        let known = |issued: &Issued| {
            let set = issued
                .fingerprints
                .read()
                .unwrap_or_else(|e| e.into_inner());
            let mut v: Vec<[u8; 32]> = set.iter().flatten().copied().collect();
            v.sort();
            v
        };
        let sorted = |mut v: Vec<[u8; 32]>| {
            v.sort();
            v
        };
        apply(
            &mut snapshot,
            &issued,
            Event::Apply(csr_with_certificate("x", a)),
        );
        assert!(
            issued.fingerprints.read().unwrap().is_none(),
            "unknown before the list"
        );
        apply(&mut snapshot, &issued, Event::Init);
        apply(
            &mut snapshot,
            &issued,
            Event::InitApply(csr_with_certificate("x", a)),
        );
        apply(
            &mut snapshot,
            &issued,
            Event::InitApply(csr_with_certificate("y", b)),
        );
        assert!(
            issued.fingerprints.read().unwrap().is_none(),
            "until the list completes"
        );
        apply(&mut snapshot, &issued, Event::InitDone);
        assert_eq!(known(&issued), sorted(vec![fingerprint(a), fingerprint(b)]));
        apply(&mut snapshot, &issued, Event::Apply(pending("z")));
        apply(
            &mut snapshot,
            &issued,
            Event::Apply(csr_with_certificate("z", c)),
        );
        apply(
            &mut snapshot,
            &issued,
            Event::Delete(csr_with_certificate("x", a)),
        );
        assert_eq!(known(&issued), sorted(vec![fingerprint(b), fingerprint(c)]));
        let mut failed = csr_with_certificate("y", b);
        if let Some(conditions) = failed.status.as_mut().and_then(|s| s.conditions.as_mut()) {
            conditions.push(CertificateSigningRequestCondition {
                type_: "Failed".into(),
                status: "True".into(),
                ..Default::default()
            });
        }
        apply(&mut snapshot, &issued, Event::Apply(failed));
        assert_eq!(known(&issued), vec![fingerprint(c)]);
    }

    fn pending(name: &str) -> CertificateSigningRequest {
        CertificateSigningRequest {
            metadata: kube::api::ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn names(work: &mut Work) -> Vec<String> {
        std::iter::from_fn(|| work.next())
            .map(|job| match job {
                Job::Review(c) => format!("review {}", c.name_any()),
                Job::Flood(c) => format!("flood {}", c.name_any()),
                Job::Retry(names) => format!("retry {}", names.len()),
            })
            .collect()
    }

    /// A requester's CSRs beyond its own budget go to the floods, which the worker takes
    /// last; another requester's CSR waits behind at most the flooder's five.
    #[test]
    fn a_flood_is_charged_to_its_requester_and_waits_behind_reviews() {
        let t0 = Instant::now();
        let mut work = Work::default();
        for i in 0..8 {
            work.queue(pending(&format!("flood-{i}")), "node/edge-2", true, t0);
        }
        assert!(work.queue(pending("fresh"), "pod/tunnel-system/uid-1", true, t0));
        work.stuck = ["old".to_string()].into();
        let order = names(&mut work);
        let reviews: Vec<String> = (0..5).map(|i| format!("review flood-{i}")).collect();
        assert_eq!(order[..5], reviews[..]);
        assert_eq!(order[5], "review fresh");
        assert_eq!(order[6], "retry 1", "a retry comes before the floods");
        assert_eq!(
            order[7..],
            ["flood flood-5", "flood flood-6", "flood flood-7"]
        );
    }

    /// A CSR seen again while it waits keeps its one place and is not charged again; a
    /// deleted one is dropped; a full queue leaves the rest to the retry.
    #[test]
    fn a_waiting_csr_is_queued_once_and_a_deleted_one_not_at_all() {
        let t0 = Instant::now();
        let mut work = Work::default();
        for _ in 0..10 {
            work.queue(pending("again"), "node/edge-1", true, t0);
        }
        for i in 0..4 {
            work.queue(pending(&format!("more-{i}")), "node/edge-1", true, t0);
        }
        work.forget("more-3");
        assert_eq!(
            names(&mut work),
            [
                "review again",
                "review more-0",
                "review more-1",
                "review more-2"
            ]
        );
        let mut done = pending("denied");
        done.status = Some(
            k8s_openapi::api::certificates::v1::CertificateSigningRequestStatus {
                conditions: Some(vec![CertificateSigningRequestCondition {
                    type_: "Denied".into(),
                    status: "True".into(),
                    ..Default::default()
                }]),
                ..Default::default()
            },
        );
        assert!(!work.queue(done, "node/edge-3", true, t0), "nothing to do");
        // Five reviews, then the floods' lane fills.
        for i in 0..QUEUED + 6 {
            let queued = work.queue(pending(&format!("f-{i}")), "node/edge-4", true, t0);
            assert_eq!(queued, i < QUEUED + 5, "{i}");
        }
    }
}
