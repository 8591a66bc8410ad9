//! What a user runs with kubectl against a pod on the edge, through the tunnel: logs,
//! logs -f, exec -i, exec -it, attach, cp both ways, port-forward, logs --previous, each
//! asserted on what kubectl shows, with the oldest kubectl here and the newest; and
//! which protocol kube-apiserver spoke to the kubelet for each streaming call.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::privileged;
use crate::k8s::apiserver::ApiServer;
use crate::k8s::node::{WORKLOAD_IMAGE, run};
use crate::{EDGE, figure, wait_for};

/// The workload pod on the edge.
pub const WORKLOAD: &str = "workload";
/// Where its `httpd` serves `/www` on the edge's loopback (host network).
const HTTP_PORT: u16 = 18080;

/// The workload: `main` writes a numbered line every 200 ms, serves `/www` over HTTP,
/// and exits when `/tmp/restart` appears (for `logs --previous`); `echo` answers each
/// line it reads on its stdin (for `attach`). Host network: no CNI runs here.
fn workload_pod() -> String {
    format!(
        "apiVersion: v1
kind: Pod
metadata:
  name: {WORKLOAD}
  namespace: default
spec:
  nodeName: {EDGE}
  hostNetwork: true
  automountServiceAccountToken: false
  tolerations: [{{operator: Exists}}]
  containers:
    - name: main
      image: {WORKLOAD_IMAGE}
      imagePullPolicy: Never
      command:
        - sh
        - -c
        - |
          mkdir -p /www && httpd -p 127.0.0.1:{HTTP_PORT} -h /www
          i=0
          while [ ! -e /tmp/restart ]; do i=$((i+1)); echo tick $i; sleep 0.2; done
          echo restarting; exit 1
    - name: echo
      image: {WORKLOAD_IMAGE}
      imagePullPolicy: Never
      stdin: true
      command: [sh, -c, 'while read l; do echo \"attached: $l\"; done']
"
    )
}

/// Creates the workload and waits until its first line is logged.
pub fn start_workload(api: &ApiServer, kubectl: &Path) {
    api.apply(kubectl, &workload_pod());
    wait_for(Duration::from_secs(60), "the workload running", || {
        api.kubectl(kubectl, &["logs", WORKLOAD, "-c", "main"])
            .stdout
            .starts_with(b"tick 1\n")
    });
}

/// Every verb with the oldest and the newest kubectl here: 1.28 speaks SPDY to the API
/// server, 1.33 WebSockets; what the API server then speaks to the kubelet is in its
/// log, printed per kubectl.
pub fn each_kubectl_on_the_workload(api: &ApiServer, dir: &Path, context: &dyn Fn() -> String) {
    let mut seen = kubelet_upgrades(&api.log_text());
    for kubectl in edge_kubectls() {
        let user = User {
            api,
            kubectl: &kubectl,
            version: kubectl_version(&kubectl),
            context,
        };
        user.logs();
        user.logs_follow();
        user.exec_stdin();
        user.exec_tty();
        user.attach();
        user.cp_both_ways(dir);
        user.port_forward(dir);
        crate::monitoring::node_proxy_paths(&user);
        user.logs_previous();

        let version = &user.version;
        let upgrades = kubelet_upgrades(&api.log_text());
        for (call, count) in &upgrades {
            let new = count - seen.get(call).copied().unwrap_or(0);
            // On 1.28 a WebSocket try reaches the kubelet, which refuses it, and the
            // API server then falls back to SPDY: both are listed.
            if new > 0 {
                figure(&format!(
                    "{version}: kube-apiserver -> kubelet: {call}, {new} upgrade requests"
                ));
            }
        }
        for call in ["exec", "attach", "portForward"] {
            assert!(
                upgrades
                    .iter()
                    .any(|(k, n)| k.starts_with(call) && seen.get(k).copied().unwrap_or(0) < *n),
                "{version}: no {call} upgrade in kube-apiserver's log: {upgrades:?}"
            );
        }
        seen = upgrades;
    }
}

/// A user with one kubectl (`version` in each figure) against the workload.
pub struct User<'a> {
    pub api: &'a ApiServer,
    pub kubectl: &'a Path,
    pub version: String,
    pub context: &'a dyn Fn() -> String,
}

