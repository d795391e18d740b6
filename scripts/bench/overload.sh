#!/usr/bin/env bash
# Overload protection, side by side in one run (docs/overload.md, "Measured"):
#
#   none      the sidecar in front of the application, no protection;
#   static    a hand-tuned static concurrency limit: a `concurrency` rule of WORKERS requests in
#             progress (the application's exact worker count), 429 past it;
#   adaptive-150  `spec.overload` (Gradient2) with `priorities`: /checkout critical, /reports
#             sheddable; tolerancePercent 150 (Netflix's default);
#   adaptive-120  the same with tolerancePercent 120 (Sluice's default).
#
# The application (examples/overload_bench.rs `app`) serves WORKERS requests at once, SERVICE_MS
# each, the rest wait in a FIFO queue: capacity WORKERS × 1000 / SERVICE_MS requests per second.
# An open-loop generator sends 20% critical, 80% sheddable at 0.7×, 1×, 2× and 4× of capacity,
# DURATION seconds each; a response slower than TIMEOUT_MS counts as failed (the client gave up).
# Then the sidecar's CPU per request with protection on and off (none vs adaptive, neither asks
# the endpoint), on an application that never queues, CPU_RATE requests/s, interleaved ROUNDS
# times. Last the convergence run: adaptive at CONV_FACTOR× (4) for 30 s, the capacity halved
# from 10 s to 20 s, /overload sampled every 200 ms into $OUT/convergence.csv (drawn by
# examples/overload_plot.rs into $OUT/convergence.svg).
#
#   scripts/bench/overload.sh                       # prints JSON lines and a Markdown table
#   PHASES=cpu scripts/bench/overload.sh            # only some of: load cpu convergence
#   WORKERS=8 SERVICE_MS=20 DURATION=20 OUT=/tmp/overload scripts/bench/overload.sh
#
# Env besides those above: FACTORS ("0.7 1 2 4"), PAUSE (3 s between load steps), CPU_SECONDS
# (10), CONV_SECONDS (30: the capacity halved over its middle third), SKIP_BUILD (1: use the
# binaries already built), SMOKE (1: the test command's check that the script works: 1 s steps
# at 2x, one CPU round of 1 s, a 3 s convergence run).
# A step in which nothing was admitted, or a CPU run (an application that never queues) with any
# failed request (an error or a timeout; a refusal is the limiter's decision), fails the script:
# its figures would be those of failures.
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=scripts/bench/lib.sh
. scripts/bench/lib.sh
install_missing curl:curl jq:jq

if [ "$SMOKE" = 1 ]; then
    DURATION=${DURATION:-1} FACTORS=${FACTORS:-2} PAUSE=${PAUSE:-0} ROUNDS=${ROUNDS:-1} CPU_SECONDS=${CPU_SECONDS:-1}
    CONV_SECONDS=${CONV_SECONDS:-3}
fi
FACTORS=${FACTORS:-0.7 1 2 4}
PAUSE=${PAUSE:-3}
CPU_SECONDS=${CPU_SECONDS:-10}
CONV_SECONDS=${CONV_SECONDS:-30}
WORKERS=${WORKERS:-8}
SERVICE_MS=${SERVICE_MS:-20}
DURATION=${DURATION:-20}
TIMEOUT_MS=${TIMEOUT_MS:-2000}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
capacity=$((WORKERS * 1000 / SERVICE_MS))

[ "${SKIP_BUILD:-0}" = 1 ] || cargo build --release --quiet --bin sluice --example overload_bench --example overload_plot
target="${CARGO_TARGET_DIR:-target}/release"
sluice="${SLUICE_BIN:-$target/sluice}"
bench="$target/examples/overload_bench"

work=$(mktemp -d)
pids=()
stop_all() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; pids=(); }
trap 'stop_all; rm -rf "$work"' EXIT

write_policies() {
    local setup="$1" dir="$work/$1"
    mkdir -p "$dir"
    case "$setup" in
    # No policy for the bench namespace: the sidecar forwards without asking the endpoint (as
    # the adaptive setup does, so their CPU per request compares protection on and off).
    none) cat >"$dir/p.yaml" <<'EOF'
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: elsewhere, namespace: other}
spec:
  rules:
    - {name: all, algorithm: fixedWindow, limit: {requests: 10, per: 1s}}
