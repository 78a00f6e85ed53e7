//! The failure rule against real Kafka: nothing is acknowledged to MQTT that is not in Kafka,
//! and only a record Kafka can never take *as that record* leaves the normal path.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use common::{Brokers, Forwarder, runtime, wait_until};
use ferry_e2e::Record;

/// `"<mqtt topic>:<n>"`, then for an oversized message `|` and incompressible filler.
fn payload(mqtt_topic: &str, n: usize, big: bool) -> Vec<u8> {
    let mut p = format!("{mqtt_topic}:{n}").into_bytes();
    if big {
        p.push(b'|');
        let mut filler = vec![0u8; 256 * 1024];
        rand::Rng::fill(&mut rand::rng(), &mut filler[..]);
        // Random bytes without '|', so the id stays the part before the first one.
        p.extend(filler.into_iter().map(|b| if b == b'|' { 0 } else { b }));
    }
    p
}

/// The `"<mqtt topic>:<n>"` prefix of each record, in partition order.
fn ids(records: &[Record]) -> Vec<(String, usize)> {
    records
        .iter()
        .map(|r| {
            let head = r.value.split(|b| *b == b'|').next().unwrap_or_default();
            let text = std::str::from_utf8(head).expect("utf-8 id");
            let (topic, n) = text.rsplit_once(':').expect("numbered payload");
            (topic.to_owned(), n.parse().expect("number"))
        })
        .collect()
}

/// Every id once; returns how many landed after a later one of their MQTT topic.
fn assert_exactly(what: &str, got: &[(String, usize)], want: &BTreeSet<(String, usize)>) -> usize {
    let got_set: BTreeSet<(String, usize)> = got.iter().cloned().collect();
    let missing: Vec<_> = want.difference(&got_set).collect();
    let unexpected: Vec<_> = got_set.difference(want).collect();
    assert!(
        missing.is_empty() && unexpected.is_empty(),
        "{what}: {} missing (first {:?}), {} unexpected (first {:?})",
        missing.len(),
        missing.first(),
        unexpected.len(),
        unexpected.first()
    );
    assert_eq!(got.len(), got_set.len(), "{what}: duplicates");
    let mut highest: BTreeMap<&str, usize> = BTreeMap::new();
    let mut late = 0;
    for (topic, n) in got {
        let h = highest.entry(topic).or_insert(*n);
        if *n < *h {
            late += 1;
        }
        *h = (*h).max(*n);
    }
    late
}

/// Ids of numbered messages: (MQTT topic, number).
type Ids = BTreeSet<(String, usize)>;

/// `total` numbered messages, round-robin over the MQTT topics `<prefix>/0` .. `<prefix>/<topics - 1>`:
/// their ids, and the messages to publish in order.
fn numbered(prefix: &str, topics: usize, total: usize) -> (Ids, Vec<(String, Vec<u8>)>) {
    let msgs: Vec<(String, Vec<u8>)> = (0..total)
        .map(|n| {
            let topic = format!("{prefix}/{}", n % topics);
            let p = payload(&topic, n, false);
            (topic, p)
        })
        .collect();
    let want = (0..total)
        .map(|n| (format!("{prefix}/{}", n % topics), n))
        .collect();
    (want, msgs)
}

/// Every id once, and per MQTT topic in increasing order.
fn assert_exactly_in_order(what: &str, got: &[(String, usize)], want: &BTreeSet<(String, usize)>) {
    assert_eq!(
        assert_exactly(what, got, want),
        0,
        "{what}: out of order: {got:?}"
    );
}

/// Oversized messages mixed into a stream on the same MQTT topics (so the same partition):
/// the forwarder learns the topics' `max.message.bytes` and produces a record that may exceed
/// it alone, so Kafka never refuses a batch holding later records. Exactly the oversized ones
/// are dead-lettered (rule with a dead-letter topic) or dropped and counted (rule with
/// `on_unwritable: drop`); every valid one arrives, once, in order per MQTT topic (before,
/// records refused with an oversized batch-mate could land after later ones).
#[test]
fn only_the_oversized_messages_of_a_mixed_stream_leave_the_normal_path() {
    let brokers = Brokers::start();
    let rt = runtime();
    let bootstrap = brokers.kafka.bootstrap();
    for t in ["sized.a", "sized.b"] {
        rt.block_on(common::create_topic_with_limit(&bootstrap, t, 64 * 1024));
    }
    rt.block_on(brokers.kafka.create_topic("sized.dlq", 1))
        .expect("topic");
    let rules = "  - name: with-dlq\n    mqtt: { topics: [\"a/+\"] }\n    kafka: { topic: sized.a }\n    dead_letter: { topic: sized.dlq }\n\
                 \x20 - name: dropping\n    mqtt: { topics: [\"b/+\"] }\n    kafka: { topic: sized.b }\n    on_unwritable: drop\n";
    let mut fwd = Forwarder::start(&brokers.config("ferry-sized", rules));
    fwd.wait_ready(Duration::from_secs(30));

    let per_rule = 2000;
    let mut msgs = Vec::new();
    let mut want: BTreeMap<(&str, bool), BTreeSet<(String, usize)>> = BTreeMap::new();
    for n in 0..per_rule {
        for prefix in ["a", "b"] {
            let topic = format!("{prefix}/{}", n % 4);
            let big = n % 97 == 13;
            msgs.push((topic.clone(), payload(&topic, n, big)));
            want.entry((prefix, big)).or_default().insert((topic, n));
        }
    }
    let bigs = want.get(&("b", true)).map_or(0, BTreeSet::len);
    rt.block_on(ferry_e2e::publish(
        brokers.mqtt.port(),
        "pub-sized",
        rumqttc::QoS::AtLeastOnce,
        msgs,
    ))
    .expect("publish");
    wait_until(&fwd, Duration::from_secs(60), "every message acked", || {
        fwd.metric("ferry_mqtt_acked_messages_total") >= (2 * per_rule) as f64
    });
    let read = |topic: &str, n: usize| {
        ids(&brokers
            .kafka
            .read_all(topic, n, Duration::from_secs(2), Duration::from_secs(30))
            .expect("read"))
    };
    let empty = BTreeSet::new();
    let want_of = |k| want.get(&k).unwrap_or(&empty);
    let want_a = want_of(("a", false));
    let late_a = assert_exactly("sized.a", &read("sized.a", want_a.len()), want_a);
    let want_b = want_of(("b", false));
    let late_b = assert_exactly("sized.b", &read("sized.b", want_b.len()), want_b);
    let want_dlq = want_of(("a", true));
    assert_exactly_in_order("sized.dlq", &read("sized.dlq", want_dlq.len()), want_dlq);
    assert_eq!(
        (late_a, late_b),
        (0, 0),
        "records that landed after a later one of their MQTT topic (with a dead-letter topic, with drop)"
    );
    let status = fwd.status().expect("status");
    let dropping = status.rule("dropping").expect("rule");
    assert_eq!(
        dropping.failed, bigs as u64,
        "exactly the oversized ones dropped"
    );
    let with_dlq = status.rule("with-dlq").expect("rule");
    assert_eq!(with_dlq.dead_lettered, want_of(("a", true)).len() as u64);
    eprintln!(
        "mixed stream: {per_rule} per rule, {bigs} oversized each; landed after a later one: {late_a} + {late_b}"
    );
}

