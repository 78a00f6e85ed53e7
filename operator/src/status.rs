//! What the status of each object should say, as pure functions of what reconcile saw.
//!
//! Two writers share a ForwardingRule's status, each under its own field manager so
//! server-side apply never lets one erase the other's fields: the reconciler (`Accepted`,
//! `Ready`, workload, ready replicas) and the data-plane poller (`Forwarding`, counters from
//! the forwarder pods' `/status`).

use ferry_api::crd::{BoundedString, BrokerConnectionStatus, ForwardingRuleStatus};
use ferry_api::status::{BlockedBy, ForwarderStatus, Held, LastError, RuleStatus};
use jiff::{SignedDuration, Timestamp};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use crate::conditions::{Desired, FALSE, TRUE, Transition, UNKNOWN, merge, owned};
use crate::validate::{MissingSecret, Unresolved};

pub const ACCEPTED: &str = "Accepted";
pub const READY: &str = "Ready";
pub const FORWARDING: &str = "Forwarding";
pub const SECRETS_RESOLVED: &str = "SecretsResolved";

/// Condition types the reconciler writes on a rule.
pub const RULE_CONTROL_TYPES: [&str; 2] = [ACCEPTED, READY];
/// Condition types the data-plane poller writes on a rule.
pub const RULE_DATA_TYPES: [&str; 1] = [FORWARDING];

/// A rule's error counts as current this long after the forwarder recorded it.
pub const RECENT_ERROR: SignedDuration = SignedDuration::from_secs(60);

/// A rule whose records have waited on Kafka this long is `Stalled`: several rounds of the
/// producer's capped retry backoff (5 s) and longer than a partition leader's failover, so a
/// transient hiccup does not flip the condition but a missing topic or a revoked ACL does.
pub const STALLED_AFTER: SignedDuration = SignedDuration::from_secs(30);

/// The rule holds a record Kafka can never take (`onUnwritable: hold`): nothing after it, of any
/// rule of the group, is acknowledged.
pub const HELD: &str = "Held";
/// The rule's messages wait behind a record another rule of its group holds.
pub const BLOCKED_BY_RULE: &str = "BlockedByRule";
/// The MQTT broker refused (some of) the rule's subscriptions.
pub const SUBSCRIPTION_REFUSED: &str = "SubscriptionRefused";

/// `Forwarding` reasons that also make the rule not `Ready`: data is not flowing. (A record
/// dead-lettered now and then, `RecordsFailing`, is worth a condition but the rule still
/// forwards.)
pub const BLOCKING_REASONS: [&str; 6] = [
    "MqttDisconnected",
    "KafkaUnreachable",
    SUBSCRIPTION_REFUSED,
    HELD,
    BLOCKED_BY_RULE,
    "Stalled",
];

/// A group's forwarder StatefulSet as last seen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Workload {
    pub name: String,
    pub wanted: i32,
    pub ready: i32,
}

impl Workload {
    fn is_ready(&self) -> bool {
        self.wanted > 0 && self.ready >= self.wanted
    }

    fn pods(&self) -> String {
        format!("{}/{}", self.ready, self.wanted)
    }
}

/// Why a rule is, or is not, rendered into its group's forwarder.
#[derive(Debug, Clone, PartialEq)]
pub enum RuleOutcome {
    Rendered {
        workload: Workload,
        paused: bool,
    },
    SecretMissing(String),
    Conflict(String),
    /// Its group's forwarder objects would take a name another owner holds.
    NameTaken(String),
    /// The forwarder would refuse it (what CEL cannot check, e.g. a template level deeper
    /// than the filters).
    Invalid(String),
    /// A CEL expression of the rule does not compile (the message names the spec field and
    /// the position).
    InvalidExpression(String),
    ConnectionNotFound(String),
    InvalidSpec(String),
    /// It does not fit its group (the forwarder's rules per group, the ConfigMap's bytes):
    /// the group's older rules keep their place.
    GroupFull(String),
    /// Its group's children could not be applied (the message has the API's answer).
    GroupNotApplied(String),
    /// A literal Kafka topic of the rule (its topic or its dead-letter topic) does not exist,
    /// and the rule is not served yet (see [`crate::preflight`]).
    TopicMissing(String),
}

/// The reconciler's part of a rule's status.
pub fn rule_control(
    current: Option<&ForwardingRuleStatus>,
    generation: Option<i64>,
    outcome: &RuleOutcome,
    now: Timestamp,
) -> (ForwardingRuleStatus, Vec<Transition>) {
    let not_accepted = |reason, message: &str| {
        vec![
            Desired::new(ACCEPTED, FALSE, reason, message),
            Desired::new(
                READY,
                FALSE,
                "NotAccepted",
                "the rule is not rendered (see Accepted)",
            ),
        ]
    };
    let (desired, workload) = match outcome {
        RuleOutcome::Rendered { workload, paused } => {
            let ready = if *paused {
                Desired::new(
                    READY,
                    FALSE,
                    "Paused",
                    "spec.paused is true: not subscribed",
                )
            } else if workload.wanted == 0 {
                Desired::new(
                    READY,
                    FALSE,
                    "ScaledToZero",
                    "the group's StatefulSet has 0 replicas (the connection's spec.forwarder.replicas or groups, or an autoscaler)",
                )
            } else if let Some((reason, message)) = blocked(current) {
                Desired::new(
                    READY,
                    FALSE,
                    reason,
                    format!("{message} ({} forwarder pods ready)", workload.pods()),
                )
            } else if workload.is_ready() {
                Desired::new(
                    READY,
                    TRUE,
                    "ForwarderReady",
                    format!("{} forwarder pods ready", workload.pods()),
                )
            } else {
                Desired::new(
                    READY,
                    FALSE,
                    "ForwarderNotReady",
                    format!("{} forwarder pods ready", workload.pods()),
                )
            };
            let accepted = Desired::new(
                ACCEPTED,
                TRUE,
                "Accepted",
                format!("served by StatefulSet {}", workload.name),
            );
            (vec![accepted, ready], Some(workload))
        }
        RuleOutcome::SecretMissing(m) => (not_accepted("SecretMissing", m), None),
        RuleOutcome::Conflict(m) => (not_accepted("Conflict", m), None),
        RuleOutcome::NameTaken(m) => (not_accepted("NameTaken", m), None),
        RuleOutcome::Invalid(m) => (not_accepted("Invalid", m), None),
        RuleOutcome::InvalidExpression(m) => (not_accepted("InvalidExpression", m), None),
        RuleOutcome::GroupFull(m) => (not_accepted("GroupFull", m), None),
        RuleOutcome::GroupNotApplied(m) => (not_accepted("GroupNotApplied", m), None),
        RuleOutcome::TopicMissing(m) => (not_accepted("TopicMissing", m), None),
        RuleOutcome::ConnectionNotFound(m) => (not_accepted("ConnectionNotFound", m), None),
        RuleOutcome::InvalidSpec(m) => (not_accepted("InvalidSpec", m), None),
    };
    let previous = current.map(|s| s.conditions.as_slice()).unwrap_or_default();
    let (conditions, transitions) = merge(previous, &desired, generation, now);
    let status = ForwardingRuleStatus {
        observed_generation: generation,
        conditions,
        workload: workload.map(|w| w.name.clone()),
        ready_replicas: workload.map(Workload::pods),
        ..ForwardingRuleStatus::default()
    };
    (status, transitions)
}

