//! A client of a schema registry's Confluent REST API: one call, a subject's schema at a
//! version (or its latest), over HTTP or verified TLS, with basic authentication.

use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use ferry_api::config::{SchemaFormat, SchemaRegistry};
use http_body_util::{BodyExt, Empty, Limited};
use hyper::http::{HeaderValue, Request, StatusCode, header};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Deserialize;

use crate::tls::{self, TlsSetupError};

/// A registry that does not answer within this is unreachable for this attempt.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// A schema is text of a few KiB; an answer beyond this is not one.
const MAX_ANSWER_BYTES: usize = 4 << 20;

/// A subject's schema as the registry served it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fetched {
    pub subject: String,
    pub version: u32,
    pub id: u32,
    pub format: SchemaFormat,
    pub text: String,
}

/// Why a schema could not be fetched; never carries credentials.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("schema registry {url}: {source}")]
    Tls { url: String, source: TlsSetupError },
    #[error("schema registry url {url:?} is not usable: {reason}")]
    Url { url: String, reason: String },
    #[error("schema registry {url} unreachable: {reason}")]
    Unreachable { url: String, reason: String },
    #[error(
        "schema registry {url} refused the credentials (HTTP {status}) for subject {subject:?}"
    )]
    Unauthorized {
        url: String,
        subject: String,
        status: u16,
    },
    #[error("schema registry {url} has no subject {subject:?} (or no version {version} of it)")]
    NotFound {
        url: String,
        subject: String,
        version: String,
    },
    #[error("schema registry {url} answered HTTP {status} for subject {subject:?}: {message}")]
    Status {
        url: String,
        subject: String,
        status: u16,
        message: String,
    },
    #[error("schema registry {url}: the answer for subject {subject:?} is not a schema: {reason}")]
    Malformed {
        url: String,
        subject: String,
        reason: String,
    },
    #[error(
        "subject {subject:?} version {version} uses schema references ({names}), which Ferry does \
         not resolve yet: register the schema self-contained"
    )]
    References {
        subject: String,
        version: u32,
        names: String,
    },
}

pub struct RegistryClient {
    base: String,
    authorization: Option<HeaderValue>,
    client: Client<HttpsConnector<HttpConnector>, Empty<Bytes>>,
}

impl RegistryClient {
    /// The registry's base URL: which registry it is (schema ids are its own).
    pub fn base(&self) -> &str {
        &self.base
    }
}

impl std::fmt::Debug for RegistryClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistryClient")
            .field("base", &self.base)
            .field("authorization", &self.authorization.as_ref().map(|_| "***"))
            .finish_non_exhaustive()
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct SubjectVersion {
    subject: String,
    version: u32,
    id: u32,
    schema: String,
    #[serde(default)]
    schema_type: Option<String>,
    #[serde(default)]
    references: Vec<Reference>,
}

#[derive(Deserialize)]
struct Reference {
    name: String,
}

#[derive(Deserialize)]
struct ErrorAnswer {
    #[serde(default)]
    message: String,
}

