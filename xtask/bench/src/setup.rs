//! What the bench needs before it can measure: the load tools (Debian packages), rathole
//! (`cargo install`), the release build of the tunnel, certificates.
//! Every step is idempotent: what is already there is left alone.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use super::procs::run_bounded;
use crate::shipped;

/// Debian packages and the command each provides.
const PACKAGES: &[(&str, &str)] = &[
    ("iperf3", "iperf3"),
    ("wrk", "wrk"),
    ("nginx", "nginx-light"),
];

/// Finds `cmd` on PATH, or in the sbin directories a non-root PATH may lack.
pub fn which(cmd: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut dirs: Vec<PathBuf> = std::env::split_paths(&path).collect();
    dirs.extend(["/usr/sbin", "/sbin", "/usr/local/sbin"].map(PathBuf::from));
    if let Some(home) = std::env::var_os("HOME") {
        dirs.push(PathBuf::from(home).join(".cargo/bin"));
    }
    dirs.into_iter().map(|d| d.join(cmd)).find(|p| p.is_file())
}

pub fn install_tools(want_rathole: bool) -> Result<()> {
    let missing: Vec<&str> = PACKAGES
        .iter()
        .filter(|(cmd, _)| which(cmd).is_none())
        .map(|(_, pkg)| *pkg)
        .collect();
    if !missing.is_empty() {
        eprintln!("bench: installing {} with apt-get", missing.join(", "));
        if which("apt-get").is_none() {
            bail!(
                "missing {}; install them (Debian packages) and run again",
                missing.join(", ")
            );
        }
        let apt = |args: &[&str]| -> Result<()> {
            let out = run_bounded(
                Command::new("apt-get")
                    .args(args)
                    .env("DEBIAN_FRONTEND", "noninteractive"),
                Duration::from_secs(600),
            )?;
            if !out.status.success() {
                bail!(
                    "apt-get {}: {}",
                    args.join(" "),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            Ok(())
        };
        apt(&["update", "-qq"])?;
        let mut args = vec!["install", "-y", "-qq", "--no-install-recommends"];
        args.extend(&missing);
        apt(&args)?;
    }
    if want_rathole && which("rathole").is_none() {
        // Not --locked: rathole's lockfile pins a `time` that no longer builds.
        eprintln!("bench: installing rathole with `cargo install rathole` (a few minutes, once)");
        let out = run_bounded(
            Command::new("cargo").args(["install", "rathole"]),
            Duration::from_secs(1200),
        )?;
        if !out.status.success() {
            // The tunnel's own figures are still worth having: go on without rathole.
            let err = String::from_utf8_lossy(&out.stderr);
            let tail: Vec<&str> = err.lines().rev().take(20).collect();
            eprintln!(
                "bench: WARNING: cargo install rathole failed; its columns will be empty:\n{}",
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
    }
    Ok(())
}

pub fn workspace_root() -> PathBuf {
    // This crate is xtask/bench; CARGO_MANIFEST_DIR is fixed at compile time.
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// Builds `tunnel` as the image ships it (xtask/src/shipped.rs): the figures are of
/// what users run. Returns the directory holding it.
pub fn build_tunnel(root: &Path) -> Result<PathBuf> {
    eprintln!(
        "bench: building tunnel (release, {}: the binary the image ships)",
        shipped::TARGET
    );
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = shipped::cargo_build(cargo, root)
        .arg("--quiet")
        .status()
        .context("run cargo build")?;
    if !status.success() {
        bail!("cargo build --release --target {} failed", shipped::TARGET);
    }
    Ok(shipped::bin_dir(root))
}

/// Certificates, the edge's token file, and the token of the simulated edges.
pub struct Pki {
    pub dir: PathBuf,
    /// The token every simulated edge registers with: each has a line of its own
    /// with it (a `default:` line is refused beside the client CA) in `tokens-sim`,
    /// which only the scale figures' cloud loads.
    pub sim_token: String,
}

pub const EDGE_NODE: &str = "bench-edge";
/// The node of the relay the fleet figures start (`--relay` of `tunnel certs`).
pub const RELAY_NODE: &str = "bench-worker";

/// `tunnel certs` into `dir`, and beside its `tokens` a `tokens-sim` that adds a line
/// for each of `sim_edges` simulated edges. Two files, since a cloud holds every line it
/// loads (about 350 bytes each): 10,000 of them would add 3.5 MiB to the idle footprint
/// of every figure but the scale ones.
pub fn certs(tunnel: &Path, dir: &Path, sim_edges: usize) -> Result<Pki> {
    let _ = std::fs::remove_dir_all(dir);
    let out = run_bounded(
        Command::new(tunnel)
            .args(["certs", "--out"])
            .arg(dir)
            .args(["--edge", EDGE_NODE, "--relay", RELAY_NODE, "--tokens"]),
        Duration::from_secs(30),
    )?;
    if !out.status.success() {
        bail!(
            "tunnel certs failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let sim_token = format!("{:032x}", rand_u128());
    let tokens = dir.join("tokens");
    let mut text = std::fs::read_to_string(&tokens).context("read tokens")?;
    for i in 0..sim_edges {
        text.push_str(&format!("{}:{sim_token}\n", crate::simedge::node_name(i)));
    }
    std::fs::write(dir.join("tokens-sim"), text)?;
    Ok(Pki {
        dir: dir.to_path_buf(),
        sim_token,
    })
}

/// rathole's TLS transport wants a PKCS#12 identity; openssl makes one from the cloud's
/// certificate and key. None (with the reason) when openssl is missing or fails.
pub fn pkcs12(pki: &Pki) -> std::result::Result<PathBuf, String> {
    let out = pki.dir.join("rathole.pfx");
    let openssl = which("openssl").ok_or("openssl not found")?;
    let r = run_bounded(
        Command::new(openssl)
            .args(["pkcs12", "-export", "-passout", "pass:bench", "-out"])
            .arg(&out)
            .arg("-inkey")
            .arg(pki.dir.join("cloud.key"))
            .arg("-in")
            .arg(pki.dir.join("cloud.crt")),
        Duration::from_secs(30),
    )
    .map_err(|e| e.to_string())?;
    if !r.status.success() {
        return Err(format!(
            "openssl pkcs12: {}",
            String::from_utf8_lossy(&r.stderr)
        ));
    }
    Ok(out)
}

fn rand_u128() -> u128 {
    use std::hash::{BuildHasher, Hasher};
    let mut v = 0u128;
    for _ in 0..2 {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0),
        );
        v = (v << 64) | h.finish() as u128;
    }
    v
}
