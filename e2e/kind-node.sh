#!/usr/bin/env bash
# kind and its node image, for a machine whose Docker engine cannot pull kindest/node.
#
#   e2e/kind-node.sh kind     build (or reuse) kind from the Go module proxy; print its path
#   e2e/kind-node.sh image    assemble (or reuse) the node image; print its reference
#
# kind is sigs.k8s.io/kind at a pinned version ($KIND_VERSION), `go install`ed and cached by version.
#
# The node image honours kind's node-image contract, the one `kind build node-image` fulfils on top
# of kind's base image, assembled here from Debian 12 packages and the binaries this project builds:
#   - the base (e2e/images/kind-base.Dockerfile): systemd as PID 1 behind kind's own entrypoint,
#     Debian's containerd, runc and CNI plugins, kind's containerd config and units, taken unchanged
#     from the kind module that boots it;
#   - kubeadm, kubelet and kubectl in /usr/bin (e2e/control-plane.sh, the same $K8S_VERSION as the
#     one-node cluster), /kind/version, and /kind/manifests/default-cni.yaml: kind's default CNI
#     manifest from that module with the kindnetd image built here;
#   - pre-loaded in the node's containerd (namespace k8s.io), under the names kubeadm and that
#     manifest ask for: kube-apiserver, kube-controller-manager, kube-scheduler, kube-proxy, etcd,
#     CoreDNS, pause and kindnetd (e2e/images/kind-images.Dockerfile). etcd is this project's etcd
#     build and CoreDNS its CoreDNS build (e2e/node.sh), whose versions may differ from the tags
#     kubeadm asks for; each image's org.sluice.version label says what is inside.
# No default-storage.yaml: kind then installs its built-in host-path StorageClass.
#
# It is tagged kindest/node:$K8S_VERSION, kind's own naming for that Kubernetes version, and
# passed to kind with --image (SLUICE_KIND_NODE_IMAGE in e2e/kind.sh): kind's default node image
# is pinned by digest, which no local build can have. It is rebuilt when an input changes (this
# script, the Dockerfiles, the versions, kindnetd's source): its org.sluice.inputs label is their
# digest.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=e2e/node.sh
source "$HERE/node.sh"

KIND_VERSION="${SLUICE_KIND_VERSION:-v0.33.0}"
KIND_BIN="$CACHE/kind-$KIND_VERSION/kind"
NODE_REF="kindest/node:$K8S_VERSION"

klog() { echo "kind-node: $*" >&2; }
kdie() { klog "$*"; exit 1; }

kind_module() { (cd "$HERE" && go mod download -json "sigs.k8s.io/kind@$KIND_VERSION" | jq -r .Dir); }

cmd_kind() {
  if [ ! -x "$KIND_BIN" ]; then
    command -v go >/dev/null || kdie "Go is required to build kind"
    klog "building kind $KIND_VERSION (cold: about a minute)"
    mkdir -p "$(dirname "$KIND_BIN")"
    GOBIN="$(dirname "$KIND_BIN")" CGO_ENABLED=0 go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kind@$KIND_VERSION"
  fi
  echo "$KIND_BIN"
}

# The kindnetd source's digest names its build: a changed source, a new binary.
kindnetd_digest() { (cd "$HERE/kind/kindnetd" && find . -type f | sort | xargs sha256sum | sha256sum | cut -c1-12); }

