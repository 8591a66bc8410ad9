//! Many simulated edges in one process, each with its own TLS connection to the cloud.
//! Each speaks what `tunnel edge` speaks (see `proto/tunnel.proto` and
//! `tunnel-user/src/edge/session.rs`): the gRPC server side of the connection (service
//! `Edge`, tonic on h2, with the edge's own HTTP/2 settings and call serving), its Hello
//! as the first message of the cloud's Control call, then a Pong for every Ping. The
//! cloud cannot tell them from real edges; what they cost the cloud is what 10,000 real
//! edges would.
//!
//! As a fleet behind many NATs: the edges of a site share a source address, each site
//! its own in 127.0.0.0/8 (bound before the connect). Each edge proves who it is with its
//! line of the cloud's token file or, as deploy/'s edges do, a client certificate of its
//! own signed by the tunnel CA (issued in memory before the first dial, so the cloud's
//! chain verification is in every handshake). An edge reconnects as the real edge does
//! (`tunnel_user::edge::Reconnect`: the next cloud of its list at once after a failure,
//! the edge's backoff once all failed), its list starting at cloud `i % len` and going
//! on in an order of its own, as a load balancer would spread a fleet.
//!
//! The bench runs them in a helper process (`helper.rs`, which reports on [`Stats`]);
//! `tunnel-user/tests/operability.rs` includes this file to hold more than 1,000 edges on
//! one cloud.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context, Result, bail};
use futures::Stream;
use proto::edge_server::{Edge, EdgeServer};
use proto::{Control, Hello, control, hello_reply};
use tokio::net::TcpSocket;
use tokio::sync::{Semaphore, oneshot};
use tokio::time::Instant;
use tokio_rustls::TlsConnector;
use tonic::{Request, Response, Status, Streaming};
use tunnel_user::config::TransportConfig;
use tunnel_user::edge::Reconnect;
use tunnel_user::io::transport;

/// The node name of simulated edge `i` (the token file has a line for each).
pub fn node_name(i: usize) -> String {
    format!("sim-{i:05}")
}

/// Edges behind one NAT: one source address for each this many.
const EDGES_PER_SITE: usize = 16;

/// The source address of simulated edge `i`: its site's, from 127.16.0.0 on (clear of
/// 127.0.0.1, where the clouds listen).
pub fn source_address(i: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(127, 16, 0, 0)) + (i / EDGES_PER_SITE) as u32)
}

/// How the simulated edges prove who they are.
pub enum Credential {
    /// The token every edge's line of the cloud's token file holds.
    Token(String),
    /// A client certificate for each, issued by the `tunnel certs` CA in this directory
    /// (`ca.crt`, `ca.key`).
    Certificate(PathBuf),
}

/// What the simulated edges of one [`spawn`] did so far.
#[derive(Default)]
pub struct Stats {
    /// Welcomed on their first connection.
    pub registered: AtomicU64,
    pub pings: AtomicU64,
    /// Connections that ended in an error or were not welcomed.
    pub failed: AtomicU64,
    /// Registrations refused because the replica was full (REPLICA_FULL).
    pub refused_full: AtomicU64,
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

/// The index into the clouds of edge `i`'s `k`th address: `i % len` first, then the
/// others in an order that differs from edge to edge, so a dead cloud's edges spread
/// over all the others.
fn cloud_of(i: usize, k: usize, len: usize) -> usize {
    let first = i % len;
    if k == 0 || len < 2 {
        return first;
    }
    (first + 1 + (i / len + k - 1) % (len - 1)) % len
}

/// The TLS set-up of edges `first .. first + n`: shared with a token; with
/// certificates, one each, issued now.
fn tls_configs(
    ca: &Path,
    credential: &Credential,
    first: usize,
    n: usize,
) -> Result<Vec<TlsConnector>> {
    match credential {
        Credential::Token(_) => Ok(vec![TlsConnector::from(
            tunnel_user::io::tls::client_config(ca, None)?,
        )]),
        Credential::Certificate(dir) => {
            let issuer = tunnel_user::certs::EdgeCa::load(dir)?;
            (first..first + n)
                .map(|i| {
                    let (cert, key) = issuer.issue(&node_name(i))?;
                    let config = tunnel_user::io::tls::client_config_with_key(ca, vec![cert], key)?;
                    Ok(TlsConnector::from(config))
                })
                .collect()
        }
    }
}

/// Edges `first .. first + n` ready to dial: their credentials made (the certificates
/// issued). [`Fleet::start`] then dials.
pub struct Fleet {
    clouds: Vec<SocketAddr>,
    first: usize,
    n: usize,
    tls: Vec<TlsConnector>,
    token: String,
}

impl Fleet {
    /// Edge `i` dials `clouds[i % len]` first (see [`cloud_of`]); `ca` is the CA of the
    /// clouds' certificate.
    pub fn new(
        clouds: &[SocketAddr],
        first: usize,
        ca: &Path,
        credential: &Credential,
        n: usize,
    ) -> Result<Self> {
        if clouds.is_empty() {
            bail!("no cloud to dial");
        }
        Ok(Self {
            clouds: clouds.to_vec(),
            first,
            n,
            tls: tls_configs(ca, credential, first, n)?,
            token: match credential {
                Credential::Token(token) => token.clone(),
                Credential::Certificate(_) => String::new(),
            },
        })
    }

