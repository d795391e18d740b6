#!/usr/bin/env bash
# runc for the test run's Docker engine (e2e/docker.sh) on a host whose root does not hold every
# capability the kernel knows: the capabilities a container asks for, narrowed to those this host's
# root has, then Debian's runc, unchanged, with the same arguments.
#
# Why: Docker 20.10 gives a --privileged container every capability the kernel knows (kind's nodes
# are --privileged, and kind runs its commands in them with `docker exec --privileged`). Where the
# host's own bounding set lacks one (on this machine CAP_SYS_RESOURCE: CapBnd 0x1fffeffffff), runc's
# capset fails and the container never starts ("unable to apply caps: operation not permitted"). A
# process cannot be given a capability its parent does not have, so the narrowed set is exactly what
# the container could get here at all. e2e/docker.sh installs this as the engine's default runtime
# only when the host's bounding set lacks a capability the kernel knows; elsewhere runc runs as is.
#
# It edits the OCI config of `runc create|run --bundle DIR` (DIR/config.json) and the process file
# of `runc exec --process FILE`, removing the missing capabilities from every set; nothing else.
set -euo pipefail

RUNC="${SLUICE_RUNC:-/usr/sbin/runc}"
# Capability names by number (linux/capability.h), as OCI specs spell them.
NAMES=(CHOWN DAC_OVERRIDE DAC_READ_SEARCH FOWNER FSETID KILL SETGID SETUID SETPCAP LINUX_IMMUTABLE
  NET_BIND_SERVICE NET_BROADCAST NET_ADMIN NET_RAW IPC_LOCK IPC_OWNER SYS_MODULE SYS_RAWIO SYS_CHROOT
  SYS_PTRACE SYS_PACCT SYS_ADMIN SYS_BOOT SYS_NICE SYS_RESOURCE SYS_TIME SYS_TTY_CONFIG MKNOD LEASE
  AUDIT_WRITE AUDIT_CONTROL SETFCAP MAC_OVERRIDE MAC_ADMIN SYSLOG WAKE_ALARM BLOCK_SUSPEND AUDIT_READ
  PERFMON BPF CHECKPOINT_RESTORE)

# The capabilities this process's bounding set lacks, as a JSON array of "CAP_…" names.
missing_json() {
  local bounding i names=()
  bounding=$((16#$(awk '/^CapBnd:/ { print $2 }' /proc/self/status)))
  for i in "${!NAMES[@]}"; do
    (( (bounding >> i) & 1 )) || names+=("\"CAP_${NAMES[$i]}\"")
  done
  local IFS=,
  echo "[${names[*]}]"
}

# narrow FILE JQ_PATH: remove the missing capabilities from every set under JQ_PATH in FILE.
narrow() {
  local file="$1" path="$2" missing
  [ -f "$file" ] || return 0
  missing="$(missing_json)"
  [ "$missing" != "[]" ] || return 0
  jq --argjson missing "$missing" \
    "if $path then $path |= with_entries(.value |= (if type == \"array\" then . - \$missing else . end)) else . end" \
    "$file" > "$file.narrowed" && mv "$file.narrowed" "$file"
}

command="" bundle="" process=""
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[$i]}" in
    create|run|exec) [ -n "$command" ] || command="${args[$i]}" ;;
    --bundle|-b) bundle="${args[$((i + 1))]:-}" ;;
    --bundle=*) bundle="${args[$i]#--bundle=}" ;;
    --process|-p) process="${args[$((i + 1))]:-}" ;;
    --process=*) process="${args[$i]#--process=}" ;;
  esac
done
case "$command" in
  create|run) narrow "${bundle:-.}/config.json" '.process.capabilities' ;;
  exec) [ -z "$process" ] || narrow "$process" '.capabilities' ;;
esac
exec "$RUNC" "$@"
