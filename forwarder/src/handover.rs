//! The forwarder's part of the hand-over between groups, as one pure machine: it is told what
//! happens (the connection, UNSUBSCRIBEs and their answers, each message received from the
//! broker, routed, and done, and what the config lists) with the time it happened, and answers
//! whether a draining forwarder's session holds nothing more (`drained`) and whether a
//! retiring rule's old subscription has nothing more for it (`handed_over`). No I/O, no clock:
//! the MQTT driver and the pipeline feed it, `/status` asks it, and `tests/handover_model.rs`
//! checks it over every interleaving of a small broker and session.
//!
//! Both verdicts end on quiet, not on proof: a broker sends what it queued for a connected
//! session as soon as the session reads (Mosquitto does, in order), so a stretch of [`QUIET`]
//! during which the session was connected, had every UNSUBSCRIBE answered and read, and
//! received nothing that counts, shows that nothing more is queued. What the forwarder has
//! received and not yet acknowledged counts until it is acknowledged, wherever it is: waiting
//! for its judgement (an expression evaluated off the read thread can take seconds), in the
//! window, or its ack not yet written.

use std::collections::{BTreeMap, BTreeSet, HashSet, VecDeque};
use std::time::{Duration, Instant};

use ferry_api::config::SubscriptionPlan;

/// How long a settled session must receive nothing that counts before a verdict is given.
/// The broker sends what it queued within a round trip of the session reading; this is many
/// round trips, and short next to a scale-down or a ConfigMap sync.
pub const QUIET: Duration = Duration::from_secs(2);

