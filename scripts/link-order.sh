#!/bin/sh
# Writes tunnel-user/link-order.txt: the functions a musl release `tunnel` runs from start
# until idle (cloud and edge, a connection refused before the edge registers, one edge
# registered, one connection proxied through a forward and closed), in the order
# callgrind first lists them. tunnel-user/build.rs links the musl build with it, so that
# this code sits together and an idle process maps less of the binary. Rerun after
# dependency or toolchain updates (symbol hashes change) and after changes to code that
# start-up runs: a stale file only costs memory, but even 10 names gone of 2,907 cost the
# idle cloud and edge 0.7 and 0.75 MiB once (docs/design.md, knob 11).
#
# Needs valgrind, python3, and the configs and certificates of a bench start-up run:
#   cargo xtask bench --only startup --no-rathole --no-konnectivity   (once)
#   scripts/link-order.sh
#
# `scripts/link-order.sh --check` (scripts/test.sh runs it after the image build) fails
# when fewer than 97% of the listed functions are in the musl build: a change of
# dependencies renamed most of them once, and the idle cloud and edge grew from 5.8 and
# 5.3 to 10.1 and 9.9 MiB (docs/benchmarks.md). The names are the same wherever the
# tree is built, because `cargo xtask shipped-binary` builds with the paths mapped to
# fixed names (xtask/src/shipped.rs).
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
order=$root/tunnel-user/link-order.txt
# The shipped binary, built if it is not (after `cargo xtask image`, it is).
bin=$(cd "$root" && cargo xtask shipped-binary)
if [ "${1:-}" = --check ]; then
    command -v nm >/dev/null || { echo "link-order check: nm (binutils) is not installed" >&2; exit 1; }
    listed=$(grep -vc '^#' "$order")
    found=$(nm --defined-only "$bin" | awk '{print $3}' | grep -x -F -f - "$order" | wc -l)
    if [ $((found * 100)) -lt $((listed * 97)) ]; then
        echo "link-order check: only $found of the $listed functions in $order are in $bin;" >&2
        echo "  make it again (the commands at the top of scripts/link-order.sh)" >&2
        exit 1
    fi
    echo "link-order check: $found of $listed functions found"
    exit 0
fi
run=$root/target/bench/run
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$bin" "$work/tunnel"
cd "$work"
# The forward's target: an echo server, so one connection runs the data path too.
target_port=$(sed -n 's/^target = "127.0.0.1:\([0-9]*\)"/\1/p' "$run/startup-tunnel-cloud.toml")
forward_port=$(sed -n '/^\[\[forward\]\]/,/^$/s/^listen = "127.0.0.1:\([0-9]*\)"/\1/p' "$run/startup-tunnel-cloud.toml")
timeout 40 python3 -c '
import socket, sys
s = socket.create_server(("127.0.0.1", int(sys.argv[1])))
while True:
    c, _ = s.accept()
    with c:
        while data := c.recv(65536):
            c.sendall(data)
' "$target_port" &
echo_server=$!
timeout -s INT 35 valgrind --tool=callgrind --demangle=no --callgrind-out-file=cloud.out \
    ./tunnel cloud -c "$run/startup-tunnel-cloud.toml" >cloud.log 2>&1 &
cloud=$!
sleep 3
# A connection before the edge has registered, as the bench's start-up probe makes every
# 2 ms: the cloud accepts it and finds no route. Without it, that path lies wherever the
# linker put it, and the idle cloud's RSS swung by 0.6 MiB between builds of one source.
timeout 15 python3 -c '
import socket, sys
with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10) as c:
    c.sendall(b"too early")
    try:
        while c.recv(100):
            pass
    except ConnectionResetError:
        pass
' "$forward_port"
timeout -s INT 32 valgrind --tool=callgrind --demangle=no --callgrind-out-file=edge.out \
    ./tunnel edge -c "$run/startup-tunnel-edge.toml" >edge.log 2>&1 &
edge=$!
for _ in $(seq 200); do grep -q "registered with the cloud" edge.log && break; sleep 0.1; done
timeout 15 python3 -c '
import socket, sys
with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10) as c:
    c.sendall(b"link-order")
    got = b""
    while len(got) < 10:
        got += c.recv(100) or sys.exit("the forward closed before the echo")
' "$forward_port"
# Both end by timeout (status 124): that is how they are stopped.
wait "$cloud" "$edge" || true
kill "$echo_server" 2>/dev/null || true
grep -q "registered with the cloud" edge.log || { echo "the edge did not register: $work/edge.log" >&2; exit 1; }
{
    echo "# Made by scripts/link-order.sh: the functions start-up, one proxied connection and an idle cloud and edge run."
    # callgrind marks a function's recursive entries `name'2`, `name'3`: the same function.
    sed -n 's/^c\{0,1\}fn=([0-9]*) \([^0(].*\)$/\1/p' cloud.out edge.out | sed "s/'[0-9]*\$//" | awk '!seen[$0]++'
} >"$order"
echo "wrote $order ($(wc -l <"$order") lines)"
