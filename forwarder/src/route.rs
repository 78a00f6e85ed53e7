//! Which Kafka records an MQTT message becomes: matching against the rules, one record per
//! distinct target, and the record's key and value.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use ferry_api::config::{Headers, OnUnwritable, ValueEncoding};
use ferry_api::expr::{Expression, JsonReads};
use ferry_api::validate::RuleTopics;
use ferry_api::{
    KafkaTopic, KeyStrategy, PayloadFormat, Rule, RuleExpressions, TopicFilter, TopicTemplate,
    ValidConfig,
};
use rdkafka::message::Header;
use smallvec::SmallVec;

use self::tree::FilterTree;
use crate::schemas::SchemaSlot;

use crate::metrics::{Metrics, RuleStats};
use crate::mqtt::{self, Message};
use crate::window::Policy;

mod tree;

/// A distinct destination: rules with the same topic, key, payload format, headers and dead
/// letter topic share one, so a message matching several is written once.
#[derive(Debug)]
pub struct Target {
    pub topic: KafkaTopic,
    pub key: KeyStrategy,
    pub payload: PayloadFormat,
    /// As configured: part of what makes two rules' targets the same.
    pub headers: Headers,
    pub header_plan: HeaderPlan,
    /// The topic's name when it is not a template (shared, so routing never allocates it).
    pub static_topic: Option<Arc<str>>,
    pub dead_letter: Option<Arc<str>>,
    pub on_unwritable: OnUnwritable,
    /// Its rules' largest message (their `mqtt.max_message_bytes`, else the connection's), in
    /// bytes of PUBLISH after the fixed header.
    pub max_message_bytes: usize,
    /// Its rules' stall budget (see `Window::expire_stalled`); `None`: none.
    pub stall_budget: Option<std::time::Duration>,
    /// The rules that lead here, for per-rule counters.
    pub rules: Vec<Arc<RuleStats>>,
    /// Each rule's `filter`, aligned with `rules`.
    pub filters: Vec<Option<Expression>>,
    /// The key's, headers' and transform's expressions (the topic's is in `topic`).
    pub expressions: RuleExpressions,
    /// Whether a message needs evaluating for this target (a filter or an expression):
    /// decided once its rules are all known, not per message.
    pub evaluates: bool,
    /// What its expressions read of `json`, together; `None` when none reads it.
    pub json_reads: Option<Arc<JsonReads>>,
    /// The registered schema its value is encoded with (`kafka.value`).
    pub value: Option<Arc<SchemaSlot>>,
}

impl Target {
    /// The rules in `matched` (positions in `rules`).
    pub fn matched<'a>(&'a self, matched: &'a RuleSet) -> impl Iterator<Item = &'a Arc<RuleStats>> {
        matched.iter().filter_map(|i| self.rules.get(i))
    }

    /// The names of the rules in `matched`.
    pub fn matched_names_vec(&self, matched: &RuleSet) -> Vec<String> {
        self.matched(matched).map(|r| r.name.clone()).collect()
    }

    /// The names of the rules in `matched`, comma-separated (for logs and headers).
    pub fn matched_names(&self, matched: &RuleSet) -> String {
        let names: Vec<&str> = self.matched(matched).map(|r| r.name.as_str()).collect();
        names.join(",")
    }

    fn needs_evaluation(&self) -> bool {
        self.all_expressions().next().is_some()
    }

    /// Its topic's, filters', key's, headers' and transform's expressions.
    fn all_expressions(&self) -> impl Iterator<Item = &Expression> {
        let e = &self.expressions;
        let topic = match &self.topic {
            KafkaTopic::Expression(t) => Some(t),
            KafkaTopic::Template(_) => None,
        };
        topic
            .into_iter()
            .chain(self.filters.iter().flatten())
            .chain(&e.key)
            .chain(e.headers.iter().map(|(_, h)| h))
            .chain(&e.transform)
    }

    /// The topic as configured, for logs and dead-letter headers when it did not resolve.
    pub fn topic_text(&self) -> String {
        match &self.topic {
            KafkaTopic::Template(t) => t.to_string(),
            KafkaTopic::Expression(e) => e.source().to_owned(),
        }
    }
}

/// A set of a target's rules, by position, ascending: sized by the rules a message matched
/// (usually one, kept inline), not by the target's.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RuleSet(SmallVec<[u32; 4]>);

