//! Semantic validation of a [`ForwarderConfig`], one function per section. Validation never
//! stops at the first problem: every invalid field is reported with its path, in file order
//! (mqtt, kafka, dead_letter, rules), so one run of `--check` lists everything to fix.
//!
//! A config that passes becomes a [`ValidConfig`], which nothing else can make: code that takes
//! one (the forwarder's router) relies on it instead of checking again, and gets the topic
//! filters and templates already parsed.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::ops::Deref;

use crate::addr;
use crate::config::{
    DeadLetter, ForwarderConfig, KafkaConfig, MAX_RULES, MAX_SHUTDOWN_TIMEOUT_SECS,
    MAX_STALL_BUDGET_SECS, MqttConfig, MqttProtocol, Problem, ProblemKind, Rule, Sasl,
    SaslMechanism, SchemaFormat, SchemaRegistry, Tls, ValueEncoding,
};
use crate::config::{
    KeyStrategy, MIN_MESSAGE_BYTES, MQTT_PAYLOAD_MAX, OnUnwritable, PayloadFormat,
};
use crate::expr::{self, Expression, Kinds};
use crate::kafka_props;
use crate::topic::{TopicFilter, TopicTemplate, is_valid_share_group, validate_kafka_topic};

/// A config that passed [`ValidConfig::new`]. Reads as a [`ForwarderConfig`] through `Deref`;
/// it cannot be changed in ways validation would have to see again.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidConfig {
    config: ForwarderConfig,
    /// One per rule, in rule order.
    topics: Vec<RuleTopics>,
}

/// A rule's topics and expressions as validation parsed and compiled them.
#[derive(Debug, Clone, PartialEq)]
pub struct RuleTopics {
    /// `mqtt.topics`, in order.
    pub filters: Vec<TopicFilter>,
    /// `kafka.topic` or `kafka.topic_expression`.
    pub kafka_topic: KafkaTopic,
    pub expressions: RuleExpressions,
}

/// Where a rule's records go.
#[derive(Debug, Clone, PartialEq)]
pub enum KafkaTopic {
    Template(TopicTemplate),
    Expression(Expression),
}

/// A rule's compiled expressions, other than its topic's.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RuleExpressions {
    /// `filter`.
    pub filter: Option<Expression>,
    /// `kafka.key`'s `expression`.
    pub key: Option<Expression>,
    /// `kafka.headers.expressions`, by header name.
    pub headers: Vec<(String, Expression)>,
    /// `payload`'s `transform`.
    pub transform: Option<Expression>,
}

impl ValidConfig {
    /// The config, if it has no problems; otherwise every problem, as
    /// [`ForwarderConfig::validate`] lists them.
    pub fn new(config: ForwarderConfig) -> Result<Self, Vec<Problem>> {
        let (problems, topics) = check(&config);
        match topics {
            Some(topics) if problems.is_empty() => Ok(Self { config, topics }),
            // A rule's topics are missing only when a problem says why, so `problems` is
            // never empty here.
            _ => Err(problems),
        }
    }

    /// Each rule with its parsed topics.
    pub fn rules_with_topics(&self) -> impl Iterator<Item = (&Rule, &RuleTopics)> {
        self.config.rules.iter().zip(&self.topics)
    }

    /// Overrides `http.listen` (the command line's `--http-listen`); any address is valid.
    pub fn set_http_listen(&mut self, listen: SocketAddr) {
        self.config.http.listen = listen;
    }

    pub fn into_inner(self) -> ForwarderConfig {
        self.config
    }

    /// The same config with this forwarder listed in `drain` (nothing validated depends on
    /// `drain`).
    pub fn with_self_draining(mut self) -> Self {
        self.config = self.config.with_self_draining();
        self
    }
}

impl Deref for ValidConfig {
    type Target = ForwarderConfig;

    fn deref(&self) -> &ForwarderConfig {
        &self.config
    }
}

impl ForwarderConfig {
    /// Every semantic problem, with its field path. Empty means valid.
    pub fn validate(&self) -> Vec<Problem> {
        check(self).0
    }
}