/// `"<mqtt topic>:<n>|"` and `size` bytes in all (filler after the id).
fn sized(mqtt_topic: &str, n: usize, size: usize) -> Vec<u8> {
    let mut p = format!("{mqtt_topic}:{n}|").into_bytes();
    p.resize(size.max(p.len()), b'.');
    p
}

/// One tenant floods its rule with large messages: those over `mqtt.max_message_bytes` (the
/// default, 1 MiB) are skipped unread and dead-lettered with the reason and without the payload;
/// those under it, which the window holds by bytes, all land in Kafka; and the neighbour rule's
/// small messages, published in between, all land, once and in order, without waiting on them.
#[test]
fn a_flood_of_large_messages_fails_only_the_oversized_ones_and_the_neighbour_flows() {
    const MIB: usize = 1024 * 1024;
    let brokers = Brokers::start();
    let rt = runtime();
    for t in ["flood.big", "flood.dlq", "flood.small"] {
        rt.block_on(brokers.kafka.create_topic(t, 1))
            .expect("topic");
    }
    let rules = "  - name: bad\n    mqtt: { topics: [\"big/+\"] }\n    kafka: { topic: flood.big }\n    dead_letter: { topic: flood.dlq }\n\
                 \x20 - name: good\n    mqtt: { topics: [\"small/+\"] }\n    kafka: { topic: flood.small }\n";
    let mut fwd = Forwarder::start(&brokers.config("ferry-flood", rules));
    fwd.wait_ready(Duration::from_secs(30));
    let (rounds, small_per_round) = (40, 25);
    let (mut msgs, mut over, mut under, mut small) = (
        Vec::new(),
        BTreeSet::new(),
        BTreeSet::new(),
        BTreeSet::new(),
    );
    for n in 0..rounds {
        // Over the limit (2 MiB), then under it (900 KiB, within Kafka's default 1 MB record).
        let topic = "big/over".to_owned();
        msgs.push((topic.clone(), sized(&topic, n, 2 * MIB)));
        over.insert((topic, n));
        let topic = "big/under".to_owned();
        msgs.push((topic.clone(), sized(&topic, n, 900 * 1024)));
        under.insert((topic, n));
        for k in 0..small_per_round {
            let topic = format!("small/{}", k % 5);
            let i = n * small_per_round + k;
            msgs.push((topic.clone(), sized(&topic, i, 100)));
            small.insert((topic, i));
        }
    }
    let total = msgs.len();
    brokers.publish_acked(&fwd, "pub-flood", msgs, total, Duration::from_secs(120));
    let read = |topic: &str, n: usize| {
        brokers.read(topic, n, Duration::from_secs(2), Duration::from_secs(60))
    };
    assert_exactly_in_order(
        "flood.small",
        &ids(&read("flood.small", small.len())),
        &small,
    );
    assert_exactly_in_order("flood.big", &ids(&read("flood.big", under.len())), &under);
    let dead = read("flood.dlq", over.len());
    assert_eq!(
        dead.len(),
        over.len(),
        "one dead letter per oversized message"
    );
    for record in &dead {
        assert!(
            record.value.is_empty(),
            "a dead letter without the unread payload"
        );
        let error = record.header("ferry.error").unwrap_or_default();
        assert!(
            error.contains("over the connection's mqtt.max_message_bytes"),
            "the reason, in ferry.error: {error:?}"
        );
    }
    let status = fwd.status().expect("status");
    let bad = status.rule("bad").expect("rule bad");
    assert_eq!(bad.dead_lettered, rounds as u64);
    let good = status.rule("good").expect("rule good");
    assert!(
        good.blocked_by.is_none() && good.held.is_none(),
        "good is not held: {good:?}"
    );
    assert_eq!(
        fwd.metric("ferry_mqtt_unread_messages_total"),
        rounds as f64
    );
    eprintln!(
        "flood: {rounds} of 2 MiB dead-lettered unread, {rounds} of 900 KiB and {} small forwarded",
        small.len()
    );
    drop(fwd);
    past_the_stall_budget_a_rules_records_take_its_dead_letter_topic(&brokers);
}

/// A rule whose topic does not exist, with a dead-letter topic and a stall budget of 3 s: its
/// records wait 3 s, then go to the dead-letter topic with the reason, in order, and the
/// neighbour's messages queued behind them in the order of acks all land. Every message is
/// acked within the design's bound: the budget, librdkafka's propagation limit (0.5 s), one
/// stall check (1 s) and the longest retry pause (10 s).
fn past_the_stall_budget_a_rules_records_take_its_dead_letter_topic(brokers: &Brokers) {
    let rt = runtime();
    for t in ["budget.dlq", "budget.ontime"] {
        rt.block_on(brokers.kafka.create_topic(t, 1))
            .expect("topic");
    }
    let rules = "  - name: later\n    mqtt: { topics: [\"later/+\"] }\n    kafka: { topic: budget.missing }\n    dead_letter: { topic: budget.dlq }\n    stall_budget_secs: 3\n\
                 \x20 - name: ontime\n    mqtt: { topics: [\"ontime/+\"] }\n    kafka: { topic: budget.ontime }\n";
    let config = brokers.config("ferry-budget", rules).replace(
        "  bootstrap_servers:",
        "  config: { topic.metadata.propagation.max.ms: 500 }\n  bootstrap_servers:",
    );
    let mut fwd = Forwarder::start(&config);
    fwd.wait_ready(Duration::from_secs(30));
    let (later, ontime) = (50, 100);
    let mut msgs = Vec::new();
    let (mut want_later, mut want_ontime) = (BTreeSet::new(), BTreeSet::new());
    for n in 0..later {
        let topic = format!("later/{}", n % 2);
        msgs.push((topic.clone(), payload(&topic, n, false)));
        want_later.insert((topic, n));
    }
    for n in 0..ontime {
        let topic = format!("ontime/{}", n % 3);
        msgs.push((topic.clone(), payload(&topic, n, false)));
        want_ontime.insert((topic, n));
    }
    let published = Instant::now();
    let bound = Duration::from_millis(3_000 + 500 + 1_000 + 10_000);
    brokers.publish_acked(&fwd, "pub-budget", msgs, later + ontime, bound);
    eprintln!(
        "stall budget 3 s: all {} acked {:.1} s after publishing",
        later + ontime,
        published.elapsed().as_secs_f64()
    );
    let read = |topic: &str, n: usize| {
        brokers.read(topic, n, Duration::from_secs(2), Duration::from_secs(30))
    };
    assert_exactly_in_order(
        "budget.ontime",
        &ids(&read("budget.ontime", ontime)),
        &want_ontime,
    );
    let dead = read("budget.dlq", later);
    assert_exactly_in_order("budget.dlq", &ids(&dead), &want_later);
    for record in &dead {
        let error = record.header("ferry.error").unwrap_or_default();
        assert!(
            error.starts_with("kafka topic budget.missing refused it for")
                && error.contains("over its rule's stall budget (3 s): unknown_topic"),
            "the reason, in ferry.error: {error:?}"
        );
    }
    let status = fwd.status().expect("status");
    let rule = status.rule("later").expect("rule");
    assert_eq!(rule.dead_lettered, later as u64);
    assert_eq!(
        fwd.metric_with(
            "ferry_rule_dead_lettered_messages_total",
            &["rule=\"later\""]
        ),
        later as f64
    );
}

