#!/usr/bin/env bash
# Brings up a real single-node Kubernetes cluster with no Docker engine: etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, containerd (+ runc) and a kubelet, every one of them
# inside a network namespace this script creates (default `ferry`, joined to the host by a veth
# pair: host 10.77.0.1, namespace/node 10.77.0.2). Pods get addresses on a CNI bridge
# (10.78.0.0/24) inside that namespace. Writes an admin kubeconfig usable from the host to
# $FERRY_CLUSTER_DIR/kubeconfig (default /tmp/ferry-cluster), waits until the node is Ready and a
# test pod runs on the bridge, then prints how to use the cluster. See README.md.
#
# Idempotent: when the cluster is already up it says so and exits 0; leftovers of a cluster that
# is only partly running are torn down (down.sh) first. Builds (kubelet & co., the pause and
# busybox images) are cached in ${FERRY_CACHE:-~/.cache/ferry}. Needs root (re-runs itself
# with sudo otherwise).
set -euo pipefail
if [ "$(id -u)" -ne 0 ]; then exec sudo -E "$0" "$@"; fi
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$here/lib.sh"
# shellcheck source=../k8s/control-plane.sh
. "$e2e_dir/k8s/control-plane.sh"
t0=$SECONDS

mkdir -p "$(dirname "$dir")"
exec 9>"$dir.lock"
if ! flock -n 9; then
  say "another up.sh or down.sh is working on $dir; waiting for it"
  flock 9
fi

print_usage() {
  local env_prefix=""
  [ "$dir" = /tmp/ferry-cluster ] || env_prefix="FERRY_CLUSTER_DIR=$dir "
  cat <<EOF
  export KUBECONFIG=$kubeconfig
  kubectl get nodes -o wide          # node $node_name at $node_ip (API server https://$node_ip:$api_port)
Pods run on the CNI bridge $pod_cidr (no NAT): a server started inside the namespace with
  nsenter --net=$nspath CMD
and listening on $node_ip (or 0.0.0.0) is reached from pods at $node_ip. The host reaches
$node_ip and the pod IPs directly. No kube-proxy: of the Service IPs only $svc_ip:443 (the
API server, for in-cluster clients) answers.
Images (imagePullPolicy: Never): $pause_image, $busybox_image
  add more: ${env_prefix}$here/import-image.sh IMAGE.tar
Logs: $logs/   Tear down: ${env_prefix}$here/down.sh
EOF
}

# alive NAME: the component's process exists and is not a zombie.
alive() {
  local pid state
  read -r pid _ < "$pids/$1" 2>/dev/null || return 1
  state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) || return 1
  [ -n "$state" ] && [ "$state" != Z ] && [ "$state" != X ]
}

node_ready() {
  [ "$(kc get node "$node_name" -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" = True ]
}

cluster_up() {
  local c
  [ -f "$dir/cluster.env" ] || return 1
  for c in "${components[@]}"; do pid_of "$c" >/dev/null || return 1; done
  [ "$(kc get --raw /readyz --request-timeout=5s 2>/dev/null)" = ok ] && node_ready
}

if cluster_up; then
  say "already up (state in $dir)"
  print_usage
  exit 0
fi
if [ -e "$dir" ] || [ -e "$nspath" ] || ip link show "$veth_host" >/dev/null 2>&1; then
  say "found a cluster in $dir / netns $netns that is not (fully) running; tearing it down first"
  FERRY_CLUSTER_LOCKED=1 bash "$here/down.sh"
  # Back to this run's settings (the old cluster.env is gone).
  # shellcheck source=lib.sh
  . "$here/lib.sh"
fi

# --- Packages ---------------------------------------------------------------------------------
have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ] || [ -x "/sbin/$1" ]; }
need=()
for bin_pkg in containerd:containerd ctr:containerd runc:runc ip:iproute2 nsenter:util-linux \
               gcc:gcc curl:curl openssl:openssl sysctl:procps; do
  have "${bin_pkg%%:*}" || need+=("${bin_pkg#*:}")
done
for plugin in bridge host-local loopback; do
  [ -x "/usr/lib/cni/$plugin" ] || { need+=(containernetworking-plugins); break; }
