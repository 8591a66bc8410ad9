//! A client's share of an edge, where clients are told apart by their socket's cgroup:
//! every redirected client connects to the cloud from loopback, so its address says
//! nothing of who it is.

use tokio::io::AsyncBufReadExt as _;

use super::*;

/// A client in one cgroup (a pod on a master, a local user's session) keeps idle
/// connections to an edge's kubelet port until it holds its share
/// (`transport.client_share` of `max_streams_per_edge`): its next connect is reset. A
/// client in another cgroup (kube-apiserver's) still reaches the edge.
#[tokio::test]
async fn a_cgroup_holding_its_share_of_an_edge_leaves_the_rest_to_another_cgroup() {
    let Some(cg) = test_cgroup(NEEDS) else { return };
    // Both under the cgroup the programs are attached to, which they inherit.
    let greedy = TestCgroup::new(&cg.path).expect("a child cgroup");
    let apiserver = TestCgroup::new(&cg.path).expect("a child cgroup");
    // An address of its own: the tests of this binary run at once, each with its own.
    let ip = "127.1.0.32";
    let mut s = Setup::new(TOKENS);
    let kubelet = common::servers::sink(&format!("{ip}:10250"));
    let mut config = redirect_to(ip, &cg.path);
    merge(
        &mut config,
        toml::toml! {
            [transport]
            max_streams_per_edge = 8
            client_share = 0.5
        },
    );
    let _cloud = s.start_cloud(config);
    let _edge = s.start_ready_edge(EdgeOpts {
        extra: allow_kubelet(ip),
        ..EdgeOpts::new("edge-1", "token-one")
    });

    // Four idle connections, then a fifth, which the cloud resets; the four stay open
    // until the script's stdin closes.
    let hold = format!(
        "import socket, sys\n\
         held = [socket.create_connection(('{ip}', {port})) for _ in range(4)]\n\
         fifth = socket.create_connection(('{ip}', {port}))\n\
         fifth.settimeout(10)\n\
         try:\n    print('fifth:', fifth.recv(1) or 'closed', flush=True)\n\
         except ConnectionResetError:\n    print('fifth: reset', flush=True)\n\
         sys.stdin.read()\n",
        port = kubelet.port()
    );
    let mut holder = greedy
        .spawn_with_stdin(&["python3", "-c", &hold])
        .expect("the greedy client");
    let mut said = tokio::io::BufReader::new(holder.stdout.take().expect("stdout")).lines();
    let fifth = tokio::time::timeout(Duration::from_secs(20), said.next_line())
        .await
        .expect("the greedy client says how its fifth connection ended")
        .expect("its stdout");
    assert_eq!(fifth.as_deref(), Some("fifth: reset"));

    let call = format!(
        "import socket\n\
         s = socket.create_connection(('{ip}', {port}), timeout=10)\n\
         s.sendall(b'hello'); s.shutdown(socket.SHUT_WR)\n\
         print(s.makefile().readline().split()[0])\n",
        port = kubelet.port()
    );
    let answer = apiserver
        .run(&["python3", "-c", &call], Duration::from_secs(20))
        .await
        .expect("kube-apiserver's call");
    assert_eq!(answer.trim(), "5", "the sink got kube-apiserver's 5 bytes");
    let over = metric(
        s.cloud_admin,
        "tunnel_dial_failures_total{reason=\"over_share\"}",
    );
    assert_eq!(over, 1.0, "the fifth connection, refused as over its share");
    drop(holder);
}
