//! The forwarder's hand-over verdicts (`ferry_forwarder::handover`), model-checked with
//! stateright over every interleaving of a small broker and session. The model drives the real
//! `Handover`, fed as the MQTT driver and the pipeline feed it, and the real subscription
//! decisions (`handover::subscription_changes` on a reload, `handover::unsubscribe_on_connect`
//! on a resumed session, from the `subscription_plan` of a real config); around them it plays
//! the broker (subscriptions, queue, in-flight messages sent again on a new connection), the
//! driver's window, the judgement queue, Kafka and the config syncs.
//!
//! Two scenarios: a replica listed in `drain`, and a rule `r` listed in `retiring` beside a
//! rule `k` it keeps. Each runs from two starts: a fresh process, listed from its start, on a
//! session a previous process left subscribed through `$share/g/` with messages queued; and a
//! process running, subscribed plainly, not listed yet.
//!
//! Bounds: time in ticks of 1 s up to `T_MAX` = 4 (the verdicts' quiet is 2 ticks); the
//! messages a session starts with (2 draining, 1 retiring) or 1 published while it runs, a copy
//! per matching subscription; a window of `WINDOW` = 2 messages, which is also the broker's
//! in-flight limit (MQTT 5's Receive Maximum); one connection loss; two config syncs in any
//! order with the rest (the listing reversed, and given again). Judging a message and Kafka
//! taking it are never prompt: a slow judgement and a Kafka outage are any stretch of time in
//! which they do not happen. About 55,000 states in all, a few seconds.
//!
//! What the broker promises, and the verdicts rely on: while the session is connected and
//! reads, the broker sends what it queued and answers what it is sent within a round trip. So
//! time does not pass while the broker could send or answer, or while the driver connects; it
//! may pass at any other moment.
//!
//! Properties: once a verdict says drained (handed over), no copy the session was given for
//! the leaving filters is anywhere but in Kafka (queued, sent again, waiting for its
//! judgement, in the window), and no leaving filter is subscribed or being subscribed (so none
//! can be queued any more); and from every state where the config lists it, with the broker
//! and Kafka up and nothing more going wrong, the verdict comes within the quiet of nothing
//! being left to do (a bounded fair path: what is enabled is done, time passes only when
//! nothing is).

use std::collections::{BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use ferry_api::config::SubscriptionPlan;
use ferry_forwarder::handover::{self, Handover, QUIET};
use stateright::{Checker, Model, Property};

/// One tick of model time.
const TICK: Duration = Duration::from_secs(1);
/// The last tick the checker explores.
const T_MAX: u8 = 4;
/// The driver's window, and the broker's in-flight limit.
const WINDOW: usize = 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Rule {
    /// Drain: any rule; retire: the retiring rule `r`.
    R,
    /// The rule `k`, kept when `r` retires.
    K,
}

impl Rule {
    fn filter(self) -> &'static str {
        match self {
            Rule::R => "r/#",
            Rule::K => "k/#",
        }
    }
}

/// One copy of a message queued for the session (a copy per matching subscription).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Msg {
    id: u8,
    rule: Rule,
}

