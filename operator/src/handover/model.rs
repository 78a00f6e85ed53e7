//! The hand-over checked over every interleaving of its events, with the `stateright` model
//! checker: the operator's real [`decide`] driven against a small world of two groups, their
//! StatefulSets, pods, configs as the pods last read them, and the broker's sessions.
//!
//! The world: groups `a` and `b` (workloads `w-a`, `w-b`), each with a rule of its own that
//! never moves (`ka`, `kb`; deleting one removes its group), and rule `r` whose messages are
//! counted, on one filter. Each group has up to two pods. A pod reads its config when it
//! starts and at a config sync, each its own event (the kubelet syncs mounted ConfigMaps up to
//! a minute apart) — the kubelet writes the ConfigMap into the pod's volume and the pod reads
//! it later, so a pod may read a version older than the ConfigMap holds by then; at each read
//! it subscribes `r`'s filter in the config's form, or
//! unsubscribes it (retiring, draining, or removed by a reload). The broker queues a message
//! for each plain subscription and for one member of each share group (any member: every
//! choice is explored), online or not. A reconcile is two events (observe and decide, then
//! apply), so anything may happen between the two; an operator restart drops what it
//! observed. The operator hears a pod's `/status` only when the pod runs the config the
//! ConfigMap holds (the digest it reports). The StatefulSet controller creates and deletes pods by the replicas; a created
//! pod starts (and opens its session) as an event of its own.
//!
//! Not modelled: a broker restart (Mosquitto drops shared subscriptions: the documented
//! limit), QoS 2, the forwarder's window (its own model, `forwarder/src/handover.rs`).
//!
//! What is checked, in every reachable state of each bounded scenario below:
//! - nothing is lost: no message of `r` is acknowledged by a pod whose config does not route
//!   it, dropped by the broker for want of a subscriber, or ended with a session, while `r`
//!   exists (from its first `Ready`, for the broker's part);
//! - from `r`'s first `Ready` to its deletion, some session subscribes its filter;
//! - in every state where nothing more can happen, every hand-over ended: each workload
//!   runs what the spec asks (replicas, the rule where it belongs, no `drain` or `retiring`
//!   left), removed groups are gone with their sessions, and no session subscribes `r`'s
//!   filter but its group's.

use std::collections::BTreeMap;

use stateright::{Checker, Model, Property};

use super::machine::{Applied, Decision, GroupSpec, PodSeen, Replicas, Report, Seen, Spec};
use super::{Retirement, decide};

const GROUPS: [&str; 2] = ["a", "b"];
const PODS: usize = 2;
const RULE: &str = "r";
const PLAIN: u8 = 1;
const SHARED: u8 = 2;

fn workload(g: usize) -> String {
    format!("w-{}", GROUPS[g])
}

fn pinned(g: usize) -> String {
    format!("k{}", GROUPS[g])
}

/// A config as rendered and as a pod read it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Config {
    /// `r` listed; `Some(true)`: in `retiring`.
    rule: Option<bool>,
    /// The group's own rule listed.
    pinned: bool,
    drain: [bool; PODS],
    shared: bool,
    /// One more at each change: a pod's digest tells the versions apart.
    revision: u8,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
