//! `--ready-file PATH`: once every listener of `tunnel cloud` or `tunnel edge` is bound and
//! serving, the process writes where each one listens. Whoever started it (the test
//! harness, a script) can then configure port 0 and read the port the kernel chose,
//! instead of picking a "free" port and racing everyone else for it until the process
//! binds it.
//!
//! One line per listener, `<config key> <address>`, in the order they were bound:
//!
//! ```text
//! tunnel.listen 127.0.0.1:40123
//! forward[0].listen 127.0.0.1:40125
//! connect.unix /run/tunnel/connect.sock
//! admin.listen 127.0.0.1:40127
//! ```
//!
//! The key never holds a space; the address is the rest of the line. The file is written
//! beside `PATH` and renamed into place, so a reader finds the whole file or none.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Context;

/// The listeners bound so far, and where to report them (nowhere without `--ready-file`).
#[derive(Debug, Default)]
pub(crate) struct ReadyFile {
    file: Option<PathBuf>,
    listeners: Vec<(String, String)>,
}

impl ReadyFile {
    pub(crate) fn new(file: Option<PathBuf>) -> Self {
        Self {
            file,
            listeners: Vec::new(),
        }
    }

    /// Records the TCP listener for config key `key`.
    pub(crate) fn tcp(
        &mut self,
        key: &str,
        listener: &tokio::net::TcpListener,
    ) -> anyhow::Result<()> {
        let addr = listener
            .local_addr()
            .with_context(|| format!("cannot read the address bound for {key}"))?;
        self.listeners.push((key.to_owned(), addr.to_string()));
        Ok(())
    }

    /// Records the unix socket listener for config key `key`.
    pub(crate) fn unix(&mut self, key: &str, path: &Path) {
        self.listeners
            .push((key.to_owned(), path.display().to_string()));
    }

    /// Writes the ready file, if one was asked for. Call once everything serves.
    pub(crate) fn report(&self) -> anyhow::Result<()> {
        let Some(file) = &self.file else {
            return Ok(());
        };
        let mut text = String::new();
        for (key, addr) in &self.listeners {
            let _ = writeln!(text, "{key} {addr}");
        }
        let mut tmp = file.clone().into_os_string();
        tmp.push(format!(".{}.tmp", std::process::id()));
        let tmp = PathBuf::from(tmp);
        std::fs::write(&tmp, text)
            .and_then(|()| std::fs::rename(&tmp, file))
            .with_context(|| format!("cannot write the ready file {}", file.display()))?;
        tracing::info!(file = %file.display(), listeners = self.listeners.len(), "listeners reported in the ready file");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn reports_the_bound_port_atomically() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("ready");
        let mut bound = ReadyFile::new(Some(file.clone()));
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        bound.tcp("admin.listen", &l).unwrap();
        bound.unix("connect.unix", Path::new("/run/a b.sock"));
        bound.report().unwrap();
        let text = std::fs::read_to_string(&file).unwrap();
        assert_eq!(
            text,
            format!(
                "admin.listen {}\nconnect.unix /run/a b.sock\n",
                l.local_addr().unwrap()
            )
        );
        // Only the file itself: the temporary one was renamed.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
