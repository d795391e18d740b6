#!/usr/bin/env bash
# The install path on a real cluster, as a user runs it: shared by e2e/kind.sh (kind) and
# e2e/local-node.sh (the one-node cluster of e2e/node.sh), so passing on one is evidence for the
# other. Runs against $KUBECONFIG with kubectl and helm on PATH.
#
#   e2e/smoke.sh PHASE...
#
# Phases, in this order:
#   install    helm install charts/sluice (e2e/values/smoke.yaml + $SMOKE_VALUES), wait until the
#              Deployment is Available (readiness really passes)
#   verify     webhook caBundles filled; an invalid policy refused through the webhook Service; a
#              policy Enforced (apply-to-enforced time measured); a labelled Deployment's pods run
#              the injected sidecar next to the app (service redirect mode: the sidecar took the
#              app port's name; the app's probes, moved to the sidecar's admin port, pass);
#              traffic through the sidecar reaches the app and is answered 429 past the limit
#              with RateLimit headers, both through port-forward and from another pod through an
#              ordinary Service with `targetPort: http`; the generated NetworkPolicy admits only
#              the sidecar's ports; a Service with a numeric targetPort is reported
#              (SidecarBypassed Event)
#   iptables   a Deployment annotated sluice.dev/redirect: iptables: its init container installs
#              the redirect; another pod dialling the app's own port (pod IP:8080) and a Service
#              with a numeric targetPort are both limited; measures the redirect's added latency
#              (when the pod network is reachable from here) and the init container's start-up cost
#   jobs       native sidecars (the chart's sidecar.kind auto, on a 1.29+ API server): a labelled
#              Job's pod has the sidecar in initContainers with restartPolicy Always, its app
#              reaches the sidecar's admin port from its first instant, and the Job completes
#              (the sidecar stopped after the app); a CronJob's run (kubectl create job --from)
#              completes too
#   drain      a rolling restart while a slow request (15 s) is in flight through the sidecar, for
#              a native and a classic (sluice.dev/sidecar-kind: classic) sidecar: the request
#              completes with 200 from the old pod, and new requests reach the new pod
#   failover   delete the Lease holder's pod: the Lease moves to the other replica (time measured),
#              which writes status for a policy change, and enforcement continues
#   upgrade    helm upgrade with a changed value rolls every operator pod; enforcement continues
#   suite      the operator's Rust e2e suite (cargo test --test e2e_operator) against this cluster,
#              its operators authenticating with a token of the chart's ServiceAccount, so the
#              chart's RBAC is what it proves sufficient (extra cargo test args: $SMOKE_SUITE_ARGS)
#   uninstall  helm uninstall leaves no webhook configuration, and pod creation in the labelled
#              namespace is not blocked
#
# Environment:
#   SLUICE_IMAGE     image the chart runs, REPO:TAG (required)
#   SMOKE_VALUES     extra values files, space-separated (e.g. the pull policy of a node)
#   SMOKE_APP_IMAGE  the upstream app's image, a busybox (default busybox:1.36)
#   SMOKE_WORK       scratch directory (default: a temporary one)
# Figures are printed as lines starting with "smoke: measured".
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CHART="$HERE/../charts/sluice"
RELEASE_NS=sluice-system
SMOKE_NS=sluice-smoke
: "${SLUICE_IMAGE:?SLUICE_IMAGE=REPO:TAG is required}"
APP_IMAGE="${SMOKE_APP_IMAGE:-busybox:1.36}"
WORK="${SMOKE_WORK:-$(mktemp -d -t sluice-smoke.XXXXXX)}"
mkdir -p "$WORK"
PORT_FORWARD=""

log() { echo "smoke: $*" >&2; }
die() { log "FAILED: $*"; diagnostics; exit 1; }

diagnostics() {
  log "diagnostics:"
  kubectl get pods -A -o wide >&2 || true
  kubectl -n "$RELEASE_NS" logs deployment/sluice --all-containers --tail=60 >&2 || true
  kubectl -n "$SMOKE_NS" describe pods >&2 || true
  kubectl -n "$SMOKE_NS" logs deployment/echo --all-containers --tail=40 >&2 || true
  kubectl get events -A --sort-by=.lastTimestamp 2>/dev/null | tail -30 >&2 || true
}

stop_port_forward() {
  if [ -n "$PORT_FORWARD" ]; then kill "$PORT_FORWARD" 2>/dev/null || true; wait "$PORT_FORWARD" 2>/dev/null || true; fi
  PORT_FORWARD=""
}
trap stop_port_forward EXIT

# Retries CMD every half second until it succeeds or MAX seconds pass.
retry() {
  local max="$1"; shift
  local deadline=$((SECONDS + max))
  until "$@"; do
    ((SECONDS < deadline)) || return 1
    sleep 0.5
  done
}

now_ms() { date +%s%3N; }
seconds_since() { awk -v a="$1" -v b="$(now_ms)" 'BEGIN { printf "%.1f", (b - a) / 1000 }'; }

helm_values() {
  local args=(--values "$HERE/values/smoke.yaml" --set "image.repository=${SLUICE_IMAGE%:*}" --set "image.tag=${SLUICE_IMAGE##*:}")
  local file
  for file in ${SMOKE_VALUES:-}; do args+=(--values "$file"); done
  printf '%s\n' "${args[@]}"
}

# Running operator pods, without those being deleted: a terminating pod stays phase Running until
# its container exits, so the phase alone would count a pod the rollout already replaced.
operator_pods() {
  kubectl -n "$RELEASE_NS" get pods -l app.kubernetes.io/name=sluice \
    --field-selector=status.phase=Running \
    -o jsonpath='{range .items[*]}{.metadata.name} {.metadata.deletionTimestamp}{"\n"}{end}' \
    | awk 'NF == 1 { printf "%s ", $1 }'
}

