#!/usr/bin/env bash
# LLM token limits under load, side by side in one run (the response-cost rules, `responseCost`):
#
#   reportAfter  check-then-report, the peers' model: admission reserves nothing, the tokens are
#                charged after the response (`mode: reportAfter`);
#   reserve      reserve-then-settle: admission reserves the estimate (the request's max_tokens
#                + 500 for the prompt, at most 5000), the response's usage settles it.
#
# Per mode, from scratch: a private redis-server, `sluice serve --redis`, SIDECARS (3) `sluice
# sidecar`s in front of one examples/fake_llm.rs upstream (streams of 500–4000 tokens, 20 tokens
# every 20 ms: 0.5–4 s; ERROR_RATE of the requests fail, half with a 500 before any output, half
# broken off mid-stream), and examples/llm_load.rs: CLIENTS (200) closed-loop clients spread over
# the sidecars round-robin, one tenant (`x-tenant: t1`), every request streamed with
# `stream_options.include_usage` and `max_tokens` MAX_TOKENS (4000: the upstream's own draw,
# uniform 500–4000, decides the length, and every request reserves 4500; `random` draws
# max_tokens uniform in 500–4000). One rule: fixedWindow, LIMIT (100000) tokens per minute per
# tenant, `usage.total_tokens`, onFailure 0.
#
# Demand. 200 clients whose streams last 0.5–4 s would ask for ~120× the limit, so each client
# thinks between its responses: uniform in [0, 2 × THINK], THINK chosen so that the demand with
# no limit is DEMAND (3) × LIMIT per minute (DEMAND=0: no think time). On a 429 a client sleeps
# the Retry-After when it is at most 60 s (OpenAI's SDK ignores longer ones), else 1 s, plus up
# to 1 s of jitter.
#
# Windows. The load starts WARMUP (60) s before a minute boundary (the script waits for it), and
# runs DURATION (300) s; the windows from that boundary that end before the load ends are
# measured (DURATION=300: 4, DURATION=120: 1), the others are listed but not counted. For each
# 1-minute window (aligned to the minute, as the rule's): the tokens the upstream served (its
# ledger, prompt + completion, every outcome, a broken-off response's tokens up to the cut)
# attributed to the window the response started in and to the one it ended in; the
# `settled` counter's increase over the window (sampled every 250 ms, interpolated at the
# boundaries); the count the limiter's Redis key held for the window (its largest sample).
# Then the accounting (settled total = the ledger's ok tokens: failed requests cost 0), the
# settle's and the check's latency (the sidecars' histograms; the settle runs after the response
# ended, so no client waits for it) and FCALLs per decided request (Redis INFO commandstats).
#
#   scripts/bench/llm-tokens.sh                        # ~12 minutes; JSON lines + Markdown tables
#   DURATION=120 scripts/bench/llm-tokens.sh           # ~7 minutes
#   MODES=reserve DEMAND=5 ERROR_RATE=0 OUT=/tmp/llm SKIP_BUILD=1 scripts/bench/llm-tokens.sh
#
# Env: DURATION (300 s), WARMUP (60 s, 1–60), CLIENTS (200), SIDECARS (3), LIMIT (100000),
# DEMAND (3), MAX_TOKENS (4000 or random), ERROR_RATE (0.05), TOKENS_PER_CHUNK (20),
# TOKEN_INTERVAL_US (20000), SEED (1), MODES ("reportAfter reserve"), REDIS_CPU (0: redis-server
# is pinned there, the rest is not), OUT (a new temporary directory: results.jsonl,
# windows.jsonl, each mode's ledger, requests, samples and metrics), SKIP_BUILD (1: use the
# binaries already built), RT_PRIORITY (1: redis-server, the endpoint and the sidecars run
# SCHED_FIFO 1, a diagnostic: it separates the settle's own time from its wait for a CPU, which
# on a 2-core machine running all of this is most of a slow settle), SMOKE (1: the test command's
# check that the script works: 2 s per mode, 4 clients on 1 sidecar, streams of 1 ms per chunk, no
# upstream errors, no wait for a minute boundary; nothing measured).
# A mode with transport errors (client to sidecar), failed settles or (with ERROR_RATE=0) upstream
# errors, or no response at all, fails the script: its figures would be those of failures.
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=scripts/bench/lib.sh
. scripts/bench/lib.sh
install_missing curl:curl jq:jq python3:python3 redis-server:redis-server redis-cli:redis-tools

