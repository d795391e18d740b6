#!/usr/bin/env bash
# The e2e suite on a real cluster: kind (Kubernetes in Docker), for machines with a Docker engine.
#
#   e2e/kind.sh [-- CARGO TEST ARGS]
#
# 1. builds the e2e test binary first (a compile error fails before any cluster exists);
# 2. builds the image from the Dockerfile and creates a kind cluster, with its kubeconfig in a
#    temporary directory (~/.kube/config is never touched), then `kind load`s the image;
#    The app of the smoke flow is busybox, built here too (e2e/image.sh busybox: Debian's
#    busybox-static) and `kind load`ed: nothing is pulled from Docker Hub. On a cgroup v1 host
#    (docker info: CgroupVersion 1) the cluster's config sets the kubelet's failCgroupV1: false,
#    without which Kubernetes 1.35+ does not run there at all.
# 3. runs e2e/smoke.sh, the flow e2e/local-node.sh runs on this repository's own one-node
#    cluster: `helm install` of charts/sluice into sluice-system; the webhooks behind their
#    Service with the operator's caBundle (an invalid policy is refused), `kubectl get rlp`
#    Enforced, a labelled Deployment running the injected sidecar (a native sidecar where the
#    cluster has them), traffic through its Service answered 429 past the limit, in both redirect
#    modes; a Job and a CronJob with injected pods that complete; a rolling restart with a request
#    in flight through the sidecar; leader failover; `helm upgrade` rolling the pods;
# 4. runs the same Rust e2e tests (e2e/smoke.sh suite) as against the local control plane (`cargo test --test
#    e2e_operator`) with SLUICE_E2E_KUBECONFIG pointing at the cluster and the operators the tests
#    start running with a token of the chart's ServiceAccount, so the chart's RBAC is what they
#    prove sufficient;
# 5. `helm uninstall`s (e2e/smoke.sh uninstall): no webhook configuration is left to block pods;
# 6. deletes the cluster on exit, whatever happened (SLUICE_KIND_KEEP=1 keeps it for debugging;
#    `kind delete cluster --name NAME` then removes it).
#
# Needs: docker (a running engine, BuildKit), kind, kubectl, helm 3, cargo, curl, and Debian's
# busybox-static (the app's image). e2e/kind-local.sh runs this on a machine without a registry
# (its own engine, base and node images assembled locally); scripts/test.sh runs that.
# Environment:
#   SLUICE_KIND_CLUSTER     cluster name (default sluice-e2e)
#   SLUICE_KIND_NODE_IMAGE  kindest/node image to boot (default: kind's own default)
#   SLUICE_KIND_KEEP=1      keep the cluster (and print how to reach it)
#   SLUICE_IMAGE            image to build and load (default sluice:kind-e2e; not :latest, so the
#                           injected sidecar's default pull policy, IfNotPresent, uses the loaded one)
#   SLUICE_KIND_STEPS       e2e/smoke.sh's steps before the suite (default: all of them)
set -euo pipefail

cd "$(dirname "$0")/.."
CLUSTER="${SLUICE_KIND_CLUSTER:-sluice-e2e}"
IMAGE="${SLUICE_IMAGE:-sluice:kind-e2e}"
RELEASE_NS=sluice-system     # the tests' own operators use --operator-namespace sluice-system
SMOKE_NS=sluice-smoke
WORK="$(mktemp -d -t sluice-kind.XXXXXX)"
# Every kubectl and helm below talks to the kind cluster only.
export KUBECONFIG="$WORK/kubeconfig"
CREATED=""

log() { echo "kind-e2e: $*" >&2; }
die() { log "$*"; exit 1; }

diagnostics() {
  log "diagnostics:"
  kubectl get pods -A -o wide >&2 || true
  kubectl -n "$RELEASE_NS" logs deployment/sluice --all-containers --tail=100 >&2 || true
  kubectl -n "$SMOKE_NS" describe pods >&2 || true
  kubectl get events -A --sort-by=.lastTimestamp 2>/dev/null | tail -30 >&2 || true
}

