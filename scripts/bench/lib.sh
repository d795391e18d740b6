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

# store_calls PORT: the decision functions and scripts Redis ran so far (INFO commandstats).
store_calls() {
    redis-cli -p "$1" INFO commandstats |
        awk -F'[:=,]' '/^cmdstat_(fcall|fcall_ro|evalsha|eval):/ {n += $3} END {print n + 0}'
}

# wait_for_port PORT WHAT: returns once 127.0.0.1:PORT accepts connections, or fails naming WHAT and
# the tail of the logs in $work (the calling script's directory).
wait_for_port() {
    local t
    for t in $(seq 200); do
        (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
        [ "$t" != 200 ] || fail "$2 on port $1 did not come up: $(tail -n 5 "${work:-.}"/*.log 2>/dev/null)"
        sleep 0.1
    done
}

# redis_cpu PORT: Redis's own CPU seconds so far (used_cpu_user + used_cpu_sys).
redis_cpu() { redis-cli -p "$1" INFO cpu | awk -F: '/^used_cpu_(user|sys):/ {s += $2} END {printf "%.6f", s}'; }

# The smoke mode of the test command (scripts/smoke.sh sets SMOKE=1): tiny runs, peers that are
# not built left out with a note, and any failed measured call fails the script.
SMOKE="${SMOKE:-0}"

# fail MESSAGE: a measurement that cannot be trusted (failed calls, nothing measured) ends the
# script with an error instead of printing numbers.
fail() { log "FAILED: $*"; exit 1; }

# skip_peer WHY: a peer this script compares against is not built. In the smoke run the script
# stops there with a note scripts/smoke.sh reports as skipped (never as passed); in a real run
# it fails.
skip_peer() {
    if [ "$SMOKE" = 1 ]; then log "SMOKE-SKIP: $*"; exit 0; fi
    fail "$*"
}

# lua_library_files: the decision code's Lua files in the order src/store/redis/library.rs
# concatenates them (DECISION_CODE), so a script loading the library by hand loads what Sluice
# loads; fails when that file no longer lists them.
lua_library_files() {
    local files
    files=$(sed -n 's|.*include_str!("\(\.\./\)*\(lua/[a-z_]*\.lua\)").*|\2|p' "$ROOT/src/store/redis/library.rs")
    [ -n "$files" ] || fail "no include_str!(\"…/lua/…\") in src/store/redis/library.rs: update lua_library_files"
    printf '%s\n' "$files"
}

# fcall_stats PORT: "calls failed_calls rejected_calls" of FCALL since the last CONFIG RESETSTAT.
fcall_stats() {
    redis-cli -p "$1" INFO commandstats | tr -d '\r' | awk -F'[:,=]' '/^cmdstat_fcall:/ {
        for (i = 2; i < NF; i += 2) v[$i] = $(i + 1)
        printf "%d %d %d\n", v["calls"], v["failed_calls"], v["rejected_calls"]; found = 1 }
        END { if (!found) print "0 0 0" }'
}

# sluice_bin: SLUICE_BIN when set, else this checkout's release build (built here unless
# SKIP_BUILD=1). Prints the path.
sluice_bin() {
    if [ -n "${SLUICE_BIN:-}" ]; then
        [ -x "$SLUICE_BIN" ] || fail "SLUICE_BIN=$SLUICE_BIN is not an executable"
        echo "$SLUICE_BIN"; return
    fi
    local target="${CARGO_TARGET_DIR:-$ROOT/target}"
    if [ "${SKIP_BUILD:-0}" != 1 ]; then (cd "$ROOT" && cargo build --release --quiet --bin sluice) >&2; fi
    [ -x "$target/release/sluice" ] || fail "$target/release/sluice is not built"
    echo "$target/release/sluice"
}
