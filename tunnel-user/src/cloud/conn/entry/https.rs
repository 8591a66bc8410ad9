//! SuperEdge's HTTPS module: TLS is terminated here with the configured certificate, the
//! node is the request's host name (its TLS SNI, or the Host header of the first request
//! when the client sent no name), and that node's edge dials the target with TLS,
//! presenting its `[https]` client certificate.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tracing::{Instrument, info};

use super::Accepted;
use crate::addr::{ClientAddr, Target};
use crate::cloud::conn::proxy::{Opener, Start};
use crate::cloud::conn::router::{Ask, Router};
use crate::cloud::conn::shares::Who;
use crate::config::HttpsEntryConfig;
use crate::io::accept::{self, Incoming};
use crate::io::http_head::{self, MAX_HEAD, respond};

/// `head_timeout`: the TLS handshake and the request head are bounded by the handshake
/// timeout.
pub(crate) async fn serve(
    router: Arc<Router>,
    opener: Arc<Opener>,
    mut incoming: Incoming<TcpListener>,
    acceptor: TlsAcceptor,
    entry: HttpsEntryConfig,
    head_timeout: Duration,
) {
    // Validation checked the entry's target: this never fails.
    let target = match Target::parse(&entry.target) {
        Ok(target) => target,
        Err(e) => return tracing::error!(error = %e, "HTTPS entry with an invalid target"),
    };
    while let Some((tcp, peer, permit)) = incoming.next().await {
        let (router, opener) = (router.clone(), opener.clone());
        let (acceptor, target) = (acceptor.clone(), target.clone());
        let span = tracing::debug_span!("conn", entry = "https", client = %peer);
        let accepted = Accepted::new(tcp, ClientAddr::Tcp(peer));
        let who = Who::Address(peer.ip());
        let conn = handle(
            router,
            opener,
            accepted,
            who,
            acceptor,
            target,
            head_timeout,
        );
        tokio::spawn(accept::hold(permit, conn.instrument(span)));
    }
}

/// Terminates TLS, finds the node the request is for, and proxies the connection to the
/// entry's target on it; a failure to open is answered with an HTTP error.
async fn handle(
    router: Arc<Router>,
    opener: Arc<Opener>,
    conn: Accepted<TcpStream>,
    who: Who,
    acceptor: TlsAcceptor,
    target: Target,
    head_timeout: Duration,
) {
    let Accepted { socket, client, .. } = conn;
    crate::io::net::tune(&socket);
    let head = tokio::time::timeout(head_timeout, async {
        let tls = acceptor.accept(socket).await.map_err(ReadNodeError::Tls)?;
        read_node(tls).await
    })
    .await;
    let (mut tls, node, first) = match head {
        Ok(Ok(head)) => head,
        Ok(Err(e)) => return info!(%client, error = %e, "HTTPS entry: bad request"),
        Err(_) => return info!(%client, "HTTPS entry: no request in time"),
    };
    let routed = router.route(Ask::Https { node, target }).await;
    match opener
        .open(routed, "https", client, who, Start::Answered)
        .await
    {
        Ok(dial) => opener.carry(dial, tls, first).await,
        Err(e) => {
            let (status, reason) = e.http_status();
            respond(&mut tls, status, reason, &e.to_string()).await;
            let _ = tls.shutdown().await;
        }
    }
}

/// Why a terminated connection names no node (logged as a bad request).
#[derive(Debug, thiserror::Error)]
enum ReadNodeError {
    #[error("TLS handshake: {0}")]
    Tls(std::io::Error),
    #[error(transparent)]
    Read(#[from] http_head::ReadError),
    #[error(transparent)]
    Head(#[from] HostError),
}

/// The node a terminated connection is for, and the bytes read to find out (they go to
/// the target first).
async fn read_node(
    mut tls: TlsStream<TcpStream>,
) -> Result<(TlsStream<TcpStream>, String, Bytes), ReadNodeError> {
    if let Some(node) = tls.get_ref().1.server_name().map(normalise) {
        return Ok((tls, node, Bytes::new()));
    }
    let parse = |buf: &[u8]| host_from_head(buf).map_err(ReadNodeError::Head);
    let (host, first) = http_head::read(&mut tls, parse).await?;
    Ok((tls, normalise(&host), first.freeze()))
}

fn normalise(host: &str) -> String {
    host.trim_end_matches('.').to_ascii_lowercase()
}

/// Why a request head names no host.
#[derive(Debug, PartialEq, thiserror::Error)]
pub enum HostError {
    #[error("request has no Host header")]
    NoHost,
    #[error("request head exceeds {MAX_HEAD} bytes")]
    TooLong,
    #[error("malformed request: {0}")]
    Malformed(httparse::Error),
}

/// The Host header (without port) of a complete request head; None while incomplete.
pub fn host_from_head(buf: &[u8]) -> Result<Option<String>, HostError> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Complete(_)) => {
            let host = req
                .headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case("host"))
                .map(|h| String::from_utf8_lossy(h.value).to_string())
                .ok_or(HostError::NoHost)?;
            let name = match host.rsplit_once(':') {
                Some((name, port))
                    if !name.is_empty()
                        && !port.is_empty()
                        && port.bytes().all(|b| b.is_ascii_digit()) =>
                {
                    name
                }
                _ => host.as_str(),
            };
            Ok(Some(name.to_string()))
        }
        Ok(httparse::Status::Partial) if buf.len() >= MAX_HEAD => Err(HostError::TooLong),
        Ok(httparse::Status::Partial) => Ok(None),
        Err(e) => Err(HostError::Malformed(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_header_names_the_node() {
        assert_eq!(
            host_from_head(b"GET /logs HTTP/1.1\r\nHost: edge-1:10250\r\n\r\n"),
            Ok(Some("edge-1".into()))
        );
        assert_eq!(
            host_from_head(b"GET / HTTP/1.1\r\nhost: edge-2\r\n\r\n"),
            Ok(Some("edge-2".into()))
        );
        assert_eq!(host_from_head(b"GET / HTTP/1.1\r\nHost: edge-1"), Ok(None));
        assert!(host_from_head(b"GET / HTTP/1.1\r\n\r\n").is_err());
        assert!(host_from_head(b"\x00\x01garbage\r\n\r\n").is_err());
    }
}
