#!/usr/bin/env bash
# One-time (idempotent) setup of a fresh Debian machine for building and testing the
# project, run as root. CI runs it with no stdin. Re-running it only checks.
set -euo pipefail

# Debian packages the project needs. Append here (one name per line, why in a comment).
PACKAGES=(
  bpftool   # inspect loaded programs / cgroup attachments (tests use `bpftool cgroup show`)
  iproute2  # `ip netns`, veth pairs for the pod-netns intercept test
  curl      # test clients
  openssl   # test certificates
  python3   # small test clients (getpeername checks; the gRPC interop test)
  python3-pip  # installs the pinned grpcio packages below
  iperf3    # throughput benchmarks
  wrk       # HTTP load benchmarks
  g++       # libfuzzer-sys compiles libFuzzer (C++) for the fuzz targets
  etcd-server  # the etcd behind the real kube-apiserver of tests/k8s_e2e/
  podman      # cargo xtask image builds the container image; tests/image.rs runs it
  runc        # the OCI runtime tests/image.rs uses (crun refuses hybrid cgroup hosts)
  musl-tools  # musl-gcc: C parts of dependencies for the static (musl) image binary
  binutils    # strip (the image's binary) and nm (scripts/link-order.sh --check)
  containerd  # the container runtime of the real node in tests/node_e2e/ (with ctr)
  patch       # scripts/patches.sh check applies patches/*.diff to the published h2 and rustls
  busybox-static  # the workload image on the real edge node of tests/node_e2e/ (FROM scratch: a shell, tar, httpd)
  prometheus  # prometheus and promtool: deploy/monitoring/'s image (cargo xtask image --prometheus), tests/monitoring.rs
  containernetworking-plugins  # bridge, host-local, loopback in /usr/lib/cni: the pods' own network on the five-node test's worker and masters (containerd's CRI; not pulled in with --no-install-recommends)
)

log() { printf '[setup] %s\n' "$*"; }

export DEBIAN_FRONTEND=noninteractive

# --- Debian packages --------------------------------------------------------------
missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done
if ((${#missing[@]})); then
  log "apt-get update (missing: ${missing[*]})"
  apt-get update -q
  log "apt-get install ${missing[*]}"
  apt-get install -y -q --no-install-recommends "${missing[@]}"
  # The package starts a Prometheus service on :9090 where systemd runs; the tests
  # start their own on loopback, so one installed here for them is stopped.
  if [[ " ${missing[*]} " == *" prometheus "* ]] && systemctl is-active --quiet prometheus 2>/dev/null; then
    log "systemctl disable --now prometheus (installed for the tests, which run their own)"
    systemctl disable --now prometheus
  fi
else
  log "Debian packages: all present"
fi

# --- Rust nightly + rust-src (for tunnel-ebpf: -Z build-std=core) -------------------
if rustup toolchain list | grep -q '^nightly-'; then
  log "rust nightly: present ($(rustc +nightly --version))"
else
  log "rustup toolchain install nightly"
  rustup toolchain install nightly --profile minimal
fi
# rust-src for the eBPF build; rustfmt and clippy for the style gate in scripts/test.sh,
# on the default toolchain (the workspace) and on nightly (tunnel-ebpf, fuzz/).
add_component() { # toolchain ("" = the default one) component
  local flag=()
  [ -n "$1" ] && flag=(--toolchain "$1")
  if rustup component list "${flag[@]}" --installed | grep -q "^$2"; then
    log "$2 (${1:-default}): present"
  else
    log "rustup component add $2 ${flag[*]}"
    rustup component add "$2" "${flag[@]}"
  fi
}
add_component "" rustfmt
add_component "" clippy
add_component nightly rust-src
add_component nightly rustfmt
add_component nightly clippy
# The static binary in the container image (cargo xtask image).
if rustup target list --installed | grep -q '^x86_64-unknown-linux-musl$'; then
  log "rust target x86_64-unknown-linux-musl: present"
else
  log "rustup target add x86_64-unknown-linux-musl"
  rustup target add x86_64-unknown-linux-musl
fi

# --- bpf-linker 0.13.0, linked against the nightly's own LLVM ------------------------
# bpf-linker must use the same LLVM major as the rustc that emits the bitcode; linking it
# to the nightly's libLLVM avoids needing a Debian llvm-NN-dev that matches (bookworm has
# none for LLVM 22). The rpath makes the binary find that libLLVM at run time.
BPF_LINKER_VERSION=0.13.0
if command -v bpf-linker >/dev/null && bpf-linker --version 2>/dev/null | grep -q "$BPF_LINKER_VERSION"; then
  log "bpf-linker: $(bpf-linker --version)"
else
  sysroot=$(rustc +nightly --print sysroot)
  llvm_so=$(basename "$(ls "$sysroot"/lib/libLLVM-*-rust-*.so | head -n1)")
  llvm_lib=${llvm_so#lib}; llvm_lib=${llvm_lib%.so}          # e.g. LLVM-22-rust-1.97.0-nightly
  llvm_major=$(echo "$llvm_lib" | cut -d- -f2)                 # e.g. 22
  log "cargo install bpf-linker@$BPF_LINKER_VERSION against $llvm_lib (takes 1-3 min)"
  RUSTFLAGS="-L native=$sysroot/lib -l dylib=$llvm_lib -C link-arg=-Wl,-rpath,$sysroot/lib" \
    cargo install "bpf-linker@$BPF_LINKER_VERSION" --locked --no-default-features \
      --features "llvm-$llvm_major,no-llvm-linking" --target x86_64-unknown-linux-gnu
  log "bpf-linker: $(bpf-linker --version)"
fi

# --- cargo-fuzz, for `cargo xtask fuzz` (the fuzz smoke in scripts/test.sh) ----------------
CARGO_FUZZ_VERSION=0.13.2
if command -v cargo-fuzz >/dev/null && cargo-fuzz --version 2>/dev/null | grep -q "$CARGO_FUZZ_VERSION"; then
  log "cargo-fuzz: $(cargo-fuzz --version)"
else
  log "cargo install cargo-fuzz@$CARGO_FUZZ_VERSION (takes 1-2 min)"
  cargo install "cargo-fuzz@$CARGO_FUZZ_VERSION" --locked
  log "cargo-fuzz: $(cargo-fuzz --version)"
fi

# --- Python grpcio, for the gRPC interop test (tunnel-user/tests/grpc_interop.rs) ------
# A third-party gRPC implementation against the replicas' listener. Pinned; the Debian
# python3 is "externally managed" (PEP 668), hence PIP_BREAK_SYSTEM_PACKAGES: these are
# leaf packages nothing of Debian's depends on.
GRPCIO_VERSION=1.85.1
if python3 -c "import grpc, grpc_tools, grpc_health.v1, sys; sys.exit(grpc.__version__ != '$GRPCIO_VERSION')" 2>/dev/null; then
  log "grpcio $GRPCIO_VERSION (+ tools, health checking): present"
else
  log "pip install grpcio grpcio-tools grpcio-health-checking $GRPCIO_VERSION"
  PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --quiet --root-user-action=ignore \
    "grpcio==$GRPCIO_VERSION" "grpcio-tools==$GRPCIO_VERSION" "grpcio-health-checking==$GRPCIO_VERSION"
fi

log "done; next: cargo build / cargo test (tunnel-user/build.rs builds the eBPF object; cargo xtask build-ebpf builds it alone)"
