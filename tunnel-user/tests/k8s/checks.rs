//! What the end-to-end tests share: their prerequisites, the edge Node and its pod,
//! and the kubectl checks (logs, exec, port-forward) that must reach the kubelet
//! stand-in through the tunnel.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use super::apiserver::{ApiServer, Assets, Daemon};
use super::kubelet::{ECHO_PORT, Kubelet, LOG_TEXT};

/// The edge Node, and the pod on it that the kubelet stand-in serves.
pub const NODE: &str = "edge-1";
pub const POD: &str = "standin";

/// The kubectl clients to check with: 1.28 (SPDY for exec and port-forward) and 1.32
/// (websocket first, SPDY fallback). A missing one is said loudly.
pub fn kubectls() -> Vec<PathBuf> {
    let mut found = Vec::new();
    for path in [
        "/usr/lib/google-cloud-sdk/bin/kubectl.1.28",
        "/usr/lib/google-cloud-sdk/bin/kubectl.1.32",
    ] {
        if Path::new(path).is_file() {
            found.push(PathBuf::from(path));
        } else {
            crate::common::privileged::cannot_run(&format!(
                "{path} is absent: not checked with it"
            ));
        }
    }
    found
}

/// The API server's assets, root and kubectl, or None after saying loudly what is
/// missing.
pub fn prerequisites(needs_root: bool) -> Option<(Assets, Vec<PathBuf>)> {
    report_panics_at_once();
    let assets = match Assets::find() {
        Ok(a) => a,
        Err(why) => {
            crate::common::privileged::cannot_run(&format!("no real kube-apiserver: {why}"));
            return None;
        }
    };
    if needs_root && !crate::common::privileged::is_root() {
        crate::common::privileged::cannot_run(
            "this e2e test needs root (eBPF, cgroups, network namespaces)",
        );
        return None;
    }
    let kubectls = kubectls();
    if kubectls.is_empty() {
        crate::common::privileged::cannot_run("no kubectl 1.28 or 1.32");
        return None;
    }
    Some((assets, kubectls))
}

/// Sends every panic of these tests straight to stderr as it happens, as well as to the
/// harness: libtest prints a failing test's output only when the whole binary is done,
/// and a CI log that keeps only the lines around `FAILED` would lose why.
fn report_panics_at_once() {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let harness = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let test = std::thread::current().name().unwrap_or("?").to_string();
            let msg = format!("\n!!!!!!!! {test} failed: {info}\n");
            let _ = std::io::Write::write_all(&mut std::io::stderr(), msg.as_bytes());
            harness(info);
        }));
    });
}

/// The admin kubectl for setting up objects (any version does).
pub fn admin_kubectl(kubectls: &[PathBuf]) -> &Path {
    &kubectls[kubectls.len() - 1]
}

