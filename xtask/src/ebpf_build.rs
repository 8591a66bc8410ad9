//! How the eBPF object is built. Shared, through `#[path]`, by `cargo xtask build-ebpf`
//! and `tunnel-user/build.rs`, so both produce the same file at the same place and
//! reuse each other's incremental state. std only: a build script cannot use xtask's
//! deps. Both crates also declare `cargo_env` at their root, which this uses.

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
/// script never build the object twice (profiles do not share their builds). Started
/// the same way by both (see cargo_env.rs), so whichever runs second finds it built.
pub fn cargo_build(workspace_root: &Path) -> Command {
    let dir = ebpf_dir(workspace_root);
    let mut cmd = crate::cargo_env::cargo_own_toolchain("cargo");
    cmd.current_dir(&dir).args(["build", "--release"]);
    // Its own target dir: a shared CARGO_TARGET_DIR would mix worktrees' objects.
    cmd.arg("--target-dir").arg(dir.join("target"));
    // The BTF names each source file, and `tunnel` embeds the object: with the paths
    // mapped, the object is the same wherever the tree is built (xtask/src/shipped.rs
    // says why that matters). Joined to tunnel-ebpf/.cargo/config.toml's rustflags:
    // cargo appends arrays.
    cmd.arg("--config").arg(format!(
        "target.bpfel-unknown-none.rustflags={:?}",
        crate::cargo_env::path_remaps(workspace_root)
    ));
    cmd
}

/// What to tell someone whose machine cannot build the object.
pub const SETUP_HINT: &str = "run scripts/setup.sh then cargo xtask build-ebpf";
