#!/usr/bin/env bash
# Over-admission, time without shared decisions and lost or doubled decisions on a Redis Cluster
# under load (issue 25): 3 masters with a replica each (cluster-node-timeout 2000), 3 `sluice
# serve --redis-cluster` replicas, one rule per algorithm offered 3x its limit
# (examples/failover_load.rs). Every key of the run lives in the slot of the hash tag
# {failover}; at FAULT_AT seconds:
#
#   failover   CLUSTER FAILOVER on the replica of that slot's master (graceful)
#   kill       that slot's master killed with SIGKILL (its replica takes over after the timeout)
#   migrate    the slot moved to another master while the load runs (MIGRATING/IMPORTING, keys
#              moved with MIGRATE: clients see ASK and then MOVED)
#
#   scripts/reliability/cluster-failover.sh                   # baseline failover kill migrate
set -euo pipefail
# shellcheck source=scripts/reliability/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
SCENARIOS=("$@")
((${#SCENARIOS[@]})) || SCENARIOS=(baseline failover kill migrate)

build_tools
write_policy

# A port whose cluster bus port (+10000) is free too.
bus_port() {
    python3 - <<'PY'
import socket
for _ in range(200):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    if port < 55000:
        b = socket.socket()
        try:
            b.bind(("127.0.0.1", port + 10000)); b.close(); print(port); break
        except OSError:
            pass
PY
}

cluster_up() {
    NODES=(); NODE_PIDS=()
    local i port dir
    for i in 0 1 2 3 4 5; do
        port=$(bus_port); dir="$WORK/node-$port"; mkdir -p "$dir"
        redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --loglevel warning \
            --cluster-enabled yes --cluster-config-file "$dir/nodes.conf" --cluster-node-timeout 2000 \
            --dir "$dir" >/dev/null 2>&1 &
        PIDS+=($!); NODE_PIDS+=($!); NODES+=("$port")
    done
    for port in "${NODES[@]}"; do wait_for 10 "node $port" redis-cli -p "$port" ping; done
    local addresses=()
    for port in "${NODES[@]}"; do addresses+=("127.0.0.1:$port"); done
    redis-cli --cluster create "${addresses[@]}" --cluster-replicas 1 --cluster-yes >/dev/null
    wait_for 30 "the cluster is ok" sh -c "redis-cli -p ${NODES[0]} cluster info | grep -q cluster_state:ok"
    wait_for 30 "every replica in sync" sh -c \
        "[ \$(for p in ${NODES[*]}; do redis-cli -p \$p info replication | grep -c master_link_status:up; done | awk '{s += \$1} END {print s}') -eq 3 ]"
    SLOT=$(redis-cli -p "${NODES[0]}" cluster keyslot '{failover}')
    start_replicas 3 --redis-cluster "$(printf 'redis://127.0.0.1:%s,' "${NODES[@]}" | sed 's/,$//')"
}

# The port and node id of the master serving SLOT, and the port of its replica.
slot_owner() {
    local id address rest
    read -r id address rest < <(redis-cli -p "${NODES[0]}" cluster nodes | awk -v slot="$SLOT" '$3 ~ /master/ && $3 !~ /fail/ {
        for (i = 9; i <= NF; i++) { n = split($i, r, "-"); if ((n == 1 && r[1] == slot) || (n == 2 && slot >= r[1] && slot <= r[2])) print $1, $2 } }' | head -n 1)
    : "$rest"
    OWNER_ID="$id"; address="${address%@*}"; OWNER_PORT="${address##*:}"
    address=$(redis-cli -p "${NODES[0]}" cluster nodes | awk -v id="$OWNER_ID" '$4 == id { print $2 }' | head -n 1)
    address="${address%@*}"; REPLICA_PORT="${address##*:}"
}

migrate_slot() {
    local target_port target_id keys
    local p
    for p in "${NODES[@]}"; do
        if [ "$p" != "$OWNER_PORT" ] && redis-cli -p "$p" role | head -n 1 | grep -q master; then target_port="$p"; break; fi
    done
    target_id=$(redis-cli -p "$target_port" cluster myid)
    redis-cli -p "$target_port" cluster setslot "$SLOT" importing "$OWNER_ID" >/dev/null
    redis-cli -p "$OWNER_PORT" cluster setslot "$SLOT" migrating "$target_id" >/dev/null
    while :; do
        mapfile -t keys < <(redis-cli -p "$OWNER_PORT" cluster getkeysinslot "$SLOT" 10 | grep -v '^$')
        ((${#keys[@]})) || break
        redis-cli -p "$OWNER_PORT" migrate 127.0.0.1 "$target_port" "" 0 5000 keys "${keys[@]}" | grep -qE '^(OK|NOKEY)$' \
            || { log "MIGRATE failed"; exit 1; }
        sleep 0.2  # a slow migration: the load meets the slot half moved
    done
    for p in "${NODES[@]}"; do redis-cli -p "$p" cluster setslot "$SLOT" node "$target_id" >/dev/null 2>&1 || true; done
    log "  slot $SLOT moved from :$OWNER_PORT to :$target_port"
}

for scenario in "${SCENARIOS[@]}"; do
    cluster_up
    slot_owner
    log "scenario $scenario: ${DURATION}s at ${RATE}/s per rule (limit 200 per 10s = 20/s), slot $SLOT on :$OWNER_PORT (replica :$REPLICA_PORT), fault at ${FAULT_AT}s"
    start_load "$scenario"
    sleep "$FAULT_AT"
    case "$scenario" in
        baseline) ;;
        failover) redis-cli -p "$REPLICA_PORT" cluster failover >/dev/null ;;
        kill)
            for i in "${!NODES[@]}"; do [ "${NODES[$i]}" = "$OWNER_PORT" ] && kill -9 "${NODE_PIDS[$i]}"; done
            ;;
        migrate) migrate_slot ;;
        *) log "unknown scenario $scenario"; exit 1 ;;
    esac
    finish_load "$scenario"
    kill_all
    rm -rf "$WORK"/node-*
done
print_table
