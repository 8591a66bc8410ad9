//! Probes for the reliability suite: process resources from /proc, checksummed round
//! trips, a long-lived canary connection, a raw TLS client speaking the Hello, and a
//! fault-injecting TCP proxy.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use super::connect_via;
use super::servers::{Pattern, hex, send_pattern};

fn status_field(pid: i32, field: &str) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Resident memory of `pid`, in KiB.
pub fn rss_kib(pid: i32) -> u64 {
    status_field(pid, "VmRSS:")
}

pub fn threads(pid: i32) -> u64 {
    status_field(pid, "Threads:")
}

/// Open file descriptors of `pid`.
pub fn fds(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Polls `f` until it returns true or `timeout` passes; returns the last answer.
pub fn eventually(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One checksummed round trip through the CONNECT proxy to a `servers::sink`:
/// `len` pattern bytes up, the sink's count and hash back.
pub fn round_trip(proxy: SocketAddr, authority: &str, seed: u64, len: u64) -> Result<(), String> {
    let mut s = connect_via(proxy, authority)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| e.to_string())?;
    let hash = send_pattern(Some(&mut s), seed, len).map_err(|e| format!("send: {e}"))?;
    s.shutdown(Shutdown::Write).map_err(|e| e.to_string())?;
    let mut answer = String::new();
    BufReader::new(&s)
        .read_line(&mut answer)
        .map_err(|e| format!("answer: {e}"))?;
    if answer.trim() == format!("{len} {hash}") {
        Ok(())
    } else {
        Err(format!("sink saw `{}`, sent {len} {hash}", answer.trim()))
    }
}

/// A connection kept open through the tunnel to a sink across a whole test: fed now and
/// then, and checked at the end: whatever else happened, it must not be disturbed.
pub struct Canary {
    stream: TcpStream,
    pattern: Pattern,
    hash: Sha256,
    sent: u64,
}

impl Canary {
    pub fn open(proxy: SocketAddr, authority: &str) -> Self {
        let stream = connect_via(proxy, authority).expect("canary CONNECT");
        Self {
            stream,
            pattern: Pattern::new(0x00CA_11A2),
            hash: Sha256::new(),
            sent: 0,
        }
    }

    pub fn feed(&mut self, len: usize) {
        let mut buf = vec![0u8; len];
        self.pattern.fill(&mut buf);
        self.hash.update(&buf);
        self.stream
            .write_all(&buf)
            .expect("canary connection broke");
        self.sent += len as u64;
    }

    /// FIN, then the sink's count and hash must match everything fed.
    pub fn finish(self) {
        self.stream.shutdown(Shutdown::Write).expect("canary FIN");
        let mut answer = String::new();
        BufReader::new(&self.stream)
            .read_line(&mut answer)
            .expect("canary answer");
        assert_eq!(
            answer.trim(),
            format!("{} {}", self.sent, hex(&self.hash.finalize())),
            "canary bytes differ"
        );
    }
}

/// Lines of `log` that contain every one of `needles`.
pub fn count_lines(log: &str, needles: &[&str]) -> usize {
    log.lines()
        .filter(|l| needles.iter().all(|n| l.contains(n)))
        .count()
}

/// A TCP connection from `source` (a loopback address) to `to`.
pub fn tcp_from(source: &str, to: SocketAddr) -> std::io::Result<TcpStream> {
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    let bind: SocketAddr = format!("{source}:0").parse().expect("source address");
    sock.bind(&bind.into())?;
    sock.connect_timeout(&to.into(), Duration::from_secs(5))?;
    Ok(sock.into())
}

/// An edge done by hand: TLS, then the gRPC server side of the connection with the h2
/// crate, so a test can send the cloud what no real edge would. Keep it to keep the
/// connection: `drive` serves it until the cloud ends it.
pub struct FakeEdge {
    conn: h2::server::Connection<
        tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
        bytes::Bytes,
    >,
    /// The response side of the cloud's Edge.Control call.
    pub control: h2::SendStream<bytes::Bytes>,
}

impl FakeEdge {
    /// Serves the connection until the cloud ends it, within `bound`; how long it took.
    pub async fn drive(mut self, bound: Duration) -> Option<Duration> {
        let started = Instant::now();
        let ended = tokio::time::timeout(bound, async {
            while let Some(Ok(_)) = self.conn.accept().await {}
        })
        .await;
        ended.ok().map(|()| started.elapsed())
    }
}

/// Connects from `source` to the cloud's edge listener as a `FakeEdge`, answers the
/// cloud's Edge.Control call with `first` (raw bytes of the response body: gRPC
/// messages, or anything else), and returns the cloud's first message (its HelloReply).
pub async fn fake_edge(
    cloud: SocketAddr,
    ca: &Path,
    source: &str,
    first: Vec<u8>,
) -> Result<(proto::HelloReply, FakeEdge), String> {
    let mut config =
        (*tunnel_user::io::tls::client_config(ca, None).map_err(|e| e.to_string())?).clone();
    config.alpn_protocols = vec![proto::ALPN.to_vec()];
    let name = rustls_pki_types::ServerName::try_from("tunnel-cloud").expect("name");
    let tcp = tcp_from(source, cloud).map_err(|e| e.to_string())?;
    tcp.set_nonblocking(true).map_err(|e| e.to_string())?;
    let tcp = tokio::net::TcpStream::from_std(tcp).map_err(|e| e.to_string())?;
    let tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
        .connect(name, tcp)
        .await
        .map_err(|e| format!("TLS: {e}"))?;
    let exchange = async {
        let mut conn = h2::server::handshake(tls)
            .await
            .map_err(|e| format!("HTTP/2: {e}"))?;
        let (request, mut respond) = conn
            .accept()
            .await
            .ok_or("closed before the Control call")?
            .map_err(|e| format!("Control call: {e}"))?;
        let response = http::Response::builder()
            .header("content-type", "application/grpc")
            .body(())
            .expect("response");
        let mut control = respond
            .send_response(response, false)
            .map_err(|e| e.to_string())?;
        control
            .send_data(first.into(), false)
            .map_err(|e| e.to_string())?;
        let mut body = request.into_body();
        let mut got = Vec::new();
        // Drive the connection while reading the cloud's first message.
        let reply = loop {
            if got.len() >= 5 {
                let len = u32::from_be_bytes([got[1], got[2], got[3], got[4]]) as usize;
                if got.len() >= 5 + len {
                    let msg = <proto::Control as prost::Message>::decode(&got[5..5 + len])
                        .map_err(|e| e.to_string())?;
                    match msg.msg {
                        Some(proto::control::Msg::HelloReply(r)) => break r,
                        other => return Err(format!("the cloud sent {other:?} first")),
                    }
                }
            }
            let data = tokio::select! {
                d = body.data() => d,
                a = conn.accept() => return Err(format!("the cloud made another call first: {:?}", a.map(|a| a.map(|(r, _)| r.uri().clone())))),
            };
            match data {
                Some(Ok(d)) => {
                    let _ = body.flow_control().release_capacity(d.len());
                    got.extend_from_slice(&d);
                }
                Some(Err(e)) => return Err(format!("the cloud reset the Control call: {e}")),
                None => return Err("the cloud ended the Control call without a reply".into()),
            }
        };
        Ok((reply, FakeEdge { conn, control }))
    };
    tokio::time::timeout(Duration::from_secs(15), exchange)
        .await
        .map_err(|_| "no reply within 15 s".to_string())?
}

/// `fake_edge` for tests without a runtime: returns the HelloReply, or what went wrong.
pub fn tls_send(
    cloud: SocketAddr,
    ca: &Path,
    source: &str,
    first: &[u8],
) -> Result<proto::HelloReply, String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(fake_edge(cloud, ca, source, first.to_vec()))
        .map(|(reply, _)| reply)
}

