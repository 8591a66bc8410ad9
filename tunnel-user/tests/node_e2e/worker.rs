//! The worker, where users run the clients of the kubelets: deploy/'s relay, which
//! carries the worker's connects to edge addresses to the replica holding the edge; a
//! pod doing what metrics-server does (its ServiceAccount token, the cluster CA, each
//! edge kubelet at its InternalIP:10250, no API server proxy); and deploy/monitoring/'s
//! Prometheus, its node list written by its `targets.sh` from `kubectl get nodes`.
//! Both pods have a network namespace of their own (the worker's CNI, `PodNetwork`), as
//! users run them: the relay's programs send their connects to the relay's listener on
//! the worker's address (`redirect.pod_port` of deploy/config/relay.toml).

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::cluster::{EDGES, FiveNodes, WORKER};
use crate::common::monitoring::{
    check_dashboard, check_rules, dashboard_panels, query, shipped_dir,
};
use crate::k8s::apiserver::ApiServer;
use crate::k8s::node::{WORKLOAD_IMAGE, run};
use crate::network::LoadBalancer;
use crate::nodes::{container_pid, daemon_pods};
use crate::verbs::edge_pod;
use crate::{NAMESPACE, figure, wait_for};

pub const RELAY_SELECTOR: &str = "app.kubernetes.io/name=tunnel-relay";
/// The pod that reads the edge kubelets as metrics-server does.
const READER: &str = "metrics-reader";
const SA_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// The peer port of the replicas (deploy/config/cloud.toml, peers.listen): a relay's
/// links.
const PEER_PORT: u16 = 9002;
/// Where the worker's pods land (deploy/config/relay.toml, redirect.pod_port).
const POD_PORT: u16 = 250;

/// deploy/'s relay Ready on the worker (and nowhere else), with its idle RSS and the
/// connections it holds: one link to each replica, and its watch of the API.
pub fn relay_on_the_worker(nodes: &FiveNodes, kubectl: &Path) {
    let api = nodes.api(0);
    let took = wait_for(Duration::from_secs(180), "the relay Ready", || {
        daemon_pods(api, kubectl, RELAY_SELECTOR)
            .iter()
            .any(|p| p.ready)
    });
    let pods = daemon_pods(api, kubectl, RELAY_SELECTOR);
    let nodes_of: Vec<&str> = pods.iter().map(|p| p.node.as_str()).collect();
    assert_eq!(nodes_of, [WORKER], "relays on {nodes_of:?}");
    let container = pods[0].container.as_deref().expect("the relay's container");
    let pid = container_pid(&nodes.worker.containerd, container);
    // Idle: no connection has been redirected yet.
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let rss_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmRSS");
    let held = connections_of(&nodes.worker.netns, &pid);
    let (programs, _) = crate::teardown::left_behind(&nodes.worker_pods_cgroup());
    figure(&format!(
        "relay on {WORKER} Ready {:.1} s after it was looked for; {} programs attached to the worker's pods' cgroup; idle RSS {:.1} MiB, TCP connections held {}: {}",
        took.as_secs_f64(),
        programs.len(),
        rss_kib as f64 / 1024.0,
        held.len(),
        held.join(", ")
    ));
    assert_eq!(programs.len(), 5, "{programs:?}");
    for m in &nodes.masters {
        let link = format!("{}:{PEER_PORT}", m.node.ip);
        let links = held.iter().filter(|c| c.ends_with(&link)).count();
        assert_eq!(links, 1, "the relay's links to {link}: {held:?}");
    }
    // Where pods land, from the one config of every node: each node's own address.
    for (name, node) in nodes
        .masters
        .iter()
        .map(|m| ("tunnel-cloud", &m.node))
        .chain([("tunnel-relay", &nodes.worker)])
    {
        let pod_listen = format!("{}:{POD_PORT}", node.ip);
        let listening = listening_in(&node.netns);
        figure(&format!(
            "{name} on {}: listening on {pod_listen} for its node's pods (redirect.pod_port, NODE_IPS {})",
            node.name, node.ip
        ));
        assert!(
            listening.contains(&pod_listen),
            "{}: {listening:?}",
            node.name
        );
    }
}

