#!/usr/bin/env bash
# Kuadrant/Limitador (limitador-server), another implementation of Envoy's gRPC rate limit service,
# as a peer for Sluice's gRPC benchmarks: built from a source tree, run on 127.0.0.1 against a
# local Redis, driven by e2e/rls-client.
#
#   scripts/bench/limitador.sh build [SRC]      build (or reuse); print the binary
#   scripts/bench/limitador.sh run DIR REDIS_PORT GRPC_PORT HTTP_PORT [redis|redis_cached [ARGS...]]
#                                               write the bench limits into DIR and exec the server
#                                               on 127.0.0.1 (foreground); ARGS go to the storage
#                                               subcommand, e.g. redis_cached --flush-period 100
#
# Source: the script does not fetch; it builds a Kuadrant/limitador source tree given to it. The
# one benchmarked is a GitHub snapshot of main at 2981b2bd389d42cf668519f9aa981a53541c4278
# (2026-05-07, "Merge pull request #486", limitador-server 2.4.0-dev), exported with `git archive`;
# `git clone https://github.com/Kuadrant/limitador && git -C limitador checkout 2981b2bd389d` gives
# the same tree (that snapshot lacked the blob of the top-level default.profraw, a stray coverage
# profile nothing reads; the tree builds without it). SRC (or SLUICE_LIMITADOR_SRC) is that tree;
# it is copied to a temp dir and never modified. The commit is read from SRC when it is a git
# checkout, else it is SLUICE_LIMITADOR_COMMIT (default: the one above). The binary is cached
# OUTSIDE the checkout in
# ${SLUICE_CACHE:-$HOME/.cache/sluice}/limitador-<commit12>/limitador-server.
#
# Build: `cargo build --release -p limitador-server --locked --no-default-features` (upstream's
# release profile: fat LTO, codegen-units 1), i.e. Redis and memory storage only, without the
# `disk` storage and so without RocksDB's C++ (librocksdb-sys). Upstream cannot build that way
# as is: limitador-server enables limitador's default features (disk_storage, redis_storage)
# unconditionally and uses the disk storage without a cfg, and limitador itself does not compile
# with redis_storage alone (storage::keys::bin, which the Redis keys use, is gated on
# disk_storage). The patch below, applied to the copy, fixes both: a `disk_storage` feature on
# limitador-server (default on, so upstream's default build is unchanged) and the two cfgs
# removed in limitador; `disk` then exits with an error. OpenSSL is still built from source
# (openssl "vendored"); protoc is needed (Debian protobuf-compiler). Cold: about 10 minutes on
# 2 cores with CARGO_BUILD_JOBS=1 under nice, ~0.9 GB of target dir. CARGO_TARGET_DIR is honoured
# (kept); without it a temp target dir is used and deleted.
#
# What `run` amounts to, by hand (ports are examples):
#
#   redis-server --bind 127.0.0.1 --port 26379 --save '' --appendonly no --dir "$DIR"
#   limitador-server --rls-ip 127.0.0.1 --rls-port 28081 --http-ip 127.0.0.1 --http-port 28080 \
#     "$DIR/limits.yaml" redis redis://127.0.0.1:26379
#   # or, with counters cached in the server and flushed to Redis in batches (every
#   # --flush-period ms, default 1000; accuracy traded for fewer Redis calls):
#   limitador-server ... "$DIR/limits.yaml" redis_cached redis://127.0.0.1:26379
#
#   B="$(e2e/rls-client.sh)"
#   echo '{"op":"rls","domain":"bench","descriptors":[{"entries":[{"key":"api_key","value":"k1"}]}],"hits_addend":1}' \
#     | "$B" stdio -addr 127.0.0.1:28081
#   curl -s http://127.0.0.1:28080/status          # no grpc.health.v1 service: HTTP /status
#   "$B" bench -addr 127.0.0.1:28081 -domain bench -descriptors 3 -duration 3s -warmup 1s
#
# The limits (namespace = the request's domain, `bench`): one limit per descriptor key, api_key,
# remote_address and path, each 100000 per 1 second and counted per value (`variables`), the same
# shape as envoy-ratelimit.sh's bench config and rls-load.sh's Sluice policies.
# SLUICE_LIMITADOR_MAX_VALUE overrides the 100000 (e.g. 2, to see it deny). Limitador's limits
# address descriptors by position in CEL, and e2e/rls-client bench sends api_key, remote_address
# and path as descriptors 0, 1 and 2 (one entry each; -descriptors 1 sends only the first), so:
#   api_key:        conditions []                         variables [descriptors[0].api_key]
#   remote_address: conditions ["size(descriptors) > 1"]  variables [descriptors[1].remote_address]
#   path:           conditions ["size(descriptors) > 2"]  variables [descriptors[2].path]
# (the size guards: past the end, descriptors[i] is an evaluation error, IndexOutOfBounds, and the
# call fails with UNAVAILABLE instead of the limit not applying). This
# matches the bench's requests exactly, but unlike the other two servers' configs it does not
# match a key at another position. A position-independent form,
#   conditions ["descriptors.exists(d, 'api_key' in d)"]
#   variables  ["descriptors.filter(d, 'api_key' in d)[0].api_key"],
# validates but matched nothing at 2981b2bd389d (not one Redis command): Limitador applies a
# limit only if every variable its expressions reference is bound in the request's context, and
# counts the comprehension's `d` among them.
set -euo pipefail

