#!/usr/bin/env bash
# envoyproxy/ratelimit, the reference implementation of Envoy's gRPC rate limit service, as the
# peer for Sluice's gRPC benchmarks: built from the Go module proxy, run on 127.0.0.1 against a
# local Redis, driven by e2e/rls-client.
#
#   scripts/bench/envoy-ratelimit.sh build                          build (or reuse); print the binary
#   scripts/bench/envoy-ratelimit.sh built                          print the binary if built, else fail
#   scripts/bench/envoy-ratelimit.sh redis DIR REDIS_PORT           exec redis-server on 127.0.0.1 (foreground)
#   scripts/bench/envoy-ratelimit.sh run DIR REDIS_PORT GRPC_PORT   write the bench config into DIR and exec
#                                                                   the server on 127.0.0.1 (foreground)
#
# The module has no tagged release and no replace lines, so `go install pkg@pseudo-version` works
# (no throwaway module needed, unlike etcd); the main package is src/service_cmd. The binary is
# cached OUTSIDE the checkout in ${SLUICE_CACHE:-$HOME/.cache/sluice}/envoy-ratelimit-<version>/.
#
# What `run` amounts to, by hand (ports are examples; HTTP and debug ports are picked free):
#
#   redis-server --bind 127.0.0.1 --port 26379 --save '' --appendonly no --dir "$DIR"
#   # config: $DIR/runtime/ratelimit/config/bench.yaml (domain bench; api_key, remote_address and
#   # path, each with no value, so every distinct value gets its own 100000/second limit)
#   RUNTIME_ROOT="$DIR/runtime" RUNTIME_SUBDIRECTORY=ratelimit RUNTIME_APPDIRECTORY=config \
#   RUNTIME_WATCH_ROOT=false BACKEND_TYPE=redis REDIS_SOCKET_TYPE=tcp REDIS_TYPE=SINGLE \
#   REDIS_URL=127.0.0.1:26379 HOST=127.0.0.1 PORT=28080 DEBUG_HOST=127.0.0.1 DEBUG_PORT=26070 \
#   GRPC_HOST=127.0.0.1 GRPC_PORT=28081 USE_STATSD=false DISABLE_STATS=true LOG_LEVEL=warn \
#   "$(scripts/bench/envoy-ratelimit.sh build)"
#
#   B="$(e2e/rls-client.sh)"
#   echo '{"op":"rls","domain":"bench","descriptors":[{"entries":[{"key":"api_key","value":"k1"}]}]}' \
#     | "$B" stdio -addr 127.0.0.1:28081
#   echo '{"op":"health","service":"ratelimit"}' | "$B" stdio -addr 127.0.0.1:28081
#   "$B" bench -addr 127.0.0.1:28081 -domain bench -descriptors 3 -duration 3s -warmup 1s
#
# Any other setting of its (src/settings/settings.go: REDIS_POOL_SIZE, REDIS_PIPELINE_WINDOW,
# LOCAL_CACHE_SIZE_IN_BYTES, ...) passes through from the caller's environment.
set -euo pipefail

VERSION="${SLUICE_ENVOY_RATELIMIT_VERSION:-v1.4.1-0.20260122083618-3fb702589d36}" # master, 2026-01-22
CACHE="${SLUICE_CACHE:-$HOME/.cache/sluice}"
OUT="$CACHE/envoy-ratelimit-$VERSION"
BIN="$OUT/ratelimit"

log() { echo "envoy-ratelimit: $*" >&2; }

cmd_build() {
  if [ ! -x "$BIN" ]; then
    command -v go >/dev/null || { log "Go is required to build envoyproxy/ratelimit"; exit 1; }
    log "building github.com/envoyproxy/ratelimit@$VERSION (cold: about a minute on 2 cores)"
    mkdir -p "$OUT"
    local start=$SECONDS gobin
    gobin="$(mktemp -d "$OUT/gobin.XXXXXX")"
    GOBIN="$gobin" CGO_ENABLED=0 go install -trimpath -ldflags "-s -w" \
      "github.com/envoyproxy/ratelimit/src/service_cmd@$VERSION"
    mv "$gobin/service_cmd" "$BIN"
    rmdir "$gobin"
    log "built in $((SECONDS - start)) s"
  fi
  echo "$BIN"
}

