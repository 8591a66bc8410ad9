//! `scripts/patches.sh`, which makes the patched h2 and rustls that `[patch.crates-io]`
//! builds from the published crates and `patches/*.diff`, run on a copy of the script,
//! the diffs and the lock file: the committed diffs apply to the crates they name, a
//! tree that is not exactly crate + diff fails the check with the file named, a tree
//! edited by hand is never overwritten, and a diff that changed under an untouched tree
//! (a git pull) makes it again. The crates come from cargo's cache (scripts/setup.sh
//! fetched them) or through cargo.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A scratch copy of what scripts/patches.sh reads, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let root = std::env::temp_dir().join(format!("patches-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        fs::create_dir_all(root.join("scripts")).expect("mkdir scripts");
        fs::create_dir_all(root.join("patches")).expect("mkdir patches");
        fs::copy(
            repo.join("scripts/patches.sh"),
            root.join("scripts/patches.sh"),
        )
        .expect("copy");
        fs::copy(repo.join("Cargo.lock"), root.join("Cargo.lock")).expect("copy Cargo.lock");
        for diff in ["h2.diff", "rustls.diff"] {
            fs::copy(
                repo.join("patches").join(diff),
                root.join("patches").join(diff),
            )
            .expect("copy diff");
        }
        Scratch(root)
    }

    fn run(&self, args: &[&str]) -> Output {
        Command::new("sh")
            .arg(self.0.join("scripts/patches.sh"))
            .args(args)
            .output()
            .expect("run scripts/patches.sh")
    }

    fn path(&self, relative: &str) -> PathBuf {
        self.0.join(relative)
    }

    /// Replaces the one occurrence of `from` in `relative` with `to`.
    fn edit(&self, relative: &str, from: &str, to: &str) {
        let file = self.path(relative);
        let text = fs::read_to_string(&file).expect("read");
        assert_eq!(text.matches(from).count(), 1, "{from:?} once in {relative}");
        fs::write(&file, text.replace(from, to)).expect("write");
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn text(output: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}stderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

fn made(scratch: &Scratch) {
    let make = scratch.run(&[]);
    assert!(make.status.success(), "{}", text(&make));
    let check = scratch.run(&["check"]);
    assert!(check.status.success(), "{}", text(&check));
    let said = text(&check);
    assert!(said.contains("patches/h2 is h2-"), "{said}");
    assert!(said.contains("patches/rustls is rustls-"), "{said}");
}

#[test]
fn a_tree_with_one_changed_line_fails_the_check_naming_the_file() {
    let scratch = Scratch::new("one-line");
    made(&scratch);
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

    // The edit is someone's work: the script refuses to make the tree again over it.
    let make = scratch.run(&[]);
    let said = text(&make);
    assert!(!make.status.success(), "{said}");
    assert!(said.contains("patches/h2 was edited by hand"), "{said}");
    let lib = fs::read_to_string(scratch.path("patches/h2/src/lib.rs")).expect("read");
    assert!(lib.contains("pub mod  client;"), "the edit was overwritten");
}

#[test]
fn a_changed_diff_makes_an_untouched_tree_again_and_diff_writes_edits_back() {
    let scratch = Scratch::new("changed-diff");
    made(&scratch);
    let buffers = "patches/rustls/src/msgs/deframer/buffers.rs";
    // What a git pull that changes the diff does.
    scratch.edit(
        "patches/rustls.diff",
        "+            // Nothing to drop.",
        "+            // Nothing at all to drop.",
    );

    let make = scratch.run(&[]);
    let said = text(&make);
    assert!(make.status.success(), "{said}");
    assert!(said.contains("made patches/rustls again"), "{said}");
    let code = fs::read_to_string(scratch.path(buffers)).expect("read");
    assert!(code.contains("// Nothing at all to drop."), "{code}");

    // An edit by hand, written back into the diff: the committed diff again, byte for byte.
    scratch.edit(buffers, "// Nothing at all to drop.", "// Nothing to drop.");
    let diff = scratch.run(&["diff", "rustls"]);
    assert!(diff.status.success(), "{}", text(&diff));
    let committed = Path::new(env!("CARGO_MANIFEST_DIR")).join("../patches/rustls.diff");
    assert_eq!(
        fs::read_to_string(scratch.path("patches/rustls.diff")).expect("read"),
        fs::read_to_string(committed).expect("read")
    );
    let check = scratch.run(&["check"]);
    assert!(check.status.success(), "{}", text(&check));
}

#[test]
fn a_tree_missing_files_is_made_again() {
    let scratch = Scratch::new("missing");
    made(&scratch);
    // What a checkout of a commit that still held the tree, then back, leaves.
    fs::remove_dir_all(scratch.path("patches/h2/src")).expect("rm src");

    let check = scratch.run(&["check"]);
    assert!(!check.status.success(), "{}", text(&check));
    let make = scratch.run(&[]);
    let said = text(&make);
    assert!(make.status.success(), "{said}");
    assert!(
        said.contains("made patches/h2 again: files were missing"),
        "{said}"
    );
    made(&scratch);
}
