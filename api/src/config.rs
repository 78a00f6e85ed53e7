//! The forwarder's configuration: the file `ferry-forwarder --config` reads and the operator
//! renders. Two input formats are accepted:
//! - Ferry's own (top-level `rules`), documented in the README;
//! - the replaced forwarder's `config.yaml` (top-level `forwarding`), unchanged.
//!
//! Both become one [`ForwarderConfig`]. Loading never stops at the first problem: every invalid
//! field is reported with its path.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::SocketAddr;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::addr;
use crate::credentials;
use crate::defaults;
use crate::env;
use crate::kafka_props;
use crate::legacy;
use crate::topic::{TopicFilter, TopicTemplate, is_valid_share_group, validate_kafka_topic};

/// Upper bound for `rules`; keeps the per-message target index small (see the forwarder's
/// delivery opaque) and a config reviewable.
pub const MAX_RULES: usize = 4096;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForwarderConfig {
    pub mqtt: MqttConfig,
    pub kafka: KafkaConfig,
    pub rules: Vec<Rule>,
    #[serde(default)]
    pub http: HttpConfig,
    /// Upper bound for the drain on SIGTERM: in-flight messages still unconfirmed by Kafka
    /// after this are left unacknowledged, so the broker redelivers them.
    #[serde(default = "default_shutdown_timeout_secs")]
    pub shutdown_timeout_secs: u64,
    /// Where messages go that Kafka can never take, for every rule without its own
    /// `dead_letter`. Unset: such messages are held (or dropped) as each rule's
    /// `on_unwritable` says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dead_letter: Option<DeadLetter>,
    #[serde(default)]
    pub log: LogConfig,
}

/// A dead-letter topic: receives the original payload, with headers naming the MQTT topic, the
/// intended Kafka topic, the rule and the error.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeadLetter {
    pub topic: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogConfig {
    /// A `tracing` filter: `info`, `debug`, or per module (`info,ferry_forwarder=debug`).
    /// `FERRY_LOG` overrides it.
    #[serde(default = "default_log_level")]
    pub level: String,
    /// `FERRY_LOG_FORMAT` or `--log-format` override it.
    #[serde(default)]
    pub format: LogFormat,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            level: default_log_level(),
            format: LogFormat::default(),
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// The MQTT protocol version spoken to the broker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum MqttProtocol {
    #[default]
    #[serde(rename = "3.1.1")]
    V311,
    #[serde(rename = "5")]
    V5,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MqttConfig {
    pub host: String,
    #[serde(default = "default_mqtt_port")]
    pub port: u16,
    /// `"3.1.1"` or `"5"`. MQTT 5 adds user properties and content type (see a rule's
    /// `kafka.headers`), announces `max_inflight` as Receive Maximum, and has session expiry.
    #[serde(default, deserialize_with = "protocol")]
    pub protocol: MqttProtocol,
    /// Stable client id: with `clean_session: false` the broker keeps the session (and the
    /// messages it holds for it) while the forwarder is away.
    pub client_id: String,
    #[serde(default)]
    pub clean_session: bool,
    /// MQTT 5 only: how long the broker keeps the session after a disconnect. Unset: 0 with
    /// `clean_session: true`, otherwise never expires (as a 3.1.1 persistent session).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_expiry_secs: Option<u32>,
    /// Subscribe as `$share/<group>/<filter>`: replicas with the same group split the messages
    /// between them, each with its own client id and session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared_group: Option<String>,
    #[serde(default = "default_keep_alive_secs")]
    pub keep_alive_secs: u16,
    /// The in-flight window: messages received from MQTT and not yet acknowledged.
    #[serde(default = "default_max_inflight")]
    pub max_inflight: u16,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
    /// A file holding the user name, read exactly (see [`crate::credentials`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username_file: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password: Option<Secret>,
    /// A file holding the password, read exactly: every byte counts, a trailing newline too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_file: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<Tls>,
    #[serde(default = "default_reconnect_min_ms")]
    pub reconnect_min_ms: u64,
    #[serde(default = "default_reconnect_max_ms")]
    pub reconnect_max_ms: u64,
}

/// PEM files for TLS. The broker's certificate is always verified: against `ca_file`, or the
/// system's trusted roots when it is unset. `cert_file` and `key_file` (both or neither) are
/// the client certificate, RSA or ECDSA.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tls {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert_file: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_file: Option<String>,
}

/// SASL authentication to Kafka (over TLS when `kafka.tls` is set).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sasl {
    pub mechanism: SaslMechanism,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub username: String,
    /// A file holding the user name, read exactly (see [`crate::credentials`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username_file: Option<String>,
    #[serde(default, skip_serializing_if = "Secret::is_empty")]
    pub password: Secret,
    /// A file holding the password, read exactly: every byte counts, a trailing newline too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_file: Option<String>,
}

// Shared with the CRD (`spec.kafka.sasl.mechanism`).
/// The SASL mechanism: SCRAM-SHA-512, SCRAM-SHA-256 or PLAIN (PLAIN only over TLS).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "crd", derive(schemars::JsonSchema))]
pub enum SaslMechanism {
    #[serde(rename = "SCRAM-SHA-512")]
    ScramSha512,
    #[serde(rename = "SCRAM-SHA-256")]
    ScramSha256,
    #[serde(rename = "PLAIN")]
    Plain,
}

