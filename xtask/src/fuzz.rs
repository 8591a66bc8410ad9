//! `cargo xtask fuzz`: every fuzz target (fuzz/fuzz_targets) for a bounded time with
//! `cargo +nightly fuzz`, then a line per target with the runs executed and the corpus
//! size. A crash fails the command and names the input libFuzzer saved.
//!
//! The committed corpus (fuzz/corpus/<target>) is only read: libFuzzer writes what it
//! finds to the first corpus directory it is given, so that one is a working copy
//! outside git: a temporary directory for `--smoke` (thrown away), and
//! fuzz/target/corpus/<target> for longer sessions (kept, so the next session starts
//! from what the last one found). Finds worth keeping are copied by hand (README).

use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context as _, bail};

/// Seconds per target of a smoke run: enough for every target to get well past its
/// seeds (tens of thousands of inputs) while the whole smoke stays near two minutes.
const SMOKE_SECONDS: u64 = 12;
/// Seconds per target otherwise.
const DEFAULT_SECONDS: u64 = 300;

/// `cargo xtask fuzz`'s options (cli.rs parses them).
#[derive(Default)]
pub struct FuzzArgs {
    /// CI mode: 12 s per target, a throw-away working corpus, libFuzzer's output shown
    /// only on failure.
    pub smoke: bool,
    /// Fuzz only these targets; empty: all.
    pub targets: Vec<String>,
    /// Seconds per target (default: 12 with --smoke, 300 without).
    pub seconds: Option<u64>,
    /// Build with AddressSanitizer. Off by default: the decoders are safe Rust, whose
    /// memory errors are panics libFuzzer catches anyway, and without it the build is
    /// shorter and the targets run faster. Worth a run after a change to `unsafe` code
    /// or to a C dependency.
    pub asan: bool,
}

/// What one target's run reported.
struct Outcome {
    target: String,
    runs: Option<u64>,
    corpus: Option<String>,
    seconds: f64,
}

/// `cargo +nightly fuzz ...` in fuzz/, without the environment of the outer cargo
/// (which runs xtask on stable), so rustup picks nightly, no flags leak in, and the
/// build is the same as one started from a shell (cargo_env.rs).
fn cargo_fuzz(root: &Path) -> Command {
    let mut cmd = crate::cargo_env::cargo_own_toolchain("cargo");
    cmd.current_dir(root.join("fuzz"))
        .args(["+nightly", "fuzz"]);
    cmd
}

/// Flags that must be the same for `build` and `run`, or `run` rebuilds. `--dev`: the
/// profile fuzz/Cargo.toml tunes for a short build (see there).
fn build_flags(args: &FuzzArgs) -> [&'static str; 3] {
    [
        "--dev",
        "--sanitizer",
        if args.asan { "address" } else { "none" },
    ]
}

