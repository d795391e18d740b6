#!/usr/bin/env bash
# Every benchmark and reliability script the docs name, in its smoke mode (SMOKE=1): a second or
# two of load instead of minutes, the peers that are not built (Limitador, envoyproxy/ratelimit)
# left out with a printed note, and any failed measured call failing the script. Numbers printed
# here mean nothing; what is checked is that each script still runs end to end against this
# checkout and refuses to print figures made of failures. scripts/test.sh runs this after the
# cargo tests; its closing line counts it.
#
#   scripts/smoke.sh                         # every script
#   scripts/smoke.sh redis-profile rls-load  # only the scripts whose path contains one of these
#
# Binaries: the release build of this checkout (sluice and the examples the scripts drive),
# built once here (cargo does nothing when it is up to date), then given to every script through
# SLUICE_BIN / LOAD_BIN / SKIP_BUILD=1 so that none builds again. Env: SMOKE_TIMEOUT (seconds
# per script, 180), SMOKE_LOGS (a directory to keep each script's output in; else a temporary
# one, removed when everything passed).
#
# A script the docs name that is in neither list below fails the run: a new script joins the
# smoke run, or says here why it cannot.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT="$(pwd)"
export SMOKE=1 SKIP_BUILD=1
TIMEOUT="${SMOKE_TIMEOUT:-180}"
LOGS="${SMOKE_LOGS:-$(mktemp -d -t sluice-smoke.XXXXXX)}"
mkdir -p "$LOGS"
started=$SECONDS

# --- what runs ------------------------------------------------------------------------------------
# name | command (run by bash from the checkout, with SMOKE=1 and the binaries exported)
RUNS=(
  "scripts/bench/check-instructions.sh|scripts/bench/check-instructions.sh"
  "scripts/bench/check-load.sh|scripts/bench/check-load.sh"
  "scripts/bench/checks-memory.sh|scripts/bench/checks-memory.sh"
  "scripts/bench/defer.sh|scripts/bench/defer.sh"
  "scripts/bench/degrade.sh|scripts/bench/degrade.sh"
  "scripts/bench/egress.sh|scripts/bench/egress.sh"
  "scripts/bench/envoy-ratelimit.sh|peer envoy-ratelimit"
  "scripts/bench/leases.sh|scripts/bench/leases.sh exact leased limitador kill"
  "scripts/bench/leases-batched.sh|scripts/bench/leases-batched.sh"
  "scripts/bench/limitador.sh|peer limitador"
  "scripts/bench/llm-tokens.sh|scripts/bench/llm-tokens.sh"
  "scripts/bench/nagle.sh|scripts/bench/nagle.sh"
  "scripts/bench/overload.sh|scripts/bench/overload.sh"
  "scripts/bench/ratios.sh|scripts/bench/ratios.sh"
  "scripts/bench/read-ahead.sh|scripts/bench/read-ahead.sh"
  "scripts/bench/redis-cost.sh|scripts/bench/redis-cost.sh"
  "scripts/bench/redis-load.sh|scripts/bench/redis-load.sh"
  "scripts/bench/redis-profile.sh|scripts/bench/redis-profile.sh"
  "scripts/bench/rls-hot-denied.sh|scripts/bench/rls-hot-denied.sh"
  "scripts/bench/rls-load.sh|scripts/bench/rls-load.sh"
  "scripts/bench/shared-fate.sh|scripts/bench/shared-fate.sh"
  "scripts/bench/sidecar-vs-nginx.sh|scripts/bench/sidecar-vs-nginx.sh"
  "scripts/bench/sidecar.sh|scripts/bench/sidecar.sh"
  "scripts/bench/sliding-log-redis.py|sliding_log"
  "scripts/bench-medians.py|bench_medians"
  "scripts/reliability/cluster-failover.sh|DURATION=2 FAULT_AT=1 scripts/reliability/cluster-failover.sh baseline failover"
  "scripts/reliability/endpoint-kill.sh|DURATION=2 FAULT_AT=1 FAULT_FOR=1 scripts/reliability/endpoint-kill.sh baseline kill-one"
  "scripts/reliability/key-flood.sh|scripts/reliability/key-flood.sh bounded"
  "scripts/reliability/limitador-faults.sh|DURATION=2 FAULT_AT=1 FAULT_FOR=1 scripts/reliability/limitador-faults.sh baseline partition"
  "scripts/reliability/redis-faults.sh|DURATION=2 FAULT_AT=1 FAULT_FOR=1 scripts/reliability/redis-faults.sh baseline partition"
  "scripts/reliability/sentinel-failover.sh|DURATION=2 FAULT_AT=1 scripts/reliability/sentinel-failover.sh baseline failover"
  "scripts/reliability/soak.sh|scripts/reliability/soak.sh"
)
# Named by the docs, not run here, and why.
NOT_RUN=(
  "scripts/test.sh|the test command itself, which runs this"
  "scripts/smoke.sh|this script"
  "scripts/fuzz.sh|run by the test command's own fuzzing phase"
  "scripts/bench/check.lua|wrk's request script, run by check-load.sh and redis-load.sh"
  "scripts/bench/policies-1rule|policies read by check-load.sh and redis-load.sh"
  "scripts/bench/policies-3rules|policies read by check-load.sh"
  "scripts/bench/redis-profile-steps.lua|loaded by redis-profile.sh"
  "scripts/bench/nagle_upstream.py|the upstream nagle.sh starts"
)

