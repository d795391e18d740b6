#!/usr/bin/env bash
# The key flood (issue 25): two tenants at once each send FLOOD_KEYS (10M) distinct keys to one
# `sluice serve` on Redis, as a client minting a new API key or user id per request would.
# Redis runs as people run a cache-sized Redis: `maxmemory MAXMEMORY` (1gb) with
# `allkeys-lru`, so a full Redis evicts keys, any namespace's. Each tenant first spends 1000
# "resident" keys (limit 1 per hour, so a resident's second request is refused); after the
# flood those residents are asked again: a resident admitted again lost its counter to the
# flood (over-admission caused by another tenant).
#
# Two runs side by side:
#   bounded    --redis-namespace-max-keys MAX_KEYS (1000000) per namespace, counted every
#              USAGE_INTERVAL (5s): at its bound a namespace's new keys are decided by its
#              rule's onStoreFailure (deny) without touching Redis
#   unbounded  no bound (the default)
#
# Reported per run: decisions per second, Redis memory (peak, end) and keys per namespace,
# evicted keys, residents that lost their counters, the replica's memory before and after, and
# decisions by onStoreFailure.
#
#   scripts/reliability/key-flood.sh                          # both runs, 10M keys per tenant
#   FLOOD_KEYS=1000000 scripts/reliability/key-flood.sh bounded
#
# docs/reliability.md has the figures.
set -euo pipefail
# shellcheck source=scripts/reliability/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
# SMOKE=1 (the test command's check that the script works): 3000 keys per tenant against a bound
# of 1000, counted every second.
if [ "$SMOKE" = 1 ]; then FLOOD_KEYS="${FLOOD_KEYS:-3000}" MAX_KEYS="${MAX_KEYS:-1000}" USAGE_INTERVAL="${USAGE_INTERVAL:-1s}"; fi
FLOOD_KEYS="${FLOOD_KEYS:-10000000}"
MAX_KEYS="${MAX_KEYS:-1000000}"
MAXMEMORY="${MAXMEMORY:-1gb}"
USAGE_INTERVAL="${USAGE_INTERVAL:-5s}"
RUNS=("$@")
((${#RUNS[@]})) || RUNS=(bounded unbounded)

build_tools
for tenant in a b; do
    printf 'apiVersion: sluice.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {name: users, namespace: %s}\nspec:\n  rules:\n    - name: per-user\n      key: [{header: X-User}]\n      algorithm: fixedWindow\n      limit: {requests: 1, per: 1h}\n      onStoreFailure: deny\n' \
        "$tenant" >"$WORK/$tenant.yaml"
done

for run in "${RUNS[@]}"; do
    bound=()
    case "$run" in
        bounded) bound=(--redis-namespace-max-keys "$MAX_KEYS") ;;
        unbounded) ;;
        *) log "unknown run $run (bounded or unbounded)"; exit 1 ;;
    esac
    REDIS=$(free_port); PORT=$(free_port)
    start_redis "$REDIS" 0-1 --maxmemory "$MAXMEMORY" --maxmemory-policy allkeys-lru
    PIDS+=("$REDIS_PID")
    "$SLUICE" serve --policies "$WORK/a.yaml" --policies "$WORK/b.yaml" --listen "127.0.0.1:$PORT" \
        --redis "redis://127.0.0.1:$REDIS" --redis-usage-interval "$USAGE_INTERVAL" "${bound[@]}" \
        2>>"$WORK/sluice.log" &
    SERVE_PID=$!; PIDS+=("$SERVE_PID")
    wait_for 20 "sluice on $PORT" curl -sf "http://127.0.0.1:$PORT/readyz"
    log "run $run: ${FLOOD_KEYS} keys per tenant, Redis maxmemory $MAXMEMORY allkeys-lru ${bound[*]}"
    python3 - "$PORT" "$REDIS" "$SERVE_PID" "$FLOOD_KEYS" "$run" >"$WORK/$run.json" <<'PY'
import http.client, json, subprocess, sys, threading, time
port, redis_port, serve_pid, flood_keys, run = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
BATCH = 250  # /v1/checks takes at most 256

def checks(tenant, users):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = json.dumps({"requests": [{"namespace": tenant, "path": "/", "headers": {"X-User": u}} for u in users]})
    connection.request("POST", "/v1/checks", body, {"content-type": "application/json"})
    response = connection.getresponse()
    data = response.read()
    connection.close()
    if response.status != 200:
        raise SystemExit(f"/v1/checks answered {response.status}: {data[:200]!r}")
    return json.loads(data)["results"]

