//! Replicas that shed instead of dying (issue 46): a replica at its edge cap refuses new
//! edges with REPLICA_FULL and they register with another replica; handshakes that time
//! out do not lock their source address out.

use super::*;

use tokio_util::sync::CancellationToken;
use tunnel_user::config::CloudConfig;

const FLEET: &str = "edge-1:t1\nedge-2:t2\nedge-3:t3\nedge-4:t4\nedge-5:t5\n";

/// `curl` of `path` on the admin listener at `admin`: the status and the body.
async fn admin_get(admin: SocketAddr, path: &str) -> (String, String) {
    let url = format!("http://{admin}{path}");
    inproc::blocking(move || {
        let out = Command::new("curl")
            .args(["-sS", "--max-time", "5", "-w", "\n%{http_code}", &url])
            .output()
            .expect("curl");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, status) = text.rsplit_once('\n').expect("a status line");
        (status.to_string(), body.to_string())
    })
    .await
}

/// The value of the metric line that starts with `name` (labels included) at `admin`.
async fn metric(admin: SocketAddr, name: &str) -> Option<f64> {
    let (_, body) = admin_get(admin, "/metrics").await;
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

#[tokio::test]
async fn a_full_replica_sends_new_edges_to_the_other_and_neither_passes_its_cap() {
    let mut a = InProcess::start(
        FLEET,
        toml::toml! { [tunnel] max_edges = 2 cloud_id = "replica-a" },
    )
    .await;
    // A second replica of the same PKI and token file, logging beside the first, that
    // admits one edge at a time (`tunnel.max_handshakes`): the storm still lands.
    let mut b_config = a.s.cloud_config(toml::toml! {
        [tunnel]
        listen = "127.0.0.1:0"
        max_edges = 3
        max_handshakes = 1
        cloud_id = "replica-b"
        [admin]
        listen = "127.0.0.1:0"
        [connect]
        listen = "127.0.0.1:0"
    });
    b_config["connect"].as_table_mut().unwrap().remove("unix");
    let path = a.path().join("cloud-b.toml");
    let b_config = CloudConfig::parse(&path, &toml::to_string(&b_config).unwrap()).unwrap();
    let b_ready_file = a.path().join("cloud-b.ready");
    let b_stop = CancellationToken::new();
    let b = tokio::spawn(tunnel_user::cloud::run(
        b_config,
        Some(b_ready_file.clone()),
        b_stop.clone(),
        // In process: the test's own capabilities stay as they are.
        tunnel_user::cloud::Capabilities::Keep,
    ));
    let b_ready = a.logs.ready(&b_ready_file).await;
    let (a_tunnel, b_tunnel) = (a.s.tunnel, b_ready.addr("tunnel.listen"));
    let (a_admin, b_admin) = (a.s.cloud_admin, b_ready.addr("admin.listen"));

    // A storm: five edges at once, each listing replica A first.
    let nodes = ["edge-1", "edge-2", "edge-3", "edge-4", "edge-5"];
    let tokens = ["t1", "t2", "t3", "t4", "t5"];
    let mut edges = Vec::new();
    for (node, token) in nodes.iter().zip(tokens) {
        let opts = EdgeOpts {
            extra: toml::toml! {
                [cloud]
                address = (a_tunnel.to_string())
                addresses = [(b_tunnel.to_string())]
            },
            ..EdgeOpts::new(node, token)
        };
        edges.push(a.start_edge(opts));
    }
    // Neither replica ever holds more than its cap: sampled while the storm lands.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let (mut on_a, mut on_b) = (0.0, 0.0);
    while tokio::time::Instant::now() < deadline {
        on_a = metric(a_admin, "tunnel_edges_connected").await.unwrap();
        on_b = metric(b_admin, "tunnel_edges_connected").await.unwrap();
        assert!(
            on_a <= 2.0 && on_b <= 3.0,
            "past a cap: A {on_a} of 2, B {on_b} of 3"
        );
        if on_a + on_b == 5.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!((on_a, on_b), (2.0, 3.0), "every edge registered, A full");

    // A refused the three past its cap with REPLICA_FULL, each went on to B at once.
    let refused = metric(
        a_admin,
        "tunnel_registrations_rejected_total{reason=\"replica_full\"}",
    )
    .await
    .unwrap_or(0.0);
    assert!(refused >= 3.0, "A refused {refused} registrations as full");
    let full = a.logs.count(
        Side::Edge,
        &["the replica is full; trying the next cloud address"],
    );
    assert!(full >= 3, "{full} edges were told A is full");
    let landed_on_b = a.logs.count(
        Side::Edge,
        &["registered with the cloud", "cloud_id=replica-b"],
    );
    assert_eq!(landed_on_b, 3, "{}", a.logs.text());
    assert_eq!(
        a.logs.count(Side::Edge, &["registration refused"]),
        0,
        "a full replica is not an error of the edge's"
    );

    // A says it is full, in its metrics and its readiness detail (still ready: it
    // serves its edges).
    assert_eq!(metric(a_admin, "tunnel_edges_max").await, Some(2.0));
    assert_eq!(metric(a_admin, "tunnel_edges_near_cap").await, Some(1.0));
    let (status, body) = admin_get(a_admin, "/readyz").await;
    assert_eq!(status, "200");
    assert!(body.contains("full, 2 of 2 edges"), "{body}");
    // B is full too now (3 of 3).
    let (_, body) = admin_get(b_admin, "/readyz").await;
    assert!(body.contains("full, 3 of 3 edges"), "{body}");

    for edge in edges {
        edge.stop().await.unwrap();
    }
    b_stop.cancel();
    b.await.unwrap().unwrap();
}

/// A storm makes handshakes time out; the old code charged each timeout to the source
/// address, and after 20 a NAT'd site (here: every client on 127.0.0.1) was refused with
/// `rate limited: too many failed registrations from this address`.
#[tokio::test(start_paused = true)]
async fn handshakes_that_time_out_do_not_lock_their_address_out() {
    let mut t =
        InProcess::start(TOKENS, toml::toml! { [transport] handshake_timeout = "1s" }).await;
    // More handshakes than the per-address burst of failures, none of them finishing in
    // time, from the address the edge will use.
    let mut stalled = Vec::new();
    for _ in 0..30 {
        stalled.push(tokio::net::TcpStream::connect(t.s.tunnel).await.unwrap());
    }
    t.logs
        .wait_count(
            Side::Cloud,
            &["handshake timed out"],
            1,
            Duration::from_secs(30),
        )
        .await;
    // Every one of them timed out: the cloud closed them all.
    for conn in &mut stalled {
        let mut buf = [0u8; 1];
        let n = tokio::time::timeout(
            Duration::from_secs(30),
            tokio::io::AsyncReadExt::read(conn, &mut buf),
        )
        .await
        .expect("the cloud closes a stalled handshake");
        assert!(matches!(n, Ok(0) | Err(_)));
    }
    let _edge = t
        .start_ready_edge(EdgeOpts::new("edge-1", "token-one"))
        .await;
    assert_eq!(
        t.logs.count(Side::Edge, &["too many failed registrations"]),
        0,
        "the edge was refused for the timeouts of its address: {}",
        t.logs.text()
    );
}
