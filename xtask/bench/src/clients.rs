//! Load the tools cannot make: new connections with one request each, a stalled
//! neighbour, thousands of idle connections held open. Every loop is bounded in time.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Semaphore;

const OP_TIMEOUT: Duration = Duration::from_secs(5);

pub fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

/// Connect, send one GET, read the whole response (Content-Length framed).
async fn one_request(addr: SocketAddr, path: &str) -> Result<()> {
    let mut s = TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: bench\r\n\r\n").as_bytes())
        .await?;
    let mut buf = Vec::with_capacity(2048);
    let mut chunk = [0u8; 4096];
    loop {
        let n = s.read(&mut chunk).await?;
        if n == 0 {
            bail!("connection closed before the response was complete");
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            if !head.starts_with("http/1.1 200") {
                bail!(
                    "unexpected response: {}",
                    head.lines().next().unwrap_or_default()
                );
            }
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .context("no content-length")?;
            if buf.len() >= end + 4 + len {
                return Ok(());
            }
        }
    }
}

pub struct NewConns {
    pub completed: u64,
    pub failed: u64,
    pub latencies_us: Vec<f64>,
    pub elapsed: Duration,
}

/// `concurrency` loops of connect + one request for `dur`.
pub async fn new_connections(
    addr: SocketAddr,
    path: &'static str,
    dur: Duration,
    concurrency: usize,
) -> NewConns {
    let deadline = Instant::now() + dur;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        tasks.push(tokio::spawn(async move {
            let (mut ok, mut failed, mut lat) = (0u64, 0u64, Vec::new());
            while Instant::now() < deadline {
                let t0 = Instant::now();
                match tokio::time::timeout(OP_TIMEOUT, one_request(addr, path)).await {
                    Ok(Ok(())) => {
                        ok += 1;
                        lat.push(t0.elapsed().as_secs_f64() * 1e6);
                    }
                    _ => {
                        failed += 1;
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
            }
            (ok, failed, lat)
        }));
    }
    let mut out = NewConns {
        completed: 0,
        failed: 0,
        latencies_us: Vec::new(),
        elapsed: Duration::ZERO,
    };
    for t in tasks {
        if let Ok((ok, failed, lat)) = t.await {
            out.completed += ok;
            out.failed += failed;
            out.latencies_us.extend(lat);
        }
    }
    out.elapsed = started.elapsed();
    out
}

/// Reads from `s` as fast as it can for `dur`; bytes read. A connection closed early
/// is an error unless `closed_ends`: then it ends the count (and says so).
async fn drain_for(s: &mut TcpStream, dur: Duration, closed_ends: bool) -> Result<Drained> {
    let mut buf = vec![0u8; 256 * 1024];
    let deadline = tokio::time::Instant::now() + dur;
    let mut bytes = 0u64;
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Err(_) => {
                return Ok(Drained {
                    bytes,
                    closed: false,
                });
            }
            Ok(Ok(0) | Err(_)) if closed_ends => {
                return Ok(Drained {
                    bytes,
                    closed: true,
                });
            }
            Ok(Ok(0)) => bail!("source closed the connection"),
            Ok(Ok(n)) => bytes += n as u64,
            Ok(Err(e)) => return Err(e.into()),
        }
    }
}

struct Drained {
    bytes: u64,
    /// The connection was closed (or reset) before the time was up.
    closed: bool,
}

/// What one connection downloaded in `neighbour_throughput`.
pub struct Neighbour {
    pub gbps: f64,
    /// Closed by the relay before the time was up (only with `closed_ends`).
    pub closed: bool,
}

