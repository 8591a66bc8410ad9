//! Least privilege for the process that faces the network: once it serves, the cloud
//! holds no CAP_SYS_ADMIN (nor CAP_NET_ADMIN, nor anything but what its remaining work
//! needs) on any of its threads, as `/proc/PID/task/*/status` shows; its eBPF maps are
//! still written (the outage mark set, then lifted), a reload still takes, and its
//! programs still detach when it stops.

use super::outage::{connect, until_connect};
use super::*;

/// `CAP_BPF`: what a kernel before 6.5 with `kernel.unprivileged_bpf_disabled` set asks
/// of every bpf() call, so the cloud may keep it; nothing else.
const CAP_BPF: u64 = 1 << 39;
const CAP_SYS_ADMIN: u64 = 1 << 21;

/// `(thread, CapEff, CapPrm, CapBnd)` of every thread of `pid`.
fn thread_capabilities(pid: i32) -> Vec<(String, u64, u64, u64)> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("the cloud's threads");
    let mut found = Vec::new();
    for task in tasks {
        let task = task.expect("task").path();
        let Ok(status) = std::fs::read_to_string(task.join("status")) else {
            continue; // exited meanwhile
        };
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .map(|v| u64::from_str_radix(v.trim(), 16).expect("hex"))
                .expect("capability line")
        };
        let name = status.lines().next().unwrap_or_default().to_string();
        let thread = format!("{} ({name})", task.display());
        found.push((thread, field("CapEff:"), field("CapPrm:"), field("CapBnd:")));
    }
    found
}

#[tokio::test]
async fn the_serving_cloud_holds_no_cap_sys_admin_yet_writes_its_maps_reloads_and_detaches() {
    let Some(cg) = test_cgroup(NEEDS) else { return };
    let ip = "127.1.0.13";
    // edge-1's token is not there yet: a reload brings it.
    let mut s = Setup::new("edge-0:token-zero\n");
    let _kubelet = start_kubelet(&s, ip, None);
    // Several runtime threads, all running when the cloud drops its capabilities: each
    // must drop them.
    let mut config = redirect_to(ip, &cg.path);
    merge(
        &mut config,
        toml::toml! {
            [runtime]
            worker_threads = 3
        },
    );
    // Ready: every listener serves.
    let mut cloud = s.start_cloud(config);

    let threads = thread_capabilities(cloud.pid());
    assert!(
        threads.len() >= 4,
        "the main thread and 3 workers: {threads:?}"
    );
    for (thread, effective, permitted, bounding) in &threads {
        eprintln!(
            "{thread}: CapEff {effective:016x} CapPrm {permitted:016x} CapBnd {bounding:016x}"
        );
        for (set, value) in [
            ("CapEff", effective),
            ("CapPrm", permitted),
            ("CapBnd", bounding),
        ] {
            assert_eq!(
                value & CAP_SYS_ADMIN,
                0,
                "{thread} holds CAP_SYS_ADMIN in {set} while it serves\n{}",
                cloud.log_text()
            );
            assert_eq!(
                value & !CAP_BPF,
                0,
                "{thread} holds more than CAP_BPF in {set}: {value:016x}"
            );
        }
    }

    cloud.wait_log(
        "capabilities dropped on every thread",
        Duration::from_secs(5),
    );

    // The outage mark, written after the drop: no edge holds edge-1.
    let (outcome, _) = until_connect(&cg, ip, "EHOSTDOWN").await;
    assert_eq!(outcome, "EHOSTDOWN Host is down", "{}", cloud.log_text());

    // A reload: edge-1's token enters the token file, and its edge registers with it.
    std::fs::write(
        s.path().join("tokens"),
        "edge-0:token-zero\nedge-1:token-one\n",
    )
    .expect("tokens");
    cloud.wait_log("token file reloaded", Duration::from_secs(10));
    let edge = s.start_ready_edge(EdgeOpts {
        extra: allow_kubelet(ip),
        ..EdgeOpts::new("edge-1", "token-one")
    });
    // The mark lifted (another map write): redirected through the tunnel, TLS verified.
    let (outcome, _) = until_connect(&cg, ip, "connected").await;
    assert_eq!(outcome, "connected", "{}", cloud.log_text());
    let args = curl_args(&s, &format!("https://{ip}:10250/"));
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let page = cg
        .run(&argv, Duration::from_secs(15))
        .await
        .expect("curl through the tunnel");
    assert!(page.contains("s_server"), "unexpected page: {page}");
    assert!(wait_redirected(&s, 2.0) >= 2.0, "not through the tunnel");
    drop(edge);

    // Stopped, it detaches what it attached: the connect goes where it was dialled.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(cloud.pid()),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("SIGTERM");
    assert_eq!(
        cloud.wait_exit(Duration::from_secs(20)),
        Some(0),
        "{}",
        cloud.log_text()
    );
    assert!(
        !bpftool_show(&cg).contains("connect4"),
        "programs left attached: {}",
        bpftool_show(&cg)
    );
    let (outcome, _) = connect(&cg, ip).await;
    assert_eq!(outcome, "connected", "straight to the kubelet");
}
