#!/usr/bin/env bash
# Redis faults under load (issue 25): 3 `sluice serve` replicas reach one Redis through
# toxiproxy (built from the Go module proxy once, cached in $SLUICE_CACHE/toxiproxy), one rule per
# algorithm offered 3x its limit (examples/failover_load.rs), and at FAULT_AT seconds a fault
# for FAULT_FOR seconds:
#
#   latency-5ms, latency-50ms, latency-500ms   every Redis answer delayed (the deadline is 50 ms)
#   bandwidth     Redis's answers limited to 8 KB/s
#   reset         every connection reset as soon as it carries data
#   partition     nothing passes (connections stay open), longer than the deadline
#   restart       Redis killed and started again at once, empty (no persistence)
#   restart-aof   the same with the append-only file on (appendfsync everysec): Redis comes back
#                 with what it had written to the file (the last second may be lost)
#
# Each scenario runs on a fresh Redis and replicas with its own keys. Reported per scenario:
# failover_load's figures, the table against the baseline, and the replicas' memory and open
# files before and after.
#
#   scripts/reliability/redis-faults.sh                       # every scenario, 40 s each
#   DURATION=20 FAULT_AT=6 FAULT_FOR=4 scripts/reliability/redis-faults.sh baseline partition
set -euo pipefail
# shellcheck source=scripts/reliability/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
FAULT_FOR="${FAULT_FOR:-5}"
TOXIPROXY_VERSION=v2.5.0
SCENARIOS=("$@")
((${#SCENARIOS[@]})) || SCENARIOS=(baseline latency-5ms latency-50ms latency-500ms bandwidth reset partition restart restart-aof)

build_tools
write_policy
TOXIPROXY="${SLUICE_CACHE:-$HOME/.cache/sluice}/toxiproxy/$TOXIPROXY_VERSION"
if [ ! -x "$TOXIPROXY/server" ] || [ ! -x "$TOXIPROXY/cli" ]; then
    log "building toxiproxy $TOXIPROXY_VERSION from the Go module proxy into $TOXIPROXY"
    GOBIN="$TOXIPROXY" PATH="$PATH:/usr/local/go/bin" go install \
        "github.com/Shopify/toxiproxy/v2/cmd/server@$TOXIPROXY_VERSION" "github.com/Shopify/toxiproxy/v2/cmd/cli@$TOXIPROXY_VERSION"
fi

toxic() { "$TOXIPROXY/cli" --host "http://127.0.0.1:$TOXI_API" toxic "$@" >/dev/null; }

for scenario in "${SCENARIOS[@]}"; do
    REDIS=$(free_port); PROXY=$(free_port); TOXI_API=$(free_port)
    persistence=()
    if [ "$scenario" = restart-aof ]; then
        persistence=(--appendonly yes --appendfsync everysec --dir "$WORK" --appendfilename "aof-$REDIS")
    fi
    start_redis "$REDIS" 0-1 "${persistence[@]}"
    PIDS+=("$REDIS_PID")
    "$TOXIPROXY/server" -host 127.0.0.1 -port "$TOXI_API" >/dev/null 2>&1 &
    PIDS+=($!)
    wait_for 10 "toxiproxy" "$TOXIPROXY/cli" --host "http://127.0.0.1:$TOXI_API" list
    "$TOXIPROXY/cli" --host "http://127.0.0.1:$TOXI_API" create --listen "127.0.0.1:$PROXY" \
        --upstream "127.0.0.1:$REDIS" redis >/dev/null
    start_replicas 3 --redis "redis://127.0.0.1:$PROXY"
    read -r rss_before fds_before < <(replica_resources)
    log "scenario $scenario: ${DURATION}s at ${RATE}/s per rule (limit 200 per 10s = 20/s), fault at ${FAULT_AT}s for ${FAULT_FOR}s"
    start_load "$scenario"
    sleep "$FAULT_AT"
    case "$scenario" in
        baseline) ;;
        latency-*) ms="${scenario#latency-}"; toxic add -n fault -t latency -a "latency=${ms%ms}" redis ;;
        bandwidth) toxic add -n fault -t bandwidth -a rate=8 redis ;;
        reset) toxic add -n fault -t reset_peer -a timeout=0 redis ;;
        partition) toxic add -n fault -t timeout -a timeout=0 redis ;;
        restart|restart-aof)
            kill -9 "$REDIS_PID"
            while kill -0 "$REDIS_PID" 2>/dev/null; do sleep 0.01; done
            start_redis "$REDIS" 0-1 "${persistence[@]}"
            PIDS+=("$REDIS_PID")
            ;;
        *) log "unknown scenario $scenario"; exit 1 ;;
    esac
    if [ "$scenario" != baseline ] && [ "$scenario" != restart ] && [ "$scenario" != restart-aof ]; then
        sleep "$FAULT_FOR"
        toxic remove -n fault redis
    fi
    wait "$LOAD_PID" || true
    read -r rss_after fds_after < <(replica_resources)
    finish_load "$scenario" "rss_kib_before=$rss_before" "rss_kib_after=$rss_after" \
        "fds_before=$fds_before" "fds_after=$fds_after"
    kill_all
done
print_table
printf '\n%-14s %14s %14s %10s %10s\n' scenario "rss before KiB" "rss after KiB" "fds before" "fds after"
for line in "${RESULTS[@]}"; do
    jq -r '[.scenario, .rss_kib_before, .rss_kib_after, .fds_before, .fds_after] | @tsv' <<<"$line" |
        awk -F'\t' '{ printf "%-14s %14s %14s %10s %10s\n", $1, $2, $3, $4, $5 }'
done
