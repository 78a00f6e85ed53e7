//! Dereference and validate: what CEL cannot check because it spans objects. Are the Secrets a
//! connection references there, with the keys it names? Do two rules of a group write the
//! same Kafka topic from overlapping filters? Pure functions over what the reconciler read;
//! each problem names the object and field a human has to fix.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use ferry_api::TopicFilter;
use ferry_api::crd::{BrokerConnection, CredentialsRef, ForwardingRule, TlsRefs};
use k8s_openapi::ByteString;
use kube::ResourceExt;

use crate::children::keys;

/// The label a Secret must carry, with the value [`MARK_VALUE`], before a BrokerConnection
/// may use it: creating a BrokerConnection must not be a way to read Secrets (its author picks
/// the hosts that receive the values). Whoever may label a Secret may also read it.
pub const SECRET_MARK: &str = "ferry.dev/broker-credentials";
pub const MARK_VALUE: &str = "true";

/// The referenced Secrets that exist, by name (the connection's namespace).
pub type Secrets = BTreeMap<String, ReadSecret>;

/// A referenced Secret as the dereference step read it.
#[derive(Debug, Clone, PartialEq)]
pub enum ReadSecret {
    /// Marked for Ferry: its data.
    Marked(BTreeMap<String, ByteString>),
    /// Without the mark: its data was not kept.
    Unmarked,
}

impl ReadSecret {
    /// What to keep of a Secret with these `labels` and `data`.
    pub fn new(
        labels: Option<&BTreeMap<String, String>>,
        data: Option<BTreeMap<String, ByteString>>,
    ) -> Self {
        if labels
            .and_then(|l| l.get(SECRET_MARK))
            .is_some_and(|v| v == MARK_VALUE)
        {
            ReadSecret::Marked(data.unwrap_or_default())
        } else {
            ReadSecret::Unmarked
        }
    }
}

/// A reference that does not resolve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MissingSecret {
    /// The field holding the reference, e.g. `spec.mqtt.credentialsSecretRef`.
    pub field: String,
    pub secret: String,
    pub problem: Unresolved,
}

/// Why a reference does not resolve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unresolved {
    /// The Secret does not exist.
    NoSecret,
    /// The Secret exists, without the mark.
    NotMarked,
    /// The Secret has no such key.
    NoKey(String),
}

impl fmt::Display for MissingSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (secret, field) = (&self.secret, &self.field);
        match &self.problem {
            Unresolved::NoSecret => write!(f, "Secret {secret:?} ({field}) does not exist"),
            Unresolved::NotMarked => write!(
                f,
                "Secret {secret:?} ({field}) is not marked for Ferry: it needs the label \
                 {SECRET_MARK}={MARK_VALUE:?}, set by someone allowed to read it"
            ),
            Unresolved::NoKey(key) => write!(f, "Secret {secret:?} ({field}) has no key {key:?}"),
        }
    }
}

