#!/usr/bin/env bash
# Quota leases under the traffic a sidecar sends (issue 41, item 2; docs/leasing.md, figures in
# docs/benchmarks.md "Quota leases under batched traffic"): REPLICAS `sluice serve` on one Redis,
# CLIENTS connections spread over them, each posting `POST /v1/checks` batches of BATCH checks of
# one hot key (BATCH=1: single `POST /v1/check`s) for DURATION seconds, once with the rule exact
# and once leased. Prints, per mode: decisions answered, decisions per second, and the store
# calls per decision: the functions Redis ran (FCALL: decisions, lease renewals and settles;
# INFO commandstats) over the decisions answered.
#
#   scripts/bench/leases-batched.sh                  # batches of 50, then single checks
#   BATCH=50 DURATION=8 scripts/bench/leases-batched.sh leased
#
# Env: REPLICAS (4), CLIENTS (8), BATCHES ("50 1": the batch sizes run), DURATION (8 s per run),
#      LIMIT and PER (1000000 per 1s: above the offered load, so every check is admitted and
#      the calls are those of admitting; a longer window spreads each window's first and last
#      calls over more decisions), BOUND (maxOvershoot, 2%), SLUICE_BIN (the binary; else the
#      release build of this checkout).
# A batch not answered 200, or a check in it refused with an error (a status in its result),
# fails the script: calls per decision of failures are not the figure.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=scripts/bench/lib.sh
. "$ROOT/scripts/bench/lib.sh"
if [ "$SMOKE" = 1 ]; then
    REPLICAS="${REPLICAS:-2}" CLIENTS="${CLIENTS:-2}" DURATION="${DURATION:-1}" BATCHES="${BATCHES:-8 1}"
fi
REPLICAS="${REPLICAS:-4}"
CLIENTS="${CLIENTS:-8}"
BATCHES="${BATCHES:-50 1}"
DURATION="${DURATION:-8}"
LIMIT="${LIMIT:-1000000}"
PER="${PER:-1s}"
BOUND="${BOUND:-2%}"
MODES=("$@")
((${#MODES[@]})) || MODES=(exact leased)

install_missing redis-server:redis-server redis-cli:redis-tools python3:python3 curl:curl
SLUICE="${SLUICE_BIN:-}"
if [ -z "$SLUICE" ]; then
    (cd "$ROOT" && cargo build --release --quiet --bin sluice)
    SLUICE="${CARGO_TARGET_DIR:-$ROOT/target}/release/sluice"
fi
work="$(mktemp -d)"
pids=()
cleanup() {
    ((${#pids[@]})) && kill "${pids[@]}" 2>/dev/null
    [ -n "${REDIS_PID:-}" ] && kill "$REDIS_PID" 2>/dev/null
    wait 2>/dev/null
    rm -rf "$work"
}
trap cleanup EXIT


run() { # MODE BATCH
    local mode="$1" batch="$2" consistency="" redis ports=() i
    [ "$mode" = leased ] && consistency="      consistency: {mode: leased, maxOvershoot: \"$BOUND\"}"
    cat >"$work/policy.yaml" <<EOF
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: hot, namespace: default}
spec:
  rules:
    - name: all-clients
      algorithm: fixedWindow
      limit: {requests: $LIMIT, per: $PER}
$consistency
EOF
    redis="$(free_port)"
    start_redis "$redis" 0-1
    for ((i = 0; i < REPLICAS; i++)); do
        ports+=("$(free_port)")
        "$SLUICE" serve --policies "$work/policy.yaml" --listen "127.0.0.1:${ports[i]}" \
            --redis "redis://127.0.0.1:$redis" 2>"$work/serve-$i.log" &
        pids+=($!)
    done
    for port in "${ports[@]}"; do
        for t in $(seq 100); do
            curl -fsS -o /dev/null "http://127.0.0.1:$port/readyz" 2>/dev/null && break
            [ "$t" != 100 ] || fail "sluice serve on $port did not get ready: $(tail -n 5 "$work"/serve-*.log)"
            sleep 0.1
        done
    done
    local before after out
    before="$(store_calls "$redis")"
    out="$(python3 - "$batch" "$CLIENTS" "$DURATION" "${ports[@]}" <<'PY'
import http.client, json, sys, threading, time
batch, clients, duration, ports = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4:]
check = {"namespace": "default", "path": "/search"}
body = json.dumps({"requests": [check] * batch} if batch > 1 else check).encode()
path = "/v1/checks" if batch > 1 else "/v1/check"
decided, failures, lock = [0], [], threading.Lock()
def client(n):
    connection = http.client.HTTPConnection("127.0.0.1", int(ports[n % len(ports)]), timeout=30)
    count, end = 0, time.monotonic() + duration
    while time.monotonic() < end:
        try:
            connection.request("POST", path, body, {"content-type": "application/json"})
            response = connection.getresponse()
            answer = json.loads(response.read())
        except Exception as error:  # a reset, a timeout, a body that is not JSON
            failures.append(repr(error)); return
        if response.status != 200:
            failures.append(f"status {response.status}: {answer}"); return
        results = answer["results"] if batch > 1 else [answer]
        errors = [r for r in results if "error" in r]
        if errors:
            failures.append(f"refused checks: {errors[:2]}"); return
        count += len(results)
    with lock:
        decided[0] += count
threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
started = time.monotonic()
for t in threads: t.start()
for t in threads: t.join()
elapsed = time.monotonic() - started
if failures or decided[0] == 0:
    sys.exit(f"FAILED: {len(failures)} clients failed ({failures[:2]}), {decided[0]} decisions")
print(decided[0], f"{decided[0] / elapsed:.0f}")
PY
)" || fail "the load failed: $out"
    after="$(store_calls "$redis")"
    local decisions rate calls
    read -r decisions rate <<<"$out"
    calls=$((after - before))
    printf '%-7s batch %3d: %8d decisions, %7d/s, %6d store calls, %.4f calls per decision\n' \
        "$mode" "$batch" "$decisions" "$rate" "$calls" "$(python3 -c "print($calls / $decisions)")"
    kill "${pids[@]}" 2>/dev/null
    wait "${pids[@]}" 2>/dev/null || true
    pids=()
    kill "$REDIS_PID" 2>/dev/null
    wait "$REDIS_PID" 2>/dev/null || true
    REDIS_PID=""
}

echo "quota leases: $REPLICAS replicas on one Redis, $CLIENTS connections, ${DURATION}s per run, limit $LIMIT per $PER (load: $(cut -d' ' -f1-3 /proc/loadavg))"
for batch in $BATCHES; do
    for mode in "${MODES[@]}"; do
        case "$mode" in exact | leased) run "$mode" "$batch" ;; *) fail "unknown mode $mode (exact, leased)" ;; esac
    done
done
