#!/usr/bin/env bash
# `POST /v1/check` through `sluice serve --redis` against the ceiling: redis-benchmark running
# Sluice's own decision function (the lua/ library, FCALL, one fixed-window rule, random keys) at
# the same concurrency on the same Redis. Also counts Redis round trips per decision from INFO
# commandstats.
#
#   scripts/bench/redis-load.sh                      # ~2 minutes
#   CONNS="16 64" DURATION=10 scripts/bench/redis-load.sh
#
# Redis runs on CPU $REDIS_CPU; redis-benchmark, or sluice and wrk, on the other CPU (a 2-core
# machine cannot give each process a core of its own: sluice and wrk share one, which the
# redis-benchmark side does not need to do, so the ratio is a lower bound).
# Env: DURATION (s, 10), CONNS ("16 64"), KEYS (100000), REDIS_CPU (0), OTHER_CPU (1),
#      SKIP_BUILD (1 to reuse the release binary), OUT (markdown results file), POLICIES
#      (policies-1rule; policies-3rules checks that 3 matching rules still cost one FCALL —
#      the redis-benchmark ceiling stays the one-rule script), SLUICE_BIN (a sluice binary),
#      SMOKE (1: 1 s at 16 connections over 1000 keys, the test command's check that the script
#      works).
# Every call is checked: a redis-benchmark FCALL that Redis failed (a library or arguments that
# no longer match lua/), a non-2xx or socket error in wrk, or a decision Sluice made without
# Redis (its store errors and fallbacks) fails the script instead of printing a ratio.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BENCH="$ROOT/scripts/bench"
if [ "${SMOKE:-0}" = 1 ]; then DURATION="${DURATION:-1}" CONNS="${CONNS:-16}" KEYS="${KEYS:-1000}" CALLS_PER_CONN=100; fi
DURATION="${DURATION:-10}"
CONNS="${CONNS:-16 64}"
KEYS="${KEYS:-100000}"
REDIS_CPU="${REDIS_CPU:-0}"
OTHER_CPU="${OTHER_CPU:-1}"
OUT="${OUT:-$(mktemp -t redis-load.XXXXXX.md)}"
export BENCH_KEYS="$KEYS"
# shellcheck source=scripts/bench/lib.sh
. "$BENCH/lib.sh"

install_missing wrk:wrk redis-server:redis-server redis-benchmark:redis-tools
SLUICE="$(sluice_bin)"

