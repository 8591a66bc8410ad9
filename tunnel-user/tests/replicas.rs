//! Several tunnel-cloud replicas on loopback with a static peer list and real edges, each
//! on a thread of its own in this process ([`Threaded`]), but for the replica killed
//! with -9, a `tunnel cloud` process. A connection that reaches a replica without the
//! node's edge is forwarded to the one that holds it; after a replica dies its edges
//! reconnect elsewhere and routes follow; a forwarded connection is never forwarded
//! again.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::config::{merge, write_toml};
use common::inproc::Threaded;
use common::servers::{self, send_pattern};
use common::{ClosedPort, Pki, Proc, connect_via};
use toml::Table;

const TOKENS: &str = "edge-1:t1\nedge-2:t2\nedge-3:t3\n";

/// One replica's addresses. Each replica lists the others' peer addresses before they
/// start, and a replica restarted comes back on its own: so the ports are chosen up
/// front and held by the test for as long as the replica lives (bound, never listening,
/// with SO_REUSEADDR as tokio's listeners have it): the cloud binds and listens beside
/// the held socket, and the kernel hands the port to no one else, not even between a
/// kill and the restart.
struct Replica {
    name: String,
    tunnel: SocketAddr,
    connect: SocketAddr,
    peer: SocketAddr,
    _held: [ClosedPort; 3],
}

impl Replica {
    fn new(name: &str) -> Self {
        let held = [ClosedPort::new(), ClosedPort::new(), ClosedPort::new()];
        Self {
            name: name.to_string(),
            tunnel: held[0].addr,
            connect: held[1].addr,
            peer: held[2].addr,
            _held: held,
        }
    }
}

fn start_cloud(dir: &Path, r: &Replica, peers: &[SocketAddr]) -> Threaded {
    start_cloud_with(dir, r, peers, Table::new())
}

/// `start_cloud` with `extra` merged into the config.
fn start_cloud_with(dir: &Path, r: &Replica, peers: &[SocketAddr], extra: Table) -> Threaded {
    let config = replica_config(r, peers, extra);
    Threaded::cloud(dir, &format!("cloud-{}", r.name), config)
}

/// Replica `r`'s config, listing `peers`, with `extra` merged in.
fn replica_config(r: &Replica, peers: &[SocketAddr], extra: Table) -> Table {
    let peers: Vec<String> = peers.iter().map(ToString::to_string).collect();
    let mut config = toml::toml! {
        [tunnel]
        listen = (r.tunnel.to_string())
        cert = "cloud.crt"
        key = "cloud.key"
        token_file = "tokens"
        client_ca = "ca.crt"
        cloud_id = (r.name.clone())

        [connect]
        listen = (r.connect.to_string())

        [peers]
        listen = (r.peer.to_string())
        static = peers

        [transport]
        heartbeat_interval = "1s"
        heartbeat_timeout = "3s"
    };
    merge(&mut config, extra);
    // A replica that issues its own serving certificate names no files (both is an error).
    let self_issued = config
        .get("csr")
        .and_then(|csr| csr.get("serving"))
        .and_then(toml::Value::as_bool)
        == Some(true);
    if self_issued {
        let tunnel = config["tunnel"].as_table_mut().expect("a table");
        tunnel.remove("cert");
        tunnel.remove("key");
    }
    config
}

/// Replica `r` as a `tunnel cloud` process, for the test that kills one with -9.
fn start_cloud_process(dir: &Path, r: &Replica, peers: &[SocketAddr]) -> Proc {
    let path = dir.join(format!("cloud-{}.toml", r.name));
    write_toml(&path, &replica_config(r, peers, Table::new()));
    let mut cloud = Proc::start(
        &format!("cloud-{}", r.name),
        dir,
        &["cloud", "--config", path.to_str().expect("utf-8 path")],
    );
    cloud.wait_ready(Duration::from_secs(10));
    cloud
}

/// An edge that dials `first` and falls back to `more`; returns once it registered.
fn start_edge(
    dir: &Path,
    node: &str,
    token: &str,
    first: SocketAddr,
    more: &[SocketAddr],
    target: SocketAddr,
) -> Threaded {
    let more: Vec<String> = more.iter().map(ToString::to_string).collect();
    let config = toml::toml! {
        node_name = node

        [cloud]
        address = (first.to_string())
        addresses = more
        server_name = "tunnel-cloud"
        ca = "ca.crt"
        token = token

        [admin]
        listen = "127.0.0.1:0"

        [allow]
        targets = [(target.to_string())]

        [transport]
        heartbeat_interval = "1s"
        heartbeat_timeout = "3s"
    };
    let edge = Threaded::edge(dir, &format!("edge-{node}"), config);
    edge.wait_log("registered with the cloud", Duration::from_secs(10));
    edge
}

