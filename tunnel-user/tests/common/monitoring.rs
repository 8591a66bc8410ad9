//! deploy/monitoring/ against a real Prometheus: its dashboard's panels and its rules
//! read from the shipped files, a Prometheus process on loopback run with the shipped
//! scrape configuration, and the checks that every expression parses and every panel
//! returns data. `tests/monitoring.rs` runs them against an in-process cloud and edges;
//! a cluster test runs [`check_rules`] and [`check_dashboard`] against the Prometheus
//! of its pod (its URL), where the panels [`NEEDS_CLUSTER`] names have data too.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::{ChildGuard, ClosedPort};

/// Debian's Prometheus (scripts/setup.sh installs the `prometheus` package).
pub const PROMETHEUS: &str = "/usr/bin/prometheus";
pub const PROMTOOL: &str = "/usr/bin/promtool";

/// deploy/monitoring/, where the shipped files are.
pub fn shipped_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/monitoring")
}

/// The Prometheus image deploy/monitoring/ runs, `tunnel-prometheus:<version>` (its
/// kustomization's `newTag`, which `cargo xtask image --prometheus` checks), and the
/// archive that command leaves for `ctr -n k8s.io images import` (named
/// `docker.io/library/tunnel-prometheus:<version>`).
pub fn prometheus_image() -> (String, PathBuf) {
    let kustomization = std::fs::read_to_string(shipped_dir().join("kustomization.yaml"))
        .expect("deploy/monitoring/kustomization.yaml");
    let version = kustomization
        .lines()
        .find_map(|l| l.trim().strip_prefix("newTag: "))
        .expect("deploy/monitoring/kustomization.yaml: newTag")
        .trim_matches('"');
    let tag = format!("tunnel-prometheus:{version}");
    let archive = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!(
        "../target/image/tunnel-prometheus-{version}.oci.tar"
    ));
    (tag, archive)
}

/// The panels whose data only a cluster makes, each with why: the loopback test skips
/// them, a cluster test checks them.
pub const NEEDS_CLUSTER: [(&str, &str); 3] = [
    (
        "Redirects (eBPF)",
        "the eBPF counters exist only with [redirect], on a master",
    ),
    (
        "Carried by relays and forwarded between replicas",
        "a relay and a second replica",
    ),
    (
        "Edge kubelets through the tunnel",
        "real kubelets that take a ServiceAccount token",
    ),
];

/// A panel of dashboard.json: its title and the PromQL of each of its queries.
#[derive(Debug)]
pub struct Panel {
    pub title: String,
    pub exprs: Vec<String>,
}

