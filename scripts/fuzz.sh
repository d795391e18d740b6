#!/usr/bin/env bash
# Fuzzes everything Sluice parses from outside (issue 25): the check API's JSON body, path
# normalization, policy YAML through validate and compile, release leases, simulate trace
# files and traffic patterns, the Host a request names, static token files, response bodies read
# for their cost, Envoy rate limit service requests (domain, descriptors, hits_addend), and the
# head of a request the sidecar receives. cargo fuzz (libFuzzer) on the nightly toolchain; the
# targets are in scripts/fuzz/fuzz_targets/, each asserting what must hold besides "no panic".
#
#   scripts/fuzz.sh                 # every target for SECONDS_EACH (60) seconds
#   SECONDS_EACH=5 scripts/fuzz.sh  # the test command's short run
#   scripts/fuzz.sh path_normalize  # one target
#
# A crash stops the run with the input saved under scripts/fuzz/artifacts/<target>/: turn it
# into a regression test next to the code it broke. The corpus grows under
# $SLUICE_CACHE/fuzz-corpus (outside the checkout), so later runs start from what earlier ones
# found. Prints, per target, the inputs tried and the corpus size.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SECONDS_EACH="${SECONDS_EACH:-60}"
CACHE="${SLUICE_CACHE:-$HOME/.cache/sluice}"
FUZZ_DIR="$ROOT/scripts/fuzz"
TARGETS=(check_request path_normalize policy_yaml lease_token trace_file request_host token_file usage_meter
    rls_descriptors simulate_pattern sidecar_request_head)
if (($#)); then TARGETS=("$@"); fi

command -v cargo >/dev/null || { echo "fuzz: cargo not found" >&2; exit 1; }
rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    echo "fuzz: installing cargo-fuzz" >&2
    cargo install cargo-fuzz --locked --quiet
fi
# The fuzz build has its own target directory, kept outside the checkout between runs.
export CARGO_TARGET_DIR="$CACHE/fuzz-target"
cd "$ROOT"
cargo +nightly fuzz build --fuzz-dir "$FUZZ_DIR" -O >&2
for target in "${TARGETS[@]}"; do
    corpus="$CACHE/fuzz-corpus/$target"
    mkdir -p "$corpus"
    log="$(mktemp)"
    if ! cargo +nightly fuzz run --fuzz-dir "$FUZZ_DIR" -O "$target" "$corpus" -- \
        -max_total_time="$SECONDS_EACH" -max_len=65536 -rss_limit_mb=2048 -timeout=10 >"$log" 2>&1; then
        tail -40 "$log" >&2
        echo "fuzz: $target FAILED (the input is under scripts/fuzz/artifacts/$target/)" >&2
        exit 1
    fi
    runs="$(grep -oE 'Done [0-9]+ runs' "$log" | grep -oE '[0-9]+' | tail -1)"
    echo "fuzz: $target: ${runs:-?} inputs in ${SECONDS_EACH}s, no crash; corpus $(find "$corpus" -type f | wc -l) inputs"
    rm -f "$log"
done
