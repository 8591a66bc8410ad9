//! Many simulated edges in one process, each with its own TLS connection to the cloud.
//! Each speaks what `tunnel edge` speaks (see `proto/tunnel.proto` and
//! `tunnel-user/src/edge/session.rs`): Hello, Welcome, then the HTTP/2 server side with
//! the edge's own settings, answering every Ping on the control stream with a Pong.
//! The cloud cannot tell them from real edges; what they cost the cloud is what 10,000
//! real edges would.
//!
//! Output on stdout, one line each: `registered <n> <ms>` once all n edges have their
//! control stream open (the cloud starts the heartbeat right after registering), then
//! `pings <total> failed <n>` every second.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use proto::{Control, FrameDecoder, Hello, HelloReply, control, hello_reply};
use tokio::net::TcpStream;
use tokio::sync::Semaphore;
use tokio_rustls::TlsConnector;
use tunnel_user::config::TransportConfig;

#[derive(Default)]
struct Stats {
    registered: AtomicU64,
    pings: AtomicU64,
    failed: AtomicU64,
}

pub async fn run(
    cloud: SocketAddr,
    ca: &Path,
    token: &str,
    n: usize,
    concurrency: usize,
) -> Result<()> {
    let tls = TlsConnector::from(tunnel_user::tls::client_config(ca, None)?);
    let stats = Arc::new(Stats::default());
    let gate = Arc::new(Semaphore::new(concurrency.max(1)));
    let transport = Arc::new(TransportConfig::default());
    let started = Instant::now();
    for i in 0..n {
        let permit = gate.clone().acquire_owned().await?;
        let (tls, stats, transport, token) = (
            tls.clone(),
            stats.clone(),
            transport.clone(),
            token.to_string(),
        );
        tokio::spawn(async move {
            let node = format!("sim-{i:05}");
            if let Err(e) = edge(cloud, tls, &node, &token, &transport, &stats, permit).await
                && stats.failed.fetch_add(1, Ordering::Relaxed) < 5
            {
                eprintln!("{node}: {e:#}");
            }
        });
    }
    // Registered means the cloud opened the control stream: its session is up.
    let deadline = Instant::now() + Duration::from_secs(240);
    loop {
        let (done, failed) = (
            stats.registered.load(Ordering::Relaxed),
            stats.failed.load(Ordering::Relaxed),
        );
        if done as usize == n {
            println!("registered {n} {}", started.elapsed().as_millis());
            break;
        }
        if failed > 0 && (done + failed) as usize >= n {
            bail!("{failed} of {n} simulated edges failed to register");
        }
        if Instant::now() > deadline {
            bail!("only {done} of {n} simulated edges registered");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        println!(
            "pings {} failed {}",
            stats.pings.load(Ordering::Relaxed),
            stats.failed.load(Ordering::Relaxed)
        );
    }
}

async fn edge(
    cloud: SocketAddr,
    tls: TlsConnector,
    node: &str,
    token: &str,
    transport: &TransportConfig,
    stats: &Stats,
    permit: tokio::sync::OwnedSemaphorePermit,
) -> Result<()> {
    let tcp = TcpStream::connect(cloud).await.context("connect")?;
    tcp.set_nodelay(true)?;
    let name = rustls::pki_types::ServerName::try_from("tunnel-cloud")?;
    let mut stream = tls.connect(name, tcp).await.context("TLS")?;
    let hello = Hello {
        protocol_version: proto::PROTOCOL_VERSION,
        node_name: node.to_string(),
        token: token.to_string(),
        identity_kind: "node".into(),
        agent_version: "bench-sim".into(),
    };
    proto::write_frame(&mut stream, &hello).await?;
    let reply: HelloReply = proto::read_frame(&mut stream).await?;
    match reply.result {
        Some(hello_reply::Result::Welcome(_)) => {}
        other => bail!("not welcomed: {other:?}"),
    }
    let mut conn = tunnel_user::transport::server_builder(transport)
        .handshake::<_, Bytes>(stream)
        .await?;
    let mut permit = Some(permit);
    while let Some(accepted) = conn.accept().await {
        let (req, mut respond) = accepted?;
        if req.uri().path() != proto::CONTROL_PATH {
            let mut resp = http::Response::new(());
            *resp.status_mut() = http::StatusCode::NOT_FOUND;
            let _ = respond.send_response(resp, true);
            continue;
        }
        let mut send = respond.send_response(http::Response::new(()), false)?;
        if permit.take().is_some() {
            stats.registered.fetch_add(1, Ordering::Relaxed);
        }
        let mut recv = req.into_body();
        // The control stream runs beside the connection, which must keep being polled.
        let pings = async {
            let mut decoder = FrameDecoder::default();
            while let Some(data) = recv.data().await {
                let data = data?;
                let _ = recv.flow_control().release_capacity(data.len());
                decoder.push(&data);
                while let Some(msg) = decoder.next_message::<Control>()? {
                    if let Some(control::Msg::Ping(p)) = msg.msg {
                        stats.pings.fetch_add(1, Ordering::Relaxed);
                        let pong = Control {
                            msg: Some(control::Msg::Pong(proto::Pong {
                                sequence: p.sequence,
                            })),
                        };
                        send.send_data(proto::encode_frame(&pong), false)?;
                    }
                }
            }
            anyhow::Ok(())
        };
        let serve = async {
            while let Some(more) = conn.accept().await {
                let (_, mut respond) = more?;
                let _ = respond.send_response(http::Response::new(()), true);
            }
            anyhow::Ok(())
        };
        tokio::select! {
            r = pings => r?,
            r = serve => r?,
        }
        return Ok(());
    }
    Ok(())
}
