#!/usr/bin/env bash
# e2e/kind.sh on this machine, as scripts/test.sh runs it: no registry is reachable, so everything
# kind.sh would pull is assembled locally first, under the names the real images have.
#
#   e2e/kind-local.sh [-- CARGO TEST ARGS]
#
# 1. starts a Docker engine of its own (e2e/docker.sh: Debian's docker.io, its own data root in
#    the cache, its own socket; the system's engine, if any, is not touched);
# 2. assembles the Dockerfile's base images (e2e/base-images.sh) and kind's node image
#    (e2e/kind-node.sh), and builds kind from the Go module proxy, each cached by version;
# 3. runs e2e/kind.sh unchanged with that kind, that node image, kubectl and helm (the ones
#    e2e/control-plane.sh builds);
# 4. stops the engine whatever happened and checks that the host is as before: no container,
#    bridge, iptables chain or rule of it, the FORWARD policy and ip_forward restored (fails if not).
#
# Needs root (dockerd), Debian's docker.io, debootstrap and busybox-static (scripts/test.sh
# installs them), Go.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { echo "kind-local: $*" >&2; }
die() { log "$*"; exit 1; }

[ "$(id -u)" -eq 0 ] || die "needs root (it starts a Docker engine)"
export PATH="$PATH:/usr/local/go/bin"
start=$SECONDS
WORK="$(mktemp -d -t sluice-kind-local.XXXXXX)"
ENGINE="$WORK/docker"
cleanup() {
  local rc=$?
  if ! e2e/docker.sh stop "$ENGINE"; then
    log "the Docker engine did not stop cleanly (see above)"; rc=1
  fi
  rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

bin="$(e2e/control-plane.sh build)"
helm="$(e2e/control-plane.sh helm)"
kind="$(e2e/kind-node.sh kind)"

# The watchdog stops the engine if this script is killed before its trap runs.
e2e/docker.sh start "$ENGINE" $$
# shellcheck source=/dev/null # written by e2e/docker.sh start
source "$ENGINE/env"

images_start=$SECONDS
e2e/base-images.sh
node_image="$(e2e/kind-node.sh image)"
log "base and node images ready in $((SECONDS - images_start)) s"

PATH="$(dirname "$kind"):$(dirname "$helm"):$bin:$PATH" SLUICE_KIND_NODE_IMAGE="$node_image" \
  e2e/kind.sh "$@"
log "passed in $((SECONDS - start)) s"
