//! `kubectl rollout restart` of each DaemonSet while kubectl calls through the tunnel
//! run in a loop: the calls made and failed (with one master none may fail; with two,
//! see [`cloud_restart_with_two_replicas`]) and the longest gap without a working one.

use std::net::IpAddr;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::cluster::{EDGES, FiveNodes};
use crate::k8s::apiserver::ApiServer;
use crate::k8s::checks::POD;
use crate::nodes::{cloud_log, cloud_log_if_there, cloud_pods, daemon_pods};
use crate::verbs::{WORKLOAD, edge_pod};
use crate::{EDGE_SELECTOR, NAMESPACE, figure, wait_for};

/// Calls through the tunnel (kubectl, or a scrape), made one after the other in a loop
/// on a thread of its own, each with the stdout it must print.
pub struct CallLoop {
    stop: Arc<AtomicBool>,
    last_failure: Arc<Mutex<Option<Instant>>>,
    thread: std::thread::JoinHandle<Calls>,
}

/// What a [`CallLoop`] saw.
pub struct Calls {
    pub made: usize,
    /// Each failed call: its command line and what it said.
    pub failed: Vec<String>,
    /// The longest time without a call that worked.
    pub longest_gap: Duration,
    /// When the last failed call ended.
    pub last_failure: Option<Instant>,
}

impl CallLoop {
    /// Cycles through `calls` (a command line and the stdout it must print), each call
    /// bounded by 20 s, at most 2,000 calls in all.
    pub fn start(calls: Vec<(Vec<String>, String)>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let last_failure = Arc::new(Mutex::new(None));
        let (stopped, failed_at) = (stop.clone(), last_failure.clone());
        let thread = std::thread::spawn(move || {
            let mut seen = Calls {
                made: 0,
                failed: Vec::new(),
                longest_gap: Duration::ZERO,
                last_failure: None,
            };
            let mut last_ok = Instant::now();
            for (argv, want) in calls.iter().cycle().take(2000) {
                if stopped.load(Ordering::Relaxed) {
                    break;
                }
                seen.made += 1;
                match call(argv, want) {
                    Ok(()) => {
                        seen.longest_gap = seen.longest_gap.max(last_ok.elapsed());
                        last_ok = Instant::now();
                    }
                    Err(e) => {
                        seen.failed.push(e);
                        seen.last_failure = Some(Instant::now());
                        *failed_at.lock().expect("last failure") = seen.last_failure;
                    }
                }
            }
            seen.longest_gap = seen.longest_gap.max(last_ok.elapsed());
            seen
        });
        Self {
            stop,
            last_failure,
            thread,
        }
    }

    /// When the last failed call so far ended.
    pub fn last_failure(&self) -> Option<Instant> {
        *self.last_failure.lock().expect("last failure")
    }

    /// Stops the loop; what it saw.
    pub fn finish(self) -> Calls {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().expect("call loop")
    }
}