if [ "$SMOKE" = 1 ]; then
    DURATION=${DURATION:-2} CLIENTS=${CLIENTS:-4} SIDECARS=${SIDECARS:-1} ERROR_RATE=${ERROR_RATE:-0}
    TOKEN_INTERVAL_US=${TOKEN_INTERVAL_US:-1000} DEMAND=${DEMAND:-0} WARMUP=${WARMUP:-1}
fi
DURATION=${DURATION:-300}
WARMUP=${WARMUP:-60}
CLIENTS=${CLIENTS:-200}
SIDECARS=${SIDECARS:-3}
LIMIT=${LIMIT:-100000}
DEMAND=${DEMAND:-3}
MAX_TOKENS=${MAX_TOKENS:-4000}
ERROR_RATE=${ERROR_RATE:-0.05}
TOKENS_MIN=500
TOKENS_MAX=4000
TOKENS_PER_CHUNK=${TOKENS_PER_CHUNK:-20}
TOKEN_INTERVAL_US=${TOKEN_INTERVAL_US:-20000}
SEED=${SEED:-1}
MODES=${MODES:-reportAfter reserve}
REDIS_CPU=${REDIS_CPU:-0}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
((WARMUP >= 1 && WARMUP <= 60)) || { log "WARMUP must be within 1..60"; exit 1; }

if [ "${SKIP_BUILD:-0}" != 1 ]; then
    cargo build --release --quiet --bin sluice --example fake_llm --example llm_load
fi
target="${CARGO_TARGET_DIR:-target}/release"
sluice="${SLUICE_BIN:-$target/sluice}"
fake="$target/examples/fake_llm"
load="$target/examples/llm_load"

# The prompt every request sends (llm_load.rs): 48 characters, 12 prompt tokens at the fake's 4
# characters a token. Mean tokens and stream time of a response, and the think time that makes
# the unlimited demand DEMAND × LIMIT a minute.
PROMPT_TOKENS=12
if [ "$MAX_TOKENS" = random ]; then
    # E[min(U[500,4000], U[500,4000])] = 500 + 3500/3.
    mean_completion=$((TOKENS_MIN + (TOKENS_MAX - TOKENS_MIN) / 3))
else
    mean_completion=$(((TOKENS_MIN + TOKENS_MAX) / 2))
fi
think_ms=$(awk -v c="$CLIENTS" -v t="$((mean_completion + PROMPT_TOKENS))" -v d="$DEMAND" -v l="$LIMIT" \
    -v chunk="$TOKENS_PER_CHUNK" -v us="$TOKEN_INTERVAL_US" -v m="$mean_completion" 'BEGIN {
        stream = m / chunk * us / 1e6
        if (d <= 0) { print 0; exit }
        think = c * 60 * t / (d * l) - stream
        printf "%d", (think > 0 ? think * 1000 : 0)
    }')

work=$(mktemp -d)
pids=()
stop_all() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    pids=()
}
trap 'stop_all; rm -rf "$work"' EXIT
trap 'exit 130' INT TERM

# prioritize PID: SCHED_FIFO 1 for all its threads, with RT_PRIORITY=1.
prioritize() {
    if [ "${RT_PRIORITY:-0}" = 1 ]; then chrt -a -f -p 1 "$1" >/dev/null; fi
}

