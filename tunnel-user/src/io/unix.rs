//! Unix socket files: bound in place of a stale one, owner-only from the start, and told
//! apart from one that another process bound at the same path later.

use std::os::fd::OwnedFd;
use std::path::Path;

use anyhow::Context;
use nix::sys::stat::Mode;
use socket2::{Domain, SockAddr, Socket, Type};
use tokio::net::UnixListener;

/// Pending connections a socket queues (what tokio's TCP listeners use).
const BACKLOG: i32 = 1024;

/// Listens on the socket file at `path` (the config key `key`, for the error). The file
/// is created mode 0600, whatever the umask: whoever may connect gets what the socket
/// serves (a proxy to every edge, or every listener of the cloud).
pub(crate) fn bind(path: &Path, key: &str) -> anyhow::Result<UnixListener> {
    // A socket file left by a previous run would make bind fail; it is ours to replace.
    if std::fs::symlink_metadata(path).is_ok_and(|m| {
        use std::os::unix::fs::FileTypeExt;
        m.file_type().is_socket()
    }) {
        std::fs::remove_file(path)
            .with_context(|| format!("cannot remove stale socket {}", path.display()))?;
    }
    let cannot = || format!("cannot listen on {} ({key})", path.display());
    let socket =
        Socket::new(Domain::UNIX, Type::STREAM.nonblocking(), None).with_context(cannot)?;
    // Linux creates the file with the mode of the socket's own inode (less the umask), so
    // the mode set here holds from the moment the path exists: a chmod after bind would
    // leave a window in which anyone the umask lets in could connect.
    nix::sys::stat::fchmod(&socket, Mode::S_IRUSR | Mode::S_IWUSR).with_context(cannot)?;
    socket
        .bind(&SockAddr::unix(path).with_context(cannot)?)
        .and_then(|()| socket.listen(BACKLOG))
        .with_context(cannot)?;
    let listener = std::os::unix::net::UnixListener::from(OwnedFd::from(socket));
    UnixListener::from_std(listener).with_context(cannot)
}

/// Device and inode of `path`, if it exists.
pub(crate) fn file_id(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino()))
}
