#!/usr/bin/env bash
# Egress shaping across replicas (issue 42; docs/egress.md): a bank that takes RATE requests a
# second (it answers 429 to a request past RATE accepted in any second), called by CALLERS
# application replicas, each offering bursts of 20-40 requests a second, so that their average
# fits the bank and their bursts together do not. Side by side in one run:
#   direct  the callers call the bank at once (no shaping);
#   client  each caller paces itself at RATE (a per-pod client-side limiter set to the bank's
#           rate: it never binds a pod that alone offers less);
#   split   each caller paces itself at RATE / CALLERS (the budget divided statically);
#   sluice  each caller calls its own `sluice sidecar`'s egress port; the sidecars share one
#           budget in Redis through one `sluice serve` (a policy per caller, one destination),
#           declared at the bank's rate;
#   sluice@LIMIT  the same budget declared at LIMIT (default 96% of RATE): the headroom that
#           absorbs the callers' timer and network lateness, so that a strict bank refuses none.
# Then, with FAULTS=1 (default), two sluice runs with a fault half-way: one sidecar killed -9
# (its waiting requests die with it), and Redis stopped for 3 s (the endpoint's localFallback).
# Prints one line per run: offered, reached the bank, refused by the bank, refused before sending,
# the most the bank saw in any second and in any 100 ms, callers' latency p50/p99, the waits the
# budget gave (p50/p99/max) against a perfect shared shaper's, and Redis calls per request sent.
#
#   scripts/bench/egress.sh                      # all modes and both faults
#   DURATION=10 scripts/bench/egress.sh sluice
#
# Env: CALLERS (6), RATE (50), LIMIT (RATE × 0.96), MAX_DELAY_MS (3000), DURATION (20 s),
#      FAULTS (1), SLUICE_BIN.
# A request that fails (no answer, a status other than 200 or 429) fails the script.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=scripts/bench/lib.sh
. "$ROOT/scripts/bench/lib.sh"
if [ "$SMOKE" = 1 ]; then
    CALLERS="${CALLERS:-2}" DURATION="${DURATION:-3}" FAULTS="${FAULTS:-0}"
