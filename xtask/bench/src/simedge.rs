//! Many simulated edges in one process, each with its own TLS connection to the cloud.
//! Each speaks what `tunnel edge` speaks (see `proto/tunnel.proto` and
//! `tunnel-user/src/edge/session.rs`): the gRPC server side of the connection (service
//! `Edge`, tonic on h2, with the edge's own HTTP/2 settings and call serving), its Hello
//! as the first message of the cloud's Control call, then a Pong for every Ping. The
//! cloud cannot tell them from real edges; what they cost the cloud is what 10,000 real
//! edges would. An edge whose connection ends dials the next cloud of its list (as a
//! real edge falls back to `cloud.addresses`).
//!
//! The bench runs them in a helper process (`helper.rs`, which reports on [`Stats`]);
//! `tunnel-user/tests/operability.rs` includes this file to hold more than 1,000 edges on
//! one cloud.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use std::pin::Pin;

use anyhow::{Context, Result, bail};
use futures::Stream;
use proto::edge_server::{Edge, EdgeServer};
use proto::{Control, Hello, control, hello_reply};
use tokio::net::TcpStream;
use tokio::sync::Semaphore;
use tokio_rustls::TlsConnector;
use tonic::{Request, Response, Status, Streaming};
use tunnel_user::config::TransportConfig;
use tunnel_user::io::transport;

/// The node name of simulated edge `i` (the token file has a line for each).
pub fn node_name(i: usize) -> String {
    format!("sim-{i:05}")
}