impl SaslMechanism {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ScramSha512 => "SCRAM-SHA-512",
            Self::ScramSha256 => "SCRAM-SHA-256",
            Self::Plain => "PLAIN",
        }
    }
}

/// A value that must never be printed: `Debug` shows a placeholder.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Secret(pub String);

impl Secret {
    pub fn expose(&self) -> &str {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaConfig {
    /// Comma-separated `host:port` list.
    pub bootstrap_servers: String,
    /// TLS to the brokers (`security.protocol` `ssl`, or `sasl_ssl` with `sasl`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<Tls>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sasl: Option<Sasl>,
    /// librdkafka producer properties, passed through; they override Ferry's defaults. Some
    /// are refused (see [`crate::kafka_props`]).
    #[serde(default, deserialize_with = "scalar_map")]
    pub config: BTreeMap<String, String>,
    /// Accept `config` settings that weaken at-least-once or in-order delivery
    /// ([`crate::kafka_props::WEAKER`]): the explicit opt-out, off by default.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_weaker_delivery: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    /// Unique; the label of this rule's metrics and status.
    pub name: String,
    pub mqtt: RuleMqtt,
    pub kafka: RuleKafka,
    #[serde(default)]
    pub payload: PayloadFormat,
    /// Overrides the top-level `dead_letter` for this rule.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dead_letter: Option<DeadLetter>,
    /// What to do with a message Kafka can never take as it is (too large, an illegal resolved
    /// topic name, rejected as invalid) when no dead-letter topic took it.
    #[serde(default)]
    pub on_unwritable: OnUnwritable,
}

/// What happens to a message Kafka can never take as it is, when no dead-letter topic took it.
/// Messages that wait on Kafka for any other reason (authorization, unknown topic, outages)
/// are always retried: those are fixable, and giving up on them would drop the stream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnUnwritable {
    /// Keep it unacknowledged and keep retrying (slowly): the rule stalls, reports why, and
    /// resumes when the cause is fixed (e.g. the topic's size limit is raised), or after a
    /// restart with a dead-letter topic or `drop` configured.
    #[default]
    Hold,
    /// Acknowledge it without writing it anywhere: counted per rule and logged. Loses the
    /// message; only by explicit choice.
    Drop,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleMqtt {
    /// MQTT topic filters (`+` and `#` wildcards).
    pub topics: Vec<String>,
    /// The maximum QoS requested in the subscription.
    #[serde(default = "default_qos")]
    pub qos: u8,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleKafka {
    /// A topic name, or a template taking MQTT topic levels (counted from 0): `telemetry.{1}`
    /// for `plant/7/telemetry` is `telemetry.7`.
    pub topic: String,
    #[serde(default)]
    pub key: KeyStrategy,
    #[serde(default)]
    pub headers: Headers,
}

/// Which Kafka headers a record carries. All off by default, so records are exactly the
/// MQTT payload.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Headers {
    /// `<prefix>topic`, `<prefix>qos`, `<prefix>retain` and, from MQTT 5 publishers that set
    /// it, `<prefix>content_type`.
    #[serde(default)]
    pub metadata: bool,
    /// MQTT 5 user properties, one header each, named as sent.
    #[serde(default)]
    pub user_properties: bool,
    #[serde(default = "default_header_prefix")]
    pub prefix: String,
}

impl Default for Headers {
    fn default() -> Self {
        Self {
            metadata: false,
            user_properties: false,
            prefix: default_header_prefix(),
        }
    }
}

/// What becomes the Kafka record key (and so the partition).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeyStrategy {
    /// The MQTT topic, as the replaced forwarder did: one MQTT topic stays in one partition,
    /// in order.
    #[default]
    MqttTopic,
    /// No key: records spread over partitions, no per-topic order in Kafka.
    None,
    /// One level of the MQTT topic, counted from 0 (`topic_level: 1` of `plant/7/temp` is `7`).
    /// A topic without that level gets no key.
    TopicLevel(usize),
}

/// How the MQTT payload becomes the Kafka record value.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PayloadFormat {
    /// The payload bytes unchanged.
    #[default]
    Raw,
    /// `{"topic":"<mqtt topic>","payload":"<base64>"}`, byte-identical to the replaced
    /// forwarder's `wrap_as_json`.
    WrappedJson,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpConfig {
    /// Address of `/healthz`, `/readyz` and `/metrics`.
    pub listen: SocketAddr,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([0, 0, 0, 0], defaults::HTTP_PORT)),
        }
    }
}

// Serde takes defaults only from functions; the values are in [`crate::defaults`].
fn default_mqtt_port() -> u16 {
    defaults::MQTT_PORT
}
fn default_keep_alive_secs() -> u16 {
    defaults::KEEP_ALIVE_SECS
}
fn default_max_inflight() -> u16 {
    defaults::MAX_INFLIGHT
}
fn default_reconnect_min_ms() -> u64 {
    defaults::RECONNECT_MIN_MS
}
fn default_reconnect_max_ms() -> u64 {
    defaults::RECONNECT_MAX_MS
}
fn default_qos() -> u8 {
    defaults::QOS
}
fn default_shutdown_timeout_secs() -> u64 {
    defaults::SHUTDOWN_TIMEOUT_SECS
}
fn default_log_level() -> String {
    defaults::LOG_LEVEL.into()
}
fn default_header_prefix() -> String {
    defaults::HEADER_PREFIX.into()
}

