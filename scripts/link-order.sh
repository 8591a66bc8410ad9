#!/bin/sh
# Writes tunnel-user/link-order.txt: the functions a musl release `tunnel` runs from start
# until idle (cloud and edge, one edge registered), in the order callgrind first lists
# them. tunnel-user/build.rs links the musl build with it, so that this code sits
# together and an idle process maps less of the binary. Rerun after dependency or
# toolchain updates (symbol hashes change); a stale file only costs memory.
#
# Needs valgrind, and the configs and certificates of a bench start-up run:
#   cargo xtask bench --only startup --no-rathole --no-konnectivity   (once)
#   scripts/link-order.sh
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
target=${CARGO_TARGET_DIR:-$root/target}
run=$root/target/bench/run
cargo build --release --locked -p tunnel-user --bin tunnel --target x86_64-unknown-linux-musl
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$target/x86_64-unknown-linux-musl/release/tunnel" "$work/tunnel"
cd "$work"
timeout -s INT 25 valgrind --tool=callgrind --demangle=no --callgrind-out-file=cloud.out \
    ./tunnel cloud -c "$run/startup-tunnel-cloud.toml" >cloud.log 2>&1 &
sleep 3
timeout -s INT 22 valgrind --tool=callgrind --demangle=no --callgrind-out-file=edge.out \
    ./tunnel edge -c "$run/startup-tunnel-edge.toml" >edge.log 2>&1 &
wait
grep -q "registered with the cloud" edge.log || { echo "the edge did not register: $work/edge.log" >&2; exit 1; }
{
    echo "# Made by scripts/link-order.sh: the functions start-up and an idle cloud and edge run."
    sed -n 's/^c\{0,1\}fn=([0-9]*) \([^0(].*\)$/\1/p' cloud.out edge.out | awk '!seen[$0]++'
} >"$root/tunnel-user/link-order.txt"
echo "wrote $root/tunnel-user/link-order.txt ($(wc -l <"$root/tunnel-user/link-order.txt") lines)"
