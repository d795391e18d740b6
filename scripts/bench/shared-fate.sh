#!/usr/bin/env bash
# What one tenant's load takes from another's decisions (issue 23): `sluice serve` on a private
# redis-server (default --redis-timeout 50ms), tenant b with one rule whose onStoreFailure is
# deny (so every b request the store fails to decide is a 429), tenant a with 64 rules. Two
# attacks, each while b sends SAMPLES checks one after the other:
#
# - flood: FLOODERS clients each posting /v1/checks batches of 250 checks against a's 64 rules;
# - regex: a's policy also has 10 rules matching header X-Blob on [ab]*a[ab]{2000}, and
#   FLOODERS clients send checks with an 8 KiB X-Blob of a's and b's;
# - settle: a's policy reserves from max_tokens; each of FLOODERS clients takes one genuine
#   hold token, rewrites it to name 765 keys of a's rule (the signature, if any, kept), and
#   posts it to /v1/settle over and over (issue 37: unsigned tokens made Redis settle 765 keys
#   per call outside a's lane; a signed token so edited is refused with 400 before Redis).
#
# Prints, per attack, b's 429s (its store failures) and b's check latency (p50, p99, max), and
# a's answers by status.
#
#   scripts/bench/shared-fate.sh                               # this checkout's release build
#   SLUICE=/path/to/sluice scripts/bench/shared-fate.sh        # another build, side by side
#
# Env: SLUICE (or SLUICE_BIN), SAMPLES (200), FLOODERS (4), SECONDS_EACH (8), SMOKE (1: 1 s per
#      attack, 1 flooder, the test command's check that the script works).
# An answer that is neither a decision (200, 429) nor expected, a request that got no answer,
# or no sample of b at all, fails the script: those figures would be of failures.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=scripts/bench/lib.sh
. "$ROOT/scripts/bench/lib.sh"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
if [ "$SMOKE" = 1 ]; then SAMPLES="${SAMPLES:-20}" FLOODERS="${FLOODERS:-1}" SECONDS_EACH="${SECONDS_EACH:-1.5}"; fi
SAMPLES="${SAMPLES:-200}"
FLOODERS="${FLOODERS:-4}"
SECONDS_EACH="${SECONDS_EACH:-8}"

install_missing redis-server:redis-server redis-cli:redis-tools
SLUICE="${SLUICE:-${SLUICE_BIN:-}}"
if [ -z "$SLUICE" ]; then
    [ "${SKIP_BUILD:-0}" = 1 ] || (cd "$ROOT" && cargo build --release --quiet --bin sluice)
    SLUICE="$TARGET/release/sluice"
fi
work="$(mktemp -d)"
cleanup() {
    [ -n "${SERVE_PID:-}" ] && kill "$SERVE_PID" 2>/dev/null
    [ -n "${REDIS_PID:-}" ] && kill "$REDIS_PID" 2>/dev/null
    rm -rf "$work"
}
trap cleanup EXIT

python3 - "$work" <<'PY'
import sys
work = sys.argv[1]
wide = "      algorithm: fixedWindow\n      limit: {requests: 100000000, per: 1h}\n"
a = "".join(f"    - name: r{r}\n      key: [{{header: X-User}}]\n{wide}" for r in range(64))
regex = "".join(
    f"    - name: x{r}\n      match: {{headers: [{{name: X-Blob, regex: '[ab]*a[ab]{{2000}}'}}]}}\n      key: [{{header: X-User}}]\n{wide}"
    for r in range(10)
)
head = "apiVersion: sluice.dev/v1alpha1\nkind: RateLimitPolicy\n"
open(f"{work}/a.yaml", "w").write(head + "metadata: {name: a, namespace: a}\nspec:\n  rules:\n" + a)
open(f"{work}/a-regex.yaml", "w").write(head + "metadata: {name: a-regex, namespace: a}\nspec:\n  rules:\n" + regex)
open(f"{work}/a-settle.yaml", "w").write(
    head + "metadata: {name: a-settle, namespace: a}\nspec:\n  rules:\n"
    "    - name: tokens\n      key: [{header: X-User}]\n      algorithm: fixedWindow\n"
    "      limit: {requests: 100000000, per: 1h}\n      responseCost:\n        fields: [usage.total_tokens]\n"
    "        estimate: {requestField: max_tokens, cap: 1000}\n"
)
open(f"{work}/b.yaml", "w").write(
    head + "metadata: {name: b, namespace: b}\nspec:\n  rules:\n"
    "    - name: users\n      key: [{header: X-User}]\n      onStoreFailure: deny\n" + wide
)
PY

