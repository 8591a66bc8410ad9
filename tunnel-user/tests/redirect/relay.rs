//! The relay (`role = "relay"`): a worker's redirect. A connect from the worker's cgroup
//! to an edge lands in the relay, which holds no edge session and carries it over its
//! link to the replica that holds the edge; the edge moving to another replica is
//! followed; with no replica holding it the connect fails with "host is down". It
//! carries nothing else: a connection to its redirect listener that no program
//! redirected, a port not configured; and an edge certificate presented on the replicas'
//! listener is no relay's.

use super::*;
use outage::until_connect;

/// The relay's certificate names its node, under a prefix no node name can carry.
const RELAY_CN: &str = "system:tunnel-relay:worker-1";

/// A replica holding edges, linked to the other replicas in `peers`, with no redirect.
fn start_replica(s: &Setup, id: &str, listen: &common::ClosedPort, peers: &[String]) -> Proc {
    let peers = peers.to_vec();
    let mut config = toml::toml! {
        [tunnel]
        listen = "127.0.0.1:0"
        cloud_id = id

        [admin]
        listen = "127.0.0.1:0"

        [peers]
        listen = (listen.addr.to_string())
        static = peers
    };
    let connect_unix = s.path().join(format!("connect-{id}.sock"));
    merge(
        &mut config,
        toml::toml! { [connect] listen = "127.0.0.1:0" unix = (path_str(&connect_unix)) },
    );
    let path = s.path().join(format!("cloud-{id}.toml"));
    write_toml(&path, &s.cloud_config(config));
    let mut cloud = Proc::start(
        id,
        s.path(),
        &["cloud", "--config", path_str(&path).as_str()],
    );
    cloud.wait_ready(Duration::from_secs(10));
    cloud
}

/// Points the setup's edges (and its edge listing) at `replica`.
fn use_replica(s: &mut Setup, replica: &Proc) {
    let ready = replica.ready();
    s.tunnel = ready.addr("tunnel.listen");
    s.cloud_admin = ready.addr("admin.listen");
}

fn relay_redirected(admin: std::net::SocketAddr) -> f64 {
    metric(admin, "tunnel_connections_total{entry=\"redirect\"}")
}

fn forwarded_to(replica: &Proc) -> f64 {
    metric(
        replica.ready().addr("admin.listen"),
        "tunnel_connections_total{entry=\"peer\"}",
    )
}

/// The remote addresses of the established TCP connections of process `pid` (`ss`).
fn established_peers(pid: i32) -> Vec<String> {
    let out = Command::new("ss")
        .args(["-Htnp", "state", "established"])
        .output()
        .expect("ss");
    let owner = format!("pid={pid},");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains(&owner))
        .filter_map(|l| l.split_whitespace().nth(3).map(str::to_string))
        .collect()
}

/// Starts edge-1 on `replica`, then curls its kubelet at `ip` from the cgroup: the page
/// arrives, and `replica` served it forwarded (from the relay).
async fn edge_reached_through(
    s: &mut Setup,
    cg: &TestCgroup,
    ip: &str,
    replica: &Proc,
    relay: &Proc,
) -> Proc {
    use_replica(s, replica);
    let edge = s.start_ready_edge(EdgeOpts {
        extra: allow_kubelet(ip),
        ..EdgeOpts::new("edge-1", "token-one")
    });
    assert_eq!(until_connect(cg, ip, "connected").await.0, "connected");
    let curl = curl_args(s, &format!("https://{ip}:10250/"));
    let curl: Vec<&str> = curl.iter().map(String::as_str).collect();
    let page = cg.run(&curl, Duration::from_secs(15)).await.expect("curl");
    assert!(page.contains("s_server"), "unexpected page: {page}");
    assert!(
        forwarded_to(replica) >= 1.0,
        "{} did not serve it; relay log:\n{}",
        replica.name,
        relay.log_text()
    );
    edge
}

