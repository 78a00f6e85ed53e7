//! The container images of `e2e/images/build.sh`: for `ferry-operator` and `ferry-forwarder`,
//! the OCI layout tarball is complete and consistent (index.json -> manifest -> config and layer,
//! every digest and size checked against the blob), the image runs as 65532:65532 with an
//! entrypoint present in the layer, has no shell, no package manager and no program but its own,
//! holds every library the binary loads (the binary runs on the extracted root filesystem alone:
//! under `chroot` as uid 65532 when the test runs as root, and always through the image's own
//! dynamic loader with every library resolved inside the image), is reproducible (two builds,
//! same bytes), and is named where releases publish it (`ghcr.io/ferry-dev/<name>:<version>`,
//! the chart's default), with the labels a registry shows (source, licence, version).
//!
//! It packs the release binaries already in the target dir (`FERRY_IMAGES_SKIP_BUILD=1`: a
//! nested `cargo build` would wait forever on the lock `cargo test` holds) and fails, saying how
//! to build them, when they are missing. With `FERRY_CONTAINERD_ADDRESS` set (a containerd
//! socket) and `ctr` installed, it also imports both images into containerd (namespace
//! `FERRY_CONTAINERD_NAMESPACE`, default `k8s.io`) and checks the digests containerd reports.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::{Read as _, Write as _};
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Instant;

use anyhow::{Context as _, Result, anyhow, bail, ensure};
use serde_json::Value;

const IMAGES: [&str; 2] = ["ferry-operator", "ferry-forwarder"];
const VERSION: &str = env!("CARGO_PKG_VERSION"); // the workspace version (version.workspace)
const NONROOT: u64 = 65532;
/// Where releases publish the images, the chart's default registry and repository path.
const PUBLISHED: &str = "ghcr.io/ferry-dev";
const MEDIA_INDEX: &str = "application/vnd.oci.image.index.v1+json";
const MEDIA_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const MEDIA_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
const MEDIA_LAYER: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
const SHELLS: [&str; 7] = ["sh", "bash", "dash", "ash", "zsh", "ksh", "busybox"];
const PACKAGE_MANAGERS: [&str; 7] = ["dpkg", "apt", "apt-get", "apk", "rpm", "yum", "dnf"];

#[test]
fn images_are_complete_nonroot_shell_free_runnable_and_reproducible() -> Result<()> {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .context("e2e has a parent")?
        .to_owned();
    let target = target_dir()?;
    // A snapshot of the binaries, so that a concurrent `cargo build --release` cannot change
    // them between the two builds compared below.
    let snapshot = tempfile::tempdir()?;
    fs::create_dir(snapshot.path().join("release"))?;
    for name in IMAGES {
        let bin = target.join("release").join(name);
        ensure!(
            bin.is_file(),
            "no release binary {}: the image test packs the release binaries and cannot build \
             them itself (cargo test holds the target dir's lock). Build them first with\n  \
             make release\n(or e2e/images/build.sh), \
             then rerun this test",
            bin.display()
        );
        let age = fs::metadata(&bin)?
            .modified()?
            .elapsed()
            .unwrap_or_default();
        println!(
            "packing {} (built {} min ago)",
            bin.display(),
            age.as_secs() / 60
        );
        fs::copy(&bin, snapshot.path().join("release").join(name))?;
    }
    let target = snapshot.path();

    let out_a = tempfile::tempdir()?;
    let out_b = tempfile::tempdir()?;
    let started = Instant::now();
    let log = build(&repo, target, out_a.path())?;
    println!("{log}e2e/images/build.sh took {:.1?}", started.elapsed());
    build(&repo, target, out_b.path())?;

    let mut summary = Vec::new();
    for name in IMAGES {
        let file = format!("{name}-{VERSION}.oci.tar");
        let (path_a, path_b) = (out_a.path().join(&file), out_b.path().join(&file));
        let image = Image::read(&path_a, name)?;
        let again = Image::read(&path_b, name)?;
        ensure!(
            image.manifest_digest == again.manifest_digest
                && fs::read(&path_a)? == fs::read(&path_b)?,
            "{name}: two builds of the same binary differ: manifest {} vs {}",
            image.manifest_digest,
            again.manifest_digest
        );
        let binary = target.join("release").join(name);
        check_config(&image, name)?;
        check_layer(&image, name, &binary)?;
        run_on_extracted_root(&image, name, &repo)?;
        import_into_containerd(&path_a, &image, name)?;
        summary.push(format!(
            "{name}:{VERSION}: {:.1} MB tarball, layer {:.1} MB gzip ({:.1} MB uncompressed, {} \
             entries); manifest {}; config {}",
            fs::metadata(&path_a)?.len() as f64 / 1e6,
            image.layer_gz_size as f64 / 1e6,
            image.layer_tar_size as f64 / 1e6,
            image.layer.len(),
            image.manifest_digest,
            image.config_digest,
        ));
    }
    println!("two builds gave identical tarballs; images:");
    for line in summary {
        println!("  {line}");
    }
    Ok(())
}

