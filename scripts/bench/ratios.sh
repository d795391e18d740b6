#!/usr/bin/env bash
# The speed ratios that guard the request path, side by side in one run, each against what a
# user would deploy instead (docs/benchmarks.md, "Ratios"): run it on every change that touches
# the request path and add its table to docs/benchmarks.md, dated.
#
#   scripts/bench/ratios.sh                 # ~12 minutes after the release build
#   SMOKE=1 scripts/bench/ratios.sh         # the test command's: every part in its smoke mode
#
# Parts (each its own script, run with the settings below; read there what each measures):
#   check API      scripts/bench/check-load.sh: `POST /v1/check` (memory store, 1 and 3 rules)
#                  against examples/minimal_axum.rs, 64 connections, 10k keys, median of ROUNDS
#                  interleaved rounds (the per-round ratios' median)
#   sidecar        scripts/bench/sidecar-vs-nginx.sh (nginx-proxy, nginx-auth, sidecar): the
#                  sidecar's own CPU per request on cold keys (every decision at the endpoint)
#                  against nginx proxy_pass's, and its throughput against nginx + auth_request's
#   Redis          scripts/bench/rls-load.sh through Envoy's rate limit service, fixed windows,
#                  1 and 3 descriptors, against envoyproxy/ratelimit: Redis CPU and Redis
#                  commands per decision, twice: Redis on a core of its own (server and client
#                  share the other) and Redis on the server's core
#   leases         scripts/bench/leases-batched.sh: store calls per decision on a hot key of a
#                  leased rule, batched (/v1/checks of 50) and single checks
# Prints one Markdown table (ratio, measured, target, met) after the parts' own output, and
# appends it with the date, commit and load to OUT. A part whose measured call fails fails this
# script (each part checks its own calls); a figure this script cannot find in a part's output
# fails it too (the part's output changed: update the parsing here). Never fails on a timing: a
# target missed is a row saying so.
#
# Env: ROUNDS (3), DURATION (8, seconds per measured run), SLUICE_BIN (else the release build of
#      this checkout, with the check-load examples), OUT (Markdown file appended to; else a temp
#      file), SMOKE (1: each part's smoke mode; envoyproxy/ratelimit's rows only if already
#      built, as in rls-load.sh's smoke mode).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BENCH="$ROOT/scripts/bench"
# shellcheck source=scripts/bench/lib.sh
. "$BENCH/lib.sh"
ROUNDS="${ROUNDS:-3}"
DURATION="${DURATION:-8}"
OUT="${OUT:-$(mktemp -t ratios.XXXXXX.md)}"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
if [ -z "${SLUICE_BIN:-}" ]; then
    (cd "$ROOT" && cargo build --release --quiet --bin sluice --example minimal_axum --example open_loop)
    SLUICE_BIN="$TARGET/release/sluice"
fi
export SLUICE_BIN SMOKE
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
load_before="$(cut -d' ' -f1-3 /proc/loadavg)"

part() { # NAME COMMAND...: runs a part, its output in $work/NAME.log (shown), failing on its failure
    local name="$1"; shift
    log "== $name: $*"
    if ! "$@" >"$work/$name.log" 2>&1; then
        cat "$work/$name.log" >&2
        fail "$name: $* failed"
    fi
    cat "$work/$name.log" >&2
}

# --- the parts ------------------------------------------------------------------------------------
if [ "$SMOKE" = 1 ]; then
    part check env SKIP_BUILD=1 OUT="$work/check.md" "$BENCH/check-load.sh"
    part sidecar env TARGETS="nginx-proxy nginx-auth sidecar" "$BENCH/sidecar-vs-nginx.sh"
    part redis-own env LIMITADOR=0 SERVER_CPU=0 CLIENT_CPU=0 REDIS_CPU=1 OUT="$work/redis-own.md" "$BENCH/rls-load.sh"
    part redis-shared env LIMITADOR=0 OUT="$work/redis-shared.md" "$BENCH/rls-load.sh"
    part leases "$BENCH/leases-batched.sh" leased
else
    part check env SKIP_BUILD=1 CONNS=64 RUNS="$ROUNDS" DURATION="$DURATION" WARMUP=2 KEYS=10000 \
        OUT="$work/check.md" "$BENCH/check-load.sh"
    part sidecar env TARGETS="nginx-proxy nginx-auth sidecar" ROUNDS="$ROUNDS" DURATION="${DURATION}s" \
        CONNS=64 KEYS=10000 "$BENCH/sidecar-vs-nginx.sh"
    part redis-own env LIMITADOR=0 DURATION="${DURATION}s" SERVER_CPU=0 CLIENT_CPU=0 REDIS_CPU=1 \
        OUT="$work/redis-own.md" "$BENCH/rls-load.sh"
    part redis-shared env LIMITADOR=0 DURATION="${DURATION}s" OUT="$work/redis-shared.md" "$BENCH/rls-load.sh"
    part leases env DURATION="$DURATION" "$BENCH/leases-batched.sh" leased
fi

# --- the figures ----------------------------------------------------------------------------------
# found WHAT VALUE: VALUE (a number), or a failure naming what a part's output no longer shows.
found() {
    [[ "$2" =~ ^[0-9]+(\.[0-9]+)?$ ]] || fail "no $1 in the parts' output (got '$2'): their format changed, update scripts/bench/ratios.sh"
    printf '%s' "$2"
}

# The check API: the closed-loop table's last column (the median of per-round ratios), "75.6%".
check_ratio() { awk -F'|' -v t="$1" '$2 ~ "^ *"t" *$" && $(NF - 1) ~ /%/ {v = $(NF - 1)} END {gsub(/[ %]/, "", v); print v}' "$work/check.md"; }
check1=$(found "check-load ratio for sluice-1rule" "$(check_ratio sluice-1rule)")
check3=$(found "check-load ratio for sluice-3rules" "$(check_ratio sluice-3rules)")

