#!/usr/bin/env bash
# A one-node Kubernetes cluster on this machine, the way kind gives one but without Docker: etcd,
# kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kube-proxy, a containerd of its
# own (Debian's, with its own root, state and socket under DIR; never the system instance), runc,
# Debian's CNI plugins (bridge + host-local) and CoreDNS as a pod, so a `helm install` of
# charts/sluice really runs pods, Services, DNS, probes and webhooks.
#
#   e2e/node.sh build                 build (or reuse) every binary and infrastructure image
#   e2e/node.sh start DIR [OWNER_PID] start the cluster with its state in DIR; write DIR/kubeconfig
#                                     (admin); with OWNER_PID, tear down (and remove DIR) once that
#                                     process is gone
#   e2e/node.sh import DIR TAR...     import OCI image tarballs (e2e/image.sh) into the node
#   e2e/node.sh exec DIR CMD...       run CMD inside the cluster's network namespace, KUBECONFIG set
#   e2e/node.sh stop DIR              stop everything `start DIR` started and undo its mounts,
#                                     network namespaces and cgroups
#
# Networking stays on this machine (docs/operator.md, "The one-node cluster"): the whole cluster
# lives in a network namespace made for it, `sluice-e2e-*`, whose only link is a veth pair with
# both ends inside it (the node IP 10.200.0.2 on one end, nothing on the other), so nothing it
# sends can leave. Pods get namespaces of their own on a bridge in it (10.244.0.0/24); kube-proxy's
# iptables rules (Services, 10.96.0.0/16) live only in it. Daemons join it with `nsenter --net`,
# not `ip netns exec`, which would also give each its own mount namespace: the kubelet's volume
# mounts must be the ones containerd and runc see.
#
# Binaries are those of e2e/control-plane.sh (same k8s.io/kubernetes module and cache), CoreDNS is
# built from the Go module proxy and cached by version, the images by content.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=e2e/control-plane.sh
source "$HERE/control-plane.sh"

COREDNS_VERSION="${SLUICE_COREDNS_VERSION:-v1.15.0}"
COREDNS_BIN="$CACHE/coredns-$COREDNS_VERSION/coredns"
IMAGES="$CACHE/node-images"
PAUSE_REF=registry.k8s.io/pause:3.10
COREDNS_REF="docker.io/sluice-e2e/coredns:$COREDNS_VERSION"
NODE_NAME=sluice-node
NODE_IP=10.200.0.2
POD_SUBNET=10.244.0.0/24
SERVICE_RANGE=10.96.0.0/16
DNS_IP=10.96.0.10
KUBELET_TUNABLES=(vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops
  kernel.keys.root_maxkeys kernel.keys.root_maxbytes)

nlog() { echo "node: $*" >&2; }

build_coredns() {
  go_build_main "$CACHE/coredns-$COREDNS_VERSION/src" github.com/coredns/coredns "$COREDNS_VERSION" \
    github.com/coredns/coredns "$COREDNS_BIN"
}

