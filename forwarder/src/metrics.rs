//! Prometheus metrics, the per-rule counters behind `/status`, and the health flags behind
//! `/readyz`. Labels are rule names and a small fixed set of failure reasons, never raw MQTT
//! topics (bounded cardinality). Label values are lower-case snake_case, as documented in
//! docs/metrics.md: alerts are written from there.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ferry_api::status::{
    BlockedBy, ConfigStatus, DrainStatus, ForwarderStatus, Held, KafkaStatus, LastError,
    MqttStatus, RuleStatus, SchemaInUse, SubscriptionRefused, Waiting,
};
use jiff::Timestamp;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::handover::Handover;
use crate::window::{BlockReason, PermanentReason};

/// The window `rate_per_second` is computed over.
const RATE_WINDOW: Duration = Duration::from_secs(60);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RuleLabel {
    rule: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QosLabel {
    qos: u8,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FailureLabel {
    rule: String,
    /// [`PermanentReason::as_str`], not the variant's name.
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReloadLabel {
    /// `applied` or `rejected`.
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReplacementLabel {
    /// `created` or `failed`.
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RetryLabel {
    rule: String,
    reason: &'static str,
}

#[derive(Clone, Default)]
struct RuleFamilies {
    received: Family<RuleLabel, Counter>,
    forwarded: Family<RuleLabel, Counter>,
    acked: Family<RuleLabel, Counter>,
    dead_lettered: Family<RuleLabel, Counter>,
    filtered: Family<RuleLabel, Counter>,
    failed: Family<FailureLabel, Counter>,
    retries: Family<RetryLabel, Counter>,
    held: Family<FailureLabel, Gauge>,
    blocked: Family<RuleLabel, Gauge>,
    last_forwarded: Family<RuleLabel, Gauge>,
}

/// One rule's counters, resolved once so the data path never hashes label sets. Kept across
/// reloads while the rule keeps its name.
pub struct RuleStats {
    pub name: String,
    received: Counter,
    forwarded: Counter,
    acked: Counter,
    dead_lettered: Counter,
    filtered: Counter,
    failed_family: Family<FailureLabel, Counter>,
    retries_family: Family<RetryLabel, Counter>,
    held_family: Family<FailureLabel, Gauge>,
    blocked_messages: Gauge,
    /// Unix seconds of the last record confirmed, for a "no data for N minutes" alert; the
    /// series is created with the first (a 0 would read as "not since 1970").
    last_forwarded: std::sync::OnceLock<Gauge>,
    last_forwarded_family: Family<RuleLabel, Gauge>,
    failed: AtomicU64,
    held: Mutex<Option<Held>>,
    blocked_by: Mutex<Option<BlockedBy>>,
    waiting: Mutex<Option<Waiting>>,
    waiting_set: AtomicBool,
    /// Unix milliseconds; 0 = never.
    last_forwarded_ms: AtomicI64,
    last_error: Mutex<Option<LastError>>,
    /// Its filters, as subscribed.
    subscribed: Mutex<Vec<String>>,
    /// The schema its values are encoded with, once found.
    schema: Mutex<Option<SchemaInUse>>,
    /// (when, forwarded count) samples for the rate, oldest first.
    samples: Mutex<VecDeque<(Instant, u64)>>,
}

impl RuleStats {
    pub fn on_received(&self) {
        self.received.inc();
    }
    pub fn on_forwarded(&self) {
        self.forwarded.inc();
        self.clear_waiting();
        let now = Timestamp::now();
        self.last_forwarded_ms
            .store(now.as_millisecond(), Ordering::Relaxed);
        self.last_forwarded
            .get_or_init(|| {
                let label = RuleLabel {
                    rule: self.name.clone(),
                };
                self.last_forwarded_family.get_or_create(&label).clone()
            })
            .set(now.as_second());
    }
    pub fn on_acked(&self) {
        self.acked.inc();
    }
    pub fn on_filtered(&self) {
        self.filtered.inc();
    }
    pub fn on_dead_lettered(&self, error: String) {
        self.dead_lettered.inc();
        self.clear_waiting();
        self.set_error(error);
    }

    /// A record of this rule failed and waits for a retry (`reason` from the window).
    pub fn on_retry(&self, reason: &'static str, message: String) {
        self.retries_family
            .get_or_create(&RetryLabel {
                rule: self.name.clone(),
                reason,
            })
            .inc();
        self.set_waiting(reason, message);
    }

    /// Records of this rule wait; keeps the first `since` while the reason stays the same.
    pub fn set_waiting(&self, reason: &'static str, message: String) {
        let message = ferry_api::status::bounded_text(message);
        self.waiting_set.store(true, Ordering::Relaxed);
        let mut w = lock(&self.waiting);
        match w.as_mut() {
            Some(w) if w.reason == reason => w.message = message.clone(),
            _ => {
                *w = Some(Waiting {
                    reason: reason.to_owned(),
                    message: message.clone(),
                    since: Timestamp::now(),
                })
            }
        }
        drop(w);
        self.set_error(message);
    }

    /// Why its records wait now, if they do.
    pub fn waiting_reason(&self) -> Option<String> {
        if !self.waiting_set.load(Ordering::Relaxed) {
            return None;
        }
        lock(&self.waiting).as_ref().map(|w| w.reason.clone())
    }

    /// What held a record for `reason` let it go (dropped, or its rules removed): the rule
    /// no longer waits for it. A wait for another reason stays.
    pub fn stop_waiting_for(&self, reason: &str) {
        if self.waiting_set.load(Ordering::Relaxed) {
            let mut w = lock(&self.waiting);
            if w.as_ref().is_some_and(|w| w.reason == reason) {
                *w = None;
                self.waiting_set.store(false, Ordering::Relaxed);
            }
        }
    }

    fn clear_waiting(&self) {
        // Cheap check first: this runs for every forwarded record.
        if self.waiting_set.load(Ordering::Relaxed) {
            *lock(&self.waiting) = None;
            self.waiting_set.store(false, Ordering::Relaxed);
        }
    }
    pub fn on_failed(&self, reason: PermanentReason, error: String) {
        self.failed_family
            .get_or_create(&FailureLabel {
                rule: self.name.clone(),
                reason: reason.as_str(),
            })
            .inc();
        self.failed.fetch_add(1, Ordering::Relaxed);
        self.set_error(error);
    }
    pub fn set_error(&self, message: String) {
        *lock(&self.last_error) = Some(LastError {
            message: ferry_api::status::bounded_text(message),
            at: Timestamp::now(),
        });
    }

    /// What this rule holds now (`records` per reason, the first record's details), as the
    /// pipeline found it in the window; keeps `since` while the same record is held.
    pub fn set_held(&self, held: Option<Held>, per_reason: &[u64; PermanentReason::ALL.len()]) {
        for (reason, count) in PermanentReason::ALL.iter().zip(per_reason) {
            let label = FailureLabel {
                rule: self.name.clone(),
                reason: reason.as_str(),
            };
            if *count > 0 {
                self.held_family
                    .get_or_create(&label)
                    .set(i64::try_from(*count).unwrap_or(i64::MAX));
            } else {
                self.held_family.remove(&label);
            }
        }
        let mut current = lock(&self.held);
        *current = held.map(|mut h| {
            h.error = ferry_api::status::bounded_text(std::mem::take(&mut h.error));
            if let Some(c) = current.as_ref()
                && (
                    c.reason.as_str(),
                    c.mqtt_topic.as_str(),
                    c.size,
                    c.dead_letter,
                ) == (
                    h.reason.as_str(),
                    h.mqtt_topic.as_str(),
                    h.size,
                    h.dead_letter,
                )
            {
                h.since = c.since;
            }
            h
        });
    }

    /// Which rules' held record this rule's messages wait behind now; keeps `since` while the
    /// same rules hold it.
    pub fn set_blocked_by(&self, blocked: Option<BlockedBy>) {
        let messages = blocked.as_ref().map_or(0, |b| b.messages);
        self.blocked_messages
            .set(i64::try_from(messages).unwrap_or(i64::MAX));
        let mut current = lock(&self.blocked_by);
        *current = blocked.map(|mut b| {
            if let Some(c) = current.as_ref()
                && c.rules == b.rules
                && c.waiting == b.waiting
            {
                b.since = c.since;
            }
            b
        });
    }

    pub fn is_held_or_blocked(&self) -> bool {
        lock(&self.held).is_some() || lock(&self.blocked_by).is_some()
    }

    fn sample(&self, now: Instant) {
        let mut s = lock(&self.samples);
        s.push_back((now, self.forwarded.get()));
        while s
            .front()
            .is_some_and(|(at, _)| now.duration_since(*at) > RATE_WINDOW + Duration::from_secs(5))
        {
            s.pop_front();
        }
    }

    fn rate(&self) -> f64 {
        let s = lock(&self.samples);
        let now = (Instant::now(), self.forwarded.get());
        match s.front() {
            Some(&(at, count)) if now.0 > at => {
                (now.1 - count.min(now.1)) as f64 / now.0.duration_since(at).as_secs_f64()
            }
            _ => 0.0,
        }
    }

    /// What the broker refused of this rule's filters (`refused`: every refused filter).
    fn refused(
        &self,
        refused: &BTreeMap<String, (&'static str, Timestamp)>,
    ) -> Option<SubscriptionRefused> {
        let mine: Vec<(&String, &(&'static str, Timestamp))> = lock(&self.subscribed)
            .iter()
            .filter_map(|f| refused.get_key_value(f))
            .collect();
        let (_, (reason, _)) = mine.first()?;
        let mut filters: Vec<String> = mine.iter().map(|(f, _)| (*f).clone()).collect();
        filters.sort_unstable();
        filters.dedup();
        Some(SubscriptionRefused {
            filters,
            reason: (*reason).to_owned(),
            since: mine.iter().map(|(_, (_, since))| *since).min()?,
        })
    }

    /// What this rule's filters are subscribed as (`$share/<group>/...` with a shared group).
    pub fn set_subscribed(&self, filters: Vec<String>) {
        *lock(&self.subscribed) = filters;
    }

    pub fn set_schema(&self, schema: Option<SchemaInUse>) {
        *lock(&self.schema) = schema;
    }

    /// Every filter of this rule, as subscribed, is in `granted` (the broker's SUBACKs on the
    /// current connection; `None` while there is none, or while the forwarder drains).
    fn subscribed(&self, granted: Option<&HashSet<String>>) -> bool {
        let Some(granted) = granted else {
            return false;
        };
        let filters = lock(&self.subscribed);
        !filters.is_empty() && filters.iter().all(|f| granted.contains(f))
    }

    /// `handed_over`: what [`Handover::handed_over`] says of it (None: not retiring).
    fn status(
        &self,
        refused: &BTreeMap<String, (&'static str, Timestamp)>,
        granted: Option<&HashSet<String>>,
        handed_over: Option<bool>,
    ) -> RuleStatus {
        let ms = self.last_forwarded_ms.load(Ordering::Relaxed);
        RuleStatus {
            name: self.name.clone(),
            received: self.received.get(),
            forwarded: self.forwarded.get(),
            acked: self.acked.get(),
            dead_lettered: self.dead_lettered.get(),
            filtered: self.filtered.get(),
            failed: self.failed.load(Ordering::Relaxed),
            rate_per_second: (self.rate() * 100.0).round() / 100.0,
            last_forwarded_at: (ms != 0)
                .then(|| Timestamp::from_millisecond(ms).ok())
                .flatten(),
            last_error: lock(&self.last_error).clone(),
            waiting: lock(&self.waiting).clone(),
            held: lock(&self.held).clone(),
            blocked_by: lock(&self.blocked_by).clone(),
            subscription_refused: self.refused(refused),
            schema: lock(&self.schema).clone(),
            // A retiring rule is unsubscribed, whatever the broker granted before.
            subscribed: handed_over.is_none() && self.subscribed(granted),
            retiring: handed_over.map(|drained| DrainStatus { drained }),
        }
    }
}

impl std::fmt::Debug for RuleStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name)
    }
}

/// A poisoned lock only means another thread panicked mid-update of plain counters; the data is
/// still the best we have.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

pub struct Metrics {
    registry: Registry,
    families: RuleFamilies,
    rules: Mutex<Vec<Arc<RuleStats>>>,
    /// Received PUBLISHes by QoS (index 0, 1, 2).
    pub received: [Counter; 3],
    pub unmatched: Counter,
    /// Messages over `mqtt.max_message_bytes`, whose payload was skipped unread.
    pub unread: Counter,
    /// PUBLISH packets the broker flagged DUP: sent again, on a new connection, because it had
    /// not seen them acknowledged. They are what an at-least-once replay consists of.
    pub redelivered: Counter,
    pub acked: Counter,
    pub produce_retries: Counter,
    pub inflight: Gauge,
    pub mqtt_connected: Gauge,
    pub kafka_reachable: Gauge,
    /// From handing a record to librdkafka to its delivery report.
    pub produce_latency: Histogram,
    /// From reading a message off MQTT to queueing its ack.
    pub ack_latency: Histogram,
    reloads: Family<ReloadLabel, Counter>,
    /// librdkafka's fatal errors: each makes the forwarder replace its producer.
    pub producer_fatal_errors: Counter,
    producer_replacements: Family<ReplacementLabel, Counter>,
    config_generation: Gauge,
    pub health: Health,
    started_at: Timestamp,
    mqtt_last_error: Mutex<Option<LastError>>,
    /// Subscribed filters the broker refused: (its reason, since when).
    mqtt_refused: Mutex<BTreeMap<String, (&'static str, Timestamp)>>,
    /// Counts changes of `mqtt_refused`'s filters.
    refused_generation: AtomicU64,
    /// The filters (as subscribed) the broker granted on the current connection: what the MQTT
    /// driver keeps, reported here.
    mqtt_granted: Mutex<HashSet<String>>,
    kafka_last_error: Mutex<Option<LastError>>,
    config: Mutex<ConfigStatus>,
    /// The hand-over's verdicts (draining, retiring rules), fed by the MQTT driver and the
    /// pipeline; `/status` reports them.
    handover: Mutex<Handover>,
    /// The filters go through `$share/<group>/`.
    subscribed_shared: AtomicBool,
}

/// What `/readyz` answers from.
#[derive(Clone, Default)]
pub struct Health {
    mqtt_connected: Arc<AtomicBool>,
    /// The broker acknowledged our subscriptions on the current connection.
    mqtt_subscribed: Arc<AtomicBool>,
    kafka_reachable: Arc<AtomicBool>,
    /// Both brokers have answered at least once since the process started.
    started: Arc<AtomicBool>,
}

impl Health {
    /// Ready once this process has been subscribed to MQTT and reached Kafka, each at least
    /// once, and from then on. A forwarder serves no traffic, so readiness only gates rollouts
    /// (a pod whose config cannot reach its brokers never becomes Ready and halts the rollout)
    /// and disruption budgets. A later broker outage hits every pod at once: turning them all
    /// NotReady would block node drains and rollouts while telling nobody more than `/status`
    /// (and the rules' `Ready` condition) already say.
    pub fn ready(&self) -> bool {
        self.started.load(Ordering::Relaxed)
    }
    fn note_progress(&self) {
        if self.mqtt_subscribed() && self.kafka_reachable() {
            self.started.store(true, Ordering::Relaxed);
        }
    }
    pub fn mqtt_subscribed(&self) -> bool {
        self.mqtt_subscribed.load(Ordering::Relaxed)
    }
    pub fn mqtt_connected(&self) -> bool {
        self.mqtt_connected.load(Ordering::Relaxed)
    }
    pub fn kafka_reachable(&self) -> bool {
        self.kafka_reachable.load(Ordering::Relaxed)
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let received_family = Family::<QosLabel, Counter>::default();
        let received =
            [0u8, 1, 2].map(|qos| received_family.get_or_create(&QosLabel { qos }).clone());
        let mut m = Self {
            families: RuleFamilies::default(),
            rules: Mutex::new(Vec::new()),
            received,
            unmatched: Counter::default(),
            unread: Counter::default(),
            redelivered: Counter::default(),
            acked: Counter::default(),
            produce_retries: Counter::default(),
            inflight: Gauge::default(),
            mqtt_connected: Gauge::default(),
            kafka_reachable: Gauge::default(),
            produce_latency: Histogram::new(exponential_buckets(0.0005, 2.0, 16)),
            ack_latency: Histogram::new(exponential_buckets(0.0005, 2.0, 16)),
            reloads: Family::default(),
            producer_fatal_errors: Counter::default(),
            producer_replacements: Family::default(),
            config_generation: Gauge::default(),
            health: Health::default(),
            started_at: Timestamp::now(),
            mqtt_last_error: Mutex::new(None),
            mqtt_refused: Mutex::new(BTreeMap::new()),
            refused_generation: AtomicU64::new(0),
            mqtt_granted: Mutex::new(HashSet::new()),
            kafka_last_error: Mutex::new(None),
            config: Mutex::new(ConfigStatus {
                generation: 1,
                applied_at: Timestamp::now(),
                reload_error: None,
                restart_required: Vec::new(),
                digest: None,
            }),
            handover: Mutex::new(Handover::default()),
            subscribed_shared: AtomicBool::new(false),
            registry: Registry::default(),
        };
        m.register(received_family);
        m.config_generation.set(1);
        m
    }

    /// Everything `/metrics` serves: `process_*` and `ferry_forwarder_build_info` under their
    /// conventional names, the forwarder's own metrics under `ferry_`.
    fn register(&mut self, received_family: Family<QosLabel, Counter>) {
        ferry_api::metrics::register(
            &mut self.registry,
            "ferry_forwarder",
            env!("CARGO_PKG_VERSION"),
        );
        // Per rule.
        let r = self.registry.sub_registry_with_prefix("ferry");
        r.register(
            "rule_received_messages",
            "Messages that matched a rule",
            self.families.received.clone(),
        );
        r.register(
            "rule_forwarded_messages",
            "Records of a rule confirmed by Kafka",
            self.families.forwarded.clone(),
        );
        r.register(
            "rule_acked_messages",
            "Messages of a rule acknowledged to MQTT, whatever became of them (forwarded, dead-lettered, filtered or dropped)",
            self.families.acked.clone(),
        );
        r.register(
            "rule_dead_lettered_messages",
            "Messages of a rule Kafka could never take, written to the dead-letter topic",
            self.families.dead_lettered.clone(),
        );
        r.register(
            "rule_filtered_messages",
            "Messages of a rule its filter expression was false for, acknowledged without forwarding",
            self.families.filtered.clone(),
        );
        r.register(
            "rule_failed_messages",
            "Messages of a rule Kafka can never take and no dead-letter topic took, acknowledged unwritten because the rule says on_unwritable: drop",
            self.families.failed.clone(),
        );
        r.register(
            "rule_held_records",
            "Records of a rule held now by on_unwritable: hold (Kafka can never take them and no dead-letter topic did), by reason; every later message of the forwarder waits behind the first",
            self.families.held.clone(),
        );
        r.register(
            "rule_blocked_messages",
            "Messages of a rule waiting now behind a record another rule holds",
            self.families.blocked.clone(),
        );
        r.register(
            "rule_last_forwarded_timestamp_seconds",
            "Unix time of the last record of a rule confirmed by Kafka (absent until one is)",
            self.families.last_forwarded.clone(),
        );
        r.register(
            "rule_produce_retries",
            "Records of a rule that failed and wait to be produced again, by reason (unauthorized, unknown_topic, queue_full, unavailable, schema_unavailable, or a permanent reason such as too_large or schema_mismatch held by on_unwritable: hold)",
            self.families.retries.clone(),
        );
        self.register_process_wide(received_family);
    }

    /// The metrics of the whole process (not per rule), under `ferry_`.
    fn register_process_wide(&mut self, received_family: Family<QosLabel, Counter>) {
        let r = self.registry.sub_registry_with_prefix("ferry");
        r.register(
            "mqtt_received_messages",
            "PUBLISH packets received from MQTT, by QoS",
            received_family,
        );
        r.register(
            "mqtt_unmatched_messages",
            "Messages that matched no rule, or (MQTT 5) copies delivered for a subscription whose rules took the message through another",
            self.unmatched.clone(),
        );
        r.register(
            "mqtt_unread_messages",
            "Messages over mqtt.max_message_bytes: their payload was skipped on the wire, never held, and they failed on each rule they matched",
            self.unread.clone(),
        );
        r.register(
            "mqtt_redelivered_messages",
            "PUBLISH packets the broker sent again (DUP): it had not seen them acknowledged before a reconnect",
            self.redelivered.clone(),
        );
        r.register(
            "mqtt_acked_messages",
            "Messages acknowledged to MQTT",
            self.acked.clone(),
        );
        r.register(
            "kafka_produce_retries",
            "Records produced again after a retriable error",
            self.produce_retries.clone(),
        );
        r.register(
            "inflight_messages",
            "Messages received and not yet acknowledged",
            self.inflight.clone(),
        );
        r.register(
            "mqtt_connected",
            "1 while the MQTT connection is up",
            self.mqtt_connected.clone(),
        );
        r.register(
            "kafka_reachable",
            "1 while Kafka answers metadata requests",
            self.kafka_reachable.clone(),
        );
        r.register(
            "kafka_produce_latency_seconds",
            "From handing a record to the Kafka producer to its delivery report",
            self.produce_latency.clone(),
        );
        r.register(
            "message_ack_latency_seconds",
            "From reading a message off MQTT to queueing its acknowledgement",
            self.ack_latency.clone(),
        );
        r.register(
            "kafka_producer_fatal_errors",
            "librdkafka fatal errors: the producer is unusable and is replaced",
            self.producer_fatal_errors.clone(),
        );
        r.register(
            "kafka_producer_replacements",
            "Attempts to create a new producer after a fatal error, by result",
            self.producer_replacements.clone(),
        );
        r.register(
            "config_reloads",
            "Config file changes, applied or rejected",
            self.reloads.clone(),
        );
        r.register(
            "config_generation",
            "1 for the config the forwarder started with, +1 per applied reload",
            self.config_generation.clone(),
        );
    }

    /// The stats of these rules, in this order: existing ones keep their counters, new ones
    /// start at zero, and rules no longer named stop being reported.
    pub fn set_rules(&self, names: &[String]) -> Vec<Arc<RuleStats>> {
        let mut current = lock(&self.rules);
        // By name, so that a reload of thousands of rules takes time linear in them.
        let by_name: HashMap<&str, &Arc<RuleStats>> =
            current.iter().map(|r| (r.name.as_str(), r)).collect();
        let next: Vec<Arc<RuleStats>> = names
            .iter()
            .map(|name| {
                by_name
                    .get(name.as_str())
                    .map(|r| Arc::clone(r))
                    .unwrap_or_else(|| Arc::new(self.new_rule(name)))
            })
            .collect();
        let named: HashSet<&str> = names.iter().map(String::as_str).collect();
        for gone in current.iter().filter(|r| !named.contains(r.name.as_str())) {
            let label = RuleLabel {
                rule: gone.name.clone(),
            };
            self.families.received.remove(&label);
            self.families.forwarded.remove(&label);
            self.families.acked.remove(&label);
            self.families.dead_lettered.remove(&label);
            self.families.filtered.remove(&label);
            self.families.blocked.remove(&label);
            self.families.last_forwarded.remove(&label);
            for reason in PermanentReason::ALL {
                let label = FailureLabel {
                    rule: gone.name.clone(),
                    reason: reason.as_str(),
                };
                self.families.failed.remove(&label);
                self.families.held.remove(&label);
            }
            // Every `reason` a retry is counted under.
            let reasons = BlockReason::ALL
                .map(BlockReason::as_str)
                .into_iter()
                .chain(PermanentReason::ALL.map(PermanentReason::as_str));
            for reason in reasons {
                self.families.retries.remove(&RetryLabel {
                    rule: gone.name.clone(),
                    reason,
                });
            }
        }
        current.clone_from(&next);
        next
    }

    fn new_rule(&self, name: &str) -> RuleStats {
        let label = RuleLabel {
            rule: name.to_owned(),
        };
        RuleStats {
            name: name.to_owned(),
            received: self.families.received.get_or_create(&label).clone(),
            forwarded: self.families.forwarded.get_or_create(&label).clone(),
            acked: self.families.acked.get_or_create(&label).clone(),
            dead_lettered: self.families.dead_lettered.get_or_create(&label).clone(),
            filtered: self.families.filtered.get_or_create(&label).clone(),
            failed_family: self.families.failed.clone(),
            retries_family: self.families.retries.clone(),
            held_family: self.families.held.clone(),
            blocked_messages: self.families.blocked.get_or_create(&label).clone(),
            last_forwarded: std::sync::OnceLock::new(),
            last_forwarded_family: self.families.last_forwarded.clone(),
            failed: AtomicU64::new(0),
            held: Mutex::new(None),
            blocked_by: Mutex::new(None),
            waiting: Mutex::new(None),
            waiting_set: AtomicBool::new(false),
            last_forwarded_ms: AtomicI64::new(0),
            last_error: Mutex::new(None),
            subscribed: Mutex::new(Vec::new()),
            schema: Mutex::new(None),
            samples: Mutex::new(VecDeque::new()),
        }
    }

    /// Takes a rate sample of every rule; call every few seconds.
    pub fn sample_rates(&self) {
        let now = Instant::now();
        for rule in lock(&self.rules).iter() {
            rule.sample(now);
        }
    }

    /// Whether the filters go through `$share/<group>/` (for `/status`).
    pub fn set_subscribed_shared(&self, shared: bool) {
        self.subscribed_shared.store(shared, Ordering::Relaxed);
    }

    /// A connection came up or went: either way nothing is granted on it yet.
    pub fn set_mqtt_connected(&self, up: bool) {
        lock(&self.mqtt_granted).clear();
        self.health.mqtt_connected.store(up, Ordering::Relaxed);
        if !up {
            self.health.mqtt_subscribed.store(false, Ordering::Relaxed);
        }
        self.mqtt_connected.set(i64::from(up));
    }

    /// The broker granted `filter` (as subscribed) on the current connection, or no longer
    /// does (refused, unsubscribed).
    pub fn set_mqtt_granted(&self, filter: &str, granted: bool) {
        let mut current = lock(&self.mqtt_granted);
        if granted {
            current.insert(filter.to_owned());
        } else {
            current.remove(filter);
        }
    }

    /// The broker's answers so far on this connection: subscribed while it granted at least
    /// one filter (a SUBACK refusing every filter leaves the forwarder unsubscribed, and not
    /// ready if it never was); `refused` fail their rules in `/status`.
    pub fn set_mqtt_subscriptions(
        &self,
        any_granted: bool,
        refused: &BTreeMap<String, &'static str>,
    ) {
        self.health
            .mqtt_subscribed
            .store(any_granted, Ordering::Relaxed);
        self.health.note_progress();
        self.set_mqtt_refused(refused);
    }

    /// Changes whenever the set of filters the broker refused does: one load tells the
    /// pipeline whether to read them again.
    pub fn refused_generation(&self) -> u64 {
        self.refused_generation.load(Ordering::Relaxed)
    }

    /// The filters the broker refused, with its reason.
    pub fn mqtt_refused(&self) -> BTreeMap<String, &'static str> {
        lock(&self.mqtt_refused)
            .iter()
            .map(|(filter, (reason, _))| (filter.clone(), *reason))
            .collect()
    }

    /// Filters the broker refused (as subscribed), with its reason; a filter refused before
    /// keeps its `since`.
    pub fn set_mqtt_refused(&self, refused: &BTreeMap<String, &'static str>) {
        let mut current = lock(&self.mqtt_refused);
        if !current.keys().eq(refused.keys()) {
            self.refused_generation.fetch_add(1, Ordering::Relaxed);
        }
        let now = Timestamp::now();
        *current = refused
            .iter()
            .map(|(filter, reason)| {
                let since = current.get(filter).map_or(now, |(_, since)| *since);
                (filter.clone(), (*reason, since))
            })
            .collect();
    }

    pub fn mqtt_error(&self, message: String) {
        *lock(&self.mqtt_last_error) = Some(LastError {
            message,
            at: Timestamp::now(),
        });
    }

    pub fn kafka_error(&self, message: String) {
        *lock(&self.kafka_last_error) = Some(LastError {
            message,
            at: Timestamp::now(),
        });
    }

    /// An attempt to create a new producer after a fatal error.
    pub fn producer_replaced(&self, created: bool) {
        let result = if created { "created" } else { "failed" };
        self.producer_replacements
            .get_or_create(&ReplacementLabel { result })
            .inc();
    }

    pub fn set_kafka_reachable(&self, up: bool) {
        self.health.kafka_reachable.store(up, Ordering::Relaxed);
        self.health.note_progress();
        self.kafka_reachable.set(i64::from(up));
    }

    /// The text of the config file running since start (see [`ConfigStatus::digest`]).
    pub fn config_started(&self, text: &str) {
        lock(&self.config).digest = Some(ferry_api::status::config_digest(text));
    }

    /// A new version of the config file (`text`) runs.
    pub fn config_applied(&self, restart_required: Vec<String>, text: &str) {
        let mut c = lock(&self.config);
        c.digest = Some(ferry_api::status::config_digest(text));
        c.generation += 1;
        c.applied_at = Timestamp::now();
        c.reload_error = None;
        c.restart_required = restart_required;
        self.config_generation.set(c.generation as i64);
        self.reloads
            .get_or_create(&ReloadLabel { result: "applied" })
            .inc();
    }

    pub fn config_rejected(&self, message: String) {
        lock(&self.config).reload_error = Some(LastError {
            message,
            at: Timestamp::now(),
        });
        self.reloads
            .get_or_create(&ReloadLabel { result: "rejected" })
            .inc();
    }

    pub fn status(&self) -> ForwarderStatus {
        ForwarderStatus {
            version: env!("CARGO_PKG_VERSION").to_owned(),
            started_at: self.started_at,
            config: lock(&self.config).clone(),
            mqtt: MqttStatus {
                connected: self.health.mqtt_connected(),
                subscribed: self.health.mqtt_subscribed(),
                shared: self.subscribed_shared.load(Ordering::Relaxed),
                last_error: lock(&self.mqtt_last_error).clone(),
            },
            kafka: KafkaStatus {
                reachable: self.health.kafka_reachable(),
                last_error: lock(&self.kafka_last_error).clone(),
            },
            inflight: self.inflight.get().max(0) as u64,
            rules: {
                let now = Instant::now();
                let refused = lock(&self.mqtt_refused);
                let handover = lock(&self.handover);
                let granted = lock(&self.mqtt_granted);
                // Draining, a forwarder subscribes nothing whatever its last SUBACKs said.
                let granted =
                    (self.health.mqtt_connected() && !handover.draining()).then_some(&*granted);
                lock(&self.rules)
                    .iter()
                    .map(|r| r.status(&refused, granted, handover.handed_over(&r.name, now)))
                    .collect()
            },
            drain: {
                let handover = lock(&self.handover);
                handover.draining().then(|| DrainStatus {
                    drained: handover.drained(Instant::now()),
                })
            },
        }
    }

    /// Draining, and the session holds nothing more (what `/status` reports as
    /// `drain.drained`).
    pub fn drained(&self) -> bool {
        lock(&self.handover).drained(Instant::now())
    }

    /// Tells the hand-over what happened, or asks it (see [`Handover`]); the MQTT driver and
    /// the pipeline call it, for each message among others.
    pub fn handover<T>(&self, f: impl FnOnce(&mut Handover) -> T) -> T {
        f(&mut lock(&self.handover))
    }

    /// Whether the MQTT driver takes messages (its window has room).
    pub fn mqtt_reading(&self) -> bool {
        lock(&self.handover).reading()
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn documented(metric: &str, label: &str) -> BTreeSet<String> {
        ferry_e2e::metrics::documented(include_str!("../../docs/metrics.md"), metric, label)
    }

    #[test]
    fn ready_once_both_brokers_answered_and_through_later_outages() {
        let m = Metrics::new();
        assert!(!m.health.ready(), "not ready before any broker answered");
        m.set_mqtt_connected(true);
        m.set_kafka_reachable(true);
        // A SUBACK refusing every filter: not subscribed, so never ready.
        let refused = BTreeMap::from([("secret/#".to_owned(), "not authorized (0x87)")]);
        m.set_mqtt_subscriptions(false, &refused);
        assert!(!m.health.mqtt_subscribed() && !m.health.ready());
        m.set_kafka_reachable(false);
        m.set_mqtt_subscriptions(true, &BTreeMap::new());
        assert!(!m.health.ready(), "Kafka has not answered yet");
        m.set_kafka_reachable(true);
        assert!(m.health.ready());
        m.set_kafka_reachable(false);
        m.set_mqtt_connected(false);
        assert!(
            m.health.ready(),
            "an outage after the start keeps the pod Ready"
        );
        assert!(!m.health.kafka_reachable() && !m.health.mqtt_subscribed());
    }

    #[test]
    fn refused_filters_fail_the_rules_that_subscribe_them() {
        let m = Metrics::new();
        let rules = m.set_rules(&["open".to_owned(), "secret".to_owned()]);
        rules[0].set_subscribed(vec!["open/#".to_owned()]);
        rules[1].set_subscribed(vec!["secret/b".to_owned(), "secret/a".to_owned()]);
        let refused = BTreeMap::from([
            ("secret/a".to_owned(), "not authorized (0x87)"),
            ("secret/b".to_owned(), "not authorized (0x87)"),
        ]);
        m.set_mqtt_subscriptions(true, &refused);
        let first = m.status();
        assert!(first.mqtt.subscribed, "another filter was granted");
        assert_eq!(first.rules[0].subscription_refused, None);
        let r = first.rules[1]
            .subscription_refused
            .clone()
            .expect("refused");
        assert_eq!(r.filters, ["secret/a", "secret/b"]);
        assert_eq!(r.reason, "not authorized (0x87)");
        // Refused again (a reconnect): the same since; granted later: cleared.
        std::thread::sleep(Duration::from_millis(5));
        m.set_mqtt_subscriptions(true, &refused);
        assert_eq!(m.status().rules[1].subscription_refused, Some(r));
        m.set_mqtt_subscriptions(true, &BTreeMap::new());
        assert_eq!(m.status().rules[1].subscription_refused, None);
    }

    /// A rule is subscribed while every filter of it is granted on the current connection,
    /// and never while it retires or the forwarder drains.
    #[test]
    fn a_rule_is_subscribed_while_each_of_its_filters_is_granted() {
        let m = Metrics::new();
        let rules = m.set_rules(&["both".to_owned(), "one".to_owned()]);
        rules[0].set_subscribed(vec!["a/#".to_owned(), "b/#".to_owned()]);
        rules[1].set_subscribed(vec!["a/#".to_owned()]);
        let subscribed =
            || -> Vec<bool> { m.status().rules.iter().map(|r| r.subscribed).collect() };
        m.set_mqtt_connected(true);
        assert_eq!(subscribed(), [false, false], "before any SUBACK");
        m.set_mqtt_granted("a/#", true);
        assert_eq!(subscribed(), [false, true], "b/# not granted yet");
        m.set_mqtt_granted("b/#", true);
        assert_eq!(subscribed(), [true, true]);
        m.handover(|h| h.set_retiring(["one"], Instant::now()));
        assert_eq!(subscribed(), [true, false], "retiring");
        m.handover(|h| h.set_retiring([], Instant::now()));
        m.handover(|h| h.set_draining(true));
        assert_eq!(subscribed(), [false, false], "draining");
        m.handover(|h| h.set_draining(false));
        m.set_mqtt_connected(false);
        m.set_mqtt_connected(true);
        assert_eq!(
            subscribed(),
            [false, false],
            "a new connection grants nothing yet"
        );
    }

    /// The operator reads `/status` up to `STATUS_MAX_BYTES`: a forwarder of the most rules,
    /// every one waiting, with its last error, blocked behind another's record and holding one
    /// of its own, with the longest names, topics and texts, still fits.
    #[test]
    fn the_status_of_the_most_rules_at_their_worst_fits_the_operators_read() {
        let m = Metrics::new();
        let names: Vec<String> = (0..ferry_api::config::MAX_RULES)
            .map(|i| format!("{i:05}-{}", "r".repeat(57)))
            .collect();
        let rules = m.set_rules(&names);
        let topic = "t".repeat(249);
        let error = format!(
            "kafka topic {topic}: {}",
            "Local: Broker transport failure. ".repeat(40)
        );
        for rule in &rules {
            rule.set_waiting("unavailable", error.clone());
            rule.set_error(error.clone());
            let held = Held {
                reason: "schema_mismatch".to_owned(),
                mqtt_topic: format!("{}…", "m".repeat(253)),
                size: u64::MAX,
                kafka_topic: Some(topic.clone()),
                dead_letter: true,
                error: error.clone(),
                records: u64::MAX,
                since: Timestamp::now(),
            };
            rule.set_held(Some(held), &[u64::MAX; PermanentReason::ALL.len()]);
            rule.set_blocked_by(Some(BlockedBy {
                rules: vec![names[0].clone()],
                messages: 1_000,
                since: Timestamp::now(),
                waiting: Some("unavailable".to_owned()),
            }));
        }
        let body = serde_json::to_vec(&m.status()).unwrap_or_default();
        eprintln!("{} bytes for {} rules", body.len(), names.len());
        assert!(
            body.len() <= ferry_api::status::STATUS_MAX_BYTES,
            "{} bytes for {} rules",
            body.len(),
            names.len()
        );
    }

    #[test]
    fn the_metrics_page_lists_every_reason_and_only_those() {
        let permanent: BTreeSet<String> =
            PermanentReason::ALL.map(|r| r.as_str().to_owned()).into();
        assert_eq!(
            documented("ferry_rule_failed_messages_total", "reason"),
            permanent
        );
        let retries: BTreeSet<String> = BlockReason::ALL
            .map(|r| r.as_str().to_owned())
            .into_iter()
            .chain(permanent)
            .collect();
        assert_eq!(
            documented("ferry_rule_produce_retries_total", "reason"),
            retries
        );
        assert_eq!(
            documented("ferry_rule_held_records", "reason"),
            PermanentReason::ALL.map(|r| r.as_str().to_owned()).into()
        );
        assert_eq!(
            documented("ferry_config_reloads_total", "result"),
            BTreeSet::from(["applied".to_owned(), "rejected".to_owned()])
        );
    }

    /// A held record waits (`waiting` says why, and after long enough the operator calls the
    /// rule Stalled); dropped once its rule says so, it waits no more. A wait for another
    /// reason stays.
    #[test]
    fn a_held_record_dropped_waits_no_more_and_other_waits_stay() {
        let m = Metrics::new();
        let rules = m.set_rules(&["r".to_owned()]);
        let waiting = || lock(&rules[0].waiting).as_ref().map(|w| w.reason.clone());
        rules[0].on_retry(PermanentReason::TooLarge.as_str(), "held".to_owned());
        assert_eq!(waiting().as_deref(), Some("too_large"));
        rules[0].on_failed(PermanentReason::TooLarge, "dropped".to_owned());
        rules[0].stop_waiting_for(PermanentReason::TooLarge.as_str());
        assert_eq!(waiting(), None);
        rules[0].on_retry(BlockReason::UnknownTopic.as_str(), "missing".to_owned());
        rules[0].stop_waiting_for(PermanentReason::TooLarge.as_str());
        assert_eq!(waiting().as_deref(), Some("unknown_topic"));
    }

    #[test]
    fn label_values_are_the_documented_snake_case_words() {
        let m = Metrics::new();
        let rules = m.set_rules(&["r".to_owned()]);
        for reason in PermanentReason::ALL {
            rules[0].on_failed(reason, "x".to_owned());
        }
        for reason in BlockReason::ALL {
            rules[0].on_retry(reason.as_str(), "x".to_owned());
        }
        m.config_applied(Vec::new(), "rules: []");
        m.config_rejected("x".to_owned());
        let text = m.encode();
        for sample in [
            r#"ferry_rule_failed_messages_total{rule="r",reason="too_large"} 1"#,
            r#"ferry_rule_failed_messages_total{rule="r",reason="invalid_topic"} 1"#,
            r#"ferry_rule_failed_messages_total{rule="r",reason="invalid_record"} 1"#,
            r#"ferry_rule_produce_retries_total{rule="r",reason="unknown_topic"} 1"#,
            r#"ferry_config_reloads_total{result="applied"} 1"#,
            r#"ferry_config_reloads_total{result="rejected"} 1"#,
            r#"ferry_forwarder_build_info{version=""#,
            "process_resident_memory_bytes ",
        ] {
            assert!(
                text.lines().any(|l| l.starts_with(sample)),
                "{sample} in\n{text}"
            );
        }
    }
}