/// Every problem, and the rules' parsed topics when all of them parsed.
fn check(config: &ForwarderConfig) -> (Vec<Problem>, Option<Vec<RuleTopics>>) {
    let mut p = Problems::default();
    check_mqtt(&mut p, &config.mqtt);
    check_kafka(&mut p, &config.kafka, &config.mqtt);
    if let Some(dl) = &config.dead_letter {
        check_dead_letter(&mut p, "dead_letter.topic", dl);
    }
    if let Some(registry) = &config.schema_registry {
        check_schema_registry(&mut p, registry);
    }
    let topics = check_rules(&mut p, config);
    check_retiring(&mut p, config);
    check_stall_budget(&mut p, "stall_budget_secs", config.stall_budget_secs);
    for (i, rule) in config.rules.iter().enumerate() {
        if let Some(secs) = rule.stall_budget_secs {
            check_stall_budget(&mut p, &format!("rules[{i}].stall_budget_secs"), secs);
        }
    }
    if config.shutdown_timeout_secs > MAX_SHUTDOWN_TIMEOUT_SECS {
        p.add(
            "shutdown_timeout_secs",
            format!(
                "{} is over the bound of {MAX_SHUTDOWN_TIMEOUT_SECS} (a day)",
                config.shutdown_timeout_secs
            ),
        );
    }
    (p.0, topics)
}

fn check_mqtt(p: &mut Problems, m: &MqttConfig) {
    if let Some(problem) = addr::host_problem(&m.host) {
        p.add("mqtt.host", format!("{:?} {problem}", m.host));
    }
    if m.port == 0 {
        p.add("mqtt.port", "must be between 1 and 65535");
    }
    check_client_id(p, m);
    if m.max_inflight == 0 {
        p.add("mqtt.max_inflight", "must be at least 1");
    }
    check_sizes(p, m);
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
        check_tls(p, "mqtt.tls", tls);
    }
    check_session(p, m);
    if m.reconnect_min_ms == 0 || m.reconnect_min_ms > m.reconnect_max_ms {
        p.add(
            "mqtt.reconnect_min_ms",
            "must be at least 1 and not above mqtt.reconnect_max_ms",
        );
    }
}

fn check_stall_budget(p: &mut Problems, at: &str, secs: u64) {
    if secs > MAX_STALL_BUDGET_SECS {
        p.add(
            at,
            format!(
                "{secs} is over the longest budget, {MAX_STALL_BUDGET_SECS} (a week); 0 means as long as it takes"
            ),
        );
    }
}

/// The window's bytes must hold the largest message, or that message could never be read.
fn check_sizes(p: &mut Problems, m: &MqttConfig) {
    if m.max_message_bytes < MIN_MESSAGE_BYTES {
        p.add(
            "mqtt.max_message_bytes",
            format!(
                "{} is below the smallest accepted ({MIN_MESSAGE_BYTES})",
                m.max_message_bytes
            ),
        );
    }
    if m.max_message_bytes as usize > MQTT_PAYLOAD_MAX {
        p.add(
            "mqtt.max_message_bytes",
            format!(
                "{} is over MQTT's largest packet ({MQTT_PAYLOAD_MAX})",
                m.max_message_bytes
            ),
        );
    }
    if m.max_inflight_bytes < u64::from(m.max_message_bytes) {
        p.add(
            "mqtt.max_inflight_bytes",
            format!(
                "{} is smaller than mqtt.max_message_bytes ({}): the largest message could never be read",
                m.max_inflight_bytes, m.max_message_bytes
            ),
        );
    }
}

fn check_client_id(p: &mut Problems, m: &MqttConfig) {
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
}

/// What a session that ends with the connection loses.
const SESSION_LOSS: &str = "the broker discards the forwarder's session, and the messages it holds for it, \
     so what is published while the forwarder is away, and what it received and had not \
     acknowledged yet, is lost";

/// Session expiry and shared subscriptions.
fn check_session(p: &mut Problems, m: &MqttConfig) {
    if m.protocol == MqttProtocol::V311 && m.session_expiry_secs.is_some() {
        p.add(
            "mqtt.session_expiry_secs",
            "is an MQTT 5 setting; set mqtt.protocol: 5 or remove it (3.1.1 sessions follow clean_session)",
        );
    }
    if !m.allow_weaker_delivery {
        if m.clean_session {
            p.add(
                "mqtt.clean_session",
                format!(
                    "true weakens the delivery guarantee: at every connect {SESSION_LOSS}; set mqtt.allow_weaker_delivery: true to accept that"
                ),
            );
        }
        if m.session_expiry_secs == Some(0) {
            p.add(
                "mqtt.session_expiry_secs",
                format!(
                    "0 weakens the delivery guarantee: at every disconnect {SESSION_LOSS}; set mqtt.allow_weaker_delivery: true to accept that"
                ),
            );
        }
    }
    if let Some(group) = &m.shared_group
        && !is_valid_share_group(group)
    {
        p.add(
            "mqtt.shared_group",
            format!("{group:?} must be non-empty and contain no '/', '+' or '#'"),
        );
    }
}

