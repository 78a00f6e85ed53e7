//! The replaced forwarder's `config.yaml`, read unchanged.

use super::no_env;
use crate::config::{KeyStrategy, PayloadFormat};
use crate::load::{SourceFormat, load_str};

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
    // Accepted as it was, and said: a clean session loses what it held.
    assert!(c.mqtt.clean_session && c.mqtt.allow_weaker_delivery);
    assert_eq!(loaded.warnings.len(), 1, "{:?}", loaded.warnings);
    assert!(
        loaded.warnings[0].contains("session is clean"),
        "{:?}",
        loaded.warnings
    );
    assert_eq!(c.mqtt.password.as_ref().map(|p| p.expose()), Some("s3cret"));
    assert_eq!(c.rules[0].payload, PayloadFormat::WrappedJson);
    // Unset variables become "" as in the original, with a warning.
    let loaded = load_str(&text, |_| None).unwrap();
    assert_eq!(loaded.warnings.len(), 2);
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