REDIS_PORT=18379
SLUICE_PORT=18380
PIDS=()
cleanup() { for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
trap 'exit 130' INT TERM

cli() { redis-cli -p "$REDIS_PORT" "$@"; }
script_calls() { cli INFO commandstats | awk -F'[=,:]' '/^cmdstat_fcall:/ {print $3}'; }
store_failures() { # store errors + fallbacks so far, from sluice's /metrics
    curl -s "http://127.0.0.1:$SLUICE_PORT/metrics" | awk '/^sluice_store_(errors|fallbacks)/ {s += $NF} END {printf "%.0f", s}'
}

start_redis "$REDIS_PORT" "$REDIS_CPU"; PIDS+=("$REDIS_PID")
# The library sluice loads itself (in src/store/redis/library.rs's order), under a name of its
# own for redis-benchmark.
LIBRARY_FILE=$(mktemp)
files=$(lua_library_files)
{
    echo '#!lua name=sluice_bench'
    for part in $files; do cat "$ROOT/$part"; done
    echo "redis.register_function('sluice_bench', decide)"
} > "$LIBRARY_FILE"
loaded=$(cli -x FUNCTION LOAD REPLACE < "$LIBRARY_FILE" 2>&1)
[ "$loaded" = sluice_bench ] || fail "FUNCTION LOAD: $loaded"

RUST_LOG=warn taskset -c "$OTHER_CPU" "$SLUICE" serve --policies "$BENCH/${POLICIES:-policies-1rule}" \
    --listen "127.0.0.1:$SLUICE_PORT" --redis "redis://127.0.0.1:$REDIS_PORT" --redis-timeout 1s 2>/dev/null & PIDS+=($!)
for _ in $(seq 100); do curl -sf -o /dev/null -d '{"path":"/"}' "http://127.0.0.1:$SLUICE_PORT/v1/check" && break; sleep 0.1; done
sample='{"namespace":"bench","path":"/orders/1","headers":{"x-api-key":"key-1"}}'
curl -s -d "$sample" "http://127.0.0.1:$SLUICE_PORT/v1/check" | grep -q '"allowed":true' || { log "sample not allowed"; exit 1; }

{
    echo "| connections | redis-benchmark FCALL (req/s) | sluice /v1/check on Redis (req/s) | ratio | sluice p50 | sluice p99 | FCALL per decision |"
    echo "|---:|---:|---:|---:|---:|---:|---:|"
} > "$OUT"

for c in $CONNS; do
    # The ceiling: the same function, one fixed-window rule (1e9 per hour, so nothing is denied),
    # random keys, `c` connections.
    # Arguments as lua/check.lua's `decide` takes them: now and hold id ("": the server's clock,
    # no hold), then the rule's parameters and cost.
    n=$((c * ${CALLS_PER_CONN:-4000}))
    cli CONFIG RESETSTAT >/dev/null
    ceiling=$(taskset -c "$OTHER_CPU" redis-benchmark -p "$REDIS_PORT" -c "$c" -n "$n" -r "$KEYS" -q \
        FCALL sluice_bench 1 "sl1:{bench}:bench:9:key-__rand_int__" "" "" "4:1000000000:3600000000:1000000000:4:-1:1" 1 \
        | tr '\r' '\n' | awk '/requests per second/ {for (i = 1; i <= NF; i++) if ($i ~ /^[0-9.]+$/) v = $i} END {print v}')
    read -r calls failed rejected <<<"$(fcall_stats "$REDIS_PORT")"
    if [ "$calls" != "$n" ] || [ "$failed" != 0 ] || [ "$rejected" != 0 ]; then
        fail "redis-benchmark FCALL: $calls calls of $n, $failed failed, $rejected rejected"
    fi
    failures0=$(store_failures)
    before=$(script_calls)
    out=$(taskset -c "$OTHER_CPU" wrk -t1 -c "$c" -d "${DURATION}s" --latency -s "$BENCH/check.lua" \
        "http://127.0.0.1:$SLUICE_PORT/v1/check")
    after=$(script_calls)
    rps=$(awk '/^Requests\/sec/ {print $2}' <<<"$out")
    total=$(awk '/requests in/ {print $1}' <<<"$out")
    p50=$(awk '$1 == "50%" {print $2}' <<<"$out")
    p99=$(awk '$1 == "99%" {print $2}' <<<"$out")
    non2xx=$(awk '/Non-2xx/ {print $4}' <<<"$out")
    errors=$(awk '/Non-2xx|Socket errors/ {printf "%s ", $0}' <<<"$out")
    if [ -n "$errors" ] || [ "${total:-0}" -le 0 ]; then fail "wrk, $c connections: ${errors:-no request answered}"; fi
    failures=$(($(store_failures) - failures0))
    [ "$failures" = 0 ] || fail "wrk, $c connections: $failures decisions without Redis (store errors and fallbacks)"
    per=$(awk -v a="$after" -v b="$before" -v t="$total" 'BEGIN { printf "%.3f", (a - b) / t }')
    ratio=$(awk -v s="$rps" -v r="$ceiling" 'BEGIN { printf "%.0f%%", 100 * s / r }')
    log "c=$c ceiling=$ceiling sluice=$rps ($ratio) p50=$p50 p99=$p99 fcall/decision=$per non2xx=${non2xx:-0}"
    echo "| $c | $ceiling | $rps | $ratio | $p50 | $p99 | $per |" >> "$OUT"
done
log "machine: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), load $(cut -d' ' -f1-3 /proc/loadavg)"
cat "$OUT"
