#!/usr/bin/env bash
# One hot key over its limit, through Envoy's rate limit service: Sluice on Redis with and
# without its denial cache, and Limitador's redis and redis_cached storage, side by side on one
# Redis. Every server has the same limit, 2 per second on one api_key; the Go load client
# (e2e/rls-client bench -keys 1) sends as fast as it can for DURATION seconds, so nearly every
# call is a denial. Reported: decisions/s, admitted (exact is 2 per second of the run, give or take
# the window the run starts in), server and Redis CPU per decision.
#
#   SLUICE_BIN=target/release/sluice scripts/bench/rls-hot-denied.sh
#
# Env: DURATION (10), SERVER_CPU (0; the server and Redis), CLIENT_CPU (1), SLUICE_BIN (else
#      `cargo build --release --bin sluice`), LIMITADOR (auto: Limitador's rows when
#      `scripts/bench/limitador.sh build` has a binary, else left out with a note; 1: required;
#      0: skipped), SMOKE (1: DURATION 1, the test command's check that the script works).
# A run with any failed call, or none answered or admitted, fails the script instead of printing
# the figures of failures.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
if [ "${SMOKE:-0}" = 1 ]; then DURATION="${DURATION:-1}"; fi
DURATION="${DURATION:-10}"
SERVER_CPU="${SERVER_CPU:-0}"
CLIENT_CPU="${CLIENT_CPU:-1}"
# shellcheck source=scripts/bench/lib.sh
. "$ROOT/scripts/bench/lib.sh"

if [ -z "${SLUICE_BIN:-}" ]; then
    (cd "$ROOT" && cargo build --release --quiet --bin sluice)
    SLUICE_BIN="${CARGO_TARGET_DIR:-$ROOT/target}/release/sluice"
fi
CLIENT="$("$ROOT/e2e/rls-client.sh")"
LIMITADOR_BIN=""
case "${LIMITADOR:-auto}" in
    0) log "*** Limitador rows skipped: LIMITADOR=0 ***" ;;
    1) LIMITADOR_BIN="$("$ROOT/scripts/bench/limitador.sh" build)" ;;
    auto) LIMITADOR_BIN="$("$ROOT/scripts/bench/limitador.sh" build 2>/dev/null)" ||
        log "*** Limitador rows skipped: not built and no source tree (scripts/bench/limitador.sh build SRC; LIMITADOR=1 requires them) ***" ;;
    *) log "LIMITADOR must be auto, 1 or 0"; exit 2 ;;
esac

WORK="$(mktemp -d)"
PIDS=()
cleanup() { for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT
REDIS_PORT="$(free_port)"
start_redis "$REDIS_PORT" "$SERVER_CPU"; PIDS+=("$REDIS_PID")
cli() { redis-cli -p "$REDIS_PORT" "$@"; }
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

cat > "$WORK/policies.yaml" <<'YAML'
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: hot, namespace: bench}
spec:
  rules:
    - name: per-api-key
      match: {descriptor: [{key: api_key}]}
      key: [{descriptor: api_key}]
      algorithm: fixedWindow
      limit: {requests: 2, per: 1s}
YAML

echo "| server | decisions/s | admitted in ${DURATION} s | server CPU µs/decision | Redis CPU µs/decision | Redis calls/decision |"
echo "|---|---:|---:|---:|---:|---:|"
run() { # name, grpc port, server pid
    local name=$1 port=$2 pid=$3 i
    for i in $(seq 100); do
        echo '{"op":"rls","domain":"bench","descriptors":[{"entries":[{"key":"api_key","value":"warm"}]}]}' \
            | "$CLIENT" stdio -addr "127.0.0.1:$port" 2>/dev/null | grep -q '"ok":true' && break
        [ "$i" != 100 ] || fail "$name: no answer on 127.0.0.1:$port in 10 s"
        sleep 0.1
    done
    cli FLUSHALL >/dev/null; cli CONFIG RESETSTAT >/dev/null
    local c0 t0 c1 t1 out
    c0=$(redis_cpu "$REDIS_PORT"); t0=$(cpu_ticks "$pid")
    out=$(taskset -c "$CLIENT_CPU" "$CLIENT" bench -addr "127.0.0.1:$port" -domain bench -descriptors 1 -keys 1 \
        -conns 4 -concurrency 64 -warmup 0s -duration "${DURATION}s")
    t1=$(cpu_ticks "$pid"); c1=$(redis_cpu "$REDIS_PORT")
    local calls
    calls=$(cli INFO commandstats | awk -F'[:=,]' '/^cmdstat_(fcall|evalsha|eval|mget|incrby):/ {s += $3} END {print s + 0}')
    python3 - "$name" "$out" "$c0" "$c1" "$t0" "$t1" "$calls" "$(getconf CLK_TCK)" <<'PY'
import json, sys
name, out, c0, c1, t0, t1, calls, hz = sys.argv[1:]
r = json.loads(out)
if r["requests"] == 0 or r["errors"] != 0 or r["ok"] == 0:
    sys.exit(f"FAILED: {name}: {r['requests']} calls, {r['errors']} failed, {r['ok']} admitted: {out}")
n = r["requests"]
print(f"| {name} | {r['rps']:.0f} | {r['ok']} | {(float(t1) - float(t0)) / float(hz) * 1e6 / n:.1f} | "
      f"{(float(c1) - float(c0)) * 1e6 / n:.2f} | {int(calls) / n:.3f} |")
PY
}

for cache in 0 100000; do
    port="$(free_port)"
    RUST_LOG=warn taskset -c "$SERVER_CPU" "$SLUICE_BIN" serve -p "$WORK/policies.yaml" --listen 127.0.0.1:0 \
        --grpc-listen "127.0.0.1:$port" --grpc-response-headers off --redis "redis://127.0.0.1:$REDIS_PORT" \
        --redis-denial-cache "$cache" 2>/dev/null & pid=$!; PIDS+=("$pid")
    run "Sluice, Redis, denial cache $([ "$cache" = 0 ] && echo off || echo on)" "$port" "$pid"
    kill "$pid"
done
if [ -n "$LIMITADOR_BIN" ]; then
    for storage in redis redis_cached; do
        port="$(free_port)"; http="$(free_port)"; mkdir -p "$WORK/$storage"
        SLUICE_LIMITADOR_MAX_VALUE=2 SLUICE_LIMITADOR_BIN="$LIMITADOR_BIN" taskset -c "$SERVER_CPU" \
            "$ROOT/scripts/bench/limitador.sh" run "$WORK/$storage" "$REDIS_PORT" "$port" "$http" "$storage" \
            >/dev/null 2>&1 & pid=$!; PIDS+=("$pid")
        sleep 0.5
        server="$(pgrep -P "$pid" -n limitador-serv || echo "$pid")"
        run "Limitador, $storage" "$port" "$server"
        kill "$pid" 2>/dev/null || true
    done
fi
log "load: $(cut -d' ' -f1-3 /proc/loadavg)"
