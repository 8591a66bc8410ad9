//! With `redirect.pin_dir` the programs outlive the process: a restarted or replaced
//! cloud adopts them.

use super::*;

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
    // Below 1024, as the config asks with pins.
    let redirect = common::ClosedPort::privileged([127, 0, 0, 1].into());
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
pub(super) struct TestBpffs(pub(super) std::path::PathBuf);

impl TestBpffs {
    pub(super) fn mount(at: std::path::PathBuf) -> Self {
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
    // Below 1024, as the config asks with pins.
    let redirect = common::ClosedPort::privileged([127, 0, 0, 1].into());
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
    let redirect6 = common::ClosedPort::try_privileged(std::net::Ipv6Addr::LOCALHOST.into()).ok();
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
    let programs = |what: &str| assert_one_program_per_hook(&cg, what);
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
        assert_outcomes(
            &outcomes,
            phase,
            signal == nix::sys::signal::Signal::SIGTERM,
        );
    }

    stop_with_the_pins_then_uninstall(cloud, &cg, ip, &config_path, &pin_dir).await;
}

/// The loop client's outcomes over one phase of replacements: every failure fast; none
/// at all in a rolling update (`handed_over`); after kill -9, at most one accepted
/// connection lost per kill (the rest refused while no process listened).
fn assert_outcomes(outcomes: &std::path::Path, phase: &str, handed_over: bool) {
    let text = std::fs::read_to_string(outcomes).expect("outcomes");
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
    if handed_over {
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

/// The last cloud stopped with the pins in place: still attached, connects refused at
/// once; then `tunnel cloud --uninstall-redirect` leaves nothing attached and no pin.
async fn stop_with_the_pins_then_uninstall(
    mut cloud: Proc,
    cg: &TestCgroup,
    ip: &str,
    config_path: &std::path::Path,
    pin_dir: &std::path::Path,
) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(cloud.pid()),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("SIGTERM the cloud");
    assert_eq!(cloud.wait_exit(Duration::from_secs(15)), Some(0));
    assert_one_program_per_hook(cg, "stopped with pins");
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
        .arg(config_path)
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
        let shown = bpftool_show(cg);
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

/// Five programs attached to `cg` (one per hook), whatever process linked them.
fn assert_one_program_per_hook(cg: &TestCgroup, what: &str) {
    let shown = bpftool_show(cg);
    assert_eq!(
        shown.lines().filter(|l| l.contains("multi")).count(),
        5,
        "{what}: one program per hook: {shown}"
    );
}