/// YAML reads `protocol: 5` as a number and `protocol: 3.1.1` as a string; accept both.
fn protocol<'de, D: serde::Deserializer<'de>>(d: D) -> Result<MqttProtocol, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Int(u64),
        Str(String),
    }
    match Raw::deserialize(d)? {
        Raw::Int(5) => Ok(MqttProtocol::V5),
        Raw::Str(s) if s == "5" || s == "5.0" => Ok(MqttProtocol::V5),
        Raw::Str(s) if s == "3.1.1" => Ok(MqttProtocol::V311),
        Raw::Int(n) => Err(serde::de::Error::custom(format!(
            "{n} is not a supported MQTT version (\"3.1.1\" or 5)"
        ))),
        Raw::Str(s) => Err(serde::de::Error::custom(format!(
            "{s:?} is not a supported MQTT version (\"3.1.1\" or 5)"
        ))),
    }
}

/// librdkafka values are strings; YAML users write `linger.ms: 5` or `enable.idempotence: true`.
fn scalar_map<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<BTreeMap<String, String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Scalar {
        Bool(bool),
        Int(i64),
        Float(f64),
        Str(String),
    }
    let raw = Option::<BTreeMap<String, Scalar>>::deserialize(d)?.unwrap_or_default();
    Ok(raw
        .into_iter()
        .map(|(k, v)| {
            let v = match v {
                Scalar::Bool(b) => b.to_string(),
                Scalar::Int(i) => i.to_string(),
                Scalar::Float(f) => f.to_string(),
                Scalar::Str(s) => s,
            };
            (k, v)
        })
        .collect())
}

/// One thing wrong with a config, at a field path such as `rules[2].kafka.topic`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub path: String,
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("config is not valid YAML for this format: {0}")]
    Syntax(String),
    #[error("config has {} problem(s):\n{}", .0.len(), ProblemList(.0))]
    Invalid(Vec<Problem>),
}

struct ProblemList<'a>(&'a [Problem]);

impl fmt::Display for ProblemList<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "  - {p}")?;
        }
        Ok(())
    }
}

/// Which input format a file was written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceFormat {
    Ferry,
    /// The replaced forwarder's `config.yaml`.
    Legacy,
}

/// A loaded, validated config, and what the loader noticed along the way.
#[derive(Debug)]
pub struct Loaded {
    pub config: ForwarderConfig,
    pub format: SourceFormat,
    /// Non-fatal notes for the log (e.g. unset variables in a legacy file).
    pub warnings: Vec<String>,
}

/// Parses and validates config text. `lookup_env` resolves `${VAR}`; credential files
/// (`*_file`) are read from the file system.
pub fn load_str(
    text: &str,
    lookup_env: impl Fn(&str) -> Option<String>,
) -> Result<Loaded, ConfigError> {
    load_str_reading(text, lookup_env, |path| std::fs::read(path))
}

/// [`load_str`] with credential files read by `read_file`.
pub fn load_str_reading(
    text: &str,
    lookup_env: impl Fn(&str) -> Option<String>,
    read_file: impl Fn(&Path) -> std::io::Result<Vec<u8>>,
) -> Result<Loaded, ConfigError> {
    let substituted = env::substitute(text, lookup_env);
    let format = detect_format(&substituted.text)?;
    let mut warnings = Vec::new();
    let config = match format {
        SourceFormat::Ferry => {
            if !substituted.missing.is_empty() {
                return Err(ConfigError::Invalid(missing_env_problems(
                    &substituted.missing,
                )));
            }
            parse::<ForwarderConfig>(&substituted.text)?
        }
        SourceFormat::Legacy => {
            // The replaced forwarder substituted unset variables with "" silently; keep
            // accepting such files, but say so.
            for name in &substituted.missing {
                warnings.push(format!(
                    "environment variable {name} is not set; substituted an empty string"
                ));
            }
            let mut config = parse::<legacy::LegacyConfig>(&substituted.text)?.into_ferry();
            // The replaced forwarder's files are accepted unchanged, so settings that weaken
            // the guarantee are allowed there, and said loudly.
            config.kafka.allow_weaker_delivery = true;
            for (key, value) in &config.kafka.config {
                if let Some(w) = kafka_props::weakens(key, value) {
                    warnings.push(format!(
                        "kafka.config.{key}: {value:?} weakens the delivery guarantee ({}); Ferry's default is {}",
                        w.why, w.expected
                    ));
                }
            }
            config
        }
    };
    let mut config = config;
    let mut problems = credentials::read_files(&mut config, &read_file);
    problems.extend(config.validate());
    if !problems.is_empty() {
        return Err(ConfigError::Invalid(problems));
    }
    Ok(Loaded {
        config,
        format,
        warnings,
    })
}

fn missing_env_problems(missing: &[String]) -> Vec<Problem> {
    missing
        .iter()
        .map(|name| Problem {
            path: format!("${{{name}}}"),
            message: "environment variable is not set (use ${NAME:-default} for a default)".into(),
        })
        .collect()
}

