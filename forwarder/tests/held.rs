//! A record Kafka can never take, held by `on_unwritable: hold`, on real Mosquitto and Kafka:
//! the holding rule says what it holds, the rules of the same forwarder whose messages wait
//! behind it say they are blocked and by whom, and a live fix (a reload, or a broker-side
//! limit raised) releases everything with nothing lost and the neighbours' records in order.

mod common;

use std::time::{Duration, Instant};

use common::{Brokers, Forwarder, numbered_messages, read_judged, runtime, wait_until};
use ferry_api::status::ForwarderStatus;
use rumqttc::QoS;

/// The held topic's `max.message.bytes`, and the held message's payload (incompressible, so
/// no codec brings it under the limit).
const LIMIT: usize = 1000;
const BIG: usize = 5000;
/// The neighbours' stream.
const STREAM: usize = 500;
/// The config file is polled every second and a changed rule re-judges a held record at once;
/// what it released then needs a few Kafka round trips.
const RELOAD_BOUND: Duration = Duration::from_secs(10);
/// A broker-side fix is found by the held record's slow retry: capped backoff of 10 s, plus
/// the broker applying its config.
const BROKER_FIX_BOUND: Duration = Duration::from_secs(25);
/// `held`/`blockedBy` are brought up to date at once on a release and every second while
/// anything is held (the pipeline's `HOLDS_REPORT_INTERVAL`): three of those intervals.
const HOLDS_CLEARED_BOUND: Duration = Duration::from_secs(3);

fn incompressible(len: usize) -> Vec<u8> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect()
}

fn images_rule(topic: &str, extra: &str) -> String {
    format!(
        "  - name: images\n    mqtt: {{ topics: [\"images/#\"] }}\n    kafka: {{ topic: {topic} }}\n{extra}"
    )
}

fn telemetry_rule(topic: &str) -> String {
    format!(
        "  - name: telemetry\n    mqtt: {{ topics: [\"sensors/+/data\"] }}\n    kafka: {{ topic: {topic} }}\n"
    )
}

/// The rules of scenario `name`: `images` (with `images_extra`, lines of its own) to
/// `<name>.images`, and `telemetry` to `<name>.telemetry`.
fn scenario_rules(name: &str, images_extra: &str) -> String {
    images_rule(&format!("{name}.images"), images_extra)
        + &telemetry_rule(&format!("{name}.telemetry"))
}

/// The only record of `topic` (waits 20 s at most, then 2 s of quiet for a second one).
fn only_record(brokers: &Brokers, topic: &str) -> ferry_e2e::Record {
    let mut records = brokers.read(topic, 1, Duration::from_secs(2), Duration::from_secs(20));
    assert_eq!(records.len(), 1, "exactly one record in {topic}");
    records.remove(0)
}

/// How a scenario releases the held record.
enum Fix {
    /// The config is reloaded with these rules.
    Reload(String),
    /// The topic's `max.message.bytes` is raised at the broker.
    RaiseLimit(String),
}

