#!/usr/bin/env bash
# The whole test suite, from a fresh machine: set-up, then every test of the workspace
# (the privileged eBPF tests need root; CI runs as root), then a short run of every fuzz
# target (docs/fuzzing.md). The benchmark is separate: `cargo xtask bench [--smoke]`
# (docs/benchmarks.md).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
# cargo may be fresh in this shell's PATH only after rustup's set-up.
export PATH="$HOME/.cargo/bin:$PATH"
cargo test --workspace --all-targets --no-fail-fast
# Bounded: 12 s per target after a nightly build of the fuzz targets.
cargo xtask fuzz --smoke
