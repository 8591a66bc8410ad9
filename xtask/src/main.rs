//! Developer commands: `cargo xtask <command>`.

mod ebpf_build;
mod fuzz;
mod image;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "xtask", about = "Developer commands for the tunnel workspace")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Build the eBPF object `tunnel` embeds (tunnel-ebpf, bpfel-unknown-none, nightly).
    ///
    /// In the release profile, as tunnel-user/build.rs builds it, so a later `cargo build`
    /// finds it built.
    // `--release` was once needed for that profile; command lines that spell it still work.
    #[command(arg(clap::Arg::new("release").long("release").hide(true).num_args(0)))]
    BuildEbpf,
    /// connect() latency from a child cgroup with vs. without the intercept programs
    /// (root; runs the tunnel-user example `bench_connect`).
    BenchConnect {
        /// Interleaved rounds.
        #[arg(long, default_value_t = 10)]
        rounds: usize,
        /// connect() calls per round and side.
        #[arg(long, default_value_t = 2000)]
        connects: usize,
    },
    /// Benchmark the tunnel against a direct connection and against rathole, on loopback
    /// (the crate xtask/bench, run in release; `cargo xtask bench --help` for its options).
    #[command(disable_help_flag = true)]
    Bench(Passed),
    /// Run the fuzz targets (fuzz/) for a bounded time each; `--smoke` is CI's short run.
    Fuzz(fuzz::FuzzArgs),
    /// The long versions of the leak, load and flapping tests (`TUNNEL_SOAK=1`): 100k
    /// short connections, 1,000 new connections/s for 60 s, 1,000 edge reconnects. The
    /// test suite runs the short versions. About 15 minutes.
    Soak,
    /// The container image of `tunnel` (static musl binary, FROM scratch) as
    /// `tunnel:<version>` in the local podman/buildah store and
    /// target/image/tunnel-<version>.oci.tar. No registry is needed.
    Image,
    /// The benchmark's measurement alone, without set-up or build (xtask/bench).
    #[command(hide = true, disable_help_flag = true)]
    BenchRun(Passed),
    /// Servers and load generators the benchmark starts as separate processes (xtask/bench).
    #[command(hide = true, disable_help_flag = true)]
    BenchHelper(Passed),
}

/// The arguments of a command that xtask hands to another binary as they are, `--help`
/// included, so that binary's own parser is the only one that knows its options.
#[derive(clap::Args)]
struct Passed {
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    args: Vec<String>,
}

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
    let status = std::process::Command::new(env!("CARGO"))
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
fn bench(command: &str, passed: &Passed) -> anyhow::Result<()> {
    eprintln!("xtask: running the bench in release (its first build compiles the tunnel too)");
    let status = std::process::Command::new(env!("CARGO"))
        .current_dir(workspace_root())
        .args(["run", "--release", "-p", "xtask-bench", "--", command])
        .args(&passed.args)
        .status()
        .context("running the bench (xtask/bench)")?;
    if !status.success() {
        bail!("the bench failed: {status}");
    }
    Ok(())
}

fn soak() -> anyhow::Result<()> {
    let status = std::process::Command::new(env!("CARGO"))
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
    let result = match Cli::parse().command {
        Cmd::BuildEbpf => build_ebpf().map(|object| println!("{}", object.display())),
        Cmd::BenchConnect { rounds, connects } => bench_connect(rounds, connects),
        Cmd::Bench(passed) => bench("bench", &passed),
        Cmd::Fuzz(args) => fuzz::fuzz(&workspace_root(), &args),
        Cmd::Soak => soak(),
        Cmd::Image => image::image(&workspace_root()),
        Cmd::BenchRun(passed) => bench("bench-run", &passed),
        Cmd::BenchHelper(passed) => bench("bench-helper", &passed),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
