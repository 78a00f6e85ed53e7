//! A throwaway PKI for tests of TLS and client certificates, made with the `openssl` CLI.
//!
//! [`Pki::generate`] writes, in its own temp dir (removed on drop):
//! - a self-signed CA (`ca.pem`, `ca.key`), with a unique subject per call, so two calls give two
//!   unrelated CAs (use the second one to check that verification fails with the wrong CA);
//! - a server certificate for SANs `DNS:localhost` and `IP:127.0.0.1`, signed by the CA
//!   (`server.pem`, `server.key`), extended key usage `serverAuth`;
//! - a client certificate with CN [`CLIENT_CN`], signed by the CA (`client.pem`, `client.key`),
//!   extended key usage `clientAuth`.
//!
//! Certificates are PEM, X.509 v3, valid for 30 days from now. Private keys are unencrypted PEM
//! PKCS#8 (`-----BEGIN PRIVATE KEY-----`), which OpenSSL, librdkafka, Java (Kafka's PEM keystore)
//! and rustls all read, for RSA and ECDSA alike. RSA keys are 2048 bits, ECDSA keys are P-256.

use std::fs;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, Result, bail};

/// The common name of the client certificate.
pub const CLIENT_CN: &str = "ferry-forwarder";

/// The key algorithm used for every key of a [`Pki`] (CA, server and client).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyType {
    /// RSA 2048.
    Rsa,
    /// ECDSA on P-256 (prime256v1).
    Ecdsa,
}

/// A CA plus a server and a client certificate signed by it, in a temp dir.
pub struct Pki {
    dir: tempfile::TempDir,
    key_type: KeyType,
    ca_cert: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
    client_cert: PathBuf,
    client_key: PathBuf,
}

impl std::fmt::Debug for Pki {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pki")
            .field("dir", &self.dir.path())
            .field("key_type", &self.key_type)
            .finish()
    }
}

const REQ_CONFIG: &str = "[req]\ndistinguished_name = dn\n[dn]\n";

impl Pki {
    /// Generates a new CA, server and client certificate. Needs the `openssl` CLI
    /// (`e2e/install.sh` installs it). Takes well under a second for ECDSA, about one for RSA.
    pub fn generate(key_type: KeyType) -> Result<Self> {
        Self::generate_for(key_type, &[])
    }

    /// [`Pki::generate`] with the server certificate also valid for `ips` (a server that
    /// listens on an address other than loopback, e.g. a cluster's node address).
    pub fn generate_for(key_type: KeyType, ips: &[IpAddr]) -> Result<Self> {
        let dir = tempfile::Builder::new().prefix("ferry-pki-").tempdir()?;
        let d = dir.path();
        fs::write(d.join("req.cnf"), REQ_CONFIG)?;
        let newkey: &[&str] = match key_type {
            KeyType::Rsa => &["-newkey", "rsa:2048"],
            KeyType::Ecdsa => &["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"],
        };
        generate_ca(d, newkey)?;
        for (name, subject, extensions) in leaves(key_type, ips) {
            sign_leaf(d, newkey, name, &subject, &extensions)?;
        }
        let pki = Self {
            key_type,
            ca_cert: d.join("ca.pem"),
            server_cert: d.join("server.pem"),
            server_key: d.join("server.key"),
            client_cert: d.join("client.pem"),
            client_key: d.join("client.key"),
            dir,
        };
        for key in [pki.server_key(), pki.client_key()] {
            let text = fs::read_to_string(key)?;
            if !text.starts_with("-----BEGIN PRIVATE KEY-----") {
                bail!(
                    "openssl wrote {} in an unexpected format (want unencrypted PKCS#8 PEM)",
                    key.display()
                );
            }
        }
        Ok(pki)
    }

    pub fn key_type(&self) -> KeyType {
        self.key_type
    }

    /// The temp dir holding every file (removed when the `Pki` is dropped).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The CA certificate (PEM): the trust anchor for both server and client certificates.
    pub fn ca_cert(&self) -> &Path {
        &self.ca_cert
    }