# The Service sends traffic to exactly the running operator pods, all ready: after a rollout the
# sidecar's next connection must not be routed to a pod that is going away.
service_routes_to_operator_pods() {
  local routed pods
  routed="$(kubectl -n "$RELEASE_NS" get endpointslices -l kubernetes.io/service-name=sluice \
    -o jsonpath='{range .items[*].endpoints[*]}{.targetRef.name}={.conditions.ready} {end}' | tr ' ' '\n' | sort | xargs)"
  pods="$(for pod in $(operator_pods); do echo "$pod=true"; done | sort | xargs)"
  [ -n "$pods" ] && [ "$routed" = "$pods" ]
}

# After a rollout: the replaced pods are gone and the Service routes only to their successors.
settle_after_rollout() {  # settle_after_rollout OLD_PODS...
  local pod
  for pod in "$@"; do
    kubectl -n "$RELEASE_NS" wait --for=delete "pod/$pod" --timeout=120s >&2 \
      || die "pod $pod was not removed after the rollout"
  done
  retry 60 service_routes_to_operator_pods \
    || die "the Service does not route to exactly the operator pods ($(operator_pods))"
}

phase_install() {
  log "install: helm install charts/sluice"
  local values; mapfile -t values < <(helm_values)
  helm install sluice "$CHART" --namespace "$RELEASE_NS" --create-namespace "${values[@]}" \
    --wait --timeout 5m || die "helm install did not finish"
  kubectl -n "$RELEASE_NS" wait --for=condition=Available deployment/sluice --timeout=180s \
    || die "the Deployment is not Available"
  kubectl -n "$RELEASE_NS" get pods -o wide >&2
}

ca_bundles_filled() {
  local kind bundles
  for kind in validatingwebhookconfiguration mutatingwebhookconfiguration; do
    bundles="$(kubectl get "$kind" sluice -o jsonpath='{range .webhooks[*]}{.clientConfig.caBundle}{"\n"}{end}')"
    if [ -z "$bundles" ] || grep -qx '' <<<"$bundles"; then return 1; fi
  done
}

refused() {
  local out
  if out="$(kubectl apply -f "$WORK/invalid.yaml" 2>&1)"; then
    kubectl delete -f "$WORK/invalid.yaml" --ignore-not-found >/dev/null 2>&1 || true
    return 1
  fi
  echo "$out" >&2
  grep -q 'denied the request' <<<"$out" && grep -q 'spec.rules\[0\].match.paths\[0\].regex' <<<"$out"
}

write_policy() {  # write_policy LIMIT
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
      limit: {requests: $1, per: 1h}
EOF
}

# Enforced=True for the policy's current generation.
enforced_now() {
  local out gen observed status
  out="$(kubectl -n "$SMOKE_NS" get rlp echo -o jsonpath='{.metadata.generation} {.status.observedGeneration} {.status.conditions[?(@.type=="Enforced")].status}')"
  read -r gen observed status <<<"$out"
  [ "$gen" = "$observed" ] && [ "$status" = True ]
}

# apply_policy LIMIT: applies it and prints how long until Enforced for its generation.
apply_policy() {
  write_policy "$1"
  local start; start="$(now_ms)"
  kubectl apply -f "$WORK/policy.yaml" >&2
  # The condition must be about this generation, not a previous one.
  sleep 0.05
  retry 60 enforced_now || die "policy not Enforced within 60 s"
  seconds_since "$start"
}

start_port_forward() {
  stop_port_forward
  local port=$((20000 + RANDOM % 10000))
  kubectl -n "$SMOKE_NS" port-forward deployment/echo "$port:15080" >"$WORK/port-forward.log" 2>&1 &
  PORT_FORWARD=$!
  SIDECAR="http://127.0.0.1:$port"
  retry 30 curl -fsS -o /dev/null "$SIDECAR/healthz" -H 'X-API-Key: warmup' \
    || { cat "$WORK/port-forward.log" >&2; die "the sidecar does not answer through port-forward"; }
}

# expect_limit KEY LIMIT: through the sidecar, the first LIMIT requests reach the app, and a 429
# with Retry-After and RateLimit headers comes by request 2*LIMIT+1 (without Redis each of the
# two operator replicas counts on its own).
expect_limit() {
  local key="$1" limit="$2" codes=() last="" body i
  for ((i = 1; i <= 2 * limit + 1; i++)); do
    last="$(curl -s -o "$WORK/body" -D "$WORK/headers" -w '%{http_code}' "$SIDECAR/healthz" -H "X-API-Key: $key")"
    codes+=("$last")
    if ((i <= limit)); then
      [ "$last" = 200 ] || die "request $i of key $key should reach the app: ${codes[*]}"
      body="$(cat "$WORK/body")"
      [ "$body" = ok ] || die "request $i of key $key did not get the app's answer: $body"
      grep -qi '^ratelimit-policy:' "$WORK/headers" || die "a 200 without RateLimit-Policy"
    fi
    if [ "$last" = 429 ]; then
      grep -qi '^retry-after:' "$WORK/headers" || die "429 without Retry-After"
      grep -qi '^ratelimit:' "$WORK/headers" || die "429 without RateLimit"
      grep -qi '^ratelimit-policy:' "$WORK/headers" || die "429 without RateLimit-Policy"
      break
    fi
  done
  log "key $key, limit $limit: ${codes[*]}"
  [ "$last" = 429 ] || die "no 429 within $((2 * limit + 1)) requests: ${codes[*]}"
}