# --- the docs' list must be covered ---------------------------------------------------------------
named=$(grep -rhoE 'scripts/[A-Za-z0-9_./-]*[A-Za-z0-9_]' docs README.md | sort -u)
missing=()
for path in $named; do
  [ -e "$path" ] || [ -e "${path%/}" ] || { missing+=("$path (named by the docs, not in the checkout)"); continue; }
  known=0
  for entry in "${RUNS[@]}" "${NOT_RUN[@]}"; do [ "${entry%%|*}" = "$path" ] && known=1; done
  # A directory the docs point to (scripts/reliability/) is not itself a script.
  [ "$known" = 1 ] || [ -d "$path" ] || missing+=("$path (named by the docs: add it to scripts/smoke.sh)")
done

# --- binaries -------------------------------------------------------------------------------------
target="${CARGO_TARGET_DIR:-$ROOT/target}/release"
examples=(failover_load redis_cost minimal_axum open_loop overload_bench overload_plot fake_llm llm_load)
echo "==> smoke: release build (sluice and ${examples[*]})"
build=(cargo build --release --locked --quiet --bin sluice)
for e in "${examples[@]}"; do build+=(--example "$e"); done
if ! "${build[@]}"; then
  echo "smoke: FAILED: the release build"
  exit 1
fi
export SLUICE_BIN="$target/sluice" SLUICE="$target/sluice" LOAD_BIN="$target/examples/failover_load"
# The Go client of the rate limit service (cached; scripts/test.sh has built it already).
PATH="$PATH:/usr/local/go/bin" e2e/rls-client.sh >/dev/null || { echo "smoke: FAILED: e2e/rls-client.sh"; exit 1; }

# --- helpers run as commands ----------------------------------------------------------------------
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# sliding-log-redis.py against a private redis-server, on this checkout's library.
sliding_log() {
  local port; port=$(free_port)
  redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --daemonize no --loglevel warning >/dev/null 2>&1 &
  local pid=$! status=0
  for _ in $(seq 100); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.05; done
  RULES=4 FILL=100 CALLS=200 python3 scripts/bench/sliding-log-redis.py "$port" WORK || status=$?
  kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
  return "$status"
}

# bench-medians.py on a criterion tree laid out as criterion writes it (a real `cargo bench` takes
# minutes), and on an empty one, which must fail.
bench_medians() {
  local dir; dir=$(mktemp -d)
  mkdir -p "$dir/criterion/decide/token_bucket/new"
  echo '{"group_id":"decide","function_id":"token_bucket","full_id":"decide/token_bucket"}' \
    >"$dir/criterion/decide/token_bucket/new/benchmark.json"
  echo '{"median":{"point_estimate":123.4,"confidence_interval":{"lower_bound":120.0,"upper_bound":125.0}}}' \
    >"$dir/criterion/decide/token_bucket/new/estimates.json"
  local out status=0
  out=$(python3 scripts/bench-medians.py "$dir") || status=$?
  echo "$out"
  if [ "$status" != 0 ] || [ "$out" != "$(printf 'decide/token_bucket\t123.4\t[120.0 .. 125.0]')" ]; then
    rm -rf "$dir"; echo "unexpected output"; return 1
  fi
  rm -rf "$dir/criterion"
  if python3 scripts/bench-medians.py "$dir"; then rm -rf "$dir"; echo "no estimates, yet exit 0"; return 1; fi
  rm -rf "$dir"
}

