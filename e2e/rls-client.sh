#!/usr/bin/env bash
# Builds (or reuses) e2e/rls-client, the Go client that drives an Envoy gRPC rate limit service
# (envoy.service.ratelimit.v3 + grpc.health.v1) with Envoy's own published protos, and prints the
# binary's path on stdout; logs go to stderr.
#
#   e2e/rls-client.sh        print the path of a built rls-client (building it first if needed)
#
# The binary is cached OUTSIDE the checkout, keyed by its sources, in
# ${SLUICE_CACHE:-$HOME/.cache/sluice}/rls-client-<first 12 hex of sha256 over go.mod go.sum main.go>/
# so an edit to any of them rebuilds and an unchanged tree never does. Modules come from the Go
# module proxy into Go's own GOMODCACHE; -mod=readonly makes a go.sum that is missing an entry an
# error instead of a silent edit of the checkout.
set -euo pipefail

SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")/rls-client" && pwd)"
CACHE="${SLUICE_CACHE:-$HOME/.cache/sluice}"

log() { echo "rls-client: $*" >&2; }

command -v go >/dev/null || { log "Go is required to build rls-client"; exit 1; }
command -v sha256sum >/dev/null || { log "sha256sum is required (coreutils)"; exit 1; }

key="$(cd "$SRC" && cat go.mod go.sum main.go | sha256sum)"
key="${key:0:12}"
dir="$CACHE/rls-client-$key"
bin="$dir/rls-client"

if [ ! -x "$bin" ]; then
  log "building into $dir"
  mkdir -p "$dir"
  start=$SECONDS
  # Build to a temporary name and rename: a concurrent caller never sees a half-written binary.
  tmp="$(mktemp "$dir/rls-client.XXXXXX")"
  trap 'rm -f "$tmp"' EXIT
  (cd "$SRC" && CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false" go build -trimpath -o "$tmp" .)
  mv "$tmp" "$bin"
  trap - EXIT
  log "built in $((SECONDS - start)) s"
fi
echo "$bin"