/// Sends `len` pattern bytes to the sink behind `node` through the CONNECT proxy at
/// `proxy`, half-closes, and checks the sink's count and hash.
fn exchange(proxy: SocketAddr, node: &str, sink: SocketAddr, len: u64) -> Result<(), String> {
    let mut conn = connect_via(proxy, &format!("{node}:{}", sink.port()))?;
    let sent = send_pattern(Some(&mut conn), len, len).map_err(|e| e.to_string())?;
    conn.shutdown(Shutdown::Write).map_err(|e| e.to_string())?;
    let mut answer = String::new();
    BufReader::new(&conn)
        .read_line(&mut answer)
        .map_err(|e| e.to_string())?;
    if answer.trim() == format!("{len} {sent}") {
        Ok(())
    } else {
        Err(format!("sink answered {answer:?}"))
    }
}

/// Retries `exchange` until it works; returns how long that took, or the last error.
fn wait_reachable(
    proxy: SocketAddr,
    node: &str,
    sink: SocketAddr,
    bound: Duration,
) -> Result<Duration, String> {
    let started = Instant::now();
    loop {
        match exchange(proxy, node, sink, 1000) {
            Ok(()) => return Ok(started.elapsed()),
            Err(e) if started.elapsed() > bound => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

#[test]
fn an_edge_on_one_replica_is_reachable_through_the_others_and_fails_over() {
    let dir = tempfile::tempdir().expect("tempdir");
    Pki::new(dir.path());
    std::fs::write(dir.path().join("tokens"), TOKENS).expect("tokens");
    let sink = servers::sink("127.0.0.1:0");
    let (a, b, c) = (Replica::new("a"), Replica::new("b"), Replica::new("c"));
    // Every replica gets the same list, its own address included: it must skip itself.
    let peers = [a.peer, b.peer, c.peer];
    let cloud_a = start_cloud_process(dir.path(), &a, &peers);
    let mut cloud_b = start_cloud_process(dir.path(), &b, &peers);
    let cloud_c = start_cloud_process(dir.path(), &c, &peers);
    for cloud in [&cloud_a, &cloud_b, &cloud_c] {
        cloud.wait_log_count("linked to replica", 2, Duration::from_secs(10));
    }

    // edge-1 and edge-2 on B (falling back to A, then C), edge-3 on A.
    let _e1 = start_edge(
        dir.path(),
        "edge-1",
        "t1",
        b.tunnel,
        &[a.tunnel, c.tunnel],
        sink,
    );
    let _e2 = start_edge(
        dir.path(),
        "edge-2",
        "t2",
        b.tunnel,
        &[c.tunnel, a.tunnel],
        sink,
    );
    let _e3 = start_edge(
        dir.path(),
        "edge-3",
        "t3",
        a.tunnel,
        &[b.tunnel, c.tunnel],
        sink,
    );

    // Every node through every replica; the first try may race the route update.
    for r in [&a, &b, &c] {
        for node in ["edge-1", "edge-2", "edge-3"] {
            let took = wait_reachable(r.connect, node, sink, Duration::from_secs(2))
                .unwrap_or_else(|e| {
                    panic!("{node} not reachable through {} within 2 s: {e}", r.name)
                });
            eprintln!(
                "{node} through replica {}: reachable after {took:?}",
                r.name
            );
        }
    }
    cloud_a.wait_log(
        "forwarding to the replica that holds the node",
        Duration::from_secs(1),
    );
    cloud_b.wait_log("forwarded connection ended", Duration::from_secs(1));
    // A bulk transfer across the middle replica arrives intact, half-close included.
    let started = Instant::now();
    exchange(a.connect, "edge-1", sink, 64 << 20).expect("64 MiB through A -> B -> edge-1");
    eprintln!("64 MiB through A -> B -> edge-1 in {:?}", started.elapsed());

    // Kill B: its edges reconnect to A or C, and both A and C route to them again.
    cloud_b.kill9();
    let killed = Instant::now();
    let mut worst = Duration::ZERO;
    for node in ["edge-1", "edge-2"] {
        for r in [&a, &c] {
            let bound = Duration::from_secs(10);
            wait_reachable(r.connect, node, sink, bound).unwrap_or_else(|e| {
                panic!(
                    "{node} not reachable through {} {bound:?} after B died: {e}",
                    r.name
                )
            });
            worst = worst.max(killed.elapsed());
        }
    }
    eprintln!(
        "failover: every edge of the killed replica reachable through both survivors {worst:?} after kill -9"
    );
    assert!(worst < Duration::from_secs(5), "failover took {worst:?}");
    // edge-3 never moved and never stopped working.
    exchange(c.connect, "edge-3", sink, 1000).expect("edge-3 through C after B died");
}

/// A peer that claims to hold `ghost` and, when a connection for it is forwarded to
/// it, forwards it straight back (as a replica would that believed the first one held
/// the node). Counts the forwarded dials it receives and keeps the answers it got.
struct ConfusedPeer {
    dials: Arc<AtomicUsize>,
    answers: Arc<Mutex<Vec<String>>>,
}

impl ConfusedPeer {
    fn start(dir: &Path, listen: SocketAddr, other: SocketAddr) -> Self {
        let dials = Arc::new(AtomicUsize::new(0));
        let answers = Arc::new(Mutex::new(Vec::new()));
        let (d, an) = (dials.clone(), answers.clone());
        let (cert, key, ca) = (
            dir.join("cloud.crt"),
            dir.join("cloud.key"),
            dir.join("ca.crt"),
        );
        let server =
            tunnel_user::io::tls::peer_server_config(&cert, &key, &ca).expect("peer server tls");
        let client = tunnel_user::io::tls::peer_client_config(&ca, &cert, &key, b"h2")
            .expect("peer client tls");
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::bind(listen)
                    .await
                    .expect("bind confused peer");
                let _ = ready_tx.send(());
                let acceptor = tokio_rustls::TlsAcceptor::from(server);
                let connector = tokio_rustls::TlsConnector::from(client);
                while let Ok((tcp, _)) = listener.accept().await {
                    let (acceptor, connector, d, an) =
                        (acceptor.clone(), connector.clone(), d.clone(), an.clone());
                    tokio::spawn(async move {
                        let Ok(tls) = acceptor.accept(tcp).await else {
                            return;
                        };
                        let Ok(mut conn) = h2::server::handshake(tls).await else {
                            return;
                        };
                        while let Some(Ok((req, respond))) = conn.accept().await {
                            tokio::spawn(confused_stream(
                                req,
                                respond,
                                other,
                                connector.clone(),
                                d.clone(),
                                an.clone(),
                            ));
                        }
                    });
                }
            });
        });
        ready_rx
            .recv_timeout(Duration::from_secs(5))
            .expect("confused peer listening");
        Self { dials, answers }
    }
}