DEFAULT_COMMIT=2981b2bd389d42cf668519f9aa981a53541c4278
CACHE="${SLUICE_CACHE:-$HOME/.cache/sluice}"

log() { echo "limitador: $*" >&2; }

bin_for() { echo "$CACHE/limitador-${1:0:12}/limitador-server"; }

cmd_build() {
  local src="${1:-${SLUICE_LIMITADOR_SRC:-}}" commit bin
  if [ -z "$src" ]; then
    # No source: reuse the cached build of the pinned commit, if any.
    commit="${SLUICE_LIMITADOR_COMMIT:-$DEFAULT_COMMIT}"
    bin="$(bin_for "$commit")"
    [ -x "$bin" ] || { log "no cached $bin; pass a Kuadrant/limitador source tree (SRC or SLUICE_LIMITADOR_SRC)"; exit 1; }
    echo "$bin"; return
  fi
  [ -f "$src/limitador-server/Cargo.toml" ] || { log "$src is not a Kuadrant/limitador tree"; exit 1; }
  if commit="$(git -C "$src" rev-parse HEAD 2>/dev/null)" && [ -n "$commit" ] &&
      [ -f "$(git -C "$src" rev-parse --show-toplevel)/limitador-server/Cargo.toml" ]; then
    :
  else
    commit="${SLUICE_LIMITADOR_COMMIT:-$DEFAULT_COMMIT}"
  fi
  bin="$(bin_for "$commit")"
  if [ ! -x "$bin" ]; then
    command -v cargo >/dev/null || { log "cargo is required to build limitador-server"; exit 1; }
    command -v protoc >/dev/null || { log "protoc is required (Debian package protobuf-compiler)"; exit 1; }
    local work start=$SECONDS target
    work="$(mktemp -d -t limitador-build.XXXXXX)"
    # shellcheck disable=SC2064 # expand now: $work is local
    trap "rm -rf '$work'" EXIT
    log "building limitador-server at ${commit:0:12} (Redis and memory storage, no RocksDB; cold: ~10 minutes on 2 cores)"
    tar -C "$src" --exclude=./target --exclude=./.git -cf - . | tar -C "$work" -xf -
    patch_redis_only | patch -d "$work" -p1 --quiet --forward
    target="${CARGO_TARGET_DIR:-$work/target}"
    (cd "$work" && CARGO_TARGET_DIR="$target" cargo build --release -p limitador-server --locked \
      --no-default-features)
    mkdir -p "$(dirname "$bin")"
    cp "$target/release/limitador-server" "$bin.tmp" && mv "$bin.tmp" "$bin"
    log "built in $((SECONDS - start)) s"
  fi
  echo "$bin"
}

