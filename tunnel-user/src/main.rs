//! `tunnel`: parse arguments, set up logging, load the config, run, map the outcome to an
//! exit code (0 ok, 1 runtime failure, 2 bad configuration or usage; clap also exits 2
//! on bad arguments).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;
use tunnel_user::config::{
    AnyConfig, CloudConfig, ConfigError, EdgeConfig, RuntimeConfig, load_any,
};

#[global_allocator]
// Large relay buffers must not go through mmap on every read (docs/design.md, performance knob 2).
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "tunnel",
    version,
    about = "Cloud-to-edge tunnel for Kubernetes"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run on a master: accept edges and carry cloud-side connections to them.
    Cloud {
        /// Config file (native or SuperEdge tunnel_cloud.toml format).
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Run on an edge node: dial out to the cloud and serve its connections.
    Edge {
        /// Config file (native or SuperEdge tunnel_edge.toml format).
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Validate a cloud or edge config file without running it; prints what it would run.
    Check {
        /// Config file (cloud or edge, native or SuperEdge format).
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Write a CA, the cloud's server certificate, edge client certificates and tokens.
    Certs(tunnel_user::certs::CertsArgs),
}

const EXIT_RUNTIME: u8 = 1;
const EXIT_CONFIG: u8 = 2;

fn main() -> ExitCode {
    let cli = Cli::parse();
    tunnel_user::logging::init("info");
    match cli.command {
        Command::Cloud { config } => match CloudConfig::load(&config) {
            Ok(c) => {
                tracing::info!("starting\n{}", c.summary());
                run(c.runtime.clone(), |stop| tunnel_user::cloud::run(c, stop))
            }
            Err(e) => config_error(&e),
        },
        Command::Edge { config } => {
            match EdgeConfig::load(&config, std::env::var("NODE_NAME").ok()) {
                Ok(c) => {
                    tracing::info!("starting\n{}", c.summary());
                    run(c.runtime.clone(), |stop| tunnel_user::edge::run(c, stop))
                }
                Err(e) => config_error(&e),
            }
        }
        Command::Check { config } => match load_any(&config, std::env::var("NODE_NAME").ok()) {
            Ok(AnyConfig::Cloud(c)) => check_ok(&config, &c.summary()),
            Ok(AnyConfig::Edge(c)) => check_ok(&config, &c.summary()),
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::from(EXIT_CONFIG)
            }
        },
        Command::Certs(args) => match tunnel_user::certs::run(&args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                tracing::error!("{e:#}");
                ExitCode::from(EXIT_RUNTIME)
            }
        },
    }
}

fn check_ok(file: &std::path::Path, summary: &str) -> ExitCode {
    println!("{}: ok\n{summary}", file.display());
    ExitCode::SUCCESS
}

fn config_error(e: &ConfigError) -> ExitCode {
    tracing::error!("invalid configuration: {e}");
    ExitCode::from(EXIT_CONFIG)
}

fn run<F, Fut>(runtime: RuntimeConfig, main: F) -> ExitCode
where
    F: FnOnce(CancellationToken) -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    let rt = match runtime.worker_threads {
        1 => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build(),
        0 => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build(),
        n => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(n)
            .enable_all()
            .build(),
    };
    let rt = match rt {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!("cannot start the runtime: {e}");
            return ExitCode::from(EXIT_RUNTIME);
        }
    };
    let result = rt.block_on(async {
        let stop = CancellationToken::new();
        tokio::spawn(stop_on_signal(stop.clone()));
        main(stop).await
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            ExitCode::from(EXIT_RUNTIME)
        }
    }
}

async fn stop_on_signal(stop: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("cannot install signal handlers");
        return;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = int.recv() => tracing::info!("SIGINT: shutting down"),
    }
    stop.cancel();
}
