//! TLS to the MQTT broker (rustls with the ring provider). The broker's certificate is always
//! verified; the client certificate may be RSA or ECDSA (PKCS#1, PKCS#8 or SEC1 PEM keys).

use std::sync::Arc;

use ferry_api::config::Tls;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{ClientConfig, RootCertStore};

/// A TLS setting that cannot work; names the file and what is wrong with it.
#[derive(Debug, thiserror::Error)]
pub enum TlsSetupError {
    #[error("{field} {path}: cannot read PEM certificates: {reason}")]
    Certificates {
        field: String,
        path: String,
        reason: String,
    },
    #[error("{field} {path}: no certificate in the file")]
    NoCertificate { field: String, path: String },
    #[error("{field} {path}: cannot read a PEM private key (PKCS#1, PKCS#8 or SEC1): {reason}")]
    Key {
        field: String,
        path: String,
        reason: String,
    },
    #[error("{at}.ca_file {path}: certificate not usable as a trust anchor: {reason}")]
    TrustAnchor {
        at: &'static str,
        path: String,
        reason: String,
    },
    #[error("{at}: no trusted roots: ca_file is unset and the system has none ({reason})")]
    NoSystemRoots { at: &'static str, reason: String },
    #[error("{at}: client certificate and key do not fit together: {source}")]
    ClientAuth {
        at: &'static str,
        source: rustls::Error,
    },
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// `at`: the settings' path in the config (`mqtt.tls`), for the errors.
pub fn client_config(at: &'static str, tls: &Tls) -> Result<ClientConfig, TlsSetupError> {
    let field = |name: &str| format!("{at}.{name}");
    let mut roots = RootCertStore::empty();
    match &tls.ca_file {
        Some(path) => {
            for cert in read_certs(field("ca_file"), path)? {
                roots.add(cert).map_err(|e| TlsSetupError::TrustAnchor {
                    at,
                    path: path.clone(),
                    reason: e.to_string(),
                })?;
            }
        }
        None => {
            let native = rustls_native_certs::load_native_certs();
            for cert in native.certs {
                // A broken system certificate is not ours to fail on; the rest still count.
                let _ = roots.add(cert);
            }
            if roots.is_empty() {
                return Err(TlsSetupError::NoSystemRoots {
                    at,
                    reason: native
                        .errors
                        .first()
                        .map_or_else(|| "none found".to_owned(), ToString::to_string),
                });
            }
        }
    }
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsSetupError::ClientAuth { at, source })?
        .with_root_certificates(roots);
    match (&tls.cert_file, &tls.key_file) {
        (Some(cert), Some(key)) => {
            let chain = read_certs(field("cert_file"), cert)?;
            let key = PrivateKeyDer::from_pem_file(key).map_err(|e| TlsSetupError::Key {
                field: field("key_file"),
                path: key.clone(),
                reason: e.to_string(),
            })?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|source| TlsSetupError::ClientAuth { at, source })
        }
        _ => Ok(builder.with_no_client_auth()),
    }
}

/// A config that trusts nobody: for a client whose URL is plain HTTP. `at` as for
/// [`client_config`].
pub fn no_roots_config(at: &'static str) -> Result<ClientConfig, TlsSetupError> {
    Ok(ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsSetupError::ClientAuth { at, source })?
        .with_root_certificates(RootCertStore::empty())
        .with_no_client_auth())
}

fn read_certs(field: String, path: &str) -> Result<Vec<CertificateDer<'static>>, TlsSetupError> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| TlsSetupError::Certificates {
            field: field.clone(),
            path: path.to_owned(),
            reason: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsSetupError::NoCertificate {
            field,
            path: path.to_owned(),
        });
    }
    Ok(certs)
}

/// The certificate problem inside a TLS handshake error, if that is what it was (tokio-rustls
/// hands rustls' error over inside the `io::Error`).
pub fn certificate_error(e: &std::io::Error) -> Option<rustls::Error> {
    let inner = e.get_ref()?.downcast_ref::<rustls::Error>()?;
    match inner {
        rustls::Error::InvalidCertificate(_) | rustls::Error::NoCertificatesPresented => {
            Some(inner.clone())
        }
        _ => None,
    }
}
