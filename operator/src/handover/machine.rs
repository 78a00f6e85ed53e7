//! The decision, pure: from what the spec asks ([`Spec`]) and what runs ([`Seen`]), what each
//! workload's config and StatefulSet should say now ([`Decision`]). The state of every
//! hand-over lives in the API objects (the configs as applied, the StatefulSets' replicas, the
//! pods' `/status`), so the next reconcile, or a restarted operator, takes it up from there.
//!
//! The rules it keeps, each in every order of events (see the model in `model.rs`):
//! - a rule leaves a workload only once its new group runs it (every answering pod has its
//!   filters subscribed), and each pod of the old workload has forwarded what its session still
//!   held for it (`retiring`, then handed over);
//! - a pod leaves for good only once it forwarded what its session held (`drain`, then
//!   drained);
//! - a group of one subscribes plainly (Mosquitto restores plain subscriptions after a
//!   restart, not shared ones), and switches only while it is the sole member of its share
//!   group: so a scale-down or scale-up duplicates no more than what one pod has in flight.

use std::collections::{BTreeMap, BTreeSet};

/// A group's replicas as the spec asks for them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replicas {
    Fixed(i32),
    /// An autoscaler's: its pods drain themselves when stopped (`drain_on_shutdown`).
    Autoscaled,
}

/// One group the spec has (it has rules, paused ones too).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupSpec {
    pub workload: String,
    /// `Fixed(0)` when no rule of the group runs (all paused): its sessions are kept.
    pub replicas: Replicas,
}

/// What the spec asks: its groups by name, and where each running rule belongs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Spec {
    pub groups: BTreeMap<String, GroupSpec>,
    /// Rule → its group (`spec.group`), for every rule that should run (not paused).
    pub targets: BTreeMap<String, String>,
}

/// A workload's config as applied (its ConfigMap), as far as the hand-over needs it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Applied {
    /// Every rule the config lists (`retiring` ones too).
    pub rules: BTreeSet<String>,
    pub retiring: BTreeSet<String>,
    /// Ordinals listed in `drain`.
    pub drain: BTreeSet<u32>,
    /// Subscribe through `$share`.
    pub shared: bool,
}

/// A pod's `/status`, as far as the hand-over needs it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// Rules whose filters are subscribed (SUBACK granted on its current connection).
    pub subscribed: BTreeSet<String>,
    /// Retiring rules its session holds nothing more for.
    pub handed_over: BTreeSet<String>,
    /// Listed in `drain`, and its session holds nothing more.
    pub drained: bool,
    /// Connected and subscribed plainly (not through `$share`).
    pub plain: bool,
    /// Connected and subscribed through `$share`.
    pub shared: bool,
}

/// One ordinal of a workload.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodSeen {
    /// A pod object exists under this ordinal.
    pub exists: bool,
    /// Its deletion has begun: what it says may be its last word.
    pub terminating: bool,
    /// It may have a session at the broker: its pod started (its phase is past `Pending`), or
    /// its client id is recorded as having run.
    pub session: bool,
    /// Its `/status`, when it answered.
    pub report: Option<Report>,
}

impl PodSeen {
    /// Its answer, unless it is going away.
    fn live_report(&self) -> Option<&Report> {
        self.report
            .as_ref()
            .filter(|_| self.exists && !self.terminating)
    }
}

/// One workload of the connection as it runs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Seen {
    pub group: String,
    /// Its StatefulSet's replicas.
    pub replicas: i32,
    /// Its config as applied; `None` without a ConfigMap (or one the operator cannot read).
    pub applied: Option<Applied>,
    /// By ordinal: every ordinal below the replicas, and any other with a pod or a session.
    pub pods: BTreeMap<u32, PodSeen>,
}

impl Seen {
    /// One past the highest ordinal that has a pod (started or not) or may hold a session.
    fn top(&self) -> u32 {
        let highest = self
            .pods
            .iter()
            .filter(|(o, p)| p.exists || self.holds(**o))
            .map(|(o, _)| o + 1)
            .max()
            .unwrap_or(0);
        highest.max(self.replicas.max(0).unsigned_abs())
    }