write_policy() {
    local mode="$1" dir="$work/policies-$1"
    mkdir -p "$dir"
    cat >"$dir/llm.yaml" <<EOF
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: llm-tokens, namespace: ai}
spec:
  rules:
    - name: tenant-tokens-per-minute
      match:
        methods: [POST]
        paths: [{prefix: /v1/chat/completions}]
        headers: [{name: X-Tenant, regex: "[a-z0-9-]{1,64}"}]
      key: [{header: X-Tenant}]
      algorithm: fixedWindow
      limit: {requests: $LIMIT, per: 1m}
      responseCost:
        fields: [usage.total_tokens]
        estimate: {requestField: max_tokens, plus: 500, cap: 5000}
        onFailure: 0
        mode: $mode
EOF
    echo "$dir"
}

# wait_http URL: until it answers 2xx (20 s at most).
wait_http() {
    for _ in $(seq 200); do curl -sf -o /dev/null "$1" && return 0; sleep 0.1; done
    log "$1 did not answer"
    exit 1
}

# sampler ENDPOINT_PORT REDIS_PORT FILE: every 250 ms, `<unix_ms> <settled total> <window start
# µs> <window count>` (the limiter's fixed-window key; `- -` before it exists).
sampler() {
    local key="" t settled window
    while :; do
        t=$(date +%s%3N)
        settled=$(curl -s "127.0.0.1:$1/metrics" |
            awk '/^sluice_reservation_cost_total/ && /outcome="settled"/ {s += $NF} END {printf "%d", s}') || settled=-
        if [ -z "$key" ]; then
            key=$(redis-cli -p "$2" --scan --pattern 'sl1:*' 2>/dev/null | grep -v '}:r:' | head -n 1) || key=""
        fi
        window="- -"
        if [ -n "$key" ]; then
            window=$(redis-cli -p "$2" HMGET "$key" start count 2>/dev/null | paste -sd' ') || window="- -"
            [[ "$window" =~ ^[0-9]+\ [0-9]+$ ]] || window="- -"
        fi
        echo "$t $settled $window" >>"$3"
        sleep 0.25
    done
}

