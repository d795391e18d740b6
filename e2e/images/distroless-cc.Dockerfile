# gcr.io/distroless/cc-debian12:nonroot, assembled where gcr.io cannot be reached
# (e2e/base-images.sh), from the same Debian 12 packages distroless takes its files from: glibc
# (libc6), libgcc-s1, libgomp1, libstdc++6, libssl3, CA certificates, tzdata and netbase, unpacked
# with dpkg-deb (no maintainer scripts, no package manager, no shell); /etc/passwd and /etc/group
# with root, nobody and nonroot (65532); the :nonroot tag's user and working directory.
FROM debian:bookworm-slim AS packages
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && mkdir /debs /out && cd /debs \
 && apt-get download libc6 libgcc-s1 libgomp1 libstdc++6 libssl3 tzdata netbase \
 && for deb in *.deb; do dpkg-deb -x "$deb" /out; done \
 && rm -rf /out/usr/share/doc /out/usr/share/man /out/usr/share/lintian /out/usr/share/locale \
 && install -D -m 0644 /etc/ssl/certs/ca-certificates.crt /out/etc/ssl/certs/ca-certificates.crt \
 && printf 'root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' > /out/etc/passwd \
 && printf 'root:x:0:\nnobody:x:65534:\nnonroot:x:65532:\n' > /out/etc/group \
 && mkdir -p /out/tmp /out/root /out/home/nonroot \
 && chmod 1777 /out/tmp && chmod 0700 /out/root \
 && chown 65532:65532 /out/home/nonroot \
 && rm -rf /var/lib/apt/lists/* \
 && ! test -e /out/bin/sh
FROM scratch
COPY --from=packages /out/ /
ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
USER 65532
WORKDIR /home/nonroot
