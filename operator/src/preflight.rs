//! Preflight: a rule's literal Kafka topics (its `spec.kafka.topic` without template levels,
//! and its dead-letter topic: its own, else its connection's) must exist before the rule is
//! rendered. A rule whose literal topic is missing is refused alone (`Accepted` False,
//! `TopicMissing`), and checked again on a slow timer, so creating the topic is enough.
//!
//! Only a rule not served now is judged: refusing a served rule would unsubscribe its filters,
//! and what its publishers send meanwhile would be lost; a served rule whose topic disappears
//! stays served and its forwarder reports it (`waiting: unknown_topic`, its stall budget).
//! Templated and expression topics are judged by the forwarder as they resolve.
//!
//! Unknown is not missing: when Kafka cannot be asked (unreachable, refused, timed out),
//! nothing is refused.
//!
//! The judgement is pure ([`refusals`]); the Kafka call ([`existing_topics`]) is at the edge:
//! one metadata request (every topic the principal may describe) per connection per check,
//! bounded in time and made off the async runtime, cached until the next check.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ferry_api::TopicTemplate;
use ferry_api::crd::{BrokerConnection, ForwardingRule};
use k8s_openapi::ByteString;
use kube::ResourceExt;
use rdkafka::ClientConfig;
use rdkafka::producer::{BaseProducer, Producer};
use tracing::{debug, info};

use crate::children::keys;
use crate::render::{Group, RenderError, render};

/// How long one metadata request may take before the topics count as unknown.
pub const METADATA_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the blocking part (client, request, teardown) may take in all before the
/// reconcile goes on without it.
const CHECK_DEADLINE: Duration = Duration::from_secs(10);
/// The default time between two checks of a connection's topics.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(60);

/// Which of a rule's topics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Which {
    /// `spec.kafka.topic`.
    Topic,
    /// The rule's own `spec.deadLetter.topic`.
    DeadLetter,
    /// Its connection's `spec.deadLetter.topic`.
    ConnectionDeadLetter,
}

/// The literal Kafka topics `rule` writes: its `spec.kafka.topic` when it has no template
/// level (a `topicExpression` is judged as it resolves, by the forwarder), and its dead-letter
/// topic, its own else its connection's.
pub fn literal_topics<'a>(
    connection: &'a BrokerConnection,
    rule: &'a ForwardingRule,
) -> Vec<(Which, &'a str)> {
    let mut out = Vec::new();
    if let Some(topic) = &rule.spec.kafka.topic
        && let Ok(template) = TopicTemplate::parse(topic)
        && let Some(name) = template.as_static()
        && rule.spec.kafka.topic_expression.is_none()
    {
        // The parsed name borrows the template: take the spec's text, which is the same.
        debug_assert_eq!(name, topic);
        out.push((Which::Topic, topic.as_str()));
    }
    match (&rule.spec.dead_letter, &connection.spec.dead_letter) {
        (Some(own), _) => out.push((Which::DeadLetter, own.topic.as_str())),
        (None, Some(shared)) => out.push((Which::ConnectionDeadLetter, shared.topic.as_str())),
        (None, None) => {}
    }
    out
}

/// The rules the preflight judges: not served now (by name in `served`), not paused (a paused
/// rule writes nothing), with a literal topic.
pub fn candidates<'a>(
    connection: &BrokerConnection,
    rules: &[&'a ForwardingRule],
    served: &BTreeSet<String>,
) -> Vec<&'a ForwardingRule> {
    rules
        .iter()
        .copied()
        .filter(|r| !r.spec.paused && !served.contains(&r.name_any()))
        .filter(|r| !literal_topics(connection, r).is_empty())
        .collect()
}

