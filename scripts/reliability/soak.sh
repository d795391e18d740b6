#!/usr/bin/env bash
# The soak (issue 25): tests/soak.rs on the release build for SOAK_SECONDS (1800): 200 checks/s
# on the check API and 100 requests/s through the sidecar, on Redis, keys rotating. Prints
# latency per interval and the endpoint's and sidecar's memory and open files over time; fails
# if memory leaves its band (+25% + 8 MiB after the first fifth) or open files grow by more
# than 16. The test command runs the same test for 60 s.
#
#   scripts/reliability/soak.sh
#   SOAK_SECONDS=300 scripts/reliability/soak.sh
#
# SMOKE=1 (the test command's check that the script works): 15 s on the debug build (the band
# is measured from the first fifth: shorter, it starts before the connection pools are made), which the
# test command's cargo test phase has built already (a release build of the tests would take
# minutes). PROFILE=debug does the same for any length.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
if [ "${SMOKE:-0}" = 1 ]; then SOAK_SECONDS="${SOAK_SECONDS:-15}" PROFILE="${PROFILE:-debug}"; fi
release=(--release)
[ "${PROFILE:-release}" = release ] || release=()
uptime
# The test's own verdict is the script's: cargo's status, and its summary line must be there.
out="$(mktemp)"
trap 'rm -f "$out"' EXIT
status=0
SLUICE_SOAK_SECONDS="${SOAK_SECONDS:-1800}" cargo test --locked "${release[@]}" --test soak -- --nocapture >"$out" 2>&1 || status=$?
grep -E '^soak:|test result|panicked' "$out" || true
uptime
if [ "$status" != 0 ] || ! grep -q '^test result: ok. 1 passed' "$out"; then
    tail -n 30 "$out" >&2
    echo "FAILED: the soak test (cargo test exited $status)" >&2
    exit 1
fi
