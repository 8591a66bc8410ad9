//! `tunnel`: parse arguments, set up logging, load the config, run, map the outcome to an
//! exit code (0 ok, 1 runtime failure, 2 bad configuration or usage; clap also exits 2
//! on bad arguments).

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;
use tunnel_user::cloud::Capabilities;
use tunnel_user::config::{
    AnyConfig, CloudConfig, ConfigError, EdgeConfig, RuntimeConfig, load_any,
};
use tunnel_user::ops::limits::{Holder, raise_open_files};

#[global_allocator]
// Large relay buffers must not go through mmap on every read (docs/design.md, performance
// knobs 2 and 16).
static GLOBAL: tunnel_user::heap::Mimalloc = tunnel_user::heap::Mimalloc;

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
        /// Instead of running: detach the eBPF redirect that a cloud with this config
        /// left pinned (redirect.pin_dir) and remove the pins, then exit.
        #[arg(long)]
        uninstall_redirect: bool,
        /// Once every listener serves, write `<config key> <address>` lines here (the
        /// port the kernel chose for `:0`); written whole, by rename.
        #[arg(long, value_name = "PATH")]
        ready_file: Option<PathBuf>,
    },
    /// Run on an edge node: dial out to the cloud and serve its connections.
    Edge {
        /// Config file (native or SuperEdge tunnel_edge.toml format).
        #[arg(long, short)]
        config: PathBuf,
        /// Once every listener serves, write `<config key> <address>` lines here (the
        /// port the kernel chose for `:0`); written whole, by rename.
        #[arg(long, value_name = "PATH")]
        ready_file: Option<PathBuf>,
        /// While registered with the cloud, this file exists (`tunnel registered`
        /// checks it): the readiness of this process alone, where a second edge process
        /// on the node (a rolling update's new pod) answers on the same admin port.
        #[arg(long, value_name = "PATH")]
        registered_file: Option<PathBuf>,
    },
    /// Exit 0 if the edge that keeps FILE (`tunnel edge --registered-file`) is
    /// registered with the cloud, 1 if not: the edge DaemonSet's readiness probe.
    Registered { file: PathBuf },
    /// Validate a cloud or edge config file without running it; prints what it would run.
    Check {
        /// Config file (cloud or edge, native or SuperEdge format).
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Write a CA, the cloud's server certificate, edge client certificates and tokens.
    Certs(tunnel_user::certs::CertsArgs),
    /// Mount a bpffs at DIR unless one is there (the cloud DaemonSet's init container: a
    /// host without a bpffs at /sys/fs/bpf gets one, which holds the redirect's pins).
    MountBpffs {
        /// Usually /sys/fs/bpf, the parent of `redirect.pin_dir`.
        dir: PathBuf,
    },
}

const EXIT_RUNTIME: u8 = 1;

/// `tunnel cloud --uninstall-redirect`: unpins (and so detaches) what the config's
/// redirect left attached.
fn uninstall_redirect_pins(c: &CloudConfig) -> ExitCode {
    let r = &c.redirect;
    let Some(pin_dir) = &r.pin_dir else {
        println!("redirect.pin_dir is not set: nothing is pinned, nothing to uninstall");
        return ExitCode::SUCCESS;
    };
    match tunnel_user::intercept::uninstall(pin_dir, r.cgroup.as_deref()) {
        Ok(removed) => {
            for path in &removed {
                println!("removed {}", path.display());
            }
            tracing::info!(pins = removed.len(), pin_dir = %pin_dir.display(), "eBPF redirect uninstalled");
            ExitCode::SUCCESS
        }
        Err(e) => {
            tracing::error!(error = %e, "uninstalling the eBPF redirect failed");
            ExitCode::from(EXIT_RUNTIME)
        }
    }
}
const EXIT_CONFIG: u8 = 2;

fn main() -> ExitCode {
    let cli = Cli::parse();
    tunnel_user::ops::logging::init("info");
    match cli.command {
        Command::Cloud {
            config,
            uninstall_redirect,
            ready_file,
        } => match CloudConfig::load(&config) {
            Ok(c) if uninstall_redirect => uninstall_redirect_pins(&c),
            Ok(c) => {
                tracing::info!("starting\n{}", c.summary());
                raise_open_files(Holder::Cloud);
                run(c.runtime.clone(), |stop| {
                    tunnel_user::cloud::run(c, ready_file, stop, Capabilities::DropAfterStart)
                })
            }
            Err(e) => config_error(&e),
        },
        Command::Edge {
            config,
            ready_file,
            registered_file,
        } => match EdgeConfig::load(&config, std::env::var("NODE_NAME").ok()) {
            Ok(c) => {
                tracing::info!("starting\n{}", c.summary());
                raise_open_files(Holder::Edge);
                run(c.runtime.clone(), |stop| {
                    tunnel_user::edge::run(c, ready_file, registered_file, stop)
                })
            }
            Err(e) => config_error(&e),
        },
        Command::Registered { file } => match file.exists() {
            true => ExitCode::SUCCESS,
            false => {
                eprintln!(
                    "not registered with the cloud: {} is absent",
                    file.display()
                );
                ExitCode::FAILURE
            }
        },
        Command::Check { config } => match load_any(&config, std::env::var("NODE_NAME").ok()) {
            Ok(AnyConfig::Cloud(c)) => check_ok(&config, &c.summary()),
            Ok(AnyConfig::Edge(c)) => check_ok(&config, &c.summary()),
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::from(EXIT_CONFIG)
            }
        },
        Command::MountBpffs { dir } => match tunnel_user::intercept::mount_bpffs(&dir) {
            Ok(true) => {
                tracing::info!(dir = %dir.display(), "mounted a bpffs");
                ExitCode::SUCCESS
            }
            Ok(false) => {
                tracing::info!(dir = %dir.display(), "a bpffs is mounted already");
                ExitCode::SUCCESS
            }
            Err(e) => {
                tracing::error!(dir = %dir.display(), error = %e, "cannot mount a bpffs");
                ExitCode::from(EXIT_RUNTIME)
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
    // A reader that stops early (`| head`) is no failure of the check: the exit status
    // says whether the config is valid, so a closed stdout is ignored, not a panic.
    let _ = writeln!(std::io::stdout(), "{}: ok\n{summary}", file.display());
    ExitCode::SUCCESS
}

fn config_error(e: &ConfigError) -> ExitCode {
    tracing::error!("invalid configuration: {e}");
    ExitCode::from(EXIT_CONFIG)
}

fn run<F, Fut>(runtime: RuntimeConfig, main: F) -> ExitCode
where
    F: FnOnce(CancellationToken) -> Fut,
    Fut: Future<Output = anyhow::Result<()>> + Send + 'static,
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
        // A task of its own rather than `block_on`'s future: when a task wakes that
        // future, the single-threaded scheduler first polls the driver (one more
        // `epoll_wait`) before polling it, and the edge's connection to the cloud is
        // polled inside it, woken for every message a connection sends.
        match tokio::spawn(main(stop)).await {
            Ok(result) => result,
            Err(e) => std::panic::resume_unwind(e.into_panic()),
        }
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