run() { # run ATTACK POLICY-FILES...
    local attack="$1"; shift
    local redis_port serve_port
    redis_port="$(free_port)"
    serve_port="$(free_port)"
    start_redis "$redis_port" 0
    "$SLUICE" serve --listen "127.0.0.1:$serve_port" --redis "redis://127.0.0.1:$redis_port" \
        "$@" 2>"$work/serve-$attack.log" &
    SERVE_PID=$!
    local i
    for i in $(seq 100); do
        curl -fsS "http://127.0.0.1:$serve_port/healthz" >/dev/null 2>&1 && break
        [ "$i" != 100 ] || fail "sluice serve did not answer: $(tail -n 5 "$work/serve-$attack.log")"
        sleep 0.1
    done
    python3 - "$serve_port" "$attack" "$SAMPLES" "$FLOODERS" "$SECONDS_EACH" <<'PY'
import base64, json, sys, threading, time, urllib.request, urllib.error, collections
port, attack, samples, flooders, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
url = f"http://127.0.0.1:{port}"
def post(path, body, timeout=60, answer=None):
    data = json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            if answer is not None:
                answer.append(json.loads(response.read()))
            return response.status
    except urllib.error.HTTPError as error:
        if answer is not None:
            answer.append(json.loads(error.read() or b"{}"))
        return error.code
a_statuses = collections.Counter()
failures = []
stop = time.monotonic() + seconds
def flood(n):
    try:
        flood_until_stop(n)
    except Exception as error:  # no answer: a reset, a timeout
        failures.append(f"a: {error!r}")
def forged_token(n):
    """A genuine hold token of a's reserving rule, rewritten to hold 765 keys."""
    answer = []
    post("/v1/check", {"namespace": "a", "path": "/", "headers": {"X-User": f"u{n}"}, "requestFields": {"max_tokens": 10}}, answer=answer)
    token = answer[0]["lease"]
    text, dot, signature = token.partition(".")
    lease = json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
    rule = lease["r"][0][0]
    lease["r"] = [[rule, str(k)] for k in range(765)]
    lease["e"] = [0] * 765
    forged = base64.urlsafe_b64encode(json.dumps(lease, separators=(",", ":")).encode()).decode().rstrip("=")
    return forged + dot + signature
def flood_until_stop(n):
    i = 0
    token = forged_token(n) if attack == "settle" else None
    while time.monotonic() < stop:
        i += 1
        if attack == "settle":
            a_statuses[post("/v1/settle", {"lease": token, "cost": 0})] += 1
        elif attack == "flood":
            checks = [{"namespace": "a", "path": "/", "headers": {"X-User": f"u{n}-{i}-{j}"}} for j in range(250)]
            a_statuses[post("/v1/checks", {"requests": checks})] += 1
        else:
            blob = ("ab" * 4096)
            a_statuses[post("/v1/check", {"namespace": "a", "path": "/", "headers": {"X-User": f"u{n}", "X-Blob": blob}})] += 1
threads = [threading.Thread(target=flood, args=(n,)) for n in range(flooders)]
for t in threads: t.start()
time.sleep(0.5)
latencies, refused, b_statuses = [], 0, collections.Counter()
for i in range(samples):
    if time.monotonic() > stop - 0.2:
        break
    started = time.monotonic()
    answer = []
    status = post("/v1/check", {"namespace": "b", "path": "/", "headers": {"X-User": f"b{i}"}}, answer=answer)
    b_statuses[status] += 1
    latencies.append((time.monotonic() - started) * 1000)
    refused += any(rule.get("storeFailure") for reply in answer for rule in reply.get("rules", []))
    time.sleep(0.01)
for t in threads: t.join()
latencies.sort()
pick = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else float("nan")
print(f"{attack}: b decided by its onStoreFailure (deny) {refused} of {len(latencies)}; b latency p50 {pick(0.5):.1f} ms, p99 {pick(0.99):.1f} ms, max {latencies[-1] if latencies else 0:.1f} ms; a answers {dict(a_statuses)}")
# A 429 is a decision (b's deny on a store failure is the figure); anything else is a failure.
failures += [f"b answered {s} x{n}" for s, n in b_statuses.items() if s not in (200, 429)]
# A forged settle refused (400) is the defence working; on a build that takes it, 200.
expected_a = (200, 429, 400) if attack == "settle" else (200, 429)
failures += [f"a answered {s} x{n}" for s, n in a_statuses.items() if s not in expected_a]
if not latencies: failures.append("no sample of b")
if not a_statuses: failures.append("a's flood got no answer")
if failures: sys.exit(f"FAILED: {attack}: {failures[:5]}")
PY
    curl -fsS "http://127.0.0.1:$serve_port/metrics" | grep -E '^sluice_store_(errors|fallbacks)_total' \
        | sed "s/^/$attack: /" || true
    kill "$SERVE_PID" "$REDIS_PID" 2>/dev/null || true
    wait "$SERVE_PID" "$REDIS_PID" 2>/dev/null || true
    SERVE_PID='' REDIS_PID=''
}
run flood --policies "$work/a.yaml" --policies "$work/b.yaml"
run regex --policies "$work/a-regex.yaml" --policies "$work/b.yaml"
run settle --policies "$work/a-settle.yaml" --policies "$work/b.yaml"
echo "binary: $SLUICE; load: $(cut -d' ' -f1-3 /proc/loadavg)"