/// Download throughput of one connection to the endless `source`, in Gbit/s, alone
/// (`stalled = false`) or while another connection to the same source is not read.
/// Both cases wait the same time before measuring and skip the same ramp-up.
/// `closed_ends`: a relay that closes the connection is measured, not an error: what
/// arrived before the close counts, over the whole time (for peers, whose failure is a
/// figure; the tunnel's is breakage).
pub async fn neighbour_throughput(
    source: SocketAddr,
    dur: Duration,
    stalled: bool,
    closed_ends: bool,
) -> Result<Neighbour> {
    let _stalled = if stalled {
        Some(TcpStream::connect(source).await?)
    } else {
        None
    };
    // Lets the stalled connection fill every buffer on the way, so it is stalled, not
    // ramping up.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut a = TcpStream::connect(source).await?;
    if drain_for(&mut a, Duration::from_millis(300), closed_ends)
        .await?
        .closed
    {
        return Ok(Neighbour {
            gbps: 0.0,
            closed: true,
        });
    }
    let d = drain_for(&mut a, dur, closed_ends).await?;
    Ok(Neighbour {
        gbps: d.bytes as f64 * 8.0 / dur.as_secs_f64() / 1e9,
        closed: d.closed,
    })
}

/// Opens `n` connections to an echo server, each proven with one byte echoed back.
pub async fn open_idle(
    addr: SocketAddr,
    n: usize,
    concurrency: usize,
    limit: Duration,
) -> Result<Vec<TcpStream>> {
    let gate = Arc::new(Semaphore::new(concurrency));
    let mut tasks = Vec::with_capacity(n);
    let deadline = tokio::time::Instant::now() + limit;
    for _ in 0..n {
        let permit = gate.clone().acquire_owned().await?;
        tasks.push(tokio::spawn(async move {
            let _permit = permit;
            tokio::time::timeout_at(deadline, async {
                let mut s = TcpStream::connect(addr).await?;
                s.write_all(b"x").await?;
                let mut b = [0u8; 1];
                s.read_exact(&mut b).await?;
                anyhow::Ok(s)
            })
            .await
            .map_err(|_| anyhow::anyhow!("timed out"))?
        }));
    }
    let mut held = Vec::with_capacity(n);
    let mut first_err = None;
    for t in tasks {
        match t.await? {
            Ok(s) => held.push(s),
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    if let Some(e) = first_err {
        bail!("only {} of {n} idle connections opened: {e:#}", held.len());
    }
    Ok(held)
}

/// Every `step`-th held connection still echoes: all were really held end to end.
pub async fn check_idle(held: &mut [TcpStream], step: usize) -> Result<usize> {
    let mut checked = 0;
    for s in held.iter_mut().step_by(step.max(1)) {
        tokio::time::timeout(OP_TIMEOUT, async {
            s.write_all(b"y").await?;
            let mut b = [0u8; 1];
            s.read_exact(&mut b).await?;
            anyhow::Ok(())
        })
        .await
        .map_err(|_| anyhow::anyhow!("held connection no longer echoes"))??;
        checked += 1;
    }
    Ok(checked)
}

/// Time from connect() to the first byte of the response to one GET on a new
/// connection; through an HTTP CONNECT proxy to `authority` when given (its 200 first).
pub async fn first_response(addr: SocketAddr, connect: Option<&str>) -> Result<Duration> {
    tokio::time::timeout(OP_TIMEOUT, async {
        let t0 = Instant::now();
        let mut s = TcpStream::connect(addr).await?;
        s.set_nodelay(true)?;
        if let Some(authority) = connect {
            s.write_all(
                format!("CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n").as_bytes(),
            )
            .await?;
            // Byte by byte, so nothing after the head is consumed.
            let mut head = Vec::new();
            let mut b = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") {
                if s.read(&mut b).await? == 0 || head.len() > 4096 {
                    bail!(
                        "CONNECT: no response head ({:?})",
                        String::from_utf8_lossy(&head)
                    );
                }
                head.push(b[0]);
            }
            if !head.starts_with(b"HTTP/1.1 200") {
                bail!("CONNECT refused: {}", String::from_utf8_lossy(&head));
            }
        }
        s.write_all(b"GET /small.txt HTTP/1.1\r\nHost: bench\r\n\r\n")
            .await?;
        let mut b = [0u8; 1];
        s.read_exact(&mut b).await?;
        anyhow::Ok(t0.elapsed())
    })
    .await
    .map_err(|_| anyhow::anyhow!("no response within {OP_TIMEOUT:?}"))?
}
