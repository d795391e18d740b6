#!/usr/bin/env bash
# Where a fixedWindow decision's time goes inside Redis: Sluice's decision library plus the
# profiling steps of scripts/bench/redis-profile-steps.lua, each one part more of a decision
# than the one before, called with redis-benchmark (FCALL, 10k keys per rule, 32 connections)
# with 1 and 3 rules; Redis's own `usec_per_call` (INFO commandstats) and used_cpu per call.
# Rounds are interleaved so the machine's noise hits every step alike; the script prints each
# round and then the median per step.
#
#   scripts/bench/redis-profile.sh            # ~3 minutes
#   ROUNDS=5 CALLS=300000 scripts/bench/redis-profile.sh
#
# Env: ROUNDS (3), CALLS (200000 per step and round), REDIS_CPU (0), CLIENT_CPU (1), SMOKE (1: one
#      round of 1000 calls, the test command's check that the script still works).
# Every step's calls are checked in INFO commandstats: a call Redis failed or rejected (a library
# that no longer matches lua/check.lua's arguments) fails the script instead of being timed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=scripts/bench/lib.sh
. "$ROOT/scripts/bench/lib.sh"
if [ "$SMOKE" = 1 ]; then ROUNDS="${ROUNDS:-1}" CALLS="${CALLS:-1000}" WARM="${WARM:-200}"; fi
ROUNDS="${ROUNDS:-3}"
CALLS="${CALLS:-200000}"
WARM="${WARM:-50000}"
REDIS_CPU="${REDIS_CPU:-0}"
CLIENT_CPU="${CLIENT_CPU:-1}"

install_missing redis-server:redis-server redis-benchmark:redis-tools
work="$(mktemp -d)"
port="$(free_port)"
trap 'kill "${REDIS_PID:-}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"' EXIT
start_redis "$port" "$REDIS_CPU"

# The library exactly as src/store/redis/library.rs concatenates it (DECISION_CODE), then the
# steps.
files=$(lua_library_files)
{
    echo "#!lua name=sluice_profile"
    for part in $files; do cat "$ROOT/$part"; done
    cat "$ROOT/scripts/bench/redis-profile-steps.lua"
} >"$work/library.lua"
redis-cli -p "$port" -x FUNCTION LOAD REPLACE <"$work/library.lua" >"$work/load.txt" 2>&1
grep -qx sluice_profile "$work/load.txt" || fail "FUNCTION LOAD: $(cat "$work/load.txt")"

# A fixedWindow rule of 10^9 per hour: every call admits, and the windows stay open for the run.
# Arguments as lua/check.lua's `decide` takes them: now and hold id ("": the server's clock, no
# hold), then per rule its parameters and cost.
params="4:1000000000:3600000000:1000000000:4:-1:1"
call() { # function rules calls
    local keys="" args="" prefix=rule
    [ "$1" = profile_incrby ] && prefix=counter # a string key, not a fixed window's hash
    for i in $(seq "$2"); do keys="$keys {p}$prefix$i:__rand_int__"; args="$args $params 1"; done
    redis-cli -p "$port" CONFIG RESETSTAT >/dev/null
    # shellcheck disable=SC2086 # keys and args are lists of words
    taskset -c "$CLIENT_CPU" redis-benchmark -p "$port" -n "$3" -c 32 -r 10000 FCALL "$1" "$2" $keys "" "" $args >/dev/null
    local stats; stats=$(fcall_stats "$port")
    read -r calls failed rejected <<<"$stats"
    if [ "$calls" != "$3" ] || [ "$failed" != 0 ] || [ "$rejected" != 0 ]; then
        # shellcheck disable=SC2086 # keys and args are lists of words
        fail "$1 with $2 rules: $calls calls of $3, $failed failed, $rejected rejected: $(redis-cli -p "$port" FCALL "$1" "$2" $keys "" "" $args 2>&1 | head -n 1)"
    fi
}

echo "redis $(redis-server --version | grep -o 'v=[0-9.]*'), load before: $(cut -d' ' -f1-3 /proc/loadavg)"
steps="profile_commands profile_arguments profile_read profile_check profile_consume profile_decide"
for rules in 1 3; do
    for f in $steps; do call "$f" "$rules" "$WARM"; done # every key exists before anything is timed
done
for round in $(seq "$ROUNDS"); do
    for rules in 1 3; do
        for f in profile_incrby $steps; do
            [ "$f" = profile_incrby ] && [ "$rules" != 1 ] && continue
            before="$(redis_cpu "$port")"
            call "$f" "$rules" "$CALLS"
            after="$(redis_cpu "$port")"
            usec="$(redis-cli -p "$port" INFO commandstats | sed -n 's/^cmdstat_fcall:.*usec_per_call=\([0-9.]*\).*/\1/p')"
            echo "round=$round rules=$rules step=$f usec_per_call=$usec used_cpu_us_per_call=$(python3 -c "print(round(($after - $before) * 1e6 / $CALLS, 2))")"
        done
    done
done | tee "$work/rounds.txt"
echo "median µs per call (usec_per_call / used_cpu):"
python3 - "$work/rounds.txt" <<'PY'
import re, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    f = dict(kv.split("=") for kv in line.split())
    rows.setdefault((int(f["rules"]), f["step"]), []).append((float(f["usec_per_call"]), float(f["used_cpu_us_per_call"])))
for (rules, step), v in sorted(rows.items(), key=lambda kv: kv[0][0]):
    print(f"  rules={rules} {step:18} {statistics.median(u for u, _ in v):6.2f} / {statistics.median(c for _, c in v):6.2f}")
PY
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
