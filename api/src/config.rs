//! The forwarder's configuration: the file `ferry-forwarder --config` reads and the operator
//! renders. These are the types only; [`crate::load`] reads a file into them (Ferry's own format,
//! with top-level `rules`, or the replaced forwarder's `config.yaml`, with top-level
//! `forwarding`), and [`crate::validate`] turns one into a [`crate::validate::ValidConfig`].

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::defaults;

/// Upper bound for `rules`. A rule costs the forwarder no time per message it does not match
/// (the subscription tree), and a few KiB of memory; the bound keeps a message's target
/// position in the forwarder's delivery opaque (14 bits), a reload's work and a config
/// reviewable.
pub const MAX_RULES: usize = 10_000;

/// Upper bound for `shutdown_timeout_secs` (a day): a drain bound beyond it is no bound, and
/// adding it to the clock must not overflow.
pub const MAX_SHUTDOWN_TIMEOUT_SECS: u64 = 86_400;
/// The longest stall budget (a week; a longer wait is no budget, and 0 says that plainly).
pub const MAX_STALL_BUDGET_SECS: u64 = 7 * 86_400;

/// How often a rule encoding with a subject's latest schema looks it up again: a version
/// registered later is used from then on.
pub const LATEST_SCHEMA_REFRESH_SECS: u64 = 300;

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
    /// How long, in seconds, a rule's records may wait on their topic for a reason of the
    /// rule's own (authorization, an unknown topic, a schema not available) before they go to
    /// the rule's dead-letter topic, with the reason, so that the rules sharing the forwarder
    /// move on; for every rule without its own. 0: as long as it takes. Without a dead-letter
    /// topic they wait on, shown on every rule they hold. Outages never count.
    #[serde(default = "default_stall_budget_secs")]
    pub stall_budget_secs: u64,
    #[serde(default)]
    pub log: LogConfig,
    /// Client ids of replicas that are leaving for good. A forwarder whose `mqtt.client_id` is
    /// listed drains: it subscribes to nothing and unsubscribes what its session holds, keeps
    /// forwarding what the broker still delivers to it (queued and in flight), and reports
    /// `drain.drained` in `/status` once everything is in Kafka and acknowledged. Its session
    /// can then end without losing anything. Applied by a live reload.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub drain: Vec<String>,
    /// Counts the versions of a config the operator rendered, each different from the one
    /// before: two versions with the same content (a move reversed, say) still differ, so a
    /// forwarder's `/status` digest says which one it runs. The forwarder does nothing else
    /// with it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub revision: u64,
    /// Drain before stopping on SIGTERM, as if listed in `drain`, for up to
    /// `shutdown_timeout_secs`: for replicas that may be stopped for good by something that
    /// does not drain them first (an autoscaler scaling down). Client ids in `except` stop
    /// without draining and keep their session (the replica that always stays: unsubscribing
    /// it would leave nobody subscribed while it restarts). Unset: stop without draining.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain_on_shutdown: Option<DrainOnShutdown>,
    /// Names of rules (in `rules`) that moved to another group, which subscribes them now.
    /// This forwarder unsubscribes their filters (unless a rule it keeps has the same one) but
    /// still routes them, so what its session already holds for them (queued or in flight) is
    /// forwarded rather than acknowledged unmatched; `/status` reports each handed over once
    /// that is done (see `RuleStatus::retiring`). Applied by a live reload.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub retiring: Vec<String>,
    /// The schema registry of rules whose `kafka.value` is encoded through one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema_registry: Option<SchemaRegistry>,
}

/// A schema registry speaking Confluent's REST API (Confluent, Apicurio's `ccompat` API,
/// Karapace, Redpanda).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchemaRegistry {
    /// Base URL, `http://` or `https://`: `https://registry:8081`, or for Apicurio
    /// `https://apicurio:8080/apis/ccompat/v7`.
    pub url: String,
    /// TLS settings for an `https://` URL (its server certificate is always verified).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<Tls>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub basic_auth: Option<BasicAuth>,
}

