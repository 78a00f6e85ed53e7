//! Scaling a group down without losing what the broker holds for the pods that leave.
//!
//! Forwarder pods share their subscription and keep persistent sessions: the broker queues
//! part of the group's messages for each of them. A pod that leaves for good (its ordinal at
//! or above the new replica count) is first listed in its config's `drain`: it unsubscribes,
//! forwards what its session still holds, and reports `drained`. Only then does the
//! StatefulSet shrink, and the operator ends the session (see [`crate::sessions`]), which by
//! then holds nothing. A group going to zero keeps pod 0's session for its return: pod 0 first
//! subscribes plainly (Mosquitto restores plain subscriptions after a restart, not shared
//! ones). [`step`] is the decision, pure; the reconcile reads the live state and applies it.

use std::collections::{BTreeMap, BTreeSet};

/// A forwarder pod's answer on `/status`, as far as scaling down needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodReport {
    /// Listed in `drain` and its session holds nothing more.
    pub drained: bool,
    /// Subscribed plainly (not through `$share`), as a group of one or none must be.
    pub plain: bool,
}

/// One group's StatefulSet as it runs, its pods' reports by ordinal (a pod without one is
/// missing: not running, or not answering), and the ordinals of its pod objects (terminating
/// ones too).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Live {
    /// The group whose workload this is (its label).
    pub group: String,
    /// The StatefulSet's uid: only the pods it controls are asked for their `/status`.
    pub uid: String,
    pub replicas: i32,
    pub reports: BTreeMap<u32, PodReport>,
    pub pods: BTreeSet<u32>,
}

/// What to apply to one group now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Step {
    /// The StatefulSet's replicas.
    pub replicas: i32,
    /// Ordinals whose pods leave for good: listed in the config's `drain`, also while they
    /// terminate (a config without them would have them subscribe again before they stop).
    pub drain: Vec<u32>,
    /// Ordinals the scale-down waits for (to report drained, or pod 0 to subscribe plainly).
    pub waiting: Vec<u32>,
}

/// From `wanted` replicas and what runs: shrink only once every leaving pod drained (and,
/// going to zero, once pod 0 subscribes plainly). A leaving pod that is not running is waited
/// for: the StatefulSet brings it back under its name and session, and it drains then. So a
/// scale-down waits visibly rather than discard a session's messages.
pub fn step(wanted: i32, live: Option<&Live>) -> Step {
    let wanted = wanted.max(0);
    let Some(live) = live else {
        return Step {
            replicas: wanted,
            ..Step::default()
        };
    };
    let stays = wanted.max(1).unsigned_abs();
    let top = live
        .replicas
        .unsigned_abs()
        .max(live.pods.last().map_or(0, |o| o + 1));
    let drain: Vec<u32> = (stays..top).collect();
    if live.replicas <= wanted {
        return Step {
            replicas: wanted,
            drain,
            waiting: Vec::new(),
        };
    }
    let mut waiting: Vec<u32> = Vec::new();
    if wanted == 0 && !live.reports.get(&0).is_some_and(|r| r.plain) {
        waiting.push(0);
    }
    waiting.extend(
        drain
            .iter()
            .copied()
            .filter(|o| !live.reports.get(o).is_some_and(|r| r.drained)),
    );
    Step {
        replicas: if waiting.is_empty() {
            wanted
        } else {
            live.replicas
        },
        drain,
        waiting,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live(replicas: i32, reports: &[(u32, bool, bool)]) -> Live {
        Live {
            group: "g".to_owned(),
            uid: "u".to_owned(),
            replicas,
            reports: reports
                .iter()
                .map(|&(o, drained, plain)| (o, PodReport { drained, plain }))
                .collect(),
            pods: (0..replicas.unsigned_abs()).collect(),
        }
    }

    #[test]
    fn scaling_up_or_holding_applies_at_once_and_drains_nobody() {
        assert_eq!(step(3, None).replicas, 3);
        let s = step(3, Some(&live(2, &[])));
        assert_eq!((s.replicas, s.drain.len(), s.waiting.len()), (3, 0, 0));
        let s = step(2, Some(&live(2, &[])));
        assert_eq!((s.replicas, s.drain.len()), (2, 0));
    }

    #[test]
    fn scaling_down_holds_the_replicas_until_every_leaving_pod_drained() {
        let s = step(1, Some(&live(3, &[(1, true, false)])));
        assert_eq!(s.replicas, 3, "pod 2 has not drained");
        assert_eq!((s.drain, s.waiting), (vec![1, 2], vec![2]));
        let s = step(1, Some(&live(3, &[(1, true, false), (2, true, false)])));
        assert_eq!((s.replicas, s.drain, s.waiting), (1, vec![1, 2], vec![]));
    }

    #[test]
    fn a_drained_pod_stays_listed_until_its_object_is_gone() {
        let mut l = live(1, &[]);
        l.pods.insert(1);
        let s = step(1, Some(&l));
        assert_eq!((s.replicas, s.drain, s.waiting), (1, vec![1], vec![]));
        l.pods.remove(&1);
        assert_eq!(step(1, Some(&l)).drain, Vec::<u32>::new());
    }

    #[test]
    fn a_leaving_pod_that_is_not_running_is_waited_for_not_dropped() {
        let s = step(1, Some(&live(2, &[(0, false, true)])));
        assert_eq!((s.replicas, s.waiting), (2, vec![1]));
    }

    #[test]
    fn going_to_zero_keeps_pod_0s_session_once_it_subscribes_plainly() {
        let s = step(0, Some(&live(2, &[(0, false, false), (1, true, false)])));
        assert_eq!((s.replicas, s.drain, s.waiting), (2, vec![1], vec![0]));
        let s = step(0, Some(&live(2, &[(0, false, true), (1, true, false)])));
        assert_eq!((s.replicas, s.waiting), (0, vec![]));
        let s = step(0, Some(&live(1, &[(0, false, true)])));
        assert_eq!((s.replicas, s.drain), (0, vec![]));
    }
}