EOF
    ;;
    static) cat >"$dir/p.yaml" <<EOF
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: static, namespace: bench}
spec:
  rules:
    - {name: in-progress, algorithm: concurrency, limit: {requests: $WORKERS, per: 1m}}
EOF
    ;;
    adaptive-150 | adaptive-120) cat >"$dir/p.yaml" <<EOF
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: protect, namespace: bench}
spec:
  priorities:
    - {class: critical, match: {paths: [{prefix: /checkout}]}}
    - {class: sheddable, match: {paths: [{prefix: /reports}]}}
  overload: {tolerancePercent: ${setup#adaptive-}}
  rules: []
EOF
    ;;
    esac
    echo "$dir"
}

# start SETUP [WORKERS SERVICE_MS]: the application, the endpoint and the sidecar; sets SIDECAR,
# ADMIN and SIDECAR_PID.
start() {
    local policies app endpoint workers="${2:-$WORKERS}" service="${3:-$SERVICE_MS}"
    policies=$(write_policies "$1")
    app=$(free_port); endpoint=$(free_port); SIDECAR=$(free_port); ADMIN=$(free_port)
    echo "$workers" >"$work/capacity"
    "$bench" app --port "$app" --workers "$workers" --service-ms "$service" --capacity-file "$work/capacity" 2>/dev/null &
    pids+=($!)
    "$sluice" serve --policies "$policies" --listen "127.0.0.1:$endpoint" 2>/dev/null &
    pids+=($!)
    until curl -sf -o /dev/null "127.0.0.1:$endpoint/readyz"; do sleep 0.1; done
    "$sluice" sidecar --listen "127.0.0.1:$SIDECAR" --admin-listen "127.0.0.1:$ADMIN" --upstream "127.0.0.1:$app" \
        --endpoint "http://127.0.0.1:$endpoint" --namespace bench 2>"$work/sidecar-$1.log" &
    SIDECAR_PID=$!
    pids+=("$SIDECAR_PID")
    until curl -sf -o /dev/null "127.0.0.1:$ADMIN/readyz" && curl -s -o /dev/null "127.0.0.1:$SIDECAR/"; do sleep 0.1; done
}

log "capacity $capacity requests/s ($WORKERS workers x $SERVICE_MS ms); $DURATION s per step; results in $OUT"
results="$OUT/results.jsonl"
PHASES=${PHASES:-load cpu convergence}
phase() { [[ " $PHASES " == *" $1 "* ]]; }
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
: >"$results"
phase load && for setup in none static adaptive-150 adaptive-120; do
    start "$setup"
    for factor in $FACTORS; do
        rate=$(awk -v c="$capacity" -v f="$factor" 'BEGIN {print c * f}')
        line=$("$bench" load --addr "127.0.0.1:$SIDECAR" --rate "$rate" --duration "$DURATION" --timeout-ms "$TIMEOUT_MS")
        echo "$line" | jq -c --arg setup "$setup" --argjson factor "$factor" --argjson capacity "$capacity" \
            '. + {setup: $setup, factor: $factor, capacity: $capacity}' | tee -a "$results"
        jq -e '.critical.ok + .sheddable.ok > 0' <<<"$line" >/dev/null || fail "$setup at ${factor}x: nothing admitted: $line"
        sleep "$PAUSE"
    done
    stop_all
done

CPU_RATE=${CPU_RATE:-3000}
ROUNDS=${ROUNDS:-2}
phase cpu && log "sidecar CPU per request, protection off and on: $CPU_RATE requests/s for $CPU_SECONDS s, $ROUNDS rounds"
cpu="$OUT/cpu.jsonl"
: >"$cpu"
phase cpu && for _ in $(seq "$ROUNDS"); do
    for setup in none adaptive-120; do
        # 4096 workers of 1 ms: the application never queues, so nothing is shed.
        start "$setup" 4096 1
        "$bench" load --addr "127.0.0.1:$SIDECAR" --rate "$CPU_RATE" --duration "$(awk -v s="$CPU_SECONDS" 'BEGIN {print (s < 2 ? s / 2 : 2)}')" >/dev/null
        before=$(ticks "$SIDECAR_PID")
        line=$("$bench" load --addr "127.0.0.1:$SIDECAR" --rate "$CPU_RATE" --duration "$CPU_SECONDS")
        after=$(ticks "$SIDECAR_PID")
        jq -e '.critical.sent + .sheddable.sent > 0 and .critical.failed + .sheddable.failed == 0' \
            <<<"$line" >/dev/null || fail "CPU run, $setup: failed requests: $line"
        echo "$line" | jq -c --arg setup "$setup" --argjson t "$((after - before))" --argjson hz "$(getconf CLK_TCK)" \
            '{setup: $setup, sent: (.critical.sent + .sheddable.sent), ok: (.critical.ok + .sheddable.ok),
              usPerRequest: ($t / $hz * 1e6 / (.critical.sent + .sheddable.sent) | floor)}' | tee -a "$cpu"
        stop_all
    done
