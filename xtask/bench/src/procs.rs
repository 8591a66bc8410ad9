//! Processes the bench starts: killed by PID when their guard drops, on ctrl-c, and by
//! the kernel if the bench itself dies (PR_SET_PDEATHSIG). Nothing else is ever killed.

use std::io::{BufRead, BufReader, Read};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// PIDs of live children, for the ctrl-c handler.
static LIVE: Mutex<Vec<u32>> = Mutex::new(Vec::new());

fn live() -> std::sync::MutexGuard<'static, Vec<u32>> {
    LIVE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Cgroup directories the bench made and has not removed yet, for the ctrl-c handler.
static CGROUPS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

fn cgroups() -> std::sync::MutexGuard<'static, Vec<PathBuf>> {
    CGROUPS.lock().unwrap_or_else(|e| e.into_inner())
}

/// `dir`, a cgroup the bench just made, is removed on ctrl-c too.
pub fn cgroup_made(dir: &Path) {
    cgroups().push(dir.to_path_buf());
}

/// `dir` is gone: nothing left for the ctrl-c handler.
pub fn cgroup_removed(dir: &Path) {
    cgroups().retain(|d| d != dir);
}

/// Removes the empty cgroup `dir`, waiting a moment for killed processes to leave it.
pub fn remove_cgroup(dir: &Path) -> bool {
    for _ in 0..50 {
        if std::fs::remove_dir(dir).is_ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// On ctrl-c or SIGTERM: kill every child we started, by PID, remove the cgroups the
/// bench made, then exit.
pub fn install_interrupt_handler() {
    let _ = ctrlc::set_handler(|| {
        eprintln!("\ninterrupted: stopping the processes the bench started");
        // The children started without a `Proc` too: the fleet's API server and etcd
        // (the tests' harness starts them), which outlive the bench otherwise.
        let mut pids: Vec<u32> = live().drain(..).collect();
        pids.extend(own_children());
        for pid in pids {
            // SAFETY: kill(2) with a PID we spawned and have not reaped yet.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        }
        for dir in cgroups().drain(..) {
            if !remove_cgroup(&dir) {
                eprintln!("bench: WARNING: could not remove {}", dir.display());
            }
        }
        std::process::exit(130);
    });
}

/// This process's children, as the kernel lists them for each of its threads.
fn own_children() -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("children")).ok())
        .flat_map(|c| {
            c.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect()
}

/// Makes `cmd` die with the bench: the kernel sends SIGKILL when our thread exits.
pub fn die_with_parent(cmd: &mut Command) {
    // SAFETY: prctl is async-signal-safe and touches only the child being set up.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
}

/// A long-running process (server, tunnel, helper), killed when dropped.
pub struct Proc {
    pub name: String,
    child: Child,
    pub log: PathBuf,
    /// Just before the spawn: where the start-up figures start their clock.
    pub spawned_at: Instant,
    /// Lines of stdout, when captured.
    lines: Option<mpsc::Receiver<String>>,
}

impl Proc {
    /// Starts `program args` with stdout and stderr in `dir/<name>.log`.
    pub fn start(
        name: &str,
        dir: &Path,
        program: &Path,
        args: &[String],
        env: &[(&str, &str)],
    ) -> Result<Self> {
        Self::spawn(name, dir, program, args, env, false)
    }

    /// Like `start`, but stdout is read line by line (see `wait_line`).
    pub fn start_piped(
        name: &str,
        dir: &Path,
        program: &Path,
        args: &[String],
        env: &[(&str, &str)],
    ) -> Result<Self> {
        Self::spawn(name, dir, program, args, env, true)
    }

    fn spawn(
        name: &str,
        dir: &Path,
        program: &Path,
        args: &[String],
        env: &[(&str, &str)],
        piped: bool,
    ) -> Result<Self> {
        let log = dir.join(format!("{name}.log"));
        let file =
            std::fs::File::create(&log).with_context(|| format!("create {}", log.display()))?;
        let mut cmd = Command::new(program);
        cmd.args(args)
            .stdin(Stdio::null())
            .stderr(file.try_clone()?);
        cmd.stdout(if piped {
            Stdio::piped()
        } else {
            Stdio::from(file)
        });
        for (k, v) in env {
            cmd.env(k, v);
        }
        die_with_parent(&mut cmd);
        let spawned_at = Instant::now();
        let mut child = cmd
            .spawn()
            .with_context(|| format!("start {name} ({})", program.display()))?;
        live().push(child.id());
        let lines = if piped {
            let out = child.stdout.take().context("piped stdout")?;
            let (tx, rx) = mpsc::channel();
            std::thread::spawn(move || {
                for line in BufReader::new(out)
                    .lines()
                    .map_while(std::result::Result::ok)
                {
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            });
            Some(rx)
        } else {
            None
        };
        Ok(Self {
            name: name.to_string(),
            child,
            log,
            spawned_at,
            lines,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log_tail(&self) -> String {
        let mut s = String::new();
        if let Ok(mut f) = std::fs::File::open(&self.log) {
            let _ = f.read_to_string(&mut s);
        }
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }

    /// Fails if the process has exited.
    pub fn check_alive(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!(
                "{} exited ({status}); log {}:\n{}",
                self.name,
                self.log.display(),
                self.log_tail()
            );
        }
        Ok(())
    }

    /// The stdout lines come since the last read, without waiting.
    pub fn lines_now(&self) -> Vec<String> {
        self.lines
            .as_ref()
            .map(|rx| rx.try_iter().collect())
            .unwrap_or_default()
    }

    /// The next stdout line for which `pick` returns Some, within `timeout`.
    pub fn wait_line<T>(
        &mut self,
        timeout: Duration,
        mut pick: impl FnMut(&str) -> Option<T>,
    ) -> Result<T> {
        let deadline = Instant::now() + timeout;
        loop {
            let rx = self.lines.as_ref().context("stdout not captured")?;
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left.min(Duration::from_millis(200))) {
                Ok(line) => {
                    if let Some(v) = pick(&line) {
                        return Ok(v);
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    self.check_alive()?;
                    bail!("{}: stdout closed", self.name);
                }
            }
            if Instant::now() >= deadline {
                bail!(
                    "{}: expected output not seen within {timeout:?}; log:\n{}",
                    self.name,
                    self.log_tail()
                );
            }
        }
    }

    /// The newest stdout line `pick` accepts among those already printed, or else the
    /// next one printed within `timeout`.
    pub fn latest_line<T>(
        &mut self,
        timeout: Duration,
        mut pick: impl FnMut(&str) -> Option<T>,
    ) -> Result<T> {
        let mut latest = None;
        if let Some(rx) = &self.lines {
            while let Ok(line) = rx.try_recv() {
                if let Some(v) = pick(&line) {
                    latest = Some(v);
                }
            }
        }
        match latest {
            Some(v) => Ok(v),
            None => self.wait_line(timeout, pick),
        }
    }

    /// Resident memory, KiB.
    pub fn rss_kib(&self) -> Result<u64> {
        rss_kib(self.pid())
    }

    /// CPU time used so far (user + system).
    pub fn cpu_time(&self) -> Result<Duration> {
        cpu_time(self.pid())
    }

    fn kill(&mut self) {
        let pid = self.child.id();
        let _ = self.child.kill();
        let _ = self.child.wait();
        live().retain(|p| *p != pid);
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Runs a bounded command to completion: killed (by PID) after `timeout`.
pub fn run_bounded(cmd: &mut Command, timeout: Duration) -> Result<std::process::Output> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    die_with_parent(cmd);
    let mut child = cmd
        .spawn()
        .with_context(|| format!("start {:?}", cmd.get_program()))?;
    let pid = child.id();
    live().push(pid);
    // Drain the pipes on threads so a chatty child cannot block on a full pipe.
    let mut out = child.stdout.take().context("stdout")?;
    let mut err = child.stderr.take().context("stderr")?;
    let out_t = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out.read_to_end(&mut v);
        v
    });
    let err_t = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err.read_to_end(&mut v);
        v
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            live().retain(|p| *p != pid);
            bail!(
                "{:?} did not finish within {timeout:?}; killed",
                cmd.get_program()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    live().retain(|p| *p != pid);
    let stdout = out_t.join().unwrap_or_default();
    let stderr = err_t.join().unwrap_or_default();
    Ok(std::process::Output {
        status,
        stdout,
        stderr,
    })
}

pub fn rss_kib(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("read /proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("no VmRSS in /proc/{pid}/status"))
}

pub fn cpu_time(pid: u32) -> Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("read /proc/{pid}/stat"))?;
    // The command name may contain spaces; fields are counted after its closing paren.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .context("malformed stat")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line, 12 and 13 after the name.
    let ticks: u64 = fields
        .get(11)
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0)
        + fields
            .get(12)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Ok(Duration::from_micros(ticks * 1_000_000 / hz))
}

/// Raises this process's open-file limit to its hard limit (children inherit it).
pub fn raise_nofile() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid pointer to a local struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
    lim.rlim_cur
}

/// A loopback port that was free a moment ago.
pub fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// A loopback port below the ephemeral range that was free a moment ago, for servers
/// that refuse ephemeral ports for their listeners (Konnectivity's).
pub fn fixed_port() -> Result<u16> {
    let low: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768);
    let (first, last) = (10_000u16, low.saturating_sub(1));
    if last <= first {
        bail!("no ports below the ephemeral range (it starts at {low})");
    }
    // Start somewhere different each time, so runs close together do not collide.
    let span = u32::from(last - first);
    let start = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos() ^ std::process::id())
        .unwrap_or(0)
        % span;
    for i in 0..span.min(2000) {
        let port = first + ((start + i) % span) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    bail!("no free port between {first} and {last}")
}

/// `dir/name` for a unix socket, refused up front when the path is too long for one.
pub fn socket_path(dir: &Path, name: &str) -> Result<PathBuf> {
    // sun_path holds 108 bytes, the terminating NUL included.
    const SUN_PATH: usize = 108;
    let path = dir.join(name);
    if path.as_os_str().len() >= SUN_PATH {
        bail!(
            "{}: too long for a unix socket ({SUN_PATH} bytes); use a shorter checkout path",
            path.display()
        );
    }
    Ok(path)
}

/// Waits until something accepts TCP connections on `addr`.
pub fn wait_listening(addr: SocketAddr, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    bail!("nothing listening on {addr} after {timeout:?}")
}

/// GET `path` on `addr` with a plain HTTP/1.0 request; true on a 200.
pub fn http_ok(addr: SocketAddr, path: &str) -> bool {
    use std::io::Write;
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(500)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
    // The admin listener answers only a Host that names it (its address), so that a web
    // page cannot reach it by DNS rebinding.
    if write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 12];
    s.read_exact(&mut buf).is_ok() && buf.starts_with(b"HTTP/1.") && &buf[9..12] == b"200"
}