/// The target dir of this checkout: where cargo put this crate's binaries (the test binary
/// itself may be in a build dir shared with other checkouts).
fn target_dir() -> Result<PathBuf> {
    let target = Path::new(env!("CARGO_BIN_EXE_demo-local"))
        .ancestors()
        .nth(2)
        .context("demo-local outside a target dir")?;
    Ok(target.to_owned())
}

fn build(repo: &Path, target: &Path, out: &Path) -> Result<String> {
    let output = Command::new("bash")
        .arg(repo.join("e2e/images/build.sh"))
        .arg("--out")
        .arg(out)
        .env("FERRY_IMAGES_SKIP_BUILD", "1")
        .env("CARGO_TARGET_DIR", target)
        .env_remove("SOURCE_DATE_EPOCH")
        .output()
        .context("running e2e/images/build.sh")?;
    ensure!(
        output.status.success(),
        "e2e/images/build.sh --out {} failed ({}):\n{}{}",
        out.display(),
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

// ---------------------------------------------------------------------------------------------
// The OCI layout

struct Image {
    manifest_digest: String,
    config_digest: String,
    config: Value,
    layer_gz_size: usize,
    layer_tar_size: usize,
    /// The layer's entries by path, in the order of the tar.
    layer: Vec<TarEntry>,
}

impl Image {
    fn read(path: &Path, name: &str) -> Result<Self> {
        let outer = parse_tar(&fs::read(path)?).with_context(|| format!("{}", path.display()))?;
        let mut files = BTreeMap::new();
        for e in outer {
            match e.kind {
                Kind::Dir => ensure!(
                    ["blobs", "blobs/sha256"].contains(&e.path.as_str()),
                    "unexpected directory {} in {}",
                    e.path,
                    path.display()
                ),
                Kind::File => {
                    files.insert(e.path, e.data);
                }
                _ => bail!("unexpected {:?} {} in {}", e.kind, e.path, path.display()),
            }
        }
        let layout: Value = json(files.get("oci-layout").context("no oci-layout")?)?;
        ensure!(
            layout["imageLayoutVersion"] == "1.0.0",
            "oci-layout: {layout}"
        );
        let mut blobs = BTreeMap::new();
        for (p, data) in &files {
            if let Some(hex) = p.strip_prefix("blobs/sha256/") {
                let digest = format!("sha256:{hex}");
                ensure!(
                    sha256(data)? == digest,
                    "blob {p} does not hash to its name"
                );
                blobs.insert(digest, data.as_slice());
            } else {
                ensure!(
                    p == "oci-layout" || p == "index.json",
                    "unexpected file {p} in the layout"
                );
            }
        }
        let blob = |d: &Value, media: &str| blob(&blobs, d, media);

        let index: Value = json(files.get("index.json").context("no index.json")?)?;
        ensure!(
            index["schemaVersion"] == 2 && index["mediaType"] == MEDIA_INDEX,
            "{index}"
        );
        let manifests = index["manifests"]
            .as_array()
            .context("index without manifests")?;
        ensure!(
            manifests.len() == 1,
            "index.json should name one image: {index}"
        );
        let desc = &manifests[0];
        ensure!(
            desc["annotations"]["io.containerd.image.name"]
                == format!("{PUBLISHED}/{name}:{VERSION}").as_str()
                && desc["annotations"]["org.opencontainers.image.ref.name"] == VERSION,
            "index.json annotations do not name {name}:{VERSION}: {desc}"
        );
        let manifest: Value = json(blob(desc, MEDIA_MANIFEST)?)?;
        ensure!(
            manifest["schemaVersion"] == 2 && manifest["mediaType"] == MEDIA_MANIFEST,
            "{manifest}"
        );
        let config_bytes = blob(&manifest["config"], MEDIA_CONFIG)?;
        let config: Value = json(config_bytes)?;
        let layers = manifest["layers"]
            .as_array()
            .context("manifest without layers")?;
        ensure!(layers.len() == 1, "expected one layer: {manifest}");
        let layer_gz = blob(&layers[0], MEDIA_LAYER)?;
        let layer_tar = gunzip(layer_gz)?;
        ensure!(
            config["rootfs"]["type"] == "layers"
                && config["rootfs"]["diff_ids"] == serde_json::json!([sha256(&layer_tar)?]),
            "config's diff_ids are not the uncompressed layer's digest: {}",
            config["rootfs"]
        );
        Ok(Self {
            manifest_digest: desc["digest"].as_str().unwrap_or_default().to_owned(),
            config_digest: manifest["config"]["digest"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            config,
            layer_gz_size: layer_gz.len(),
            layer_tar_size: layer_tar.len(),
            layer: parse_tar(&layer_tar).context("the layer")?,
        })
    }

    fn entries(&self) -> BTreeMap<&str, &TarEntry> {
        self.layer.iter().map(|e| (e.path.as_str(), e)).collect()
    }
}

/// The blob a descriptor names, checking its media type, digest and size.
fn blob<'a>(blobs: &BTreeMap<String, &'a [u8]>, d: &Value, media: &str) -> Result<&'a [u8]> {
    ensure!(
        d["mediaType"] == media,
        "descriptor {d}: media type is not {media}"
    );
    let digest = d["digest"].as_str().context("descriptor without digest")?;
    let data = *blobs
        .get(digest)
        .with_context(|| format!("descriptor {d}: no blob {digest}"))?;
    ensure!(
        d["size"].as_u64() == Some(data.len() as u64),
        "descriptor {d}: blob {digest} has {} bytes",
        data.len()
    );
    Ok(data)
}

fn check_config(image: &Image, name: &str) -> Result<()> {
    let c = &image.config;
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    };
    ensure!(
        c["architecture"] == arch && c["os"] == "linux",
        "{name}: platform: {c}"
    );
    let cfg = &c["config"];
    ensure!(cfg["User"] == "65532:65532", "{name}: User {}", cfg["User"]);
    ensure!(
        cfg["Entrypoint"] == serde_json::json!([format!("/usr/local/bin/{name}")]),
        "{name}: Entrypoint {}",
        cfg["Entrypoint"]
    );
    let env: Vec<&str> = cfg["Env"]
        .as_array()
        .context("no Env")?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    ensure!(
        env.iter().any(|e| e.starts_with("PATH="))
            && env.contains(&"SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt"),
        "{name}: Env {env:?}"
    );
    ensure!(
        cfg["WorkingDir"] == "/home/nonroot",
        "{name}: WorkingDir {}",
        cfg["WorkingDir"]
    );
    let labels = &cfg["Labels"];
    ensure!(
        labels["org.opencontainers.image.title"] == name
            && labels["org.opencontainers.image.version"] == VERSION
            && labels["org.opencontainers.image.licenses"] == "Apache-2.0"
            && labels["org.opencontainers.image.source"] == "https://github.com/ferry-dev/ferry",
        "{name}: Labels {labels}"
    );
    ensure!(
        c["created"] == "1970-01-01T00:00:00Z",
        "{name}: created {}",
        c["created"]
    );
    Ok(())
}

