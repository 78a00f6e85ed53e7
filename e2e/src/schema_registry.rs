//! A real schema registry for tests: Apicurio Registry (`e2e/registry/pom.xml` pins the version;
//! `e2e/install.sh` builds it from Maven Central into `$FERRY_CACHE/apicurio-registry-<version>`),
//! serving the Confluent Schema Registry API at `/apis/ccompat/v7`, storage in memory (H2), on a
//! free loopback port. Stopped on drop and, like the brokers, through `PR_SET_PDEATHSIG` when the
//! thread that started it ends.
//!
//! Variants ([`SchemaRegistryOptions`]): HTTPS with a [`Pki`]'s server certificate, and HTTP
//! basic authentication. Apicurio's own basic auth exchanges the credentials for a token at a
//! Keycloak, so the build swaps its authentication mechanism for Quarkus's standard HTTP basic
//! one with users given at start; Apicurio's own authorization check still decides (every
//! request needs an authenticated user, anonymous ones get 401).
//!
//! The independent decoder: [`SchemaRegistry::confluent_consume`] runs `e2e/tools/confluent_consume.py`
//! (confluent-kafka's own deserializers, in the venv `install.sh` makes), and
//! [`SchemaRegistry::confluent_produce`] writes reference records with confluent-kafka's
//! serializers.

use std::fmt;
use std::io::Write as _;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail, ensure};

use crate::credentials::{check_credential, check_password};
use crate::http::{HttpOptions, http_request};
use crate::logs::tail;
use crate::pki::Pki;
use crate::process::{Placement, cache_dir, free_port, spawn_tied, terminate};

/// The registry build's pins, read where `install.sh` reads them.
const REGISTRY_POM: &str = include_str!("../registry/pom.xml");
const PYTHON_REQUIREMENTS: &str = include_str!("../tools/confluent-requirements.txt");

/// How long a start may take before it fails. Measured here (2 cores, load 3-4): the API
/// answers 3.2 to 3.7 s after the JVM starts; up to 8 s without the JVM options below.
const START_TIMEOUT: Duration = Duration::from_secs(45);

/// The JVM of a test registry: C1 only and the serial collector start it fastest (about 3.5 s
/// instead of 4-8 s) and keep it at about 155 MB RSS (210 MB without -Xms64m); a test's
/// schemas need little heap.
const REGISTRY_JVM: &[&str] = &[
    "-Xms64m",
    "-Xmx256m",
    "-XX:TieredStopAtLevel=1",
    "-XX:+UseSerialGC",
];

/// The Confluent-compatible API's path under the registry's root.
pub const CCOMPAT_PATH: &str = "/apis/ccompat/v7";

/// A schema's type as the Confluent API names it (`schemaType`; absent means Avro).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SchemaType {
    Avro,
    Protobuf,
    Json,
}

impl SchemaType {
    /// The `schemaType` of the Confluent API.
    pub fn api_name(self) -> &'static str {
        match self {
            Self::Avro => "AVRO",
            Self::Protobuf => "PROTOBUF",
            Self::Json => "JSON",
        }
    }

    /// The format argument of `confluent_consume.py` / `confluent_produce.py`.
    fn tool_name(self) -> &'static str {
        match self {
            Self::Avro => "avro",
            Self::Protobuf => "protobuf",
            Self::Json => "json",
        }
    }
}

impl fmt::Display for SchemaType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.api_name())
    }
}

/// How to start a [`SchemaRegistry`]. `SchemaRegistryOptions::default()` is what
/// [`SchemaRegistry::start`] runs: plain HTTP, anonymous access.
#[derive(Debug, Default, Clone)]
pub struct SchemaRegistryOptions<'a> {
    /// HTTPS only (no plain HTTP listener), with the PKI's server certificate (SANs
    /// `localhost`, `127.0.0.1` and the PKI's extra IPs). The files are copied into the
    /// registry's dir. [`SchemaRegistry::url`] is then `https://…`.
    pub tls: Option<&'a Pki>,
    /// `(user name, password)`: every request needs these in HTTP basic auth; without, or with
    /// others, the registry answers 401. Name: see [`crate::check_credential`]; password: see
    /// [`crate::check_password`].
    pub basic_auth: Option<(String, String)>,
}

/// A running Apicurio Registry; see the module docs.
pub struct SchemaRegistry {
    child: Child,
    dir: tempfile::TempDir,
    host: IpAddr,
    port: u16,
    ca: Option<PathBuf>,
    basic_auth: Option<(String, String)>,
}