log "$CLIENTS clients over $SIDECARS sidecars, limit $LIMIT tokens/min, demand ${DEMAND}x (think time mean ${think_ms} ms), max_tokens $MAX_TOKENS, error rate $ERROR_RATE; $DURATION s per mode, first ${WARMUP} s warm-up; results in $OUT"
results="$OUT/results.jsonl"
windows="$OUT/windows.jsonl"
: >"$results"
: >"$windows"
for mode in $MODES; do
    policies=$(write_policy "$mode")
    rport=$(free_port)
    start_redis "$rport" "$REDIS_CPU"
    pids+=("$REDIS_PID")
    prioritize "$REDIS_PID"
    fport=$(free_port)
    : >"$OUT/$mode.ledger"
    "$fake" --listen "127.0.0.1:$fport" --tokens-min "$TOKENS_MIN" --tokens-max "$TOKENS_MAX" \
        --tokens-per-chunk "$TOKENS_PER_CHUNK" --token-interval-us "$TOKEN_INTERVAL_US" \
        --error-rate "$ERROR_RATE" --seed "$SEED" --ledger "$OUT/$mode.ledger" >/dev/null 2>"$OUT/$mode.fake.log" &
    pids+=($!)
    eport=$(free_port)
    RUST_LOG=warn "$sluice" serve --redis "redis://127.0.0.1:$rport" --policies "$policies" \
        --listen "127.0.0.1:$eport" 2>"$OUT/$mode.serve.log" &
    pids+=($!)
    prioritize $!
    wait_http "127.0.0.1:$eport/readyz"
    wait_http "127.0.0.1:$fport/healthz"
    targets=()
    admins=()
    for i in $(seq "$SIDECARS"); do
        sport=$(free_port)
        aport=$(free_port)
        RUST_LOG=warn "$sluice" sidecar --listen "127.0.0.1:$sport" --admin-listen "127.0.0.1:$aport" \
            --upstream "127.0.0.1:$fport" --endpoint "http://127.0.0.1:$eport" --namespace ai \
            2>"$OUT/$mode.sidecar-$i.log" &
        pids+=($!)
        prioritize $!
        targets+=("127.0.0.1:$sport")
        admins+=("$aport")
    done
    for a in "${admins[@]}"; do wait_http "127.0.0.1:$a/readyz"; done

    # Start WARMUP s before a minute boundary at least 2 s away.
    now=$(date +%s%3N)
    boundary=$(((now + WARMUP * 1000 + 2000 + 59999) / 60000 * 60000))
    start=$((boundary - WARMUP * 1000))
    log "$mode: load from $(date -d "@$((start / 1000))" +%T) (waiting $(((start - now) / 1000)) s), measured windows from $(date -d "@$((boundary / 1000))" +%T)"
    # The smoke run measures no window: it does not wait for one.
    [ "$SMOKE" = 1 ] || sleep "$(awk -v ms="$((start - $(date +%s%3N)))" 'BEGIN {printf "%.3f", (ms > 0 ? ms : 0) / 1000}')"
    : >"$OUT/$mode.samples"
    sampler "$eport" "$rport" "$OUT/$mode.samples" &
    sampler_pid=$!
    pids+=("$sampler_pid")
    uptime_before=$(uptime)
    load_start=$(date +%s%3N)
    command=("$load" --targets "$(IFS=,; echo "${targets[*]}")" --clients "$CLIENTS" --duration "$DURATION"
        --think-ms "$think_ms" --max-tokens "$MAX_TOKENS" --seed "$SEED" --out "$OUT/$mode.requests")
    log "$mode: ${command[*]}"
    "${command[@]}" >"$OUT/$mode.summary.json"
    load_end=$(date +%s%3N)
    # Settles follow the responses' ends by a few milliseconds.
    sleep "$([ "$SMOKE" = 1 ] && echo 0.5 || echo 2)"
    kill "$sampler_pid" 2>/dev/null || true
    uptime_after=$(uptime)
    curl -s "127.0.0.1:$eport/metrics" >"$OUT/$mode.endpoint.metrics"
    : >"$OUT/$mode.sidecars.metrics"
    for a in "${admins[@]}"; do curl -s "127.0.0.1:$a/metrics" >>"$OUT/$mode.sidecars.metrics"; done
    redis-cli -p "$rport" INFO commandstats >"$OUT/$mode.commandstats"
    stop_all

    MODE=$mode DIR=$OUT LIMIT=$LIMIT LOAD_START=$load_start LOAD_END=$load_end DURATION=$DURATION \
        MEASURED_FROM=$boundary UPTIME_BEFORE=$uptime_before UPTIME_AFTER=$uptime_after \
        COMMAND="${command[*]}" THINK_MS=$think_ms DEMAND=$DEMAND MAX_TOKENS=$MAX_TOKENS ERROR_RATE=$ERROR_RATE \
        python3 - "$windows" <<'PY' | tee -a "$results"
import json, os, re, statistics, sys

env = os.environ
mode, out, limit = env["MODE"], env["DIR"], int(env["LIMIT"])
load_start, load_end = int(env["LOAD_START"]), int(env["LOAD_END"])
measured_from, planned_end = int(env["MEASURED_FROM"]), int(env["LOAD_START"]) + int(float(env["DURATION"]) * 1000)
W = 60_000

def path(name):
    return os.path.join(out, f"{mode}.{name}")

ledger = []
for line in open(path("ledger")):
    f = line.split()
    if len(f) == 6:
        ledger.append((int(f[0]), int(f[1]), int(f[3]), int(f[4]), f[5]))
