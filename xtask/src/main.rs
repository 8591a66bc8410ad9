//! Developer commands: `cargo xtask <command>`.

mod ebpf_build;

use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "Developer commands for the tunnel workspace")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Build the eBPF object (tunnel-ebpf) for bpfel-unknown-none with nightly.
    BuildEbpf {
        /// Optimised, the profile `tunnel` embeds.
        #[arg(long)]
        release: bool,
    },
}

fn workspace_root() -> PathBuf {
    // xtask lives one level below the root; CARGO_MANIFEST_DIR is fixed at compile time.
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

fn build_ebpf(release: bool) -> anyhow::Result<PathBuf> {
    let root = workspace_root();
    let mut cmd = ebpf_build::cargo_build(&root, release);
    let status = cmd
        .status()
        .with_context(|| format!("running {cmd:?} ({})", ebpf_build::SETUP_HINT))?;
    if !status.success() {
        bail!(
            "building the eBPF object failed ({status}); if the toolchain is missing: {}",
            ebpf_build::SETUP_HINT
        );
    }
    Ok(ebpf_build::object_path(&root, release))
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Cmd::BuildEbpf { release } => {
            let object = build_ebpf(release)?;
            println!("{}", object.display());
        }
    }
    Ok(())
}