done
for pkg in libc6-dev busybox-static; do dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg"); done
if [ ${#need[@]} -gt 0 ]; then
  mapfile -t need < <(printf '%s\n' "${need[@]}" | sort -u)
  say "installing Debian packages: ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  # A system-wide containerd is of no use here (this cluster runs its own).
  if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet containerd 2>/dev/null; then
    systemctl disable --now containerd >/dev/null 2>&1 || true
  fi
fi
command -v kubectl >/dev/null 2>&1 || die "kubectl is not on PATH"
export PATH="$PATH:/usr/sbin:/sbin"

# --- Binaries and images (cached) ---------------------------------------------------------------
bash "$e2e_dir/k8s/build.sh"

pause_image="ferry.local/pause:$k8s_version"
pause_tar="$images_cache/pause-$k8s_version.tar"
if [ ! -f "$pause_tar" ]; then
  src="$cache/go/pkg/mod/k8s.io/kubernetes@$k8s_version/build/pause/linux/pause.c"
  [ -f "$src" ] || die "no $src (the kubernetes module should be in the module cache after e2e/k8s/build.sh)"
  say "building the pause image $pause_image from kubernetes' build/pause/linux/pause.c"
  rootfs=$(mktemp -d); chmod 755 "$rootfs"
  gcc -Os -Wall -Werror -static -DVERSION="$k8s_version-ferry" -o "$rootfs/pause" "$src"
  strip "$rootfs/pause"
  oci_tar "$pause_tar" "$pause_image" "$rootfs" '{"Entrypoint":["/pause"],"User":"65535:65535"}'
  rm -rf "$rootfs"
fi
busybox_version=$(dpkg-query -W -f='${Version}' busybox-static | sed 's/^[0-9]*://; s/[-+~].*//')
busybox_image="ferry.local/busybox:$busybox_version"
busybox_tar="$images_cache/busybox-$busybox_version.tar"
if [ ! -f "$busybox_tar" ]; then
  say "building the image $busybox_image from Debian's busybox-static (sh, nc, wget, ... for test pods)"
  rootfs=$(mktemp -d); chmod 755 "$rootfs"
  mkdir -p "$rootfs/bin" "$rootfs/tmp" "$rootfs/etc"
  chmod 1777 "$rootfs/tmp"
  cp /bin/busybox "$rootfs/bin/busybox"
  for applet in $(/bin/busybox --list); do
    [ "$applet" = busybox ] || ln -s busybox "$rootfs/bin/$applet"
  done
  printf 'root:x:0:0:root:/:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n' > "$rootfs/etc/passwd"
  printf 'root:x:0:\nnobody:x:65534:\n' > "$rootfs/etc/group"
  oci_tar "$busybox_tar" "$busybox_image" "$rootfs" '{"Env":["PATH=/bin"],"Cmd":["sh"]}'
  rm -rf "$rootfs"
fi

# --- State dir, keys, configuration -------------------------------------------------------------
[[ $node_name =~ ^[a-z0-9]([-a-z0-9]*[a-z0-9])?$ ]] || die "node name '$node_name' is not a DNS label (set FERRY_CLUSTER_NODE)"
for cidr in "$net.0/24" "$pod_cidr"; do
  if [ -n "$(ip -o route show "$cidr" 2>/dev/null)" ] || ip -o addr show | grep -q " inet ${cidr%.*}\."; then
    die "$cidr is already routed or assigned on this host (another cluster? set FERRY_CLUSTER_NET / FERRY_CLUSTER_POD_NET)"
  fi
done
mkdir -p "$dir" "$logs" "$pids" "$dir/containerd" "$registry_hosts" "$dir/cni/net.d" "$dir/cni/networks" \
  "$dir/kubelet" "$dir/pod-logs"
# The control plane's settings for e2e/k8s/control-plane.sh (its flags, keys and certificates).
export CP_DIR=$dir CP_ETCD_PORT=$etcd_port CP_ETCD_PEER_PORT=$etcd_peer_port CP_API_BIND=0.0.0.0 \
  CP_API_ADVERTISE=$node_ip CP_API_PORT=$api_port CP_SERVICE_CIDR=$svc_cidr \
  CP_KUBECONFIG=$kubeconfig CP_KCM_PORT=$kcm_port CP_SCHED_PORT=$sched_port
cp_prepare
cat > "$dir/cluster.env" <<EOF
netns=$netns
nspath=$nspath
veth_host=$veth_host
net=$net
host_ip=$host_ip
node_ip=$node_ip
pod_net=$pod_net
pod_cidr=$pod_cidr
pod_gw=$pod_gw
svc_cidr=$svc_cidr
svc_ip=$svc_ip
api_port=$api_port
node_name=$node_name
pause_image=$pause_image
busybox_image=$busybox_image
k8s_version=$k8s_version
EOF

admin_token=$(openssl rand -hex 16)
node_token=$(openssl rand -hex 16)
printf '%s,ferry-admin,ferry-admin,"system:masters"\n%s,system:node:%s,system:node:%s,"system:nodes"\n' \
  "$admin_token" "$node_token" "$node_name" "$node_name" > "$dir/pki/tokens.csv"

cat > "$dir/containerd/config.toml" <<EOF
version = 2
root = "$dir/containerd/root"
state = "$dir/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs"]

[grpc]
  address = "$sock"

[ttrpc]
  address = "$sock.ttrpc"

[plugins]
  [plugins."io.containerd.internal.v1.opt"]
    path = "$dir/containerd/opt"
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "$pause_image"
    # This machine refuses negative oom_score_adj values.
    restrict_oom_score_adj = true
    disable_apparmor = true
    # Pod network namespaces under the state dir, not /var/run/netns.
    netns_mounts_under_state_dir = true
    [plugins."io.containerd.grpc.v1.cri".containerd]
      snapshotter = "overlayfs"
      default_runtime_name = "runc"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
          SystemdCgroup = false
          Root = "$dir/runc"
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "/usr/lib/cni"
      conf_dir = "$dir/cni/net.d"
      max_conf_num = 1
    # Per-registry settings (<host:port>/hosts.toml: its CA, mirrors), read at each pull, so a
    # test can add a registry to a running cluster.
    [plugins."io.containerd.grpc.v1.cri".registry]
      config_path = "$registry_hosts"
EOF

cat > "$dir/cni/net.d/10-ferry.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "ferry",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "cni0",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [[{ "subnet": "$pod_cidr", "gateway": "$pod_gw" }]],
        "routes": [{ "dst": "0.0.0.0/0" }],
        "dataDir": "$dir/cni/networks"
      }
    }
  ]
}
EOF