/// One call, bounded by 20 s: whether it printed `want`, or what it said.
fn call(argv: &[String], want: &str) -> Result<(), String> {
    let out = Command::new("timeout")
        .arg("20")
        .args(argv)
        .output()
        .expect("timeout");
    let stdout = String::from_utf8_lossy(&out.stdout);
    (out.status.success() && stdout == want)
        .then_some(())
        .ok_or_else(|| {
            format!(
                "{argv:?}: {} {stdout:?} {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            )
        })
}

/// The command line of `kubectl args` with `kubeconfig`.
pub fn kubectl_call(kubectl: &Path, kubeconfig: &Path, args: &[&str]) -> Vec<String> {
    [kubectl, Path::new("--kubeconfig"), kubeconfig]
        .iter()
        .map(|p| p.display().to_string())
        .chain(args.iter().map(|a| a.to_string()))
        .collect()
}

/// The cloud DaemonSet restarted under `kubectl logs` and `exec` of the stand-in's pod:
/// none fails, and the new pod took the old one's listeners.
pub fn cloud_restart_under_calls(api: &ApiServer, kubectl: &Path) {
    let kubeconfig = &api.admin_kubeconfig;
    let calls = CallLoop::start(vec![
        (
            kubectl_call(kubectl, kubeconfig, &["logs", POD]),
            crate::k8s::kubelet::LOG_TEXT.to_string(),
        ),
        (
            kubectl_call(kubectl, kubeconfig, &["exec", POD, "--", "echo", "ok"]),
            "ok\n".to_string(),
        ),
    ]);
    std::thread::sleep(Duration::from_secs(2));
    let restarted = Instant::now();
    api.kubectl_ok(
        kubectl,
        &[
            "rollout",
            "restart",
            "-n",
            NAMESPACE,
            "daemonset/tunnel-cloud",
        ],
    );
    let rolled = wait_for(Duration::from_secs(150), "the rollout complete", || {
        api.kubectl(
            kubectl,
            &[
                "rollout",
                "status",
                "-n",
                NAMESPACE,
                "daemonset/tunnel-cloud",
                "--timeout=10s",
            ],
        )
        .status
        .success()
    });
    // Both pods' logs while the old one drains, for a failure message.
    let logs: Vec<String> = cloud_pods(api, kubectl)
        .iter()
        .map(|p| {
            format!(
                "--- {}:\n{}",
                p.name,
                cloud_log_if_there(api, kubectl, &p.name)
            )
        })
        .collect();
    // The old pod drains after the new one took over; calls go on until it is gone.
    wait_for(Duration::from_secs(60), "the old pod gone", || {
        cloud_pods(api, kubectl).len() == 1
    });
    let Calls { made, failed, .. } = calls.finish();
    figure(&format!(
        "kubectl rollout restart complete in {:.1} s; kubectl logs/exec calls made {made}, failed {}",
        rolled.as_secs_f64(),
        failed.len()
    ));
    assert!(
        failed.is_empty(),
        "calls failed during the rollout:\n{}\ncloud logs:\n{}",
        failed.join("\n"),
        logs.join("\n")
    );
    assert!(made >= 10, "only {made} calls during the rollout");
    let pods = cloud_pods(api, kubectl);
    let new_log = cloud_log(api, kubectl, &pods[0].name);
    assert!(
        new_log.contains("took the listeners"),
        "the new pod took the old one's listeners:\n{new_log}"
    );
    figure(&format!(
        "old pod gone {:.1} s after the restart (its drain included)",
        restarted.elapsed().as_secs_f64()
    ));
}

/// The edge's DaemonSet restarted under a loop of `kubectl exec` to the workload: the
/// calls made and failed, and the longest gap without a working one. The new pod starts
/// beside the old (maxSurge), registers a second session, takes the new calls, and the
/// old one finishes its calls and leaves.
pub fn edge_restart_under_exec(api: &ApiServer, kubectl: &Path, context: &dyn Fn() -> String) {
    let calls = CallLoop::start(vec![(
        kubectl_call(
            kubectl,
            &api.admin_kubeconfig,
            &["exec", WORKLOAD, "-c", "main", "--", "echo", "ok"],
        ),
        "ok\n".to_string(),
    )]);
    std::thread::sleep(Duration::from_secs(2));
    let old_pods: Vec<String> = daemon_pods(api, kubectl, EDGE_SELECTOR)
        .into_iter()
        .map(|p| p.name)
        .collect();
    api.kubectl_ok(
        kubectl,
        &[
            "rollout",
            "restart",
            "-n",
            NAMESPACE,
            "daemonset/tunnel-edge",
        ],
    );
    // `kubectl rollout status` of a DaemonSet with maxSurge says complete once the new
    // pod is scheduled, while the old one still runs: the rollout is over when the old
    // pod is gone and the new one is Ready.
    let rolled = wait_for(
        Duration::from_secs(150),
        "the edge's rollout complete (the old pod gone, the new one Ready)",
        || match &daemon_pods(api, kubectl, EDGE_SELECTOR)[..] {
            [new] => new.ready && !old_pods.contains(&new.name),
            _ => false,
        },
    );
    // Until the new edge carries calls again, or 60 s.
    let _ = wait_for(
        Duration::from_secs(60),
        "a call through the new edge",
        || {
            api.kubectl(kubectl, &["exec", WORKLOAD, "-c", "main", "--", "true"])
                .status
                .success()
        },
    );
    std::thread::sleep(Duration::from_secs(2));
    let Calls {
        made,
        failed,
        longest_gap,
        ..
    } = calls.finish();
    figure(&format!(
        "kubectl rollout restart daemonset/tunnel-edge: old pod {old_pods:?} gone, new one Ready in {:.1} s; kubectl exec calls made {made}, failed {}, longest gap {:.1} s",
        rolled.as_secs_f64(),
        failed.len(),
        longest_gap.as_secs_f64()
    ));
    assert!(made >= 5, "only {made} calls during the edge's rollout");
    assert!(
        failed.is_empty(),
        "calls failed during the edge's rollout:\n{}\n{}",
        failed.join("\n"),
        context()
    );
}

/// The command line of a scrape of edge `edge_ip`'s kubelet `/metrics` from master-2's
/// redirected cgroup, as a Prometheus beside its API server would: it prints `ok` when
/// the kubelet's metrics came back.
fn scrape_from_master_two(nodes: &FiveNodes, edge_ip: IpAddr) -> Vec<String> {
    let master = &nodes.masters[1];
    let pki = &master.api.pki;
    let curl = format!(
        "curl -sSf --max-time 10 --cacert {} --cert {} --key {} https://{edge_ip}:10250/metrics | grep -q kubelet_running_pods && echo ok",
        pki.path("ca.crt"),
        pki.path("kubelet-client.crt"),
        pki.path("kubelet-client.key"),
    );
    [
        "nsenter".to_string(),
        format!("--net=/run/netns/{}", master.node.netns),
        "sh".into(),
        "-c".into(),
        format!(r#"echo $$ > "$0" && {{ {curl}; }}"#),
        master
            .cgroup
            .path
            .join("cgroup.procs")
            .display()
            .to_string(),
    ]
    .into()
}

/// `kubectl rollout restart daemonset/tunnel-cloud` with a replica on each master,
/// while kubectl calls through each master's API server to the pod on each edge run,
/// and scrapes of each edge kubelet's `/metrics` from master-2's redirected cgroup:
/// calls made and failed, scrapes missed, each failure printed; beside them, the
/// scrapes the Prometheus on the worker made and missed over the rollout (through the
/// relay).
pub fn cloud_restart_with_two_replicas(
    nodes: &FiveNodes,
    kubectl: &Path,
    prometheus: &crate::worker::Prometheus,
) {
    let api = nodes.api(0);
    let mut loops = Vec::new();
    for master in &nodes.masters {
        let kubeconfig = &master.api.admin_kubeconfig;
        let calls = EDGES
            .iter()
            .flat_map(|e| {
                let pod = edge_pod(e);
                [
                    (
                        kubectl_call(kubectl, kubeconfig, &["exec", &pod, "--", "echo", "ok"]),
                        "ok\n".to_string(),
                    ),
                    (
                        kubectl_call(
                            kubectl,
                            kubeconfig,
                            &["logs", &pod, "--tail=1", "--limit-bytes=5"],
                        ),
                        "tick ".to_string(),
                    ),
                ]
            })
            .collect();
        let what = format!(
            "kubectl logs/exec through {}'s API server",
            master.node.name
        );
        loops.push((what, CallLoop::start(calls)));
    }
    let scrapes = (0..EDGES.len())
        .map(|i| {
            (
                scrape_from_master_two(nodes, nodes.edge_ip(i)),
                "ok\n".to_string(),
            )
        })
        .collect();
    let what = "scrapes of each edge kubelet's /metrics from master-2's redirected cgroup";
    loops.push((what.to_string(), CallLoop::start(scrapes)));
    std::thread::sleep(Duration::from_secs(2));

    let old: Vec<String> = cloud_pods(api, kubectl)
        .into_iter()
        .map(|p| p.name)
        .collect();
    let restarted = Instant::now();
    api.kubectl_ok(
        kubectl,
        &[
            "rollout",
            "restart",
            "-n",
            NAMESPACE,
            "daemonset/tunnel-cloud",
        ],
    );
    // Over when both old pods are gone (each drains after its successor took over) and
    // both new ones are Ready.
    let rolled = wait_for(
        Duration::from_secs(240),
        "the two-replica rollout complete",
        || {
            let pods = cloud_pods(api, kubectl);
            pods.len() == 2 && pods.iter().all(|p| p.ready && !old.contains(&p.name))
        },
    );
    std::thread::sleep(Duration::from_secs(2));
    figure(&format!(
        "kubectl rollout restart daemonset/tunnel-cloud with two replicas: both replaced in {:.1} s",
        rolled.as_secs_f64()
    ));
    let (mut failures, mut all) = (Vec::new(), 0);
    for (what, calls) in loops {
        let Calls {
            made,
            failed,
            longest_gap,
            ..
        } = calls.finish();
        figure(&format!(
            "  during it, {what}: made {made}, failed {}, longest gap {:.1} s",
            failed.len(),
            longest_gap.as_secs_f64()
        ));
        assert!(made >= 5, "only {made} of {what}");
        all += made;
        for f in &failed {
            figure(&format!("    failed: {}", f.trim()));
        }
        failures.extend(failed.into_iter().map(|f| format!("{what}: {f}")));
    }
    let (scraped, missed) = crate::worker::scrapes_missed(prometheus, restarted.elapsed());
    all += scraped;
    failures.extend((0..missed).map(|_| "a scrape of Prometheus on the worker".to_string()));
    // The goal is none, which one master meets (`cloud_restart_under_calls`). With two,
    // a call to one replica for an edge the other holds, or one moving between them, is
    // at times refused, reset or failed as host down while a pod hands over: 0 to 3 in 600
    // per rollout on 1.28 and 1.36 (the figures above show each). More than 1 in 100
    // fails the test.
    assert!(
        failures.len() * 100 <= all,
        "{} of {all} calls failed during the rollout ({:.0} s):\n{}\n{}",
        failures.len(),
        restarted.elapsed().as_secs_f64(),
        failures.join("\n"),
        nodes.context()
    );
}
