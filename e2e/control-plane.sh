#!/usr/bin/env bash
# A real Kubernetes control plane (etcd + kube-apiserver, no nodes) as local processes, the way
# controller-runtime's envtest runs one: the e2e tests need the real API server's CRD schema and CEL,
# webhooks called over TLS, watches, server-side apply, Leases and RBAC, and this machine has no
# Docker for kind.
#
#   e2e/control-plane.sh build            build (or reuse) kube-apiserver, kubectl and etcd; print the bin dir
#   e2e/control-plane.sh start DIR [PID]  start etcd + kube-apiserver with state in DIR, wait for /readyz,
#                                         write DIR/kubeconfig (admin) and DIR/operator.kubeconfig
#                                         (user "sluice-operator", no groups: only what RBAC grants it);
#                                         with PID, tear down (and remove DIR) by itself once that process is gone
#   e2e/control-plane.sh stop DIR         stop what `start DIR` started
#   e2e/control-plane.sh restart DIR      kill -9 etcd and kube-apiserver and start them again on the
#                                         same ports and data (a crashed control plane coming back)
#   e2e/control-plane.sh helm             build (or reuse) helm; print its path
#
# Binaries are built from the Go module proxy and cached OUTSIDE the checkout, keyed by version, in
# ${SLUICE_CACHE:-$HOME/.cache/sluice}/k8s-<version>/bin (GOMODCACHE and GOCACHE are Go's own, so a
# second build of the same version is a no-op and a rebuild after a version bump reuses most objects).
set -euo pipefail

K8S_VERSION="${SLUICE_K8S_VERSION:-v1.36.3}"   # k8s-openapi 0.29 supports 1.33–1.37
ETCD_VERSION="${SLUICE_ETCD_VERSION:-v3.6.16}"
HELM_VERSION="${SLUICE_HELM_VERSION:-v3.22.0}"
CACHE="${SLUICE_CACHE:-$HOME/.cache/sluice}"
OUT="$CACHE/k8s-$K8S_VERSION"
BIN="$OUT/bin"
# The API server and kubectl for every e2e test; the node's components for the one-node cluster
# (e2e/node.sh); kubeadm for the kind node image (e2e/kind-node.sh), which boots with it.
K8S_COMPONENTS=(kube-apiserver kubectl kube-controller-manager kube-scheduler kubelet kube-proxy kubeadm)

log() { echo "control-plane: $*" >&2; }

build_kubernetes() {
  # Arguments: the cmd/ components to build.
  # k8s.io/kubernetes's go.mod replaces every staging module (k8s.io/api, k8s.io/apiserver, …) with
  # ./staging/src/… and requires them at v0.0.0, which the proxy does not serve (golang/go#35878).
  # A throwaway module maps each of them to the published v0.X.Y of the same release.
  local src="$OUT/src-kubernetes" staging="v0.${K8S_VERSION#v1.}"
  rm -rf "$src" && mkdir -p "$src" && cd "$src"
  go mod init sluice.dev/k8s-build >/dev/null 2>&1
  local gomod
  gomod="$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | jq -r .GoMod)"
  local args=(-require="k8s.io/kubernetes@$K8S_VERSION")
  while read -r mod; do
    args+=(-replace="$mod=$mod@$staging")
  done < <(go mod edit -json "$gomod" | jq -r '.Replace[] | select(.New.Path | startswith("./staging/")) | .Old.Path')
  go mod edit "${args[@]}"
  # The tools-file idiom: importing the main packages lets `go mod tidy` resolve their whole graph.
  cat > tools.go <<'EOF'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kubeadm"
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
EOF
  go mod tidy >/dev/null
  local minor="${K8S_VERSION#v1.}"; minor="${minor%%.*}"
  local v=k8s.io/component-base/version
  # /version must be real: clients and the apiserver's own compatibility-version checks read it.
  local ldflags="-s -w -X $v.gitVersion=$K8S_VERSION -X $v.gitMajor=1 -X $v.gitMinor=$minor \
-X $v.gitTreeState=clean -X $v.buildDate=1970-01-01T00:00:00Z -X $v.gitCommit=0000000000000000000000000000000000000000"
  local component
  for component in "$@"; do
    CGO_ENABLED=0 go build -trimpath -ldflags "$ldflags" -o "$BIN/$component.tmp" "k8s.io/kubernetes/cmd/$component"
    mv "$BIN/$component.tmp" "$BIN/$component"
  done
}

