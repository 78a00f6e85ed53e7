//! The replaced forwarder's `config.yaml` (MaibornWolff mqtt-kafka-forwarding-service), read
//! unchanged. Like the original, unknown keys are ignored. Its meaning is kept:
//! - an empty `mqtt.client_id` means a clean session, any other a persistent one;
//! - the Kafka key is the MQTT topic; `wrap_as_json` wraps the payload;
//! - `kafka.config` passes through to librdkafka (and still overrides defaults).
//!
//! One deliberate change: the original subscribed at QoS 2; Ferry subscribes at its default,
//! QoS 1 ([`crate::defaults::QOS`]). Both give at-least-once into Kafka (the Kafka side can
//! duplicate either way), and QoS 1 needs half the packets per message.

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::config::{
    ForwarderConfig, Headers, HttpConfig, KafkaConfig, KeyStrategy, LogConfig, MqttConfig,
    MqttProtocol, PayloadFormat, Rule, RuleKafka, RuleMqtt, Secret, Tls,
};
use crate::defaults;

#[derive(Debug, Deserialize)]
pub(crate) struct LegacyConfig {
    mqtt: LegacyMqtt,
    kafka: LegacyKafka,
    forwarding: Vec<LegacyForwarding>,
}

#[derive(Debug, Deserialize)]
struct LegacyMqtt {
    host: String,
    port: u16,
    client_id: String,
    credentials: Option<LegacyCredentials>,
    tls: Option<LegacyTls>,
}

#[derive(Debug, Deserialize)]
struct LegacyCredentials {
    username: String,
    password: Secret,
}

#[derive(Debug, Deserialize)]
struct LegacyTls {
    ca_cert: String,
    client_cert: Option<String>,
    client_key: Option<String>,
}

#[derive(Debug, Deserialize)]
struct LegacyKafka {
    bootstrap_server: String,
    port: u16,
    config: Option<BTreeMap<String, String>>,
}

#[derive(Debug, Deserialize)]
struct LegacyForwarding {
    name: String,
    mqtt: LegacyTopic,
    kafka: LegacyTopic,
    wrap_as_json: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct LegacyTopic {
    topic: String,
}

/// The legacy mapping has always used a 60 s keep-alive, not Ferry's default: kept, so a
/// legacy file behaves as it did.
const KEEP_ALIVE_SECS: u16 = 60;

impl LegacyConfig {
    pub(crate) fn into_ferry(self) -> ForwarderConfig {
        ForwarderConfig {
            mqtt: self.mqtt.into_ferry(),
            kafka: self.kafka.into_ferry(),
            rules: self
                .forwarding
                .into_iter()
                .map(LegacyForwarding::into_ferry)
                .collect(),
            http: HttpConfig::default(),
            shutdown_timeout_secs: defaults::SHUTDOWN_TIMEOUT_SECS,
            dead_letter: None,
            stall_budget_secs: defaults::STALL_BUDGET_SECS,
            log: LogConfig::default(),
            drain: Vec::new(),
            revision: 0,
            retiring: Vec::new(),
            drain_on_shutdown: None,
            schema_registry: None,
        }
    }
}

impl LegacyMqtt {
    fn into_ferry(self) -> MqttConfig {
        let (username, password) = match self.credentials {
            Some(c) => (Some(c.username), Some(c.password)),
            None => (None, None),
        };
        MqttConfig {
            host: self.host,
            port: self.port,
            clean_session: self.client_id.is_empty(),
            client_id: self.client_id,
            keep_alive_secs: KEEP_ALIVE_SECS,
            max_inflight: defaults::MAX_INFLIGHT,
            max_inflight_bytes: defaults::MAX_INFLIGHT_BYTES,
            max_message_bytes: defaults::MAX_MESSAGE_BYTES,
            username,
            username_file: None,
            password,
            password_file: None,
            protocol: MqttProtocol::V311,
            session_expiry_secs: None,
            shared_group: None,
            subscribe_shared: true,
            tls: self.tls.map(|t| Tls {
                ca_file: Some(t.ca_cert),
                cert_file: t.client_cert,
                key_file: t.client_key,
            }),
            reconnect_min_ms: defaults::RECONNECT_MIN_MS,
            reconnect_max_ms: defaults::RECONNECT_MAX_MS,
            // Set by the loader, with a warning, when the file asks for a clean session.
            allow_weaker_delivery: false,
        }
    }
}

impl LegacyKafka {
    fn into_ferry(self) -> KafkaConfig {
        KafkaConfig {
            bootstrap_servers: format!("{}:{}", self.bootstrap_server, self.port),
            tls: None,
            sasl: None,
            config: self.config.unwrap_or_default(),
            allow_weaker_delivery: false,
        }
    }
}

impl LegacyForwarding {
    fn into_ferry(self) -> Rule {
        Rule {
            name: self.name,
            mqtt: RuleMqtt {
                topics: vec![self.mqtt.topic],
                qos: defaults::QOS,
                max_message_bytes: None,
            },
            filter: None,
            kafka: RuleKafka {
                topic: self.kafka.topic,
                topic_expression: None,
                key: KeyStrategy::MqttTopic,
                headers: Headers::default(),
                value: None,
            },
            payload: if self.wrap_as_json.unwrap_or(false) {
                PayloadFormat::WrappedJson
            } else {
                PayloadFormat::Raw
            },
            dead_letter: None,
            // The replaced forwarder crash-looped on such a message: holding it is the same
            // guarantee without the crash.
            on_unwritable: Default::default(),
            stall_budget_secs: None,
        }
    }
}