# A port nothing answers on, from 20000-31999 (below Linux's ephemeral range), as in
# e2e/control-plane.sh.
free_port() {
  local p
  for _ in $(seq 100); do
    p=$((20000 + RANDOM % 12000))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then echo "$p"; return; fi
  done
  log "no free port found"; exit 1
}

cmd_redis() {
  local dir="$1" port="$2"
  command -v redis-server >/dev/null || { log "redis-server is required (Debian package redis-server)"; exit 1; }
  mkdir -p "$dir"
  # No persistence: counters are throwaway, and snapshots would cost the benchmark disk I/O.
  exec redis-server --bind 127.0.0.1 --port "$port" --save '' --appendonly no --dir "$dir" \
    --protected-mode yes
}

cmd_run() {
  local dir="$1" redis_port="$2" grpc_port="$3"
  cmd_build >/dev/null
  mkdir -p "$dir" && dir="$(cd "$dir" && pwd)"
  local conf="$dir/runtime/ratelimit/config"
  mkdir -p "$conf"
  # A descriptor key with no value is a wildcard: each distinct value gets a limit of its own, the
  # same shape as the bench's api_key / remote_address / path descriptors (e2e/rls-client bench).
  cat > "$conf/bench.yaml" <<'EOF'
domain: bench
descriptors:
  - key: api_key
    rate_limit:
      unit: second
      requests_per_unit: 100000
  - key: remote_address
    rate_limit:
      unit: second
      requests_per_unit: 100000
  - key: path
    rate_limit:
      unit: second
      requests_per_unit: 100000
EOF
  local http_port debug_port
  http_port="${SLUICE_RL_HTTP_PORT:-$(free_port)}"
  debug_port="${SLUICE_RL_DEBUG_PORT:-$(free_port)}"
  log "grpc 127.0.0.1:$grpc_port, http 127.0.0.1:$http_port, debug 127.0.0.1:$debug_port, redis 127.0.0.1:$redis_port"
  # RUNTIME_WATCH_ROOT=false: reload on edits inside the config dir; the default watches for
  # RUNTIME_ROOT being re-pointed as a symlink, which a plain directory never is.
  RUNTIME_ROOT="$dir/runtime" RUNTIME_SUBDIRECTORY=ratelimit RUNTIME_APPDIRECTORY=config \
  RUNTIME_WATCH_ROOT=false BACKEND_TYPE=redis REDIS_SOCKET_TYPE=tcp REDIS_TYPE=SINGLE \
  REDIS_URL="127.0.0.1:$redis_port" HOST=127.0.0.1 PORT="$http_port" \
  DEBUG_HOST=127.0.0.1 DEBUG_PORT="$debug_port" GRPC_HOST=127.0.0.1 GRPC_PORT="$grpc_port" \
  USE_STATSD=false DISABLE_STATS=true LOG_LEVEL="${LOG_LEVEL:-warn}" \
    exec "$BIN"
}

case "${1:-}" in
  build) cmd_build ;;
  built) [ -x "$BIN" ] || { log "not built: $BIN (scripts/bench/envoy-ratelimit.sh build)"; exit 1; }; echo "$BIN" ;;
  redis) [ $# -eq 3 ] || { echo "usage: $0 redis DIR REDIS_PORT" >&2; exit 2; }; shift; cmd_redis "$@" ;;
  run) [ $# -eq 4 ] || { echo "usage: $0 run DIR REDIS_PORT GRPC_PORT" >&2; exit 2; }; shift; cmd_run "$@" ;;
  *) echo "usage: $0 build | built | redis DIR REDIS_PORT | run DIR REDIS_PORT GRPC_PORT" >&2; exit 2 ;;
esac