impl RuleSet {
    pub fn insert(&mut self, position: usize) {
        let Ok(position) = u32::try_from(position) else {
            return;
        };
        // Positions mostly come in ascending order: a push.
        if self.0.last().is_none_or(|last| *last < position) {
            self.0.push(position);
        } else if let Err(at) = self.0.binary_search(&position) {
            self.0.insert(at, position);
        }
    }

    pub fn remove(&mut self, position: usize) {
        if let Some(at) = self.find(position) {
            self.0.remove(at);
        }
    }

    pub fn contains(&self, position: usize) -> bool {
        self.find(position).is_some()
    }

    fn find(&self, position: usize) -> Option<usize> {
        let position = u32::try_from(position).ok()?;
        self.0.binary_search(&position).ok()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The positions, ascending.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        self.0.iter().map(|p| *p as usize)
    }
}

/// One target a message goes to, and which of its rules it matched.
#[derive(Debug, Clone)]
pub struct Routed {
    pub target: Arc<Target>,
    pub matched: RuleSet,
}

/// One filter of one rule, as the tree finds it.
#[derive(Debug)]
struct Subscribed {
    /// Index of its rule.
    rule: usize,
    /// Index of its rule's target.
    target: usize,
    /// Its rule's position in the target's rules.
    position: usize,
    /// The MQTT 5 identifier of its subscription.
    id: u32,
}

#[derive(Debug)]
pub struct Router {
    /// Every rule's filters, in rule order, then in the order of the rule's `topics`.
    filters: Vec<Subscribed>,
    /// Indexes into `filters`, by topic filter.
    tree: FilterTree<usize>,
    targets: Vec<Arc<Target>>,
    rules: Vec<Arc<RuleStats>>,
    /// By rule index: the config lists it in `retiring`.
    retiring: Vec<bool>,
    schemas: Vec<Arc<SchemaSlot>>,
}

/// What makes two rules' targets the same (the fields `Router::new` compares).
#[derive(PartialEq, Eq, Hash)]
struct TargetKey<'a> {
    topic: TopicKey<'a>,
    key: &'a KeyStrategy,
    payload: &'a PayloadFormat,
    headers: &'a Headers,
    dead_letter: Option<Arc<str>>,
    on_unwritable: OnUnwritable,
    max_message_bytes: u32,
    stall_budget: Option<std::time::Duration>,
    value: Option<&'a ValueEncoding>,
}

