# rust:1.95-bookworm, assembled where Docker Hub cannot be reached (e2e/base-images.sh): Debian 12
# with the C toolchain the official image's buildpack-deps base gives crates' build scripts (gcc,
# libc6-dev, make, pkg-config, git, curl, CA certificates), and the build machine's own Rust
# toolchain of that version under the official image's layout: rustup at /usr/local/cargo/bin with
# its proxies, the toolchain under /usr/local/rustup, the same ENV.
FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl git gcc libc6-dev make pkg-config \
 && rm -rf /var/lib/apt/lists/*
ARG RUST_VERSION
ENV RUSTUP_HOME=/usr/local/rustup \
    CARGO_HOME=/usr/local/cargo \
    PATH=/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    RUST_VERSION=${RUST_VERSION}
COPY toolchain/ /usr/local/rustup/toolchains/${RUST_VERSION}-x86_64-unknown-linux-gnu/
COPY rustup /usr/local/cargo/bin/rustup
RUN cd /usr/local/cargo/bin \
 && for proxy in cargo cargo-clippy cargo-fmt clippy-driver rustc rustdoc rustfmt rust-gdb rust-lldb; do ln rustup "$proxy"; done \
 && printf 'version = "12"\ndefault_toolchain = "%s-x86_64-unknown-linux-gnu"\nprofile = "minimal"\n' "$RUST_VERSION" \
      > /usr/local/rustup/settings.toml \
 && chmod -R a+w /usr/local/rustup /usr/local/cargo \
 && rustc --version && cargo --version
