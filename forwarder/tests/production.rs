//! The production features on real brokers: MQTT 5 headers, topic templates, dead letters,
//! `/status`, live reload, shared subscriptions and draining with Kafka away.

mod common;

use std::time::{Duration, Instant};

use common::{
    Brokers, Forwarder, V5Message, judge, numbered_messages, publish_v5, read_judged, runtime,
    wait_until,
};
use rumqttc::QoS;

const SENSORS_TO: &str =
    "  - name: sensors\n    mqtt: { topics: [\"sensors/+/data\"] }\n    kafka: { topic: ";

#[test]
fn mqtt5_headers_topic_templates_and_dead_letters() {
    let brokers = Brokers::start();
    let rt = runtime();
    for t in ["telemetry.a", "telemetry.b", "dlq", "x.ok"] {
        rt.block_on(brokers.kafka.create_topic(t, 1))
            .expect("topic");
    }
    rt.block_on(common::create_topic_with_limit(
        &brokers.kafka.bootstrap(),
        "small",
        1000,
    ));
    let rules = "  - name: telemetry\n    mqtt: { topics: [\"plant/+/telemetry\"] }\n    kafka:\n      topic: \"telemetry.{1}\"\n      headers: { metadata: true, user_properties: true }\n    dead_letter: { topic: dlq }\n\
                 \x20 - name: small\n    mqtt: { topics: [\"big/#\"] }\n    kafka: { topic: small }\n    dead_letter: { topic: dlq }\n\
                 \x20 - name: no-dlq\n    mqtt: { topics: [\"nodlq/+\"] }\n    kafka: { topic: \"x.{1}\" }\n    on_unwritable: drop\n";
    let config = brokers.config("ferry-v5", rules).replace(
        "  client_id: ferry-v5\n",
        "  client_id: ferry-v5\n  protocol: 5\n",
    );
    let mut fwd = Forwarder::start(&config);
    fwd.wait_ready(Duration::from_secs(30));

    let big = incompressible(5000);
    rt.block_on(publish_v5(brokers.mqtt.port(), "pub-v5", v5_samples(&big)));

    wait_until(&fwd, Duration::from_secs(30), "every message acked", || {
        fwd.metric("ferry_mqtt_acked_messages_total") >= 9.0
    });
    telemetry_carries_the_mqtt5_metadata_as_headers(&brokers);
    failures_are_dead_lettered_with_their_reason(&brokers, &big);
    status_counts_each_rule(&fwd);
}

/// Bytes lz4 cannot shrink, so a size limit applies to them as they are.
fn incompressible(len: u32) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect()
}

/// Telemetry from plants a (content type, user properties) and b (none), a topic that makes an
/// illegal Kafka topic, `big` for the size-limited topic, and two for the rule without a dead
/// letter topic (one unroutable).
fn v5_samples(big: &[u8]) -> Vec<V5Message> {
    let props = vec![
        ("device".to_string(), "a1".to_string()),
        ("trace".to_string(), "t1".to_string()),
    ];
    let json = Some("application/json".to_string());
    let mut msgs: Vec<V5Message> = Vec::new();
    for i in 0..3 {
        msgs.push((
            "plant/a/telemetry".into(),
            format!("a{i}").into_bytes(),
            json.clone(),
            props.clone(),
        ));
    }
    for i in 0..2 {
        msgs.push((
            "plant/b/telemetry".into(),
            format!("b{i}").into_bytes(),
            None,
            vec![],
        ));
    }
    msgs.push((
        "plant/bad level/telemetry".into(),
        b"unroutable".to_vec(),
        None,
        vec![],
    ));
    msgs.push(("big/1".into(), big.to_vec(), None, vec![]));
    msgs.push((
        "nodlq/bad level".into(),
        b"lost cause".to_vec(),
        None,
        vec![],
    ));
    msgs.push(("nodlq/ok".into(), b"fine".to_vec(), None, vec![]));
    msgs
}

/// Up to `n` records of `topic` (waits 20 s at most, 1 s of quiet).
fn read(brokers: &Brokers, topic: &str, n: usize) -> Vec<ferry_e2e::Record> {
    brokers
        .kafka
        .read_all(topic, n, Duration::from_secs(1), Duration::from_secs(20))
        .expect("read")
}