fn check_layer(image: &Image, name: &str, binary: &Path) -> Result<()> {
    let entries = image.entries();
    ensure!(
        entries.len() == image.layer.len(),
        "{name}: duplicate paths in the layer"
    );
    let paths: Vec<&str> = image.layer.iter().map(|e| e.path.as_str()).collect();
    ensure!(
        paths.is_sorted(),
        "{name}: layer entries are not sorted by name"
    );
    for e in &image.layer {
        let p = e.path.as_str();
        ensure!(
            !p.starts_with('/') && !p.split('/').any(|c| c.is_empty() || c == "." || c == ".."),
            "{name}: unsafe path {p:?}"
        );
        ensure!(e.mtime == 0, "{name}: /{p} has mtime {} (want 0)", e.mtime);
        let owner = if p == "home/nonroot" { NONROOT } else { 0 };
        ensure!(
            e.uid == owner && e.gid == owner,
            "{name}: /{p} is owned by {}:{}",
            e.uid,
            e.gid
        );
        ensure!(
            e.mode & 0o6000 == 0,
            "{name}: /{p} is setuid/setgid ({:o})",
            e.mode
        );
        if e.kind != Kind::Symlink && e.mode & 0o002 != 0 {
            ensure!(p == "tmp", "{name}: /{p} is world-writable ({:o})", e.mode);
        }
        let base = p.rsplit('/').next().unwrap_or(p);
        if e.kind != Kind::Dir {
            ensure!(
                !SHELLS.contains(&base),
                "{name}: the image has a shell: /{p}"
            );
            ensure!(
                !PACKAGE_MANAGERS.contains(&base),
                "{name}: the image has a package manager: /{p}"
            );
        }
        // The only programs: the binary; everything else executable is a shared library.
        if e.kind == Kind::File && e.mode & 0o111 != 0 {
            ensure!(
                p == format!("usr/local/bin/{name}") || base.contains(".so"),
                "{name}: unexpected executable /{p}"
            );
        }
    }
    for shell in ["bin/sh", "usr/bin/sh", "bin/bash", "usr/bin/bash"] {
        ensure!(
            resolve(&entries, shell).is_none(),
            "{name}: /{shell} exists"
        );
    }

    let kind_mode = |p: &str| {
        resolve(&entries, p).map(|r| (entries[r.as_str()].kind, entries[r.as_str()].mode))
    };
    let bin = format!("usr/local/bin/{name}");
    ensure!(
        kind_mode(&bin) == Some((Kind::File, 0o755)),
        "{name}: entrypoint /{bin}: {:?}",
        kind_mode(&bin)
    );
    ensure!(
        kind_mode("tmp") == Some((Kind::Dir, 0o1777)),
        "{name}: /tmp {:?}",
        kind_mode("tmp")
    );
    ensure!(
        kind_mode("home/nonroot") == Some((Kind::Dir, 0o700)),
        "{name}: /home/nonroot {:?}",
        kind_mode("home/nonroot")
    );
    let text = |p: &str| -> Result<String> {
        let r = resolve(&entries, p).with_context(|| format!("{name}: no /{p}"))?;
        Ok(String::from_utf8_lossy(&entries[r.as_str()].data).into_owned())
    };
    ensure!(
        text("etc/passwd")?
            .lines()
            .any(|l| l.starts_with("nonroot:x:65532:65532:")),
        "{name}: /etc/passwd has no nonroot 65532"
    );
    ensure!(
        text("etc/group")?
            .lines()
            .any(|l| l.starts_with("nonroot:x:65532:")),
        "{name}: /etc/group has no nonroot 65532"
    );
    ensure!(
        text("etc/nsswitch.conf")?
            .lines()
            .any(|l| l.starts_with("hosts:")),
        "{name}: /etc/nsswitch.conf lacks hosts:"
    );
    let certs = text("etc/ssl/certs/ca-certificates.crt")?
        .matches("-----BEGIN CERTIFICATE-----")
        .count();
    ensure!(certs >= 50, "{name}: only {certs} CA certificates");

    // Every library the dynamic loader resolves here, byte for byte the same in the image.
    let libs = ldd(binary)?;
    ensure!(!libs.is_empty(), "{name}: ldd lists no libraries");
    for lib in &libs {
        let inside = resolve(&entries, lib.trim_start_matches('/'))
            .with_context(|| format!("{name}: the image lacks {lib}"))?;
        let e = entries[inside.as_str()];
        ensure!(
            e.kind == Kind::File,
            "{name}: {lib} -> /{inside} is not a file"
        );
        ensure!(
            e.data == fs::read(lib)?,
            "{name}: /{inside} differs from this system's {lib}"
        );
    }
    println!(
        "{name}: layer checked: {} entries, {certs} CA certificates, libraries {}",
        image.layer.len(),
        libs.join(" ")
    );
    Ok(())
}