/// A compacted topic refuses a record without a key (INVALID_RECORD), and with it the whole
/// batch the record was in. Two rules: `born` writes to a topic compacted from the start (the
/// forwarder learns it and sends a keyless record alone), `live` to one made compacted after
/// the forwarder learned it was not (so keyless records share batches, and each record of a
/// refused batch is judged again alone). Either way every keyed record lands, once and in
/// order, and only the keyless ones are dead-lettered (before, their batch-mates were too).
#[test]
fn only_the_invalid_records_of_a_refused_batch_are_dead_lettered() {
    let brokers = Brokers::start();
    let rt = runtime();
    let bootstrap = brokers.kafka.bootstrap();
    rt.block_on(common::create_topic_with_config(
        &bootstrap,
        "born",
        &[("cleanup.policy", "compact")],
    ));
    for t in ["live", "born.dlq", "live.dlq"] {
        rt.block_on(brokers.kafka.create_topic(t, 1))
            .expect("topic");
    }
    // `topic_level: 2`: `<rule>/dev/<n>` is keyed by `<n>`, `<rule>/dev` has no key.
    let rule = |name: &str| {
        format!(
            "  - name: {name}\n    mqtt: {{ topics: [\"{name}/#\"] }}\n    kafka: {{ topic: {name}, key: {{ topic_level: 2 }} }}\n    dead_letter: {{ topic: {name}.dlq }}\n"
        )
    };
    let config = brokers.config("ferry-compacted", &(rule("born") + &rule("live")));
    let mut fwd = Forwarder::start(&config);
    fwd.wait_ready(Duration::from_secs(30));
    // The forwarder learns `live`'s config (not compacted) with its first record; then it
    // is compacted, well within the forwarder's refresh interval (60 s).
    let publish = |client: &str, msgs: Vec<(String, Vec<u8>)>| {
        rt.block_on(ferry_e2e::publish(
            brokers.mqtt.port(),
            client,
            rumqttc::QoS::AtLeastOnce,
            msgs,
        ))
        .expect("publish");
    };
    publish(
        "pub-first",
        vec![("live/dev/0".to_owned(), payload("live/dev/0", 0, false))],
    );
    wait_until(
        &fwd,
        Duration::from_secs(30),
        "the first record acked",
        || fwd.metric("ferry_mqtt_acked_messages_total") >= 1.0,
    );
    // Its answer is one DescribeConfigs round trip after the first record was taken.
    std::thread::sleep(Duration::from_secs(1));
    rt.block_on(common::alter_topic_config(
        &bootstrap,
        "live",
        "cleanup.policy",
        "compact",
    ));
    // The broker applies a topic's config change asynchronously.
    std::thread::sleep(Duration::from_secs(2));
    let total = 400;
    let mut msgs = Vec::new();
    let mut want: BTreeMap<(&str, bool), BTreeSet<(String, usize)>> = BTreeMap::new();
    want.entry(("live", true))
        .or_default()
        .insert(("live/dev/0".to_owned(), 0));
    for n in 1..=total {
        for name in ["born", "live"] {
            let keyed = n % 100 != 50;
            let topic = if keyed {
                format!("{name}/dev/{}", n % 4)
            } else {
                format!("{name}/dev")
            };
            msgs.push((topic.clone(), payload(&topic, n, false)));
            want.entry((name, keyed)).or_default().insert((topic, n));
        }
    }
    publish("pub-compacted", msgs);
    wait_until(&fwd, Duration::from_secs(60), "every message acked", || {
        fwd.metric("ferry_mqtt_acked_messages_total") >= (1 + 2 * total) as f64
    });
    let read = |topic: &str, n: usize| {
        ids(&brokers
            .kafka
            .read_all(topic, n, Duration::from_secs(2), Duration::from_secs(30))
            .expect("read"))
    };
    let status = fwd.status().expect("status");
    for name in ["born", "live"] {
        let (keyed, keyless) = (&want[&(name, true)], &want[&(name, false)]);
        assert_exactly_in_order(name, &read(name, keyed.len()), keyed);
        let dlq = format!("{name}.dlq");
        assert_exactly_in_order(&dlq, &read(&dlq, keyless.len()), keyless);
        let rule = status.rule(name).expect("rule");
        assert_eq!(
            (rule.forwarded, rule.dead_lettered),
            (keyed.len() as u64, keyless.len() as u64),
            "{name}"
        );
    }
}