    /// The server certificate (PEM), SANs `localhost` and `127.0.0.1`.
    pub fn server_cert(&self) -> &Path {
        &self.server_cert
    }

    /// The server's private key (unencrypted PKCS#8 PEM).
    pub fn server_key(&self) -> &Path {
        &self.server_key
    }

    /// The client certificate (PEM), CN [`CLIENT_CN`].
    pub fn client_cert(&self) -> &Path {
        &self.client_cert
    }

    /// The client's private key (unencrypted PKCS#8 PEM).
    pub fn client_key(&self) -> &Path {
        &self.client_key
    }
}

/// The CA in `d` (`ca.key`, `ca.pem`): self-signed, with a subject unique to this call.
fn generate_ca(d: &Path, newkey: &[&str]) -> Result<()> {
    let nonce = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|t| t.as_nanos())
        .unwrap_or_default();
    openssl(
        d,
        &[
            &["req", "-config", "req.cnf", "-x509", "-new", "-nodes"],
            newkey,
            &["-keyout", "ca.key", "-out", "ca.pem", "-days", "30"],
            &[
                "-subj",
                &format!("/O=Ferry tests/CN=Ferry Test CA {nonce:x}"),
            ],
            &["-addext", "basicConstraints=critical,CA:TRUE"],
            &["-addext", "keyUsage=critical,keyCertSign,cRLSign"],
            &["-addext", "subjectKeyIdentifier=hash"],
        ]
        .concat(),
    )
}

/// The server and client certificates: (file name, subject, extensions).
fn leaves(key_type: KeyType, ips: &[IpAddr]) -> [(&'static str, String, String); 2] {
    let extra_sans: String = ips.iter().map(|ip| format!(",IP:{ip}")).collect();
    let server_key_usage = match key_type {
        KeyType::Rsa => "digitalSignature,keyEncipherment",
        KeyType::Ecdsa => "digitalSignature",
    };
    [
        (
            "server",
            "/O=Ferry tests/CN=localhost".to_owned(),
            format!(
                "basicConstraints=critical,CA:FALSE\n\
                 keyUsage=critical,{server_key_usage}\n\
                 extendedKeyUsage=serverAuth\n\
                 subjectAltName=DNS:localhost,IP:127.0.0.1{extra_sans}\n\
                 subjectKeyIdentifier=hash\n\
                 authorityKeyIdentifier=keyid\n"
            ),
        ),
        (
            "client",
            format!("/O=Ferry tests/CN={CLIENT_CN}"),
            "basicConstraints=critical,CA:FALSE\n\
             keyUsage=critical,digitalSignature\n\
             extendedKeyUsage=clientAuth\n\
             subjectKeyIdentifier=hash\n\
             authorityKeyIdentifier=keyid\n"
                .to_owned(),
        ),
    ]
}

/// `name.key` and `name.pem` in `d`: a key and CSR, signed by the CA with explicit extensions.
fn sign_leaf(d: &Path, newkey: &[&str], name: &str, subject: &str, extensions: &str) -> Result<()> {
    let (key, csr, cert, ext) = (
        format!("{name}.key"),
        format!("{name}.csr"),
        format!("{name}.pem"),
        format!("{name}.ext"),
    );
    fs::write(d.join(&ext), extensions)?;
    openssl(
        d,
        &[
            &["req", "-config", "req.cnf", "-new", "-nodes"],
            newkey,
            &["-keyout", &key, "-out", &csr, "-subj", subject],
        ]
        .concat(),
    )?;
    openssl(
        d,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAserial",
            "ca.srl",
            "-CAcreateserial",
            "-days",
            "30",
            "-sha256",
            "-extfile",
            &ext,
            "-out",
            &cert,
        ],
    )
}

fn openssl(dir: &Path, args: &[&str]) -> Result<()> {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .context("cannot run `openssl` (install it: e2e/install.sh)")?;
    if !out.status.success() {
        bail!(
            "openssl {} failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}