    /// Whether ordinal `o` may hold messages in a session: it has one (its pod started, or its
    /// client id is recorded) and its pod exists or comes back (the StatefulSet keeps the
    /// ordinal, or the group is at zero and keeps its sessions for its return). A session
    /// above the replicas without a pod was drained before the StatefulSet shrank, and is
    /// being ended; a pod that never started subscribed nothing.
    fn holds(&self, o: u32) -> bool {
        let kept = |o: u32| o < self.replicas.max(0).unsigned_abs() || self.replicas <= 0;
        self.pods
            .get(&o)
            .is_some_and(|p| p.session && (p.exists || kept(o)))
    }

    /// Whether ordinal `o` holds nothing more: it reported drained (its last word counts: a
    /// pod in `drain` that terminates leaves for good), or it never had a session (no pod of
    /// it started) and its config as applied lists it in `drain` already, so a pod that starts
    /// for it from now on subscribes nothing.
    fn drained(&self, o: u32) -> bool {
        let pod = self.pods.get(&o);
        let reported = pod
            .and_then(|p| p.report.as_ref())
            .is_some_and(|r| r.drained);
        let nothing = !pod.is_some_and(|p| p.session);
        // Only under a config that lists it: one that reported drained from an older config
        // could read a newer one without it and subscribe again.
        self.applied.as_ref().is_some_and(|a| a.drain.contains(&o)) && (reported || nothing)
    }

    /// The answer of ordinal `o`, unless its pod is going away.
    fn live(&self, o: u32) -> Option<&Report> {
        self.pods.get(&o).and_then(PodSeen::live_report)
    }

    fn lists(&self, rule: &str) -> bool {
        self.applied
            .as_ref()
            .is_some_and(|a| a.rules.contains(rule))
    }

    fn retires(&self, rule: &str) -> bool {
        self.applied
            .as_ref()
            .is_some_and(|a| a.retiring.contains(rule))
    }

    /// Whether `rule` runs here: its config as applied lists it (not retiring: a pod that has
    /// not read that config yet would unsubscribe it when it does), and every pod that runs
    /// and stays (not leaving, not terminating) has its filters subscribed under that config,
    /// one at least. A pod that has not started has no subscription to lose and subscribes
    /// when it starts; one that terminates comes back under its session and reads the config
    /// then; but one that runs an older config may still read one in between.
    fn runs(&self, rule: &str, leaving: &BTreeSet<u32>) -> bool {
        if !self.lists(rule) || self.retires(rule) {
            return false;
        }
        let staying: Vec<(&u32, &PodSeen)> = self
            .pods
            .iter()
            .filter(|(o, p)| !leaving.contains(o) && p.exists && !p.terminating && p.session)
            .collect();
        !staying.is_empty()
            && staying
                .iter()
                .all(|(_, p)| p.live_report().is_some_and(|r| r.subscribed.contains(rule)))
    }

    /// Whether no session of this workload holds anything more for `rule`: each ordinal that
    /// may have a session reports it handed over (or drained), from a pod that is not
    /// terminating. A pod not running is waited for: it comes back under its session.
    fn handed_over(&self, rule: &str) -> bool {
        self.pods.keys().all(|o| {
            !self.holds(*o)
                || self
                    .live(*o)
                    .is_some_and(|r| r.drained || r.handed_over.contains(rule))
        })
    }
}

/// How far a rule's move to another group is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MovePhase {
    /// Its new group does not run it yet: where it was goes on serving it (duplicates, never
    /// a gap).
    Subscribing,
    /// Its new group runs it; where it was forwards what its sessions still hold for it.
    HandingOver,
}

impl MovePhase {
    pub fn as_str(self) -> &'static str {
        match self {
            MovePhase::Subscribing => "Subscribing",
            MovePhase::HandingOver => "HandingOver",
        }
    }
}

