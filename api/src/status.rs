//! What a forwarder reports on `GET /status`: the contract the operator reads to fill in each
//! ForwardingRule's status. JSON, camelCase; fields are only ever added.

use jiff::Timestamp;
use serde::{Deserialize, Serialize};

/// The HTTP path of [`ForwarderStatus`] on the forwarder's `http.listen` address.
pub const STATUS_PATH: &str = "/status";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ForwarderStatus {
    /// The forwarder's version.
    pub version: String,
    pub started_at: Timestamp,
    pub config: ConfigStatus,
    pub mqtt: MqttStatus,
    pub kafka: KafkaStatus,
    /// Messages read from MQTT and not yet acknowledged.
    pub inflight: u64,
    /// One entry per rule of the running config, in config order.
    pub rules: Vec<RuleStatus>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ConfigStatus {
    /// 1 for the config the forwarder started with, +1 for each reload applied.
    pub generation: u64,
    pub applied_at: Timestamp,
    /// The last reload that was refused (the previous config keeps running); cleared by the
    /// next successful reload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reload_error: Option<LastError>,
    /// Changed settings that only take effect after a restart (e.g. `mqtt.host`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub restart_required: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MqttStatus {
    pub connected: bool,
    /// The broker acknowledged the subscriptions of the current connection.
    pub subscribed: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<LastError>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KafkaStatus {
    /// The last metadata request (every few seconds) was answered.
    pub reachable: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<LastError>,
}

/// Counters since the forwarder started (they survive reloads while the rule keeps its name).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RuleStatus {
    pub name: String,
    /// Messages that matched this rule.
    pub received: u64,
    /// Records Kafka confirmed for this rule.
    pub forwarded: u64,
    /// Matching messages acknowledged to MQTT (forwarded, dead-lettered or failed).
    pub acked: u64,
    /// Messages Kafka could never take that went to the dead-letter topic.
    pub dead_lettered: u64,
    /// Matching messages the rule's `filter` was false for: acknowledged, not forwarded.
    #[serde(default)]
    pub filtered: u64,
    /// Messages Kafka could never take and no dead-letter topic took, acknowledged unwritten
    /// because the rule says `on_unwritable: drop`.
    pub failed: u64,
    /// Records forwarded per second over the last minute.
    pub rate_per_second: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_forwarded_at: Option<Timestamp>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<LastError>,
    /// Set while this rule's records wait on Kafka (retried, holding the window): why, and
    /// since when. Cleared when one of its records goes through.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting: Option<Waiting>,
}

/// Why a rule's records are not getting into Kafka right now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Waiting {
    /// `unauthorized`, `unknown_topic`, `queue_full`, `unavailable` (retried until Kafka takes
    /// them), or `too_large`, `invalid_topic`, `invalid_record` (held by `on_unwritable: hold`).
    pub reason: String,
    /// The error, with the Kafka topic.
    pub message: String,
    pub since: Timestamp,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LastError {
    pub message: String,
    pub at: Timestamp,
}

impl ForwarderStatus {
    pub fn rule(&self, name: &str) -> Option<&RuleStatus> {
        self.rules.iter().find(|r| r.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The wire format the operator parses; a renamed field breaks this test, not a cluster.
    const EXAMPLE: &str = r#"{
  "version": "0.1.0",
  "startedAt": "2026-11-22T10:00:00Z",
  "config": {"generation": 2, "appliedAt": "2026-11-22T10:05:00Z",
             "reloadError": {"message": "rules[0].kafka.topic: ...", "at": "2026-11-22T10:06:00Z"},
             "restartRequired": ["mqtt.host"]},
  "mqtt": {"connected": true, "subscribed": true},
  "kafka": {"reachable": false, "lastError": {"message": "broker down", "at": "2026-11-22T10:07:00Z"}},
  "inflight": 12,
  "rules": [{"name": "telemetry", "received": 10, "forwarded": 9, "acked": 8, "deadLettered": 1,
             "failed": 0, "ratePerSecond": 0.5, "lastForwardedAt": "2026-11-22T10:07:30Z"}]
}"#;

    #[test]
    fn wire_format_round_trips() {
        let status: ForwarderStatus = serde_json::from_str(EXAMPLE).unwrap();
        assert_eq!(status.config.generation, 2);
        assert_eq!(status.config.restart_required, vec!["mqtt.host"]);
        let rule = status.rule("telemetry").unwrap();
        assert_eq!((rule.forwarded, rule.dead_lettered), (9, 1));
        assert!(rule.last_error.is_none());
        assert!(!status.kafka.reachable);
        let again: ForwarderStatus =
            serde_json::from_str(&serde_json::to_string(&status).unwrap()).unwrap();
        assert_eq!(again, status);
    }
}
