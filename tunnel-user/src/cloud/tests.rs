//! A whole cloud in this process, the way a test embeds it: listeners bound on port 0
//! and handed in, a cancellation token to stop it.

use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use super::{Bound, Loaded, serve_loaded};
use crate::certs::{CertsArgs, generate};
use crate::config::{CloudConfig, EdgeConfig};

/// Serves on listeners the test bound (on port 0) until `shutdown` is
/// cancelled, then drains; the addresses in `config` of what `bound` holds are not used.
/// No handover; eBPF programs in `bound` must be linked already.
async fn serve(
    config: CloudConfig,
    bound: Bound,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let loaded = Loaded::load(&config, &shutdown).await?;
    let loaded = loaded.expect("no certificate to wait for");
    serve_loaded(&config, loaded, bound, shutdown).await
}

/// Echoes every connection's bytes back.
async fn echo_server() -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind echo");
    let addr = listener.local_addr().expect("echo addr");
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = conn.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    addr
}

/// `CONNECT authority` through the proxy at `proxy`: the stream after the answer, and
/// the answer's status line.
async fn connect_via(
    proxy: std::net::SocketAddr,
    authority: &str,
) -> std::io::Result<(BufReader<TcpStream>, String)> {
    let mut tcp = TcpStream::connect(proxy).await?;
    tcp.write_all(format!("CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n").as_bytes())
        .await?;
    let mut tcp = BufReader::new(tcp);
    let mut status = String::new();
    tcp.read_line(&mut status).await?;
    loop {
        let mut line = String::new();
        if tcp.read_line(&mut line).await? == 0 || line == "\r\n" {
            break;
        }
    }
    Ok((tcp, status))
}

/// An edge registers with a cloud served on listeners the test bound, a connection
/// through the cloud's HTTP CONNECT entry reaches an echo server behind the edge, and
/// the cloud stops promptly, with Ok, when its token is cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_process_cloud_carries_a_connection_and_stops_on_its_token() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut certs = CertsArgs::new(dir.path());
    certs.edges = vec!["edge-1".into()];
    generate(&certs).expect("certificates");
    let echo = echo_server().await;

    let edges = TcpListener::bind("127.0.0.1:0").await.expect("bind edges");
    let connect = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind connect");
    let (edges_addr, connect_addr) = (edges.local_addr().unwrap(), connect.local_addr().unwrap());
    // The listen addresses are placeholders: the bound listeners are handed in.
    let cloud_toml = r#"
[tunnel]
listen = "127.0.0.1:0"
cert = "cloud.crt"
key = "cloud.key"
client_ca = "ca.crt"
cloud_id = "in-process"
drain_timeout = "1s"

