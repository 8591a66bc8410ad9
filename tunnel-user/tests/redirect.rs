//! The transparent redirect end to end (privileged): a client in a child cgroup dials an
//! edge node's IP:10250 and lands, through tunnel-cloud and tunnel-edge, on the
//! "kubelet" behind the edge, with TLS verified end to end. Each test makes its own
//! child cgroup and edge address; nothing attaches to the root cgroup.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::netns::EdgeNetns;
use common::privileged::{TestCgroup, cannot_run, test_cgroup};
use common::servers::hex;
use common::{ChildGuard, EdgeOpts, Proc, Setup, merge, metric, path_str, probe, write_toml};
use rcgen::ExtendedKeyUsagePurpose;
use std::path::Path;
use toml::Table;

const TOKENS: &str = "edge-1:token-one\n";

/// Why these tests need root, for the loud skip.
const NEEDS: &str = "eBPF redirect tests";

/// An HTTPS server standing in for the kubelet on `ip:10250`, inside `netns` if given,
/// requiring a client certificate (the "apiserver" one it issues alongside).
fn start_kubelet(s: &Setup, ip: &str, netns: Option<&EdgeNetns>) -> ChildGuard {
    s.pki.issue(
        "kubelet",
        &[ip],
        "kubelet",
        ExtendedKeyUsagePurpose::ServerAuth,
    );
    s.pki.issue(
        "apiserver",
        &["apiserver"],
        "apiserver",
        ExtendedKeyUsagePurpose::ClientAuth,
    );
    let ip_addr: std::net::IpAddr = ip.parse().expect("an IP address");
    let accept = std::net::SocketAddr::from((ip_addr, 10250)).to_string();
    let inside: Vec<&str> = netns.map(|n| n.exec().to_vec()).unwrap_or_default();
    let mut argv = inside.clone();
    argv.extend([
        "openssl",
        "s_server",
        "-quiet",
        "-www",
        "-Verify",
        "1",
        "-CAfile",
        "ca.crt",
        "-cert",
        "kubelet.crt",
        "-key",
        "kubelet.key",
        "-accept",
        &accept,
    ]);
    let kubelet = ChildGuard(
        Command::new(argv[0])
            .current_dir(s.path())
            .args(&argv[1..])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("openssl s_server"),
    );
    // Probed from where it listens: the host cannot reach a namespace's loopback.
    let probe = format!("import socket; socket.create_connection(('{ip}', 10250), timeout=1)");
    let mut argv = inside;
    argv.extend(["python3", "-c", &probe]);
    let started = probe::eventually(Duration::from_secs(10), || {
        Command::new(argv[0])
            .args(&argv[1..])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    });
    assert!(started, "openssl s_server did not start");
    kubelet
}

fn curl_args(s: &Setup, url: &str) -> Vec<String> {
    let p = |f: &str| s.path().join(f).to_string_lossy().to_string();
    [
        "curl",
        "-sS",
        "--max-time",
        "10",
        "--cacert",
        &p("ca.crt"),
        "--cert",
        &p("apiserver.crt"),
        "--key",
        &p("apiserver.key"),
        url,
    ]
    .iter()
    .map(|a| a.to_string())
    .collect()
}

fn redirected(s: &Setup) -> f64 {
    metric(
        s.cloud_admin,
        "tunnel_connections_total{entry=\"redirect\"}",
    )
}

