//! Developer commands: `cargo xtask <command>`.

mod bench;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "xtask", about = "Developer commands for the tunnel workspace")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Benchmark the tunnel against a direct connection and against rathole, on loopback.
    Bench(bench::BenchArgs),
    /// The benchmark itself, run from a release build by `bench` (not for direct use).
    #[command(hide = true)]
    BenchRun(bench::BenchArgs),
    /// Servers and load generators the benchmark starts as separate processes.
    #[command(hide = true)]
    BenchHelper(bench::helper::HelperArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Bench(args) => bench::bench(&args),
        Command::BenchRun(args) => bench::run(&args),
        Command::BenchHelper(args) => bench::helper::main(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
