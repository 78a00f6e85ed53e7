//! What the status of each object should say, as pure functions of what reconcile saw.
//!
//! Two writers share a ForwardingRule's status, each under its own field manager so
//! server-side apply never lets one erase the other's fields: the reconciler (`Accepted`,
//! `Ready`, workload, ready replicas) and the data-plane poller (`Forwarding`, counters from
//! the forwarder pods' `/status`).

use ferry_api::crd::{BoundedString, BrokerConnectionStatus, ForwardingRule, ForwardingRuleStatus};
use ferry_api::status::{BlockedBy, ForwarderStatus, Held, LastError, RuleStatus};
use std::collections::BTreeSet;

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::Resource;

use crate::conditions::{Desired, FALSE, TRUE, Transition, UNKNOWN, merge, owned};
use crate::handover::{Move, MovePhase};
use crate::render::workload_name;
use crate::validate::{MissingSecret, Unresolved};

pub const ACCEPTED: &str = "Accepted";
pub const READY: &str = "Ready";
pub const FORWARDING: &str = "Forwarding";
pub const SECRETS_RESOLVED: &str = "SecretsResolved";
/// True while the rule moves to another group (see [`moving`]).
pub const MOVING: &str = "Moving";

/// Condition types the reconciler writes on a rule.
pub const RULE_CONTROL_TYPES: [&str; 3] = [ACCEPTED, READY, MOVING];
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
/// Some forwarder pod serving the rule's group has not subscribed its current filters yet (a
/// rule just added or changed, before the kubelet synced the ConfigMap and the broker's
/// SUBACK): what is published to them now may reach no one.
pub const SUBSCRIBING: &str = "Subscribing";

/// `Forwarding` reasons that also make the rule not `Ready`: data is not flowing. (A record
/// dead-lettered now and then, `RecordsFailing`, is worth a condition but the rule still
/// forwards.)
pub const BLOCKING_REASONS: [&str; 7] = [
    "MqttDisconnected",
    "KafkaUnreachable",
    SUBSCRIPTION_REFUSED,
    HELD,
    BLOCKED_BY_RULE,
    "Stalled",
    SUBSCRIBING,
];

/// `Forwarding` reasons found only once every serving pod has subscribed the rule's filters
/// (they come after [`SUBSCRIBING`] in [`forwarding`]'s order).
const AFTER_SUBSCRIBED: [&str; 4] = [HELD, BLOCKED_BY_RULE, "Stalled", "RecordsFailing"];

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

/// `Ready` False while the group has no forwarder pod ready.
const FORWARDER_NOT_READY: &str = "ForwarderNotReady";
/// The `Moving` reason once the rule's new group serves it alone (the condition then goes).
pub const MOVED: &str = "Moved";

/// The reconciler's part of a rule's status, for a caller that cannot read the rule's spec:
/// what the data plane said of another generation never makes it `Ready` (see
/// [`rule_control_for`]).
pub fn rule_control(
    current: Option<&ForwardingRuleStatus>,
    generation: Option<i64>,
    outcome: &RuleOutcome,
    now: Timestamp,
) -> (ForwardingRuleStatus, Vec<Transition>) {
    control(current, generation, outcome, (false, None), now)
}

/// The reconciler's part of `rule`'s status: `Accepted`, `Ready` (True once every serving pod
/// of its group has subscribed its current filters, see `ready`), `Moving` while `step` says
/// it is on its way to another group, its workload and the columns `kubectl get fr` prints.
pub fn rule_control_for(
    rule: &ForwardingRule,
    outcome: &RuleOutcome,
    step: Option<&Move>,
    now: Timestamp,
) -> (ForwardingRuleStatus, Vec<Transition>) {
    let current = rule.status.as_ref();
    let topics = column(rule.spec.mqtt.topics.iter().map(|t| t.0.as_str()));
    // What the data plane said of an earlier generation holds while the filters are the ones
    // it was about (`mqttTopics` is what this writer rendered last).
    let same_filters = current.is_some_and(|s| s.mqtt_topics == topics);
    let moving = step.map(|m| moving(&rule.spec.connection_ref.name, &rule.spec.group, m));
    let generation = rule.meta().generation;
    let (mut status, transitions) =
        control(current, generation, outcome, (same_filters, moving), now);
    status.mqtt_topics = topics;
    let kafka = &rule.spec.kafka;
    status.kafka_topic = kafka
        .topic
        .clone()
        .or_else(|| kafka.topic_expression.clone());
    (status, transitions)
}