/// What the forwarder sent the broker and it has not read yet, in order.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Up {
    Subscribe(Vec<String>),
    Unsubscribe(Vec<String>),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scenario {
    Drain,
    Retire,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Action {
    Publish(Rule),
    Deliver,
    BrokerRead,
    Judge,
    Complete,
    Disconnect,
    Connect,
    Sync,
    Tick,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct State {
    now: u8,
    // The broker's side of the session.
    subs: BTreeSet<String>,
    queue: VecDeque<Msg>,
    /// Sent and not acknowledged, as the broker sees it; true once the forwarder wrote it to
    /// Kafka (its ack lost with a connection).
    inflight: Vec<(Msg, bool)>,
    /// What it sends again first on this connection (its in-flight ones at the connect).
    resend: VecDeque<Msg>,
    to_broker: VecDeque<Up>,
    connected: bool,
    next_id: u8,
    // The forwarder.
    epoch: u8,
    /// Received, waiting for (or in) their judgement: (copy, epoch).
    judging: VecDeque<(Msg, u8)>,
    /// Judged, in the window: (copy, epoch).
    window: VecDeque<(Msg, u8)>,
    unsubscribe_later: Vec<String>,
    /// The config the forwarder runs lists it (in `drain`, or `r` in `retiring`).
    listed: bool,
    handover: Handover,
    // What may still happen.
    publishes: u8,
    disconnects: u8,
    syncs: u8,
}

impl State {
    fn taken(&self) -> usize {
        self.judging.len() + self.window.len()
    }
    fn reading(&self) -> bool {
        self.taken() < WINDOW
    }
}

/// Where a run starts, and what may happen on its way.
#[derive(Clone, Copy, Debug)]
struct Run {
    /// `Some`: a fresh process, listed from its start, on a session a previous process left
    /// subscribed through `$share/g/` with a copy of these rules' messages queued. `None`: a
    /// process running, subscribed plainly, not listed.
    restarted: Option<&'static [Rule]>,
    publishes: u8,
    disconnects: u8,
    syncs: u8,
}

struct HandoverModel {
    scenario: Scenario,
    run: Run,
    /// Tick 0.
    base: Instant,
    listed: SubscriptionPlan,
    unlisted: SubscriptionPlan,
}

/// A group `g` of one replica (subscribing plainly) with rules `r` and `k`; `listed` adds
/// `drain` or `retiring` as the scenario says.
fn plan(scenario: Scenario, listed: bool) -> SubscriptionPlan {
    let mut yaml = r##"
mqtt: { host: h, client_id: leaving, shared_group: g, subscribe_shared: false }
kafka: { bootstrap_servers: "k:9092" }
rules:
  - name: r
    mqtt: { topics: ["r/#"] }
    kafka: { topic: r }
  - name: k
    mqtt: { topics: ["k/#"] }
    kafka: { topic: k }
"##
    .to_owned();
    match (scenario, listed) {
        (_, false) => {}
        (Scenario::Drain, true) => yaml.push_str("drain: [leaving]\n"),
        (Scenario::Retire, true) => yaml.push_str("retiring: [r]\n"),
    }
    match ferry_api::load_str(&yaml, |_| None) {
        Ok(loaded) => loaded.config.subscription_plan(),
        Err(e) => panic!("the model's config: {e}"),
    }
}

/// The filter as a message matches it: a shared one as its `<filter>`.
fn matched_as(filter: &str) -> &str {
    filter.strip_prefix("$share/g/").unwrap_or(filter)
}

fn filters(plan: &SubscriptionPlan) -> Vec<String> {
    plan.subscribe.iter().map(|(f, _)| f.clone()).collect()
}

impl HandoverModel {
    fn new(scenario: Scenario, run: Run) -> Self {
        assert_eq!(
            QUIET,
            2 * TICK,
            "the bounds below count the quiet as 2 ticks"
        );
        Self {
            scenario,
            run,
            base: Instant::now(),
            listed: plan(scenario, true),
            unlisted: plan(scenario, false),
        }
    }

    fn at(&self, tick: u8) -> Instant {
        self.base + TICK * u32::from(tick)
    }

    fn plan(&self, listed: bool) -> &SubscriptionPlan {
        if listed { &self.listed } else { &self.unlisted }
    }

    /// The copies the verdict is about.
    fn leaving(&self, m: &Msg) -> bool {
        self.scenario == Scenario::Drain || m.rule == Rule::R
    }

    /// The filters the verdict is about, in either form.
    fn leaving_filter(&self, f: &str) -> bool {
        self.scenario == Scenario::Drain || matched_as(f) == Rule::R.filter()
    }

    fn verdict(&self, s: &State) -> bool {
        let now = self.at(s.now);
        match self.scenario {
            Scenario::Drain => s.handover.drained(now),
            Scenario::Retire => s.handover.handed_over("r", now) == Some(true),
        }
    }

    /// Tells the hand-over what the config lists now, as a reload or the start does.
    fn configure(&self, h: &mut Handover, listed: bool, now: Instant) {
        h.set_draining(self.scenario == Scenario::Drain && listed);
        let retiring = (self.scenario == Scenario::Retire && listed).then_some("r");
        h.set_retiring(retiring, now);
    }

    /// The state a run starts in (see [`Run::restarted`]).
    fn start(&self) -> State {
        let queued = self.run.restarted.unwrap_or(&[]);
        let queue: VecDeque<Msg> = (queued.iter().enumerate())
            .map(|(i, rule)| Msg {
                id: i as u8,
                rule: *rule,
            })
            .collect();
        let listed = self.run.restarted.is_some();
        let mut handover = Handover::default();
        self.configure(&mut handover, listed, self.at(0));
        let subs: BTreeSet<String> = if listed {
            ["$share/g/r/#", "$share/g/k/#"].map(str::to_owned).into()
        } else {
            handover.connected(true, self.at(0));
            filters(&self.unlisted).into_iter().collect()
        };
        State {
            now: 0,
            subs,
            next_id: queue.len() as u8,
            queue,
            inflight: Vec::new(),
            resend: VecDeque::new(),
            to_broker: VecDeque::new(),
            connected: !listed,
            epoch: u8::from(!listed),
            judging: VecDeque::new(),
            window: VecDeque::new(),
            unsubscribe_later: Vec::new(),
            listed,
            handover,
            publishes: self.run.publishes,
            disconnects: self.run.disconnects,
            syncs: self.run.syncs,
        }
    }

    /// Whether the broker has something to do at once, or the driver is connecting: time
    /// does not pass then. (Time passing while disconnected changes no verdict: each waits for
    /// a settled connection, and counts its quiet from then.)
    fn prompt(&self, s: &State) -> bool {
        !s.connected || !s.to_broker.is_empty() || self.sendable(s).is_some()
    }

    /// What the broker sends next, if the driver reads: what it sends again first, then its
    /// queue while its in-flight limit allows.
    fn sendable(&self, s: &State) -> Option<(Msg, bool)> {
        if !s.connected || !s.reading() {
            return None;
        }
        match s.resend.front() {
            Some(m) => Some((*m, true)),
            None if s.inflight.len() < WINDOW => s.queue.front().map(|m| (*m, false)),
            None => None,
        }
    }

    fn step(&self, s: &State, action: &Action) -> Option<State> {
        let mut s = s.clone();
        let now = self.at(s.now);
        match action {
            Action::Publish(rule) => {
                s.publishes = s.publishes.checked_sub(1)?;
                let copies = s.subs.iter().filter(|f| matched_as(f) == rule.filter());
                for _ in 0..copies.count() {
                    let copy = Msg {
                        id: s.next_id,
                        rule: *rule,
                    };
                    s.next_id += 1;
                    s.queue.push_back(copy);
                }
            }
            Action::Deliver => self.deliver(&mut s, now)?,
            Action::BrokerRead => match s.to_broker.pop_front()? {
                // Its SUBACK says nothing the verdicts use.
                Up::Subscribe(fs) => s.subs.extend(fs),
                // Its UNSUBACK follows every PUBLISH sent before it.
                Up::Unsubscribe(fs) => {
                    for f in fs {
                        s.subs.remove(&f);
                    }
                    s.handover.unsubscribe_answered(now);
                }
            },
            Action::Judge => {
                let (m, epoch) = s.judging.pop_front()?;
                // The router's answer: a copy of `r` reaches no rule kept.
                let retiring = self.scenario == Scenario::Retire && s.listed;
                let alone = (retiring && m.rule == Rule::R).then_some("r");
                s.handover.routed(alone);
                s.window.push_back((m, epoch));
            }
            Action::Complete => self.complete(&mut s, now)?,
            Action::Disconnect => {
                if !s.connected {
                    return None;
                }
                s.disconnects = s.disconnects.checked_sub(1)?;
                s.connected = false;
                s.resend.clear();
                s.to_broker.clear();
                s.handover.disconnected();
            }
            Action::Connect => self.connect(&mut s, now)?,
            Action::Sync => {
                s.syncs = s.syncs.checked_sub(1)?;
                self.reload(&mut s, now);
            }
            Action::Tick => {
                if s.now >= T_MAX || self.prompt(&s) {
                    return None;
                }
                s.now += 1;
            }
        }
        Some(s)
    }

    /// The broker sends the driver its next message (see [`Self::sendable`]).
    fn deliver(&self, s: &mut State, now: Instant) -> Option<()> {
        let (m, again) = self.sendable(s)?;
        if again {
            s.resend.pop_front();
        } else {
            s.queue.pop_front();
            s.inflight.push((m, false));
        }
        s.handover.delivered(now);
        s.judging.push_back((m, s.epoch));
        let reading = s.reading();
        s.handover.set_reading(reading, now);
        Some(())
    }

    /// Kafka took the window's oldest message (acks go in arrival order: which of its records
    /// Kafka takes first does not matter here). Never prompt: Kafka may be slow or down for as
    /// long as the checker lets time pass.
    fn complete(&self, s: &mut State, now: Instant) -> Option<()> {
        let (m, epoch) = s.window.pop_front()?;
        // Acknowledged only on the connection it arrived on; the broker reads the ack within a
        // round trip, and nothing the verdicts use happens in between.
        if s.connected && epoch == s.epoch {
            s.inflight.retain(|(i, _)| i.id != m.id);
        } else if let Some(held) = s.inflight.iter_mut().find(|(i, _)| i.id == m.id) {
            held.1 = true;
        }
        s.handover.completed(1, now);
        let reading = s.reading();
        s.handover.set_reading(reading, now);
        Some(())
    }

    /// A new connection on the resumed session: the broker sends again what it had in
    /// flight; the driver subscribes its plan and unsubscribes what the session must lose.
    fn connect(&self, s: &mut State, now: Instant) -> Option<()> {
        if s.connected {
            return None;
        }
        s.connected = true;
        s.epoch += 1;
        s.resend = s.inflight.iter().map(|(m, _)| *m).collect();
        let reading = s.reading();
        s.handover.connected(reading, now);
        let plan = self.plan(s.listed);
        if !plan.subscribe.is_empty() {
            s.to_broker.push_back(Up::Subscribe(filters(plan)));
        }
        let later = std::mem::take(&mut s.unsubscribe_later);
        let gone = handover::unsubscribe_on_connect(plan, later, true);
        if !gone.is_empty() {
            s.to_broker.push_back(Up::Unsubscribe(gone));
            s.handover.unsubscribe_sent(1);
        }
        Some(())
    }

    /// The forwarder reads its config again, the listing flipped: as the pipeline applies it.
    fn reload(&self, s: &mut State, now: Instant) {
        let (old, new) = (self.plan(s.listed), self.plan(!s.listed));
        s.listed = !s.listed;
        self.configure(&mut s.handover, s.listed, now);
        let (added, removed) = handover::subscription_changes(&old.subscribe, &new.subscribe);
        if !s.connected {
            // The next connection subscribes the plan anyway.
            s.unsubscribe_later.extend(removed);
            return;
        }
        if !added.is_empty() {
            let added = added.into_iter().map(|(f, _)| f).collect();
            s.to_broker.push_back(Up::Subscribe(added));
        }
        if !removed.is_empty() {
            s.to_broker.push_back(Up::Unsubscribe(removed));
            s.handover.unsubscribe_sent(1);
        }
    }

    /// Once the verdict is given: no copy the session was given for the leaving filters is
    /// anywhere but in Kafka (the model loses none: each is queued, sent, waits for its
    /// judgement, is in the window, or is done), those the broker still counts in flight
    /// included (their acks on the way); and nothing more can be queued for them.
    fn nothing_left(&self, s: &State) -> bool {
        let leaving = |m: &Msg| self.leaving(m);
        (s.inflight.iter()).all(|(m, in_kafka)| *in_kafka || !leaving(m))
            && !s.queue.iter().any(leaving)
            && !s.resend.iter().any(leaving)
            && !s.judging.iter().any(|(m, _)| leaving(m))
            && !s.window.iter().any(|(m, _)| leaving(m))
            && !s.subs.iter().any(|f| self.leaving_filter(f))
            && !s.to_broker.iter().any(|u| match u {
                Up::Subscribe(fs) => fs.iter().any(|f| self.leaving_filter(f)),
                _ => false,
            })
    }

    /// From `s`, the broker and Kafka back up and nothing more going wrong: what is enabled is
    /// done, time passes only when nothing is; the verdict must come within the quiet of
    /// nothing being left to do.
    fn ends_once_up(&self, s: &State) -> bool {
        const PROMPT: [Action; 5] = [
            Action::Connect,
            Action::BrokerRead,
            Action::Deliver,
            Action::Judge,
            Action::Complete,
        ];
        let mut s = s.clone();
        let mut idle_ticks = 0;
        // Each prompt step moves a message or a packet one place on: far fewer than this.
        for _ in 0..100 {
            if self.verdict(&s) {
                return true;
            }
            match PROMPT.iter().find_map(|a| self.step(&s, a)) {
                Some(next) => {
                    s = next;
                    idle_ticks = 0;
                }
                None if idle_ticks < 2 => {
                    idle_ticks += 1;
                    s.now += 1;
                }
                None => return false,
            }
        }
        false
    }
}

impl Model for HandoverModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![self.start()]
    }

    fn actions(&self, _: &State, actions: &mut Vec<Action>) {
        // Draining, every rule leaves: one is enough.
        if self.scenario == Scenario::Retire {
            actions.push(Action::Publish(Rule::K));
        }
        actions.extend([
            Action::Publish(Rule::R),
            Action::Deliver,
            Action::BrokerRead,
            Action::Judge,
            Action::Complete,
            Action::Disconnect,
            Action::Connect,
            Action::Sync,
            Action::Tick,
        ]);
    }

    fn next_state(&self, s: &State, action: Action) -> Option<State> {
        self.step(s, &action)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(
                "a verdict leaves nothing behind",
                |m: &HandoverModel, s: &State| !m.verdict(s) || m.nothing_left(s),
            ),
            Property::always(
                "the hand-over ends once the broker and Kafka are up",
                |m: &HandoverModel, s: &State| !s.listed || m.ends_once_up(s),
            ),
            // The model reaches what the verdicts are about.
            Property::sometimes("a verdict", |m: &HandoverModel, s: &State| m.verdict(s)),
            Property::sometimes(
                "a leaving message waits for its judgement after the quiet",
                |m: &HandoverModel, s: &State| {
                    s.now >= 2
                        && s.handover.reading()
                        && s.judging.iter().any(|(j, _)| m.leaving(j))
                },
            ),
            Property::sometimes(
                "a copy is sent again on a new connection",
                |m: &HandoverModel, s: &State| {
                    s.epoch >= 2 && s.resend.iter().any(|r| m.leaving(r))
                },
            ),
        ]
    }
}

