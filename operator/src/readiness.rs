//! `ferry_rule_ready` and `ferry_connection_ready`: one series per object, its `Ready`
//! condition's status and reason as labels (cert-manager's `certificate_ready_status`,
//! Strimzi's `strimzi_resource_state`), for alerts and the dashboard.
//!
//! Read at scrape time from the stores the controllers already keep (a rule's series goes with
//! the rule, and nothing is kept or allocated per reconcile). The stores hold the statuses as
//! the API server has them, and `Ready` is never one of the writes that wait for the status
//! budget (see `crate::budget`): only moving counters wait, and they do not change it. So the
//! series says what `kubectl get` says. A replica that does not lead keeps no stores and serves
//! no series.

use std::sync::{Arc, Mutex, PoisonError};

use ferry_api::crd::{BrokerConnection, ForwardingRule};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::Resource;
use kube::core::DeserializeGuard;
use kube::runtime::reflector::Store;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::gauge::ConstGauge;

use crate::conditions::{FALSE, TRUE, UNKNOWN};
use crate::status::{BLOCKING_REASONS, READY};

/// A rule's `Ready` reasons, as the operator writes them (the label's whole vocabulary, with
/// [`NOT_RECONCILED`] and [`OTHER`]).
pub const RULE_REASONS: [&str; 12] = [
    "ForwarderReady",
    "ForwarderNotReady",
    "Paused",
    "ScaledToZero",
    "NotAccepted",
    BLOCKING_REASONS[0],
    BLOCKING_REASONS[1],
    BLOCKING_REASONS[2],
    BLOCKING_REASONS[3],
    BLOCKING_REASONS[4],
    BLOCKING_REASONS[5],
    BLOCKING_REASONS[6],
];

/// A connection's `Ready` reasons, as the operator writes them.
pub const CONNECTION_REASONS: [&str; 7] = [
    "ForwardersReady",
    "ForwardersNotReady",
    "NoRules",
    "ScaledToZero",
    "SecretMissing",
    "SecretNotMarked",
    "InvalidSpec",
];

/// An object without a `Ready` condition yet (created, not reconciled).
pub const NOT_RECONCILED: &str = "NotReconciled";
/// A reason this operator does not write (another version's): kept out of the label so that
/// its values stay a fixed set.
pub const OTHER: &str = "Other";

/// The stores of a leading replica; empty while it does not lead.
#[derive(Clone, Default)]
pub struct Watched(Arc<Mutex<Option<Stores>>>);

#[derive(Clone)]
struct Stores {
    connections: Store<DeserializeGuard<BrokerConnection>>,
    rules: Store<DeserializeGuard<ForwardingRule>>,
}

impl std::fmt::Debug for Watched {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Watched")
    }
}

impl Watched {
    /// Serves the series of the objects in these stores (the controllers' own).
    pub fn watch(
        &self,
        connections: Store<DeserializeGuard<BrokerConnection>>,
        rules: Store<DeserializeGuard<ForwardingRule>>,
    ) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) =
            Some(Stores { connections, rules });
    }

    /// Serves none (the controllers stopped).
    pub fn clear(&self) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = None;
    }

    fn stores(&self) -> Option<Stores> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// `Ready`'s (status, reason) label values from `conditions`, the reason one of `known` (else
/// [`OTHER`]).
pub fn ready_labels(
    conditions: &[Condition],
    known: &[&'static str],
) -> (&'static str, &'static str) {
    let Some(ready) = conditions.iter().find(|c| c.type_ == READY) else {
        return (UNKNOWN, NOT_RECONCILED);
    };
    let status = [TRUE, FALSE]
        .into_iter()
        .find(|s| *s == ready.status)
        .unwrap_or(UNKNOWN);
    let reason = known
        .iter()
        .copied()
        .find(|r| *r == ready.reason)
        .unwrap_or(OTHER);
    (status, reason)
}

/// One sample: 1 when `Ready` is True, else 0.
fn sample<'a>(
    encoder: &mut DescriptorEncoder<'_>,
    (name, help): (&str, &str),
    series: impl Iterator<Item = [(&'static str, &'a str); 4]>,
) -> Result<(), std::fmt::Error> {
    let mut metric = encoder.encode_descriptor(
        name,
        help,
        None,
        prometheus_client::metrics::MetricType::Gauge,
    )?;
    for labels in series {
        let ready = i64::from(labels[2].1 == TRUE);
        let family = metric.encode_family(&labels)?;
        ConstGauge::new(ready).encode(family)?;
    }
    Ok(())
}

