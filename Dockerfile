# syntax=docker/dockerfile:1
#
# The one `sluice` binary (serve, operator, sidecar, crd) in a small non-root image.
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

# distroless/cc: glibc, libgcc and CA certificates, no shell; the :nonroot tag runs as 65532.
FROM gcr.io/distroless/cc-debian12:nonroot
LABEL org.opencontainers.image.title="sluice" \
      org.opencontainers.image.description="Kubernetes-native distributed rate limiter" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=builder /out/sluice /usr/local/bin/sluice
USER 65532:65532
# 8080: check API, /healthz, /readyz, /metrics (serve, operator); 9443: operator webhooks;
# 15080/9091: the injected sidecar's proxy and admin ports.
EXPOSE 8080 9443
ENTRYPOINT ["sluice"]
CMD ["--help"]
