//! Copies bytes between a socket and the HTTP/2 stream of one proxied connection, on
//! both sides of the tunnel. A half-close travels as END_STREAM and comes out as a FIN;
//! an abort travels as RST_STREAM and comes out as a TCP RST. Flow control is HTTP/2's
//! own, per stream: received bytes are released only once written to the socket, so a
//! reader that stalls holds back its own stream and nothing else.
//!
//! A stream may be spliced before its far end has answered the dial (`splice_dialing`):
//! the socket's bytes go out at once, right behind the dial request, and the receiving
//! half comes with the answer. That saves a round trip per connection for clients that
//! send first and wait for nothing (a TLS ClientHello, an HTTP request).

use std::convert::Infallible;
use std::future::poll_fn;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use bytes::{Bytes, BytesMut};
use h2::{Reason, RecvStream, SendStream};
use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadHalf, WriteHalf};

/// The read half of a socket we splice. Plain sockets wait for readability without
/// holding a buffer, so an idle connection costs no buffer memory; TLS streams must
/// read to find out.
pub trait SocketRead: Send {
    /// Waits until a read will probably not block (or returns at once when that cannot
    /// be known).
    fn readable(&mut self) -> impl Future<Output = io::Result<()>> + Send;
    /// Reads what is there into `buf`; 0 means end of stream. A plain socket answers
    /// `WouldBlock` instead of waiting, so the caller can drop its buffer while idle.
    /// Cancel-safe.
    fn read_some(&mut self, buf: &mut BytesMut) -> impl Future<Output = io::Result<usize>> + Send;
}

macro_rules! plain_socket_read {
    ($half:ty) => {
        impl SocketRead for $half {
            fn readable(&mut self) -> impl Future<Output = io::Result<()>> + Send {
                <$half>::readable(self)
            }
            async fn read_some(&mut self, buf: &mut BytesMut) -> io::Result<usize> {
                self.try_read_buf(buf)
            }
        }
    };
}
plain_socket_read!(tokio::net::tcp::OwnedReadHalf);
plain_socket_read!(tokio::net::unix::OwnedReadHalf);

impl<T: AsyncRead + Send> SocketRead for ReadHalf<T> {
    async fn readable(&mut self) -> io::Result<()> {
        Ok(())
    }
    async fn read_some(&mut self, buf: &mut BytesMut) -> io::Result<usize> {
        self.read_buf(buf).await
    }
}

/// A socket we can splice: TCP, a unix socket (the HTTP CONNECT entry), or TLS over TCP
/// (SuperEdge's HTTPS module, where the tunnel terminates or originates TLS).
pub trait Socket: Send + 'static {
    type Read: SocketRead + 'static;
    type Write: AsyncWrite + Unpin + Send + 'static;
    fn into_halves(self) -> (Self::Read, Self::Write);
    /// Closes the socket so the peer sees an abort, not an orderly end.
    fn abort(read: Self::Read, write: Self::Write);
}

impl Socket for tokio::net::TcpStream {
    type Read = tokio::net::tcp::OwnedReadHalf;
    type Write = tokio::net::tcp::OwnedWriteHalf;
    fn into_halves(self) -> (Self::Read, Self::Write) {
        self.into_split()
    }
    fn abort(read: Self::Read, write: Self::Write) {
        crate::net::abort_on_close(read.as_ref());
        // Dropping the write half would send a FIN first, and the peer would read a
        // clean end of stream before the RST.
        write.forget();
    }
}

impl Socket for tokio::net::UnixStream {
    type Read = tokio::net::unix::OwnedReadHalf;
    type Write = tokio::net::unix::OwnedWriteHalf;
    fn into_halves(self) -> (Self::Read, Self::Write) {
        self.into_split()
    }
    // A unix socket has no RST; closing it without a shutdown is the strongest signal.
    fn abort(_read: Self::Read, write: Self::Write) {
        write.forget();
    }
}

macro_rules! tls_socket {
    ($stream:ty) => {
        impl Socket for $stream {
            type Read = ReadHalf<$stream>;
            type Write = WriteHalf<$stream>;
            fn into_halves(self) -> (Self::Read, Self::Write) {
                tokio::io::split(self)
            }
            fn abort(read: Self::Read, write: Self::Write) {
                let tls = read.unsplit(write);
                crate::net::abort_on_close(tls.get_ref().0);
            }
        }
    };
}
tls_socket!(tokio_rustls::server::TlsStream<tokio::net::TcpStream>);
tls_socket!(tokio_rustls::client::TlsStream<tokio::net::TcpStream>);

