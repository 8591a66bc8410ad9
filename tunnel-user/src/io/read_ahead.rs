//! Large reads under TLS. rustls asks its transport for at most about 4 KiB at a time,
//! so without this a bulk transfer would cost one `recvfrom` per 4 KiB. `ReadAhead` sits
//! between the TCP socket and TLS: it reads what the socket has, up to `READ_AHEAD`
//! bytes, in one call and hands it out from memory. The buffer exists only while it
//! holds bytes, so an idle edge connection costs nothing here.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// Bytes read from the socket at once when the reader asks for less.
pub(crate) const READ_AHEAD: usize = 128 * 1024;

pub(crate) struct ReadAhead {
    tcp: TcpStream,
    buf: BytesMut,
}

impl ReadAhead {
    pub(crate) fn new(tcp: TcpStream) -> Self {
        Self {
            tcp,
            buf: BytesMut::new(),
        }
    }

    /// Copies buffered bytes into `out`; frees the buffer once it is drained.
    fn drain_into(&mut self, out: &mut ReadBuf<'_>) {
        let n = self.buf.len().min(out.remaining());
        out.put_slice(&self.buf[..n]);
        self.buf.advance(n);
        if self.buf.is_empty() {
            self.buf = BytesMut::new();
        }
    }
}

impl AsyncRead for ReadAhead {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        if !me.buf.is_empty() {
            me.drain_into(out);
            return Poll::Ready(Ok(()));
        }
        if out.remaining() >= READ_AHEAD {
            return Pin::new(&mut me.tcp).poll_read(cx, out);
        }
        ready!(me.tcp.poll_read_ready(cx))?;
        // Allocated only once the socket is readable, so waiting holds no buffer.
        if me.buf.capacity() < READ_AHEAD {
            me.buf.reserve(READ_AHEAD);
        }
        // tokio's poll_read, unlike try_read, takes a short read as the socket drained
        // (epoll is edge-triggered), so the next wait costs no `recvfrom` that would only
        // say EAGAIN.
        let read = tokio_util::io::poll_read_buf(Pin::new(&mut me.tcp), cx, &mut me.buf);
        match read {
            Poll::Ready(Ok(n)) if n > 0 => me.drain_into(out),
            // The end of the stream, an error, or stale readiness (the read registered
            // for the next): nothing is held.
            _ => me.buf = BytesMut::new(),
        }
        read.map_ok(|_| ())
    }
}

impl AsyncWrite for ReadAhead {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().tcp).poll_write(cx, data)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn small_reads_see_every_byte_in_order_and_the_end() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let sent: Vec<u8> = (0..1_000_000u32).map(|i| (i % 251) as u8).collect();
        let writer = {
            let sent = sent.clone();
            tokio::spawn(async move {
                let mut s = TcpStream::connect(addr).await.unwrap();
                s.write_all(&sent).await.unwrap();
                s.shutdown().await.unwrap();
            })
        };
        let (tcp, _) = listener.accept().await.unwrap();
        let mut r = ReadAhead::new(tcp);
        let mut got = Vec::new();
        let mut small = [0u8; 4096];
        loop {
            let n = r.read(&mut small).await.unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&small[..n]);
        }
        writer.await.unwrap();
        assert_eq!(got, sent);
        assert_eq!(r.buf.capacity(), 0, "an idle reader holds no buffer");
    }
}