/// MQTT 5 metadata and user properties become headers; what was not sent is not invented.
fn telemetry_carries_the_mqtt5_metadata_as_headers(brokers: &Brokers) {
    let a = read(brokers, "telemetry.a", 3);
    assert_eq!(a.len(), 3, "{a:?}");
    assert_eq!(a[0].value, b"a0");
    assert_eq!(a[0].key_str(), Some("plant/a/telemetry"));
    for (name, want) in [
        ("mqtt.topic", "plant/a/telemetry"),
        ("mqtt.qos", "1"),
        ("mqtt.retain", "false"),
        ("mqtt.content_type", "application/json"),
        ("device", "a1"),
        ("trace", "t1"),
    ] {
        assert_eq!(a[2].header(name), Some(want), "header {name} in {:?}", a[2]);
    }
    let b = read(brokers, "telemetry.b", 2);
    assert_eq!(b.len(), 2);
    assert_eq!(
        b[0].header("mqtt.content_type"),
        None,
        "not sent, not invented"
    );
    assert_eq!(b[0].header("device"), None);
}

/// The unroutable and the oversize message are dead-lettered with the topic, rule and error.
fn failures_are_dead_lettered_with_their_reason(brokers: &Brokers, big: &[u8]) {
    let dlq = read(brokers, "dlq", 2);
    assert_eq!(dlq.len(), 2, "{dlq:?}");
    let unroutable = dlq
        .iter()
        .find(|r| r.value == b"unroutable")
        .expect("template failure dead-lettered");
    assert_eq!(
        unroutable.header("ferry.mqtt.topic"),
        Some("plant/bad level/telemetry")
    );
    assert_eq!(
        unroutable.header("ferry.kafka.topic"),
        Some("telemetry.{1}")
    );
    assert_eq!(unroutable.header("ferry.rule"), Some("telemetry"));
    assert!(
        unroutable
            .header("ferry.error")
            .is_some_and(|e| e.contains("not a legal Kafka topic")),
        "{unroutable:?}"
    );
    let oversize = dlq
        .iter()
        .find(|r| r.value == big)
        .expect("oversize dead-lettered");
    assert_eq!(oversize.header("ferry.kafka.topic"), Some("small"));
    assert!(
        oversize
            .header("ferry.error")
            .is_some_and(|e| e.contains("too large")),
        "{:?}",
        oversize.headers
    );
    assert_eq!(read(brokers, "x.ok", 1).len(), 1);
}

/// `/status` and the metrics count each rule's messages by outcome.
fn status_counts_each_rule(fwd: &Forwarder) {
    let status = fwd.status().expect("status");
    eprintln!(
        "{}",
        serde_json::to_string_pretty(&status).unwrap_or_default()
    );
    let t = status.rule("telemetry").expect("rule status");
    assert_eq!(
        (t.received, t.forwarded, t.dead_lettered, t.failed, t.acked),
        (6, 5, 1, 0, 6)
    );
    assert!(t.last_forwarded_at.is_some());
    assert!(
        t.last_error
            .as_ref()
            .is_some_and(|e| e.message.contains("bad level"))
    );
    let small = status.rule("small").expect("rule status");
    assert_eq!((small.forwarded, small.dead_lettered), (0, 1));
    let nodlq = status.rule("no-dlq").expect("rule status");
    assert_eq!(
        (nodlq.received, nodlq.forwarded, nodlq.failed, nodlq.acked),
        (2, 1, 1, 2)
    );
    assert!(status.mqtt.connected && status.mqtt.subscribed && status.kafka.reachable);
    assert_eq!(status.config.generation, 1);
    assert_eq!(fwd.metric("ferry_rule_dead_lettered_messages_total"), 2.0);
    assert_eq!(fwd.metric("ferry_rule_failed_messages_total"), 1.0);
    assert!(fwd.metric("ferry_kafka_produce_latency_seconds_count") >= 7.0);
}