/// A rule whose Kafka topic does not exist (auto-creation off): its messages are retried and
/// hold the window, nothing is acknowledged, `/status` says why; once the topic is created
/// everything arrives, in order. Before the failure rule this was counted and acknowledged:
/// silent loss. Its neighbour's messages, behind it in the order of acknowledgements, wait
/// too, and its `/status` says so: blocked by `later`, waiting on `unknown_topic`, with the
/// exact count (before, only a held record said so, and the neighbour looked healthy).
#[test]
fn a_missing_topic_holds_messages_unacknowledged_until_it_exists() {
    let brokers = Brokers::start();
    let rt = runtime();
    rt.block_on(brokers.kafka.create_topic("ontime", 1))
        .expect("topic");
    let rules = "  - name: later\n    mqtt: { topics: [\"later/+\"] }\n    kafka: { topic: later }\n\
                 \x20 - name: ontime\n    mqtt: { topics: [\"ontime/+\"] }\n    kafka: { topic: ontime }\n";
    // librdkafka fails records to an unknown topic after this (default 30 s): make it fail
    // fast, so what the forwarder does with the failure is what the test sees.
    let config = brokers.config("ferry-later", rules).replace(
        "  bootstrap_servers:",
        "  config: { topic.metadata.propagation.max.ms: 500 }\n  bootstrap_servers:",
    );
    let mut fwd = Forwarder::start(&config);
    fwd.wait_ready(Duration::from_secs(30));
    let total = 300;
    let want: BTreeSet<(String, usize)> = (0..total)
        .map(|n| (format!("later/{}", n % 3), n))
        .collect();
    let neighbours = 100;
    let mut msgs: Vec<(String, Vec<u8>)> = want
        .iter()
        .map(|(topic, n)| (topic.clone(), payload(topic, *n, false)))
        .collect();
    msgs.extend((0..neighbours).map(|n| {
        let topic = format!("ontime/{}", n % 3);
        let body = payload(&topic, n, false);
        (topic, body)
    }));
    rt.block_on(ferry_e2e::publish(
        brokers.mqtt.port(),
        "pub-later",
        rumqttc::QoS::AtLeastOnce,
        msgs,
    ))
    .expect("publish");
    wait_until(
        &fwd,
        Duration::from_secs(30),
        "the rule reports why it waits",
        || {
            fwd.status()
                .and_then(|s| s.rule("later").and_then(|r| r.waiting.clone()))
                .is_some_and(|w| w.reason == "unknown_topic" && w.message.contains("later"))
        },
    );
    // Several retry rounds and many times librdkafka's propagation limit.
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!(
        fwd.metric("ferry_mqtt_acked_messages_total"),
        0.0,
        "nothing acked while the topic is missing"
    );
    let status = fwd.status().expect("status");
    let rule = status.rule("later").expect("rule");
    assert_eq!((rule.acked, rule.failed), (0, 0));
    assert!(status.inflight > 0);
    let ontime = status.rule("ontime").expect("rule");
    assert_eq!(
        ontime.acked, 0,
        "the neighbour's messages wait in the order of acks"
    );
    let blocked = ontime
        .blocked_by
        .as_ref()
        .expect("the neighbour says it is blocked");
    assert_eq!(
        (
            blocked.rules.as_slice(),
            blocked.waiting.as_deref(),
            blocked.messages
        ),
        (
            ["later".to_owned()].as_slice(),
            Some("unknown_topic"),
            neighbours as u64
        ),
        "{status:?}"
    );
    assert_eq!(
        fwd.metric_with("ferry_rule_blocked_messages", &["rule=\"ontime\""]),
        neighbours as f64
    );
    assert!(
        rule.blocked_by.is_none(),
        "the waiting rule is not blocked by itself"
    );

    rt.block_on(brokers.kafka.create_topic("later", 1))
        .expect("topic");
    wait_until(&fwd, Duration::from_secs(60), "every message acked", || {
        fwd.metric("ferry_mqtt_acked_messages_total") >= (total + neighbours) as f64
    });
    // The next holds report (every second while something is blocked) clears it.
    wait_until(
        &fwd,
        Duration::from_secs(3),
        "the neighbour no longer blocked",
        || {
            fwd.status()
                .and_then(|s| s.rule("ontime").map(|r| r.blocked_by.is_none()))
                .unwrap_or(false)
        },
    );
    let got = ids(&brokers
        .kafka
        .read_all(
            "later",
            total,
            Duration::from_secs(2),
            Duration::from_secs(30),
        )
        .expect("read"));
    assert_exactly_in_order("later", &got, &want);
    let status = fwd.status().expect("status");
    assert_eq!(
        status.rule("later").map(|r| r.waiting.clone()),
        Some(None),
        "waiting cleared once records go through: {status:?}"
    );
    drop(fwd);
    a_full_producer_queue_lets_no_record_overtake_an_earlier_one(&brokers);
}

/// The producer's queue (`queue.buffering.max.messages`) no larger than the window while each
/// message has four targets: produce calls are refused synchronously (`QueueFull`) again and
/// again. A refused record keeps its place: in each Kafka topic every record arrives exactly
/// once, and per MQTT topic in order. (Before, the records handed out behind a refused one
/// went ahead of it.)
fn a_full_producer_queue_lets_no_record_overtake_an_earlier_one(brokers: &Brokers) {
    let rt = runtime();
    let kafka_topics = ["full-0", "full-1", "full-2", "full-3"];
    let mut rules = String::new();
    for t in kafka_topics {
        rt.block_on(brokers.kafka.create_topic(t, 1))
            .expect("topic");
        rules += &format!(
            "  - name: {t}\n    mqtt: {{ topics: [\"full/+\"] }}\n    kafka: {{ topic: {t} }}\n"
        );
    }
    let window = 100;
    let config = brokers
        .config("ferry-full", &rules)
        .replace("max_inflight: 1000", &format!("max_inflight: {window}"))
        .replace(
            "  bootstrap_servers:",
            &format!(
                "  config: {{ queue.buffering.max.messages: {window}, linger.ms: 10 }}\n  bootstrap_servers:"
            ),
        );
    let mut fwd = Forwarder::start(&config);
    fwd.wait_ready(Duration::from_secs(30));
    let total = 2000;
    let (want, msgs) = numbered("full", 5, total);
    let started = Instant::now();
    brokers.publish_acked(&fwd, "pub-full", msgs, total, Duration::from_secs(120));
    let refused = fwd.metric_with(
        "ferry_rule_produce_retries_total",
        &["reason=\"queue_full\""],
    );
    eprintln!(
        "{total} messages × 4 targets through a producer queue of {window}: {refused} produce calls refused as queue full, {:.1} s",
        started.elapsed().as_secs_f64()
    );
    assert!(refused > 0.0, "the producer's queue was full at times");
    for t in kafka_topics {
        let got = ids(&brokers
            .kafka
            .read_all(t, total, Duration::from_secs(1), Duration::from_secs(30))
            .expect("read"));
        assert_exactly_in_order(t, &got, &want);
    }
}

/// Publishes `numbered_messages(topics, total)` in batches of `batch` every `every`, from a
/// thread of its own: a steady stream across whatever the test does meanwhile.
fn steady_stream(
    port: u16,
    topics: usize,
    total: usize,
    batch: usize,
    every: Duration,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let rt = runtime();
        let msgs = common::numbered_messages(topics, total);
        for (i, chunk) in msgs.chunks(batch).enumerate() {
            let started = std::time::Instant::now();
            rt.block_on(ferry_e2e::publish(
                port,
                format!("pub-steady-{i}"),
                rumqttc::QoS::AtLeastOnce,
                chunk.to_vec(),
            ))
            .expect("publish");
            std::thread::sleep(every.saturating_sub(started.elapsed()));
        }
    })
}

/// How many times the broker saw `client_id` connect (Mosquitto with `log_connections`).
fn connects(mqtt: &ferry_e2e::Mosquitto, client_id: &str) -> usize {
    let log = std::fs::read_to_string(mqtt.dir().join("mosquitto.log")).expect("mosquitto log");
    log.lines()
        .filter(|l| l.contains("New client connected") && l.contains(&format!(" as {client_id} ")))
        .count()
}