struct Session {
    /// `r`'s filter: [`PLAIN`] and/or [`SHARED`].
    subs: u8,
    /// Messages of `r` the broker holds for it.
    queue: u8,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
struct Pod {
    exists: bool,
    terminating: bool,
    /// Its process runs and is connected.
    running: bool,
    /// The config the kubelet last wrote into its volume.
    disk: Option<Config>,
    /// The config it runs (it reads its volume after the kubelet wrote it).
    loaded: Option<Config>,
    /// Its session at the broker (kept while the pod is away).
    session: Option<Session>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
struct Workload {
    /// The ConfigMap.
    config: Option<Config>,
    /// The StatefulSet's replicas; `None`: no StatefulSet.
    replicas: Option<i32>,
    pods: [Pod; PODS],
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct World {
    /// `r`'s group; `None` once deleted.
    target: Option<usize>,
    /// Whether each group's own rule exists.
    pinned: [bool; 2],
    wanted: [i32; 2],
    workloads: [Workload; 2],
    /// What the operator observed and decided, not yet applied.
    pending: Option<Decision>,
    kafka_up: bool,
    /// `r` was `Ready` once (its group ran it).
    ready_once: bool,
    lost: u8,
    /// A message reached two pods of one group (possible only through two forms at once).
    duplicated: bool,
    /// Environment events left: spec changes, evictions, restarts, outages.
    events: u8,
    publishes: u8,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Action {
    Move(usize),
    DeleteRule,
    RemoveGroup(usize),
    Scale(usize, i32),
    Evict(usize, usize),
    Restart(usize, usize),
    OperatorRestart,
    KafkaDown,
    KafkaUp,
    /// The member of each group's share group that gets the message.
    Publish([usize; 2]),
    Deliver(usize, usize),
    /// The kubelet writes the ConfigMap as it is now into the pod's volume.
    Kubelet(usize, usize),
    /// The pod reads its volume.
    Sync(usize, usize),
    Create(usize, usize),
    /// A created pod's container starts (until then it is `Pending` and has no session).
    Start(usize, usize),
    Terminate(usize, usize),
    Gone(usize, usize),
    Observe,
    Apply,
}

/// Which environment events a scenario allows, and how many.
#[derive(Debug, Clone)]
struct Scenario {
    name: &'static str,
    start_target: usize,
    start_wanted: [i32; 2],
    events: u8,
    publishes: u8,
    moves: bool,
    delete_rule: bool,
    remove_group: bool,
    scales: &'static [(usize, i32)],
    evictions: bool,
    restarts: bool,
    operator_restart: bool,
    kafka_outage: bool,
}

struct HandOver {
    scenario: Scenario,
}

impl World {
    fn rule_wanted(&self) -> bool {
        self.target.is_some()
    }

    fn in_spec(&self, g: usize) -> bool {
        self.pinned[g] || self.target == Some(g)
    }

    fn spec(&self) -> Spec {
        let mut spec = Spec::default();
        for (g, name) in GROUPS.iter().enumerate() {
            if self.in_spec(g) {
                let group = GroupSpec {
                    workload: workload(g),
                    replicas: Replicas::Fixed(self.wanted[g]),
                };
                spec.groups.insert((*name).to_owned(), group);
                if self.pinned[g] {
                    spec.targets.insert(pinned(g), (*name).to_owned());
                }
            }
        }
        if let Some(t) = self.target {
            spec.targets.insert(RULE.to_owned(), GROUPS[t].to_owned());
        }
        spec
    }

    fn seen(&self) -> BTreeMap<String, Seen> {
        let mut out = BTreeMap::new();
        for (g, w) in self.workloads.iter().enumerate() {
            if w.replicas.is_none() && w.config.is_none() {
                continue;
            }
            let applied = w.config.as_ref().map(|c| {
                let mut a = Applied::default();
                if let Some(retiring) = c.rule {
                    a.rules.insert(RULE.to_owned());
                    if retiring {
                        a.retiring.insert(RULE.to_owned());
                    }
                }
                if c.pinned {
                    a.rules.insert(pinned(g));
                }
                a.shared = c.shared;
                for (o, d) in c.drain.iter().enumerate() {
                    if *d {
                        a.drain.insert(index(o));
                    }
                }
                a
            });
            let pods = w
                .pods
                .iter()
                .enumerate()
                .map(|(o, p)| (index(o), pod_seen(g, o, p, w.config.as_ref())))
                .collect();
            let seen = Seen {
                group: GROUPS[g].to_owned(),
                replicas: w.replicas.unwrap_or(0),
                applied,
                pods,
            };
            out.insert(workload(g), seen);
        }
        out
    }

    /// Some session subscribes `r`'s filter.
    fn covered(&self) -> bool {
        self.workloads
            .iter()
            .flat_map(|w| &w.pods)
            .any(|p| p.session.as_ref().is_some_and(|s| s.subs != 0))
    }

    /// The rule's group runs it: some pod has it subscribed, and every running pod does.
    fn rule_runs(&self) -> bool {
        let Some(t) = self.target else { return false };
        let w = &self.workloads[t];
        let running: Vec<(usize, &Pod)> = w
            .pods
            .iter()
            .enumerate()
            .filter(|(_, p)| p.running)
            .collect();
        !running.is_empty() && running.iter().all(|(o, p)| subscribed(*o, p))
    }
}

fn index(o: usize) -> u32 {
    u32::try_from(o).unwrap_or(u32::MAX)
}

fn form(config: &Config) -> u8 {
    if config.shared { SHARED } else { PLAIN }
}

/// The pod runs `r` with its filter subscribed in its config's form.
fn subscribed(o: usize, p: &Pod) -> bool {
    let (Some(c), Some(s)) = (&p.loaded, &p.session) else {
        return false;
    };
    p.running && c.rule == Some(false) && !c.drain[o] && s.subs & form(c) != 0
}

/// What the pod's `/status` says, as the forwarder decides it; heard only when the pod runs
/// the config the ConfigMap holds (`current`: its digest is the ConfigMap's).
fn pod_seen(g: usize, o: usize, p: &Pod, current: Option<&Config>) -> PodSeen {
    let heard = p.running && p.loaded.as_ref() == current;
    let report = p.loaded.as_ref().filter(|_| heard).map(|c| {
        let s = p.session.clone().unwrap_or_default();
        let quiet = s.queue == 0 && s.subs == 0;
        let mut r = Report {
            drained: c.drain[o] && quiet,
            plain: !c.shared,
            shared: c.shared,
            ..Report::default()
        };
        if subscribed(o, p) {
            r.subscribed.insert(RULE.to_owned());
        }
        if c.pinned && !c.drain[o] {
            r.subscribed.insert(pinned(g));
        }
        if c.rule == Some(true) && quiet {
            r.handed_over.insert(RULE.to_owned());
        }
        r
    });
    PodSeen {
        exists: p.exists,
        terminating: p.terminating,
        session: p.session.is_some(),
        report,
    }
}

/// A pod (re)reads its config: it subscribes `r`'s filter in the config's form, the new form
/// before it drops the old; unsubscribes it while `r` retires or the pod drains; and, on a
/// reload (`reloaded`), unsubscribes what a rule that left its config had. A process that
/// starts knows only the rules its config lists.
fn read_config(p: &mut Pod, o: usize, config: Option<Config>, reloaded: bool) {
    let before = p.loaded.as_ref().and_then(|c| c.rule).is_some();
    p.loaded = config;
    let session = p.session.get_or_insert_with(Session::default);
    match &p.loaded {
        Some(c) if c.rule == Some(false) && !c.drain[o] => session.subs = form(c),
        Some(c) if c.rule.is_some() || c.drain[o] => session.subs = 0,
        _ if reloaded && before => session.subs = 0,
        _ => {}
    }
}

impl HandOver {
    fn environment(&self, w: &World, actions: &mut Vec<Action>) {
        let s = &self.scenario;
        if w.publishes > 0 {
            let members = |g: usize| {
                let n = w.workloads[g]
                    .pods
                    .iter()
                    .filter(|p| p.session.as_ref().is_some_and(|s| s.subs & SHARED != 0))
                    .count();
                n.max(1)
            };
            for a in 0..members(0) {
                for b in 0..members(1) {
                    actions.push(Action::Publish([a, b]));
                }
            }
        }
        if w.events == 0 {
            return;
        }
        if let Some(t) = w.target {
            if s.moves {
                actions.push(Action::Move(1 - t));
            }
            if s.delete_rule {
                actions.push(Action::DeleteRule);
            }
        }
        for g in 0..2 {
            if s.remove_group && w.pinned[g] {
                actions.push(Action::RemoveGroup(g));
            }
            for o in 0..PODS {
                let p = &w.workloads[g].pods[o];
                if s.evictions && p.exists && !p.terminating {
                    actions.push(Action::Evict(g, o));
                }
                if s.restarts && p.running {
                    actions.push(Action::Restart(g, o));
                }
            }
        }
        for &(g, n) in s.scales {
            if w.wanted[g] != n {
                actions.push(Action::Scale(g, n));
            }
        }
        if s.operator_restart && w.pending.is_some() {
            actions.push(Action::OperatorRestart);
        }
        if s.kafka_outage && w.kafka_up {
            actions.push(Action::KafkaDown);
        }
    }

    fn system(w: &World, actions: &mut Vec<Action>) {
        if !w.kafka_up {
            actions.push(Action::KafkaUp);
        }
        for (g, wl) in w.workloads.iter().enumerate() {
            for (o, p) in wl.pods.iter().enumerate() {
                let queued = p.session.as_ref().is_some_and(|s| s.queue > 0);
                if p.running && w.kafka_up && queued {
                    actions.push(Action::Deliver(g, o));
                }
                if p.exists && !p.terminating && wl.config.is_some() && p.disk != wl.config {
                    actions.push(Action::Kubelet(g, o));
                }
                if p.running && p.disk.is_some() && p.loaded != p.disk {
                    actions.push(Action::Sync(g, o));
                }
                let below = wl
                    .replicas
                    .is_some_and(|n| index(o) < n.max(0).unsigned_abs());
                if below && !p.exists {
                    actions.push(Action::Create(g, o));
                }
                let pending = p.exists && !p.terminating && !p.running && p.loaded.is_none();
                if pending && wl.config.is_some() {
                    actions.push(Action::Start(g, o));
                }
                if p.exists && !p.terminating && !below {
                    actions.push(Action::Terminate(g, o));
                }
                if p.terminating {
                    actions.push(Action::Gone(g, o));
                }
            }
        }
        match &w.pending {
            Some(_) => actions.push(Action::Apply),
            None if operator_changes(w) => actions.push(Action::Observe),
            None => {}
        }
    }
}

/// Whether a reconcile now would change anything.
fn operator_changes(w: &World) -> bool {
    let mut after = w.clone();
    apply(&mut after, &decide(&w.spec(), &w.seen()));
    after.workloads != w.workloads || after.lost != w.lost
}

/// Applies a decision as the reconcile does: each workload's config and replicas, a retired
/// workload's objects deleted, then the sessions of pods gone for good ended.
fn apply(w: &mut World, d: &Decision) {
    for g in 0..2 {
        let Some(step) = d.workloads.get(&workload(g)) else {
            continue;
        };
        let wl = &mut w.workloads[g];
        if step.retirement == Some(Retirement::Done) {
            wl.config = None;
            wl.replicas = None;
            continue;
        }
        let mut drain = [false; PODS];
        for o in &step.drain {
            if let Some(d) = drain.get_mut(usize::try_from(*o).unwrap_or(usize::MAX)) {
                *d = true;
            }
        }
        let mut config = Config {
            rule: step
                .rules
                .contains(RULE)
                .then(|| step.retiring.contains(RULE)),
            pinned: step.rules.contains(&pinned(g)),
            drain,
            shared: step.shared,
            revision: wl.config.as_ref().map_or(0, |c| c.revision),
        };
        if wl.config.as_ref() != Some(&config) {
            config.revision = config.revision.wrapping_add(1);
        }
        wl.config = Some(config);
        wl.replicas = step.replicas;
    }
    let wanted = w.rule_wanted();
    for wl in &mut w.workloads {
        for (o, p) in wl.pods.iter_mut().enumerate() {
            // Kept while the group is at zero (it comes back) or the ordinal runs.
            let kept = wl
                .replicas
                .is_some_and(|n| n == 0 || index(o) < n.max(0).unsigned_abs());
            if p.exists || kept {
                continue;
            }
            if let Some(s) = p.session.take()
                && s.queue > 0
                && wanted
            {
                w.lost += 1;
            }
        }
    }
}

impl Model for HandOver {
    type State = World;
    type Action = Action;

    fn init_states(&self) -> Vec<World> {
        let s = &self.scenario;
        let mut w = World {
            target: Some(s.start_target),
            pinned: [true, true],
            wanted: s.start_wanted,
            workloads: Default::default(),
            pending: None,
            kafka_up: true,
            ready_once: false,
            lost: 0,
            duplicated: false,
            events: s.events,
            publishes: s.publishes,
        };
        // Settled: what the operator and the pods make of the spec with nothing else going on.
        for _ in 0..20 {
            let mut actions = Vec::new();
            Self::system(&w, &mut actions);
            let Some(a) = actions.into_iter().next() else {
                break;
            };
            if let Some(next) = self.next_state(&w, a) {
                w = next;
            }
        }
        vec![w]
    }

    fn actions(&self, w: &World, actions: &mut Vec<Action>) {
        self.environment(w, actions);
        Self::system(w, actions);
    }

    fn next_state(&self, last: &World, action: Action) -> Option<World> {
        let mut w = last.clone();
        match action {
            Action::Move(g) => {
                w.target = Some(g);
                w.events -= 1;
            }
            Action::DeleteRule => {
                w.target = None;
                w.events -= 1;
            }
            Action::RemoveGroup(g) => {
                w.pinned[g] = false;
                w.events -= 1;
            }
            Action::Scale(g, n) => {
                w.wanted[g] = n;
                w.events -= 1;
            }
            Action::Evict(g, o) => {
                let p = &mut w.workloads[g].pods[o];
                p.terminating = true;
                p.running = false;
                w.events -= 1;
            }
            Action::Restart(g, o) => {
                let p = &mut w.workloads[g].pods[o];
                let config = p.disk.clone();
                read_config(p, o, config, false);
                w.events -= 1;
            }
            Action::OperatorRestart => {
                w.pending = None;
                w.events -= 1;
            }
            Action::KafkaDown => {
                w.kafka_up = false;
                w.events -= 1;
            }
            Action::KafkaUp => w.kafka_up = true,
            Action::Publish(choice) => {
                publish(&mut w, choice);
                w.publishes -= 1;
            }
            Action::Deliver(g, o) => {
                let wanted = w.rule_wanted();
                let p = &mut w.workloads[g].pods[o];
                let routes = p.loaded.as_ref().is_some_and(|c| c.rule.is_some());
                if let Some(s) = p.session.as_mut() {
                    s.queue -= 1;
                }
                if !routes && wanted {
                    w.lost += 1;
                }
            }
            Action::Kubelet(g, o) => {
                w.workloads[g].pods[o].disk = w.workloads[g].config.clone();
            }
            Action::Sync(g, o) => {
                let p = &mut w.workloads[g].pods[o];
                let config = p.disk.clone();
                read_config(p, o, config, true);
            }
            Action::Create(g, o) => w.workloads[g].pods[o].exists = true,
            Action::Start(g, o) => {
                let config = w.workloads[g].config.clone();
                let p = &mut w.workloads[g].pods[o];
                p.running = true;
                p.disk.clone_from(&config);
                read_config(p, o, config, false);
            }
            Action::Terminate(g, o) => {
                let p = &mut w.workloads[g].pods[o];
                p.terminating = true;
                p.running = false;
            }
            Action::Gone(g, o) => {
                let p = &mut w.workloads[g].pods[o];
                let session = p.session.take();
                *p = Pod {
                    session,
                    ..Pod::default()
                };
            }
            Action::Observe => w.pending = Some(decide(&w.spec(), &w.seen())),
            Action::Apply => {
                if let Some(d) = w.pending.take() {
                    apply(&mut w, &d);
                }
            }
        }
        w.ready_once |= w.rule_runs();
        if !w.rule_wanted() {
            w.ready_once = false;
        }
        Some(w)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("nothing is lost", |_: &HandOver, w: &World| w.lost == 0),
            Property::always(
                "a group's pods never both receive a message",
                |_: &HandOver, w: &World| !w.duplicated,
            ),
            Property::always(
                "a Ready rule stays subscribed",
                |_: &HandOver, w: &World| !w.ready_once || w.covered(),
            ),
            Property::always("every hand-over ends", |m: &HandOver, w: &World| {
                let mut actions = Vec::new();
                HandOver::system(w, &mut actions);
                m.environment(w, &mut actions);
                !actions.is_empty() || settled(w)
            }),
            Property::sometimes("a message reaches Kafka", |_: &HandOver, w: &World| {
                w.publishes < 1 && w.lost == 0
            }),
        ]
    }
}

/// The broker takes a message of `r`: a copy for each plain subscription, one for the
/// `choice`n member of each share group; none for a filter no session subscribes.
fn publish(w: &mut World, choice: [usize; 2]) {
    let mut delivered = false;
    for (g, wl) in w.workloads.iter_mut().enumerate() {
        let mut member = 0;
        let mut pods = 0;
        for p in &mut wl.pods {
            let Some(s) = p.session.as_mut() else {
                continue;
            };
            let plain = s.subs & PLAIN != 0;
            let shared = s.subs & SHARED != 0 && member == choice[g];
            member += usize::from(s.subs & SHARED != 0);
            if plain || shared {
                s.queue += 1;
                delivered = true;
                pods += 1;
            }
        }
        w.duplicated |= pods > 1;
    }
    if !delivered && w.ready_once && w.rule_wanted() {
        w.lost += 1;
    }
}

/// Nothing left to hand over: the spec's groups run as asked, with `r` only in its group and
/// not retiring, no pod listed in `drain`, removed groups gone with their sessions, and no
/// session subscribed to `r` but its group's running pods. (A move into a group at zero
/// replicas waits, visibly, for the group to run a pod: until then the rule is served where
/// it was.)
fn settled(w: &World) -> bool {
    (0..2).all(|g| {
        let wl = &w.workloads[g];
        if !w.in_spec(g) {
            return wl.config.is_none()
                && wl.replicas.is_none()
                && wl.pods.iter().all(|p| !p.exists && p.session.is_none());
        }
        let Some(c) = &wl.config else { return false };
        let rule = (w.target == Some(g)).then_some(false);
        // A move into a group at zero replicas waits for it, the rule served where it was.
        let waits = w.target.is_some_and(|t| t != g && w.wanted[t] == 0) && c.rule == Some(false);
        let subscribed_here = |o: usize, p: &Pod| {
            p.session.as_ref().is_none_or(|s| s.subs == 0)
                || ((w.target == Some(g) || waits) && subscribed(o, p))
                || (w.target == Some(g)
                    && !p.exists
                    && wl.replicas == Some(0)
                    && p.session.as_ref().is_some_and(|s| s.subs == PLAIN))
        };
        wl.replicas == Some(w.wanted[g])
            && (c.rule == rule || waits)
            && !c
                .drain
                .iter()
                .enumerate()
                .any(|(o, d)| *d && index(o) < index_of(w.wanted[g]))
            && wl
                .pods
                .iter()
                .enumerate()
                .all(|(o, p)| subscribed_here(o, p))
    })
}

fn index_of(n: i32) -> u32 {
    n.max(0).unsigned_abs()
}

fn check(scenario: Scenario) {
    let name = scenario.name;
    let checker = HandOver { scenario }
        .checker()
        .threads(2)
        .spawn_bfs()
        .join();
    eprintln!("{name}: {} states", checker.unique_state_count());
    checker.assert_properties();
}

const NONE: &[(usize, i32)] = &[];

fn scenario(name: &'static str) -> Scenario {
    Scenario {
        name,
        start_target: 0,
        start_wanted: [1, 1],
        events: 2,
        publishes: 2,
        moves: false,
        delete_rule: false,
        remove_group: false,
        scales: NONE,
        evictions: false,
        restarts: false,
        operator_restart: false,
        kafka_outage: false,
    }
}

/// A move, reversed or not, with evictions and restarts of any pod at any point.
#[test]
fn a_move_reversed_half_way_with_pods_evicted_loses_nothing_and_ends() {
    check(Scenario {
        events: 4,
        moves: true,
        evictions: true,
        restarts: true,
        operator_restart: true,
        ..scenario("move")
    });
}

/// A move while either group scales, and an operator restart between observing and
/// applying.
#[test]
fn a_move_during_a_scale_change_and_an_operator_restart_loses_nothing_and_ends() {
    check(Scenario {
        events: 3,
        moves: true,
        scales: &[(0, 2), (1, 0), (1, 2)],
        operator_restart: true,
        ..scenario("move and scale")
    });
}

/// Scaling down (to one and to zero) and up, with evictions and a Kafka outage.
#[test]
fn scaling_down_and_up_with_evictions_and_an_outage_loses_nothing_and_ends() {
    check(Scenario {
        start_wanted: [2, 1],
        events: 3,
        scales: &[(0, 1), (0, 0), (0, 2)],
        evictions: true,
        restarts: true,
        kafka_outage: true,
        ..scenario("scale")
    });
}

/// The rule's group removed (its rule moved away), or the rule deleted, mid-way.
#[test]
fn a_group_removed_or_the_rule_deleted_mid_move_loses_nothing_and_ends() {
    check(Scenario {
        start_wanted: [2, 1],
        events: 3,
        publishes: 1,
        moves: true,
        delete_rule: true,
        remove_group: true,
        evictions: true,
        ..scenario("remove")
    });
}