# A peer (envoy-ratelimit.sh, limitador.sh): when built, started on a private Redis and asked one
# ShouldRateLimit; when not, skipped with a note (building them takes minutes, and Limitador
# needs a source tree).
peer() {
  local name="$1" bin
  case "$name" in
    envoy-ratelimit) bin=$(scripts/bench/envoy-ratelimit.sh built 2>/dev/null) ;;
    limitador) bin=$(scripts/bench/limitador.sh build 2>/dev/null) ;;
  esac || { echo "SMOKE-SKIP: $name is not built (scripts/bench/$name.sh build)"; return 0; }
  local dir redis grpc http status=0 pids=()
  dir=$(mktemp -d); redis=$(free_port); grpc=$(free_port); http=$(free_port)
  redis-server --port "$redis" --bind 127.0.0.1 --save '' --appendonly no --dir "$dir" >/dev/null 2>&1 & pids+=($!)
  if [ "$name" = envoy-ratelimit ]; then
    scripts/bench/envoy-ratelimit.sh run "$dir" "$redis" "$grpc" >"$dir/server.log" 2>&1 & pids+=($!)
  else
    SLUICE_LIMITADOR_BIN="$bin" scripts/bench/limitador.sh run "$dir" "$redis" "$grpc" "$http" >"$dir/server.log" 2>&1 & pids+=($!)
  fi
  local client answer=""
  client=$(PATH="$PATH:/usr/local/go/bin" e2e/rls-client.sh)
  for _ in $(seq 100); do
    answer=$(echo '{"op":"rls","domain":"bench","descriptors":[{"entries":[{"key":"api_key","value":"k1"}]}],"hits_addend":1}' |
      "$client" stdio -addr "127.0.0.1:$grpc" 2>/dev/null) && grep -q '"overall_code":"OK"' <<<"$answer" && break
    answer=""; sleep 0.2
  done
  [ -n "$answer" ] || { status=1; echo "$name: no OK answer in 20 s"; tail -n 20 "$dir/server.log"; }
  echo "$name: $answer"
  kill "${pids[@]}" 2>/dev/null; wait "${pids[@]}" 2>/dev/null
  rm -rf "$dir"
  return "$status"
}

export -f free_port sliding_log bench_medians peer

# --- the runs -------------------------------------------------------------------------------------
passed=() failed=() skipped=()
for entry in "${RUNS[@]}"; do
  name="${entry%%|*}" command="${entry#*|}"
  if (($#)); then
    wanted=0
    for filter in "$@"; do [[ "$name" == *"$filter"* ]] && wanted=1; done
    [ "$wanted" = 1 ] || continue
  fi
  log="$LOGS/$(basename "$name").log"
  t0=$SECONDS
  status=0
  timeout -k 10 "$TIMEOUT" bash -c "$command" </dev/null >"$log" 2>&1 || status=$?
  took=$((SECONDS - t0))
  if [ "$status" = 0 ] && grep -q 'SMOKE-SKIP: ' "$log"; then
    skipped+=("$name: $(grep -o 'SMOKE-SKIP: .*' "$log" | head -n 1 | cut -d' ' -f2-)")
    printf '  %-42s skipped  %4d s  %s\n' "$name" "$took" "$(grep -o 'SMOKE-SKIP: .*' "$log" | head -n 1)"
  elif [ "$status" = 0 ]; then
    passed+=("$name")
    printf '  %-42s ok       %4d s\n' "$name" "$took"
  else
    failed+=("$name")
    [ "$status" = 124 ] && echo "  (timed out after $TIMEOUT s)" >>"$log"
    printf '  %-42s FAILED   %4d s  (exit %s; %s)\n' "$name" "$took" "$status" "$log"
    tail -n 15 "$log" | sed 's/^/      | /'
  fi
done

for m in "${missing[@]}"; do
  failed+=("$m")
  echo "  $m"
done
echo "smoke: ${#passed[@]} passed, ${#failed[@]} failed, ${#skipped[@]} skipped (peers not built) in $((SECONDS - started)) s"
for s in "${skipped[@]}"; do echo "  skipped: $s"; done
if ((${#failed[@]})); then
  echo "smoke: FAILED: ${failed[*]} (logs in $LOGS)"
  exit 1
fi
[ -n "${SMOKE_LOGS:-}" ] || rm -rf "$LOGS"