/// `mqtt`'s window is what the producer queue must hold.
fn check_kafka(p: &mut Problems, kafka: &KafkaConfig, mqtt: &MqttConfig) {
    if kafka.bootstrap_servers.trim().is_empty() {
        p.add("kafka.bootstrap_servers", "must not be empty");
    } else {
        for s in kafka.bootstrap_servers.split(',').map(str::trim) {
            if let Some(problem) = addr::server_problem(s) {
                p.add("kafka.bootstrap_servers", format!("{s:?} {problem}"));
            }
        }
    }
    check_kafka_properties(p, kafka, mqtt);
    if let Some(tls) = &kafka.tls {
        check_tls(p, "kafka.tls", tls);
    }
    if let Some(sasl) = &kafka.sasl {
        check_sasl(p, sasl, kafka.tls.is_some());
    }
}

fn check_sasl(p: &mut Problems, sasl: &Sasl, over_tls: bool) {
    check_user_password(
        p,
        "kafka.sasl",
        !sasl.username.is_empty() || sasl.username_file.is_some(),
        !sasl.password.is_empty() || sasl.password_file.is_some(),
    );
    if !over_tls && sasl.mechanism == SaslMechanism::Plain {
        p.add(
            "kafka.sasl.mechanism",
            "PLAIN sends the password in clear text; use it only with kafka.tls",
        );
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
fn check_kafka_properties(p: &mut Problems, kafka: &KafkaConfig, mqtt: &MqttConfig) {
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
            && let Some(problem) = kafka_props::queue_too_small(value, mqtt.max_inflight)
        {
            p.add(&at, problem);
        }
        if key == kafka_props::QUEUE_MAX_KBYTES
            && let Some(problem) = kafka_props::queue_bytes_too_small(value, mqtt.max_message_bytes)
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

/// The rules' parsed topics come back only when every rule's topics parsed.
fn check_schema_registry(p: &mut Problems, registry: &SchemaRegistry) {
    if let Some(problem) = registry_url_problem(&registry.url) {
        // A URL with credentials is not echoed: they would reach logs and status.
        let shown = if registry.url.contains('@') {
            "the url".to_owned()
        } else {
            format!("{:?}", registry.url)
        };
        p.add("schema_registry.url", format!("{shown} {problem}"));
    }
    if let Some(tls) = &registry.tls {
        if registry.url.starts_with("http://") {
            p.add(
                "schema_registry.tls",
                "is set but the url is http://: use https:// for TLS",
            );
        }
        check_tls(p, "schema_registry.tls", tls);
    }
    if let Some(auth) = &registry.basic_auth {
        if registry.url.starts_with("http://") {
            p.add(
                "schema_registry.basic_auth",
                "sends the password in clear text over http://: use an https:// url",
            );
        }
        check_user_password(
            p,
            "schema_registry.basic_auth",
            !auth.username.is_empty() || auth.username_file.is_some(),
            !auth.password.is_empty() || auth.password_file.is_some(),
        );
    }
}

/// A username and a password, each set inline or by a file.
fn check_user_password(p: &mut Problems, at: &str, username: bool, password: bool) {
    if !username {
        p.add(
            format!("{at}.username"),
            "must not be empty (set username or username_file)",
        );
    }
    if !password {
        p.add(
            format!("{at}.password"),
            "must not be empty (set password or password_file)",
        );
    }
}

/// What is wrong with a registry base URL: an `http` or `https` URL with a host, no query,
/// fragment or credentials (those come from `basic_auth`).
pub fn registry_url_problem(url: &str) -> Option<&'static str> {
    let Some(rest) = url
        .strip_prefix("https://")
        .or_else(|| url.strip_prefix("http://"))
    else {
        return Some("must start with http:// or https://");
    };
    let authority = rest.split('/').next().unwrap_or_default();
    if authority.is_empty() {
        return Some("has no host");
    }
    if authority.contains('@') {
        return Some("must not carry credentials: set basic_auth");
    }
    if rest.contains(['?', '#']) || rest.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Some("must be a base URL without query, fragment or spaces");
    }
    None
}

fn check_value_encoding(
    p: &mut Problems,
    at: &dyn Fn(&str) -> String,
    rule: &Rule,
    value: &ValueEncoding,
    has_registry: bool,
) {
    if !has_registry {
        p.add(
            at("kafka.value"),
            "encodes through a schema registry, and none is configured (schema_registry; on \
             Kubernetes, the BrokerConnection's spec.schemaRegistry)",
        );
    }
    if value.subject.trim().is_empty() {
        p.add(at("kafka.value.subject"), "must not be empty");
    }
    if value.version == Some(0) {
        p.add(at("kafka.value.version"), "versions start at 1");
    }
    if value.message.is_some() && value.format != SchemaFormat::Protobuf {
        p.add(
            at("kafka.value.message"),
            "names a Protobuf message: set it only with format protobuf",
        );
    }
    if rule.payload == PayloadFormat::WrappedJson {
        p.add(
            at("payload"),
            "wrapped_json is Ferry's own JSON envelope; a schema-encoded value is the payload \
             (raw) or a transform's result",
        );
    }
}

/// `retiring` names rules of this config, each once.
fn check_retiring(p: &mut Problems, config: &ForwarderConfig) {
    let names: BTreeSet<&str> = config.rules.iter().map(|r| r.name.as_str()).collect();
    let mut seen = BTreeSet::new();
    for (i, name) in config.retiring.iter().enumerate() {
        if !names.contains(name.as_str()) {
            p.add(
                format!("retiring[{i}]"),
                format!("{name:?} is not a rule of this config (a retiring rule stays in `rules`)"),
            );
        } else if !seen.insert(name.as_str()) {
            p.add(
                format!("retiring[{i}]"),
                format!("{name:?} is listed twice"),
            );
        }
    }
}

fn check_rules(p: &mut Problems, config: &ForwarderConfig) -> Option<Vec<RuleTopics>> {
    let rules = &config.rules;
    let max_message_bytes = config.mqtt.max_message_bytes;
    if rules.is_empty() {
        p.add("rules", "must contain at least one rule");
    }
    if rules.len() > MAX_RULES {
        p.add(
            "rules",
            format!(
                "has {} rules; at most {MAX_RULES} are supported",
                rules.len()
            ),
        );
    }
    let mut names = BTreeSet::new();
    let mut topics = Vec::with_capacity(rules.len());
    for (i, rule) in rules.iter().enumerate() {
        let at = |field: &str| format!("rules[{i}].{field}");
        check_rule_name(p, &at("name"), &rule.name, &mut names);
        check_rule_size(p, &at("mqtt.max_message_bytes"), rule, max_message_bytes);
        let parsed = check_rule_topics(p, &at, rule, rule.max_message_bytes(max_message_bytes));
        if rule.kafka.headers.prefix.chars().any(char::is_control) {
            p.add(
                at("kafka.headers.prefix"),
                "must not contain control characters",
            );
        }
        if let Some(dl) = &rule.dead_letter {
            check_dead_letter(p, &at("dead_letter.topic"), dl);
        }
        if let Some(value) = &rule.kafka.value {
            check_value_encoding(p, &at, rule, value, config.schema_registry.is_some());
            if config.dead_letter_of(rule).is_none() && rule.on_unwritable == OnUnwritable::Hold {
                p.add(
                    at("dead_letter"),
                    "must be set (or the top-level dead_letter, or on_unwritable: drop) when \
                     kafka.value is set: a message whose value does not fit the schema would \
                     otherwise hold every rule of the forwarder",
                );
            }
        }
        topics.push(parsed);
    }
    topics.into_iter().collect()
}

/// `seen` holds the names of the rules before this one.
fn check_rule_name<'a>(p: &mut Problems, at: &str, name: &'a str, seen: &mut BTreeSet<&'a str>) {
    if !is_valid_rule_name(name) {
        p.add(
            at,
            format!(
                "{name:?} must be 1-63 characters of letters, digits, '.', '_' or '-' (it labels metrics)"
            ),
        );
    } else if !seen.insert(name) {
        p.add(
            at,
            format!("{name:?} is used by another rule; names must be unique"),
        );
    }
}