impl User<'_> {
    pub fn figure(&self, line: &str) {
        figure(&format!("{}: {line}", self.version));
    }

    /// `kubectl args`, asserted to succeed; its stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.api.kubectl(self.kubectl, args);
        assert!(
            out.status.success(),
            "kubectl {args:?}: {}: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr),
            (self.context)()
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// kubectl with the admin kubeconfig, its stdout piped, killed when the guard drops.
    fn spawn(&self, args: &[&str], stdin: bool) -> crate::common::ChildGuard {
        let child = Command::new(self.kubectl)
            .arg("--kubeconfig")
            .arg(&self.api.admin_kubeconfig)
            .args(args)
            .stdin(if stdin {
                std::process::Stdio::piped()
            } else {
                std::process::Stdio::null()
            })
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("kubectl");
        crate::common::ChildGuard(child)
    }

    /// The first field of `sha256sum` output run in the workload's `main`.
    fn sha256_in_pod(&self, file: &str) -> String {
        let out = self.ok(&["exec", WORKLOAD, "-c", "main", "--", "sha256sum", file]);
        out.split_whitespace()
            .next()
            .unwrap_or_default()
            .to_string()
    }

    fn logs(&self) {
        let logs = self.ok(&["logs", WORKLOAD, "-c", "main"]);
        self.figure(&format!(
            "kubectl logs: ok, {} lines from `tick 1`",
            logs.lines().count()
        ));
    }

    /// logs -f: lines arrive while the pod writes them.
    fn logs_follow(&self) {
        let mut follow = self.spawn(&["logs", "-f", "--tail=1", WORKLOAD, "-c", "main"], false);
        let lines = timed_lines(follow.0.stdout.take().expect("stdout"));
        let mut got = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(15);
        while got.len() < 10 && Instant::now() < deadline {
            if let Ok(l) = lines.recv_timeout(Duration::from_secs(1)) {
                got.push(l);
            }
        }
        drop(follow);
        assert!(
            got.len() >= 10,
            "kubectl logs -f: {got:?}\n{}",
            (self.context)()
        );
        let ticks: Vec<u64> = got
            .iter()
            .filter_map(|(_, l)| l.strip_prefix("tick ")?.parse().ok())
            .collect();
        assert!(
            ticks.len() == got.len() && ticks.windows(2).all(|w| w[1] == w[0] + 1),
            "kubectl logs -f: not consecutive ticks: {got:?}"
        );
        let spread = got[got.len() - 1].0 - got[0].0;
        assert!(
            spread >= Duration::from_secs(1),
            "kubectl logs -f: all at once ({spread:?})"
        );
        self.figure(&format!(
            "kubectl logs -f: ok, {} lines (tick {} to {}) arriving over {:.1} s",
            got.len(),
            ticks[0],
            ticks[ticks.len() - 1],
            spread.as_secs_f64()
        ));
    }

    /// exec: stdin, stdout, stderr and the exit code.
    fn exec_stdin(&self) {
        let out = self.api.kubectl_as(
            self.kubectl,
            &self.api.admin_kubeconfig,
            &[
                "exec",
                "-i",
                WORKLOAD,
                "-c",
                "main",
                "--",
                "sh",
                "-c",
                "tr a-z A-Z; echo to-stderr >&2; exit 3",
            ],
            Some(b"through the tunnel\n"),
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(3),
            "kubectl exec: {stderr}\n{}",
            (self.context)()
        );
        assert_eq!(String::from_utf8_lossy(&out.stdout), "THROUGH THE TUNNEL\n");
        assert!(
            stderr.contains("to-stderr"),
            "kubectl exec stderr: {stderr}"
        );
        self.figure("kubectl exec -i: ok (stdin in, stdout upper-cased, stderr, exit code 3)");
    }

    /// exec -t: a TTY (kubectl needs a terminal of its own for it: `script` gives one,
    /// sized 41x133, which kubectl sends as the TTY's first resize). The resize travels
    /// beside the command's start, so the pod reads the size a moment later: at once it
    /// may still be 0x0, which busybox's `stty size` reports as an error.
    fn exec_tty(&self) {
        let line = format!(
            "stty rows 41 cols 133; exec {} --kubeconfig {} exec -it {WORKLOAD} -c main -- sh -c 'tty; sleep 1; stty size 2>&1'",
            self.kubectl.display(),
            self.api.admin_kubeconfig.display()
        );
        let out = run(Command::new("timeout").args(["30", "script", "-qec", &line, "/dev/null"]))
            .unwrap_or_else(|e| panic!("kubectl exec -it: {e}\n{}", (self.context)()));
        // `^@`: the terminal's echo of the end of script's (empty) input.
        let shown = String::from_utf8_lossy(&out.stdout)
            .replace("^@", "")
            .replace("\r\n", " | ");
        assert!(
            shown.contains("/dev/pts/"),
            "kubectl exec -it: no TTY in the pod: {shown:?}"
        );
        assert!(
            shown.contains("41 133"),
            "kubectl exec -it: the pod's TTY is not the 41x133 kubectl's terminal has: {shown:?}"
        );
        self.figure(&format!(
            "kubectl exec -it: ok, in the pod `tty; stty size`: {shown}"
        ));
    }

    /// attach: to the `echo` container's stdin and stdout.
    fn attach(&self) {
        let mut attach = self.spawn(&["attach", "-i", WORKLOAD, "-c", "echo"], true);
        let lines = timed_lines(attach.0.stdout.take().expect("stdout"));
        let mut stdin = attach.0.stdin.take().expect("stdin");
        let deadline = Instant::now() + Duration::from_secs(20);
        let answer = loop {
            // kubectl attaches in the background; lines sent before are not lost to the
            // container but may precede the attach, so send until one comes back.
            let _ = stdin.write_all(b"hello through the tunnel\n");
            if let Ok((_, l)) = lines.recv_timeout(Duration::from_secs(1)) {
                break l;
            }
            assert!(
                Instant::now() < deadline,
                "kubectl attach: no answer\n{}",
                (self.context)()
            );
        };
        drop(stdin);
        drop(attach);
        assert_eq!(answer, "attached: hello through the tunnel");
        self.figure(&format!("kubectl attach -i: ok, {answer:?}"));
    }

    /// cp, both ways, checksummed.
    fn cp_both_ways(&self, dir: &Path) {
        let mut data = vec![0u8; 4 << 20];
        std::io::Read::read_exact(
            &mut std::fs::File::open("/dev/urandom").expect("urandom"),
            &mut data,
        )
        .expect("random");
        let up = dir.join("cp-up");
        std::fs::write(&up, &data).expect("cp-up");
        let target = format!("{WORKLOAD}:/tmp/up");
        self.ok(&["cp", "-c", "main", up.to_str().expect("utf-8"), &target]);
        let in_pod = self.sha256_in_pod("/tmp/up");
        let down = dir.join("cp-down");
        self.ok(&["cp", "-c", "main", &target, down.to_str().expect("utf-8")]);
        let back = std::fs::read(&down).expect("cp-down");
        assert_eq!(in_pod, sha256_hex(&data), "kubectl cp to the pod");
        assert_eq!(
            sha256_hex(&back),
            sha256_hex(&data),
            "kubectl cp from the pod"
        );
        self.figure(&format!(
            "kubectl cp: ok both ways, 4 MiB, sha256 {}",
            &in_pod[..16]
        ));
    }

    /// port-forward: 64 MiB from the pod's HTTP server, checksummed.
    fn port_forward(&self, dir: &Path) {
        let made = self.ok(&[
            "exec",
            WORKLOAD,
            "-c",
            "main",
            "--",
            "sh",
            "-c",
            "head -c 67108864 /dev/urandom > /www/big",
        ]);
        assert!(made.is_empty(), "{made}");
        let want = self.sha256_in_pod("/www/big");
        let mut forward = self.spawn(
            &[
                "port-forward",
                &format!("pod/{WORKLOAD}"),
                &format!(":{HTTP_PORT}"),
            ],
            false,
        );
        let lines = timed_lines(forward.0.stdout.take().expect("stdout"));
        let port = loop {
            let (_, l) = lines
                .recv_timeout(Duration::from_secs(15))
                .unwrap_or_else(|_| {
                    panic!("kubectl port-forward printed no port\n{}", (self.context)())
                });
            if let Some(rest) = l.strip_prefix("Forwarding from 127.0.0.1:") {
                break rest.split(' ').next().expect("port").to_string();
            }
        };
        let file = dir.join("forwarded");
        let started = Instant::now();
        run(Command::new("curl")
            .args(["-sf", "--max-time", "120", "-o"])
            .arg(&file)
            .arg(format!("http://127.0.0.1:{port}/big")))
        .unwrap_or_else(|e| panic!("through kubectl port-forward: {e}\n{}", (self.context)()));
        let took = started.elapsed();
        drop(forward);
        let got = std::fs::read(&file).expect("forwarded file");
        assert_eq!(got.len(), 64 << 20, "kubectl port-forward: size");
        assert_eq!(sha256_hex(&got), want, "kubectl port-forward: checksum");
        self.figure(&format!(
            "kubectl port-forward: ok, 64 MiB over HTTP in {:.1} s ({:.0} MiB/s), sha256 {}",
            took.as_secs_f64(),
            64.0 / took.as_secs_f64(),
            &want[..16]
        ));
    }

    /// logs --previous, after `main` exits and is restarted (again, for a second
    /// kubectl).
    fn logs_previous(&self) {
        let restarts = || {
            self.ok(&[
                "get",
                "pod",
                WORKLOAD,
                "-o",
                "jsonpath={.status.containerStatuses[?(@.name==\"main\")].restartCount}",
            ])
            .trim()
            .parse::<u32>()
            .unwrap_or(0)
        };
        let restarts_before = restarts();
        self.ok(&[
            "exec",
            WORKLOAD,
            "-c",
            "main",
            "--",
            "touch",
            "/tmp/restart",
        ]);
        let (api, kubectl) = (self.api, self.kubectl);
        let restarted = wait_for(Duration::from_secs(90), "main restarted", || {
            restarts() > restarts_before
                && api
                    .kubectl(kubectl, &["logs", WORKLOAD, "-c", "main"])
                    .stdout
                    .starts_with(b"tick 1\n")
                && api
                    .kubectl(kubectl, &["logs", "--previous", WORKLOAD, "-c", "main"])
                    .stdout
                    .ends_with(b"restarting\n")
        });
        let previous = self.ok(&["logs", "--previous", WORKLOAD, "-c", "main"]);
        self.figure(&format!(
            "kubectl logs --previous: ok after {:.1} s, {} lines ending {:?}",
            restarted.as_secs_f64(),
            previous.lines().count(),
            previous.lines().last()
        ));
    }
}

