//! What a forwarder reports on `GET /status`: the contract the operator reads to fill in each
//! ForwardingRule's status. JSON, camelCase; fields are only ever added.

use jiff::Timestamp;
use serde::{Deserialize, Serialize};

/// The HTTP path of [`ForwarderStatus`] on the forwarder's `http.listen` address.
pub const STATUS_PATH: &str = "/status";

/// The largest `/status` body the operator reads. A forwarder of `config::MAX_RULES` rules,
/// each waiting, blocked and holding a record with the longest names and texts
/// ([`TEXT_MAX_BYTES`]), stays under it (a forwarder test checks). What the operator holds of
/// the bodies together grows with the rules it serves, not with this bound.
pub const STATUS_MAX_BYTES: usize = 32 << 20;

/// Error texts in `/status` are cut to this many bytes (then `…`): a status's size must not
/// depend on how long an error grows.
pub const TEXT_MAX_BYTES: usize = 512;

/// `text` cut to at most [`TEXT_MAX_BYTES`] (on a character boundary, then `…`).
pub fn bounded_text(mut text: String) -> String {
    if text.len() > TEXT_MAX_BYTES {
        let mut end = TEXT_MAX_BYTES - '…'.len_utf8();
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push('…');
    }
    text
}

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
    /// Present while the config lists this forwarder in `drain`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain: Option<DrainStatus>,
}

/// A forwarder leaving for good: see the config's `drain`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DrainStatus {
    /// Connected, nothing subscribed any more, everything received acknowledged, and the
    /// broker has delivered nothing for a quiet period: its session holds no message.
    pub drained: bool,
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
    /// [`config_digest`] of the config file's text this forwarder runs, when it watches a
    /// file: the operator trusts what a pod says of a hand-over only when it runs the config
    /// the ConfigMap holds now (a pod may still read an older version the kubelet wrote).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
}

/// The SHA-256 of a config file's text, in hex.
pub fn config_digest(text: &str) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(text.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MqttStatus {
    pub connected: bool,
    /// The broker acknowledged the subscriptions of the current connection.
    pub subscribed: bool,
    /// The filters are subscribed through `$share/<group>/` (false: plainly, or none).
    #[serde(default)]
    pub shared: bool,
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
    /// Matching messages acknowledged to MQTT (forwarded, dead-lettered, filtered or failed).
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
    /// Set while a record of this rule is held (`on_unwritable: hold`): Kafka can never take
    /// it as it is and no dead-letter topic took it, so it stays unacknowledged and every
    /// message after it, of every rule of the forwarder, waits (acks go out in order).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held: Option<Held>,
    /// Set while messages of this rule are complete but wait behind a record another rule
    /// holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blocked_by: Option<BlockedBy>,
    /// Set while the broker refuses subscriptions of this rule (its SUBACK refused them, e.g.
    /// by an ACL): nothing arrives through those filters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subscription_refused: Option<SubscriptionRefused>,
    /// The registered schema this rule encodes its values with (`kafka.value`), once found.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema: Option<SchemaInUse>,
    /// Every filter of this rule, in the form the config asks for (through `$share` or plain),
    /// is granted by the broker (SUBACK) on the current connection: messages published now
    /// reach this forwarder. False while connecting, before the SUBACK, and while the rule is
    /// paused, retiring or the forwarder drains. Absent from forwarders older than the field.
    #[serde(default)]
    pub subscribed: bool,
    /// Present while the config lists this rule in `retiring` (it moved to another group):
    /// `drained` once this forwarder's session holds nothing more for it, so the rule can
    /// leave this forwarder's config without a message being acknowledged unmatched.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retiring: Option<DrainStatus>,
}

/// A schema registry's schema, as a rule uses it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "crd", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct SchemaInUse {
    pub subject: String,
    pub version: u32,
    pub id: u32,
}

/// Filters of a rule the broker refused to subscribe.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SubscriptionRefused {
    /// As subscribed (`$share/<group>/<filter>` with a shared group), sorted.
    pub filters: Vec<String>,
    /// The broker's reason for the first of them: an MQTT 5 reason code (`not authorized
    /// (0x87)`), or `failure (0x80)`, all MQTT 3.1.1 says.
    pub reason: String,
    pub since: Timestamp,
}

/// The first record a rule holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Held {
    /// `too_large`, `invalid_topic`, `invalid_record`, `invalid_json` or `expression_failed`.
    pub reason: String,
    /// The message's MQTT topic (at most 256 bytes, then cut with `…`).
    pub mqtt_topic: String,
    /// The message's payload, in bytes.
    pub size: u64,
    /// The Kafka topic that refused it; absent when its topic resolved to no legal name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kafka_topic: Option<String>,
    /// The refusal was of its dead-letter copy: the dead-letter topic cannot take it either.
    #[serde(default)]
    pub dead_letter: bool,
    /// Kafka's error (or the expression's), with the topic.
    pub error: String,
    /// Records of this rule held now (this one and any later ones).
    pub records: u64,
    pub since: Timestamp,
}

/// Which rules stop the order of acknowledgements this rule's messages wait in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BlockedBy {
    /// The rules of the first held record, or of the oldest message whose records wait on
    /// Kafka (usually one).
    pub rules: Vec<String>,
    /// This rule's messages waiting behind it.
    pub messages: u64,
    pub since: Timestamp,
    /// Why those rules' records wait (`unknown_topic`, `unauthorized`, `schema_unavailable`,
    /// ... as in [`Waiting::reason`]); absent when a record is held.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting: Option<String>,
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
             "failed": 0, "ratePerSecond": 0.5, "lastForwardedAt": "2026-11-22T10:07:30Z"},
            {"name": "images", "received": 1, "forwarded": 0, "acked": 0, "deadLettered": 0,
             "failed": 0, "ratePerSecond": 0,
             "held": {"reason": "too_large", "mqttTopic": "cam/1", "size": 2000000,
                      "kafkaTopic": "images", "deadLetter": false,
                      "error": "kafka topic images: Broker: Message size too large",
                      "records": 1, "since": "2026-11-22T10:07:00Z"}},
            {"name": "metrics", "received": 5, "forwarded": 5, "acked": 0, "deadLettered": 0,
             "failed": 0, "ratePerSecond": 1,
             "blockedBy": {"rules": ["images"], "messages": 5, "since": "2026-11-22T10:07:00Z"}}]
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
        let held = status.rule("images").and_then(|r| r.held.as_ref()).unwrap();
        assert_eq!((held.reason.as_str(), held.size), ("too_large", 2_000_000));
        let blocked = status
            .rule("metrics")
            .and_then(|r| r.blocked_by.as_ref())
            .unwrap();
        assert_eq!(
            (blocked.rules.as_slice(), blocked.messages),
            (&["images".to_owned()][..], 5)
        );
        let again: ForwarderStatus =
            serde_json::from_str(&serde_json::to_string(&status).unwrap()).unwrap();
        assert_eq!(again, status);
    }
}