/// A rule's own size limit fits between the smallest accepted and the connection's.
fn check_rule_size(p: &mut Problems, at: &str, rule: &Rule, connection_max: u32) {
    let Some(max) = rule.mqtt.max_message_bytes else {
        return;
    };
    if max < MIN_MESSAGE_BYTES {
        p.add(
            at,
            format!("{max} is below the smallest accepted ({MIN_MESSAGE_BYTES})"),
        );
    } else if max > connection_max {
        p.add(
            at,
            format!(
                "{max} is over the connection's mqtt.max_message_bytes ({connection_max}): larger messages are never read; raise that instead"
            ),
        );
    }
}

/// A rule's `mqtt` and `kafka.topic`; its parsed topics when they all parsed. `payload_bytes`:
/// the largest payload the rule takes, for its expressions' cost.
fn check_rule_topics(
    p: &mut Problems,
    at: &dyn Fn(&str) -> String,
    rule: &Rule,
    payload_bytes: u32,
) -> Option<RuleTopics> {
    if rule.mqtt.topics.is_empty() {
        p.add(at("mqtt.topics"), "must contain at least one topic filter");
    }
    // Index-aligned with `mqtt.topics`, so problems name the filter's position.
    let filters: Vec<Option<TopicFilter>> = rule
        .mqtt
        .topics
        .iter()
        .enumerate()
        .map(|(j, filter)| match TopicFilter::parse(filter) {
            Ok(parsed) => Some(parsed),
            Err(e) => {
                p.add(
                    at(&format!("mqtt.topics[{j}]")),
                    format!("{filter:?} is not a valid MQTT topic filter: {e}"),
                );
                None
            }
        })
        .collect();
    if rule.mqtt.qos > 2 {
        p.add(
            at("mqtt.qos"),
            format!("{} is not an MQTT QoS (0, 1 or 2)", rule.mqtt.qos),
        );
    }
    let payload_bytes = payload_bytes as usize;
    let kafka_topic = check_kafka_topic(p, at, rule, &filters, payload_bytes);
    let expressions = check_expressions(p, at, rule, payload_bytes);
    Some(RuleTopics {
        filters: filters.into_iter().collect::<Option<_>>()?,
        kafka_topic: kafka_topic?,
        expressions: expressions?,
    })
}

