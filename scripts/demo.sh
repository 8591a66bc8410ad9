#!/usr/bin/env bash
# The one-machine demo: tunnel cloud and tunnel edge on loopback with generated
# certificates, and real traffic through them. Everything it starts it stops (by PID).
#
#   scripts/demo.sh            set up the machine, build, run the demo
#   DEMO_KEEP=1 scripts/demo.sh  leave the processes running until Ctrl-C
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
cargo xtask build-ebpf --release
cargo build --release -p tunnel-user
TUNNEL=$PWD/target/release/tunnel

work=$(mktemp -d /tmp/tunnel-demo.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT INT TERM
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

# The edge node's own address is 127.1.0.5 on this one machine.
EDGE_IP=127.1.0.5
HTTP_PORT=18080

say "certificates (tunnel certs)"
"$TUNNEL" certs --out "$work/certs" --edge edge-1 --tokens --server kubelet=$EDGE_IP
token=$(grep '^edge-1:' "$work/certs/tokens" | cut -d: -f2)

cat > "$work/cloud.toml" <<TOML
[tunnel]
listen = "127.0.0.1:19000"
cert = "certs/cloud.crt"
key = "certs/cloud.key"
token_file = "certs/tokens"

[admin]
listen = "127.0.0.1:19100"

[[node]]
name = "edge-1"
addresses = ["$EDGE_IP"]

[connect]
listen = "127.0.0.1:19080"
TOML

cat > "$work/edge.toml" <<TOML
node_name = "edge-1"

[cloud]
address = "127.0.0.1:19000"
server_name = "tunnel-cloud"
ca = "certs/ca.crt"
token = "$token"

[admin]
listen = "127.0.0.1:19101"

[allow]
targets = []
node_addresses = ["$EDGE_IP"]
ports = [$HTTP_PORT, 10250]
TOML

say "a web server on the edge side ($EDGE_IP:$HTTP_PORT)"
mkdir -p "$work/www"
echo "hello from behind the edge" > "$work/www/hello.txt"
head -c $((64 << 20)) /dev/urandom > "$work/www/blob"
python3 -m http.server $HTTP_PORT --bind $EDGE_IP --directory "$work/www" >/dev/null 2>&1 &
pids+=($!)

say "tunnel cloud and tunnel edge"
"$TUNNEL" cloud --config "$work/cloud.toml" 2> "$work/cloud.log" &
pids+=($!)
"$TUNNEL" edge --config "$work/edge.toml" 2> "$work/edge.log" &
pids+=($!)
for _ in $(seq 100); do
  curl -sf http://127.0.0.1:19101/readyz >/dev/null && break
  sleep 0.1
done
curl -sf http://127.0.0.1:19101/readyz >/dev/null || { cat "$work/cloud.log" "$work/edge.log"; echo "edge never registered"; exit 1; }
echo "edge registered: $(curl -s http://127.0.0.1:19101/readyz)"

say "curl through the HTTP CONNECT proxy, by node name and by node IP"
curl -sS -p -x http://127.0.0.1:19080 http://edge-1:$HTTP_PORT/hello.txt
curl -sS -p -x http://127.0.0.1:19080 http://$EDGE_IP:$HTTP_PORT/hello.txt

say "64 MiB through the tunnel, checksummed"
want=$(sha256sum < "$work/www/blob" | cut -d' ' -f1)
got=$(curl -sS -p -x http://127.0.0.1:19080 http://edge-1:$HTTP_PORT/blob | sha256sum | cut -d' ' -f1)
echo "sent $want"; echo "got  $got"
[ "$want" = "$got" ] || { echo "checksum mismatch"; exit 1; }

say "a target outside the edge's allowlist is refused"
curl -sS -o /dev/null -w "CONNECT edge-1:22 -> HTTP %{http_code}\n" -p -x http://127.0.0.1:19080 http://edge-1:22/ || true

if [ -n "${DEMO_KEEP:-}" ]; then
  say "running; logs in $work/*.log; Ctrl-C to stop"
  wait
fi
say "demo done"
