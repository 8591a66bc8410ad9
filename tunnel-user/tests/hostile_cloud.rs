//! What a hostile or broken cloud can make a real edge do. A cloud that welcomes the
//! edge and drains it at once, over and over, gets ever slower reconnects, never more
//! than two connections open and one post_start hook running (the edge in this process,
//! [`Threaded`]). A cloud that asks for another address of the node than the one that
//! names it (`NODE_IPS`, the environment of a `tunnel edge` process) is refused with the
//! allowlist error.

#![expect(
    clippy::unwrap_used,
    reason = "a panic with its message is how a test reports failure"
)]
mod common;

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::config::write_toml;
use common::inproc::Threaded;
use common::probe::{self, count_lines, round_trip};
use common::{EdgeOpts, Proc, Setup, connect_via, servers};
use proto::edge_client::EdgeClient;
use proto::{Control, Drain, HelloReply, Welcome, control, hello_reply};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tunnel_user::config::TransportConfig;
use tunnel_user::io::transport::{self, Outgoing};

const TOKENS: &str = "edge-1:token-one\nedge-2:token-two\n";

/// Connections the fake cloud accepted, and how many were open at once.
#[derive(Default)]
struct Seen {
    accepted: AtomicUsize,
    open: AtomicUsize,
    most_open: AtomicUsize,
}

/// A cloud that welcomes every edge and in the same breath tells it to move to another
/// replica, and never closes a connection itself. It speaks as tunnel-cloud does: TLS
/// with the cloud certificate of `dir`, then the gRPC client side of the connection
/// (`io::transport`), the Edge.Control call, the edge's Hello, a Welcome, a Drain.
async fn draining_cloud(dir: &Path, seen: Arc<Seen>) -> SocketAddr {
    let tls =
        tunnel_user::io::tls::server_config(&dir.join("cloud.crt"), &dir.join("cloud.key"), None)
            .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            seen.accepted.fetch_add(1, Ordering::SeqCst);
            let open = seen.open.fetch_add(1, Ordering::SeqCst) + 1;
            seen.most_open.fetch_max(open, Ordering::SeqCst);
            let (acceptor, seen) = (acceptor.clone(), seen.clone());
            tokio::spawn(async move {
                if let Ok(tls) = acceptor.accept(tcp).await {
                    welcome_and_drain(tls).await;
                }
                seen.open.fetch_sub(1, Ordering::SeqCst);
            });
        }
    });
    addr
}

/// Welcomes and drains the edge on `tls`, then holds the connection until the edge
/// closes it.
async fn welcome_and_drain<T>(tls: T)
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let Ok((channel, connection)) =
        transport::client_handshake(&TransportConfig::default(), tls).await
    else {
        return;
    };
    let mut connection = std::pin::pin!(connection);
    let exchange = async {
        let (send, outgoing) = mpsc::channel::<Control>(4);
        let mut replies = EdgeClient::new(channel.clone())
            .control(Outgoing(outgoing))
            .await
            .ok()?
            .into_inner();
        // The edge's Hello comes first; anything else ends the exchange unanswered.
        let first = replies.message().await.ok()??;
        matches!(first.msg, Some(control::Msg::Hello(_))).then_some(())?;
        let welcome = HelloReply {
            result: Some(hello_reply::Result::Welcome(Welcome {
                protocol_version: proto::PROTOCOL_VERSION,
                cloud_id: "draining".into(),
                heartbeat_interval_ms: 1000,
            })),
        };
        for msg in [
            control::Msg::HelloReply(welcome),
            control::Msg::Drain(Drain {
                reason: "always".into(),
            }),
        ] {
            send.send(Control { msg: Some(msg) }).await.ok()?;
        }
        // Both ends of the call stay open for as long as the connection does.
        Some((send, replies))
    };
    let kept = tokio::select! {
        _ = &mut connection => return,
        kept = exchange => kept,
    };
    let _ = connection.await;
    drop(kept);
}

/// The hook's record: `start <pid>` and `end <pid>` lines, appended in the order they
/// happened; returns (hooks started, most running at once).
fn hook_runs(record: &Path) -> (usize, usize) {
    let text = std::fs::read_to_string(record).unwrap_or_default();
    let (mut started, mut running, mut most) = (0, 0usize, 0);
    for line in text.lines() {
        if line.starts_with("start ") {
            started += 1;
            running += 1;
            most = most.max(running);
        } else if line.starts_with("end ") {
            running = running.saturating_sub(1);
        }
    }
    (started, most)
}