done

if phase convergence; then
    CONV_FACTOR=${CONV_FACTOR:-4}
    log "convergence: adaptive at ${CONV_FACTOR}x for $CONV_SECONDS s, capacity halved over its middle third"
    start adaptive-120
    csv="$OUT/convergence.csv"
    echo "seconds,limit,in_flight,latency_ms,capacity" >"$csv"
    "$bench" load --addr "127.0.0.1:$SIDECAR" --rate "$((capacity * CONV_FACTOR))" --duration "$CONV_SECONDS" --timeout-ms "$TIMEOUT_MS" >"$OUT/convergence.json" &
    load=$!
    begin=$(date +%s%N)
    while kill -0 "$load" 2>/dev/null; do
        elapsed=$(( ($(date +%s%N) - begin) / 1000000 ))
        if [ "$elapsed" -ge $((CONV_SECONDS * 1000 / 3)) ] && [ "$elapsed" -lt $((CONV_SECONDS * 2000 / 3)) ]; then workers=$((WORKERS / 2)); else workers=$WORKERS; fi
        echo "$workers" >"$work/capacity"
        curl -s "127.0.0.1:$ADMIN/overload" | jq -r --arg t "$(awk -v ms="$elapsed" 'BEGIN {print ms / 1000}')" \
            --arg c "$((workers * 1000 / SERVICE_MS))" \
            '[$t, .protection.state.limit, .protection.state.inFlight, .protection.state.estimate.shortLatencyMs, $c] | @csv' >>"$csv"
        sleep 0.2
    done
    wait "$load" || fail "convergence: the load failed"
    jq -e '.critical.ok + .sheddable.ok > 0' "$OUT/convergence.json" >/dev/null || fail "convergence: nothing admitted"
    stop_all
    "$target/examples/overload_plot" "$csv" "$OUT/convergence.svg" "$CONV_FACTOR"
fi

log "table"
jq -rs '
  "| setup | load | goodput (of capacity) | admitted p50 / p99 ms, critical | admitted p50 / p99 ms, sheddable | critical success | sheddable success |",
  "|---|---|---|---|---|---|---|",
  (.[] | "| \(.setup) | \(.factor)x | \((.goodput / .capacity * 1000 | floor) / 10)% | \(.critical.p50Ms // "-") / \(.critical.p99Ms // "-") | \(.sheddable.p50Ms // "-") / \(.sheddable.p99Ms // "-") | \((.critical.successRate * 1000 | floor) / 10)% | \((.sheddable.successRate * 1000 | floor) / 10)% |")
' "$results"
jq -rs 'group_by(.setup)[] | "sidecar CPU, \(.[0].setup): \([.[].usPerRequest] | sort | .[length / 2 | floor]) µs per request (rounds: \([.[].usPerRequest] | map(tostring) | join(", ")))"' "$cpu"
phase convergence && log "convergence: $OUT/convergence.csv, $OUT/convergence.svg"
