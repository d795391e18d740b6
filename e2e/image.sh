#!/usr/bin/env bash
# OCI image tarballs without Docker or a registry, for the one-node cluster (e2e/node.sh), which
# imports them into its containerd with `ctr images import`.
#
#   e2e/image.sh sluice BINARY REF OUT.tar   what the Dockerfile's runtime stage provides: the binary
#                                           at /usr/local/bin/sluice, the shared libraries it links,
#                                           CA certificates, user 65532, entrypoint `sluice`, and
#                                           Debian's iptables (nft and legacy, IPv4 and IPv6
#                                           restore/save, in /usr/sbin) for `sluice redirect`, the
#                                           init container of the sidecar's iptables mode
#   e2e/image.sh pause REF OUT.tar           Kubernetes' pause.c (from the k8s.io/kubernetes module
#                                           source), compiled static: the pod sandbox
#   e2e/image.sh busybox REF OUT.tar         Debian's busybox-static: the demo's upstream app
#   e2e/image.sh static BINARY REF OUT.tar   one static binary as /BINARY-NAME, its entrypoint
#                                           (CoreDNS)
#
# REF is a full reference (docker.io/library/sluice:node-e2e): containerd stores the image under
# that name, the name a pod spec's `image: sluice:node-e2e` normalizes to. Layers are written
# with sorted names, numeric owners and mtime 0, so the same inputs give the same digests.
set -euo pipefail

log() { echo "image: $*" >&2; }
die() { log "$*"; exit 1; }

WORK="$(mktemp -d -t sluice-image.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
ROOTFS="$WORK/rootfs"
mkdir -p "$ROOTFS"

sha() { sha256sum "$1" | cut -d' ' -f1; }
# A static executable has no loader for ldd to ask.
is_static() { ! ldd "$1" >/dev/null 2>&1; }

# copy_libraries FILE...: the shared libraries the files link (what distroless/cc carries and
# more), taken from this (the build) machine, at the paths the loader looks them up.
copy_libraries() {
  local lib
  while read -r lib; do
    [ -f "$ROOTFS$lib" ] || install -D -m 0755 "$(readlink -f "$lib")" "$ROOTFS$lib"
  done < <(for file in "$@"; do ldd "$file"; done | grep -o '/[^ ]*' | sort -u)
}

# Debian's iptables (package iptables), for `sluice redirect`: the two multi-call binaries, the
# restore/save names they dispatch on (argv[0]), as symlinks the way the package installs them,
# the extensions they dlopen at run time (the tcp match, the REDIRECT target) and every library
# those link.
IPTABLES_NAMES=(iptables-nft-restore iptables-nft-save ip6tables-nft-restore ip6tables-nft-save
  iptables-legacy-restore iptables-legacy-save ip6tables-legacy-restore ip6tables-legacy-save)