/// Our PeerHello as gRPC binary metadata: base64 in a `-bin` header.
fn hello() -> http::HeaderValue {
    use base64::Engine;
    let hello = prost::Message::encode_to_vec(&proto::PeerHello {
        replica_id: "confused".into(),
        instance: 42,
    });
    http::HeaderValue::from_str(&base64::engine::general_purpose::STANDARD.encode(hello))
        .expect("base64 is a header value")
}

async fn confused_stream(
    req: http::Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<bytes::Bytes>,
    other: SocketAddr,
    connector: tokio_rustls::TlsConnector,
    dials: Arc<AtomicUsize>,
    answers: Arc<Mutex<Vec<String>>>,
) {
    match req.uri().path() {
        // gRPC by hand: the answer's headers, then length-prefixed messages (a flag byte
        // for "not compressed" before the length).
        "/tunnel.v1.Peer/Routes" => {
            let mut resp = http::Response::new(());
            resp.headers_mut()
                .insert(proto::PEER_HELLO_METADATA, hello());
            resp.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/grpc"),
            );
            let Ok(mut send) = respond.send_response(resp, false) else {
                return;
            };
            // A session from the future: newer than anything, so it wins every choice.
            let since = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .expect("clock")
                .as_millis() as u64
                + 60_000;
            let claim = proto::NodeClaim {
                node: "ghost".into(),
                connected_at_ms: since,
            };
            let update = proto::RouteUpdate {
                reset: true,
                held: vec![claim],
                released: vec![],
            };
            let _ = send.send_data(grpc_message(&update), false);
            loop {
                tokio::time::sleep(Duration::from_millis(500)).await;
                if send
                    .send_data(grpc_message(&proto::RouteUpdate::default()), false)
                    .is_err()
                {
                    return;
                }
            }
        }
        "/tunnel.v1.Peer/Dial" => {
            dials.fetch_add(1, Ordering::SeqCst);
            // Forward it back where it came from, headers and all.
            let result = async {
                let tcp = tokio::net::TcpStream::connect(other)
                    .await
                    .map_err(|e| e.to_string())?;
                let name =
                    tunnel_user::io::tls::server_name("tunnel-cloud").map_err(|e| e.to_string())?;
                let tls = connector
                    .connect(name, tcp)
                    .await
                    .map_err(|e| e.to_string())?;
                let (sender, conn) = h2::client::handshake(tls)
                    .await
                    .map_err(|e| e.to_string())?;
                tokio::spawn(async move {
                    let _ = conn.await;
                });
                let mut again = http::Request::post("http://tunnel/tunnel.v1.Peer/Dial")
                    .body(())
                    .expect("request");
                for h in [
                    proto::DIAL_REQUEST_METADATA,
                    proto::PEER_HELLO_METADATA,
                    "content-type",
                    "te",
                ] {
                    if let Some(v) = req.headers().get(h) {
                        again.headers_mut().insert(h, v.clone());
                    }
                }
                let (response, _send) = sender
                    .ready()
                    .await
                    .map_err(|e| e.to_string())?
                    .send_request(again, false)
                    .map_err(|e| e.to_string())?;
                let response = response.await.map_err(|e| e.to_string())?;
                // A refusal is a trailers-only answer: the status is in the headers.
                let status = tonic::Status::from_header_map(response.headers())
                    .ok_or("no grpc-status in the answer")?;
                Ok::<_, String>(proto::DialResult::from_status(&status))
            }
            .await;
            let result = result.unwrap_or_else(|e| proto::DialResult {
                status: proto::DialStatus::Refused as i32,
                message: e,
            });
            answers.lock().expect("answers").push(format!(
                "{:?}: {}",
                result.status(),
                result.message
            ));
            let _ = respond.send_response(result.into_status().into_http::<()>().map(|_| ()), true);
        }
        _ => {}
    }
}

