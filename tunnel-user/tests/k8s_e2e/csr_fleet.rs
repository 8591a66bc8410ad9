//! CSRs at fleet rate, against the real API server: a fleet of edges (each its own
//! requester, `system:node:fleet-<i>`, by impersonation) files its CSRs all at once,
//! and the cloud's replicas, linked as peers, decide each CSR once between them. The
//! test checks that with a few hundred; `csr_fleet_bootstrap_figures` (ignored: a
//! measurement, `cargo test -p tunnel-user --test k8s_e2e csr_fleet -- --ignored
//! --nocapture`) bootstraps `TUNNEL_CSR_FLEET` edges (default 2,000) with one replica
//! and then two, at `TUNNEL_CSR_RATE` (default: `csr.rate`'s), and prints CSRs issued
//! per second and the time until all are issued.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use kube::api::{Api, ListParams};

use crate::common::config::write_toml;
use crate::common::{self, probe::count_lines};
use crate::k8s::apiserver::{ApiServer, ApiServerOpts, Credential, Daemon, write_kubeconfig};
use crate::k8s::checks::{admin_kubectl, prerequisites, wait_log};
use crate::{create_token, tunnel};

const SIGNER: &str = "tunnel.io/edge-client";
/// What a replica logs when another replica's write came first (debug).
const CONFLICT: &str = "another writer (a replica) came first";

/// The API server with deploy/ applied, and `replicas` clouds signing CSRs, linked.
struct Fleet {
    replicas: Vec<Daemon>,
    api: ApiServer,
    _ports: Vec<common::ClosedPort>,
    _dir: tempfile::TempDir,
}