fn check(scenario: Scenario, run: Run) {
    let started = std::time::Instant::now();
    let checker = HandoverModel::new(scenario, run)
        .checker()
        .spawn_bfs()
        .join();
    eprintln!(
        "{scenario:?} {run:?}: {} states ({} unique), depth {}, in {:.1?}",
        checker.state_count(),
        checker.unique_state_count(),
        checker.max_depth(),
        started.elapsed()
    );
    checker.assert_properties();
}

/// A fresh process on a session holding two messages, its listing reversed and given again;
/// and a running one listed while a message is published.
#[test]
fn a_drained_session_holds_nothing_and_a_drain_ends() {
    check(
        Scenario::Drain,
        Run {
            restarted: Some(&[Rule::R, Rule::K]),
            publishes: 0,
            disconnects: 1,
            syncs: 2,
        },
    );
    check(
        Scenario::Drain,
        Run {
            restarted: None,
            publishes: 1,
            disconnects: 1,
            syncs: 2,
        },
    );
}

/// As for the drain: a fresh process on a session holding a message of the retiring rule,
/// its listing reversed and given again; and a running one whose rule is listed while a
/// message of it, or of the rule it keeps, is published.
#[test]
fn a_retiring_rule_handed_over_has_nothing_left_and_a_hand_over_ends() {
    check(
        Scenario::Retire,
        Run {
            restarted: Some(&[Rule::R]),
            publishes: 0,
            disconnects: 1,
            syncs: 2,
        },
    );
    check(
        Scenario::Retire,
        Run {
            restarted: None,
            publishes: 1,
            disconnects: 1,
            syncs: 2,
        },
    );
}
