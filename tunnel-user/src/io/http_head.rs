//! An HTTP/1 request head read before the connection's route is known, within bounds, and
//! the error answered to it: shared by the cloud's CONNECT and HTTPS entries and the
//! edge's proxy. What the head must say is the caller's parser ([`super::http_connect`],
//! `cloud::conn::entry::https`).

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Bound on a request head: clients send one short line and a few headers.
pub const MAX_HEAD: usize = 8 * 1024;

/// Why no head was read: the stream failed or ended first.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReadError {
    #[error("{0}")]
    Io(std::io::Error),
    #[error("connection closed before a request head")]
    Closed,
}

/// Reads `stream` until `parse` finds a complete head in the bytes read so far; returns
/// what it found and every byte read (the head and what followed it). Never reads past
/// [`MAX_HEAD`], whatever the client sends: `parse` refuses an incomplete head of that
/// size.
pub(crate) async fn read<S, T, E>(
    stream: &mut S,
    parse: impl Fn(&[u8]) -> Result<Option<T>, E>,
) -> Result<(T, BytesMut), E>
where
    S: AsyncRead + Unpin,
    E: From<ReadError>,
{
    let mut buf = BytesMut::with_capacity(1024);
    loop {
        let room = MAX_HEAD.saturating_sub(buf.len()).max(1) as u64;
        let n = (&mut *stream)
            .take(room)
            .read_buf(&mut buf)
            .await
            .map_err(ReadError::Io)?;
        if n == 0 {
            return Err(ReadError::Closed.into());
        }
        if let Some(head) = parse(&buf)? {
            return Ok((head, buf));
        }
    }
}

/// Answers `status` with `body` as text (a bare status line when it is empty).
pub(crate) async fn respond<S: AsyncWrite + Unpin>(
    stream: &mut S,
    status: u16,
    reason: &str,
    body: &str,
) {
    let msg = if body.is_empty() {
        format!("HTTP/1.1 {status} {reason}\r\n\r\n")
    } else {
        format!(
            "HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}\n",
            body.len() + 1
        )
    };
    // The client may already be gone; there is nobody left to tell.
    let _ = stream.write_all(msg.as_bytes()).await;
}
