//! Conditions with stable timestamps: a condition keeps its `lastTransitionTime` while its
//! status stays the same, so an unchanged world yields a byte-identical status and the
//! operator can skip the write (and nobody's watch fires).

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

pub const TRUE: &str = "True";
pub const FALSE: &str = "False";
pub const UNKNOWN: &str = "Unknown";

/// What a condition should say now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Desired {
    pub type_: &'static str,
    pub status: &'static str,
    pub reason: &'static str,
    pub message: String,
}

impl Desired {
    pub fn new(
        type_: &'static str,
        status: &'static str,
        reason: &'static str,
        message: impl Into<String>,
    ) -> Self {
        Self {
            type_,
            status,
            reason,
            message: message.into(),
        }
    }
}

/// A condition whose status changed (or that is new): worth an Event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transition {
    pub type_: String,
    pub status: String,
    pub reason: String,
    pub message: String,
    /// The condition did not exist before.
    pub first: bool,
}

/// Reasons of a False condition that nobody has to act on, worth an Event but not a Warning:
/// what someone chose (a paused rule, a connection scaled to zero or without rules), a rule's
/// filters being subscribed after it was added or changed (the kubelet syncs the ConfigMap
/// within about a minute), a move to another group that is over.
const EXPECTED: [&str; 5] = ["Paused", "ScaledToZero", "NoRules", "Subscribing", "Moved"];

/// Reasons a new object's condition starts with while its forwarder pods start, load it or
/// have not reported yet: the expected beginning (Argo CD shows it Progressing), not news; a
/// change to them later is. Thousands of rules created at once would otherwise each get an
/// Event for it.
const STARTING: [&str; 4] = [
    "ForwarderNotReady",
    "ForwardersNotReady",
    "NoReport",
    "Subscribing",
];

/// Condition types whose appearance is news: a rule starting to move to another group.
const NEWS_WHEN_NEW: [&str; 1] = ["Moving"];

impl Transition {
    /// Worth telling a human: a change of status, or a problem from the start.
    pub fn noteworthy(&self) -> bool {
        !self.first
            || NEWS_WHEN_NEW.contains(&self.type_.as_str())
            || (self.status != TRUE && !STARTING.contains(&self.reason.as_str()))
    }

    /// Whether its Event is a Warning: a condition turned False, unless expected.
    pub fn warns(&self) -> bool {
        self.status == FALSE && !EXPECTED.contains(&self.reason.as_str())
    }
}

/// The conditions to write: `desired`, each keeping the `lastTransitionTime` of the same
/// type in `current` when its status did not change. `now` is truncated to seconds, as the
/// API server stores it, so a read-back compares equal.
pub fn merge(
    current: &[Condition],
    desired: &[Desired],
    generation: Option<i64>,
    now: Timestamp,
) -> (Vec<Condition>, Vec<Transition>) {
    let now = Time(Timestamp::from_second(now.as_second()).unwrap_or(now));
    let mut transitions = Vec::new();
    let merged = desired
        .iter()
        .map(|d| {
            let previous = current.iter().find(|c| c.type_ == d.type_);
            let last_transition_time = match previous {
                Some(p) if p.status == d.status => p.last_transition_time.clone(),
                _ => {
                    transitions.push(Transition {
                        type_: d.type_.to_owned(),
                        status: d.status.to_owned(),
                        reason: d.reason.to_owned(),
                        message: d.message.clone(),
                        first: previous.is_none(),
                    });
                    now.clone()
                }
            };
            Condition {
                type_: d.type_.to_owned(),
                status: d.status.to_owned(),
                reason: d.reason.to_owned(),
                message: d.message.clone(),
                observed_generation: generation,
                last_transition_time,
            }
        })
        .collect();
    (merged, transitions)
}

/// The conditions of `types` in `all`, in the order of `types` (what one writer owns).
pub fn owned(all: &[Condition], types: &[&str]) -> Vec<Condition> {
    types
        .iter()
        .filter_map(|t| all.iter().find(|c| c.type_ == *t).cloned())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(second: i64) -> Timestamp {
        Timestamp::from_second(second).unwrap()
    }

    #[test]
    fn unchanged_status_keeps_its_transition_time_and_reports_nothing() {
        let desired = [Desired::new("Ready", TRUE, "ForwarderReady", "1/1")];
        let (first, transitions) = merge(&[], &desired, Some(1), at(100));
        assert_eq!(transitions.len(), 1);
        let (second, transitions) = merge(&first, &desired, Some(1), at(200));
        assert!(transitions.is_empty());
        assert_eq!(
            first, second,
            "identical input must give an identical status"
        );
    }

    #[test]
    fn pods_starting_is_no_news_on_a_new_object_but_a_later_change_to_it_is() {
        let starting = |reason: &str, first| Transition {
            type_: "Ready".into(),
            status: FALSE.into(),
            reason: reason.into(),
            message: String::new(),
            first,
        };
        assert!(!starting("ForwarderNotReady", true).noteworthy());
        assert!(!starting("NoReport", true).noteworthy());
        assert!(starting("ForwarderNotReady", false).noteworthy());
        assert!(starting("SecretMissing", true).noteworthy());
    }

    #[test]
    fn message_change_alone_is_not_a_transition() {
        let (first, _) = merge(
            &[],
            &[Desired::new("Ready", FALSE, "ForwarderNotReady", "0/2")],
            Some(1),
            at(100),
        );
        let (second, transitions) = merge(
            &first,
            &[Desired::new("Ready", FALSE, "ForwarderNotReady", "1/2")],
            Some(2),
            at(200),
        );
        assert!(transitions.is_empty());
        assert_eq!(
            second[0].last_transition_time,
            first[0].last_transition_time
        );
        assert_eq!(second[0].message, "1/2");
        assert_eq!(second[0].observed_generation, Some(2));
    }

    #[test]
    fn status_change_moves_the_transition_time_to_now_in_whole_seconds() {
        let (first, _) = merge(
            &[],
            &[Desired::new("Ready", FALSE, "ForwarderNotReady", "")],
            None,
            at(100),
        );
        let now = Timestamp::from_millisecond(200_750).unwrap();
        let (second, transitions) = merge(
            &first,
            &[Desired::new("Ready", TRUE, "ForwarderReady", "")],
            None,
            now,
        );
        assert_eq!(transitions[0].status, TRUE);
        assert_eq!(second[0].last_transition_time, Time(at(200)));
    }

    #[test]
    fn owned_picks_one_writers_types() {
        let (all, _) = merge(
            &[],
            &[
                Desired::new("Accepted", TRUE, "Accepted", ""),
                Desired::new("Forwarding", TRUE, "Forwarding", ""),
            ],
            None,
            at(1),
        );
        let mine = owned(&all, &["Forwarding", "Ready"]);
        assert_eq!(mine.len(), 1);
        assert_eq!(mine[0].type_, "Forwarding");
    }
}