build_kindnetd() {
  local out; out="$CACHE/kindnetd-$(kindnetd_digest)/kindnetd"
  if [ ! -x "$out" ]; then
    klog "building kindnetd (e2e/kind/kindnetd)"
    mkdir -p "$(dirname "$out")"
    (cd "$HERE/kind/kindnetd" && CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$out.tmp" ./cmd/kindnetd)
    mv "$out.tmp" "$out"
  fi
  echo "$out"
}

inputs_digest() {
  {
    echo "$KIND_VERSION $K8S_VERSION $COREDNS_VERSION $ETCD_VERSION $(kindnetd_digest)"
    cat "${BASH_SOURCE[0]}" "$HERE/images/kind-base.Dockerfile" "$HERE/images/kind-images.Dockerfile" \
      "$HERE/images/kind-node.Dockerfile"
    docker image inspect -f '{{.Id}}' debian:bookworm-slim gcr.io/distroless/cc-debian12:nonroot
  } | sha256sum | cut -c1-16
}

# target_for REF: the kind-images.Dockerfile target (and component) that makes REF.
target_for() {
  case "$1" in
    */kube-proxy:*) echo "kube-proxy" ;;
    */kube-apiserver:*|*/kube-controller-manager:*|*/kube-scheduler:*)
      local name="${1##*/}"; echo "component ${name%%:*}" ;;
    */etcd:*) echo "component etcd" ;;
    */coredns:*) echo "coredns" ;;
    */pause:*) echo "pause" ;;
    */kindnetd:*) echo "kindnetd" ;;
    *) return 1 ;;
  esac
}