/// The data plane's `Forwarding` condition when it says data is not flowing: its reason (one
/// of [`BLOCKING_REASONS`]) and message.
fn blocked(current: Option<&ForwardingRuleStatus>) -> Option<(&'static str, &str)> {
    let c = condition(&current?.conditions, FORWARDING)?;
    if c.status != FALSE {
        return None;
    }
    let reason = BLOCKING_REASONS.into_iter().find(|r| *r == c.reason)?;
    Some((reason, c.message.as_str()))
}

/// Whether a change of a rule's `Forwarding` condition from `before` to `after` changes what
/// its `Ready` condition says (the reconciler then has to run for it).
pub fn ready_affected(before: &ForwardingRuleStatus, after: &ForwardingRuleStatus) -> bool {
    blocked(Some(before)) != blocked(Some(after))
}

/// Whether a rule's `Ready` disagrees with its `Forwarding`: the reconcile that wrote `Ready`
/// read an older `Forwarding` (the data plane's write had not reached its cache yet), and
/// nothing else would make it run again. The data-plane poll then asks for it again.
pub fn ready_stale(status: &ForwardingRuleStatus) -> bool {
    let Some(ready) = condition(&status.conditions, READY) else {
        return false;
    };
    let blocking = blocked(Some(status)).map(|(reason, _)| reason);
    if ready.status == TRUE {
        return blocking.is_some();
    }
    BLOCKING_REASONS.contains(&ready.reason.as_str()) && blocking != Some(ready.reason.as_str())
}

/// The reconciler's fields of a rule status as it stands (to compare before writing).
pub fn rule_control_view(status: &ForwardingRuleStatus) -> ForwardingRuleStatus {
    ForwardingRuleStatus {
        observed_generation: status.observed_generation,
        conditions: owned(&status.conditions, &RULE_CONTROL_TYPES),
        workload: status.workload.clone(),
        ready_replicas: status.ready_replicas.clone(),
        mqtt_topics: status.mqtt_topics.clone(),
        kafka_topic: status.kafka_topic.clone(),
        ..ForwardingRuleStatus::default()
    }
}

/// The data-plane poller's fields of a rule status as it stands.
pub fn rule_data_view(status: &ForwardingRuleStatus) -> ForwardingRuleStatus {
    ForwardingRuleStatus {
        conditions: owned(&status.conditions, &RULE_DATA_TYPES),
        forwarded: status.forwarded,
        filtered: status.filtered,
        dead_lettered: status.dead_lettered,
        failed: status.failed,
        rate_per_second: status.rate_per_second,
        last_forwarded_at: status.last_forwarded_at.clone(),
        last_error: status.last_error.clone(),
        schema: status.schema.clone(),
        ..ForwardingRuleStatus::default()
    }
}

/// A list as one plain string (`a,b`), for a `kubectl get` column: the API server prints a
/// list column as JSON.
pub fn column<'a>(items: impl IntoIterator<Item = &'a str>) -> Option<String> {
    let joined = items.into_iter().collect::<Vec<_>>().join(",");
    (!joined.is_empty()).then_some(joined)
}

/// A connection's status: `SecretsResolved`, `Ready`, its groups and the Kafka it produces to.
pub fn connection(
    current: Option<&BrokerConnectionStatus>,
    generation: Option<i64>,
    bootstrap_servers: &[BoundedString],
    missing_secrets: &[MissingSecret],
    workloads: &[(String, Workload)],
    now: Timestamp,
) -> (BrokerConnectionStatus, Vec<Transition>) {
    let mut desired = Vec::new();
    if missing_secrets.is_empty() {
        desired.push(Desired::new(
            SECRETS_RESOLVED,
            TRUE,
            "Resolved",
            "every referenced Secret and key exists",
        ));
    } else {
        let message = missing_secrets
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ");
        let reason = if missing_secrets
            .iter()
            .all(|m| m.problem == Unresolved::NotMarked)
        {
            "SecretNotMarked"
        } else {
            "SecretMissing"
        };
        desired.push(Desired::new(
            SECRETS_RESOLVED,
            FALSE,
            reason,
            message.clone(),
        ));
        desired.push(Desired::new(READY, FALSE, reason, message));
    }
    if missing_secrets.is_empty() {
        // A group scaled to zero is so on purpose, not a forwarder failing to start.
        let not_ready: Vec<String> = workloads
            .iter()
            .filter(|(_, w)| w.wanted > 0 && !w.is_ready())
            .map(|(_, w)| format!("{} {} pods ready", w.name, w.pods()))
            .collect();
        desired.push(if workloads.is_empty() {
            Desired::new(
                READY,
                TRUE,
                "NoRules",
                "no ForwardingRule uses this connection",
            )
        } else if workloads.iter().all(|(_, w)| w.wanted == 0) {
            Desired::new(
                READY,
                FALSE,
                "ScaledToZero",
                "every group wants 0 forwarder pods (its replicas are 0, or all its rules are paused): none runs",
            )
        } else if not_ready.is_empty() {
            let (ready, wanted) = workloads
                .iter()
                .fold((0, 0), |(r, w), (_, x)| (r + x.ready, w + x.wanted));
            Desired::new(
                READY,
                TRUE,
                "ForwardersReady",
                format!(
                    "{} groups, {ready}/{wanted} forwarder pods ready",
                    workloads.len()
                ),
            )
        } else {
            Desired::new(READY, FALSE, "ForwardersNotReady", not_ready.join(", "))
        });
    }
    let previous = current.map(|s| s.conditions.as_slice()).unwrap_or_default();
    let (conditions, transitions) = merge(previous, &desired, generation, now);
    let status = BrokerConnectionStatus {
        observed_generation: generation,
        conditions,
        groups: workloads.iter().map(|(g, _)| g.clone()).collect(),
        group_names: column(workloads.iter().map(|(g, _)| g.as_str())),
        bootstrap_servers: column(bootstrap_servers.iter().map(|s| s.0.as_str())),
        mqtt_sessions: Vec::new(),
        session_prefix: None,
    };
    (status, transitions)
}