# write_app NAME MODE: the demo app's Deployment (busybox httpd on a port named http, with
# probes on it), labelled for injection, in redirect mode MODE.
write_app() {
  cat <<EOF
apiVersion: apps/v1
kind: Deployment
metadata: {name: $1, namespace: $SMOKE_NS}
spec:
  replicas: 1
  selector: {matchLabels: {app: $1}}
  template:
    metadata:
      labels: {app: $1, sluice.dev/inject: "true"}
      annotations: {sluice.dev/redirect: $2}
    spec:
      containers:
        - name: app
          image: $APP_IMAGE
          imagePullPolicy: IfNotPresent
          command: [sh, -c, "mkdir -p /tmp/www && echo ok > /tmp/www/healthz && exec httpd -f -p 8080 -h /tmp/www"]
          ports: [{name: http, containerPort: 8080}]
          # Moved to the sidecar's admin port by the webhook, which runs them against the app.
          readinessProbe: {httpGet: {path: /healthz, port: http}, periodSeconds: 2}
          livenessProbe: {tcpSocket: {port: 8080}, periodSeconds: 10}
EOF
}

phase_verify() {
  kubectl create namespace "$SMOKE_NS" --dry-run=client -o yaml | kubectl apply -f - >/dev/null
  kubectl label namespace "$SMOKE_NS" sluice.dev/kind-smoke=true --overwrite >/dev/null

  log "verify: the webhook configurations get the operator's caBundle"
  retry 60 ca_bundles_filled || die "a webhook has no caBundle"

  log "verify: an invalid policy is refused through the webhook Service"
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
  retry 60 refused || die "the validating webhook did not refuse the invalid policy"

  log "verify: a policy is accepted and enforced"
  local took; took="$(apply_policy 3)"
  log "measured apply-to-enforced (new policy): $took s"
  kubectl -n "$SMOKE_NS" get rlp >&2

  log "verify: the operator chose the sidecar kind (--sidecar-kind auto) and logged why"
  local chosen
  chosen="$(kubectl -n "$RELEASE_NS" logs deployment/sluice | grep -m1 'injected sidecars are' || true)"
  [ -n "$chosen" ] || die "the operator did not log its sidecar kind"
  log "operator: $chosen"

  log "verify: a labelled Deployment runs the injected sidecar next to the app"
  write_app echo service > "$WORK/echo.yaml"
  kubectl apply -f "$WORK/echo.yaml" >&2
  kubectl -n "$SMOKE_NS" rollout status deployment/echo --timeout=180s >&2 || die "the app did not roll out"
  local ready
  # The sidecar is native (an init container) or classic (a container): both lists.
  ready="$(kubectl -n "$SMOKE_NS" get pods -l app=echo -o jsonpath='{range .items[0].status.initContainerStatuses[*]}{.name}={.ready} {end}{range .items[0].status.containerStatuses[*]}{.name}={.ready} {end}')"
  log "app pod containers: $ready"
  [[ " $ready " == *" sluice-sidecar=true "* ]] || die "no ready sluice-sidecar container (containers: $ready)"
  [[ " $ready " == *" app=true "* ]] || die "the app container is not ready (containers: $ready)"

  log "verify: traffic through the sidecar, 429 past the limit"
  start_port_forward
  expect_limit k1 3
  decided_by_endpoint
  log "verify: the sidecar took over the app port's name; the app's probes run through its admin port"
  local names probe
  names="$(kubectl -n "$SMOKE_NS" get pods -l app=echo -o jsonpath='{range .items[0].spec.initContainers[*]}{.name}:{range .ports[*]}{.name}={.containerPort},{end} {end}{range .items[0].spec.containers[*]}{.name}:{range .ports[*]}{.name}={.containerPort},{end} {end}')"
  log "container ports: $names"
  [[ " $names " == *" sluice-sidecar:http=15080,"* ]] || die "the sidecar's listener is not named http: $names"
  [[ " $names " == *" app:=8080,"* ]] || die "the app's port kept its name: $names"
  probe="$(kubectl -n "$SMOKE_NS" get pods -l app=echo -o jsonpath='{.items[0].spec.containers[0].readinessProbe.httpGet.port}{.items[0].spec.containers[0].readinessProbe.httpGet.path}')"
  [ "$probe" = "15081/app-health/app/readyz" ] || die "the app's readiness probe was not moved to the sidecar: $probe"

  log "verify: from another pod through an ordinary Service (targetPort: http), 429 past the limit"
  cat > "$WORK/echo-service.yaml" <<EOF
apiVersion: v1
kind: Service
metadata: {name: echo, namespace: $SMOKE_NS}
spec:
  selector: {app: echo}
  ports: [{name: http, port: 80, targetPort: http}]
EOF
  kubectl apply -f "$WORK/echo-service.yaml" >&2
  start_client
  local service_ip
  service_ip="$(kubectl -n "$SMOKE_NS" get service echo -o jsonpath='{.spec.clusterIP}')"
  retry 60 client_reaches "http://$service_ip/healthz" \
    || { cat "$WORK/client-out" >&2; die "the client pod does not reach the echo Service"; }
  expect_limit_from_client "http://$service_ip/healthz" k-svc 3

  log "verify: the NetworkPolicy admits ingress to the injected pod only on the sidecar's ports"
  local label policy
  label="$(kubectl -n "$SMOKE_NS" get pods -l app=echo -o jsonpath='{.items[0].metadata.labels.sluice\.dev/ingress-ports}')"
  [ "$label" = 15080.15081 ] || die "the injected pod's sluice.dev/ingress-ports label is $label"
  retry 60 kubectl -n "$SMOKE_NS" get networkpolicy sluice-ingress-15080-15081 -o json >"$WORK/networkpolicy.json" 2>/dev/null \
    || die "no NetworkPolicy sluice-ingress-15080-15081"
  policy="$(jq -c '[.spec.podSelector.matchLabels, .spec.policyTypes, .spec.ingress]' "$WORK/networkpolicy.json")"
  log "NetworkPolicy: $policy"
  [ "$policy" = '[{"sluice.dev/ingress-ports":"15080.15081"},["Ingress"],[{"ports":[{"port":15080,"protocol":"TCP"},{"port":15081,"protocol":"TCP"}]}]]' ] \
    || die "the NetworkPolicy is not what injected pods need: $policy"

  phase_egress_in_pod

  log "verify: a Service with a numeric targetPort to the app is reported"
  cat > "$WORK/echo-direct.yaml" <<EOF
apiVersion: v1
kind: Service
metadata: {name: echo-direct, namespace: $SMOKE_NS}
spec:
  selector: {app: echo}
  ports: [{port: 80, targetPort: 8080}]
EOF
  kubectl apply -f "$WORK/echo-direct.yaml" >&2
  retry 60 bypass_reported echo-direct || die "no SidecarBypassed Event on the Service echo-direct"
  kubectl -n "$SMOKE_NS" delete service echo-direct >&2
}

