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

/// The error of a TCP listener for config key `key` that could not be bound to `addr`.
/// When the port is in use it names who holds it: a port another user took (a local
/// user's process listening where kube-apiserver's or a probe's connections land) reads
/// differently from a second copy of this process.
pub(crate) fn listen_error(addr: SocketAddr, key: &str, e: std::io::Error) -> anyhow::Error {
    let mut what = format!("cannot listen on {addr} ({key})");
    if e.kind() == std::io::ErrorKind::AddrInUse {
        let own = nix::unistd::geteuid().as_raw();
        let uids = port_holders(addr);
        let port = addr.port();
        what += &match uids.as_slice() {
            [] => format!(": port {port} is in use (its holder is not listed in /proc/net)"),
            [one] if *one == own => format!(
                ": port {port} is held by a process of this same user (uid {own}): another copy of this process?"
            ),
            _ => {
                let uids: Vec<String> = uids.iter().map(|u| format!("uid {u}")).collect();
                format!(
                    ": port {port} is held by {} (this process runs as uid {own})",
                    uids.join(", ")
                )
            }
        };
    }
    anyhow::Error::new(e).context(what)
}

/// The uids owning the sockets that keep `addr` from being bound (listening, or bound
/// and not listening), from /proc/net/tcp and tcp6 of this network namespace.
fn port_holders(addr: SocketAddr) -> Vec<u32> {
    let mut uids = Vec::new();
    for (file, v6) in [("/proc/net/tcp", false), ("/proc/net/tcp6", true)] {
        let Ok(table) = std::fs::read_to_string(file) else {
            continue;
        };
        for line in table.lines().skip(1) {
            if let Some(uid) = holder(line, v6, addr)
                && !uids.contains(&uid)
            {
                uids.push(uid);
            }
        }
    }
    uids
}

/// The uid of a /proc/net/tcp(6) line's socket when it holds `addr`'s port on `addr`'s
/// address (or either is a wildcard).
fn holder(line: &str, v6: bool, addr: SocketAddr) -> Option<u32> {
    // sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid ...
    let fields: Vec<&str> = line.split_whitespace().collect();
    let (ip, port) = fields.get(1)?.split_once(':')?;
    // 0A: listening; 07: bound, not listening (what a bind conflicts with besides).
    if u16::from_str_radix(port, 16).ok()? != addr.port() || !matches!(*fields.get(3)?, "0A" | "07")
    {
        return None;
    }
    // The address's bytes read as 32-bit words in host order, each printed in hex.
    let words: Vec<u32> = (0..ip.len() / 8)
        .map(|i| u32::from_str_radix(ip.get(i * 8..i * 8 + 8)?, 16).ok())
        .collect::<Option<_>>()?;
    let ip: std::net::IpAddr = match (v6, words.as_slice()) {
        (false, [a]) => std::net::Ipv4Addr::from(a.to_ne_bytes()).into(),
        (true, [a, b, c, d]) => {
            let mut bytes = [0u8; 16];
            for (chunk, w) in bytes.chunks_mut(4).zip([a, b, c, d]) {
                chunk.copy_from_slice(&w.to_ne_bytes());
            }
            std::net::Ipv6Addr::from(bytes).into()
        }
        _ => return None,
    };
    let overlaps = ip.is_unspecified()
        || addr.ip().is_unspecified()
        || ip.to_canonical() == addr.ip().to_canonical();
    overlaps.then(|| fields.get(7)?.parse().ok()).flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proc_net_tcp_line_names_the_holder_of_a_port() {
        // As a little-endian host prints them: 127.0.0.1:9102 and [::1]:9102 listening,
        // 0.0.0.0:9102 bound, one connected.
        let v4 = "   0: 0100007F:238E 00000000:0000 0A 00000000:00000000 00:00000000 00000000 65534        0 4242 1 0000000000000000 100 0 0 10 0";
        let any = "   1: 00000000:238E 00000000:0000 07 00000000:00000000 00:00000000 00000000  1000        0 4243 1 0000000000000000 100 0 0 10 0";
        let connected = "   2: 0100007F:238E 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 4244 1 0000000000000000 100 0 0 10 0";
        let v6 = "   0: 00000000000000000000000001000000:238E 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000 64102        0 4245 1 0000000000000000 100 0 0 10 0";
        let at = |s: &str| s.parse::<SocketAddr>().unwrap();
        if cfg!(target_endian = "little") {
            assert_eq!(holder(v4, false, at("127.0.0.1:9102")), Some(65534));
            assert_eq!(holder(v4, false, at("0.0.0.0:9102")), Some(65534));
            assert_eq!(holder(v4, false, at("127.0.0.2:9102")), None);
            assert_eq!(holder(v4, false, at("127.0.0.1:9103")), None);
            assert_eq!(holder(any, false, at("127.0.0.2:9102")), Some(1000));
            assert_eq!(holder(v6, true, at("[::1]:9102")), Some(64102));
            assert_eq!(holder(v6, true, at("[::2]:9102")), None);
        }
        assert_eq!(holder(connected, false, at("127.0.0.1:9102")), None);
        assert_eq!(holder("garbage", false, at("127.0.0.1:9102")), None);
    }

    #[test]
    fn a_port_in_use_is_named_with_its_holder() {
        let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = held.local_addr().unwrap();
        let e = std::net::TcpListener::bind(addr).map(drop).unwrap_err();
        let message = format!("{:#}", listen_error(addr, "admin.listen", e));
        let own = nix::unistd::geteuid();
        assert!(
            message.starts_with(&format!(
                "cannot listen on {addr} (admin.listen): port {} is held by a process of this same user (uid {own})",
                addr.port()
            )),
            "{message}"
        );
    }
}
