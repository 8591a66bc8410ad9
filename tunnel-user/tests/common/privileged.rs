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

/// Tries to listen on `addr` as user and group `uid` (with SO_REUSEADDR and, if asked,
/// SO_REUSEPORT, as a process sharing the port would), in a forked child that then
/// exits: 0, or the errno. Needs root.
pub fn listen_as(uid: u32, addr: std::net::SocketAddr, reuse_port: bool) -> i32 {
    use nix::sys::wait::{WaitStatus, waitpid};
    use nix::unistd::ForkResult;
    let sockaddr = socket2::SockAddr::from(addr);
    let family = i32::from(sockaddr.family());
    let one: libc::c_int = 1;
    // SAFETY: the child only makes system calls (the test harness has other threads,
    // whose locks a child must not wait for) and leaves by _exit.
    match unsafe { nix::unistd::fork() }.expect("fork") {
        ForkResult::Child => unsafe {
            let errno = || *libc::__errno_location();
            let code = if libc::setgroups(0, std::ptr::null()) != 0
                || libc::setgid(uid) != 0
                || libc::setuid(uid) != 0
            {
                255
            } else {
                let fd = libc::socket(family, libc::SOCK_STREAM, 0);
                let set = |option| {
                    let size = std::mem::size_of_val(&one) as libc::socklen_t;
                    libc::setsockopt(fd, libc::SOL_SOCKET, option, (&raw const one).cast(), size)
                        == 0
                };
                let listening = fd >= 0
                    && set(libc::SO_REUSEADDR)
                    && (!reuse_port || set(libc::SO_REUSEPORT))
                    && libc::bind(fd, sockaddr.as_ptr().cast(), sockaddr.len()) == 0
                    && libc::listen(fd, 1) == 0;
                if listening { 0 } else { errno() }
            };
            libc::_exit(code)
        },
        ForkResult::Parent { child } => match waitpid(child, None).expect("waitpid") {
            WaitStatus::Exited(_, 255) => panic!("the child could not become uid {uid}"),
            WaitStatus::Exited(_, code) => code,
            other => panic!("the child ended as {other:?}"),
        },
    }
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
        self.spawn_from(argv, std::process::Stdio::null())
    }

    /// [`Self::spawn`] with a pipe for its stdin, which it reads until the test drops it.
    pub fn spawn_with_stdin(&self, argv: &[&str]) -> io::Result<tokio::process::Child> {
        self.spawn_from(argv, std::process::Stdio::piped())
    }

    fn spawn_from(
        &self,
        argv: &[&str],
        stdin: std::process::Stdio,
    ) -> io::Result<tokio::process::Child> {
        let mut cmd = tokio::process::Command::new("sh");
        cmd.arg("-c")
            .arg(r#"echo $$ > "$0" && exec "$@""#)
            .arg(self.path.join("cgroup.procs"))
            .args(argv)
            .stdin(stdin)
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