/// [`rule_control_for`] from its parts: whether the rule's filters are those last rendered,
/// and its `Moving` condition if it moves.
fn control(
    current: Option<&ForwardingRuleStatus>,
    generation: Option<i64>,
    outcome: &RuleOutcome,
    (same_filters, moving): (bool, Option<Desired>),
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
    let (mut desired, workload) = match outcome {
        RuleOutcome::Rendered { workload, paused } => {
            let ready = ready(current, generation, workload, *paused, same_filters);
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
    desired.extend(moving);
    let previous = current.map(|s| s.conditions.as_slice()).unwrap_or_default();
    let (conditions, mut transitions) = merge(previous, &desired, generation, now);
    let served_by = workload.map(|w| w.name.as_str());
    transitions.extend(move_step(previous, desired.last(), served_by));
    let status = ForwardingRuleStatus {
        observed_generation: generation,
        conditions,
        workload: workload.map(|w| w.name.clone()),
        ready_replicas: workload.map(Workload::pods),
        ..ForwardingRuleStatus::default()
    };
    (status, transitions)
}

/// A rendered rule's `Ready`: True once the data plane says every pod serving its group has
/// subscribed its current filters (what is published now reaches a forwarder) and nothing
/// stops its data. How many of the group's pods are ready is in the message and
/// `readyReplicas`, not in the verdict: a pod still starting (a scale-up, a restart) serves
/// nothing yet, so it holds nothing up.
fn ready(
    current: Option<&ForwardingRuleStatus>,
    generation: Option<i64>,
    workload: &Workload,
    paused: bool,
    same_filters: bool,
) -> Desired {
    let pods = workload.pods();
    if paused {
        return Desired::new(
            READY,
            FALSE,
            "Paused",
            "spec.paused is true: not subscribed",
        );
    }
    if workload.wanted == 0 {
        return Desired::new(
            READY,
            FALSE,
            "ScaledToZero",
            "the group's StatefulSet has 0 replicas (the connection's spec.forwarder.replicas or groups, or an autoscaler)",
        );
    }
    let not_ready = || {
        let message = format!("{pods} forwarder pods ready");
        Desired::new(READY, FALSE, FORWARDER_NOT_READY, message)
    };
    match data_plane(current, generation, same_filters) {
        DataPlane::Blocked(SUBSCRIBING, _) if workload.ready == 0 => not_ready(),
        DataPlane::Blocked(reason, message) => Desired::new(
            READY,
            FALSE,
            reason,
            format!("{message} ({pods} forwarder pods ready)"),
        ),
        DataPlane::Flowing => Desired::new(
            READY,
            TRUE,
            "ForwarderReady",
            format!(
                "{pods} forwarder pods ready; every pod serving the group has subscribed its filters"
            ),
        ),
        DataPlane::Waiting(_) if workload.ready == 0 => not_ready(),
        DataPlane::Waiting(why) => Desired::new(
            READY,
            FALSE,
            SUBSCRIBING,
            format!(
                "waiting for the forwarder pods to report its filters subscribed{} ({pods} forwarder pods ready)",
                why.map(|w| format!(": {w}")).unwrap_or_default()
            ),
        ),
    }
}

/// What the data plane's `Forwarding` condition says for a rule's `Ready`.
#[derive(Debug, PartialEq)]
enum DataPlane<'a> {
    /// Every serving pod has subscribed the rule's filters, and nothing stops its data.
    Flowing,
    /// Data does not flow: one of [`BLOCKING_REASONS`], and its message.
    Blocked(&'static str, &'a str),
    /// Nothing said of this generation yet (a rule just added, its spec just changed), or the
    /// pods could not be asked (the message, if any).
    Waiting(Option<&'a str>),
}

/// The data plane's word on generation `generation` of the rule, from its status. A
/// `Forwarding` written for another generation counts only for a `Ready` already True for
/// this generation or for filters that did not change (`same_filters`); so does one saying the
/// pods could not be asked: nothing says that data stopped.
fn data_plane(
    current: Option<&ForwardingRuleStatus>,
    generation: Option<i64>,
    same_filters: bool,
) -> DataPlane<'_> {
    let Some(status) = current else {
        return DataPlane::Waiting(None);
    };
    if let Some((reason, message)) = blocked(Some(status)) {
        return DataPlane::Blocked(reason, message);
    }
    let Some(forwarding) = condition(&status.conditions, FORWARDING) else {
        return DataPlane::Waiting(None);
    };
    let kept = condition(&status.conditions, READY)
        .is_some_and(|r| r.status == TRUE && (r.observed_generation == generation || same_filters));
    // None: written by an operator from before `Forwarding` said which generation it is about.
    let this_generation =
        forwarding.observed_generation.is_none() || forwarding.observed_generation == generation;
    if kept || (this_generation && forwarding.status != UNKNOWN) {
        DataPlane::Flowing
    } else if forwarding.status == UNKNOWN {
        DataPlane::Waiting(Some(&forwarding.message))
    } else {
        DataPlane::Waiting(None)
    }
}

/// The `Moving` condition of a rule on its way from group `step.from` to group `to` (its
/// `spec.group`) of `connection`: True, its reason the move's step, its message naming both
/// workloads and what the move waits for.
pub fn moving(connection: &str, to: &str, step: &Move) -> Desired {
    let from: Vec<String> = step
        .from
        .iter()
        .map(|g| workload_name(connection, g))
        .collect();
    let from = from.join(", ");
    let to = workload_name(connection, to);
    match step.phase {
        MovePhase::Subscribing => Desired::new(
            MOVING,
            TRUE,
            SUBSCRIBING,
            format!(
                "moving from StatefulSet {from} to {to}: {from} serves it until every pod of {to} has subscribed its filters"
            ),
        ),
        MovePhase::HandingOver => Desired::new(
            MOVING,
            TRUE,
            "HandingOver",
            format!(
                "moving from StatefulSet {from} to {to}: {to} serves it; {from}'s pods forward what their sessions still hold for it, then drop it"
            ),
        ),
    }
}

/// The Events of a move the conditions' merge does not give: its next step (the condition
/// stays True), and its end (the condition goes; `served_by` the workload serving it now).
fn move_step(
    previous: &[Condition],
    desired: Option<&Desired>,
    served_by: Option<&str>,
) -> Option<Transition> {
    let was = condition(previous, MOVING).filter(|c| c.status == TRUE)?;
    match desired.filter(|d| d.type_ == MOVING) {
        Some(d) if d.reason != was.reason => Some(Transition {
            type_: MOVING.to_owned(),
            status: TRUE.to_owned(),
            reason: d.reason.to_owned(),
            message: d.message.clone(),
            first: false,
        }),
        Some(_) => None,
        None => Some(Transition {
            type_: MOVING.to_owned(),
            status: FALSE.to_owned(),
            reason: MOVED.to_owned(),
            message: match served_by {
                Some(w) => format!("moved: served by StatefulSet {w} alone"),
                None => "the move ended".to_owned(),
            },
            first: false,
        }),
    }
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

/// Whether a change of a rule's `Forwarding` condition from `before` to `after` may change
/// what its `Ready` condition says (the reconciler then has to run for it): what blocks the
/// data (and its message, which `Ready` repeats), whether the pods answered, and which
/// generation it is about.
pub fn ready_affected(before: &ForwardingRuleStatus, after: &ForwardingRuleStatus) -> bool {
    verdict(before) != verdict(after)
}

/// What of a rule's `Forwarding` its `Ready` depends on (see [`ready_affected`]).
type Verdict<'a> = Option<(Option<(&'static str, &'a str)>, bool, Option<i64>)>;

fn verdict(status: &ForwardingRuleStatus) -> Verdict<'_> {
    let c = condition(&status.conditions, FORWARDING)?;
    Some((
        blocked(Some(status)),
        c.status == UNKNOWN,
        c.observed_generation,
    ))
}

/// Whether a rule's `Ready` disagrees with its `Forwarding`: the reconcile that wrote `Ready`
/// read an older `Forwarding` (the data plane's write had not reached its cache yet), and
/// nothing else would make it run again. The data-plane poll then asks for it again. Only what
/// the data plane decides counts (not `Paused`, `ScaledToZero`, `NotAccepted`), judged as
/// `ready` would for the generation `Ready` was written for.
pub fn ready_stale(status: &ForwardingRuleStatus) -> bool {
    let Some(ready) = condition(&status.conditions, READY) else {
        return false;
    };
    let reason = ready.reason.as_str();
    let decided_by_data_plane =
        ready.status == TRUE || reason == FORWARDER_NOT_READY || BLOCKING_REASONS.contains(&reason);
    let waiting = ready.status == FALSE && (reason == SUBSCRIBING || reason == FORWARDER_NOT_READY);
    let agrees = match data_plane(Some(status), ready.observed_generation, false) {
        DataPlane::Flowing => ready.status == TRUE,
        DataPlane::Blocked(SUBSCRIBING, _) => waiting,
        DataPlane::Blocked(blocking, _) => ready.status == FALSE && reason == blocking,
        DataPlane::Waiting(_) => waiting,
    };
    decided_by_data_plane && !agrees
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

/// A forwarder pod of a rule's group, as one poll saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct PodSeen {
    pub name: String,
    /// Its kubelet reports it Ready: a forwarder's readiness latches once it has subscribed
    /// and reached Kafka, through later outages.
    pub ready: bool,
    /// Its `/status`, if it answered this poll.
    pub report: Option<ForwarderStatus>,
}

impl PodSeen {
    /// Whether messages reach it and its state counts: its kubelet says Ready (it subscribed
    /// and reached Kafka since it started), and it does not drain (it gave up its
    /// subscriptions on purpose). `none_ready`: no pod of its group is Ready (all starting, or
    /// their readiness not reported yet); then one connected with the broker's SUBACK in
    /// serves too.
    fn serves(&self, none_ready: bool) -> bool {
        match &self.report {
            Some(r) => {
                r.drain.is_none()
                    && (self.ready || (none_ready && r.mqtt.connected && r.mqtt.subscribed))
            }
            None => self.ready,
        }
    }

    /// Whether its report counts for the rule's conditions: it is Ready, or drains
    /// (forwarding what its session holds). `none_ready`: no pod of its group is Ready; then
    /// one that got as far as both brokers counts, and so does one that failed to (it says why
    /// none starts), but not one still quietly starting.
    fn counts(&self, none_ready: bool) -> bool {
        let Some(r) = &self.report else {
            return false;
        };
        if r.drain.is_some() || (self.ready && !none_ready) {
            return true;
        }
        let failed = r.mqtt.last_error.is_some() || r.kafka.last_error.is_some();
        none_ready && (failed || (r.mqtt.connected && r.mqtt.subscribed && r.kafka.reachable))
    }
}

/// Whether no pod of `pods` is Ready (see [`PodSeen::serves`]).
fn none_ready<'a>(mut pods: impl Iterator<Item = &'a PodSeen>) -> bool {
    !pods.any(|p| p.ready && p.report.as_ref().is_none_or(|r| r.drain.is_none()))
}

