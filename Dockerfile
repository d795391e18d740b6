# syntax=docker/dockerfile:1
#
# The one `sluice` binary (serve, operator, sidecar, redirect, crd) in a small non-root image, with
# Debian's iptables for `sluice redirect`.
#
#   docker build -t sluice:dev .
#   docker run --rm sluice:dev --help
#
# The builder and the runtime are both Debian 12 (bookworm), so the binary's glibc matches.
# Cargo's registry and target directory are BuildKit cache mounts: a rebuild after a source edit
# recompiles only the crate, not its ~400 dependencies.

ARG RUST_VERSION=1.95

FROM rust:${RUST_VERSION}-bookworm AS builder
WORKDIR /src
# Release binaries without the debug info the workspace profile keeps for profiling (smaller image).
ENV CARGO_PROFILE_RELEASE_STRIP=debuginfo \
    CARGO_TERM_COLOR=never
# Cargo.toml names benches/ targets explicitly and src/store/redis.rs embeds lua/*.lua, so both are
# needed to build; tests, docs and examples are not (see .dockerignore).
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY lua ./lua
COPY benches ./benches
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    --mount=type=cache,target=/usr/local/cargo/git,sharing=locked \
    --mount=type=cache,target=/src/target,sharing=locked \
    cargo build --release --locked --bin sluice \
 && install -D -m 0755 target/release/sluice /out/sluice \
 && /out/sluice --version

# Debian's iptables for `sluice redirect`, the init container of the sidecar's iptables mode (it
# runs iptables-{nft,legacy}-{restore,save} and ip6tables-*). distroless has no package manager,
# so the package is installed here and the files that command needs are gathered under /out, at
# their paths: the two multi-call binaries, the names they dispatch on (argv[0]) as the package's
# symlinks, the extensions they dlopen at run time (the tcp match, the REDIRECT target) and the
# libraries all of those link, except glibc's, which distroless/cc has (the same Debian 12's).
# e2e/image.sh copies the same files.
FROM debian:bookworm-slim AS iptables
RUN apt-get update \
 && apt-get install -y --no-install-recommends iptables \
 && rm -rf /var/lib/apt/lists/* \
 && libdir="$(dirname /usr/lib/*-linux-gnu/xtables)" \
 && mkdir -p /out/usr/sbin "/out$libdir" \
 && cd /usr/sbin \
 && cp -P xtables-nft-multi xtables-legacy-multi \
      iptables-nft-restore iptables-nft-save ip6tables-nft-restore ip6tables-nft-save \
      iptables-legacy-restore iptables-legacy-save ip6tables-legacy-restore ip6tables-legacy-save \
      /out/usr/sbin/ \
 && cp -RP "$libdir/xtables" "/out$libdir/" \
 && for file in xtables-nft-multi xtables-legacy-multi "$libdir"/xtables/*.so; do ldd "$file"; done \
      | grep -o '/[^ ]*' | sort -u | grep -v -e '/libc\.so' -e '/libm\.so' -e '/ld-linux' \
      | while read -r lib; do cp -L "$lib" "/out$libdir/"; done \
 && /out/usr/sbin/iptables-nft-save --version && /out/usr/sbin/iptables-legacy-save --version

# distroless/cc: glibc, libgcc and CA certificates, no shell; the :nonroot tag runs as 65532. Its
# PATH has /usr/sbin, where `sluice redirect` finds iptables.
FROM gcr.io/distroless/cc-debian12:nonroot
LABEL org.opencontainers.image.title="sluice" \
      org.opencontainers.image.description="Kubernetes-native distributed rate limiter" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=builder /out/sluice /usr/local/bin/sluice
COPY --from=iptables /out/ /
# The init container running `sluice redirect` is made root with NET_ADMIN and NET_RAW by the
# webhook, for that command only; everything else runs as 65532 without capabilities.
USER 65532:65532
# 8080: check API, /healthz, /readyz, /metrics (serve, operator); 9443: operator webhooks;
# 15080/15081: the injected sidecar's proxy and admin ports (the webhook sets them); `sluice
# redirect` listens on nothing.
EXPOSE 8080 9443
ENTRYPOINT ["sluice"]
CMD ["--help"]