# A Warning SidecarBypassed Event regards Service $1.
bypass_reported() {
  kubectl -n "$SMOKE_NS" get events -o json \
    | jq -e --arg name "$1" '[.items[] | select(.reason == "SidecarBypassed" and .involvedObject.name == $name)] | length > 0' >/dev/null
}

# The egress path in a real pod (docs/egress.md): a policy offers the echo pods a downstream (their
# own httpd on loopback, so nothing else is needed), the sidecar binds its listen port once its
# snapshot has the entry, and calls made at once leave one interval apart, each told its wait.
egress_answers() {
  [ "$(kubectl -n "$SMOKE_NS" exec deploy/echo -c app -- sh -c 'timeout 10 wget -q -O - http://127.0.0.1:15100/healthz' 2>/dev/null)" = ok ]
}

phase_egress_in_pod() {
  log "verify: egress through the sidecar: calls wait for their slots in the shared budget"
  cat > "$WORK/egress.yaml" <<EOF
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: echo-egress, namespace: $SMOKE_NS}
spec:
  selector: {matchLabels: {app: echo}}
  egress:
    - name: self
      destination: http://127.0.0.1:8080
      listenPort: 15100
      limit: {requests: 2, per: 1s, maxDelay: 5s}
EOF
  kubectl apply -f "$WORK/egress.yaml" >&2 || die "the egress policy was refused"
  retry 60 egress_answers || die "the app's egress port (127.0.0.1:15100) never answered ok"
  sleep 2
  # Four calls at once at 2 a second: waits of about 0, 500, 1000 and 1500 ms.
  kubectl -n "$SMOKE_NS" exec deploy/echo -c app -- sh -c \
    'for i in 1 2 3 4; do (timeout 15 wget -S -O /dev/null http://127.0.0.1:15100/healthz 2>&1 | grep -i "sluice-egress-waited-ms") & done; wait' \
    >"$WORK/egress-out" 2>&1 || true
  local waits most
  waits="$(awk -F': *' '{print $2 + 0}' "$WORK/egress-out" | sort -n | tr '\n' ' ')"
  log "egress waits (ms): $waits"
  [ "$(wc -l <"$WORK/egress-out")" = 4 ] || { cat "$WORK/egress-out" >&2; die "not every egress call answered with its wait"; }
  most="$(awk -F': *' '{print $2 + 0}' "$WORK/egress-out" | sort -n | tail -1)"
  ((most >= 1000 && most <= 5000)) || die "the egress calls were not spaced by the budget: waits $waits"
  kubectl delete -f "$WORK/egress.yaml" >&2
}

# A plain pod (not injected) to send traffic from inside the pod network. Its busybox is Debian's
# static build, whose wget cannot resolve names (static glibc has no NSS: it crashes), so it is
# given addresses: a Service's ClusterIP (still kube-proxy's Service path) or a pod IP. Its own
# -T timeout crashes it too: busybox's timeout applet bounds it instead.
start_client() {
  kubectl -n "$SMOKE_NS" get pod client >/dev/null 2>&1 && return 0
  kubectl -n "$SMOKE_NS" run client --image="$APP_IMAGE" --image-pull-policy=IfNotPresent --restart=Never \
    --command -- sleep 86400 >&2
  kubectl -n "$SMOKE_NS" wait --for=condition=Ready pod/client --timeout=120s >&2 || die "the client pod is not ready"
}

# client_get URL KEY: from the client pod; prints the status code, leaves $WORK/client-out
# (the response's headers, then the body after a ---BODY--- line; busybox wget shows only the
# status line of an error response).
client_get() {
  kubectl -n "$SMOKE_NS" exec client -- sh -c \
    "rm -f /tmp/body; timeout 10 wget -S -O /tmp/body --header 'X-API-Key: $2' '$1' 2>/tmp/headers; cat /tmp/headers; echo ---BODY---; cat /tmp/body 2>/dev/null; rm -f /tmp/body" \
    >"$WORK/client-out" 2>&1 || true
  { grep -o 'HTTP/1\.[01] [0-9]*' "$WORK/client-out" || true; } | tail -1 | cut -d' ' -f2
}

client_reaches() { [ -n "$(client_get "$1" "warmup-$RANDOM")" ]; }

# expect_limit_from_client URL KEY LIMIT: as expect_limit, from the client pod.
expect_limit_from_client() {
  local url="$1" key="$2" limit="$3" codes=() last="" i
  for ((i = 1; i <= 2 * limit + 1; i++)); do
    last="$(client_get "$url" "$key")"
    codes+=("$last")
    if ((i <= limit)); then
      [ "$last" = 200 ] || { cat "$WORK/client-out" >&2; die "request $i of key $key to $url should reach the app: ${codes[*]}"; }
      [ "$(sed -n '/^---BODY---$/,$p' "$WORK/client-out" | sed 1d)" = ok ] || die "request $i of key $key did not get the app's answer"
      grep -qi 'ratelimit-policy:' "$WORK/client-out" || die "a 200 from $url without RateLimit-Policy: it did not pass the sidecar"
    fi
    [ "$last" = 429 ] && break
  done
  log "from the client pod, $url key $key, limit $limit: ${codes[*]}"
  [ "$last" = 429 ] || die "no 429 from $url within $((2 * limit + 1)) requests: ${codes[*]}"
}