/// The TCP addresses listened on in network namespace `netns`.
fn listening_in(netns: &str) -> Vec<String> {
    let out = run(Command::new("nsenter")
        .arg(format!("--net=/run/netns/{netns}"))
        .args(["ss", "-Htln"]))
    .expect("ss");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(3).map(str::to_string))
        .collect()
}

/// The established TCP connections of process `pid` in network namespace `netns`, as
/// "local -> peer".
fn connections_of(netns: &str, pid: &str) -> Vec<String> {
    let out = run(Command::new("nsenter")
        .arg(format!("--net=/run/netns/{netns}"))
        .args(["ss", "-Htnp", "state", "established"]))
    .expect("ss");
    let owner = format!("pid={pid},");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains(&owner))
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            Some(format!("{} -> {}", f.get(2)?, f.get(3)?))
        })
        .collect()
}

/// A pod on the worker with a ServiceAccount bound to what metrics-server's chart grants
/// (`nodes/metrics`, `nodes/stats`) reads `/metrics/resource` and `/stats/summary` from
/// each edge kubelet at its InternalIP:10250 with curl, as metrics-server does: its
/// token, the cluster CA, through the relay. Prints each edge's CPU and memory; a path
/// its RBAC does not grant (`/pods`, nodes/proxy) is refused by the kubelet.
pub fn metrics_server_reads_from_a_worker_pod(nodes: &FiveNodes, kubectl: &Path) {
    let api = nodes.api(0);
    api.apply(
        kubectl,
        &format!(
            "apiVersion: v1
kind: ServiceAccount
metadata: {{name: {READER}, namespace: default}}
---
# What metrics-server's chart grants its ServiceAccount on the kubelets.
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {{name: {READER}}}
rules:
  - apiGroups: [\"\"]
    resources: [nodes/metrics, nodes/stats]
    verbs: [get]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {{name: {READER}}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: {READER}}}
subjects: [{{kind: ServiceAccount, name: {READER}, namespace: default}}]
---
apiVersion: v1
kind: Pod
metadata: {{name: {READER}, namespace: default}}
spec:
  nodeName: {WORKER}
  serviceAccountName: {READER}
  tolerations: [{{operator: Exists}}]
  containers:
    - name: main
      image: {WORKLOAD_IMAGE}
      imagePullPolicy: Never
      command: [sleep, '3600']
"
        ),
    );
    wait_for(Duration::from_secs(90), "the reader pod running", || {
        api.kubectl(kubectl, &["exec", READER, "--", "true"])
            .status
            .success()
    });
    in_its_own_network(nodes, kubectl, "default", &["pod", READER]);
    for (i, edge) in EDGES.iter().enumerate() {
        let ip = nodes.edge_ip(i);
        let read = |path: &str| read_kubelet(api, kubectl, &format!("https://{ip}:10250{path}"));
        let (resource, summary) = (read("/metrics/resource"), read("/stats/summary"));
        let (resource, summary) = (
            resource.unwrap_or_else(|e| panic!("{edge}: {e}\n{}", nodes.context())),
            summary.unwrap_or_else(|e| panic!("{edge}: {e}\n{}", nodes.context())),
        );
        let sample = |name: &str| {
            resource
                .lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
                .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
                .unwrap_or_else(|| panic!("{edge}: no {name} in /metrics/resource:\n{resource}"))
        };
        let (cpu_seconds, memory) = (
            sample("node_cpu_usage_seconds_total"),
            sample("node_memory_working_set_bytes"),
        );
        let summary: Value = serde_json::from_str(&summary).expect("stats/summary is JSON");
        assert_eq!(summary["node"]["nodeName"], *edge);
        let node = &summary["node"];
        figure(&format!(
            "metrics-server's reads from a pod on {WORKER}, {edge} at {ip}:10250: /metrics/resource node CPU {cpu_seconds:.1} s, working set {:.1} MiB; /stats/summary CPU {} nanocores, working set {} bytes, {} pods",
            memory / 1048576.0,
            node["cpu"]["usageNanoCores"],
            node["memory"]["workingSetBytes"],
            summary["pods"].as_array().map_or(0, Vec::len)
        ));
        assert!(memory > 0.0 && node["memory"]["workingSetBytes"].as_u64() > Some(0));
    }
    let ip = nodes.edge_ip(0);
    let refused = read_kubelet(api, kubectl, &format!("https://{ip}:10250/pods"));
    figure(&format!(
        "the same token for {}'s /pods (nodes/proxy, not granted): {}",
        EDGES[0],
        refused.as_ref().map_or_else(|e| e.trim(), |_| "read")
    ));
    assert!(
        refused.as_ref().is_err_and(|e| e.contains("403")),
        "{refused:?}"
    );
}

