//! Socket options every hop of the tunnel needs.

use std::time::Duration;

use socket2::{SockRef, TcpKeepalive};
use tokio::net::TcpStream;

/// TCP_NODELAY on every hop: a response written in two writes must not wait for the
/// peer's delayed ACK (tens of milliseconds with Nagle on). Keepalive finds peers that
/// vanished without a FIN on connections that carry no heartbeat of their own.
pub fn tune(stream: &TcpStream) {
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
pub fn abort_on_close(socket: &impl std::os::fd::AsFd) {
    // SO_LINGER with a zero timeout is the portable way to ask for RST on close.
    let _ = SockRef::from(socket).set_linger(Some(Duration::ZERO));
}