/// Runs the binary on the extracted layer alone.
fn run_on_extracted_root(image: &Image, name: &str, repo: &Path) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let root = dir.path().join("rootfs");
    extract(&image.layer, &root)?;
    let entries = image.entries();

    // 1. Through the image's own loader, told to look only in the image's library dirs: every
    //    library must resolve inside the root (a missing one would resolve on the host).
    let bin_entry = entries
        .get(format!("usr/local/bin/{name}").as_str())
        .context("no binary")?;
    let interp = elf_interpreter(&bin_entry.data)?;
    let loader = root.join(
        resolve(&entries, interp.trim_start_matches('/'))
            .with_context(|| format!("{name}: no loader {interp} in the image"))?,
    );
    let lib_dirs: Vec<String> = image
        .layer
        .iter()
        .filter(|e| e.kind == Kind::File && e.path.contains(".so"))
        .filter_map(|e| {
            Some(
                root.join(Path::new(&e.path).parent()?)
                    .display()
                    .to_string(),
            )
        })
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let bin = root.join(format!("usr/local/bin/{name}"));
    let via_loader = |args: &[&str]| -> Result<Output> {
        Ok(Command::new(&loader)
            .args(["--inhibit-cache", "--library-path", &lib_dirs.join(":")])
            .arg(&bin)
            .args(args)
            .env_clear()
            .output()?)
    };
    let list = Command::new(&loader)
        .args([
            "--inhibit-cache",
            "--library-path",
            &lib_dirs.join(":"),
            "--list",
        ])
        .arg(&bin)
        .output()?;
    let listed = String::from_utf8_lossy(&list.stdout);
    ensure!(
        list.status.success(),
        "{name}: {} --list: {listed}",
        loader.display()
    );
    for line in listed.lines().filter(|l| l.contains("=>")) {
        let resolved = line.split("=>").nth(1).unwrap_or_default().trim();
        ensure!(
            resolved.starts_with(&root.display().to_string()),
            "{name}: the image's loader resolves a library outside the image: {line}"
        );
    }
    let help = via_loader(&["--help"])?;
    ensure!(
        help.status.success() && String::from_utf8_lossy(&help.stdout).contains("Usage:"),
        "{name} --help through the image's loader: {}\n{}{}",
        help.status,
        String::from_utf8_lossy(&help.stdout),
        String::from_utf8_lossy(&help.stderr)
    );
    println!("{name}: runs on the image's loader and libraries alone");

    // 2. Under chroot as the image's user, with the image's environment (needs root).
    if unsafe { libc::geteuid() } != 0 {
        println!(
            "{name}: not root: no chroot run (the loader run above still checked the libraries)"
        );
        return Ok(());
    }
    let env: Vec<(String, String)> = image.config["config"]["Env"]
        .as_array()
        .context("no Env")?
        .iter()
        .filter_map(|v| {
            v.as_str()?
                .split_once('=')
                .map(|(k, v)| (k.into(), v.into()))
        })
        .collect();
    let chroot = |args: &[&str]| -> Result<Output> {
        Command::new(program("chroot"))
            .arg("--userspec=65532:65532")
            .arg(&root)
            .arg(format!("/usr/local/bin/{name}"))
            .args(args)
            .env_clear()
            .envs(env.iter().cloned())
            .stdin(Stdio::null())
            .output()
            .context("running chroot")
    };
    let help = chroot(&["--help"])?;
    ensure!(
        help.status.success() && String::from_utf8_lossy(&help.stdout).contains("Usage:"),
        "chroot {} /usr/local/bin/{name} --help as 65532: {}\n{}{}",
        root.display(),
        help.status,
        String::from_utf8_lossy(&help.stdout),
        String::from_utf8_lossy(&help.stderr)
    );
    if name == "ferry-forwarder" {
        // Where the operator mounts the config; the example needs no file besides itself.
        let config_dir = root.join("etc/ferry/config");
        fs::create_dir_all(&config_dir)?;
        fs::copy(
            repo.join("examples/forwarder.yaml"),
            config_dir.join("config.yaml"),
        )?;
        let check = chroot(&["--check", "--config", "/etc/ferry/config/config.yaml"])?;
        ensure!(
            check.status.success(),
            "ferry-forwarder --check in the image: {}\n{}{}",
            check.status,
            String::from_utf8_lossy(&check.stdout),
            String::from_utf8_lossy(&check.stderr)
        );
        print!(
            "{name}: in the image: {}",
            String::from_utf8_lossy(&check.stdout)
        );
    }
    println!(
        "{name}: `chroot --userspec=65532:65532 <layer> /usr/local/bin/{name} --help` exits 0"
    );
    Ok(())
}

