//! Which Kafka records an MQTT message becomes: matching against the rules, one record per
//! distinct target, and the record's key and value.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use ferry_api::{ForwarderConfig, KeyStrategy, PayloadFormat, TopicFilter};

/// A distinct destination: two rules with the same topic, key and payload format share one,
/// so a message matching both is written once.
#[derive(Debug, Clone)]
pub struct Target {
    pub kafka_topic: String,
    pub key: KeyStrategy,
    pub payload: PayloadFormat,
    /// Indices (into the config's rules) of the rules that lead here, for per-rule counters.
    pub rules: Vec<usize>,
}

#[derive(Debug)]
pub struct Router {
    filters: Vec<(TopicFilter, usize)>,
    targets: Vec<Target>,
    /// For each rule, the index of its target.
    rule_target: Vec<usize>,
    rule_names: Vec<String>,
}

impl Router {
    /// Builds from a validated config (invalid filters were rejected by validation and are
    /// skipped here rather than panicking).
    pub fn new(config: &ForwarderConfig) -> Self {
        let mut targets: Vec<Target> = Vec::new();
        let mut rule_target = Vec::with_capacity(config.rules.len());
        let mut filters = Vec::new();
        for (i, rule) in config.rules.iter().enumerate() {
            let existing = targets.iter().position(|t| {
                t.kafka_topic == rule.kafka.topic
                    && t.key == rule.kafka.key
                    && t.payload == rule.payload
            });
            let t = match existing {
                Some(t) => {
                    targets[t].rules.push(i);
                    t
                }
                None => {
                    targets.push(Target {
                        kafka_topic: rule.kafka.topic.clone(),
                        key: rule.kafka.key,
                        payload: rule.payload,
                        rules: vec![i],
                    });
                    targets.len() - 1
                }
            };
            rule_target.push(t);
            for f in &rule.mqtt.topics {
                if let Ok(filter) = TopicFilter::parse(f) {
                    filters.push((filter, i));
                }
            }
        }
        Self {
            filters,
            targets,
            rule_target,
            rule_names: config.rules.iter().map(|r| r.name.clone()).collect(),
        }
    }

    pub fn targets(&self) -> &[Target] {
        &self.targets
    }

    pub fn rule_names(&self) -> &[String] {
        &self.rule_names
    }

    /// The distinct targets of a topic, in rule order, appended to `out`.
    pub fn route(&self, topic: &str, out: &mut Vec<usize>) {
        out.clear();
        for (filter, rule) in &self.filters {
            let t = self.rule_target[*rule];
            if !out.contains(&t) && filter.matches(topic) {
                out.push(t);
            }
        }
    }
}

/// The record key for a message under a key strategy.
pub fn record_key(strategy: KeyStrategy, mqtt_topic: &str) -> Option<&str> {
    match strategy {
        KeyStrategy::MqttTopic => Some(mqtt_topic),
        KeyStrategy::None => None,
        KeyStrategy::TopicLevel(n) => mqtt_topic.split('/').nth(n),
    }
}

/// The wrapped record of the replaced forwarder: compact JSON, `topic` then `payload`, standard
/// base64 with padding.
pub fn wrap_json(mqtt_topic: &str, payload: &[u8]) -> Vec<u8> {
    #[derive(serde::Serialize)]
    struct Wrapped<'a> {
        topic: &'a str,
        payload: String,
    }
    let wrapped = Wrapped {
        topic: mqtt_topic,
        payload: BASE64.encode(payload),
    };
    // Serializing a struct of two strings cannot fail; fall back to an empty object if the
    // impossible happens rather than panicking on the data path.
    serde_json::to_vec(&wrapped).unwrap_or_else(|_| b"{}".to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(yaml: &str) -> ForwarderConfig {
        ferry_api::load_str(yaml, |_| None)
            .map(|l| l.config)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    const TWO_RULES_SAME_TARGET: &str = r#"
mqtt: { host: h, client_id: c }
kafka: { bootstrap_servers: "k:9092" }
rules:
  - name: all
    mqtt: { topics: ["plant/#"] }
    kafka: { topic: telemetry }
  - name: temps
    mqtt: { topics: ["plant/+/temp", "plant/1/temp"] }
    kafka: { topic: telemetry }
  - name: wrapped
    mqtt: { topics: ["plant/+/temp"] }
    kafka: { topic: telemetry }
    payload: wrapped_json
"#;

    #[test]
    fn a_message_reaches_each_distinct_target_once() {
        let router = Router::new(&config(TWO_RULES_SAME_TARGET));
        assert_eq!(router.targets().len(), 2);
        let mut out = Vec::new();
        router.route("plant/1/temp", &mut out);
        assert_eq!(out, vec![0, 1]);
        assert_eq!(router.targets()[0].rules, vec![0, 1]);
        router.route("plant/1/pressure", &mut out);
        assert_eq!(out, vec![0]);
        router.route("other/1/temp", &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn keys() {
        assert_eq!(record_key(KeyStrategy::MqttTopic, "a/b/c"), Some("a/b/c"));
        assert_eq!(record_key(KeyStrategy::None, "a/b/c"), None);
        assert_eq!(record_key(KeyStrategy::TopicLevel(1), "a/b/c"), Some("b"));
        assert_eq!(record_key(KeyStrategy::TopicLevel(5), "a/b/c"), None);
    }

    #[test]
    fn wrapped_json_matches_the_replaced_forwarder_byte_for_byte() {
        // serde_json + BASE64_STANDARD over {topic, payload}, as in the original's mqtt.rs.
        assert_eq!(
            wrap_json("foo/bar", b"hello"),
            br#"{"topic":"foo/bar","payload":"aGVsbG8="}"#.to_vec()
        );
        assert_eq!(
            wrap_json("caf\u{e9}/\"q\"", &[0, 255, 1]),
            "{\"topic\":\"caf\u{e9}/\\\"q\\\"\",\"payload\":\"AP8B\"}"
                .as_bytes()
                .to_vec()
        );
        assert_eq!(
            wrap_json("t", b""),
            br#"{"topic":"t","payload":""}"#.to_vec()
        );
    }
}