/// The rules to refuse (rule name → message): those of [`candidates`] one of whose literal
/// topics is not in `existing`. `interval`: how often the topics are checked again (said in
/// the message).
pub fn refusals(
    connection: &BrokerConnection,
    rules: &[&ForwardingRule],
    served: &BTreeSet<String>,
    existing: &BTreeSet<String>,
    interval: Duration,
) -> BTreeMap<String, String> {
    let name = connection.name_any();
    candidates(connection, rules, served)
        .into_iter()
        .filter_map(|rule| {
            let missing: Vec<String> = literal_topics(connection, rule)
                .into_iter()
                .filter(|(_, topic)| !existing.contains(*topic))
                .map(|(which, topic)| match which {
                    Which::Topic => format!("its Kafka topic {topic:?} (spec.kafka.topic)"),
                    Which::DeadLetter => {
                        format!("its dead-letter topic {topic:?} (spec.deadLetter.topic)")
                    }
                    Which::ConnectionDeadLetter => format!(
                        "its dead-letter topic {topic:?} (BrokerConnection {name:?}'s spec.deadLetter.topic)"
                    ),
                })
                .collect();
            (!missing.is_empty()).then(|| {
                (
                    rule.name_any(),
                    format!(
                        "{} does not exist in Kafka (or the connection's principal may not describe it); the rule is rendered once it does, checked every {} s",
                        missing.join(" and "),
                        interval.as_secs()
                    ),
                )
            })
        })
        .collect()
}

/// The names of the rules a forwarder config lists (`config.yaml` of a group's ConfigMap).
pub fn rules_in_config(config_yaml: &str) -> Vec<String> {
    #[derive(serde::Deserialize)]
    struct Named {
        name: String,
    }
    #[derive(serde::Deserialize)]
    struct Listed {
        #[serde(default)]
        rules: Vec<Named>,
    }
    serde_saphyr::from_str::<Listed>(config_yaml)
        .map(|l| l.rules.into_iter().map(|r| r.name).collect())
        .unwrap_or_default()
}

/// Why a client config for the connection could not be made. Never carries a value: any may
/// be a credential.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClientError {
    #[error("{0}")]
    Render(String),
    #[error("the {0} copied from the connection's Secret is not UTF-8 text")]
    NotText(&'static str),
}

impl From<RenderError> for ClientError {
    fn from(e: RenderError) -> Self {
        ClientError::Render(e.to_string())
    }
}

/// The librdkafka client config the operator asks Kafka with, as the forwarder connects: the
/// connection's bootstrap servers and `kafka.config` over Ferry's defaults, its TLS and SASL.
/// The CA, client certificate and key (`secret_data`, keyed as the group Secret is) are
/// passed in memory (`ssl.*.pem`), never through files. Idempotence is off: this client only
/// asks for metadata, and so asks for no producer id.
pub fn client_config(
    connection: &BrokerConnection,
    secret_data: &BTreeMap<String, ByteString>,
) -> Result<ClientConfig, ClientError> {
    let rendered = render(&Group {
        connection,
        name: "default",
        rules: Vec::new(),
    })?;
    let kafka = rendered.config.kafka;
    let mut cc = ferry_kafka_settings::client_config(&ferry_api::config::KafkaConfig {
        tls: None,
        sasl: None,
        ..kafka.clone()
    });
    cc.set("enable.idempotence", "false");
    let text = |key: &str, what: &'static str| -> Result<Option<String>, ClientError> {
        secret_data
            .get(key)
            .map(|b| String::from_utf8(b.0.clone()).map_err(|_| ClientError::NotText(what)))
            .transpose()
    };
    if let Some(p) = kafka.security_protocol() {
        cc.set("security.protocol", p);
    }
    if kafka.tls.is_some() {
        cc.set("ssl.endpoint.identification.algorithm", "https");
        if let Some(ca) = text(keys::KAFKA_CA, "Kafka CA certificate")? {
            cc.set("ssl.ca.pem", ca);
        }
        if let (Some(cert), Some(key)) = (
            text(keys::KAFKA_CERT, "Kafka client certificate")?,
            text(keys::KAFKA_KEY, "Kafka client key")?,
        ) {
            cc.set("ssl.certificate.pem", cert);
            cc.set("ssl.key.pem", key);
        }
    }
    if let Some(sasl) = &kafka.sasl {
        cc.set("sasl.mechanism", sasl.mechanism.as_str());
        if let Some(user) = text(keys::KAFKA_USERNAME, "Kafka username")? {
            cc.set("sasl.username", user);
        }
        if let Some(password) = text(keys::KAFKA_PASSWORD, "Kafka password")? {
            cc.set("sasl.password", password);
        }
    }
    Ok(cc)
}