fn sha256_hex(data: &[u8]) -> String {
    use sha2::Digest;
    format!("{:x}", sha2::Sha256::digest(data))
}

/// Lines of `child`'s stdout as they arrive, each with when it did.
fn timed_lines(stdout: std::process::ChildStdout) -> std::sync::mpsc::Receiver<(Instant, String)> {
    use std::io::BufRead;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            if tx.send((Instant::now(), line)).is_err() {
                return;
            }
        }
    });
    rx
}

/// The kubectls the edge's verbs are run with: the oldest here and the newest (1.33).
/// A missing one is said loudly.
fn edge_kubectls() -> Vec<PathBuf> {
    let mut found = Vec::new();
    for version in ["1.28", "1.33"] {
        let path = PathBuf::from(format!("/usr/lib/google-cloud-sdk/bin/kubectl.{version}"));
        if path.is_file() {
            found.push(path);
        } else {
            privileged::cannot_run(&format!(
                "{} is absent: not checked with it",
                path.display()
            ));
        }
    }
    assert!(!found.is_empty(), "no kubectl 1.28 or 1.33");
    found
}

/// `kubectl 1.33` for `.../kubectl.1.33`.
fn kubectl_version(kubectl: &Path) -> String {
    let name = kubectl.file_name().expect("name").to_string_lossy();
    format!("kubectl {}", name.trim_start_matches("kubectl."))
}

