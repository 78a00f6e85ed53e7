//! Prometheus metrics and the health flags behind `/readyz`. Labels are rule names and a small
//! fixed set of failure reasons, never raw MQTT topics (bounded cardinality).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

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
    reason: FailureReason,
}

/// Why Kafka can never take a record.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum FailureReason {
    TooLarge,
    InvalidTopic,
    Unauthorized,
    UnknownTopic,
    Rejected,
}

impl FailureReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::TooLarge => "record too large",
            Self::InvalidTopic => "invalid topic",
            Self::Unauthorized => "not authorized",
            Self::UnknownTopic => "unknown topic",
            Self::Rejected => "rejected by Kafka",
        }
    }
}

/// Per-rule counters, resolved once so the data path never hashes label sets.
pub struct RuleCounters {
    pub forwarded: Counter,
    failed: Family<FailureLabel, Counter>,
    name: String,
}

impl RuleCounters {
    pub fn failed(&self, reason: FailureReason) {
        self.failed
            .get_or_create(&FailureLabel {
                rule: self.name.clone(),
                reason,
            })
            .inc();
    }
}

pub struct Metrics {
    pub registry: Registry,
    pub rules: Vec<RuleCounters>,
    /// Received PUBLISHes by QoS (index 0, 1, 2).
    pub received: [Counter; 3],
    pub unmatched: Counter,
    pub acked: Counter,
    pub produce_retries: Counter,
    pub inflight: Gauge,
    pub mqtt_connected: Gauge,
    pub kafka_reachable: Gauge,
    pub health: Health,
}

/// What `/readyz` answers from.
#[derive(Clone, Default)]
pub struct Health {
    mqtt_connected: Arc<AtomicBool>,
    /// The broker acknowledged our subscriptions on the current connection.
    mqtt_subscribed: Arc<AtomicBool>,
    kafka_reachable: Arc<AtomicBool>,
}

impl Health {
    pub fn ready(&self) -> bool {
        self.mqtt_subscribed.load(Ordering::Relaxed) && self.kafka_reachable.load(Ordering::Relaxed)
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

impl Metrics {
    pub fn new(rule_names: &[String]) -> Self {
        let mut registry = Registry::with_prefix("ferry");
        let forwarded = Family::<RuleLabel, Counter>::default();
        let failed = Family::<FailureLabel, Counter>::default();
        registry.register(
            "rule_forwarded_messages",
            "Messages of a rule confirmed by Kafka",
            forwarded.clone(),
        );
        registry.register(
            "rule_failed_messages",
            "Messages of a rule Kafka can never take, acknowledged after being counted and logged",
            failed.clone(),
        );
        let rules = rule_names
            .iter()
            .map(|name| RuleCounters {
                forwarded: forwarded
                    .get_or_create(&RuleLabel { rule: name.clone() })
                    .clone(),
                failed: failed.clone(),
                name: name.clone(),
            })
            .collect();
        let received_family = Family::<QosLabel, Counter>::default();
        let received =
            [0u8, 1, 2].map(|qos| received_family.get_or_create(&QosLabel { qos }).clone());
        let unmatched = Counter::default();
        let acked = Counter::default();
        let produce_retries = Counter::default();
        let inflight = Gauge::default();
        let mqtt_connected = Gauge::default();
        let kafka_reachable = Gauge::default();
        registry.register(
            "mqtt_received_messages",
            "PUBLISH packets received from MQTT, by QoS",
            received_family,
        );
        registry.register(
            "mqtt_unmatched_messages",
            "Messages that matched no rule",
            unmatched.clone(),
        );
        registry.register(
            "mqtt_acked_messages",
            "Messages acknowledged to MQTT",
            acked.clone(),
        );
        registry.register(
            "kafka_produce_retries",
            "Records produced again after a retriable error",
            produce_retries.clone(),
        );
        registry.register(
            "inflight_messages",
            "Messages received and not yet acknowledged",
            inflight.clone(),
        );
        registry.register(
            "mqtt_connected",
            "1 while the MQTT connection is up",
            mqtt_connected.clone(),
        );
        registry.register(
            "kafka_reachable",
            "1 while Kafka answers metadata requests",
            kafka_reachable.clone(),
        );
        Self {
            registry,
            rules,
            received,
            unmatched,
            acked,
            produce_retries,
            inflight,
            mqtt_connected,
            kafka_reachable,
            health: Health::default(),
        }
    }

    pub fn set_mqtt_connected(&self, up: bool) {
        self.health.mqtt_connected.store(up, Ordering::Relaxed);
        if !up {
            self.health.mqtt_subscribed.store(false, Ordering::Relaxed);
        }
        self.mqtt_connected.set(i64::from(up));
    }

    pub fn set_mqtt_subscribed(&self) {
        self.health.mqtt_subscribed.store(true, Ordering::Relaxed);
    }

    pub fn set_kafka_reachable(&self, up: bool) {
        self.health.kafka_reachable.store(up, Ordering::Relaxed);
        self.kafka_reachable.set(i64::from(up));
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}
