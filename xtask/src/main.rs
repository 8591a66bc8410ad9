//! Developer commands: `cargo xtask <command>`.

mod cargo_env;
mod cli;
mod ebpf_build;
mod fuzz;
mod image;
mod shipped;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context as _, bail};

use cli::Cmd;

fn workspace_root() -> PathBuf {
    // xtask lives one level below the root; CARGO_MANIFEST_DIR is fixed at compile time.
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

fn build_ebpf() -> anyhow::Result<PathBuf> {
    let root = workspace_root();
    let mut cmd = ebpf_build::cargo_build(&root);
    let status = cmd
        .status()
        .with_context(|| format!("running {cmd:?} ({})", ebpf_build::SETUP_HINT))?;
    if !status.success() {
        bail!(
            "building the eBPF object failed ({status}); if the toolchain is missing: {}",
            ebpf_build::SETUP_HINT
        );
    }
    Ok(ebpf_build::object_path(&root))
}

fn bench_connect(rounds: usize, connects: usize) -> anyhow::Result<()> {
    let status = cargo_env::cargo(env!("CARGO"))
        .current_dir(workspace_root())
        .args([
            "run",
            "--release",
            "-p",
            "tunnel-user",
            "--example",
            "bench_connect",
            "--",
        ])
        .args([rounds.to_string(), connects.to_string()])
        .status()
        .context("running the bench_connect example")?;
    if !status.success() {
        bail!("bench_connect failed: {status}");
    }
    Ok(())
}

/// Runs the bench crate's `command` in release, which compiles tunnel-user (in release)
/// on the first run.
fn bench(command: &str, args: &[OsString]) -> anyhow::Result<()> {
    eprintln!("xtask: running the bench in release (its first build compiles the tunnel too)");
    let status = cargo_env::cargo(env!("CARGO"))
        .current_dir(workspace_root())
        .args(["run", "--release", "-p", "xtask-bench", "--", command])
        .args(args)
        .status()
        .context("running the bench (xtask/bench)")?;
    if !status.success() {
        bail!("the bench failed: {status}");
    }
    Ok(())
}

fn soak() -> anyhow::Result<()> {
    let status = cargo_env::cargo(env!("CARGO"))
        .current_dir(workspace_root())
        .env("TUNNEL_SOAK", "1")
        .args(["test", "-p", "tunnel-user", "--test", "leaks", "--test", "faults", "--"])
        // One at a time: the load test's rate must not compete with the flapping edge.
        .args(["--nocapture", "--test-threads=1"])
        .status()
        .context("running the soak tests")?;
    if !status.success() {
        bail!("soak tests failed: {status}");
    }
    Ok(())
}

fn main() -> ExitCode {
    let cmd = match cli::parse() {
        Ok(cmd) => cmd,
        Err(e) => {
            eprintln!("error: {e}\n\nThe commands and their options: cargo xtask --help");
            return ExitCode::from(2);
        }
    };
    let result = match cmd {
        Cmd::BuildEbpf => build_ebpf().map(|object| println!("{}", object.display())),
        Cmd::BenchConnect { rounds, connects } => bench_connect(rounds, connects),
        Cmd::Bench { command, args } => bench(command, &args),
        Cmd::Fuzz(args) => fuzz::fuzz(&workspace_root(), &args),
        Cmd::Soak => soak(),
        Cmd::Image { prometheus: false } => image::image(&workspace_root()),
        Cmd::Image { prometheus: true } => image::prometheus(&workspace_root()),
        Cmd::ShippedBinary => {
            image::build_binary(&workspace_root()).map(|binary| println!("{}", binary.display()))
        }
        Cmd::Help => {
            print!("{}", cli::USAGE);
            Ok(())
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
