//! Least privilege for the process that faces the network: once the cloud serves, it
//! keeps only the capabilities its remaining work needs (docs/design.md,
//! "Capabilities"). Binding ports below 1024, loading the eBPF programs, linking them
//! to the cgroup and pinning them are done by then; what is left is bpf() on the maps
//! it holds (the node table, the outage marks, the deadline, the counters), files it
//! owns (the pins it removes at uninstall, the reloaded certificates) and sockets it
//! has (the handover passes descriptors). So a remote bug in TLS, HTTP/2 or the cloud's
//! own code lands in a process without CAP_SYS_ADMIN, CAP_NET_ADMIN or CAP_BPF.
//!
//! Capabilities belong to each thread, not to the process, and every thread of the
//! runtime (its workers, the blocking pool) runs already; one that kept them would hold
//! them for all, in one address space. So each thread drops them itself, in the handler
//! of a signal sent to it (what libcap's `psx` does for `cap_set_proc`), and
//! `/proc/self/task/*/status` is read back until every thread shows the kept set.
//! Threads started later inherit it.

use std::io;
use std::sync::atomic::{AtomicI32, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tracing::{info, warn};

/// Whether `cloud::run` drops capabilities once it serves: the `tunnel` binary does; a
/// test running the cloud inside its own process keeps the test's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capabilities {
    DropAfterStart,
    Keep,
}

const CAP_SETPCAP: u32 = 8;
const CAP_SYS_ADMIN: u32 = 21;
const CAP_BPF: u32 = 39;

/// linux/capability.h, by number.
const NAMES: [&str; 41] = [
    "CHOWN",
    "DAC_OVERRIDE",
    "DAC_READ_SEARCH",
    "FOWNER",
    "FSETID",
    "KILL",
    "SETGID",
    "SETUID",
    "SETPCAP",
    "LINUX_IMMUTABLE",
    "NET_BIND_SERVICE",
    "NET_BROADCAST",
    "NET_ADMIN",
    "NET_RAW",
    "IPC_LOCK",
    "IPC_OWNER",
    "SYS_MODULE",
    "SYS_RAWIO",
    "SYS_CHROOT",
    "SYS_PTRACE",
    "SYS_PACCT",
    "SYS_ADMIN",
    "SYS_BOOT",
    "SYS_NICE",
    "SYS_RESOURCE",
    "SYS_TIME",
    "SYS_TTY_CONFIG",
    "MKNOD",
    "LEASE",
    "AUDIT_WRITE",
    "AUDIT_CONTROL",
    "SETFCAP",
    "MAC_OVERRIDE",
    "MAC_ADMIN",
    "SYSLOG",
    "WAKE_ALARM",
    "BLOCK_SUSPEND",
    "AUDIT_READ",
    "PERFMON",
    "BPF",
    "CHECKPOINT_RESTORE",
];

const fn bit(cap: u32) -> u64 {
    1 << cap
}

/// `CAP_A, CAP_B`, or `none`.
fn names(set: u64) -> String {
    let named: Vec<String> = (0..64)
        .filter(|c| set & bit(*c) != 0)
        .map(|c| match NAMES.get(c as usize) {
            Some(name) => format!("CAP_{name}"),
            None => format!("capability {c}"),
        })
        .collect();
    if named.is_empty() {
        "none".into()
    } else {
        named.join(", ")
    }
}

/// Drops, on every thread, every capability but what the rest of the cloud's life
/// needs: with the eBPF redirect (`redirect`), CAP_BPF where this kernel asks it of
/// every bpf() call; nothing else. The bounding set loses them too (so no exec gets
/// them back), given CAP_SETPCAP, which goes last.
pub(crate) fn drop_after_start(redirect: bool) -> anyhow::Result<()> {
    let held = Sets::of_this_thread()?;
    let mut keep = 0;
    if redirect && bpf_asks_a_capability(&held) {
        keep = if held.permitted & bit(CAP_BPF) != 0 {
            bit(CAP_BPF)
        } else {
            warn!(
                "this kernel asks a capability of every bpf() call and CAP_BPF is not held: CAP_SYS_ADMIN is kept for the eBPF maps (grant CAP_BPF to drop it)"
            );
            bit(CAP_SYS_ADMIN)
        };
    }
    keep &= held.permitted;
    let mut bounding_drop = held.bounding & !keep;
    if held.effective & bit(CAP_SETPCAP) == 0 && bounding_drop != 0 {
        // Only worth saying where something is held: an unprivileged process's bounding
        // set gives it nothing without an exec of a privileged file.
        if held.permitted != 0 {
            warn!(
                bounding = %names(bounding_drop),
                "without CAP_SETPCAP the bounding set cannot shrink: these stay in it (add SETPCAP to the container's capabilities)"
            );
        }
        bounding_drop = 0;
    }
    if held.effective == keep && held.permitted == keep && bounding_drop == 0 {
        tracing::debug!(kept = %names(keep), "no capability to drop");
        return Ok(());
    }
    let want = Sets {
        effective: keep,
        permitted: keep,
        bounding: held.bounding & !bounding_drop,
    };
    on_every_thread(keep, bounding_drop, want)?;
    info!(
        kept = %names(keep),
        dropped = %names(held.permitted & !keep),
        bounding = %names(want.bounding),
        "capabilities dropped on every thread now that the listeners are bound and the eBPF programs linked"
    );
    Ok(())
}

