# Sourced by the fault scripts of scripts/reliability/: the policy (one rule per algorithm, each
# offered 3x its limit), starting `sluice serve` replicas, the load (examples/failover_load.rs)
# and the table comparing each scenario with the baseline. Every server listens on 127.0.0.1.
# shellcheck shell=bash

RELIABILITY_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=scripts/bench/lib.sh
source "$RELIABILITY_ROOT/scripts/bench/lib.sh"

DURATION="${DURATION:-40}"
FAULT_AT="${FAULT_AT:-15}"
RATE="${RATE:-60}"
ON_STORE_FAILURE="${ON_STORE_FAILURE:-deny}"
RULE_PATHS=(/fixed /log /counter /bucket /gcra /leaky)

WORK="$(mktemp -d)"
PIDS=()
kill_all() {
    for pid in "${PIDS[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    PIDS=()
}
trap 'kill_all; rm -rf "$WORK"' EXIT

# SLUICE_BIN and LOAD_BIN (examples/failover_load) use binaries already built; without both,
# the release build of this checkout is made (or brought up to date) first.
build_tools() {
    install_missing redis-server:redis-server redis-cli:redis-tools python3:python3 jq:jq curl:curl
    if [ -z "${SLUICE_BIN:-}" ] || [ -z "${LOAD_BIN:-}" ]; then
        (cd "$RELIABILITY_ROOT" && cargo build --release --quiet --bin sluice --example failover_load)
    fi
    local target="${CARGO_TARGET_DIR:-$RELIABILITY_ROOT/target}"
    SLUICE="${SLUICE_BIN:-$target/release/sluice}"
    LOAD="${LOAD_BIN:-$target/release/examples/failover_load}"
    [ -x "$SLUICE" ] || fail "no sluice binary at $SLUICE"
    [ -x "$LOAD" ] || fail "no failover_load binary at $LOAD"
}

# One rule per algorithm, 200 per 10 s, keyed by the run, with ON_STORE_FAILURE.
write_policy() {
    {
        printf 'apiVersion: sluice.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {name: faults, namespace: failover}\nspec:\n  rules:\n'
        local pair
        for pair in fixedWindow:/fixed slidingWindowLog:/log slidingWindowCounter:/counter tokenBucket:/bucket gcra:/gcra leakyBucket:/leaky; do
            printf '    - name: %s\n      match: {paths: [{exact: "%s"}]}\n      key: [{header: x-run}]\n      algorithm: %s\n      limit: {requests: 200, per: 10s}\n      onStoreFailure: %s\n' \
                "${pair#*/}" "${pair#*:}" "${pair%%:*}" "$ON_STORE_FAILURE"
        done
    } >"$WORK/policy.yaml"
}