/// See the module's documentation. `Hash` and `Eq` so that a model checker can keep states of
/// it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Handover {
    /// The config lists this forwarder in `drain`.
    draining: bool,
    /// The rules the config lists in `retiring`, by name.
    retiring: BTreeMap<String, Retiring>,
    /// None while no connection is up.
    connection: Option<Connection>,
    /// Messages received from the broker since the process started (the last one's number).
    received: u64,
    /// Messages done since the process started: acknowledged, or given up with their
    /// connection (the broker redelivers those). Done in the order they arrived.
    completed: u64,
    /// The messages received and not routed yet (which rules they are for is not known):
    /// their number and when each arrived, oldest first. Routed in the order they arrived.
    unrouted: VecDeque<(u64, Instant)>,
    last_delivery: Option<Instant>,
    last_completion: Option<Instant>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Connection {
    since: Instant,
    /// UNSUBSCRIBE packets sent on it and not answered yet.
    unsubscribes_pending: usize,
    /// When the last UNSUBACK that left none pending came.
    unsubscribes_answered: Option<Instant>,
    /// Since when the driver takes messages (its window has room); None while it does not:
    /// what the broker holds back then is unknown, so quiet proves nothing.
    reading_since: Option<Instant>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Retiring {
    /// When the config listed it (its UNSUBSCRIBE went out then, if it had one).
    since: Instant,
    /// Every message received until then must be done: some may be its own.
    received_before: u64,
    /// The last message routed to it and to no rule kept (the number, when it arrived): its
    /// old subscription still delivered that one.
    last_alone: Option<(u64, Instant)>,
}

impl Handover {
    /// Whether the config lists this forwarder in `drain`.
    pub fn set_draining(&mut self, draining: bool) {
        self.draining = draining;
    }

    pub fn draining(&self) -> bool {
        self.draining
    }

    /// The rules the config lists in `retiring` now; a rule newly listed starts its quiet at
    /// `now`, one no longer listed is forgotten.
    pub fn set_retiring<'a>(&mut self, rules: impl IntoIterator<Item = &'a str>, now: Instant) {
        let mut listed = BTreeMap::new();
        for rule in rules {
            let state = self.retiring.remove(rule).unwrap_or(Retiring {
                since: now,
                received_before: self.received,
                last_alone: None,
            });
            listed.insert(rule.to_owned(), state);
        }
        self.retiring = listed;
    }

    pub fn is_retiring(&self, rule: &str) -> bool {
        self.retiring.contains_key(rule)
    }

    /// A connection is up (its CONNACK came), the driver taking messages or not.
    pub fn connected(&mut self, reading: bool, now: Instant) {
        self.connection = Some(Connection {
            since: now,
            unsubscribes_pending: 0,
            unsubscribes_answered: None,
            reading_since: reading.then_some(now),
        });
    }

    /// The connection is gone; what was pending on it with it.
    pub fn disconnected(&mut self) {
        self.connection = None;
    }

    /// `packets` UNSUBSCRIBEs went out on the current connection.
    pub fn unsubscribe_sent(&mut self, packets: usize) {
        if let Some(c) = self.connection.as_mut() {
            c.unsubscribes_pending += packets;
        }
    }

    /// An UNSUBACK came on the current connection.
    pub fn unsubscribe_answered(&mut self, now: Instant) {
        if let Some(c) = self.connection.as_mut() {
            c.unsubscribes_pending = c.unsubscribes_pending.saturating_sub(1);
            if c.unsubscribes_pending == 0 {
                c.unsubscribes_answered = Some(now);
            }
        }
    }

    /// Whether the driver takes messages now (its window, in messages and bytes, has room).
    pub fn set_reading(&mut self, reading: bool, now: Instant) {
        if let Some(c) = self.connection.as_mut() {
            match (reading, c.reading_since) {
                (true, None) => c.reading_since = Some(now),
                (false, Some(_)) => c.reading_since = None,
                _ => {}
            }
        }
    }

    /// Whether the driver took messages when it last said.
    pub fn reading(&self) -> bool {
        self.connection
            .as_ref()
            .is_some_and(|c| c.reading_since.is_some())
    }

    /// A message was received from the broker.
    pub fn delivered(&mut self, now: Instant) {
        self.received += 1;
        self.unrouted.push_back((self.received, now));
        self.last_delivery = Some(now);
    }

    /// The oldest message not routed yet was routed; `alone_for`: the retiring rules it went
    /// to when no rule kept took it (their old subscription still delivers).
    pub fn routed<'a>(&mut self, alone_for: impl IntoIterator<Item = &'a str>) {
        let Some(arrived) = self.unrouted.pop_front() else {
            return;
        };
        for rule in alone_for {
            if let Some(r) = self.retiring.get_mut(rule) {
                r.last_alone = Some(arrived);
            }
        }
    }

    /// `n` messages are done, the oldest first: acknowledged, or given up with their
    /// connection.
    pub fn completed(&mut self, n: usize, now: Instant) {
        if n == 0 {
            return;
        }
        self.completed = (self.completed + n as u64).min(self.received);
        self.last_completion = Some(now);
    }

    /// Messages received from the broker and not done yet, wherever they are.
    pub fn unfinished(&self) -> u64 {
        self.received - self.completed
    }

    /// Since when the session is connected with every UNSUBSCRIBE answered and the driver
    /// reading; None while it is not.
    fn settled_since(&self) -> Option<Instant> {
        let c = self.connection.as_ref()?;
        if c.unsubscribes_pending > 0 {
            return None;
        }
        let reading = c.reading_since?;
        Some(
            [Some(c.since), c.unsubscribes_answered, Some(reading)]
                .into_iter()
                .flatten()
                .fold(reading, Instant::max),
        )
    }

    /// Draining, and the session holds nothing more: settled, every message received is done,
    /// and for [`QUIET`] since it settled nothing arrived and nothing was acknowledged (an
    /// acknowledgement frees a slot of the broker's own in-flight window, which it may then
    /// fill from its queue).
    pub fn drained(&self, now: Instant) -> bool {
        if !self.draining || self.unfinished() > 0 {
            return false;
        }
        self.settled_since().is_some_and(|settled| {
            let last = [self.last_delivery, self.last_completion]
                .into_iter()
                .flatten()
                .fold(settled, Instant::max);
            now.saturating_duration_since(last) >= QUIET
        })
    }

    /// None unless `rule` is retiring; then whether it is handed over: settled, and for
    /// [`QUIET`] since it settled, since it was listed and since the last message that came
    /// for it alone, every message that arrived has been routed and none came for it alone;
    /// and every message received before it was listed, or up to that last one, is done.
    pub fn handed_over(&self, rule: &str, now: Instant) -> Option<bool> {
        let r = self.retiring.get(rule)?;
        let Some(settled) = self.settled_since() else {
            return Some(false);
        };
        let from = [Some(r.since), r.last_alone.map(|(_, at)| at)]
            .into_iter()
            .flatten()
            .fold(settled, Instant::max);
        let Some(quiet_until) = from.checked_add(QUIET) else {
            return Some(false);
        };
        let quiet = now >= quiet_until;
        // A message that arrived during the quiet and is not routed yet may be its own.
        let judged = self
            .unrouted
            .front()
            .is_none_or(|(_, arrived)| *arrived >= quiet_until);
        let must_be_done = r.last_alone.map_or(0, |(n, _)| n).max(r.received_before);
        Some(quiet && judged && self.completed >= must_be_done)
    }
}

