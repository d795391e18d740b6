#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what the tests need (Debian packages,
# the Go-built control plane once that lands), then runs every Rust test. CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages the tests start or drive: Redis (shared store), openssl (TLS test certificates).
packages=(redis-server redis-tools openssl)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "==> installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
# Tests start their own servers; a packaged Redis listening on 6379 would only get in the way.
if command -v systemctl >/dev/null 2>&1; then systemctl stop redis-server >/dev/null 2>&1 || true; fi

echo "==> cargo test"
cargo test --locked --all-features -- --test-threads="${SLUICE_TEST_THREADS:-4}"