# go_build_main SRC MODULE VERSION PACKAGE OUT: builds PACKAGE, a main package of MODULE, from a
# throwaway module in SRC that merely requires MODULE@VERSION. (`go install` of etcd/server fails:
# its go.mod has replace lines; requiring it from another module works.)
go_build_main() {
  local src="$1" module="$2" version="$3" package="$4" out="$5"
  rm -rf "$src" && mkdir -p "$src" && cd "$src"
  go mod init sluice.dev/build >/dev/null 2>&1
  # The tools-file idiom: importing the main package lets `go mod tidy` resolve its whole graph.
  printf '//go:build tools\n\npackage tools\n\nimport _ "%s"\n' "$package" > tools.go
  go mod edit -require="$module@$version"
  go mod tidy >/dev/null
  CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$out.tmp" "$package"
  mv "$out.tmp" "$out"
}

build_etcd() {
  go_build_main "$OUT/src-etcd" go.etcd.io/etcd/server/v3 "$ETCD_VERSION" go.etcd.io/etcd/server/v3 "$BIN/etcd"
}

# helm renders the chart for scripts/test.sh's check of charts/sluice/rendered/; `go install` of
# its main package works from the module proxy (no replace lines).
cmd_helm() {
  local dir="$CACHE/helm-$HELM_VERSION"
  if [ ! -x "$dir/helm" ]; then
    log "building helm $HELM_VERSION (cold: a few minutes)"
    mkdir -p "$dir"
    GOBIN="$dir" CGO_ENABLED=0 go install -trimpath -ldflags "-s -w" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
  fi
  echo "$dir/helm"
}