/// Kafka unreachable for 100 s (a partition: the proxy holds every byte, no reset) under a
/// steady stream: the MQTT connection stays up throughout (over twice the 45 s after which a
/// silent client is dropped), `/status` says MQTT is connected and Kafka is not, nothing is acked
/// while Kafka is away, and once it is back every message arrives, in order, with no replay.
#[test]
fn a_long_kafka_partition_keeps_the_mqtt_session_and_loses_nothing() {
    const PARTITION: Duration = Duration::from_secs(100);
    let proxy = ferry_e2e::FaultProxy::start_without_upstream().expect("proxy");
    let mqtt = ferry_e2e::Mosquitto::start_with(ferry_e2e::MosquittoOptions {
        log_connections: true,
        ..Default::default()
    })
    .expect("mosquitto");
    let kafka = ferry_e2e::Kafka::start_with(ferry_e2e::KafkaOptions {
        proxy: Some(&proxy),
        ..Default::default()
    })
    .expect("kafka");
    let rt = runtime();
    rt.block_on(kafka.create_topic("partitioned", 1))
        .expect("topic");
    let brokers = Brokers { mqtt, kafka };
    let rules = "  - name: partitioned\n    mqtt: { topics: [\"sensors/#\"] }\n    kafka: { topic: partitioned }\n";
    let config = brokers.config("ferry-partition", rules).replace(
        &brokers.kafka.bootstrap(),
        &brokers
            .kafka
            .proxied_bootstrap()
            .expect("proxied bootstrap"),
    );
    assert!(
        !config.contains("keep_alive"),
        "default keep-alive (30 s) under test"
    );
    let mut fwd = Forwarder::start(&config);
    fwd.wait_ready(Duration::from_secs(30));

    // 200 messages/s for 120 s: before, during and after the partition.
    let total = 24_000;
    let stream = steady_stream(brokers.mqtt.port(), 20, total, 200, Duration::from_secs(1));
    std::thread::sleep(Duration::from_secs(10));
    proxy.set_mode(ferry_e2e::ProxyMode::Blackhole);
    let cut_at = std::time::Instant::now();
    wait_until(&fwd, Duration::from_secs(60), "the window fills", || {
        fwd.status().is_some_and(|s| s.inflight >= 900)
    });
    let acked_when_full = fwd.metric("ferry_mqtt_acked_messages_total");
    while cut_at.elapsed() < PARTITION {
        std::thread::sleep(Duration::from_secs(15));
        let status = fwd.status().expect("status");
        assert!(
            status.mqtt.connected,
            "mqtt connected during the Kafka partition ({:?} in)",
            cut_at.elapsed()
        );
        assert!(!status.kafka.reachable, "kafka reported unreachable");
        assert_eq!(
            fwd.metric("ferry_mqtt_acked_messages_total"),
            acked_when_full,
            "nothing acked while Kafka is away"
        );
    }
    proxy.set_mode(ferry_e2e::ProxyMode::Pass);
    stream.join().expect("publisher");
    let d = common::read_judged(
        &brokers.kafka,
        "partitioned",
        total,
        Duration::from_secs(180),
    );
    eprintln!("kafka partition of {PARTITION:?}: {d:?}");
    assert_eq!(
        connects(&brokers.mqtt, "ferry-partition"),
        1,
        "one MQTT connection throughout"
    );
    assert_eq!((d.missing, d.out_of_order), (0, 0));
    // No MQTT reconnect, so no redelivery; the idempotent producer adds none.
    assert_eq!(d.duplicates, 0);
    assert!(fwd.running(), "the forwarder never exits");
}

/// The forwarder SIGKILLed every 5 s for 30 s under a steady stream: nothing is lost, order
/// holds, and each kill replays at most the window (1000) messages.
#[test]
fn killed_every_five_seconds_for_half_a_minute_replays_at_most_the_window_per_kill() {
    let brokers = Brokers::start();
    let rt = runtime();
    rt.block_on(brokers.kafka.create_topic("killed", 1))
        .expect("topic");
    let rules =
        "  - name: killed\n    mqtt: { topics: [\"sensors/#\"] }\n    kafka: { topic: killed }\n";
    let mut fwd = Forwarder::start(&brokers.config("ferry-killed", rules));
    fwd.wait_ready(Duration::from_secs(30));
    let window = common::WINDOW;
    // 1,000 messages/s for 40 s: six kills, each replaying what its window held and the acks
    // the broker had not read.
    let total = 40_000;
    let stream = steady_stream(
        brokers.mqtt.port(),
        20,
        total,
        100,
        Duration::from_millis(100),
    );
    let (mut kills, mut bound) = (0, 0);
    let start = std::time::Instant::now();
    while start.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_secs(5));
        bound += fwd.crash(brokers.mqtt.port(), window);
        kills += 1;
        fwd.restart();
    }
    stream.join().expect("publisher");
    fwd.wait_ready(Duration::from_secs(30));
    let d = common::read_judged(&brokers.kafka, "killed", total, Duration::from_secs(120));
    eprintln!(
        "{kills} kills in 30 s under 1k msg/s: {d:?}; {:.0} replayed per kill (window {window})",
        d.duplicates as f64 / f64::from(kills)
    );
    assert_eq!((d.missing, d.out_of_order), (0, 0));
    assert!(
        d.duplicates <= bound,
        "{} replays for {kills} kills exceed the window and unread acks per kill ({bound})",
        d.duplicates
    );
}