/// Publishes the oversized message on `images/cam1`, then the neighbours' stream; waits until
/// the holding and the blocked rule say so (checked by `held_ok`); applies `fix`; asserts
/// everything is acknowledged within `bound` and the stream is in Kafka exactly once, in order.
/// Returns the forwarder for scenario-specific checks.
fn held_then_fixed(
    brokers: &Brokers,
    name: &str,
    rules: &str,
    held_ok: impl Fn(&ForwarderStatus) -> bool,
    fix: Fix,
    bound: Duration,
) -> Forwarder {
    let rt = runtime();
    let stream_topic = format!("{name}.telemetry");
    let mut fwd = Forwarder::start_configmap(&brokers.config(&format!("ferry-{name}"), rules));
    fwd.wait_ready(Duration::from_secs(30));
    let mut msgs = vec![("images/cam1".to_owned(), incompressible(BIG))];
    msgs.extend(numbered_messages(4, STREAM));
    rt.block_on(ferry_e2e::publish(
        brokers.mqtt.port(),
        format!("pub-{name}"),
        QoS::AtLeastOnce,
        msgs,
    ))
    .expect("publish");

    wait_until(
        &fwd,
        Duration::from_secs(30),
        "held and blocked, said so",
        || {
            fwd.status().is_some_and(|s| {
                let blocked = s.rule("telemetry").is_some_and(|t| {
                    t.forwarded == STREAM as u64
                        && t.blocked_by
                            .as_ref()
                            .is_some_and(|b| b.rules == ["images"] && b.messages == STREAM as u64)
                });
                blocked && held_ok(&s)
            })
        },
    );
    let status = fwd.status().expect("status");
    let telemetry = status.rule("telemetry").expect("telemetry");
    assert_eq!(
        telemetry.acked, 0,
        "acks are in order: none passes the held record"
    );
    assert!(telemetry.held.is_none());
    let images = status.rule("images").expect("images");
    assert!(
        images.blocked_by.is_none(),
        "a holding rule is held, not blocked"
    );
    assert_eq!(fwd.metric("ferry_mqtt_acked_messages_total"), 0.0);
    assert_eq!(
        fwd.metric_with(
            "ferry_rule_held_records",
            &["rule=\"images\"", "reason=\"too_large\""]
        ),
        1.0
    );
    assert_eq!(
        fwd.metric_with("ferry_rule_blocked_messages", &["rule=\"telemetry\""]),
        STREAM as f64
    );

    let fixed_at = Instant::now();
    match fix {
        Fix::Reload(rules) => fwd.swap_config(&brokers.config(&format!("ferry-{name}"), &rules)),
        Fix::RaiseLimit(topic) => rt.block_on(raise_limit(&brokers.kafka.bootstrap(), &topic)),
    }
    wait_until(&fwd, bound, "everything acknowledged after the fix", || {
        fwd.metric("ferry_mqtt_acked_messages_total") >= (STREAM + 1) as f64
    });
    let released_after = fixed_at.elapsed();
    // Nothing waits either: a rule still `waiting` after its fix is `Stalled` to the operator.
    wait_until(
        &fwd,
        HOLDS_CLEARED_BOUND,
        "holds and waits cleared in /status",
        || {
            fwd.status().is_some_and(|s| {
                s.rules
                    .iter()
                    .all(|r| r.held.is_none() && r.blocked_by.is_none() && r.waiting.is_none())
            })
        },
    );
    assert_eq!(
        fwd.metric_with("ferry_rule_blocked_messages", &["rule=\"telemetry\""]),
        0.0
    );
    // Each message acknowledged once: a re-judge never completes a message twice.
    assert_eq!(
        fwd.metric("ferry_mqtt_acked_messages_total"),
        (STREAM + 1) as f64
    );
    let d = read_judged(
        &brokers.kafka,
        &stream_topic,
        STREAM,
        Duration::from_secs(30),
    );
    eprintln!("{name}: released {released_after:?} after the fix; telemetry {d:?}");
    assert_eq!(
        (d.records, d.missing, d.duplicates, d.out_of_order),
        (STREAM, 0, 0, 0)
    );
    assert_eq!(
        fwd.status()
            .expect("status")
            .rule("telemetry")
            .map(|t| t.acked),
        Some(STREAM as u64)
    );
    fwd
}

async fn raise_limit(bootstrap: &str, topic: &str) {
    common::alter_topic_config(bootstrap, topic, "max.message.bytes", "1048588").await;
}

fn create_topics(brokers: &Brokers, name: &str, limited: &[&str], plain: &[&str]) {
    let rt = runtime();
    for t in limited {
        rt.block_on(common::create_topic_with_limit(
            &brokers.kafka.bootstrap(),
            &format!("{name}.{t}"),
            LIMIT,
        ));
    }
    for t in plain {
        rt.block_on(brokers.kafka.create_topic(&format!("{name}.{t}"), 1))
            .expect("topic");
    }
}

/// What the holding rule says while its own topic refuses the record.
fn held_too_large(s: &ForwarderStatus, kafka_topic: &str) -> bool {
    s.rule("images")
        .and_then(|r| r.held.as_ref())
        .is_some_and(|h| {
            h.reason == "too_large"
                && h.mqtt_topic == "images/cam1"
                && h.size == BIG as u64
                && h.kafka_topic.as_deref() == Some(kafka_topic)
                && !h.dead_letter
                && h.error.contains(kafka_topic)
                && h.error.to_lowercase().contains("too large")
                && h.records == 1
        })
}