/// `kafka.topic` or `kafka.topic_expression`: exactly one.
fn check_kafka_topic(
    p: &mut Problems,
    at: &dyn Fn(&str) -> String,
    rule: &Rule,
    filters: &[Option<TopicFilter>],
    payload_bytes: usize,
) -> Option<KafkaTopic> {
    let k = &rule.kafka;
    match (&k.topic_expression, k.topic.is_empty()) {
        (Some(source), true) => compiled(
            p,
            &at("kafka.topic_expression"),
            source,
            STRING,
            payload_bytes,
        )
        .map(KafkaTopic::Expression),
        (Some(_), false) => {
            p.add(
                at("kafka.topic_expression"),
                "is set together with kafka.topic: set one of them",
            );
            None
        }
        (None, true) => {
            p.add(
                at("kafka.topic"),
                "must be set: a Kafka topic name or template (or set kafka.topic_expression)",
            );
            None
        }
        (None, false) => match TopicTemplate::parse(&k.topic) {
            Ok(template) => {
                check_template_levels(p, &at("kafka.topic"), &template, filters);
                Some(KafkaTopic::Template(template))
            }
            Err(e) => {
                p.add(
                    at("kafka.topic"),
                    format!(
                        "{:?} is not a valid Kafka topic name or template: it {e}",
                        k.topic
                    ),
                );
                None
            }
        },
    }
}