/// Kafka with ACLs. First the forwarder's SCRAM user may write nowhere, so every producer it
/// creates fails fatally (idempotent writes not authorized: see
/// `fatal_producers_are_replaced_with_backoff_and_lose_nothing`). Then it may write, and loses
/// its WRITE right on the topic mid-stream and gets it back 20 s later: nothing is acknowledged
/// while it is denied, the rule's status names the error, and afterwards every message arrives,
/// in order. Before the failure rule an authorization failure was counted and acknowledged:
/// silent loss.
#[test]
fn revoked_authorization_holds_messages_until_the_acl_is_restored() {
    const USER: &str = "ferry-acl";
    const PASSWORD: &str = "acl-Secret-4711";
    let pki = ferry_e2e::Pki::generate(ferry_e2e::KeyType::Rsa).expect("pki");
    let mqtt = ferry_e2e::Mosquitto::start().expect("mosquitto");
    let kafka = ferry_e2e::Kafka::start_with(ferry_e2e::KafkaOptions {
        sasl_ssl: Some(ferry_e2e::SaslSsl {
            pki: &pki,
            scram_sha512_users: vec![(USER.into(), PASSWORD.into())],
            plain_users: vec![],
            require_client_cert: false,
        }),
        acls: true,
        ..Default::default()
    })
    .expect("kafka");
    let rt = runtime();
    for topic in ["guarded", "guarded-early"] {
        rt.block_on(kafka.create_topic(topic, 1)).expect("topic");
    }
    let config = format!(
        "mqtt:\n  host: 127.0.0.1\n  port: {mqtt_port}\n  client_id: ferry-acl\n  reconnect_max_ms: 1000\n\
         kafka:\n  bootstrap_servers: {bootstrap}\n  tls: {{ ca_file: {ca} }}\n\
         \x20 sasl: {{ mechanism: SCRAM-SHA-512, username: {USER}, password: {PASSWORD} }}\n\
         rules:\n  - name: guarded\n    mqtt: {{ topics: [\"sensors/#\"] }}\n    kafka: {{ topic: guarded }}\n\
         \x20 - name: early\n    mqtt: {{ topics: [\"early/+\"] }}\n    kafka: {{ topic: guarded-early }}\n",
        mqtt_port = mqtt.port(),
        bootstrap = kafka.sasl_ssl_bootstrap(),
        ca = pki.ca_cert().display(),
    );
    let started = Instant::now();
    let mut fwd = Forwarder::start(&config);
    fwd.wait_ready(Duration::from_secs(30));
    fatal_producers_are_replaced_with_backoff_and_lose_nothing(
        &fwd,
        started,
        mqtt.port(),
        || kafka.grant_produce(USER, "guarded-early").expect("grant"),
        |n| {
            ids(&kafka
                .read_all(
                    "guarded-early",
                    n,
                    Duration::from_secs(1),
                    Duration::from_secs(30),
                )
                .expect("read"))
        },
    );
    kafka.grant_produce(USER, "guarded").expect("grant");

    // 200 messages/s for 50 s.
    let total = 10_000;
    let stream = steady_stream(mqtt.port(), 10, total, 200, Duration::from_secs(1));
    std::thread::sleep(Duration::from_secs(8));
    kafka.revoke_produce(USER, "guarded").expect("revoke");
    wait_until(
        &fwd,
        Duration::from_secs(60),
        "the rule reports the denial",
        || {
            fwd.status()
                .and_then(|s| s.rule("guarded").and_then(|r| r.waiting.clone()))
                .is_some_and(|w| w.reason == "unauthorized" && w.message.contains("guarded"))
        },
    );
    // What was confirmed before the denial may still be acknowledged; then nothing.
    std::thread::sleep(Duration::from_secs(3));
    let acked = fwd.metric("ferry_mqtt_acked_messages_total");
    std::thread::sleep(Duration::from_secs(15));
    assert_eq!(
        fwd.metric("ferry_mqtt_acked_messages_total"),
        acked,
        "nothing acked while denied"
    );
    let status = fwd.status().expect("status");
    let rule = status.rule("guarded").expect("rule");
    assert_eq!(rule.failed, 0, "never given up");
    // The neighbour's messages wait behind the denied ones in the order of acks, and it says
    // which rule it waits on, and why.
    let early_acked = status.rule("early").map_or(0, |r| r.acked);
    let neighbours = 20;
    rt.block_on(ferry_e2e::publish(
        mqtt.port(),
        "pub-early",
        rumqttc::QoS::AtLeastOnce,
        (0..neighbours)
            .map(|n| ("early/1".to_owned(), payload("early/1", 10_000 + n, false)))
            .collect(),
    ))
    .expect("publish");
    wait_until(
        &fwd,
        Duration::from_secs(10),
        "the neighbour says it is blocked by the denied rule",
        || {
            fwd.status()
                .and_then(|s| s.rule("early").and_then(|r| r.blocked_by.clone()))
                .is_some_and(|b| {
                    b.rules == ["guarded"] && b.waiting.as_deref() == Some("unauthorized")
                })
        },
    );
    // The stream filled the window: the neighbour's messages wait at the broker, not read,
    // and it is stopped all the same.
    let blocked = fwd
        .status()
        .and_then(|s| s.rule("early").and_then(|r| r.blocked_by.clone()))
        .map_or(u64::MAX, |b| b.messages);
    assert!(blocked <= neighbours as u64, "{blocked}");
    assert_eq!(
        fwd.metric_with("ferry_rule_blocked_messages", &["rule=\"early\""]),
        blocked as f64
    );
    kafka.grant_produce(USER, "guarded").expect("grant again");
    stream.join().expect("publisher");
    wait_until(
        &fwd,
        Duration::from_secs(120),
        "every message acked",
        || fwd.metric("ferry_mqtt_acked_messages_total") >= total as f64,
    );
    let d = common::read_judged(&kafka, "guarded", total, Duration::from_secs(60));
    eprintln!("authorization revoked for ~20 s under 200 msg/s: {d:?}");
    assert_eq!((d.missing, d.out_of_order), (0, 0));
    // No MQTT reconnect, so no redelivery.
    assert_eq!(d.duplicates, 0);
    let early = fwd
        .status()
        .and_then(|s| s.rule("early").cloned())
        .expect("early");
    assert_eq!(
        early.acked,
        early_acked + neighbours as u64,
        "the neighbour's all acked"
    );
    assert!(early.blocked_by.is_none(), "and no longer blocked");
}

