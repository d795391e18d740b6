# The kind node image's own layer over the base (e2e/kind-node.sh): kubeadm, kubelet and kubectl,
# /kind/version and kind's default CNI manifest; containerd's sandbox image set to the pause image
# kubeadm asks for (kind's `build node-image` does the same). The images are pre-loaded after this.
#
# restrict_oom_score_adj = true: containerd then never asks for an oom_score_adj below its own.
# Lowering one needs CAP_SYS_RESOURCE, which a node does not have where the host's root lacks it
# (e2e/docker-runc.sh); without this, every pod sandbox dies in runc's init ("can't get final
# child's PID from pipe"). Where containerd runs at its unit's -999 nothing changes: no pod asks
# for less than -998. (kind's entrypoint sets the same for user namespaces, for the same reason.)
ARG BASE
FROM ${BASE}
COPY bin/ /usr/bin/
COPY kind/ /kind/
ARG PAUSE_IMAGE
RUN sed -i "s|^\( *sandbox_image = \).*|\1\"${PAUSE_IMAGE}\"|" /etc/containerd/config.toml \
 && grep -q "sandbox_image = \"${PAUSE_IMAGE}\"" /etc/containerd/config.toml \
 && sed -i "s|^\( *restrict_oom_score_adj = \).*|\1true|" /etc/containerd/config.toml \
 && grep -q "restrict_oom_score_adj = true" /etc/containerd/config.toml \
 && kubeadm version -o short && kubelet --version