# The iptables redirect mode, per pod: nothing reaches the app's port but through the sidecar.
phase_iptables() {
  log "iptables: a Deployment annotated sluice.dev/redirect: iptables"
  cat > "$WORK/policy-ipt.yaml" <<EOF
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: echo-ipt, namespace: $SMOKE_NS}
spec:
  selector: {matchLabels: {app: echo-ipt}}
  rules:
    - name: per-key
      # Requests without the key (the latency measurement) are not limited.
      key: [{header: X-API-Key, missing: skip}]
      algorithm: fixedWindow
      limit: {requests: 3, per: 1h}
EOF
  kubectl apply -f "$WORK/policy-ipt.yaml" >&2
  write_app echo-ipt iptables > "$WORK/echo-ipt.yaml"
  kubectl apply -f "$WORK/echo-ipt.yaml" >&2
  kubectl -n "$SMOKE_NS" rollout status deployment/echo-ipt --timeout=180s >&2 || die "the iptables Deployment did not roll out"
  local pod ip
  pod="$(app_pod echo-ipt)"
  [ -n "$pod" ] || die "no running echo-ipt pod"
  ip="$(kubectl -n "$SMOKE_NS" get pod "$pod" -o jsonpath='{.status.podIP}')"
  log "iptables: the init container's rules:"
  local rules
  rules="$(kubectl -n "$SMOKE_NS" logs "$pod" -c sluice-init)" || die "no log from sluice-init"
  printf '%s\n' "$rules" >&2
  # Read whole first: `kubectl logs | grep -q` fails under pipefail whenever grep's early exit
  # ends kubectl's write (SIGPIPE), although the line is there.
  grep -q -- '--dport 8080 -j REDIRECT --to-ports 15080' <<<"$rules" || die "sluice-init did not install the redirect of 8080"

  log "iptables: another pod dials the app's own port ($ip:8080): it goes through the sidecar"
  start_client
  expect_limit_from_client "http://$ip:8080/healthz" k-direct 3
  log "iptables: a Service with a numeric targetPort is limited too"
  cat > "$WORK/echo-ipt-service.yaml" <<EOF
apiVersion: v1
kind: Service
metadata: {name: echo-ipt, namespace: $SMOKE_NS}
spec:
  selector: {app: echo-ipt}
  ports: [{port: 80, targetPort: 8080}]
EOF
  kubectl apply -f "$WORK/echo-ipt-service.yaml" >&2
  local service_ip
  service_ip="$(kubectl -n "$SMOKE_NS" get service echo-ipt -o jsonpath='{.spec.clusterIP}')"
  retry 60 client_reaches "http://$service_ip/healthz" \
    || { cat "$WORK/client-out" >&2; die "the client pod does not reach the echo-ipt Service"; }
  expect_limit_from_client "http://$service_ip/healthz" k-ipt-svc 3
  local np
  np="$(kubectl -n "$SMOKE_NS" get pod "$pod" -o jsonpath='{.metadata.labels.sluice\.dev/ingress-ports}')"
  [ "$np" = 8080.15080.15081 ] || die "the iptables pod's ingress ports are $np"
  retry 60 kubectl -n "$SMOKE_NS" get networkpolicy sluice-ingress-8080-15080-15081 >/dev/null 2>&1 \
    || die "no NetworkPolicy for the iptables pod's ports"

  startup_cost echo echo-ipt
  redirect_latency "$ip"
}

# write_job_template NAME: a labelled Job pod template whose app first asks the sidecar's admin
# port, once, without retrying (a native sidecar is up before the app starts), then works two
# seconds and exits 0.
write_job_template() {
  cat <<EOF
    metadata:
      labels: {app: $1, sluice.dev/inject: "true"}
    spec:
      restartPolicy: Never
      containers:
        - name: app
          image: $APP_IMAGE
          imagePullPolicy: IfNotPresent
          command: [sh, -c, "timeout 5 wget -q -O - http://127.0.0.1:15081/healthz && sleep 2"]
EOF
}

# expect_job_complete JOB: the Job completes within 120 s (else its pod is described); its pod
# had a native sidecar, which was stopped after the app.
expect_job_complete() {
  local job="$1" start pod sidecars order app_end sidecar_end
  start="$(now_ms)"
  if ! kubectl -n "$SMOKE_NS" wait --for=condition=Complete "job/$job" --timeout=120s >&2; then
    kubectl -n "$SMOKE_NS" describe pods -l "job-name=$job" >&2 || true
    kubectl -n "$SMOKE_NS" logs -l "job-name=$job" --all-containers --tail=20 >&2 || true
    die "the Job $job did not complete within 120 s"
  fi
  log "measured Job $job complete: $(seconds_since "$start") s after it was created"
  pod="$(kubectl -n "$SMOKE_NS" get pods -l "job-name=$job" -o jsonpath='{.items[0].metadata.name}')"
  sidecars="$(kubectl -n "$SMOKE_NS" get pod "$pod" -o jsonpath='{range .spec.initContainers[*]}{.name}={.restartPolicy} {end}')"
  log "Job $job, pod $pod, init containers: $sidecars"
  [[ " $sidecars " == *" sluice-sidecar=Always "* ]] || die "the Job's pod has no native sidecar: $sidecars"
  [ "$(kubectl -n "$SMOKE_NS" get pod "$pod" -o jsonpath='{.metadata.annotations.sluice\.dev/sidecar-kind}')" = native ] \
    || die "the Job's pod is not stamped sluice.dev/sidecar-kind: native"
  [ "$(kubectl -n "$SMOKE_NS" get pod "$pod" -o jsonpath='{.status.phase}')" = Succeeded ] || die "the Job's pod did not succeed"
  # Shutdown order: the app finished first, the sidecar was stopped after it.
  order="$(kubectl -n "$SMOKE_NS" get pod "$pod" -o json | jq -r '
    [(.status.containerStatuses[] | select(.name == "app") | .state.terminated.finishedAt),
     (.status.initContainerStatuses[] | select(.name == "sluice-sidecar") | .state.terminated | "\(.finishedAt) \(.exitCode)")] | join(" ")')"
  log "Job $job: the app finished at, the sidecar finished at and its exit code: $order"
  read -r app_end sidecar_end _ <<<"$order"
  if [ -z "$sidecar_end" ] || [ "$sidecar_end" = null ]; then die "the sidecar of the Job's pod did not stop: $order"; fi
  [[ ! "$sidecar_end" < "$app_end" ]] || die "the sidecar stopped before the app: $order"
}