node_build() {
  cmd_build >/dev/null
  local missing=() tool
  for tool in containerd containerd-shim-runc-v2 runc ctr nsenter iptables conntrack gcc; do
    command -v "$tool" >/dev/null || missing+=("$tool")
  done
  [ -x /usr/lib/cni/bridge ] && [ -x /usr/lib/cni/host-local ] || missing+=(containernetworking-plugins)
  ((${#missing[@]} == 0)) || { nlog "missing: ${missing[*]} (scripts/test.sh installs them)"; exit 1; }
  if [ ! -x "$COREDNS_BIN" ]; then
    nlog "building CoreDNS $COREDNS_VERSION (cold: a few minutes)"; mkdir -p "$(dirname "$COREDNS_BIN")"
    (build_coredns)
  fi
  mkdir -p "$IMAGES"
  [ -f "$IMAGES/pause-$K8S_VERSION.tar" ] || "$HERE/image.sh" pause "$PAUSE_REF" "$IMAGES/pause-$K8S_VERSION.tar"
  [ -f "$IMAGES/coredns-$COREDNS_VERSION.tar" ] \
    || "$HERE/image.sh" static "$COREDNS_BIN" "$COREDNS_REF" "$IMAGES/coredns-$COREDNS_VERSION.tar"
  echo "$BIN"
}

netns_of() { cat "$1/netns"; }
# Runs a command in the cluster's network namespace only (same mount namespace as the caller).
in_node() { local dir="$1"; shift; nsenter --net="/run/netns/$(netns_of "$dir")" -- "$@"; }

# The v1 hierarchies mounted here (plus the unified one of a hybrid host), where the kubelet's
# cgroup root is made and, at stop, removed.
cgroup_mounts() { awk '$3 == "cgroup" || $3 == "cgroup2" { print $2 }' /proc/self/mounts; }

# start_daemon DIR NAME CMD...: NAME runs in the cluster's network namespace, logs in DIR/NAME.log.
start_daemon() {
  local dir="$1" name="$2"; shift 2
  # nsenter itself, not a function around it, so that $! is the daemon (nsenter execs it).
  nsenter --net="/run/netns/$(netns_of "$dir")" -- "$@" >"$dir/$name.log" 2>&1 &
  echo $! > "$dir/$name.pid"
}

# wait_for DIR NAME SECONDS CMD...: until CMD succeeds; fails with NAME's log tail.
wait_for() {
  local dir="$1" name="$2" max="$3"; shift 3
  local deadline=$((SECONDS + max))
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS > deadline)); then
      nlog "$name did not come up in ${max}s; last log lines:"; tail -25 "$dir/$name.log" >&2 || true
      return 1
    fi
    sleep 0.5
  done
}

node_start() {
  local dir="$1" owner="${2:-}"
  node_build >/dev/null
  mkdir -p "$dir" && dir="$(cd "$dir" && pwd)"
  local ns; ns="sluice-e2e-$(openssl rand -hex 4)"
  echo "$ns" > "$dir/netns"
  if [ -n "$owner" ]; then
    # Watchdog first, so that a start failing half-way is undone too.
    ( while kill -0 "$owner" 2>/dev/null; do sleep 1; done; node_stop "$dir"; rm -rf "$dir" ) >/dev/null 2>&1 &
    disown
  fi
  if ! node_start_in "$dir" "$ns"; then
    nlog "start failed; stopping what started"; node_stop "$dir"; exit 1
  fi
  nlog "ready: $NODE_NAME at $NODE_IP in netns $ns (KUBECONFIG=$dir/kubeconfig, e2e/node.sh exec $dir …)"
  echo "$dir/kubeconfig"
}

node_start_in() {
  local dir="$1" ns="$2"
  ip netns add "$ns"
  ip -n "$ns" link set lo up
  ip -n "$ns" link add node0 type veth peer name node0-peer
  ip -n "$ns" addr add "$NODE_IP/24" dev node0
  ip -n "$ns" link set node0 up
  ip -n "$ns" link set node0-peer up
  # Service IPs need a route before kube-proxy's DNAT; the default leads to the empty peer end.
  ip -n "$ns" route add default dev node0
  in_node "$dir" sysctl -qw net.ipv4.ip_forward=1

  local pki="$dir/pki"; mkdir -p "$pki"
  openssl req -x509 -newkey rsa:2048 -nodes -days 3 -subj /CN=sluice-node-ca \
    -keyout "$pki/ca.key" -out "$pki/ca.crt" 2>/dev/null
  issue_cert "$pki" apiserver /CN=kube-apiserver \
    "IP:$NODE_IP,IP:10.96.0.1,IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
  # The API server's client certificate towards the kubelet (logs, exec, port-forward).
  issue_cert "$pki" apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client"
  openssl genrsa -out "$pki/sa.key" 2048 2>/dev/null
  openssl rsa -in "$pki/sa.key" -pubout -out "$pki/sa.pub" 2>/dev/null
  local ca; ca="$(base64 -w0 < "$pki/ca.crt")"
  # Static tokens. The kubelet is a real node identity (Node authorizer + NodeRestriction), kube-proxy
  # and the scheduler get their bootstrap roles; the controller-manager, which would otherwise
  # need one ServiceAccount per controller, is a master.
  local who user groups token
  : > "$pki/tokens.csv"
  while read -r who user groups; do
    token="$(openssl rand -hex 16)"
    printf '%s,%s,%s,"%s"\n' "$token" "$user" "$user" "$groups" >> "$pki/tokens.csv"
    write_kubeconfig "$dir/$who.kubeconfig" "https://$NODE_IP:6443" "$user" "$token" "$ca"
  done <<EOF
admin admin system:masters
controller-manager system:kube-controller-manager system:masters
scheduler system:kube-scheduler system:authenticated
kubelet system:node:$NODE_NAME system:nodes
kube-proxy system:kube-proxy system:authenticated
EOF
  cp "$dir/admin.kubeconfig" "$dir/kubeconfig"

  start_daemon "$dir" etcd "$BIN/etcd" --data-dir="$dir/etcd" --name=node \
    --listen-client-urls=http://127.0.0.1:2379 --advertise-client-urls=http://127.0.0.1:2379 \
    --listen-peer-urls=http://127.0.0.1:2380 --initial-advertise-peer-urls=http://127.0.0.1:2380 \
    --initial-cluster=node=http://127.0.0.1:2380 --unsafe-no-fsync=true
  start_daemon "$dir" kube-apiserver "$BIN/kube-apiserver" --etcd-servers=http://127.0.0.1:2379 \
    --cert-dir="$pki" --tls-cert-file="$pki/apiserver.crt" --tls-private-key-file="$pki/apiserver.key" \
    --client-ca-file="$pki/ca.crt" --secure-port=6443 --bind-address=0.0.0.0 --advertise-address="$NODE_IP" \
    --service-cluster-ip-range="$SERVICE_RANGE" --allow-privileged=true \
    --authorization-mode=Node,RBAC --enable-admission-plugins=NodeRestriction \
    --kubelet-client-certificate="$pki/apiserver-kubelet-client.crt" \
    --kubelet-client-key="$pki/apiserver-kubelet-client.key" --kubelet-preferred-address-types=InternalIP \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local \
    --service-account-key-file="$pki/sa.pub" --service-account-signing-key-file="$pki/sa.key" \
    --token-auth-file="$pki/tokens.csv"
  wait_for "$dir" kube-apiserver 120 in_node "$dir" "$BIN/kubectl" --kubeconfig "$dir/kubeconfig" get --raw /readyz

  start_daemon "$dir" kube-controller-manager "$BIN/kube-controller-manager" \
    --kubeconfig="$dir/controller-manager.kubeconfig" --bind-address=127.0.0.1 --leader-elect=false \
    --service-account-private-key-file="$pki/sa.key" --root-ca-file="$pki/ca.crt" \
    --use-service-account-credentials=false --controllers='*,-nodeipam'
  start_daemon "$dir" kube-scheduler "$BIN/kube-scheduler" \
    --kubeconfig="$dir/scheduler.kubeconfig" --bind-address=127.0.0.1 --leader-elect=false

  # containerd: everything it writes under DIR, pod network namespaces included.
  local ctrd="$dir/containerd"; mkdir -p "$ctrd" "$dir/cni/net.d" "$dir/cni/ipam"
  cat > "$ctrd/config.toml" <<EOF
version = 2
root = "$ctrd/root"
state = "$ctrd/state"
[grpc]
  address = "$ctrd/containerd.sock"
[ttrpc]
  address = "$ctrd/containerd-ttrpc.sock"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "$ctrd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_REF"
  netns_mounts_under_state_dir = true
  # No CAP_SYS_RESOURCE here (a sandboxed VM): the kubelet's negative OOM scores (-998 for pod
  # sandboxes) cannot be set, and runc fails the whole container over it. Clamp them instead.
  restrict_oom_score_adj = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "$(command -v runc)"
        Root = "$ctrd/runc"
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$dir/cni/net.d"
EOF
  cat > "$dir/cni/net.d/10-sluice-e2e.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "sluice-e2e",
  "plugins": [
    {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "dataDir": "$dir/cni/ipam",
              "ranges": [[{"subnet": "$POD_SUBNET"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}},
    {"type": "loopback"}
  ]
}
EOF
  start_daemon "$dir" containerd containerd --config "$ctrd/config.toml"
  wait_for "$dir" containerd 30 ctr --address "$ctrd/containerd.sock" version
  node_import "$dir" "$IMAGES/pause-$K8S_VERSION.tar" "$IMAGES/coredns-$COREDNS_VERSION.tar"

  # The kubelet's cgroup root, under every hierarchy, so that the pods' cgroups are all below it
  # and stop can remove them.
  local cgroot; cgroot="/$(netns_of "$dir")"; echo "$cgroot" > "$dir/cgroup-root"
  local mnt
  for mnt in $(cgroup_mounts); do
    mkdir -p "$mnt$cgroot"
    if [ -f "$mnt/cpuset.cpus" ]; then
      cat "$mnt/cpuset.cpus" > "$mnt$cgroot/cpuset.cpus"; cat "$mnt/cpuset.mems" > "$mnt$cgroot/cpuset.mems"
    fi
  done
  # The kubelet sets these machine-wide kernel tunables to its liking (they are not per network
  # namespace); stop puts them back.
  local tunable
  for tunable in "${KUBELET_TUNABLES[@]}"; do echo "$tunable=$(sysctl -n "$tunable")"; done > "$dir/sysctl.saved"
  printf 'nameserver 127.0.0.1\n' > "$dir/resolv.conf"
  mkdir -p "$dir/kubelet" "$dir/pod-logs"
  cat > "$dir/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# This machine is cgroup v1 (hybrid); since 1.35 the kubelet refuses v1 unless told not to.
failCgroupV1: false
# containerd 1.6 does not answer the RuntimeConfig call, so the kubelet falls back to this.
cgroupDriver: cgroupfs
cgroupRoot: $cgroot
podLogsDir: $dir/pod-logs
address: $NODE_IP
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $pki/ca.crt}
authorization: {mode: Webhook}
clusterDNS: [$DNS_IP]
clusterDomain: cluster.local
resolvConf: $dir/resolv.conf
failSwapOn: false
# Lowering an OOM score needs CAP_SYS_RESOURCE, which this machine's root lacks.
oomScoreAdj: 0
# The shared disk is often over 85% full: neither evict the test's pods nor delete the images it
# imported (they cannot be pulled again: there is no registry).
evictionHard: {memory.available: 100Mi, nodefs.available: 1%, nodefs.inodesFree: 1%, imagefs.available: 1%}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
maxPods: 40
EOF
  start_daemon "$dir" kubelet "$BIN/kubelet" --config="$dir/kubelet.yaml" --root-dir="$dir/kubelet" \
    --cert-dir="$dir/kubelet-pki" \
    --kubeconfig="$dir/kubelet.kubeconfig" --container-runtime-endpoint="unix://$ctrd/containerd.sock" \
    --hostname-override="$NODE_NAME" --node-ip="$NODE_IP"

  cat > "$dir/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: $dir/kube-proxy.kubeconfig}
hostnameOverride: $NODE_NAME
mode: iptables
clusterCIDR: $POD_SUBNET
# Every Service connection is masqueraded, so a reply from a pod on the same bridge goes back
# through the node's conntrack whether or not bridged traffic is seen by iptables.
iptables: {masqueradeAll: true}
# Leave the machine-wide conntrack table size and timeouts alone.
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
healthzBindAddress: 127.0.0.1:10256
oomScoreAdj: 0
metricsBindAddress: 127.0.0.1:10249
EOF
  start_daemon "$dir" kube-proxy "$BIN/kube-proxy" --config="$dir/kube-proxy.yaml"

  local kubectl=(in_node "$dir" "$BIN/kubectl" --kubeconfig "$dir/kubeconfig")
  wait_for "$dir" kubelet 120 "${kubectl[@]}" wait --for=condition=Ready "node/$NODE_NAME" --timeout=1s
  sed -e "s|@COREDNS_IMAGE@|$COREDNS_REF|" -e "s|@DNS_IP@|$DNS_IP|" "$HERE/node/coredns.yaml" \
    | "${kubectl[@]}" apply -f - >/dev/null
  if ! "${kubectl[@]}" -n kube-system rollout status deployment/coredns --timeout=180s >&2; then
    "${kubectl[@]}" -n kube-system describe pods -l k8s-app=kube-dns >&2 || true
    return 1
  fi
}

node_import() {
  local dir="$1"; shift
  local tar
  for tar in "$@"; do
    ctr --address "$dir/containerd/containerd.sock" -n k8s.io images import --no-unpack=false "$tar" >/dev/null \
      || { nlog "importing $tar failed"; return 1; }
  done
}

node_exec() {
  local dir="$1"; shift
  KUBECONFIG="$dir/kubeconfig" PATH="$BIN:$PATH" in_node "$dir" "$@"
}

node_stop() {
  local dir="$1"
  [ -d "$dir" ] || return 0
  kill_pidfile "$dir/kubelet.pid"
  kill_pidfile "$dir/kube-proxy.pid"
  if [ -f "$dir/sysctl.saved" ]; then
    local setting
    while read -r setting; do sysctl -qw "$setting" || true; done < "$dir/sysctl.saved"
    rm -f "$dir/sysctl.saved"
  fi
  # Every container process is in the kubelet's cgroup root; the shims are containerd's children.
  local cgroot mnt pid
  cgroot="$(cat "$dir/cgroup-root" 2>/dev/null || true)"
  if [ -n "$cgroot" ]; then
    for mnt in $(cgroup_mounts); do
      [ -d "$mnt$cgroot" ] || continue
      # (find fails when a cgroup goes away under it: the kills below make that happen.)
      for pid in $(find "$mnt$cgroot" -name cgroup.procs -exec cat {} + 2>/dev/null || true); do
        kill -9 "$pid" 2>/dev/null || true
      done
    done
  fi
  if [ -S "$dir/containerd/containerd.sock" ]; then
    for pid in $(pgrep -f "containerd-shim-runc-v2 .*-address $dir/containerd/containerd.sock" || true); do
      kill -9 "$pid" 2>/dev/null || true
    done
  fi
  local p
  for p in containerd kube-scheduler kube-controller-manager kube-apiserver etcd; do kill_pidfile "$dir/$p.pid"; done
  # Container root filesystems, volumes and pod network namespaces, deepest first.
  # (/proc/self/mounts escapes blanks, so one mount point is one word.)
  local mounts
  mounts="$(awk -v d="$dir/" 'index($2, d) == 1 { print $2 }' /proc/self/mounts | sort -r)"
  for mnt in $mounts; do umount -l "$mnt" 2>/dev/null || true; done
  if [ -n "$cgroot" ]; then
    for mnt in $(cgroup_mounts); do
      if [ -d "$mnt$cgroot" ]; then find "$mnt$cgroot" -depth -type d -exec rmdir {} + 2>/dev/null || true; fi
    done
  fi
  if [ -f "$dir/netns" ]; then ip netns delete "$(netns_of "$dir")" 2>/dev/null || true; fi
  local left
  left="$(pgrep -f -- "$dir/" || true)"
  if [ -n "$left" ]; then nlog "still running after stop: $(echo "$left" | tr '\n' ' ')"; return 1; fi
  nlog "stopped $dir"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  case "${1:-}" in
    build) node_build ;;
    start) shift; node_start "$@" ;;
    import) shift; node_import "$@" ;;
    exec) shift; node_exec "$@" ;;
    stop) shift; node_stop "$@" ;;
    *) echo "usage: $0 build | start DIR [OWNER_PID] | import DIR TAR... | exec DIR CMD... | stop DIR" >&2; exit 2 ;;
  esac
fi
