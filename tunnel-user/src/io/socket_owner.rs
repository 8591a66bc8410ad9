//! Who owns the far end of a loopback connection: the user and the cgroup (v2) of the
//! client socket, asked of the kernel by `sock_diag` (`NETLINK_SOCK_DIAG`), as `ss -e`
//! reads them. The redirect entry's clients all connect from a loopback address, so
//! their address says nothing of who they are; their socket's cgroup does (a pod, or
//! kube-apiserver's static pod), and needs no privilege to read.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// The owner of a client socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Owner {
    pub(crate) uid: u32,
    /// The cgroup v2 id (the inode of its directory); 0 where the kernel reports none.
    pub(crate) cgroup: u64,
}

const SOCK_DIAG_BY_FAMILY: u16 = 20;
/// `inet_diag.h`: the cgroup v2 id attribute of an answer (Linux 5.7+).
const INET_DIAG_CGROUP_ID: u16 = 21;
/// Exact lookups leave the cookie unset (`INET_DIAG_NOCOOKIE`).
const NO_COOKIE: u32 = !0;
const NLMSG_HDR: usize = 16;
/// `struct inet_diag_req_v2`.
const REQUEST: usize = 56;
/// `struct inet_diag_msg`.
const ANSWER: usize = 72;
const NLMSG_ERROR: u16 = 2;

/// The owner of the TCP socket whose local address is `client` and whose peer is
/// `server`: the client's end of a connection this process accepted on `server`.
/// `Ok(None)` when no such socket exists (the client has gone).
pub(crate) fn tcp_owner(client: SocketAddr, server: SocketAddr) -> io::Result<Option<Owner>> {
    // SAFETY: a plain socket(2) call; the descriptor is owned at once.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
            libc::NETLINK_SOCK_DIAG,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a new descriptor nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let request = request(client, server);
    // SAFETY: the buffer is valid for its length; the kernel is the default destination.
    let sent = unsafe { libc::send(fd.as_raw_fd(), request.as_ptr().cast(), request.len(), 0) };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut answer = [0u8; 1024];
    // SAFETY: the buffer is valid for its length.
    let got = unsafe { libc::recv(fd.as_raw_fd(), answer.as_mut_ptr().cast(), answer.len(), 0) };
    if got < 0 {
        return Err(io::Error::last_os_error());
    }
    parse(&answer[..got as usize])
}

fn request(client: SocketAddr, server: SocketAddr) -> Vec<u8> {
    let mut m = Vec::with_capacity(NLMSG_HDR + REQUEST);
    m.extend(((NLMSG_HDR + REQUEST) as u32).to_ne_bytes());
    m.extend(SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    m.extend((libc::NLM_F_REQUEST as u16).to_ne_bytes());
    m.extend(1u32.to_ne_bytes()); // sequence
    m.extend(0u32.to_ne_bytes()); // port id: the kernel's
    let family = match client.ip() {
        IpAddr::V4(_) => libc::AF_INET,
        IpAddr::V6(_) => libc::AF_INET6,
    };
    m.extend([family as u8, libc::IPPROTO_TCP as u8, 0, 0]);
    m.extend(u32::MAX.to_ne_bytes()); // every state
    // inet_diag_sockid: ports and addresses in network order.
    m.extend(client.port().to_be_bytes());
    m.extend(server.port().to_be_bytes());
    m.extend(address(client.ip()));
    m.extend(address(server.ip()));
    m.extend(0u32.to_ne_bytes()); // any interface
    m.extend(NO_COOKIE.to_ne_bytes());
    m.extend(NO_COOKIE.to_ne_bytes());
    m
}

/// An address as `inet_diag_sockid` holds it: 16 bytes, an IPv4 one in the first 4.
fn address(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(v4) => {
            let mut a = [0u8; 16];
            a[..4].copy_from_slice(&v4.octets());
            a
        }
        IpAddr::V6(v6) => v6.octets(),
    }
}

fn parse(message: &[u8]) -> io::Result<Option<Owner>> {
    let malformed = || io::Error::new(io::ErrorKind::InvalidData, "malformed sock_diag answer");
    let header = message.get(..NLMSG_HDR).ok_or_else(malformed)?;
    let len = u32::from_ne_bytes(header[0..4].try_into().unwrap_or_default()) as usize;
    let kind = u16::from_ne_bytes(header[4..6].try_into().unwrap_or_default());
    let message = message.get(..len).ok_or_else(malformed)?;
    if kind == NLMSG_ERROR {
        let errno = message
            .get(NLMSG_HDR..NLMSG_HDR + 4)
            .map(|b| i32::from_ne_bytes(b.try_into().unwrap_or_default()))
            .ok_or_else(malformed)?;
        return match -errno {
            libc::ENOENT => Ok(None),
            errno => Err(io::Error::from_raw_os_error(errno)),
        };
    }
    if kind != SOCK_DIAG_BY_FAMILY {
        return Err(malformed());
    }
    let body = message.get(NLMSG_HDR..).ok_or_else(malformed)?;
    let fixed = body.get(..ANSWER).ok_or_else(malformed)?;
    let uid = u32::from_ne_bytes(fixed[64..68].try_into().unwrap_or_default());
    let mut cgroup = 0;
    // Attributes (rtattr: length, type, value), each padded to 4 bytes.
    let mut attributes = &body[ANSWER..];
    while attributes.len() >= 4 {
        let len = u16::from_ne_bytes([attributes[0], attributes[1]]) as usize;
        let kind = u16::from_ne_bytes([attributes[2], attributes[3]]);
        if len < 4 || len > attributes.len() {
            break;
        }
        if kind == INET_DIAG_CGROUP_ID && len >= 12 {
            cgroup = u64::from_ne_bytes(attributes[4..12].try_into().unwrap_or_default());
        }
        attributes = &attributes[(len + 3) & !3..];
    }
    Ok(Some(Owner { uid, cgroup }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cgroup v2 id of this process: the inode of its cgroup's directory.
    fn own_cgroup() -> Option<u64> {
        use std::os::unix::fs::MetadataExt as _;
        let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
        let root = mounts
            .lines()
            .find(|l| l.split(' ').nth(2) == Some("cgroup2"))?
            .split(' ')
            .nth(1)?
            .to_string();
        let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
        let path = own.lines().find_map(|l| l.strip_prefix("0::"))?;
        Some(std::fs::metadata(format!("{root}{path}")).ok()?.ino())
    }

    #[test]
    fn the_owner_of_a_loopback_client_is_this_process_user_and_cgroup() {
        for server in ["127.0.0.1:0", "[::1]:0"] {
            let listener = std::net::TcpListener::bind(server).expect("bind");
            let server = listener.local_addr().unwrap();
            let client = std::net::TcpStream::connect(server).expect("connect");
            let (_accepted, peer) = listener.accept().expect("accept");
            assert_eq!(peer, client.local_addr().unwrap());

            let owner = tcp_owner(peer, server).expect("sock_diag").expect("found");
            // SAFETY: geteuid has no preconditions.
            assert_eq!(owner.uid, unsafe { libc::geteuid() });
            if let Some(cgroup) = own_cgroup() {
                assert_eq!(owner.cgroup, cgroup, "{server}");
            }
            drop(client);
        }
    }

    #[test]
    fn a_client_that_is_gone_has_no_owner() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let server = listener.local_addr().unwrap();
        // A port nothing holds any more (a listener there would be found: the lookup
        // is the kernel's own, listeners included).
        let nobody = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("bind");
        assert_eq!(tcp_owner(nobody, server).expect("sock_diag"), None);
    }
}
