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
        let defaults: MqttConfig = MqttConfig {
            host: self.mqtt.host,
            port: self.mqtt.port,
            clean_session: self.mqtt.client_id.is_empty(),
            client_id: self.mqtt.client_id,
            keep_alive_secs: KEEP_ALIVE_SECS,
            max_inflight: defaults::MAX_INFLIGHT,
            username: None,
            username_file: None,
            password: None,
            password_file: None,
            protocol: MqttProtocol::V311,
            session_expiry_secs: None,
            shared_group: None,
            tls: self.mqtt.tls.map(|t| Tls {
                ca_file: Some(t.ca_cert),
                cert_file: t.client_cert,
                key_file: t.client_key,
            }),
            reconnect_min_ms: defaults::RECONNECT_MIN_MS,
            reconnect_max_ms: defaults::RECONNECT_MAX_MS,
        };
        let (username, password) = match self.mqtt.credentials {
            Some(c) => (Some(c.username), Some(c.password)),
            None => (None, None),
        };
        ForwarderConfig {
            mqtt: MqttConfig {
                username,
                password,
                ..defaults
            },
            kafka: KafkaConfig {
                bootstrap_servers: format!("{}:{}", self.kafka.bootstrap_server, self.kafka.port),
                tls: None,
                sasl: None,
                config: self.kafka.config.unwrap_or_default(),
                allow_weaker_delivery: false,
            },
            rules: self
                .forwarding
                .into_iter()
                .map(|f| Rule {
                    name: f.name,
                    mqtt: RuleMqtt {
                        topics: vec![f.mqtt.topic],
                        qos: defaults::QOS,
                    },
                    kafka: RuleKafka {
                        topic: f.kafka.topic,
                        key: KeyStrategy::MqttTopic,
                        headers: Headers::default(),
                    },
                    payload: if f.wrap_as_json.unwrap_or(false) {
                        PayloadFormat::WrappedJson
                    } else {
                        PayloadFormat::Raw
                    },
                    dead_letter: None,
                    // The replaced forwarder crash-looped on such a message: holding it is
                    // the same guarantee without the crash.
                    on_unwritable: Default::default(),
                })
                .collect(),
            http: HttpConfig::default(),
            shutdown_timeout_secs: defaults::SHUTDOWN_TIMEOUT_SECS,
            dead_letter: None,
            log: LogConfig::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::config::{KeyStrategy, PayloadFormat, SourceFormat, load_str};

    /// The example shipped with the replaced forwarder, verbatim.
    const SHIPPED: &str = "mqtt:
    host: localhost
    port: 1883
    client_id: 'kafka-forwarding-service-1'
kafka:
    bootstrap_server: localhost
    port: 9092
forwarding:
    - name: foobar
      mqtt:
        topic: foo/bar/#
      kafka:
        topic: foobar
      wrap_as_json: false
";

    #[test]
    fn shipped_example_loads_unchanged() {
        let loaded = load_str(SHIPPED, |_| None).unwrap();
        assert_eq!(loaded.format, SourceFormat::Legacy);
        let c = loaded.config;
        assert_eq!(c.mqtt.client_id, "kafka-forwarding-service-1");
        assert!(!c.mqtt.clean_session);
        assert_eq!(c.kafka.bootstrap_servers, "localhost:9092");
        assert_eq!(c.rules[0].mqtt.topics, vec!["foo/bar/#".to_string()]);
        assert_eq!(c.rules[0].kafka.key, KeyStrategy::MqttTopic);
        assert_eq!(c.rules[0].payload, PayloadFormat::Raw);
    }

    #[test]
    fn legacy_env_credentials_and_clean_session() {
        let text = SHIPPED
            .replace("client_id: 'kafka-forwarding-service-1'", "client_id: ''\n    credentials: {username: u, password: \"${PW}\"}\n    unknown_key: ignored")
            .replace("wrap_as_json: false", "wrap_as_json: true");
        let loaded = load_str(&text, |n| (n == "PW").then(|| "s3cret".to_string())).unwrap();
        let c = loaded.config;
        assert!(c.mqtt.clean_session);
        assert_eq!(c.mqtt.password.as_ref().map(|p| p.expose()), Some("s3cret"));
        assert_eq!(c.rules[0].payload, PayloadFormat::WrappedJson);
        // Unset variables become "" as in the original, with a warning.
        let loaded = load_str(&text, |_| None).unwrap();
        assert_eq!(loaded.warnings.len(), 1);
    }

    #[test]
    fn legacy_invalid_topic_names_the_field() {
        let text = SHIPPED.replace("topic: foobar", "topic: 'foo bar'");
        let err = load_str(&text, |_| None).unwrap_err().to_string();
        assert!(
            err.contains("rules[0].kafka.topic: \"foo bar\" is not a valid Kafka topic name"),
            "{err}"
        );
    }
}