/// Runs the two directions of a connection until both have finished, or until either
/// fails, which ends the other too; returns the failure.
pub(crate) async fn both_directions<E>(
    a: impl Future<Output = Result<(), E>>,
    b: impl Future<Output = Result<(), E>>,
) -> Option<E> {
    tokio::pin!(a, b);
    let (mut a_done, mut b_done) = (false, false);
    loop {
        let step = tokio::select! {
            r = &mut a, if !a_done => { a_done = true; r }
            r = &mut b, if !b_done => { b_done = true; r }
        };
        if let Err(e) = step {
            return Some(e);
        }
        if a_done && b_done {
            return None;
        }
    }
}

/// Whether the far end of the stream we send into has answered its dial yet. Until it
/// has, a failure to send ends only the sending direction, not the connection: the far
/// end refused the dial (it then resets the stream with NO_ERROR, RFC 9113 section 8.1,
/// having sent its complete answer), or the stream or its connection is gone; the
/// answer, which then comes at once (or its deadline does), tells which.
pub(crate) struct Answered(AtomicBool);

impl Answered {
    pub(crate) fn not_yet() -> Self {
        Self(AtomicBool::new(false))
    }

    pub(crate) fn set(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    /// What a failure to send into the stream means for the sending direction: the end
    /// of the connection once answered, before that only the end of this direction.
    pub(crate) fn send_failed<F>(&self, failure: F) -> Result<(), F> {
        if self.0.load(Ordering::Relaxed) {
            Err(failure)
        } else {
            Ok(())
        }
    }
}

/// How a spliced connection ended. `E` is why the far end refused a stream spliced
/// before its answer (`splice_dialing`); an established stream cannot be refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SpliceEnd<E = Infallible> {
    /// Both directions finished with a half-close.
    Closed,
    /// The local socket failed or was reset; the stream was reset.
    SocketAborted(String),
    /// The stream was reset or the tunnel connection died; the socket was reset.
    TunnelAborted(String),
    /// The far end answered the dial with a refusal; the socket was reset, and what it
    /// had sent went with the stream, read by nobody.
    Refused(E),
}

/// Process-wide byte counters (the `tunnel_bytes_total` metric).
#[derive(Clone, Debug, Default)]
pub struct Totals {
    pub to_tunnel: Counter,
    pub from_tunnel: Counter,
}

/// Bytes moved by one connection, readable while it runs (the debug listing) and added
/// to the process totals as they move.
#[derive(Debug, Default)]
pub struct Meter {
    to_tunnel: AtomicU64,
    from_tunnel: AtomicU64,
    totals: Totals,
}

impl Meter {
    pub fn new(totals: Totals) -> Self {
        Self {
            totals,
            ..Self::default()
        }
    }

    /// Bytes read from the socket and sent into the stream.
    pub fn to_tunnel(&self) -> u64 {
        self.to_tunnel.load(Ordering::Relaxed)
    }

    /// Bytes received from the stream and written to the socket.
    pub fn from_tunnel(&self) -> u64 {
        self.from_tunnel.load(Ordering::Relaxed)
    }

    fn add_to_tunnel(&self, n: usize) {
        self.to_tunnel.fetch_add(n as u64, Ordering::Relaxed);
        self.totals.to_tunnel.inc_by(n as u64);
    }

    fn add_from_tunnel(&self, n: usize) {
        self.from_tunnel.fetch_add(n as u64, Ordering::Relaxed);
        self.totals.from_tunnel.inc_by(n as u64);
    }
}

enum Failure<E> {
    Socket(io::Error),
    Tunnel(String),
    /// The far end refused the dial.
    Refused(E),
}

/// Splices `socket` with the stream `send`/`recv` until both directions have finished
/// or either side aborts. `first` is sent before anything read from the socket (bytes a
/// proxy read past a request's headers).
pub async fn splice<S: Socket>(
    socket: S,
    send: SendStream<Bytes>,
    recv: RecvStream,
    first: Bytes,
    chunk: usize,
    meter: &Meter,
) -> SpliceEnd {
    // An answer that is in already: it counts as answered from the first poll on.
    splice_dialing(
        socket,
        send,
        std::future::ready(Ok(recv)),
        first,
        chunk,
        meter,
    )
    .await
}

