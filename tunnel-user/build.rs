//! Builds the eBPF object (tunnel-ebpf) and hands the crate a copy of it in OUT_DIR as
//! `TUNNEL_EBPF_OBJECT`, where `intercept` embeds it with `include_bytes_aligned!`.
//!
//! Why build here rather than only locate what `cargo xtask build-ebpf` left behind:
//! `cargo build` / `cargo test` of the workspace stays one step after
//! `scripts/setup.sh`, and the embedded object can never be older than its sources
//! (cargo re-runs this script when tunnel-ebpf or tunnel-common change). The build
//! itself is the same command xtask runs (`xtask/src/ebpf_build.rs`), into the same
//! target dir, so the two share incremental state: whichever runs second finds the
//! object built.
//!
//! The nested cargo uses a target dir of its own (tunnel-ebpf/target), not ours, so it
//! never waits on the lock the outer cargo holds.
//!
//! Why a copy: the script must not watch the object it builds. A file written while the
//! script runs is newer than the run, so cargo would take it for changed, re-run the
//! script and recompile this crate on the next build. The copy is ours alone: a
//! `cargo clean` or an xtask build in tunnel-ebpf cannot take it away from under us.

#[path = "../xtask/src/cargo_env.rs"]
mod cargo_env;
#[path = "../xtask/src/ebpf_build.rs"]
mod ebpf_build;

use std::path::Path;

fn main() {
    link_for_memory();
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
        "xtask/src/cargo_env.rs",
    ] {
        println!("cargo:rerun-if-changed={}", root.join(input).display());
    }

    let mut cmd = ebpf_build::cargo_build(root);
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
    let object = ebpf_build::object_path(root);
    if !object.is_file() {
        panic!(
            "the eBPF build succeeded but {} is missing: {}",
            object.display(),
            ebpf_build::SETUP_HINT
        );
    }
    let out_dir = std::env::var_os("OUT_DIR").unwrap_or_default();
    let embedded = Path::new(&out_dir).join("tunnel-ebpf.o");
    if let Err(e) = std::fs::copy(&object, &embedded) {
        panic!(
            "cannot copy {} to {}: {e}",
            object.display(),
            embedded.display()
        );
    }
    println!("cargo:rustc-env=TUNNEL_EBPF_OBJECT={}", embedded.display());
}

/// How the shipped binary (static-pie musl) is linked, for memory; only for musl: a
/// glibc build links as rustc chooses.
///
/// - Packed relative relocations (RELR): at start the binary relocates itself from its
///   own relocation table, 0.9 MiB of 24-byte RELA entries that stay resident for the
///   process's life; packed, 11 KiB (musl reads RELR since 1.2.4). A glibc build with
///   RELR would need glibc 2.36 wherever it runs.
/// - The functions start-up, a proxied connection and an idle process run, placed
///   together (`link-order.txt`, `scripts/link-order.sh` makes it): a page fault on code
///   maps 64 KiB, and start-up reaches code spread over most of the file, so an idle
///   process had 9 of its 13 MiB of code resident. This needs lld (rustup ships it, as `gcc-ld/ld.lld`); a symbol
///   the file names that the build lacks is skipped, so a stale file costs memory, not
///   correctness.
fn link_for_memory() {
    let env = std::env::var("CARGO_CFG_TARGET_ENV").unwrap_or_default();
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if os != "linux" || env != "musl" {
        return;
    }
    println!("cargo:rustc-link-arg-bin=tunnel=-Wl,-z,pack-relative-relocs");
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let host = std::env::var("HOST").unwrap_or_default();
    let sysroot = std::process::Command::new(&rustc)
        .args(["--print", "sysroot"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    let Some(sysroot) = sysroot else {
        println!(
            "cargo:warning=cannot ask {rustc} for its sysroot: linking without link-order.txt"
        );
        return;
    };
    let gcc_ld = Path::new(&sysroot).join(format!("lib/rustlib/{host}/bin/gcc-ld"));
    if !gcc_ld.join("ld.lld").is_file() {
        println!(
            "cargo:warning=no {}/ld.lld: linking without link-order.txt",
            gcc_ld.display()
        );
        return;
    }
    let manifest_dir = std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default();
    let order = Path::new(&manifest_dir).join("link-order.txt");
    println!("cargo:rerun-if-changed={}", order.display());
    for arg in [
        "-fuse-ld=lld".to_string(),
        format!("-B{}", gcc_ld.display()),
        format!("-Wl,--symbol-ordering-file={}", order.display()),
        "-Wl,--no-warn-symbol-ordering".to_string(),
    ] {
        println!("cargo:rustc-link-arg-bin=tunnel={arg}");
    }
}
