//! A delaying TCP proxy for the round-trip figures: every chunk is written `one_way`
//! after it was read, in order, both ways (the kernel here has no sch_netem). Loopback
//! only; threads, because it carries a few connections at a time.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Result;

pub struct DelayProxy {
    pub addr: SocketAddr,
    conns: Arc<Mutex<Vec<TcpStream>>>,
    stop: Arc<AtomicBool>,
}

impl DelayProxy {
    /// `handshake`: also hold a new connection's first bytes one round trip, as a TCP
    /// handshake across the same distance would (the client's connect() to this proxy
    /// completes at once, on loopback). The tunnel's own link pays it once, at
    /// registration; a direct client and each of rathole's data channels, per
    /// connection.
    pub fn start(upstream: SocketAddr, one_way: Duration, handshake: bool) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let conns: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (cs, st) = (conns.clone(), stop.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if st.load(Ordering::Relaxed) {
                    return;
                }
                let Ok(client) = client else { continue };
                let accepted = Instant::now();
                let Ok(server) = TcpStream::connect_timeout(&upstream, Duration::from_secs(5))
                else {
                    continue;
                };
                let mut held = cs.lock().unwrap_or_else(|e| e.into_inner());
                // Connections that ended are dropped from the list; a failed clone just
                // leaves this one unproxied.
                held.retain(|s| s.peer_addr().is_ok());
                let clones = (|| -> std::io::Result<_> {
                    for s in [&client, &server] {
                        s.set_nodelay(true)?;
                        held.push(s.try_clone()?);
                    }
                    Ok((client.try_clone()?, server.try_clone()?))
                })();
                drop(held);
                let Ok((c2, s2)) = clones else { continue };
                let not_before = handshake.then(|| accepted + 2 * one_way);
                delayed_pump(client, server, one_way, not_before);
                delayed_pump(s2, c2, one_way, not_before);
            }
        });
        Ok(Self { addr, conns, stop })
    }
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for c in self
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            let _ = c.shutdown(Shutdown::Both);
        }
        // Wakes the accept loop so it sees `stop`.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
    }
}

/// Copies `from` to `to`, each chunk written `delay` after it was read (or after
/// `not_before`, if later): a reader thread stamps the chunks, a writer thread holds
/// each one until its time. Ends when either side ends.
fn delayed_pump(
    mut from: TcpStream,
    mut to: TcpStream,
    delay: Duration,
    not_before: Option<Instant>,
) {
    let (tx, rx) = std::sync::mpsc::channel::<(Instant, Vec<u8>)>();
    let due = move || {
        let now = Instant::now();
        not_before.map_or(now, |t| t.max(now)) + delay
    };
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match from.read(&mut buf) {
                // An empty chunk carries the end of stream, in order.
                Ok(0) | Err(_) => {
                    let _ = tx.send((due(), Vec::new()));
                    return;
                }
                Ok(n) => {
                    if tx.send((due(), buf[..n].to_vec())).is_err() {
                        return;
                    }
                }
            }
        }
    });
    std::thread::spawn(move || {
        for (due, chunk) in rx {
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
            if chunk.is_empty() || to.write_all(&chunk).is_err() {
                break;
            }
        }
        let _ = to.shutdown(Shutdown::Write);
    });
}