/// Copies what the connection references into the group Secret's keys (see
/// [`crate::children::keys`]), or lists every reference that does not resolve.
pub fn resolve_secrets(
    connection: &BrokerConnection,
    secrets: &Secrets,
) -> Result<BTreeMap<String, ByteString>, Vec<MissingSecret>> {
    let spec = &connection.spec;
    let mut out = BTreeMap::new();
    let mut missing = Vec::new();
    let mut take = |field: &str, secret: &str, key: &str, into: &str| {
        let problem = match secrets.get(secret) {
            None => Unresolved::NoSecret,
            Some(ReadSecret::Unmarked) => Unresolved::NotMarked,
            Some(ReadSecret::Marked(data)) => match data.get(key) {
                Some(value) => {
                    out.insert(into.to_owned(), value.clone());
                    return;
                }
                None => Unresolved::NoKey(key.to_owned()),
            },
        };
        missing.push(MissingSecret {
            field: field.to_owned(),
            secret: secret.to_owned(),
            problem,
        });
    };
    // Usernames given literally (a Strimzi KafkaUser's Secret has none): not read from a Secret.
    let mut literal = BTreeMap::new();
    let mut credentials = |field: &str, c: &CredentialsRef, user: &str, password: &str| {
        match &c.username {
            Some(name) => {
                literal.insert(user.to_owned(), ByteString(name.clone().into_bytes()));
            }
            None => take(field, &c.name, &c.username_key, user),
        }
        take(field, &c.name, &c.password_key, password);
    };
    if let Some(c) = &spec.mqtt.credentials_secret_ref {
        credentials(
            "spec.mqtt.credentialsSecretRef",
            c,
            keys::MQTT_USERNAME,
            keys::MQTT_PASSWORD,
        );
    }
    if let Some(s) = &spec.kafka.sasl {
        credentials(
            "spec.kafka.sasl.credentialsSecretRef",
            &s.credentials_secret_ref,
            keys::KAFKA_USERNAME,
            keys::KAFKA_PASSWORD,
        );
    }
    if let Some(c) = spec
        .schema_registry
        .as_ref()
        .and_then(|r| r.credentials_secret_ref.as_ref())
    {
        credentials(
            "spec.schemaRegistry.credentialsSecretRef",
            c,
            keys::REGISTRY_USERNAME,
            keys::REGISTRY_PASSWORD,
        );
    }
    let mut tls = |at: &str, t: &TlsRefs, ca: &str, cert: &str, key: &str| {
        if let Some(r) = &t.ca_secret_ref {
            take(&format!("{at}.caSecretRef"), &r.name, &r.key, ca);
        }
        if let Some(r) = &t.client_cert_secret_ref {
            let field = format!("{at}.clientCertSecretRef");
            take(&field, &r.name, &r.cert_key, cert);
            take(&field, &r.name, &r.key_key, key);
        }
    };
    if let Some(t) = &spec.mqtt.tls {
        tls(
            "spec.mqtt.tls",
            t,
            keys::MQTT_CA,
            keys::MQTT_CERT,
            keys::MQTT_KEY,
        );
    }
    if let Some(t) = &spec.kafka.tls {
        tls(
            "spec.kafka.tls",
            t,
            keys::KAFKA_CA,
            keys::KAFKA_CERT,
            keys::KAFKA_KEY,
        );
    }
    if let Some(t) = spec.schema_registry.as_ref().and_then(|r| r.tls.as_ref()) {
        tls(
            "spec.schemaRegistry.tls",
            t,
            keys::REGISTRY_CA,
            keys::REGISTRY_CERT,
            keys::REGISTRY_KEY,
        );
    }
    if missing.is_empty() {
        out.extend(literal);
        Ok(out)
    } else {
        // One line per Secret that is missing or unmarked, not one per key.
        missing.dedup_by(|a, b| {
            a.secret == b.secret
                && a.field == b.field
                && a.problem == b.problem
                && !matches!(a.problem, Unresolved::NoKey(_))
        });
        Err(missing)
    }
}

/// Where a rule's records go, as its spec writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target<'a> {
    /// `kafka.topic`: a name or template.
    Topic(&'a str),
    /// `kafka.topicExpression`: compared as text, since what it computes is unknown here.
    Expression(&'a str),
}

impl<'a> Target<'a> {
    fn of(rule: &'a ForwardingRule) -> Option<Self> {
        let k = &rule.spec.kafka;
        match (&k.topic, &k.topic_expression) {
            (Some(topic), _) => Some(Self::Topic(topic)),
            (None, Some(expression)) => Some(Self::Expression(expression)),
            (None, None) => None,
        }
    }
}

impl fmt::Display for Target<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Topic(t) => write!(f, "Kafka topic {t:?}"),
            Self::Expression(e) => write!(f, "the Kafka topic of expression {e:?}"),
        }
    }
}

/// Rules of one group that write the same Kafka topic (the same `topic`, or the same
/// `topicExpression` text) from overlapping filters: the oldest (then the first by name) keeps
/// it, so a new rule can never take a running one down; each later one is refused with the
/// reason (rule name → reason). A rule with a CEL `filter` conflicts with none: filters can
/// make two rules disjoint, and the forwarder writes a message both take once per distinct
/// target anyway.
pub fn conflicts(rules: &[&ForwardingRule]) -> BTreeMap<String, String> {
    let mut sorted: Vec<&&ForwardingRule> = rules
        .iter()
        .filter(|r| !r.spec.paused && r.spec.filter.is_none())
        .collect();
    sorted.sort_by_key(|r| (r.creation_timestamp(), r.name_any()));
    let filters = |r: &ForwardingRule| -> Vec<TopicFilter> {
        r.spec
            .mqtt
            .topics
            .iter()
            .filter_map(|t| TopicFilter::parse(&t.0).ok())
            .collect()
    };
    let mut refused = BTreeMap::new();
    for (i, later) in sorted.iter().enumerate() {
        let Some(target) = Target::of(later) else {
            continue;
        };
        let later_filters = filters(later);
        let clash = sorted[..i]
            .iter()
            .filter(|earlier| !refused.contains_key(&earlier.name_any()))
            .filter(|earlier| Target::of(earlier) == Some(target))
            .find_map(|earlier| {
                filters(earlier).into_iter().find_map(|a| {
                    later_filters
                        .iter()
                        .find(|b| a.overlaps(b))
                        .map(|b| (earlier.name_any(), a, b.clone()))
                })
            });
        if let Some((earlier, a, b)) = clash {
            refused.insert(
                later.name_any(),
                format!(
                    "writes {target} like rule {earlier:?}, and its filter {:?} overlaps {earlier:?}'s {:?}: a message would be forwarded twice; change the topic or the filters, or move one rule to another group",
                    b.as_str(),
                    a.as_str()
                ),
            );
        }
    }
    refused
}