/// Waits until `daemon`'s log contains `needle`.
pub fn wait_log(daemon: &Daemon, needle: &str, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while !daemon.log_text().contains(needle) {
        assert!(
            Instant::now() < deadline,
            "{}: `{needle}` not logged within {timeout:?}:\n{}",
            daemon.name,
            daemon.log_tail(40)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The edge Node (status: its InternalIP and kubelet port) and a pod bound to it.
pub fn create_node_and_pod(api: &ApiServer, kubectl: &Path, edge_ip: &str) {
    api.apply(
        kubectl,
        &format!(
            "apiVersion: v1\nkind: Node\nmetadata:\n  name: {NODE}\n  labels:\n    node-role.kubernetes.io/edge: \"\"\n"
        ),
    );
    api.kubectl_ok(
        kubectl,
        &[
            "patch",
            "node",
            NODE,
            "--subresource=status",
            "--type=merge",
            "-p",
            &format!(
                r#"{{"status":{{"addresses":[{{"type":"InternalIP","address":"{edge_ip}"}}],"daemonEndpoints":{{"kubeletEndpoint":{{"Port":10250}}}}}}}}"#
            ),
        ],
    );
    // No controller-manager runs: the default service account is made by hand (the
    // ServiceAccount admission plugin looks it up).
    api.apply(
        kubectl,
        &format!(
            "apiVersion: v1\nkind: ServiceAccount\nmetadata:\n  name: default\n---\napiVersion: v1\nkind: Pod\nmetadata:\n  name: {POD}\nspec:\n  nodeName: {NODE}\n  automountServiceAccountToken: false\n  containers:\n  - name: main\n    image: standin\n"
        ),
    );
    // kubectl port-forward refuses a pod that is not Running; no kubelet reports it.
    api.kubectl_ok(
        kubectl,
        &[
            "patch",
            "pod",
            POD,
            "--subresource=status",
            "--type=merge",
            "-p",
            r#"{"status":{"phase":"Running"}}"#,
        ],
    );
}

/// `kubectl logs`, `exec` (stdin, stdout, stderr, exit code) and `port-forward` of the
/// stand-in's pod with each kubectl, all of which reach the stand-in through the API
/// server and the tunnel.
pub fn kubectl_checks(
    api: &ApiServer,
    kubectls: &[PathBuf],
    kubelet: &Kubelet,
    context: &dyn Fn() -> String,
) {
    for bin in kubectls {
        let name = bin.display();
        let out = api.kubectl(bin, &["logs", POD]);
        assert!(
            out.status.success(),
            "{name} logs failed: {}\nkubelet saw {:?}\n{}",
            String::from_utf8_lossy(&out.stderr),
            kubelet.requests(),
            context()
        );
        assert_eq!(String::from_utf8_lossy(&out.stdout), LOG_TEXT, "{name}");
        eprintln!("{name}: kubectl logs: ok");

        let script = "tr a-z A-Z; echo to-stderr >&2; exit 3";
        let out = api.kubectl_as(
            bin,
            &api.admin_kubeconfig,
            &["exec", "-i", POD, "--", "sh", "-c", script],
            Some(b"through the tunnel\n"),
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(3),
            "{name} exec: the command's exit code; stderr {stderr}\nkubelet saw {:?}\n{}",
            kubelet.requests(),
            context()
        );
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "THROUGH THE TUNNEL\n",
            "{name} exec stdout"
        );
        assert!(stderr.contains("to-stderr"), "{name} exec stderr: {stderr}");
        eprintln!("{name}: kubectl exec -i (stdin, stdout, stderr, exit code 3): ok");

        let forwarded = port_forward_echo(api, bin, b"ping through the tunnel\n");
        assert_eq!(
            forwarded, b"ping through the tunnel\n",
            "{name} port-forward echo"
        );
        eprintln!("{name}: kubectl port-forward: ok");
    }
}

/// The stand-in saw each kubectl's logs request, and its exec and port-forward as SPDY
/// upgrades (kubectl 1.32 tries websocket first; the stand-in refuses it, so it falls
/// back, as against a kubelet that does not speak websocket).
pub fn assert_reached_stand_in(kubelet: &Kubelet, clients: usize) {
    let seen = kubelet.requests();
    eprintln!("the kubelet stand-in saw:\n  {}", seen.join("\n  "));
    let count = |prefix: &str, upgrade: &str| {
        seen.iter()
            .filter(|r| r.starts_with(prefix) && r.ends_with(upgrade))
            .count()
    };
    assert_eq!(
        count(
            &format!("GET /containerLogs/default/{POD}/main"),
            "upgrade="
        ),
        clients,
        "{seen:?}"
    );
    assert_eq!(
        count(
            &format!("POST /exec/default/{POD}/main?"),
            "upgrade=spdy/3.1"
        ),
        clients,
        "{seen:?}"
    );
    assert_eq!(
        count(
            &format!("POST /portForward/default/{POD}"),
            "upgrade=spdy/3.1"
        ),
        clients,
        "{seen:?}"
    );
}

/// Runs `kubectl port-forward` to the stand-in's echo port, sends `payload` through
/// the local port it opens, and returns what comes back.
pub fn port_forward_echo(api: &ApiServer, bin: &Path, payload: &[u8]) -> Vec<u8> {
    use std::io::{Read, Write};
    let (guard, mut conn) = port_forward(api, bin);
    conn.write_all(payload).expect("send");
    conn.shutdown(std::net::Shutdown::Write)
        .expect("half-close");
    let mut back = Vec::new();
    let _ = conn.read_to_end(&mut back);
    drop(guard);
    back
}

/// `kubectl port-forward` to the stand-in's echo port (stopped when the guard drops),
/// and a connection to the local port it opened: one connection through the tunnel.
pub fn port_forward(
    api: &ApiServer,
    bin: &Path,
) -> (crate::common::ChildGuard, std::net::TcpStream) {
    use std::io::BufRead;
    let mut child = Command::new(bin)
        .arg("--kubeconfig")
        .arg(&api.admin_kubeconfig)
        .args([
            "port-forward",
            &format!("pod/{POD}"),
            &format!(":{ECHO_PORT}"),
        ])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("kubectl port-forward");
    let stdout = child.stdout.take().expect("stdout");
    let guard = crate::common::ChildGuard(child);
    // "Forwarding from 127.0.0.1:PORT -> 8080", within a bounded time.
    let (line_tx, line_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = std::io::BufReader::new(stdout).lines();
        while let Some(Ok(line)) = lines.next() {
            let _ = line_tx.send(line);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(15);
    let local = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = line_rx
            .recv_timeout(left)
            .unwrap_or_else(|_| panic!("{}: port-forward printed no local port", bin.display()));
        if let Some(rest) = line.strip_prefix("Forwarding from 127.0.0.1:") {
            break rest
                .split(' ')
                .next()
                .expect("port")
                .parse::<u16>()
                .expect("port number");
        }
    };
    let conn = std::net::TcpStream::connect(("127.0.0.1", local)).expect("connect forwarded port");
    conn.set_read_timeout(Some(Duration::from_secs(15)))
        .expect("timeout");
    (guard, conn)
}