/// A thread's effective, permitted and bounding sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Sets {
    effective: u64,
    permitted: u64,
    bounding: u64,
}

impl Sets {
    fn of_this_thread() -> io::Result<Self> {
        let tid = nix::unistd::gettid().as_raw();
        Self::of_thread(tid)?.ok_or_else(|| io::Error::other("no status of this thread"))
    }

    /// From `/proc/self/task/<tid>/status`; None if the thread is gone.
    fn of_thread(tid: i32) -> io::Result<Option<Self>> {
        match std::fs::read_to_string(format!("/proc/self/task/{tid}/status")) {
            Ok(text) => parse_status(&text).map(Some),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }
}

fn parse_status(text: &str) -> io::Result<Sets> {
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
            .ok_or_else(|| io::Error::other(format!("no {name} in a thread's status")))
    };
    Ok(Sets {
        effective: field("CapEff:")?,
        permitted: field("CapPrm:")?,
        bounding: field("CapBnd:")?,
    })
}

/// Whether this kernel refuses bpf() on a descriptor the process holds without CAP_BPF
/// (or CAP_SYS_ADMIN): before Linux 6.5 every command checks it while
/// `kernel.unprivileged_bpf_disabled` is set; since, only creating maps and loading
/// programs do. Asked of the kernel: this thread lowers its effective set, makes a
/// lookup in no map (fd -1: EBADF where no capability is asked, EPERM where one is) and
/// raises it again.
fn bpf_asks_a_capability(held: &Sets) -> bool {
    let without = held.effective & !(bit(CAP_BPF) | bit(CAP_SYS_ADMIN));
    if capset(without, held.permitted) != 0 {
        return true;
    }
    const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
    // `union bpf_attr` for a lookup: map_fd (-1), then key and value pointers (null).
    let mut attr = [0u64; 4];
    attr[0] = u64::from(u32::MAX);
    // SAFETY: attr is a zeroed bpf_attr of the size passed; the kernel reads map_fd and
    // fails before it looks at the pointers.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_MAP_LOOKUP_ELEM,
            attr.as_mut_ptr(),
            std::mem::size_of_val(&attr),
        )
    };
    let errno = io::Error::last_os_error().raw_os_error();
    if capset(held.effective, held.permitted) != 0 {
        warn!("cannot raise the effective capabilities again after the bpf() probe");
    }
    !(rc < 0 && errno == Some(libc::EBADF))
}

/// `capset(2)` of this thread: `effective` and `permitted`, nothing inheritable. 0 or
/// the errno; async-signal-safe.
fn capset(effective: u64, permitted: u64) -> i32 {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const VERSION_3: u32 = 0x2008_0522;
    let mut header = Header {
        version: VERSION_3,
        pid: 0,
    };
    let half = |set: u64, high: bool| (if high { set >> 32 } else { set }) as u32;
    let data = [false, true].map(|high| Data {
        effective: half(effective, high),
        permitted: half(permitted, high),
        inheritable: 0,
    });
    // SAFETY: a version-3 header and the two data words it asks for.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) };
    if rc == 0 { 0 } else { errno() }
}

fn errno() -> i32 {
    // SAFETY: this thread's errno.
    unsafe { *libc::__errno_location() }
}

/// What this thread keeps: the bounding set loses `bounding_drop` (while CAP_SETPCAP is
/// still effective), the ambient set empties, then effective and permitted become
/// `keep`. 0 or the errno; async-signal-safe.
fn apply(keep: u64, bounding_drop: u64) -> i32 {
    for cap in (0..64).filter(|c| bounding_drop & bit(*c) != 0) {
        // SAFETY: prctl with integer arguments only.
        if unsafe { libc::prctl(libc::PR_CAPBSET_DROP, libc::c_ulong::from(cap), 0, 0, 0) } != 0 {
            return errno();
        }
    }
    // SAFETY: as above. EINVAL: a kernel without ambient capabilities has none to clear.
    let rc = unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
            0,
            0,
            0,
        )
    };
    if rc != 0 && errno() != libc::EINVAL {
        return errno();
    }
    capset(keep, keep)
}

/// What the signal handler applies, set before any signal is sent.
static KEEP: AtomicU64 = AtomicU64::new(0);
static BOUNDING_DROP: AtomicU64 = AtomicU64::new(0);
/// Handlers run in this round, and the first errno one met.
static APPLIED: AtomicUsize = AtomicUsize::new(0);
static FAILED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(_: libc::c_int) {
    // The interrupted code may be about to read errno.
    let saved = errno();
    let failed = apply(
        KEEP.load(Ordering::Acquire),
        BOUNDING_DROP.load(Ordering::Acquire),
    );
    if failed != 0 {
        let _ = FAILED.compare_exchange(0, failed, Ordering::AcqRel, Ordering::Acquire);
    }
    // SAFETY: this thread's errno, put back.
    unsafe { *libc::__errno_location() = saved };
    APPLIED.fetch_add(1, Ordering::AcqRel);
}