/// HTTP basic authentication, as for SASL: a value inline or a file read exactly.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BasicAuth {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub username: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username_file: Option<String>,
    #[serde(default, skip_serializing_if = "Secret::is_empty")]
    pub password: Secret,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_file: Option<String>,
}

/// How a rule's record value is encoded through the schema registry: validated against the
/// schema and written in Confluent's wire format (magic byte, schema id, payload).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ValueEncoding {
    pub format: SchemaFormat,
    /// The registry subject whose schema encodes the value (`telemetry-value` by the topic
    /// name strategy).
    pub subject: String,
    /// A version of the subject; unset: the latest, looked up again every
    /// [`LATEST_SCHEMA_REFRESH_SECS`] and at each reload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<u32>,
    /// Protobuf: the fully-qualified message to encode; unset: the schema's first message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// The encodings a registry's schemas give (the registry's `schemaType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SchemaFormat {
    Avro,
    Protobuf,
    JsonSchema,
}

impl SchemaFormat {
    /// As the registry's `schemaType` names it.
    pub const fn registry_type(self) -> &'static str {
        match self {
            Self::Avro => "AVRO",
            Self::Protobuf => "PROTOBUF",
            Self::JsonSchema => "JSON",
        }
    }
}

/// See [`ForwarderConfig::drain_on_shutdown`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrainOnShutdown {
    /// Client ids that stop without draining.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub except: Vec<String>,
}

