//! How the eBPF object is built. Shared, through `#[path]`, by `cargo xtask build-ebpf`
//! and `tunnel-user/build.rs`, so both produce the same file at the same place and
//! reuse each other's incremental state. std only: a build script cannot use xtask's deps.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The `tunnel-ebpf` directory, from the workspace root.
pub fn ebpf_dir(workspace_root: &Path) -> PathBuf {
    workspace_root.join("tunnel-ebpf")
}

/// Where the object lands for a profile (`release` or `debug`).
pub fn object_path(workspace_root: &Path, release: bool) -> PathBuf {
    let profile = if release { "release" } else { "debug" };
    ebpf_dir(workspace_root)
        .join("target/bpfel-unknown-none")
        .join(profile)
        .join("tunnel-ebpf")
}

/// `cargo build` run inside `tunnel-ebpf/`, whose rust-toolchain.toml (nightly +
/// rust-src) and .cargo/config.toml (target, build-std, bpf-linker) say how to build.
pub fn cargo_build(workspace_root: &Path, release: bool) -> Command {
    let dir = ebpf_dir(workspace_root);
    let mut cmd = Command::new("cargo");
    cmd.current_dir(&dir).arg("build");
    if release {
        cmd.arg("--release");
    }
    // Its own target dir: a shared CARGO_TARGET_DIR would mix worktrees' objects.
    cmd.arg("--target-dir").arg(dir.join("target"));
    // The outer cargo (running xtask or a build script) exports these; left in place they
    // would pick the stable toolchain over rust-toolchain.toml, or pass host flags to
    // the BPF build.
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

/// What to tell someone whose machine cannot build the object.
pub const SETUP_HINT: &str = "run scripts/setup.sh then cargo xtask build-ebpf";
