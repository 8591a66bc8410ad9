//! Finding the cgroup v2 hierarchy and naming cgroups the way the kernel does.

use std::io;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};

use super::InterceptError;

/// Where cgroup v2 lives: `/sys/fs/cgroup` on pure-v2 hosts (most current
/// distributions and Kubernetes nodes), `/sys/fs/cgroup/unified` on hybrid hosts.
const CANDIDATES: [&str; 2] = ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"];

/// `statfs.f_type` of a cgroup2 mount.
const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;

/// The mount point of the cgroup v2 hierarchy: `/sys/fs/cgroup` if it is cgroup2,
/// else `/sys/fs/cgroup/unified`.
pub fn detect_cgroup_root() -> Result<PathBuf, InterceptError> {
    CANDIDATES
        .iter()
        .map(PathBuf::from)
        .find(|p| is_cgroup2(p))
        .ok_or_else(|| InterceptError::NoCgroupV2 {
            path: PathBuf::from(CANDIDATES.join(" or ")),
        })
}

/// Whether `path` is a directory in a cgroup2 filesystem (any cgroup, not only a root).
pub fn is_cgroup2(path: &Path) -> bool {
    let Ok(c_path) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    // SAFETY: statfs writes only into the zeroed struct we pass; c_path is NUL-terminated.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::statfs(c_path.as_ptr(), &mut st) };
    // f_type's integer type differs between libc targets; widen before comparing.
    let fs_type = st.f_type as i64;
    rc == 0 && fs_type == CGROUP2_SUPER_MAGIC
}

/// The kernel's id of a cgroup v2 directory, as `bpf_get_current_cgroup_id()` returns it.
/// Since Linux 5.5 (64-bit kernfs inode numbers) that id is the directory's inode number.
pub fn cgroup_id(path: &Path) -> io::Result<u64> {
    Ok(std::fs::metadata(path)?.ino())
}

/// The cgroup v2 directory of the calling process, under the hierarchy mounted at `root`.
pub fn own_cgroup(root: &Path) -> io::Result<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/cgroup")?;
    parse_v2_entry(&text)
        .map(|rel| root.join(rel.trim_start_matches('/')))
        .ok_or_else(|| io::Error::other("no cgroup v2 (\"0::\") line in /proc/self/cgroup"))
}

/// The path in the `0::<path>` line of `/proc/<pid>/cgroup` (the v2 hierarchy).
fn parse_v2_entry(proc_cgroup: &str) -> Option<&str> {
    proc_cgroup.lines().find_map(|l| l.strip_prefix("0::"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_v2_line_of_a_hybrid_host() {
        let text = "9:name=systemd:/\n4:memory:/x/y\n0::/kubepods/pod1/ctr\n";
        assert_eq!(parse_v2_entry(text), Some("/kubepods/pod1/ctr"));
    }

    #[test]
    fn no_v2_line_on_a_pure_v1_host() {
        assert_eq!(parse_v2_entry("4:memory:/x\n1:cpu:/\n"), None);
    }
}