requests = [line.split() for line in open(path("requests")) if line.strip()]
samples = []
for line in open(path("samples")):
    f = line.split()
    if len(f) == 4 and f[1] != "-":
        samples.append((int(f[0]), int(f[1]), None if f[2] == "-" else int(f[2]), None if f[3] == "-" else int(f[3])))

def settled_at(t):
    """The settled counter at instant t (ms), linear between the samples around it."""
    before = [s for s in samples if s[0] <= t]
    after = [s for s in samples if s[0] >= t]
    if not before:
        return samples[0][1] if samples else 0
    if not after:
        return before[-1][1]
    a, b = before[-1], after[0]
    if b[0] == a[0]:
        return a[1]
    return a[1] + (b[1] - a[1]) * (t - a[0]) / (b[0] - a[0])

first = min([load_start] + [l[0] for l in ledger]) // W * W
last = max([load_end] + [l[1] for l in ledger])
rows = []
for w in range(first, last + 1, W):
    by_start = sum(p + c for s, e, p, c, o in ledger if w <= s < w + W)
    by_end = sum(p + c for s, e, p, c, o in ledger if w <= e < w + W)
    ok_by_start = sum(p + c for s, e, p, c, o in ledger if w <= s < w + W and o == "ok")
    counts = [s[3] for s in samples if s[2] == w * 1000 and s[3] is not None]
    measured = w >= measured_from and w + W <= planned_end
    row = {
        "mode": mode, "window": w // 1000, "measured": measured,
        "servedByStart": by_start, "servedByEnd": by_end, "okByStart": ok_by_start,
        "settled": round(settled_at(w + W) - settled_at(w)),
        "limiterCount": max(counts) if counts else None,
        "responsesStarted": sum(1 for l in ledger if w <= l[0] < w + W),
        "refused": sum(1 for r in requests if r[5] == "refused" and w <= int(r[0]) < w + W),
    }
    rows.append(row)
with open(sys.argv[1], "a") as f:
    for row in rows:
        f.write(json.dumps(row) + "\n")

def metric_lines(text, name):
    for line in text.splitlines():
        if line.startswith(name):
            labels, _, value = line.rpartition(" ")
            yield labels, float(value)

endpoint = open(path("endpoint.metrics")).read()
sidecars = open(path("sidecars.metrics")).read()
def total(text, name, label):
    return sum(v for l, v in metric_lines(text, name) if label in l)

def histogram(text, name):
    buckets = {}
    for labels, value in metric_lines(text, name + "_bucket"):
        le = re.search(r'le="([^"]+)"', labels).group(1)
        bound = float("inf") if le == "+Inf" else float(le)
        buckets[bound] = buckets.get(bound, 0) + value
    return sorted(buckets.items())

def quantile(buckets, q):
    """Prometheus' histogram_quantile: linear inside the bucket the rank falls in (ms)."""
    n = buckets[-1][1] if buckets else 0
    if n == 0:
        return None
    rank, lower, below = q * n, 0.0, 0.0
    for bound, cum in buckets:
        if cum >= rank:
            if bound == float("inf"):
                return round(lower * 1000, 3)
            return round((lower + (bound - lower) * (rank - below) / max(cum - below, 1)) * 1000, 3)
        lower, below = bound, cum
    return None

def share_within(buckets, seconds):
    n = buckets[-1][1] if buckets else 0
    within = max([cum for bound, cum in buckets if bound <= seconds + 1e-12], default=0)
    return round(within / n, 4) if n else None

settle = histogram(sidecars, "sluice_sidecar_settle_duration_seconds")
check = histogram(sidecars, "sluice_sidecar_check_duration_seconds")
# Successful FCALLs (the endpoint's first call finds the library missing, loads it and retries).
fcalls = failed_fcalls = fcall_usec = 0
for line in open(path("commandstats")):
    m = re.match(r"cmdstat_fcall\w*:calls=(\d+),usec=(\d+),.*failed_calls=(\d+)", line.strip())
    if m:
        fcalls += int(m.group(1)) - int(m.group(3))
        failed_fcalls += int(m.group(3))
        fcall_usec += int(m.group(2))
