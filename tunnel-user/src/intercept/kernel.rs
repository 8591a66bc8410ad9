//! What the redirect needs from the running kernel, checked before anything is loaded:
//! an old or trimmed kernel gets one error naming its release, the missing feature and
//! the fallback, instead of a verifier log.
//!
//! Two gates. First the release, for the needs aya's probes cannot see: its probes load
//! a sock_addr program with the `connect4` attach type only, so they cannot tell whether
//! the `getpeername` attach types exist (Linux 5.8), and cgroup bpf links (5.7) would
//! need a real attach. Then the probes ([`probe`]): the program types, map types and
//! helpers the programs use, and `SO_NETNS_COOKIE`, each asked of the kernel itself, so
//! a kernel whose release looks new enough but lacks one (a trimmed config) is caught
//! too. [`verdict`] turns the release and the probe results into the answer; it does no
//! I/O, so every branch has a unit test.

use std::io;
use std::os::fd::AsRawFd as _;

use aya::maps::MapType;
use aya::programs::ProgramType;
use aya::sys::{BpfHelper, is_helper_supported, is_map_supported, is_program_supported};

use super::InterceptError;

/// The newest need only the release tells: cgroup `getpeername` hooks (5.8). Cgroup
/// bpf links are older (5.7).
pub(super) const RELEASE_GATE: (&str, (u32, u32)) = ("the cgroup getpeername hooks", (5, 8));

/// How to ask the kernel about one need.
#[derive(Debug, Clone, Copy)]
enum Probe {
    Program(ProgramType),
    Map(MapType),
    Helper(ProgramType, BpfHelper),
    /// `getsockopt(SO_NETNS_COOKIE)`, which the loader uses to tell host clients from
    /// pods.
    NetnsCookie,
}

/// Everything the programs (tunnel-ebpf, and aya-log-ebpf inside them) and the loader
/// use, each with how the error names it.
const NEEDS: [(&str, Probe); 14] = [
    (
        "the cgroup sock_addr program type (Linux 4.17+)",
        Probe::Program(ProgramType::CgroupSockAddr),
    ),
    (
        "the sock_ops program type (Linux 4.13+)",
        Probe::Program(ProgramType::SockOps),
    ),
    ("the hash map type", Probe::Map(MapType::Hash)),
    (
        "the LRU hash map type (Linux 4.10+)",
        Probe::Map(MapType::LruHash),
    ),
    ("the array map type", Probe::Map(MapType::Array)),
    (
        "the per-CPU array map type (Linux 4.6+)",
        Probe::Map(MapType::PerCpuArray),
    ),
    (
        "the ring buffer map type (Linux 5.8+, for the programs' log records)",
        Probe::Map(MapType::RingBuf),
    ),
    (
        "bpf_get_netns_cookie in sock_addr programs (Linux 5.7+)",
        Probe::Helper(
            ProgramType::CgroupSockAddr,
            BpfHelper::BPF_FUNC_get_netns_cookie,
        ),
    ),
    (
        "bpf_get_socket_cookie in sock_addr programs",
        Probe::Helper(
            ProgramType::CgroupSockAddr,
            BpfHelper::BPF_FUNC_get_socket_cookie,
        ),
    ),
    (
        "bpf_get_current_cgroup_id in sock_addr programs",
        Probe::Helper(
            ProgramType::CgroupSockAddr,
            BpfHelper::BPF_FUNC_get_current_cgroup_id,
        ),
    ),
    (
        "bpf_ringbuf_reserve in sock_addr programs (Linux 5.8+)",
        Probe::Helper(
            ProgramType::CgroupSockAddr,
            BpfHelper::BPF_FUNC_ringbuf_reserve,
        ),
    ),
    (
        "bpf_get_socket_cookie in sock_ops programs",
        Probe::Helper(ProgramType::SockOps, BpfHelper::BPF_FUNC_get_socket_cookie),
    ),
    (
        "bpf_ringbuf_reserve in sock_ops programs (Linux 5.8+)",
        Probe::Helper(ProgramType::SockOps, BpfHelper::BPF_FUNC_ringbuf_reserve),
    ),
    ("SO_NETNS_COOKIE (Linux 5.14+)", Probe::NetnsCookie),
];

