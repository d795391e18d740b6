#!/usr/bin/env bash
# A Docker engine of the test run's own: Debian's dockerd (package docker.io) with its own data
# root, exec root and socket, never the system's instance (if there is one, it is left alone).
#
#   e2e/docker.sh start DIR [OWNER_PID]  start it; DIR/env is a file to `source` (DOCKER_HOST and a
#                                        PATH whose `docker` is the daemon's own client); with
#                                        OWNER_PID, stop it once that process is gone
#   e2e/docker.sh stop DIR               stop it and undo what it did to the host (below); fails if
#                                        anything is left behind
#   e2e/docker.sh env DIR                print the env file's path
#
# The data root is the cache ($SLUICE_CACHE/docker, outside the checkout): the assembled base
# images (e2e/base-images.sh), the kind node image (e2e/kind-node.sh) and the BuildKit cache of
# `docker build` (cargo's registry and target directory) survive from one run to the next, each
# image under a tag that names its version.
#
# What dockerd does to the host, and what stop undoes: it sets the iptables FORWARD policy to DROP
# and adds its chains (DOCKER, DOCKER-USER, DOCKER-ISOLATION-STAGE-*, and its nat rules) and a
# MASQUERADE rule per network, turns on net.ipv4.ip_forward, and makes bridges (docker0, one
# br-* per network such as kind's). Stop puts the FORWARD policy and ip_forward back as they were,
# deletes the chains and rules that name docker or its bridges, and deletes the bridges it made;
# then it checks that iptables-save shows none of them and fails if it does. The one-node cluster
# (e2e/node.sh) lives in a network namespace of its own, so FORWARD DROP on the host does not reach
# it while both run.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${SLUICE_CACHE:-$HOME/.cache/sluice}"
DATA_ROOT="$CACHE/docker"
DOCKERD="${SLUICE_DOCKERD:-/usr/sbin/dockerd}"
CLIENT="${SLUICE_DOCKER_CLIENT:-/usr/bin/docker}"

dlog() { echo "docker: $*" >&2; }
die() { dlog "$*"; exit 1; }

bridges() { ip -o link show type bridge 2>/dev/null | awk -F': ' '{ print $2 }' | sed 's/@.*//' | sort; }

