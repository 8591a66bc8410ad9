//! What the fuzz targets check: one function per target, taking the raw fuzz input and
//! panicking when a property of a decoder of network input does not hold.
//!
//! Why a crate of its own rather than code in the fuzz targets or in tunnel-user: the
//! same checks run in two places, the cargo-fuzz targets (`fuzz/fuzz_targets/*.rs`,
//! nightly, libFuzzer) and a plain stable test (`tests/corpus.rs`) that replays the
//! committed corpus and a few thousand seeded pseudo-random inputs on every
//! `cargo test --workspace`. Keeping them here keeps test oracles out of the `tunnel`
//! binary, and keeps the fuzz targets one line each, so the two can never drift apart.
//!
//! Each check takes `&[u8]` (what libFuzzer hands out). Where a decoder's input has
//! structure, the check also *builds* a valid input from the bytes and asserts that the
//! decoder returns what was put in, so the fuzzer explores both garbage and near-valid
//! inputs.

pub mod admin;
pub mod certs;
pub mod config;
pub mod frames;
pub mod headers;
pub mod http_heads;
pub mod peer_routes;
pub mod seeds;
pub mod tokens;

/// A check: panics when a property does not hold for this input.
pub type Check = fn(&[u8]);

/// Every fuzz target: its name (the file `fuzz/fuzz_targets/<name>.rs` and the corpus
/// directory `fuzz/corpus/<name>/`) and its check.
pub const TARGETS: &[(&str, Check)] = &[
    ("frames", frames::check),
    ("headers", headers::check),
    ("connect_head", http_heads::check_connect),
    ("https_host", http_heads::check_https_host),
    ("config", config::check),
    ("token_file", tokens::check),
    ("client_cert", certs::check),
    ("peer_routes", peer_routes::check),
    ("admin_filter", admin::check),
];

/// Reads the fuzz input as a sequence of choices; runs out gracefully (zeros), so every
/// input, however short, builds something.
pub(crate) struct Choices<'a> {
    data: &'a [u8],
}

impl<'a> Choices<'a> {
    pub(crate) fn new(data: &'a [u8]) -> Self {
        Self { data }
    }

    pub(crate) fn byte(&mut self) -> u8 {
        match self.data.split_first() {
            Some((&b, rest)) => {
                self.data = rest;
                b
            }
            None => 0,
        }
    }

    pub(crate) fn u16(&mut self) -> u16 {
        u16::from_be_bytes([self.byte(), self.byte()])
    }

    /// Up to `max` bytes, the length chosen by the input.
    pub(crate) fn bytes(&mut self, max: usize) -> &'a [u8] {
        let n = (self.byte() as usize).min(max).min(self.data.len());
        let (taken, rest) = self.data.split_at(n);
        self.data = rest;
        taken
    }

    /// A string of up to `max` characters, each mapped into `alphabet`.
    pub(crate) fn string_from(&mut self, alphabet: &[u8], max: usize) -> String {
        self.bytes(max)
            .iter()
            .map(|b| alphabet[*b as usize % alphabet.len()] as char)
            .collect()
    }

    /// Whatever is left.
    pub(crate) fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.data)
    }
}

/// Lower-case letters, digits, '-' and '.': what node names are made of.
pub(crate) const NAME_CHARS: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789-.";

/// A valid node name built from the input (never empty).
pub(crate) fn node_name(c: &mut Choices<'_>) -> String {
    let middle = c.string_from(NAME_CHARS, 40);
    let name = format!("n{middle}0");
    debug_assert!(tunnel_user::addr::check_node_name(&name).is_ok());
    name
}
