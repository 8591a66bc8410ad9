//! Carries one proxied connection between a socket and the gRPC call of its stream, on
//! both sides of the tunnel. The socket's bytes are the call's outgoing messages
//! (`Outbound`, the stream the call's body is framed from: it reads the socket itself,
//! so no task sits between the socket and HTTP/2), and the incoming messages are written
//! to the socket.
//! A half-close travels as the end of the message stream and comes out as a FIN; an
//! abort travels as a cancelled call or an error status and comes out as a TCP RST.
//! Flow control is HTTP/2's own, per stream: the next incoming chunk is taken only once
//! the last one is written to the socket, so a reader that stalls holds back its own
//! stream and nothing else.
//!
//! The copy may start before the far end of the call has answered its dial (`copy_dialing`):
//! the socket's bytes go out at once, right behind the dial request, and the incoming
//! half comes with the answer. That saves a round trip per connection for clients that
//! send first and wait for nothing (a TLS ClientHello, an HTTP request).

use std::convert::Infallible;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll, ready};

use bytes::{Bytes, BytesMut};
use futures::Stream;
use futures::future::BoxFuture;
use futures::task::AtomicWaker;
use prometheus_client::metrics::counter::Counter;
use proto::Chunk;
use proto::chunk_call::IncomingChunks;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::sync::oneshot;
use tonic::Status;

/// The read half of a socket we copy. Plain sockets wait for readability without
/// holding a buffer, so an idle connection costs no buffer memory; TLS streams must
/// read to find out.
pub(crate) trait SocketRead: AsyncRead + Send + Unpin + 'static {
    /// Polls until a read will probably not block, without a buffer (ready at once when
    /// that cannot be known).
    fn poll_readable(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>>;
    /// Polls for what the socket has, read into `buf`; `Ok(0)` is the end of the stream.
    /// Through `poll_read`, not `try_read`: tokio's `poll_read` takes a short read as
    /// the socket drained (epoll is edge-triggered), so the next wait costs no
    /// `recvfrom` that would only say EAGAIN, one per message and hop.
    fn poll_read_some(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut BytesMut,
    ) -> Poll<io::Result<usize>> {
        tokio_util::io::poll_read_buf(Pin::new(self), cx, buf)
    }
    /// Whether `poll_readable` waits, so the buffer can be dropped while idle.
    const WAITS_FOR_READINESS: bool;
}

macro_rules! plain_socket_read {
    ($half:ty) => {
        impl SocketRead for $half {
            const WAITS_FOR_READINESS: bool = true;
            fn poll_readable(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
                self.as_ref().poll_read_ready(cx)
            }
        }
    };
}
plain_socket_read!(tokio::net::tcp::OwnedReadHalf);
plain_socket_read!(tokio::net::unix::OwnedReadHalf);

impl<T: AsyncRead + Send + 'static> SocketRead for ReadHalf<T> {
    const WAITS_FOR_READINESS: bool = false;
    fn poll_readable(&mut self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// A socket we can copy: TCP, a unix socket (the HTTP CONNECT entry), or TLS over TCP
/// (SuperEdge's HTTPS module, where the tunnel terminates or originates TLS).
pub(crate) trait Socket: Send + 'static {
    type Read: SocketRead;
    type Write: AsyncWrite + Unpin + Send + 'static;
    fn into_halves(self) -> (Self::Read, Self::Write);
    /// Closes the socket (once the read half is gone too) so the peer sees an abort,
    /// not an orderly end.
    fn abort(write: Self::Write);
}

impl Socket for tokio::net::TcpStream {
    type Read = tokio::net::tcp::OwnedReadHalf;
    type Write = tokio::net::tcp::OwnedWriteHalf;
    fn into_halves(self) -> (Self::Read, Self::Write) {
        self.into_split()
    }
    fn abort(write: Self::Write) {
        crate::io::net::abort_on_close(write.as_ref());
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
    fn abort(write: Self::Write) {
        write.forget();
    }
}

/// The write half of a TLS stream, with the TCP socket's descriptor for an abort.
pub(crate) struct TlsWrite<T> {
    half: WriteHalf<T>,
    /// Open while `half` is: the TLS stream owns it, and each half keeps that alive.
    fd: RawFd,
}

impl<T: AsyncWrite> AsyncWrite for TlsWrite<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().half).poll_write(cx, buf)
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().half).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().half).poll_shutdown(cx)
    }
}

