//! The patched h2 and rustls that `[patch.crates-io]` points at: committed as
//! `patches/h2/` and `patches/rustls/`, so that a fresh clone builds with plain cargo, and
//! kept exactly the published crate plus `patches/*.diff` by `scripts/patches.sh`.
//!
//! A clone of the repository loads as a workspace with nothing run first, its h2 and
//! rustls the trees under `patches/`. The script runs on a copy of itself, the diffs, the
//! trees and the lock file: the committed trees pass the check, a tree that is not
//! exactly crate + diff fails it with the file named, `diff` writes an edit into the diff,
//! and `make` makes a tree again from a changed diff but never over changes git does not
//! hold. The crates come from cargo's cache or through cargo.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// A directory of its own under the system's temporary directory, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn empty(name: &str) -> Self {
        let root = std::env::temp_dir().join(format!("patches-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        fs::create_dir_all(&root).expect("mkdir scratch");
        Scratch(root)
    }

    /// A copy of what scripts/patches.sh reads: itself, the lock file and `patches/`.
    fn copy(name: &str) -> Self {
        let scratch = Scratch::empty(name);
        fs::create_dir_all(scratch.path("scripts")).expect("mkdir scripts");
        fs::copy(
            repo().join("scripts/patches.sh"),
            scratch.path("scripts/patches.sh"),
        )
        .expect("copy patches.sh");
        fs::copy(repo().join("Cargo.lock"), scratch.path("Cargo.lock")).expect("copy lock");
        let cp = Command::new("cp")
            .arg("-R")
            .arg(repo().join("patches"))
            .arg(scratch.path("patches"))
            .output()
            .expect("run cp");
        assert!(cp.status.success(), "cp -R patches: {}", text(&cp));
        scratch
    }

    /// Makes the copy a git repository with everything committed, as `make` requires.
    fn commit_all(&self) {
        self.git(&["init", "--quiet"]);
        // --force: h2's own .gitignore names its Cargo.lock.
        self.git(&["add", "--all", "--force"]);
        self.git(&[
            "-c",
            "user.name=test",
            "-c",
            "user.email=test@localhost",
            "commit",
            "--quiet",
            "--message",
            "trees",
        ]);
    }

    fn git(&self, args: &[&str]) {
        let git = Command::new("git")
            .args(args)
            .current_dir(&self.0)
            .output()
            .expect("run git");
        assert!(git.status.success(), "git {args:?}: {}", text(&git));
    }

    fn run(&self, args: &[&str]) -> Output {
        Command::new("sh")
            .arg(self.path("scripts/patches.sh"))
            .args(args)
            .output()
            .expect("run scripts/patches.sh")
    }

    fn path(&self, relative: &str) -> PathBuf {
        self.0.join(relative)
    }

    fn read(&self, relative: &str) -> String {
        fs::read_to_string(self.path(relative)).expect("read")
    }

    /// Replaces the one occurrence of `from` in `relative` with `to`.
    fn edit(&self, relative: &str, from: &str, to: &str) {
        let text = self.read(relative);
        assert_eq!(text.matches(from).count(), 1, "{from:?} once in {relative}");
        fs::write(self.path(relative), text.replace(from, to)).expect("write");
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn text(output: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}stderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Runs `command` with its output in files of `scratch` (cargo metadata prints megabytes,
/// more than a pipe holds while the command is waited for), killed after `bound`.
fn run_bounded(scratch: &Scratch, command: &mut Command, bound: Duration) -> Output {
    let out = scratch.path("command.stdout");
    let err = scratch.path("command.stderr");
    let mut child = command
        .stdin(Stdio::null())
        .stdout(fs::File::create(&out).expect("create stdout file"))
        .stderr(fs::File::create(&err).expect("create stderr file"))
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {command:?}: {e}"));
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if started.elapsed() > bound {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{command:?} still running after {bound:?}; stderr:\n{}",
                fs::read_to_string(&err).unwrap_or_default()
            );
        }
        thread::sleep(Duration::from_millis(50));
    };
    Output {
        status,
        stdout: fs::read(&out).expect("read stdout"),
        stderr: fs::read(&err).expect("read stderr"),
    }
}

fn head(scratch: &Scratch, dir: &Path) -> String {
    let git = run_bounded(
        scratch,
        Command::new("git")
            .args(["rev-parse", "HEAD"])
            .current_dir(dir),
        Duration::from_secs(10),
    );
    assert!(
        git.status.success(),
        "git rev-parse in {dir:?}: {}",
        text(&git)
    );
    String::from_utf8_lossy(&git.stdout).trim().to_owned()
}

/// What the repository holds at HEAD, as `git clone` gives it to a new user: changes not
/// committed are not in the clone, so a tree left out of git (ignored, or made by a
/// script) fails here.
#[test]
fn a_fresh_clone_loads_as_a_workspace_with_the_patched_crates() {
    let scratch = Scratch::empty("fresh-clone");
    let clone = scratch.path("tunnel");
    let cloned = run_bounded(
        &scratch,
        Command::new("git")
            .args(["clone", "--quiet"])
            .arg(repo())
            .arg(&clone),
        Duration::from_secs(60),
    );
    assert!(cloned.status.success(), "git clone: {}", text(&cloned));
    assert_eq!(
        head(&scratch, &clone),
        head(&scratch, &repo()),
        "the clone's HEAD"
    );

    // What cargo build, cargo install --path and rust-analyzer do first: load the
    // workspace, [patch] paths included. --locked: the committed lock file fits it. Cargo
    // fetches only what its cache lacks (nothing, after the suite's build).
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let metadata = run_bounded(
        &scratch,
        Command::new(cargo)
            .args(["metadata", "--format-version", "1", "--locked"])
            .current_dir(&clone),
        Duration::from_secs(300),
    );
    assert!(
        metadata.status.success(),
        "cargo metadata in a fresh clone: {}",
        text(&metadata)
    );
    let json = String::from_utf8_lossy(&metadata.stdout);
    for name in ["h2", "rustls"] {
        let manifest = clone.join("patches").join(name).join("Cargo.toml");
        let field = format!("\"manifest_path\":\"{}\"", manifest.display());
        assert!(
            json.contains(&field),
            "{name} does not come from {manifest:?} in the clone"
        );
    }
}

#[test]
fn the_committed_trees_pass_and_one_changed_line_fails_the_check_naming_the_file() {
    let scratch = Scratch::copy("one-line");
    let check = scratch.run(&["check"]);
    let said = text(&check);
    assert!(check.status.success(), "{said}");
    assert!(said.contains("patches/h2 is h2-"), "{said}");
    assert!(said.contains("patches/rustls is rustls-"), "{said}");

    scratch.edit(
        "patches/h2/src/lib.rs",
        "pub mod client;",
        "pub mod  client;",
    );
    let check = scratch.run(&["check"]);
    let said = text(&check);
    assert!(!check.status.success(), "{said}");
    assert!(said.contains("patches/h2/src/lib.rs differ"), "{said}");
    assert!(said.contains("patches/h2 is not h2-"), "{said}");
}

#[test]
fn diff_writes_an_edit_into_the_diff_and_back_byte_for_byte() {
    let scratch = Scratch::copy("diff");
    let buffers = "patches/rustls/src/msgs/deframer/buffers.rs";
    scratch.edit(buffers, "// Nothing to drop.", "// Nothing at all to drop.");

    let diff = scratch.run(&["diff", "rustls"]);
    assert!(diff.status.success(), "{}", text(&diff));
    let written = scratch.read("patches/rustls.diff");
    assert!(
        written.contains("+            // Nothing at all to drop."),
        "{written}"
    );
    let check = scratch.run(&["check"]);
    assert!(check.status.success(), "{}", text(&check));

    scratch.edit(buffers, "// Nothing at all to drop.", "// Nothing to drop.");
    let diff = scratch.run(&["diff", "rustls"]);
    assert!(diff.status.success(), "{}", text(&diff));
    assert_eq!(
        scratch.read("patches/rustls.diff"),
        fs::read_to_string(repo().join("patches/rustls.diff")).expect("read")
    );
}

#[test]
fn make_follows_a_changed_diff_but_never_overwrites_what_git_does_not_hold() {
    let scratch = Scratch::copy("make");
    scratch.commit_all();
    let buffers = "patches/rustls/src/msgs/deframer/buffers.rs";

    // An edit not committed is someone's work: make refuses and leaves it.
    scratch.edit(buffers, "// Nothing to drop.", "// Mine.");
    let make = scratch.run(&["make", "rustls"]);
    let said = text(&make);
    assert!(!make.status.success(), "{said}");
    assert!(said.contains(buffers), "{said}");
    assert!(said.contains("has changes git does not hold"), "{said}");
    assert!(
        scratch.read(buffers).contains("// Mine."),
        "the edit was lost"
    );
    scratch.edit(buffers, "// Mine.", "// Nothing to drop.");

    // What a new upstream version or a pulled diff asks for.
    scratch.edit(
        "patches/rustls.diff",
        "+            // Nothing to drop.",
        "+            // Nothing at all to drop.",
    );
    let make = scratch.run(&["make", "rustls"]);
    assert!(make.status.success(), "{}", text(&make));
    assert!(scratch.read(buffers).contains("// Nothing at all to drop."));
    let check = scratch.run(&["check"]);
    assert!(check.status.success(), "{}", text(&check));
}