/// The pod `pod` (`["pod", NAME]`, or `["pods", "-l", SELECTOR]` for one) in `namespace`
/// has an address of its own on the worker's pod network, not the worker's: printed and
/// asserted. Its address.
fn in_its_own_network(nodes: &FiveNodes, kubectl: &Path, namespace: &str, pod: &[&str]) -> String {
    let api = nodes.api(0);
    let mut args = vec!["-n", namespace, "get"];
    args.extend(pod);
    let listed = pod.contains(&"-l");
    let pod = pod.join(" ");
    let path = if listed {
        "{.items[0].status"
    } else {
        "{.status"
    };
    let jsonpath = format!("jsonpath={path}.podIP}} {path}.hostIP}} {path}.phase}}");
    args.extend(["-o", &jsonpath]);
    let mut seen = String::new();
    wait_for(
        Duration::from_secs(90),
        "the pod running with its address",
        || {
            let out = api.kubectl(kubectl, &args);
            seen = String::from_utf8_lossy(&out.stdout).into_owned();
            out.status.success() && seen.ends_with(" Running")
        },
    );
    let mut fields = seen.split(' ');
    let (pod_ip, host_ip) = (fields.next().unwrap_or(""), fields.next().unwrap_or(""));
    let network = nodes
        .worker
        .pods
        .as_ref()
        .expect("the worker's pod network");
    figure(&format!(
        "{pod} on {WORKER}: its own network namespace, address {pod_ip} on {} ({}), the node's {host_ip}",
        network.bridge, network.subnet
    ));
    assert_ne!(pod_ip, host_ip, "{pod} uses the host network");
    assert_eq!(host_ip, nodes.worker.ip.to_string());
    let prefix = network.subnet.trim_end_matches("0/24");
    assert!(
        pod_ip.starts_with(prefix),
        "{pod} at {pod_ip}, not on {}",
        network.subnet
    );
    pod_ip.to_string()
}

/// What the reader pod on the worker is refused. The relay's listener for pods, on the
/// worker's address, dialled directly: closed, as it carries only connects its programs
/// redirected (no open proxy), and the relay says so. And a connect to an edge whose
/// node no replica holds a tunnel to (a Node the test adds, with no kubelet): it fails
/// at once with "host is down" (EHOSTDOWN, the relay's program), as on a master. The
/// Node is deleted again.
pub fn what_a_pod_is_refused(nodes: &FiveNodes, kubectl: &Path) {
    let api = nodes.api(0);
    let pod_listen = format!("{}:{POD_PORT}", nodes.worker.ip);
    let direct = api.kubectl(
        kubectl,
        &[
            "exec",
            READER,
            "--",
            "sh",
            "-c",
            &format!(
                "printf 'GET /metrics HTTP/1.0\\r\\n\\r\\n' | nc -w 5 {} {POD_PORT}",
                nodes.worker.ip
            ),
        ],
    );
    let relay = daemon_pods(api, kubectl, RELAY_SELECTOR);
    let relay = &relay.first().expect("the relay's pod").name;
    let said = "connection on the redirect listener without an original destination";
    let mut logged = String::new();
    wait_for(
        Duration::from_secs(10),
        "the relay's word on a direct dial",
        || {
            logged = api.kubectl_ok(kubectl, &["-n", NAMESPACE, "logs", relay]);
            logged.contains(said)
        },
    );
    let line = logged.lines().find(|l| l.contains(said)).unwrap_or("");
    figure(&format!(
        "the relay's pod listener {pod_listen} dialled directly from the reader pod: {} bytes back; the relay: {}",
        direct.stdout.len(),
        line.trim()
    ));
    assert!(
        direct.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&direct.stdout)
    );

    // In the edges' range (198.18.<pid>.x), past the addresses the test's edges take.
    let ip = std::net::Ipv4Addr::new(198, 18, std::process::id() as u8, 250);
    api.apply(
        kubectl,
        &format!(
            "apiVersion: v1
kind: Node
metadata:
  name: {WITHOUT_TUNNEL}
  labels: {{node-role.kubernetes.io/edge: ''}}
status:
  addresses: [{{type: InternalIP, address: '{ip}'}}]
"
        ),
    );
    // busybox's nc says why its connect failed; `time` how long it took.
    let connect = format!("time nc -w 5 {ip} 10250 </dev/null");
    let added = Instant::now();
    let said = loop {
        let out = api.kubectl(kubectl, &["exec", READER, "--", "sh", "-c", &connect]);
        let said = String::from_utf8_lossy(&out.stderr).into_owned();
        if said.contains("Host is down") {
            break said;
        }
        // Until the relay's Node watch has it, the connect goes where it was dialled.
        assert!(
            added.elapsed() < Duration::from_secs(30),
            "a pod's connect to {ip}:10250, an edge without tunnel: {said}"
        );
        std::thread::sleep(Duration::from_millis(250));
    };
    let took = added.elapsed();
    api.kubectl_ok(kubectl, &["delete", "node", WITHOUT_TUNNEL, "--wait=false"]);
    let real = said
        .lines()
        .find_map(|l| l.trim().strip_prefix("real"))
        .unwrap_or("?")
        .trim();
    figure(&format!(
        "a pod on {WORKER} to {ip}:10250 ({WITHOUT_TUNNEL}, labelled an edge, no tunnel): {}, in {real} ({:.1} s after the Node was added)",
        said.lines()
            .find(|l| l.contains("Host is down"))
            .unwrap_or("")
            .trim(),
        took.as_secs_f64()
    ));
}

