#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what the tests need (Debian packages,
# the Go-built control plane), then runs every Rust test, every benchmark and reliability script
# the docs name in its smoke mode (scripts/smoke.sh), the fuzzers briefly and the one-node
# cluster. CI (.ci/run) runs exactly this. The closing line says FAILED when anything failed.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages the tests start or drive: Redis (shared store), openssl (TLS test
# certificates and the control plane's), nginx (examples/nginx against the ext_authz mode),
# jq and curl (the control-plane build and start script); for the one-node cluster
# (e2e/local-node.sh): containerd, runc, the CNI plugins, iptables and conntrack (kube-proxy),
# busybox-static (the demo app's image), libc6-dev (the static pause binary), ca-certificates
# (the image's trust store); for kind (e2e/kind-local.sh): Debian's Docker engine (docker.io) and
# debootstrap (the Debian root file system of the base images); shellcheck for the e2e scripts;
# g++ for libFuzzer (scripts/fuzz.sh).
packages=(redis-server redis-tools openssl nginx jq curl containerd runc containernetworking-plugins
  iptables conntrack iproute2 util-linux busybox-static libc6-dev gcc g++ ca-certificates shellcheck
  docker.io debootstrap)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "==> installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  # No package's service is started by the install (docker.io's would be the system's Docker
  # engine, with its iptables changes): the tests start their own instances. policy-rc.d is
  # Debian's way to say so, removed again if it was not there.
  policy_rc=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    policy_rc=/usr/sbin/policy-rc.d
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy_rc" >/dev/null && $SUDO chmod 0755 "$policy_rc"
  fi
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
  [ -z "$policy_rc" ] || $SUDO rm -f "$policy_rc"
fi
# The debug and release builds take about 4.5 GB of target/, the Go-built control plane and node
# another 8 GB of Go caches the first time; a disk that fills up mid-build fails as a linker's bus
# error, far from its cause.
free_gb=$(df -Pk . | awk 'NR == 2 { printf "%d", $4 / 1048576 }')
echo "==> ${free_gb} GB free on $(df -P . | awk 'NR == 2 { print $6 }')"
if [ "$free_gb" -lt "${SLUICE_MIN_FREE_GB:-8}" ]; then
  echo "only ${free_gb} GB free: the build needs at least ${SLUICE_MIN_FREE_GB:-8} GB (set SLUICE_MIN_FREE_GB to change)"
  exit 1
fi
# A fresh clone builds everything once: incremental state would only take space.
if [ "${CI:-}" = true ]; then export CARGO_INCREMENTAL=0; fi

# Tests start their own servers; a packaged Redis listening on 6379 would only get in the way.
if command -v systemctl >/dev/null 2>&1; then systemctl stop redis-server nginx >/dev/null 2>&1 || true; fi

# etcd, kube-apiserver and kubectl for the operator's e2e tests, built from the Go module proxy
# once and cached outside the checkout by version (about 20 minutes the first time on 2 cores).
echo "==> control plane (cached in ${SLUICE_CACHE:-$HOME/.cache/sluice})"
PATH="$PATH:/usr/local/go/bin" e2e/control-plane.sh build

# The independent gRPC client of the rate limit service tests (tests/rls_grpc.rs), built against
# Envoy's published Go protos and cached the same way.
echo "==> rate limit service test client"
PATH="$PATH:/usr/local/go/bin" e2e/rls-client.sh >/dev/null

echo "==> generated files"
# The chart ships a copy of the CRD; `sluice crd` output itself is checked by tests/crd_generated.rs.
cmp crds/ratelimitpolicy.yaml charts/sluice/crds/ratelimitpolicy.yaml \
  || { echo "charts/sluice/crds/ratelimitpolicy.yaml differs from crds/: copy it over"; exit 1; }
# The committed render of the chart's defaults is what the templates produce.
helm="$(PATH="$PATH:/usr/local/go/bin" e2e/control-plane.sh helm)"
"$helm" lint charts/sluice --strict >/dev/null
"$helm" template sluice charts/sluice --namespace sluice-system --kube-version v1.36.3 \
  | diff -u charts/sluice/rendered/default.yaml - \
  || { echo "charts/sluice/rendered/default.yaml is stale: regenerate it (charts/sluice/README.md)"; exit 1; }