impl SchemaRegistry {
    /// Where `install.sh` puts the runnable registry: `registry.jar` and its `lib/`.
    pub fn install_dir() -> PathBuf {
        cache_dir().join(format!("apicurio-registry-{}", apicurio_version()))
    }

    /// Plain HTTP, anonymous access.
    pub fn start() -> Result<Self> {
        Self::start_with(SchemaRegistryOptions::default())
    }

    /// Plain HTTP, every request authenticated with `user` and `password` (HTTP basic).
    pub fn start_with_basic_auth(user: &str, password: &str) -> Result<Self> {
        Self::start_with(SchemaRegistryOptions {
            basic_auth: Some((user.to_owned(), password.to_owned())),
            ..SchemaRegistryOptions::default()
        })
    }

    pub fn start_with(options: SchemaRegistryOptions<'_>) -> Result<Self> {
        Self::start_placed(options, Placement::default())
    }

    /// [`SchemaRegistry::start_with`], run where `placement` says and listening on
    /// `placement.bind` instead of 127.0.0.1. Returns once the Confluent API answers (a 200
    /// to `GET /subjects`, with the credentials when there are some), so a test never meets a
    /// registry still starting; fails with the log's tail if it does not within 45 s.
    pub fn start_placed(options: SchemaRegistryOptions<'_>, placement: Placement) -> Result<Self> {
        let install = Self::install_dir();
        if !install.join(".complete").exists() {
            bail!(
                "Apicurio Registry not built in {}: run e2e/install.sh",
                install.display()
            );
        }
        let host = placement.host();
        let dir = tempfile::Builder::new()
            .prefix("ferry-schema-registry-")
            .tempdir()?;
        let port = free_port()?;
        let mut props = vec![
            ("quarkus.http.host".to_owned(), host.to_string()),
            // Work files (H2 keeps its database in memory; Vert.x caches files) in the dir.
            (
                "java.io.tmpdir".to_owned(),
                dir.path().display().to_string(),
            ),
        ];
        let mut ca = None;
        match options.tls {
            None => props.push(("quarkus.http.port".to_owned(), port.to_string())),
            Some(pki) => {
                let copy = |from: &Path, name: &str| -> Result<String> {
                    let to = dir.path().join(name);
                    std::fs::copy(from, &to).with_context(|| format!("copy {}", from.display()))?;
                    Ok(to.display().to_string())
                };
                let cert = copy(pki.server_cert(), "server.pem")?;
                let key = copy(pki.server_key(), "server.key")?;
                props.extend([
                    ("quarkus.http.ssl-port".to_owned(), port.to_string()),
                    // No plain HTTP listener: with requests over HTTP disabled, Quarkus does not
                    // bind quarkus.http.port (set to a free one all the same, not 8080).
                    (
                        "quarkus.http.insecure-requests".to_owned(),
                        "disabled".to_owned(),
                    ),
                    ("quarkus.http.port".to_owned(), free_port()?.to_string()),
                    ("quarkus.http.ssl.certificate.files".to_owned(), cert),
                    ("quarkus.http.ssl.certificate.key-files".to_owned(), key),
                ]);
                ca = Some(PathBuf::from(copy(pki.ca_cert(), "ca.pem")?));
            }
        }
        if let Some((user, password)) = &options.basic_auth {
            check_credential("schema registry user", user)?;
            check_password("schema registry password", password)?;
            // Quarkus's config expands `${…}` and trims the ends of the -D properties below.
            ensure!(
                !password.contains("${") && password.trim() == password,
                "the schema registry password may not contain \"${{\" nor start or end with \
                 white space (Quarkus's config expands and trims it)"
            );
            props.extend([
                // Apicurio's authorization: anonymous requests are refused.
                ("registry.auth.enabled".to_owned(), "true".to_owned()),
                // No OIDC server: the users below are the only identities.
                ("quarkus.oidc.tenant-enabled".to_owned(), "false".to_owned()),
                (
                    format!("quarkus.security.users.embedded.users.{user}"),
                    password.clone(),
                ),
            ]);
        }
        let log = dir.path().join("registry.log");
        let mut cmd = placement.command(Path::new("java"));
        cmd.args(REGISTRY_JVM)
            .args(props.iter().map(|(k, v)| format!("-D{k}={v}")))
            .arg("-jar")
            .arg(install.join("registry.jar"))
            .current_dir(dir.path());
        let child = spawn_tied(&mut cmd, &log)?;
        let mut registry = Self {
            child,
            dir,
            host,
            port,
            ca,
            basic_auth: options.basic_auth,
        };
        registry.wait_ready(START_TIMEOUT)?;
        Ok(registry)
    }

    fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        let mut last = String::from("no answer yet");
        while start.elapsed() < timeout {
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "schema registry exited with {status} before its API answered; log {}:\n{}",
                    self.log().display(),
                    tail(&self.log())
                );
            }
            match self.request("GET", "/subjects", None) {
                Ok((200, _)) => return Ok(()),
                Ok((status, body)) => last = format!("{status} {body}"),
                Err(e) => last = format!("{e:#}"),
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        bail!(
            "schema registry's API did not answer 200 at {} within {timeout:?} (last: {last}); \
             log {}:\n{}",
            self.url(),
            self.log().display(),
            tail(&self.log())
        )
    }

    /// The Confluent-compatible API's base URL, e.g. `http://127.0.0.1:PORT/apis/ccompat/v7`
    /// (`https://` with TLS): what a Confluent client's `schema.registry.url` is set to.
    pub fn url(&self) -> String {
        let scheme = if self.ca.is_some() { "https" } else { "http" };
        format!("{scheme}://{}{CCOMPAT_PATH}", self.address())
    }

    /// `host:port` of the API.
    pub fn address(&self) -> SocketAddr {
        SocketAddr::new(self.host, self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// With TLS, the CA that signed the registry's certificate.
    pub fn ca_cert(&self) -> Option<&Path> {
        self.ca.as_deref()
    }

    /// The registry's dir (its log, the certificate copies).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The registry's output (Quarkus's log, one line per event).
    pub fn log(&self) -> PathBuf {
        self.dir.path().join("registry.log")
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// One request to the Confluent API, `path` relative to [`SchemaRegistry::url`] (e.g.
    /// `/subjects/t-value/versions`), with the registry's credentials and trusting its CA; a
    /// `body` is sent as `application/json`. Returns status and body.
    pub fn request(&self, method: &str, path: &str, body: Option<&str>) -> Result<(u16, String)> {
        let options = HttpOptions {
            body,
            tls_ca: self.ca.as_deref(),
            basic_auth: self
                .basic_auth
                .as_ref()
                .map(|(user, password)| (user.as_str(), password.as_str())),
        };
        http_request(
            self.address(),
            method,
            &format!("{CCOMPAT_PATH}{path}"),
            &options,
        )
    }

    /// [`SchemaRegistry::request`] that expects a 200 with a JSON body, and returns it parsed.
    pub fn request_ok(
        &self,
        method: &str,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> Result<serde_json::Value> {
        let text = body.map(serde_json::Value::to_string);
        let (status, answer) = self.request(method, path, text.as_deref())?;
        ensure!(status == 200, "{method} {path}: {status} {answer}");
        serde_json::from_str(&answer)
            .with_context(|| format!("{method} {path}: not JSON: {answer}"))
    }

    /// Registers `schema` under `subject` (`POST /subjects/{subject}/versions`); returns its
    /// id. Registering the same schema again returns the same id.
    pub fn register(&self, subject: &str, schema_type: SchemaType, schema: &str) -> Result<u32> {
        let mut body = serde_json::json!({ "schema": schema });
        if schema_type != SchemaType::Avro {
            body["schemaType"] = schema_type.api_name().into();
        }
        let answer = self.request_ok(
            "POST",
            &format!("/subjects/{subject}/versions"),
            Some(&body),
        )?;
        id_of(&answer).with_context(|| format!("register {subject}: {answer}"))
    }

    /// Reads `count` records of `topic` at `bootstrap` and decodes each with confluent-kafka's
    /// own deserializer for `schema_type` against this registry (`e2e/tools/confluent_consume.py`).
    /// One JSON object per record: `partition`, `offset`, `key`, `schema_id` (from the wire
    /// header) and `value` (decoded). Fails with the script's output when a record does not
    /// decode or fewer than `count` arrive within `timeout`.
    pub fn confluent_consume(
        &self,
        bootstrap: &str,
        topic: &str,
        count: usize,
        schema_type: SchemaType,
        timeout: Duration,
    ) -> Result<Vec<serde_json::Value>> {
        let mut cmd = self.tool("confluent_consume.py")?;
        cmd.args([
            bootstrap,
            topic,
            &count.to_string(),
            schema_type.tool_name(),
        ])
        .arg(self.url())
        .args(self.tool_connection_args())
        .arg("--timeout")
        .arg(timeout.as_secs_f64().to_string());
        let out = run_tool(&mut cmd, "", timeout + Duration::from_secs(30))?;
        out.lines()
            .map(|line| {
                serde_json::from_str(line).with_context(|| format!("confluent_consume.py: {line}"))
            })
            .collect()
    }

    /// Writes one record per value to `topic` at `bootstrap` with confluent-kafka's serializer
    /// for `schema_type`, using the schema registered last under `<topic>-value`
    /// (`e2e/tools/confluent_produce.py`; Protobuf: the message named `message`, or the file's
    /// first). Returns the schema id the records carry.
    pub fn confluent_produce(
        &self,
        bootstrap: &str,
        topic: &str,
        schema_type: SchemaType,
        message: Option<&str>,
        values: &[serde_json::Value],
    ) -> Result<u32> {
        let mut cmd = self.tool("confluent_produce.py")?;
        cmd.args([bootstrap, topic, schema_type.tool_name()])
            .arg(self.url())
            .args(self.tool_connection_args());
        if let Some(message) = message {
            cmd.args(["--message", message]);
        }
        let input: String = values.iter().map(|v| format!("{v}\n")).collect();
        let out = run_tool(&mut cmd, &input, Duration::from_secs(60))?;
        out.trim()
            .parse()
            .with_context(|| format!("confluent_produce.py printed no schema id: {out}"))
    }

    /// A command running one of `e2e/tools/`'s scripts with the venv's Python.
    fn tool(&self, script: &str) -> Result<Command> {
        let venv = python_venv();
        if !venv.join(".complete").exists() {
            bail!(
                "confluent-kafka's venv not found in {}: run e2e/install.sh",
                venv.display()
            );
        }
        let mut cmd = Command::new(venv.join("bin/python"));
        // No __pycache__ in the repository's e2e/tools.
        cmd.env("PYTHONDONTWRITEBYTECODE", "1").arg(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tools")
                .join(script),
        );
        Ok(cmd)
    }

    fn tool_connection_args(&self) -> Vec<String> {
        let mut args = Vec::new();
        if let Some((user, password)) = &self.basic_auth {
            args.extend([
                "--registry-user".to_owned(),
                user.clone(),
                "--registry-password".to_owned(),
                password.clone(),
            ]);
        }
        if let Some(ca) = &self.ca {
            args.extend(["--registry-ca".to_owned(), ca.display().to_string()]);
        }
        args
    }
}

impl Drop for SchemaRegistry {
    fn drop(&mut self) {
        terminate(&mut self.child, Duration::from_secs(5));
    }
}

/// The Apicurio version `e2e/registry/pom.xml` pins.
fn apicurio_version() -> &'static str {
    REGISTRY_POM
        .split_once("<apicurio.version>")
        .and_then(|(_, rest)| rest.split_once("</apicurio.version>"))
        .map(|(version, _)| version.trim())
        .expect("e2e/registry/pom.xml names <apicurio.version>")
}

/// `$FERRY_CACHE/python-confluent-kafka-<version>`, as `install.sh` names it.
pub fn python_venv() -> PathBuf {
    let version = PYTHON_REQUIREMENTS
        .lines()
        .find_map(|line| {
            line.strip_prefix("confluent-kafka[")?
                .split_once("]==")
                .map(|(_, v)| v)
        })
        .expect("e2e/tools/confluent-requirements.txt pins confluent-kafka")
        .trim();
    cache_dir().join(format!("python-confluent-kafka-{version}"))
}

/// The `id` of a Confluent API answer (`{"id": 1}`, `{"id": 1, "version": …}`).
fn id_of(answer: &serde_json::Value) -> Result<u32> {
    answer["id"]
        .as_u64()
        .and_then(|id| u32::try_from(id).ok())
        .ok_or_else(|| anyhow!("no id"))
}

/// Runs a tool to its end with `input` on stdin; its stdout, or an error with both outputs.
fn run_tool(cmd: &mut Command, input: &str, timeout: Duration) -> Result<String> {
    let what = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot run {what}"))?;
    // A script that fails early closes its stdin: its exit status and stderr say why.
    let _ = child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(input.as_bytes());
    // Output is drained by wait_with_output; the script bounds its own run (--timeout), and
    // this is the backstop.
    let pid = child.id();
    let watchdog = std::thread::spawn(move || {
        let start = Instant::now();
        while start.elapsed() < timeout {
            std::thread::sleep(Duration::from_millis(100));
            // SAFETY: kill(pid, 0) only checks that the process still exists.
            if unsafe { libc::kill(pid as i32, 0) } != 0 {
                return false;
            }
        }
        // SAFETY: plain kill(2) of the tool this function started.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        true
    });
    let out = child.wait_with_output()?;
    let killed = watchdog.join().unwrap_or(false);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        !killed && out.status.success(),
        "{what}: {}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        if killed {
            format!("killed after {timeout:?}")
        } else {
            out.status.to_string()
        }
    );
    Ok(stdout)
}