#[test]
fn a_cloud_that_drains_every_session_at_once_gets_backoff_two_connections_and_one_hook() {
    const WINDOW: Duration = Duration::from_secs(6);
    let mut s = Setup::new(TOKENS);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let seen = Arc::new(Seen::default());
    s.tunnel = rt.block_on(draining_cloud(s.path(), seen.clone()));
    let record = s.path().join("hooks");
    // Each run takes 2 s: registrations closer together than that find one running.
    let hook = format!(
        "echo start $$ >> {0}; sleep 2; echo end $$ >> {0}",
        record.display()
    );
    let config = s.edge_config(&EdgeOpts {
        extra: toml::toml! {
            [hooks]
            post_start = ["sh", "-c", hook]
        },
        ..EdgeOpts::new("edge-1", "token-one")
    });
    let edge = Threaded::edge(s.path(), "edge-1", config);
    // A window of the real clock: the hook is a process that takes real time.
    std::thread::sleep(WINDOW);
    let accepted = seen.accepted.load(Ordering::SeqCst);
    let most_open = seen.most_open.load(Ordering::SeqCst);
    let (hooks, most_hooks) = hook_runs(&record);
    let log = edge.log_text();
    let skipped = count_lines(&log, &["post_start hook of an earlier registration"]);
    println!(
        "Welcome+Drain loop for {WINDOW:?}: {accepted} connections, at most {most_open} open at once; {hooks} post_start hooks run, at most {most_hooks} at once, {skipped} skipped"
    );
    // Backoff from 50-100 ms, doubling: at most 7 registrations fit in 6 s. Without it
    // the edge reconnected as fast as TLS allows, hundreds of times.
    assert!(
        (2..=8).contains(&accepted),
        "{accepted} connections in {WINDOW:?}:\n{log}"
    );
    assert!(
        log.contains("the cloud drained this session before it settled; backing off"),
        "{log}"
    );
    assert!(
        most_open <= 2,
        "{most_open} connections open at once: drained ones pile up"
    );
    assert!(
        hooks >= 1 && most_hooks == 1,
        "{hooks} hooks, {most_hooks} at once:\n{}",
        std::fs::read_to_string(&record).unwrap_or_default()
    );
    assert!(skipped >= 1, "no hook was skipped:\n{log}");
}

/// A non-loopback address of this host's interfaces: what the edge's interface
/// detection would allow beside the node's own. Not a link-local one, which a node
/// entry may not list (a test that runs beside this one may have put one on a veth).
fn another_interface_address() -> IpAddr {
    tunnel_user::addr::interface_addresses()
        .into_iter()
        .find(|a| matches!(a, IpAddr::V4(v4) if !v4.is_loopback() && !v4.is_link_local()))
        .expect(
            "this test needs an interface with a non-loopback, non-link-local IPv4 address (eth0)",
        )
}

/// Starts an edge as `node` with `[allow]` for `port` on the node's addresses only, and
/// `NODE_IPS=<node_ips>` in its environment when given.
fn start_edge(s: &Setup, node: &str, token: &str, port: u16, node_ips: Option<&str>) -> Proc {
    let config = s.path().join(format!("{node}.toml"));
    write_toml(
        &config,
        &s.edge_config(&EdgeOpts {
            extra: toml::toml! {
                [allow]
                targets = []
                ports = [port]
            },
            ..EdgeOpts::new(node, token)
        }),
    );
    let env = node_ips.map(|ips| format!("NODE_IPS={ips}"));
    let wrapper: Vec<&str> = match &env {
        Some(env) => vec!["env", env],
        None => Vec::new(),
    };
    let mut edge = Proc::start_via(
        node,
        s.path(),
        &wrapper,
        &["edge", "--config", config.to_str().unwrap()],
    );
    edge.wait_ready(Duration::from_secs(10));
    edge
}

#[test]
fn an_edge_given_its_node_address_refuses_the_node_s_other_interfaces() {
    let other = another_interface_address();
    let mut s = Setup::new(TOKENS);
    // 127.1.0.5 plays the address that names the node (its InternalIP).
    let sink = servers::sink("127.1.0.5:0");
    let port = sink.port();
    let _cloud = s.start_cloud(toml::toml! {
        [[node]]
        name = "edge-1"
        addresses = ["127.1.0.5", (other.to_string())]
    });
    let edge = start_edge(&s, "edge-1", "token-one", port, Some("127.1.0.5"));
    edge.wait_log("registered with the cloud", Duration::from_secs(10));

    let refused = connect_via(s.connect, &format!("{other}:{port}"))
        .expect_err("a dial to another interface's address");
    println!("CONNECT {other}:{port} (another interface): {refused}");
    assert!(refused.contains("403"), "{refused}");
    let line = format!("target {other}:{port} is not in this edge's allowlist");
    assert!(
        probe::eventually(Duration::from_secs(5), || edge.log_text().contains(&line)),
        "no `{line}` in the edge's log:\n{}",
        edge.log_text()
    );
    for authority in [format!("127.1.0.5:{port}"), format!("edge-1:{port}")] {
        round_trip(s.connect, &authority, 7, 1 << 16)
            .unwrap_or_else(|e| panic!("CONNECT {authority}, the node's address: {e}"));
    }

    // Neither allow.node_addresses nor NODE_IPS: the interfaces, with a warning that
    // says so.
    let fallback = start_edge(&s, "edge-2", "token-two", port, None);
    fallback.wait_log(
        "neither allow.node_addresses nor NODE_IPS",
        Duration::from_secs(5),
    );
    let log = fallback.log_text();
    assert!(log.contains(&other.to_string()), "{log}");
}