/// Waits (bounded) for the redirect count to reach `n`; the cloud counts a connection
/// when it accepts it, which can trail the client's exit.
fn wait_redirected(s: &Setup, n: f64) -> f64 {
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let got = redirected(s);
        if got >= n || Instant::now() > deadline {
            return got;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The cloud config for node `edge-1` at `ip`, with connects from `cgroup` to its port
/// 10250 redirected.
fn redirect_to(ip: &str, cgroup: &Path) -> Table {
    toml::toml! {
        [[node]]
        name = "edge-1"
        addresses = [ip]

        [redirect]
        enabled = true
        listen = "127.0.0.1:0"
        cgroup = (path_str(cgroup))
        ports = [10250]
    }
}

/// The edge's allowlist: its own node address `ip`, port 10250 (the kubelet).
fn allow_kubelet(ip: &str) -> Table {
    toml::toml! {
        [allow]
        targets = []
        node_addresses = [ip]
        ports = [10250]
    }
}

fn start(s: &mut Setup, cg: &TestCgroup, ip: &str) -> (Proc, Proc) {
    let cloud = s.start_cloud(redirect_to(ip, &cg.path));
    let edge = s.start_ready_edge(EdgeOpts {
        extra: allow_kubelet(ip),
        ..EdgeOpts::new("edge-1", "token-one")
    });
    (cloud, edge)
}

#[tokio::test]
async fn kubelet_behind_the_edge_is_reached_transparently_with_tls_end_to_end() {
    let Some(cg) = test_cgroup(NEEDS) else { return };
    let ip = "127.1.0.5";
    let mut s = Setup::new(TOKENS);
    let _kubelet = start_kubelet(&s, ip, None);
    let (mut cloud, edge) = start(&mut s, &cg, ip);
    let args = curl_args(&s, &format!("https://{ip}:10250/"));
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();

    // In the cgroup: redirected through the tunnel; curl verifies the kubelet's
    // certificate for 127.1.0.5, so TLS was not terminated anywhere on the way.
    let page = cg
        .run(&argv, Duration::from_secs(15))
        .await
        .expect("curl in the cgroup");
    assert!(page.contains("s_server"), "unexpected page: {page}");
    assert_eq!(
        wait_redirected(&s, 1.0),
        1.0,
        "the connection did not go through the tunnel"
    );

    // The client sees the address it dialled.
    // The client then sends bytes that are not TLS and waits for the kubelet to hang up:
    // a client that closed at once could be gone before the cloud accepted it, and its
    // original destination with it.
    let script = format!(
        "import socket; s = socket.create_connection(('{ip}', 10250)); print(s.getpeername()); \
         s.settimeout(5); s.sendall(b'GET / HTTP/1.0\\r\\n\\r\\n'); s.recv(1)"
    );
    let peer = cg
        .run(&["python3", "-c", &script], Duration::from_secs(10))
        .await
        .expect("python getpeername");
    assert_eq!(peer.trim(), format!("('{ip}', 10250)"));
    assert_eq!(wait_redirected(&s, 2.0), 2.0);

    // Outside the cgroup: straight to the kubelet, not through the tunnel.
    let out = Command::new(argv[0])
        .args(&argv[1..])
        .output()
        .expect("curl outside");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A non-edge port from inside the cgroup is left alone too.
    let other = std::net::TcpListener::bind(format!("{ip}:0")).expect("bind other port");
    let script = format!(
        "import socket; socket.create_connection(('{ip}', {}))",
        other.local_addr().unwrap().port()
    );
    cg.run(&["python3", "-c", &script], Duration::from_secs(10))
        .await
        .expect("non-edge port");
    other.set_nonblocking(true).unwrap();
    assert!(
        other.accept().is_ok(),
        "the non-edge connection should have reached its own listener"
    );
    // Nothing more is counted: the count holds still.
    assert_eq!(
        common::settled(Duration::from_millis(300), Duration::from_secs(10), || {
            redirected(&s)
        }),
        2.0,
        "outside-cgroup or non-edge connections went through the tunnel"
    );

    // A stopped edge fails at once, not after a timeout.
    drop(edge);
    // Once the cloud knows it is gone (polled, not a fixed sleep): the bound below is
    // on the failure itself.
    assert!(
        common::probe::eventually(Duration::from_secs(10), || {
            common::metric(s.cloud_admin, "tunnel_edges_connected") == 0.0
        }),
        "the cloud still lists the stopped edge"
    );
    let started = Instant::now();
    let failed = cg.run(&argv, Duration::from_secs(15)).await;
    assert!(failed.is_err(), "curl succeeded with the edge stopped");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "failure took {:?}",
        started.elapsed()
    );
    cloud.wait_log(
        "node `edge-1` has no connected edge",
        Duration::from_secs(5),
    );

    // After shutdown no program is left attached, as the kernel reports it.
    let before = bpftool_show(&cg);
    assert!(
        before.contains("connect4"),
        "programs not attached while running: {before}"
    );
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(cloud.pid()),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    assert_eq!(
        cloud.wait_exit(Duration::from_secs(10)),
        Some(0),
        "cloud did not stop on SIGTERM"
    );
    let after = bpftool_show(&cg);
    assert!(
        !after.contains("connect4") && !after.contains("sock_ops"),
        "programs still attached: {after}"
    );
}

/// The programs' aya-log records reach the cloud's log under `tunnel::ebpf`: none while
/// the filter says info, the redirect with its original destination once it says debug,
/// and none again after it goes back.
#[tokio::test]
async fn ebpf_redirect_records_follow_the_runtime_log_filter() {
    let Some(cg) = test_cgroup(NEEDS) else { return };
    // Not the other test's address: the tests run side by side, each with its kubelet.
    let ip = "127.1.0.6";
    let mut s = Setup::new(TOKENS);
    let _kubelet = start_kubelet(&s, ip, None);
    let (cloud, _edge) = start(&mut s, &cg, ip);
    let args = curl_args(&s, &format!("https://{ip}:10250/"));
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let record = format!("redirected {ip}:10250 to 127.0.0.1:");
    let records = || cloud.log_text().matches(&record).count();
    let fetch = || async {
        let page = cg
            .run(&argv, Duration::from_secs(15))
            .await
            .expect("curl in the cgroup");
        assert!(page.contains("s_server"), "unexpected page: {page}");
    };

    fetch().await;
    assert_eq!(wait_redirected(&s, 1.0), 1.0);
    assert_eq!(records(), 0, "an eBPF debug record at the info filter");

    set_log_filter(&s, "info,tunnel_user=debug,tunnel::ebpf=debug");
    fetch().await;
    cloud.wait_log(&record, Duration::from_secs(5));
    assert_eq!(records(), 1);
    // The same connection as the cloud routed it: to the node, by its original address.
    cloud.wait_log(
        &format!("original_dst={ip}:10250}}: connection closed id=2 node=edge-1"),
        Duration::from_secs(5),
    );

    set_log_filter(&s, "info");
    fetch().await;
    assert_eq!(wait_redirected(&s, 3.0), 3.0);
    assert_eq!(
        common::settled(Duration::from_millis(300), Duration::from_secs(10), || {
            records()
        }),
        1,
        "an eBPF debug record after the filter went back"
    );
}

fn set_log_filter(s: &Setup, filter: &str) {
    let out = Command::new("curl")
        .args(["-sSf", "-X", "PUT", "--data-binary", filter])
        .arg(format!("http://{}/debug/flags/v", s.cloud_admin))
        .output()
        .expect("curl PUT /debug/flags/v");
    assert!(
        out.status.success(),
        "PUT /debug/flags/v {filter}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn bpftool_show(cg: &TestCgroup) -> String {
    let out = Command::new("bpftool")
        .args(["cgroup", "show"])
        .arg(&cg.path)
        .output()
        .expect("bpftool");
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// The ids of the programs attached to the test cgroup: which process's programs.
fn attached_ids(cg: &TestCgroup) -> Vec<String> {
    let mut ids: Vec<String> = bpftool_show(cg)
        .lines()
        .filter(|l| l.contains("multi"))
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect();
    ids.sort();
    ids
}

/// Runs the trailing command (the cloud) the way containerd runs a pod on cgroup v2: in
/// cgroup `$0` (moved there first), in a cgroup namespace of its own, with a cgroup2 of
/// that namespace at `$1` (so `$1` is the pod's own cgroup) and the host's hierarchy
/// bind-mounted at `$2` beforehand, as deploy/cloud.yaml mounts it. `$3 == own` mounts
/// the namespace's own cgroup2 at `$1`; anything else leaves the host's there (the old,
/// wrong deploy shape).
const POD_CGROUP_SH: &str = r#"echo $$ > "$0/cgroup.procs" && exec unshare --cgroup --mount --propagation private sh -c '
    mount --bind "$0" "$1" || exit 1
    if [ "$2" = own ]; then umount -l "$0" && mount -t cgroup2 cgroup2 "$0" || exit 1; fi
    shift 2; exec "$@"' "$@""#;

/// tunnel-cloud in a cgroup namespace of its own (a DaemonSet pod): it attaches to a
/// cgroup named through the host's hierarchy mounted at a path of its own, exempts its
/// own (pod) cgroup by the right id, redirects a client in a sibling cgroup, and leaves
/// connections from its own cgroup alone. With the host's hierarchy mounted over its
/// own view instead, it refuses to start with an error saying so, rather than exempting
/// the wrong cgroup.
#[tokio::test]
async fn cloud_in_its_own_cgroup_namespace_exempts_its_pod_cgroup() {
    let Some(cg) = test_cgroup(NEEDS) else { return };
    let root = tunnel_user::intercept::detect_cgroup_root().expect("cgroup root");
    let pod = TestCgroup::new(&cg.path).expect("pod cgroup");
    let client = TestCgroup::new(&cg.path).expect("client cgroup");
    let ip = "127.1.0.7";
    let mut s = Setup::new(TOKENS);
    let _kubelet = start_kubelet(&s, ip, None);
    let host_view = s.path().join("host-cgroup");
    std::fs::create_dir(&host_view).expect("mount point");
    let attach_at = host_view.join(cg.path.strip_prefix(&root).expect("under root"));
    let config = redirect_to(ip, &attach_at);
    let wrapper = |view: &'static str| {
        [
            "sh".to_string(),
            "-c".into(),
            POD_CGROUP_SH.into(),
            pod.path.display().to_string(),
            root.display().to_string(),
            host_view.display().to_string(),
            view.into(),
        ]
    };

    // The old deploy shape: the host's hierarchy over the pod's own.
    let argv = wrapper("host");
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    let mut wrong = s.spawn_cloud(config.clone(), &argv);
    assert_eq!(
        wrong.wait_exit(Duration::from_secs(10)),
        Some(1),
        "cloud should refuse: {}",
        wrong.log_text()
    );
    let log = wrong.log_text();
    assert!(
        log.contains("mount the host's hierarchy at a path of its own"),
        "{log}"
    );
    drop(wrong);

    let argv = wrapper("own");
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    let mut cloud = s.spawn_cloud(config, &argv);
    s.cloud_ready(&mut cloud);
    let log = cloud.log_text();
    let pod_id = tunnel_user::intercept::cgroup_id(&pod.path).expect("pod cgroup id");
    let attach_id = tunnel_user::intercept::cgroup_id(&cg.path).expect("cgroup id");
    assert!(
        log.contains(&format!("exempt_cgroup_id={pod_id}")),
        "the exempt cgroup is the pod's ({pod_id}): {log}"
    );
    assert!(
        log.contains(&format!("cgroup_id={attach_id}")),
        "attached at the test cgroup ({attach_id}): {log}"
    );
    let _edge = s.start_ready_edge(EdgeOpts {
        extra: allow_kubelet(ip),
        ..EdgeOpts::new("edge-1", "token-one")
    });

    let args = curl_args(&s, &format!("https://{ip}:10250/"));
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let page = client
        .run(&argv, Duration::from_secs(15))
        .await
        .expect("curl in the sibling cgroup");
    assert!(page.contains("s_server"), "unexpected page: {page}");
    assert_eq!(
        wait_redirected(&s, 1.0),
        1.0,
        "the sibling was not redirected"
    );

    // From the pod's own cgroup: straight to the kubelet, not through the tunnel.
    let page = pod
        .run(&argv, Duration::from_secs(15))
        .await
        .expect("curl in the pod cgroup");
    assert!(page.contains("s_server"), "unexpected page: {page}");
    assert_eq!(
        common::settled(Duration::from_millis(300), Duration::from_secs(10), || {
            redirected(&s)
        }),
        1.0,
        "the pod's own connection was redirected"
    );
}

/// A cloud that takes its node table from the API leaves the edges its predecessor
/// pinned in place until its Node watcher has listed: its start must not send connects
/// to an edge's own address, past the tunnel. Here the API server never answers, so
/// the window in which the edge map would have been empty lasts the whole test.
#[tokio::test]
async fn a_restarted_cloud_keeps_the_pinned_edges_until_its_node_table_is_listed() {
    let Some(cg) = test_cgroup(NEEDS) else { return };
    let ip = "127.1.0.9";
    // What a connect that bypasses the tunnel would reach.
    let direct = std::net::TcpListener::bind((ip, 10250)).expect("bind the edge address");
    direct.set_nonblocking(true).expect("nonblocking");
    let mut s = Setup::new(TOKENS);
    let bpffs = TestBpffs::mount(s.path().join("bpffs"));
    let _ports = s.reserve_cloud_ports();
    let redirect = common::ClosedPort::new();
    let pinned = toml::toml! {
        [redirect]
        listen = (redirect.addr.to_string())
        pin_dir = (path_str(&bpffs.0.join("tunnel")))
    };
    let mut first_config = redirect_to(ip, &cg.path);
    merge(&mut first_config, pinned.clone());
    let mut first = s.start_cloud(first_config);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(first.pid()),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    assert_eq!(first.wait_exit(Duration::from_secs(15)), Some(0));

    let api = common::ClosedPort::new();
    let kubeconfig = s.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://{}\n    insecure-skip-tls-verify: true\nusers:\n- name: u\n  user:\n    token: t\ncontexts:\n- name: c\n  context:\n    cluster: c\n    user: u\ncurrent-context: c\n",
            api.addr
        ),
    )
    .unwrap();
    let env = format!("KUBECONFIG={}", kubeconfig.display());
    // The same redirect, but no node table of its own: it comes from the API.
    let mut second_config = redirect_to(ip, &cg.path);
    second_config.remove("node");
    merge(&mut second_config, pinned);
    merge(
        &mut second_config,
        toml::toml! { [kubernetes] enabled = true },
    );
    let mut second = s.spawn_cloud(second_config, &["env", &env]);
    s.cloud_ready(&mut second);
    second.wait_log("watch failed", Duration::from_secs(10));
    let out = cg
        .spawn(&[
            "python3",
            "-c",
            // The cloud resets the connection at once (the node is not in its table yet),
            // which on loopback may already show in connect().
            "import socket,sys\ntry:\n socket.create_connection((sys.argv[1], 10250), timeout=5)\nexcept ConnectionResetError:\n pass\nprint('reached')",
            ip,
        ])
        .expect("client")
        .wait_with_output()
        .await
        .expect("client output");
    assert!(
        matches!(direct.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "the connect went to {ip}:10250 itself: the restart emptied the edge map; client {out:?}\n{}",
        second.log_text()
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("reached"),
        "redirected to the running cloud: {out:?}\n{}",
        second.log_text()
    );
}

/// A bpffs instance of the test's own, unmounted when dropped (with whatever is pinned).
struct TestBpffs(std::path::PathBuf);

impl TestBpffs {
    fn mount(at: std::path::PathBuf) -> Self {
        std::fs::create_dir(&at).expect("bpffs mount point");
        let out = Command::new("mount")
            .args(["-t", "bpf", "bpf"])
            .arg(&at)
            .output()
            .expect("mount");
        assert!(out.status.success(), "mount -t bpf: {out:?}");
        Self(at)
    }
}

impl Drop for TestBpffs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// What the "kubelet" sends on every connection: fixed bytes the client checksums.
fn payload() -> Vec<u8> {
    (0..64 * 1024u32).map(|i| (i * 7 + i / 251) as u8).collect()
}

/// A plain TCP "kubelet" on `addr` that writes [`payload`] to every connection and
/// closes; runs until the test process exits (its thread owns the listener).
fn payload_server(addr: &str) {
    let listener = std::net::TcpListener::bind(addr).expect("bind payload server");
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let mut conn = conn;
                let _ = std::io::Write::write_all(&mut conn, &payload());
            });
        }
    });
}

