#!/usr/bin/env python3
"""Lays out the root filesystem of a Ferry container image and writes it as an OCI image.

    oci.py image --binary B --name N --metadata CARGO_METADATA_JSON --out FILE.oci.tar [--epoch S]

`image` (used by e2e/images/build.sh, locally and in the release workflow) writes an OCI image
layout tarball, as `ctr images import` and `skopeo copy oci-archive:` take it, without Docker:
`oci-layout`, `index.json` naming the image (annotations `io.containerd.image.name` =
ghcr.io/ferry-dev/N:VERSION, where releases publish it, and `org.opencontainers.image.ref.name`
= VERSION), and in `blobs/sha256/` one gzip layer, the image config and the manifest.

The root filesystem holds only what the binary needs, taken from this (Debian) system:
  - /usr/local/bin/N: the binary with its debug info stripped (`objcopy --strip-debug`: the
    symbol table stays, so backtraces keep function names; the unstripped binary in the target
    dir has the same build id, for symbolizing): here 123 MB -> 17-21 MB.
  - the dynamic loader and every library `ldd` lists, at their paths here, with the symlinks on
    the way (on Debian 12: /lib -> usr/lib, /lib64 -> usr/lib64, libz.so.1 -> libz.so.1.2.13).
    Nothing is dlopen()ed: glibc >= 2.34 has the `files` and `dns` NSS services built in.
  - /etc/ssl/certs/ca-certificates.crt (Debian's ca-certificates bundle; SSL_CERT_FILE points at
    it, for rustls-native-certs and OpenSSL), and where OpenSSL looks by default on Debian
    (/usr/lib/ssl/cert.pem, /usr/lib/ssl/certs) when the binary links libcrypto.
  - /etc/passwd and /etc/group (root, nobody, nonroot 65532), a minimal /etc/nsswitch.conf,
    /etc/os-release, /home/nonroot (65532, 0700), /tmp (1777).
  - for scanners and licences, as distroless images do: /var/lib/dpkg/status.d/<package> (the
    dpkg status of each package a file comes from) and its /usr/share/doc/<package>/copyright.
No shell, no package manager, nothing setuid. The image runs as 65532:65532.

Reproducible: entries sorted by name, owner 0:0 (except /home/nonroot), modes normalized to
0755/0644, every mtime = --epoch (SOURCE_DATE_EPOCH, default 0), gzip without name or time,
JSON with sorted keys. The same binary and system libraries give the same digests.
"""

import argparse
import datetime
import gzip
import hashlib
import io
import json
import os
import platform
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile

NONROOT = 65532
WORKDIR = "/home/nonroot"
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
ENV = [
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    f"SSL_CERT_FILE={CA_BUNDLE}",
]
ARCHITECTURES = {"x86_64": "amd64", "aarch64": "arm64"}

PASSWD = f"""\
root:x:0:0:root:/root:/sbin/nologin
nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin
nonroot:x:{NONROOT}:{NONROOT}:nonroot:{WORKDIR}:/sbin/nologin
"""
GROUP = f"""\
root:x:0:
nobody:x:65534:
nonroot:x:{NONROOT}:
"""
NSSWITCH = """\
# Users and groups from /etc/passwd and /etc/group; host names from /etc/hosts, then DNS
# (both services are built into glibc; no libnss_* module is needed).
passwd:    files
group:     files
shadow:    files
hosts:     files dns
networks:  files
protocols: files
services:  files
"""

# Where releases publish the images (.github/workflows/release.yml), and so the name a local
# build carries: the chart's default image is then the imported one.
PUBLISHED_REPOSITORY = "ghcr.io/ferry-dev"

MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"


def fail(msg):
    sys.exit(f"ferry: images: {msg}")


class Entry:
    __slots__ = ("path", "kind", "mode", "uid", "gid", "data", "link")

    def __init__(self, path, kind, mode, uid=0, gid=0, data=None, link=None):
        self.path, self.kind, self.mode = path, kind, mode
        self.uid, self.gid, self.data, self.link = uid, gid, data, link

    def same(self, other):
        return all(getattr(self, k) == getattr(other, k) for k in self.__slots__)


