//! Builds the eBPF object (tunnel-ebpf) and hands its path to the crate as
//! `TUNNEL_EBPF_OBJECT`, where `intercept` embeds it with `include_bytes_aligned!`.
//!
//! Why build here rather than only locate what `cargo xtask build-ebpf` left behind:
//! `cargo build` / `cargo test` of the workspace stays one step after
//! `scripts/setup.sh`, and the embedded object can never be older than its sources
//! (cargo re-runs this script when tunnel-ebpf or tunnel-common change). The build
//! itself is the same command xtask runs (`xtask/src/ebpf_build.rs`), into the same
//! target dir, so the two share incremental state: after a first build this costs one
//! no-op nested `cargo build`.
//!
//! The nested cargo uses a target dir of its own (tunnel-ebpf/target), not ours, so it
//! never waits on the lock the outer cargo holds.

#[path = "../xtask/src/ebpf_build.rs"]
mod ebpf_build;

use std::path::Path;

fn main() {
    let manifest_dir = std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default();
    let Some(root) = Path::new(&manifest_dir).parent() else {
        panic!("CARGO_MANIFEST_DIR has no parent: cannot find the workspace root");
    };
    for input in [
        "tunnel-ebpf/src",
        "tunnel-ebpf/Cargo.toml",
        "tunnel-ebpf/Cargo.lock",
        "tunnel-ebpf/.cargo/config.toml",
        "tunnel-ebpf/rust-toolchain.toml",
        "tunnel-common/src",
        "tunnel-common/Cargo.toml",
        "xtask/src/ebpf_build.rs",
    ] {
        println!("cargo:rerun-if-changed={}", root.join(input).display());
    }

    let mut cmd = ebpf_build::cargo_build(root, true);
    let output = match cmd.output() {
        Ok(output) => output,
        Err(e) => panic!(
            "cannot run {cmd:?}: {e}\n\nThe eBPF toolchain is missing: {}",
            ebpf_build::SETUP_HINT
        ),
    };
    if !output.status.success() {
        panic!(
            "building the eBPF object (tunnel-ebpf) failed: {}\n{}\n\n\
             If nightly, rust-src or bpf-linker are missing: {}",
            output.status,
            String::from_utf8_lossy(&output.stderr),
            ebpf_build::SETUP_HINT
        );
    }
    let object = ebpf_build::object_path(root, true);
    if !object.is_file() {
        panic!(
            "the eBPF build succeeded but {} is missing: {}",
            object.display(),
            ebpf_build::SETUP_HINT
        );
    }
    // A deleted or replaced object (cargo clean in tunnel-ebpf, an xtask build) re-runs us.
    println!("cargo:rerun-if-changed={}", object.display());
    println!("cargo:rustc-env=TUNNEL_EBPF_OBJECT={}", object.display());
}
