//! Listener handover between two tunnel-cloud processes on one host.
//!
//! In a DaemonSet rolling update with `maxSurge: 1, maxUnavailable: 0` the new pod starts
//! while the old one still serves, both in the host's network namespace, so the new one
//! cannot bind the fixed ports. It asks the running process over a unix socket
//! (`handover.socket`) instead and receives its listening sockets (SCM_RIGHTS): the same
//! sockets, with the same accept queues. It stands by while the old process accepts. On
//! SIGTERM the old process stops accepting, says so here, and drains; the new one then
//! accepts from the queues the old one left. A connect in between waits in a queue; none
//! is refused or reset.
//!
//! Why not `SO_REUSEPORT`: each socket of a reuseport group has its own accept queue, the
//! kernel keeps hashing new connects to the old socket until it is closed, and closing it
//! resets the connections waiting in its queue (unless the host enabled
//! `net.ipv4.tcp_migrate_req`). A handed-over socket has one queue for both processes.
//!
//! Wire format (a stream socket; the successor sends nothing): the running process sends
//! `tunnel-handover v1 <n>\n` and n lines `<key>\n`, the config key of each listener
//! (`tunnel.listen`, `redirect.listen`, ...), with the n descriptors in that order in one
//! SCM_RIGHTS message on the first byte. When it stops accepting it sends `stopped\n` and
//! closes. A connection that closes without it (the process died) means the same.

use std::collections::HashMap;
use std::io::{self, IoSlice, IoSliceMut, Read as _};
use std::net::SocketAddr;
use std::os::fd::{AsFd as _, AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd, RawFd};
use std::os::unix::net::UnixStream as StdUnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _, Interest};
use tokio::net::{UnixListener, UnixStream};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::io::accept::Incoming;
use crate::io::unix;

const HELLO: &str = "tunnel-handover v1";
const STOPPED: &[u8] = b"stopped\n";
/// SCM_MAX_FD: the most descriptors one message carries.
const MAX_FDS: usize = 253;
/// How long a starting process waits for the running one's listing.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);

/// Listening sockets taken from the running process and not used yet.
pub(crate) struct Taken {
    fds: HashMap<String, OwnedFd>,
    conn: StdUnixStream,
    /// Bytes that came after the listing: `stopped` if the predecessor stopped already.
    rest: Vec<u8>,
    /// How many were taken into use.
    used: usize,
}

/// Asks the process serving `path` for its listeners. `None` when nobody serves it: no
/// socket there, or one left by a process that is gone.
pub(crate) fn take(path: &Path) -> anyhow::Result<Option<Taken>> {
    let conn = match StdUnixStream::connect(path) {
        Ok(conn) => conn,
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused
            ) =>
        {
            return Ok(None);
        }
        Err(e) => {
            return Err(e).with_context(|| {
                format!("cannot connect to {} (handover.socket)", path.display())
            });
        }
    };
    let what = || {
        format!(
            "the running tunnel cloud did not hand over its listeners on {} (handover.socket)",
            path.display()
        )
    };
    conn.set_read_timeout(Some(ANSWER_TIMEOUT))
        .with_context(what)?;
    let (keys, fds, rest) = receive(&conn).with_context(what)?;
    if keys.len() != fds.len() {
        bail!(
            "{}: {} listeners named, {} received",
            what(),
            keys.len(),
            fds.len()
        );
    }
    conn.set_read_timeout(None).with_context(what)?;
    Ok(Some(Taken {
        fds: keys.into_iter().zip(fds).collect(),
        conn,
        rest,
        used: 0,
    }))
}

/// Reads the listing and the descriptors sent with it.
fn receive(conn: &StdUnixStream) -> anyhow::Result<(Vec<String>, Vec<OwnedFd>, Vec<u8>)> {
    let mut buf = vec![0u8; 64 * 1024];
    let mut cmsg = nix::cmsg_space!([RawFd; MAX_FDS]);
    let (read, fds) = {
        let mut iov = [IoSliceMut::new(&mut buf)];
        let msg = nix::sys::socket::recvmsg::<()>(
            conn.as_raw_fd(),
            &mut iov,
            Some(&mut cmsg),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )?;
        let mut fds = Vec::new();
        for c in msg.cmsgs()? {
            if let ControlMessageOwned::ScmRights(raw) = c {
                // SAFETY: the kernel installed these descriptors in this process for this
                // message; nothing else owns them.
                fds.extend(
                    raw.into_iter()
                        .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
                );
            }
        }
        if msg.flags.contains(MsgFlags::MSG_CTRUNC) {
            bail!("descriptors cut off");
        }
        (msg.bytes, fds)
    };
    let mut data = buf[..read].to_vec();
    let mut last = read;
    // A stream may split the listing; the descriptors came with its first byte.
    loop {
        if let Some((keys, used)) = parse(&data)? {
            return Ok((keys, fds, data.split_off(used)));
        }
        if last == 0 {
            bail!("the connection closed before the listing ended");
        }
        last = (&*conn).read(&mut buf)?;
        data.extend_from_slice(&buf[..last]);
    }
}