/// A Kafka topic as [`KafkaTopic`]'s equality sees it: an expression by its source.
#[derive(PartialEq, Eq, Hash)]
enum TopicKey<'a> {
    Template(&'a TopicTemplate),
    Expression(&'a str),
}

impl<'a> TopicKey<'a> {
    fn of(topic: &'a KafkaTopic) -> Self {
        match topic {
            KafkaTopic::Template(t) => Self::Template(t),
            KafkaTopic::Expression(e) => Self::Expression(e.source()),
        }
    }
}

impl Router {
    /// Builds from a validated config, whose filters and templates are already parsed: in
    /// time linear in its rules and filters.
    pub fn new(config: &ValidConfig, metrics: &Metrics) -> Self {
        let names: Vec<String> = config.rules.iter().map(|r| r.name.clone()).collect();
        let rules = metrics.set_rules(&names);
        let mut targets: Vec<Target> = Vec::new();
        let mut by_key: HashMap<TargetKey<'_>, usize> = HashMap::new();
        let mut filters = Vec::new();
        let mut tree = FilterTree::default();
        let mut slots: Vec<Arc<SchemaSlot>> = Vec::new();
        let mut slot_of: HashMap<&ValueEncoding, usize> = HashMap::new();
        let listed: HashSet<&str> = config.retiring.iter().map(String::as_str).collect();
        let mut retiring = Vec::with_capacity(rules.len());
        for (i, (rule, parsed)) in config.rules_with_topics().enumerate() {
            retiring.push(listed.contains(rule.name.as_str()));
            rules[i].set_subscribed(
                rule.mqtt
                    .topics
                    .iter()
                    .map(|f| config.subscribed_as(f))
                    .collect(),
            );
            let dead_letter: Option<Arc<str>> = config
                .dead_letter_of(rule)
                .map(|d| Arc::from(d.topic.as_str()));
            let key = TargetKey {
                topic: TopicKey::of(&parsed.kafka_topic),
                key: &rule.kafka.key,
                payload: &rule.payload,
                headers: &rule.kafka.headers,
                dead_letter,
                on_unwritable: rule.on_unwritable,
                max_message_bytes: rule.max_message_bytes(config.mqtt.max_message_bytes),
                stall_budget: config.stall_budget_of(rule),
                value: rule.kafka.value.as_ref(),
            };
            let filter = parsed.expressions.filter.clone();
            let t = match by_key.get(&key) {
                Some(&t) => {
                    targets[t].rules.push(Arc::clone(&rules[i]));
                    targets[t].filters.push(filter);
                    t
                }
                None => {
                    // One slot per distinct encoding, found by hash: linear in the rules.
                    let value = rule.kafka.value.as_ref().map(|spec| {
                        let at = *slot_of.entry(spec).or_insert_with(|| {
                            slots.push(SchemaSlot::new(spec.clone()));
                            slots.len() - 1
                        });
                        Arc::clone(&slots[at])
                    });
                    targets.push(target(rule, parsed, &key, &rules[i], filter, value));
                    by_key.insert(key, targets.len() - 1);
                    targets.len() - 1
                }
            };
            let position = targets[t].rules.len() - 1;
            rules[i].set_schema(None);
            if let Some(slot) = &targets[t].value {
                slot.add_rule(Arc::clone(&rules[i]));
            }
            for f in &parsed.filters {
                let id = mqtt::subscription_id(&config.subscribed_as(f.as_str()));
                tree.insert(matched_as(f), filters.len());
                filters.push(Subscribed {
                    rule: i,
                    target: t,
                    position,
                    id,
                });
            }
        }
        Self {
            filters,
            tree,
            targets: targets
                .into_iter()
                .map(|mut t| {
                    t.evaluates = t.needs_evaluation();
                    t.json_reads = JsonReads::union(t.all_expressions()).map(Arc::new);
                    Arc::new(t)
                })
                .collect(),
            rules,
            retiring,
            schemas: slots,
        }
    }

    pub fn targets(&self) -> &[Arc<Target>] {
        &self.targets
    }

    /// The distinct schema encodings of its rules, to look up.
    pub fn schemas(&self) -> &[Arc<SchemaSlot>] {
        &self.schemas
    }

    /// The rules, in config order.
    pub fn rules(&self) -> &[Arc<RuleStats>] {
        &self.rules
    }

    /// What each rule says about a record Kafka can never take, by rule name.
    pub fn policies(&self) -> HashMap<&str, Policy> {
        self.targets
            .iter()
            .flat_map(|t| {
                t.rules.iter().map(|r| {
                    let policy = Policy::Rule {
                        dead_letter: t.dead_letter.clone(),
                        on_unwritable: t.on_unwritable,
                    };
                    (r.name.as_str(), policy)
                })
            })
            .collect()
    }

    /// The distinct targets of a message on `topic`, in rule order, with the rules each
    /// matched, into `out`; counts the message as received for every rule it matched.
    /// `delivered_for`: the subscriptions it was delivered for
    /// (MQTT 5 identifiers; empty when unknown). A broker may deliver a message once per
    /// matching subscription (Mosquitto does with MQTT 5): a rule then takes only the copy
    /// delivered for the first of its filters that matches, so it gets the message once
    /// however its filters overlap its own or other rules'. Identifiers that name no filter
    /// matching the topic (a config since replaced) route by the topic alone: a duplicate at
    /// worst, never a loss. `refused`: the identifiers of the filters the broker refused: no
    /// copy ever comes for those, so a rule's first *granted* matching filter decides.
    ///
    /// Returns the names of the retiring rules it reached when no rule kept did: their old
    /// subscription still delivers (see [`crate::handover::Handover::routed`]).
    pub fn route(
        &self,
        topic: &str,
        delivered_for: &[u32],
        refused: &HashSet<u32>,
        out: &mut Vec<Routed>,
    ) -> Vec<&str> {
        out.clear();
        let mut matching = Vec::new();
        self.tree.matches(topic, &mut matching);
        if matching.is_empty() {
            return Vec::new();
        }
        // Rule order, then filter order: the order the rules are written in.
        matching.sort_unstable();
        let filters = || matching.iter().filter_map(|f| self.filters.get(*f));
        let known = !delivered_for.is_empty() && filters().any(|f| delivered_for.contains(&f.id));
        let mut last_rule = usize::MAX;
        // The retiring rules it reached; whether it reached a rule kept.
        let (mut retiring, mut kept): (Vec<&str>, bool) = (Vec::new(), false);
        for f in filters() {
            if f.rule == last_rule || (known && refused.contains(&f.id)) {
                continue;
            }
            // The rule's first granted matching filter decides; a copy for another is not its own.
            last_rule = f.rule;
            if known && !delivered_for.contains(&f.id) {
                continue;
            }
            let (Some(rule), Some(target)) = (self.rules.get(f.rule), self.targets.get(f.target))
            else {
                continue;
            };
            rule.on_received();
            if self.retiring.get(f.rule).copied().unwrap_or(false) {
                retiring.push(rule.name.as_str());
            } else {
                kept = true;
            }
            match out.iter_mut().find(|o| Arc::ptr_eq(&o.target, target)) {
                Some(routed) => routed.matched.insert(f.position),
                None => {
                    let mut matched = RuleSet::default();
                    matched.insert(f.position);
                    out.push(Routed {
                        target: Arc::clone(target),
                        matched,
                    });
                }
            }
        }
        // Only what no kept rule takes shows that a retiring rule's old filters still deliver.
        if kept {
            retiring.clear();
        }
        retiring
    }
}

/// What a filter matches as: a shared filter (`$share/<group>/<filter>`) as its `<filter>`.
fn matched_as(filter: &TopicFilter) -> &str {
    let text = filter.as_str();
    match filter.share_group() {
        Some(group) => text
            .get("$share/".len() + group.len() + 1..)
            .unwrap_or(text),
        None => text,
    }
}

/// The target of `rule` (the first of its `key`), which the rules of the same key share.
fn target(
    rule: &Rule,
    parsed: &RuleTopics,
    key: &TargetKey<'_>,
    stats: &Arc<RuleStats>,
    filter: Option<Expression>,
    value: Option<Arc<SchemaSlot>>,
) -> Target {
    let static_topic = match &parsed.kafka_topic {
        KafkaTopic::Template(t) => t.as_static().map(Arc::from),
        KafkaTopic::Expression(_) => None,
    };
    Target {
        topic: parsed.kafka_topic.clone(),
        key: rule.kafka.key.clone(),
        payload: rule.payload.clone(),
        headers: rule.kafka.headers.clone(),
        header_plan: HeaderPlan::new(&rule.kafka.headers),
        static_topic,
        dead_letter: key.dead_letter.clone(),
        on_unwritable: key.on_unwritable,
        max_message_bytes: key.max_message_bytes as usize,
        stall_budget: key.stall_budget,
        rules: vec![Arc::clone(stats)],
        filters: vec![filter],
        evaluates: false,
        json_reads: None,
        value,
        expressions: RuleExpressions {
            filter: None,
            ..parsed.expressions.clone()
        },
    }
}

/// A target's header settings, with the metadata header names built once rather than for
/// every message.
#[derive(Debug)]
pub struct HeaderPlan {
    /// `<prefix>topic`, `<prefix>qos`, `<prefix>retain`, `<prefix>content_type`.
    metadata: Option<[String; 4]>,
    user_properties: bool,
}

impl HeaderPlan {
    pub fn new(h: &Headers) -> Self {
        Self {
            metadata: h.metadata.then(|| {
                ["topic", "qos", "retain", "content_type"].map(|n| format!("{}{n}", h.prefix))
            }),
            user_properties: h.user_properties,
        }
    }

    /// Appends the headers of a message's record to `out`, in order.
    pub fn add<'m>(&'m self, m: &'m Message, out: &mut Vec<(&'m str, &'m [u8])>) {
        if let Some([topic, qos, retain, content_type]) = &self.metadata {
            const QOS: [&[u8]; 3] = [b"0", b"1", b"2"];
            let retain_value: &[u8] = if m.retain { b"true" } else { b"false" };
            out.push((topic, m.topic.as_bytes()));
            out.push((qos, QOS[usize::from(m.qos.min(2))]));
            out.push((retain, retain_value));
            if let Some(ct) = &m.content_type {
                out.push((content_type, ct.as_bytes()));
            }
        }
        if self.user_properties {
            for (k, v) in &m.user_properties {
                out.push((k, v.as_bytes()));
            }
        }
    }
}

