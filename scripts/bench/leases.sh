#!/usr/bin/env bash
# Quota leases measured side by side (docs/leasing.md; figures in docs/benchmarks.md, "Quota
# leases"): ENFORCERS servers of Envoy's rate limit service on one Redis each, one hot key offered
# MULTIPLE times its limit plus COLD_KEYS other keys, the same traffic (examples/failover_load.rs
# over gRPC, one HTTP/2 connection per server) for:
#
#   exact      sluice serve, the rule with consistency: exact (every decision asks Redis)
#   leased     sluice serve, the same rule with consistency: leased, maxOvershoot 2%
#   limitador  Limitador (redis_cached: counters kept in each server and flushed to Redis
#              periodically, its answer to hot keys), the same limit
#
# Per server kind, two runs: the hot key alone (store calls per decision: the scripts Redis ran,
# FCALL for Sluice, EVALSHA for Limitador, from INFO commandstats, over the decisions answered),
# then hot and cold keys together (admitted per full window of PER seconds as a multiple of the
# limit: max and p99; decisions answered per second; latency; CPU seconds of the servers and of
# Redis per 1000 decisions). Then `kill`: leased, one server killed -9 half a second into a
# window, while it holds slices: what that window admitted, and the next.
#
#   scripts/bench/leases.sh                       # all of it, ~5 minutes
#   ENFORCERS=8 LIMIT=10000 PER=20 MULTIPLE=10 COLD_KEYS=10000 COLD_RATE=500 DURATION=80 scripts/bench/leases.sh
#   scripts/bench/leases.sh exact leased          # only these kinds (and no kill)
#
# Limitador is built by scripts/bench/limitador.sh (cached outside the checkout); without its
# source tree (SLUICE_LIMITADOR_SRC) or a built binary (SLUICE_LIMITADOR_BIN) its runs are left
# out, and the script says so.
set -euo pipefail
# The smoke run of the test command (SMOKE=1): 2 servers, 1 s windows, a few seconds per run;
# numbers meaningless, every step of the script exercised. Any transport error or non-200 in a
# run without a kill fails the script.
if [ "${SMOKE:-0}" = 1 ]; then
    ENFORCERS="${ENFORCERS:-2}" LIMIT="${LIMIT:-100}" PER="${PER:-1}" MULTIPLE="${MULTIPLE:-2}" COLD_KEYS="${COLD_KEYS:-10}"
    COLD_RATE="${COLD_RATE:-20}" HOT_DURATION="${HOT_DURATION:-1}" DURATION="${DURATION:-1}"