/// The forwarder's user may write to no topic, so Kafka refuses every producer an id
/// (`CLUSTER_AUTHORIZATION_FAILED`, which librdkafka makes a fatal error): producers are
/// replaced no faster than the backoff allows (0.5 s doubling), nothing is acknowledged, the
/// metrics and `/status` say so; once a WRITE right is granted, the next producer writes every
/// held message exactly once, in order. (Before, producers were replaced as fast as they
/// failed.)
fn fatal_producers_are_replaced_with_backoff_and_lose_nothing(
    fwd: &Forwarder,
    started: Instant,
    mqtt_port: u16,
    grant: impl FnOnce(),
    read: impl FnOnce(usize) -> Vec<(String, usize)>,
) {
    let total = 200;
    let (want, msgs) = numbered("early", 4, total);
    runtime()
        .block_on(ferry_e2e::publish(
            mqtt_port,
            "pub-early",
            rumqttc::QoS::AtLeastOnce,
            msgs,
        ))
        .expect("publish");
    let fatal_logged = || {
        fwd.log()
            .matches("kafka producer hit a fatal error")
            .count()
    };
    wait_until(fwd, Duration::from_secs(30), "three fatal errors", || {
        fatal_logged() >= 3
    });
    std::thread::sleep(Duration::from_secs(1));
    let fatal = fatal_logged();
    let elapsed = started.elapsed();
    // The first fatal error at t0 ≥ 0, then one new producer at t0 + 0.5 s·(2^k − 1) for each
    // k ≥ 1 (each failing again), until now.
    let bound = 1 + (elapsed.as_secs_f64() / 0.5 + 1.0).log2().floor() as usize;
    eprintln!(
        "idempotent writes not authorized: {fatal} fatal producer errors in {:.1} s (backoff bound {bound})",
        elapsed.as_secs_f64()
    );
    assert!(
        fatal <= bound,
        "{fatal} fatal errors in {elapsed:?}: replaced faster than the backoff"
    );
    assert_eq!(
        fwd.metric("ferry_kafka_producer_fatal_errors_total"),
        fatal as f64
    );
    assert!(
        fwd.metric_with(
            "ferry_kafka_producer_replacements_total",
            &["result=\"created\""]
        ) >= 1.0
    );
    assert_eq!(
        fwd.metric("ferry_mqtt_acked_messages_total"),
        0.0,
        "nothing acked without a working producer"
    );
    let status = fwd.status().expect("status");
    let last = status
        .kafka
        .last_error
        .map(|e| e.message)
        .unwrap_or_default();
    // The fatal error ("...; next producer in N ms"), or the same refusal as the next
    // producer's client reports it while acquiring its producer id: either names the cause.
    assert!(
        last.to_lowercase().contains("cluster authorization failed"),
        "status: {last}"
    );
    grant();
    let granted = Instant::now();
    // The next producer comes at the latest one backoff step (at most the time since the
    // first fatal error) after the grant.
    wait_until(
        fwd,
        Duration::from_secs(60),
        "every held message acked",
        || fwd.metric("ferry_mqtt_acked_messages_total") >= total as f64,
    );
    eprintln!(
        "granted: every held message acked {:.1} s later",
        granted.elapsed().as_secs_f64()
    );
    assert_exactly_in_order("guarded-early", &read(total), &want);
}

/// MQTT partitioned away for 30 s (a fault proxy holds every byte, no reset) under a steady
/// stream, with a 5 s keep-alive: the forwarder judges the silent connection dead, reconnects
/// once the partition heals, resumes its session, and nothing is lost; what the broker replays
/// is at most the window per reconnect, never acked twice.
#[test]
fn a_thirty_second_mqtt_partition_loses_nothing_and_replays_at_most_the_window() {
    let mqtt = ferry_e2e::Mosquitto::start_with(ferry_e2e::MosquittoOptions {
        log_connections: true,
        ..Default::default()
    })
    .expect("mosquitto");
    let proxy =
        ferry_e2e::FaultProxy::start(std::net::SocketAddr::from(([127, 0, 0, 1], mqtt.port())))
            .expect("proxy");
    let kafka = ferry_e2e::Kafka::start().expect("kafka");
    let rt = runtime();
    rt.block_on(kafka.create_topic("mqtt-cut", 1))
        .expect("topic");
    let brokers = Brokers { mqtt, kafka };
    let rules =
        "  - name: cut\n    mqtt: { topics: [\"sensors/#\"] }\n    kafka: { topic: mqtt-cut }\n";
    let config = brokers.config("ferry-mqtt-cut", rules).replace(
        &format!("  port: {}\n", brokers.mqtt.port()),
        &format!("  port: {}\n  keep_alive_secs: 5\n", proxy.port()),
    );
    let mut fwd = Forwarder::start(&config);
    fwd.wait_ready(Duration::from_secs(30));
    let window = 1000;
    // 200 messages/s for 60 s, published straight to the broker.
    let total = 12_000;
    let stream = steady_stream(brokers.mqtt.port(), 20, total, 200, Duration::from_secs(1));
    std::thread::sleep(Duration::from_secs(10));
    proxy.set_mode(ferry_e2e::ProxyMode::Blackhole);
    // Silence is judged after 1.5 keep-alives while reading.
    wait_until(
        &fwd,
        Duration::from_secs(20),
        "the dead connection is noticed",
        || fwd.status().is_some_and(|s| !s.mqtt.connected),
    );
    std::thread::sleep(Duration::from_secs(22));
    proxy.set_mode(ferry_e2e::ProxyMode::Pass);
    stream.join().expect("publisher");
    wait_until(&fwd, Duration::from_secs(60), "connected again", || {
        fwd.status().is_some_and(|s| s.mqtt.connected)
    });
    let d = common::read_judged(&brokers.kafka, "mqtt-cut", total, Duration::from_secs(120));
    let sessions = connects(&brokers.mqtt, "ferry-mqtt-cut");
    eprintln!("mqtt partition of 30 s: {sessions} connections; {d:?}");
    assert_eq!((d.missing, d.out_of_order), (0, 0));
    assert!(sessions >= 2, "the forwarder reconnected");
    assert!(
        d.duplicates <= (sessions - 1) * window,
        "{} replays for {} reconnects",
        d.duplicates,
        sessions - 1
    );
    assert!(fwd.running(), "the forwarder never exits");
}

/// Mosquitto (persistence on) restarted gracefully while the forwarder drains a backlog: the
/// forwarder reconnects, the broker resumes its session with the messages it still held, and
/// nothing is lost; order holds (replays repeat in order).
#[test]
fn a_graceful_mosquitto_restart_mid_stream_keeps_the_session_and_loses_nothing() {
    let mqtt = ferry_e2e::Mosquitto::start_with(ferry_e2e::MosquittoOptions {
        persistence: true,
        log_connections: true,
        ..Default::default()
    })
    .expect("mosquitto");
    let kafka = ferry_e2e::Kafka::start().expect("kafka");
    let rt = runtime();
    rt.block_on(kafka.create_topic("restarted", 1))
        .expect("topic");
    let mut brokers = Brokers { mqtt, kafka };
    let rules = "  - name: restarted\n    mqtt: { topics: [\"sensors/#\"] }\n    kafka: { topic: restarted }\n";
    let mut fwd = Forwarder::start(&brokers.config("ferry-restarted", rules));
    fwd.wait_ready(Duration::from_secs(30));
    // Stop the forwarder so a backlog builds up in its session, then let it drain it.
    fwd.kill();
    let total = 30_000;
    rt.block_on(ferry_e2e::publish(
        brokers.mqtt.port(),
        "pub-backlog",
        rumqttc::QoS::AtLeastOnce,
        common::numbered_messages(20, total),
    ))
    .expect("publish");
    fwd.restart();
    fwd.wait_ready(Duration::from_secs(30));
    wait_until(&fwd, Duration::from_secs(60), "draining", || {
        fwd.metric("ferry_mqtt_acked_messages_total") >= 1000.0
    });
    brokers.mqtt.stop();
    brokers.mqtt.resume().expect("mosquitto back");
    let d = common::read_judged(&brokers.kafka, "restarted", total, Duration::from_secs(120));
    eprintln!(
        "mosquitto restarted mid-drain: {} connections since; {d:?}",
        connects(&brokers.mqtt, "ferry-restarted")
    );
    assert_eq!((d.missing, d.out_of_order), (0, 0));
    assert!(fwd.running(), "the forwarder never exits");
    // The broker's log starts anew with the restart.
    assert!(
        connects(&brokers.mqtt, "ferry-restarted") >= 1,
        "reconnected after the restart"
    );
}