wait_for() { # SECONDS DESCRIPTION COMMAND...
    local within="$1" what="$2"; shift 2
    for _ in $(seq $((within * 20))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.05; done
    log "timed out waiting for: $what"
    [ -s "$WORK/sluice.log" ] && tail -n 20 "$WORK/sluice.log" >&2
    exit 1
}

# start_replicas N STORE-ARGS...: N `sluice serve` on the policy; their addresses in ENDPOINTS
# and pids in SLUICE_PIDS.
start_replicas() {
    local n="$1"; shift
    ENDPOINTS=(); SLUICE_PIDS=()
    for _ in $(seq "$n"); do
        local port; port=$(free_port)
        "$SLUICE" serve --policies "$WORK/policy.yaml" --listen "127.0.0.1:$port" --fallback-replicas "$n" "$@" \
            2>>"$WORK/sluice.log" &
        PIDS+=($!); SLUICE_PIDS+=($!); ENDPOINTS+=("127.0.0.1:$port")
    done
    local endpoint
    for endpoint in "${ENDPOINTS[@]}"; do wait_for 20 "sluice on $endpoint" curl -sf "http://$endpoint/readyz"; done
}

# Memory (RSS, KiB) and open files of the replicas, summed: "rss_kib fds".
replica_resources() {
    local pid rss=0 fds=0
    for pid in "${SLUICE_PIDS[@]}"; do
        rss=$((rss + $(awk '/^VmRSS:/ {print $2}' "/proc/$pid/status")))
        fds=$((fds + $(find "/proc/$pid/fd" -mindepth 1 -maxdepth 1 | wc -l)))
    done
    echo "$rss $fds"
}

# start_load RUN: the load in the background from the next 10 s boundary (so the windows of
# every scenario fall alike), with the extra flags in LOAD_ARGS; its pid in LOAD_PID, its report
# in $WORK/load.json.
LOAD_ARGS=()
start_load() {
    # In the smoke run (SMOKE=1) no wait: its windows are not compared.
    [ "$SMOKE" = 1 ] || python3 -c 'import time; time.sleep(10 - time.time() % 10 + 0.02)'
    "$LOAD" --endpoints "$(IFS=,; echo "${ENDPOINTS[*]}")" --paths "$(IFS=,; echo "${RULE_PATHS[*]}")" \
        --namespace failover --rate "$RATE" --duration "$DURATION" --window 10 --run "$1-$$" "${LOAD_ARGS[@]}" \
        >"$WORK/load.json" &
    LOAD_PID=$!
}

# finish_load SCENARIO [KEY=VALUE...]: waits for the load; its report with the scenario's name
# and the extra fields appended to RESULTS, and printed.
RESULTS=()
finish_load() {
    local scenario="$1"; shift
    wait "$LOAD_PID" 2>/dev/null || true  # a scenario may have waited for it already
    # No figures from a load that did not run: every rule must have been offered requests and
    # decided some; in the baseline, where nothing fails, every answer must be a decision made
    # with the store (no error, no non-200, nothing by onStoreFailure).
    jq -e --argjson paths "$(printf '%s\n' "${RULE_PATHS[@]}" | jq -R . | jq -s .)" \
        'all($paths[] as $p | .[$p]; . != null and .sent > 0 and .admitted + .refused > 0)' \
        "$WORK/load.json" >/dev/null 2>&1 || fail "$scenario: the load decided nothing on some rule: $(head -c 600 "$WORK/load.json")"
    if [ "$scenario" = baseline ]; then
        jq -e 'all(.[] | objects | select(has("sent")); .non_200 == 0 and .transport_errors == 0 and ([.by_store_failure[]] | add // 0) == 0)' \
            "$WORK/load.json" >/dev/null || fail "baseline: failed calls: $(head -c 600 "$WORK/load.json")"
    fi
    local extra='{}' pair
    for pair in "$@"; do extra=$(jq -c --arg k "${pair%%=*}" --arg v "${pair#*=}" '. + {($k): $v}' <<<"$extra"); done
    RESULTS+=("$(jq -c --arg s "$scenario" --argjson e "$extra" '{scenario: $s} + $e + .' "$WORK/load.json")")
    printf '%s\n' "${RESULTS[-1]}"
}

# The table: per scenario and rule, admitted and its difference from the baseline's, the most
# admitted in a 10 s window, decisions by onStoreFailure, the longest time an endpoint decided
# without the store, and answers that were not a 200.
print_table() {
    printf '\n%-12s %-8s %9s %9s %11s %11s %10s %8s\n' scenario rule admitted "vs base" "max/window" "by failure" "no-store" "non-200"
    local line scenario rule base
    for line in "${RESULTS[@]}"; do
        scenario=$(jq -r .scenario <<<"$line")
        for rule in "${RULE_PATHS[@]}"; do
            base=$(printf '%s\n' "${RESULTS[@]}" | jq -r --arg r "$rule" 'select(.scenario == "baseline") | .[$r].admitted' | head -n 1)
            jq -r --arg r "$rule" --arg s "$scenario" --arg b "${base:-0}" '.[$r] |
                [$s, $r, .admitted, (.admitted - ($b | tonumber)), .max_admitted_in_a_window,
                 ([.by_store_failure[]] | add // 0), "\(.longest_without_store_ms) ms", (.non_200 + .transport_errors)] | @tsv' <<<"$line" |
                awk -F'\t' '{ printf "%-12s %-8s %9s %+9d %11s %11s %10s %8s\n", $1, $2, $3, $4, $5, $6, $7, $8 }'
        done
    done
}