/// Every topic Kafka lists to the connection's principal, or why not (no value in it).
/// Blocking: run it off the async runtime.
fn fetch_topics(cc: &ClientConfig, timeout: Duration) -> Result<BTreeSet<String>, String> {
    let producer: BaseProducer = cc.create().map_err(|e| match e {
        // The value is left out: it may be a credential.
        rdkafka::error::KafkaError::ClientConfig(_, description, key, _) => {
            format!("librdkafka refuses {key}: {description}")
        }
        _ => "librdkafka cannot create a client".to_owned(),
    })?;
    let metadata = producer
        .client()
        .fetch_metadata(None, timeout)
        .map_err(|e| format!("metadata request: {e}"))?;
    Ok(metadata
        .topics()
        .iter()
        .map(|t| t.name().to_owned())
        .collect())
}

/// What the last check of one connection found.
struct Checked {
    /// Of the connection's Kafka settings and credentials: a change is checked again at once.
    settings: u64,
    /// Of the rules judged (name, generation): a rule changed is checked again at once, unless
    /// the last check could not ask Kafka (then only after the interval: one timeout each).
    rules: u64,
    at: Instant,
    /// `None`: unknown.
    topics: Option<BTreeSet<String>>,
}

/// The topics found per connection, until the next check.
pub struct TopicCache {
    pub interval: Duration,
    checked: Mutex<HashMap<String, Checked>>,
}

impl TopicCache {
    pub fn new(interval: Duration) -> Self {
        Self {
            interval,
            checked: Mutex::new(HashMap::new()),
        }
    }

    /// Forgets a connection (deleted).
    pub fn forget(&self, key: &str) {
        if let Ok(mut c) = self.checked.lock() {
            c.remove(key);
        }
    }
}

fn hash_of(value: impl Hash) -> u64 {
    let mut h = DefaultHasher::new();
    value.hash(&mut h);
    h.finish()
}

