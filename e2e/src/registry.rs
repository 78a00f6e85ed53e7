//! A private OCI registry for tests: Debian's `docker-registry` (the CNCF distribution registry,
//! v2.8) serving HTTPS with a certificate of its own test CA, its storage in a temp dir. Images
//! go in with `skopeo copy oci-archive:…` and charts with `helm push`, as a platform team mirrors
//! a release; a containerd trusts it through a `hosts.toml` ([`Registry::write_containerd_hosts`]).
//!
//! Started with a [`Placement`] it runs inside a network namespace on its address (the cluster's
//! node address: containerd and this process both reach it there). It is stopped on drop and,
//! like the brokers, through `PR_SET_PDEATHSIG` when the thread that started it ends.

use std::fs;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

use anyhow::{Context as _, Result, ensure};

use crate::pki::{KeyType, Pki};
use crate::process::{Placement, free_port, spawn_tied, terminate, wait_for_addr, which};

pub struct Registry {
    dir: tempfile::TempDir,
    child: Child,
    host: IpAddr,
    port: u16,
    pki: Pki,
}

impl Registry {
    /// Starts `docker-registry serve` with a config written into its temp dir; returns once it
    /// listens.
    pub fn start_placed(placement: Placement) -> Result<Self> {
        let host = placement.host();
        let pki = Pki::generate_for(KeyType::Ecdsa, &[host])?;
        let dir = tempfile::Builder::new()
            .prefix("ferry-registry-")
            .tempdir()?;
        let port = free_port()?;
        let config = dir.path().join("config.yml");
        fs::write(
            &config,
            format!(
                "version: 0.1\n\
                 log:\n  level: info\n  accesslog:\n    disabled: false\n\
                 storage:\n  filesystem:\n    rootdirectory: {storage}\n\
                 http:\n  addr: {host}:{port}\n  tls:\n    certificate: {cert}\n    key: {key}\n",
                storage = dir.path().join("storage").display(),
                cert = pki.server_cert().display(),
                key = pki.server_key().display(),
            ),
        )?;
        let log = dir.path().join("registry.log");
        let program = which("docker-registry").context(
            "docker-registry is not installed (Debian package docker-registry: e2e/install.sh)",
        )?;
        let mut cmd = placement.command(&program);
        cmd.arg("serve").arg(&config);
        let mut child = spawn_tied(&mut cmd, &log)?;
        wait_for_addr(
            host,
            port,
            Duration::from_secs(20),
            &mut child,
            "docker-registry",
            &log,
        )?;
        Ok(Self {
            dir,
            child,
            host,
            port,
            pki,
        })
    }

    /// `host:port`, the registry part of an image reference.
    pub fn address(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }

    /// The CA that signed the registry's certificate.
    pub fn ca_cert(&self) -> &Path {
        self.pki.ca_cert()
    }

    pub fn log(&self) -> PathBuf {
        self.dir.path().join("registry.log")
    }

    /// `skopeo copy oci-archive:ARCHIVE docker://<registry>/REPOSITORY:TAG`, trusting the
    /// registry's CA; returns the digest of the manifest in the registry.
    pub fn push_oci_archive(&self, archive: &Path, repository: &str, tag: &str) -> Result<String> {
        let certs = self.dir.path().join("skopeo-certs");
        fs::create_dir_all(&certs)?;
        // skopeo's --dest-cert-dir takes CAs as *.crt files.
        fs::copy(self.ca_cert(), certs.join("ca.crt"))?;
        let digest_file = self
            .dir
            .path()
            .join(format!("{}.digest", repository.replace('/', "_")));
        let destination = format!("docker://{}/{repository}:{tag}", self.address());
        let out = Command::new("skopeo")
            .arg("copy")
            .arg("--dest-cert-dir")
            .arg(&certs)
            .arg("--digestfile")
            .arg(&digest_file)
            .arg(format!("oci-archive:{}", archive.display()))
            .arg(&destination)
            .output()
            .context("cannot run skopeo (Debian package skopeo: e2e/install.sh)")?;
        ensure!(
            out.status.success(),
            "skopeo copy {} {destination}: {}\n{}{}",
            archive.display(),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let digest = fs::read_to_string(&digest_file)?.trim().to_owned();
        ensure!(
            digest.starts_with("sha256:"),
            "skopeo wrote no digest for {destination}: {digest:?}"
        );
        Ok(digest)
    }

    /// Makes the containerd whose `config_path` is `hosts_dir` trust this registry's CA
    /// (`<hosts_dir>/<host:port>/hosts.toml`; containerd reads it at each pull).
    pub fn write_containerd_hosts(&self, hosts_dir: &Path) -> Result<()> {
        let dir = hosts_dir.join(self.address());
        fs::create_dir_all(&dir)?;
        let url = format!("https://{}", self.address());
        fs::write(
            dir.join("hosts.toml"),
            format!(
                "server = \"{url}\"\n\n[host.\"{url}\"]\n  capabilities = [\"pull\", \"resolve\"]\n  ca = \"{}\"\n",
                self.ca_cert().display()
            ),
        )?;
        Ok(())
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        terminate(&mut self.child, Duration::from_secs(5));
    }
}