/// Whether connect4/6 can set the errno of a connect they fail (`bpf_set_retval` in
/// sock_addr programs, Linux 5.18+), so that one to an edge without a tunnel fails with
/// "host is down". Not a need: without it they redirect such a connect as before. A probe
/// that cannot answer counts as yes, and the load decides.
pub(super) fn can_refuse() -> bool {
    match is_helper_supported(ProgramType::CgroupSockAddr, BpfHelper::BPF_FUNC_set_retval) {
        Ok(supported) => supported,
        Err(error) => {
            tracing::debug!(%error, "kernel feature probe of bpf_set_retval failed");
            true
        }
    }
}

/// One need and what the kernel said: `Some(false)` = missing, `None` = the probe
/// itself failed (e.g. EPERM without privileges), which decides nothing; loading will.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Probed {
    pub(crate) what: &'static str,
    pub(crate) supported: Option<bool>,
}

/// Asks the running kernel about every need (a few trivial map creations and program
/// loads, each freed at once).
pub(super) fn probe() -> Vec<Probed> {
    NEEDS
        .iter()
        .map(|&(what, how)| {
            let answer = match how {
                Probe::Program(t) => is_program_supported(t).map_err(|e| e.to_string()),
                Probe::Map(t) => is_map_supported(t).map_err(|e| e.to_string()),
                Probe::Helper(t, h) => is_helper_supported(t, h).map_err(|e| e.to_string()),
                Probe::NetnsCookie => match netns_cookie() {
                    Ok(_) => Ok(true),
                    Err(e) if e.raw_os_error() == Some(libc::ENOPROTOOPT) => Ok(false),
                    Err(e) => Err(e.to_string()),
                },
            };
            let supported = match answer {
                Ok(supported) => Some(supported),
                Err(error) => {
                    tracing::debug!(feature = what, %error, "kernel feature probe failed");
                    None
                }
            };
            Probed { what, supported }
        })
        .collect()
}

/// Whether a kernel of `release` with the `probed` answers can run the redirect. The
/// release gate goes first: it covers needs no probe sees. An unparseable release passes
/// it (the probes and the load decide).
pub(super) fn verdict(release: &str, probed: &[Probed]) -> Result<(), InterceptError> {
    let (feature, need) = RELEASE_GATE;
    if parse_release(release).is_some_and(|have| have < need) {
        return Err(InterceptError::KernelTooOld {
            release: release.to_string(),
            feature,
            need,
        });
    }
    let missing: Vec<&str> = probed
        .iter()
        .filter(|p| p.supported == Some(false))
        .map(|p| p.what)
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(InterceptError::KernelFeature {
            release: release.to_string(),
            what: missing.join(", "),
        })
    }
}

/// The running kernel's release (`uname -r`), or "" if uname fails.
pub(super) fn release() -> String {
    // SAFETY: uname fills the zeroed struct; release is NUL-terminated by the kernel.
    let mut uts: libc::utsname = unsafe { std::mem::zeroed() };
    if unsafe { libc::uname(&mut uts) } == 0 {
        unsafe { std::ffi::CStr::from_ptr(uts.release.as_ptr()) }
            .to_string_lossy()
            .into_owned()
    } else {
        String::new()
    }
}