#[test]
fn a_forwarded_connection_is_never_forwarded_again() {
    let dir = tempfile::tempdir().expect("tempdir");
    Pki::new(dir.path());
    std::fs::write(dir.path().join("tokens"), TOKENS).expect("tokens");
    let a = Replica::new("a");
    let confused_port = ClosedPort::new(); // held: ConfusedPeer binds it beside
    let confused_addr = confused_port.addr;
    let confused = ConfusedPeer::start(dir.path(), confused_addr, a.peer);
    let cloud = start_cloud(dir.path(), &a, &[a.peer, confused_addr]);
    cloud.wait_log("linked to replica", Duration::from_secs(10));

    // A believes `confused` holds ghost, `confused` believes A does.
    let started = Instant::now();
    let (mut conn, head, attempt) = loop {
        let attempt = Instant::now();
        let mut s = std::net::TcpStream::connect(a.connect).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        write!(
            s,
            "CONNECT ghost:10250 HTTP/1.1\r\nHost: ghost:10250\r\n\r\n"
        )
        .expect("request");
        // Until the route arrives, ghost is an unknown host (404).
        let mut head = [0u8; 12];
        s.read_exact(&mut head).expect("status line");
        if &head != b"HTTP/1.1 404" || started.elapsed() > Duration::from_secs(3) {
            break (s, head, attempt);
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut rest = String::new();
    conn.read_to_string(&mut rest).expect("refusal");
    let took = attempt.elapsed();
    let response = format!("{}{rest}", String::from_utf8_lossy(&head));
    assert!(response.starts_with("HTTP/1.1 502"), "{response}");
    assert!(response.contains("via replica `confused`"), "{response}");
    assert!(
        response.contains("replica `a` holds no edge session for node `ghost`"),
        "{response}"
    );
    assert!(took < Duration::from_secs(1), "the refusal took {took:?}");
    // No ping-pong: one forward to `confused`, one back to A, refused there for good.
    let dials = common::settled(Duration::from_millis(300), Duration::from_secs(10), || {
        confused.dials.load(Ordering::SeqCst)
    });
    assert_eq!(dials, 1);
    let answers = confused.answers.lock().expect("answers").clone();
    assert_eq!(answers.len(), 1, "{answers:?}");
    assert!(answers[0].starts_with("NotHeld:"), "{answers:?}");
    eprintln!(
        "loop refused in {took:?}: {}",
        response.lines().last().unwrap_or_default()
    );
    cloud.wait_log(
        "forwarded connection refused: node not held here",
        Duration::from_secs(1),
    );
}

/// A peer address that accepts TCP but never answers TLS: the link to it times out on
/// the handshake bound and is logged, while the link to the real replica works and its
/// edges are reachable meanwhile.
#[test]
fn a_peer_that_accepts_but_never_answers_times_out_and_holds_up_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    Pki::new(dir.path());
    std::fs::write(dir.path().join("tokens"), TOKENS).expect("tokens");
    let sink = servers::sink("127.0.0.1:0");
    let mute = servers::silent("127.0.0.1:0");
    let (a, b) = (Replica::new("a"), Replica::new("b"));
    let started = Instant::now();
    let cloud_a = start_cloud(dir.path(), &a, &[mute, b.peer]);
    let _cloud_b = start_cloud(dir.path(), &b, &[a.peer]);
    let _e1 = start_edge(dir.path(), "edge-1", "t1", b.tunnel, &[], sink);
    let took = wait_reachable(a.connect, "edge-1", sink, Duration::from_secs(5))
        .expect("edge-1 through A while A's other peer is silent");
    eprintln!(
        "edge-1 on B reachable through A {:?} after A started, its other peer silent",
        started.elapsed()
    );
    assert!(took < Duration::from_secs(5));
    // transport.handshake_timeout is 10 s (the default).
    let line = cloud_a.wait_line(
        &["cannot link to replica", &mute.to_string()],
        Duration::from_secs(15),
    );
    eprintln!(
        "silent peer, {:?} after A started: {line}",
        started.elapsed()
    );
    assert!(
        line.contains("timed out"),
        "the log line does not name the timeout: {line}"
    );
    exchange(a.connect, "edge-1", sink, 1 << 20)
        .expect("1 MiB through A after the silent peer timed out");
}

/// A fixed forward on a replica without the node's edge: the client's bytes ride behind
/// the dial request to the replica that holds the edge, and on from there to the edge,
/// before either has answered. A target the edge refuses resets the client, counted and
/// logged once on the forwarding replica, and its bytes reach nothing.
#[test]
fn a_forward_through_the_replica_that_holds_the_edge_sends_early_bytes_and_resets_on_refusal() {
    let dir = tempfile::tempdir().expect("tempdir");
    Pki::new(dir.path());
    std::fs::write(dir.path().join("tokens"), TOKENS).expect("tokens");
    let sink = servers::sink("127.0.0.1:0");
    let forbidden = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    forbidden.set_nonblocking(true).expect("nonblocking");
    let forbidden_addr = forbidden.local_addr().expect("addr");
    let (a, b) = (Replica::new("a"), Replica::new("b"));
    let mut extra = common::config::forwards("edge-1", &[sink, forbidden_addr]);
    merge(&mut extra, toml::toml! { [admin] listen = "127.0.0.1:0" });
    let cloud_a = start_cloud_with(dir.path(), &a, &[b.peer], extra);
    let ready = cloud_a.ready();
    let (to_sink, to_forbidden, a_admin) = (
        ready.addr("forward[0].listen"),
        ready.addr("forward[1].listen"),
        ready.addr("admin.listen"),
    );
    let cloud_b = start_cloud(dir.path(), &b, &[a.peer]);
    let _e1 = start_edge(dir.path(), "edge-1", "t1", b.tunnel, &[], sink);
    wait_reachable(a.connect, "edge-1", sink, Duration::from_secs(5))
        .expect("edge-1 on B through A");

    // Bytes and FIN right away, before any answer; the sink's count and hash come back.
    let mut conn = std::net::TcpStream::connect(to_sink).expect("connect");
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let sent = send_pattern(Some(&mut conn), 5, 100_000).expect("send");
    conn.shutdown(Shutdown::Write).expect("FIN");
    let mut answer = String::new();
    conn.read_to_string(&mut answer).expect("answer");
    assert_eq!(answer.trim(), format!("100000 {sent}"));

    let started = Instant::now();
    let mut conn = std::net::TcpStream::connect(to_forbidden).expect("connect");
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    common::assert_reset(&mut conn, b"early secret bytes");
    let took = started.elapsed();
    eprintln!("forbidden target through A -> B: client reset after {took:?}");
    assert!(took < Duration::from_secs(1), "reset after {took:?}");
    assert!(
        matches!(forbidden.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "something connected to the forbidden target"
    );

    cloud_a.wait_log("via replica `b`", Duration::from_secs(2));
    cloud_b.wait_log("forwarded connection failed", Duration::from_secs(2));
    let log_a = cloud_a.log_text();
    // (CONNECTs that raced the route above were refused too.)
    let refusals: Vec<&str> = log_a
        .lines()
        .filter(|l| l.contains("connection refused") && l.contains("entry=\"forward\""))
        .collect();
    assert_eq!(refusals.len(), 1, "{refusals:#?}");
    assert!(
        refusals[0].contains("via replica `b`")
            && refusals[0].contains("edge-1")
            && refusals[0].contains(&forbidden_addr.to_string()),
        "{}",
        refusals[0]
    );
    assert!(
        !log_a.contains("connection aborted from the edge side"),
        "a refusal logged again as an abort:\n{log_a}"
    );
    assert_eq!(
        cloud_b
            .log_text()
            .matches("forwarded connection failed")
            .count(),
        1
    );
    let scrape = common::scrape(a_admin);
    assert_eq!(
        common::sample(&scrape, "tunnel_dial_failures_total{reason=\"forbidden\"}"),
        1.0,
        "{scrape}"
    );
    assert_eq!(
        common::sample(&scrape, "tunnel_connections_total{entry=\"forward\"}"),
        2.0,
        "{scrape}"
    );
}

/// A CA rotation (new CA, new certificates on disk) reaches the links between replicas
/// without a restart: A serves the new certificate on its peer listener and links with
/// a B that restarted on the new files.
#[test]
fn a_rotated_ca_and_certificate_reach_the_links_between_replicas() {
    let dir = tempfile::tempdir().expect("tempdir");
    Pki::new(dir.path());
    std::fs::write(dir.path().join("tokens"), TOKENS).expect("tokens");
    let sink = servers::sink("127.0.0.1:0");
    let (a, b) = (Replica::new("a"), Replica::new("b"));
    let cloud_a = start_cloud(dir.path(), &a, &[b.peer]);
    let cloud_b = start_cloud(dir.path(), &b, &[a.peer]);
    cloud_a.wait_log_count("linked to replica", 1, Duration::from_secs(10));
    let old = common::served_fingerprint(a.peer);
    assert_eq!(old, common::file_fingerprint(&dir.path().join("cloud.crt")));

    Pki::new(dir.path()); // a new CA, and new certificates signed by it
    cloud_a.wait_log("peer TLS reloaded", Duration::from_secs(10));
    let new = common::served_fingerprint(a.peer);
    assert_ne!(
        new, old,
        "A's peer listener still serves the old certificate"
    );
    assert_eq!(new, common::file_fingerprint(&dir.path().join("cloud.crt")));

    // B, restarted on the new files, trusts only the new CA: A must present its new
    // certificate and accept B's.
    cloud_b.stop().expect("B stops");
    let _cloud_b = start_cloud(dir.path(), &b, &[a.peer]);
    let _e1 = start_edge(dir.path(), "edge-1", "t1", b.tunnel, &[], sink);
    let took = wait_reachable(a.connect, "edge-1", sink, Duration::from_secs(20))
        .expect("edge-1 on B through A after the rotation");
    eprintln!(
        "after the CA rotation: edge-1 on the restarted B reachable through A after {took:?}"
    );
}

/// `csr.serving` on both replicas: each presents its self-issued certificate on the
/// links, where both ends check `tunnel-cloud`. A proxied connection through the link
/// keeps carrying bytes while both renew (12 s lifetime: every 8 s), a new one works
/// after, and a link made anew (B restarted) takes A's renewed certificate.
#[test]
fn self_issued_serving_certificates_link_replicas_across_renewals() {
    let dir = tempfile::tempdir().expect("tempdir");
    Pki::new(dir.path());
    std::fs::write(dir.path().join("tokens"), TOKENS).expect("tokens");
    let sink = servers::sink("127.0.0.1:0");
    let serving = toml::toml! {
        [csr]
        serving = true
        ca_key = "ca.key"
        serving_lifetime = "12s"
    };
    let (a, b) = (Replica::new("a"), Replica::new("b"));
    let cloud_a = start_cloud_with(dir.path(), &a, &[b.peer], serving.clone());
    let cloud_b = start_cloud_with(dir.path(), &b, &[a.peer], serving.clone());
    cloud_a.wait_log_count("linked to replica", 1, Duration::from_secs(10));
    let _e1 = start_edge(dir.path(), "edge-1", "t1", b.tunnel, &[], sink);
    wait_reachable(a.connect, "edge-1", sink, Duration::from_secs(20))
        .expect("edge-1 on B through A");
    let mut canary = common::probe::Canary::open(a.connect, &format!("edge-1:{}", sink.port()));
    canary.feed(64 << 10);
    cloud_a.wait_log_count("serving certificate renewed", 1, Duration::from_secs(20));
    cloud_b.wait_log_count("serving certificate renewed", 1, Duration::from_secs(20));
    canary.feed(64 << 10);
    canary.finish();
    exchange(a.connect, "edge-1", sink, 100_000).expect("a new connection after the renewals");

    cloud_b.stop().expect("B stops");
    let _cloud_b = start_cloud_with(dir.path(), &b, &[a.peer], serving);
    let _e2 = start_edge(dir.path(), "edge-2", "t2", b.tunnel, &[], sink);
    wait_reachable(a.connect, "edge-2", sink, Duration::from_secs(20))
        .expect("edge-2 on the restarted B through A, on a new link");
}

/// A target that reads `ECHOED` bytes of each connection and writes them back.
fn echo_fixed() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            std::thread::spawn(move || {
                let mut buf = [0u8; ECHOED];
                if conn.read_exact(&mut buf).is_ok() {
                    let _ = conn.write_all(&buf);
                }
            });
        }
    });
    addr
}

