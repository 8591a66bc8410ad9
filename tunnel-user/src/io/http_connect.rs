//! The head of an HTTP CONNECT request: shared by the cloud's CONNECT entry and the
//! edge's proxy, which read it with [`super::http_head`].

use bytes::Bytes;
use tokio::io::AsyncRead;

use super::http_head::{self, MAX_HEAD, ReadError};

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
    pub(crate) fn status(&self) -> (u16, &'static str) {
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

/// Reads a CONNECT head from `stream` ([`http_head::read`]).
pub(crate) async fn read_head<S: AsyncRead + Unpin>(
    stream: &mut S,
) -> Result<ConnectRequest, HeadError> {
    http_head::read(stream, parse_head)
        .await
        .map(|(req, _)| req)
}

impl From<ReadError> for HeadError {
    fn from(e: ReadError) -> Self {
        match e {
            ReadError::Io(e) => HeadError::Malformed(e.to_string()),
            ReadError::Closed => HeadError::Incomplete,
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
    fn parses_an_ipv6_authority() {
        let req = parse_head(
            b"CONNECT [fd00:7e57::5]:10250 HTTP/1.1\r\nHost: [fd00:7e57::5]:10250\r\n\r\n",
        )
        .unwrap()
        .unwrap();
        assert_eq!(req.authority, "[fd00:7e57::5]:10250");
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