/// `msg` as one gRPC message: a flag byte (not compressed), the length, the message.
pub fn grpc_frame(msg: &impl prost::Message) -> Vec<u8> {
    let body = msg.encode_to_vec();
    let mut frame = vec![0];
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend_from_slice(&body);
    frame
}

/// An edge's first Control message: its Hello, as `node` with `token`.
pub fn hello_frame(node: &str, token: &str) -> Vec<u8> {
    let hello = proto::Hello {
        protocol_version: proto::PROTOCOL_VERSION,
        node_name: node.into(),
        token: token.into(),
        identity_kind: "node".into(),
        agent_version: "test".into(),
    };
    grpc_frame(&proto::Control {
        msg: Some(proto::control::Msg::Hello(hello)),
    })
}

/// A TCP proxy between edge and cloud that can black-hole traffic (a partition: bytes
/// vanish, nothing is closed) or cut every connection (an RST-free close).
pub struct FaultProxy {
    pub addr: SocketAddr,
    blackhole: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<TcpStream>>>,
    pub accepted: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl FaultProxy {
    pub fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind proxy");
        let addr = listener.local_addr().expect("addr");
        let blackhole = Arc::new(AtomicBool::new(false));
        let conns: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let accepted = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (bh, cs, acc, st) = (
            blackhole.clone(),
            conns.clone(),
            accepted.clone(),
            stop.clone(),
        );
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if st.load(Ordering::Relaxed) {
                    return;
                }
                let Ok(client) = client else { continue };
                acc.fetch_add(1, Ordering::Relaxed);
                let _ = client.set_nodelay(true);
                let mut list = cs.lock().unwrap();
                list.retain(|c: &TcpStream| c.peer_addr().is_ok());
                list.push(client.try_clone().expect("clone"));
                if bh.load(Ordering::Relaxed) {
                    // Partitioned: the SYN got an answer from the kernel, nothing more will.
                    let bh = bh.clone();
                    std::thread::spawn(move || pump(client, None, bh));
                    continue;
                }
                let Ok(server) = TcpStream::connect(upstream) else {
                    continue;
                };
                let _ = server.set_nodelay(true);
                list.push(server.try_clone().expect("clone"));
                drop(list);
                let (c2, s2) = (
                    client.try_clone().expect("clone"),
                    server.try_clone().expect("clone"),
                );
                let (b1, b2) = (bh.clone(), bh.clone());
                std::thread::spawn(move || pump(client, Some(server), b1));
                std::thread::spawn(move || pump(s2, Some(c2), b2));
            }
        });
        Self {
            addr,
            blackhole,
            conns,
            accepted,
            stop,
        }
    }

    pub fn partition(&self, on: bool) {
        self.blackhole.store(on, Ordering::Relaxed);
    }

    /// Closes every connection through the proxy (both sides see a FIN).
    pub fn cut_all(&self) {
        for c in self.conns.lock().unwrap().drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.cut_all();
        let _ = TcpStream::connect(self.addr);
    }
}

/// Copies `from` to `to`, dropping the bytes while the black hole is on.
fn pump(mut from: TcpStream, to: Option<TcpStream>, blackhole: Arc<AtomicBool>) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if blackhole.load(Ordering::Relaxed) {
            continue;
        }
        if let Some(mut to) = to.as_ref()
            && to.write_all(&buf[..n]).is_err()
        {
            break;
        }
    }
    if let Some(to) = to {
        let _ = to.shutdown(Shutdown::Write);
    }
}