/// Sends one byte through `addr` to an echo server and waits for it to come back.
pub fn echo_ok(addr: SocketAddr) -> bool {
    echo_within(addr, Duration::from_millis(500), Duration::from_secs(2))
}

/// `echo_ok` with its own bounds on the connect and on the wait for the byte.
fn echo_within(addr: SocketAddr, connect: Duration, reply: Duration) -> bool {
    use std::io::Write;
    let Ok(mut s) = TcpStream::connect_timeout(&addr, connect) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(reply));
    let mut b = [0u8; 1];
    s.write_all(b"x").is_ok() && s.read_exact(&mut b).is_ok() && b[0] == b'x'
}

/// Time from `since` to the first byte echoed through `addr`, trying every 2 ms for up
/// to `bound`. A try that connects and then fails (a relay accepting before its far
/// side is up resets or closes it) is "not yet", as a refused connect is; each try gets
/// 200 ms, so one stuck try costs little. `alive` is checked between tries, so a
/// process that died ends the wait with its own error rather than at `bound`.
pub fn first_echo(
    addr: SocketAddr,
    since: Instant,
    bound: Duration,
    mut alive: impl FnMut() -> Result<()>,
) -> Result<Duration> {
    const PER_TRY: Duration = Duration::from_millis(200);
    const BETWEEN_TRIES: Duration = Duration::from_millis(2);
    loop {
        if echo_within(addr, PER_TRY, PER_TRY) {
            return Ok(since.elapsed());
        }
        alive()?;
        if since.elapsed() >= bound {
            bail!("no byte echoed through {addr} within {bound:?} of the start");
        }
        std::thread::sleep(BETWEEN_TRIES);
    }
}

/// Waits until `check` passes.
pub fn wait_until(what: &str, timeout: Duration, mut check: impl FnMut() -> bool) -> Result<()> {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if check() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bail!("{what}: not ready after {timeout:?}")
}

/// Waits until a socket is listening on `addr`'s port, without connecting to it (a probe
/// connection would reach the target server behind a tunnel as a bogus client).
pub fn wait_bound(addr: SocketAddr, timeout: Duration) -> Result<()> {
    let needle = format!(":{:04X} 00000000:0000 0A", addr.port());
    wait_until(&format!("listener on {addr}"), timeout, || {
        std::fs::read_to_string("/proc/net/tcp")
            .is_ok_and(|t| t.lines().any(|l| l.contains(&needle)))
    })
}