/// Opens a new connection to argv[1]:argv[2] every 50 ms for argv[4] seconds, reads to
/// EOF and compares the SHA-256 with argv[3]; appends `ok` or `fail <seconds> <why>` to
/// the file argv[5] for each.
const LOOP_CLIENT_PY: &str = r#"
import hashlib, socket, sys, time
ip, port, want, secs, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), sys.argv[5]
end = time.time() + secs
with open(out, "a", buffering=1) as log:
    while time.time() < end:
        started = time.time()
        try:
            s = socket.create_connection((ip, port), timeout=5)
            s.settimeout(5)
            data = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
            s.close()
            if hashlib.sha256(data).hexdigest() != want:
                raise Exception(f"checksum mismatch ({len(data)} bytes)")
            log.write("ok\n")
        except Exception as e:
            log.write(f"fail {time.time() - started:.3f} {e}\n")
        time.sleep(0.05)
"#;

fn ok_lines(file: &std::path::Path) -> usize {
    std::fs::read_to_string(file)
        .unwrap_or_default()
        .lines()
        .filter(|l| *l == "ok")
        .count()
}

/// Waits (bounded) until the loop client has `more` successful fetches beyond `from`.
fn wait_ok(file: &std::path::Path, from: usize, more: usize) -> usize {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let now = ok_lines(file);
        if now >= from + more {
            return now;
        }
        assert!(
            Instant::now() < deadline,
            "the redirect did not work again within 20 s: {}",
            std::fs::read_to_string(file).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// With `redirect.pin_dir`, the programs outlive the process: tunnel-cloud is replaced
/// five times by SIGTERM and five times by kill -9 while a client in the redirected
/// cgroup opens a new connection and fetches a checksummed payload about 20 times a
/// second. Each new process adopts the pinned links and maps (still one program per hook
/// attached) and waits for the edge to reconnect before answering.
///
/// SIGTERM runs as a DaemonSet rolling update with `maxSurge: 1, maxUnavailable: 0`
/// does: the new process starts while the old one serves, takes its listeners over
/// `handover.socket` and stands by; then the old one gets SIGTERM, stops accepting and
/// drains. Not one request may fail. kill -9 runs as a crash: the new process starts
/// after the old one died, so the only failures are connects refused while no process
/// listens (fast, never sent around the tunnel, never left hanging) and the connection
/// open at each kill. After `tunnel cloud --uninstall-redirect`, nothing is attached and
/// no pin is left.
#[tokio::test]
async fn pinned_redirect_survives_replacement_and_uninstalls_to_nothing() {
    let Some(cg) = test_cgroup(NEEDS) else { return };
    let ip = "127.1.0.8";
    let mut s = Setup::new(TOKENS);
    payload_server(&format!("{ip}:10250"));
    let want = {
        use sha2::Digest as _;
        hex(&sha2::Sha256::digest(payload()))
    };
    let bpffs = TestBpffs::mount(s.path().join("bpffs"));
    let pin_dir = bpffs.0.join("tunnel");
    // Every process binds the same ports, on purpose: taken over with SIGTERM, bound
    // again after a kill -9. Reserved by the test throughout (ClosedPort), so no one
    // else can take them in between.
    let _ports = s.reserve_cloud_ports();
    let redirect = common::ClosedPort::new();
    let mut config = redirect_to(ip, &cg.path);
    merge(
        &mut config,
        toml::toml! {
            [redirect]
            listen = (redirect.addr.to_string())
            pin_dir = (path_str(&pin_dir))

            [handover]
            socket = (path_str(&s.path().join("handover.sock")))
        },
    );
    // None on a host without IPv6 loopback (the cloud then skips it too).
    let redirect6 = common::ClosedPort::try_hold("[::1]:0".parse().unwrap()).ok();
    if let Some(r6) = &redirect6 {
        merge(
            &mut config,
            toml::toml! { [redirect] listen6 = (r6.addr.to_string()) },
        );
    }
    let mut cloud = s.start_cloud(config);
    let config_path = s.path().join("cloud.toml");
    let _edge = s.start_ready_edge(EdgeOpts {
        extra: allow_kubelet(ip),
        ..EdgeOpts::new("edge-1", "token-one")
    });
    let programs = |what: &str| {
        let shown = bpftool_show(&cg);
        assert_eq!(
            shown.lines().filter(|l| l.contains("multi")).count(),
            5,
            "{what}: one program per hook: {shown}"
        );
    };
    programs("first start");

    for (phase, signal) in [
        ("SIGTERM", nix::sys::signal::Signal::SIGTERM),
        ("kill -9", nix::sys::signal::Signal::SIGKILL),
    ] {
        let outcomes = s.path().join(format!("outcomes-{}", signal as i32));
        let mut client = cg
            .spawn(&[
                "python3",
                "-c",
                LOOP_CLIENT_PY,
                ip,
                "10250",
                &want,
                "600",
                outcomes.to_str().expect("utf-8"),
            ])
            .expect("loop client");
        let mut ok = wait_ok(&outcomes, 0, 5);
        let cloud_args = ["cloud", "--config", config_path.to_str().expect("utf-8")];
        if signal == nix::sys::signal::Signal::SIGTERM {
            // A new process stopped while it stands by (a rollout undone before the old
            // pod went) changes nothing: the old one serves on with its own programs.
            let ids = attached_ids(&cg);
            let mut standby = Proc::start("cloud-standby", s.path(), &cloud_args);
            standby.wait_log(
                "standing by until it stops accepting",
                Duration::from_secs(10),
            );
            assert_eq!(attached_ids(&cg), ids, "linked while standing by");
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(standby.pid()), signal).unwrap();
            assert_eq!(standby.wait_exit(Duration::from_secs(15)), Some(0));
            assert!(
                standby.log_text().contains("stopped while standing by"),
                "{}",
                standby.log_text()
            );
            assert_eq!(attached_ids(&cg), ids, "the old process lost its programs");
            ok = wait_ok(&outcomes, ok, 5);
        }
        for round in 0..5 {
            let start_next = || {
                Proc::start(
                    &format!("cloud-{}-{round}", signal as i32),
                    s.path(),
                    &cloud_args,
                )
            };
            let old_ids = attached_ids(&cg);
            // Once, the pins as a release without the IPv6 maps left them: the next
            // process adopts the IPv4 maps and creates the IPv6 ones.
            let v6_maps = ["map_edges6", "map_orig6_by_cookie", "map_orig6_by_peer"];
            let cg_pins = std::fs::read_dir(pin_dir.join("v1"))
                .expect("pin dir")
                .next()
                .expect("one attach cgroup")
                .expect("entry")
                .path();
            let old_layout = round == 0 && signal == nix::sys::signal::Signal::SIGKILL;
            let next = if signal == nix::sys::signal::Signal::SIGTERM {
                let next = start_next();
                next.wait_log(
                    "standing by until it stops accepting",
                    Duration::from_secs(10),
                );
                assert_eq!(attached_ids(&cg), old_ids, "linked while standing by");
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(cloud.pid()), signal).unwrap();
                assert_eq!(cloud.wait_exit(Duration::from_secs(15)), Some(0));
                assert!(
                    cloud
                        .log_text()
                        .contains("the new tunnel cloud accepts from here on"),
                    "the old process did not hand over: {}",
                    cloud.log_text()
                );
                programs(&format!("{phase} {round}: old cloud gone"));
                assert!(
                    s.connect_unix.exists(),
                    "the old process removed the CONNECT socket the new one serves"
                );
                next
            } else {
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(cloud.pid()), signal).unwrap();
                let _ = cloud.wait_exit(Duration::from_secs(15));
                programs(&format!("{phase} {round}: no cloud running"));
                if old_layout {
                    for map in v6_maps {
                        std::fs::remove_file(cg_pins.join(map)).expect("unpin an IPv6 map");
                    }
                }
                start_next()
            };
            drop(cloud);
            cloud = next;
            cloud.wait_ready(Duration::from_secs(10));
            assert!(
                cloud.log_text().contains("adopted=true"),
                "the new process did not adopt the pinned links: {}",
                cloud.log_text()
            );
            programs(&format!("{phase} {round}: adopted"));
            if old_layout {
                for map in v6_maps {
                    assert!(cg_pins.join(map).exists(), "{map} not pinned again");
                }
            }
            assert_ne!(
                attached_ids(&cg),
                old_ids,
                "the new programs are not linked"
            );
            ok = wait_ok(&outcomes, ok, 20);
        }
        // The outcome file has every request; the loop's own deadline is only a bound.
        let _ = client.start_kill();
        let _ = client.wait().await;
        let text = std::fs::read_to_string(&outcomes).expect("outcomes");
        let made = text.lines().count();
        let failures: Vec<&str> = text.lines().filter(|l| l.starts_with("fail")).collect();
        eprintln!(
            "rolling restart by {phase} (5 replacements): {made} requests made, {} failed",
            failures.len()
        );
        for f in &failures {
            eprintln!("  {f}");
        }
        for f in &failures {
            let took: f64 = f
                .split(' ')
                .nth(1)
                .and_then(|t| t.parse().ok())
                .expect("fail line");
            assert!(
                took < 1.0,
                "a failure during {phase} took {took}s: redirected connects must fail fast"
            );
        }
        if signal == nix::sys::signal::Signal::SIGTERM {
            // The listeners never closed: the new process shared them before the old one
            // stopped accepting, and the old one drained what it had accepted.
            assert!(
                failures.is_empty(),
                "{} requests failed during the SIGTERM rolling restart",
                failures.len()
            );
        }
        // Refused: made while no process listened (between the old one's exit and the
        // new one's bind). Anything else is an accepted connection that was lost: after
        // kill -9 at most the one connection the client had open at each kill.
        let lost = failures
            .iter()
            .filter(|f| !f.contains("Connection refused"))
            .count();
        assert!(
            lost <= 5,
            "{lost} accepted connections lost during {phase} (at most 5)"
        );
    }

    // Stopped with the pins in place: still attached, connects refused at once.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(cloud.pid()),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    assert_eq!(cloud.wait_exit(Duration::from_secs(15)), Some(0));
    programs("stopped with pins");
    let started = Instant::now();
    let refused = cg
        .run(
            &[
                "python3",
                "-c",
                &format!("import socket; socket.create_connection(('{ip}', 10250), timeout=5)"),
            ],
            Duration::from_secs(10),
        )
        .await;
    assert!(
        refused.is_err(),
        "a redirected connect with no cloud succeeded"
    );
    assert!(
        format!("{refused:?}").contains("ConnectionRefused"),
        "{refused:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(2));

    let out = Command::new(common::BIN)
        .args(["cloud", "--uninstall-redirect", "--config"])
        .arg(&config_path)
        .output()
        .expect("tunnel cloud --uninstall-redirect");
    assert!(out.status.success(), "{out:?}");
    let removed = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        removed
            .lines()
            .filter(|l| l.starts_with("removed "))
            .count(),
        11,
        "five links and six maps (three per address family): {removed}"
    );
    // The kernel releases an unpinned link from a work queue (bpf_link_put), a moment
    // after the unlink returns.
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let shown = bpftool_show(&cg);
        if shown.lines().all(|l| !l.contains("multi")) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still attached 3 s after uninstall: {shown}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(!pin_dir.exists(), "pins left in {}", pin_dir.display());
}

