#!/usr/bin/env bash
# The e2e suite on a real cluster: kind (Kubernetes in Docker), for machines with a Docker engine.
#
#   e2e/kind.sh [-- CARGO TEST ARGS]
#
# 1. builds the e2e test binary first (a compile error fails before any cluster exists);
# 2. builds the image from the Dockerfile and creates a kind cluster, with its kubeconfig in a
#    temporary directory (~/.kube/config is never touched), then `kind load`s the image;
# 3. `helm install`s charts/sluice into sluice-system and waits for the rollout;
# 4. checks what only a real cluster has: the webhooks behind their Service with the operator's
#    caBundle (an invalid policy is refused), `kubectl get rlp` Enforced, a labelled Deployment
#    started with the injected sidecar, and traffic through it answered 429 past the limit;
# 5. runs the same Rust e2e tests as against the local control plane (`cargo test --test
#    e2e_operator`) with SLUICE_E2E_KUBECONFIG pointing at the cluster and the operators the tests
#    start running with a token of the chart's ServiceAccount, so the chart's RBAC is what they
#    prove sufficient;
# 6. deletes the cluster on exit, whatever happened (SLUICE_KIND_KEEP=1 keeps it for debugging;
#    `kind delete cluster --name NAME` then removes it).
#
# Needs: docker (a running engine, BuildKit), kind, kubectl, helm 3, cargo, curl.
# Environment:
#   SLUICE_KIND_CLUSTER     cluster name (default sluice-e2e)
#   SLUICE_KIND_NODE_IMAGE  kindest/node image to boot (default: kind's own default)
#   SLUICE_KIND_KEEP=1      keep the cluster (and print how to reach it)
#   SLUICE_IMAGE            image to build and load (default sluice:kind-e2e; not :latest, so the
#                           injected sidecar's default pull policy, IfNotPresent, uses the loaded one)
set -euo pipefail

cd "$(dirname "$0")/.."
CLUSTER="${SLUICE_KIND_CLUSTER:-sluice-e2e}"
IMAGE="${SLUICE_IMAGE:-sluice:kind-e2e}"
IMAGE_REPO="${IMAGE%:*}"
IMAGE_TAG="${IMAGE##*:}"
RELEASE_NS=sluice-system     # the tests' own operators use --operator-namespace sluice-system
SMOKE_NS=sluice-smoke
WORK="$(mktemp -d -t sluice-kind.XXXXXX)"
# Every kubectl and helm below talks to the kind cluster only.
export KUBECONFIG="$WORK/kubeconfig"
CREATED=""
PORT_FORWARD=""

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
  if [ -n "$PORT_FORWARD" ]; then kill "$PORT_FORWARD" 2>/dev/null || true; fi
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

# Retries CMD every second until it succeeds or SECONDS_MAX pass.
retry() {
  local max="$1"; shift
  local deadline=$((SECONDS + max))
  until "$@"; do
    ((SECONDS < deadline)) || return 1
    sleep 1
  done
}

for tool in docker kind kubectl helm cargo curl; do
  command -v "$tool" >/dev/null || die "$tool is required"
done
docker info >/dev/null 2>&1 || die "no Docker engine reachable (docker info failed)"
helm version --short | grep -q '^v3\.' || log "warning: the chart is tested with helm 3 ($(helm version --short))"
if kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
  die "a kind cluster named $CLUSTER exists already; delete it or set SLUICE_KIND_CLUSTER"
fi

log "building the e2e tests"
cargo test --test e2e_operator --no-run

log "building image $IMAGE"
DOCKER_BUILDKIT=1 docker build -t "$IMAGE" .

log "creating kind cluster $CLUSTER"
CREATED=1
kind create cluster --name "$CLUSTER" --kubeconfig "$KUBECONFIG" --wait 180s \
  ${SLUICE_KIND_NODE_IMAGE:+--image "$SLUICE_KIND_NODE_IMAGE"}
kind load docker-image "$IMAGE" --name "$CLUSTER"

# The Rust suite starts its own operators (local processes) in namespaces e2e-*, with their own
# Leases. The chart's operator must not be a second status writer there, and its policy webhook
# must not refuse what the suite stores on purpose (a CEL-valid policy the shared validation
# rejects, to see Accepted=False): both are scoped to the smoke namespace.
cat > "$WORK/values.yaml" <<EOF
image: {repository: "$IMAGE_REPO", tag: "$IMAGE_TAG", pullPolicy: Never}
operator:
  namespaces: [$SMOKE_NS]
  logFormat: text
webhooks:
  policies:
    namespaceSelector: {matchLabels: {sluice.dev/kind-smoke: "true"}}
EOF
log "installing the chart"
helm install sluice charts/sluice --namespace "$RELEASE_NS" --create-namespace \
  --values "$WORK/values.yaml" --wait --timeout 5m
kubectl -n "$RELEASE_NS" rollout status deployment/sluice --timeout=180s

# ---- what only a real cluster has ------------------------------------------------------------
kubectl create namespace "$SMOKE_NS"
kubectl label namespace "$SMOKE_NS" sluice.dev/kind-smoke=true

log "webhook: an invalid policy is refused through the Service"
cat > "$WORK/invalid.yaml" <<EOF
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: broken, namespace: $SMOKE_NS}
spec:
  rules:
    - name: r
      match: {paths: [{regex: "(unclosed"}]}
      key: [{header: X-API-Key}]
      algorithm: fixedWindow
      limit: {requests: 3, per: 1h}
