#!/usr/bin/env bash
# Over-admission and time without shared decisions when Redis fails over behind Sentinels
# (issue 25): 3 `sluice serve` replicas on a Sentinel-managed master + replica (3 sentinels,
# down-after-milliseconds 1000), one rule per algorithm, each offered 3x its limit by
# examples/failover_load.rs; at FAULT_AT seconds the master is failed over (SENTINEL FAILOVER),
# or killed with SIGKILL, or nothing happens (the baseline). Each scenario runs on a fresh
# topology with its own keys; the table compares the admitted counts with the baseline's.
#
#   scripts/reliability/sentinel-failover.sh                  # 40 s per scenario
#   DURATION=20 FAULT_AT=8 ON_STORE_FAILURE=localFallback scripts/reliability/sentinel-failover.sh kill
#
# MIN_REPLICAS_TO_WRITE=1 starts both Redis servers with `min-replicas-to-write 1` and
# `min-replicas-max-lag 1` (MIN_REPLICAS_MAX_LAG): a master without a replica in sync refuses
# writes (NOREPLICAS), which closes the window in which a demoted master takes writes that are
# then lost, at the price of refusing every write while no replica is connected.
#
# docs/reliability.md has the figures.
set -euo pipefail
# shellcheck source=scripts/reliability/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
SCENARIOS=("$@")
((${#SCENARIOS[@]})) || SCENARIOS=(baseline failover kill)

build_tools
write_policy

GUARD=()
if [ -n "${MIN_REPLICAS_TO_WRITE:-}" ]; then
    GUARD=(--min-replicas-to-write "$MIN_REPLICAS_TO_WRITE" --min-replicas-max-lag "${MIN_REPLICAS_MAX_LAG:-1}")
fi

topology_up() {
    MASTER=$(free_port); REPLICA=$(free_port)
    redis-server --port "$MASTER" --bind 127.0.0.1 --save '' --appendonly no --loglevel warning --dir "$WORK" \
        "${GUARD[@]}" >/dev/null 2>&1 &
    MASTER_PID=$!; PIDS+=("$MASTER_PID")
    redis-server --port "$REPLICA" --bind 127.0.0.1 --save '' --appendonly no --loglevel warning \
        --replicaof 127.0.0.1 "$MASTER" --dir "$WORK" "${GUARD[@]}" >/dev/null 2>&1 &
    PIDS+=($!)
    SENTINELS=()
    local i port
    for i in 0 1 2; do
        port=$(free_port)
        printf 'port %s\nbind 127.0.0.1\nsentinel monitor mymaster 127.0.0.1 %s 2\nsentinel down-after-milliseconds mymaster 1000\nsentinel failover-timeout mymaster 10000\n' \
            "$port" "$MASTER" >"$WORK/sentinel-$i.conf"
        redis-server "$WORK/sentinel-$i.conf" --sentinel >/dev/null 2>&1 &
        PIDS+=($!); SENTINELS+=("$port")
    done
    wait_for 20 "replica in sync" sh -c "redis-cli -p $REPLICA info replication | grep -q master_link_status:up"
    wait_for 20 "sentinels see each other" sh -c \
        "[ \$(redis-cli -p ${SENTINELS[0]} sentinel sentinels mymaster | grep -c '^127.0.0.1$') -ge 2 ]"
    # A sentinel learns of the replica from the master's INFO (every 10 s at first): until then
    # SENTINEL FAILOVER answers NOGOODSLAVE, which a fault early in the run (the smoke run's
    # FAULT_AT=1) would meet.
    local s
    for s in "${SENTINELS[@]}"; do
        wait_for 30 "sentinel $s sees the replica" sh -c "redis-cli -p $s sentinel replicas mymaster | grep -qx $REPLICA"
    done
    start_replicas 3 --redis-sentinel-master mymaster --redis-sentinel \
        "redis://127.0.0.1:${SENTINELS[0]},redis://127.0.0.1:${SENTINELS[1]},redis://127.0.0.1:${SENTINELS[2]}"
}

for scenario in "${SCENARIOS[@]}"; do
    topology_up
    log "scenario $scenario: ${DURATION}s at ${RATE}/s per rule (limit 200 per 10s = 20/s), fault at ${FAULT_AT}s"
    start_load "$scenario"
    sleep "$FAULT_AT"
    promoted=""
    case "$scenario" in
        baseline) ;;
        failover)
            answer=$(redis-cli -p "${SENTINELS[0]}" sentinel failover mymaster)
            [ "$answer" = OK ] || fail "SENTINEL FAILOVER: $answer"
            ;;
        kill) kill -9 "$MASTER_PID" ;;
        *) log "unknown scenario $scenario"; exit 1 ;;
    esac
    if [ "$scenario" != baseline ]; then
        fault_at=$(date +%s.%N)
        wait_for 30 "the replica promoted" sh -c "redis-cli -p $REPLICA role | head -n 1 | grep -q master"
        promoted=$(python3 -c "import time; print(round(time.time() - $fault_at, 2))")
        log "  replica promoted ${promoted}s after the fault"
    fi
    finish_load "$scenario" "promoted_after_s=$promoted"
    kill_all
done
print_table