impl Fleet {
    fn start(replicas: usize, rate: Option<f64>) -> Option<Self> {
        let (assets, kubectls) = prerequisites(false)?;
        let kubectl = admin_kubectl(&kubectls).to_path_buf();
        let dir = tempfile::tempdir().expect("tempdir");
        let api = ApiServer::start(&assets, dir.path(), &ApiServerOpts::default());
        let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
        api.kubectl_ok(&kubectl, &["create", "namespace", "tunnel-system"]);
        api.kubectl_ok(&kubectl, &["apply", "-k", deploy.to_str().expect("utf-8")]);
        let token = create_token(&api, &kubectl, "tunnel-system", "tunnel-cloud", &[]);
        let kubeconfig = dir.path().join("tunnel-cloud.kubeconfig");
        write_kubeconfig(&kubeconfig, &api.url, &api.pki, Credential::Token(&token));
        let tunnel_dir = dir.path().join("tunnel");
        std::fs::create_dir(&tunnel_dir).expect("tunnel dir");
        let _pki = common::Pki::new(&tunnel_dir);
        let ports: Vec<common::ClosedPort> = (0..3 * replicas)
            .map(|_| common::ClosedPort::new())
            .collect();
        let peer_addrs: Vec<String> = (0..replicas)
            .map(|r| ports[3 * r + 2].addr.to_string())
            .collect();
        let rate = rate.unwrap_or(10.0);
        let started: Vec<Daemon> = (0..replicas)
            .map(|r| {
                let [tunnel_addr, connect, peer] =
                    [0, 1, 2].map(|k| ports[3 * r + k].addr.to_string());
                let config = tunnel_dir.join(format!("cloud-{r}.toml"));
                write_toml(
                    &config,
                    &toml::toml! {
                        [tunnel]
                        listen = tunnel_addr
                        cert = "cloud.crt"
                        key = "cloud.key"
                        client_ca = "ca.crt"
                        cloud_id = (format!("cloud-{r}"))

                        [connect]
                        listen = connect

                        [peers]
                        listen = peer
                        static = (peer_addrs.clone())

                        [kubernetes]
                        enabled = true
                        edge_service_account = "tunnel-system:tunnel-edge"

                        [csr]
                        enabled = true
                        signer_name = SIGNER
                        ca_key = "ca.key"
                        rate = rate
                    },
                );
                let mut cmd = Command::new(common::BIN);
                cmd.args(["cloud", "--config"])
                    .arg(&config)
                    .env("KUBECONFIG", &kubeconfig)
                    .env("POD_NAMESPACE", "tunnel-system");
                let name: &'static str = Box::leak(format!("tunnel-cloud-{r}").into_boxed_str());
                tunnel(name, &tunnel_dir, cmd)
            })
            .collect();
        for cloud in &started {
            wait_log(cloud, "signing the edges' CSRs", Duration::from_secs(30));
            // Linked to every other replica: each decides its share from the start.
            let deadline = Instant::now() + Duration::from_secs(30);
            while count_lines(&cloud.log_text(), &["linked to replica"]) < replicas - 1 {
                assert!(Instant::now() < deadline, "{}", cloud.log_tail(20));
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        Some(Self {
            replicas: started,
            api,
            _ports: ports,
            _dir: dir,
        })
    }

    async fn client(&self) -> kube::Client {
        let kubeconfig =
            kube::config::Kubeconfig::read_from(&self.api.admin_kubeconfig).expect("kubeconfig");
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
            .await
            .expect("client config");
        kube::Client::try_from(config).expect("client")
    }
}

/// Edge `i`'s CSR, as the edge files it (`edge::csr`): a new P-256 key, CN the node.
fn fleet_csr(i: usize) -> (String, serde_json::Value) {
    let node = format!("fleet-{i:06}");
    let key = rcgen::KeyPair::generate().expect("key");
    let mut params = rcgen::CertificateParams::default();
    params.distinguished_name = rcgen::DistinguishedName::new();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, node.as_str());
    let pem = params
        .serialize_request(&key)
        .and_then(|r| r.pem())
        .expect("request");
    use base64::Engine as _;
    let csr = serde_json::json!({
        "apiVersion": "certificates.k8s.io/v1",
        "kind": "CertificateSigningRequest",
        "metadata": {"name": format!("tunnel-edge-{node}")},
        "spec": {
            "request": base64::engine::general_purpose::STANDARD.encode(pem),
            "signerName": SIGNER,
            "usages": ["digital signature", "client auth"],
            "expirationSeconds": 3600,
        },
    });
    (node, csr)
}

/// Files `n` CSRs, each as its own node (impersonated, so the API server records
/// `system:node:<node>` as the requester), 64 at a time.
async fn file_all(client: &kube::Client, csrs: Vec<(String, serde_json::Value)>) {
    let results: Vec<Result<(), String>> = futures::stream::iter(csrs)
        .map(|(node, body)| {
            let client = client.clone();
            async move {
                let mut request =
                    http::Request::post("/apis/certificates.k8s.io/v1/certificatesigningrequests")
                        .header("Content-Type", "application/json")
                        .header("Impersonate-User", format!("system:node:{node}"))
                        .header("Impersonate-Group", "system:nodes")
                        .body(serde_json::to_vec(&body).expect("json"))
                        .expect("request");
                request.headers_mut().append(
                    "Impersonate-Group",
                    http::HeaderValue::from_static("system:authenticated"),
                );
                client
                    .request::<CertificateSigningRequest>(request)
                    .await
                    .map(drop)
                    .map_err(|e| e.to_string())
            }
        })
        .buffer_unordered(64)
        .collect()
        .await;
    let failed: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(
        failed.is_empty(),
        "{} filings failed: {:?}",
        failed.len(),
        failed.first()
    );
}

/// The signer's CSRs: how many issued, and how many denied or failed (with one reason).
async fn tally(api: &Api<CertificateSigningRequest>) -> (usize, usize, Option<String>) {
    let fields = format!("spec.signerName={SIGNER}");
    let mut params = ListParams::default().fields(&fields).limit(500);
    let (mut issued, mut refused, mut why) = (0, 0, None);
    loop {
        let page = api.list(&params).await.expect("list CSRs");
        for csr in &page.items {
            let status = csr.status.as_ref();
            let conditions = status
                .and_then(|s| s.conditions.as_deref())
                .unwrap_or_default();
            if let Some(c) = conditions.iter().find(|c| c.type_ != "Approved") {
                refused += 1;
                why = Some(format!(
                    "{}: {}",
                    c.type_,
                    c.message.clone().unwrap_or_default()
                ));
            } else if status.is_some_and(|s| s.certificate.is_some()) {
                issued += 1;
            }
        }
        match page.metadata.continue_ {
            Some(token) if !token.is_empty() => params = params.continue_token(&token),
            _ => return (issued, refused, why),
        }
    }
}

/// What one bootstrap of the fleet took.
struct Bootstrap {
    filed: Duration,
    all_issued: Duration,
    /// CSRs each replica signed.
    signed: Vec<usize>,
    /// Writes each replica lost to another replica (409).
    conflicts: Vec<usize>,
}

/// Files `n` CSRs at once and waits (bounded by `bound`) until every one is issued;
/// fails on a denial.
fn bootstrap(fleet: &Fleet, n: usize, bound: Duration) -> Bootstrap {
    let csrs: Vec<_> = (0..n).map(fleet_csr).collect();
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(async {
        let client = fleet.client().await;
        let api: Api<CertificateSigningRequest> = Api::all(client.clone());
        let started = Instant::now();
        file_all(&client, csrs).await;
        let filed = started.elapsed();
        loop {
            let (issued, refused, why) = tally(&api).await;
            assert_eq!(refused, 0, "CSRs denied or failed, e.g. {why:?}");
            if issued == n {
                break;
            }
            assert!(
                started.elapsed() < bound,
                "{issued} of {n} issued after {:?}",
                started.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let all_issued = started.elapsed();
        let logs: Vec<String> = fleet.replicas.iter().map(Daemon::log_text).collect();
        Bootstrap {
            filed,
            all_issued,
            signed: logs
                .iter()
                .map(|l| count_lines(l, &["CSR approved and signed"]))
                .collect(),
            conflicts: logs.iter().map(|l| count_lines(l, &[CONFLICT])).collect(),
        }
    })
}

/// Two replicas, 300 edges filing their CSRs at once: every CSR is issued, none denied
/// (300 requesters at once are no flood), each signed by one replica, both replicas
/// take a share, and neither loses a write to the other (the old signer had both
/// review every CSR, and one lost each write with a 409 Conflict).
#[test]
fn csr_fleet_two_replicas_decide_each_csr_once() {
    let Some(fleet) = Fleet::start(2, Some(100.0)) else {
        return;
    };
    const N: usize = 300;
    let b = bootstrap(&fleet, N, Duration::from_secs(120));
    eprintln!(
        "csr fleet: {N} CSRs issued in {:?} by 2 replicas: signed {:?}, writes lost {:?}",
        b.all_issued, b.signed, b.conflicts
    );
    assert_eq!(b.signed.iter().sum::<usize>(), N, "each signed once");
    assert!(b.signed.iter().all(|&s| s > N / 4), "shares {:?}", b.signed);
    assert_eq!(b.conflicts, [0, 0], "a replica decided another's CSR");
}

/// The measurement (not a test): the fleet's bootstrap with one replica, then two.
#[test]
#[ignore = "a measurement: run with --ignored --nocapture"]
fn csr_fleet_bootstrap_figures() {
    let n: usize = std::env::var("TUNNEL_CSR_FLEET")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_000);
    let rate: Option<f64> = std::env::var("TUNNEL_CSR_RATE")
        .ok()
        .and_then(|v| v.parse().ok());
    for replicas in [1, 2] {
        let Some(fleet) = Fleet::start(replicas, rate) else {
            return;
        };
        let b = bootstrap(&fleet, n, Duration::from_secs(3600));
        let per_second = n as f64 / b.all_issued.as_secs_f64();
        println!(
            "figure: csr fleet bootstrap: {n} edges, {replicas} replica(s), csr.rate {}: filed in {:.1?}, all issued {:.1?} after the first filing ({per_second:.1} CSRs/s), none denied; signed per replica {:?}, writes lost to another replica {:?}",
            rate.map_or("default".to_string(), |r| r.to_string()),
            b.filed,
            b.all_issued,
            b.signed,
            b.conflicts,
        );
    }
}