# Native sidecars: a Job's and a CronJob's pods complete.
phase_jobs() {
  log "jobs: a labelled Job completes: its native sidecar is up before the app and stopped after it"
  kubectl -n "$SMOKE_NS" delete job job-once cron-now --ignore-not-found >&2
  {
    cat <<EOF
apiVersion: batch/v1
kind: Job
metadata: {name: job-once, namespace: $SMOKE_NS}
spec:
  backoffLimit: 0
  template:
EOF
    write_job_template job-once
  } > "$WORK/job.yaml"
  kubectl apply -f "$WORK/job.yaml" >&2
  expect_job_complete job-once

  log "jobs: a CronJob's run completes (created at once with kubectl create job --from)"
  {
    cat <<EOF
apiVersion: batch/v1
kind: CronJob
metadata: {name: cron, namespace: $SMOKE_NS}
spec:
  schedule: "* * * * *"
  # Run by hand below rather than waiting up to a minute for the schedule.
  suspend: true
  jobTemplate:
    spec:
      backoffLimit: 0
      template:
EOF
    write_job_template cron | sed 's/^/    /'
  } > "$WORK/cronjob.yaml"
  kubectl apply -f "$WORK/cronjob.yaml" >&2
  kubectl -n "$SMOKE_NS" create job cron-now --from=cronjob/cron >&2
  expect_job_complete cron-now
  # cron-now is the CronJob's (ownerReference): it goes with it.
  kubectl -n "$SMOKE_NS" delete cronjob cron >&2
  kubectl -n "$SMOKE_NS" delete job job-once cron-now --ignore-not-found --wait=false >&2
}

# write_slow_app NAME KIND: a Deployment whose app answers /cgi-bin/slow?SECONDS that many
# seconds later (busybox httpd CGI) with its pod's name and, like a well-behaved server, finishes
# what it serves on SIGTERM (it exits 20 s later), with a KIND sidecar; and its Service.
write_slow_app() {
  cat <<EOF
apiVersion: v1
kind: ConfigMap
metadata: {name: slow-cgi, namespace: $SMOKE_NS}
data:
  slow: |
    #!/bin/sh
    sleep "\${QUERY_STRING:-0}"
    printf 'Content-Type: text/plain\r\n\r\n'
    hostname
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: $1, namespace: $SMOKE_NS}
spec:
  replicas: 1
  selector: {matchLabels: {app: $1}}
  template:
    metadata:
      labels: {app: $1, sluice.dev/inject: "true"}
      annotations: {sluice.dev/sidecar-kind: $2}
    spec:
      terminationGracePeriodSeconds: 40
      volumes: [{name: cgi, configMap: {name: slow-cgi, defaultMode: 0755}}]
      containers:
        - name: app
          image: $APP_IMAGE
          imagePullPolicy: IfNotPresent
          command: [sh, -c, "httpd -f -p 8080 -h /www & trap 'sleep 20; exit 0' TERM; wait"]
          volumeMounts: [{name: cgi, mountPath: /www/cgi-bin}]
          ports: [{name: http, containerPort: 8080}]
          readinessProbe: {tcpSocket: {port: http}, periodSeconds: 1}
---
apiVersion: v1
kind: Service
metadata: {name: $1, namespace: $SMOKE_NS}
spec:
  selector: {app: $1}
  ports: [{name: http, port: 80, targetPort: http}]
EOF
}

# The body of the client pod's last client_get.
client_body() { sed -n '/^---BODY---$/,$p' "$WORK/client-out" | sed 1d; }

# Pod $1 is being deleted (or gone).
pod_terminating() {
  local deleting
  deleting="$(kubectl -n "$SMOKE_NS" get pod "$1" -o jsonpath='{.metadata.deletionTimestamp}' 2>/dev/null)" || return 0
  [ -n "$deleting" ]
}