fn detect_format(text: &str) -> Result<SourceFormat, ConfigError> {
    let top: BTreeMap<String, serde::de::IgnoredAny> =
        serde_saphyr::from_str(text).map_err(|e| ConfigError::Syntax(e.to_string()))?;
    match (top.contains_key("rules"), top.contains_key("forwarding")) {
        (true, true) => Err(ConfigError::Invalid(vec![Problem {
            path: "forwarding".into(),
            message: "a config has either `rules` (Ferry format) or `forwarding` (legacy format), not both"
                .into(),
        }])),
        (false, true) => Ok(SourceFormat::Legacy),
        _ => Ok(SourceFormat::Ferry),
    }
}

fn parse<T: serde::de::DeserializeOwned>(text: &str) -> Result<T, ConfigError> {
    let mut at: Option<(String, String)> = None;
    let result = serde_saphyr::with_deserializer_from_str(text, |de| {
        serde_path_to_error::deserialize::<_, T>(de).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            at = Some((path, inner.to_string()));
            inner
        })
    });
    match result {
        Ok(v) => Ok(v),
        Err(e) => match at {
            // A type or shape error at a known field: report it like a validation problem.
            Some((path, message)) if path != "." && !path.is_empty() => {
                Err(ConfigError::Invalid(vec![Problem {
                    path,
                    message: first_line(&message),
                }]))
            }
            _ => Err(ConfigError::Syntax(first_line(&e.to_string()))),
        },
    }
}

fn first_line(s: &str) -> String {
    s.lines().next().unwrap_or_default().trim().to_owned()
}

impl ForwarderConfig {
    /// Every semantic problem, with its field path. Empty means valid.
    pub fn validate(&self) -> Vec<Problem> {
        let mut p = Problems::default();
        let m = &self.mqtt;
        if let Some(problem) = addr::host_problem(&m.host) {
            p.add("mqtt.host", format!("{:?} {problem}", m.host));
        }
        if m.port == 0 {
            p.add("mqtt.port", "must be between 1 and 65535");
        }
        if m.client_id.is_empty() && !m.clean_session {
            p.add(
                "mqtt.client_id",
                "must be set unless clean_session is true: a persistent session needs a stable client id",
            );
        }
        if m.client_id
            .chars()
            .any(|c| c.is_whitespace() || c.is_control())
        {
            p.add(
                "mqtt.client_id",
                format!(
                    "{:?} contains whitespace or control characters",
                    m.client_id
                ),
            );
        }
        if m.max_inflight == 0 {
            p.add("mqtt.max_inflight", "must be at least 1");
        }
        if m.keep_alive_secs != 0 && m.keep_alive_secs < 5 {
            p.add("mqtt.keep_alive_secs", "must be 0 (off) or at least 5");
        }
        if m.password.is_some() && m.username.is_none() {
            p.add(
                "mqtt.password",
                "is set but mqtt.username (or mqtt.username_file) is not",
            );
        }
        if let Some(tls) = &m.tls {
            check_tls(&mut p, "mqtt.tls", tls);
        }
        if m.protocol == MqttProtocol::V311 && m.session_expiry_secs.is_some() {
            p.add(
                "mqtt.session_expiry_secs",
                "is an MQTT 5 setting; set mqtt.protocol: 5 or remove it (3.1.1 sessions follow clean_session)",
            );
        }
        if let Some(group) = &m.shared_group
            && !is_valid_share_group(group)
        {
            p.add(
                "mqtt.shared_group",
                format!("{group:?} must be non-empty and contain no '/', '+' or '#'"),
            );
        }
        if m.reconnect_min_ms == 0 || m.reconnect_min_ms > m.reconnect_max_ms {
            p.add(
                "mqtt.reconnect_min_ms",
                "must be at least 1 and not above mqtt.reconnect_max_ms",
            );
        }

        if self.kafka.bootstrap_servers.trim().is_empty() {
            p.add("kafka.bootstrap_servers", "must not be empty");
        } else {
            for s in self.kafka.bootstrap_servers.split(',').map(str::trim) {
                if let Some(problem) = addr::server_problem(s) {
                    p.add("kafka.bootstrap_servers", format!("{s:?} {problem}"));
                }
            }
        }
        check_kafka_properties(&mut p, &self.kafka, m.max_inflight);
        if let Some(tls) = &self.kafka.tls {
            check_tls(&mut p, "kafka.tls", tls);
        }
        if let Some(sasl) = &self.kafka.sasl {
            if sasl.username.is_empty() && sasl.username_file.is_none() {
                p.add(
                    "kafka.sasl.username",
                    "must not be empty (set username or username_file)",
                );
            }
            if sasl.password.is_empty() && sasl.password_file.is_none() {
                p.add(
                    "kafka.sasl.password",
                    "must not be empty (set password or password_file)",
                );
            }
            if self.kafka.tls.is_none() && sasl.mechanism == SaslMechanism::Plain {
                p.add(
                    "kafka.sasl.mechanism",
                    "PLAIN sends the password in clear text; use it only with kafka.tls",
                );
            }
        }
        if let Some(dl) = &self.dead_letter {
            check_dead_letter(&mut p, "dead_letter.topic", dl);
        }

        if self.rules.is_empty() {
            p.add("rules", "must contain at least one rule");
        }
        if self.rules.len() > MAX_RULES {
            p.add(
                "rules",
                format!(
                    "has {} rules; at most {MAX_RULES} are supported",
                    self.rules.len()
                ),
            );
        }
        let mut names = BTreeSet::new();
        for (i, rule) in self.rules.iter().enumerate() {
            let at = |field: &str| format!("rules[{i}].{field}");
            if !is_valid_rule_name(&rule.name) {
                p.add(
                    at("name"),
                    format!(
                        "{:?} must be 1-63 characters of letters, digits, '.', '_' or '-' (it labels metrics)",
                        rule.name
                    ),
                );
            } else if !names.insert(rule.name.as_str()) {
                p.add(
                    at("name"),
                    format!(
                        "{:?} is used by another rule; names must be unique",
                        rule.name
                    ),
                );
            }
            if rule.mqtt.topics.is_empty() {
                p.add(at("mqtt.topics"), "must contain at least one topic filter");
            }
            for (j, filter) in rule.mqtt.topics.iter().enumerate() {
                if let Err(e) = TopicFilter::parse(filter) {
                    p.add(
                        at(&format!("mqtt.topics[{j}]")),
                        format!("{filter:?} is not a valid MQTT topic filter: {e}"),
                    );
                }
            }
            if rule.mqtt.qos > 2 {
                p.add(
                    at("mqtt.qos"),
                    format!("{} is not an MQTT QoS (0, 1 or 2)", rule.mqtt.qos),
                );
            }
            match TopicTemplate::parse(&rule.kafka.topic) {
                Err(e) => p.add(
                    at("kafka.topic"),
                    format!(
                        "{:?} is not a valid Kafka topic name or template: it {e}",
                        rule.kafka.topic
                    ),
                ),
                Ok(template) => {
                    for (j, filter) in rule.mqtt.topics.iter().enumerate() {
                        let Ok(filter) = TopicFilter::parse(filter) else {
                            continue;
                        };
                        let (depth, open) = filter.depth();
                        if let Some(level) = template.levels().find(|&n| n >= depth && !open) {
                            p.add(
                                at("kafka.topic"),
                                format!(
                                    "uses topic level {{{level}}}, but topics matching mqtt.topics[{j}] {:?} have only {depth} level(s), counted from 0",
                                    filter.as_str()
                                ),
                            );
                        }
                    }
                }
            }
            if rule.kafka.headers.prefix.chars().any(char::is_control) {
                p.add(
                    at("kafka.headers.prefix"),
                    "must not contain control characters",
                );
            }
            if let Some(dl) = &rule.dead_letter {
                check_dead_letter(&mut p, &at("dead_letter.topic"), dl);
            }
        }
        p.0
    }

