//! The fuzz checks on stable, without cargo-fuzz: every committed corpus file of every
//! target, then a few thousand seeded pseudo-random inputs per target (random bytes and
//! mutations of the corpus files), through the same checks the fuzz targets run.
//! Deterministic: a failure names the input and writes it to a file, ready to be
//! committed as a regression seed under `fuzz/corpus/<target>/`.

use std::path::{Path, PathBuf};

use fuzz_checks::TARGETS;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn corpus_dir(target: &str) -> PathBuf {
    root().join("fuzz/corpus").join(target)
}

fn check_fn(target: &str) -> fn(&[u8]) {
    TARGETS
        .iter()
        .find(|(name, _)| *name == target)
        .map(|(_, f)| *f)
        .unwrap_or_else(|| panic!("no target {target}"))
}

fn corpus(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = corpus_dir(target);
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| {
            let path = entry.expect("directory entry").path();
            let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            (
                path.file_name()
                    .expect("file name")
                    .to_string_lossy()
                    .into_owned(),
                bytes,
            )
        })
        .collect();
    files.sort();
    files
}

/// Runs one input; on a panic, saves it and fails naming the file.
fn run(target: &str, what: &str, input: &[u8]) {
    let check = check_fn(target);
    if std::panic::catch_unwind(|| check(input)).is_err() {
        let saved = std::env::temp_dir().join(format!(
            "fuzz-{target}-{}.bin",
            what.replace(['/', ' '], "_")
        ));
        let _ = std::fs::write(&saved, input);
        panic!(
            "target {target}: {what} failed; the input is in {} (copy it to fuzz/corpus/{target}/ once fixed)",
            saved.display()
        );
    }
}

/// splitmix64: small, seeded, good enough to pick bytes.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// A few byte-level mutations of `base`, as a fuzzer's first steps would make.
fn mutate(rng: &mut Rng, base: &[u8], other: &[u8]) -> Vec<u8> {
    let mut v = base.to_vec();
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(v.len() + 1);
        let last = v.len().saturating_sub(1);
        match rng.below(7) {
            0 if !v.is_empty() => v[at.min(last)] ^= 1 << rng.below(8),
            1 if !v.is_empty() => v[at.min(last)] = rng.next() as u8,
            2 => v.insert(at, rng.next() as u8),
            3 if at < v.len() => drop(v.remove(at)),
            4 => v.truncate(at),
            5 => {
                // Splice in a piece of another corpus file.
                let from = rng.below(other.len() + 1);
                let to = from + rng.below(other.len() - from + 1);
                v.splice(at..at, other[from..to].iter().copied());
            }
            _ => {
                // Interesting values where length prefixes and ports live.
                let value: [u8; 4] = [
                    [0, 0, 0, 0],
                    [0xff; 4],
                    [0, 1, 0, 1],
                    [0, 0, 0x10, 0x01],
                    [0x7f, 0xff, 0xff, 0xff],
                ][rng.below(5)];
                let n = rng.below(4) + 1;
                v.splice(at..at, value[..n].iter().copied());
            }
        }
    }
    v
}

/// Inputs per target beyond the corpus: random ones, then mutations.
const RANDOM: usize = 1000;
const MUTATED: usize = 2000;

fn replay_and_explore(target: &str) {
    let files = corpus(target);
    assert!(!files.is_empty(), "fuzz/corpus/{target}/ has no seeds");
    for (name, bytes) in &files {
        run(target, &format!("corpus file {name}"), bytes);
    }
    let mut rng = Rng(0x5eed ^ target.len() as u64 ^ (target.as_bytes()[0] as u64) << 8);
    for i in 0..RANDOM {
        let len = rng.below(300);
        run(target, &format!("random input {i}"), &rng.bytes(len));
    }
    for i in 0..MUTATED {
        let (_, base) = &files[rng.below(files.len())];
        let (_, other) = &files[rng.below(files.len())];
        let input = mutate(&mut rng, base, other);
        run(target, &format!("mutated input {i}"), &input);
    }
}

macro_rules! target_tests {
    ($($name:ident),* $(,)?) => {
        $(#[test]
        fn $name() {
            replay_and_explore(stringify!($name));
        })*

        /// The list above, `TARGETS`, `fuzz/fuzz_targets/*.rs`, the `[[bin]]`s of
        /// fuzz/Cargo.toml and the corpus directories all name the same targets.
        #[test]
        fn every_target_has_a_test_a_fuzz_target_and_a_corpus() {
            let mut here = vec![$(stringify!($name)),*];
            here.sort_unstable();
            let mut listed: Vec<&str> = TARGETS.iter().map(|(n, _)| *n).collect();
            listed.sort_unstable();
            assert_eq!(here, listed, "target_tests! and TARGETS differ");
            let names_in = |dir: &str, ext: Option<&str>| -> Vec<String> {
                let mut v: Vec<String> = std::fs::read_dir(root().join(dir))
                    .unwrap_or_else(|e| panic!("{dir}: {e}"))
                    .map(|e| e.expect("entry").path())
                    .filter(|p| ext.is_none_or(|ext| p.extension().is_some_and(|e| e == ext)))
                    .map(|p| p.file_stem().expect("name").to_string_lossy().into_owned())
                    .collect();
                v.sort();
                v
            };
            assert_eq!(names_in("fuzz/fuzz_targets", Some("rs")), listed, "fuzz/fuzz_targets/");
            assert_eq!(names_in("fuzz/corpus", None), listed, "fuzz/corpus/");
            let manifest = std::fs::read_to_string(root().join("fuzz/Cargo.toml")).expect("fuzz/Cargo.toml");
            for name in &listed {
                assert!(manifest.contains(&format!("name = \"{name}\"\npath = \"fuzz_targets/{name}.rs\"")), "fuzz/Cargo.toml has no [[bin]] {name}");
            }
        }
    };
}

target_tests!(
    frames,
    headers,
    connect_head,
    https_host,
    config,
    token_file,
    client_cert,
    peer_routes,
    admin_filter
);

/// The `gen-*` seeds are what `fuzz_checks::seeds` makes today.
#[test]
fn generated_seeds_are_committed() {
    let write = std::env::var_os("FUZZ_WRITE_SEEDS").is_some();
    let seeds = fuzz_checks::seeds::seeds(&root());
    for (target, name, bytes) in &seeds {
        let path = corpus_dir(target).join(format!("gen-{name}"));
        if write {
            std::fs::create_dir_all(corpus_dir(target)).expect("corpus dir");
            std::fs::write(&path, bytes).expect("write seed");
        } else {
            let committed = std::fs::read(&path).ok();
            assert!(
                committed.as_ref() == Some(bytes),
                "{} is missing or stale: FUZZ_WRITE_SEEDS=1 cargo test -p fuzz-checks --test corpus",
                path.display()
            );
        }
    }
    for (target, _) in TARGETS {
        for (file, _) in corpus(target) {
            if let Some(name) = file.strip_prefix("gen-") {
                assert!(
                    seeds.iter().any(|(t, n, _)| t == target && n == name),
                    "fuzz/corpus/{target}/{file} is no longer generated: delete it"
                );
            }
        }
    }
}