/// Compiles `filter`, the key's, the headers' and the transform's expressions.
fn check_expressions(
    p: &mut Problems,
    at: &dyn Fn(&str) -> String,
    rule: &Rule,
    payload_bytes: usize,
) -> Option<RuleExpressions> {
    let mut ok = true;
    let mut one = |p: &mut Problems, path: String, source: &str, returns: Returns| {
        let compiled = compiled(p, &path, source, returns, payload_bytes);
        ok &= compiled.is_some();
        compiled
    };
    let filter = rule
        .filter
        .as_deref()
        .and_then(|f| one(p, at("filter"), f, BOOL));
    let key = match &rule.kafka.key {
        KeyStrategy::Expression(source) => one(p, at("kafka.key.expression"), source, BYTES),
        _ => None,
    };
    let mut headers = Vec::new();
    let mut bad_name = false;
    for (name, source) in &rule.kafka.headers.expressions {
        let path = at(&format!("kafka.headers.expressions.{name}"));
        if name.is_empty() || name.chars().any(char::is_control) {
            p.add(
                &path,
                format!("header name {name:?} must be non-empty, without control characters"),
            );
            bad_name = true;
        }
        if let Some(e) = one(p, path, source, BYTES) {
            headers.push((name.clone(), e));
        }
    }
    let transform = match &rule.payload {
        PayloadFormat::Transform(source) => one(p, at("payload.transform"), source, ANY),
        _ => None,
    };
    (ok && !bad_name).then_some(RuleExpressions {
        filter,
        key,
        headers,
        transform,
    })
}