    /// Every distinct (filter, QoS) to subscribe to; the highest QoS wins when rules share a
    /// filter. With `mqtt.shared_group`, filters not already shared become
    /// `$share/<group>/<filter>`.
    pub fn subscriptions(&self) -> Vec<(String, u8)> {
        let mut subs: BTreeMap<String, u8> = BTreeMap::new();
        for rule in &self.rules {
            for filter in &rule.mqtt.topics {
                let subscribed = match &self.mqtt.shared_group {
                    Some(group) if !filter.starts_with("$share/") => {
                        format!("$share/{group}/{filter}")
                    }
                    _ => filter.clone(),
                };
                let qos = subs.entry(subscribed).or_insert(0);
                *qos = (*qos).max(rule.mqtt.qos);
            }
        }
        subs.into_iter().collect()
    }

    /// The dead-letter topic of a rule: its own, else the top-level one.
    pub fn dead_letter_of<'a>(&'a self, rule: &'a Rule) -> Option<&'a DeadLetter> {
        rule.dead_letter.as_ref().or(self.dead_letter.as_ref())
    }
}

fn check_tls(p: &mut Problems, at: &str, tls: &Tls) {
    if tls.cert_file.is_some() != tls.key_file.is_some() {
        p.add(
            format!("{at}.key_file"),
            "cert_file and key_file go together: set both for a client certificate, or neither",
        );
    }
    for (field, value) in [
        ("ca_file", &tls.ca_file),
        ("cert_file", &tls.cert_file),
        ("key_file", &tls.key_file),
    ] {
        if value.as_deref().is_some_and(|v| v.trim().is_empty()) {
            p.add(format!("{at}.{field}"), "must not be empty when set");
        }
    }
}

/// `kafka.config` against [`kafka_props`]: managed, unsupported and weakening properties.
fn check_kafka_properties(p: &mut Problems, kafka: &KafkaConfig, max_inflight: u16) {
    for (key, value) in &kafka.config {
        let at = format!("kafka.config.{key}");
        if key == "bootstrap.servers" {
            p.add(&at, "set kafka.bootstrap_servers instead");
        } else if kafka_props::is_managed(key) && (kafka.tls.is_some() || kafka.sasl.is_some()) {
            p.add(
                &at,
                "is set from kafka.tls / kafka.sasl; set it there, not in both",
            );
        }
        if let Some(why) = kafka_props::unsupported(key) {
            p.add(&at, format!("cannot be used: it {why}"));
        }
        if let Some(w) = kafka_props::weakens(key, value)
            && !kafka.allow_weaker_delivery
        {
            p.add(
                &at,
                format!(
                    "{value:?} weakens the delivery guarantee: it must be {}, because {}; set kafka.allow_weaker_delivery: true to accept that",
                    w.expected, w.why
                ),
            );
        }
        if key == kafka_props::QUEUE_MAX_MESSAGES
            && let Some(problem) = kafka_props::queue_too_small(value, max_inflight)
        {
            p.add(&at, problem);
        }
    }
}

