//! How the eBPF object is built. Shared, through `#[path]`, by `cargo xtask build-ebpf`
//! and `tunnel-user/build.rs`, so both produce the same file at the same place and
//! reuse each other's incremental state. std only: a build script cannot use xtask's deps.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The `tunnel-ebpf` directory, from the workspace root.
pub fn ebpf_dir(workspace_root: &Path) -> PathBuf {
    workspace_root.join("tunnel-ebpf")
}

/// Where the object lands.
pub fn object_path(workspace_root: &Path) -> PathBuf {
    ebpf_dir(workspace_root).join("target/bpfel-unknown-none/release/tunnel-ebpf")
}

/// `cargo build --release` run inside `tunnel-ebpf/`, whose rust-toolchain.toml
/// (nightly + rust-src) and .cargo/config.toml (target, build-std, bpf-linker) say how
/// to build. Release only: one profile, the one `tunnel` embeds, so xtask and the build
/// script never build the object twice (profiles do not share their builds).
pub fn cargo_build(workspace_root: &Path) -> Command {
    let dir = ebpf_dir(workspace_root);
    let mut cmd = Command::new("cargo");
    cmd.current_dir(&dir).args(["build", "--release"]);
    // Its own target dir: a shared CARGO_TARGET_DIR would mix worktrees' objects.
    cmd.arg("--target-dir").arg(dir.join("target"));
    for (var, _) in std::env::vars_os() {
        if var.to_str().is_some_and(from_outer_cargo) {
            cmd.env_remove(var);
        }
    }
    cmd
}

/// What the outer cargo (running xtask, or tunnel-user's build script) exports, which the
/// nested build must not see. Toolchain and flags: left in place they would pick the
/// stable toolchain over rust-toolchain.toml, or pass host flags to the BPF build. What
/// cargo sets for a build script or a `cargo run` (HOST, OUT_DIR, CARGO_PKG_*, ...):
/// aya-ebpf's build scripts watch HOST (aya-build), which a build script has and xtask
/// has not, so with it left in, every switch between the two rebuilt the object and
/// tunnel-user, which embeds it, recompiled. Without them, both callers start the same
/// build and the second finds it done.
fn from_outer_cargo(var: &str) -> bool {
    const VARS: &[&str] = &[
        "RUSTUP_TOOLCHAIN",
        "RUSTC",
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_BUILD_RUSTFLAGS",
        "CARGO_BUILD_TARGET",
        "CARGO_TARGET_DIR",
        "CARGO",
        "CARGO_MANIFEST_DIR",
        "CARGO_MANIFEST_PATH",
        "CARGO_MANIFEST_LINKS",
        "CARGO_CRATE_NAME",
        "CARGO_BIN_NAME",
        "CARGO_PRIMARY_PACKAGE",
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

/// What to tell someone whose machine cannot build the object.
pub const SETUP_HINT: &str = "run scripts/setup.sh then cargo xtask build-ebpf";
