#!/usr/bin/env bash
# Overload protection, side by side in one run (docs/overload.md, "Measured"):
#
#   none      the sidecar in front of the application, no protection;
#   static    a hand-tuned static concurrency limit: a `concurrency` rule of WORKERS requests in
#             progress (the application's exact worker count), 429 past it;
#   adaptive  `spec.overload` (Gradient2) with `priorities`: /checkout critical, /reports sheddable.
#
# The application (examples/overload_bench.rs `app`) serves WORKERS requests at once, SERVICE_MS
# each, the rest wait in a FIFO queue: capacity WORKERS × 1000 / SERVICE_MS requests per second.
# An open-loop generator sends 20% critical, 80% sheddable at 0.7×, 1×, 2× and 4× of capacity,
# DURATION seconds each; a response slower than TIMEOUT_MS counts as failed (the client gave up).
# Then the convergence run: adaptive at 2× for 30 s, the capacity halved from 10 s to 20 s,
# /overload sampled every 250 ms into $OUT/convergence.csv (drawn by examples/overload_plot.rs).
#
#   scripts/bench/overload.sh                       # prints JSON lines and a Markdown table
#   WORKERS=8 SERVICE_MS=20 DURATION=20 OUT=/tmp/overload scripts/bench/overload.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=scripts/bench/lib.sh
. scripts/bench/lib.sh
install_missing curl:curl jq:jq

WORKERS=${WORKERS:-8}
SERVICE_MS=${SERVICE_MS:-20}
DURATION=${DURATION:-20}
TIMEOUT_MS=${TIMEOUT_MS:-2000}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
capacity=$((WORKERS * 1000 / SERVICE_MS))

cargo build --release --quiet --bin sluice --example overload_bench --example overload_plot
target="${CARGO_TARGET_DIR:-target}/release"
sluice="$target/sluice"
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
    adaptive) cat >"$dir/p.yaml" <<'EOF'
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: protect, namespace: bench}
spec:
  priorities:
    - {class: critical, match: {paths: [{prefix: /checkout}]}}
    - {class: sheddable, match: {paths: [{prefix: /reports}]}}
  overload: {initialLimit: 8, minLimit: 2, maxLimit: 400}
  rules: []
EOF
    ;;
    esac
    echo "$dir"
}

# start SETUP: the application, the endpoint and the sidecar; sets SIDECAR and ADMIN.
start() {
    local policies app endpoint
    policies=$(write_policies "$1")
    app=$(free_port); endpoint=$(free_port); SIDECAR=$(free_port); ADMIN=$(free_port)
    echo "$WORKERS" >"$work/capacity"
    "$bench" app --port "$app" --workers "$WORKERS" --service-ms "$SERVICE_MS" --capacity-file "$work/capacity" 2>/dev/null &
    pids+=($!)
    "$sluice" serve --policies "$policies" --listen "127.0.0.1:$endpoint" 2>/dev/null &
    pids+=($!)
    until curl -sf -o /dev/null "127.0.0.1:$endpoint/readyz"; do sleep 0.1; done
    "$sluice" sidecar --listen "127.0.0.1:$SIDECAR" --admin-listen "127.0.0.1:$ADMIN" --upstream "127.0.0.1:$app" \
        --endpoint "http://127.0.0.1:$endpoint" --namespace bench 2>"$work/sidecar-$1.log" &
    pids+=($!)
    until curl -sf -o /dev/null "127.0.0.1:$ADMIN/readyz" && curl -s -o /dev/null "127.0.0.1:$SIDECAR/"; do sleep 0.1; done
}

log "capacity $capacity requests/s ($WORKERS workers x $SERVICE_MS ms); $DURATION s per step; results in $OUT"
results="$OUT/results.jsonl"
: >"$results"
for setup in none static adaptive; do
    start "$setup"
    for factor in 0.7 1 2 4; do
        rate=$(python3 -c "print($capacity * $factor)")
        cpu0=$(awk '{print $14 + $15}' "/proc/${pids[2]}/stat")
        line=$("$bench" load --addr "127.0.0.1:$SIDECAR" --rate "$rate" --duration "$DURATION" --timeout-ms "$TIMEOUT_MS")
        cpu1=$(awk '{print $14 + $15}' "/proc/${pids[2]}/stat")
        echo "$line" | jq -c --arg setup "$setup" --argjson factor "$factor" --argjson capacity "$capacity" \
            --argjson ticks "$((cpu1 - cpu0))" --argjson hz "$(getconf CLK_TCK)" \
            '. + {setup: $setup, factor: $factor, capacity: $capacity, sidecarCpuSeconds: ($ticks / $hz)}' | tee -a "$results"
        sleep 3
    done
    stop_all
done

log "convergence: adaptive at 2x for 30 s, capacity halved from 10 s to 20 s"
start adaptive
csv="$OUT/convergence.csv"
echo "seconds,limit,in_flight,latency_ms,capacity" >"$csv"
"$bench" load --addr "127.0.0.1:$SIDECAR" --rate "$((capacity * 2))" --duration 30 --timeout-ms "$TIMEOUT_MS" >"$OUT/convergence.json" &
load=$!
begin=$(date +%s.%N)
for i in $(seq 120); do
    now=$(python3 -c "print(round($(date +%s.%N) - $begin, 2))")
    [ "$i" = 40 ] && echo "$((WORKERS / 2))" >"$work/capacity"
    [ "$i" = 80 ] && echo "$WORKERS" >"$work/capacity"
    workers=$(cat "$work/capacity")
    curl -s "127.0.0.1:$ADMIN/overload" | jq -r --arg t "$now" --arg c "$((workers * 1000 / SERVICE_MS))" \
        '[$t, .protection.state.limit, .protection.state.inFlight, .protection.state.estimate.shortLatencyMs, $c] | @csv' >>"$csv"
    sleep 0.25
done
wait "$load"
stop_all
"$target/examples/overload_plot" "$csv" "$OUT/convergence.svg"

log "table"
jq -rs '
  "| setup | load | goodput (of capacity) | admitted p50 / p99 ms | critical success | sheddable success | sidecar CPU µs/request |",
  "|---|---|---|---|---|---|---|",
  (.[] | "| \(.setup) | \(.factor)x | \((.goodput / .capacity * 100 | floor))% | \(.sheddable.p50Ms // "-") / \(.sheddable.p99Ms // "-") (critical \(.critical.p50Ms // "-") / \(.critical.p99Ms // "-")) | \((.critical.successRate * 1000 | floor) / 10)% | \((.sheddable.successRate * 1000 | floor) / 10)% | \((.sidecarCpuSeconds / (.critical.sent + .sheddable.sent) * 1e6 | floor)) |")
' "$results"
log "convergence: $csv, $OUT/convergence.svg"