cat > "$dir/kubelet-config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
containerRuntimeEndpoint: unix://$sock
# cgroup v1 on this machine, no systemd, no swap accounting, no QoS cgroups.
cgroupDriver: cgroupfs
failCgroupV1: false
cgroupsPerQOS: false
enforceNodeAllocatable: []
failSwapOn: false
evictionHard: {}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
# Mounted ConfigMaps refresh with the kubelet's sync (default 1 min): a test cluster should see
# an edited config within seconds, as a forwarder's live reload would in production after it.
syncFrequency: 10s
makeIPTablesUtilChains: false
address: 0.0.0.0
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $kubelet_healthz_port
# Only the API server (in the same namespace) talks to the kubelet; it sends no client cert.
authentication:
  anonymous:
    enabled: true
  webhook:
    enabled: false
authorization:
  mode: AlwaysAllow
rotateCertificates: false
serverTLSBootstrap: false
resolvConf: /etc/resolv.conf
podLogsDir: $dir/pod-logs
volumePluginDir: $dir/kubelet/volume-plugins
serializeImagePulls: false
EOF

# --- Network namespace ---------------------------------------------------------------------------
say "creating netns $netns: $veth_host $host_ip/24 <-> eth0 $node_ip/24 (pods $pod_cidr)"
ip netns add "$netns"
peer="fvp$$"
ip link add "$veth_host" type veth peer name "$peer"
ip link set "$peer" netns "$netns"
ip -n "$netns" link set "$peer" name eth0
ip addr add "$host_ip/24" dev "$veth_host"
ip link set "$veth_host" up
ip -n "$netns" link set lo up
ip -n "$netns" addr add "$node_ip/24" dev eth0
ip -n "$netns" link set eth0 up
ip -n "$netns" route add default via "$host_ip"
# The `kubernetes` Service IP is local in the namespace, so in-cluster clients reach the API
# server (which listens on :443 on every address of the namespace) without kube-proxy.
ip -n "$netns" addr add "$svc_ip/32" dev lo
# Pods reach the host (and the host the pods) through the namespace.
in_ns sysctl -qw net.ipv4.ip_forward=1
ip route add "$pod_cidr" via "$node_ip" dev "$veth_host"

# --- Components ------------------------------------------------------------------------------------
# start NAME BINARY ARGS...: runs it in the namespace, detached (own session, no inherited fds),
# logging to $logs/NAME.log; records "PID BINARY" in $pids/NAME.
start() {
  local name=$1 exe=$2
  shift
  setsid nsenter --net="$nspath" -- "$@" </dev/null >>"$logs/$name.log" 2>&1 9>&- &
  echo "$! $exe" > "$pids/$name"
}