/// Of the partitions of `topic` whose leader is not `spare`, the one holding the most records
/// now, and how many it holds.
fn busiest_partition(
    cluster: &ferry_e2e::KafkaCluster,
    topic: &str,
    partitions: i32,
    spare: i32,
) -> (i32, i64) {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let consumer: BaseConsumer = cluster.client_config().create().expect("consumer");
    (0..partitions)
        .filter(|&p| cluster.leader_of(topic, p).expect("leader") != spare)
        .map(|p| {
            let (_, high) = consumer
                .fetch_watermarks(topic, p, Duration::from_secs(10))
                .expect("watermarks");
            (p, high)
        })
        .max_by_key(|&(_, high)| high)
        .expect("a partition")
}

/// Samples `ferry_mqtt_acked_messages_total` every 20 ms from `since` until acks resume after
/// a stall (no growth for a second: at 1k msg/s acks grow every few milliseconds). Returns when
/// acks last grew before the stall and when they grew again, both since `since`; fails after
/// `deadline`, and if the forwarder exits.
fn ack_stall(fwd: &mut Forwarder, since: Instant, deadline: Duration) -> (Duration, Duration) {
    let stall = Duration::from_secs(1);
    let mut last = fwd.metric("ferry_mqtt_acked_messages_total");
    let mut last_growth = since;
    loop {
        assert!(fwd.running(), "the forwarder exited:\n{}", fwd.log());
        let now = fwd.metric("ferry_mqtt_acked_messages_total");
        let at = Instant::now();
        if now > last {
            if at - last_growth >= stall {
                return (last_growth - since, at - since);
            }
            last = now;
            last_growth = at;
        }
        assert!(
            since.elapsed() < deadline,
            "no ack stall followed by acks again within {deadline:?}; acks last grew {:?} in \
             (at {last}):\n{}",
            last_growth - since,
            fwd.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A 3-node Kafka cluster (KRaft, RF 3, min ISR 2): the node leading the busiest partition is
/// SIGKILLed 7 s into a 1k msg/s stream. The idempotent `acks=all` producer follows the new
/// leader on its own: nothing is lost, per-MQTT-topic order holds, nothing is written twice,
/// the MQTT connection stays up and the forwarder never exits. Acks stop while the partition has
/// no leader (they go out in PUBLISH order) and resume within the failover bound.
#[test]
fn a_sigkilled_partition_leader_loses_nothing_and_acks_resume_after_the_failover() {
    let started = Instant::now();
    let mut cluster = ferry_e2e::KafkaCluster::start(3).expect("kafka cluster");
    let mqtt = ferry_e2e::Mosquitto::start_with(ferry_e2e::MosquittoOptions {
        log_connections: true,
        ..Default::default()
    })
    .expect("mosquitto");
    eprintln!(
        "3-node cluster {} up in {:?}",
        cluster.bootstrap(),
        started.elapsed()
    );
    let rt = runtime();
    // Two partitions led by each node; the 20 MQTT topics (the keys) spread over them.
    let partitions = 6;
    rt.block_on(cluster.create_topic("failover", partitions))
        .expect("topic");
    let rules = "  - name: failover\n    mqtt: { topics: [\"sensors/#\"] }\n    kafka: { topic: failover }\n";
    let config = common::config(&mqtt, &cluster.bootstrap(), "ferry-failover", rules);
    let mut fwd = Forwarder::start(&config);
    fwd.wait_ready(Duration::from_secs(30));
    // A broker's failover, not the controller's too (its election adds the quorum's timeouts).
    let controller = cluster.active_controller().expect("active controller");

    // 1,000 messages/s for 25 s.
    let total = 25_000;
    let stream = steady_stream(mqtt.port(), 20, total, 100, Duration::from_millis(100));
    std::thread::sleep(Duration::from_secs(7));
    let (partition, records) = busiest_partition(&cluster, "failover", partitions, controller);
    assert!(records > 0, "the stream reaches partition {partition}");
    let leader = cluster.leader_of("failover", partition).expect("leader");
    cluster.kill(leader).expect("kill the leader");
    let killed = Instant::now();

    // The bound, from the fixture's failover settings and librdkafka's metadata refresh:
    // - the killed node is fenced when its broker session expires, 5 s after its last
    //   heartbeat (one a second), so at most 5 s after the kill; the controller then hands its
    //   partitions to in-sync replicas at once (RF 3: two are left, min ISR 2 is met);
    // - while a partition's leader connection is down, librdkafka asks for its metadata again
    //   every second (its 1 s topic scan, besides the fast leader queries after the failed
    //   produce requests), so it sees the new leader within about a second of the election;
    // - then one produce round trip, and the first acks go out.
    // 5 + 1 s, and 4 s for three JVMs, the forwarder and the publisher sharing 2 cores.
    let bound = Duration::from_secs(10);
    let (new_leader, elected, (stalled, resumed)) = std::thread::scope(|s| {
        let election = s.spawn(|| {
            let new = cluster
                .wait_for_new_leader("failover", partition, leader, Duration::from_secs(30))
                .expect("a new leader");
            (new, killed.elapsed())
        });
        let acks = ack_stall(&mut fwd, killed, 2 * bound);
        let (new, elected) = election.join().expect("election watcher");
        (new, elected, acks)
    });
    eprintln!(
        "node {leader}, leading partition {partition} ({records} records; controller: node \
         {controller}), SIGKILLed: acks last grew {stalled:?} after, node {new_leader} leads \
         the partition from {elected:?} (metadata), acks resumed {resumed:?} after the kill \
         (bound {bound:?})"
    );

    stream.join().expect("publisher");
    let d = common::read_judged(&cluster, "failover", total, Duration::from_secs(120));
    let retries = fwd.metric("ferry_kafka_produce_retries_total");
    eprintln!("partition leader SIGKILLed under 1k msg/s: {d:?}; forwarder re-produced {retries}");
    assert_eq!((d.missing, d.out_of_order), (0, 0));
    assert_eq!(
        connects(&mqtt, "ferry-failover"),
        1,
        "one MQTT connection throughout"
    );
    // No MQTT reconnect, so no redelivery; librdkafka retries the killed leader's unconfirmed
    // batches to the new leader with their sequence numbers, which it deduplicates.
    assert_eq!(d.duplicates, 0);
    assert!(fwd.running(), "the forwarder never exits");
    assert!(
        resumed < bound,
        "acks resumed {resumed:?} after the kill, over the {bound:?} bound"
    );
}
