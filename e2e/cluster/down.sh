#!/usr/bin/env bash
# Tears down the cluster of e2e/cluster/up.sh (same FERRY_CLUSTER_DIR; the rest is read from
# "$FERRY_CLUSTER_DIR/cluster.env"): stops the kubelet, the pods' containers and their shims,
# containerd and the control plane by PID (SIGTERM, then SIGKILL), then any other process left in
# the network namespace; unmounts everything under the state dir, deepest first (pod volumes,
# container rootfs and shm mounts, pod network namespaces, the kubelet's own bind mount);
# deletes the netns and the veth; removes the state dir. Safe to run twice, or on a cluster whose
# up.sh failed half-way. FERRY_CLUSTER_KEEP_LOGS=DIR copies the component logs to DIR first.
# Exits non-zero only if something could not be removed (it says what).
set -uo pipefail
if [ "$(id -u)" -ne 0 ]; then exec sudo -E "$0" "$@"; fi
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$here/lib.sh"
t0=$SECONDS

if [ -z "${FERRY_CLUSTER_LOCKED:-}" ] && [ -d "$(dirname "$dir")" ]; then
  exec 9>"$dir.lock"
  if ! flock -n 9; then
    say "another up.sh or down.sh is working on $dir; waiting for it"
    flock 9
  fi
  # shellcheck source=lib.sh
  . "$here/lib.sh"
fi

if [ ! -e "$dir" ] && [ ! -e "$nspath" ] && ! ip link show "$veth_host" >/dev/null 2>&1; then
  say "not up (no $dir, no netns $netns): nothing to do"
  exit 0
fi

if [ -n "${FERRY_CLUSTER_KEEP_LOGS:-}" ] && [ -d "$logs" ]; then
  mkdir -p "$FERRY_CLUSTER_KEEP_LOGS" && cp -a "$logs/." "$FERRY_CLUSTER_KEEP_LOGS/" &&
    say "logs copied to $FERRY_CLUSTER_KEEP_LOGS"
fi

running() { # PID: exists and is not a zombie
  local s
  s=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1) || return 1
  [ -n "$s" ] && [ "$s" != Z ] && [ "$s" != X ]
}

