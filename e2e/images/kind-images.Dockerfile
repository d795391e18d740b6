# The images a kind node boots with, pre-loaded in its containerd (e2e/kind-node.sh builds each
# target and tags it under the name kubeadm and kind's default CNI manifest ask for). Where Docker
# Hub and registry.k8s.io cannot be reached, they are assembled from the binaries this project
# already builds from the Go module proxy (e2e/control-plane.sh, e2e/node.sh) and Debian packages.
# The build context holds those binaries and Kubernetes' pause.c.

# kube-proxy and kindnetd program iptables/nftables: Debian's, as the official images' distroless-
# iptables base carries them (nft is the default backend of both Debian 12 and those images).
FROM debian:bookworm-slim AS iptables
RUN apt-get update \
 && apt-get install -y --no-install-recommends iptables nftables conntrack ipset kmod \
 && rm -rf /var/lib/apt/lists/*

# registry.k8s.io/kube-proxy: kubeadm's DaemonSet runs /usr/local/bin/kube-proxy.
FROM iptables AS kube-proxy
COPY kube-proxy /usr/local/bin/kube-proxy

# docker.io/kindest/kindnetd: kind's own CNI daemon (e2e/kind/kindnetd), /bin/kindnetd as upstream.
FROM iptables AS kindnetd
COPY kindnetd /bin/kindnetd
CMD ["/bin/kindnetd"]

# registry.k8s.io/kube-apiserver, -controller-manager, -scheduler and etcd: one static binary in
# /usr/local/bin (kubeadm's static pods name the command), on distroless as upstream, run as root
# as upstream (they read /etc/kubernetes/pki).
FROM gcr.io/distroless/cc-debian12:nonroot AS component
ARG COMPONENT
COPY ${COMPONENT} /usr/local/bin/${COMPONENT}
USER 0

# registry.k8s.io/coredns/coredns: /coredns is the entrypoint kubeadm's Deployment passes -conf to.
FROM gcr.io/distroless/cc-debian12:nonroot AS coredns
COPY coredns /coredns
USER 0
EXPOSE 53 53/udp
ENTRYPOINT ["/coredns"]

# registry.k8s.io/pause: Kubernetes' pause.c, compiled static, as upstream (user 65535).
FROM debian:bookworm-slim AS pause-build
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
ARG K8S_VERSION
COPY pause.c /pause.c
RUN gcc -Os -static -Wall -Werror -DVERSION="\"${K8S_VERSION}-sluice\"" -o /pause /pause.c && strip /pause

FROM scratch AS pause
COPY --from=pause-build /pause /pause
USER 65535:65535
ENTRYPOINT ["/pause"]
