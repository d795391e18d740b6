# What kind's base image (kindest/base, built by kind's images/base/Dockerfile) gives a node, where
# it cannot be pulled, assembled from Debian 12's packages (e2e/kind-node.sh): systemd as PID 1,
# containerd and runc (Debian's, where kind builds its own), the CNI plugins kindnet's config uses
# (ptp, host-local, portmap, loopback) at /opt/cni/bin, iptables/nftables, conntrack; and kind's own
# files unchanged from the sigs.k8s.io/kind module of the kind that boots it: the entrypoint (mount,
# cgroup v1/v2 and containerd fix-ups before systemd), the containerd config, the kubelet and
# containerd units, sysctls. The build context's files/ is that module's images/base/files.
FROM debian:bookworm-slim
# Packages first: Debian's containerd ships /etc/containerd/config.toml as a conffile, which kind's
# replaces below.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      systemd conntrack iptables nftables iproute2 ethtool util-linux mount kmod libseccomp2 pigz \
      bash ca-certificates curl jq procps containerd runc containernetworking-plugins \
 && rm -rf /var/lib/apt/lists/*
COPY files/ /
# As kind's Dockerfile: no units but the ones a node needs, journald not reading kmsg, systemd as
# /sbin/init; kind's containerd unit starts /usr/local/bin/containerd and its CNI config looks in
# /opt/cni/bin, so Debian's binaries are linked there; cri-base.json is kind's, from `ctr oci spec`.
RUN chmod 0755 /kind /kind/bin /kind/bin/* /usr/local/bin/* \
 && find /lib/systemd/system/sysinit.target.wants/ -name "systemd-tmpfiles-setup.service" -delete \
 && rm -f /lib/systemd/system/multi-user.target.wants/* \
 && rm -f /etc/systemd/system/*.wants/* \
 && rm -f /lib/systemd/system/local-fs.target.wants/* \
 && rm -f /lib/systemd/system/sockets.target.wants/*udev* \
 && rm -f /lib/systemd/system/sockets.target.wants/*initctl* \
 && rm -f /lib/systemd/system/basic.target.wants/* \
 && echo "ReadKMsg=no" >> /etc/systemd/journald.conf \
 && ln -sf /usr/lib/systemd/systemd /sbin/init \
 && ln -sf /usr/bin/containerd /usr/local/bin/containerd \
 && mkdir -p /opt/cni/bin \
 && for plugin in host-local loopback ptp portmap bridge; do ln -sf "/usr/lib/cni/$plugin" "/opt/cni/bin/$plugin"; done \
 && ctr oci spec \
      | jq '.hooks.createContainer[.hooks.createContainer| length] |= . + {"path": "/kind/bin/mount-product-files.sh"}' \
      | jq 'del(.process.rlimits)' > /etc/containerd/cri-base.json \
 && systemctl enable kubelet.service containerd.service undo-mount-hacks.service \
 && systemctl mask systemd-binfmt.service \
 && mkdir -p /etc/kubernetes/manifests
ENV container=docker
STOPSIGNAL SIGRTMIN+3
ENTRYPOINT [ "/usr/local/bin/entrypoint", "/sbin/init" ]