fi
CALLERS="${CALLERS:-6}"
RATE="${RATE:-50}"
MAX_DELAY_MS="${MAX_DELAY_MS:-3000}"
DURATION="${DURATION:-20}"
FAULTS="${FAULTS:-1}"
LIMIT="${LIMIT:-$((RATE * 96 / 100))}"
MODES=("$@")
((${#MODES[@]})) || MODES=(direct client split sluice "sluice@$LIMIT")

install_missing redis-server:redis-server redis-cli:redis-tools python3:python3 curl:curl
SLUICE="${SLUICE_BIN:-}"
if [ -z "$SLUICE" ]; then
    (cd "$ROOT" && cargo build --release --quiet --bin sluice)
    SLUICE="${CARGO_TARGET_DIR:-$ROOT/target}/release/sluice"
fi
DRIVER="$ROOT/scripts/bench/egress.py"
work="$(mktemp -d)"
pids=()
sidecars=()
cleanup() {
    ((${#pids[@]})) && kill "${pids[@]}" 2>/dev/null
    ((${#sidecars[@]})) && kill "${sidecars[@]}" 2>/dev/null
    [ -n "${REDIS_PID:-}" ] && kill -CONT "$REDIS_PID" 2>/dev/null && kill "$REDIS_PID" 2>/dev/null
    wait 2>/dev/null
    rm -rf "$work"
}
trap cleanup EXIT



bank="$(free_port)"
python3 "$DRIVER" bank "$bank" "$RATE" &
pids+=($!)
wait_for_port "$bank" "the bank"

redis="$(free_port)"
start_redis "$redis" 0-1
egress_ports=()
for ((i = 0; i < CALLERS; i++)); do egress_ports+=("$(free_port)"); done
declare_budget() { # REQUESTS_PER_SECOND: (re)writes the callers' policies with that egress limit
    : >"$work/policies.new"
    for ((i = 0; i < CALLERS; i++)); do
        cat >>"$work/policies.new" <<YAML
---
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: caller-$i, namespace: pay}
spec:
  selector: {matchLabels: {app: caller-$i}}
  egress:
  - name: bank
    destination: http://127.0.0.1:$bank
    listenPort: ${egress_ports[i]}
    limit: {requests: $1, per: 1s, maxDelay: ${MAX_DELAY_MS}ms}
YAML
    done
    mv "$work/policies.new" "$work/policies.yaml"
    BUDGET="$1"
}
declare_budget "$RATE"
endpoint="$(free_port)"
"$SLUICE" serve --policies "$work/policies.yaml" --listen "127.0.0.1:$endpoint" --reload-interval 200ms \
    --redis "redis://127.0.0.1:$redis" --redis-breaker-cooldown 1s 2>"$work/serve.log" &
pids+=($!)
wait_for_port "$endpoint" "sluice serve"

start_sidecar() { # I
    "$SLUICE" sidecar --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 --upstream 127.0.0.1:9 \
        --endpoint "http://127.0.0.1:$endpoint" --namespace pay --labels "app=caller-$1" \
        --snapshot-interval 200ms 2>"$work/sidecar-$1.log" &
    sidecars[$1]=$!
}
for ((i = 0; i < CALLERS; i++)); do start_sidecar "$i"; done
for port in "${egress_ports[@]}"; do wait_for_port "$port" "an egress port"; done

printf '%-16s %7s %7s %6s %7s %6s %6s %8s %8s %16s %16s %8s\n' run offered reached bank429 refused 'max/1s' 'max/.1s' 'p50 ms' 'p99 ms' 'waited p50/p99/max' 'ideal p50/p99' 'calls/req'
# budget REQUESTS_PER_SECOND: the sluice runs' egress limit, in force once every sidecar's
# snapshot has it (the endpoint reloads the file; the sidecars follow its snapshot).
budget() {
    [ "$BUDGET" = "$1" ] && return 0
    declare_budget "$1"
    for t in $(seq 100); do
        curl -fsS "http://127.0.0.1:$endpoint/v1/snapshot" 2>/dev/null | grep -q "\"requests\":$1," && break
        [ "$t" != 100 ] || fail "the endpoint did not load the egress limit $1"
        sleep 0.1
    done
    sleep 1
}
run() { # NAME MODE [FAULT]
    local name="$1" mode="$2" fault="${3:-}" targets=() before after out pace="$RATE"
    case "$mode" in
        sluice) targets=("${egress_ports[@]}"); budget "$RATE" ;;
        sluice@*) targets=("${egress_ports[@]}"); budget "${mode#sluice@}"; pace="${mode#sluice@}"; mode=sluice ;;
        *) for ((i = 0; i < CALLERS; i++)); do targets+=("$bank"); done ;;
    esac
    before="$(store_calls "$redis")"
    python3 "$DRIVER" callers "$mode" "$bank" "$DURATION" "$RATE" "$pace" "$MAX_DELAY_MS" "${targets[@]}" >"$work/run.json" &
    local driver=$!
    case "$fault" in
        kill) sleep "$(python3 -c "print($DURATION / 2)")"; kill -9 "${sidecars[0]}" ;;
        redis) sleep "$(python3 -c "print($DURATION / 2)")"; kill -STOP "$REDIS_PID"; sleep 3; kill -CONT "$REDIS_PID" ;;
    esac
    wait "$driver" || fail "$name: the callers failed"
    after="$(store_calls "$redis")"
    out="$(cat "$work/run.json")"
    python3 - "$name" "$out" "$((after - before))" "$fault" <<'PY' || fail "$name: $out"
import json, sys
name, s, calls, fault = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
# A killed sidecar's callers get connection errors: those are the fault, not a failed call.
if s["errors"] and fault != "kill":
    sys.exit(f"{s['errors']} requests failed: {s['error_sample']}")
sent = max(s["reached_bank"], 1)
print(f"{name:<16} {s['offered']:7d} {s['reached_bank']:7d} {s['bank_refused']:6d} {s['refused_before_sending']:7d} "
      f"{s['most_in_1s']:6d} {s['most_in_100ms']:6d} {s['latency_p50_ms']:8.0f} {s['latency_p99_ms']:8.0f} "
      f"{s['waited_p50_ms']:>5}/{s['waited_p99_ms']:>5}/{s['waited_max_ms']:>5} "
      f"{s['ideal_wait_p50_ms']:>7.0f}/{s['ideal_wait_p99_ms']:>7.0f} {calls / sent:8.2f}")
PY
}
for mode in "${MODES[@]}"; do run "$mode" "$mode"; done
if [ "$FAULTS" = 1 ]; then
    run "sluice@$LIMIT+kill" "sluice@$LIMIT" kill
    start_sidecar 0
    wait_for_port "${egress_ports[0]}" "the restarted sidecar's egress port"
    run "sluice@$LIMIT+redis" "sluice@$LIMIT" redis
fi
log "bank refuses above $RATE in any second; $CALLERS callers; maxDelay ${MAX_DELAY_MS}ms; ${DURATION}s per run; ideal: a perfect shared shaper at the run's rate; load $(cut -d' ' -f1-3 /proc/loadavg)"