/// The Node of [`what_a_pod_is_refused`].
const WITHOUT_TUNNEL: &str = "edge-without-tunnel";

/// GET `url` from the reader pod with curl, its ServiceAccount token and the cluster CA:
/// the body, or curl's error.
fn read_kubelet(api: &ApiServer, kubectl: &Path, url: &str) -> Result<String, String> {
    let curl = format!(
        r#"curl -sS --fail-with-body --max-time 10 --cacert {SA_DIR}/ca.crt -H "Authorization: Bearer $(cat {SA_DIR}/token)" {url}"#
    );
    let out = api.kubectl(kubectl, &["exec", READER, "--", "sh", "-c", &curl]);
    let body = String::from_utf8_lossy(&out.stdout).into_owned();
    match out.status.success() {
        true => Ok(body),
        false => Err(format!(
            "{url}: {body} {}",
            String::from_utf8_lossy(&out.stderr)
        )),
    }
}

/// deploy/monitoring/'s Prometheus in a pod on the worker.
pub struct Prometheus {
    /// `http://<forwarder>`: the pod's :9090, through [`Self::_forwarder`].
    pub base: String,
    pub overlay: std::path::PathBuf,
    /// On the host's loopback, dialling the pod from the worker's network namespace:
    /// only the worker routes to its pods.
    _forwarder: LoadBalancer,
}