const ECHOED: usize = 1000;

/// One connection through `forward` as a TLS client makes one: its first bytes right
/// away (no half-close), then it waits for the answer.
fn echo_once(forward: SocketAddr, seed: u64) -> Result<(), String> {
    let mut conn = std::net::TcpStream::connect(forward).map_err(|e| e.to_string())?;
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| e.to_string())?;
    let mut sent = [0u8; ECHOED];
    servers::Pattern::new(seed).fill(&mut sent);
    conn.write_all(&sent).map_err(|e| format!("write: {e}"))?;
    let mut back = [0u8; ECHOED];
    conn.read_exact(&mut back)
        .map_err(|e| format!("read: {e}"))?;
    (back == sent)
        .then_some(())
        .ok_or_else(|| "other bytes came back".to_string())
}

/// Waits, at most 5 s, until a connection through `forward` is echoed.
fn wait_echo_through(forward: SocketAddr) {
    let started = Instant::now();
    while let Err(e) = echo_once(forward, 0) {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "edge-1 on A not reachable through B: {e}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Client threads, each making one echoed connection through a forward after another
/// until [`EchoClients::finish`].
struct EchoClients {
    stop: Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<(u64, Vec<String>)>>,
}

impl EchoClients {
    fn start(forward: SocketAddr, count: u64) -> Self {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let threads = (0..count)
            .map(|client| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let (mut made, mut failed) = (0u64, Vec::new());
                    while !stop.load(Ordering::Relaxed) && made < 100_000 {
                        made += 1;
                        if let Err(e) = echo_once(forward, client << 32 | made) {
                            failed.push(e);
                        }
                    }
                    (made, failed)
                })
            })
            .collect();
        Self { stop, threads }
    }

    /// Stops the clients: the connections made, and the errors of those that failed.
    fn finish(self) -> (u64, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        let (mut made, mut failed) = (0, Vec::new());
        for thread in self.threads {
            let (m, f) = thread.join().expect("a client thread");
            made += m;
            failed.extend(f);
        }
        (made, failed)
    }
}