/// What a forwarder subscribes to, and what its resumed session may hold that it must not.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SubscriptionPlan {
    /// Every distinct (filter, QoS) to subscribe to on each connect.
    pub subscribe: Vec<(String, u8)>,
    /// Filters a session resumed from an earlier config may hold (the other shared/plain form
    /// of each filter, or every form while draining): unsubscribed on connect.
    pub unsubscribe_on_connect: Vec<String>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl ForwarderConfig {
    /// Every distinct (filter, QoS) to subscribe to; the highest QoS wins when rules share a
    /// filter. With `mqtt.shared_group` (and `mqtt.subscribe_shared`), filters not already
    /// shared become `$share/<group>/<filter>`. None while draining.
    pub fn subscriptions(&self) -> Vec<(String, u8)> {
        if self.draining() {
            return Vec::new();
        }
        let mut subs: BTreeMap<String, u8> = BTreeMap::new();
        let retiring: std::collections::HashSet<&str> =
            self.retiring.iter().map(String::as_str).collect();
        for rule in self
            .rules
            .iter()
            .filter(|r| !retiring.contains(r.name.as_str()))
        {
            for filter in &rule.mqtt.topics {
                let qos = subs.entry(self.subscribed_as(filter)).or_insert(0);
                *qos = (*qos).max(rule.mqtt.qos);
            }
        }
        subs.into_iter().collect()
    }

    /// [`Self::subscriptions`], and the forms of the rules' filters not subscribed now.
    pub fn subscription_plan(&self) -> SubscriptionPlan {
        let subscribe = self.subscriptions();
        let mut unsubscribe: std::collections::BTreeSet<String> = Default::default();
        for filter in self.rules.iter().flat_map(|r| r.mqtt.topics.iter()) {
            unsubscribe.insert(filter.clone());
            if let Some(group) = &self.mqtt.shared_group
                && !filter.starts_with("$share/")
            {
                unsubscribe.insert(format!("$share/{group}/{filter}"));
            }
        }
        for (filter, _) in &subscribe {
            unsubscribe.remove(filter);
        }
        SubscriptionPlan {
            subscribe,
            unsubscribe_on_connect: unsubscribe.into_iter().collect(),
        }
    }

    /// This forwarder is listed in `drain`.
    pub fn draining(&self) -> bool {
        self.drain.contains(&self.mqtt.client_id)
    }

    /// This forwarder drains before it stops on SIGTERM (see `drain_on_shutdown`).
    pub fn drains_on_shutdown(&self) -> bool {
        self.drain_on_shutdown
            .as_ref()
            .is_some_and(|d| !d.except.contains(&self.mqtt.client_id))
    }

    /// The same config with this forwarder listed in `drain`.
    pub fn with_self_draining(mut self) -> Self {
        if !self.draining() {
            self.drain.push(self.mqtt.client_id.clone());
        }
        self
    }

    /// Its filters go through `$share/<group>/`.
    pub fn shares_subscriptions(&self) -> bool {
        self.mqtt.shared_group.is_some() && self.mqtt.subscribe_shared
    }

    /// What a rule's `filter` is subscribed as: `$share/<group>/<filter>` with
    /// `mqtt.shared_group` and `mqtt.subscribe_shared` (unless already shared), else itself.
    pub fn subscribed_as(&self, filter: &str) -> String {
        match &self.mqtt.shared_group {
            Some(group) if self.mqtt.subscribe_shared && !filter.starts_with("$share/") => {
                format!("$share/{group}/{filter}")
            }
            _ => filter.to_owned(),
        }
    }

    /// The dead-letter topic of a rule: its own, else the top-level one.
    pub fn dead_letter_of<'a>(&'a self, rule: &'a Rule) -> Option<&'a DeadLetter> {
        rule.dead_letter.as_ref().or(self.dead_letter.as_ref())
    }

    /// How long `rule`'s records may wait on their topic for a reason of the rule's own before
    /// they take its dead-letter topic; `None`: as long as it takes.
    pub fn stall_budget_of(&self, rule: &Rule) -> Option<std::time::Duration> {
        let secs = rule.stall_budget_secs.unwrap_or(self.stall_budget_secs);
        (secs > 0).then(|| std::time::Duration::from_secs(secs))
    }
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
    /// With `shared_group`: `false` subscribes the filters plainly, for a group of one replica
    /// (Mosquitto restores plain subscriptions from its persistence after a restart, shared
    /// ones not). Either way the other form is unsubscribed on connect, so switching between
    /// them leaves no subscription behind. A live reload subscribes the new form before it
    /// unsubscribes the old.
    #[serde(default = "default_true", skip_serializing_if = "is_true")]
    pub subscribe_shared: bool,
    #[serde(default = "default_keep_alive_secs")]
    pub keep_alive_secs: u16,
    /// The in-flight window: messages received from MQTT and not yet acknowledged.
    #[serde(default = "default_max_inflight")]
    pub max_inflight: u16,
    /// The window in bytes: the payloads (and topics) of the messages in it. The driver reads
    /// no further PUBLISH while the next would pass it (one message is always let in). Also
    /// bounds librdkafka's queue (`queue.buffering.max.kbytes`), so the forwarder holds about
    /// twice this at most, whatever the payloads.
    #[serde(default = "default_max_inflight_bytes")]
    pub max_inflight_bytes: u64,
    /// The largest MQTT message the forwarder reads, in bytes of payload. A larger one is not
    /// read into memory: its payload is skipped on the wire, and it fails on each rule it
    /// matches (their dead-letter topic, with the reason and without the payload, or
    /// `on_unwritable`). Expressions' cost is estimated for payloads of this size at most.
    #[serde(default = "default_max_message_bytes")]
    pub max_message_bytes: u32,
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
    /// Accept session settings that lose messages across a disconnect (`clean_session: true`,
    /// `session_expiry_secs: 0`): the explicit opt-out, off by default.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_weaker_delivery: bool,
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

/// The smallest `max_message_bytes` accepted: below it, ordinary control messages would fail.
pub const MIN_MESSAGE_BYTES: u32 = 1024;
/// MQTT's largest packet (its remaining length), so its largest payload.
pub const MQTT_PAYLOAD_MAX: usize = 268_435_455;

impl KafkaConfig {
    /// librdkafka's `security.protocol` for its TLS and SASL settings (`None`: plaintext).
    pub fn security_protocol(&self) -> Option<&'static str> {
        match (&self.tls, &self.sasl) {
            (None, None) => None,
            (Some(_), None) => Some("ssl"),
            (None, Some(_)) => Some("sasl_plaintext"),
            (Some(_), Some(_)) => Some("sasl_ssl"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    /// Unique; the label of this rule's metrics and status.
    pub name: String,
    pub mqtt: RuleMqtt,
    /// A CEL expression (bool): only messages it is true for are forwarded; the others are
    /// acknowledged and counted as filtered. See `expr.rs` for the variables.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filter: Option<String>,
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
    /// Overrides the top-level `stall_budget_secs` for this rule.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stall_budget_secs: Option<u64>,
}

impl Rule {
    /// The largest payload this rule takes: its own limit, else the connection's
    /// (`connection`: `mqtt.max_message_bytes`).
    pub fn max_message_bytes(&self, connection: u32) -> u32 {
        self.mqtt
            .max_message_bytes
            .map_or(connection, |own| own.min(connection))
    }
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
    /// The largest payload this rule takes, in bytes, at most `mqtt.max_message_bytes`
    /// (unset: that). A larger message fails on this rule only, as one over the connection's
    /// limit does. Its expressions' cost is estimated for payloads of this size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_message_bytes: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleKafka {
    /// A topic name, or a template taking MQTT topic levels (counted from 0): `telemetry.{1}`
    /// for `plant/7/telemetry` is `telemetry.7`. Empty (unset) when `topic_expression` is set.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub topic: String,
    /// A CEL expression (string) that names the topic, instead of `topic`: checked per message
    /// like a template's result.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topic_expression: Option<String>,
    #[serde(default)]
    pub key: KeyStrategy,
    #[serde(default)]
    pub headers: Headers,
    /// Encode the value through the schema registry; unset: the value as `payload` makes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<ValueEncoding>,
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
    /// Header name → CEL expression (string or bytes; `null` leaves the header out).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub expressions: BTreeMap<String, String>,
}

impl Default for Headers {
    fn default() -> Self {
        Self {
            metadata: false,
            user_properties: false,
            prefix: default_header_prefix(),
            expressions: BTreeMap::new(),
        }
    }
}

/// What becomes the Kafka record key (and so the partition).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
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
    /// A CEL expression (string or bytes; `null` for no key): `json.device`.
    Expression(String),
}

/// How the MQTT payload becomes the Kafka record value.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PayloadFormat {
    /// The payload bytes unchanged.
    #[default]
    Raw,
    /// `{"topic":"<mqtt topic>","payload":"<base64>"}`, byte-identical to the replaced
    /// forwarder's `wrap_as_json`.
    WrappedJson,
    /// A CEL expression whose result (a map, list or value) is written as JSON: reshape,
    /// drop fields, add topic levels or the receive time.
    Transform(String),
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
fn default_true() -> bool {
    true
}

fn is_true(b: &bool) -> bool {
    *b
}

fn default_mqtt_port() -> u16 {
    defaults::MQTT_PORT
}
fn default_keep_alive_secs() -> u16 {
    defaults::KEEP_ALIVE_SECS
}
fn default_max_inflight() -> u16 {
    defaults::MAX_INFLIGHT
}
fn default_max_inflight_bytes() -> u64 {
    defaults::MAX_INFLIGHT_BYTES
}
fn default_max_message_bytes() -> u32 {
    defaults::MAX_MESSAGE_BYTES
}
fn default_stall_budget_secs() -> u64 {
    defaults::STALL_BUDGET_SECS
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
    pub kind: ProblemKind,
}

/// What a [`Problem`] is about, so that callers tell problems apart without reading messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ProblemKind {
    /// A setting or a name: missing, out of range, malformed.
    #[default]
    Setting,
    /// An expression that does not compile, or that would cost more than its budget.
    Expression,
}

impl Problem {
    /// A problem with a setting at `path`.
    pub fn new(path: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            path: path.into(),
            message: message.into(),
            kind: ProblemKind::Setting,
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn config(mqtt: &str, drain: &str) -> ForwarderConfig {
        let yaml = format!(
            "mqtt: {{ host: h, client_id: me{mqtt} }}\nkafka: {{ bootstrap_servers: \"k:9092\" }}\n\
             rules:\n  - name: a\n    mqtt: {{ topics: [\"s/#\", \"$share/x/t\"] }}\n    kafka: {{ topic: t }}\n{drain}"
        );
        serde_saphyr::from_str(&yaml).unwrap_or_else(|e| panic!("{e}\n{yaml}"))
    }

    fn filters(subs: &[(String, u8)]) -> Vec<&str> {
        subs.iter().map(|(f, _)| f.as_str()).collect()
    }

    #[test]
    fn a_shared_group_subscribes_shared_and_drops_the_plain_form_on_connect() {
        let plan = config(", shared_group: g", "").subscription_plan();
        assert_eq!(filters(&plan.subscribe), ["$share/g/s/#", "$share/x/t"]);
        assert_eq!(plan.unsubscribe_on_connect, ["s/#"]);
    }

    #[test]
    fn a_single_replica_subscribes_plainly_and_drops_the_shared_form_on_connect() {
        let c = config(", shared_group: g, subscribe_shared: false", "");
        let plan = c.subscription_plan();
        assert_eq!(filters(&plan.subscribe), ["$share/x/t", "s/#"]);
        assert_eq!(plan.unsubscribe_on_connect, ["$share/g/s/#"]);
        assert!(!c.shares_subscriptions());
    }

    #[test]
    fn a_draining_forwarder_subscribes_nothing_and_drops_every_form() {
        let c = config(", shared_group: g", "drain: [other, me]\n");
        assert!(c.draining());
        let plan = c.subscription_plan();
        assert!(plan.subscribe.is_empty());
        assert_eq!(
            plan.unsubscribe_on_connect,
            ["$share/g/s/#", "$share/x/t", "s/#"]
        );
        let other = config(", shared_group: g", "drain: [other]\n");
        assert!(!other.draining() && !other.subscription_plan().subscribe.is_empty());
    }

    #[test]
    fn a_retiring_rule_is_unsubscribed_unless_a_kept_rule_has_its_filter() {
        let yaml = "mqtt: { host: h, client_id: me, shared_group: g }\n\
             kafka: { bootstrap_servers: \"k:9092\" }\n\
             rules:\n\
             \x20 - { name: moved, mqtt: { topics: [\"m/#\", \"both/#\"] }, kafka: { topic: t } }\n\
             \x20 - { name: kept, mqtt: { topics: [\"both/#\"] }, kafka: { topic: t } }\n\
             retiring: [moved]\n";
        let c: ForwarderConfig = serde_saphyr::from_str(yaml).unwrap_or_else(|e| panic!("{e}"));
        let plan = c.subscription_plan();
        assert_eq!(filters(&plan.subscribe), ["$share/g/both/#"]);
        assert_eq!(
            plan.unsubscribe_on_connect,
            ["$share/g/m/#", "both/#", "m/#"]
        );
        assert!(c.validate().is_empty(), "{:?}", c.validate());
        let mut unknown = c.clone();
        unknown.retiring = vec!["moved".into(), "gone".into(), "moved".into()];
        let problems: Vec<String> = unknown.validate().iter().map(ToString::to_string).collect();
        assert_eq!(
            problems,
            [
                "retiring[1]: \"gone\" is not a rule of this config (a retiring rule stays in `rules`)",
                "retiring[2]: \"moved\" is listed twice"
            ]
        );
    }
}