cmd_build() {
  command -v go >/dev/null || { log "Go is required to build the control plane"; exit 1; }
  command -v jq >/dev/null || { log "jq is required (Debian package jq)"; exit 1; }
  mkdir -p "$BIN"
  local start=$SECONDS
  # The etcd version is part of the cache key too: a marker file names it.
  if [ ! -x "$BIN/etcd" ] || [ "$(cat "$BIN/etcd.version" 2>/dev/null)" != "$ETCD_VERSION" ]; then
    log "building etcd $ETCD_VERSION"; (build_etcd); echo "$ETCD_VERSION" > "$BIN/etcd.version"
  fi
  local missing=() component
  for component in "${K8S_COMPONENTS[@]}"; do
    [ -x "$BIN/$component" ] || missing+=("$component")
  done
  if ((${#missing[@]})); then
    log "building ${missing[*]} $K8S_VERSION (cold: 10-20 min on 2 cores for the first, minutes for each other)"
    (build_kubernetes "${missing[@]}")
  fi
  log "binaries ready in $BIN ($((SECONDS - start)) s)"
  echo "$BIN"
}

# A port nothing answers on, from 20000-31999: below Linux's ephemeral range (32768+), so outgoing
# connections do not take it between this probe and the server's bind. bash's /dev/tcp probes.
free_port() {
  local p
  for _ in $(seq 100); do
    p=$((20000 + RANDOM % 12000))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then echo "$p"; return; fi
  done
  log "no free port found"; exit 1
}

# wait_healthy PIDFILE SECONDS CMD...: until CMD succeeds; fails when the process exits first or
# the time runs out.
wait_healthy() {
  local pidfile="$1" deadline=$((SECONDS + $2)); shift 2
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS > deadline)) || ! kill -0 "$(cat "$pidfile")" 2>/dev/null; then return 1; fi
    sleep 0.2
  done
}

issue_cert() {  # issue_cert PKI NAME SUBJECT [SANS]: NAME.key and NAME.crt, signed by PKI/ca.*
  local pki="$1" name="$2" subject="$3" sans="${4:-}"
  openssl req -newkey rsa:2048 -nodes -subj "$subject" -keyout "$pki/$name.key" -out "$pki/$name.csr" 2>/dev/null
  if [ -n "$sans" ]; then printf 'subjectAltName=%s\n' "$sans" > "$pki/$name.ext"; else : > "$pki/$name.ext"; fi
  openssl x509 -req -in "$pki/$name.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
    -days 3 -extfile "$pki/$name.ext" -out "$pki/$name.crt" 2>/dev/null
}

write_kubeconfig() {  # write_kubeconfig FILE SERVER USER TOKEN CA_BASE64
  cat > "$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: e2e
  cluster: {server: "$2", certificate-authority-data: "$5"}
users:
- name: $3
  user: {token: "$4"}
contexts:
- name: e2e
  context: {cluster: e2e, user: $3}
current-context: e2e
EOF
}

# kill_pidfile FILE: SIGTERM, up to 5 s, then SIGKILL the process FILE names; removes FILE.
kill_pidfile() {
  local file="$1" pid
  [ -f "$file" ] || return 0
  pid="$(cat "$file")"
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
  rm -f "$file"
}

cmd_start() {
  local dir="$1" owner="${2:-}"
  if [ ! -x "$BIN/kube-apiserver" ] || [ ! -x "$BIN/etcd" ]; then cmd_build >/dev/null; fi
  mkdir -p "$dir" && dir="$(cd "$dir" && pwd)"
  local pki="$dir/pki"; mkdir -p "$pki"
  # One CA signs the serving certificate (with 127.0.0.1 as an IP SAN so rustls can verify it).
  openssl req -x509 -newkey rsa:2048 -nodes -days 3 -subj /CN=sluice-e2e-ca \
    -keyout "$pki/ca.key" -out "$pki/ca.crt" 2>/dev/null
  issue_cert "$pki" apiserver /CN=kube-apiserver "IP:127.0.0.1,DNS:localhost,DNS:kubernetes.default.svc"
  openssl genrsa -out "$pki/sa.key" 2048 2>/dev/null
  openssl rsa -in "$pki/sa.key" -pubout -out "$pki/sa.pub" 2>/dev/null
  # Static tokens: an admin in system:masters, and the operator's user with no groups at all, so the
  # RBAC test proves the repo's ClusterRole alone is enough.
  local admin_token operator_token
  admin_token="$(openssl rand -hex 16)"; operator_token="$(openssl rand -hex 16)"
  printf '%s,admin,admin,"system:masters"\n%s,sluice-operator,sluice-operator\n' \
    "$admin_token" "$operator_token" > "$pki/tokens.csv"

  # free_port's probe and the server's bind race with anything else picking ports, so a server
  # that exits at start is retried on fresh ports (its log tail is shown when it gives up).
  local etcd_port peer_port api_port attempt
  for attempt in 1 2 3; do
    etcd_port="$(free_port)"; peer_port="$(free_port)"
    while [ "$peer_port" = "$etcd_port" ]; do peer_port="$(free_port)"; done
    rm -rf "$dir/etcd"
    run_etcd "$dir" "$etcd_port" "$peer_port"
    if wait_healthy "$dir/etcd.pid" 30 curl -fsS "http://127.0.0.1:$etcd_port/health"; then break; fi
    log "etcd did not start (attempt $attempt); last log lines:"; tail -5 "$dir/etcd.log" >&2
    kill_pidfile "$dir/etcd.pid"
    if [ "$attempt" = 3 ]; then exit 1; fi
  done
  for attempt in 1 2 3; do
    api_port="$(free_port)"
    while [ "$api_port" = "$etcd_port" ] || [ "$api_port" = "$peer_port" ]; do api_port="$(free_port)"; done
    run_apiserver "$dir" "$etcd_port" "$api_port"
    if api_ready "$dir" "$api_port" 120; then break; fi
    log "kube-apiserver did not become ready (attempt $attempt); last log lines:"
    tail -20 "$dir/kube-apiserver.log" >&2
    kill_pidfile "$dir/kube-apiserver.pid"
    if [ "$attempt" = 3 ]; then cmd_stop "$dir"; exit 1; fi
  done

  echo "$etcd_port $peer_port $api_port" > "$dir/ports"
  local ca; ca="$(base64 -w0 < "$pki/ca.crt")"
  write_kubeconfig "$dir/kubeconfig" "https://127.0.0.1:$api_port" admin "$admin_token" "$ca"
  write_kubeconfig "$dir/operator.kubeconfig" "https://127.0.0.1:$api_port" sluice-operator "$operator_token" "$ca"

  if [ -n "$owner" ]; then
    # Watchdog: a test binary that dies (or forgets to stop us) must not leave servers behind,
    # nor its state: the owner's temporary directory is never dropped (it lives in a static).
    ( while kill -0 "$owner" 2>/dev/null; do sleep 1; done; cmd_stop "$dir"; rm -rf "$dir" ) >/dev/null 2>&1 &
    disown
  fi
  log "ready at https://127.0.0.1:$api_port (kubeconfig $dir/kubeconfig)"
  echo "$dir/kubeconfig"
}

run_etcd() {  # run_etcd DIR CLIENT_PORT PEER_PORT: in the background, pid in DIR/etcd.pid
  local dir="$1" etcd_port="$2" peer_port="$3"
  "$BIN/etcd" --data-dir="$dir/etcd" --name=e2e \
    --listen-client-urls="http://127.0.0.1:$etcd_port" --advertise-client-urls="http://127.0.0.1:$etcd_port" \
    --listen-peer-urls="http://127.0.0.1:$peer_port" --initial-advertise-peer-urls="http://127.0.0.1:$peer_port" \
    --initial-cluster="e2e=http://127.0.0.1:$peer_port" --unsafe-no-fsync=true \
    >>"$dir/etcd.log" 2>&1 &
  echo $! > "$dir/etcd.pid"
}

run_apiserver() {  # run_apiserver DIR ETCD_PORT API_PORT: in the background, pid in DIR/kube-apiserver.pid
  local dir="$1" etcd_port="$2" api_port="$3" pki="$1/pki"
  "$BIN/kube-apiserver" --etcd-servers="http://127.0.0.1:$etcd_port" --cert-dir="$pki" \
    --tls-cert-file="$pki/apiserver.crt" --tls-private-key-file="$pki/apiserver.key" \
    --secure-port="$api_port" --bind-address=127.0.0.1 --advertise-address=127.0.0.1 \
    --service-cluster-ip-range=10.0.0.0/24 --allow-privileged=true \
    --disable-admission-plugins=ServiceAccount --authorization-mode=RBAC \
    --service-account-issuer="https://127.0.0.1:$api_port/" --service-account-key-file="$pki/sa.pub" \
    --service-account-signing-key-file="$pki/sa.key" --token-auth-file="$pki/tokens.csv" \
    >>"$dir/kube-apiserver.log" 2>&1 &
  echo $! > "$dir/kube-apiserver.pid"
}

# api_ready DIR PORT SECONDS: /readyz answers ok (etcd reachable, post-start hooks such as RBAC
# bootstrap done), as the admin of DIR/pki/tokens.csv.
api_ready() {
  local dir="$1" token
  token="$(head -n 1 "$dir/pki/tokens.csv" | cut -d, -f1)"
  wait_healthy "$dir/kube-apiserver.pid" "$3" curl -fsS --cacert "$dir/pki/ca.crt" \
    -H "Authorization: Bearer $token" "https://127.0.0.1:$2/readyz"
}

# The API server and etcd killed (SIGKILL) and started again on the same ports and data, as a
# crashed or rebooted control plane comes back; returns once /readyz is ok again.
cmd_restart() {
  local dir="$1" etcd_port peer_port api_port p
  read -r etcd_port peer_port api_port < "$dir/ports"
  for p in kube-apiserver etcd; do kill -9 "$(cat "$dir/$p.pid")" 2>/dev/null || true; done
  for p in kube-apiserver etcd; do
    while kill -0 "$(cat "$dir/$p.pid")" 2>/dev/null; do sleep 0.05; done
  done
  run_etcd "$dir" "$etcd_port" "$peer_port"
  wait_healthy "$dir/etcd.pid" 30 curl -fsS "http://127.0.0.1:$etcd_port/health" || { log "etcd did not restart"; tail -5 "$dir/etcd.log" >&2; exit 1; }
  run_apiserver "$dir" "$etcd_port" "$api_port"
  api_ready "$dir" "$api_port" 120 || { log "kube-apiserver did not restart"; tail -20 "$dir/kube-apiserver.log" >&2; exit 1; }
  log "restarted at https://127.0.0.1:$api_port"
}

cmd_stop() {
  local dir="$1" p
  for p in kube-apiserver etcd; do kill_pidfile "$dir/$p.pid"; done
}

# Sourced (by e2e/node.sh) for its functions only.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  case "${1:-}" in
    build) cmd_build ;;
    start) shift; cmd_start "$@" ;;
    stop) shift; cmd_stop "$@" ;;
    restart) shift; cmd_restart "$@" ;;
    bin-dir) echo "$BIN" ;;
    helm) cmd_helm ;;
    *) echo "usage: $0 build | start DIR [OWNER_PID] | stop DIR | restart DIR | bin-dir | helm" >&2; exit 2 ;;
  esac
fi
