//! What privileged tests (eBPF, cgroups, network namespaces) need: whether they can run
//! here, and a child cgroup that only processes we start are put in, removed (with those
//! processes) on drop.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// `CI` set to anything but empty/"0"/"false".
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "0" && v != "false")
}

/// A test that cannot run here: fails in CI, skips loudly elsewhere.
pub fn cannot_run(why: &str) {
    assert!(!in_ci(), "CI is set, so this must not be skipped: {why}");
    // Straight to fd 2: eprintln! output of a passing test is swallowed by the harness.
    let msg = format!("\n!!!!!!!! SKIPPED (not in CI): {why} !!!!!!!!\n");
    let _ = std::io::Write::write_all(&mut std::io::stderr(), msg.as_bytes());
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// The cgroup v2 root to create test cgroups under, or None when this machine cannot
/// run a privileged test (after failing in CI / saying why): `needs` names the tests.
pub fn cgroup_root(needs: &str) -> Option<PathBuf> {
    if !is_root() {
        cannot_run(&format!(
            "{needs} need root (CAP_BPF, CAP_NET_ADMIN, CAP_SYS_ADMIN)"
        ));
        return None;
    }
    match tunnel_user::intercept::detect_cgroup_root() {
        Ok(root) => Some(root),
        Err(e) => {
            cannot_run(&format!("no cgroup v2: {e}"));
            None
        }
    }
}

/// A test cgroup under [`cgroup_root`], or None as it says.
pub fn test_cgroup(needs: &str) -> Option<TestCgroup> {
    Some(TestCgroup::new(&cgroup_root(needs)?).expect("create test cgroup"))
}

static SEQ: AtomicU32 = AtomicU32::new(0);

/// A unique per-process, per-call suffix: `<pid>-<n>`.
fn unique() -> String {
    format!(
        "{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    )
}

pub struct TestCgroup {
    pub path: PathBuf,
    started: Mutex<Vec<u32>>,
}

impl TestCgroup {
    /// Creates `<parent>/tunnel-test-<pid>-<n>`. `parent` is never used for anything
    /// but holding the new directory.
    pub fn new(parent: &Path) -> io::Result<Self> {
        let path = parent.join(format!("tunnel-test-{}", unique()));
        std::fs::create_dir(&path)?;
        Ok(Self {
            path,
            started: Mutex::new(Vec::new()),
        })
    }

    /// Starts `argv` inside this cgroup: a shell writes its own pid into cgroup.procs,
    /// then execs `argv`, so only that process (and what it forks) is in the cgroup.
    pub fn spawn(&self, argv: &[&str]) -> io::Result<tokio::process::Child> {
        let mut cmd = tokio::process::Command::new("sh");
        cmd.arg("-c")
            .arg(r#"echo $$ > "$0" && exec "$@""#)
            .arg(self.path.join("cgroup.procs"))
            .args(argv)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true);
        let child = cmd.spawn()?;
        if let Some(pid) = child.id() {
            self.started
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(pid);
        }
        Ok(child)
    }

    /// [`Self::spawn`] and wait, at most `limit`; stdout as text.
    pub async fn run(&self, argv: &[&str], limit: Duration) -> io::Result<String> {
        let child = self.spawn(argv)?;
        let out = tokio::time::timeout(limit, child.wait_with_output())
            .await
            .map_err(|_| {
                io::Error::new(io::ErrorKind::TimedOut, format!("{argv:?} timed out"))
            })??;
        if !out.status.success() {
            return Err(io::Error::other(format!(
                "{argv:?} failed ({}): {}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        // Stragglers: only the pids we started (the kernel lists them while alive).
        let started = self
            .started
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let procs = std::fs::read_to_string(self.path.join("cgroup.procs")).unwrap_or_default();
        for pid in procs.lines().filter_map(|l| l.trim().parse::<u32>().ok()) {
            if started.contains(&pid) {
                // SAFETY: plain kill(2) of a pid this guard started.
                unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            }
        }
        // An exiting task leaves the cgroup a moment after it is reaped: retry, bounded.
        for _ in 0..100 {
            match std::fs::remove_dir(&self.path) {
                Ok(()) => return,
                Err(e) if e.kind() == io::ErrorKind::NotFound => return,
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
        eprintln!(
            "warning: could not remove test cgroup {}",
            self.path.display()
        );
    }
}