# Against 2981b2bd389d; see the header.
patch_redis_only() {
  cat <<'EOF'
--- a/limitador-server/Cargo.toml
+++ b/limitador-server/Cargo.toml
@@ -13,12 +13,14 @@ readme = "README.md"
 edition = "2021"
 
 [features]
+default = ["disk_storage"]
+disk_storage = ["limitador/disk_storage"]
 distributed_storage = ["limitador/distributed_storage"]
 
 # See more keys and their definitions at https://doc.rust-lang.org/cargo/reference/manifest.html
 
 [dependencies]
-limitador = { path = "../limitador" }
+limitador = { path = "../limitador", default-features = false, features = ["redis_storage"] }
 tokio = { version = "1", features = ["full"] }
 thiserror = "2"
 tonic = "0.14"
--- a/limitador-server/src/config.rs
+++ b/limitador-server/src/config.rs
@@ -170,6 +170,7 @@ impl Default for Configuration {
 #[derive(PartialEq, Eq, Debug)]
 pub enum StorageConfiguration {
     InMemory(InMemoryStorageConfiguration),
+    #[cfg(feature = "disk_storage")]
     Disk(DiskStorageConfiguration),
     Redis(RedisStorageConfiguration),
     #[cfg(feature = "distributed_storage")]
@@ -191,6 +192,7 @@ pub struct DistributedStorageConfiguration {
 }
 
 #[derive(PartialEq, Eq, Debug)]
+#[cfg(feature = "disk_storage")]
 pub struct DiskStorageConfiguration {
     pub path: String,
     pub optimization: storage::disk::OptimizeFor,
--- a/limitador-server/src/main.rs
+++ b/limitador-server/src/main.rs
@@ -9,9 +9,11 @@ extern crate tonic_middleware;
 #[cfg(feature = "distributed_storage")]
 use crate::config::DistributedStorageConfiguration;
 use crate::config::{
-    redacted_url, Configuration, DiskStorageConfiguration, InMemoryStorageConfiguration,
+    redacted_url, Configuration, InMemoryStorageConfiguration,
     RedisStorageCacheConfiguration, RedisStorageConfiguration, StorageConfiguration,
 };
+#[cfg(feature = "disk_storage")]
+use crate::config::DiskStorageConfiguration;
 use crate::envoy_rls::server::{run_envoy_rls_server, RateLimitHeaders};
 use crate::http_api::server::run_http_server;
 use crate::metrics::MetricsLayer;
@@ -24,6 +26,7 @@ use const_format::formatcp;
 use limitador::counter::Counter;
 use limitador::errors::LimitadorError;
 use limitador::limit::{Expression, Limit};
+#[cfg(feature = "disk_storage")]
 use limitador::storage::disk::DiskStorage;
 use limitador::storage::redis::{
     AsyncRedisStorage, CachedRedisStorage, CachedRedisStorageBuilder, DEFAULT_BATCH_SIZE,
@@ -97,6 +100,7 @@ impl Limiter {
             StorageConfiguration::InMemory(cfg) => Self::in_memory_limiter(cfg),
             #[cfg(feature = "distributed_storage")]
             StorageConfiguration::Distributed(cfg) => Self::distributed_limiter(cfg),
+            #[cfg(feature = "disk_storage")]
             StorageConfiguration::Disk(cfg) => Self::disk_limiter(cfg),
         };
 
@@ -149,6 +153,7 @@ impl Limiter {
         })
     }
 
+    #[cfg(feature = "disk_storage")]
     fn disk_limiter(cfg: DiskStorageConfiguration) -> Self {
         let storage = match DiskStorage::open(cfg.path.as_str(), cfg.optimization) {
             Ok(storage) => storage,
@@ -767,6 +772,12 @@ fn create_config() -> (Configuration, &'static str) {
             url: sub.get_one::<String>("URL").unwrap().to_owned(),
             cache: None,
         }),
+        #[cfg(not(feature = "disk_storage"))]
+        Some(("disk", _)) => {
+            eprintln!("This limitador-server was built without the disk_storage feature");
+            process::exit(1)
+        }
+        #[cfg(feature = "disk_storage")]
         Some(("disk", sub)) => StorageConfiguration::Disk(DiskStorageConfiguration {
             path: sub
                 .get_one::<String>("PATH")
--- a/limitador/src/counter.rs
+++ b/limitador/src/counter.rs
@@ -109,7 +109,6 @@ impl Counter {
         !self.set_variables.is_empty()
     }
 
-    #[cfg(feature = "disk_storage")]
     pub(crate) fn variables_for_key(&self) -> Vec<(&str, &str)> {
         let mut variables = Vec::with_capacity(self.set_variables.len());
         for (var, value) in &self.set_variables {
--- a/limitador/src/storage/keys.rs
+++ b/limitador/src/storage/keys.rs
@@ -184,7 +184,6 @@ mod tests {
     }
 }
 
-#[cfg(feature = "disk_storage")]
 pub mod bin {
     use serde::{Deserialize, Serialize};
     use std::collections::HashMap;
EOF
}

write_limits() { # FILE
  local max="${SLUICE_LIMITADOR_MAX_VALUE:-100000}" i=0 key cond
  : > "$1"
  for key in api_key remote_address path; do
    if [ "$i" = 0 ]; then cond=""; else cond="\"size(descriptors) > $i\""; fi
    cat >> "$1" <<EOF
- namespace: bench
  name: per-${key//_/-}
  max_value: $max
  seconds: 1
  conditions: [$cond]
  variables: ["descriptors[$i].$key"]
EOF
    i=$((i + 1))
  done
}

cmd_run() {
  local dir="$1" redis_port="$2" grpc_port="$3" http_port="$4" storage="${5:-redis}" bin
  shift $(($# < 5 ? $# : 5))
  case "$storage" in redis | redis_cached) ;; *) log "storage must be redis or redis_cached"; exit 2 ;; esac
  bin="${SLUICE_LIMITADOR_BIN:-$(cmd_build)}"
  mkdir -p "$dir" && dir="$(cd "$dir" && pwd)"
  write_limits "$dir/limits.yaml"
  "$bin" --validate "$dir/limits.yaml" >/dev/null || { log "limits.yaml does not validate"; exit 1; }
  log "grpc 127.0.0.1:$grpc_port, http 127.0.0.1:$http_port, $storage redis://127.0.0.1:$redis_port $*"
  exec "$bin" --rls-ip 127.0.0.1 --rls-port "$grpc_port" --http-ip 127.0.0.1 --http-port "$http_port" \
    "$dir/limits.yaml" "$storage" "redis://127.0.0.1:$redis_port" "$@"
}

case "${1:-}" in
  build) [ $# -le 2 ] || { echo "usage: $0 build [SRC]" >&2; exit 2; }; shift; cmd_build "$@" ;;
  run) [ $# -ge 5 ] || { echo "usage: $0 run DIR REDIS_PORT GRPC_PORT HTTP_PORT [redis|redis_cached [ARGS...]]" >&2; exit 2; }
    shift; cmd_run "$@" ;;
  *) echo "usage: $0 build [SRC] | run DIR REDIS_PORT GRPC_PORT HTTP_PORT [redis|redis_cached [ARGS...]]" >&2; exit 2 ;;
esac