/// Three live fixes of the rule: a dead-letter topic added, `on_unwritable: drop`, the rule
/// removed. Each releases the held record and the 500 messages of the other rule within
/// seconds, 0 lost.
#[test]
fn a_held_record_blocks_its_group_visibly_and_a_reloaded_rule_releases_it() {
    let brokers = Brokers::start();

    let name = "dlqfix";
    create_topics(&brokers, name, &["images"], &["telemetry", "dlq"]);
    let v1 = scenario_rules(name, "");
    let v2 = scenario_rules(name, &format!("    dead_letter: {{ topic: {name}.dlq }}\n"));
    let fwd = held_then_fixed(
        &brokers,
        name,
        &v1,
        |s| held_too_large(s, "dlqfix.images"),
        Fix::Reload(v2),
        RELOAD_BOUND,
    );
    let dlq = only_record(&brokers, "dlqfix.dlq");
    assert_eq!(
        dlq.value,
        incompressible(BIG),
        "the held record, dead-lettered"
    );
    assert_eq!(dlq.header("ferry.mqtt.topic"), Some("images/cam1"));
    let images = fwd
        .status()
        .and_then(|s| s.rule("images").cloned())
        .expect("images");
    assert_eq!((images.dead_lettered, images.acked), (1, 1));
    drop(fwd);

    let name = "dropfix";
    create_topics(&brokers, name, &["images"], &["telemetry"]);
    let v1 = scenario_rules(name, "");
    let v2 = scenario_rules(name, "    on_unwritable: drop\n");
    let fwd = held_then_fixed(
        &brokers,
        name,
        &v1,
        |s| held_too_large(s, "dropfix.images"),
        Fix::Reload(v2),
        RELOAD_BOUND,
    );
    let images = fwd
        .status()
        .and_then(|s| s.rule("images").cloned())
        .expect("images");
    assert_eq!((images.failed, images.acked), (1, 1), "dropped, counted");
    drop(fwd);

    let name = "removefix";
    create_topics(&brokers, name, &["images"], &["telemetry"]);
    let v1 = scenario_rules(name, "");
    let fwd = held_then_fixed(
        &brokers,
        name,
        &v1,
        |s| held_too_large(s, "removefix.images"),
        Fix::Reload(telemetry_rule(&format!("{name}.telemetry"))),
        RELOAD_BOUND,
    );
    assert!(
        fwd.status().is_some_and(|s| s.rule("images").is_none()),
        "the removed rule is no longer reported"
    );
    assert!(
        fwd.log().contains("acknowledged unwritten"),
        "{}",
        fwd.log()
    );
}

/// Broker-side fixes, found by the held record's slow retry: the topic's limit raised; and a
/// dead-letter topic that refuses the copy too (held visibly, saying so), its limit raised.
#[test]
fn a_held_record_is_released_when_the_broker_takes_it_and_a_refused_dead_letter_is_held_visibly() {
    let brokers = Brokers::start();

    let name = "limitfix";
    create_topics(&brokers, name, &["images"], &["telemetry"]);
    let v1 = scenario_rules(name, "");
    drop(held_then_fixed(
        &brokers,
        name,
        &v1,
        |s| held_too_large(s, "limitfix.images"),
        Fix::RaiseLimit("limitfix.images".into()),
        BROKER_FIX_BOUND,
    ));
    let images = only_record(&brokers, "limitfix.images");
    assert_eq!(
        images.value,
        incompressible(BIG),
        "written to its own topic once the limit allows"
    );

    let name = "dlqrefused";
    create_topics(&brokers, name, &["images", "dlq"], &["telemetry"]);
    let v1 = scenario_rules(name, &format!("    dead_letter: {{ topic: {name}.dlq }}\n"));
    let dead_letter_refused = |s: &ForwarderStatus| {
        s.rule("images")
            .and_then(|r| r.held.as_ref())
            .is_some_and(|h| {
                h.reason == "too_large"
                    && h.dead_letter
                    && h.kafka_topic.as_deref() == Some("dlqrefused.dlq")
                    && h.error.contains("dlqrefused.dlq")
                    && h.size == BIG as u64
            })
    };
    let fwd = held_then_fixed(
        &brokers,
        name,
        &v1,
        dead_letter_refused,
        Fix::RaiseLimit("dlqrefused.dlq".into()),
        BROKER_FIX_BOUND,
    );
    let dlq = only_record(&brokers, "dlqrefused.dlq");
    assert_eq!(dlq.value, incompressible(BIG));
    let images = fwd
        .status()
        .and_then(|s| s.rule("images").cloned())
        .expect("images");
    assert_eq!((images.dead_lettered, images.acked), (1, 1));
}
