//! A minimal HTTP/1.0 client for the servers the tests start: probes, `/status`, `/metrics`
//! and the schema registry's API.

use std::io::Write as _;
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use rustls::pki_types::pem::PemObject as _;

/// A minimal HTTP/1.0 GET to `addr`: (status, body). Fails when nothing answers there, so a
/// check never passes on an empty body.
pub fn http_get_at(addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    http_request(addr, "GET", path, &HttpOptions::default())
}

/// How [`http_request`] talks to a server beyond method and path.
#[derive(Debug, Default, Clone, Copy)]
pub struct HttpOptions<'a> {
    /// Sent as `application/json` (the Confluent schema registry API takes it).
    pub body: Option<&'a str>,
    /// HTTPS, trusting only this CA (PEM); the name checked is `addr`'s IP.
    pub tls_ca: Option<&'a Path>,
    /// `(user, password)` for HTTP basic authentication.
    pub basic_auth: Option<(&'a str, &'a str)>,
}

/// One HTTP/1.0 request to `addr`: (status, body). The server closes the connection after its
/// answer, which is never chunked; fails when nothing answers.
pub fn http_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    options: &HttpOptions<'_>,
) -> Result<(u16, String)> {
    use base64::Engine as _;
    use std::io::Read as _;
    let what = format!("{method} {addr}{path}");
    let mut request = format!("{method} {path} HTTP/1.0\r\nHost: {addr}\r\n");
    if let Some((user, password)) = options.basic_auth {
        let token = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        request.push_str(&format!("Authorization: Basic {token}\r\n"));
    }
    if let Some(body) = options.body {
        request.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    request.push_str("\r\n");
    request.push_str(options.body.unwrap_or(""));
    let tcp = TcpStream::connect_timeout(&addr, Duration::from_secs(3))
        .with_context(|| format!("{what}: cannot connect"))?;
    tcp.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut answer = Vec::new();
    match options.tls_ca {
        None => {
            let mut tcp = tcp;
            tcp.write_all(request.as_bytes())?;
            tcp.read_to_end(&mut answer)
                .with_context(|| format!("{what}: reading the answer"))?;
        }
        Some(ca) => {
            let conn = rustls::ClientConnection::new(
                tls_client_config(ca)?,
                rustls::pki_types::ServerName::from(addr.ip()),
            )?;
            let mut tls = rustls::StreamOwned::new(conn, tcp);
            tls.write_all(request.as_bytes())
                .with_context(|| format!("{what}: TLS"))?;
            match tls.read_to_end(&mut answer) {
                Ok(_) => {}
                // A peer that closes without close_notify, after a whole answer.
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !answer.is_empty() => {}
                Err(e) => return Err(e).with_context(|| format!("{what}: reading the answer")),
            }
        }
    }
    let text = String::from_utf8_lossy(&answer);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .with_context(|| format!("{what}: not an HTTP answer: {text:?}"))?;
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("{what}: no status in {head:?}"))?;
    Ok((status, body.to_owned()))
}

/// A rustls client configuration trusting only the certificates in the PEM file `ca`.
fn tls_client_config(ca: &Path) -> Result<Arc<rustls::ClientConfig>> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_file_iter(ca)
        .with_context(|| format!("read {}", ca.display()))?
    {
        roots.add(cert?)?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}

/// [`http_get_at`] on 127.0.0.1: enough for `/readyz`, `/status` and `/metrics`.
pub fn http_get(port: u16, path: &str) -> Result<(u16, String)> {
    http_get_at(SocketAddr::from((Ipv4Addr::LOCALHOST, port)), path)
}

/// The body of a 200 answer to `GET path` at `addr`; any other status is an error.
pub fn http_get_ok(addr: SocketAddr, path: &str) -> Result<String> {
    match http_get_at(addr, path)? {
        (200, body) => Ok(body),
        (status, body) => bail!("GET {addr}{path}: {status}\n{body}"),
    }
}