/// kube-apiserver's upgrades to a kubelet (its proxy's log at `--vmodule=upgradeaware=6`,
/// with the request's headers: 1.36 logs them as JSON on one line, 1.28 as a Go map on
/// the next): how many calls of each kind went with which protocol.
fn kubelet_upgrades(log: &str) -> std::collections::BTreeMap<String, usize> {
    let header = |text: &str, name: &str| {
        [format!("\"{name}\":[\""), format!("{name}:[")]
            .iter()
            .find_map(|start| {
                let rest = text.split(start.as_str()).nth(1)?;
                Some(rest.split([']', '"']).next()?.to_string())
            })
    };
    let mut calls = std::collections::BTreeMap::new();
    let mut lines = log.lines().peekable();
    while let Some(line) = lines.next() {
        let Some(at) = line.find("Connecting to backend proxy") else {
            continue;
        };
        let mut text = line[at..].to_string();
        while let Some(next) = lines.peek().filter(|l| l.starts_with(' ')) {
            text += next;
            lines.next();
        }
        let Some(call) = ["/exec/", "/attach/", "/portForward/"]
            .iter()
            .find(|c| text.contains(*c))
        else {
            continue;
        };
        let tty = if text.contains("tty=1") { " -t" } else { "" };
        let protocol = match header(&text, "Upgrade") {
            Some(u) if u.eq_ignore_ascii_case("websocket") => format!(
                "WebSocket ({})",
                header(&text, "Sec-Websocket-Protocol").unwrap_or_default()
            ),
            Some(u) => format!(
                "{u} ({})",
                header(&text, "X-Stream-Protocol-Version").unwrap_or_default()
            ),
            None => "no upgrade".to_string(),
        };
        *calls
            .entry(format!("{}{tty}: {protocol}", call.trim_matches('/')))
            .or_default() += 1;
    }
    calls
}

