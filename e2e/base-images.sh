#!/usr/bin/env bash
# The base images the Dockerfile names, for a Docker engine that cannot reach a registry, assembled
# locally under those exact names (nothing in the Dockerfile changes; on a machine with registry
# access `docker build` pulls the public ones instead and this script is not needed):
#
#   docker/dockerfile:1                     the Dockerfile frontend of its `# syntax=` line: BuildKit's
#                                           dockerfile-frontend (Go module proxy, github.com/moby/
#                                           buildkit $BUILDKIT_VERSION, Dockerfile syntax 1.28),
#                                           e2e/images/dockerfile-frontend.Dockerfile
#   debian:bookworm-slim                    Debian 12 from Debian's archive (debootstrap, minbase),
#                                           with the official image's apt sources and its "slim"
#                                           dpkg exclusions (no docs, man pages or locales)
#   rust:<RUST_VERSION>-bookworm            that, plus the C toolchain crates' build scripts use and
#                                           this machine's Rust toolchain of that version, in the
#                                           official image's layout (e2e/images/rust.Dockerfile)
#   gcr.io/distroless/cc-debian12:nonroot   glibc, libgcc, libstdc++, libssl, CA certificates,
#                                           users root/nobody/nonroot, no shell, user 65532
#                                           (e2e/images/distroless-cc.Dockerfile)
#
#   e2e/base-images.sh     (with DOCKER_HOST set, e.g. from e2e/docker.sh's env file)
#
# This machine's own trust anchors go in too: /usr/local/share/ca-certificates/*.crt, where Debian
# keeps local CAs, is copied to the same place in debian:bookworm-slim, so every image that installs
# ca-certificates on it (the Rust image, distroless, the Dockerfile's build stages) trusts what this
# machine trusts. Here that is what lets a build container reach the crate registry and Debian's
# archive: they are reached through an egress proxy that re-signs TLS with its own CA (cargo in a
# container without it: "SSL certificate problem: self-signed certificate in certificate chain").
# Where there is no such CA, nothing is copied and the images are plain Debian.
#
# An image already in the engine under its name is kept: the engine's data root is the cache
# (e2e/docker.sh), and the Debian root file system's tarball is cached beside it, so that a data
# root wiped only costs the imports. RUST_VERSION is the Dockerfile's ARG default.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${SLUICE_CACHE:-$HOME/.cache/sluice}"
MIRROR="${SLUICE_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
BUILDKIT_VERSION="${SLUICE_BUILDKIT_VERSION:-v0.34.2}"

# Every scratch directory lives under WORK, removed on exit however the script ends (a failed
# debootstrap or build included).
WORK="$(mktemp -d -t sluice-base-images.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT

blog() { echo "base-images: $*" >&2; }
die() { blog "$*"; exit 1; }

have() { docker image inspect "$1" >/dev/null 2>&1; }

dockerfile_frontend() {
  local ref=docker/dockerfile:1 dir="$CACHE/dockerfile-frontend-$BUILDKIT_VERSION"
  if have "$ref" && [ "$(docker image inspect -f '{{index .Config.Labels "org.sluice.buildkit"}}' "$ref")" = "$BUILDKIT_VERSION" ]; then return 0; fi
  if [ ! -x "$dir/dockerfile-frontend" ]; then
    command -v go >/dev/null || die "Go is required to build the Dockerfile frontend"
    blog "building BuildKit's dockerfile-frontend $BUILDKIT_VERSION (cold: about a minute)"
    local package=github.com/moby/buildkit/frontend/dockerfile/cmd/dockerfile-frontend
    # The release build's tags and version stamp (its Dockerfile: netgo static_build osusergo).
    ( mkdir -p "$dir/src" && cd "$dir/src" \
      && { [ -f go.mod ] || go mod init sluice.dev/build >/dev/null 2>&1; } \
      && printf '//go:build tools\n\npackage tools\n\nimport _ "%s"\n' "$package" > tools.go \
      && go mod edit -require="github.com/moby/buildkit@$BUILDKIT_VERSION" && go mod tidy >/dev/null \
      && CGO_ENABLED=0 go build -trimpath -tags "netgo static_build osusergo" \
           -ldflags "-s -w -X main.Version=$BUILDKIT_VERSION -X main.Package=$package" \
           -o "$dir/dockerfile-frontend.tmp" "$package" ) || die "building the Dockerfile frontend failed"
    mv "$dir/dockerfile-frontend.tmp" "$dir/dockerfile-frontend"
  fi
  blog "assembling $ref"
  local context="$WORK/frontend"
  mkdir -p "$context"
  cp "$dir/dockerfile-frontend" "$context/"
  # The classic builder: BuildKit would first need this very image to read a Dockerfile with a
  # syntax line, and this one has none; either reads it the same.
  DOCKER_BUILDKIT=0 docker build -q -t "$ref" --label "org.sluice.buildkit=$BUILDKIT_VERSION" \
    -f "$HERE/images/dockerfile-frontend.Dockerfile" "$context" >/dev/null
}