fn import_into_containerd(tarball: &Path, image: &Image, name: &str) -> Result<()> {
    let Some(address) = std::env::var_os("FERRY_CONTAINERD_ADDRESS") else {
        println!("{name}: FERRY_CONTAINERD_ADDRESS not set: not importing into containerd");
        return Ok(());
    };
    let namespace =
        std::env::var("FERRY_CONTAINERD_NAMESPACE").unwrap_or_else(|_| "k8s.io".to_owned());
    let ctr = |args: &[&str]| -> Result<String> {
        let out = Command::new("ctr")
            .arg("--address")
            .arg(&address)
            .args(["--namespace", &namespace])
            .args(args)
            .output()
            .map_err(|e| anyhow!("FERRY_CONTAINERD_ADDRESS is set but `ctr` cannot run: {e}"))?;
        ensure!(
            out.status.success(),
            "ctr {}: {}\n{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    };
    ctr(&["images", "import", &tarball.display().to_string()])?;
    let reference = format!("{PUBLISHED}/{name}:{VERSION}");
    let listed = ctr(&["images", "ls", &format!("name=={reference}")])?;
    ensure!(
        listed.contains(&image.manifest_digest),
        "containerd lists {reference} without digest {}:\n{listed}",
        image.manifest_digest
    );
    println!("{name}: imported into containerd ({namespace}) as {reference}");
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Helpers: tar, gzip, sha256, ldd

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    File,
    Dir,
    Symlink,
}

struct TarEntry {
    path: String,
    kind: Kind,
    mode: u32,
    uid: u64,
    gid: u64,
    mtime: u64,
    link: String,
    data: Vec<u8>,
}

/// Every entry of a tar archive (ustar, pax and GNU long names, as the `tar` crate reads them).
fn parse_tar(bytes: &[u8]) -> Result<Vec<TarEntry>> {
    let mut archive = tar::Archive::new(bytes);
    let mut entries = Vec::new();
    for entry in archive.entries()? {
        let mut entry = entry?;
        let path = entry.path()?.to_string_lossy().into_owned();
        let kind = match entry.header().entry_type() {
            tar::EntryType::Regular => Kind::File,
            tar::EntryType::Directory => Kind::Dir,
            tar::EntryType::Symlink => Kind::Symlink,
            other => bail!("unexpected tar entry type {other:?} for {path}"),
        };
        let link = entry
            .link_name()?
            .map(|l| l.to_string_lossy().into_owned())
            .unwrap_or_default();
        let header = entry.header();
        let (mode, uid, gid, mtime) = (
            header.mode()?,
            header.uid()?,
            header.gid()?,
            header.mtime()?,
        );
        let mut data = Vec::new();
        entry.read_to_end(&mut data)?;
        entries.push(TarEntry {
            path: path
                .trim_start_matches("./")
                .trim_end_matches('/')
                .to_owned(),
            kind,
            mode,
            uid,
            gid,
            mtime,
            link,
            data,
        });
    }
    Ok(entries)
}

fn cstr(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

/// The path inside the layer that `path` leads to, following the layer's symlinks.
fn resolve(entries: &BTreeMap<&str, &TarEntry>, path: &str) -> Option<String> {
    let mut pending: Vec<String> = path.split('/').rev().map(str::to_owned).collect();
    let mut cur: Vec<String> = Vec::new();
    let mut hops = 0;
    while let Some(part) = pending.pop() {
        match part.as_str() {
            "" | "." => continue,
            ".." => {
                cur.pop();
                continue;
            }
            _ => {}
        }
        cur.push(part);
        let joined = cur.join("/");
        let e = entries.get(joined.as_str())?;
        if e.kind == Kind::Symlink {
            hops += 1;
            if hops > 40 {
                return None;
            }
            cur.pop();
            if e.link.starts_with('/') {
                cur.clear();
            }
            pending.extend(e.link.split('/').rev().map(str::to_owned));
        }
    }
    Some(cur.join("/"))
}

fn extract(layer: &[TarEntry], root: &Path) -> Result<()> {
    fs::create_dir_all(root)?;
    let root_user = unsafe { libc::geteuid() } == 0;
    for e in layer {
        let path = root.join(&e.path);
        match e.kind {
            Kind::Dir => fs::create_dir(&path)?,
            Kind::Symlink => std::os::unix::fs::symlink(&e.link, &path)?,
            _ => fs::write(&path, &e.data)?,
        }
    }
    for e in layer.iter().rev() {
        let path = root.join(&e.path);
        if e.kind != Kind::Symlink {
            fs::set_permissions(&path, fs::Permissions::from_mode(e.mode))?;
        }
        if root_user {
            std::os::unix::fs::lchown(&path, Some(e.uid as u32), Some(e.gid as u32))?;
        }
    }
    Ok(())
}

/// `name` from PATH, else from /usr/sbin or /sbin (not on every user's PATH).
fn program(name: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from(name))
}

fn json(bytes: &[u8]) -> Result<Value> {
    Ok(serde_json::from_slice(bytes)?)
}

fn sha256(data: &[u8]) -> Result<String> {
    let out = pipe("sha256sum", &[], data)?;
    let hex = String::from_utf8_lossy(&out);
    Ok(format!(
        "sha256:{}",
        hex.split_whitespace().next().unwrap_or_default()
    ))
}

fn gunzip(data: &[u8]) -> Result<Vec<u8>> {
    pipe("gzip", &["-dc"], data)
}

/// Runs `cmd`, feeding `input` on stdin from a thread, and returns its stdout.
fn pipe(cmd: &str, args: &[&str], input: &[u8]) -> Result<Vec<u8>> {
    let mut child = Command::new(cmd)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {cmd}"))?;
    let mut stdin = child.stdin.take().context("stdin")?;
    let out = std::thread::scope(|s| {
        s.spawn(move || stdin.write_all(input));
        child.wait_with_output()
    })?;
    ensure!(
        out.status.success(),
        "{cmd}: {}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(out.stdout)
}

/// The loader and libraries `ldd` resolves for `binary` on this system.
fn ldd(binary: &Path) -> Result<Vec<String>> {
    let out = Command::new("ldd")
        .arg(binary)
        .env("LC_ALL", "C")
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success() && !text.contains("not found"),
        "ldd {}: {text}",
        binary.display()
    );
    Ok(text
        .lines()
        .filter_map(|l| {
            let l = l.split(" (0x").next()?.trim();
            let path = l.split("=>").last()?.trim();
            path.starts_with('/').then(|| path.to_owned())
        })
        .collect())
}

/// The program interpreter (PT_INTERP) of a 64-bit little-endian ELF executable.
fn elf_interpreter(elf: &[u8]) -> Result<String> {
    let u16_at = |o: usize| -> Option<u64> {
        Some(u16::from_le_bytes(elf.get(o..o + 2)?.try_into().ok()?).into())
    };
    let u32_at = |o: usize| -> Option<u64> {
        Some(u32::from_le_bytes(elf.get(o..o + 4)?.try_into().ok()?).into())
    };
    let u64_at =
        |o: usize| -> Option<u64> { Some(u64::from_le_bytes(elf.get(o..o + 8)?.try_into().ok()?)) };
    ensure!(
        elf.starts_with(b"\x7fELF\x02\x01"),
        "not a 64-bit little-endian ELF file"
    );
    let (phoff, phentsize, phnum) = (u64_at(0x20), u16_at(0x36), u16_at(0x38));
    let (phoff, phentsize, phnum) = (
        phoff.context("short ELF")? as usize,
        phentsize.context("short ELF")? as usize,
        phnum.context("short ELF")? as usize,
    );
    for i in 0..phnum {
        let ph = phoff + i * phentsize;
        if u32_at(ph) == Some(3) {
            let offset = u64_at(ph + 8).context("short ELF")? as usize;
            let size = u64_at(ph + 32).context("short ELF")? as usize;
            let interp = elf.get(offset..offset + size).context("short ELF")?;
            return Ok(cstr(interp));
        }
    }
    bail!("no PT_INTERP: not a dynamically linked executable")
}
