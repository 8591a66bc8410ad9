//! The relay (`role = "relay"`): a worker's redirect. A connect from the worker's cgroup
//! to an edge lands in the relay, which holds no edge session and carries it over its
//! link to the replica that holds the edge; the edge moving to another replica is
//! followed; with no replica holding it the connect fails with "host is down". It
//! carries nothing else: a connection to its redirect listener that no program
//! redirected, a port not configured; and an edge certificate presented on the replicas'
//! listener is no relay's.

use std::sync::Arc;

use super::*;
use common::inproc::{self, Threaded};
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

    let relay_config = relay_config(
        ip,
        &cg,
        &peers,
        toml::toml! {
            [admin]
            listen = "127.0.0.1:0"
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

/// The relay's config for `s`'s PKI, redirecting `ip` from `cg`, linked to `peers`, as
/// a relay with `tunnel.cert`/`key` runs.
fn relay_config(ip: &str, cg: &TestCgroup, peers: &[String], extra: Table) -> Table {
    let mut config = redirect_to(ip, &cg.path);
    merge(
        &mut config,
        toml::toml! {
            role = "relay"

            [tunnel]
            cert = "relay.crt"
            key = "relay.key"
            client_ca = "ca.crt"
            cloud_id = "relay-worker-1"

            [peers]
            static = (peers.to_vec())
        },
    );
    merge(&mut config, extra);
    config
}

/// A relay started before the cloud has published its CA (a fresh install: the cloud
/// fills the ConfigMap on its first start, the kubelet brings it into the pod later)
/// waits for it, with the edge's log line, and links to the replicas once it is there.
/// Before, its start failed on the missing `peers.ca` and the kubelet restarted it.
#[test]
fn a_relay_started_before_the_ca_is_published_waits_for_it() {
    let Some(cg) = test_cgroup(NEEDS) else { return };
    let s = Setup::new(TOKENS);
    s.pki
        .issue("relay", &[], RELAY_CN, ExtendedKeyUsagePurpose::ClientAuth);
    let peer = common::ClosedPort::new();
    let peers = vec![peer.addr.to_string()];
    let replica = start_replica(&s, "replica-a", &peer, &peers);
    let published = s.path().join("published");
    std::fs::create_dir(&published).expect("mkdir");
    let ca = published.join("ca.crt");
    let extra = toml::toml! {
        [peers]
        ca = (path_str(&ca))

        [relay]
        wait_for_ca = true
    };
    let config = relay_config("127.1.0.32", &cg, &peers, extra);
    let relay = Threaded::cloud_starting(s.path(), "relay", config);
    relay.wait_log(
        "waiting for the cloud's CA certificate",
        Duration::from_secs(10),
    );
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        !relay.log_text().contains("linked to replica"),
        "linked with no CA: {}",
        relay.log_text()
    );

    std::fs::copy(s.path().join("ca.crt"), &ca).expect("publish the CA");
    relay.wait_log("the cloud's CA certificate is here", Duration::from_secs(5));
    relay.ready();
    relay.wait_log("linked to replica", Duration::from_secs(10));
    replica.wait_log("relay connected node=worker-1", Duration::from_secs(10));
    relay.stop().expect("the relay stops");
}

/// The serial number `openssl x509 -serial` prints for certificate file `cert`.
fn serial_of(cert: &Path) -> String {
    let out = Command::new("openssl")
        .args(["x509", "-noout", "-serial", "-in"])
        .arg(cert)
        .output()
        .expect("openssl x509");
    let text = String::from_utf8_lossy(&out.stdout);
    text.trim()
        .strip_prefix("serial=")
        .unwrap_or_else(|| panic!("openssl x509 -serial: {text}"))
        .to_uppercase()
}

/// A relay whose certificate is renewed moves its open links to it, as an edge presents
/// its renewal on its open session: each replica sees the relay link again with the new
/// certificate, a connection opened through the relay before the renewal carries its
/// request and answer after it (on the link it began on), and new connections go
/// through. The relay's renewal from the cluster (`[relay.csr]`) puts the certificate in
/// force through the same setter as this reload of its files (`reload::apply_tls`).
/// Before, the links kept the certificate they started with until they broke.
#[tokio::test]
async fn a_relay_moves_its_links_to_a_renewed_certificate_without_losing_a_call() {
    let Some(cg) = test_cgroup(NEEDS) else { return };
    let ip = "127.1.0.33";
    let mut s = Setup::new(TOKENS);
    let _kubelet = start_kubelet(&s, ip, None);
    s.pki
        .issue("relay", &[], RELAY_CN, ExtendedKeyUsagePurpose::ClientAuth);
    let first = serial_of(&s.path().join("relay.crt"));
    let (peer_a, peer_b) = (common::ClosedPort::new(), common::ClosedPort::new());
    let peers = vec![peer_a.addr.to_string(), peer_b.addr.to_string()];
    let replica_a = start_replica(&s, "replica-a", &peer_a, &peers);
    let replica_b = start_replica(&s, "replica-b", &peer_b, &peers);
    let config = relay_config(ip, &cg, &peers, Table::new());
    let dir = s.path().to_path_buf();
    let relay = inproc::blocking(move || Threaded::cloud(&dir, "relay", config)).await;
    for replica in [&replica_a, &replica_b] {
        let linked = format!("relay connected node=worker-1 serial={first}");
        replica.wait_log(&linked, Duration::from_secs(10));
    }
    use_replica(&mut s, &replica_a);
    let _edge = s.start_ready_edge(EdgeOpts {
        extra: allow_kubelet(ip),
        ..EdgeOpts::new("edge-1", "token-one")
    });
    assert_eq!(until_connect(&cg, ip, "connected").await.0, "connected");

    // A connection through the relay, TLS to the kubelet done, its request held back
    // until the relay has moved its links.
    let (opened, go) = (s.path().join("opened"), s.path().join("go"));
    let p = |f: &str| s.path().join(f).to_string_lossy().to_string();
    let held = format!(
        "import os, socket, ssl, time\n\
         ctx = ssl.create_default_context(cafile='{ca}')\n\
         ctx.load_cert_chain('{cert}', '{key}')\n\
         conn = ctx.wrap_socket(socket.create_connection(('{ip}', 10250), timeout=30), server_hostname='{ip}')\n\
         open('{opened}', 'w').close()\n\
         deadline = time.time() + 30\n\
         while not os.path.exists('{go}') and time.time() < deadline:\n    time.sleep(0.05)\n\
         conn.sendall(b'GET / HTTP/1.0\\r\\n\\r\\n')\n\
         page = b''\n\
         while True:\n    data = conn.recv(65536)\n    if not data:\n        break\n    page += data\n\
         print('answered' if b's_server' in page else 'no page: %r' % page[:200])\n",
        ca = p("ca.crt"),
        cert = p("apiserver.crt"),
        key = p("apiserver.key"),
        opened = opened.display(),
        go = go.display(),
    );
    let cg = Arc::new(cg);
    let long = tokio::spawn({
        let cg = cg.clone();
        async move {
            cg.run(&["python3", "-c", &held], Duration::from_secs(60))
                .await
        }
    });
    let started = Instant::now();
    while !opened.exists() {
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "the held connection did not open: {}",
            relay.log_text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The renewal: a new key and certificate in the relay's files.
    s.pki
        .issue("relay", &[], RELAY_CN, ExtendedKeyUsagePurpose::ClientAuth);
    let renewed = serial_of(&s.path().join("relay.crt"));
    assert_ne!(first, renewed);
    for replica in [&replica_a, &replica_b] {
        let linked = format!("relay connected node=worker-1 serial={renewed}");
        replica.wait_log(&linked, Duration::from_secs(15));
    }
    let logs = relay.logs.clone();
    inproc::blocking(move || {
        logs.wait_count_blocking(
            inproc::Side::Any,
            &["link moved to the new certificate"],
            2,
            Duration::from_secs(5),
        )
    })
    .await;

    std::fs::write(&go, "").expect("go");
    let answer = long.await.expect("task").expect("the held connection");
    assert_eq!(answer.trim(), "answered", "{}", relay.log_text());
    // And a new connection, on the moved links.
    let forwarded = forwarded_to(&replica_a);
    let curl = curl_args(&s, &format!("https://{ip}:10250/"));
    let curl: Vec<&str> = curl.iter().map(String::as_str).collect();
    let page = cg.run(&curl, Duration::from_secs(15)).await.expect("curl");
    assert!(page.contains("s_server"), "unexpected page: {page}");
    assert!(
        forwarded_to(&replica_a) > forwarded,
        "not through replica A"
    );
    let relay_log = relay.log_text();
    drop(relay);
    assert!(
        !relay_log.contains("keeping the link up with the previous one"),
        "{relay_log}"
    );
}