#[test]
fn live_reload_applies_rules_without_dropping_the_session_and_keeps_running_on_bad_config() {
    let brokers = Brokers::start();
    let rt = runtime();
    for t in ["before", "after", "others"] {
        rt.block_on(brokers.kafka.create_topic(t, 1))
            .expect("topic");
    }
    let v1 = brokers.config("ferry-reload", &format!("{SENSORS_TO}before }}\n"));
    let mut fwd = Forwarder::start_configmap(&v1);
    fwd.wait_ready(Duration::from_secs(30));

    // Long enough that the reload (the file is polled every second) lands mid-stream.
    let (topics, total) = (5, 80_000);
    let publisher = rt.spawn(ferry_e2e::publish(
        brokers.mqtt.port(),
        "pub-reload",
        QoS::AtLeastOnce,
        numbered_messages(topics, total),
    ));
    wait_until(
        &fwd,
        Duration::from_secs(60),
        "forwarding under load",
        || fwd.metric("ferry_rule_forwarded_messages_total") >= 3000.0,
    );
    // Mid-stream: the sensors rule changes its target, and a rule is added.
    let v2 = brokers.config(
        "ferry-reload",
        &format!(
            "{SENSORS_TO}after }}\n  - name: others\n    mqtt: {{ topics: [\"others/#\"] }}\n    kafka: {{ topic: others }}\n"
        ),
    );
    fwd.swap_config(&v2);
    wait_until(&fwd, Duration::from_secs(10), "reload applied", || {
        fwd.status().is_some_and(|s| s.config.generation == 2)
    });
    let inflight_at_reload = fwd.metric("ferry_inflight_messages");
    rt.block_on(publisher).expect("join").expect("publish");
    // The SUBSCRIBE for the added rule queues behind the acks already requested; once every
    // message is acked it has reached the broker, so what is published now is delivered.
    wait_until(&fwd, Duration::from_secs(60), "backlog acked", || {
        fwd.metric("ferry_mqtt_acked_messages_total") >= total as f64
    });
    rt.block_on(ferry_e2e::publish(
        brokers.mqtt.port(),
        "pub-others",
        QoS::AtLeastOnce,
        (0..100)
            .map(|i| (format!("others/{i}"), b"o".to_vec()))
            .collect(),
    ))
    .expect("publish others");

    let mut records = brokers
        .kafka
        .read_all("before", 1, Duration::from_secs(3), Duration::from_secs(60))
        .expect("read before");
    let before = records.len();
    let after = brokers
        .kafka
        .read_all("after", 1, Duration::from_secs(3), Duration::from_secs(60))
        .expect("read after");
    let moved = after.len();
    records.extend(after);
    let d = judge(&records, total);
    eprintln!(
        "reload mid-stream ({inflight_at_reload} in flight just after): {before} to the old target, {moved} to the new one; {d:?}"
    );
    assert_eq!(d.missing, 0, "lost across the reload");
    assert_eq!(d.duplicates, 0, "re-sent across the reload");
    assert!(before >= 3000 && moved > 0);
    let others = brokers
        .kafka
        .read_all(
            "others",
            100,
            Duration::from_secs(2),
            Duration::from_secs(30),
        )
        .expect("read others");
    assert_eq!(others.len(), 100, "the added rule forwards:\n{}", fwd.log());
    assert_eq!(
        fwd.log().matches("mqtt connected").count(),
        1,
        "the MQTT session was never dropped:\n{}",
        fwd.log()
    );

    // An invalid config is refused; the running one keeps forwarding.
    let broken = v2.replace("name: others", "name: sensors");
    fwd.swap_config(&broken);
    wait_until(&fwd, Duration::from_secs(10), "reload rejected", || {
        fwd.status()
            .is_some_and(|s| s.config.reload_error.is_some())
    });
    let status = fwd.status().expect("status");
    let err = status.config.reload_error.as_ref().expect("reload error");
    assert!(err.message.contains("rules[1].name"), "{}", err.message);
    assert_eq!(status.config.generation, 2);
    assert_eq!(fwd.metric("ferry_config_reloads_total"), 2.0);
    assert!(fwd.log().contains("keeping the running config"));
    rt.block_on(ferry_e2e::publish(
        brokers.mqtt.port(),
        "pub-after-bad",
        QoS::AtLeastOnce,
        vec![("sensors/0/data".into(), b"0:999999".to_vec())],
    ))
    .expect("publish");
    let after = brokers
        .kafka
        .read_all(
            "after",
            moved + 1,
            Duration::from_secs(1),
            Duration::from_secs(30),
        )
        .expect("read after");
    assert_eq!(after.len(), moved + 1, "still forwarding on the old config");
}