cmd_image() {
  command -v docker >/dev/null || kdie "docker is required"
  docker info >/dev/null 2>&1 || kdie "no Docker engine reachable (e2e/docker.sh starts one)"
  docker image inspect debian:bookworm-slim >/dev/null 2>&1 || kdie "no debian:bookworm-slim: run e2e/base-images.sh first"
  local digest; digest="$(inputs_digest)"
  if [ "$(docker image inspect -f '{{index .Config.Labels "org.sluice.inputs"}}' "$NODE_REF" 2>/dev/null)" = "$digest" ]; then
    echo "$NODE_REF"; return 0
  fi
  local start=$SECONDS
  node_build >/dev/null   # kubelet, kubeadm, kube-*, etcd, CoreDNS
  local kindnetd module
  kindnetd="$(build_kindnetd)"
  module="$(kind_module)"
  [ -d "$module/images/base/files" ] || kdie "no images/base/files in the kind module at $module"
  local work; work="$(mktemp -d -t sluice-kind-node.XXXXXX)"
  # shellcheck disable=SC2064 # the path is fixed now
  trap "rm -rf '$work'; docker rm -f 'sluice-kind-node-$digest' >/dev/null 2>&1 || true" EXIT

  klog "assembling the kind base (Debian packages + kind $KIND_VERSION's base files)"
  mkdir -p "$work/base"
  cp -R "$module/images/base/files" "$work/base/files"
  chmod -R u+w "$work/base"
  local base="sluice-kind-base:$digest"
  docker build -q -t "$base" -f "$HERE/images/kind-base.Dockerfile" "$work/base" >/dev/null

  # The images kubeadm asks for, and kindnet's under the name the manifest below gives it.
  local kindnetd_ref
  kindnetd_ref="docker.io/kindest/kindnetd:v20260312-2411fe07-$(kindnetd_digest)"
  local refs=() ref
  mapfile -t refs < <("$BIN/kubeadm" config images list --kubernetes-version "$K8S_VERSION")
  refs+=("$kindnetd_ref")
  local pause_ref="" pause_src
  mkdir -p "$work/images"
  pause_src="$(go env GOMODCACHE)/k8s.io/kubernetes@$K8S_VERSION/build/pause/linux/pause.c"
  [ -f "$pause_src" ] || kdie "no pause.c in the k8s.io/kubernetes@$K8S_VERSION module"
  cp "$pause_src" "$work/images/pause.c"
  cp "$BIN/kube-apiserver" "$BIN/kube-controller-manager" "$BIN/kube-scheduler" "$BIN/kube-proxy" \
    "$BIN/etcd" "$COREDNS_BIN" "$kindnetd" "$work/images/"
  for ref in "${refs[@]}"; do
    local spec target component="" version
    spec="$(target_for "$ref")" || kdie "no recipe for $ref (kubeadm asks for it)"
    read -r target component <<<"$spec"
    case "$target" in
      component) version="$K8S_VERSION"; [ "$component" = etcd ] && version="$ETCD_VERSION" ;;
      coredns) version="$COREDNS_VERSION" ;;
      kindnetd) version="kind@2411fe07" ;;
      *) version="$K8S_VERSION" ;;
    esac
    [ "$target" = pause ] && pause_ref="$ref"
    klog "  $ref ($version)"
    docker build -q -t "$ref" --target "$target" --label "org.sluice.version=$version" \
      --build-arg "COMPONENT=${component:-}" --build-arg "K8S_VERSION=$K8S_VERSION" \
      -f "$HERE/images/kind-images.Dockerfile" "$work/images" >/dev/null
  done
  mkdir -p "$work/node"
  docker save -o "$work/node/images.tar" "${refs[@]}"

  klog "assembling $NODE_REF"
  mkdir -p "$work/node/bin" "$work/node/kind/manifests"
  cp "$BIN/kubeadm" "$BIN/kubelet" "$BIN/kubectl" "$work/node/bin/"
  echo "$K8S_VERSION" > "$work/node/kind/version"
  # kind's default CNI manifest, a Go constant of the module, with our kindnetd image in it (kind
  # renders its {{ .PodSubnet }} at create time).
  # shellcheck disable=SC2016 # the backticks are Go's, not the shell's
  sed -n '/^const defaultCNIManifest = `/,/^`/p' "$module/pkg/build/nodeimage/const_cni.go" \
    | sed '1d;$d' | sed "s|\` + kindnetdImage + \`|$kindnetd_ref|" > "$work/node/kind/manifests/default-cni.yaml"
  grep -q "image: $kindnetd_ref" "$work/node/kind/manifests/default-cni.yaml" \
    || kdie "kind $KIND_VERSION's default CNI manifest no longer has the shape this script reads"
  docker build -q -t "sluice-kind-node-stage:$digest" --build-arg "BASE=$base" --build-arg "PAUSE_IMAGE=$pause_ref" \
    -f "$HERE/images/kind-node.Dockerfile" "$work/node" >/dev/null

  # Pre-load the images the way `kind build node-image` does: containerd started in a container of
  # the node image, `ctr images import` into the k8s.io namespace, the container committed.
  klog "pre-loading ${#refs[@]} images into the node's containerd"
  local container="sluice-kind-node-$digest"
  docker run -d --name "$container" --privileged --entrypoint sleep "sluice-kind-node-stage:$digest" infinity >/dev/null
  docker cp "$work/node/images.tar" "$container:/kind/images.tar"
  docker exec "$container" bash -euc '
    containerd >/tmp/containerd.log 2>&1 &
    for _ in $(seq 100); do ctr version >/dev/null 2>&1 && break; sleep 0.2; done
    ctr --namespace=k8s.io images import --all-platforms --no-unpack /kind/images.tar >/dev/null
    ctr --namespace=k8s.io images list -q
    kill %1; wait || true
    rm -f /kind/images.tar /tmp/containerd.log' > "$work/loaded"
  for ref in "${refs[@]}"; do
    grep -q "${ref}$" "$work/loaded" || kdie "$ref is not in the node's containerd after the import"
  done
  docker commit \
    --change 'ENTRYPOINT [ "/usr/local/bin/entrypoint", "/sbin/init" ]' --change 'CMD []' \
    --change "LABEL org.sluice.inputs=$digest" \
    "$container" "$NODE_REF" >/dev/null
  docker rm -f "$container" >/dev/null
  # The stage images are steps, not cache: only the node image (and the base images) are kept.
  docker rmi "sluice-kind-node-stage:$digest" "$base" "${refs[@]}" >/dev/null 2>&1 || true
  klog "$NODE_REF ready in $((SECONDS - start)) s ($(docker image inspect -f '{{.Size}}' "$NODE_REF" | awk '{ printf "%.0f MB", $1 / 1e6 }'))"
  echo "$NODE_REF"
}

PATH="$PATH:/usr/local/go/bin"
case "${1:-}" in
  kind) cmd_kind ;;
  image) cmd_image ;;
  *) echo "usage: $0 kind | image" >&2; exit 2 ;;
esac