XTABLES_EXTENSIONS=/usr/lib/x86_64-linux-gnu/xtables
copy_iptables() {
  local multi name
  for multi in xtables-nft-multi xtables-legacy-multi; do
    [ -x "/usr/sbin/$multi" ] || die "no /usr/sbin/$multi (Debian package iptables)"
    install -D -m 0755 "/usr/sbin/$multi" "$ROOTFS/usr/sbin/$multi"
  done
  for name in "${IPTABLES_NAMES[@]}"; do
    case "$name" in
      *-nft-*) ln -s xtables-nft-multi "$ROOTFS/usr/sbin/$name" ;;
      *) ln -s xtables-legacy-multi "$ROOTFS/usr/sbin/$name" ;;
    esac
  done
  [ -d "$XTABLES_EXTENSIONS" ] || die "no $XTABLES_EXTENSIONS (Debian package iptables)"
  mkdir -p "$ROOTFS$XTABLES_EXTENSIONS"
  # -P: the extensions' symlinks (libxt_REDIRECT.so among them) stay symlinks.
  cp -RP "$XTABLES_EXTENSIONS/." "$ROOTFS$XTABLES_EXTENSIONS/"
  copy_libraries /usr/sbin/xtables-nft-multi /usr/sbin/xtables-legacy-multi "$XTABLES_EXTENSIONS"/*.so
}

# write_image REF OUT CONFIG_JSON: ROOTFS as one layer, CONFIG_JSON as the image's runtime config.
write_image() {
  local ref="$1" out="$2" runtime_config="$3"
  local layout="$WORK/layout" blobs="$WORK/layout/blobs/sha256"
  mkdir -p "$blobs"
  tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$ROOTFS" -cf "$WORK/layer.tar" .
  local diff_id; diff_id="$(sha "$WORK/layer.tar")"
  # gzip -n: no name or timestamp in the header, so the digest depends on the content only.
  gzip -n -c "$WORK/layer.tar" > "$WORK/layer.tar.gz"
  local layer_digest layer_size
  layer_digest="$(sha "$WORK/layer.tar.gz")"; layer_size="$(stat -c %s "$WORK/layer.tar.gz")"
  mv "$WORK/layer.tar.gz" "$blobs/$layer_digest"

  jq -cn --argjson runtime "$runtime_config" --arg diff "sha256:$diff_id" --arg ref "$ref" '{
      architecture: "amd64", os: "linux", created: "1970-01-01T00:00:00Z", config: $runtime,
      rootfs: {type: "layers", diff_ids: [$diff]},
      history: [{created: "1970-01-01T00:00:00Z", created_by: ("e2e/image.sh " + $ref)}]
    }' > "$WORK/config.json"
  local config_digest config_size
  config_digest="$(sha "$WORK/config.json")"; config_size="$(stat -c %s "$WORK/config.json")"
  mv "$WORK/config.json" "$blobs/$config_digest"

  jq -cn --arg cd "sha256:$config_digest" --argjson cs "$config_size" \
      --arg ld "sha256:$layer_digest" --argjson ls "$layer_size" '{
      schemaVersion: 2, mediaType: "application/vnd.oci.image.manifest.v1+json",
      config: {mediaType: "application/vnd.oci.image.config.v1+json", digest: $cd, size: $cs},
      layers: [{mediaType: "application/vnd.oci.image.layer.v1.tar+gzip", digest: $ld, size: $ls}]
    }' > "$WORK/manifest.json"
  local manifest_digest manifest_size
  manifest_digest="$(sha "$WORK/manifest.json")"; manifest_size="$(stat -c %s "$WORK/manifest.json")"
  mv "$WORK/manifest.json" "$blobs/$manifest_digest"

  # io.containerd.image.name is the full name `ctr images import` stores; ref.name is the OCI
  # layout's own (the tag).
  jq -cn --arg md "sha256:$manifest_digest" --argjson ms "$manifest_size" --arg ref "$ref" '{
      schemaVersion: 2,
      manifests: [{mediaType: "application/vnd.oci.image.manifest.v1+json", digest: $md, size: $ms,
        platform: {architecture: "amd64", os: "linux"},
        annotations: {"io.containerd.image.name": $ref,
                      "org.opencontainers.image.ref.name": ($ref | split(":") | last)}}]
    }' > "$layout/index.json"
  echo '{"imageLayoutVersion":"1.0.0"}' > "$layout/oci-layout"
  mkdir -p "$(dirname "$out")"
  tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$layout" \
    -cf "$out.tmp" oci-layout index.json blobs
  mv "$out.tmp" "$out"
  log "$ref -> $out (layer $(numfmt --to=iec "$layer_size"))"
}

# The users the Dockerfile's base (distroless :nonroot) has.
write_users() {
  mkdir -p "$ROOTFS/etc" "$ROOTFS/home/nonroot" "$ROOTFS/tmp"
  chmod 1777 "$ROOTFS/tmp"
  printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' \
    > "$ROOTFS/etc/passwd"
  printf 'root:x:0:\nnonroot:x:65532:\n' > "$ROOTFS/etc/group"
  chown 65532:65532 "$ROOTFS/home/nonroot"
}

image_sluice() {
  local binary="$1" ref="$2" out="$3"
  [ -x "$binary" ] || die "no executable at $binary"
  # Without the debug info the release profile keeps for profiling, as the Dockerfile's build.
  mkdir -p "$ROOTFS/usr/local/bin"
  strip --strip-debug -o "$ROOTFS/usr/local/bin/sluice" "$binary"
  chmod 0755 "$ROOTFS/usr/local/bin/sluice"
  # The runtime libraries distroless/cc carries: exactly what the binary links.
  copy_libraries "$binary"
  copy_iptables
  [ -f /etc/ssl/certs/ca-certificates.crt ] || die "no /etc/ssl/certs/ca-certificates.crt (Debian package ca-certificates)"
  install -D -m 0644 /etc/ssl/certs/ca-certificates.crt "$ROOTFS/etc/ssl/certs/ca-certificates.crt"
  printf 'hosts: files dns\n' > "$ROOTFS/etc/nsswitch.conf"
  write_users
  write_image "$ref" "$out" '{
      "User": "65532:65532", "Entrypoint": ["sluice"], "Cmd": ["--help"],
      "Env": ["PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt"],
      "ExposedPorts": {"8080/tcp": {}, "9443/tcp": {}}, "WorkingDir": "/home/nonroot"}'
}

image_pause() {
  local ref="$1" out="$2"
  local k8s_version="${SLUICE_K8S_VERSION:-v1.36.3}" src
  src="$(go env GOMODCACHE)/k8s.io/kubernetes@$k8s_version/build/pause/linux/pause.c"
  [ -f "$src" ] || go mod download "k8s.io/kubernetes@$k8s_version"
  [ -f "$src" ] || die "no pause.c in the k8s.io/kubernetes@$k8s_version module"
  mkdir -p "$ROOTFS"
  gcc -Os -static -Wall -Werror -DVERSION="\"$k8s_version-sluice\"" -o "$ROOTFS/pause" "$src"
  strip "$ROOTFS/pause"
  write_image "$ref" "$out" '{"User": "65535:65535", "Entrypoint": ["/pause"]}'
}

image_busybox() {
  local ref="$1" out="$2"
  [ -x /bin/busybox ] || die "no /bin/busybox (Debian package busybox-static)"
  is_static /bin/busybox || die "/bin/busybox is not static (install busybox-static)"
  install -D -m 0755 /bin/busybox "$ROOTFS/bin/busybox"
  local applet
  for applet in $(/bin/busybox --list); do
    [ "$applet" = busybox ] || ln -s busybox "$ROOTFS/bin/$applet"
  done
  write_users
  write_image "$ref" "$out" '{"Cmd": ["sh"], "Env": ["PATH=/bin"]}'
}

image_static() {
  local binary="$1" ref="$2" out="$3" name
  name="$(basename "$binary")"
  is_static "$binary" || die "$binary is not statically linked"
  install -D -m 0755 "$binary" "$ROOTFS/$name"
  write_image "$ref" "$out" "$(jq -cn --arg e "/$name" '{Entrypoint: [$e]}')"
}

for tool in jq tar gzip sha256sum; do command -v "$tool" >/dev/null || die "$tool is required"; done
case "${1:-}" in
  sluice) shift; [ $# -eq 3 ] || die "usage: $0 sluice BINARY REF OUT.tar"; image_sluice "$@" ;;
  pause) shift; [ $# -eq 2 ] || die "usage: $0 pause REF OUT.tar"; image_pause "$@" ;;
  busybox) shift; [ $# -eq 2 ] || die "usage: $0 busybox REF OUT.tar"; image_busybox "$@" ;;
  static) shift; [ $# -eq 3 ] || die "usage: $0 static BINARY REF OUT.tar"; image_static "$@" ;;
  *) die "usage: $0 sluice BINARY REF OUT.tar | pause REF OUT.tar | busybox REF OUT.tar | static BINARY REF OUT.tar" ;;
esac
