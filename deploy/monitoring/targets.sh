#!/bin/sh
# Writes the node list Prometheus scrapes (file_sd, prometheus.yml) from `kubectl get
# nodes`, into the ConfigMap prometheus-targets of deploy/monitoring/; run it after
# `kubectl apply -k deploy/monitoring/` and whenever nodes come or go (Prometheus
# rereads the files when the kubelet updates the volume, within a minute or so).
#   deploy/monitoring/targets.sh              # update the ConfigMap
#   deploy/monitoring/targets.sh --out DIR    # only write the files, for a Prometheus of your own
# KUBECTL names the kubectl to run (default: kubectl, with its usual KUBECONFIG).
# ADMIN_PORT is the tunnel's admin port on masters and workers (deploy/config/cloud.toml).
set -eu

KUBECTL=${KUBECTL:-kubectl}
ADMIN_PORT=${ADMIN_PORT:-9101}
NAMESPACE=tunnel-monitoring
EDGE=node-role.kubernetes.io/edge
MASTER=node-role.kubernetes.io/control-plane

out=
case "${1:-}" in
  --out) out=${2:?--out needs a directory}; mkdir -p "$out" ;;
  "") ;;
  *) echo "usage: $0 [--out DIR]" >&2; exit 2 ;;
esac
dir=${out:-$(mktemp -d)}
[ -n "$out" ] || trap 'rm -rf "$dir"' EXIT

# Prints "name address" for each node the selector matches: its first InternalIP
# (the one the kubelet and the tunnel's node table use), IPv6 in brackets.
nodes() {
  "$KUBECTL" get nodes -l "$1" -o jsonpath='{range .items[*]}{.metadata.name}{" "}{.status.addresses[?(@.type=="InternalIP")].address}{"\n"}{end}' |
    awk 'NF >= 2 { ip = $2; if (ip ~ /:/) ip = "[" ip "]"; print $1, ip }'
}

# Writes file_sd JSON: one target group per node, port $2, the node's name as label $3.
file_sd() {
  awk -v port="$1" -v label="$2" '
    BEGIN { printf "[" }
    { printf "%s\n  {\"targets\": [\"%s:%s\"], \"labels\": {\"%s\": \"%s\"}}", (NR > 1 ? "," : ""), $2, port, label, $1 }
    END { printf "%s]\n", (NR ? "\n" : "") }'
}

nodes "$EDGE" | file_sd 10250 node >"$dir/edge-kubelet.json"
nodes "$MASTER,!$EDGE" | file_sd "$ADMIN_PORT" host >"$dir/tunnel-cloud.json"
nodes "!$MASTER,!$EDGE" | file_sd "$ADMIN_PORT" host >"$dir/tunnel-relay.json"
# deploy/ keeps the edges' admin listener on their loopback: nothing to list.
echo "[]" >"$dir/tunnel-edge.json"

for f in edge-kubelet tunnel-cloud tunnel-relay; do
  echo "$f: $(grep -c '"targets"' "$dir/$f.json" || true) targets" >&2
done
if [ -z "$out" ]; then
  "$KUBECTL" -n "$NAMESPACE" create configmap prometheus-targets --from-file="$dir" \
    --dry-run=client -o yaml | "$KUBECTL" apply -f -
fi
