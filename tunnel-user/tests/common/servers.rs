//! Target servers that stand behind the edge in tests: plain std threads on loopback.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::thread;

use sha2::{Digest, Sha256};

/// Deterministic pseudo-random bytes (xorshift), so both ends can hash the same stream.
pub struct Pattern(u64);

impl Pattern {
    pub fn new(seed: u64) -> Self {
        Self(seed | 1)
    }
    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            chunk.copy_from_slice(&self.0.to_le_bytes()[..chunk.len()]);
        }
    }
}

/// SHA-256 of `len` bytes of `Pattern::new(seed)`, written to `out` if given.
pub fn send_pattern(out: Option<&mut dyn Write>, seed: u64, len: u64) -> std::io::Result<String> {
    let mut p = Pattern::new(seed);
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 256 * 1024];
    let mut left = len;
    let mut out = out;
    while left > 0 {
        let n = left.min(buf.len() as u64) as usize;
        p.fill(&mut buf[..n]);
        h.update(&buf[..n]);
        if let Some(w) = out.as_mut() {
            w.write_all(&buf[..n])?;
        }
        left -= n as u64;
    }
    Ok(hex(&h.finalize()))
}

/// Reads to EOF; returns (bytes, SHA-256).
pub fn hash_reader(r: &mut dyn Read) -> std::io::Result<(u64, String)> {
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 256 * 1024];
    let mut total = 0u64;
    loop {
        let n = r.read(&mut buf)?;
        if n == 0 {
            return Ok((total, hex(&h.finalize())));
        }
        total += n as u64;
        h.update(&buf[..n]);
    }
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn serve(bind: &str, handler: fn(TcpStream)) -> SocketAddr {
    let listener = TcpListener::bind(bind).expect("bind target server");
    let addr = listener.local_addr().expect("addr");
    thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            thread::spawn(move || handler(conn));
        }
    });
    addr
}

/// Reads everything until the client's FIN, then answers `<bytes> <sha256>\n` and closes:
/// exercises the upstream direction and the half-close.
pub fn sink(bind: &str) -> SocketAddr {
    serve(bind, |mut conn| {
        if let Ok((n, hash)) = hash_reader(&mut conn) {
            let _ = writeln!(conn, "{n} {hash}");
        }
    })
}

/// Reads `<seed> <len>\n`, then sends that pattern and closes: the downstream direction.
pub fn source(bind: &str) -> SocketAddr {
    serve(bind, |mut conn| {
        let mut line = Vec::new();
        let mut b = [0u8; 1];
        while conn.read(&mut b).is_ok_and(|n| n == 1) && b[0] != b'\n' {
            line.push(b[0]);
        }
        let line = String::from_utf8_lossy(&line).to_string();
        let mut parts = line
            .split_whitespace()
            .map(|p| p.parse::<u64>().unwrap_or(0));
        let (seed, len) = (parts.next().unwrap_or(1), parts.next().unwrap_or(0));
        let _ = send_pattern(Some(&mut conn), seed, len);
    })
}

/// Answers each `GET` line-delimited request with an HTTP response written in two
/// writes (head, then body): the pattern that stalls on Nagle plus delayed ACK.
pub fn two_writes(bind: &str) -> SocketAddr {
    serve(bind, |mut conn| {
        let _ = conn.set_nodelay(true);
        let mut buf = [0u8; 4096];
        let mut pending = Vec::new();
        loop {
            match conn.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => pending.extend_from_slice(&buf[..n]),
            }
            while let Some(end) = pending.windows(4).position(|w| w == b"\r\n\r\n") {
                pending.drain(..end + 4);
                let body = b"hello from two writes\n";
                let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", body.len());
                if conn.write_all(head.as_bytes()).is_err() || conn.write_all(body).is_err() {
                    return;
                }
            }
        }
    })
}

/// Accepts and reads everything, never writes a byte: a target (or a cloud) that
/// accepts but never answers.
pub fn silent(bind: &str) -> SocketAddr {
    serve(bind, |mut conn| {
        let mut buf = [0u8; 4096];
        while conn.read(&mut buf).is_ok_and(|n| n > 0) {}
    })
}

/// A listener whose accept queue is full and never drained: the kernel drops further
/// SYNs, so a connect() to it hangs until the caller's own timeout. Held open while
/// this value lives.
pub struct NeverAccepting {
    pub addr: SocketAddr,
    _listener: socket2::Socket,
    _queued: Vec<TcpStream>,
}

impl NeverAccepting {
    pub fn start() -> Self {
        use socket2::{Domain, Socket, Type};
        let listener = Socket::new(Domain::IPV4, Type::STREAM, None).expect("socket");
        listener
            .bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())
            .expect("bind");
        // Backlog 0 holds one connection; one more in flight fills it for good.
        listener.listen(0).expect("listen");
        let addr = listener
            .local_addr()
            .expect("addr")
            .as_socket()
            .expect("inet");
        let mut queued = Vec::new();
        for _ in 0..4 {
            match TcpStream::connect_timeout(&addr, std::time::Duration::from_millis(300)) {
                Ok(s) => queued.push(s),
                Err(_) => break,
            }
        }
        let probe = TcpStream::connect_timeout(&addr, std::time::Duration::from_millis(300));
        assert!(
            probe.is_err(),
            "the never-accepting listener at {addr} still completes connects"
        );
        Self {
            addr,
            _listener: listener,
            _queued: queued,
        }
    }
}