echo "==> formatting and lints"
shellcheck -x e2e/*.sh scripts/test.sh scripts/fuzz.sh scripts/smoke.sh scripts/bench/*.sh scripts/reliability/*.sh .ci/run
cargo fmt --check || { echo "cargo fmt --check failed: run cargo fmt"; exit 1; }
cargo clippy --locked --all-targets --quiet -- -D warnings

echo "==> benchmarks compile"
cargo check --locked --benches --examples --quiet

echo "==> cargo test"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
status=0
cargo_status=0
cargo test --locked --no-fail-fast -- --test-threads="${SLUICE_TEST_THREADS:-4}" 2>&1 | tee "$log" || cargo_status=$?
status=$cargo_status
# Every benchmark and reliability script the docs name, for a second or two each (tiny loads,
# peers that are not built skipped with a note), so that a script that no longer works against
# this code fails here instead of printing numbers (scripts/smoke.sh).
echo "==> scripts (smoke)"
smoke_start=$SECONDS smoke_status=0
# (Not into $log: the closing line counts the cargo tests' own results.)
scripts/smoke.sh 2>&1 || smoke_status=$?
smoke_took=$((SECONDS - smoke_start))
if [ "$smoke_status" -eq 0 ]; then smoke_result="passed"; else smoke_result="FAILED"; status=$smoke_status; fi
# Every parser of outside input under libFuzzer for a few seconds each (scripts/fuzz.sh runs
# longer); a crash fails the run with its input saved.
echo "==> fuzzing (short)"
fuzz_status=0
SECONDS_EACH="${SLUICE_FUZZ_SECONDS:-5}" scripts/fuzz.sh 2>&1 | tee -a "$log" || fuzz_status=$?
if [ "$fuzz_status" -ne 0 ]; then status=$fuzz_status; fi
# The install path without Docker on a real one-node cluster: release image, helm install,
# webhooks, the injected sidecar enforcing in both redirect modes, uninstall (docs/operator.md,
# "The one-node cluster"). kind, next, runs the whole flow; the steps only it would repeat (Jobs,
# drain, failover, upgrade, the Rust suite) are left to it: e2e/local-node.sh alone runs them all.
echo "==> real node: e2e/local-node.sh"
node_start=$SECONDS node_status=0
SLUICE_NODE_STEPS="install verify iptables uninstall" e2e/local-node.sh 2>&1 | tee -a "$log" || node_status=$?
if [ "$node_status" -eq 0 ]; then node_result="passed"; else node_result="FAILED"; status=$node_status; fi
node_took=$((SECONDS - node_start))
# The users' own workflow: the image built from the Dockerfile by a Docker engine, a kind cluster
# booted from a node image, e2e/kind.sh unchanged (e2e/kind-local.sh assembles what no registry
# here serves, then checks the host is left as it was; docs/operator.md, "kind").
echo "==> kind: e2e/kind-local.sh"
kind_start=$SECONDS kind_status=0
e2e/kind-local.sh 2>&1 | tee -a "$log" || kind_status=$?
if [ "$kind_status" -eq 0 ]; then kind_result="passed"; else kind_result="FAILED"; status=$kind_status; fi
# One closing line for the whole run (cargo's last line is the doc-tests', which has none).
echo "sluice: kind flow $kind_result in $((SECONDS - kind_start)) s"
echo "sluice: real-node flow $node_result in $node_took s"
echo "sluice: scripts smoke $smoke_result in $smoke_took s"
# The tests' counts come from cargo's "test result:" lines; a test binary that died (a panic while
# panicking aborts it, a signal, a timeout) prints none, so its tests are in no count: cargo's
# "process didn't exit successfully: … (signal: …)" lines name them, and cargo's own status says
# the run failed. The line says FAILED whenever anything did, whatever the counts.
# (No such line is the usual case: grep's status 1 must not end the script under set -e.)
aborted=$(grep "process didn't exit successfully: .*(signal: " "$log" | grep -oE '/[^ ]+/deps/[A-Za-z0-9_-]+' |
  sed 's|.*/||; s/-[0-9a-f]*$//' | sort -u | paste -sd, - || true)
awk -v status="$status" -v cargo="$cargo_status" -v aborted="$aborted" '
  /^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i; if ($(i+1) ~ /^ignored/) s += $i } }
  END {
    line = sprintf("%d passed, %d failed, %d skipped", p, f, s)
    if (aborted != "") line = line sprintf("; test binaries without a result (aborted): %s", aborted)
    if (cargo != 0 && f == 0 && aborted == "") line = line sprintf("; cargo test exited %d", cargo)
    printf "sluice: %s%s\n", (status != 0 ? "FAILED: " : ""), line
  }' "$log"
exit "$status"
