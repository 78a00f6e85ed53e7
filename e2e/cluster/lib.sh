# Sourced by e2e/cluster/{up,down,import-image}.sh: the cluster's names, addresses and paths, and
# shared helpers. Every setting can be overridden by the environment (see README.md); down.sh and
# import-image.sh read the values up.sh used from "$dir/cluster.env".
# shellcheck shell=bash

cluster_lib_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
e2e_dir=$(dirname "$cluster_lib_dir")
cache=${FERRY_CACHE:-$HOME/.cache/ferry}
k8s_version=$(tr -d ' \t\r\n' < "$e2e_dir/k8s/VERSION")
k8s_bin="$cache/k8s-$k8s_version/bin"
images_cache="$cache/cluster/images"

dir=${FERRY_CLUSTER_DIR:-/tmp/ferry-cluster}
dir=${dir%/}
netns=${FERRY_CLUSTER_NETNS:-ferry}
# A /24 shared by the host end of the veth (.1) and the namespace's end (.2): the node address,
# where the API server and every server started in the namespace listen.
net=${FERRY_CLUSTER_NET:-10.77.0}
# The pods' /24 on the CNI bridge inside the namespace (gateway .1, pods from .2).
pod_net=${FERRY_CLUSTER_POD_NET:-10.78.0}
# Service ClusterIPs (a x.y.z.0/N range). There is no kube-proxy: only the `kubernetes` Service's
# first IP works, because it is also put on the namespace's loopback and the API server listens
# on :443 there.
svc_cidr=${FERRY_CLUSTER_SERVICE_CIDR:-10.96.0.0/24}

host_ip=$net.1
node_ip=$net.2
pod_cidr=$pod_net.0/24
pod_gw=$pod_net.1
svc_ip=${svc_cidr%.*}.1
node_name=${FERRY_CLUSTER_NODE:-$netns}
nspath=/var/run/netns/$netns
if [ ${#netns} -le 12 ]; then veth_host="$netns-h"; else veth_host="fv-$(printf %s "$netns" | sha1sum | cut -c1-12)"; fi
api_port=443

# Inside the namespace (its own loopback, so fixed ports).
etcd_port=2379
etcd_peer_port=2380
kcm_port=10257
sched_port=10259
kubelet_healthz_port=10248

sock="$dir/containerd/containerd.sock"
# containerd's registry hosts directory (config_path): <host:port>/hosts.toml.
registry_hosts="$dir/containerd/certs.d"
kubeconfig="$dir/kubeconfig"
logs="$dir/logs"
pids="$dir/pids"
components=(etcd kube-apiserver kube-controller-manager kube-scheduler containerd kubelet)

# Values up.sh recorded win over the defaults above (down.sh must undo what up.sh did).
if [ -f "$dir/cluster.env" ]; then
  # shellcheck disable=SC1091
  . "$dir/cluster.env"
fi

say() { printf 'ferry: cluster %s: %s\n' "$netns" "$*"; }
die() { printf 'ferry: cluster %s: %s\n' "$netns" "$*" >&2; exit 1; }

# kubectl as the cluster admin, from the host.
kc() { kubectl --kubeconfig "$kubeconfig" "$@"; }

# Runs CMD inside the cluster's network namespace. Not `ip netns exec`: that remounts /sys and
# hides the cgroup mounts from the kubelet.
in_ns() { nsenter --net="$nspath" -- "$@"; }

ctr_() { ctr --address "$sock" -n k8s.io "$@"; }

# pid_of NAME: the recorded PID of a component if that process is still this component (its
# argv[0] is the recorded binary; zombies have an empty cmdline), else nothing and status 1.
pid_of() {
  local f="$pids/$1" pid exe argv0
  [ -f "$f" ] || return 1
  read -r pid exe < "$f" || return 1
  [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 1
  argv0=$(tr '\0' '\n' 2>/dev/null < "/proc/$pid/cmdline" | head -n1) || return 1
  [ "$argv0" = "$exe" ] || return 1
  echo "$pid"
}

# The inode of the cluster's network namespace (to find every process inside it), or nothing.
netns_inode() { [ -e "$nspath" ] && stat -L -c %i "$nspath" 2>/dev/null; }

# Every PID whose network namespace is the cluster's.
pids_in_netns() {
  local ino p
  ino=$(netns_inode) || return 0
  [ -n "$ino" ] || return 0
  for p in /proc/[0-9]*; do
    [ "$(stat -L -c %i "$p/ns/net" 2>/dev/null)" = "$ino" ] && echo "${p#/proc/}"
  done
  return 0
}

# Mount points at or under $1, deepest first (octal escapes of /proc/self/mountinfo decoded).
mounts_under() {
  local root=$1
  awk -v root="$root" '{
      p = $5
      while (match(p, /\\[0-7][0-7][0-7]/)) {
        c = substr(p, RSTART + 1, 3)
        p = substr(p, 1, RSTART - 1) sprintf("%c", (substr(c,1,1) * 64) + (substr(c,2,1) * 8) + substr(c,3,1)) substr(p, RSTART + 4)
      }
      if (p == root || index(p, root "/") == 1) print p
    }' /proc/self/mountinfo | LC_ALL=C sort -r -u
}

# oci_tar OUT NAME ROOTFS CONFIG_JSON: packs ROOTFS as a one-layer OCI image layout tarball
# (oci-layout, index.json naming the image NAME, blobs/sha256/{layer,config,manifest}) that
# `ctr images import` accepts. CONFIG_JSON is the image config's "config" object.
oci_tar() {
  local out=$1 name=$2 rootfs=$3 cfg=$4 work arch ld lsz cd csz md msz
  arch=$(dpkg --print-architecture 2>/dev/null || echo amd64)
  work=$(mktemp -d)
  mkdir -p "$work/blobs/sha256"
  tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$rootfs" -cf "$work/layer" .
  ld=$(sha256sum "$work/layer" | cut -d' ' -f1); lsz=$(stat -c %s "$work/layer")
  mv "$work/layer" "$work/blobs/sha256/$ld"
  printf '{"architecture":"%s","os":"linux","config":%s,"rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}' \
    "$arch" "$cfg" "$ld" > "$work/config"
  cd=$(sha256sum "$work/config" | cut -d' ' -f1); csz=$(stat -c %s "$work/config")
  mv "$work/config" "$work/blobs/sha256/$cd"
  printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:%s","size":%s},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"sha256:%s","size":%s}]}' \
    "$cd" "$csz" "$ld" "$lsz" > "$work/manifest"
  md=$(sha256sum "$work/manifest" | cut -d' ' -f1); msz=$(stat -c %s "$work/manifest")
  mv "$work/manifest" "$work/blobs/sha256/$md"
  printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%s,"platform":{"architecture":"%s","os":"linux"},"annotations":{"io.containerd.image.name":"%s","org.opencontainers.image.ref.name":"%s"}}]}' \
    "$md" "$msz" "$arch" "$name" "${name##*:}" > "$work/index.json"
  echo '{"imageLayoutVersion":"1.0.0"}' > "$work/oci-layout"
  mkdir -p "$(dirname "$out")"
  tar -C "$work" -cf "$out.tmp" oci-layout index.json blobs
  mv -f "$out.tmp" "$out"
  rm -rf "$work"
}