/// How one kind's series are made: its name label, its reasons, what an unreadable object's
/// `Ready` says, and where its conditions are.
struct Kind<K> {
    label: &'static str,
    reasons: &'static [&'static str],
    unreadable: &'static str,
    conditions: fn(&K) -> &[Condition],
}

const RULES: Kind<ForwardingRule> = Kind {
    label: "rule",
    reasons: &RULE_REASONS,
    // Its Ready is written False, NotAccepted (InvalidSpec).
    unreadable: "NotAccepted",
    conditions: |r| {
        r.status
            .as_ref()
            .map(|s| s.conditions.as_slice())
            .unwrap_or_default()
    },
};

const CONNECTIONS: Kind<BrokerConnection> = Kind {
    label: "connection",
    reasons: &CONNECTION_REASONS,
    unreadable: "InvalidSpec",
    conditions: |c| {
        c.status
            .as_ref()
            .map(|s| s.conditions.as_slice())
            .unwrap_or_default()
    },
};

/// The label sets of `objects`' series, borrowed from the store's objects.
fn series<'a, K>(
    objects: &'a [Arc<DeserializeGuard<K>>],
    kind: &'a Kind<K>,
) -> impl Iterator<Item = [(&'static str, &'a str); 4]> + 'a
where
    K: Resource<DynamicType = ()>,
{
    objects.iter().map(move |guarded| {
        let (status, reason) = match &guarded.0 {
            Ok(object) => ready_labels((kind.conditions)(object), kind.reasons),
            Err(_) => (FALSE, kind.unreadable),
        };
        labels(guarded.meta(), kind.label, status, reason)
    })
}

impl Collector for Watched {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(stores) = self.stores() else {
            return Ok(());
        };
        let rules = stores.rules.state();
        sample(
            &mut encoder,
            (
                "ferry_rule_ready",
                "1 while a ForwardingRule's Ready condition is True; its status and reason as labels",
            ),
            series(&rules, &RULES),
        )?;
        let connections = stores.connections.state();
        sample(
            &mut encoder,
            (
                "ferry_connection_ready",
                "1 while a BrokerConnection's Ready condition is True; its status and reason as labels",
            ),
            series(&connections, &CONNECTIONS),
        )
    }
}

/// Borrowed from the store's object: nothing is copied per series.
fn labels<'a>(
    meta: &'a k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    kind: &'static str,
    status: &'static str,
    reason: &'static str,
) -> [(&'static str, &'a str); 4] {
    [
        ("namespace", meta.namespace.as_deref().unwrap_or_default()),
        (kind, meta.name.as_deref().unwrap_or_default()),
        ("status", status),
        ("reason", reason),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ready(status: &str, reason: &str) -> Vec<Condition> {
        vec![Condition {
            type_: READY.into(),
            status: status.into(),
            reason: reason.into(),
            message: String::new(),
            observed_generation: None,
            last_transition_time: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                jiff::Timestamp::UNIX_EPOCH,
            ),
        }]
    }

    #[test]
    fn the_labels_are_a_fixed_set_whatever_the_status_holds() {
        assert_eq!(
            ready_labels(&ready("False", "KafkaUnreachable"), &RULE_REASONS),
            (FALSE, "KafkaUnreachable")
        );
        assert_eq!(
            ready_labels(&ready("True", "ForwarderReady"), &RULE_REASONS),
            (TRUE, "ForwarderReady")
        );
        assert_eq!(ready_labels(&[], &RULE_REASONS), (UNKNOWN, NOT_RECONCILED));
        assert_eq!(
            ready_labels(&ready("Maybe", "SomethingNew"), &RULE_REASONS),
            (UNKNOWN, OTHER)
        );
    }
}