/// What one poll saw of a rule's data plane.
#[derive(Debug, Clone, Copy)]
pub struct RuleSeen<'a> {
    /// The rule's name in the forwarder config.
    pub name: &'a str,
    /// The rule's `metadata.generation`, whose filters [`RuleSeen::stale`] is about.
    pub generation: Option<i64>,
    /// The pods of each group serving the rule: its own group, then, while it moves, the one
    /// it leaves (either one subscribed throughout is enough).
    pub groups: &'a [&'a [PodSeen]],
    /// Pods whose config may still have the rule's earlier filters: they have not loaded a
    /// config since the filters changed (a report names the rule, not its filters).
    pub stale: &'a BTreeSet<String>,
}

/// The data-plane part of one rule's status from what a poll saw of its pods. Its
/// `Forwarding` condition carries the rule's generation: `Ready` counts only what the data
/// plane said of the filters the rule has now (see `data_plane`).
pub fn rule_data(
    current: Option<&ForwardingRuleStatus>,
    seen: &RuleSeen<'_>,
    now: Timestamp,
) -> (ForwardingRuleStatus, Vec<Transition>) {
    let pods = seen.groups.iter().flat_map(|g| g.iter());
    // Counters of every pod that has the rule, serving yet or not.
    let all: Vec<Loaded<'_>> = with_rule(pods.clone(), seen.name);
    // A pod still starting (not Ready: it has not reached both brokers yet) says nothing of a
    // rule: the others serve it, or nobody does yet.
    let none_ready = none_ready(pods.clone());
    let loaded: Vec<Loaded<'_>> =
        with_rule(pods.clone().filter(|p| p.counts(none_ready)), seen.name);
    let no_reports = pods.clone().all(|p| p.report.is_none());
    let recent_error = all
        .iter()
        .filter_map(|(_, _, r)| r.last_error.as_ref())
        .max_by_key(|e| e.at);
    let subscribed = subscription(current, seen);
    let condition = forwarding(no_reports, &loaded, &subscribed, recent_error, now);
    // The pods' rates are averages over their last minute: while the data plane is known not
    // to forward, RATE says 0 at once rather than the minute before the outage. Pods still
    // subscribing hold up no one already forwarding.
    let flowing = !(condition.status == FALSE
        && condition.reason != SUBSCRIBING
        && BLOCKING_REASONS.contains(&condition.reason));
    let previous = current.map(|s| s.conditions.as_slice()).unwrap_or_default();
    let (conditions, transitions) = merge(previous, &[condition], seen.generation, now);
    // Summed over the pods that report the rule; absent while none does.
    let total = |count: fn(&RuleStatus) -> u64| {
        let sum: u64 = all.iter().map(|(_, _, r)| count(r)).sum();
        (!all.is_empty()).then(|| i64::try_from(sum).unwrap_or(i64::MAX))
    };
    let rate: f64 = all.iter().map(|(_, _, r)| r.rate_per_second).sum();
    let status = ForwardingRuleStatus {
        conditions,
        forwarded: total(|r| r.forwarded),
        filtered: total(|r| r.filtered),
        dead_lettered: total(|r| r.dead_lettered),
        failed: total(|r| r.failed),
        // Two decimals: a rate that moves in the noise should not rewrite the status.
        rate_per_second: (!all.is_empty()).then(|| {
            if flowing {
                (rate * 100.0).round() / 100.0
            } else {
                0.0
            }
        }),
        last_forwarded_at: all
            .iter()
            .filter_map(|(_, _, r)| r.last_forwarded_at)
            .max()
            .map(|t| Time(Timestamp::from_second(t.as_second()).unwrap_or(t))),
        last_error: recent_error.map(|e| e.message.clone()),
        // The newest any pod uses (pods pick up a new latest version within minutes).
        schema: all
            .iter()
            .filter_map(|(_, _, r)| r.schema.as_ref())
            .max_by_key(|s| (s.version, s.id))
            .cloned(),
        ..ForwardingRuleStatus::default()
    };
    (status, transitions)
}

/// The reports of `pods` that have rule `rule` loaded.
fn with_rule<'a>(pods: impl Iterator<Item = &'a PodSeen>, rule: &str) -> Vec<Loaded<'a>> {
    pods.filter_map(|p| {
        let report = p.report.as_ref()?;
        Some((p.name.as_str(), report, report.rule(rule)?))
    })
    .collect()
}

/// Whether the pods serving a rule have subscribed its current filters.
#[derive(Debug, Clone, PartialEq)]
enum Subscription {
    /// Every pod serving one of its groups has (this many serve it).
    Complete(usize),
    /// Not yet: how many have, and what the others wait for.
    Incomplete(String),
}

/// How far one group's serving pods are with a rule's filters.
struct GroupSubscription<'a> {
    serving: usize,
    subscribed: usize,
    /// Serving pods that lack them, and why.
    lacking: Vec<(&'a str, String)>,
    /// Serving (Ready) pods that did not answer: they may have them or not.
    unanswered: Vec<&'a str>,
}