cleanup() {
  local rc=$?
  if [ "$rc" -ne 0 ] && [ -n "$CREATED" ]; then diagnostics; fi
  if [ -n "$CREATED" ]; then
    if [ "${SLUICE_KIND_KEEP:-}" = 1 ]; then
      kind get kubeconfig --name "$CLUSTER" > "./kind-$CLUSTER.kubeconfig" 2>/dev/null || true
      log "kept cluster $CLUSTER: KUBECONFIG=./kind-$CLUSTER.kubeconfig; remove: kind delete cluster --name $CLUSTER"
    else
      log "deleting cluster $CLUSTER"
      kind delete cluster --name "$CLUSTER" >&2 || true
    fi
  fi
  rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

for tool in docker kind kubectl helm cargo curl; do
  command -v "$tool" >/dev/null || die "$tool is required"
done
docker info >/dev/null 2>&1 || die "no Docker engine reachable (docker info failed); without Docker, e2e/local-node.sh runs the same flow"
helm version --short | grep -q '^v3\.' || log "warning: the chart is tested with helm 3 ($(helm version --short))"
if kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
  die "a kind cluster named $CLUSTER exists already; delete it or set SLUICE_KIND_CLUSTER"
fi

phase_start=$SECONDS
# phase NAME: the time since the last phase, for the closing line.
PHASES=()
phase() { PHASES+=("$1 $((SECONDS - phase_start)) s;"); log "$1: $((SECONDS - phase_start)) s"; phase_start=$SECONDS; }

log "building the e2e tests"
cargo test --locked --test e2e_operator --no-run
phase "e2e tests built"

log "building image $IMAGE from the Dockerfile"
DOCKER_BUILDKIT=1 docker build -t "$IMAGE" .
log "image $IMAGE: $(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{ printf "%.1f MB", $1 / 1e6 }')"
phase "docker build"
APP_IMAGE=docker.io/sluice-e2e/busybox:1.35.0
e2e/image.sh busybox "$APP_IMAGE" "$WORK/busybox.tar"

# Kubernetes 1.35+ refuses to start the kubelet on cgroup v1 unless told it may.
printf 'kind: Cluster\napiVersion: kind.x-k8s.io/v1alpha4\n' > "$WORK/kind.yaml"
if [ "$(docker info -f '{{.CgroupVersion}}' 2>/dev/null)" = 1 ]; then
  log "cgroup v1 host: the kubelet runs with failCgroupV1: false"
  printf 'kubeadmConfigPatches:\n- |\n  kind: KubeletConfiguration\n  failCgroupV1: false\n' >> "$WORK/kind.yaml"
fi

log "creating kind cluster $CLUSTER"
CREATED=1
kind create cluster --name "$CLUSTER" --kubeconfig "$KUBECONFIG" --config "$WORK/kind.yaml" --wait 300s \
  ${SLUICE_KIND_NODE_IMAGE:+--image "$SLUICE_KIND_NODE_IMAGE"}
phase "kind create cluster"
kind load docker-image "$IMAGE" --name "$CLUSTER"
kind load image-archive "$WORK/busybox.tar" --name "$CLUSTER"
phase "kind load"

# The install and what only a real cluster has: the same flow as the one-node cluster of
# e2e/local-node.sh (e2e/smoke.sh).
SMOKE=(env SLUICE_IMAGE="$IMAGE" SMOKE_APP_IMAGE="${APP_IMAGE#docker.io/}" SMOKE_WORK="$WORK/smoke"
  SMOKE_VALUES="$PWD/e2e/values/loaded-image.yaml" e2e/smoke.sh)
# shellcheck disable=SC2086 # the steps are words
"${SMOKE[@]}" ${SLUICE_KIND_STEPS:-install verify iptables jobs drain failover upgrade}
phase "smoke flow"

# ---- the Rust e2e suite against the cluster, then uninstall -------------------------------------
[ "${1:-}" = "--" ] && shift
SMOKE_SUITE_ARGS="$*" "${SMOKE[@]}" suite uninstall
phase "suite and uninstall"
log "passed: ${PHASES[*]}"