EOF
refused() {
  local out
  if out="$(kubectl apply -f "$WORK/invalid.yaml" 2>&1)"; then
    kubectl delete -f "$WORK/invalid.yaml" --ignore-not-found >/dev/null 2>&1 || true
    return 1
  fi
  echo "$out" >&2
  grep -q 'denied the request' <<<"$out" && grep -q 'spec.rules\[0\].match.paths\[0\].regex' <<<"$out"
}
retry 60 refused || die "the validating webhook did not refuse the invalid policy"

log "policy: accepted and enforced"
cat > "$WORK/policy.yaml" <<EOF
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: echo, namespace: $SMOKE_NS}
spec:
  selector: {matchLabels: {app: echo}}
  rules:
    - name: per-key
      key: [{header: X-API-Key}]
      algorithm: fixedWindow
      limit: {requests: 3, per: 1h}
EOF
kubectl apply -f "$WORK/policy.yaml"
kubectl -n "$SMOKE_NS" wait --for=condition=Enforced rlp/echo --timeout=60s
kubectl -n "$SMOKE_NS" get rlp

log "injection: a labelled Deployment starts with the sidecar"
# The application is the same image running `sluice serve` (GET /healthz answers ok), so the
# smoke test needs no image from a registry.
cat > "$WORK/echo.yaml" <<EOF
apiVersion: v1
kind: ConfigMap
metadata: {name: echo-policies, namespace: $SMOKE_NS}
data:
  none.yaml: |
    apiVersion: sluice.dev/v1alpha1
    kind: RateLimitPolicy
    metadata: {name: unused, namespace: nowhere}
    spec:
      rules:
        - name: r
          key: [{literal: all}]
          algorithm: fixedWindow
          limit: {requests: 1, per: 1h}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: echo, namespace: $SMOKE_NS}
spec:
  replicas: 1
  selector: {matchLabels: {app: echo}}
  template:
    metadata:
      labels: {app: echo, sluice.dev/inject: "true"}
    spec:
      containers:
        - name: app
          image: $IMAGE
          imagePullPolicy: Never
          args: [serve, --policies, /policies/none.yaml, --listen, "0.0.0.0:8080"]
          ports: [{name: http, containerPort: 8080}]
          volumeMounts: [{name: policies, mountPath: /policies}]
      volumes:
        - name: policies
          configMap: {name: echo-policies}
EOF
kubectl apply -f "$WORK/echo.yaml"
kubectl -n "$SMOKE_NS" rollout status deployment/echo --timeout=180s
containers="$(kubectl -n "$SMOKE_NS" get pods -l app=echo -o jsonpath='{.items[0].spec.containers[*].name}')"
[[ " $containers " == *" sluice-sidecar "* ]] || die "no sidecar injected (containers: $containers)"

log "traffic: through the sidecar, 429 past the limit"
local_port=$((20000 + RANDOM % 10000))
kubectl -n "$SMOKE_NS" port-forward deployment/echo "$local_port:15080" >"$WORK/port-forward.log" 2>&1 &
PORT_FORWARD=$!
retry 30 curl -fsS -o /dev/null "http://127.0.0.1:$local_port/healthz" -H 'X-API-Key: warmup' \
  || die "the sidecar does not answer through port-forward"
codes=() last=""
for _ in 1 2 3 4 5 6 7; do
  last="$(curl -s -o /dev/null -D "$WORK/headers" -w '%{http_code}' "http://127.0.0.1:$local_port/healthz" -H 'X-API-Key: k1')"
  codes+=("$last")
  if [ "$last" = 429 ]; then
    grep -qi '^retry-after:' "$WORK/headers" || die "429 without Retry-After"
    break
  fi
done
log "status codes: ${codes[*]}"
# Without Redis each of the 2 operator replicas counts on its own (3 each): the first 3 requests
# always pass, and a 429 must come by the 7th whichever replicas answered.
[ "${codes[*]:0:3}" = "200 200 200" ] || die "the first 3 requests should pass: ${codes[*]}"
[ "$last" = 429 ] || die "no 429 within 7 requests: ${codes[*]}"
kill "$PORT_FORWARD" 2>/dev/null || true
PORT_FORWARD=""

# ---- the Rust e2e suite against the cluster --------------------------------------------------
# The operators it starts authenticate as the chart's ServiceAccount: a token, in a kubeconfig of
# its own next to the admin one.
token="$(kubectl -n "$RELEASE_NS" create token sluice --duration=2h)"
server="$(kubectl config view --raw --minify -o jsonpath='{.clusters[0].cluster.server}')"
ca="$(kubectl config view --raw --minify -o jsonpath='{.clusters[0].cluster.certificate-authority-data}')"
cat > "$WORK/operator.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: kind-$CLUSTER
  cluster: {server: "$server", certificate-authority-data: "$ca"}
users:
- name: sluice-operator
  user: {token: "$token"}
contexts:
- name: sluice-operator
  context: {cluster: kind-$CLUSTER, user: sluice-operator}
current-context: sluice-operator
EOF

log "running the e2e suite against the cluster"
[ "${1:-}" = "--" ] && shift
SLUICE_E2E_KUBECONFIG="$KUBECONFIG" SLUICE_E2E_OPERATOR_KUBECONFIG="$WORK/operator.kubeconfig" \
  cargo test --test e2e_operator "$@"
log "passed"