docker_start() {
  local dir="$1" owner="${2:-}"
  [ "$(id -u)" -eq 0 ] || die "needs root (dockerd)"
  [ -x "$DOCKERD" ] || die "no $DOCKERD: install Debian's docker.io (scripts/test.sh does)"
  [ -x "$CLIENT" ] || die "no $CLIENT: install Debian's docker.io (scripts/test.sh does)"
  mkdir -p "$dir" "$DATA_ROOT" && dir="$(cd "$dir" && pwd)"
  # The exec root holds the daemon's and its containerd's sockets: unix socket paths are limited to
  # 108 bytes, so it is short and under /run, named after DIR's hash.
  local exec_root; exec_root="/run/sluice-docker-$(echo "$dir" | sha256sum | cut -c1-8)"
  [ ! -e "$exec_root/docker.pid" ] || die "a daemon already runs for $dir ($exec_root)"
  mkdir -p "$exec_root" "$dir/bin"
  echo "$exec_root" > "$dir/exec-root"
  # What stop restores.
  sysctl -n net.ipv4.ip_forward > "$dir/ip_forward"
  iptables -S FORWARD | awk '$1 == "-P" { print $3 }' > "$dir/forward_policy"
  bridges > "$dir/bridges.before"
  # kind and the scripts call `docker`: the daemon's own client (Debian's, the same version), first
  # in PATH, whatever other client the machine has.
  ln -sf "$CLIENT" "$dir/bin/docker"
  cat > "$dir/env" <<EOF
export DOCKER_HOST=unix://$exec_root/docker.sock
export DOCKER_BUILDKIT=1
export PATH="$dir/bin:\$PATH"
EOF
  if [ -n "$owner" ]; then
    ( while kill -0 "$owner" 2>/dev/null; do sleep 1; done; docker_stop "$dir" ) >/dev/null 2>&1 &
    disown
  fi
  # Where this host's root lacks a capability the kernel knows, --privileged containers (kind's
  # nodes) cannot start under plain runc: e2e/docker-runc.sh narrows what they ask for first.
  local runtime=()
  local bounding last; bounding=$((16#$(awk '/^CapBnd:/ { print $2 }' /proc/self/status)))
  last="$(cat /proc/sys/kernel/cap_last_cap)"
  if (( (bounding & ((1 << (last + 1)) - 1)) != ((1 << (last + 1)) - 1) )); then
    dlog "this host's root lacks capabilities the kernel knows (CapBnd $(awk '/^CapBnd:/ { print $2 }' /proc/self/status)): containers run through e2e/docker-runc.sh"
    runtime=(--add-runtime "sluice-runc=$HERE/docker-runc.sh" --default-runtime sluice-runc)
  fi
  dlog "starting dockerd (data root $DATA_ROOT, socket $exec_root/docker.sock)"
  # --host: only the private socket (no TCP, not /var/run/docker.sock); the managed containerd it
  # starts keeps its state under the exec root and its content under the data root.
  setsid "$DOCKERD" --data-root "$DATA_ROOT" --exec-root "$exec_root" \
    --pidfile "$exec_root/docker.pid" --host "unix://$exec_root/docker.sock" \
    --storage-driver overlay2 --log-level warn "${runtime[@]}" >"$dir/dockerd.log" 2>&1 &
  local deadline=$((SECONDS + 60))
  until DOCKER_HOST="unix://$exec_root/docker.sock" "$CLIENT" info >/dev/null 2>&1; do
    if ((SECONDS > deadline)) || ! kill -0 $! 2>/dev/null; then
      tail -20 "$dir/dockerd.log" >&2; docker_stop "$dir" || true; die "dockerd did not start"
    fi
    sleep 0.5
  done
  dlog "ready: source $dir/env"
}

# iptables rules and chains of this daemon: those naming a DOCKER chain, docker0 or a br-* bridge.
docker_rules() { iptables-save 2>/dev/null | grep -E 'DOCKER|docker0|br-[0-9a-f]{12}' || true; }

docker_stop() {
  local dir="$1"
  [ -f "$dir/exec-root" ] || return 0
  local exec_root; exec_root="$(cat "$dir/exec-root")"
  export DOCKER_HOST="unix://$exec_root/docker.sock"
  if [ -f "$exec_root/docker.pid" ]; then
    local pid; pid="$(cat "$exec_root/docker.pid")"
    # Containers first (kind's nodes among them), so that nothing keeps a mount or a veth.
    local running; running="$("$CLIENT" ps -q 2>/dev/null || true)"
    # shellcheck disable=SC2086 # one id per word
    [ -z "$running" ] || "$CLIENT" rm -f $running >/dev/null 2>&1 || true
    kill "$pid" 2>/dev/null || true
    local deadline=$((SECONDS + 30))
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.5; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  # Its containerd and shims (under the exec root) go with it; any left are stopped here.
  pkill -f -- "$exec_root/" 2>/dev/null || true
  # Undo its iptables changes: rules that jump to its chains or name its bridges, then its chains.
  local table chain
  for table in filter nat; do
    # (No matching rule is the usual case on a second stop: grep's status must not end the script.)
    { iptables-save -t "$table" 2>/dev/null | grep -E '^-A' | grep -E 'DOCKER|docker0|br-[0-9a-f]{12}' || true; } \
      | sed 's/^-A/-D/' | while read -r rule; do
        # shellcheck disable=SC2086 # the rule's words are iptables arguments
        eval iptables -t "$table" $rule 2>/dev/null || true
      done
    for chain in $(iptables-save -t "$table" 2>/dev/null | awk -F'[: ]' '/^:DOCKER/ { print $2 }'); do
      iptables -t "$table" -F "$chain" 2>/dev/null || true
    done
    for chain in $(iptables-save -t "$table" 2>/dev/null | awk -F'[: ]' '/^:DOCKER/ { print $2 }'); do
      iptables -t "$table" -X "$chain" 2>/dev/null || true
    done
  done
  [ ! -f "$dir/forward_policy" ] || iptables -P FORWARD "$(cat "$dir/forward_policy")"
  [ ! -f "$dir/ip_forward" ] || sysctl -qw net.ipv4.ip_forward="$(cat "$dir/ip_forward")"
  # The bridges it made (docker0, kind's br-*), not any that were there before it started.
  if [ -f "$dir/bridges.before" ]; then
    local link
    for link in $(comm -13 "$dir/bridges.before" <(bridges)); do
      case "$link" in docker0|br-*) ip link delete "$link" 2>/dev/null || true ;; esac
    done
  fi
  # Mounts under the exec root (netns files, the containerd's state) and the root itself.
  { grep -o " ${exec_root}[^ ]*" /proc/self/mounts || true; } | sort -r | while read -r mount; do umount -l "$mount" 2>/dev/null || true; done
  rm -rf "$exec_root"
  rm -f "$dir/exec-root"
  local left; left="$(docker_rules)"
  if [ -n "$left" ]; then dlog "left in iptables after stop:"; echo "$left" >&2; return 1; fi
  if [ -f "$dir/forward_policy" ] && [ "$(iptables -S FORWARD | awk '$1 == "-P" { print $3 }')" != "$(cat "$dir/forward_policy")" ]; then
    dlog "the FORWARD policy was not restored"; return 1
  fi
  dlog "stopped; iptables, ip_forward and bridges as before"
}

case "${1:-}" in
  start) shift; docker_start "$@" ;;
  stop) shift; docker_stop "$@" ;;
  env) echo "$2/env" ;;
  *) echo "usage: $0 start DIR [OWNER_PID] | stop DIR | env DIR" >&2; exit 2 ;;
esac
