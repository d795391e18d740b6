# Sourced by the benchmark scripts: what each of them needs to start and read the servers it
# compares. Every server listens on 127.0.0.1 only.
# shellcheck shell=bash

log() { printf '%s\n' "$*" >&2; }

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# install_missing COMMAND:PACKAGE...: installs (Debian) the package of each command not found.
install_missing() {
    local pair need=()
    for pair in "$@"; do command -v "${pair%%:*}" >/dev/null 2>&1 || need+=("${pair#*:}"); done
    ((${#need[@]})) || return 0
    log "installing ${need[*]}"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}") >&2
}

# start_redis PORT CPU [redis-server ARGS...]: a private redis-server without persistence, pinned
# to CPU, in the background; its pid in REDIS_PID. Returns once it answers PING, or exits.
start_redis() {
    local port="$1" cpu="$2"; shift 2
    taskset -c "$cpu" redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no \
        --daemonize no --loglevel warning "$@" >/dev/null 2>&1 &
    # shellcheck disable=SC2034 # read by the scripts that source this
    REDIS_PID=$!
    for _ in $(seq 100); do
        redis-cli -p "$port" ping >/dev/null 2>&1 && return 0
        sleep 0.05
    done
    log "redis-server on port $port did not start"
    exit 1
}

# redis_cpu PORT: Redis's own CPU seconds so far (used_cpu_user + used_cpu_sys).
redis_cpu() { redis-cli -p "$1" INFO cpu | awk -F: '/^used_cpu_(user|sys):/ {s += $2} END {printf "%.6f", s}'; }