/// The keys of a complete listing and the bytes it took, or None while it is incomplete.
fn parse(data: &[u8]) -> anyhow::Result<Option<(Vec<String>, usize)>> {
    let mut lines = Vec::new();
    let mut at = 0;
    while let Some(end) = data[at..].iter().position(|&b| b == b'\n') {
        lines.push(String::from_utf8_lossy(&data[at..at + end]).into_owned());
        at += end + 1;
        let Some(header) = lines.first() else {
            continue;
        };
        let count = header
            .strip_prefix(HELLO)
            .and_then(|n| n.trim().parse::<usize>().ok())
            .with_context(|| format!("expected `{HELLO} <count>`, got `{header}`"))?;
        if lines.len() == count + 1 {
            lines.remove(0);
            return Ok(Some((lines, at)));
        }
    }
    Ok(None)
}

impl Taken {
    /// How many listeners were offered and not (yet) taken into use.
    pub(crate) fn unused(&self) -> usize {
        self.fds.len()
    }

    /// How many listeners were taken into use.
    pub(crate) fn used(&self) -> usize {
        self.used
    }

    /// The running process's listener `key`, if it listens where `want` says (port 0:
    /// any port on that address); otherwise the caller binds anew.
    pub(crate) fn tcp(&mut self, key: &str, want: SocketAddr) -> Option<std::net::TcpListener> {
        let listener = std::net::TcpListener::from(self.fds.remove(key)?);
        match listener.local_addr() {
            Ok(got) if got == want || (want.port() == 0 && got.ip() == want.ip()) => {
                self.used += 1;
                Some(listener)
            }
            got => {
                info!(key, ?got, %want, "the running cloud listens elsewhere for this key: binding anew");
                None
            }
        }
    }

    /// The running process's unix listener `key`, if it is bound at `want`.
    pub(crate) fn unix(
        &mut self,
        key: &str,
        want: &Path,
    ) -> Option<std::os::unix::net::UnixListener> {
        let listener = std::os::unix::net::UnixListener::from(self.fds.remove(key)?);
        let got = listener
            .local_addr()
            .ok()
            .and_then(|a| a.as_pathname().map(Path::to_path_buf));
        if got.as_deref() == Some(want) {
            self.used += 1;
            return Some(listener);
        }
        info!(key, ?got, want = %want.display(), "the running cloud listens elsewhere for this key: binding anew");
        None
    }

    /// Returns once the running process stopped accepting (it says so, or it is gone).
    pub(crate) async fn predecessor_stopped(self) {
        if !self.rest.is_empty() {
            return;
        }
        // Anything at all (`stopped`, the end of the stream, an error) means it stopped.
        let conn = self.conn.set_nonblocking(true).map(|()| self.conn);
        if let Ok(mut conn) = conn.and_then(UnixStream::from_std) {
            let _ = conn.read(&mut [0u8; 64]).await;
        }
    }
}

/// Duplicates of this process's listeners, for a successor.
#[derive(Default)]
pub(crate) struct Offer(Vec<(String, OwnedFd)>);

impl Offer {
    pub(crate) fn add(&mut self, key: &str, fd: BorrowedFd<'_>) -> anyhow::Result<()> {
        let fd = fd
            .try_clone_to_owned()
            .with_context(|| format!("cannot duplicate the {key} listener for a handover"))?;
        self.0.push((key.to_string(), fd));
        Ok(())
    }
}

/// Binds the handover socket, replacing one left by a process that is gone (`take`
/// found nobody serving it, or the predecessor removed it when it stopped). Owner-only
/// (as `unix::bind` makes every socket): whoever connects gets every listener.
pub(crate) fn bind(path: &Path) -> anyhow::Result<UnixListener> {
    unix::bind(path, "handover.socket")
}

/// Hands `offer` to every new process that connects to `listener`, until `shutdown`.
/// Then it removes `path` (the next process to serve it is a successor), drops the
/// duplicates and tells the successors standing by that this process stopped
/// accepting. Returns how many it told: those now serve this process's listeners.
pub(crate) async fn serve(
    listener: UnixListener,
    path: PathBuf,
    offer: Offer,
    shutdown: CancellationToken,
) -> usize {
    let mut successors: Vec<UnixStream> = Vec::new();
    // One process at a time: each is answered before the next is accepted.
    let mut incoming = Incoming::new(listener, "handover", 1, shutdown);
    while let Some((mut conn, _, _permit)) = incoming.next().await {
        let uid = nix::unistd::geteuid().as_raw();
        match conn.peer_cred() {
            Ok(cred) if cred.uid() == uid => {}
            other => {
                warn!(peer = ?other, "handover socket: refused a process of another user");
                continue;
            }
        }
        match send(&mut conn, &offer).await {
            Ok(()) => {
                info!(
                    listeners = offer.0.len(),
                    "a new tunnel cloud took the listeners; it stands by until this one stops accepting"
                );
                // Successors that died meanwhile (their end is closed) need no word.
                successors.retain(|s| !matches!(s.try_read(&mut [0u8; 1]), Ok(0)));
                successors.push(conn);
            }
            Err(e) => warn!(error = %e, "handing the listeners to a new tunnel cloud failed"),
        }
    }
    drop(incoming);
    let _ = std::fs::remove_file(&path);
    drop(offer);
    let mut told = 0;
    for mut s in successors {
        if s.write_all(STOPPED).await.is_ok() {
            told += 1;
        }
    }
    if told > 0 {
        info!(
            successors = told,
            "stopped accepting: the new tunnel cloud accepts from here on"
        );
    }
    told
}