fi
# lib.sh sets its own default DURATION: keep the caller's, or this script's.
requested_duration="${DURATION:-80}"
# shellcheck source=scripts/reliability/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../reliability/lib.sh"
DURATION="$requested_duration"
ENFORCERS="${ENFORCERS:-8}"
LIMIT="${LIMIT:-10000}"
PER="${PER:-20}"
BOUND="${BOUND:-2%}"
MULTIPLE="${MULTIPLE:-10}"
COLD_KEYS="${COLD_KEYS:-10000}"
COLD_RATE="${COLD_RATE:-500}"
HOT_DURATION="${HOT_DURATION:-40}"
KINDS=("$@")
((${#KINDS[@]})) || KINDS=(exact leased limitador kill)
HOT_RATE=$((LIMIT * MULTIPLE / PER))

install_missing redis-server:redis-server redis-cli:redis-tools python3:python3 jq:jq curl:curl
if [ -z "${SLUICE_BIN:-}" ] || [ -z "${LOAD_BIN:-}" ]; then
    (cd "$RELIABILITY_ROOT" && cargo build --release --quiet --bin sluice --example failover_load)
fi
TARGET="${CARGO_TARGET_DIR:-$RELIABILITY_ROOT/target}"
SLUICE="${SLUICE_BIN:-$TARGET/release/sluice}"
LOAD="${LOAD_BIN:-$TARGET/release/examples/failover_load}"
LIMITADOR="${SLUICE_LIMITADOR_BIN:-}"
if [[ " ${KINDS[*]} " == *" limitador "* ]] && [ -z "$LIMITADOR" ]; then
    LIMITADOR=$("$RELIABILITY_ROOT/scripts/bench/limitador.sh" build 2>/dev/null) || {
        log "Limitador is not built and no source tree was given (SLUICE_LIMITADOR_SRC): its runs are left out"
        LIMITADOR=""
    }
fi

policy() { # MODE: the rule, exact or leased
    local consistency=""
    [ "$1" = leased ] && consistency="      consistency: {mode: leased, maxOvershoot: \"$BOUND\"}"
    cat >"$WORK/policy-$1.yaml" <<EOF
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: hot, namespace: leases}
spec:
  rules:
    - name: per-client
      match:
        descriptor:
          - {key: path, exact: /api}
          - {key: run}
      key: [{descriptor: run}]
      algorithm: fixedWindow
      limit: {requests: $LIMIT, per: ${PER}s}
$consistency
EOF
}
cat >"$WORK/limitador-limits.yaml" <<EOF
- namespace: leases
  name: per-client
  max_value: $LIMIT
  seconds: $PER
  conditions: ["descriptors[0].path == '/api'"]
  variables: ["descriptors[0].run"]
EOF

start_servers() { # KIND REDIS_PORT: ENFORCERS servers; gRPC addresses in SERVERS, pids in SERVER_PIDS
    local kind="$1" redis="$2" grpc http
    SERVERS=(); SERVER_PIDS=(); HTTPS=()
    for _ in $(seq "$ENFORCERS"); do
        grpc=$(free_port); http=$(free_port)
        if [ "$kind" = limitador ]; then
            "$LIMITADOR" --rls-ip 127.0.0.1 --rls-port "$grpc" --http-ip 127.0.0.1 --http-port "$http" \
                "$WORK/limitador-limits.yaml" redis_cached "redis://127.0.0.1:$redis" >>"$WORK/limitador.log" 2>&1 &
        else
            "$SLUICE" serve --policies "$WORK/policy-$kind.yaml" --listen "127.0.0.1:$http" --grpc-listen "127.0.0.1:$grpc" \
                --redis "redis://127.0.0.1:$redis" 2>>"$WORK/sluice.log" &
        fi
        PIDS+=($!); SERVER_PIDS+=($!); SERVERS+=("127.0.0.1:$grpc"); HTTPS+=("127.0.0.1:$http")
    done
    for http in "${HTTPS[@]}"; do
        if [ "$kind" = limitador ]; then wait_for 30 "limitador on $http" curl -sf "http://$http/status"
        else wait_for 30 "sluice on $http" curl -sf "http://$http/readyz"; fi
    done
}

cpu_seconds() { # PIDS...: user+system CPU seconds, summed
    local pid ticks=0 hz
    hz=$(getconf CLK_TCK)
    for pid in "$@"; do
        [ -r "/proc/$pid/stat" ] || continue
        ticks=$((ticks + $(awk '{print $14 + $15}' "/proc/$pid/stat")))
    done
    python3 -c "print($ticks / $hz)"
}

# Calls a client made: the scripts Redis ran (the commands inside them are counted apart).
commands() { redis-cli -p "$1" info commandstats | awk -F'[=,:]' '/^cmdstat_(fcall|evalsha|eval):/ {n += $3} END {print n + 0}'; }

RESULTS=()
run() { # KIND PHASE COLD_RATE DURATION
    local kind="$1" phase="$2" cold_rate="$3" duration="$4" redis
    redis=$(free_port)
    start_redis "$redis" 0-1
    PIDS+=("$REDIS_PID")
    start_servers "$kind" "$redis"
    python3 -c "import time; time.sleep($PER - time.time() % $PER + 0.02)"
    local cmd0 cpu0 rcpu0 started
    cmd0=$(commands "$redis"); cpu0=$(cpu_seconds "${SERVER_PIDS[@]}"); rcpu0=$(cpu_seconds "$REDIS_PID")
    started=$(date +%s.%N)
    "$LOAD" --protocol rls --endpoints "$(IFS=,; echo "${SERVERS[*]}")" --paths /api --namespace leases --domain leases \
        --descriptor-key path --run-key run --rate "$HOT_RATE" --cold-keys "$COLD_KEYS" --cold-rate "$cold_rate" \
        --duration "$duration" --window "$PER" --timeout-ms 1000 --run "hot-$kind-$phase-$$" >"$WORK/load.json"
    local elapsed cmds cpu rcpu
    elapsed=$(python3 -c "import time; print(time.time() - $started)")
    cmds=$(($(commands "$redis") - cmd0))
    cpu=$(python3 -c "print($(cpu_seconds "${SERVER_PIDS[@]}") - $cpu0)")
    rcpu=$(python3 -c "print($(cpu_seconds "$REDIS_PID") - $rcpu0)")
    RESULTS+=("$(jq -c --arg k "$kind" --arg p "$phase" --argjson cmds "$cmds" --argjson cpu "$cpu" --argjson rcpu "$rcpu" \
        --argjson elapsed "$elapsed" --argjson limit "$LIMIT" '
        def full: if (.admitted_per_window | length) > 2 then .admitted_per_window[1:-1] else .admitted_per_window end;
        def p99: sort | .[((length * 0.99) | ceil) - 1];
        (.["/api"]) as $hot | (.["/api cold"] // {sent: 0, admitted: 0, transport_errors: 0}) as $cold |
        ($hot.sent + $cold.sent - $hot.transport_errors - $cold.transport_errors) as $answered |
        {kind: $k, phase: $p, hot_sent: $hot.sent, hot_admitted: $hot.admitted, cold_sent: $cold.sent, cold_admitted: $cold.admitted,
         errors: ($hot.transport_errors + $cold.transport_errors + $hot.non_200 + $cold.non_200),
         windows: ($hot.admitted_per_window | map(. / $limit)),
         max_window: (($hot | full | max // 0) / $limit), p99_window: (($hot | full | p99 // 0) / $limit),
         store_calls_per_decision: ($cmds / $answered), decisions_per_s: ($answered / $elapsed),
         p50_ms: $hot.latency_ms.p50, p99_ms: $hot.latency_ms.p99,
         server_cpu_s_per_1000: (1000 * $cpu / $answered), redis_cpu_s_per_1000: (1000 * $rcpu / $answered)}' "$WORK/load.json")")
    printf '%s\n' "${RESULTS[-1]}"
    jq -e '.errors == 0 and .hot_sent > 0' <<<"${RESULTS[-1]}" >/dev/null || fail "$kind $phase: failed calls (errors) or none sent"
    kill_all
}

kill_run() { # leased, one server killed -9 holding slices half a second into a window
    local redis
    redis=$(free_port)
    start_redis "$redis" 0-1
    PIDS+=("$REDIS_PID")
    start_servers leased "$redis"
    python3 -c "import time; time.sleep($PER - time.time() % $PER + 0.02)"
    "$LOAD" --protocol rls --endpoints "$(IFS=,; echo "${SERVERS[*]}")" --paths /api --namespace leases --domain leases \
        --descriptor-key path --run-key run --rate "$HOT_RATE" --duration $((3 * PER)) --window "$PER" --timeout-ms 1000 \
        --run "kill-$$" >"$WORK/load.json" &
    local load=$! victim="${HTTPS[0]}" held
    sleep "$PER.5"
    held=$(curl -s "http://$victim/v1/snapshot" | jq -c '.store.quotaLeases | {held, unitsHeld}')
    kill -9 "${SERVER_PIDS[0]}"
    wait "$load" || true
    RESULTS+=("$(jq -c --arg held "$held" --argjson limit "$LIMIT" '.["/api"] as $hot |
        {kind: "kill", phase: "killed 0.5 s into window 2", held_when_killed: ($held | fromjson),
         windows: ($hot.admitted_per_window | map(. / $limit)), admitted_per_window: $hot.admitted_per_window,
         errors: ($hot.transport_errors + $hot.non_200)}' "$WORK/load.json")")
    printf '%s\n' "${RESULTS[-1]}"
    # The killed server's calls fail by design; the others' must have been decided.
    jq -e '([.admitted_per_window[]] | add // 0) > 0' <<<"${RESULTS[-1]}" >/dev/null || fail "kill: nothing admitted"
    kill_all
}

log "load average before: $(cut -d' ' -f1-3 /proc/loadavg); $ENFORCERS servers per kind, limit $LIMIT per ${PER}s," \
    "leased bound $BOUND, hot key at ${MULTIPLE}x (${HOT_RATE}/s), $COLD_KEYS cold keys at ${COLD_RATE}/s"
for kind in "${KINDS[@]}"; do
    case "$kind" in
        exact|leased) policy "$kind"; run "$kind" hot 0 "$HOT_DURATION"; run "$kind" mixed "$COLD_RATE" "$DURATION" ;;
        limitador) [ -n "$LIMITADOR" ] || continue
            run limitador hot 0 "$HOT_DURATION"; run limitador mixed "$COLD_RATE" "$DURATION" ;;
        kill) policy leased; kill_run ;;
        *) log "unknown kind $kind: exact, leased, limitador or kill"; exit 2 ;;
    esac
done
log "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
printf '\n%-10s %-6s %18s %10s %10s %12s %9s %9s %10s %10s %7s\n' kind phase "store calls/dec." "max/limit" "p99/limit" "decisions/s" "p50 ms" "p99 ms" "cpu s/1k" "redis s/1k" errors
for line in "${RESULTS[@]}"; do
    jq -r 'select(.store_calls_per_decision != null) |
        [.kind, .phase, (.store_calls_per_decision * 10000 | round / 10000), (.max_window * 1000 | round / 1000),
         (.p99_window * 1000 | round / 1000), (.decisions_per_s | round), .p50_ms, .p99_ms,
         (.server_cpu_s_per_1000 * 1000 | round / 1000), (.redis_cpu_s_per_1000 * 1000 | round / 1000), .errors] | @tsv' <<<"$line" |
        awk -F'\t' '{ printf "%-10s %-6s %18s %10s %10s %12s %9s %9s %10s %10s %7s\n", $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11 }'
done
for line in "${RESULTS[@]}"; do jq -r 'select(.kind == "kill") | "kill: \(.held_when_killed) held by the killed server; admitted per window \(.admitted_per_window)"' <<<"$line"; done