# stop GRACE PID...: SIGTERM, up to GRACE seconds, then SIGKILL (and up to 5 s more).
stop() {
  local grace=$1 p end left
  shift
  [ $# -gt 0 ] || return 0
  kill -TERM "$@" 2>/dev/null
  end=$((SECONDS + grace))
  while :; do
    left=()
    for p in "$@"; do running "$p" && left+=("$p"); done
    [ ${#left[@]} -gt 0 ] || return 0
    [ $SECONDS -lt $end ] || break
    sleep 0.2
  done
  say "SIGKILL to ${left[*]} (still running ${grace} s after SIGTERM)"
  kill -KILL "${left[@]}" 2>/dev/null
  end=$((SECONDS + 5))
  for p in "${left[@]}"; do
    while running "$p" && [ $SECONDS -lt $end ]; do sleep 0.1; done
  done
}

# descendants PID...: every process below them (children first is not needed: all get SIGKILL).
descendants() {
  local all
  all=$(for s in /proc/[0-9]*/stat; do
    sed -n 's/^\([0-9]*\) (.*) [A-Za-z] \([0-9]*\) .*/\1 \2/p' "$s" 2>/dev/null
  done)
  local frontier=("$@") next p
  while [ ${#frontier[@]} -gt 0 ]; do
    next=()
    for p in "${frontier[@]}"; do
      while read -r child parent; do
        [ "$parent" = "$p" ] && { echo "$child"; next+=("$child"); }
      done <<< "$all"
    done
    frontier=("${next[@]}")
  done
}

# The containerd shims serving this cluster's containerd (their command line names its socket).
our_shims() {
  local c line
  for c in /proc/[0-9]*/cmdline; do
    line=$(tr '\0' ' ' 2>/dev/null < "$c") || continue
    case $line in
      */containerd-shim-runc-v2\ *" -address $sock "*) c=${c#/proc/}; echo "${c%/cmdline}" ;;
    esac
  done
  return 0
}

component_pid() { pid_of "$1" 2>/dev/null || true; }

# 1. The kubelet, so that it restarts nothing.
p=$(component_pid kubelet)
[ -z "$p" ] || { say "stopping kubelet ($p)"; stop 10 "$p"; }

# 2. The pods' containers: through containerd while it runs (runc then removes the containers'
#    cgroups and the shims unmount their rootfs), then whatever is left, by PID.
if [ -n "$(component_pid containerd)" ] && [ -S "$sock" ]; then
  mapfile -t tasks < <(timeout 10 ctr --address "$sock" -n k8s.io tasks ls -q 2>/dev/null)
  if [ ${#tasks[@]} -gt 0 ]; then
    say "removing ${#tasks[@]} container task(s)"
    for t in "${tasks[@]}"; do
      timeout 15 ctr --address "$sock" -n k8s.io tasks delete --force "$t" >/dev/null 2>&1 || true
    done
  fi
fi
mapfile -t shims < <(our_shims)
if [ ${#shims[@]} -gt 0 ]; then
  mapfile -t procs < <(descendants "${shims[@]}")
  if [ ${#procs[@]} -gt 0 ]; then
    say "SIGKILL to ${#procs[@]} leftover container process(es)"
    kill -KILL "${procs[@]}" 2>/dev/null
  fi
  say "stopping ${#shims[@]} containerd shim(s)"
  stop 5 "${shims[@]}"
fi

# 3. containerd and the control plane: the API server's clients first, etcd last (the API
#    server does not finish a graceful shutdown once etcd is gone).
for group in "containerd kube-scheduler kube-controller-manager" kube-apiserver etcd; do
  ps_=()
  for c in $group; do
    p=$(component_pid "$c")
    [ -z "$p" ] || ps_+=("$p")
  done
  [ ${#ps_[@]} -eq 0 ] || { say "stopping $group (${ps_[*]})"; stop 10 "${ps_[@]}"; }
done

# 4. Anything else still in the namespace (e.g. brokers a test started there).
mapfile -t rest < <(pids_in_netns | grep -vx "$$")
if [ ${#rest[@]} -gt 0 ]; then
  names=$(for p in "${rest[@]}"; do printf '%s(%s) ' "$(cat "/proc/$p/comm" 2>/dev/null)" "$p"; done)
  say "stopping processes left in netns $netns: $names"
  stop 5 "${rest[@]}"
fi

# 5. Leftovers outside the state dir: the kubelet's /var/log/containers links to our pod logs,
#    the shims' sockets in /run/containerd/s.
if [ -d /var/log/containers ]; then
  for l in /var/log/containers/*.log; do
    [ -L "$l" ] || continue
    case $(readlink "$l") in "$dir"/*) rm -f "$l" ;; esac
  done
fi
if [ -d "$dir/containerd/state/io.containerd.runtime.v2.task" ]; then
  for a in "$dir"/containerd/state/io.containerd.runtime.v2.task/*/*/address; do
    [ -f "$a" ] || continue
    s=$(sed -n 's|^unix://\(/run/containerd/s/[0-9a-f]*\)$|\1|p' "$a")
    [ -n "$s" ] && [ -S "$s" ] && rm -f "$s"
  done
fi
# Cgroups of containers that runc did not delete (containerd puts them in k8s.io/<id> of each
# hierarchy; empty once their processes are gone).
if [ -d "$dir/containerd/state/io.containerd.runtime.v2.task/k8s.io" ]; then
  for b in "$dir"/containerd/state/io.containerd.runtime.v2.task/k8s.io/*/; do
    id=$(basename "$b")
    [ ${#id} -eq 64 ] || continue
    for cg in /sys/fs/cgroup/*/k8s.io/"$id"; do [ -d "$cg" ] && rmdir "$cg" 2>/dev/null; done
  done
fi

# 6. Mounts under the state dir, deepest first (a few rounds: mounts can be stacked).
for round in 1 2 3 4 5; do
  mapfile -t mnts < <(mounts_under "$dir")
  [ ${#mnts[@]} -gt 0 ] || break
  [ "$round" -gt 1 ] || say "unmounting ${#mnts[@]} mount(s) under $dir"
  for m in "${mnts[@]}"; do
    umount "$m" 2>/dev/null || { [ "$round" -lt 3 ] || umount -l "$m" 2>/dev/null; } || true
  done
done

# 7. The network namespace (its veth end goes with it) and the host's end of the veth.
if [ -e "$nspath" ]; then
  ip netns del "$netns" 2>/dev/null || say "ip netns del $netns failed"
fi
for _ in $(seq 50); do ip link show "$veth_host" >/dev/null 2>&1 || break; sleep 0.1; done
if ip link show "$veth_host" >/dev/null 2>&1; then ip link del "$veth_host" 2>/dev/null || true; fi

# 8. The state dir, only if nothing is mounted under it any more (never delete through a mount).
status=0
mapfile -t mnts < <(mounts_under "$dir")
if [ ${#mnts[@]} -gt 0 ]; then
  echo "ferry: cluster $netns: still mounted under $dir, not removing it:" >&2
  printf '  %s\n' "${mnts[@]}" >&2
  status=1
elif [ -e "$dir" ]; then
  rm -rf --one-file-system "$dir" || status=1
fi
if [ -e "$nspath" ] || ip link show "$veth_host" >/dev/null 2>&1; then
  echo "ferry: cluster $netns: netns $nspath or link $veth_host still present" >&2
  status=1
fi
[ $status -ne 0 ] || say "down in $((SECONDS - t0)) s"
exit $status