    /// Starts the edges, at most `concurrency` registering at once (a first
    /// registration or one after a connection ended), and returns once the last has
    /// started. They run until the runtime stops.
    ///
    /// The bound stands in for what real edges have and the simulators do not: a CPU
    /// each. Unbounded, the attempts of thousands of edges share one simulator's core,
    /// all pass the handshake bound together, are made again, and starve the heartbeats
    /// of the edges already registered, which the replicas then drop (seen at 25,000
    /// edges on the loaded machine: 18,776 sessions dropped in one minute, none
    /// registered after).
    pub async fn start(self, concurrency: usize) -> Result<Arc<Stats>> {
        let stats = Arc::new(Stats::default());
        let gate = Arc::new(Semaphore::new(concurrency.max(1)));
        let transport = Arc::new(TransportConfig::default());
        let clouds = Arc::new(self.clouds);
        for i in self.first..self.first + self.n {
            let permit = gate.clone().acquire_owned().await?;
            let tls = self.tls[(i - self.first) % self.tls.len()].clone();
            let (stats, transport, token, clouds) = (
                stats.clone(),
                transport.clone(),
                self.token.clone(),
                clouds.clone(),
            );
            let gate = gate.clone();
            tokio::spawn(async move {
                let node = node_name(i);
                let mut reconnect = Reconnect::new(clouds.len());
                let mut first = Some(permit);
                let mut welcomed_before = false;
                // Until the runtime stops.
                loop {
                    // The edge's handshake bound starts once it has its slot.
                    let permit = match first.take() {
                        Some(permit) => permit,
                        None => match gate.clone().acquire_owned().await {
                            Ok(permit) => permit,
                            Err(_) => return,
                        },
                    };
                    let cloud = clouds[cloud_of(i, reconnect.current(), clouds.len())];
                    let (answer, answered) = oneshot::channel();
                    let conn = edge(
                        cloud,
                        source_address(i),
                        tls.clone(),
                        Hello {
                            protocol_version: proto::PROTOCOL_VERSION,
                            node_name: node.clone(),
                            token: token.clone(),
                            identity_kind: "node".into(),
                            agent_version: "bench-sim".into(),
                        },
                        &transport,
                        &stats,
                        permit,
                        welcomed_before,
                        answer,
                    );
                    tokio::pin!(conn);
                    // Registered within the handshake bound, as the edge's own attempt is.
                    let registered = tokio::select! {
                        ended = &mut conn => Err(ended.err().unwrap_or_else(|| anyhow::anyhow!("closed before the welcome"))),
                        welcome = answered => match welcome {
                            Ok(Ok(())) => Ok(()),
                            Ok(Err(refused)) => Err(anyhow::anyhow!("registration refused: {refused}")),
                            Err(_) => Err(anyhow::anyhow!("closed before the welcome")),
                        },
                        () = tokio::time::sleep(transport.handshake_timeout()) => Err(anyhow::anyhow!("handshake timed out")),
                    };
                    let back_off = match registered {
                        Ok(()) => {
                            welcomed_before = true;
                            reconnect.registered(true);
                            let since = Instant::now();
                            let _ = conn.await;
                            reconnect.session_ended(since.elapsed());
                            true
                        }
                        Err(e) => {
                            if stats.failed.fetch_add(1, Ordering::Relaxed) < 5 {
                                eprintln!("{node}: {e:#}");
                            }
                            reconnect.failed()
                        }
                    };
                    if back_off {
                        tokio::time::sleep(reconnect.delay()).await;
                    }
                }
            });
        }
        Ok(stats)
    }
}

/// One connection of a simulated edge from `source`, until it ends. `permit` is its
/// registration slot, held until the welcome; `again`: it was welcomed on an earlier
/// connection; `answer` gets the cloud's answer to its Hello.
#[expect(
    clippy::too_many_arguments,
    reason = "one call site, each argument named"
)]
async fn edge(
    cloud: SocketAddr,
    source: Ipv4Addr,
    tls: TlsConnector,
    hello: Hello,
    transport: &TransportConfig,
    stats: &Arc<Stats>,
    permit: tokio::sync::OwnedSemaphorePermit,
    again: bool,
    answer: oneshot::Sender<Result<(), String>>,
) -> Result<()> {
    let socket = TcpSocket::new_v4()?;
    socket
        .bind(SocketAddrV4::new(source, 0).into())
        .with_context(|| format!("bind {source}"))?;
    let tcp = socket.connect(cloud).await.context("connect")?;
    tcp.set_nodelay(true)?;
    let name = rustls::pki_types::ServerName::try_from("tunnel-cloud")?;
    let stream = tls.connect(name, tcp).await.context("TLS")?;
    let service = EdgeServer::new(SimEdge {
        hello: std::sync::Mutex::new(Some((hello, Some(permit), answer))),
        stats: stats.clone(),
        again,
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
    /// The Hello, the slot it holds until the cloud welcomes it, and where the answer
    /// goes.
    hello: std::sync::Mutex<Option<Greeting>>,
    stats: Arc<Stats>,
    /// Welcomed on an earlier connection: this welcome is a re-registration.
    again: bool,
}

type Greeting = (
    Hello,
    Option<tokio::sync::OwnedSemaphorePermit>,
    oneshot::Sender<Result<(), String>>,
);

type Messages<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl Edge for SimEdge {
    type ControlStream = Messages<Control>;

    async fn control(
        &self,
        request: Request<Streaming<Control>>,
    ) -> Result<Response<Self::ControlStream>, Status> {
        let (hello, permit, answer) = self
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
        let again = self.again;
        let mut recv = request.into_inner();
        tokio::spawn(async move {
            let (mut permit, mut answer) = (permit, Some(answer));
            while let Ok(Some(msg)) = recv.message().await {
                match msg.msg {
                    Some(control::Msg::HelloReply(r)) => match r.result {
                        Some(hello_reply::Result::Welcome(_)) => {
                            drop(permit.take());
                            // A welcome the attempt no longer waits for (past its
                            // handshake bound, its connection being closed) is none.
                            if answer.take().is_none_or(|a| a.send(Ok(())).is_err()) {
                                return;
                            }
                            if again {
                                stats.reregistered.fetch_add(1, Ordering::Relaxed);
                                stats.last_rereg_ms.fetch_max(unix_ms(), Ordering::Relaxed);
                            } else {
                                stats.registered.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        Some(hello_reply::Result::Reject(r))
                            if r.reason == proto::RejectReason::ReplicaFull as i32 =>
                        {
                            stats.refused_full.fetch_add(1, Ordering::Relaxed);
                            if let Some(answer) = answer.take() {
                                let _ = answer.send(Err("the replica is full".into()));
                            }
                            return;
                        }
                        other => {
                            if let Some(answer) = answer.take() {
                                let _ = answer.send(Err(format!("{other:?}")));
                            }
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