/// An IPv6 node address: a client in the cgroup dials `https://[<ULA>]:10250/`,
/// connect6 sends it to the cloud's IPv6 redirect listener (`[::1]`, the default), the
/// cloud recovers the original destination by the client's address and the edge, inside
/// the node's namespace, dials it. TLS is verified end to end against the IP SAN, and
/// the client's getpeername shows the address it dialled. The address answers nowhere
/// on the host, so nothing but the tunnel can have carried the connection.
#[tokio::test]
async fn kubelet_on_an_ipv6_node_address_is_reached_through_the_tunnel() {
    let Some(cg) = test_cgroup(NEEDS) else { return };
    if std::net::TcpListener::bind("[::1]:0").is_err() {
        cannot_run("no IPv6 loopback for the IPv6 redirect listener");
        return;
    }
    // The node's address answers nowhere on the host (an `unreachable` route), so a
    // connect there that is not redirected fails at once.
    let (node, edge6) = match EdgeNetns::new().and_then(|mut n| Ok((n.add_edge_ip6()?, n))) {
        Ok((edge6, n)) => (n, edge6.to_string()),
        Err(e) => {
            cannot_run(&format!("cannot create the IPv6 node's namespace: {e}"));
            return;
        }
    };
    let mut s = Setup::new(TOKENS);
    // The edge, inside the namespace, reaches the cloud over the veth.
    s.tunnel = std::net::SocketAddr::from((node.host_ip, 0));
    let kubelet = start_kubelet(&s, &edge6, Some(&node));

    let cloud = s.start_cloud(redirect_to(&edge6, &cg.path));
    let edge_config = s.path().join("edge-v6.toml");
    let mut config = toml::toml! {
        node_name = "edge-1"

        [cloud]
        address = (s.tunnel.to_string())
        server_name = "tunnel-cloud"
        ca = "ca.crt"
        token = "token-one"
    };
    merge(&mut config, allow_kubelet(&edge6));
    write_toml(&edge_config, &config);
    let edge = Proc::start_via(
        "edge-v6",
        s.path(),
        &node.exec(),
        &[
            "edge",
            "--config",
            edge_config.to_str().expect("utf-8 path"),
        ],
    );
    cloud.wait_log("edge registered", Duration::from_secs(15));

    // Nothing on the host answers at the address: only the redirect can reach it.
    let mut args = curl_args(&s, &format!("https://[{edge6}]:10250/"));
    // -g: the brackets are an IPv6 literal, not a glob.
    args.insert(1, "-g".into());
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let outside = Command::new(argv[0])
        .args(&argv[1..])
        .output()
        .expect("curl outside");
    assert!(
        !outside.status.success(),
        "the IPv6 node address answered on the host"
    );
    eprintln!(
        "outside the cgroup: {}",
        String::from_utf8_lossy(&outside.stderr).trim()
    );

    // In the cgroup: through the tunnel, with curl verifying the kubelet's certificate
    // for its address.
    let page = cg
        .run(&argv, Duration::from_secs(15))
        .await
        .unwrap_or_else(|e| {
            panic!(
                "curl in the cgroup: {e}\ncloud log:\n{}\nedge log:\n{}",
                cloud.log_text(),
                edge.log_text()
            )
        });
    assert!(page.contains("s_server"), "unexpected page: {page}");
    eprintln!(
        "in the cgroup: curl https://[{edge6}]:10250/ -> {}",
        page.lines().next().unwrap_or_default()
    );
    assert_eq!(
        wait_redirected(&s, 1.0),
        1.0,
        "the connection did not go through the tunnel"
    );

    // The client sees the address it dialled (see the IPv4 test for why it waits).
    let script = format!(
        "import socket; s = socket.create_connection(('{edge6}', 10250)); print(s.getpeername()); \
         s.settimeout(5); s.sendall(b'GET / HTTP/1.0\\r\\n\\r\\n'); s.recv(1)"
    );
    let peer = cg
        .run(&["python3", "-c", &script], Duration::from_secs(10))
        .await
        .expect("python getpeername");
    eprintln!("in the cgroup: getpeername() = {}", peer.trim());
    assert_eq!(peer.trim(), format!("('{edge6}', 10250, 0, 0)"));
    assert_eq!(wait_redirected(&s, 2.0), 2.0);
    let log = cloud.log_text();
    let routed = format!("original_dst=[{edge6}]:10250");
    assert!(
        log.contains(&routed),
        "no {routed} in the cloud log:\n{log}"
    );

    // HTTP CONNECT with `[<ULA>]:10250` as the authority (curl -x sends it so),
    // from outside the cgroup: the same kubelet, TLS verified again.
    let mut args = args.clone();
    args.splice(1..1, ["-x".to_string(), format!("http://{}", s.connect)]);
    let via_connect = Command::new(&args[0])
        .args(&args[1..])
        .output()
        .expect("curl -x");
    let page = String::from_utf8_lossy(&via_connect.stdout);
    assert!(
        via_connect.status.success() && page.contains("s_server"),
        "CONNECT [{edge6}]:10250: {page} {}",
        String::from_utf8_lossy(&via_connect.stderr)
    );
    eprintln!(
        "curl -x http://{} https://[{edge6}]:10250/ -> {}",
        s.connect,
        page.lines().next().unwrap_or_default()
    );
    drop(kubelet);
}