/// `kubectl apply -k` of deploy/monitoring/ (an overlay: a 5 s scrape interval so the
/// rollout's window holds scrapes), its node list by `targets.sh`; then every edge
/// target `up`, printed with its scrape duration, and a cAdvisor series of each edge's
/// pod.
pub fn prometheus_on_the_worker(nodes: &FiveNodes, kubectl: &Path) -> Prometheus {
    let api = nodes.api(0);
    let overlay = write_monitoring_overlay(nodes.dir.path());
    let applied = Instant::now();
    api.kubectl_ok(
        kubectl,
        &["apply", "-k", crate::install::overlay_arg(&overlay)],
    );
    let targets = run(Command::new(shipped_dir().join("targets.sh"))
        .env("KUBECTL", kubectl)
        .env("KUBECONFIG", &api.admin_kubeconfig))
    .expect("deploy/monitoring/targets.sh");
    figure(&format!(
        "deploy/monitoring/targets.sh: {}",
        String::from_utf8_lossy(&targets.stderr)
            .trim()
            .replace('\n', "; ")
    ));
    let pod = ["pods", "-l", "app.kubernetes.io/name=prometheus"];
    let pod_ip = in_its_own_network(nodes, kubectl, "tunnel-monitoring", &pod);
    let pod: std::net::IpAddr = pod_ip.parse().expect("Prometheus' pod address");
    let forwarder = LoadBalancer::start_dialling_from(
        "127.0.0.1:0".parse().expect("loopback"),
        vec![std::net::SocketAddr::new(pod, 9090)],
        Some(&nodes.worker.netns),
    )
    .expect("a forwarder to Prometheus");
    let prometheus = Prometheus {
        base: format!("http://{}", forwarder.listen),
        overlay,
        _forwarder: forwarder,
    };
    wait_for(
        Duration::from_secs(240),
        "every edge target of Prometheus up",
        || {
            edge_targets(&prometheus.base)
                .is_ok_and(|t| t.len() == 2 * EDGES.len() && t.iter().all(|t| t["health"] == "up"))
        },
    );
    figure(&format!(
        "Prometheus on {WORKER}: every edge target up {:.1} s after kubectl apply -k",
        applied.elapsed().as_secs_f64()
    ));
    for t in all_targets(&prometheus.base).expect("/api/v1/targets") {
        figure(&format!(
            "  target {} {} ({}): {}, last scrape {:.1} ms {}",
            t["labels"]["job"].as_str().unwrap_or("?"),
            t["scrapeUrl"].as_str().unwrap_or("?"),
            t["labels"]["node"]
                .as_str()
                .or(t["labels"]["host"].as_str())
                .unwrap_or("?"),
            t["health"].as_str().unwrap_or("?"),
            t["lastScrapeDuration"].as_f64().unwrap_or(f64::NAN) * 1000.0,
            t["lastError"].as_str().unwrap_or("")
        ));
    }
    for edge in EDGES {
        let expr =
            format!("container_memory_working_set_bytes{{job=\"edge-cadvisor\", node=\"{edge}\"}}");
        let samples = query(&prometheus.base, &expr).expect("a cAdvisor query");
        // The edge's pod, where cAdvisor names it; else the first cgroup it reports.
        let pod = edge_pod(edge);
        let sample = samples
            .iter()
            .find(|s| s["metric"]["pod"] == pod.as_str())
            .or(samples.first())
            .unwrap_or_else(|| panic!("no sample of {expr}"));
        figure(&format!(
            "  /api/v1/query {expr}: {} series; {} {} bytes",
            samples.len(),
            sample["metric"],
            sample["value"][1].as_str().unwrap_or("?")
        ));
    }
    prometheus
}

/// Every target Prometheus scrapes.
fn all_targets(base: &str) -> Result<Vec<Value>, String> {
    let out =
        run(Command::new("curl").args(["-sSf", "-m", "10", &format!("{base}/api/v1/targets")]))?;
    let answer: Value = serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())?;
    Ok(answer["data"]["activeTargets"]
        .as_array()
        .cloned()
        .unwrap_or_default())
}

/// The targets of the edge kubelets' two jobs.
fn edge_targets(base: &str) -> Result<Vec<Value>, String> {
    Ok(all_targets(base)?
        .into_iter()
        .filter(|t| {
            matches!(
                t["labels"]["job"].as_str(),
                Some("edge-kubelet" | "edge-cadvisor")
            )
        })
        .collect())
}

/// The overlay of deploy/monitoring/ in `dir/monitoring-overlay`: its path.
fn write_monitoring_overlay(dir: &Path) -> std::path::PathBuf {
    let overlay = dir.join("monitoring-overlay");
    std::fs::create_dir_all(&overlay).expect("overlay dir");
    let shipped = std::fs::read_to_string(shipped_dir().join("prometheus.yml"))
        .expect("deploy/monitoring/prometheus.yml");
    let config = shipped.replacen("scrape_interval: 30s", "scrape_interval: 5s", 1);
    assert_ne!(config, shipped, "prometheus.yml sets scrape_interval: 30s");
    std::fs::write(overlay.join("prometheus.yml"), config).expect("prometheus.yml");
    std::fs::copy(shipped_dir().join("rules.yml"), overlay.join("rules.yml")).expect("rules.yml");
    let shipped = std::fs::canonicalize(shipped_dir()).expect("deploy/monitoring/");
    let up = overlay.components().count() - 1;
    let base = format!(
        "{}{}",
        "../".repeat(up),
        shipped.display().to_string().trim_start_matches('/')
    );
    std::fs::write(
        overlay.join("kustomization.yaml"),
        format!(
            "resources:
  - {base}
configMapGenerator:
  - name: prometheus-config
    behavior: replace
    files: [prometheus.yml, rules.yml]
"
        ),
    )
    .expect("kustomization");
    overlay
}