#[test]
fn two_replicas_share_a_subscription_and_lose_nothing_when_one_is_killed() {
    let brokers = Brokers::start();
    let rt = runtime();
    rt.block_on(brokers.kafka.create_topic("telemetry", 2))
        .expect("topic");
    let config = |id: &str| {
        brokers
            .config(id, &format!("{SENSORS_TO}telemetry }}\n"))
            .replace(
                &format!("  client_id: {id}\n"),
                &format!("  client_id: {id}\n  protocol: 5\n  shared_group: ferry\n"),
            )
    };
    let mut a = Forwarder::start(&config("ferry-0"));
    let mut b = Forwarder::start(&config("ferry-1"));
    a.wait_ready(Duration::from_secs(30));
    b.wait_ready(Duration::from_secs(30));
    let (topics, total) = (20, 40_000);
    let publisher = rt.spawn(ferry_e2e::publish(
        brokers.mqtt.port(),
        "pub-shared",
        QoS::AtLeastOnce,
        numbered_messages(topics, total),
    ));
    wait_until(
        &b,
        Duration::from_secs(60),
        "both replicas forwarding",
        || {
            a.metric("ferry_rule_forwarded_messages_total") >= 2000.0
                && b.metric("ferry_rule_forwarded_messages_total") >= 2000.0
        },
    );
    let (fa, fb) = (
        a.metric("ferry_rule_forwarded_messages_total"),
        b.metric("ferry_rule_forwarded_messages_total"),
    );
    let bound = b.crash(brokers.mqtt.port(), common::WINDOW);
    // As a StatefulSet would: the same identity comes back and resumes its session.
    std::thread::sleep(Duration::from_secs(1));
    b.restart();
    rt.block_on(publisher).expect("join").expect("publish");
    let d = read_judged(&brokers.kafka, "telemetry", total, Duration::from_secs(240));
    eprintln!(
        "2 replicas sharing $share/ferry (split before the kill: {fa} / {fb}); one SIGKILLed and restarted: {d:?}"
    );
    assert_eq!(d.missing, 0, "lost messages");
    // Only the killed replica's messages come again: its window and the acks the broker had
    // not read (see brokers.rs, the single SIGKILL).
    assert!(
        d.duplicates <= bound,
        "replay beyond what was in flight ({bound}): {}",
        d.duplicates
    );
}

#[test]
fn sigterm_with_kafka_away_and_thousands_in_flight_acks_everything_once_kafka_returns() {
    let mut brokers = Brokers::start();
    // The broker's own in-flight limit at the window, so thousands can be in flight by design
    // rather than only when Mosquitto 2.0.11 overshoots its default limit of 1000.
    brokers.mqtt = ferry_e2e::Mosquitto::start_with(ferry_e2e::MosquittoOptions {
        max_inflight_messages: Some(5000),
        ..ferry_e2e::MosquittoOptions::default()
    })
    .expect("mosquitto");
    let rt = runtime();
    rt.block_on(brokers.kafka.create_topic("telemetry", 1))
        .expect("topic");
    let config = brokers
        .config("ferry-drain", &format!("{SENSORS_TO}telemetry }}\n"))
        .replace("max_inflight: 1000", "max_inflight: 5000")
        .replace("shutdown_timeout_secs: 20", "shutdown_timeout_secs: 60");
    let mut fwd = Forwarder::start(&config);
    fwd.wait_ready(Duration::from_secs(30));
    let (topics, total) = (5, 30_000);
    let publisher = rt.spawn(ferry_e2e::publish(
        brokers.mqtt.port(),
        "pub-drain",
        QoS::AtLeastOnce,
        numbered_messages(topics, total),
    ));
    wait_until(&fwd, Duration::from_secs(60), "forwarding", || {
        fwd.metric("ferry_rule_forwarded_messages_total") >= 2000.0
    });
    brokers.kafka.stop();
    wait_until(&fwd, Duration::from_secs(30), "thousands in flight", || {
        fwd.metric("ferry_inflight_messages") >= 3000.0
    });
    let inflight = fwd.metric("ferry_inflight_messages");
    let term = Instant::now();
    fwd.signal(libc::SIGTERM);
    std::thread::sleep(Duration::from_secs(1));
    assert!(fwd.running(), "must wait for Kafka within its drain bound");
    brokers.kafka.resume().expect("kafka back");
    let status = fwd
        .wait_exit(Duration::from_secs(60))
        .expect("exits once drained");
    eprintln!(
        "SIGTERM with {inflight} in flight and Kafka away: exit {status} after {:.1} s",
        term.elapsed().as_secs_f64()
    );
    assert!(status.success(), "{}", fwd.log());
    assert!(
        fwd.log().contains("mqtt disconnected cleanly"),
        "{}",
        fwd.log()
    );
    assert!(!fwd.log().contains("drain bound passed"));
    fwd.restart();
    rt.block_on(publisher).expect("join").expect("publish");
    let d = read_judged(&brokers.kafka, "telemetry", total, Duration::from_secs(240));
    eprintln!("drained with Kafka away, then restarted: {d:?}");
    assert_eq!(d.missing, 0);
    assert_eq!(
        d.duplicates, 0,
        "every in-flight message was acked before exit"
    );
    assert_eq!(d.out_of_order, 0);
}

