//! How xtask, the bench and tunnel-user/build.rs start cargo: without the environment
//! the outer cargo set for them, so the build is the one a shell would start.
//!
//! Why: cargo compares a build script's `rerun-if-env-changed` variables with its own
//! environment, not with what it hands the script. ring's build script watches
//! CARGO_PKG_NAME, CARGO_MANIFEST_DIR, OUT_DIR, DEBUG, ...; aya-build (below aya-ebpf)
//! watches HOST. cargo sets those for the process it runs (a build script, or xtask
//! under `cargo run`), so a cargo started from there and one started from a shell, or
//! from another `cargo run` binary, see different values: each time they take turns,
//! ring and everything above it (rustls, kube, tunnel-user) is rebuilt, or the eBPF
//! object and tunnel-user, which embeds it.
//!
//! std only, and shared through `#[path]`: a build script cannot use xtask's deps.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;

/// `program` (a cargo) without what cargo sets for a build script or a `cargo run`.
pub fn cargo(program: impl AsRef<OsStr>) -> Command {
    let mut cmd = Command::new(program);
    for (var, _) in std::env::vars_os() {
        if var.to_str().is_some_and(set_by_cargo) {
            cmd.env_remove(var);
        }
    }
    cmd
}

/// As [`cargo`], for a build with a toolchain and flags of its own (tunnel-ebpf, fuzz/):
/// also without the toolchain and flags of the outer build, which would pick the stable
/// toolchain over rust-toolchain.toml or `+nightly`, or pass host flags on.
pub fn cargo_own_toolchain(program: impl AsRef<OsStr>) -> Command {
    let mut cmd = cargo(program);
    for var in [
        "RUSTUP_TOOLCHAIN",
        "RUSTC",
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_BUILD_RUSTFLAGS",
        "CARGO_BUILD_TARGET",
        "CARGO_TARGET_DIR",
    ] {
        cmd.env_remove(var);
    }
    cmd
}

/// rustc flags that write the workspace, cargo's and rustup's directories under fixed
/// names into what is compiled (debug information, panic locations, BTF), so that a
/// build is the same wherever the tree, CARGO_HOME and RUSTUP_HOME are. For the shipped
/// binary (shipped.rs) and the eBPF object it embeds (ebpf_build.rs). rustc applies the
/// last prefix that matches, so the homes, which may lie inside the tree, come after it.
pub fn path_remaps(workspace_root: &Path) -> Vec<String> {
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default();
    let dir_or = |var: &str, default: &str| {
        std::env::var_os(var)
            .map(PathBuf::from)
            .unwrap_or_else(|| home.join(default))
    };
    [
        (workspace_root.to_path_buf(), "/tunnel"),
        (dir_or("CARGO_HOME", ".cargo"), "/cargo"),
        (dir_or("RUSTUP_HOME", ".rustup"), "/rustup"),
    ]
    .into_iter()
    .map(|(from, to)| format!("--remap-path-prefix={}={to}", from.display()))
    .collect()
}

/// What cargo sets for a build script or the binary of a `cargo run` (the Cargo book,
/// "Environment variables Cargo sets"), which a shell does not have.
fn set_by_cargo(var: &str) -> bool {
    const VARS: &[&str] = &[
        "CARGO",
        "CARGO_MANIFEST_DIR",
        "CARGO_MANIFEST_PATH",
        "CARGO_MANIFEST_LINKS",
        "CARGO_CRATE_NAME",
        "CARGO_BIN_NAME",
        "CARGO_PRIMARY_PACKAGE",
        "CARGO_TARGET_TMPDIR",
        "CARGO_RUSTC_CURRENT_DIR",
        "OUT_DIR",
        "TARGET",
        "HOST",
        "NUM_JOBS",
        "OPT_LEVEL",
        "DEBUG",
        "PROFILE",
        "RUSTDOC",
        "RUSTC_LINKER",
    ];
    const PREFIXES: &[&str] = &["CARGO_PKG_", "CARGO_CFG_", "CARGO_FEATURE_", "DEP_"];
    VARS.contains(&var) || PREFIXES.iter().any(|prefix| var.starts_with(prefix))
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    #[test]
    fn remaps_map_the_tree_first_and_the_homes_after_it() {
        let remaps = super::path_remaps(Path::new("/src/tunnel"));
        assert_eq!(remaps.len(), 3, "{remaps:?}");
        assert_eq!(remaps[0], "--remap-path-prefix=/src/tunnel=/tunnel");
        assert!(remaps[1].ends_with("=/cargo"), "{remaps:?}");
        assert!(remaps[2].ends_with("=/rustup"), "{remaps:?}");
    }
}