class Plan:
    """The image's files: relative paths ("etc/passwd") to entries."""

    def __init__(self):
        self.entries = {}
        self.host_files = []  # host paths copied as regular files, for their dpkg packages

    def _put(self, entry):
        old = self.entries.get(entry.path)
        if old is not None:
            if not old.same(entry):
                fail(f"two different entries for /{entry.path}")
            return
        parent = os.path.dirname(entry.path)
        if parent:
            self.dir(parent)
        self.entries[entry.path] = entry

    def dir(self, path, mode=0o755, uid=0, gid=0):
        path = path.strip("/")
        old = self.entries.get(path)
        if old is not None and old.kind == "dir" and (mode, uid, gid) == (0o755, 0, 0):
            return  # an implied parent of a directory already there with its own mode
        self._put(Entry(path, "dir", mode, uid, gid))

    def file(self, path, data, mode=0o644):
        self._put(Entry(path.strip("/"), "file", mode, data=data))

    def symlink(self, path, target):
        self._put(Entry(path.strip("/"), "symlink", 0o777, link=target))

    def host_path(self, path, _depth=0):
        """Copies the host file at `path`, keeping every symlink met on the way as a symlink."""
        if _depth > 40:
            fail(f"too many symlinks resolving {path}")
        parts = [p for p in os.path.normpath(path).split("/") if p]
        cur = ""
        for i, part in enumerate(parts):
            cur += "/" + part
            try:
                st = os.lstat(cur)
            except FileNotFoundError:
                fail(f"{cur} does not exist (needed for {path})")
            last = i == len(parts) - 1
            if stat.S_ISLNK(st.st_mode):
                target = os.readlink(cur)
                self.symlink(cur, target)
                base = os.path.dirname(cur)
                resolved = os.path.normpath(os.path.join(base, target))
                return self.host_path(os.path.join(resolved, *parts[i + 1 :]), _depth + 1)
            if last:
                if not stat.S_ISREG(st.st_mode):
                    fail(f"{cur} is not a regular file")
                with open(cur, "rb") as f:
                    data = f.read()
                self.file(cur, data, 0o755 if st.st_mode & 0o111 else 0o644)
                self.host_files.append(cur)
            elif not stat.S_ISDIR(st.st_mode):
                fail(f"{cur} is not a directory (needed for {path})")
            else:
                self.dir(cur)


def run(cmd, **kw):
    try:
        return subprocess.run(
            cmd, check=True, capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"}, **kw
        ).stdout
    except FileNotFoundError:
        fail(f"`{cmd[0]}` is not installed")
    except subprocess.CalledProcessError as e:
        fail(f"`{' '.join(cmd)}` failed ({e.returncode}): {e.stderr.strip()}")


def libraries(binary):
    """The loader and libraries `ldd` resolves for `binary`, as ldd names them."""
    out = subprocess.run(
        ["ldd", binary], capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"}
    )
    text = out.stdout + out.stderr
    if "not a dynamic executable" in text or "statically linked" in text:
        return []
    if out.returncode != 0:
        fail(f"ldd {binary} failed: {text.strip()}")
    missing = [l.split()[0] for l in text.splitlines() if "not found" in l]
    if missing:
        fail(f"{binary} needs libraries this system lacks: {', '.join(missing)}")
    libs = []
    for line in text.splitlines():
        m = re.match(r"^\s*(?:\S+\s+=>\s+)?(/\S+)\s+\(0x[0-9a-f]+\)\s*$", line)
        if m:
            libs.append(m.group(1))
    if not any(os.path.basename(l).startswith("ld-") for l in libs):
        fail(f"no dynamic loader in `ldd {binary}`:\n{text}")
    return libs