macro_rules! tls_socket {
    ($stream:ty) => {
        impl Socket for $stream {
            type Read = ReadHalf<$stream>;
            type Write = TlsWrite<$stream>;
            fn into_halves(self) -> (Self::Read, Self::Write) {
                let fd = self.get_ref().0.as_raw_fd();
                let (read, half) = tokio::io::split(self);
                (read, TlsWrite { half, fd })
            }
            fn abort(write: Self::Write) {
                // SAFETY: `write` keeps the TLS stream, and so the descriptor, open.
                let fd = unsafe { BorrowedFd::borrow_raw(write.fd) };
                crate::io::net::abort_on_close(&fd);
                // Dropping a TLS half sends nothing; the socket closes with its other half.
                drop(write);
            }
        }
    };
}
tls_socket!(tokio_rustls::server::TlsStream<tokio::net::TcpStream>);
tls_socket!(tokio_rustls::client::TlsStream<tokio::net::TcpStream>);

/// Runs the two directions of a connection until both have finished, or until either
/// fails, which ends the other too; returns the failure. When both have failed by the
/// time it looks, `a`'s failure is the one returned.
pub(crate) async fn both_directions<E>(
    a: impl Future<Output = Result<(), E>>,
    b: impl Future<Output = Result<(), E>>,
) -> Option<E> {
    tokio::pin!(a, b);
    let (mut a_done, mut b_done) = (false, false);
    loop {
        let step = tokio::select! {
            biased;
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

/// How a copied connection ended. `E` is why the far end refused a call copied
/// before its answer (`copy_dialing`); an established call cannot be refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum CopyEnd<E = Infallible> {
    /// Both directions finished with a half-close.
    Closed,
    /// The local socket failed or was reset; the call was cancelled.
    SocketAborted(String),
    /// The call was cancelled or failed, or the tunnel connection died; the socket was
    /// reset.
    TunnelAborted(String),
    /// The far end answered the dial with a refusal; the socket was reset, and what it
    /// had sent went with the call, read by nobody.
    Refused(E),
}

/// Process-wide byte counters (the `tunnel_bytes_total` metric).
#[derive(Clone, Debug, Default)]
pub(crate) struct Totals {
    pub(crate) to_tunnel: Counter,
    pub(crate) from_tunnel: Counter,
}

/// Bytes moved by one connection, readable while it runs (the debug listing) and added
/// to the process totals as they move.
#[derive(Debug, Default)]
pub(crate) struct Meter {
    to_tunnel: AtomicU64,
    from_tunnel: AtomicU64,
    totals: Totals,
}

impl Meter {
    pub(crate) fn new(totals: Totals) -> Arc<Self> {
        Arc::new(Self {
            totals,
            ..Self::default()
        })
    }

    /// Bytes read from the socket and sent into the stream.
    pub(crate) fn to_tunnel(&self) -> u64 {
        self.to_tunnel.load(Ordering::Relaxed)
    }

    /// Bytes received from the stream and written to the socket.
    #[expect(
        clippy::wrong_self_convention,
        reason = "a count of the bytes from the tunnel, as `to_tunnel` is of those to it, not a conversion"
    )]
    pub(crate) fn from_tunnel(&self) -> u64 {
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

/// Set when the connection is aborted from the side that writes the socket; wakes the
/// `Outbound` so it cancels the call.
#[derive(Default)]
struct AbortSignal {
    set: AtomicBool,
    waker: AtomicWaker,
}

impl AbortSignal {
    fn set(&self) {
        self.set.store(true, Ordering::Release);
        self.waker.wake();
    }

    fn is_set(&self, cx: &mut Context<'_>) -> bool {
        self.waker.register(cx.waker());
        self.set.load(Ordering::Acquire)
    }
}

/// How the socket-to-call direction ended.
enum OutboundEnd {
    /// The socket's end of stream, passed on as the end of the messages.
    Eof,
    /// The socket failed; the call was cancelled.
    SocketFailed(String),
    /// The call dropped its messages unfinished, and gives the socket back: before the
    /// far end's answer, for a call opened again elsewhere ([`Redial`]).
    Dropped(Box<Source>),
}

/// What an `Outbound` reads once the socket is handed in.
struct Source {
    read: Box<dyn ReadSome>,
    first: Bytes,
    chunk: usize,
    /// Kept between reads of a bulk transfer; dropped when the socket goes idle.
    buf: Option<BytesMut>,
    meter: Arc<Meter>,
    end: Option<oneshot::Sender<OutboundEnd>>,
    /// What went into the call, while it may be opened again ([`Redial`]); `None` once
    /// the far end answered or past [`REPLAY_LIMIT`], so no connection keeps it.
    replay: Option<Replay>,
}

/// The bytes a call carried before its far end answered, to send again on a new call.
struct Replay {
    sent: BytesMut,
    answered: Arc<Answered>,
}

impl Source {
    /// Keeps `data`, on its way into the call, for a replay while that may still come.
    fn record(&mut self, data: &[u8]) {
        if let Some(replay) = &mut self.replay {
            if replay.answered.is_set() || replay.sent.len() + data.len() > REPLAY_LIMIT {
                self.replay = None;
            } else {
                replay.sent.extend_from_slice(data);
            }
        }
    }

    /// Makes what the call carried go first again, for a new call; false when it was
    /// not kept.
    fn rewind(&mut self) -> bool {
        let Some(replay) = &mut self.replay else {
            return false;
        };
        replay.sent.extend_from_slice(&self.first);
        self.first = replay.sent.split().freeze();
        true
    }
}

/// `SocketRead` behind a box, so one `Outbound` type serves every kind of socket.
trait ReadSome: Send + Unpin {
    fn poll_chunk(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut Option<BytesMut>,
        chunk: usize,
    ) -> Poll<io::Result<Option<Bytes>>>;
}

impl<R: SocketRead> ReadSome for R {
    fn poll_chunk(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut Option<BytesMut>,
        chunk: usize,
    ) -> Poll<io::Result<Option<Bytes>>> {
        if buf.is_none() {
            // No buffer until there is something to read: an idle socket costs none.
            ready!(self.poll_readable(cx))?;
        }
        let b = buf.get_or_insert_with(BytesMut::new);
        if b.capacity() - b.len() < chunk / 4 {
            b.reserve(chunk);
        }
        let polled = self.poll_read_some(cx, b);
        let n = match polled {
            Poll::Pending => {
                // Idle: a waiting plain socket needs no buffer, and keeping one would
                // cost a whole chunk per idle connection.
                if R::WAITS_FOR_READINESS && b.is_empty() {
                    *buf = None;
                }
                return Poll::Pending;
            }
            Poll::Ready(r) => r?,
        };
        if n == 0 {
            return Poll::Ready(Ok(None));
        }
        let data = if n >= chunk / 4 {
            b.split().freeze()
        } else {
            let small = Bytes::copy_from_slice(b);
            *buf = None;
            small
        };
        Poll::Ready(Ok(Some(data)))
    }
}

enum OutboundState {
    /// The call is under way but the socket is not handed in yet (an HTTP CONNECT
    /// client gets its 200 only once the edge has connected).
    Waiting(oneshot::Receiver<Source>),
    Reading(Source),
    Done,
}

/// The outgoing messages of a connection's call: the socket's bytes, read by whichever
/// task sends the call's body. Created before the call with `outbound`; the
/// socket comes later through its `OutboundHandle`. Yields `Chunk::Abort` (which
/// cancels the call) when the socket fails, when the connection is aborted from the
/// other direction, or when the handle goes without handing in a socket.
pub(crate) struct Outbound {
    state: OutboundState,
    abort: Arc<AbortSignal>,
}

/// The other end of an `Outbound`: hands it the socket (`copy_dialing` does).
pub(crate) struct OutboundHandle {
    source: oneshot::Sender<Source>,
    abort: Arc<AbortSignal>,
}

/// A call's outgoing message stream and the handle that will feed it a socket.
pub(crate) fn outbound() -> (Outbound, OutboundHandle) {
    let (source, waiting) = oneshot::channel();
    let abort = Arc::new(AbortSignal::default());
    (
        Outbound {
            state: OutboundState::Waiting(waiting),
            abort: abort.clone(),
        },
        OutboundHandle { source, abort },
    )
}

impl Outbound {
    fn end(&mut self, how: OutboundEnd) {
        if let OutboundState::Reading(source) = &mut self.state
            && let Some(end) = source.end.take()
        {
            let _ = end.send(how);
        }
        self.state = OutboundState::Done;
    }
}

/// An `Outbound` as a callee's response messages: an abort ends the call with ABORTED.
pub(crate) struct ResponseChunks(Outbound);

impl ResponseChunks {
    pub(crate) fn new(outbound: Outbound) -> Self {
        Self(outbound)
    }
}

impl Stream for ResponseChunks {
    type Item = Result<Chunk, Status>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        Pin::new(&mut self.get_mut().0).poll_next(cx).map(|chunk| {
            chunk.map(|chunk| match chunk {
                Chunk::Abort(why) => Err(Status::aborted(why)),
                data => Ok(data),
            })
        })
    }
}

impl Stream for Outbound {
    type Item = Chunk;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Chunk>> {
        let this = self.get_mut();
        loop {
            if matches!(this.state, OutboundState::Done) {
                return Poll::Ready(None);
            }
            if this.abort.is_set(cx) {
                this.state = OutboundState::Done;
                return Poll::Ready(Some(Chunk::Abort("connection aborted".into())));
            }
            let source = match &mut this.state {
                OutboundState::Waiting(waiting) => match ready!(Pin::new(waiting).poll(cx)) {
                    Ok(source) => {
                        this.state = OutboundState::Reading(source);
                        continue;
                    }
                    Err(_) => {
                        this.state = OutboundState::Done;
                        return Poll::Ready(Some(Chunk::Abort("connection given up".into())));
                    }
                },
                OutboundState::Reading(source) => source,
                OutboundState::Done => unreachable!("checked above"),
            };
            if !source.first.is_empty() {
                let first = std::mem::take(&mut source.first);
                source.meter.add_to_tunnel(first.len());
                source.record(&first);
                return Poll::Ready(Some(Chunk::Data(first)));
            }
            let chunk = source.chunk;
            return match ready!(source.read.poll_chunk(cx, &mut source.buf, chunk)) {
                Ok(Some(data)) => {
                    source.meter.add_to_tunnel(data.len());
                    source.record(&data);
                    Poll::Ready(Some(Chunk::Data(data)))
                }
                Ok(None) => {
                    this.end(OutboundEnd::Eof);
                    Poll::Ready(None)
                }
                Err(e) => {
                    let why = e.to_string();
                    this.end(OutboundEnd::SocketFailed(why.clone()));
                    Poll::Ready(Some(Chunk::Abort(why)))
                }
            };
        }
    }
}

impl Drop for Outbound {
    /// A call that ends before its messages do gives the socket back (`copy_dialing`
    /// keeps it for a new call when the far end never answered).
    fn drop(&mut self) {
        let mut source = match std::mem::replace(&mut self.state, OutboundState::Done) {
            OutboundState::Reading(source) => source,
            OutboundState::Waiting(mut waiting) => match waiting.try_recv() {
                Ok(source) => source,
                Err(_) => return,
            },
            OutboundState::Done => return,
        };
        if let Some(end) = source.end.take() {
            let _ = end.send(OutboundEnd::Dropped(Box::new(source)));
        }
    }
}

/// Whether the far end of the call has answered its dial yet. Until it has, the end of
/// the outgoing direction without the socket's end of stream ends only that direction,
/// not the connection: the far end refused the dial, or the call or its connection is
/// gone; the answer, which then comes at once (or its deadline does), tells which.
pub(crate) struct Answered(AtomicBool);

impl Answered {
    pub(crate) fn not_yet() -> Self {
        Self(AtomicBool::new(false))
    }

    pub(crate) fn set(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    fn is_set(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    /// What a failure of the outgoing direction means: the end of the connection once
    /// answered, before that only the end of this direction.
    pub(crate) fn send_failed<F>(&self, failure: F) -> Result<(), F> {
        if self.0.load(Ordering::Relaxed) {
            Err(failure)
        } else {
            Ok(())
        }
    }
}

enum Failure<E> {
    Socket(String),
    Tunnel(String),
    /// The far end refused the dial.
    Refused(E),
}

/// Copies between `socket` and a call whose far end has answered: `outbound` is the handle of
/// the call's outgoing messages, `inbound` its incoming ones, until both directions
/// have finished or either side aborts. `first` is sent before anything read from the
/// socket (bytes a proxy read past a request's headers).
pub(crate) async fn copy<S: Socket>(
    socket: S,
    outbound: OutboundHandle,
    inbound: IncomingChunks,
    first: Bytes,
    chunk: usize,
    meter: &Arc<Meter>,
) -> CopyEnd {
    // An answer that is in already: it counts as answered from the first poll on.
    copy_dialing(
        socket,
        outbound,
        Box::pin(std::future::ready(Ok(inbound))),
        first,
        chunk,
        meter,
        NoRedial,
    )
    .await
}

/// The far end's answer to a call copied before it (`copy_dialing`): the call's
/// incoming messages once it has connected, or why not.
pub(crate) type Dialing<'a, E> = BoxFuture<'a, Result<IncomingChunks, E>>;

/// The most of a connection's first bytes kept to send again on a new call ([`Redial`]):
/// a redirected client sends a TLS ClientHello and waits, and one is a few KiB at most
/// (about 1.8 KiB with a post-quantum key share); past this, no new call.
pub(crate) const REPLAY_LIMIT: usize = 8 * 1024;

/// How long a refused call may take to give the socket back (`OutboundEnd::Dropped`):
/// its stream is reset or its connection gone by the time the refusal comes, so this is
/// a bound, not a wait.
const GIVE_BACK: std::time::Duration = std::time::Duration::from_secs(1);

/// Opens a connection's call again, elsewhere, when the far end refused it before
/// answering for a reason that says nothing saw its bytes (`copy_dialing` replays them).
pub(crate) trait Redial<E>: Send {
    /// Whether the bytes are kept for a new call at all.
    const REDIALS: bool = true;
    /// Whether a call refused with `e` is opened again.
    fn may_redial(&self, e: &E) -> bool;
    /// The new call: the handle of its outgoing messages and its answer; or why there
    /// is none (`e` when nothing better is known).
    fn redial(
        &mut self,
        e: E,
    ) -> impl Future<Output = Result<(OutboundHandle, Dialing<'static, E>), E>> + Send;
}

/// A call that is never opened again: an answered one's, or the edge's.
pub(crate) struct NoRedial;

impl<E: Send> Redial<E> for NoRedial {
    const REDIALS: bool = false;
    fn may_redial(&self, _: &E) -> bool {
        false
    }
    async fn redial(&mut self, e: E) -> Result<(OutboundHandle, Dialing<'static, E>), E> {
        Err(e)
    }
}

/// `copy` for a call whose far end has not answered its dial yet: the socket's bytes
/// flow into the call at once, and `answer` gives the incoming messages once the far
/// end has connected, or why it did not; a refusal resets the socket, unless `redial`
/// opens a new call, which gets the bytes sent so far first. `answer` comes boxed: a
/// future held inline would stay in the connection's task (and in every async frame
/// that passes it on) for as long as the connection lives, idle or not.
pub(crate) async fn copy_dialing<S: Socket, E: Send, R: Redial<E>>(
    socket: S,
    mut outbound: OutboundHandle,
    mut answer: Dialing<'_, E>,
    first: Bytes,
    chunk: usize,
    meter: &Arc<Meter>,
    mut redial: R,
) -> CopyEnd<E> {
    let (read, mut write) = socket.into_halves();
    let answered = Arc::new(Answered::not_yet());
    let mut source = Source {
        read: Box::new(read),
        first,
        chunk,
        buf: None,
        meter: meter.clone(),
        end: None,
        replay: R::REDIALS.then(|| Replay {
            sent: BytesMut::new(),
            answered: answered.clone(),
        }),
    };
    let (failure, abort) = loop {
        let (end, mut ended) = oneshot::channel();
        source.end = Some(end);
        let OutboundHandle {
            source: hand_in,
            abort,
        } = outbound;
        // A call that is gone already gives the socket back at once.
        let mut back = hand_in.send(source).err();
        let mut up_ended = false;
        let failure = {
            // `up` first: a client that resets before the answer has its socket's failure
            // reported before the call is reset, so it is logged as the client's abort,
            // not as the refused dial that the reset makes of the answer.
            let up = async {
                let end = (&mut ended).await;
                up_ended = true;
                match end {
                    Ok(OutboundEnd::Eof) => Ok(()),
                    Ok(OutboundEnd::SocketFailed(why)) => Err(Failure::Socket(why)),
                    // The call's body dropped the messages unfinished: the call is over.
                    Ok(OutboundEnd::Dropped(source)) => {
                        back = Some(*source);
                        answered.send_failed(Failure::Tunnel("the call ended".into()))
                    }
                    Err(_) => answered.send_failed(Failure::Tunnel("the call ended".into())),
                }
            };
            let down = async {
                let mut inbound = (&mut answer).await.map_err(Failure::Refused)?;
                answered.set();
                inbound_to_socket(&mut inbound, &mut write, meter).await
            };
            both_directions(up, down).await
        };
        let e = match failure {
            Some(Failure::Refused(e)) if redial.may_redial(&e) => e,
            failure => break (failure, abort),
        };
        if back.is_none() && !up_ended {
            back = match tokio::time::timeout(GIVE_BACK, &mut ended).await {
                Ok(Ok(OutboundEnd::Dropped(source))) => Some(*source),
                _ => None,
            };
        }
        // A socket kept by the call past the bound, or bytes past `REPLAY_LIMIT`: the
        // refusal stands.
        let Some(again) = back.and_then(|mut s| s.rewind().then_some(s)) else {
            break (Some(Failure::Refused(e)), abort);
        };
        match redial.redial(e).await {
            Ok((handle, dialing)) => {
                (source, outbound, answer) = (again, handle, dialing);
            }
            Err(e) => break (Some(Failure::Refused(e)), abort),
        }
    };
    match failure {
        None => CopyEnd::Closed,
        Some(Failure::Socket(why)) => {
            // After a failed read the call is cancelled already; after a failed write
            // this cancels it.
            abort.set();
            CopyEnd::SocketAborted(why)
        }
        Some(Failure::Tunnel(why)) => {
            abort.set();
            S::abort(write);
            CopyEnd::TunnelAborted(why)
        }
        Some(Failure::Refused(e)) => {
            // Cancelling is a no-op after the far end's own refusal (the call is over
            // already); after our own deadline it tells the far end to give up.
            abort.set();
            S::abort(write);
            CopyEnd::Refused(e)
        }
    }
}

async fn inbound_to_socket<W: AsyncWrite + Unpin, E>(
    inbound: &mut IncomingChunks,
    write: &mut W,
    meter: &Meter,
) -> Result<(), Failure<E>> {
    loop {
        // The next message is taken only now, after the last one was written: a
        // socket that is not read holds back this call, not the connection.
        match inbound.message().await {
            Ok(Some(Chunk::Data(data))) => {
                write
                    .write_all(&data)
                    .await
                    .map_err(|e| Failure::Socket(e.to_string()))?;
                meter.add_from_tunnel(data.len());
            }
            Ok(Some(Chunk::Abort(why))) => return Err(Failure::Tunnel(why)),
            Ok(None) => break,
            // This side reset the call itself: its outgoing body failed, because the
            // socket did. Which direction reports first is a race; either way it is the
            // socket's end, not the far end's.
            Err(status) if reset_here(&status) => {
                return Err(Failure::Socket(describe(&status)));
            }
            Err(status) => return Err(Failure::Tunnel(describe(&status))),
        }
    }
    // An end is not urgent: the tasks that are ready now go first (another connection's
    // bytes, or a new connection's first ones, which often came in the same read).
    tokio::task::yield_now().await;
    write
        .shutdown()
        .await
        .map_err(|e| Failure::Socket(e.to_string()))
}

/// Whether `status` is this side's own reset of the call (h2's "sent by user"),
/// not the far end's, nor one h2 made itself, nor the end of the tunnel
/// connection.
fn reset_here(status: &Status) -> bool {
    std::error::Error::source(status)
        .and_then(|e| e.downcast_ref::<h2::Error>())
        .is_some_and(|e| e.is_reset() && !e.is_remote() && !e.is_library())
}

/// A call's failure for logs: its code and message.
pub(crate) fn describe(status: &Status) -> String {
    if status.message().is_empty() {
        format!("{:?}", status.code())
    } else {
        format!("{:?}: {}", status.code(), status.message())
    }
}