/// A rule on its way into `to` from the workloads that still list it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Move {
    pub to: String,
    /// The groups of the workloads it leaves.
    pub from: BTreeSet<String>,
    pub phase: MovePhase,
}

/// Where a workload whose group the spec no longer has stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Retirement {
    /// Its rules' new groups do not all run them yet: it goes on serving them.
    Serving,
    /// Its pods forward what their sessions hold, then report drained.
    Draining,
    /// Nothing left to hand over: its objects may go and its sessions end.
    Done,
}

/// What one workload's config and StatefulSet should say now.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Step {
    pub group: String,
    /// The rules its config lists (those leaving for another group too).
    pub rules: BTreeSet<String>,
    /// Of those, the ones that moved and whose new group runs them.
    pub retiring: BTreeSet<String>,
    /// Ordinals that leave for good: listed in the config's `drain` (also while they
    /// terminate: a config without them would have them subscribe again before they stop).
    pub drain: Vec<u32>,
    /// The StatefulSet's replicas; `None`: an autoscaler's, left alone.
    pub replicas: Option<i32>,
    /// Subscribe through `$share`.
    pub shared: bool,
    /// Ordinals a change of replicas or a retirement waits for.
    pub waiting: Vec<u32>,
    /// Set for a workload whose group the spec no longer has.
    pub retirement: Option<Retirement>,
}

/// Everything to apply now: by workload name, and the moves under way by rule.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Decision {
    pub workloads: BTreeMap<String, Step>,
    pub moves: BTreeMap<String, Move>,
}

/// Rules a workload keeps listing though its group is not theirs (or they were deleted), and
/// of those the ones in `retiring`, by workload name.
type Kept = BTreeMap<String, (BTreeSet<String>, BTreeSet<String>)>;

/// The decision for `spec` given what runs (`seen`, by workload name).
pub fn decide(spec: &Spec, seen: &BTreeMap<String, Seen>) -> Decision {
    let empty = Seen::default();
    let mut out = Decision::default();
    for (group, g) in &spec.groups {
        let s = seen.get(&g.workload).unwrap_or(&empty);
        let mut step = scale(g.replicas, s);
        step.group.clone_from(group);
        out.workloads.insert(g.workload.clone(), step);
    }
    let listed: BTreeSet<&String> = seen
        .values()
        .filter_map(|s| s.applied.as_ref())
        .flat_map(|a| &a.rules)
        .collect();
    let mut kept = Kept::new();
    for rule in spec.targets.keys().chain(listed) {
        if out.moves.contains_key(rule) || kept.values().any(|(r, _)| r.contains(rule)) {
            continue;
        }
        let target = spec
            .targets
            .get(rule)
            .and_then(|g| Some((g, spec.groups.get(g)?)));
        let runs = target.is_some_and(|(_, t)| {
            let leaving: BTreeSet<u32> = out
                .workloads
                .get(&t.workload)
                .map(|s| s.drain.iter().copied().collect())
                .unwrap_or_default();
            seen.get(&t.workload)
                .is_some_and(|s| s.runs(rule, &leaving))
        });
        let home = target.map(|(_, t)| t.workload.as_str());
        let from = keep(rule, home, runs, seen, &mut kept);
        let Some((group, t)) = target else { continue };
        if let Some(step) = out.workloads.get_mut(&t.workload) {
            step.rules.insert(rule.clone());
        }
        if !from.is_empty() {
            let phase = if runs {
                MovePhase::HandingOver
            } else {
                MovePhase::Subscribing
            };
            let to = group.clone();
            out.moves.insert(rule.clone(), Move { to, from, phase });
        }
    }
    for (workload, (rules, retiring)) in kept {
        if let Some(step) = out.workloads.get_mut(&workload) {
            step.rules.extend(rules);
            step.retiring.extend(retiring);
        } else if let Some(s) = seen.get(&workload) {
            out.workloads.insert(workload, retire(s, rules, retiring));
        }
    }
    for (workload, s) in seen {
        if !out.workloads.contains_key(workload) {
            out.workloads.insert(
                workload.clone(),
                retire(s, BTreeSet::new(), BTreeSet::new()),
            );
        }
    }
    bring_back(&mut out, seen);
    out
}

