#!/usr/bin/env bash
# The whole test suite, from a fresh machine: set-up, the style gate (rustfmt, clippy on
# the workspace and on tunnel-ebpf), then every test of the workspace
# (the privileged eBPF tests need root; CI runs as root), then a short run of every fuzz
# target (docs/fuzzing.md). The benchmark is separate: `cargo xtask bench [--smoke]`
# (docs/benchmarks.md).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
# A full run writes about 15 GiB of build output (the workspace in debug and as the musl
# image, the eBPF object, the fuzz targets); a disk that fills midway fails with an
# unrelated-looking compiler error, so say up front when the room is short.
free_gib=$(df --output=avail -BG . | tail -n 1 | tr -dc '0-9')
if ((free_gib < 20)); then
  echo "[test] WARNING: only ${free_gib} GiB free under $(pwd); a full run needs about 15 GiB" >&2
fi
# cargo may be fresh in this shell's PATH only after rustup's set-up.
export PATH="$HOME/.cargo/bin:$PATH"
# The patched crates are exactly the published ones plus patches/*.diff (setup made them).
sh scripts/patches.sh check
# Style gate first: it is quick, and a red one needs no test run to explain.
cargo fmt --all --check
(cd tunnel-ebpf && cargo fmt --check)  # its own workspace and (nightly) toolchain
(cd fuzz && cargo +nightly fmt --check)
cargo clippy --workspace --all-targets -- -D warnings
# tunnel-ebpf as aya-template checks it: for the BPF target, with its own toolchain.
(cd tunnel-ebpf && cargo clippy -- -D warnings)
# The container image, which tests/image.rs runs (release build for musl, then podman),
# and deploy/monitoring/'s Prometheus image (Debian's prometheus, FROM scratch).
cargo xtask image
cargo xtask image --prometheus
# The link order still names the functions of that build (else an idle process holds
# about 4 MiB more code: docs/design.md, knob 11).
sh scripts/link-order.sh --check
cargo test --workspace --all-targets --no-fail-fast
# The suites that run a real Kubernetes, again on each further version named (`:`
# between directories; .ci/run names 1.28 beside the newest): one version at a time,
# as they bind the same host ports and share the host's cgroups and mounts.
IFS=: read -ra also <<<"${KUBEBUILDER_ASSETS_ALSO:-}"
for assets in "${also[@]}"; do
  echo "[test] the Kubernetes suites again, on $assets"
  KUBEBUILDER_ASSETS=$assets cargo test -p tunnel-user --test k8s_e2e --test node_e2e --no-fail-fast
done
# Bounded: 12 s per target after a nightly build of the fuzz targets.
cargo xtask fuzz --smoke