/// Connections through replica B to an edge that moves from A to B, as in a rolling
/// update of two replicas (A drains; the edge registers with B), all go through: a call
/// B forwarded to A that ends before the edge answered (A's link closes, A no longer
/// holds the edge) is opened again where the edge is now, with the client's bytes
/// replayed, and a connection that finds no route while B's link to A is down waits
/// for one. Before this, a few in a hundred were reset in the move.
#[test]
fn connections_through_a_replica_survive_their_edge_moving_to_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    Pki::new(dir.path());
    std::fs::write(dir.path().join("tokens"), TOKENS).expect("tokens");
    let echo = echo_fixed();
    let (a, b) = (Replica::new("a"), Replica::new("b"));
    let cloud_a = start_cloud(dir.path(), &a, &[b.peer]);
    let cloud_b = start_cloud_with(
        dir.path(),
        &b,
        &[a.peer],
        common::config::forwards("edge-1", &[echo]),
    );
    let forward = cloud_b.ready().addr("forward[0].listen");
    for cloud in [&cloud_a, &cloud_b] {
        cloud.wait_log("linked to replica", Duration::from_secs(10));
    }
    let edge = start_edge(dir.path(), "edge-1", "t1", a.tunnel, &[b.tunnel], echo);
    wait_echo_through(forward);

    let clients = EchoClients::start(forward, 4);
    std::thread::sleep(Duration::from_millis(300));
    cloud_a.stop().expect("A drains and stops");
    edge.wait_log_count("registered with the cloud", 2, Duration::from_secs(10));
    cloud_b.wait_line(&["routes from replica changed"], Duration::from_secs(1));
    std::thread::sleep(Duration::from_millis(500));
    let (made, failed) = clients.finish();
    eprintln!(
        "edge-1 moved from A to B: {made} connections through B, {} failed",
        failed.len()
    );
    assert!(made > 100, "only {made} connections made");
    assert!(
        failed.is_empty(),
        "{} of {made} failed: {failed:?}",
        failed.len()
    );
}