async fn send(conn: &mut UnixStream, offer: &Offer) -> io::Result<()> {
    if offer.0.len() > MAX_FDS {
        return Err(io::Error::other(format!(
            "{} listeners, at most {MAX_FDS} pass in one message",
            offer.0.len()
        )));
    }
    let mut text = format!("{HELLO} {}\n", offer.0.len());
    for (key, _) in &offer.0 {
        text.push_str(key);
        text.push('\n');
    }
    let fds: Vec<RawFd> = offer.0.iter().map(|(_, fd)| fd.as_raw_fd()).collect();
    let rights = [ControlMessage::ScmRights(&fds)];
    let cmsgs: &[ControlMessage<'_>] = if fds.is_empty() { &[] } else { &rights };
    let sent = loop {
        conn.writable().await?;
        let raw = conn.as_fd().as_raw_fd();
        match conn.try_io(Interest::WRITABLE, || {
            nix::sys::socket::sendmsg::<()>(
                raw,
                &[IoSlice::new(text.as_bytes())],
                cmsgs,
                MsgFlags::empty(),
                None,
            )
            .map_err(io::Error::from)
        }) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            r => break r?,
        }
    };
    // The descriptors went with the first byte; the rest of the listing, if any, follows.
    conn.write_all(&text.as_bytes()[sent..]).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn listeners_pass_to_a_successor_which_stands_by_until_told() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("handover.sock");
        assert!(take(&path).unwrap().is_none(), "nobody serves it yet");

        let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = tcp.local_addr().unwrap();
        let mut offer = Offer::default();
        offer.add("tunnel.listen", tcp.as_fd()).unwrap();
        let shutdown = CancellationToken::new();
        let server = tokio::spawn(serve(
            bind(&path).unwrap(),
            path.clone(),
            offer,
            shutdown.clone(),
        ));

        let p = path.clone();
        let mut taken = tokio::task::spawn_blocking(move || take(&p))
            .await
            .unwrap()
            .unwrap()
            .expect("the running process answers");
        assert_eq!((taken.unused(), taken.used()), (1, 0));
        let other = SocketAddr::from(([127, 0, 0, 1], addr.port().wrapping_add(1)));
        let got = taken.tcp("tunnel.listen", addr).expect("same address");
        assert_eq!(got.local_addr().unwrap(), addr);
        assert!(taken.tcp("tunnel.listen", other).is_none(), "taken once");
        assert_eq!((taken.unused(), taken.used()), (0, 1));

        // The same socket: a connect queued there is accepted through the copy.
        let _client = std::net::TcpStream::connect(addr).unwrap();
        drop(tcp);
        got.set_nonblocking(false).unwrap();
        got.accept()
            .expect("accepted through the handed-over socket");

        let stopped = tokio::spawn(taken.predecessor_stopped());
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            !stopped.is_finished(),
            "stands by while the predecessor runs"
        );
        shutdown.cancel();
        assert_eq!(server.await.unwrap(), 1);
        tokio::time::timeout(Duration::from_secs(5), stopped)
            .await
            .expect("told")
            .unwrap();
        assert!(!path.exists(), "the path is left to the successor");
    }

    #[tokio::test]
    async fn a_successor_takes_over_when_the_predecessor_dies() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("handover.sock");
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut offer = Offer::default();
        offer.add("admin.listen", tcp.as_fd()).unwrap();
        let server = tokio::spawn(serve(
            bind(&path).unwrap(),
            path.clone(),
            offer,
            CancellationToken::new(),
        ));
        let p = path.clone();
        let taken = tokio::task::spawn_blocking(move || take(&p))
            .await
            .unwrap()
            .unwrap()
            .expect("the running process answers");
        let stopped = tokio::spawn(taken.predecessor_stopped());
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!stopped.is_finished());
        // Like a kill -9: its end of the connection closes without a word.
        server.abort();
        tokio::time::timeout(Duration::from_secs(5), stopped)
            .await
            .expect("a closed connection means stopped")
            .unwrap();
        // The socket file stays behind; the next process finds nobody there.
        assert!(path.exists());
        assert!(take(&path).unwrap().is_none());
    }

    #[test]
    fn a_listing_may_arrive_in_pieces() {
        assert!(parse(b"tunnel-handover v1 2\na\n").unwrap().is_none());
        let (keys, used) = parse(b"tunnel-handover v1 2\na\nb\nstopped\n")
            .unwrap()
            .unwrap();
        assert_eq!(keys, ["a", "b"]);
        assert_eq!(used, 25);
        assert!(parse(b"tunnel-handover v2 0\n").is_err());
    }
}