# DRAIN_IP answers with pod $1's name: its CGI runs (any answer is not enough: a 404 says the
# app does not serve the script yet).
pod_answers() {
  [ "$(client_get "http://$DRAIN_IP/cgi-bin/slow?0" "drain-$RANDOM")" = 200 ] && [ "$(client_body)" = "$1" ]
}

# A rolling restart while a request is in flight through the sidecar, native and classic.
phase_drain() {
  start_client
  local app kind old bg out_file code_file body
  for app in slow:native slow-classic:classic; do
    kind="${app#*:}"; app="${app%%:*}"
    log "drain ($kind sidecar): a rolling restart while a 15 s request is in flight"
    write_slow_app "$app" "$kind" > "$WORK/$app.yaml"
    kubectl apply -f "$WORK/$app.yaml" >&2
    kubectl -n "$SMOKE_NS" rollout status "deployment/$app" --timeout=180s >&2 || die "$app did not roll out"
    old="$(app_pod "$app")"
    DRAIN_IP="$(kubectl -n "$SMOKE_NS" get service "$app" -o jsonpath='{.spec.clusterIP}')"
    retry 60 pod_answers "$old" \
      || { cat "$WORK/client-out" >&2; die "the $app Service does not answer from its pod $old"; }
    out_file="$WORK/$app-inflight.out"; code_file="$WORK/$app-inflight.code"
    rm -f "$out_file" "$code_file"
    # busybox wget exits non-zero on anything but a 2xx.
    # set +e: the subshell inherits -e, which would end it before a failure's status is written.
    ( set +e; kubectl -n "$SMOKE_NS" exec client -- sh -c "timeout 60 wget -q -O - 'http://$DRAIN_IP/cgi-bin/slow?15'" >"$out_file" 2>&1
      echo $? >"$code_file" ) &
    bg=$!
    sleep 2
    kubectl -n "$SMOKE_NS" rollout restart "deployment/$app" >&2
    # The old pod must be terminating while the request is still in flight, or nothing was tested.
    retry 60 pod_terminating "$old" || die "the old pod $old was not terminated"
    [ ! -s "$code_file" ] || die "the request ended before the old pod $old was terminating: $(cat "$out_file")"
    log "drain ($kind): $old is terminating, the request still in flight"
    wait "$bg" || true
    if [ "$(cat "$code_file")" != 0 ]; then
      kubectl -n "$SMOKE_NS" logs "$old" --all-containers --prefix --tail=30 >&2 || true
      die "the in-flight request through the $kind sidecar failed (exit $(cat "$code_file")): $(cat "$out_file")"
    fi
    body="$(cat "$out_file")"
    [ "$body" = "$old" ] || die "the in-flight request was not answered by the old pod $old: $body"
    log "drain ($kind): the in-flight request completed with 200 from $old"
    kubectl -n "$SMOKE_NS" rollout status "deployment/$app" --timeout=180s >&2 || die "$app did not roll out again"
    DRAIN_NEW="$(app_pod "$app")"
    retry 60 pod_answers "$DRAIN_NEW" || { cat "$WORK/client-out" >&2; die "new requests do not reach the new pod $DRAIN_NEW"; }
    log "drain ($kind): new requests reach $DRAIN_NEW"
    kubectl -n "$SMOKE_NS" delete deployment "$app" --wait=false >&2
  done
}

# The running pod of app $1 that is not being deleted (a replaced one may still be listed).
app_pod() {
  kubectl -n "$SMOKE_NS" get pods -l "app=$1" --field-selector=status.phase=Running \
    -o jsonpath='{range .items[*]}{.metadata.name} {.metadata.deletionTimestamp}{"\n"}{end}' | awk 'NF == 1 { print $1; exit }'
}

# Seconds from a pod's start to Ready (conditions have whole seconds), and the init container's run.
startup_cost() {
  local app json
  for app in "$@"; do
    json="$(kubectl -n "$SMOKE_NS" get pod "$(app_pod "$app")" -o json)"
    log "measured pod start-up ($app): $(jq -r '[.status.startTime, (.status.conditions[] | select(.type == "Ready") | .lastTransitionTime)] | map(fromdateiso8601) | "\(.[1] - .[0]) s to Ready"' <<<"$json")$(jq -r '.status.initContainerStatuses // [] | map(select(.name == "sluice-init") | .state.terminated | ", sluice-init ran \((.finishedAt | fromdateiso8601) - (.startedAt | fromdateiso8601)) s") | join("")' <<<"$json")"
  done
}

# The redirect's added latency: the same requests to the app's port (redirected) and to the
# sidecar's port, sequentially, on kept-alive and on new connections; and, for scale, to the
# service-mode pod's app port, which nothing redirects (no sidecar at all). Only where the pod
# network is reachable from this shell (the one-node cluster's namespace, not kind's host).
redirect_latency() {
  local ip="$1" direct target mode
  if ! curl -s -o /dev/null --max-time 2 "http://$ip:15081/healthz"; then
    log "redirect latency: not measured (the pod network is not reachable from here)"
    return 0
  fi
  direct="$(kubectl -n "$SMOKE_NS" get pod "$(app_pod echo)" -o jsonpath='{.status.podIP}')"
  for mode in keep-alive close; do
    for target in "$ip:8080 redirected to the sidecar" "$ip:15080 the sidecar's port" "$direct:8080 the app, no sidecar"; do
      for _ in $(seq 300); do printf 'url = "http://%s/healthz"\noutput = "/dev/null"\n' "${target%% *}"; done > "$WORK/curl-urls"
      curl -s -K "$WORK/curl-urls" -H "Connection: $mode" -w '%{time_total}\n' \
        | sort -n | awk -v what="$mode, ${target#* }" '{ t[NR] = $1 } END { printf "smoke: measured request latency (%s): median %.3f ms, p90 %.3f ms over %d\n", what, t[int(NR / 2)] * 1000, t[int(NR * 0.9)] * 1000, NR }' >&2
    done
  done
}

# The sidecar's own metrics (admin port): its decisions came from the endpoint through the Service
# (DNS, TLS against the operator's CA, TokenReview of its pod's token), not from a fallback.
decided_by_endpoint() {
  local port=$((20000 + RANDOM % 10000)) pf metrics
  kubectl -n "$SMOKE_NS" port-forward deployment/echo "$port:15081" >"$WORK/port-forward-admin.log" 2>&1 &
  pf=$!
  retry 30 curl -fsS -o "$WORK/sidecar-metrics" "http://127.0.0.1:$port/metrics" || { kill "$pf"; die "no sidecar metrics"; }
  kill "$pf" 2>/dev/null || true
  metrics="$(grep -E '^sluice_sidecar_(decisions|endpoint_errors)' "$WORK/sidecar-metrics" || true)"
  log "sidecar metrics: $(tr '\n' ' ' <<<"$metrics")"
  grep -qE '^sluice_sidecar_decisions_total\{.*source="endpoint".*result="deny".*\} [1-9]' <<<"$metrics" \
    || die "the sidecar's denial did not come from the endpoint"
  if grep -qE '^sluice_sidecar_decisions_total\{source="(local|failure_mode)".*\} [1-9]' <<<"$metrics"; then
    die "the sidecar decided without the endpoint"
  fi
}

lease_holder() {
  kubectl -n "$RELEASE_NS" get lease sluice-operator -o jsonpath='{.spec.holderIdentity}' 2>/dev/null
}
has_holder() { [ -n "$(lease_holder)" ]; }
# Sets NEW_HOLDER; true once it is someone other than OLD_HOLDER.
lease_moved() { NEW_HOLDER="$(lease_holder)"; [ -n "$NEW_HOLDER" ] && [ "$NEW_HOLDER" != "$OLD_HOLDER" ]; }

phase_failover() {
  local old new start
  retry 60 has_holder || die "no Lease holder"
  old="$(lease_holder)"; OLD_HOLDER="$old"
  log "failover: deleting the Lease holder $old"
  start="$(now_ms)"
  kubectl -n "$RELEASE_NS" delete pod "$old" --wait=false >&2
  retry 120 lease_moved || die "the Lease did not move from $old"
  new="$NEW_HOLDER"
  log "measured leader failover (pod deleted to Lease held by $new): $(seconds_since "$start") s"
  [[ " $(operator_pods) " == *" $new "* ]] || die "the new holder $new is not a running operator pod"
  local took; took="$(apply_policy 2)"
  log "measured apply-to-enforced (after failover, written by $new): $took s"
  kubectl -n "$RELEASE_NS" rollout status deployment/sluice --timeout=180s >&2
  settle_after_rollout "$old"
  start_port_forward
  expect_limit k2 2
}

phase_upgrade() {
  local before after values
  before="$(operator_pods)"
  log "upgrade: helm upgrade with operator.logLevel=debug (pods before: $before)"
  mapfile -t values < <(helm_values)
  helm upgrade sluice "$CHART" --namespace "$RELEASE_NS" "${values[@]}" --set operator.logLevel=debug \
    --wait --timeout 5m >&2 || die "helm upgrade did not finish"
  kubectl -n "$RELEASE_NS" rollout status deployment/sluice --timeout=180s >&2
  # shellcheck disable=SC2086 # one argument per pod name
  settle_after_rollout $before
  after="$(operator_pods)"
  local pod
  for pod in $before; do
    [[ " $after " != *" $pod "* ]] || die "pod $pod survived the upgrade (after: $after)"
  done
  local level
  level="$(kubectl -n "$RELEASE_NS" get deployment sluice -o jsonpath='{.spec.template.spec.containers[0].env[?(@.name=="RUST_LOG")].value}')"
  [ "$level" = debug ] || die "the upgraded pods run with RUST_LOG=$level"
  log "upgrade: rolled to $after"
  start_port_forward
  expect_limit k3 2
}

phase_suite() {
  local token server ca
  token="$(kubectl -n "$RELEASE_NS" create token sluice --duration=2h)"
  server="$(kubectl config view --raw --minify -o jsonpath='{.clusters[0].cluster.server}')"
  ca="$(kubectl config view --raw --minify -o jsonpath='{.clusters[0].cluster.certificate-authority-data}')"
  cat > "$WORK/operator.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: smoke
  cluster: {server: "$server", certificate-authority-data: "$ca"}
users:
- name: sluice-operator
  user: {token: "$token"}
contexts:
- name: sluice-operator
  context: {cluster: smoke, user: sluice-operator}
current-context: sluice-operator
EOF
  log "suite: cargo test --test e2e_operator against this cluster, as the chart's ServiceAccount"
  # The webhook test registers webhooks at https://127.0.0.1:<port>, which only an API server on
  # the test's own loopback reaches; the verify phase proved the webhooks through the Service.
  local args
  read -r -a args <<<"${SMOKE_SUITE_ARGS:-}"
  (cd "$HERE/.." && SLUICE_E2E_KUBECONFIG="$KUBECONFIG" SLUICE_E2E_OPERATOR_KUBECONFIG="$WORK/operator.kubeconfig" \
    cargo test --locked --test e2e_operator -- --skip webhooks_refuse_invalid_policies_and_inject_labelled_pods "${args[@]}") \
    || die "the e2e suite failed against this cluster"
}

phase_uninstall() {
  stop_port_forward
  log "uninstall: helm uninstall"
  helm uninstall sluice --namespace "$RELEASE_NS" --wait --timeout 3m >&2 || die "helm uninstall failed"
  local left
  left="$(kubectl get validatingwebhookconfigurations,mutatingwebhookconfigurations -o name | grep -i sluice || true)"
  [ -z "$left" ] || die "webhook configurations left behind: $left"
  # A labelled pod in the labelled namespace: nothing may block or mutate it any more.
  kubectl -n "$SMOKE_NS" run after-uninstall --image="$APP_IMAGE" --image-pull-policy=IfNotPresent \
    --labels=sluice.dev/inject=true --restart=Never --command -- sleep 3600 >&2 \
    || die "pod creation is blocked after uninstall"
  local containers
  containers="$(kubectl -n "$SMOKE_NS" get pod after-uninstall -o jsonpath='{.spec.containers[*].name}')"
  [ "$containers" = after-uninstall ] || die "a pod created after uninstall was mutated: $containers"
  kubectl -n "$SMOKE_NS" delete pod after-uninstall --wait=false >&2
  log "uninstall: left in $RELEASE_NS: $(kubectl -n "$RELEASE_NS" get secrets,leases,configmaps -o name 2>/dev/null | tr '\n' ' ')"
}

(($#)) || { sed -n '2,46p' "$0"; exit 2; }
for phase in "$@"; do
  case "$phase" in
    install|verify|iptables|jobs|drain|failover|upgrade|suite|uninstall) "phase_$phase" ;;
    *) die "unknown phase $phase" ;;
  esac
done
log "passed: $*"