/// The data-plane part of one rule's status from the `/status` reports of its group's ready
/// pods (`(pod name, report)`). `rule` is the rule's name in the forwarder config.
pub fn rule_data(
    current: Option<&ForwardingRuleStatus>,
    rule: &str,
    reports: &[(String, ForwarderStatus)],
    now: Timestamp,
) -> (ForwardingRuleStatus, Vec<Transition>) {
    let loaded: Vec<Loaded<'_>> = reports
        .iter()
        .filter_map(|(pod, r)| r.rule(rule).map(|x| (pod.as_str(), r, x)))
        .collect();
    let recent_error = loaded
        .iter()
        .filter_map(|(_, _, r)| r.last_error.as_ref())
        .max_by_key(|e| e.at);
    let condition = forwarding(reports.is_empty(), &loaded, recent_error, now);
    // The pods' rates are averages over their last minute: while the data plane is known not
    // to forward, RATE says 0 at once rather than the minute before the outage.
    let flowing = !(condition.status == FALSE && BLOCKING_REASONS.contains(&condition.reason));
    let previous = current.map(|s| s.conditions.as_slice()).unwrap_or_default();
    let (conditions, transitions) = merge(previous, &[condition], None, now);
    // Summed over the pods that report the rule; absent while none does.
    let total = |count: fn(&RuleStatus) -> u64| {
        let sum: u64 = loaded.iter().map(|(_, _, r)| count(r)).sum();
        (!loaded.is_empty()).then(|| i64::try_from(sum).unwrap_or(i64::MAX))
    };
    let rate: f64 = loaded.iter().map(|(_, _, r)| r.rate_per_second).sum();
    let status = ForwardingRuleStatus {
        conditions,
        forwarded: total(|r| r.forwarded),
        filtered: total(|r| r.filtered),
        dead_lettered: total(|r| r.dead_lettered),
        failed: total(|r| r.failed),
        // Two decimals: a rate that moves in the noise should not rewrite the status.
        rate_per_second: (!loaded.is_empty()).then(|| {
            if flowing {
                (rate * 100.0).round() / 100.0
            } else {
                0.0
            }
        }),
        last_forwarded_at: loaded
            .iter()
            .filter_map(|(_, _, r)| r.last_forwarded_at)
            .max()
            .map(|t| Time(Timestamp::from_second(t.as_second()).unwrap_or(t))),
        last_error: recent_error.map(|e| e.message.clone()),
        // The newest any pod uses (pods pick up a new latest version within minutes).
        schema: loaded
            .iter()
            .filter_map(|(_, _, r)| r.schema.as_ref())
            .max_by_key(|s| (s.version, s.id))
            .cloned(),
        ..ForwardingRuleStatus::default()
    };
    (status, transitions)
}

/// One pod's report that has the rule loaded: (pod name, whole report, the rule's part).
type Loaded<'a> = (&'a str, &'a ForwarderStatus, &'a RuleStatus);

