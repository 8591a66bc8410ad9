//! Finding the cgroup v2 hierarchy and naming cgroups the way the kernel does, from the
//! host or from inside a pod with its own cgroup namespace.

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

/// The cgroup to attach to: `configured` if it is a cgroup2 directory, its `unified`
/// subdirectory if that is (the host's `/sys/fs/cgroup` of a hybrid host, mounted into
/// a pod), else the detected hierarchy root when nothing is configured.
pub(crate) fn attach_cgroup(configured: Option<&Path>) -> Result<PathBuf, InterceptError> {
    let Some(path) = configured else {
        return detect_cgroup_root();
    };
    [path.to_path_buf(), path.join("unified")]
        .into_iter()
        .find(|p| is_cgroup2(p))
        .ok_or_else(|| InterceptError::NoCgroupV2 {
            path: path.to_path_buf(),
        })
}

/// Whether `path` is a directory in a cgroup2 filesystem (any cgroup, not only a root).
fn is_cgroup2(path: &Path) -> bool {
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
/// Since Linux 5.5 (64-bit kernfs inode numbers) that id is the directory's inode number
/// (the same 8 bytes `name_to_handle_at` returns as its file handle).
pub fn cgroup_id(path: &Path) -> io::Result<u64> {
    Ok(std::fs::metadata(path)?.ino())
}

/// The cgroup v2 directory of the calling process, as a path this process can open.
///
/// `/proc/self/cgroup` names it relative to the root of our cgroup namespace (`0::/`
/// inside a pod), so it must be joined to a cgroup2 mount whose root lies inside that
/// namespace: the kernel shows a mount of a cgroup outside it (the host's hierarchy
/// mounted into a pod) with a root of `/..`, and joining to that would name the wrong
/// cgroup (the host's root for a pod).
pub(crate) fn own_cgroup() -> Result<PathBuf, InterceptError> {
    let read = |file: &str| {
        std::fs::read_to_string(file).map_err(|source| InterceptError::ExemptCgroup {
            path: PathBuf::from(file),
            source,
        })
    };
    let proc_cgroup = read("/proc/self/cgroup")?;
    let mountinfo = read("/proc/self/mountinfo")?;
    let Some(own) = parse_v2_entry(&proc_cgroup) else {
        return Err(InterceptError::NoCgroupV2 {
            path: PathBuf::from("/proc/self/cgroup (no \"0::\" line)"),
        });
    };
    let mounts = cgroup2_mounts(&mountinfo);
    // The standard places first, so a pod's own /sys/fs/cgroup wins over other mounts.
    let ordered = mounts
        .iter()
        .filter(|m| CANDIDATES.iter().any(|c| Path::new(c) == m.mount_point))
        .chain(mounts.iter());
    ordered
        .filter_map(|m| m.path_of(own))
        .find(|p| p.is_dir())
        .ok_or_else(|| InterceptError::OwnCgroupHidden {
            cgroup: own.to_string(),
        })
}

/// The path in the `0::<path>` line of `/proc/<pid>/cgroup` (the v2 hierarchy).
fn parse_v2_entry(proc_cgroup: &str) -> Option<&str> {
    proc_cgroup.lines().find_map(|l| l.strip_prefix("0::"))
}

/// A cgroup2 mount: which cgroup is its root (relative to our cgroup namespace) and
/// where it is mounted.
#[derive(Debug, PartialEq)]
struct Cgroup2Mount {
    root: String,
    mount_point: PathBuf,
}

impl Cgroup2Mount {
    /// Where `cgroup` (a path relative to our cgroup namespace root) is under this
    /// mount, if the mount's root is inside the namespace and holds it.
    fn path_of(&self, cgroup: &str) -> Option<PathBuf> {
        if self.root.starts_with("/..") {
            return None;
        }
        let rest = if self.root == "/" {
            cgroup
        } else {
            // "/a" holds "/a" and "/a/b", not "/ab".
            cgroup
                .strip_prefix(self.root.as_str())
                .filter(|r| r.is_empty() || r.starts_with('/'))?
        };
        let rest = rest.trim_start_matches('/');
        Some(if rest.is_empty() {
            self.mount_point.clone()
        } else {
            self.mount_point.join(rest)
        })
    }
}

/// The cgroup2 mounts in `/proc/self/mountinfo` (fields: id, parent, dev, root, mount
/// point, options, optional fields, `-`, fs type, ...; octal escapes for spaces).
fn cgroup2_mounts(mountinfo: &str) -> Vec<Cgroup2Mount> {
    mountinfo
        .lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            if right.split(' ').next()? != "cgroup2" {
                return None;
            }
            let mut fields = left.split(' ');
            let root = unescape(fields.nth(3)?);
            let mount_point = PathBuf::from(unescape(fields.next()?));
            Some(Cgroup2Mount { root, mount_point })
        })
        .collect()
}

/// Undoes mountinfo's `\ooo` escapes of space, tab, newline and backslash.
fn unescape(field: &str) -> String {
    let mut out = String::with_capacity(field.len());
    let mut rest = field;
    while let Some(i) = rest.find('\\') {
        out.push_str(&rest[..i]);
        let code = rest
            .get(i + 1..i + 4)
            .and_then(|o| u8::from_str_radix(o, 8).ok());
        match code {
            Some(b) => {
                out.push(char::from(b));
                rest = &rest[i + 4..];
            }
            None => {
                out.push('\\');
                rest = &rest[i + 1..];
            }
        }
    }
    out.push_str(rest);
    out
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

    /// A pod with its own cgroup namespace and the host's hierarchy mounted beside its
    /// own: only the pod's own mount can name the pod's cgroup.
    #[test]
    fn a_host_hierarchy_mounted_into_a_cgroup_namespace_is_not_used_for_our_cgroup() {
        let mountinfo = "\
58 48 0:38 /.. /run/tunnel/cgroup rw,relatime - cgroup2 cgroup2 rw
66 48 0:38 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup rw,nsdelegate
70 48 0:40 / /proc rw - proc proc rw
";
        let mounts = cgroup2_mounts(mountinfo);
        assert_eq!(mounts.len(), 2);
        assert_eq!(mounts[0].path_of("/"), None);
        assert_eq!(
            mounts[1].path_of("/"),
            Some(PathBuf::from("/sys/fs/cgroup"))
        );
    }

    #[test]
    fn a_host_process_resolves_under_the_hierarchy_root() {
        let m = &cgroup2_mounts("30 20 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n")[0];
        assert_eq!(
            m.path_of("/system.slice/k3s.service"),
            Some(PathBuf::from("/sys/fs/cgroup/system.slice/k3s.service"))
        );
    }

    #[test]
    fn a_mount_of_a_subtree_holds_only_its_descendants() {
        let m = &cgroup2_mounts("30 20 0:26 /a\\040b /mnt/x rw - cgroup2 cgroup2 rw\n")[0];
        assert_eq!(m.root, "/a b");
        assert_eq!(m.path_of("/a b/c"), Some(PathBuf::from("/mnt/x/c")));
        assert_eq!(m.path_of("/other"), None);
        assert_eq!(m.path_of("/a bc"), None);
    }
}