fn check_dead_letter(p: &mut Problems, at: &str, dl: &DeadLetter) {
    if let Err(e) = validate_kafka_topic(&dl.topic) {
        p.add(
            at,
            format!("{:?} is not a valid Kafka topic name: it {e}", dl.topic),
        );
    }
}

fn is_valid_rule_name(name: &str) -> bool {
    (1..=63).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

#[derive(Default)]
struct Problems(Vec<Problem>);

impl Problems {
    fn add(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.0.push(Problem {
            path: path.into(),
            message: message.into(),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    const FERRY: &str = r#"
mqtt:
  host: localhost
  client_id: ferry-1
kafka:
  bootstrap_servers: localhost:9092
  config:
    linger.ms: 10
    enable.idempotence: true
rules:
  - name: telemetry
    mqtt:
      topics: ["plant/+/telemetry"]
    kafka:
      topic: telemetry
      key: { topic_level: 1 }
    payload: wrapped_json
"#;

    #[test]
    fn ferry_format_with_defaults() {
        let loaded = load_str(FERRY, no_env).unwrap();
        let c = loaded.config;
        assert_eq!(loaded.format, SourceFormat::Ferry);
        assert_eq!(c.mqtt.port, 1883);
        assert!(!c.mqtt.clean_session);
        assert_eq!(c.mqtt.max_inflight, 1000);
        assert_eq!(c.kafka.config["linger.ms"], "10");
        assert_eq!(c.kafka.config["enable.idempotence"], "true");
        assert_eq!(c.rules[0].mqtt.qos, 1);
        assert_eq!(c.rules[0].kafka.key, KeyStrategy::TopicLevel(1));
        assert_eq!(c.rules[0].payload, PayloadFormat::WrappedJson);
        assert_eq!(c.http.listen.port(), 8080);
    }

    #[test]
    fn every_problem_is_listed_with_its_path() {
        let text = r#"
mqtt: { host: "", port: 0, client_id: "" , max_inflight: 0}
kafka: { bootstrap_servers: "nohost" }
rules:
  - name: a
    mqtt: { topics: ["a/#/b", "ok/+"], qos: 3 }
    kafka: { topic: "a b" }
  - name: a
    mqtt: { topics: [] }
    kafka: { topic: ok }
"#;
        let Err(ConfigError::Invalid(problems)) = load_str(text, no_env) else {
            panic!("expected invalid")
        };
        let paths: Vec<&str> = problems.iter().map(|p| p.path.as_str()).collect();
        for expected in [
            "mqtt.host",
            "mqtt.port",
            "mqtt.client_id",
            "mqtt.max_inflight",
            "kafka.bootstrap_servers",
            "rules[0].mqtt.topics[0]",
            "rules[0].mqtt.qos",
            "rules[0].kafka.topic",
            "rules[1].name",
            "rules[1].mqtt.topics",
        ] {
            assert!(
                paths.contains(&expected),
                "missing {expected} in {problems:#?}"
            );
        }
        let topic = problems
            .iter()
            .find(|p| p.path == "rules[0].kafka.topic")
            .unwrap();
        assert_eq!(
            topic.to_string(),
            r#"rules[0].kafka.topic: "a b" is not a valid Kafka topic name or template: it may contain only ASCII letters, digits, '.', '_' and '-'"#
        );
    }

    #[test]
    fn type_errors_name_the_field() {
        let text = FERRY.replace("client_id: ferry-1", "client_id: ferry-1\n  port: lots");
        let Err(ConfigError::Invalid(problems)) = load_str(&text, no_env) else {
            panic!("expected invalid")
        };
        assert_eq!(problems[0].path, "mqtt.port");
    }

    #[test]
    fn unknown_fields_are_rejected_in_ferry_format() {
        let text = FERRY.replace("client_id: ferry-1", "client_id: ferry-1\n  clientid: typo");
        let Err(ConfigError::Invalid(problems)) = load_str(&text, no_env) else {
            panic!("expected invalid")
        };
        assert!(problems[0].message.contains("clientid"), "{problems:?}");
    }

    #[test]
    fn unset_variables_fail_ferry_format() {
        let text = FERRY.replace("host: localhost", "host: ${MQTT_HOST}");
        let Err(ConfigError::Invalid(problems)) = load_str(&text, no_env) else {
            panic!("expected invalid")
        };
        assert_eq!(problems[0].path, "${MQTT_HOST}");
        let ok = load_str(&text, |n| (n == "MQTT_HOST").then(|| "broker".to_string())).unwrap();
        assert_eq!(ok.config.mqtt.host, "broker");
    }

    #[test]
    fn password_is_never_debug_printed() {
        let text = FERRY.replace(
            "client_id: ferry-1",
            "client_id: ferry-1\n  username: u\n  password: hunter2",
        );
        let loaded = load_str(&text, no_env).unwrap();
        assert!(!format!("{loaded:?}").contains("hunter2"));
        assert_eq!(
            loaded.config.mqtt.password.as_ref().map(Secret::expose),
            Some("hunter2")
        );
    }

    #[test]
    fn production_settings_load() {
        let text = r#"
mqtt:
  host: broker
  client_id: ferry-0
  protocol: 5
  session_expiry_secs: 3600
  shared_group: ferry
  tls: { ca_file: /etc/ferry/ca.pem, cert_file: /etc/ferry/tls.crt, key_file: /etc/ferry/tls.key }
kafka:
  bootstrap_servers: kafka:9093
  tls: { ca_file: /etc/ferry/kafka-ca.pem }
  sasl: { mechanism: SCRAM-SHA-512, username: ferry, password: s3cret }
dead_letter: { topic: ferry.dlq }
log: { level: debug, format: json }
rules:
  - name: telemetry
    mqtt: { topics: ["plant/+/telemetry", "$share/other/x/#"] }
    kafka:
      topic: "telemetry.{1}"
      headers: { metadata: true, user_properties: true }
    dead_letter: { topic: telemetry.dlq }
  - name: other
    mqtt: { topics: ["x/y"] }
    kafka: { topic: other }
"#;
        let c = load_str(text, no_env).unwrap().config;
        assert_eq!(c.mqtt.protocol, MqttProtocol::V5);
        assert_eq!(
            c.kafka.sasl.as_ref().unwrap().mechanism,
            SaslMechanism::ScramSha512
        );
        assert_eq!(c.log.format, LogFormat::Json);
        assert_eq!(c.rules[0].kafka.headers.prefix, "mqtt.");
        assert_eq!(
            c.dead_letter_of(&c.rules[0]).unwrap().topic,
            "telemetry.dlq"
        );
        assert_eq!(c.dead_letter_of(&c.rules[1]).unwrap().topic, "ferry.dlq");
        assert_eq!(
            c.subscriptions(),
            vec![
                ("$share/ferry/plant/+/telemetry".to_string(), 1),
                ("$share/ferry/x/y".to_string(), 1),
                ("$share/other/x/#".to_string(), 1),
            ]
        );
        assert!(!format!("{c:?}").contains("s3cret"));
        let v311 = load_str(&text.replace("protocol: 5", "protocol: \"3.1.1\""), no_env);
        let Err(ConfigError::Invalid(problems)) = v311 else {
            panic!("session expiry needs MQTT 5")
        };
        assert_eq!(problems[0].path, "mqtt.session_expiry_secs");
    }

    #[test]
    fn production_settings_problems_name_their_fields() {
        let text = r#"
mqtt:
  host: broker
  client_id: ferry-0
  shared_group: "a/b"
  tls: { cert_file: /c.pem }
kafka:
  bootstrap_servers: kafka:9093
  sasl: { mechanism: PLAIN, username: "", password: "" }
  config: { security.protocol: plaintext }
dead_letter: { topic: "no good" }
rules:
  - name: r
    mqtt: { topics: ["plant/+"] }
    kafka: { topic: "t.{2}" }
    dead_letter: { topic: ".." }
  - name: s
    mqtt: { topics: ["plant/#"] }
    kafka: { topic: "t.{2" }
"#;
        let Err(ConfigError::Invalid(problems)) = load_str(text, no_env) else {
            panic!("expected invalid")
        };
        let paths: Vec<&str> = problems.iter().map(|p| p.path.as_str()).collect();
        for expected in [
            "mqtt.shared_group",
            "mqtt.tls.key_file",
            "kafka.sasl.username",
            "kafka.sasl.password",
            "kafka.sasl.mechanism",
            "kafka.config.security.protocol",
            "dead_letter.topic",
            "rules[0].kafka.topic",
            "rules[0].dead_letter.topic",
            "rules[1].kafka.topic",
        ] {
            assert!(
                paths.contains(&expected),
                "missing {expected} in {problems:#?}"
            );
        }
        let level = problems
            .iter()
            .find(|p| p.path == "rules[0].kafka.topic")
            .unwrap();
        assert!(level.message.contains("have only 2 level(s)"), "{level}");
        let bad = load_str(
            &text.replace("shared_group: \"a/b\"", "protocol: 4"),
            no_env,
        );
        assert!(matches!(bad, Err(ConfigError::Invalid(p)) if p[0].path == "mqtt.protocol"));
    }

    fn problems_of(text: &str) -> Vec<Problem> {
        match load_str(text, no_env) {
            Err(ConfigError::Invalid(problems)) => problems,
            other => panic!("expected invalid, got {other:?}"),
        }
    }

    fn with_kafka_config(entries: &str) -> String {
        FERRY.replace(
            "    enable.idempotence: true\n",
            &format!("    enable.idempotence: true\n{entries}"),
        )
    }

    #[test]
    fn hosts_and_bootstrap_servers_are_checked() {
        for (host, ok) in crate::addr::HOST_VECTORS {
            let text = FERRY.replace("host: localhost", &format!("host: {host:?}"));
            let result = load_str(&text, no_env);
            assert_eq!(result.is_ok(), *ok, "{host:?}: {result:?}");
        }
        let problems = problems_of(&FERRY.replace("host: localhost", "host: mqtt://broker"));
        assert_eq!(
            problems[0].to_string(),
            r#"mqtt.host: "mqtt://broker" is not a host name or IP address (a DNS name, an IPv4 address or an IPv6 address without brackets; no scheme, port or spaces)"#
        );
        let servers = FERRY.replace("localhost:9092", "\"[::1]:9092, kafka:0,kafka:9093\"");
        let problems = problems_of(&servers);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert_eq!(
            problems[0].to_string(),
            r#"kafka.bootstrap_servers: "kafka:0" has a port outside 1-65535"#
        );
    }

    #[test]
    fn weaker_kafka_settings_need_the_opt_out() {
        for (entry, path, expected) in [
            ("acks: 1", "kafka.config.acks", "all (or -1)"),
            (
                "request.required.acks: 0",
                "kafka.config.request.required.acks",
                "all (or -1)",
            ),
            (
                "message.timeout.ms: 30000",
                "kafka.config.message.timeout.ms",
                "0 (never time out)",
            ),
            (
                "delivery.timeout.ms: 5000",
                "kafka.config.delivery.timeout.ms",
                "0 (never time out)",
            ),
        ] {
            let text = with_kafka_config(&format!("    {entry}\n"));
            let problems = problems_of(&text);
            assert_eq!(problems.len(), 1, "{entry}: {problems:?}");
            assert_eq!(problems[0].path, path);
            assert!(
                problems[0]
                    .message
                    .contains(&format!("it must be {expected}"))
                    && problems[0]
                        .message
                        .contains("set kafka.allow_weaker_delivery: true to accept that"),
                "{}",
                problems[0]
            );
            let allowed = text.replace(
                "  bootstrap_servers: localhost:9092\n",
                "  bootstrap_servers: localhost:9092\n  allow_weaker_delivery: true\n",
            );
            let loaded = load_str(&allowed, no_env).unwrap_or_else(|e| panic!("{entry}: {e}"));
            assert!(loaded.config.kafka.allow_weaker_delivery);
        }
        let off = FERRY.replace("enable.idempotence: true", "enable.idempotence: false");
        assert_eq!(problems_of(&off)[0].path, "kafka.config.enable.idempotence");
        for safe in [
            "acks: all",
            "acks: \"-1\"",
            "acks: ALL",
            "message.timeout.ms: 0",
            "enable.gapless.guarantee: true",
        ] {
            let text = with_kafka_config(&format!("    {safe}\n"));
            assert!(load_str(&text, no_env).is_ok(), "{safe}");
        }
    }

    #[test]
    fn unsupported_kafka_settings_are_refused_even_with_the_opt_out() {
        for (entry, path, why) in [
            (
                "transactional.id: ferry",
                "kafka.config.transactional.id",
                "the forwarder runs no transactions",
            ),
            (
                "delivery.report.only.error: true",
                "kafka.config.delivery.report.only.error",
                "nothing would ever be acknowledged",
            ),
            (
                "group.id: ferry",
                "kafka.config.group.id",
                "is a consumer property",
            ),
        ] {
            let text = with_kafka_config(&format!("    {entry}\n")).replace(
                "  bootstrap_servers: localhost:9092\n",
                "  bootstrap_servers: localhost:9092\n  allow_weaker_delivery: true\n",
            );
            let problems = problems_of(&text);
            assert_eq!(problems[0].path, path, "{problems:?}");
            assert!(problems[0].message.contains(why), "{}", problems[0]);
        }
    }

    #[test]
    fn the_producer_queue_must_hold_the_window() {
        let queue =
            |n: &str| with_kafka_config(&format!("    queue.buffering.max.messages: {n}\n"));
        let problems = problems_of(&queue("999"));
        assert_eq!(
            problems[0].path,
            "kafka.config.queue.buffering.max.messages"
        );
        assert!(
            problems[0]
                .message
                .contains("smaller than the in-flight window (1000)")
        );
        assert!(load_str(&queue("1000"), no_env).is_ok());
        assert!(load_str(&queue("0"), no_env).is_ok());
    }

    #[test]
    fn legacy_files_keep_weaker_settings_with_a_warning() {
        let text = "mqtt: { host: h, port: 1883, client_id: c }\nkafka: { bootstrap_server: k, port: 9092, config: { acks: \"1\" } }\nforwarding:\n  - { name: f, mqtt: { topic: a }, kafka: { topic: a } }\n";
        let loaded = load_str(text, no_env).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(loaded.format, SourceFormat::Legacy);
        assert!(
            loaded
                .warnings
                .iter()
                .any(|w| w.starts_with("kafka.config.acks: \"1\" weakens the delivery guarantee")),
            "{:?}",
            loaded.warnings
        );
    }

    #[test]
    fn subscriptions_merge_filters() {
        let mut c = load_str(FERRY, no_env).unwrap().config;
        let mut second = c.rules[0].clone();
        second.name = "again".into();
        second.mqtt.qos = 2;
        c.rules.push(second);
        assert_eq!(
            c.subscriptions(),
            vec![("plant/+/telemetry".to_string(), 2)]
        );
    }
}
