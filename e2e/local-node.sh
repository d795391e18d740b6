#!/usr/bin/env bash
# The install path for real on this machine, no Docker needed: the release binary in an OCI image
# (e2e/image.sh), a one-node cluster (e2e/node.sh), then the same flow as e2e/kind.sh
# (e2e/smoke.sh): helm install, webhooks, injection, 429s through a running sidecar, Jobs with
# native sidecars, a rolling restart with a request in flight, leader failover, helm upgrade, the operator's e2e suite as the chart's ServiceAccount, helm uninstall. scripts/test.sh runs it; needs root (network
# namespaces, containerd, mounts).
#
#   e2e/local-node.sh
#
# Environment:
#   SLUICE_NODE_KEEP=1   leave the cluster running at the end and print how to reach it
#                        (`e2e/node.sh stop DIR` then removes it)
#   SLUICE_NODE_STEPS    e2e/smoke.sh's steps (default: all of them; scripts/test.sh runs those
#                        kind does not repeat, as kind runs the whole flow after it)
set -euo pipefail
cd "$(dirname "$0")/.."

log() { echo "local-node: $*" >&2; }
die() { log "$*"; exit 1; }

[ "$(id -u)" -eq 0 ] || die "needs root: it creates network namespaces, mounts and a containerd"
export PATH="$PATH:/usr/local/go/bin"
start=$SECONDS

log "building the release binary and the e2e suite"
cargo build --release --locked --bin sluice --quiet
# Built here, where the registries are reachable: the suite runs inside the node's namespace.
cargo test --locked --test e2e_operator --no-run --quiet
binary="${CARGO_TARGET_DIR:-target}/release/sluice"

log "node binaries and images"
bin="$(e2e/node.sh build)"
helm="$(e2e/control-plane.sh helm)"

WORK="$(mktemp -d -t sluice-local-node.XXXXXX)"
NODE="$WORK/node"
cleanup() {
  local rc=$?
  if [ "${SLUICE_NODE_KEEP:-}" = 1 ]; then
    log "kept: e2e/node.sh exec $NODE kubectl get pods -A; remove with e2e/node.sh stop $NODE"
  else
    e2e/node.sh stop "$NODE" || log "stopping the node failed"
    rm -rf "$WORK" || log "could not remove $WORK"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

e2e/image.sh sluice "$binary" docker.io/library/sluice:node-e2e "$WORK/sluice.tar"
e2e/image.sh busybox docker.io/sluice-e2e/busybox:1.35.0 "$WORK/busybox.tar"

log "starting the node"
node_start=$SECONDS
# Without KEEP the watchdog owns it too: if this script is killed, the node goes with it.
owner=$$; [ "${SLUICE_NODE_KEEP:-}" = 1 ] && owner=""
e2e/node.sh start "$NODE" $owner >/dev/null
e2e/node.sh import "$NODE" "$WORK/sluice.tar" "$WORK/busybox.tar"
log "node up in $((SECONDS - node_start)) s"

flow_start=$SECONDS
# shellcheck disable=SC2086 # the steps are words
e2e/node.sh exec "$NODE" env PATH="$(dirname "$helm"):$bin:$PATH" SMOKE_WORK="$WORK/smoke" \
  SLUICE_IMAGE=sluice:node-e2e SMOKE_APP_IMAGE=sluice-e2e/busybox:1.35.0 \
  SMOKE_VALUES="$PWD/e2e/values/loaded-image.yaml" \
  e2e/smoke.sh ${SLUICE_NODE_STEPS:-install verify iptables jobs drain failover upgrade suite uninstall}
log "passed: flow $((SECONDS - flow_start)) s, all $((SECONDS - start)) s"