#[tokio::test]
async fn a_relay_carries_redirected_connections_to_the_replica_holding_the_edge() {
    let Some(cg) = test_cgroup(NEEDS) else { return };
    let ip = "127.1.0.31";
    let mut s = Setup::new(TOKENS);
    let _kubelet = start_kubelet(&s, ip, None);
    s.pki
        .issue("relay", &[], RELAY_CN, ExtendedKeyUsagePurpose::ClientAuth);
    let (peer_a, peer_b) = (common::ClosedPort::new(), common::ClosedPort::new());
    let peers = vec![peer_a.addr.to_string(), peer_b.addr.to_string()];
    let replica_a = start_replica(&s, "replica-a", &peer_a, &peers);
    let replica_b = start_replica(&s, "replica-b", &peer_b, &peers);

    let mut relay_config = redirect_to(ip, &cg.path);
    merge(
        &mut relay_config,
        toml::toml! {
            role = "relay"

            [tunnel]
            cert = "relay.crt"
            key = "relay.key"
            client_ca = "ca.crt"
            cloud_id = "relay-worker-1"

            [admin]
            listen = "127.0.0.1:0"

            [peers]
            static = (peers.clone())
        },
    );
    let path = s.path().join("relay.toml");
    write_toml(&path, &relay_config);
    let mut relay = Proc::start(
        "relay",
        s.path(),
        &["cloud", "--config", path_str(&path).as_str()],
    );
    let ready = relay.wait_ready(Duration::from_secs(10));
    let relay_admin = ready.addr("admin.listen");
    for held_by_replicas in ["tunnel.listen", "peers.listen", "connect.listen"] {
        assert!(
            !ready.0.contains_key(held_by_replicas),
            "a relay listens on {held_by_replicas}: {:?}",
            ready.0
        );
    }
    // Each replica serves the relay's link as a relay's, not a replica's.
    for replica in [&replica_a, &replica_b] {
        replica.wait_log("relay connected node=worker-1", Duration::from_secs(10));
    }

    // What the relay holds: one link to each replica, nothing else.
    let mut links = established_peers(relay.pid());
    links.sort();
    let mut want = peers.clone();
    want.sort();
    assert_eq!(links, want, "the relay's TCP connections");
    eprintln!(
        "relay, idle with 2 replicas: {} connections, RSS {} KiB (this build)",
        links.len(),
        probe::rss_kib(relay.pid())
    );

    // No replica holds edge-1: the relay marks it, and connect() fails at once.
    let (outcome, took) = until_connect(&cg, ip, "EHOSTDOWN").await;
    eprintln!("relay, no tunnel: connect() -> {outcome} in {took:?}");
    assert_eq!(outcome, "EHOSTDOWN Host is down", "{}", relay.log_text());
    assert!(took < Duration::from_millis(100), "took {took:?}");

    // The edge on replica A: the relay forwards there, TLS verified end to end.
    let edge = edge_reached_through(&mut s, &cg, ip, &replica_a, &relay).await;

    // The edge moves to replica B: host is down while nobody holds it, then the relay
    // follows it there.
    drop(edge);
    let (outcome, _) = until_connect(&cg, ip, "EHOSTDOWN").await;
    assert_eq!(outcome, "EHOSTDOWN Host is down");
    let _edge = edge_reached_through(&mut s, &cg, ip, &replica_b, &relay).await;

    // Nothing else: a port not in redirect.ports goes where it was going (nothing
    // listens there on the host), and a direct connection to the redirect listener is
    // refused with a reset and a log line.
    let carried = relay_redirected(relay_admin);
    let port_py = format!(
        "import errno,socket\ns = socket.socket()\ntry:\n    s.connect(('{ip}', 10251))\n    print('connected')\nexcept OSError as e:\n    print(errno.errorcode.get(e.errno))"
    );
    let other_port = cg
        .run(&["python3", "-c", &port_py], Duration::from_secs(15))
        .await
        .expect("python connect");
    assert_eq!(
        other_port.trim(),
        "ECONNREFUSED",
        "a port not configured was carried"
    );
    let redirect_listener = ready.addr("redirect.listen");
    let mut direct = std::net::TcpStream::connect(redirect_listener).expect("connect");
    common::assert_reset(&mut direct, b"GET / HTTP/1.0\r\n\r\n");
    relay.wait_log(
        "connection on the redirect listener without an original destination",
        Duration::from_secs(5),
    );
    assert_eq!(
        relay_redirected(relay_admin),
        carried,
        "carried what it should not"
    );

    // An edge's certificate, from the same CA, is no relay's: the replica refuses it.
    let edge_cert = (
        s.path().join("edge-edge-1.crt"),
        s.path().join("edge-edge-1.key"),
    );
    s.pki.client_cert("edge-1");
    let presented = Command::new("openssl")
        .args(["s_client", "-brief", "-connect", &peer_a.addr.to_string()])
        .args(["-servername", "tunnel-cloud", "-CAfile"])
        .arg(s.path().join("ca.crt"))
        .arg("-cert")
        .arg(&edge_cert.0)
        .arg("-key")
        .arg(&edge_cert.1)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("openssl s_client");
    eprintln!("edge certificate on the replicas' listener: openssl {presented}");
    replica_a.wait_log(
        "client certificate names neither `tunnel-cloud` (a replica) nor `system:tunnel-relay:<node>` (a relay)",
        Duration::from_secs(10),
    );
}
