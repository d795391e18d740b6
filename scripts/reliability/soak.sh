#!/usr/bin/env bash
# The soak (issue 25): tests/soak.rs on the release build for SOAK_SECONDS (1800): 200 checks/s
# on the check API and 100 requests/s through the sidecar, on Redis, keys rotating. Prints
# latency per interval and the endpoint's and sidecar's memory and open files over time; fails
# if memory leaves its band (+25% + 8 MiB after the first fifth) or open files grow by more
# than 16. The test command runs the same test for 60 s.
#
#   scripts/reliability/soak.sh
#   SOAK_SECONDS=300 scripts/reliability/soak.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
uptime
SLUICE_SOAK_SECONDS="${SOAK_SECONDS:-1800}" cargo test --release --test soak -- --nocapture 2>&1 | grep -E '^soak:|test result|panicked'
uptime