/// How long one round waits for the threads signalled to run the handler, and how many
/// rounds (a thread started meanwhile by one that had not dropped yet needs another).
const ROUND: Duration = Duration::from_secs(1);
const ROUNDS: usize = 5;

/// Applies `keep` and `bounding_drop` on every thread of the process, and checks that
/// each shows `want`.
fn on_every_thread(keep: u64, bounding_drop: u64, want: Sets) -> anyhow::Result<()> {
    // A real-time signal nothing else in the process uses (tokio's are SIGTERM and
    // SIGINT; the C library keeps the first two or three real-time signals).
    let signal = libc::SIGRTMIN() + 6;
    KEEP.store(keep, Ordering::Release);
    BOUNDING_DROP.store(bounding_drop, Ordering::Release);
    FAILED.store(0, Ordering::Release);
    // SAFETY: a zeroed sigaction with our handler; the old one is put back below.
    let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
    action.sa_sigaction = on_signal as *const () as usize;
    action.sa_flags = libc::SA_RESTART;
    let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointers to sigaction structs.
    if unsafe { libc::sigaction(signal, &action, &mut old) } != 0 {
        return Err(anyhow::Error::from(io::Error::last_os_error())
            .context("cannot install the handler that drops capabilities"));
    }
    let result = rounds(signal, keep, bounding_drop, want);
    // Every handler ran on success, so no signal is pending; after a failure one may
    // be, and the default action of a real-time signal ends the process.
    let after = if result.is_ok() {
        old
    } else {
        let mut ignore: libc::sigaction = unsafe { std::mem::zeroed() };
        ignore.sa_sigaction = libc::SIG_IGN;
        ignore
    };
    // SAFETY: as above.
    unsafe { libc::sigaction(signal, &after, std::ptr::null_mut()) };
    result
}

fn rounds(signal: libc::c_int, keep: u64, bounding_drop: u64, want: Sets) -> anyhow::Result<()> {
    let me = nix::unistd::gettid().as_raw();
    let pid = std::process::id() as libc::pid_t;
    for _ in 0..ROUNDS {
        let behind = threads_behind(want)?;
        if behind.is_empty() {
            return Ok(());
        }
        APPLIED.store(0, Ordering::Release);
        let mut signalled = 0;
        for tid in behind {
            if tid == me {
                let failed = apply(keep, bounding_drop);
                if failed != 0 {
                    FAILED.store(failed, Ordering::Release);
                }
                continue;
            }
            // SAFETY: tgkill of a thread of this process; ESRCH if it exited meanwhile.
            if unsafe { libc::syscall(libc::SYS_tgkill, pid, tid, signal) } == 0 {
                signalled += 1;
            }
        }
        let deadline = Instant::now() + ROUND;
        while APPLIED.load(Ordering::Acquire) < signalled && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        let failed = FAILED.load(Ordering::Acquire);
        if failed != 0 {
            return Err(anyhow::Error::from(io::Error::from_raw_os_error(failed))
                .context("cannot drop capabilities"));
        }
    }
    let behind = threads_behind(want)?;
    anyhow::ensure!(
        behind.is_empty(),
        "threads {behind:?} still hold capabilities after {ROUNDS} rounds of dropping them"
    );
    Ok(())
}

/// The threads of this process whose sets are not `want` yet.
fn threads_behind(want: Sets) -> io::Result<Vec<i32>> {
    let mut behind = Vec::new();
    for entry in std::fs::read_dir("/proc/self/task")? {
        let Some(tid) = entry?.file_name().to_str().and_then(|t| t.parse().ok()) else {
            continue;
        };
        if Sets::of_thread(tid)?.is_some_and(|sets| sets != want) {
            behind.push(tid);
        }
    }
    Ok(behind)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_threads_sets_and_names_them() {
        // What the cloud holds in deploy/'s container before it drops them.
        let status = "Name:\ttunnel\nCapInh:\t0000000000000000\nCapPrm:\t0000008000201400\nCapEff:\t0000008000201400\nCapBnd:\t0000008000201500\nCapAmb:\t0000000000000000\n";
        let sets = parse_status(status).expect("sets");
        assert_eq!(sets.effective, sets.permitted);
        assert_eq!(
            names(sets.effective),
            "CAP_NET_BIND_SERVICE, CAP_NET_ADMIN, CAP_SYS_ADMIN, CAP_BPF"
        );
        assert_eq!(names(sets.bounding & !sets.effective), "CAP_SETPCAP");
        assert_eq!(names(0), "none");
        assert!(parse_status("Name:\tx\n").is_err());
    }
}
