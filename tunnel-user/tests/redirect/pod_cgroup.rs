//! tunnel-cloud in a cgroup namespace of its own, as a DaemonSet pod runs.

use super::*;

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
