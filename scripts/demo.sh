#!/usr/bin/env bash
# The one-machine demo: tunnel cloud and tunnel edge on loopback with generated
# certificates, and real traffic through them. Everything it starts it stops (by PID).
#
#   scripts/demo.sh            set up the machine, build, run the demo
#   DEMO_KEEP=1 scripts/demo.sh  leave the processes running until Ctrl-C
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

say "set-up (scripts/setup.sh)"
bash scripts/setup.sh
# Each build says what it builds and shows cargo's progress: on a fresh clone they take
# minutes, which must not look like a hang.
say "build: the eBPF object (cargo xtask build-ebpf: nightly, bpfel-unknown-none)"
cargo xtask build-ebpf
say "build: tunnel in release (cargo build --release -p tunnel-user; minutes the first time)"
cargo build --release -p tunnel-user
TUNNEL=$PWD/target/release/tunnel

work=$(mktemp -d /tmp/tunnel-demo.XXXXXX)
pids=()
demo_cgroup=
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  [ -n "$demo_cgroup" ] && rmdir "$demo_cgroup" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT INT TERM

# The edge node's own address is 127.1.0.5 on this one machine.
EDGE_IP=127.1.0.5
HTTP_PORT=18080

# The transparent redirect needs root and cgroup v2. It is attached to a child cgroup
# made for the demo, never to the root cgroup: only the demo's client is redirected.
cgroup_root=
if [ "$(id -u)" = 0 ]; then
  if [ -f /sys/fs/cgroup/cgroup.controllers ]; then cgroup_root=/sys/fs/cgroup
  elif [ -f /sys/fs/cgroup/unified/cgroup.controllers ]; then cgroup_root=/sys/fs/cgroup/unified
  fi
fi
if [ -n "$cgroup_root" ]; then
  demo_cgroup=$cgroup_root/tunnel-demo-$$
  mkdir "$demo_cgroup"
fi

say "certificates (tunnel certs)"
"$TUNNEL" certs --out "$work/certs" --edge edge-1 --edge apiserver --tokens --server kubelet=$EDGE_IP
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
if [ -n "$demo_cgroup" ]; then
  cat >> "$work/cloud.toml" <<TOML

[redirect]
enabled = true
listen = "127.0.0.1:19250"
cgroup = "$demo_cgroup"
ports = [10250]
TOML
fi

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
for _ in $(seq 100); do
  curl -sf -o /dev/null http://$EDGE_IP:$HTTP_PORT/hello.txt && break
  sleep 0.1
done

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
curl -s -o /dev/null -w "CONNECT edge-1:22 -> HTTP %{http_connect}\n" -p -x http://127.0.0.1:19080 http://edge-1:22/ || true

if [ -n "$demo_cgroup" ]; then
  say "transparent redirect: a 'kubelet' (openssl s_server) on $EDGE_IP:10250 behind the edge"
  (cd "$work/certs" && exec openssl s_server -quiet -www -Verify 1 -CAfile ca.crt \
      -cert server-kubelet.crt -key server-kubelet.key -accept $EDGE_IP:10250 >/dev/null 2>&1) &
  pids+=($!)
  for _ in $(seq 100); do
    (exec 3<>/dev/tcp/$EDGE_IP/10250) 2>/dev/null && break
    sleep 0.1
  done
  echo "programs attached to the demo cgroup (bpftool cgroup show $demo_cgroup):"
  bpftool cgroup show "$demo_cgroup" || true
  echo
  echo "curl https://$EDGE_IP:10250/ from inside the demo cgroup (TLS verified end to end against the CA):"
  sh -c 'echo $$ > "$0/cgroup.procs" && exec "$@"' "$demo_cgroup" \
    curl -sS --cacert "$work/certs/ca.crt" --cert "$work/certs/edge-apiserver.crt" --key "$work/certs/edge-apiserver.key" \
    -o "$work/kubelet-page" https://$EDGE_IP:10250/
  head -n 4 "$work/kubelet-page"
  echo "connections the eBPF program redirected into tunnel-cloud:"
  curl -s http://127.0.0.1:19100/metrics | grep -E '^tunnel_(ebpf_redirected_total|connections_total\{entry="redirect"\})'
else
  say "transparent redirect skipped: needs root and cgroup v2"
fi

if [ -n "${DEMO_KEEP:-}" ]; then
  say "running; logs in $work/*.log; Ctrl-C to stop"
  wait
fi
say "demo done"