# The sidecar: sidecar-vs-nginx's ratio line.
sidecar_line=$(grep -m1 '^sidecar own CPU ÷ nginx proxy_pass own CPU' "$work/sidecar.log" || true)
sidecar_cpu=$(found "sidecar CPU ratio" "$(sed -n 's/^sidecar own CPU ÷ nginx proxy_pass own CPU: \([0-9.]*\)×.*/\1/p' <<<"$sidecar_line")")
sidecar_rps=$(found "sidecar throughput ratio" "$(sed -n 's/.*throughput ÷ nginx + auth_request: \([0-9.]*\)×.*/\1/p' <<<"$sidecar_line")")

# Redis: rls-load's rows, "Redis CPU µs/decision" (column 9) and the commands per decision
# (column 10, its first number), for Sluice's default and envoyproxy/ratelimit.
rls() { # FILE TARGET-PREFIX DESCRIPTORS COLUMN
    awk -F'|' -v t="$2" -v d="$3" -v c="$4" 'index($2, " " t) == 1 && $3 + 0 == d {v = $c} END {split(v, w, ":"); gsub(/ /, "", w[1]); print w[1]}' "$1"
}
ratelimit_built=1
grep -q '^| envoyproxy/ratelimit Redis' "$work/redis-own.md" || ratelimit_built=0
if [ "$ratelimit_built" = 0 ] && [ "$SMOKE" != 1 ]; then fail "no envoyproxy/ratelimit rows in rls-load's output"; fi
ratio() { python3 -c "import sys; a, b = float(sys.argv[1]), float(sys.argv[2]); print(f'{a / b:.2f}')" "$1" "$2"; }
redis_rows=""
for placement in own shared; do
    file="$work/redis-$placement.md"
    where="Redis on its own core"
    [ "$placement" = shared ] && where="Redis on the server's core"
    for d in 1 3; do
        cpu=$(found "Sluice's Redis CPU ($placement, $d)" "$(rls "$file" "Sluice Redis, one call per request (default)" "$d" 9)")
        calls=$(found "Sluice's Redis commands ($placement, $d)" "$(rls "$file" "Sluice Redis, one call per request (default)" "$d" 10)")
        if [ "$ratelimit_built" = 1 ]; then
            peer_cpu=$(found "ratelimit's Redis CPU ($placement, $d)" "$(rls "$file" "envoyproxy/ratelimit Redis" "$d" 9)")
            peer_calls=$(found "ratelimit's Redis commands ($placement, $d)" "$(rls "$file" "envoyproxy/ratelimit Redis" "$d" 10)")
            r=$(ratio "$cpu" "$peer_cpu")
            met=$(python3 -c "print('yes' if $r <= 1.0 else 'no')")
            redis_rows+="| Redis CPU per decision ÷ envoyproxy/ratelimit's, $d descriptor(s), $where | ${r}× ($cpu vs $peer_cpu µs) | ≤ 1× | $met |"$'\n'
            redis_rows+="| Redis calls per decision (commands sent: one FCALL vs INCRBY + EXPIRE each), $d descriptor(s), $where | $calls vs $peer_calls | — | — |"$'\n'
        else
            redis_rows+="| Redis CPU per decision, $d descriptor(s), $where | $cpu µs (envoyproxy/ratelimit not built: smoke run) | — | — |"$'\n'
        fi
    done
done

# Leases: leases-batched's "leased  batch N: … X calls per decision" lines.
lease_calls() { awk -v b="$1" '$1 == "leased" && $2 == "batch" && $3 + 0 == b {print $(NF - 3)}' "$work/leases.log"; }
batched_size=50
[ "$SMOKE" = 1 ] && batched_size=8
lease_batched=$(found "leased batch $batched_size calls" "$(lease_calls "$batched_size")")
lease_single=$(found "leased batch 1 calls" "$(lease_calls 1)")

at_least() { python3 -c "print('yes' if float('$1') >= float('$2') else 'no')"; }
at_most() { python3 -c "print('yes' if float('$1') <= float('$2') else 'no')"; }
{
    echo
    echo "### ratios $(date -u +%Y-%m-%dT%H:%MZ), $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo
    echo "$(nproc) CPUs; load before: $load_before, after: $(cut -d' ' -f1-3 /proc/loadavg); SMOKE=$SMOKE ROUNDS=$ROUNDS DURATION=${DURATION}s; command: scripts/bench/ratios.sh"
    echo
    echo "| ratio | measured | target | met |"
    echo "|---|---:|---:|---|"
    echo "| check API ÷ minimal axum, 1 rule (requests/s) | ${check1}% | ≥ 95% | $(at_least "$check1" 95) |"
    echo "| check API ÷ minimal axum, 3 rules (requests/s) | ${check3}% | ≥ 90% | $(at_least "$check3" 90) |"
    echo "| sidecar own CPU ÷ nginx proxy_pass's, cold keys | ${sidecar_cpu}× | ≤ 1.5× | $(at_most "$sidecar_cpu" 1.5) |"
    echo "| sidecar throughput ÷ nginx + auth_request's | ${sidecar_rps}× | ≥ 4× | $(at_least "$sidecar_rps" 4) |"
    printf '%s' "$redis_rows"
    echo "| leased rule's store calls per decision, batched checks ($batched_size) | $lease_batched | ≤ 0.01 | $(at_most "$lease_batched" 0.01) |"
    echo "| leased rule's store calls per decision, single checks | $lease_single | ≤ 0.01 | $(at_most "$lease_single" 0.01) |"
} | tee -a "$OUT"
log "appended to $OUT"
