//! How the `tunnel` binary users run is built: static (musl), release, with the build
//! paths mapped to fixed names. Shared, through `#[path]`, by `cargo xtask image` and
//! `cargo xtask shipped-binary` (which scripts/link-order.sh runs) and by the bench,
//! which measures this binary, so all three build the same file the same way. std only;
//! both crates declare `cargo_env` at their root, which this uses.
//!
//! Why the paths are mapped: rustc writes the directory it builds in into the debug
//! information and into the bitcode that LLVM hashes to name a crate's local functions
//! (`<name>.llvm.<hash>`). `tunnel-user/link-order.txt` names those functions, so a
//! clone built in another directory matched only 90% of the file and idled at 8.8 MiB
//! instead of 5 (the bench's start-up figures; the link order: docs/design.md, knob
//! 11). Mapped, and with the embedded eBPF object
//! built the same way (ebpf_build.rs), the names are the same wherever the tree is
//! built. With the build time fixed as well (below), two clones of a commit build the
//! same file, byte for byte.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The shipped target: static musl, linked for memory by `tunnel-user/build.rs`.
pub const TARGET: &str = "x86_64-unknown-linux-musl";

/// `cargo build` of the shipped `tunnel`, run from the workspace root. The remaps go in
/// as `target.<TARGET>.rustflags`, so build scripts and proc macros (built for the
/// host) are the same builds as every other command's. A RUSTFLAGS in the environment
/// overrides them, as it overrides any configured rustflags.
pub fn cargo_build(cargo: impl AsRef<OsStr>, workspace_root: &Path) -> Command {
    let mut cmd = crate::cargo_env::cargo(cargo);
    cmd.current_dir(workspace_root).args([
        "build",
        "--release",
        "--locked",
        "-p",
        "tunnel-user",
        "--bin",
        "tunnel",
        "--target",
        TARGET,
    ]);
    cmd.arg("--config").arg(format!(
        "target.{TARGET}.rustflags={:?}",
        crate::cargo_env::path_remaps(workspace_root)
    ));
    // mimalloc's C code keeps `__TIME__`; gcc takes the time from here instead, so two
    // builds of a tree are the same to the byte (the one difference left, and as the
    // linker merges strings, a 9-byte shift through .rodata). Unless the caller set it.
    if std::env::var_os("SOURCE_DATE_EPOCH").is_none() {
        cmd.env("SOURCE_DATE_EPOCH", "0");
    }
    cmd
}

/// The directory [`cargo_build`] leaves the binary in: under CARGO_TARGET_DIR when it
/// is set (as cargo resolves it, from the current directory), else under the
/// workspace's `target`.
pub fn bin_dir(workspace_root: &Path) -> PathBuf {
    let target_dir = match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => std::path::absolute(&dir).unwrap_or_else(|_| PathBuf::from(dir)),
        None => workspace_root.join("target"),
    };
    target_dir.join(TARGET).join("release")
}