/// The rule's `Forwarding` condition: the first problem found, in the order a reader would
/// look for it (no report, MQTT, Kafka, a stalled window, failing records), else True.
fn forwarding(
    no_reports: bool,
    loaded: &[Loaded<'_>],
    recent_error: Option<&LastError>,
    now: Timestamp,
) -> Desired {
    if no_reports {
        Desired::new(
            FORWARDING,
            UNKNOWN,
            "NoReport",
            "no forwarder pod answered GET /status",
        )
    } else if loaded.is_empty() {
        Desired::new(
            FORWARDING,
            UNKNOWN,
            "NoReport",
            "the forwarder pods have not loaded this rule yet",
        )
    } else if let Some((pod, r, _)) = loaded.iter().find(|(_, r, _)| !r.mqtt.connected) {
        Desired::new(
            FORWARDING,
            FALSE,
            "MqttDisconnected",
            with_error(
                format!("pod {pod}: not connected to MQTT"),
                &r.mqtt.last_error,
            ),
        )
    } else if let Some((pod, r, _)) = loaded.iter().find(|(_, r, _)| !r.kafka.reachable) {
        Desired::new(
            FORWARDING,
            FALSE,
            "KafkaUnreachable",
            with_error(format!("pod {pod}: Kafka unreachable"), &r.kafka.last_error),
        )
    } else if let Some((pod, refused)) = first(loaded, |r| r.subscription_refused.as_ref()) {
        Desired::new(
            FORWARDING,
            FALSE,
            SUBSCRIPTION_REFUSED,
            format!(
                "pod {pod}: the MQTT broker refused the subscription to {} ({}): nothing arrives through it; check the broker's ACL for the forwarder's user",
                refused.filters.join(", "),
                refused.reason
            ),
        )
    } else if let Some((pod, h)) = first(loaded, |r| r.held.as_ref()) {
        Desired::new(FORWARDING, FALSE, HELD, held_message(pod, h))
    } else if let Some((pod, b)) = first(loaded, |r| {
        // Behind records that wait on Kafka, as long as they would make their own rule
        // Stalled: a broker's hiccup does not flip every neighbour.
        r.blocked_by
            .as_ref()
            .filter(|b| b.waiting.is_none() || now.duration_since(b.since) >= STALLED_AFTER)
    }) {
        Desired::new(FORWARDING, FALSE, BLOCKED_BY_RULE, blocked_message(pod, b))
    } else if let Some((pod, w)) = loaded
        .iter()
        .filter_map(|(pod, _, r)| Some((pod, r.waiting.as_ref()?)))
        .filter(|(_, w)| now.duration_since(w.since) >= STALLED_AFTER)
        .min_by_key(|(_, w)| w.since)
    {
        Desired::new(
            FORWARDING,
            FALSE,
            "Stalled",
            format!(
                "pod {pod}: records wait on {} since {} ({}), holding the window: {}",
                // `schema_unavailable`: the schema registry has not given the rule's schema.
                if w.reason.starts_with("schema") {
                    "the schema registry"
                } else {
                    "Kafka"
                },
                w.since,
                w.reason,
                w.message
            ),
        )
    } else if let Some(e) = recent_error.filter(|e| now.duration_since(e.at) < RECENT_ERROR) {
        Desired::new(FORWARDING, FALSE, "RecordsFailing", e.message.clone())
    } else {
        Desired::new(
            FORWARDING,
            TRUE,
            "Forwarding",
            format!("{} pods: MQTT connected, Kafka reachable", loaded.len()),
        )
    }
}

/// The first pod whose report of the rule has `field`, with it.
fn first<'a, T>(
    loaded: &[Loaded<'a>],
    field: impl Fn(&'a RuleStatus) -> Option<&'a T>,
) -> Option<(&'a str, &'a T)> {
    loaded
        .iter()
        .find_map(|(pod, _, r)| Some((*pod, field(r)?)))
}

/// What a held record is and how to release it. Only what identifies the record, so the
/// message stays the same (and nothing is written) while the same record is held.
/// The `BlockedByRule` message: which rules stop this one's messages, and why; nothing that
/// moves (the count), so it is written once per stall.
fn blocked_message(pod: &str, b: &BlockedBy) -> String {
    let rules = b.rules.join(", ");
    match &b.waiting {
        None => format!(
            "pod {pod}: messages wait behind a record held by rule {rules} (acknowledgements go out in order); see that rule's status"
        ),
        Some(reason) => format!(
            "pod {pod}: messages wait behind records of rule {rules} that wait on Kafka ({reason}) since {} (acknowledgements go out in order); see that rule's status",
            b.since
        ),
    }
}

fn held_message(pod: &str, h: &Held) -> String {
    let refused_by = match (&h.kafka_topic, h.dead_letter) {
        (Some(t), true) => format!("its dead-letter topic {t} refused the copy too"),
        (Some(t), false) => format!("Kafka topic {t}"),
        (None, _) => "no legal Kafka topic".to_owned(),
    };
    format!(
        "pod {pod}: holds a record Kafka can never take as it is ({}: MQTT topic {}, {} bytes; {refused_by}: {}); every later message of its group waits. Release it: give the rule a deadLetter topic that can take it, set onUnwritable: drop, remove the rule, or raise the topic's max.message.bytes",
        h.reason, h.mqtt_topic, h.size, h.error
    )
}

/// Whether the poller writes a rule's data-plane status now (`current` and `desired` as
/// [`rule_data_view`] and [`rule_data`] give them). A condition change, and the counters
/// appearing or going, are written at once; counters, rates and times that merely moved wait
/// until `min_interval` has passed since this rule's last write, so steady traffic costs about
/// one write per rule per `min_interval` instead of one per poll.
pub fn data_write_due(
    current: &ForwardingRuleStatus,
    desired: &ForwardingRuleStatus,
    last_write: Option<Timestamp>,
    now: Timestamp,
    min_interval: SignedDuration,
) -> bool {
    if current == desired {
        return false;
    }
    if data_write_urgent(current, desired) {
        return true;
    }
    last_write.is_none_or(|at| now.duration_since(at) >= min_interval)
}

/// Whether a due data-plane write is news (a condition change, the counters appearing or
/// going), written at once, rather than counters that merely moved, which may wait for the
/// operator's write budget.
pub fn data_write_urgent(current: &ForwardingRuleStatus, desired: &ForwardingRuleStatus) -> bool {
    current.conditions != desired.conditions
        || current.forwarded.is_some() != desired.forwarded.is_some()
}

fn with_error(what: String, error: &Option<ferry_api::status::LastError>) -> String {
    match error {
        Some(e) => format!("{what}: {}", e.message),
        None => what,
    }
}

/// The `Ready` condition, for printing and tests.
pub fn condition<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_api::status::{ConfigStatus, KafkaStatus, MqttStatus};

    fn at(s: i64) -> Timestamp {
        Timestamp::from_second(s).unwrap()
    }

    fn workload(ready: i32, wanted: i32) -> Workload {
        Workload {
            name: "plant-default".into(),
            wanted,
            ready,
        }
    }

    #[test]
    fn rendered_rule_is_ready_when_all_wanted_pods_are() {
        let outcome = RuleOutcome::Rendered {
            workload: workload(1, 2),
            paused: false,
        };
        let (s, t) = rule_control(None, Some(3), &outcome, at(10));
        assert_eq!(condition(&s.conditions, ACCEPTED).unwrap().status, TRUE);
        let ready = condition(&s.conditions, READY).unwrap();
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str()),
            (FALSE, "ForwarderNotReady")
        );
        assert_eq!(s.ready_replicas.as_deref(), Some("1/2"));
        assert_eq!(s.workload.as_deref(), Some("plant-default"));
        assert_eq!(t.len(), 2);

        let outcome = RuleOutcome::Rendered {
            workload: workload(2, 2),
            paused: false,
        };
        let (s2, t) = rule_control(Some(&s), Some(3), &outcome, at(20));
        assert_eq!(condition(&s2.conditions, READY).unwrap().status, TRUE);
        assert_eq!(t.len(), 1, "only Ready changed");
        assert_eq!(rule_control_view(&s2), s2);
    }

    #[test]
    fn an_expression_that_does_not_compile_has_its_own_reason() {
        let message = "spec.filter does not compile: x (at line 1, column 9)";
        let outcome = RuleOutcome::InvalidExpression(message.into());
        let (s, _) = rule_control(None, Some(1), &outcome, at(10));
        let accepted = condition(&s.conditions, ACCEPTED).unwrap();
        assert_eq!(
            (accepted.status.as_str(), accepted.reason.as_str()),
            (FALSE, "InvalidExpression")
        );
        assert_eq!(accepted.message, message);
        assert_eq!(s.workload, None);
    }

    #[test]
    fn refused_rule_names_its_reason_and_has_no_workload() {
        let outcome = RuleOutcome::Conflict("writes topic t like rule a".into());
        let (s, _) = rule_control(None, Some(1), &outcome, at(10));
        let accepted = condition(&s.conditions, ACCEPTED).unwrap();
        assert_eq!(accepted.reason, "Conflict");
        assert_eq!(accepted.message, "writes topic t like rule a");
        assert_eq!(
            condition(&s.conditions, READY).unwrap().reason,
            "NotAccepted"
        );
        assert!(s.workload.is_none());
    }

    #[test]
    fn paused_and_scaled_to_zero_are_not_ready_with_their_reason() {
        for (outcome, reason) in [
            (
                RuleOutcome::Rendered {
                    workload: workload(1, 1),
                    paused: true,
                },
                "Paused",
            ),
            (
                RuleOutcome::Rendered {
                    workload: workload(0, 0),
                    paused: false,
                },
                "ScaledToZero",
            ),
        ] {
            let (s, _) = rule_control(None, None, &outcome, at(1));
            assert_eq!(condition(&s.conditions, READY).unwrap().reason, reason);
        }
    }

    #[test]
    fn a_connection_scaled_to_zero_says_so_and_its_events_are_normal() {
        let groups = [
            ("default".to_owned(), workload(1, 1)),
            ("bulk".to_owned(), workload(1, 1)),
        ];
        let (running, _) = connection(None, Some(1), &[], &[], &groups, at(1));
        let zero = groups.clone().map(|(g, _)| (g, workload(0, 0)));
        let (s, t) = connection(Some(&running), Some(2), &[], &[], &zero, at(2));
        let c = condition(&s.conditions, READY).unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            (FALSE, "ScaledToZero")
        );
        assert_eq!(t.len(), 1);
        assert!(t[0].noteworthy() && !t[0].warns(), "a Normal Event: {t:?}");
        // And its rules: Ready False, reason ScaledToZero, a Normal Event too.
        let rendered = |paused| RuleOutcome::Rendered {
            workload: workload(0, 0),
            paused,
        };
        let (ready, _) = rule_control(
            None,
            Some(1),
            &RuleOutcome::Rendered {
                workload: workload(1, 1),
                paused: false,
            },
            at(1),
        );
        for paused in [false, true] {
            let (_, t) = rule_control(Some(&ready), Some(2), &rendered(paused), at(2));
            assert!(t.len() == 1 && t[0].noteworthy() && !t[0].warns(), "{t:?}");
        }
        // One group scaled to zero of two running is not a forwarder failing.
        let mixed = [groups[0].clone(), ("bulk".to_owned(), workload(0, 0))];
        let (s, _) = connection(Some(&running), Some(2), &[], &[], &mixed, at(2));
        assert_eq!(condition(&s.conditions, READY).unwrap().status, TRUE);
    }

    #[test]
    fn connection_names_missing_secrets_and_heals() {
        let missing = |problem| MissingSecret {
            field: "spec.mqtt.credentialsSecretRef".to_owned(),
            secret: "creds".to_owned(),
            problem,
        };
        let (unmarked, _) = connection(
            None,
            Some(1),
            &[],
            &[missing(Unresolved::NotMarked)],
            &[],
            at(1),
        );
        let c = condition(&unmarked.conditions, SECRETS_RESOLVED).unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            (FALSE, "SecretNotMarked")
        );
        assert!(
            c.message.contains("ferry.dev/broker-credentials"),
            "{}",
            c.message
        );
        let (s, _) = connection(
            None,
            Some(1),
            &[],
            &[
                missing(Unresolved::NotMarked),
                missing(Unresolved::NoSecret),
            ],
            &[],
            at(1),
        );
        let c = condition(&s.conditions, SECRETS_RESOLVED).unwrap();
        assert_eq!(c.status, FALSE);
        assert!(c.message.contains("creds") && c.message.contains("credentialsSecretRef"));
        assert_eq!(
            condition(&s.conditions, READY).unwrap().reason,
            "SecretMissing"
        );

        let groups = [
            ("default".to_owned(), workload(1, 1)),
            ("bulk".to_owned(), workload(1, 1)),
        ];
        let servers = [
            BoundedString("k0:9092".into()),
            BoundedString("k1:9092".into()),
        ];
        let (healed, t) = connection(Some(&s), Some(1), &servers, &[], &groups, at(2));
        assert_eq!(
            condition(&healed.conditions, SECRETS_RESOLVED)
                .unwrap()
                .status,
            TRUE
        );
        assert_eq!(condition(&healed.conditions, READY).unwrap().status, TRUE);
        assert_eq!(t.len(), 2);
        assert_eq!(healed.groups, vec!["default", "bulk"]);
        // Plain strings for `kubectl get`, not lists.
        assert_eq!(healed.group_names.as_deref(), Some("default,bulk"));
        assert_eq!(healed.bootstrap_servers.as_deref(), Some("k0:9092,k1:9092"));
        assert_eq!(s.group_names, None, "no groups: an empty column");
    }

    fn report(connected: bool, reachable: bool, rule: Option<RuleStatus>) -> ForwarderStatus {
        ForwarderStatus {
            version: "0".into(),
            started_at: at(0),
            config: ConfigStatus {
                generation: 1,
                applied_at: at(0),
                reload_error: None,
                restart_required: vec![],
                digest: None,
            },
            mqtt: MqttStatus {
                connected,
                subscribed: connected,
                shared: true,
                last_error: None,
            },
            kafka: KafkaStatus {
                reachable,
                last_error: (!reachable).then(|| LastError {
                    message: "broker down".into(),
                    at: at(5),
                }),
            },
            inflight: 0,
            rules: rule.into_iter().collect(),
            drain: None,
        }
    }

    fn rule(forwarded: u64, rate: f64, error_at: Option<i64>) -> RuleStatus {
        RuleStatus {
            name: "telemetry".into(),
            received: forwarded,
            forwarded,
            acked: forwarded,
            dead_lettered: forwarded / 10,
            filtered: forwarded / 5,
            failed: forwarded / 10,
            rate_per_second: rate,
            last_forwarded_at: Some(
                Timestamp::from_millisecond(forwarded as i64 * 1000 + 250).unwrap(),
            ),
            last_error: error_at.map(|s| LastError {
                message: "record too large".into(),
                at: at(s),
            }),
            waiting: None,
            held: None,
            blocked_by: None,
            subscription_refused: None,
            schema: None,
            retiring: None,
            subscribed: true,
        }
    }

    /// Records of one rule waiting on Kafka (a missing topic) stop the order of
    /// acknowledgements: the rules behind them are `BlockedByRule` naming that rule and why,
    /// once the wait is as long as the one that makes the rule itself `Stalled`; not before (a
    /// broker's hiccup flips nobody), and nothing is written again while the stall lasts.
    #[test]
    fn the_rules_behind_records_waiting_on_kafka_are_blocked_once_the_wait_is_a_stall() {
        let mut bad = rule(0, 0.0, None);
        bad.name = "bad".into();
        bad.waiting = Some(ferry_api::status::Waiting {
            reason: "unknown_topic".into(),
            message: "kafka topic missing: Broker: Unknown topic or partition".into(),
            since: at(50),
        });
        let mut good = rule(999, 0.0, None);
        good.name = "good".into();
        good.blocked_by = Some(BlockedBy {
            rules: vec!["bad".into()],
            messages: 1000,
            since: at(50),
            waiting: Some("unknown_topic".into()),
        });
        let mut both = report(true, true, None);
        both.rules = vec![bad, good];
        let reports = vec![("p-0".to_owned(), both)];
        let forwarding = |name, now| {
            let (s, _) = rule_data(None, name, &reports, now);
            let c = condition(&s.conditions, FORWARDING).unwrap().clone();
            (s, c)
        };
        let soon = at(50) + STALLED_AFTER - SignedDuration::from_secs(1);
        for name in ["bad", "good"] {
            let (_, c) = forwarding(name, soon);
            assert_eq!(c.status, TRUE, "{name} before the wait is a stall: {c:?}");
        }
        let later = at(50) + STALLED_AFTER;
        let (_, c) = forwarding("bad", later);
        assert_eq!((c.status.as_str(), c.reason.as_str()), (FALSE, "Stalled"));
        let (blocked, c) = forwarding("good", later);
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            (FALSE, BLOCKED_BY_RULE)
        );
        for part in ["p-0", "rule bad", "unknown_topic"] {
            assert!(c.message.contains(part), "{part} in {}", c.message);
        }
        let mut more = reports.clone();
        if let Some(b) = more[0].1.rules[1].blocked_by.as_mut() {
            b.messages = 1000;
        }
        let (again, t) = rule_data(Some(&blocked), "good", &more, later + STALLED_AFTER);
        assert!(t.is_empty(), "{t:?}");
        assert_eq!(again.conditions, blocked.conditions);
    }

    #[test]
    fn a_held_record_and_the_rules_behind_it_are_not_ready_with_their_own_reasons() {
        let mut images = rule(0, 0.0, None);
        images.name = "images".into();
        images.held = Some(Held {
            reason: "too_large".into(),
            mqtt_topic: "cam/1".into(),
            size: 5000,
            kafka_topic: Some("images".into()),
            dead_letter: false,
            error: "kafka topic images: Broker: Message size too large".into(),
            records: 1,
            since: at(50),
        });
        let mut telemetry = rule(10, 1.0, None);
        telemetry.blocked_by = Some(ferry_api::status::BlockedBy {
            rules: vec!["images".into()],
            messages: 10,
            since: at(50),
            waiting: None,
        });
        let mut both = report(true, true, Some(images.clone()));
        both.rules.push(telemetry.clone());
        let reports = vec![("p-0".to_owned(), both)];
        let (held, _) = rule_data(None, "images", &reports, at(60));
        let c = condition(&held.conditions, FORWARDING).unwrap();
        assert_eq!((c.status.as_str(), c.reason.as_str()), (FALSE, HELD));
        for part in [
            "p-0",
            "too_large",
            "cam/1",
            "5000 bytes",
            "Kafka topic images",
            "deadLetter",
        ] {
            assert!(c.message.contains(part), "{part} in {}", c.message);
        }
        let (blocked, _) = rule_data(None, "telemetry", &reports, at(60));
        let c = condition(&blocked.conditions, FORWARDING).unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            (FALSE, BLOCKED_BY_RULE)
        );
        assert!(c.message.contains("rule images"), "{}", c.message);

        // The same record held later (its count grew, time passed): nothing to write.
        let mut more = reports.clone();
        if let Some(h) = more[0].1.rules[0].held.as_mut() {
            h.records = 3;
        }
        if let Some(b) = more[0].1.rules[1].blocked_by.as_mut() {
            b.messages = 500;
        }
        let (held_later, t) = rule_data(Some(&held), "images", &more, at(90));
        assert!(t.is_empty());
        assert_eq!(held_later.conditions, held.conditions);
        let (blocked_later, t) = rule_data(Some(&blocked), "telemetry", &more, at(90));
        assert!(t.is_empty());
        assert_eq!(blocked_later.conditions, blocked.conditions);

        // Ready follows with the same reasons (what the REASON column shows).
        let rendered = RuleOutcome::Rendered {
            workload: workload(1, 1),
            paused: false,
        };
        for (status, reason) in [(&held, HELD), (&blocked, BLOCKED_BY_RULE)] {
            let (s, _) = rule_control(Some(status), Some(1), &rendered, at(60));
            let ready = condition(&s.conditions, READY).unwrap();
            assert_eq!(
                (ready.status.as_str(), ready.reason.as_str()),
                (FALSE, reason)
            );
        }

        // A dead-letter copy refused too says so.
        let mut refused = reports.clone();
        if let Some(h) = refused[0].1.rules[0].held.as_mut() {
            h.dead_letter = true;
            h.kafka_topic = Some("dlq".into());
        }
        let (s, _) = rule_data(None, "images", &refused, at(60));
        let c = condition(&s.conditions, FORWARDING).unwrap();
        assert!(
            c.message.contains("dead-letter topic dlq refused"),
            "{}",
            c.message
        );
    }

    #[test]
    fn data_plane_sums_pods_and_picks_the_worst_condition() {
        let reports = vec![
            (
                "p-0".to_owned(),
                report(true, true, Some(rule(10, 1.234, None))),
            ),
            (
                "p-1".to_owned(),
                report(true, true, Some(rule(20, 2.0, None))),
            ),
        ];
        let (s, _) = rule_data(None, "telemetry", &reports, at(100));
        assert_eq!(s.forwarded, Some(30));
        assert_eq!(
            (s.filtered, s.dead_lettered, s.failed),
            (Some(6), Some(3), Some(3))
        );
        assert_eq!(s.rate_per_second, Some(3.23));
        assert_eq!(s.last_forwarded_at, Some(Time(at(20))));
        assert_eq!(condition(&s.conditions, FORWARDING).unwrap().status, TRUE);
        assert_eq!(rule_data_view(&s), s);

        let reports = vec![
            (
                "p-0".to_owned(),
                report(true, true, Some(rule(10, 1.0, None))),
            ),
            (
                "p-1".to_owned(),
                report(true, false, Some(rule(20, 2.0, None))),
            ),
        ];
        let (s, _) = rule_data(None, "telemetry", &reports, at(100));
        let c = condition(&s.conditions, FORWARDING).unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            (FALSE, "KafkaUnreachable")
        );
        assert!(c.message.contains("p-1") && c.message.contains("broker down"));
        assert_eq!(
            s.rate_per_second,
            Some(0.0),
            "not forwarding: RATE 0, not the last minute's average"
        );
        assert_eq!(s.forwarded, Some(30), "the counters stay");
    }

    #[test]
    fn recent_rule_error_degrades_and_an_old_one_does_not() {
        let reports = vec![(
            "p-0".to_owned(),
            report(true, true, Some(rule(10, 1.0, Some(90)))),
        )];
        let (s, _) = rule_data(None, "telemetry", &reports, at(100));
        assert_eq!(
            condition(&s.conditions, FORWARDING).unwrap().reason,
            "RecordsFailing"
        );
        assert_eq!(s.last_error.as_deref(), Some("record too large"));
        let (s, _) = rule_data(None, "telemetry", &reports, at(1000));
        assert_eq!(condition(&s.conditions, FORWARDING).unwrap().status, TRUE);
    }

    #[test]
    fn records_waiting_past_the_bound_stall_the_rule_naming_pod_and_reason() {
        let mut waiting = rule(10, 0.0, None);
        waiting.waiting = Some(ferry_api::status::Waiting {
            reason: "unknown_topic".into(),
            message: "kafka topic telemetry: unknown topic".into(),
            since: at(100),
        });
        let reports = vec![("p-0".to_owned(), report(true, true, Some(waiting)))];
        let before_bound = at(100) + STALLED_AFTER - SignedDuration::from_secs(1);
        let (s, _) = rule_data(None, "telemetry", &reports, before_bound);
        assert_eq!(condition(&s.conditions, FORWARDING).unwrap().status, TRUE);
        let (s, _) = rule_data(None, "telemetry", &reports, at(100) + STALLED_AFTER);
        let c = condition(&s.conditions, FORWARDING).unwrap();
        assert_eq!((c.status.as_str(), c.reason.as_str()), (FALSE, "Stalled"));
        assert!(
            c.message.contains("p-0")
                && c.message.contains("unknown_topic")
                && c.message.contains("kafka topic telemetry"),
            "{}",
            c.message
        );
        // An unreachable Kafka explains the wait better than the wait itself.
        let mut down = reports.clone();
        down[0].1.kafka.reachable = false;
        let (s, _) = rule_data(None, "telemetry", &down, at(1000));
        assert_eq!(
            condition(&s.conditions, FORWARDING).unwrap().reason,
            "KafkaUnreachable"
        );
    }

    #[test]
    fn a_refused_subscription_fails_its_rule_naming_filters_and_reason() {
        let mut refused = rule(10, 0.0, None);
        refused.subscription_refused = Some(ferry_api::status::SubscriptionRefused {
            filters: vec!["secret/#".into()],
            reason: "not authorized (0x87)".into(),
            since: at(100),
        });
        let reports = vec![("p-0".to_owned(), report(true, true, Some(refused)))];
        let (s, _) = rule_data(None, "telemetry", &reports, at(101));
        let c = condition(&s.conditions, FORWARDING).unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            (FALSE, SUBSCRIPTION_REFUSED)
        );
        assert!(
            c.message.contains("p-0")
                && c.message.contains("secret/#")
                && c.message.contains("not authorized (0x87)"),
            "{}",
            c.message
        );
        assert!(
            BLOCKING_REASONS.contains(&SUBSCRIPTION_REFUSED),
            "Ready follows"
        );
        // The same refusal later: the same condition, nothing to write.
        let (later, _) = rule_data(Some(&s), "telemetry", &reports, at(500));
        assert_eq!(later.conditions, s.conditions);
    }

    #[test]
    fn ready_follows_the_data_plane_when_data_is_not_flowing() {
        let rendered = RuleOutcome::Rendered {
            workload: workload(2, 2),
            paused: false,
        };
        let (ready, _) = rule_control(None, Some(1), &rendered, at(1));
        assert_eq!(condition(&ready.conditions, READY).unwrap().status, TRUE);

        let down = vec![(
            "p-0".to_owned(),
            report(true, false, Some(rule(1, 0.0, None))),
        )];
        let (data, _) = rule_data(Some(&ready), "telemetry", &down, at(2));
        assert!(ready_affected(&ready, &data));
        let mut both = ready.clone();
        both.conditions.extend(data.conditions.clone());
        let (s, t) = rule_control(Some(&both), Some(1), &rendered, at(3));
        let c = condition(&s.conditions, READY).unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            (FALSE, "KafkaUnreachable")
        );
        assert!(c.message.contains("broker down") && c.message.contains("2/2"));
        assert_eq!(t.len(), 1, "one transition: Ready went False");

        // A Ready written from an older Forwarding is stale until the reconcile runs again.
        let with_forwarding = |control: &ForwardingRuleStatus, data: &ForwardingRuleStatus| {
            let mut whole = control.clone();
            whole.conditions.retain(|c| c.type_ != FORWARDING);
            whole.conditions.extend(
                data.conditions
                    .iter()
                    .filter(|c| c.type_ == FORWARDING)
                    .cloned(),
            );
            whole
        };
        assert!(
            !ready_stale(&with_forwarding(&s, &data)),
            "Ready False KafkaUnreachable from Forwarding False: agrees"
        );
        let up = vec![(
            "p-0".to_owned(),
            report(true, true, Some(rule(1, 0.0, None))),
        )];
        let (data_up, _) = rule_data(Some(&s), "telemetry", &up, at(4));
        let recovered = with_forwarding(&s, &data_up);
        assert!(
            ready_stale(&recovered),
            "Forwarding True again, Ready still KafkaUnreachable"
        );
        let (fixed, _) = rule_control(Some(&recovered), Some(1), &rendered, at(5));
        assert!(
            !ready_stale(&with_forwarding(&fixed, &data_up)),
            "reconciled: agrees again"
        );
        assert!(
            ready_stale(&with_forwarding(&ready, &data)),
            "Ready True while Forwarding says KafkaUnreachable"
        );

        // Records failing now and then: still Ready.
        let failing = vec![(
            "p-0".to_owned(),
            report(true, true, Some(rule(1, 0.0, Some(2)))),
        )];
        let (data, _) = rule_data(Some(&ready), "telemetry", &failing, at(3));
        assert!(!ready_affected(&ready, &data));
        let mut both = ready.clone();
        both.conditions.extend(data.conditions);
        let (s, _) = rule_control(Some(&both), Some(1), &rendered, at(4));
        assert_eq!(condition(&s.conditions, READY).unwrap().status, TRUE);

        // Paused says paused, whatever the data plane last said.
        let paused = RuleOutcome::Rendered {
            workload: workload(0, 0),
            paused: true,
        };
        let mut stale = ready.clone();
        stale.conditions.extend(
            rule_data(Some(&ready), "telemetry", &down, at(2))
                .0
                .conditions,
        );
        let (s, _) = rule_control(Some(&stale), Some(1), &paused, at(5));
        assert_eq!(condition(&s.conditions, READY).unwrap().reason, "Paused");
    }

    #[test]
    fn no_reports_is_unknown() {
        let (s, _) = rule_data(None, "telemetry", &[], at(1));
        assert_eq!(
            condition(&s.conditions, FORWARDING).unwrap().status,
            UNKNOWN
        );
        assert!(s.forwarded.is_none() && s.rate_per_second.is_none());
        let reports = vec![("p-0".to_owned(), report(true, true, None))];
        let (s, _) = rule_data(None, "telemetry", &reports, at(1));
        assert_eq!(
            condition(&s.conditions, FORWARDING).unwrap().reason,
            "NoReport"
        );
    }

    #[test]
    fn moving_counters_wait_for_the_interval_and_a_condition_change_does_not() {
        let pod = |forwarded, connected| {
            (
                "p-0".to_owned(),
                report(connected, true, Some(rule(forwarded, 5.0, None))),
            )
        };
        let minute = SignedDuration::from_secs(60);
        let (first, _) = rule_data(None, "telemetry", &[pod(10, true)], at(100));
        let due = |current: &ForwardingRuleStatus, desired, last: Option<i64>, now| {
            data_write_due(current, desired, last.map(at), at(now), minute)
        };
        let empty = ForwardingRuleStatus::default();
        assert!(due(&empty, &first, None, 100), "the first report");
        assert!(!due(&first, &first, Some(100), 500), "nothing changed");

        let (moved, _) = rule_data(Some(&first), "telemetry", &[pod(20, true)], at(101));
        assert_ne!(moved, first);
        assert!(!due(&first, &moved, Some(100), 101), "counters moved: wait");
        assert!(
            !due(&first, &moved, Some(100), 159),
            "still within the interval"
        );
        assert!(
            due(&first, &moved, Some(100), 160),
            "the interval has passed"
        );
        assert!(
            due(&first, &moved, None, 101),
            "no write remembered (a restart)"
        );

        let (down, _) = rule_data(Some(&first), "telemetry", &[pod(20, false)], at(101));
        assert!(
            due(&first, &down, Some(100), 101),
            "MqttDisconnected: at once"
        );
        let (gone, _) = rule_data(Some(&first), "telemetry", &[], at(101));
        assert!(due(&first, &gone, Some(100), 101), "no report: at once");
    }
}