/// What the simulated edges of one [`spawn`] did so far.
#[derive(Default)]
pub struct Stats {
    /// Welcomed on their first connection.
    pub registered: AtomicU64,
    pub pings: AtomicU64,
    /// Connections that ended in an error.
    pub failed: AtomicU64,
    /// Welcomed again after a connection ended.
    pub reregistered: AtomicU64,
    /// Unix time (ms) of the latest re-registration.
    pub last_rereg_ms: AtomicU64,
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Starts edges `first .. first + n`, at most `concurrency` registering at once, and
/// returns once the last has started. Edge `i` dials `clouds[i % len]` first and, each
/// time its connection ends, another of them (spread, so a dead cloud's edges land on all
/// the others). They run until the runtime stops.
pub async fn spawn(
    clouds: &[SocketAddr],
    first: usize,
    ca: &Path,
    token: &str,
    n: usize,
    concurrency: usize,
) -> Result<Arc<Stats>> {
    if clouds.is_empty() {
        bail!("no cloud to dial");
    }
    let tls = TlsConnector::from(tunnel_user::io::tls::client_config(ca, None)?);
    let stats = Arc::new(Stats::default());
    let gate = Arc::new(Semaphore::new(concurrency.max(1)));
    let transport = Arc::new(TransportConfig::default());
    for i in first..first + n {
        let permit = gate.clone().acquire_owned().await?;
        let (tls, stats, transport, token, clouds) = (
            tls.clone(),
            stats.clone(),
            transport.clone(),
            token.to_string(),
            clouds.to_vec(),
        );
        tokio::spawn(async move {
            let node = node_name(i);
            let mut at = i % clouds.len();
            let mut permit = Some(permit);
            let mut welcomed_before = false;
            // Until the runtime stops.
            loop {
                let welcomed = Arc::new(std::sync::atomic::AtomicBool::new(false));
                let r = edge(
                    clouds[at],
                    tls.clone(),
                    &node,
                    &token,
                    &transport,
                    &stats,
                    permit.take(),
                    welcomed_before,
                    welcomed.clone(),
                )
                .await;
                if let Err(e) = r
                    && stats.failed.fetch_add(1, Ordering::Relaxed) < 5
                {
                    eprintln!("{node}: {e:#}");
                }
                welcomed_before |= welcomed.load(Ordering::Relaxed);
                if clouds.len() > 1 {
                    at = (at + 1 + (i / clouds.len()) % (clouds.len() - 1)) % clouds.len();
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
    }
    Ok(stats)
}

/// One connection of a simulated edge, until it ends. `permit` is the registration
/// slot of its first connection; `again`: it was welcomed on an earlier one; `welcomed`
/// is set when this one is.
#[expect(
    clippy::too_many_arguments,
    reason = "one call site, each argument named"
)]
async fn edge(
    cloud: SocketAddr,
    tls: TlsConnector,
    node: &str,
    token: &str,
    transport: &TransportConfig,
    stats: &Arc<Stats>,
    permit: Option<tokio::sync::OwnedSemaphorePermit>,
    again: bool,
    welcomed: Arc<std::sync::atomic::AtomicBool>,
) -> Result<()> {
    let tcp = TcpStream::connect(cloud).await.context("connect")?;
    tcp.set_nodelay(true)?;
    let name = rustls::pki_types::ServerName::try_from("tunnel-cloud")?;
    let stream = tls.connect(name, tcp).await.context("TLS")?;
    let hello = Hello {
        protocol_version: proto::PROTOCOL_VERSION,
        node_name: node.to_string(),
        token: token.to_string(),
        identity_kind: "node".into(),
        agent_version: "bench-sim".into(),
    };
    let service = EdgeServer::new(SimEdge {
        hello: std::sync::Mutex::new(Some((hello, permit))),
        stats: stats.clone(),
        again,
        welcomed,
    });
    let mut conn = transport::server_handshake(transport, stream).await?;
    while let Some(accepted) = conn.accept().await {
        let (request, respond) = accepted?;
        tokio::spawn(transport::serve_call(service.clone(), request, respond));
    }
    Ok(())
}

/// The `Edge` service of one simulated edge: Control only.
struct SimEdge {
    /// The Hello, and the slot it holds until the cloud welcomes it.
    hello: std::sync::Mutex<Option<(Hello, Option<tokio::sync::OwnedSemaphorePermit>)>>,
    stats: Arc<Stats>,
    /// Welcomed on an earlier connection: this welcome is a re-registration.
    again: bool,
    welcomed: Arc<std::sync::atomic::AtomicBool>,
}

type Messages<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl Edge for SimEdge {
    type ControlStream = Messages<Control>;

    async fn control(
        &self,
        request: Request<Streaming<Control>>,
    ) -> Result<Response<Self::ControlStream>, Status> {
        let (hello, permit) = self
            .hello
            .lock()
            .expect("lock")
            .take()
            .ok_or_else(|| Status::failed_precondition("a second Control call"))?;
        let (tx, rx) = tokio::sync::mpsc::channel(8);
        let _ = tx.try_send(Ok(Control {
            msg: Some(control::Msg::Hello(hello)),
        }));
        let stats = self.stats.clone();
        let (again, welcomed) = (self.again, self.welcomed.clone());
        let mut recv = request.into_inner();
        tokio::spawn(async move {
            let mut permit = permit;
            while let Ok(Some(msg)) = recv.message().await {
                match msg.msg {
                    Some(control::Msg::HelloReply(r)) => match r.result {
                        Some(hello_reply::Result::Welcome(_))
                            if !welcomed.swap(true, Ordering::Relaxed) =>
                        {
                            drop(permit.take());
                            if again {
                                stats.reregistered.fetch_add(1, Ordering::Relaxed);
                                stats.last_rereg_ms.fetch_max(unix_ms(), Ordering::Relaxed);
                            } else {
                                stats.registered.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        other => {
                            eprintln!("not welcomed: {other:?}");
                            return;
                        }
                    },
                    Some(control::Msg::Ping(p)) => {
                        stats.pings.fetch_add(1, Ordering::Relaxed);
                        let pong = Control {
                            msg: Some(control::Msg::Pong(proto::Pong {
                                sequence: p.sequence,
                            })),
                        };
                        if tx.send(Ok(pong)).await.is_err() {
                            return;
                        }
                    }
                    _ => {}
                }
            }
        });
        let stream =
            futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
        Ok(Response::new(Box::pin(stream)))
    }
}