/// The workloads other than `home` (the rule's group's; `None`: the rule was deleted or
/// paused) that keep listing `rule`, into `kept`, and their groups. A workload that lists it
/// keeps serving it until its group runs it (`runs`), then lists it in `retiring` until each
/// of its pods forwarded what its session held for it (a deleted rule retires at once: its
/// filters are unsubscribed and what the sessions hold for it is still forwarded). A
/// retiring rule stays retiring: whoever made it retire still serves it.
fn keep(
    rule: &str,
    home: Option<&str>,
    runs: bool,
    seen: &BTreeMap<String, Seen>,
    kept: &mut Kept,
) -> BTreeSet<String> {
    let mut from = BTreeSet::new();
    for (workload, s) in seen {
        if home == Some(workload.as_str()) || !s.lists(rule) {
            continue;
        }
        // Handed over under a config that says so: a pod that reported it from an older
        // config could read a newer one that subscribes the rule again.
        if s.retires(rule) && s.handed_over(rule) {
            continue;
        }
        from.insert(s.group.clone());
        let entry = kept.entry(workload.clone()).or_default();
        entry.0.insert(rule.to_owned());
        if runs || home.is_none() || s.retires(rule) {
            entry.1.insert(rule.to_owned());
        }
    }
    from
}

/// A group at zero replicas whose pod 0 kept its session (for the group's return) while it
/// listed a rule now retiring: pod 0 runs again until it handed the rule over.
fn bring_back(out: &mut Decision, seen: &BTreeMap<String, Seen>) {
    for (workload, step) in &mut out.workloads {
        let Some(s) = seen.get(workload) else {
            continue;
        };
        if step.replicas == Some(0) && !step.retiring.is_empty() && s.holds(0) {
            step.replicas = Some(1);
            step.waiting.push(0);
        }
    }
}

/// A workload whose group the spec no longer has, still listing `rules` that run elsewhere
/// now (`retiring`: whose new group runs them). It serves them until each new group runs
/// them, then all its pods drain; then it is done. One at zero replicas whose pod 0 has a
/// session is brought back to drain it.
fn retire(s: &Seen, rules: BTreeSet<String>, retiring: BTreeSet<String>) -> Step {
    let mut step = Step {
        group: s.group.clone(),
        replicas: Some(s.replicas),
        shared: s.replicas > 1 || s.top() > 1,
        ..Step::default()
    };
    // Nothing it lists is wanted elsewhere, or what is was handed over.
    if rules.is_empty() {
        step.retirement = Some(Retirement::Done);
        return step;
    }
    // At zero replicas, pod 0's session (kept for the group's return) is drained too.
    let back = s.replicas == 0 && s.holds(0);
    if back {
        step.replicas = Some(1);
    }
    let top = s.top().max(u32::from(back));
    step.retirement = Some(if retiring.len() < rules.len() {
        Retirement::Serving
    } else {
        step.drain = (0..top).collect();
        step.waiting = (0..top).filter(|o| !s.drained(*o)).collect();
        if step.waiting.is_empty() {
            Retirement::Done
        } else {
            Retirement::Draining
        }
    });
    step.rules = rules;
    step.retiring = retiring;
    step
}

/// Replicas, `drain` and the subscription's form for a group the spec has. Scaling down, the
/// leaving pods drain first and the StatefulSet shrinks only once each did; a group going to
/// zero then waits for pod 0 to subscribe plainly (its session is kept for the group's
/// return). A group of one joins `$share` before a second pod starts, and leaves it only once
/// it is alone, so no message reaches two pods through different forms for longer than one
/// pod's reload (the switch subscribes the new form before it unsubscribes the old).
pub fn scale(wanted: Replicas, s: &Seen) -> Step {
    let mut step = resize(wanted, s);
    // Every pod above what the StatefulSet keeps leaves for good: listed in `drain` until its
    // object is gone (a config without it would have it subscribe again before it stops).
    if let Some(replicas) = step.replicas {
        let keeps = replicas.max(1).unsigned_abs();
        let first = step.drain.first().copied().unwrap_or(keeps).min(keeps);
        step.drain = (first..s.top()).collect();
    }
    step
}