def outcome(result):
    if "allowed" not in result:
        return f"error-{result.get('status')}"
    return "allowed" if result["allowed"] else "refused"

def resident_keys(tenant):
    scan = subprocess.run(["redis-cli", "-p", redis_port, "--scan", "--pattern", f"*resident-{tenant}-*"],
                          capture_output=True, text=True).stdout
    return len(scan.split())

def redis_info():
    text = subprocess.run(["redis-cli", "-p", redis_port, "INFO"], capture_output=True, text=True).stdout
    info = dict(line.split(":", 1) for line in text.splitlines() if ":" in line and not line.startswith("#"))
    return int(info["used_memory"]), int(info.get("evicted_keys", 0))

def rss_kib():
    with open(f"/proc/{serve_pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))

def residents(tenant):
    return [f"resident-{tenant}-{i}" for i in range(1000)]

def resident_checks(tenant):
    return [outcome(r) for start in range(0, 1000, BATCH) for r in checks(tenant, residents(tenant)[start:start + BATCH])]

report = {"run": run, "flood_keys_per_tenant": flood_keys}
for tenant in "ab":
    first = resident_checks(tenant)
    second = resident_checks(tenant)
    assert first.count("allowed") == 1000 and second.count("refused") == 1000, (first[:3], second[:3])
report["rss_kib_before"] = rss_kib()

counts = {t: {} for t in "ab"}
peak = [0]
done = threading.Event()
failures = []
def flood(tenant):
    try:
        flood_all(tenant)
    except Exception as error:  # a reset, a timeout: the flood's figures would be short
        failures.append(f"{tenant}: {error!r}")
def flood_all(tenant):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    for start in range(0, flood_keys, BATCH):
        users = [f"{tenant}-{n}" for n in range(start, min(start + BATCH, flood_keys))]
        body = json.dumps({"requests": [{"namespace": tenant, "path": "/", "headers": {"X-User": u}} for u in users]})
        connection.request("POST", "/v1/checks", body, {"content-type": "application/json"})
        response = connection.getresponse()
        data = response.read()
        key = f"http-{response.status}"
        if response.status == 200:
            for result in json.loads(data)["results"]:
                key = outcome(result)
                counts[tenant][key] = counts[tenant].get(key, 0) + 1
        else:
            counts[tenant][key] = counts[tenant].get(key, 0) + len(users)
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], redis_info()[0])
        done.wait(2)
sampler = threading.Thread(target=sample)
sampler.start()
started = time.monotonic()
flooders = [threading.Thread(target=flood, args=(t,)) for t in "ab"]
for f in flooders: f.start()
for f in flooders: f.join()
elapsed = time.monotonic() - started
done.set(); sampler.join()
used, evicted = redis_info()
report.update({
    "seconds": round(elapsed, 1),
    "decisions_per_second": round(2 * flood_keys / elapsed),
    "flood_outcomes": counts,
    "redis_used_memory_peak_mb": round(max(peak[0], used) / 2**20, 1),
    "redis_used_memory_end_mb": round(used / 2**20, 1),
    "redis_evicted_keys": evicted,
    "rss_kib_after": rss_kib(),
})
# A resident whose key is gone lost its counter (evicted); one admitted again is over-admission.
# (In the bounded run a namespace at its bound is refused by onStoreFailure, so its key count
# is the evidence there.)
report["resident_keys_left_of_1000"] = {t: resident_keys(t) for t in "ab"}
report["residents_admitted_again"] = {t: resident_checks(t).count("allowed") for t in "ab"}
print(json.dumps(report))
# Refusals (the bound's onStoreFailure: deny) are the measurement; an answer that is no decision
# (an HTTP error, a result without `allowed`) or a flood that broke off is a failure.
failures += [f"{t}: {n} x {k}" for t in "ab" for k, n in counts[t].items() if k not in ("allowed", "refused")]
if failures: raise SystemExit(f"FAILED: {run}: {failures[:5]}")
PY
    # The replica's own key count per namespace (its last SCAN), and its store errors by kind.
    sleep "${USAGE_INTERVAL%s}"
    curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^sluice_(redis_keys|store_errors_total)' \
        | sed "s/^/$run: /" || true
    echo "$run: redis dbsize $(redis-cli -p "$REDIS" dbsize)"
    jq . "$WORK/$run.json"
    kill_all
done
echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