[connect]
listen = "127.0.0.1:0"
"#;
    let config = CloudConfig::parse(&dir.path().join("cloud.toml"), cloud_toml).expect("cloud");
    let mut bound = Bound::edges(Some(edges));
    bound.connect_tcp = Some(connect);
    let stop_cloud = CancellationToken::new();
    let cloud = tokio::spawn(serve(config, bound, stop_cloud.clone()));

    let edge_toml = format!(
        r#"
node_name = "edge-1"

[cloud]
address = "{edges_addr}"
server_name = "tunnel-cloud"
ca = "ca.crt"
cert = "edge-edge-1.crt"
key = "edge-edge-1.key"

[allow]
targets = ["{echo}"]
"#
    );
    let edge_config =
        EdgeConfig::parse(&dir.path().join("edge.toml"), &edge_toml, None).expect("edge");
    let stop_edge = CancellationToken::new();
    let edge = tokio::spawn(crate::edge::run(edge_config, None, None, stop_edge.clone()));

    // By name: until the edge has registered, the cloud knows no node `edge-1` (404).
    let authority = format!("edge-1:{}", echo.port());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut tunnel = loop {
        let (tunnel, status) = connect_via(connect_addr, &authority)
            .await
            .expect("CONNECT");
        if status.starts_with("HTTP/1.1 200") {
            break tunnel;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the edge never registered: {status}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let message = b"through the tunnel and back";
    tunnel.write_all(message).await.expect("send");
    let mut back = vec![0u8; message.len()];
    tokio::time::timeout(Duration::from_secs(10), tunnel.read_exact(&mut back))
        .await
        .expect("echo in time")
        .expect("echo");
    assert_eq!(back, message);
    drop(tunnel);

    stop_cloud.cancel();
    let stopped = tokio::time::timeout(Duration::from_secs(15), cloud)
        .await
        .expect("the cloud stops within its drain bound")
        .expect("the cloud task");
    assert!(stopped.is_ok(), "{stopped:?}");
    // Its listeners went with it.
    assert!(TcpStream::connect(connect_addr).await.is_err());

    stop_edge.cancel();
    tokio::time::timeout(Duration::from_secs(15), edge)
        .await
        .expect("the edge stops")
        .expect("the edge task")
        .expect("the edge's run");
}

/// The wait of a connection redirected right after a takeover (`entry::redirect`) ends
/// the moment the node's edge registers: woken by the registry, not at a poll's tick
/// (paused time: the wait ends at the very instant the session is added).
#[tokio::test(start_paused = true)]
async fn the_takeover_wait_for_an_edge_ends_as_it_registers() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut certs = CertsArgs::new(dir.path());
    certs.edges = vec!["edge-1".into()];
    generate(&certs).expect("certificates");
    let cloud_toml = r#"
[tunnel]
listen = "127.0.0.1:0"
cert = "cloud.crt"
key = "cloud.key"
client_ca = "ca.crt"
cloud_id = "in-process"
"#;
    let config = CloudConfig::parse(&dir.path().join("cloud.toml"), cloud_toml).expect("cloud");
    let stop = CancellationToken::new();
    let loaded = super::Loaded::load(&config, &stop).await.expect("loaded");
    let mut loaded = loaded.expect("no certificate to wait for");
    let mut metrics = prometheus_client::registry::Registry::default();
    let (c, admission) = super::Components::build(
        &config,
        &mut loaded,
        None,
        "in-process",
        &mut metrics,
        &stop,
    )
    .expect("components");
    let edges = TcpListener::bind("127.0.0.1:0").await.expect("bind edges");
    let edges_addr = edges.local_addr().unwrap();
    let incoming = crate::io::accept::Incoming::new(edges, "edges", 16, stop.clone());
    tokio::spawn(super::edges::admission::serve(
        std::sync::Arc::new(admission),
        incoming,
    ));
    let router = c.router.clone();
    let waiting = tokio::spawn(async move {
        router.until_here("edge-1").await;
        tokio::time::Instant::now()
    });

    // Off any 10 ms tick of the wait's start.
    tokio::time::sleep(Duration::from_millis(3_005)).await;
    assert!(!waiting.is_finished(), "the wait ended without an edge");
    let edge_toml = format!(
        r#"
node_name = "edge-1"

[cloud]
address = "{edges_addr}"
server_name = "tunnel-cloud"
ca = "ca.crt"
cert = "edge-edge-1.crt"
key = "edge-edge-1.key"
"#
    );
    let edge_config =
        EdgeConfig::parse(&dir.path().join("edge.toml"), &edge_toml, None).expect("edge");
    let registered = c.registry.subscribe();
    let edge_started = tokio::time::Instant::now();
    let edge = tokio::spawn(crate::edge::run(edge_config, None, None, stop.clone()));
    let ended = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the wait ends once the edge registers")
        .expect("the wait");
    assert!(c.router.is_here("edge-1"));
    assert!(registered.has_changed().unwrap(), "the registry changed");
    let after = ended - edge_started;
    assert!(
        after < Duration::from_millis(5),
        "the wait ended {after:?} after the edge started"
    );
    stop.cancel();
    let _ = edge.await;
}