/// A replica that claims `node` with a session newer than any, and answers the first
/// connection forwarded to it as one whose edge just left: it releases the node on its
/// routes, then refuses the dial as not held, without reading it.
struct LeavingReplica {
    dials: Arc<AtomicUsize>,
}

impl LeavingReplica {
    fn start(dir: &Path, listen: SocketAddr, node: &'static str) -> Self {
        let dials = Arc::new(AtomicUsize::new(0));
        let d = dials.clone();
        let server = tunnel_user::io::tls::peer_server_config(
            &dir.join("cloud.crt"),
            &dir.join("cloud.key"),
            &dir.join("ca.crt"),
        )
        .expect("peer server tls");
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::bind(listen).await.expect("bind");
                let _ = ready_tx.send(());
                let acceptor = tokio_rustls::TlsAcceptor::from(server);
                let (left, _) = tokio::sync::watch::channel(false);
                let left = Arc::new(left);
                while let Ok((tcp, _)) = listener.accept().await {
                    let (acceptor, d, left) = (acceptor.clone(), d.clone(), left.clone());
                    tokio::spawn(async move {
                        let Ok(tls) = acceptor.accept(tcp).await else {
                            return;
                        };
                        let Ok(mut conn) = h2::server::handshake(tls).await else {
                            return;
                        };
                        while let Some(Ok((req, respond))) = conn.accept().await {
                            let (d, left) = (d.clone(), left.clone());
                            tokio::spawn(leaving_stream(req, respond, node, d, left));
                        }
                    });
                }
            });
        });
        ready_rx
            .recv_timeout(Duration::from_secs(5))
            .expect("leaving replica listening");
        Self { dials }
    }
}

/// A gRPC message on the wire: not compressed, its length, the message.
fn grpc_message(message: &impl prost::Message) -> bytes::Bytes {
    let body = message.encode_to_vec();
    let mut framed = vec![0u8];
    framed.extend_from_slice(&(body.len() as u32).to_be_bytes());
    framed.extend_from_slice(&body);
    bytes::Bytes::from(framed)
}

async fn leaving_stream(
    req: http::Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<bytes::Bytes>,
    node: &'static str,
    dials: Arc<AtomicUsize>,
    left: Arc<tokio::sync::watch::Sender<bool>>,
) {
    match req.uri().path() {
        "/tunnel.v1.Peer/Routes" => {
            let mut resp = http::Response::new(());
            resp.headers_mut()
                .insert(proto::PEER_HELLO_METADATA, hello());
            resp.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/grpc"),
            );
            let Ok(mut send) = respond.send_response(resp, false) else {
                return;
            };
            let since = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .expect("clock")
                .as_millis() as u64
                + 60_000;
            let claim = proto::NodeClaim {
                node: node.into(),
                connected_at_ms: since,
            };
            let update = proto::RouteUpdate {
                reset: true,
                held: vec![claim],
                released: vec![],
            };
            let _ = send.send_data(grpc_message(&update), false);
            let mut leaving = left.subscribe();
            loop {
                let update = tokio::select! {
                    _ = leaving.changed() => proto::RouteUpdate {
                        reset: false,
                        held: vec![],
                        released: vec![node.into()],
                    },
                    () = tokio::time::sleep(Duration::from_millis(500)) => proto::RouteUpdate::default(),
                };
                if send.send_data(grpc_message(&update), false).is_err() {
                    return;
                }
            }
        }
        "/tunnel.v1.Peer/Dial" => {
            dials.fetch_add(1, Ordering::SeqCst);
            left.send_replace(true);
            // The release goes out before the refusal, as a replica's would.
            tokio::time::sleep(Duration::from_millis(50)).await;
            let refusal = proto::DialResult::refusal(
                proto::DialStatus::NotHeld,
                "replica `leaving` holds no edge session for the node".into(),
            );
            let _ = respond.send_response(refusal.into_http::<()>().map(|_| ()), true);
        }
        _ => {}
    }
}