/// The topics that exist in the connection's Kafka, from the cache when its check is recent
/// and nothing it depends on changed, else asked again; `None` when unknown (nothing is
/// refused for it). `key`: the connection's; `rules`: those [`candidates`] found.
pub async fn existing_topics(
    cache: &TopicCache,
    key: &str,
    connection: &BrokerConnection,
    secret_data: &BTreeMap<String, ByteString>,
    rules: &[&ForwardingRule],
) -> Option<BTreeSet<String>> {
    let settings = hash_of((
        serde_json::to_string(&connection.spec.kafka).unwrap_or_default(),
        serde_json::to_string(&connection.spec.dead_letter).unwrap_or_default(),
        secret_data
            .iter()
            .filter(|(k, _)| k.starts_with("kafka"))
            .map(|(k, v)| (k.as_str(), v.0.as_slice()))
            .collect::<Vec<_>>(),
    ));
    let rule_keys: BTreeSet<(String, Option<i64>)> = rules
        .iter()
        .map(|r| (r.name_any(), r.metadata.generation))
        .collect();
    let rules_hash = hash_of(&rule_keys);
    let was_known = {
        let checked = cache.checked.lock().ok()?;
        match checked.get(key) {
            Some(c)
                if c.settings == settings
                    && c.at.elapsed() < cache.interval
                    && (c.topics.is_none() || c.rules == rules_hash) =>
            {
                return c.topics.clone();
            }
            Some(c) => c.topics.is_some(),
            None => true,
        }
    };
    let topics = match client_config(connection, secret_data) {
        Err(e) => Err(e.to_string()),
        Ok(cc) => {
            let blocking = tokio::task::spawn_blocking(move || fetch_topics(&cc, METADATA_TIMEOUT));
            match tokio::time::timeout(CHECK_DEADLINE, blocking).await {
                Ok(Ok(result)) => result,
                Ok(Err(_)) => Err("the check failed".to_owned()),
                Err(_) => Err(format!("no answer within {} s", CHECK_DEADLINE.as_secs())),
            }
        }
    };
    let topics = match topics {
        Ok(t) => {
            debug!(connection = %key, topics = t.len(), "Kafka topics checked");
            Some(t)
        }
        Err(why) => {
            // Once per connection while it stays unknown; debug after.
            if was_known {
                info!(connection = %key, reason = %why, "cannot list the Kafka topics: no rule is refused for a missing topic until they can be");
            } else {
                debug!(connection = %key, reason = %why, "cannot list the Kafka topics");
            }
            None
        }
    };
    if let Ok(mut checked) = cache.checked.lock() {
        checked.insert(
            key.to_owned(),
            Checked {
                settings,
                rules: rules_hash,
                at: Instant::now(),
                topics: topics.clone(),
            },
        );
    }
    topics
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conn(extra: &str) -> BrokerConnection {
        let kafka = if extra.contains("  kafka:") {
            ""
        } else {
            "  kafka: { bootstrapServers: [\"k:9092\"] }\n"
        };
        serde_saphyr::from_str(&format!(
            "apiVersion: ferry.dev/v1alpha1\nkind: BrokerConnection\nmetadata: {{ name: c, namespace: n }}\nspec:\n  mqtt: {{ host: mqtt }}\n{kafka}{extra}"
        ))
        .expect("connection")
    }

    fn rule(name: &str, kafka: &str, extra: &str) -> ForwardingRule {
        serde_saphyr::from_str(&format!(
            "apiVersion: ferry.dev/v1alpha1\nkind: ForwardingRule\nmetadata: {{ name: {name}, namespace: n }}\nspec:\n  connectionRef: {{ name: c }}\n  mqtt: {{ topics: [\"a/#\"] }}\n  kafka: {kafka}\n{extra}"
        ))
        .expect("rule")
    }

    fn set(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|s| (*s).to_owned()).collect()
    }

    const EVERY: Duration = Duration::from_secs(60);

    #[test]
    fn only_literal_topics_are_checked_and_the_dead_letter_topic_is_the_rules_else_the_connections()
    {
        let c = conn("  deadLetter: { topic: shared-dlq }");
        let literal = rule("lit", "{ topic: orders }", "");
        let templated = rule("tpl", "{ topic: \"orders.{1}\" }", "");
        let expression = rule("expr", "{ topicExpression: \"'x'\" }", "");
        let own = rule(
            "own",
            "{ topic: \"t.{1}\" }",
            "  deadLetter: { topic: own-dlq }",
        );
        assert_eq!(
            literal_topics(&c, &literal),
            [
                (Which::Topic, "orders"),
                (Which::ConnectionDeadLetter, "shared-dlq")
            ]
        );
        assert_eq!(
            literal_topics(&c, &templated),
            [(Which::ConnectionDeadLetter, "shared-dlq")]
        );
        assert_eq!(
            literal_topics(&c, &expression),
            [(Which::ConnectionDeadLetter, "shared-dlq")]
        );
        assert_eq!(literal_topics(&c, &own), [(Which::DeadLetter, "own-dlq")]);
        let bare = conn("");
        assert!(literal_topics(&bare, &templated).is_empty());
        assert!(literal_topics(&bare, &expression).is_empty());
    }

    #[test]
    fn a_rule_not_served_whose_literal_topic_is_missing_is_refused_alone_naming_it() {
        let c = conn("");
        let present = rule("present", "{ topic: orders }", "");
        let missing = rule("missing", "{ topic: nowhere }", "");
        let templated = rule("templated", "{ topic: \"nowhere.{1}\" }", "");
        let rules = [&present, &missing, &templated];
        let refused = refusals(&c, &rules, &set(&[]), &set(&["orders"]), EVERY);
        assert_eq!(refused.keys().collect::<Vec<_>>(), ["missing"]);
        let message = &refused["missing"];
        assert!(
            message.contains("its Kafka topic \"nowhere\" (spec.kafka.topic) does not exist"),
            "{message}"
        );
        assert!(message.contains("checked every 60 s"), "{message}");
    }

    #[test]
    fn a_served_rule_is_never_refused_for_a_missing_topic() {
        let c = conn("");
        let served = rule("served", "{ topic: gone }", "");
        let rules = [&served];
        assert!(refusals(&c, &rules, &set(&["served"]), &set(&[]), EVERY).is_empty());
        assert!(candidates(&c, &rules, &set(&["served"])).is_empty());
    }

    #[test]
    fn a_paused_rule_is_not_judged() {
        let c = conn("");
        let paused = rule("paused", "{ topic: gone }", "  paused: true");
        assert!(refusals(&c, &[&paused], &set(&[]), &set(&[]), EVERY).is_empty());
    }

    #[test]
    fn a_missing_dead_letter_topic_is_named_as_the_rules_or_the_connections() {
        let c = conn("  deadLetter: { topic: shared-dlq }");
        let shared = rule("shared", "{ topic: orders }", "");
        let own = rule(
            "own",
            "{ topic: orders }",
            "  deadLetter: { topic: own-dlq }",
        );
        let both = rule("both", "{ topic: nowhere }", "");
        let rules = [&shared, &own, &both];
        let refused = refusals(&c, &rules, &set(&[]), &set(&["orders"]), EVERY);
        assert!(
            refused["shared"].starts_with("its dead-letter topic \"shared-dlq\" (BrokerConnection \"c\"'s spec.deadLetter.topic) does not exist"),
            "{}",
            refused["shared"]
        );
        assert!(
            refused["own"].starts_with(
                "its dead-letter topic \"own-dlq\" (spec.deadLetter.topic) does not exist"
            ),
            "{}",
            refused["own"]
        );
        assert!(
            refused["both"].starts_with("its Kafka topic \"nowhere\" (spec.kafka.topic) and its dead-letter topic \"shared-dlq\""),
            "{}",
            refused["both"]
        );
        let all = set(&["orders", "own-dlq", "shared-dlq", "nowhere"]);
        assert!(refusals(&c, &rules, &set(&[]), &all, EVERY).is_empty());
    }

    #[test]
    fn the_rules_a_config_lists_are_read_by_name() {
        let yaml = "mqtt: { host: m }\nrules:\n  - name: a\n    kafka: { topic: t }\n  - name: b\n";
        assert_eq!(rules_in_config(yaml), ["a", "b"]);
        assert!(rules_in_config("not: [valid").is_empty());
    }

    #[test]
    fn the_client_has_the_connections_tls_and_sasl_in_memory_never_as_files() {
        let c = conn(
            "  kafka:\n    bootstrapServers: [\"k:9093\"]\n    tls:\n      caSecretRef: { name: ca, key: ca.crt }\n      clientCertSecretRef: { name: cert }\n    sasl:\n      mechanism: SCRAM-SHA-512\n      credentialsSecretRef: { name: user }\n",
        );
        let data: BTreeMap<String, ByteString> = [
            (keys::KAFKA_CA, "CA PEM"),
            (keys::KAFKA_CERT, "CERT PEM"),
            (keys::KAFKA_KEY, "KEY PEM"),
            (keys::KAFKA_USERNAME, "forwarder"),
            (keys::KAFKA_PASSWORD, "s3cret"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), ByteString(v.as_bytes().to_vec())))
        .collect();
        let cc = client_config(&c, &data).expect("config");
        assert_eq!(cc.get("bootstrap.servers"), Some("k:9093"));
        assert_eq!(cc.get("security.protocol"), Some("sasl_ssl"));
        assert_eq!(cc.get("ssl.ca.pem"), Some("CA PEM"));
        assert_eq!(cc.get("ssl.certificate.pem"), Some("CERT PEM"));
        assert_eq!(cc.get("ssl.key.pem"), Some("KEY PEM"));
        assert_eq!(cc.get("sasl.mechanism"), Some("SCRAM-SHA-512"));
        assert_eq!(cc.get("sasl.username"), Some("forwarder"));
        assert_eq!(cc.get("sasl.password"), Some("s3cret"));
        assert_eq!(cc.get("enable.idempotence"), Some("false"));
        for file in [
            "ssl.ca.location",
            "ssl.certificate.location",
            "ssl.key.location",
        ] {
            assert_eq!(cc.get(file), None, "{file}");
        }
        let plain = client_config(&conn(""), &BTreeMap::new()).expect("config");
        assert_eq!(plain.get("security.protocol"), None);
    }

    #[test]
    fn a_refused_client_config_names_the_property_never_its_value() {
        let mut cc = ClientConfig::new();
        cc.set("sasl.password", "s3cret").set("linger.ms", "s3cret");
        let why = fetch_topics(&cc, Duration::from_millis(1)).expect_err("refused");
        assert!(!why.contains("s3cret"), "{why}");
        assert!(why.contains("linger.ms"), "{why}");
    }
}