/// `splice` for a stream whose far end has not answered its dial yet: the socket's bytes
/// flow into the stream at once, and `answer` gives the receiving half once the far end
/// has connected, or why it did not; a refusal resets the socket.
pub async fn splice_dialing<S: Socket, E>(
    socket: S,
    mut send: SendStream<Bytes>,
    answer: impl Future<Output = Result<RecvStream, E>>,
    first: Bytes,
    chunk: usize,
    meter: &Meter,
) -> SpliceEnd<E> {
    let (mut read, mut write) = socket.into_halves();
    let answered = Answered::not_yet();
    let failure = {
        let up = async {
            // Everything that fails here past the socket is a failure to send.
            match socket_to_stream(&mut read, &mut send, first, chunk, meter).await {
                Err(Failure::Tunnel(why)) => answered.send_failed(Failure::Tunnel(why)),
                r => r,
            }
        };
        let down = async {
            let mut recv = answer.await.map_err(Failure::Refused)?;
            answered.set();
            stream_to_socket(&mut recv, &mut write, meter).await
        };
        both_directions(up, down).await
    };
    match failure {
        None => SpliceEnd::Closed,
        Some(Failure::Socket(e)) => {
            send.send_reset(Reason::CANCEL);
            SpliceEnd::SocketAborted(e.to_string())
        }
        Some(Failure::Tunnel(why)) => {
            S::abort(read, write);
            SpliceEnd::TunnelAborted(why)
        }
        Some(Failure::Refused(e)) => {
            S::abort(read, write);
            // A no-op after the far end's own refusal (the stream is over already);
            // after our own deadline it tells the far end to give up.
            send.send_reset(Reason::CANCEL);
            SpliceEnd::Refused(e)
        }
    }
}

async fn socket_to_stream<R: SocketRead, E>(
    read: &mut R,
    send: &mut SendStream<Bytes>,
    first: Bytes,
    chunk: usize,
    meter: &Meter,
) -> Result<(), Failure<E>> {
    if !first.is_empty() {
        meter.add_to_tunnel(first.len());
        send_all(send, first).await.map_err(Failure::Tunnel)?;
    }
    // Allocated when data arrives and dropped after a short read, so an idle
    // connection holds no buffer; a bulk transfer keeps reusing one.
    let mut buf: Option<BytesMut> = None;
    loop {
        tokio::select! {
            r = read.readable() => r.map_err(Failure::Socket)?,
            r = poll_fn(|cx| send.poll_reset(cx)) => return Err(tunnel_reset(r)),
        }
        let b = buf.get_or_insert_with(BytesMut::new);
        if b.capacity() < chunk / 4 {
            b.reserve(chunk);
        }
        let n = tokio::select! {
            r = read.read_some(b) => match r {
                Ok(n) => n,
                // Readiness stays set after a short read, so `readable` returns at once
                // and this follows: the connection has gone idle. Keeping the buffer
                // here would cost a whole chunk per idle connection.
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if b.is_empty() {
                        buf = None;
                    }
                    continue;
                }
                Err(e) => return Err(Failure::Socket(e)),
            },
            r = poll_fn(|cx| send.poll_reset(cx)) => return Err(tunnel_reset(r)),
        };
        if n == 0 {
            send.send_data(Bytes::new(), true)
                .map_err(|e| Failure::Tunnel(e.to_string()))?;
            return Ok(());
        }
        meter.add_to_tunnel(n);
        let data = if n >= chunk / 4 {
            b.split().freeze()
        } else {
            let small = Bytes::copy_from_slice(b);
            buf = None;
            small
        };
        send_all(send, data).await.map_err(Failure::Tunnel)?;
    }
}

/// Sends `data` as the peer's window allows; h2 would otherwise queue it without bound.
pub(crate) async fn send_all(send: &mut SendStream<Bytes>, mut data: Bytes) -> Result<(), String> {
    while !data.is_empty() {
        send.reserve_capacity(data.len());
        match poll_fn(|cx| send.poll_capacity(cx)).await {
            Some(Ok(0)) => continue,
            Some(Ok(n)) => {
                let part = data.split_to(n.min(data.len()));
                send.send_data(part, false).map_err(|e| e.to_string())?;
            }
            Some(Err(e)) => return Err(e.to_string()),
            None => return Err("stream closed".into()),
        }
    }
    Ok(())
}

fn tunnel_reset<E>(r: Result<Reason, h2::Error>) -> Failure<E> {
    match r {
        Ok(reason) => Failure::Tunnel(format!("stream reset by peer ({reason:?})")),
        Err(e) => Failure::Tunnel(e.to_string()),
    }
}

async fn stream_to_socket<W: AsyncWrite + Unpin, E>(
    recv: &mut RecvStream,
    write: &mut W,
    meter: &Meter,
) -> Result<(), Failure<E>> {
    while let Some(data) = recv.data().await {
        let data = data.map_err(|e| Failure::Tunnel(e.to_string()))?;
        write.write_all(&data).await.map_err(Failure::Socket)?;
        meter.add_from_tunnel(data.len());
        // Only now is the window reopened: a socket that is not read holds back this
        // stream, not the connection.
        let _ = recv.flow_control().release_capacity(data.len());
    }
    write.shutdown().await.map_err(Failure::Socket)
}