/// The pod on edge `edge` in the five-node cluster.
pub fn edge_pod(edge: &str) -> String {
    format!("on-{edge}")
}

/// On each edge of the five-node cluster, a pod that logs a numbered line a second.
pub fn start_a_pod_on_each_edge(api: &ApiServer, kubectl: &Path, edges: &[&str]) {
    for edge in edges {
        api.apply(
            kubectl,
            &format!(
                "apiVersion: v1
kind: Pod
metadata:
  name: {pod}
  namespace: default
spec:
  nodeName: {edge}
  hostNetwork: true
  automountServiceAccountToken: false
  tolerations: [{{operator: Exists}}]
  containers:
    - name: main
      image: {WORKLOAD_IMAGE}
      imagePullPolicy: Never
      command: [sh, -c, 'i=0; while true; do i=$((i+1)); echo tick $i; sleep 1; done']
",
                pod = edge_pod(edge)
            ),
        );
    }
    wait_for(
        Duration::from_secs(90),
        "a pod running on each edge",
        || {
            edges.iter().all(|e| {
                api.kubectl(kubectl, &["logs", &edge_pod(e)])
                    .stdout
                    .starts_with(b"tick 1\n")
            })
        },
    );
}

/// `kubectl logs` and `kubectl exec` to the pod on each edge through each master's own
/// API server, each asserted and printed with how long it took.
pub fn logs_and_exec_through_either_api_server(nodes: &crate::cluster::FiveNodes, kubectl: &Path) {
    for master in &nodes.masters {
        for edge in crate::cluster::EDGES {
            let pod = edge_pod(edge);
            let asked = Instant::now();
            let logs = master.api.kubectl(kubectl, &["logs", &pod, "--tail=1"]);
            let exec = master
                .api
                .kubectl(kubectl, &["exec", &pod, "--", "echo", "ok"]);
            let took = asked.elapsed();
            assert!(
                logs.status.success() && logs.stdout.starts_with(b"tick "),
                "kubectl logs {pod} through {}'s API server: {}\n{}",
                master.node.name,
                String::from_utf8_lossy(&logs.stderr),
                nodes.context()
            );
            assert!(
                exec.status.success() && exec.stdout == b"ok\n",
                "kubectl exec {pod} through {}'s API server: {}\n{}",
                master.node.name,
                String::from_utf8_lossy(&exec.stderr),
                nodes.context()
            );
            figure(&format!(
                "through {}'s API server to {pod} on {edge}: kubectl logs {:?} and exec ok, both in {:.2} s",
                master.node.name,
                String::from_utf8_lossy(&logs.stdout).trim(),
                took.as_secs_f64()
            ));
        }
    }
}