/// [`scale`] before the `drain` list follows the replicas it decides.
fn resize(wanted: Replicas, s: &Seen) -> Step {
    let Replicas::Fixed(wanted) = wanted else {
        return Step {
            replicas: None,
            shared: true,
            ..Step::default()
        };
    };
    let wanted = wanted.max(0);
    let stays = wanted.max(1).unsigned_abs();
    let others = s.pods.iter().any(|(o, p)| *o > 0 && p.exists);
    let pod0 = s.pods.get(&0).and_then(PodSeen::live_report);
    let mut step = Step {
        drain: (stays..s.top()).collect(),
        ..Step::default()
    };
    if s.replicas > wanted.max(1) || (wanted <= 1 && others) {
        step.shared = true;
        step.waiting = step
            .drain
            .iter()
            .copied()
            .filter(|o| !s.drained(*o))
            .collect();
        step.replicas = Some(if step.waiting.is_empty() {
            wanted.max(1)
        } else {
            s.replicas
        });
        return step;
    }
    // Pod 0 subscribes in `shared`'s form under a config that asks for it.
    let pod0_in = |shared: bool| {
        s.applied.as_ref().is_some_and(|a| a.shared == shared)
            && pod0.is_some_and(|r| if shared { r.shared } else { r.plain })
    };
    if wanted > 1 {
        step.shared = true;
        // Pod 0's session may be subscribed plainly: it joins the share group alone, before a
        // second member does.
        let switching = s.replicas <= 1 && s.holds(0) && !pod0_in(true);
        step.replicas = Some(if switching { 1 } else { wanted });
        if switching {
            step.waiting.push(0);
        }
        return step;
    }
    // One pod at most from here: it subscribes plainly.
    step.replicas = Some(wanted);
    if wanted == 0 && s.replicas > 0 && s.holds(0) && !pod0_in(false) {
        step.replicas = Some(s.replicas);
        step.waiting.push(0);
    }
    step
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    fn set(items: &[&str]) -> BTreeSet<String> {
        items.iter().map(|s| (*s).to_owned()).collect()
    }

    /// A workload of `group` at `replicas`, its config listing `rules` (`retiring` of them)
    /// and `drain`, with a running pod per ordinal below the replicas.
    pub(in crate::handover) fn seen(
        group: &str,
        replicas: i32,
        rules: &[&str],
        retiring: &[&str],
        drain: &[u32],
    ) -> Seen {
        Seen {
            group: group.to_owned(),
            replicas,
            applied: Some(Applied {
                rules: set(rules),
                retiring: set(retiring),
                drain: drain.iter().copied().collect(),
                shared: replicas > 1,
            }),
            pods: (0..replicas.unsigned_abs())
                .map(|o| {
                    let pod = PodSeen {
                        exists: true,
                        session: true,
                        ..PodSeen::default()
                    };
                    (o, pod)
                })
                .collect(),
        }
    }

    fn report(s: &mut Seen, o: u32, r: Report) {
        if let Some(p) = s.pods.get_mut(&o) {
            p.report = Some(r);
        }
    }

    fn subscribed(rules: &[&str]) -> Report {
        Report {
            subscribed: set(rules),
            plain: true,
            ..Report::default()
        }
    }

    pub(in crate::handover) fn spec(groups: &[(&str, i32)], targets: &[(&str, &str)]) -> Spec {
        Spec {
            groups: groups
                .iter()
                .map(|(g, n)| {
                    let workload = format!("w-{g}");
                    (
                        (*g).to_owned(),
                        GroupSpec {
                            workload,
                            replicas: Replicas::Fixed(*n),
                        },
                    )
                })
                .collect(),
            targets: targets
                .iter()
                .map(|(r, g)| ((*r).to_owned(), (*g).to_owned()))
                .collect(),
        }
    }

    pub(in crate::handover) fn workloads(list: Vec<Seen>) -> BTreeMap<String, Seen> {
        list.into_iter()
            .map(|s| (format!("w-{}", s.group), s))
            .collect()
    }

    #[test]
    fn a_scale_down_drains_the_leaving_pods_under_a_config_that_lists_them_before_shrinking() {
        let mut s = seen("a", 3, &["r"], &[], &[]);
        let step = scale(Replicas::Fixed(1), &s);
        assert_eq!((step.replicas, step.drain.clone()), (Some(3), vec![1, 2]));
        // Drained under a config that did not list it yet: it may read one that does not.
        report(
            &mut s,
            1,
            Report {
                drained: true,
                ..Report::default()
            },
        );
        report(
            &mut s,
            2,
            Report {
                drained: true,
                ..Report::default()
            },
        );
        assert_eq!(scale(Replicas::Fixed(1), &s).replicas, Some(3));
        if let Some(a) = s.applied.as_mut() {
            a.drain = [1, 2].into();
        }
        let step = scale(Replicas::Fixed(1), &s);
        assert_eq!((step.replicas, step.waiting.len()), (Some(1), 0));
        assert!(step.shared, "pod 0 leaves the share group only once alone");
    }

    #[test]
    fn going_to_zero_waits_for_pod_0_to_subscribe_plainly_under_a_plain_config() {
        let mut s = seen("a", 1, &["r"], &[], &[]);
        report(
            &mut s,
            0,
            Report {
                shared: true,
                ..Report::default()
            },
        );
        let step = scale(Replicas::Fixed(0), &s);
        assert_eq!(
            (step.replicas, step.waiting.clone(), step.shared),
            (Some(1), vec![0], false)
        );
        report(&mut s, 0, subscribed(&["r"]));
        assert_eq!(scale(Replicas::Fixed(0), &s).replicas, Some(0));
    }

    #[test]
    fn a_group_of_one_joins_the_share_group_alone_before_a_second_pod_starts() {
        let mut s = seen("a", 1, &["r"], &[], &[]);
        report(&mut s, 0, subscribed(&["r"]));
        let step = scale(Replicas::Fixed(2), &s);
        assert_eq!((step.replicas, step.shared), (Some(1), true));
        if let Some(a) = s.applied.as_mut() {
            a.shared = true;
        }
        report(
            &mut s,
            0,
            Report {
                shared: true,
                ..Report::default()
            },
        );
        assert_eq!(scale(Replicas::Fixed(2), &s).replicas, Some(2));
    }

    #[test]
    fn a_moved_rule_is_served_where_it_was_until_its_group_runs_it_then_handed_over() {
        let spec = spec(&[("a", 1), ("b", 1)], &[("r", "b"), ("ka", "a")]);
        let a = seen("a", 1, &["ka", "r"], &[], &[]);
        let b = seen("b", 1, &[], &[], &[]);
        let d = decide(&spec, &workloads(vec![a.clone(), b]));
        assert_eq!(d.workloads["w-a"].rules, set(&["ka", "r"]));
        assert!(d.workloads["w-a"].retiring.is_empty());
        assert_eq!(d.moves["r"].phase, MovePhase::Subscribing);
        // b's pod runs it under a config that lists it: a retires it.
        let mut b = seen("b", 1, &["r"], &[], &[]);
        report(&mut b, 0, subscribed(&["r"]));
        let d = decide(&spec, &workloads(vec![a, b.clone()]));
        assert_eq!(d.workloads["w-a"].retiring, set(&["r"]));
        assert_eq!(d.moves["r"].phase, MovePhase::HandingOver);
        // Handed over under a config that lists it retiring: dropped.
        let mut a = seen("a", 1, &["ka", "r"], &["r"], &[]);
        report(
            &mut a,
            0,
            Report {
                handed_over: set(&["r"]),
                ..Report::default()
            },
        );
        let d = decide(&spec, &workloads(vec![a, b]));
        assert_eq!(d.workloads["w-a"].rules, set(&["ka"]));
        assert!(d.moves.is_empty());
    }

    #[test]
    fn a_move_reversed_half_way_keeps_the_rule_subscribed_where_it_is_until_its_group_runs_it_again()
     {
        // r moved a → b, b runs it, a retires it; then r goes back to a.
        let spec = spec(
            &[("a", 1), ("b", 1)],
            &[("r", "a"), ("ka", "a"), ("kb", "b")],
        );
        let mut a = seen("a", 1, &["ka", "r"], &["r"], &[]);
        report(
            &mut a,
            0,
            Report {
                handed_over: set(&["r"]),
                ..subscribed(&["ka"])
            },
        );
        let mut b = seen("b", 1, &["kb", "r"], &[], &[]);
        report(&mut b, 0, subscribed(&["kb", "r"]));
        let d = decide(&spec, &workloads(vec![a, b]));
        assert!(
            d.workloads["w-a"].retiring.is_empty(),
            "a subscribes it again"
        );
        assert_eq!(d.workloads["w-b"].rules, set(&["kb", "r"]));
        assert!(
            d.workloads["w-b"].retiring.is_empty(),
            "b serves it until a runs it"
        );
        assert_eq!(d.moves["r"].from, set(&["b"]));
    }

    #[test]
    fn a_hand_over_waits_for_a_terminating_pod_to_come_back_and_hand_over_too() {
        let spec = spec(&[("a", 2), ("b", 1)], &[("r", "b"), ("ka", "a")]);
        let mut a = seen("a", 2, &["ka", "r"], &["r"], &[]);
        report(
            &mut a,
            0,
            Report {
                handed_over: set(&["r"]),
                ..Report::default()
            },
        );
        report(
            &mut a,
            1,
            Report {
                handed_over: set(&["r"]),
                ..Report::default()
            },
        );
        if let Some(p) = a.pods.get_mut(&1) {
            p.terminating = true;
        }
        let mut b = seen("b", 1, &["r"], &[], &[]);
        report(&mut b, 0, subscribed(&["r"]));
        let d = decide(&spec, &workloads(vec![a, b]));
        assert_eq!(
            d.workloads["w-a"].retiring,
            set(&["r"]),
            "pod 1 comes back and hands over"
        );
    }

    #[test]
    fn a_removed_group_waits_only_for_the_groups_that_take_its_rules() {
        // Group a is gone (its rule r moved to b); group c, unrelated, has no pod running.
        let spec = spec(&[("b", 1), ("c", 1)], &[("r", "b"), ("kc", "c")]);
        let mut a = seen("a", 1, &["r"], &[], &[]);
        report(&mut a, 0, subscribed(&["r"]));
        let mut b = seen("b", 1, &["r"], &[], &[]);
        report(&mut b, 0, subscribed(&["r"]));
        let c = seen("c", 1, &["kc"], &[], &[]);
        let d = decide(&spec, &workloads(vec![a.clone(), b.clone(), c.clone()]));
        assert_eq!(d.workloads["w-a"].retirement, Some(Retirement::Draining));
        assert_eq!(d.workloads["w-a"].drain, vec![0]);
        let mut a = seen("a", 1, &["r"], &["r"], &[0]);
        report(
            &mut a,
            0,
            Report {
                drained: true,
                ..Report::default()
            },
        );
        let d = decide(&spec, &workloads(vec![a, b, c]));
        assert_eq!(d.workloads["w-a"].retirement, Some(Retirement::Done));
    }

    #[test]
    fn a_deleted_rule_retires_where_it_is_listed_so_its_filters_are_unsubscribed() {
        let spec = spec(&[("a", 1)], &[("ka", "a")]);
        let a = seen("a", 1, &["ka", "r"], &[], &[]);
        let d = decide(&spec, &workloads(vec![a]));
        assert_eq!(d.workloads["w-a"].retiring, set(&["r"]));
        assert!(d.moves.is_empty(), "not a move: it has no group");
    }
}