def dpkg_package(path):
    """The Debian package owning `path` (also under its merged-/usr aliases), or None."""
    real = os.path.realpath(path)
    candidates = [path, real]
    for p in (path, real):
        if p.startswith("/usr/"):
            candidates.append(p[len("/usr") :])
    for c in dict.fromkeys(candidates):
        out = subprocess.run(["dpkg-query", "-S", c], capture_output=True, text=True)
        if out.returncode == 0:
            for line in out.stdout.splitlines():
                pkgs, _, owned = line.partition(": ")
                if owned == c and "," not in pkgs and not pkgs.startswith("diversion"):
                    return pkgs.strip()
    return None


def stripped(binary):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "stripped")
        run(["objcopy", "--strip-debug", binary, out])
        with open(out, "rb") as f:
            return f.read()


def plan(binary, name):
    if not os.access(binary, os.X_OK):
        fail(f"{binary} is not an executable file")
    p = Plan()
    libs = libraries(binary)
    for lib in libs:
        p.host_path(lib)
    lib_files = list(p.host_files)

    p.file(f"usr/local/bin/{name}", stripped(binary), 0o755)

    p.file("etc/passwd", PASSWD.encode())
    p.file("etc/group", GROUP.encode())
    p.file("etc/nsswitch.conf", NSSWITCH.encode())
    for release in ("/etc/os-release", "/etc/debian_version"):
        if os.path.lexists(release):
            p.host_path(release)
    p.host_path(CA_BUNDLE)
    with open(CA_BUNDLE, "rb") as f:
        if f.read().count(b"-----BEGIN CERTIFICATE-----") < 10:
            fail(f"{CA_BUNDLE} holds (almost) no certificates; install Debian's ca-certificates")
    if any(os.path.basename(l).startswith("libcrypto.so") for l in libs):
        # OpenSSL's compiled-in OPENSSLDIR on Debian is /usr/lib/ssl (as libssl3 + openssl lay it out).
        p.symlink("usr/lib/ssl/cert.pem", CA_BUNDLE)
        p.symlink("usr/lib/ssl/certs", os.path.dirname(CA_BUNDLE))
    p.dir("tmp", 0o1777)
    p.dir(WORKDIR, 0o700, NONROOT, NONROOT)

    # Package metadata for image scanners and the licences of what is redistributed.
    if shutil.which("dpkg-query") is None:
        fail("dpkg-query not found: the images are assembled from a Debian system's libraries")
    packages = {"ca-certificates"}  # its bundle is generated, owned by no package
    for f in lib_files:
        pkg = dpkg_package(f)
        if pkg is None:
            fail(f"no Debian package owns {f}")
        packages.add(pkg)  # e.g. libc6:amd64
    for pkg in sorted(packages):
        status = run(["dpkg-query", "-s", pkg])
        short = pkg.split(":")[0]
        p.file(f"var/lib/dpkg/status.d/{short}", status.encode())
        copyright = f"/usr/share/doc/{short}/copyright"
        if os.path.exists(copyright):
            p.host_path(copyright)
    return p


def layer_tar(p, epoch):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(p.entries):
            e = p.entries[path]
            info = tarfile.TarInfo(path)
            info.mtime, info.mode, info.uid, info.gid = epoch, e.mode, e.uid, e.gid
            info.uname = info.gname = ""
            if e.kind == "dir":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif e.kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, e.link
                tar.addfile(info)
            else:
                info.size = len(e.data)
                tar.addfile(info, io.BytesIO(e.data))
    return buf.getvalue()