debian_slim() {
  local ref=debian:bookworm-slim local_cas=(/usr/local/share/ca-certificates/*.crt)
  [ -e "${local_cas[0]}" ] || local_cas=()
  # The tarball's name carries the local CAs' digest: new anchors, a new root file system.
  local cas_digest; cas_digest="$(cat "${local_cas[@]}" /dev/null | sha256sum | cut -c1-12)"
  local tarball="$CACHE/base/debian-bookworm-slim-cas-$cas_digest.tar"
  if have "$ref" && [ "$(docker image inspect -f '{{.Comment}}' "$ref")" = "$(basename "$tarball")" ]; then return 0; fi
  if [ ! -f "$tarball" ]; then
    command -v debootstrap >/dev/null || die "debootstrap is required (Debian package debootstrap)"
    blog "assembling $ref with debootstrap from $MIRROR (cold: a few minutes)"
    local root="$WORK/debian"
    mkdir -p "$root"
    debootstrap --variant=minbase bookworm "$root" "$MIRROR" >"$root.log" 2>&1 \
      || { tail -20 "$root.log" >&2; rm -f "$root.log"; die "debootstrap failed"; }
    rm -f "$root.log"
    # The official image's apt sources (deb822) and its dpkg/apt settings for a small image.
    rm -f "$root/etc/apt/sources.list"
    cat > "$root/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: ${MIRROR}
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: ${MIRROR}-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    cat > "$root/etc/dpkg/dpkg.cfg.d/docker" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/info/*
EOF
    printf 'APT::Install-Recommends "false";\n' > "$root/etc/apt/apt.conf.d/docker-no-recommends"
    printf 'DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/*.bin || true"; };\n' \
      > "$root/etc/apt/apt.conf.d/docker-clean"
    if ((${#local_cas[@]})); then
      install -D -m 0644 -t "$root/usr/local/share/ca-certificates/" "${local_cas[@]}"
    fi
    find "$root/usr/share/doc" -mindepth 2 ! -name copyright -type f -delete 2>/dev/null || true
    rm -rf "$root/usr/share/man"/* "$root/usr/share/locale"/* "$root/usr/share/info"/* \
      "$root/var/lib/apt/lists"/* "$root/var/cache/apt"/*.bin "$root/var/cache/apt/archives"/*.deb \
      "$root/var/log"/*.log "$root/var/log/apt"/*
    mkdir -p "$CACHE/base"
    tar --numeric-owner -C "$root" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
  fi
  blog "importing $ref"
  # The comment names the tarball, so a changed one is imported again.
  docker import --message "$(basename "$tarball")" --change 'CMD ["bash"]' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    "$tarball" "$ref" >/dev/null
}

rust_image() {
  local version; version="$(sed -n 's/^ARG RUST_VERSION=//p' "$HERE/../Dockerfile")"
  [ -n "$version" ] || die "no ARG RUST_VERSION= in the Dockerfile"
  local ref="rust:$version-bookworm"
  # Built on the current debian:bookworm-slim: a re-imported one means a rebuild.
  if have "$ref" && [ "$(docker image inspect -f '{{index .Config.Labels "org.sluice.base"}}' "$ref")" = "$(docker image inspect -f '{{.Id}}' debian:bookworm-slim)" ]; then return 0; fi
  # This machine's toolchain of that version (rustup's directory for it, whatever its name).
  local sysroot="" candidate
  for candidate in "${RUSTUP_HOME:-$HOME/.rustup}"/toolchains/*; do
    if "$candidate/bin/rustc" --version 2>/dev/null | grep -q "^rustc $version\."; then sysroot="$candidate"; break; fi
  done
  [ -n "$sysroot" ] || die "no Rust $version toolchain here: rustup toolchain install $version"
  local full; full="$("$sysroot/bin/rustc" --version | awk '{ print $2 }')"
  local rustup="${CARGO_HOME:-$HOME/.cargo}/bin/rustup"
  [ -x "$rustup" ] || die "no rustup at $rustup"
  blog "assembling $ref (Rust $full from $sysroot)"
  local context="$WORK/rust"
  mkdir -p "$context"
  # The toolchain without its documentation (the official image installs the minimal profile).
  mkdir "$context/toolchain"
  tar -C "$sysroot" --exclude=./share/doc -cf - . | tar -C "$context/toolchain" -xf -
  cp "$rustup" "$context/rustup"
  docker build -q -t "$ref" --label "org.sluice.base=$(docker image inspect -f '{{.Id}}' debian:bookworm-slim)" --build-arg "RUST_VERSION=$full" -f "$HERE/images/rust.Dockerfile" "$context" >/dev/null
}

distroless() {
  local ref=gcr.io/distroless/cc-debian12:nonroot base
  base="$(docker image inspect -f '{{.Id}}' debian:bookworm-slim)"
  if have "$ref" && [ "$(docker image inspect -f '{{index .Config.Labels "org.sluice.base"}}' "$ref")" = "$base" ]; then return 0; fi
  blog "assembling $ref"
  docker build -q -t "$ref" --label "org.sluice.base=$base" - < "$HERE/images/distroless-cc.Dockerfile" >/dev/null
}

command -v docker >/dev/null || die "docker is required"
docker info >/dev/null 2>&1 || die "no Docker engine reachable (e2e/docker.sh starts one)"
PATH="$PATH:/usr/local/go/bin"
dockerfile_frontend
debian_slim
rust_image
distroless
blog "ready: docker/dockerfile:1, debian:bookworm-slim, rust:*-bookworm, gcr.io/distroless/cc-debian12:nonroot"
