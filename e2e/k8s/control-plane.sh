#!/usr/bin/env bash
# How a test control plane is started: the one definition of the flags of etcd, kube-apiserver,
# kube-controller-manager and kube-scheduler, and of the keys, certificates and kubeconfigs they
# share. Two launchers use it:
#   - the loopback fixture (e2e/src/kube.rs) runs `control-plane.sh COMMAND` and spawns the
#     components itself, tied to the test thread;
#   - the kubelet cluster (e2e/cluster/up.sh) sources this file and starts them, detached, in
#     its network namespace.
#
# Commands (also functions, when sourced):
#   prepare              creates the layout below and the service-account key
#   args COMPONENT       COMPONENT's command-line arguments, each ended by a NUL byte
#   extract-ca           writes the CA of the API server's self-signed certificate to pki/ca.crt
#                        (fails until the API server has written its certificate)
#   kubeconfig FILE NAME USER [NAMESPACE]
#                        writes a kubeconfig for USER, whose token is in $CP_TOKEN (never on a
#                        command line); NAME names its cluster and context, NAMESPACE (default
#                        `default`) is the context's
#
# Layout under $CP_DIR:
#   etcd/                       etcd's data
#   pki/service-account.key     signs (kube-apiserver) and verifies service-account tokens
#   pki/tokens.csv              static bearer tokens; written by the caller, who chooses the users
#   pki/apiserver/              the API server's serving certificate, self-signed by the server
#                               itself: "leaf, then its CA", valid for the advertised address
#   pki/ca.crt                  that CA (extract-ca), trusted by every kubeconfig and the pods
#   pki/kcm/, pki/scheduler/    the serving certificates kube-controller-manager and
#                               kube-scheduler generate for their /healthz
#
# Settings (environment): CP_DIR; CP_ETCD_PORT, CP_ETCD_PEER_PORT (etcd on 127.0.0.1);
# CP_API_BIND, CP_API_ADVERTISE, CP_API_PORT (the API server); CP_SERVICE_CIDR; CP_KUBECONFIG (the
# admin kubeconfig kube-controller-manager and kube-scheduler use); CP_KCM_PORT, CP_SCHED_PORT
# (their /healthz on 127.0.0.1).
# shellcheck shell=bash

# The issuer in-cluster clients see in their service-account tokens.
CP_SERVICE_ACCOUNT_ISSUER=https://kubernetes.default.svc.cluster.local

cp_prepare() {
  mkdir -p "$CP_DIR/etcd" "$CP_DIR/pki/apiserver" "$CP_DIR/pki/kcm" "$CP_DIR/pki/scheduler"
  chmod 700 "$CP_DIR/pki" "$CP_DIR/etcd"
  openssl genrsa -out "$CP_DIR/pki/service-account.key" 2048 2>/dev/null
}

cp_args() { # COMPONENT
  case $1 in
    etcd)
      printf '%s\0' --name=ferry --data-dir="$CP_DIR/etcd" \
        --listen-client-urls="http://127.0.0.1:$CP_ETCD_PORT" \
        --advertise-client-urls="http://127.0.0.1:$CP_ETCD_PORT" \
        --listen-peer-urls="http://127.0.0.1:$CP_ETCD_PEER_PORT" \
        --initial-advertise-peer-urls="http://127.0.0.1:$CP_ETCD_PEER_PORT" \
        --initial-cluster="ferry=http://127.0.0.1:$CP_ETCD_PEER_PORT" \
        --unsafe-no-fsync --log-level=warn
      ;;
    kube-apiserver)
      printf '%s\0' --etcd-servers="http://127.0.0.1:$CP_ETCD_PORT" \
        --bind-address="$CP_API_BIND" --advertise-address="$CP_API_ADVERTISE" \
        --secure-port="$CP_API_PORT" --cert-dir="$CP_DIR/pki/apiserver" \
        --token-auth-file="$CP_DIR/pki/tokens.csv" \
        --authorization-mode=Node,RBAC --allow-privileged=true \
        --service-account-key-file="$CP_DIR/pki/service-account.key" \
        --service-account-signing-key-file="$CP_DIR/pki/service-account.key" \
        --service-account-issuer="$CP_SERVICE_ACCOUNT_ISSUER" \
        --service-cluster-ip-range="$CP_SERVICE_CIDR" \
        --kubelet-preferred-address-types=InternalIP --profiling=false
      ;;
    kube-controller-manager)
      # No --authentication-kubeconfig: the delegated authentication would wait forever for the
      # kube-system/extension-apiserver-authentication ConfigMap, which this API server (no
      # client CA) never writes. /healthz is then served to anonymous requests.
      printf '%s\0' --kubeconfig="$CP_KUBECONFIG" \
        --bind-address=127.0.0.1 --secure-port="$CP_KCM_PORT" --cert-dir="$CP_DIR/pki/kcm" \
        --controllers='*' --use-service-account-credentials=false --leader-elect=false \
        --service-account-private-key-file="$CP_DIR/pki/service-account.key" \
        --root-ca-file="$CP_DIR/pki/ca.crt" \
        --service-cluster-ip-range="$CP_SERVICE_CIDR" --profiling=false
      ;;
    kube-scheduler)
      printf '%s\0' --kubeconfig="$CP_KUBECONFIG" --leader-elect=false \
        --bind-address=127.0.0.1 --secure-port="$CP_SCHED_PORT" \
        --cert-dir="$CP_DIR/pki/scheduler" --profiling=false
      ;;
    *)
      echo "control-plane.sh: no component '$1' (etcd, kube-apiserver, kube-controller-manager, kube-scheduler)" >&2
      return 2
      ;;
  esac
}

cp_extract_ca() {
  local bundle="$CP_DIR/pki/apiserver/apiserver.crt"
  [ "$(grep -c -- '-----END CERTIFICATE-----' "$bundle" 2>/dev/null)" -ge 2 ] || return 1
  awk '/-----BEGIN CERTIFICATE-----/ { n++ } n == 2' "$bundle" > "$CP_DIR/pki/ca.crt.tmp"
  mv -f "$CP_DIR/pki/ca.crt.tmp" "$CP_DIR/pki/ca.crt"
}

cp_kubeconfig() { # FILE NAME USER [NAMESPACE] (token in $CP_TOKEN)
  local file=$1 name=$2 user=$3 namespace=${4:-default}
  : "${CP_TOKEN:?CP_TOKEN must hold the token of USER}"
  (
    umask 077
    cat > "$file.tmp" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: $name
  cluster:
    server: https://$CP_API_ADVERTISE:$CP_API_PORT
    certificate-authority-data: $(base64 -w0 < "$CP_DIR/pki/ca.crt")
users:
- name: $user
  user:
    token: $CP_TOKEN
contexts:
- name: $name
  context:
    cluster: $name
    user: $user
    namespace: $namespace
current-context: $name
EOF
  )
  mv -f "$file.tmp" "$file"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -euo pipefail
  command=${1:-}
  shift || true
  case $command in
    prepare) cp_prepare ;;
    args) cp_args "$@" ;;
    extract-ca) cp_extract_ca ;;
    kubeconfig) cp_kubeconfig "$@" ;;
    *)
      echo "usage: control-plane.sh prepare | args COMPONENT | extract-ca | kubeconfig FILE NAME USER [NAMESPACE]" >&2
      exit 2
      ;;
  esac
fi