#[test]
fn drain_bound_passing_leaves_unconfirmed_messages_for_redelivery() {
    let mut brokers = Brokers::start();
    let rt = runtime();
    rt.block_on(brokers.kafka.create_topic("telemetry", 1))
        .expect("topic");
    let config = brokers
        .config("ferry-bound", &format!("{SENSORS_TO}telemetry }}\n"))
        .replace("shutdown_timeout_secs: 20", "shutdown_timeout_secs: 2");
    let mut fwd = Forwarder::start(&config);
    fwd.wait_ready(Duration::from_secs(30));
    let total = 10_000;
    brokers.kafka.stop();
    rt.block_on(ferry_e2e::publish(
        brokers.mqtt.port(),
        "pub-bound",
        QoS::AtLeastOnce,
        numbered_messages(5, total),
    ))
    .expect("publish");
    wait_until(&fwd, Duration::from_secs(30), "window filled", || {
        fwd.metric("ferry_inflight_messages") >= 1000.0
    });
    let term = Instant::now();
    fwd.signal(libc::SIGTERM);
    let status = fwd
        .wait_exit(Duration::from_secs(15))
        .expect("exits at its bound");
    let took = term.elapsed();
    eprintln!("SIGTERM with Kafka down and a 2 s bound: exit {status} after {took:.1?}");
    assert!(took >= Duration::from_secs(2) && took < Duration::from_secs(10));
    assert!(fwd.log().contains("drain bound passed"), "{}", fwd.log());
    brokers.kafka.resume().expect("kafka back");
    fwd.restart();
    let d = read_judged(&brokers.kafka, "telemetry", total, Duration::from_secs(120));
    eprintln!("after the bound passed and a restart: {d:?}");
    assert_eq!(d.missing, 0, "unconfirmed messages were redelivered");
}

#[test]
fn mqtt5_persistent_session_survives_a_kill_and_restart_losing_nothing() {
    let brokers = Brokers::start();
    let rt = runtime();
    rt.block_on(brokers.kafka.create_topic("telemetry", 1))
        .expect("topic");
    let window = 500;
    let config = brokers
        .config("ferry-rm", &format!("{SENSORS_TO}telemetry }}\n"))
        .replace(
            "  client_id: ferry-rm\n",
            "  client_id: ferry-rm\n  protocol: 5\n",
        )
        .replace("max_inflight: 1000", &format!("max_inflight: {window}"));
    let mut fwd = Forwarder::start(&config);
    fwd.wait_ready(Duration::from_secs(30));
    let (topics, total) = (20, 40_000);
    let publisher = rt.spawn(ferry_e2e::publish(
        brokers.mqtt.port(),
        "pub-rm",
        QoS::AtLeastOnce,
        numbered_messages(topics, total),
    ));
    wait_until(&fwd, Duration::from_secs(60), "forwarding", || {
        fwd.metric("ferry_rule_forwarded_messages_total") >= 5000.0
    });
    let bound = fwd.crash(brokers.mqtt.port(), window);
    fwd.restart();
    rt.block_on(publisher).expect("join").expect("publish");
    let d = read_judged(&brokers.kafka, "telemetry", total, Duration::from_secs(240));
    eprintln!("MQTT 5 (Receive Maximum {window}), SIGKILL mid-stream and restart: {d:?}");
    // The session (expiry: never) kept what was published while the forwarder was down.
    assert_eq!(d.missing, 0);
    assert_eq!(d.out_of_order, 0);
    // The window (Receive Maximum) plus the acks the broker had not read, as with 3.1.1.
    assert!(
        d.duplicates <= bound,
        "replayed {} (bound {bound})",
        d.duplicates
    );
}