/// `(major, minor)` of a kernel release such as `6.8.0-45-generic` or `5.14.21`.
pub(super) fn parse_release(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// The netns cookie of this process's network namespace (`SO_NETNS_COOKIE`).
pub(super) fn netns_cookie() -> io::Result<u64> {
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    let mut cookie: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cookie`, which is that size.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_NETNS_COOKIE,
            (&raw mut cookie).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cookie)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every need answered `yes`, except the ones named, answered `no`.
    fn probed_without(missing: &[&str]) -> Vec<Probed> {
        NEEDS
            .iter()
            .map(|&(what, _)| Probed {
                what,
                supported: Some(!missing.iter().any(|m| what.contains(m))),
            })
            .collect()
    }

    fn assert_names(err: InterceptError, needles: &[&str]) {
        let text = err.to_string();
        println!("{text}");
        for needle in needles {
            assert!(text.contains(needle), "{needle:?} missing from: {text}");
        }
    }

    /// The probes against the running kernel (a few trivial loads, nothing attached): a
    /// probe answering no on a kernel that runs the redirect would stop every cloud.
    #[test]
    fn the_running_kernel_passes_its_own_probes() {
        let probed = probe();
        println!("Linux {}: {probed:?}", release());
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("SKIPPED: not root, the BPF probes cannot load programs");
            return;
        }
        for p in &probed {
            assert_eq!(p.supported, Some(true), "{}", p.what);
        }
        // And a probe can say no: XDP's helper is not offered to sock_addr programs.
        let control = is_helper_supported(
            ProgramType::CgroupSockAddr,
            BpfHelper::BPF_FUNC_xdp_adjust_head,
        );
        assert_eq!(control.ok(), Some(false), "control probe");
        verdict(&release(), &probed).expect("this kernel runs the redirect");
    }

    #[test]
    fn kernel_releases_parse_to_major_and_minor() {
        assert_eq!(parse_release("6.8.0-45-generic"), Some((6, 8)));
        assert_eq!(parse_release("5.14.21-150500.55-default"), Some((5, 14)));
        assert_eq!(parse_release("4.19"), Some((4, 19)));
        assert_eq!(parse_release("garbage"), None);
        assert!(parse_release("5.4.0").unwrap() < RELEASE_GATE.1);
        assert!(parse_release("5.8.0").unwrap() >= RELEASE_GATE.1);
    }

    #[test]
    fn a_new_kernel_with_every_feature_passes() {
        verdict("6.8.0-45-generic", &probed_without(&[])).expect("all fine");
        // Probes that could not run (no privileges) decide nothing.
        let unknown: Vec<Probed> = NEEDS
            .iter()
            .map(|&(what, _)| Probed {
                what,
                supported: None,
            })
            .collect();
        verdict("6.8.0-45-generic", &unknown).expect("unknown is not missing");
        // Nor does a release we cannot read, when the probes say yes.
        verdict("weird-kernel", &probed_without(&[])).expect("unparseable release");
    }

    #[test]
    fn an_old_release_is_refused_before_the_probes() {
        let err = verdict("5.4.0-150-generic", &probed_without(&[])).unwrap_err();
        assert!(matches!(err, InterceptError::KernelTooOld { .. }), "{err}");
        assert_names(
            err,
            &[
                "Linux 5.4.0-150-generic",
                "getpeername",
                "5.8+",
                "HTTP CONNECT",
                "egress selector",
            ],
        );
    }

    #[test]
    fn a_missing_program_type_is_named_with_kernel_and_fallback() {
        let err = verdict(
            "5.15.0-1-amd64",
            &probed_without(&["sock_ops program type"]),
        )
        .unwrap_err();
        assert!(matches!(err, InterceptError::KernelFeature { .. }), "{err}");
        assert_names(
            err,
            &[
                "Linux 5.15.0-1-amd64 lacks the sock_ops program type",
                "HTTP CONNECT",
                "egress selector",
            ],
        );
    }

    #[test]
    fn a_missing_map_type_is_named_with_kernel_and_fallback() {
        let err = verdict("6.1.0-13-cloud-amd64", &probed_without(&["LRU hash"])).unwrap_err();
        assert!(matches!(err, InterceptError::KernelFeature { .. }), "{err}");
        assert_names(
            err,
            &[
                "Linux 6.1.0-13-cloud-amd64 lacks the LRU hash map type",
                "HTTP CONNECT",
            ],
        );
    }

    #[test]
    fn every_missing_feature_is_named_in_one_error() {
        let err = verdict(
            "5.10.0-21-amd64",
            &probed_without(&["ring buffer", "bpf_ringbuf_reserve", "SO_NETNS_COOKIE"]),
        )
        .unwrap_err();
        let text = err.to_string();
        assert_names(
            err,
            &[
                "Linux 5.10.0-21-amd64",
                "the ring buffer map type (Linux 5.8+",
                "bpf_ringbuf_reserve in sock_addr programs",
                "bpf_ringbuf_reserve in sock_ops programs",
                "SO_NETNS_COOKIE (Linux 5.14+)",
                "HTTP CONNECT",
            ],
        );
        assert!(!text.contains("sock_ops program type"), "{text}");
    }
}
