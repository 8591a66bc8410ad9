//! What outlives one tunnel-cloud: the cgroup links (so the programs stay attached while
//! the process restarts or is replaced) and the maps the next process must see (the edge
//! targets, and the original destinations of connections redirected but not yet
//! accepted), pinned in a bpffs under `<pin_dir>/v1/cg<attach cgroup id>/`. `v1` is the
//! layout of the pinned maps: a binary with another layout uses another directory.
//!
//! The next process loads its programs against the pinned maps and swaps them into the
//! pinned links with `BPF_LINK_UPDATE`, atomically: every connect runs either the old
//! program or the new one, never none.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd};
use std::path::{Path, PathBuf};

use tunnel_common::maps;

/// Maps pinned by name; the others (config, counters, log buffer) belong to one process.
/// The IPv6 maps came later without changing the IPv4 ones: a process taking over from
/// a release without them creates and pins them (aya does when no pin exists yet).
pub(crate) const PINNED_MAPS: [&str; 6] = [
    maps::EDGES,
    maps::ORIG_BY_COOKIE,
    maps::ORIG_BY_PEER,
    maps::EDGES6,
    maps::ORIG6_BY_COOKIE,
    maps::ORIG6_BY_PEER,
];

/// `enum bpf_attach_type` values of the programs (linux/bpf.h).
pub(crate) const ATTACH_SOCK_OPS: u32 = 3;
pub(crate) const ATTACH_INET4_CONNECT: u32 = 10;
pub(crate) const ATTACH_INET6_CONNECT: u32 = 11;
pub(crate) const ATTACH_INET4_GETPEERNAME: u32 = 29;
pub(crate) const ATTACH_INET6_GETPEERNAME: u32 = 30;

const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_LINK_UPDATE: libc::c_long = 29;

/// Whether `dir` is on a bpffs.
pub fn is_bpffs(dir: &Path) -> io::Result<bool> {
    let fs = nix::sys::statfs::statfs(dir)?;
    Ok(fs.filesystem_type() == nix::sys::statfs::BPF_FS_MAGIC)
}

/// Mounts a bpffs at `dir` unless one is there; whether it mounted one. In the cloud
/// DaemonSet's init container `dir` is the host's `/sys/fs/bpf` with Bidirectional mount
/// propagation, so the mount is the host's and outlives the pod, as the pins must.
pub fn mount_bpffs(dir: &Path) -> io::Result<bool> {
    if is_bpffs(dir)? {
        return Ok(false);
    }
    // Only root may pin or read pins: they attach programs to the host's cgroups.
    nix::mount::mount(
        Some("bpffs"),
        dir,
        Some("bpf"),
        nix::mount::MsFlags::empty(),
        Some("mode=0700"),
    )?;
    Ok(true)
}

/// The pin directory of one attach cgroup.
pub(crate) fn dir(pin_dir: &Path, attach_cgroup_id: u64) -> PathBuf {
    pin_dir.join("v1").join(format!("cg{attach_cgroup_id}"))
}

pub(crate) fn map_path(dir: &Path, map: &str) -> PathBuf {
    dir.join(format!("map_{}", map.to_ascii_lowercase()))
}

fn link_path(dir: &Path, program: &str) -> PathBuf {
    dir.join(format!("link_{program}"))
}

/// Whether the cgroup links of `dir` are pinned already (a predecessor attached).
pub(crate) fn adopting(dir: &Path) -> bool {
    link_path(dir, super::PROG_CONNECT4).exists()
}

/// Attaches `prog` to `cgroup` through the link pinned for `program` in `dir`: the
/// pinned link gets `prog` in place of its current program, or a new link is created and
/// pinned.
pub(crate) fn attach(
    dir: &Path,
    program: &str,
    prog: BorrowedFd<'_>,
    cgroup: BorrowedFd<'_>,
    attach_type: u32,
) -> io::Result<()> {
    let path = link_path(dir, program);
    if path.exists() {
        let link = obj_get(&path)?;
        let mut attr = Attr::default();
        attr.put_u32(0, fd_u32(link.as_fd()));
        attr.put_u32(4, fd_u32(prog));
        bpf(BPF_LINK_UPDATE, &mut attr)?;
        return Ok(());
    }
    let mut attr = Attr::default();
    attr.put_u32(0, fd_u32(prog));
    attr.put_u32(4, fd_u32(cgroup));
    attr.put_u32(8, attach_type);
    // SAFETY: LINK_CREATE returns a new fd we own.
    let link = unsafe { OwnedFd::from_raw_fd(bpf(BPF_LINK_CREATE, &mut attr)?) };
    let c_path = c_path(&path)?;
    let mut attr = Attr::default();
    attr.put_u64(0, c_path.as_ptr() as u64);
    attr.put_u32(8, fd_u32(link.as_fd()));
    bpf(BPF_OBJ_PIN, &mut attr)?;
    Ok(())
}

/// Removes every pin under `pin_dir` for the attach cgroup: unpinning a link that no
/// process holds detaches its program. Returns what was removed.
pub(crate) fn uninstall(pin_dir: &Path, attach_cgroup_id: u64) -> io::Result<Vec<PathBuf>> {
    let dir = dir(pin_dir, attach_cgroup_id);
    let mut removed = Vec::new();
    let entries = match std::fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(removed),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let path = entry?.path();
        std::fs::remove_file(&path)?;
        removed.push(path);
    }
    std::fs::remove_dir(&dir)?;
    // The parents only if nothing else (another cgroup's pins) is in them.
    for parent in [pin_dir.join("v1"), pin_dir.to_path_buf()] {
        if std::fs::remove_dir(&parent).is_err() {
            break;
        }
    }
    Ok(removed)
}

fn obj_get(path: &Path) -> io::Result<OwnedFd> {
    let c_path = c_path(path)?;
    let mut attr = Attr::default();
    attr.put_u64(0, c_path.as_ptr() as u64);
    // SAFETY: OBJ_GET returns a new fd we own.
    Ok(unsafe { OwnedFd::from_raw_fd(bpf(BPF_OBJ_GET, &mut attr)?) })
}

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in pin path"))
}

fn fd_u32(fd: BorrowedFd<'_>) -> u32 {
    fd.as_raw_fd() as u32
}

/// `union bpf_attr` as bytes; each command reads the fields it knows, the rest zero.
#[repr(C, align(8))]
struct Attr([u8; 128]);

impl Default for Attr {
    fn default() -> Self {
        Self([0; 128])
    }
}

impl Attr {
    fn put_u32(&mut self, at: usize, v: u32) {
        self.0[at..at + 4].copy_from_slice(&v.to_ne_bytes());
    }
    fn put_u64(&mut self, at: usize, v: u64) {
        self.0[at..at + 8].copy_from_slice(&v.to_ne_bytes());
    }
}

/// The bpf(2) syscall (aya keeps its link update and raw link creation private).
fn bpf(cmd: libc::c_long, attr: &mut Attr) -> io::Result<i32> {
    // SAFETY: attr is a zero-padded bpf_attr of the size passed; the pointers in it
    // (paths) outlive the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr.0.as_mut_ptr(),
            std::mem::size_of::<Attr>(),
        )
    };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc as i32)
    }
}