/// A connection through replica B that B forwarded to the replica holding its edge, which
/// answers that it holds the edge no longer (its edge moved to B a moment ago), is opened
/// again where the edge is now, B itself, with the client's first bytes sent again: the
/// client sees its answer, not a reset. Before this, it was reset.
#[test]
fn a_forwarded_call_refused_as_not_held_is_opened_again_where_the_edge_is() {
    let dir = tempfile::tempdir().expect("tempdir");
    Pki::new(dir.path());
    std::fs::write(dir.path().join("tokens"), TOKENS).expect("tokens");
    let echo = echo_fixed();
    let b = Replica::new("b");
    let leaving_port = ClosedPort::new();
    let leaving = LeavingReplica::start(dir.path(), leaving_port.addr, "edge-1");
    let mut extra = common::config::forwards("edge-1", &[echo]);
    merge(&mut extra, toml::toml! { [admin] listen = "127.0.0.1:0" });
    let cloud_b = start_cloud_with(dir.path(), &b, &[leaving_port.addr], extra);
    let ready = cloud_b.ready();
    let (forward, admin) = (ready.addr("forward[0].listen"), ready.addr("admin.listen"));
    let _edge = start_edge(dir.path(), "edge-1", "t1", b.tunnel, &[], echo);
    cloud_b.wait_line(
        &["routes from replica changed", "held=1"],
        Duration::from_secs(10),
    );

    echo_once(forward, 7).expect("the connection, refused by the replica it went to");
    assert_eq!(leaving.dials.load(Ordering::SeqCst), 1);
    cloud_b.wait_log("opened again where the node is now", Duration::from_secs(1));
    let scrape = common::scrape(admin);
    assert_eq!(
        common::sample(&scrape, "tunnel_calls_rerouted_total"),
        1.0,
        "{scrape}"
    );
    assert_eq!(
        common::sample(&scrape, "tunnel_peer_forwards_total"),
        1.0,
        "{scrape}"
    );
}

/// Connections through replica B to an edge held by replica A while A is replaced as a
/// DaemonSet's rolling update replaces it: A' starts beside A and takes its listeners
/// over the handover socket, A stops accepting and drains, and the edge, behind a WAN
/// link (250 ms each way) and dialling one address as edges dial a load balancer,
/// registers again with A'. B's link to A's address ends with A's routes and comes back
/// to A' before the edge has registered there: the edge held a moment ago is moving, and
/// a connection waits for it rather than being refused. Before, B knew every replica's
/// holdings again once A' answered, found the node held nowhere, and refused at once:
/// the reset of the five-node rollout (node_e2e five_nodes).
#[test]
fn connections_through_a_replica_survive_the_other_handing_over_to_its_successor() {
    let dir = tempfile::tempdir().expect("tempdir");
    Pki::new(dir.path());
    std::fs::write(dir.path().join("tokens"), TOKENS).expect("tokens");
    let echo = echo_fixed();
    let (a, b) = (Replica::new("a"), Replica::new("b"));
    let handover = toml::toml! {
        [handover]
        socket = (dir.path().join("handover-a.sock").display().to_string())
    };
    let cloud_a = start_cloud_with(dir.path(), &a, &[b.peer], handover.clone());
    let cloud_b = start_cloud_with(
        dir.path(),
        &b,
        &[a.peer],
        common::config::forwards("edge-1", &[echo]),
    );
    let forward = cloud_b.ready().addr("forward[0].listen");
    for cloud in [&cloud_a, &cloud_b] {
        cloud.wait_log("linked to replica", Duration::from_secs(10));
    }
    let wan = tokio::runtime::Runtime::new().expect("runtime");
    let link = wan.block_on(common::inproc::DelayProxy::start(
        a.tunnel,
        Duration::from_millis(250),
    ));
    let edge = start_edge(dir.path(), "edge-1", "t1", link.addr, &[], echo);
    wait_echo_through(forward);

    // Each connection takes a round trip of the WAN link at least: clients enough for
    // some to start while the edge moves.
    let clients = EchoClients::start(forward, 16);
    std::thread::sleep(Duration::from_millis(300));
    let successor = Threaded::cloud_starting(
        dir.path(),
        "cloud-a-successor",
        replica_config(&a, &[b.peer], handover),
    );
    successor.wait_log(
        "standing by until it stops accepting",
        Duration::from_secs(10),
    );
    std::thread::sleep(Duration::from_millis(300));
    cloud_a.stop().expect("A drains and stops");
    successor.ready();
    edge.wait_log_count("registered with the cloud", 2, Duration::from_secs(10));
    cloud_b.wait_line(
        &["routes from replica changed", "held=1"],
        Duration::from_secs(5),
    );
    std::thread::sleep(Duration::from_millis(500));
    let (made, failed) = clients.finish();
    eprintln!(
        "edge-1 moved from A to its successor: {made} connections through B, {} failed",
        failed.len()
    );
    assert!(made >= 40, "only {made} connections made");
    assert!(
        failed.is_empty(),
        "{} of {made} failed: {:?}\nB's log:\n{}",
        failed.len(),
        &failed[..failed.len().min(5)],
        cloud_b.log_text()
    );
}