# start_component NAME: a control-plane component, with the flags control-plane.sh gives it.
start_component() {
  local args
  mapfile -d '' args < <(cp_args "$1")
  [ ${#args[@]} -gt 0 ] || fail "control-plane.sh gave no arguments for $1"
  start "$1" "$k8s_bin/$1" "${args[@]}"
}

fail_hook=
fail() { # MESSAGE [COMPONENT]
  echo "ferry: cluster $netns: $1" >&2
  [ -z "$fail_hook" ] || $fail_hook >&2 || true
  if [ -n "${2:-}" ] && [ -f "$logs/$2.log" ]; then
    echo "--- last lines of $logs/$2.log:" >&2
    tail -n 25 "$logs/$2.log" >&2
  fi
  echo "ferry: cluster $netns: left as is for inspection (logs in $logs/); remove it with $here/down.sh" >&2
  exit 1
}

# wait_for SECONDS WHAT COMPONENT CMD...: until CMD succeeds; fails early if COMPONENT exits.
wait_for() {
  local timeout=$1 what=$2 comp=$3 end
  shift 3
  end=$((SECONDS + timeout))
  until "$@" >/dev/null 2>&1; do
    if [ -n "$comp" ] && ! alive "$comp"; then fail "$comp exited while waiting for $what" "$comp"; fi
    [ $SECONDS -lt $end ] || fail "$what not ready within $timeout s" "$comp"
    sleep 0.25
  done
}

ns_get() { [ "$(in_ns curl -fsS --max-time 2 "$@" 2>/dev/null)" = ok ]; }
etcd_ok() { in_ns curl -fsS --max-time 2 "http://127.0.0.1:$etcd_port/health" 2>/dev/null | grep -q '"health":"true"'; }
readyz_ok() { [ "$(kc get --raw /readyz --request-timeout=3s 2>/dev/null)" = ok ]; }

say "starting etcd and containerd"
start_component etcd
start containerd "$(command -v containerd)" --config "$dir/containerd/config.toml"
wait_for 30 "etcd /health" etcd etcd_ok

say "starting kube-apiserver on https://$node_ip:$api_port"
start_component kube-apiserver
wait_for 60 "kube-apiserver serving certificate" kube-apiserver cp_extract_ca
CP_TOKEN=$admin_token cp_kubeconfig "$kubeconfig" "$netns" ferry-admin
CP_TOKEN=$node_token cp_kubeconfig "$dir/kubelet.kubeconfig" "$netns" "system:node:$node_name"

wait_for 30 "containerd" containerd ctr_ version
for tar in "$pause_tar" "$busybox_tar"; do
  if ! err=$(ctr_ images import "$tar" 2>&1 >/dev/null); then
    echo "$err" >&2
    fail "importing $tar failed" containerd
  fi
done
wait_for 90 "kube-apiserver /readyz (from the host, through $veth_host)" kube-apiserver readyz_ok

say "starting kube-controller-manager, kube-scheduler and kubelet"
start_component kube-controller-manager
start_component kube-scheduler
start kubelet "$k8s_bin/kubelet" \
  --config="$dir/kubelet-config.yaml" --kubeconfig="$dir/kubelet.kubeconfig" \
  --root-dir="$dir/kubelet" --hostname-override="$node_name" --node-ip="$node_ip"
wait_for 60 "kube-controller-manager /healthz" kube-controller-manager ns_get -k "https://127.0.0.1:$kcm_port/healthz"
wait_for 60 "kube-scheduler /healthz" kube-scheduler ns_get -k "https://127.0.0.1:$sched_port/healthz"
wait_for 60 "kubelet /healthz" kubelet ns_get "http://127.0.0.1:$kubelet_healthz_port/healthz"
wait_for 120 "node $node_name Ready" kubelet node_ready
wait_for 60 "ServiceAccount default/default" kube-controller-manager kc get serviceaccount default -n default

# --- Smoke test: a pod on the bridge -------------------------------------------------------------
say "node $node_name Ready; checking that a pod runs on the bridge network"
kc apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: ferry-smoke
  namespace: default
spec:
  terminationGracePeriodSeconds: 2
  containers:
  - name: pause
    image: $pause_image
    imagePullPolicy: Never
EOF
pod_running() { [ "$(kc get pod ferry-smoke -o 'jsonpath={.status.phase}' 2>/dev/null)" = Running ]; }
fail_hook="kc describe pod ferry-smoke"
wait_for 120 "pod ferry-smoke Running" kubelet pod_running
pod_ip=$(kc get pod ferry-smoke -o 'jsonpath={.status.podIP}')
case $pod_ip in
  "$pod_net".*) ;;
  *) fail "the smoke-test pod got IP '$pod_ip', not one in $pod_cidr" containerd ;;
esac
kc delete pod ferry-smoke --wait=true --timeout=60s >/dev/null

say "up in $((SECONDS - t0)) s: Kubernetes $k8s_version, node $node_name Ready (smoke-test pod ran at $pod_ip)"
print_usage
