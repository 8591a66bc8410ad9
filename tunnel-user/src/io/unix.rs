//! Unix socket files: bound in place of a stale one, and told apart from one that
//! another process bound at the same path later.

use std::path::Path;

use anyhow::Context;
use tokio::net::UnixListener;

/// Listens on the socket file at `path` (the config key `key`, for the error).
pub fn bind(path: &Path, key: &str) -> anyhow::Result<UnixListener> {
    // A socket file left by a previous run would make bind fail; it is ours to replace.
    if std::fs::symlink_metadata(path).is_ok_and(|m| {
        use std::os::unix::fs::FileTypeExt;
        m.file_type().is_socket()
    }) {
        std::fs::remove_file(path)
            .with_context(|| format!("cannot remove stale socket {}", path.display()))?;
    }
    UnixListener::bind(path).with_context(|| format!("cannot listen on {} ({key})", path.display()))
}

/// Device and inode of `path`, if it exists.
pub fn file_id(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino()))
}