/// A rule's [`Subscription`]: complete once every pod serving one of its groups reports its
/// filters subscribed, from a config that has its current filters. A pod that did not answer
/// changes nothing: the rule stays as the last poll found it, if that was for this generation.
fn subscription(current: Option<&ForwardingRuleStatus>, seen: &RuleSeen<'_>) -> Subscription {
    let groups: Vec<GroupSubscription<'_>> = seen
        .groups
        .iter()
        .map(|pods| group_subscription(seen, pods))
        .collect();
    if let Some(g) = groups
        .iter()
        .find(|g| g.serving > 0 && g.subscribed == g.serving)
    {
        return Subscription::Complete(g.subscribed);
    }
    let confirmed = current
        .and_then(|s| condition(&s.conditions, FORWARDING))
        .is_some_and(|c| {
            c.observed_generation == seen.generation
                && (c.status == TRUE || AFTER_SUBSCRIBED.contains(&c.reason.as_str()))
        });
    if let Some(g) = groups
        .iter()
        .find(|g| confirmed && g.subscribed > 0 && g.lacking.is_empty())
    {
        return Subscription::Complete(g.serving);
    }
    let Some(g) = groups.first() else {
        return Subscription::Incomplete("the rule has no group".to_owned());
    };
    if g.serving == 0 {
        return Subscription::Incomplete(
            "no forwarder pod of its group serves yet (none is ready or subscribed)".to_owned(),
        );
    }
    let waiting: Vec<String> = g
        .lacking
        .iter()
        .map(|(pod, why)| format!("{pod} ({why})"))
        .chain(
            g.unanswered
                .iter()
                .map(|pod| format!("{pod} (did not answer GET /status)")),
        )
        .collect();
    Subscription::Incomplete(format!(
        "{} of {} forwarder pods serving its group have subscribed its filters; waiting for {}",
        g.subscribed,
        g.serving,
        few(&waiting)
    ))
}

/// The first three of `items`, then how many more.
fn few(items: &[String]) -> String {
    const SHOWN: usize = 3;
    let mut text = items
        .iter()
        .take(SHOWN)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if items.len() > SHOWN {
        text.push_str(&format!(" and {} more", items.len() - SHOWN));
    }
    text
}

fn group_subscription<'a>(seen: &RuleSeen<'_>, pods: &'a [PodSeen]) -> GroupSubscription<'a> {
    let mut g = GroupSubscription {
        serving: 0,
        subscribed: 0,
        lacking: Vec::new(),
        unanswered: Vec::new(),
    };
    let none_ready = none_ready(pods.iter());
    for pod in pods.iter().filter(|p| p.serves(none_ready)) {
        g.serving += 1;
        let name = pod.name.as_str();
        let Some(report) = &pod.report else {
            g.unanswered.push(name);
            continue;
        };
        let why = match report.rule(seen.name) {
            None => match &report.config.reload_error {
                Some(e) => format!("its config reload was refused: {}", e.message),
                None => "has not loaded the rule yet".to_owned(),
            },
            Some(_) if seen.stale.contains(name) => "has not loaded its new filters yet".to_owned(),
            Some(r) if r.subscribed => {
                g.subscribed += 1;
                continue;
            }
            Some(_) if !report.mqtt.connected => "not connected to MQTT".to_owned(),
            Some(_) => "loaded it; the broker has not granted its filters yet".to_owned(),
        };
        g.lacking.push((name, why));
    }
    g
}

/// One pod's report that has the rule loaded: (pod name, whole report, the rule's part).
type Loaded<'a> = (&'a str, &'a ForwarderStatus, &'a RuleStatus);

/// The rule's `Forwarding` condition: the first problem found, in the order a reader would
/// look for it (no report, MQTT, Kafka, its filters not subscribed everywhere, a stalled
/// window, failing records), else True.
fn forwarding(
    no_reports: bool,
    loaded: &[Loaded<'_>],
    subscribed: &Subscription,
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
    } else if let Subscription::Incomplete(message) = subscribed {
        Desired::new(FORWARDING, FALSE, SUBSCRIBING, message.clone())
    } else {
        after_subscribed(loaded, subscribed, recent_error, now)
    }
}