allowed = total(endpoint, "sluice_decisions_total", 'outcome="allowed"')
limited = total(endpoint, "sluice_decisions_total", 'outcome="limited"')
summary = json.loads(open(path("summary.json")).read())
outcomes = {}
for s, e, p, c, o in ledger:
    outcomes[o] = outcomes.get(o, 0) + 1
ok_tokens = sum(p + c for s, e, p, c, o in ledger if o == "ok")
failed_tokens = sum(p + c for s, e, p, c, o in ledger if o != "ok")
settled_total = round(total(endpoint, "sluice_reservation_cost_total", 'outcome="settled"'))
measured = [r for r in rows if r["measured"]]

def stats(key):
    values = [r[key] / limit for r in measured if r[key] is not None]
    if not values:
        return {"max": None, "p50": None}
    return {"max": round(max(values), 3), "p50": round(statistics.median(values), 3)}

result = {
    "mode": mode, "limit": limit, "demand": float(env["DEMAND"]), "thinkMs": int(env["THINK_MS"]),
    "maxTokens": env["MAX_TOKENS"], "errorRate": float(env["ERROR_RATE"]),
    "measuredWindows": len(measured),
    "servedByStart": stats("servedByStart"), "servedByEnd": stats("servedByEnd"),
    "settledPerWindow": stats("settled"), "limiterCount": stats("limiterCount"),
    "clients": summary,
    "endpoint": {"allowed": round(allowed), "limited": round(limited)},
    "ledger": {"outcomes": outcomes, "okTokens": ok_tokens, "failedTokensServed": failed_tokens},
    "reservation": {
        "reserved": round(total(endpoint, "sluice_reservation_cost_total", 'outcome="reserved"')),
        "settled": settled_total,
        "expired": round(total(endpoint, "sluice_reservation_cost_total", 'outcome="expired"')),
        "settledMinusOkTokens": settled_total - ok_tokens,
    },
    "settles": {
        "released": round(total(sidecars, "sluice_sidecar_releases_total", 'result="released"')),
        "failed": round(total(sidecars, "sluice_sidecar_releases_total", 'result="failed"')),
        "p50Ms": quantile(settle, 0.5), "p99Ms": quantile(settle, 0.99),
        "within800us": share_within(settle, 0.0008),
    },
    "checks": {
        "count": round(check[-1][1]) if check else 0,
        "p50Ms": quantile(check, 0.5), "p99Ms": quantile(check, 0.99),
    },
    "endpointChecks": {
        "p50Ms": quantile(histogram(endpoint, "sluice_check_duration_seconds"), 0.5),
        "p99Ms": quantile(histogram(endpoint, "sluice_check_duration_seconds"), 0.99),
    },
    "redis": {
        "fcalls": fcalls, "failedFcalls": failed_fcalls, "decided": round(allowed + limited),
        "usecPerFcall": round(fcall_usec / max(fcalls + failed_fcalls, 1), 1),
        "fcallsPerDecision": round(fcalls / (allowed + limited), 3) if allowed + limited else None,
    },
    "rtPriority": env.get("RT_PRIORITY", "0") == "1",
    "uptimeBefore": env["UPTIME_BEFORE"].strip(), "uptimeAfter": env["UPTIME_AFTER"].strip(),
    "command": env["COMMAND"],
}
print(json.dumps(result))
c = summary
problems = []
if c["ok"] + c["noUsage"] == 0: problems.append("no response completed")
if c["transport"]: problems.append(f'{c["transport"]} transport errors')
if result["settles"]["failed"]: problems.append(f'{result["settles"]["failed"]} failed settles')
if float(env["ERROR_RATE"]) == 0 and c["error"] + c["broken"]: problems.append(f'{c["error"] + c["broken"]} upstream errors with ERROR_RATE=0')
if problems: sys.exit(f"FAILED: {mode}: " + ", ".join(problems))
PY
done