/// The names of the Secrets a connection references.
pub fn referenced_secrets(c: &BrokerConnection) -> BTreeSet<String> {
    let s = &c.spec;
    let mut names = BTreeSet::new();
    names.extend(
        s.mqtt
            .credentials_secret_ref
            .as_ref()
            .map(|r| r.name.clone()),
    );
    names.extend(
        s.kafka
            .sasl
            .as_ref()
            .map(|r| r.credentials_secret_ref.name.clone()),
    );
    let registry = s.schema_registry.as_ref();
    names.extend(
        registry
            .and_then(|r| r.credentials_secret_ref.as_ref())
            .map(|r| r.name.clone()),
    );
    let registry_tls = registry.and_then(|r| r.tls.as_ref());
    for tls in [s.mqtt.tls.as_ref(), s.kafka.tls.as_ref(), registry_tls]
        .into_iter()
        .flatten()
    {
        names.extend(tls.ca_secret_ref.as_ref().map(|r| r.name.clone()));
        names.extend(tls.client_cert_secret_ref.as_ref().map(|r| r.name.clone()));
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conn(yaml_spec: &str) -> BrokerConnection {
        serde_saphyr::from_str(&format!(
            "apiVersion: ferry.dev/v1alpha1\nkind: BrokerConnection\nmetadata: {{ name: c, namespace: n }}\nspec:\n{yaml_spec}"
        ))
        .expect("connection")
    }

    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn rule(name: &str, topics: &str, kafka: &str) -> ForwardingRule {
        serde_saphyr::from_str(&format!(
            "apiVersion: ferry.dev/v1alpha1\nkind: ForwardingRule\nmetadata: {{ name: {name}, namespace: n }}\n\
             spec:\n  connectionRef: {{ name: c }}\n  mqtt: {{ topics: {topics} }}\n  kafka: {{ topic: {kafka} }}\n"
        ))
        .expect("rule")
    }

    const SPEC: &str = "  mqtt:\n    host: h\n    credentialsSecretRef: { name: mqtt-credentials }\n    tls: { clientCertSecretRef: { name: mqtt-client } }\n  kafka:\n    bootstrapServers: [\"k:9093\"]\n    sasl: { mechanism: SCRAM-SHA-512, credentialsSecretRef: { name: kafka, usernameKey: user, passwordKey: pass } }\n";

    fn secret(pairs: &[(&str, &str)]) -> ReadSecret {
        ReadSecret::Marked(
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), ByteString(v.as_bytes().to_vec())))
                .collect(),
        )
    }

    /// Every Secret `SPEC` references, with its keys.
    fn spec_secrets() -> Secrets {
        BTreeMap::from([
            (
                "mqtt-credentials".to_owned(),
                secret(&[("username", "u"), ("password", "p")]),
            ),
            (
                "mqtt-client".to_owned(),
                secret(&[("tls.crt", "CERT"), ("tls.key", "KEY")]),
            ),
            (
                "kafka".to_owned(),
                secret(&[("user", "ku"), ("pass", "kp")]),
            ),
        ])
    }

    #[test]
    fn resolved_secrets_land_under_the_group_keys() {
        let got = resolve_secrets(&conn(SPEC), &spec_secrets()).expect("resolves");
        let keys: Vec<&str> = got.keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            vec![
                "kafka-password",
                "kafka-username",
                "mqtt-password",
                "mqtt-tls.crt",
                "mqtt-tls.key",
                "mqtt-username"
            ]
        );
        assert_eq!(got["kafka-password"].0, b"kp");
    }

    /// The Secrets Strimzi's User Operator writes for a KafkaUser: SCRAM has `password` and
    /// `sasl.jaas.config` but no username (it is the KafkaUser's name); TLS has `ca.crt`,
    /// `user.crt`, `user.key`, `user.p12` and `user.password`. The cluster CA is its own Secret.
    #[test]
    fn strimzi_shaped_secrets_resolve_with_a_literal_username_and_named_keys() {
        const STRIMZI: &str = "  mqtt:\n    host: h\n  kafka:\n    bootstrapServers: [\"k:9093\"]\n    \
             tls: { caSecretRef: { name: plant-cluster-ca-cert, key: ca.crt }, clientCertSecretRef: { name: forwarder-tls, certKey: user.crt, keyKey: user.key } }\n    \
             sasl: { mechanism: SCRAM-SHA-512, credentialsSecretRef: { name: forwarder, username: forwarder } }\n";
        let secrets: Secrets = BTreeMap::from([
            (
                "forwarder".to_owned(),
                secret(&[
                    ("password", "scram-pw"),
                    (
                        "sasl.jaas.config",
                        "org.apache.kafka.common.security.scram.ScramLoginModule required username=\"forwarder\" password=\"scram-pw\";",
                    ),
                ]),
            ),
            (
                "forwarder-tls".to_owned(),
                secret(&[
                    ("ca.crt", "CLIENTS-CA"),
                    ("user.crt", "CERT"),
                    ("user.key", "KEY"),
                    ("user.p12", "P12"),
                    ("user.password", "P12-PW"),
                ]),
            ),
            (
                "plant-cluster-ca-cert".to_owned(),
                secret(&[("ca.crt", "CLUSTER-CA"), ("ca.p12", "P12")]),
            ),
        ]);
        let got = resolve_secrets(&conn(STRIMZI), &secrets).expect("resolves");
        let text = |k: &str| String::from_utf8_lossy(&got[k].0).into_owned();
        assert_eq!(text("kafka-username"), "forwarder", "the literal");
        assert_eq!(text("kafka-password"), "scram-pw");
        assert_eq!(text("kafka-tls.crt"), "CERT");
        assert_eq!(text("kafka-tls.key"), "KEY");
        assert_eq!(text("kafka-ca.crt"), "CLUSTER-CA");
        assert_eq!(got.len(), 5, "nothing else copied: {:?}", got.keys());
    }

    #[test]
    fn the_schema_registrys_secrets_are_referenced_resolved_and_named_when_missing() {
        let spec = format!(
            "{SPEC}  schemaRegistry:\n    url: https://r\n    tls: {{ caSecretRef: {{ name: registry-ca, key: ca.crt }} }}\n    credentialsSecretRef: {{ name: registry }}\n"
        );
        let c = conn(&spec);
        let names = referenced_secrets(&c);
        assert!(
            names.contains("registry") && names.contains("registry-ca"),
            "{names:?}"
        );
        let mut secrets = spec_secrets();
        secrets.insert("registry-ca".to_owned(), secret(&[("ca.crt", "CA")]));
        let missing = resolve_secrets(&c, &secrets).expect_err("missing");
        let text: Vec<String> = missing.iter().map(ToString::to_string).collect();
        assert_eq!(
            text,
            [r#"Secret "registry" (spec.schemaRegistry.credentialsSecretRef) does not exist"#]
        );
        secrets.insert(
            "registry".to_owned(),
            secret(&[("username", "ru"), ("password", "rp")]),
        );
        let got = resolve_secrets(&c, &secrets).expect("resolves");
        assert_eq!(got[keys::REGISTRY_PASSWORD].0, b"rp");
        assert_eq!(got[keys::REGISTRY_CA].0, b"CA");
    }

    #[test]
    fn every_missing_secret_or_key_is_named_with_its_field() {
        let secrets: Secrets = BTreeMap::from([("kafka".to_owned(), secret(&[("user", "ku")]))]);
        let missing = resolve_secrets(&conn(SPEC), &secrets).expect_err("missing");
        let text: Vec<String> = missing.iter().map(ToString::to_string).collect();
        assert_eq!(
            text,
            vec![
                r#"Secret "mqtt-credentials" (spec.mqtt.credentialsSecretRef) does not exist"#,
                r#"Secret "kafka" (spec.kafka.sasl.credentialsSecretRef) has no key "pass""#,
                r#"Secret "mqtt-client" (spec.mqtt.tls.clientCertSecretRef) does not exist"#,
            ]
        );
    }

    #[test]
    fn a_secret_without_the_mark_is_named_and_nothing_of_it_is_kept() {
        let labels = |v: &str| BTreeMap::from([(SECRET_MARK.to_owned(), v.to_owned())]);
        let data = || {
            Some(BTreeMap::from([(
                "password".to_owned(),
                ByteString(b"hunter2".to_vec()),
            )]))
        };
        assert_eq!(ReadSecret::new(None, data()), ReadSecret::Unmarked);
        assert_eq!(
            ReadSecret::new(Some(&labels("yes")), data()),
            ReadSecret::Unmarked,
            "only the exact value"
        );
        assert!(matches!(
            ReadSecret::new(Some(&labels("true")), data()),
            ReadSecret::Marked(d) if d.len() == 1
        ));

        let secrets: Secrets = BTreeMap::from([
            ("mqtt-credentials".to_owned(), ReadSecret::Unmarked),
            (
                "mqtt-client".to_owned(),
                secret(&[("tls.crt", "CERT"), ("tls.key", "KEY")]),
            ),
            (
                "kafka".to_owned(),
                secret(&[("user", "ku"), ("pass", "kp")]),
            ),
        ]);
        let missing = resolve_secrets(&conn(SPEC), &secrets).expect_err("unmarked");
        let text: Vec<String> = missing.iter().map(ToString::to_string).collect();
        assert_eq!(
            text,
            vec![
                r#"Secret "mqtt-credentials" (spec.mqtt.credentialsSecretRef) is not marked for Ferry: it needs the label ferry.dev/broker-credentials="true", set by someone allowed to read it"#
            ]
        );
        assert_eq!(missing[0].problem, Unresolved::NotMarked);
    }

    #[test]
    fn overlapping_rules_writing_one_topic_conflict_and_the_later_is_refused() {
        let a = rule("a-temps", "[\"plant/+/temp\"]", "telemetry");
        let b = rule("b-plant1", "[\"plant/1/#\"]", "telemetry");
        let c = rule("c-other-topic", "[\"plant/1/#\"]", "other");
        let d = rule("d-disjoint", "[\"office/#\"]", "telemetry");
        let refused = conflicts(&[&d, &c, &b, &a]);
        assert_eq!(refused.keys().collect::<Vec<_>>(), vec!["b-plant1"]);
        assert!(
            refused["b-plant1"].contains("overlaps \"a-temps\"'s \"plant/+/temp\""),
            "{refused:?}"
        );
        let mut paused = a.clone();
        paused.spec.paused = true;
        assert!(
            conflicts(&[&paused, &b]).is_empty(),
            "a paused rule forwards nothing"
        );
    }

    #[test]
    fn topic_expressions_conflict_when_their_text_is_the_same() {
        let expression = |name: &str, text: &str| {
            let mut r = rule(name, "[\"plant/#\"]", "unused");
            r.spec.kafka.topic = None;
            r.spec.kafka.topic_expression = Some(text.into());
            r
        };
        let a = expression("a", "'t.' + levels[1]");
        let b = expression("b", "'t.' + levels[1]");
        let c = expression("c", "'u.' + levels[1]");
        // A topic equal to the expression's text is not the same target.
        let d = rule("d", "[\"plant/#\"]", "\"'t.' + levels[1]\"");
        let refused = conflicts(&[&a, &b, &c, &d]);
        assert_eq!(refused.keys().collect::<Vec<_>>(), vec!["b"]);
        assert!(
            refused["b"].contains(
                "writes the Kafka topic of expression \"'t.' + levels[1]\" like rule \"a\""
            ),
            "{refused:?}"
        );
    }

    #[test]
    fn a_rule_with_a_filter_conflicts_with_none() {
        let a = rule("a", "[\"plant/#\"]", "telemetry");
        let mut b = rule("b", "[\"plant/1/#\"]", "telemetry");
        b.spec.filter = Some("json.temp > 50.0".into());
        assert!(conflicts(&[&a, &b]).is_empty());
        // Either side: an earlier rule with a filter does not hold the topic against a later one.
        let mut a_filtered = a.clone();
        a_filtered.spec.filter = Some("json.temp <= 50.0".into());
        let b_plain = rule("b", "[\"plant/1/#\"]", "telemetry");
        assert!(conflicts(&[&a_filtered, &b_plain]).is_empty());
        assert_eq!(
            conflicts(&[&a, &b_plain]).len(),
            1,
            "without filters they do"
        );
    }

    #[test]
    fn a_new_rule_never_takes_the_topic_from_a_running_one() {
        let created = |mut r: ForwardingRule, at: &str| {
            r.metadata.creation_timestamp = Some(Time(at.parse().expect("timestamp")));
            r
        };
        let running = created(
            rule("zz-running", "[\"plant/#\"]", "telemetry"),
            "2026-01-01T00:00:00Z",
        );
        let newcomer = created(
            rule("aa-new", "[\"plant/1/#\"]", "telemetry"),
            "2026-06-01T00:00:00Z",
        );
        let refused = conflicts(&[&newcomer, &running]);
        assert_eq!(refused.keys().collect::<Vec<_>>(), vec!["aa-new"]);
    }
}
