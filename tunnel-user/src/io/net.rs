//! Socket options every hop of the tunnel needs, and the connection to a target that
//! both ends' dialers make.

use std::net::SocketAddr;
use std::time::Duration;

use proto::DialStatus;
use socket2::{SockRef, TcpKeepalive};
use tokio::net::TcpStream;

use crate::addr::Target;

/// Why a connection to a target was not made.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("cannot resolve {target}: {error}")]
    Resolve {
        target: Target,
        error: std::io::Error,
    },
    #[error("{0} resolved to no address")]
    NoAddress(Target),
    #[error("connect to {addr}: {error}")]
    Connect {
        addr: SocketAddr,
        error: std::io::Error,
    },
    #[error("connect to {target} timed out after {timeout:?}")]
    Timeout { target: Target, timeout: Duration },
}

impl ConnectError {
    /// What the end that asked for the connection is told.
    pub(crate) fn status(&self) -> DialStatus {
        match self {
            ConnectError::Timeout { .. } => DialStatus::Timeout,
            ConnectError::Resolve { .. }
            | ConnectError::NoAddress(_)
            | ConnectError::Connect { .. } => DialStatus::Refused,
        }
    }
}

/// Connects to `target` (an address, or a host name and port, whose addresses are tried
/// in turn) within `timeout`, and tunes the socket: the edge's dial for the cloud and
/// the cloud's for an edge both end here.
pub(crate) async fn connect(target: &Target, timeout: Duration) -> Result<TcpStream, ConnectError> {
    let connect = async {
        let addrs: Vec<SocketAddr> = match target.socket_addr() {
            Some(addr) => vec![addr],
            None => tokio::net::lookup_host((target.host(), target.port()))
                .await
                .map_err(|error| ConnectError::Resolve {
                    target: target.clone(),
                    error,
                })?
                .collect(),
        };
        let mut last = ConnectError::NoAddress(target.clone());
        for addr in addrs {
            match TcpStream::connect(addr).await {
                Ok(tcp) => return Ok(tcp),
                Err(error) => last = ConnectError::Connect { addr, error },
            }
        }
        Err(last)
    };
    let tcp =
        tokio::time::timeout(timeout, connect)
            .await
            .map_err(|_| ConnectError::Timeout {
                target: target.clone(),
                timeout,
            })??;
    tune(&tcp);
    Ok(tcp)
}

/// TCP_NODELAY on every hop: a response written in two writes must not wait for the
/// peer's delayed ACK (tens of milliseconds with Nagle on). Keepalive finds peers that
/// vanished without a FIN on connections that carry no heartbeat of their own.
pub(crate) fn tune(stream: &TcpStream) {
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(error = %e, "cannot set TCP_NODELAY");
    }
    let keepalive = TcpKeepalive::new()
        .with_time(Duration::from_secs(30))
        .with_interval(Duration::from_secs(10))
        .with_retries(3);
    if let Err(e) = SockRef::from(stream).set_tcp_keepalive(&keepalive) {
        tracing::debug!(error = %e, "cannot set TCP keepalive");
    }
}

/// Makes the next close of `socket` send RST instead of FIN, so the peer sees an abort
/// as an abort.
pub(crate) fn abort_on_close(socket: &impl std::os::fd::AsFd) {
    // SO_LINGER with a zero timeout is the portable way to ask for RST on close.
    let _ = SockRef::from(socket).set_linger(Some(Duration::ZERO));
}