fn all_targets(root: &Path) -> anyhow::Result<Vec<String>> {
    let out = cargo_fuzz(root)
        .arg("list")
        .output()
        .context("running cargo +nightly fuzz list (scripts/setup.sh installs cargo-fuzz)")?;
    if !out.status.success() {
        bail!(
            "cargo fuzz list failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(String::from)
        .collect())
}

pub fn fuzz(root: &Path, args: &FuzzArgs) -> anyhow::Result<()> {
    let started = Instant::now();
    let available = all_targets(root)?;
    let targets = if args.targets.is_empty() {
        available.clone()
    } else {
        args.targets.clone()
    };
    if let Some(unknown) = targets.iter().find(|t| !available.contains(t)) {
        bail!(
            "no fuzz target `{unknown}`; there are: {}",
            available.join(", ")
        );
    }
    let seconds = args.seconds.unwrap_or(if args.smoke {
        SMOKE_SECONDS
    } else {
        DEFAULT_SECONDS
    });

    eprintln!(
        "[fuzz] cargo +nightly fuzz build {} ({} targets)",
        build_flags(args).join(" "),
        available.len()
    );
    let build_started = Instant::now();
    let status = cargo_fuzz(root)
        .arg("build")
        .args(build_flags(args))
        .status()
        .context("running cargo +nightly fuzz build")?;
    if !status.success() {
        bail!("cargo fuzz build failed ({status})");
    }
    let build_secs = build_started.elapsed().as_secs_f64();
    eprintln!("[fuzz] built in {build_secs:.0} s");

    let scratch = if args.smoke {
        Some(TempDir::new("tunnel-fuzz-smoke")?)
    } else {
        None
    };
    let mut outcomes = Vec::new();
    for target in &targets {
        let work = match &scratch {
            Some(dir) => dir.path().join(target),
            None => root.join("fuzz/target/corpus").join(target),
        };
        std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
        outcomes.push(run_target(root, args, target, &work, seconds)?);
    }

    println!(
        "\n{:<14} {:>12} {:>8} {:>20}",
        "target", "runs", "seconds", "corpus (inputs/size)"
    );
    for o in &outcomes {
        let runs = o.runs.map(|r| r.to_string()).unwrap_or_else(|| "?".into());
        println!(
            "{:<14} {:>12} {:>8.0} {:>20}",
            o.target,
            runs,
            o.seconds,
            o.corpus.as_deref().unwrap_or("?")
        );
    }
    println!(
        "fuzz: {} targets without a crash; build {build_secs:.0} s, total {:.0} s",
        outcomes.len(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

fn run_target(
    root: &Path,
    args: &FuzzArgs,
    target: &str,
    work: &Path,
    seconds: u64,
) -> anyhow::Result<Outcome> {
    let committed = root.join("fuzz/corpus").join(target);
    eprintln!(
        "[fuzz] {target}: {seconds} s, working corpus {}",
        work.display()
    );
    let started = Instant::now();
    let mut child = cargo_fuzz(root)
        .arg("run")
        .args(build_flags(args))
        .arg(target)
        .arg(work)
        .arg(&committed)
        .arg("--")
        .arg(format!("-max_total_time={seconds}"))
        // One input taking this long is a hang worth failing on.
        .arg("-timeout=10")
        .arg("-rss_limit_mb=2048")
        .arg("-print_final_stats=1")
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running cargo +nightly fuzz run {target}"))?;
    // libFuzzer reports on stderr: kept for the summary, and passed on as it comes in a
    // long session (a smoke run shows it only on failure).
    let mut log = String::new();
    if let Some(stderr) = child.stderr.take() {
        for line in BufReader::new(stderr).lines() {
            let line = line.context("reading libFuzzer's output")?;
            if !args.smoke {
                eprintln!("{line}");
            }
            log.push_str(&line);
            log.push('\n');
        }
    }
    let status = child.wait().context("waiting for cargo fuzz run")?;
    let secs = started.elapsed().as_secs_f64();
    if !status.success() {
        if args.smoke {
            let tail: Vec<&str> = log.lines().rev().take(60).collect();
            for line in tail.iter().rev() {
                eprintln!("  {line}");
            }
        }
        let artifact = log
            .lines()
            .find_map(|l| {
                l.split_once("Test unit written to ")
                    .map(|(_, p)| p.trim().to_string())
            })
            .map(|p| root.join("fuzz").join(p).display().to_string())
            .unwrap_or_else(|| "(libFuzzer saved no input; see its output above)".into());
        bail!(
            "fuzz target {target} failed ({status}); input: {artifact}\n\
             reproduce: cd fuzz && cargo +nightly fuzz run {} {target} {artifact}",
            build_flags(args).join(" ")
        );
    }
    Ok(Outcome {
        target: target.to_string(),
        runs: final_runs(&log),
        corpus: last_corpus(&log),
        seconds: secs,
    })
}

/// `stat::number_of_executed_units: N` (from -print_final_stats).
fn final_runs(log: &str) -> Option<u64> {
    log.lines()
        .rev()
        .find_map(|l| l.strip_prefix("stat::number_of_executed_units:"))
        .and_then(|n| n.trim().parse().ok())
}

/// `corp: 41/2210b` of libFuzzer's last status line.
fn last_corpus(log: &str) -> Option<String> {
    log.lines().rev().find_map(|l| {
        l.split_once("corp: ")
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .map(String::from)
    })
}

/// A directory removed on drop (xtask has no tempfile dependency).
struct TempDir(PathBuf);

impl TempDir {
    fn new(prefix: &str) -> anyhow::Result<Self> {
        let path = std::env::temp_dir().join(format!("{prefix}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(Self(path))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_libfuzzer_stats() {
        let log = "#2\tINITED cov: 10 ft: 11 corp: 3/120b exec/s: 0 rss: 30Mb\n\
                   #9000\tDONE   cov: 99 ft: 140 corp: 41/2210b lim: 4096 exec/s: 600 rss: 60Mb\n\
                   Done 9000 runs in 16 second(s)\n\
                   stat::number_of_executed_units: 9000\n\
                   stat::average_exec_per_sec:     562\n";
        assert_eq!(final_runs(log), Some(9000));
        assert_eq!(last_corpus(log).as_deref(), Some("41/2210b"));
        assert_eq!(final_runs("nothing"), None);
    }
}