/// The panels of deploy/monitoring/dashboard.json, their queries as Prometheus takes
/// them ([`promql`]).
pub fn dashboard_panels() -> Vec<Panel> {
    let path = shipped_dir().join("dashboard.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    let dashboard: Value = serde_json::from_str(&text).expect("dashboard.json is JSON");
    dashboard["panels"]
        .as_array()
        .expect("dashboard.json: panels")
        .iter()
        .map(|p| Panel {
            title: p["title"].as_str().expect("a panel's title").to_owned(),
            exprs: p["targets"]
                .as_array()
                .expect("a panel's targets")
                .iter()
                .map(|t| promql(t["expr"].as_str().expect("a target's expr")))
                .collect(),
        })
        .collect()
}

/// A dashboard query as Prometheus takes it: Grafana's `$__rate_interval` (at least
/// four scrape intervals) made a minute, which holds enough samples at the scrape
/// intervals of both the loopback test (1 s) and deploy/ (30 s, two samples).
pub fn promql(expr: &str) -> String {
    expr.replace("$__rate_interval", "1m")
}

/// `GET base + path` with curl; the body, or why not.
fn get(base: &str, path: &str, form: &[(&str, &str)]) -> Result<Value, String> {
    let mut curl = Command::new("curl");
    curl.args(["-sS", "-m", "10", "-G"]);
    for (key, value) in form {
        curl.arg("--data-urlencode").arg(format!("{key}={value}"));
    }
    let out = curl
        .arg(format!("{base}{path}"))
        .output()
        .map_err(|e| format!("curl: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "GET {base}{path}: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    serde_json::from_slice(&out.stdout).map_err(|e| {
        format!(
            "GET {base}{path}: {e}: {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// The result of an instant query of `expr` at the Prometheus at `base`
/// (`http://host:port`): its samples, or the error Prometheus gave (a parse error
/// names the position).
pub fn query(base: &str, expr: &str) -> Result<Vec<Value>, String> {
    let answer = get(base, "/api/v1/query", &[("query", expr)])?;
    if answer["status"] != "success" {
        return Err(format!(
            "{expr}: {}: {}",
            answer["errorType"], answer["error"]
        ));
    }
    Ok(answer["data"]["result"]
        .as_array()
        .cloned()
        .unwrap_or_default())
}

/// Every rule the Prometheus at `base` loaded (rules.yml), as `(name, query)`.
pub fn loaded_rules(base: &str) -> Result<Vec<(String, String)>, String> {
    let answer = get(base, "/api/v1/rules", &[])?;
    let groups = answer["data"]["groups"]
        .as_array()
        .ok_or_else(|| format!("/api/v1/rules: {answer}"))?;
    Ok(groups
        .iter()
        .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
        .map(|r| {
            (
                r["name"].as_str().unwrap_or_default().to_owned(),
                r["query"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect())
}

/// The alert names of deploy/monitoring/rules.yml, read from its `- alert:` lines.
pub fn shipped_alerts() -> Vec<String> {
    let text = std::fs::read_to_string(shipped_dir().join("rules.yml")).expect("rules.yml");
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("- alert:"))
        .map(|name| name.trim().to_owned())
        .collect()
}

/// Every rule of rules.yml is loaded by the Prometheus at `base` and its query
/// evaluates there; returns the rules' names, or what failed.
pub fn check_rules(base: &str) -> Result<Vec<String>, String> {
    let loaded = loaded_rules(base)?;
    let mut names = Vec::new();
    for alert in shipped_alerts() {
        let (name, rule) = loaded
            .iter()
            .find(|(name, _)| *name == alert)
            .ok_or_else(|| format!("rule {alert} is not loaded: {loaded:?}"))?;
        query(base, rule).map_err(|e| format!("rule {name}: {e}"))?;
        names.push(name.clone());
    }
    Ok(names)
}

/// Every query of every panel of dashboard.json but those titled in `skip` evaluates at
/// the Prometheus at `base` and returns at least one sample. Returns each panel's
/// title with its queries' sample counts, or every panel that failed.
pub fn check_dashboard(base: &str, skip: &[&str]) -> Result<Vec<(String, Vec<usize>)>, String> {
    let mut checked = Vec::new();
    let mut failed = Vec::new();
    for panel in dashboard_panels() {
        if skip.contains(&panel.title.as_str()) {
            continue;
        }
        let mut counts = Vec::new();
        for expr in &panel.exprs {
            match query(base, expr) {
                Ok(samples) if samples.is_empty() => {
                    failed.push(format!("{}: no data: {expr}", panel.title))
                }
                Ok(samples) => counts.push(samples.len()),
                Err(e) => failed.push(format!("{}: {e}", panel.title)),
            }
        }
        checked.push((panel.title, counts));
    }
    match failed.is_empty() {
        true => Ok(checked),
        false => Err(failed.join("\n")),
    }
}

/// A `prometheus` process on loopback, run with deploy/monitoring/'s prometheus.yml and
/// rules.yml made local: its files under `dir`, a one-second scrape and evaluation
/// interval. Killed when dropped.
pub struct Prometheus {
    pub url: String,
    /// Where the file_sd files go ([`Self::targets`]).
    targets: PathBuf,
    _process: ChildGuard,
    _port: ClosedPort,
}

impl Prometheus {
    /// Starts it and waits until it is ready; every file_sd list starts empty.
    pub fn start(dir: &Path) -> Result<Self, String> {
        let shipped = shipped_dir();
        let read = |name: &str| {
            std::fs::read_to_string(shipped.join(name)).map_err(|e| format!("{name}: {e}"))
        };
        let etc = dir.join("etc");
        let targets = etc.join("targets");
        let secrets = dir.join("serviceaccount");
        for d in [&targets, &secrets] {
            std::fs::create_dir_all(d).map_err(|e| e.to_string())?;
        }
        // The kubelet jobs' credentials, as a pod's ServiceAccount volume holds them;
        // they have no targets here.
        std::fs::write(secrets.join("token"), "not-a-token").map_err(|e| e.to_string())?;
        std::fs::write(secrets.join("ca.crt"), "").map_err(|e| e.to_string())?;
        let config = read("prometheus.yml")?
            .replace("/etc/prometheus/", &format!("{}/", etc.display()))
            .replace(
                "/var/run/secrets/kubernetes.io/serviceaccount/",
                &format!("{}/", secrets.display()),
            )
            .replace("scrape_interval: 30s", "scrape_interval: 1s")
            .replace("evaluation_interval: 30s", "evaluation_interval: 1s");
        std::fs::write(etc.join("prometheus.yml"), config).map_err(|e| e.to_string())?;
        std::fs::write(etc.join("rules.yml"), read("rules.yml")?).map_err(|e| e.to_string())?;
        for job in [
            "tunnel-cloud",
            "tunnel-relay",
            "tunnel-edge",
            "edge-kubelet",
        ] {
            std::fs::write(targets.join(format!("{job}.json")), "[]").map_err(|e| e.to_string())?;
        }
        // Reserved for the whole run (Go's listener sets SO_REUSEADDR too).
        let port = ClosedPort::new();
        let log = std::fs::File::create(dir.join("prometheus.log")).map_err(|e| e.to_string())?;
        let child = Command::new(PROMETHEUS)
            .arg(format!(
                "--config.file={}",
                etc.join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={}", port.addr))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| {
                format!("{PROMETHEUS}: {e} (Debian's prometheus; scripts/setup.sh installs it)")
            })?;
        let process = ChildGuard(child);
        let url = format!("http://{}", port.addr);
        if !super::wait_http_ok(&format!("{url}/-/ready"), Duration::from_secs(30)) {
            let log = std::fs::read_to_string(dir.join("prometheus.log")).unwrap_or_default();
            return Err(format!("prometheus did not become ready:\n{log}"));
        }
        Ok(Self {
            url,
            targets,
            _process: process,
            _port: port,
        })
    }

    /// Writes the file_sd list of `job` (prometheus.yml's): one target group per
    /// address, with `label` set to its name.
    pub fn targets(&self, job: &str, label: &str, targets: &[(&str, SocketAddr)]) {
        let groups: Vec<Value> = targets
            .iter()
            .map(|(name, addr)| {
                serde_json::json!({"targets": [addr.to_string()], "labels": {label: name}})
            })
            .collect();
        // Written beside and renamed: Prometheus never reads half a file.
        let path = self.targets.join(format!("{job}.json"));
        let temp = path.with_extension("tmp");
        std::fs::write(&temp, Value::Array(groups).to_string()).expect("file_sd");
        std::fs::rename(&temp, &path).expect("file_sd rename");
    }

    /// Waits until every target of `jobs` was scraped and is up, at most `bound`;
    /// returns the active targets, or what they are when the bound passed.
    pub fn wait_up(
        &self,
        jobs: &[&str],
        count: usize,
        bound: Duration,
    ) -> Result<Vec<Value>, String> {
        let deadline = Instant::now() + bound;
        loop {
            let answer = get(&self.url, "/api/v1/targets", &[("state", "active")])?;
            let active: Vec<Value> = answer["data"]["activeTargets"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .filter(|t| jobs.contains(&t["labels"]["job"].as_str().unwrap_or_default()))
                .collect();
            if active.len() == count && active.iter().all(|t| t["health"] == "up") {
                return Ok(active);
            }
            if Instant::now() > deadline {
                return Err(format!("targets of {jobs:?} not all up: {active:#?}"));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Waits until `expr` returns at least one sample, at most `bound`.
    pub fn wait_for(&self, expr: &str, bound: Duration) -> Result<Vec<Value>, String> {
        let deadline = Instant::now() + bound;
        loop {
            let samples = query(&self.url, expr)?;
            if !samples.is_empty() {
                return Ok(samples);
            }
            if Instant::now() > deadline {
                return Err(format!("no data for {expr} within {bound:?}"));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The alerts Prometheus holds now (pending or firing).
    pub fn alerts(&self) -> Result<Vec<Value>, String> {
        let answer = get(&self.url, "/api/v1/alerts", &[])?;
        Ok(answer["data"]["alerts"]
            .as_array()
            .cloned()
            .unwrap_or_default())
    }
}
