#!/usr/bin/env bash
# Builds Ferry's container images without Docker, as OCI image layout tarballs:
#
#   ${out}/ferry-operator-<version>.oci.tar    image ghcr.io/ferry-dev/ferry-operator:<version>
#   ${out}/ferry-forwarder-<version>.oci.tar   image ghcr.io/ferry-dev/ferry-forwarder:<version>
#
# <version> is the workspace version (Cargo.toml). This is the one way Ferry's images are built:
# `make images` here, and the release workflow (.github/workflows/release.yml) on each
# architecture, which pushes these tarballs with skopeo. Load one into containerd (the name
# comes from the tarball, the chart's default image) with
#   ctr -n k8s.io images import ${out}/ferry-forwarder-<version>.oci.tar
# or push it to a registry with
#   skopeo copy oci-archive:${out}/ferry-forwarder-<version>.oci.tar docker://REGISTRY/ferry-dev/ferry-forwarder:<version>
#
# Each image is one layer: the release binary (debug info stripped) at /usr/local/bin/<name>,
# the dynamic loader and the libraries `ldd` lists, copied from this Debian system, CA
# certificates, /etc/passwd and /etc/group with the user nonroot (65532), /etc/nsswitch.conf
# and /tmp. No shell, no package manager; it runs as 65532:65532 with entrypoint
# /usr/local/bin/<name>. e2e/images/oci.py does the work and documents the details.
# Reproducible: the same binaries and system libraries give the same digests (mtimes are
# SOURCE_DATE_EPOCH, default 0).
#
# Usage: e2e/images/build.sh [--out DIR]   (default $FERRY_IMAGES_DIR, else $CARGO_TARGET_DIR/images)
# It first runs `cargo build --release -p ferry-forwarder -p ferry-operator -p ferry-bench -p ferry-e2e` (a
# no-op when up to date; the same packages as `make release`, so that both build with the same
# features and never rebuild each other's output) in CARGO_TARGET_DIR (the Makefile sets a
# per-checkout one; default <repo>/target, cargo's own). With
# FERRY_IMAGES_SKIP_BUILD=1 it packs the release binaries already there instead (e.g. from
# within `cargo test`, which holds the target dir's lock). Needs python3, ldd, objcopy and
# dpkg-query (Debian).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
# The target dir is the checkout's own (the Makefile's, else cargo's default), and so are the
# images: packing another checkout's binaries would test a build that is not this one.
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$repo/target}
out=${FERRY_IMAGES_DIR:-$CARGO_TARGET_DIR/images}

usage() { sed -n 's/^# \{0,1\}//; /^Usage:/,/dpkg-query/p' "$0"; }
while [ $# -gt 0 ]; do
  case $1 in
    --out) [ $# -ge 2 ] || { echo "ferry: images: --out needs a directory" >&2; exit 2; }; out=$2; shift 2 ;;
    --out=*) out=${1#--out=}; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "ferry: images: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done

cargo=${CARGO:-cargo}
python=${PYTHON:-python3}
binaries=(ferry-operator ferry-forwarder)

if [ "${FERRY_IMAGES_SKIP_BUILD:-}" = 1 ]; then
  echo "ferry: images: FERRY_IMAGES_SKIP_BUILD=1: packing the release binaries in $CARGO_TARGET_DIR as they are"
else
  (cd "$repo" && "$cargo" build --release -p ferry-forwarder -p ferry-operator -p ferry-bench -p ferry-e2e)
fi
for b in "${binaries[@]}"; do
  if [ ! -x "$CARGO_TARGET_DIR/release/$b" ]; then
    echo "ferry: images: no release binary $CARGO_TARGET_DIR/release/$b; build it with" >&2
    echo "  make release  (or run this script without FERRY_IMAGES_SKIP_BUILD)" >&2
    exit 1
  fi
done

mkdir -p "$out"
metadata=$(mktemp)
trap 'rm -f "$metadata"' EXIT
"$cargo" metadata --no-deps --format-version 1 --manifest-path "$repo/Cargo.toml" > "$metadata"
version=$("$python" -c 'import json, sys
print(next(p["version"] for p in json.load(open(sys.argv[1]))["packages"] if p["name"] == "ferry-forwarder"))' "$metadata")

for b in "${binaries[@]}"; do
  "$python" "$here/oci.py" image --binary "$CARGO_TARGET_DIR/release/$b" --name "$b" \
    --metadata "$metadata" --out "$out/$b-$version.oci.tar"
done
echo "ferry: images: load into containerd with: ctr -n k8s.io images import $out/<name>-$version.oci.tar"