impl RegistryClient {
    /// From a validated config whose credential files were read.
    pub fn new(config: &SchemaRegistry) -> Result<Self, RegistryError> {
        let base = config.url.trim_end_matches('/').to_owned();
        let tls = match &config.tls {
            Some(t) => tls::client_config("schema_registry.tls", t),
            // Plain HTTP needs no roots; an image without system roots must still reach it.
            None if base.starts_with("http://") => tls::no_roots_config("schema_registry.tls"),
            None => tls::client_config("schema_registry.tls", &Default::default()),
        };
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls.map_err(|source| RegistryError::Tls {
                url: base.clone(),
                source,
            })?)
            .https_or_http()
            .enable_http1()
            .build();
        let authorization = match &config.basic_auth {
            Some(a) => {
                let token = base64::engine::general_purpose::STANDARD.encode(format!(
                    "{}:{}",
                    a.username,
                    a.password.expose()
                ));
                let mut value = HeaderValue::from_str(&format!("Basic {token}")).map_err(|_| {
                    RegistryError::Url {
                        url: base.clone(),
                        reason: "basic_auth does not make a valid header".into(),
                    }
                })?;
                value.set_sensitive(true);
                Some(value)
            }
            None => None,
        };
        Ok(Self {
            base,
            authorization,
            client: Client::builder(TokioExecutor::new()).build(connector),
        })
    }

    pub fn url(&self) -> &str {
        &self.base
    }

    /// The schema of `subject` at `version` (`None`: its latest).
    pub async fn fetch(
        &self,
        subject: &str,
        version: Option<u32>,
    ) -> Result<Fetched, RegistryError> {
        let version_text = version.map_or_else(|| "latest".to_owned(), |v| v.to_string());
        let uri = format!(
            "{}/subjects/{}/versions/{version_text}",
            self.base,
            path_segment(subject)
        );
        let mut request = Request::get(&uri).header(
            header::ACCEPT,
            "application/vnd.schemaregistry.v1+json, application/json",
        );
        if let Some(auth) = &self.authorization {
            request = request.header(header::AUTHORIZATION, auth.clone());
        }
        let request = request.body(Empty::new()).map_err(|e| RegistryError::Url {
            url: self.base.clone(),
            reason: e.to_string(),
        })?;
        let unreachable = |reason: String| RegistryError::Unreachable {
            url: self.base.clone(),
            reason,
        };
        let (status, body) = tokio::time::timeout(REQUEST_TIMEOUT, async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|e| unreachable(error_chain(&e)))?;
            let status = response.status();
            let body = Limited::new(response.into_body(), MAX_ANSWER_BYTES)
                .collect()
                .await
                .map_err(|e| unreachable(format!("reading the answer: {e}")))?
                .to_bytes();
            Ok::<_, RegistryError>((status, body))
        })
        .await
        .map_err(|_| unreachable(format!("no answer within {REQUEST_TIMEOUT:?}")))??;
        self.answer(subject, &version_text, status, &body)
    }

    fn answer(
        &self,
        subject: &str,
        version: &str,
        status: StatusCode,
        body: &[u8],
    ) -> Result<Fetched, RegistryError> {
        let url = || self.base.clone();
        match status {
            s if s.is_success() => {}
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => {
                return Err(RegistryError::Unauthorized {
                    url: url(),
                    subject: subject.to_owned(),
                    status: status.as_u16(),
                });
            }
            StatusCode::NOT_FOUND => {
                return Err(RegistryError::NotFound {
                    url: url(),
                    subject: subject.to_owned(),
                    version: version.to_owned(),
                });
            }
            _ => {
                let message = serde_json::from_slice::<ErrorAnswer>(body)
                    .map(|e| e.message)
                    .unwrap_or_default();
                return Err(RegistryError::Status {
                    url: url(),
                    subject: subject.to_owned(),
                    status: status.as_u16(),
                    message: excerpt(&message),
                });
            }
        }
        let malformed = |reason: String| RegistryError::Malformed {
            url: url(),
            subject: subject.to_owned(),
            reason,
        };
        let v: SubjectVersion =
            serde_json::from_slice(body).map_err(|e| malformed(e.to_string()))?;
        if !v.references.is_empty() {
            return Err(RegistryError::References {
                subject: v.subject,
                version: v.version,
                names: v
                    .references
                    .iter()
                    .map(|r| r.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        }
        let format = match v.schema_type.as_deref() {
            None | Some("AVRO") => SchemaFormat::Avro,
            Some("PROTOBUF") => SchemaFormat::Protobuf,
            Some("JSON") => SchemaFormat::JsonSchema,
            Some(other) => return Err(malformed(format!("unknown schemaType {other:?}"))),
        };
        Ok(Fetched {
            subject: v.subject,
            version: v.version,
            id: v.id,
            format,
            text: v.schema,
        })
    }
}

/// A subject as one URL path segment: everything but RFC 3986's unreserved characters
/// percent-encoded (subjects may hold `/`, `:` or spaces).
fn path_segment(subject: &str) -> String {
    // `.` and `..` alone are dot-segments a proxy or server would collapse.
    if subject == "." || subject == ".." {
        return subject.replace('.', "%2E");
    }
    let mut out = String::with_capacity(subject.len());
    for b in subject.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// An error and its causes, for a connection error whose top says only "client error".
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

/// A registry's message, bounded: it ends up in status and logs.
fn excerpt(message: &str) -> String {
    const MAX: usize = 300;
    match message.char_indices().nth(MAX) {
        Some((at, _)) => format!("{}…", &message[..at]),
        None => message.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_api::config::{BasicAuth, Secret};

    fn client(url: &str) -> RegistryClient {
        let config = SchemaRegistry {
            url: url.into(),
            tls: None,
            basic_auth: Some(BasicAuth {
                username: "ferry".into(),
                password: Secret("s3cret-pass".into()),
                ..BasicAuth::default()
            }),
        };
        match RegistryClient::new(&config) {
            Ok(c) => c,
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn subjects_are_one_escaped_path_segment() {
        assert_eq!(path_segment("telemetry-value"), "telemetry-value");
        assert_eq!(
            path_segment("com.acme/Reading v2"),
            "com.acme%2FReading%20v2"
        );
        assert_eq!(path_segment("ü"), "%C3%BC");
        assert_eq!(path_segment(".."), "%2E%2E");
        assert_eq!(path_segment("a.b"), "a.b");
    }

    #[test]
    fn answers_become_schemas_or_typed_errors_without_credentials() {
        let c = client("http://127.0.0.1:1/apis/ccompat/v7/");
        assert_eq!(c.url(), "http://127.0.0.1:1/apis/ccompat/v7");
        assert!(!format!("{c:?}").contains("s3cret"), "{c:?}");
        let ok = br#"{"subject":"t-value","version":3,"id":7,"schema":"{\"type\":\"string\"}"}"#;
        let f = c.answer("t-value", "latest", StatusCode::OK, ok);
        assert_eq!(
            f.ok(),
            Some(Fetched {
                subject: "t-value".into(),
                version: 3,
                id: 7,
                format: SchemaFormat::Avro,
                text: r#"{"type":"string"}"#.into(),
            })
        );
        let proto = br#"{"subject":"p","version":1,"id":2,"schemaType":"PROTOBUF","schema":"syntax = \"proto3\";"}"#;
        let f = c.answer("p", "1", StatusCode::OK, proto);
        assert_eq!(f.map(|f| f.format).ok(), Some(SchemaFormat::Protobuf));
        let refs = br#"{"subject":"p","version":1,"id":2,"schema":"{}","references":[{"name":"other.avsc","subject":"o","version":1}]}"#;
        let e = c.answer("p", "1", StatusCode::OK, refs).err();
        assert!(matches!(e, Some(RegistryError::References { .. })), "{e:?}");
        for status in [
            StatusCode::UNAUTHORIZED,
            StatusCode::FORBIDDEN,
            StatusCode::NOT_FOUND,
            StatusCode::SERVICE_UNAVAILABLE,
        ] {
            let e = c.answer("p", "latest", status, br#"{"error_code":1,"message":"m"}"#);
            let e = e.err().map(|e| e.to_string());
            assert!(
                e.as_ref()
                    .is_some_and(|text| !text.contains("s3cret") && text.contains("\"p\"")),
                "{status}: {e:?}"
            );
        }
        let e = c.answer("p", "latest", StatusCode::OK, b"<html>").err();
        assert!(matches!(e, Some(RegistryError::Malformed { .. })), "{e:?}");
    }

    #[tokio::test]
    async fn an_unreachable_registry_is_an_error_naming_it() {
        let port = ferry_e2e::free_port().unwrap_or_else(|e| panic!("{e}"));
        let url = format!("http://127.0.0.1:{port}");
        let e = client(&url).fetch("t-value", None).await.err();
        assert!(
            matches!(&e, Some(RegistryError::Unreachable { url: u, .. }) if *u == url),
            "{e:?}"
        );
    }
}