pub fn header<'a>(key: &'a str, value: &'a [u8]) -> Header<'a, &'a [u8]> {
    Header {
        key,
        value: Some(value),
    }
}

/// The record key for a message under a key strategy; `None` for an expression too (the
/// pipeline evaluates it).
pub fn record_key<'t>(strategy: &KeyStrategy, mqtt_topic: &'t str) -> Option<&'t str> {
    match strategy {
        KeyStrategy::MqttTopic => Some(mqtt_topic),
        KeyStrategy::None | KeyStrategy::Expression(_) => None,
        KeyStrategy::TopicLevel(n) => mqtt_topic.split('/').nth(*n),
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
    use proptest::prelude::*;

    fn config(yaml: &str) -> ValidConfig {
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

    /// The names of the rules `out` reaches, sorted.
    fn rules_reached(out: &[Routed]) -> Vec<String> {
        let mut names: Vec<String> = out
            .iter()
            .flat_map(|o| o.target.matched_names_vec(&o.matched))
            .collect();
        names.sort();
        names
    }

    #[test]
    fn a_copy_per_subscription_reaches_each_rule_once() {
        let c = config(
            r#"
mqtt: { host: h, client_id: c, protocol: 5, shared_group: g }
kafka: { bootstrap_servers: "k:9092" }
rules:
  - name: wide
    mqtt: { topics: ["a/#"] }
    kafka: { topic: wide }
  - name: narrow
    mqtt: { topics: ["a/+/c"] }
    kafka: { topic: narrow }
  - name: both
    mqtt: { topics: ["a/+/c", "a/#"] }
    kafka: { topic: both }
"#,
        );
        let router = Router::new(&c, &Metrics::new());
        let id = |f: &str| mqtt::subscription_id(&format!("$share/g/{f}"));
        let mut out = Vec::new();
        let mut reached = |ids: &[u32]| {
            router.route("a/b/c", ids, &HashSet::new(), &mut out);
            rules_reached(&out)
        };
        // Mosquitto with MQTT 5: one copy per matching subscription, each with its identifier.
        let mut per_copy = [reached(&[id("a/#")]), reached(&[id("a/+/c")])].concat();
        per_copy.sort();
        assert_eq!(per_copy, ["both", "narrow", "wide"], "each rule once");
        // One copy for both subscriptions, identifiers unknown (a replaced config) or none
        // (MQTT 3.1.1): every matching rule.
        for ids in [&[id("a/#"), id("a/+/c")][..], &[7], &[]] {
            assert_eq!(reached(ids), ["both", "narrow", "wide"], "{ids:?}");
        }
        // A copy delivered for a filter that matches nothing else falls back to the topic.
        router.route("a/x", &[id("a/+/c")], &HashSet::new(), &mut out);
        assert_eq!(rules_reached(&out), ["both", "wide"]);
        // The broker refused `both`'s first filter: the copies for its second are its own.
        let refused: HashSet<u32> = [id("a/+/c")].into();
        router.route("a/b/c", &[id("a/#")], &refused, &mut out);
        assert_eq!(
            rules_reached(&out),
            ["both", "wide"],
            "a/# granted, a/+/c refused"
        );
    }

    fn indices(router: &Router, out: &[Routed]) -> Vec<usize> {
        out.iter()
            .map(|o| {
                router
                    .targets()
                    .iter()
                    .position(|r| Arc::ptr_eq(r, &o.target))
                    .unwrap()
            })
            .collect()
    }

    #[test]
    fn a_message_reaches_each_distinct_target_once() {
        let metrics = Metrics::new();
        let router = Router::new(&config(TWO_RULES_SAME_TARGET), &metrics);
        assert_eq!(router.targets().len(), 2);
        let mut out = Vec::new();
        router.route("plant/1/temp", &[], &HashSet::new(), &mut out);
        assert_eq!(indices(&router, &out), vec![0, 1]);
        let names: Vec<&str> = router.targets()[0]
            .rules
            .iter()
            .map(|r| r.name.as_str())
            .collect();
        assert_eq!(names.join(","), "all,temps");
        assert_eq!(
            out[0].matched,
            RuleSet(SmallVec::from_slice(&[0, 1])),
            "both rules of the shared target"
        );
        router.route("plant/1/pressure", &[], &HashSet::new(), &mut out);
        assert_eq!(indices(&router, &out), vec![0]);
        let matched: Vec<&str> = out[0]
            .target
            .matched(&out[0].matched)
            .map(|r| r.name.as_str())
            .collect();
        assert_eq!(matched, ["all"], "only the rule that matched is credited");
        router.route("other/1/temp", &[], &HashSet::new(), &mut out);
        assert!(out.is_empty());
        let received: Vec<u64> = metrics.status().rules.iter().map(|r| r.received).collect();
        assert_eq!(received, vec![2, 1, 1], "per rule, once per message");
    }

    #[test]
    fn a_target_of_many_rules_knows_exactly_which_matched() {
        let mut yaml = String::from(
            "mqtt: { host: h, client_id: c }\nkafka: { bootstrap_servers: \"k:9092\" }\nrules:\n",
        );
        for i in 0..130 {
            yaml += &format!(
                "  - name: r{i}\n    mqtt: {{ topics: [\"t/{i}\"] }}\n    kafka: {{ topic: shared }}\n"
            );
        }
        let metrics = Metrics::new();
        let router = Router::new(&config(&yaml), &metrics);
        assert_eq!(router.targets().len(), 1);
        let mut out = Vec::new();
        for i in [0, 63, 64, 65, 129] {
            router.route(&format!("t/{i}"), &[], &HashSet::new(), &mut out);
            let names: Vec<&str> = out[0]
                .target
                .matched(&out[0].matched)
                .map(|r| r.name.as_str())
                .collect();
            assert_eq!(names, [format!("r{i}")], "only rule {i}");
        }
        let mut set = RuleSet::default();
        for p in [100, 5, 9000, 5, 64] {
            set.insert(p);
        }
        assert_eq!(set.iter().collect::<Vec<_>>(), [5, 64, 100, 9000]);
        assert!(set.contains(100) && !set.contains(36) && !set.is_empty());
        for p in [100, 5, 9000, 64] {
            set.remove(p);
        }
        assert!(set.is_empty());
    }

    /// The matcher the subscription tree replaced, kept as the tree's oracle: every filter of
    /// every rule tried against every message, and targets found by comparing each rule with
    /// every target built before it. What a message on `topic` reaches: per target (its index
    /// in build order), the names of the rules it matched.
    fn scanned(
        config: &ValidConfig,
        topic: &str,
        delivered_for: &[u32],
    ) -> Vec<(usize, Vec<String>)> {
        type Key = (
            KafkaTopic,
            KeyStrategy,
            PayloadFormat,
            Headers,
            Option<String>,
            OnUnwritable,
        );
        let mut targets: Vec<Key> = Vec::new();
        let mut filters = Vec::new();
        for (i, (rule, parsed)) in config.rules_with_topics().enumerate() {
            let key = (
                parsed.kafka_topic.clone(),
                rule.kafka.key.clone(),
                rule.payload.clone(),
                rule.kafka.headers.clone(),
                config.dead_letter_of(rule).map(|d| d.topic.clone()),
                rule.on_unwritable,
            );
            let t = targets.iter().position(|k| *k == key).unwrap_or_else(|| {
                targets.push(key);
                targets.len() - 1
            });
            for f in &parsed.filters {
                let id = mqtt::subscription_id(&config.subscribed_as(f.as_str()));
                filters.push((f, t, i, id));
            }
        }
        let known = !delivered_for.is_empty()
            && filters
                .iter()
                .any(|(f, _, _, id)| delivered_for.contains(id) && f.matches(topic));
        let mut out: Vec<(usize, Vec<String>)> = Vec::new();
        let mut last_rule = usize::MAX;
        for (f, t, rule, id) in &filters {
            if *rule == last_rule || !f.matches(topic) {
                continue;
            }
            last_rule = *rule;
            if known && !delivered_for.contains(id) {
                continue;
            }
            let name = config.rules[*rule].name.clone();
            match out.iter_mut().find(|(target, _)| target == t) {
                Some((_, names)) => names.push(name),
                None => out.push((*t, vec![name])),
            }
        }
        out
    }

    /// A random group: rules of one to three filters (some shared, some `$`), writing to one
    /// of two topics, some wrapped.
    fn random_config() -> impl Strategy<Value = String> {
        let level = prop::sample::select(vec!["a", "b", "", "$a", "+", "#"]);
        let filter = (prop::collection::vec(level, 1..4), any::<bool>()).prop_filter_map(
            "a valid filter",
            |(levels, shared)| {
                let inner = levels.join("/");
                TopicFilter::parse(&inner).ok()?;
                Some(if shared {
                    format!("$share/s/{inner}")
                } else {
                    inner
                })
            },
        );
        let rule = (prop::collection::vec(filter, 1..4), 0..2u8, any::<bool>());
        (prop::collection::vec(rule, 1..12), any::<bool>()).prop_map(|(rules, group)| {
            let group = if group { ", shared_group: g" } else { "" };
            let mut yaml = format!(
                "mqtt: {{ host: h, client_id: c, protocol: 5{group} }}\nkafka: {{ bootstrap_servers: \"k:9092\" }}\nrules:\n"
            );
            for (i, (filters, topic, wrapped)) in rules.iter().enumerate() {
                let topics = serde_json::to_string(filters).unwrap_or_default();
                let payload = if *wrapped { ", payload: wrapped_json" } else { "" };
                yaml += &format!(
                    "  - {{ name: r{i}, mqtt: {{ topics: {topics} }}, kafka: {{ topic: k{topic} }}{payload} }}\n"
                );
            }
            yaml
        })
    }

    proptest::proptest! {
        /// The router reaches the same targets, in the same order, for the same rules, as the
        /// scan it replaced: whatever the filters, the topic and the subscriptions a copy was
        /// delivered for.
        #[test]
        fn the_tree_routes_as_the_scan_did(
            yaml in random_config(),
            topics in prop::collection::vec(
                prop::collection::vec(prop::sample::select(vec!["a", "b", "", "$a"]), 1..5),
                1..8,
            ),
            delivered in prop::collection::vec(0..40usize, 0..3),
        ) {
            let config = config(&yaml);
            let router = Router::new(&config, &Metrics::new());
            // Identifiers of some of the group's subscriptions (and of none, past them).
            let subscribed: Vec<u32> = config
                .subscriptions()
                .iter()
                .map(|(f, _)| mqtt::subscription_id(f))
                .collect();
            let delivered_for: Vec<u32> = delivered
                .iter()
                .map(|i| subscribed.get(*i).copied().unwrap_or(7))
                .collect();
            let mut out = Vec::new();
            for levels in &topics {
                let topic = levels.join("/");
                router.route(&topic, &delivered_for, &HashSet::new(), &mut out);
                let routed: Vec<(usize, Vec<String>)> = out
                    .iter()
                    .map(|o| (indices(&router, std::slice::from_ref(o))[0], o.target.matched_names_vec(&o.matched)))
                    .collect();
                proptest::prop_assert_eq!(
                    routed,
                    scanned(&config, &topic, &delivered_for),
                    "topic {:?}, delivered for {:?}",
                    topic,
                    delivered_for
                );
            }
        }
    }

    #[test]
    fn headers_carry_metadata_and_user_properties() {
        let m = Message {
            epoch: 1,
            topic: "plant/1/temp".into(),
            payload: bytes::Bytes::from_static(b"x"),
            qos: 1,
            pkid: 7,
            retain: true,
            dup: false,
            content_type: Some("application/json".into()),
            user_properties: vec![("trace".into(), "abc".into())],
            subscription_ids: Vec::new(),
            size: 0,
            unread: None,
        };
        let pairs = |plan: &HeaderPlan| {
            let mut out = Vec::new();
            plan.add(&m, &mut out);
            out.into_iter()
                .map(|(k, v)| (k.to_owned(), String::from_utf8_lossy(v).into_owned()))
                .collect::<Vec<_>>()
        };
        let off = Headers::default();
        assert!(pairs(&HeaderPlan::new(&off)).is_empty());
        let all = Headers {
            metadata: true,
            user_properties: true,
            prefix: "mqtt.".into(),
            expressions: Default::default(),
        };
        let got = pairs(&HeaderPlan::new(&all));
        let want: Vec<(String, String)> = [
            ("mqtt.topic", "plant/1/temp"),
            ("mqtt.qos", "1"),
            ("mqtt.retain", "true"),
            ("mqtt.content_type", "application/json"),
            ("trace", "abc"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn keys() {
        assert_eq!(record_key(&KeyStrategy::MqttTopic, "a/b/c"), Some("a/b/c"));
        assert_eq!(record_key(&KeyStrategy::None, "a/b/c"), None);
        assert_eq!(record_key(&KeyStrategy::TopicLevel(1), "a/b/c"), Some("b"));
        assert_eq!(record_key(&KeyStrategy::TopicLevel(5), "a/b/c"), None);
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
