#!/usr/bin/env bash
# Imports an image tarball into the containerd of the cluster of e2e/cluster/up.sh (same
# FERRY_CLUSTER_DIR), in the `k8s.io` namespace the kubelet uses, so pods can run it with
# `imagePullPolicy: Never` (or IfNotPresent). Accepts what `ctr images import` accepts: an OCI
# image layout tarball whose index.json names the image with the `io.containerd.image.name`
# annotation, or a `docker save` tarball. Extra arguments go to `ctr images import`
# (e.g. --base-name, --index-name for OCI tarballs without that annotation).
#
#   e2e/cluster/import-image.sh IMAGE.tar [ctr import flags...]
set -euo pipefail
if [ "$(id -u)" -ne 0 ]; then exec sudo -E "$0" "$@"; fi
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$here/lib.sh"
[ $# -ge 1 ] || die "usage: $0 IMAGE.tar [ctr images import flags...]"
tarball=$1
shift
[ -f "$tarball" ] || die "no such file: $tarball"
[ -S "$sock" ] || die "no containerd socket at $sock: is the cluster up ($here/up.sh)?"
ctr_ images import "$@" "$tarball"
