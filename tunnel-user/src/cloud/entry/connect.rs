//! HTTP CONNECT proxy on TCP and on a unix socket: `CONNECT host:port`, where host is a
//! node name or a node address. This is what kube-apiserver's
//! EgressSelectorConfiguration `HTTPConnect` sends, and what `curl -x` sends.

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, UnixListener};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info};

use crate::cloud::{Cloud, proxy, route};
use crate::splice::Socket;

/// Bounds on the request head: clients send one short line and a few headers.
pub const MAX_HEAD: usize = 8 * 1024;

pub async fn serve_tcp(cloud: Arc<Cloud>, listener: TcpListener, shutdown: CancellationToken) {
    while let Some((tcp, peer)) = super::next_conn(|| listener.accept(), &shutdown, "connect").await
    {
        crate::net::tune(&tcp);
        let cloud = cloud.clone();
        let span = tracing::debug_span!("conn", entry = "connect", client = %peer);
        tokio::spawn(
            async move { handle(&cloud, tcp, "connect", peer.to_string()).await }.instrument(span),
        );
    }
}

pub async fn serve_unix(cloud: Arc<Cloud>, listener: UnixListener, shutdown: CancellationToken) {
    while let Some((stream, _)) =
        super::next_conn(|| listener.accept(), &shutdown, "connect-unix").await
    {
        let cloud = cloud.clone();
        let span = tracing::debug_span!("conn", entry = "connect-unix");
        tokio::spawn(
            async move { handle(&cloud, stream, "connect-unix", "unix".into()).await }
                .instrument(span),
        );
    }
}

/// A parsed request head.
#[derive(Debug, PartialEq, Eq)]
pub struct ConnectRequest {
    pub authority: String,
    /// Bytes the client sent after the head (its first bytes for the target).
    pub rest: Bytes,
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum HeadError {
    #[error("malformed request: {0}")]
    Malformed(String),
    #[error("method {0} not allowed; only CONNECT")]
    Method(String),
    #[error("request head exceeds {MAX_HEAD} bytes")]
    TooLarge,
    #[error("incomplete request")]
    Incomplete,
}

impl HeadError {
    fn status(&self) -> (u16, &'static str) {
        match self {
            HeadError::Method(_) => (405, "Method Not Allowed"),
            HeadError::TooLarge => (431, "Request Header Fields Too Large"),
            HeadError::Malformed(_) | HeadError::Incomplete => (400, "Bad Request"),
        }
    }
}

/// Parses a CONNECT head from `buf`; `Ok(None)` means more bytes are needed.
pub fn parse_head(buf: &[u8]) -> Result<Option<ConnectRequest>, HeadError> {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Complete(len)) => {
            let method = req.method.unwrap_or_default();
            if !method.eq_ignore_ascii_case("CONNECT") {
                return Err(HeadError::Method(method.to_string()));
            }
            let authority = req.path.unwrap_or_default().to_string();
            Ok(Some(ConnectRequest {
                authority,
                rest: Bytes::copy_from_slice(&buf[len..]),
            }))
        }
        Ok(httparse::Status::Partial) if buf.len() >= MAX_HEAD => Err(HeadError::TooLarge),
        Ok(httparse::Status::Partial) => Ok(None),
        Err(e) => Err(HeadError::Malformed(e.to_string())),
    }
}

async fn read_head<S: AsyncRead + Unpin>(stream: &mut S) -> Result<ConnectRequest, HeadError> {
    let mut buf = BytesMut::with_capacity(1024);
    loop {
        // Never read past the bound, whatever the client sends.
        let room = MAX_HEAD.saturating_sub(buf.len()).max(1);
        let n = (&mut *stream)
            .take(room as u64)
            .read_buf(&mut buf)
            .await
            .map_err(|e| HeadError::Malformed(e.to_string()))?;
        if n == 0 {
            return Err(HeadError::Incomplete);
        }
        if let Some(req) = parse_head(&buf)? {
            return Ok(req);
        }
    }
}

async fn respond<S: AsyncWrite + Unpin>(stream: &mut S, status: u16, reason: &str, body: &str) {
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

async fn handle<S>(cloud: &Cloud, mut stream: S, entry: &'static str, client: String)
where
    S: Socket + AsyncRead + AsyncWrite + Unpin,
{
    // The head is bounded by the handshake timeout (10 s unless configured).
    let head = match tokio::time::timeout(cloud.transport.handshake_timeout, read_head(&mut stream))
        .await
    {
        Ok(Ok(head)) => head,
        Ok(Err(e)) => {
            info!(%client, error = %e, "bad CONNECT request");
            let (status, reason) = e.status();
            respond(&mut stream, status, reason, &e.to_string()).await;
            return;
        }
        Err(_) => {
            info!(%client, "CONNECT request head not received in time");
            respond(&mut stream, 408, "Request Timeout", "").await;
            return;
        }
    };
    let routed = route::route_connect(&cloud.nodes(), &head.authority, |n| cloud.is_connected(n));
    let client = proxy::Client {
        entry,
        addr: &client,
    };
    match proxy::open(cloud, routed, &client).await {
        Ok(opened) => {
            respond(&mut stream, 200, "Connection established", "").await;
            proxy::run(cloud, opened, &client, stream, head.rest).await;
        }
        Err(e) => {
            let (status, reason) = e.http_status();
            respond(&mut stream, status, reason, &e.to_string()).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_connect_and_keeps_early_bytes() {
        let req = parse_head(b"CONNECT edge-1:10250 HTTP/1.1\r\nHost: edge-1:10250\r\n\r\nhello")
            .unwrap()
            .unwrap();
        assert_eq!(req.authority, "edge-1:10250");
        assert_eq!(&req.rest[..], b"hello");
    }

    #[test]
    fn partial_head_wants_more() {
        assert_eq!(
            parse_head(b"CONNECT edge-1:10250 HTTP/1.1\r\nHost:"),
            Ok(None)
        );
    }

    #[test]
    fn rejects_other_methods_garbage_and_huge_heads() {
        assert_eq!(
            parse_head(b"GET / HTTP/1.1\r\n\r\n"),
            Err(HeadError::Method("GET".into()))
        );
        assert!(matches!(
            parse_head(b"\x16\x03\x01garbage\r\n\r\n"),
            Err(HeadError::Malformed(_))
        ));
        let mut huge = b"CONNECT a:1 HTTP/1.1\r\n".to_vec();
        huge.extend(std::iter::repeat_n(b'x', MAX_HEAD));
        assert!(matches!(
            parse_head(&huge),
            Err(HeadError::TooLarge) | Err(HeadError::Malformed(_))
        ));
    }
}