/// What a reload subscribes (new filters, and those whose QoS changed) and unsubscribes: in
/// time linear in the filters. The new filters go out before the old ones are unsubscribed,
/// so that a filter changing form (shared, plain) is never subscribed in neither.
pub fn subscription_changes(
    old: &[(String, u8)],
    new: &[(String, u8)],
) -> (Vec<(String, u8)>, Vec<String>) {
    let old_set: HashSet<(&str, u8)> = old.iter().map(|(f, q)| (f.as_str(), *q)).collect();
    let new_filters: HashSet<&str> = new.iter().map(|(f, _)| f.as_str()).collect();
    let added = new
        .iter()
        .filter(|(f, q)| !old_set.contains(&(f.as_str(), *q)))
        .cloned()
        .collect();
    let removed = old
        .iter()
        .filter(|(f, _)| !new_filters.contains(f.as_str()))
        .map(|(f, _)| f.clone())
        .collect();
    (added, removed)
}

/// What a new connection unsubscribes, besides subscribing `plan.subscribe`: the filters a
/// reload dropped while no connection was up (`dropped_offline`), and on a resumed session
/// every form of the rules' filters an earlier config or process may have left subscribed
/// (the other shared/plain form, a retiring rule's, everything while draining): the broker
/// would go on delivering them. Never what it subscribes; sorted, each once.
pub fn unsubscribe_on_connect(
    plan: &SubscriptionPlan,
    dropped_offline: Vec<String>,
    session_present: bool,
) -> Vec<String> {
    let resumed = if session_present {
        plan.unsubscribe_on_connect.clone()
    } else {
        Vec::new()
    };
    dropped_offline
        .into_iter()
        .chain(resumed)
        .filter(|f| !plan.subscribe.iter().any(|(s, _)| s == f))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A clock for the tests: `at(s)` is `s` seconds after a fixed start.
    struct Clock(Instant);

    impl Clock {
        fn new() -> Self {
            Self(Instant::now())
        }
        fn at(&self, secs: f64) -> Instant {
            self.0 + Duration::from_secs_f64(secs)
        }
    }

    /// Connected and reading at 0, listed in `drain`, unsubscribed and answered at 0.1.
    fn draining(clock: &Clock) -> Handover {
        let mut h = Handover::default();
        h.set_draining(true);
        h.connected(true, clock.at(0.0));
        h.unsubscribe_sent(1);
        h.unsubscribe_answered(clock.at(0.1));
        h
    }

    #[test]
    fn drained_after_quiet_once_settled() {
        let c = Clock::new();
        let h = draining(&c);
        assert!(
            !h.drained(c.at(2.0)),
            "2 s since the connect, not the UNSUBACK"
        );
        assert!(h.drained(c.at(2.1)));
        let mut not_listed = h.clone();
        not_listed.set_draining(false);
        assert!(!not_listed.drained(c.at(9.0)));
    }

    #[test]
    fn not_drained_while_an_unsubscribe_is_unanswered_or_disconnected_or_not_reading() {
        let c = Clock::new();
        let mut h = draining(&c);
        h.unsubscribe_sent(2);
        h.unsubscribe_answered(c.at(1.0));
        assert!(!h.drained(c.at(9.0)), "one of two UNSUBSCRIBEs answered");
        h.unsubscribe_answered(c.at(1.0));
        assert!(h.drained(c.at(3.0)));
        h.set_reading(false, c.at(3.0));
        assert!(
            !h.drained(c.at(9.0)),
            "a full window holds back what the broker has"
        );
        h.set_reading(true, c.at(9.0));
        assert!(!h.drained(c.at(10.9)) && h.drained(c.at(11.0)));
        h.disconnected();
        assert!(!h.drained(c.at(20.0)));
        h.connected(true, c.at(20.0));
        assert!(
            !h.drained(c.at(21.9)) && h.drained(c.at(22.0)),
            "quiet on the new connection"
        );
    }

    /// The fix of issue 35, item 4: what waits for its judgement, or anywhere before its ack,
    /// counts, however long ago it arrived.
    #[test]
    fn not_drained_while_a_message_received_is_not_acknowledged() {
        let c = Clock::new();
        let mut h = draining(&c);
        h.delivered(c.at(0.5));
        h.delivered(c.at(0.5));
        assert!(!h.drained(c.at(60.0)), "both wait for their judgement");
        h.routed([]);
        h.routed([]);
        assert!(!h.drained(c.at(60.0)), "both in the window");
        h.completed(1, c.at(60.0));
        assert!(!h.drained(c.at(120.0)), "one not acknowledged");
        h.completed(1, c.at(120.0));
        assert!(
            !h.drained(c.at(121.9)),
            "the last ack may free the broker's window"
        );
        assert!(h.drained(c.at(122.0)));
    }

    fn retiring(clock: &Clock, received_before: usize) -> Handover {
        let mut h = Handover::default();
        h.connected(true, clock.at(0.0));
        for _ in 0..received_before {
            h.delivered(clock.at(0.0));
            h.routed([]);
        }
        h.set_retiring(["moved"], clock.at(1.0));
        h.unsubscribe_sent(1);
        h.unsubscribe_answered(clock.at(1.1));
        h
    }

    #[test]
    fn handed_over_after_quiet_with_what_came_before_it_done() {
        let c = Clock::new();
        let mut h = retiring(&c, 2);
        assert_eq!(h.handed_over("kept", c.at(9.0)), None, "not retiring");
        assert_eq!(
            h.handed_over("moved", c.at(9.0)),
            Some(false),
            "two not done"
        );
        h.completed(2, c.at(2.0));
        assert_eq!(h.handed_over("moved", c.at(3.0)), Some(false));
        assert_eq!(h.handed_over("moved", c.at(3.1)), Some(true));
        h.set_retiring([], c.at(4.0));
        assert_eq!(h.handed_over("moved", c.at(9.0)), None, "no longer listed");
    }

    #[test]
    fn a_message_for_the_rule_alone_starts_the_quiet_again_and_must_be_done() {
        let c = Clock::new();
        let mut h = retiring(&c, 0);
        h.delivered(c.at(2.0));
        h.routed(["moved"]);
        h.delivered(c.at(2.5));
        h.routed([]);
        h.completed(1, c.at(2.6));
        assert_eq!(h.handed_over("moved", c.at(3.9)), Some(false));
        assert_eq!(
            h.handed_over("moved", c.at(4.0)),
            Some(true),
            "its own is done"
        );
        // Kept rules' traffic goes on: it neither starts the quiet again nor must be done.
        h.delivered(c.at(4.2));
        assert_eq!(h.handed_over("moved", c.at(9.0)), Some(true));
    }

    #[test]
    fn not_handed_over_while_a_message_of_the_quiet_waits_for_its_judgement() {
        let c = Clock::new();
        let mut h = retiring(&c, 0);
        h.delivered(c.at(2.0));
        assert_eq!(
            h.handed_over("moved", c.at(9.0)),
            Some(false),
            "it may be the rule's own"
        );
        h.routed(["moved"]);
        assert_eq!(h.handed_over("moved", c.at(9.0)), Some(false), "not done");
        h.completed(1, c.at(9.0));
        assert_eq!(h.handed_over("moved", c.at(9.0)), Some(true));
        // After the quiet, what waits cannot be its own: the broker sent that long before.
        h.delivered(c.at(4.0));
        assert_eq!(h.handed_over("moved", c.at(9.0)), Some(true));
    }

    fn plan(extra: &str) -> SubscriptionPlan {
        let yaml = format!(
            "mqtt: {{ host: h, client_id: me, shared_group: g, subscribe_shared: false }}\n\
             kafka: {{ bootstrap_servers: \"k:9092\" }}\n\
             rules:\n\
             \x20 - {{ name: moved, mqtt: {{ topics: [\"m/#\"] }}, kafka: {{ topic: m }} }}\n\
             \x20 - {{ name: kept, mqtt: {{ topics: [\"k/#\"] }}, kafka: {{ topic: k }} }}\n{extra}"
        );
        match ferry_api::load_str(&yaml, |_| None) {
            Ok(loaded) => loaded.config.subscription_plan(),
            Err(e) => panic!("{e}"),
        }
    }

    /// Issue 35, item 2: a fresh process on a resumed session loses a retiring rule's filter
    /// in both forms an earlier process may have subscribed, and everything while draining.
    #[test]
    fn a_resumed_session_loses_every_form_of_what_the_config_no_longer_subscribes() {
        let retiring = plan("retiring: [moved]\n");
        assert_eq!(
            unsubscribe_on_connect(&retiring, Vec::new(), true),
            ["$share/g/k/#", "$share/g/m/#", "m/#"]
        );
        let draining = plan("drain: [me]\n");
        assert_eq!(
            unsubscribe_on_connect(&draining, vec!["m/#".to_owned()], true),
            ["$share/g/k/#", "$share/g/m/#", "k/#", "m/#"]
        );
        // A new session holds nothing; what a reload dropped offline goes all the same.
        assert_eq!(
            unsubscribe_on_connect(&retiring, vec!["old/#".to_owned(), "k/#".to_owned()], false),
            ["old/#"],
            "never what it subscribes"
        );
    }

    #[test]
    fn a_reload_subscribes_what_is_new_or_changed_and_unsubscribes_what_is_gone() {
        let old = [("a".to_owned(), 1), ("b".to_owned(), 1)];
        let new = [("b".to_owned(), 2), ("c".to_owned(), 0)];
        let (added, removed) = subscription_changes(&old, &new);
        assert_eq!(added, [("b".to_owned(), 2), ("c".to_owned(), 0)]);
        assert_eq!(removed, ["a"]);
    }

    #[test]
    fn a_rule_listed_again_keeps_its_quiet_and_one_listed_anew_starts_one() {
        let c = Clock::new();
        let mut h = retiring(&c, 0);
        h.set_retiring(["moved", "other"], c.at(2.0));
        assert_eq!(h.handed_over("moved", c.at(3.1)), Some(true));
        assert_eq!(h.handed_over("other", c.at(3.1)), Some(false));
        assert_eq!(h.handed_over("other", c.at(4.0)), Some(true));
        assert!(h.is_retiring("other") && !h.is_retiring("kept"));
    }
}