/// [`forwarding`] once the rule's filters are subscribed: a held record, a wait behind
/// another rule, a stalled window, failing records, else True.
fn after_subscribed(
    loaded: &[Loaded<'_>],
    subscribed: &Subscription,
    recent_error: Option<&LastError>,
    now: Timestamp,
) -> Desired {
    if let Some((pod, h)) = first(loaded, |r| r.held.as_ref()) {
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
        let pods = match subscribed {
            Subscription::Complete(n) => *n,
            Subscription::Incomplete(_) => loaded.len(),
        };
        Desired::new(
            FORWARDING,
            TRUE,
            "Forwarding",
            format!(
                "filters subscribed on every forwarder pod serving its group ({pods}); MQTT connected, Kafka reachable"
            ),
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

    /// A rule's status once the data plane found its filters subscribed on every pod serving
    /// its group (generation 1).
    fn subscribed_everywhere() -> ForwardingRuleStatus {
        let reports = vec![(
            "p-0".to_owned(),
            report(true, true, Some(rule(1, 0.0, None))),
        )];
        seen_data(None, "telemetry", &reports, at(0)).0
    }

    /// `Ready` waits for the data plane, not for every wanted pod: none ready is
    /// ForwarderNotReady, some ready but nothing reported is Subscribing, and a report of its
    /// filters subscribed is Ready whatever the count (a scale-up under way), which the message
    /// and `readyReplicas` keep showing.
    #[test]
    fn ready_waits_for_the_data_plane_not_for_every_wanted_pod() {
        let rendered = |ready, wanted| RuleOutcome::Rendered {
            workload: workload(ready, wanted),
            paused: false,
        };
        let (s, t) = rule_control(None, Some(1), &rendered(0, 2), at(10));
        assert_eq!(condition(&s.conditions, ACCEPTED).unwrap().status, TRUE);
        let ready = condition(&s.conditions, READY).unwrap();
        assert_eq!(
            (
                ready.status.as_str(),
                ready.reason.as_str(),
                ready.message.as_str()
            ),
            (FALSE, "ForwarderNotReady", "0/2 forwarder pods ready")
        );
        assert_eq!(s.workload.as_deref(), Some("plant-default"));
        assert_eq!(t.len(), 2);
        assert!(
            t.iter().all(|t| !t.noteworthy() || t.type_ == ACCEPTED),
            "pods starting is no news: {t:?}"
        );

        let (s, t) = rule_control(Some(&s), Some(1), &rendered(2, 2), at(20));
        let ready = condition(&s.conditions, READY).unwrap();
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str()),
            (FALSE, SUBSCRIBING),
            "pods ready, no word from them on the rule yet: {}",
            ready.message
        );
        assert!(t.is_empty(), "still False: {t:?}");

        let mut seen = subscribed_everywhere();
        seen.conditions.extend(s.conditions.clone());
        let (s, t) = rule_control(Some(&seen), Some(1), &rendered(1, 2), at(30));
        let ready = condition(&s.conditions, READY).unwrap();
        assert_eq!(ready.status, TRUE, "{}", ready.message);
        assert!(
            ready.message.contains("1/2 forwarder pods ready"),
            "{}",
            ready.message
        );
        assert_eq!(s.ready_replicas.as_deref(), Some("1/2"));
        assert_eq!(t.len(), 1, "only Ready changed");
        assert_eq!(rule_control_view(&s), s);
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
            Some(&subscribed_everywhere()),
            Some(1),
            &RuleOutcome::Rendered {
                workload: workload(1, 1),
                paused: false,
            },
            at(1),
        );
        assert_eq!(condition(&ready.conditions, READY).unwrap().status, TRUE);
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

    /// [`rule_data`] of rule `name` from `reports` of one group's Ready pods, for generation
    /// 1, no pod behind on the rule's filters.
    fn seen_data(
        current: Option<&ForwardingRuleStatus>,
        name: &str,
        reports: &[(String, ForwarderStatus)],
        now: Timestamp,
    ) -> (ForwardingRuleStatus, Vec<Transition>) {
        let pods: Vec<PodSeen> = reports
            .iter()
            .map(|(pod, r)| PodSeen {
                name: pod.clone(),
                ready: true,
                report: Some(r.clone()),
            })
            .collect();
        let groups = [pods.as_slice()];
        let seen = RuleSeen {
            name,
            generation: Some(1),
            groups: &groups,
            stale: &BTreeSet::new(),
        };
        rule_data(current, &seen, now)
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
            let (s, _) = seen_data(None, name, &reports, now);
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
        let (again, t) = seen_data(Some(&blocked), "good", &more, later + STALLED_AFTER);
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
        let (held, _) = seen_data(None, "images", &reports, at(60));
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
        let (blocked, _) = seen_data(None, "telemetry", &reports, at(60));
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
        let (held_later, t) = seen_data(Some(&held), "images", &more, at(90));
        assert!(t.is_empty());
        assert_eq!(held_later.conditions, held.conditions);
        let (blocked_later, t) = seen_data(Some(&blocked), "telemetry", &more, at(90));
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
        let (s, _) = seen_data(None, "images", &refused, at(60));
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
        let (s, _) = seen_data(None, "telemetry", &reports, at(100));
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
        let (s, _) = seen_data(None, "telemetry", &reports, at(100));
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
        let (s, _) = seen_data(None, "telemetry", &reports, at(100));
        assert_eq!(
            condition(&s.conditions, FORWARDING).unwrap().reason,
            "RecordsFailing"
        );
        assert_eq!(s.last_error.as_deref(), Some("record too large"));
        let (s, _) = seen_data(None, "telemetry", &reports, at(1000));
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
        let (s, _) = seen_data(None, "telemetry", &reports, before_bound);
        assert_eq!(condition(&s.conditions, FORWARDING).unwrap().status, TRUE);
        let (s, _) = seen_data(None, "telemetry", &reports, at(100) + STALLED_AFTER);
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
        let (s, _) = seen_data(None, "telemetry", &down, at(1000));
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
        let (s, _) = seen_data(None, "telemetry", &reports, at(101));
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
        let (later, _) = seen_data(Some(&s), "telemetry", &reports, at(500));
        assert_eq!(later.conditions, s.conditions);
    }

    #[test]
    fn ready_follows_the_data_plane_when_data_is_not_flowing() {
        let rendered = RuleOutcome::Rendered {
            workload: workload(2, 2),
            paused: false,
        };
        let (ready, _) = rule_control(Some(&subscribed_everywhere()), Some(1), &rendered, at(1));
        assert_eq!(condition(&ready.conditions, READY).unwrap().status, TRUE);

        let down = vec![(
            "p-0".to_owned(),
            report(true, false, Some(rule(1, 0.0, None))),
        )];
        let (data, _) = seen_data(Some(&ready), "telemetry", &down, at(2));
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
        let (data_up, _) = seen_data(Some(&s), "telemetry", &up, at(4));
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
        let (data, _) = seen_data(Some(&ready), "telemetry", &failing, at(3));
        assert!(!ready_affected(&subscribed_everywhere(), &data));
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
            seen_data(Some(&ready), "telemetry", &down, at(2))
                .0
                .conditions,
        );
        let (s, _) = rule_control(Some(&stale), Some(1), &paused, at(5));
        assert_eq!(condition(&s.conditions, READY).unwrap().reason, "Paused");
    }

    /// `rule_data` of rule "telemetry" at generation 1 over one group's `pods`, `stale` behind
    /// on its filters.
    fn over(
        current: Option<&ForwardingRuleStatus>,
        groups: &[&[PodSeen]],
        stale: &[&str],
    ) -> (ForwardingRuleStatus, Vec<Transition>) {
        let stale: BTreeSet<String> = stale.iter().map(|s| (*s).to_owned()).collect();
        let seen = RuleSeen {
            name: "telemetry",
            generation: Some(1),
            groups,
            stale: &stale,
        };
        rule_data(current, &seen, at(100))
    }

    /// A pod, Ready or not, answering with the rule "telemetry" subscribed or not, or without it.
    fn pod(name: &str, ready: bool, subscribed: Option<bool>) -> PodSeen {
        let rule = subscribed.map(|subscribed| RuleStatus {
            subscribed,
            ..rule(1, 0.0, None)
        });
        PodSeen {
            name: name.into(),
            ready,
            report: Some(report(true, true, rule)),
        }
    }

    fn forwarding_of(s: &ForwardingRuleStatus) -> (String, String, String) {
        let c = condition(&s.conditions, FORWARDING).unwrap();
        (c.status.clone(), c.reason.clone(), c.message.clone())
    }

    /// The first finding: a rule added to a running group must not be Ready before
    /// every pod serving the group has subscribed its filters; each pod that has not says why.
    #[test]
    fn a_rule_is_ready_once_every_pod_serving_its_group_has_subscribed_its_filters() {
        let rendered = RuleOutcome::Rendered {
            workload: workload(2, 2),
            paused: false,
        };
        let waiting_for = |pods: &[PodSeen], stale: &[&str], why: &str| {
            let (s, t) = over(None, &[pods], stale);
            let (status, reason, message) = forwarding_of(&s);
            assert_eq!((status.as_str(), reason.as_str()), (FALSE, SUBSCRIBING));
            assert!(
                message.starts_with("1 of 2 forwarder pods serving its group have subscribed its filters; waiting for p-1 (")
                    && message.contains(why),
                "{why} in {message}"
            );
            assert!(!t[0].noteworthy(), "a new rule subscribing is no news");
            s
        };
        let p0 = pod("p-0", true, Some(true));
        let not_loaded = waiting_for(
            &[p0.clone(), pod("p-1", true, None)],
            &[],
            "has not loaded the rule yet",
        );
        waiting_for(
            &[p0.clone(), pod("p-1", true, Some(false))],
            &[],
            "the broker has not granted its filters yet",
        );
        waiting_for(
            &[p0.clone(), pod("p-1", true, Some(true))],
            &["p-1"],
            "has not loaded its new filters yet",
        );
        let mut refused = pod("p-1", true, None);
        if let Some(r) = refused.report.as_mut() {
            r.config.reload_error = Some(LastError {
                message: "rules[3]: bad".into(),
                at: at(50),
            });
        }
        waiting_for(
            &[p0.clone(), refused],
            &[],
            "its config reload was refused: rules[3]: bad",
        );

        // Ready says why, with the data plane's message.
        let (control, t) = rule_control(Some(&not_loaded), Some(1), &rendered, at(100));
        let ready = condition(&control.conditions, READY).unwrap();
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str()),
            (FALSE, SUBSCRIBING)
        );
        assert!(ready.message.contains("1 of 2") && ready.message.contains("2/2"));
        assert!(
            t.iter().all(|t| !t.noteworthy() || t.type_ == ACCEPTED),
            "{t:?}"
        );

        // Both subscribed: Forwarding True, Ready follows (the poller asks for the reconcile).
        let both = [p0, pod("p-1", true, Some(true))];
        let (flowing, t) = over(Some(&not_loaded), &[&both], &[]);
        assert_eq!(forwarding_of(&flowing).0, TRUE);
        assert!(forwarding_of(&flowing).2.contains("serving its group (2)"));
        assert!(t.len() == 1 && t[0].noteworthy() && !t[0].warns(), "{t:?}");
        assert!(ready_affected(&not_loaded, &flowing));
        let mut whole = control.clone();
        whole.conditions.extend(flowing.conditions.clone());
        assert!(ready_stale(&whole), "Ready still Subscribing");
        let (control, t) = rule_control(Some(&whole), Some(1), &rendered, at(101));
        assert_eq!(condition(&control.conditions, READY).unwrap().status, TRUE);
        assert_eq!(t.len(), 1);
        let mut whole = control.clone();
        whole.conditions.extend(flowing.conditions);
        assert!(!ready_stale(&whole));
    }

    /// The second finding: a pod still starting (a scale-up) serves nothing yet, so the
    /// rules the others serve stay as they are, with no Event; once it serves, it counts.
    #[test]
    fn a_pod_still_starting_holds_up_no_rule_the_others_serve() {
        let serving = [pod("p-0", true, Some(true)), pod("p-1", true, Some(true))];
        let (before, _) = over(None, &[&serving], &[]);
        let rendered = |ready, wanted| RuleOutcome::Rendered {
            workload: workload(ready, wanted),
            paused: false,
        };
        let (control, _) = rule_control(Some(&before), Some(1), &rendered(2, 2), at(100));
        let mut previous = control.clone();
        previous.conditions.extend(before.conditions.clone());

        // Starting: no IP yet, then answering (config loaded, not connected, not subscribed).
        let mut connecting = pod("p-2", false, Some(false));
        if let Some(r) = connecting.report.as_mut() {
            r.mqtt.connected = false;
            r.mqtt.subscribed = false;
        }
        let no_ip = PodSeen {
            name: "p-2".into(),
            ready: false,
            report: None,
        };
        for new in [no_ip, connecting] {
            let pods = [serving[0].clone(), serving[1].clone(), new];
            let (after, t) = over(Some(&previous), &[&pods], &[]);
            assert_eq!(
                after.conditions,
                before.conditions,
                "{:?}",
                forwarding_of(&after)
            );
            assert!(t.is_empty(), "{t:?}");
            let (control, t) = rule_control(Some(&previous), Some(1), &rendered(2, 3), at(101));
            let ready = condition(&control.conditions, READY).unwrap();
            assert_eq!(ready.status, TRUE);
            assert!(ready.message.contains("2/3"), "{}", ready.message);
            assert_eq!(control.ready_replicas.as_deref(), Some("2/3"));
            assert!(t.is_empty(), "no Event for a scale-up: {t:?}");
        }

        // Subscribed but Kafka not reached yet (not Ready): still starting, nothing flips.
        let mut no_kafka_yet = pod("p-2", false, Some(true));
        if let Some(r) = no_kafka_yet.report.as_mut() {
            r.kafka.reachable = false;
        }
        let pods = [serving[0].clone(), serving[1].clone(), no_kafka_yet];
        let (after, _) = over(Some(&previous), &[&pods], &[]);
        assert_eq!(
            after.conditions,
            before.conditions,
            "{:?}",
            forwarding_of(&after)
        );
        // Ready: it serves, and counts from then on.
        let pods = [
            serving[0].clone(),
            serving[1].clone(),
            pod("p-2", true, Some(true)),
        ];
        let (after, _) = over(Some(&previous), &[&pods], &[]);
        assert!(
            forwarding_of(&after).2.contains("serving its group (3)"),
            "{:?}",
            forwarding_of(&after)
        );
        // Ready before its filters are granted (its readiness lags nothing here): waited for.
        let pods = [
            serving[0].clone(),
            serving[1].clone(),
            pod("p-2", true, Some(false)),
        ];
        let (after, _) = over(Some(&previous), &[&pods], &[]);
        assert_eq!(forwarding_of(&after).1, SUBSCRIBING);

        // A pod that drains gave up its subscriptions on purpose: not waited for.
        let mut draining = pod("p-1", true, Some(false));
        if let Some(r) = draining.report.as_mut() {
            r.drain = Some(ferry_api::status::DrainStatus { drained: false });
        }
        let (after, _) = over(Some(&previous), &[&[serving[0].clone(), draining]], &[]);
        assert_eq!(forwarding_of(&after).0, TRUE, "{:?}", forwarding_of(&after));

        // A group's first pod still starting, no error yet: no news, nothing to warn of.
        let mut starting = pod("p-0", false, Some(false));
        if let Some(r) = starting.report.as_mut() {
            r.mqtt.subscribed = false;
            r.kafka.reachable = false;
        }
        let (s, t) = over(None, &[&[starting]], &[]);
        assert_eq!(forwarding_of(&s).1, SUBSCRIBING, "{:?}", forwarding_of(&s));
        assert!(!t[0].noteworthy(), "{t:?}");

        // With no pod serving, one that failed to reach a broker says why none starts.
        let mut alone = pod("p-0", false, Some(false));
        if let Some(r) = alone.report.as_mut() {
            r.mqtt.connected = false;
            r.mqtt.subscribed = false;
            r.mqtt.last_error = Some(LastError {
                message: "not authorized".into(),
                at: at(1),
            });
        }
        let (s, _) = over(None, &[&[alone]], &[]);
        let (status, reason, message) = forwarding_of(&s);
        assert_eq!(
            (status.as_str(), reason.as_str()),
            (FALSE, "MqttDisconnected")
        );
        assert!(message.contains("p-0") && message.contains("not authorized"));
    }

    /// A Ready pod that did not answer this poll changes nothing: a rule found subscribed for
    /// this generation stays so, one still subscribing stays so (naming the pod).
    #[test]
    fn a_pod_that_did_not_answer_changes_nothing() {
        let both = [pod("p-0", true, Some(true)), pod("p-1", true, Some(true))];
        let silent = PodSeen {
            name: "p-1".into(),
            ready: true,
            report: None,
        };
        let partly = [pod("p-0", true, Some(true)), silent];
        let (flowing, _) = over(None, &[&both], &[]);
        let (after, t) = over(Some(&flowing), &[&partly], &[]);
        assert_eq!(after.conditions, flowing.conditions);
        assert!(t.is_empty());

        let (subscribing, _) = over(None, &[&[both[0].clone(), pod("p-1", true, None)]], &[]);
        let (after, t) = over(Some(&subscribing), &[&partly], &[]);
        let (status, reason, message) = forwarding_of(&after);
        assert_eq!((status.as_str(), reason.as_str()), (FALSE, SUBSCRIBING));
        assert!(
            message.contains("p-1 (did not answer GET /status)"),
            "{message}"
        );
        assert!(t.is_empty());

        // Found subscribed for another generation: that says nothing of this one's filters.
        let mut older = flowing.clone();
        older.conditions[0].observed_generation = Some(0);
        let (after, _) = over(Some(&older), &[&partly], &[]);
        assert_eq!(forwarding_of(&after).1, SUBSCRIBING);
    }

    /// While a rule moves, either group subscribed on every serving pod is enough: the old
    /// one until the new one runs it, then the new one while the old one hands over.
    #[test]
    fn while_a_rule_moves_either_group_subscribed_is_enough() {
        let new_without = [pod("bulk-0", true, None)];
        let new_with = [pod("bulk-0", true, Some(true))];
        let old_with = [pod("default-0", true, Some(true))];
        let mut retiring = pod("default-0", true, Some(false));
        if let Some(r) = retiring.report.as_mut() {
            r.rules[0].retiring = Some(ferry_api::status::DrainStatus { drained: false });
        }
        let old_retiring = [retiring];
        for groups in [
            [&new_without[..], &old_with[..]],
            [&new_with, &old_retiring],
        ] {
            let (s, _) = over(None, &groups, &[]);
            assert_eq!(forwarding_of(&s).0, TRUE, "{:?}", forwarding_of(&s));
        }
        let (s, _) = over(None, &[&new_without, &old_retiring], &[]);
        let (_, reason, message) = forwarding_of(&s);
        assert_eq!(reason, SUBSCRIBING);
        assert!(
            message.contains("bulk-0 (has not loaded the rule yet)"),
            "{message}"
        );
    }

    /// A ForwardingRule of connection plant at `generation`, with `filter`, in `group`.
    fn fr(generation: i64, filter: &str, group: &str) -> ForwardingRule {
        serde_saphyr::from_str(&format!(
            "apiVersion: ferry.dev/v1alpha1\nkind: ForwardingRule\n\
             metadata: {{ name: telemetry, namespace: n, generation: {generation} }}\n\
             spec:\n  connectionRef: {{ name: plant }}\n  group: {group}\n  mqtt: {{ topics: [\"{filter}\"] }}\n  kafka: {{ topic: t }}\n"
        ))
        .expect("rule")
    }

    /// The reconcile must not say Ready from what the data plane said of other filters: the
    /// rule's filters changed, Ready is False at once until the data plane reports them
    /// subscribed (this generation); any other change keeps Ready as it is.
    #[test]
    fn ready_never_says_true_from_what_the_data_plane_said_of_other_filters() {
        let rendered = RuleOutcome::Rendered {
            workload: workload(2, 2),
            paused: false,
        };
        let with = |mut rule: ForwardingRule, status: &ForwardingRuleStatus| {
            rule.status = Some(status.clone());
            rule
        };
        let data = subscribed_everywhere();
        let (control, _) = rule_control_for(
            &with(fr(1, "plant/+/temp", "default"), &data),
            &rendered,
            None,
            at(1),
        );
        let mut whole = control.clone();
        whole.conditions.extend(data.conditions.clone());
        assert_eq!(condition(&whole.conditions, READY).unwrap().status, TRUE);
        assert_eq!(whole.mqtt_topics.as_deref(), Some("plant/+/temp"));
        assert_eq!(whole.kafka_topic.as_deref(), Some("t"));

        // Generation 2, same filters (another field changed): Ready stays, no Event.
        let (same, t) = rule_control_for(
            &with(fr(2, "plant/+/temp", "default"), &whole),
            &rendered,
            None,
            at(2),
        );
        assert_eq!(condition(&same.conditions, READY).unwrap().status, TRUE);
        assert!(t.is_empty(), "{t:?}");
        assert_eq!(same.observed_generation, Some(2));

        // Generation 2, new filters: False at once, a Normal Event.
        let (changed, t) = rule_control_for(
            &with(fr(2, "plant/+/alarm", "default"), &whole),
            &rendered,
            None,
            at(2),
        );
        let ready = condition(&changed.conditions, READY).unwrap();
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str()),
            (FALSE, SUBSCRIBING)
        );
        assert!(t.len() == 1 && t[0].noteworthy() && !t[0].warns(), "{t:?}");
        assert_eq!(changed.mqtt_topics.as_deref(), Some("plant/+/alarm"));
        // Without the filters to compare, another generation's word never counts.
        let (blind, _) = rule_control(Some(&whole), Some(2), &rendered, at(2));
        assert_eq!(
            condition(&blind.conditions, READY).unwrap().reason,
            SUBSCRIBING
        );

        // The data plane reports generation 2 subscribed: Ready again.
        let mut whole2 = changed.clone();
        let mut data2 = data.clone();
        data2.conditions[0].observed_generation = Some(2);
        whole2.conditions.extend(data2.conditions.clone());
        assert!(ready_stale(&whole2));
        let (again, t) = rule_control_for(
            &with(fr(2, "plant/+/alarm", "default"), &whole2),
            &rendered,
            None,
            at(3),
        );
        assert_eq!(condition(&again.conditions, READY).unwrap().status, TRUE);
        assert_eq!(t.len(), 1);

        // No pod answered: a Ready True for this generation stays; a Ready not yet True waits.
        let (unknown, _) = seen_data(Some(&whole), "telemetry", &[], at(4));
        let mut silent = control.clone();
        silent.conditions.extend(unknown.conditions.clone());
        let (kept, t) = rule_control(Some(&silent), Some(1), &rendered, at(5));
        assert_eq!(condition(&kept.conditions, READY).unwrap().status, TRUE);
        assert!(t.is_empty());
        let mut waiting = changed.clone();
        waiting.conditions.extend(unknown.conditions);
        let (still, _) = rule_control(Some(&waiting), Some(2), &rendered, at(5));
        let ready = condition(&still.conditions, READY).unwrap();
        assert_eq!(ready.reason, SUBSCRIBING);
        assert!(
            ready.message.contains("no forwarder pod answered"),
            "{}",
            ready.message
        );
    }

    /// No reconcile storm: whatever the data plane and the pods say, the `Ready` the reconcile
    /// writes is never found stale by the poll (which would ask for the reconcile again).
    #[test]
    fn the_ready_a_reconcile_writes_is_never_stale() {
        let pods = |subscribed: Option<bool>, connected, reachable| {
            let mut p = pod("p-0", true, subscribed);
            if let Some(r) = p.report.as_mut() {
                r.mqtt.connected = connected;
                r.kafka.reachable = reachable;
            }
            vec![p]
        };
        let mut datas: Vec<Option<ForwardingRuleStatus>> = vec![None];
        for p in [
            pods(Some(true), true, true),
            pods(None, true, true),
            pods(Some(false), true, true),
            pods(Some(true), false, true),
            pods(Some(true), true, false),
            vec![],
        ] {
            datas.push(Some(over(None, &[&p], &[]).0));
        }
        let mut older = subscribed_everywhere();
        older.conditions[0].observed_generation = Some(0);
        datas.push(Some(older));
        let mut previous_readies: Vec<Option<ForwardingRuleStatus>> = vec![None];
        for data in datas.iter().flatten() {
            for (ready, wanted) in [(0, 1), (1, 2), (2, 2)] {
                let rendered = RuleOutcome::Rendered {
                    workload: workload(ready, wanted),
                    paused: false,
                };
                previous_readies.push(Some(rule_control(Some(data), Some(1), &rendered, at(1)).0));
            }
        }
        for data in &datas {
            for previous in &previous_readies {
                for (ready, wanted) in [(0, 1), (1, 2), (2, 2), (0, 0)] {
                    let rendered = RuleOutcome::Rendered {
                        workload: workload(ready, wanted),
                        paused: false,
                    };
                    let mut before = previous.clone().unwrap_or_default();
                    before
                        .conditions
                        .extend(data.iter().flat_map(|d| d.conditions.clone()));
                    let (written, _) = rule_control(Some(&before), Some(1), &rendered, at(2));
                    let mut whole = written.clone();
                    whole
                        .conditions
                        .extend(data.iter().flat_map(|d| d.conditions.clone()));
                    assert!(
                        !ready_stale(&whole),
                        "{:?} from {:?}",
                        condition(&whole.conditions, READY),
                        data.as_ref().map(forwarding_of)
                    );
                }
            }
        }
    }

    /// A move shows on the rule: `Moving` True with its step as the reason, naming both
    /// workloads; a Normal Event when it starts, at each step and when it is over, and then
    /// the condition is gone.
    #[test]
    fn a_move_shows_on_the_rule_with_an_event_for_each_step() {
        let rendered = |group: &str| RuleOutcome::Rendered {
            workload: Workload {
                name: workload_name("plant", group),
                wanted: 1,
                ready: 1,
            },
            paused: false,
        };
        let rule = |status: Option<ForwardingRuleStatus>| {
            let mut r = fr(2, "plant/+/temp", "bulk");
            r.status = status;
            r
        };
        let step = |phase| Move {
            to: "bulk".into(),
            from: ["default".to_owned()].into(),
            phase,
        };
        let moving_of = |s: &ForwardingRuleStatus| condition(&s.conditions, MOVING).cloned();
        let events = |t: &[Transition]| -> Vec<(String, String, String)> {
            t.iter()
                .filter(|t| t.type_ == MOVING)
                .inspect(|t| assert!(t.noteworthy() && !t.warns(), "a Normal Event: {t:?}"))
                .map(|t| (t.status.clone(), t.reason.clone(), t.message.clone()))
                .collect()
        };

        let (subscribing, t) = rule_control_for(
            &rule(None),
            &rendered("default"),
            Some(&step(MovePhase::Subscribing)),
            at(1),
        );
        let c = moving_of(&subscribing).unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            (TRUE, "Subscribing")
        );
        assert_eq!(
            c.message,
            "moving from StatefulSet plant-default to plant-bulk: plant-default serves it until every pod of plant-bulk has subscribed its filters"
        );
        assert_eq!(events(&t).len(), 1);
        assert_eq!(rule_control_view(&subscribing), subscribing);
        let (same, t) = rule_control_for(
            &rule(Some(subscribing.clone())),
            &rendered("default"),
            Some(&step(MovePhase::Subscribing)),
            at(2),
        );
        assert_eq!(same, subscribing);
        assert!(events(&t).is_empty());

        let (handing, t) = rule_control_for(
            &rule(Some(subscribing)),
            &rendered("default"),
            Some(&step(MovePhase::HandingOver)),
            at(3),
        );
        let c = moving_of(&handing).unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            (TRUE, "HandingOver")
        );
        assert!(
            c.message.contains(
                "plant-bulk serves it; plant-default's pods forward what their sessions still hold"
            ),
            "{}",
            c.message
        );
        assert_eq!(
            events(&t),
            [(TRUE.to_owned(), "HandingOver".to_owned(), c.message.clone())]
        );

        let (done, t) = rule_control_for(&rule(Some(handing)), &rendered("bulk"), None, at(4));
        assert_eq!(moving_of(&done), None);
        assert_eq!(
            events(&t),
            [(
                FALSE.to_owned(),
                MOVED.to_owned(),
                "moved: served by StatefulSet plant-bulk alone".to_owned()
            )]
        );
        let (after, t) = rule_control_for(&rule(Some(done)), &rendered("bulk"), None, at(5));
        assert_eq!(moving_of(&after), None);
        assert!(events(&t).is_empty());
    }

    #[test]
    fn no_reports_is_unknown() {
        let (s, _) = seen_data(None, "telemetry", &[], at(1));
        assert_eq!(
            condition(&s.conditions, FORWARDING).unwrap().status,
            UNKNOWN
        );
        assert!(s.forwarded.is_none() && s.rate_per_second.is_none());
        // A pod that answers without the rule: not loaded yet, so not subscribed.
        let reports = vec![("p-0".to_owned(), report(true, true, None))];
        let (s, _) = seen_data(None, "telemetry", &reports, at(1));
        let c = condition(&s.conditions, FORWARDING).unwrap();
        assert_eq!((c.status.as_str(), c.reason.as_str()), (FALSE, SUBSCRIBING));
        assert!(
            c.message.contains("has not loaded the rule yet"),
            "{}",
            c.message
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
        let (first, _) = seen_data(None, "telemetry", &[pod(10, true)], at(100));
        let due = |current: &ForwardingRuleStatus, desired, last: Option<i64>, now| {
            data_write_due(current, desired, last.map(at), at(now), minute)
        };
        let empty = ForwardingRuleStatus::default();
        assert!(due(&empty, &first, None, 100), "the first report");
        assert!(!due(&first, &first, Some(100), 500), "nothing changed");

        let (moved, _) = seen_data(Some(&first), "telemetry", &[pod(20, true)], at(101));
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

        let (down, _) = seen_data(Some(&first), "telemetry", &[pod(20, false)], at(101));
        assert!(
            due(&first, &down, Some(100), 101),
            "MqttDisconnected: at once"
        );
        let (gone, _) = seen_data(Some(&first), "telemetry", &[], at(101));
        assert!(due(&first, &gone, Some(100), 101), "no report: at once");
    }
}