log "tables"
python3 - "$results" "$windows" <<'PY'
import json, sys

results = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
windows = [json.loads(l) for l in open(sys.argv[2]) if l.strip()]

def mp(s):
    return "-" if s["max"] is None else f'{s["max"]:.3f}x / {s["p50"]:.3f}x'

def ms(v):
    return "-" if v is None else f"{v:.3f}"

print("| mode | measured windows | served by start: max / p50 | served by end: max / p50 | settled: max / p50 | limiter's window count: max / p50 | admitted / refused (clients; refusals with Retry-After > 60 s) | allowed / limited (endpoint) |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for r in results:
    c = r["clients"]
    admitted = c["ok"] + c["noUsage"] + c["error"] + c["broken"]
    longest = "" if c["retryAfterMaxS"] is None else ", longest %g s" % c["retryAfterMaxS"]
    print(f'| {r["mode"]}{" (SCHED_FIFO)" if r["rtPriority"] else ""} | {r["measuredWindows"]} | {mp(r["servedByStart"])} | {mp(r["servedByEnd"])} | {mp(r["settledPerWindow"])} | {mp(r["limiterCount"])} | {admitted} / {c["refused"]} ({c["retryAfterOverMax"]}{longest}) | {r["endpoint"]["allowed"]} / {r["endpoint"]["limited"]} |')
print()
print("| mode | upstream ok / 500 / broken off | tokens: ledger ok / settled (difference) / served to failed requests | reserved / expired | settle p50 / p99 ms (share <= 0.8 ms) | check p50 / p99 ms: sidecar; endpoint | FCALLs / decided requests (µs in Redis per FCALL) | load before -> after |")
print("|---|---:|---:|---:|---:|---:|---:|---|")
for r in results:
    o, rs, s, ch, rd = r["ledger"]["outcomes"], r["reservation"], r["settles"], r["checks"], r["redis"]
    load = lambda u: u.split("load average:")[-1].strip()
    print(f'| {r["mode"]}{" (SCHED_FIFO)" if r["rtPriority"] else ""} | {o.get("ok", 0)} / {o.get("error500", 0)} / {o.get("aborted", 0) + o.get("cancelled", 0)} | {r["ledger"]["okTokens"]} / {rs["settled"]} ({rs["settledMinusOkTokens"]:+d}) / {r["ledger"]["failedTokensServed"]} | {rs["reserved"]} / {rs["expired"]} | {ms(s["p50Ms"])} / {ms(s["p99Ms"])} ({s["within800us"]}) | {ms(ch["p50Ms"])} / {ms(ch["p99Ms"])}; {ms(r["endpointChecks"]["p50Ms"])} / {ms(r["endpointChecks"]["p99Ms"])} | {rd["fcalls"]} / {rd["decided"]} = {rd["fcallsPerDecision"]} ({rd["usecPerFcall"]}) | {load(r["uptimeBefore"])} -> {load(r["uptimeAfter"])} |')
print()
print("Per window (x the limit; * = measured):")
print()
print("| mode | window | served by start | served by end | settled | limiter's count | responses started | refused |")
print("|---|---|---:|---:|---:|---:|---:|---:|")
import time
for w in windows:
    limit = next(r["limit"] for r in results if r["mode"] == w["mode"])
    x = lambda v: "-" if v is None else f"{v / limit:.3f}"
    print(f'| {w["mode"]} | {time.strftime("%H:%M", time.localtime(w["window"]))}{" *" if w["measured"] else ""} | {x(w["servedByStart"])} | {x(w["servedByEnd"])} | {x(w["settled"])} | {x(w["limiterCount"])} | {w["responsesStarted"]} | {w["refused"]} |')
print()
for r in results:
    print(f'{r["mode"]}: {r["command"]}')
PY