/// What a field's expression must return, in types and in words.
type Returns = (Kinds, &'static str);
const BOOL: Returns = (Kinds::BOOL, "a bool");
const STRING: Returns = (Kinds::STRING, "a string");
const BYTES: Returns = (
    Kinds::STRING.or(Kinds::BYTES).or(Kinds::NULL),
    "a string, bytes or null",
);
const ANY: Returns = (Kinds::ANY, "a value");

fn compiled(
    p: &mut Problems,
    path: &str,
    source: &str,
    returns: Returns,
    payload_bytes: usize,
) -> Option<Expression> {
    match expr::compile_returning(source, returns.0, returns.1, payload_bytes) {
        Ok(e) => Some(e),
        Err(e) => {
            p.0.push(Problem {
                kind: ProblemKind::Expression,
                ..Problem::new(path, e.to_string())
            });
            None
        }
    }
}

/// A template level must exist in every topic a filter matches (unless the filter ends in `#`).
fn check_template_levels(
    p: &mut Problems,
    at: &str,
    template: &TopicTemplate,
    filters: &[Option<TopicFilter>],
) {
    for (j, filter) in filters.iter().enumerate() {
        let Some(filter) = filter else { continue };
        let (depth, open) = filter.depth();
        if let Some(level) = template.levels().find(|&n| n >= depth && !open) {
            p.add(
                at,
                format!(
                    "uses topic level {{{level}}}, but topics matching mqtt.topics[{j}] {:?} have only {depth} level(s), counted from 0",
                    filter.as_str()
                ),
            );
        }
    }
}

fn is_valid_rule_name(name: &str) -> bool {
    (1..=63).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// Collects problems in the order they are found.
#[derive(Default)]
struct Problems(Vec<Problem>);

impl Problems {
    fn add(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.0.push(Problem::new(path, message));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(yaml: &str) -> ForwarderConfig {
        serde_saphyr::from_str(yaml).unwrap_or_else(|e| panic!("{e}\n{yaml}"))
    }

    const TWO_RULES: &str = r#"
mqtt: { host: h, client_id: c }
kafka: { bootstrap_servers: "k:9092" }
rules:
  - name: a
    mqtt: { topics: ["plant/+/temp", "plant/1/#"] }
    kafka: { topic: "t.{1}" }
  - name: b
    mqtt: { topics: ["x"] }
    kafka: { topic: x }
"#;

    #[test]
    fn a_valid_config_carries_each_rules_parsed_topics() {
        let valid = ValidConfig::new(parsed(TWO_RULES)).unwrap();
        let topics: Vec<(&str, Vec<&str>, Option<&str>)> = valid
            .rules_with_topics()
            .map(|(rule, t)| {
                let filters = t.filters.iter().map(TopicFilter::as_str).collect();
                let topic = match &t.kafka_topic {
                    KafkaTopic::Template(template) => template.as_static(),
                    KafkaTopic::Expression(_) => None,
                };
                (rule.name.as_str(), filters, topic)
            })
            .collect();
        assert_eq!(
            topics,
            [
                ("a", vec!["plant/+/temp", "plant/1/#"], None),
                ("b", vec!["x"], Some("x")),
            ]
        );
    }

    #[test]
    fn an_invalid_config_is_refused_with_every_problem_validate_lists() {
        let config = parsed(
            &TWO_RULES
                .replace("\"x\"", "\"x/#/y\"")
                .replace("host: h", "host: \"\""),
        );
        let problems = config.validate();
        let paths: Vec<&str> = problems.iter().map(|p| p.path.as_str()).collect();
        assert_eq!(paths, ["mqtt.host", "rules[1].mqtt.topics[0]"]);
        assert_eq!(ValidConfig::new(config), Err(problems));
    }

    #[test]
    fn an_expression_that_can_never_return_its_fields_type_is_refused_by_field() {
        let rules = TWO_RULES.replace(
            "    kafka: { topic: x }\n",
            "    kafka: { topic_expression: \"size(topic)\", key: { expression: \"qos > 1\" } }\n    filter: \"topic + '/x'\"\n",
        );
        let problems = parsed(&rules).validate();
        let found: Vec<String> = problems.iter().map(ToString::to_string).collect();
        assert_eq!(
            found,
            [
                "rules[1].kafka.topic_expression: does not compile: returns an int, never a string (at line 1, column 1)",
                "rules[1].filter: does not compile: returns a string, never a bool (at line 1, column 1)",
                "rules[1].kafka.key.expression: does not compile: returns a bool, never a string, bytes or null (at line 1, column 1)",
            ]
        );
        // A value only the message decides is left to the evaluation.
        let open = TWO_RULES.replace(
            "    kafka: { topic: x }\n",
            "    kafka: { topic: x }\n    filter: \"json.enabled\"\n",
        );
        assert_eq!(parsed(&open).validate(), []);
    }

    /// The transform of issue 34, about 400 bytes: over the budget for payloads of any size,
    /// accepted where the rule (or its connection) declares payloads of 2 KiB.
    const REALISTIC_TRANSFORM: &str = "{'id': json.id, 'room': levels[3], 'labels': json.tags.map(x, x + '!'), 'big': json.vals.filter(v, v > 10), 'doubled': json.vals.map(v, v > 10, v * 2), 'sum_flags': json.flags.exists(f, f == 'alarm'), 'all_ok': json.vals.all(v, v < 1000), 'names': json.items.map(i, i.name), 'first': json.items.map(i, i.ok, i.id), 'count': size(json.vals)}";

    #[test]
    fn a_rule_that_declares_small_payloads_may_have_a_costlier_transform() {
        let with = |connection: &str, rule: &str| {
            TWO_RULES
                .replace("client_id: c }", &format!("client_id: c{connection} }}"))
                .replace(
                    "    mqtt: { topics: [\"x\"] }\n    kafka: { topic: x }\n",
                    &format!(
                        "    mqtt: {{ topics: [\"x\"]{rule} }}\n    kafka: {{ topic: x }}\n    payload: {{ transform: \"{REALISTIC_TRANSFORM}\" }}\n"
                    ),
                )
        };
        let found = |yaml: &str| -> Vec<String> {
            parsed(yaml)
                .validate()
                .iter()
                .map(ToString::to_string)
                .collect()
        };
        let undeclared = found(&with("", ""));
        assert_eq!(undeclared.len(), 1, "{undeclared:?}");
        assert!(
            undeclared[0].starts_with(
                "rules[1].payload.transform: does not compile: one evaluation may cost an estimated"
            ) && undeclared[0].contains("a payload of 262144 bytes")
                && undeclared[0]
                    .contains("declare smaller payloads (the rule's mqtt.max_message_bytes)"),
            "{undeclared:?}"
        );
        assert_eq!(
            found(&with("", ", max_message_bytes: 2048")),
            Vec::<String>::new()
        );
        assert_eq!(
            found(&with(", max_message_bytes: 2048", "")),
            Vec::<String>::new(),
            "the connection's limit is every rule's"
        );
        // A rule's limit never passes its connection's: larger messages are never read.
        assert_eq!(
            found(&with(
                ", max_message_bytes: 2048",
                ", max_message_bytes: 4096"
            )),
            [
                "rules[1].mqtt.max_message_bytes: 4096 is over the connection's mqtt.max_message_bytes (2048): larger messages are never read; raise that instead"
            ]
        );
        assert_eq!(
            found(&TWO_RULES.replace(
                "client_id: c }",
                "client_id: c, max_inflight_bytes: 100000 }"
            )),
            [
                "mqtt.max_inflight_bytes: 100000 is smaller than mqtt.max_message_bytes (1048576): the largest message could never be read"
            ]
        );
    }

    #[test]
    fn a_stall_budget_over_a_week_is_refused_by_field() {
        let config = format!(
            "stall_budget_secs: 604801\n{}",
            TWO_RULES.replace(
                "    kafka: { topic: x }\n",
                "    kafka: { topic: x }\n    stall_budget_secs: 604800\n"
            )
        );
        let found: Vec<String> = parsed(&config)
            .validate()
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            found,
            [
                "stall_budget_secs: 604801 is over the longest budget, 604800 (a week); 0 means as long as it takes"
            ]
        );
    }

    #[test]
    fn a_schema_encoded_value_needs_a_registry_a_subject_and_a_payload_it_can_encode() {
        let encoded = |value: &str, extra: &str| {
            TWO_RULES.replace(
                "    kafka: { topic: x }\n",
                &format!(
                    "    kafka: {{ topic: x, value: {value} }}\n    dead_letter: {{ topic: dlq }}\n{extra}"
                ),
            )
        };
        let good = "{ format: avro, subject: x-value }";
        let registry = "schema_registry: { url: \"https://registry:8081/ccompat\" }\n";
        assert_eq!(
            parsed(&format!("{registry}{}", encoded(good, ""))).validate(),
            []
        );
        // A value that does not fit the schema needs a way out other than holding the group.
        let without = format!("{registry}{}", encoded(good, ""))
            .replace("    dead_letter: { topic: dlq }\n", "");
        assert_eq!(
            parsed(&without)
                .validate()
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>(),
            [
                "rules[1].dead_letter: must be set (or the top-level dead_letter, or on_unwritable: drop) when kafka.value is set: a message whose value does not fit the schema would otherwise hold every rule of the forwarder"
            ]
        );
        assert_eq!(
            parsed(&format!("{without}    on_unwritable: drop\n")).validate(),
            []
        );
        assert_eq!(
            parsed(&format!("dead_letter: {{ topic: all.dlq }}\n{without}")).validate(),
            []
        );
        let found = |yaml: &str| -> Vec<String> {
            parsed(yaml)
                .validate()
                .iter()
                .map(ToString::to_string)
                .collect()
        };
        assert_eq!(
            found(&encoded(good, "")),
            [
                "rules[1].kafka.value: encodes through a schema registry, and none is configured (schema_registry; on Kubernetes, the BrokerConnection's spec.schemaRegistry)"
            ]
        );
        let bad = "{ format: avro, subject: \" \", version: 0, message: a.B }";
        assert_eq!(
            found(&format!(
                "{registry}{}",
                encoded(bad, "    payload: wrapped_json\n")
            )),
            [
                "rules[1].kafka.value.subject: must not be empty",
                "rules[1].kafka.value.version: versions start at 1",
                "rules[1].kafka.value.message: names a Protobuf message: set it only with format protobuf",
                "rules[1].payload: wrapped_json is Ferry's own JSON envelope; a schema-encoded value is the payload (raw) or a transform's result",
            ]
        );
        for (url, problem) in [
            ("registry:8081", "must start with http:// or https://"),
            ("https:///x", "has no host"),
            (
                "https://u:p@registry",
                "must not carry credentials: set basic_auth",
            ),
            (
                "https://registry/?a=1",
                "must be a base URL without query, fragment or spaces",
            ),
        ] {
            assert_eq!(registry_url_problem(url), Some(problem), "{url}");
        }
        let tls_over_http = "schema_registry: { url: \"http://r\", tls: { ca_file: ca.pem }, basic_auth: { username: u } }\n";
        assert_eq!(
            found(&format!("{tls_over_http}{}", encoded(good, ""))),
            [
                "schema_registry.tls: is set but the url is http://: use https:// for TLS",
                "schema_registry.basic_auth: sends the password in clear text over http://: use an https:// url",
                "schema_registry.basic_auth.password: must not be empty (set password or password_file)",
            ]
        );
        let in_url = "schema_registry: { url: \"https://u:s3cret@r\" }\n";
        assert_eq!(
            found(&format!("{in_url}{}", encoded(good, ""))),
            ["schema_registry.url: the url must not carry credentials: set basic_auth"]
        );
    }
}