def canonical_json(obj):
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def sha256(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


def descriptor(media_type, data, **extra):
    return {"mediaType": media_type, "digest": sha256(data), "size": len(data), **extra}


def package_metadata(metadata_file, name):
    with open(metadata_file) as f:
        meta = json.load(f)
    for pkg in meta["packages"]:
        if pkg["name"] == name:
            return pkg
    fail(f"package {name} not in {metadata_file}")


def write_image(args):
    pkg = package_metadata(args.metadata, args.name)
    version = pkg["version"]
    arch = ARCHITECTURES.get(platform.machine())
    if arch is None:
        fail(f"unsupported architecture {platform.machine()}")
    p = plan(args.binary, args.name)
    created = datetime.datetime.fromtimestamp(args.epoch, datetime.timezone.utc)
    created = created.strftime("%Y-%m-%dT%H:%M:%SZ")

    layer = layer_tar(p, args.epoch)
    layer_gz = gzip.compress(layer, compresslevel=9, mtime=0)
    labels = {
        "org.opencontainers.image.title": args.name,
        "org.opencontainers.image.version": version,
        "org.opencontainers.image.description": pkg.get("description") or "",
        "org.opencontainers.image.licenses": pkg.get("license") or "",
        "org.opencontainers.image.source": pkg.get("repository") or "",
    }
    config = canonical_json(
        {
            "architecture": arch,
            "os": "linux",
            "created": created,
            "config": {
                "User": f"{NONROOT}:{NONROOT}",
                "Entrypoint": [f"/usr/local/bin/{args.name}"],
                "Env": ENV,
                "WorkingDir": WORKDIR,
                "Labels": labels,
            },
            "rootfs": {"type": "layers", "diff_ids": [sha256(layer)]},
            "history": [
                {
                    "created": created,
                    "created_by": f"e2e/images/oci.py image --name {args.name}",
                    "comment": "binary, its libraries and minimal /etc from the build system",
                }
            ],
        }
    )
    manifest = canonical_json(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_MANIFEST,
            "config": descriptor(MEDIA_CONFIG, config),
            "layers": [descriptor(MEDIA_LAYER, layer_gz)],
        }
    )
    ref = f"{args.name}:{version}"
    index = canonical_json(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_INDEX,
            "manifests": [
                descriptor(
                    MEDIA_MANIFEST,
                    manifest,
                    platform={"architecture": arch, "os": "linux"},
                    annotations={
                        "io.containerd.image.name": f"{PUBLISHED_REPOSITORY}/{ref}",
                        "org.opencontainers.image.ref.name": version,
                    },
                )
            ],
        }
    )
    files = {
        "oci-layout": canonical_json({"imageLayoutVersion": "1.0.0"}),
        "index.json": index,
    }
    for blob in (layer_gz, config, manifest):
        files["blobs/sha256/" + hashlib.sha256(blob).hexdigest()] = blob

    out = args.out
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = f"{out}.tmp.{os.getpid()}"
    try:
        with tarfile.open(tmp, mode="w", format=tarfile.PAX_FORMAT) as tar:
            names = sorted(set(files) | {"blobs", "blobs/sha256"})
            for path in names:
                info = tarfile.TarInfo(path)
                info.mtime, info.uid, info.gid, info.uname, info.gname = args.epoch, 0, 0, "", ""
                if path in files:
                    info.mode, info.size = 0o644, len(files[path])
                    tar.addfile(info, io.BytesIO(files[path]))
                else:
                    info.mode, info.type = 0o755, tarfile.DIRTYPE
                    tar.addfile(info)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)

    mb = lambda n: f"{n / 1e6:.1f} MB"
    print(f"ferry: images: {PUBLISHED_REPOSITORY}/{ref} -> {out} ({mb(os.path.getsize(out))})")
    print(f"  manifest {sha256(manifest)}")
    print(f"  config   {sha256(config)} (image id)")
    print(
        f"  layer    {sha256(layer_gz)}: {mb(len(layer_gz))} gzip, {mb(len(layer))} tar, "
        f"{len(p.entries)} entries"
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("image")
    s.add_argument("--binary", required=True)
    s.add_argument("--name", required=True)
    s.add_argument("--epoch", type=int, default=int(os.environ.get("SOURCE_DATE_EPOCH", "0")))
    s.add_argument("--metadata", required=True, help="`cargo metadata --no-deps` output")
    s.add_argument("--out", required=True)
    args = ap.parse_args()
    write_image(args)


if __name__ == "__main__":
    main()