/// Over the last `window` (the rollout), the scrapes of the edge kubelets Prometheus
/// made and missed (`up` 0), per job and edge, printed; their totals.
pub fn scrapes_missed(prometheus: &Prometheus, window: Duration) -> (usize, usize) {
    let range = format!("{}s", window.as_secs().max(1));
    let per = |expr: &str| -> Vec<(String, f64)> {
        query(&prometheus.base, expr)
            .unwrap_or_else(|e| panic!("{expr}: {e}"))
            .iter()
            .map(|s| {
                let key = format!(
                    "{} {}",
                    s["metric"]["job"].as_str().unwrap_or("?"),
                    s["metric"]["node"].as_str().unwrap_or("?")
                );
                (
                    key,
                    s["value"][1]
                        .as_str()
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(f64::NAN),
                )
            })
            .collect()
    };
    let jobs = "{job=~\"edge-kubelet|edge-cadvisor\"}";
    let made = per(&format!("count_over_time(up{jobs}[{range}])"));
    let ok = per(&format!("sum_over_time(up{jobs}[{range}])"));
    let fewest = per(&format!(
        "min_over_time(scrape_samples_scraped{jobs}[{range}])"
    ));
    let (mut all, mut missed) = (0, 0);
    for (key, n) in &made {
        let good = ok.iter().find(|(k, _)| k == key).map_or(0.0, |(_, v)| *v);
        let least = fewest
            .iter()
            .find(|(k, _)| k == key)
            .map_or(f64::NAN, |(_, v)| *v);
        all += *n as usize;
        missed += (*n - good) as usize;
        figure(&format!(
            "  during it, Prometheus' scrapes of {key} (up over the last {range}): made {n}, missed {}, fewest samples in one {least}",
            n - good
        ));
    }
    assert_eq!(made.len(), 2 * EDGES.len(), "{made:?}");
    (all, missed)
}

/// Every rule of deploy/monitoring/rules.yml loaded and evaluated, and every panel of
/// its dashboard returning data, against the Prometheus on the worker.
pub fn dashboard_and_rules_evaluate(prometheus: &Prometheus) {
    let rules = check_rules(&prometheus.base).unwrap_or_else(|e| panic!("{e}"));
    figure(&format!(
        "rules.yml against Prometheus on {WORKER}: {} rules loaded and evaluated: {}",
        rules.len(),
        rules.join(", ")
    ));
    let panels = check_dashboard(&prometheus.base, &ONLY_ON_FAILURES)
        .unwrap_or_else(|e| panic!("dashboard panels without data:\n{e}"));
    for (title, counts) in &panels {
        figure(&format!(
            "  dashboard panel {title:?}: series per query {counts:?}"
        ));
    }
    // Their counters are labelled by the reason, so a series exists only once one
    // failed (tests/monitoring.rs makes them fail): here they must parse and evaluate.
    for panel in dashboard_panels() {
        if ONLY_ON_FAILURES.contains(&panel.title.as_str()) {
            for expr in &panel.exprs {
                let samples = query(&prometheus.base, expr).unwrap_or_else(|e| panic!("{e}"));
                figure(&format!(
                    "  dashboard panel {:?}: {expr} evaluates, {} series (none failed)",
                    panel.title,
                    samples.len()
                ));
            }
        }
    }
}

/// The dashboard's panels that show failures only: no series until one happens.
const ONLY_ON_FAILURES: [&str; 2] = [
    "Dial failures by reason",
    "Registrations refused and sessions revoked",
];

/// The monitoring overlay and the reader's objects deleted; pods gone is the caller's
/// wait.
pub fn uninstall(api: &ApiServer, kubectl: &Path, prometheus: &Prometheus) {
    api.kubectl_ok(
        kubectl,
        &[
            "delete",
            "-k",
            crate::install::overlay_arg(&prometheus.overlay),
            "--wait=false",
            "--ignore-not-found",
        ],
    );
    for kind in ["pod", "serviceaccount", "clusterrolebinding", "clusterrole"] {
        api.kubectl_ok(
            kubectl,
            &["delete", kind, READER, "--wait=false", "--ignore-not-found"],
        );
    }
}
