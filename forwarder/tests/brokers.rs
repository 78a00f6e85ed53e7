//! The forwarder binary against real Mosquitto and real Kafka (see ferry-e2e). Each test starts
//! its own brokers on free loopback ports.

mod common;

use std::time::{Duration, Instant};

use base64::Engine as _;
use common::{Brokers, Forwarder, judge, numbered_messages, read_judged, runtime, wait_until};
use ferry_e2e::rumqttc::QoS;

const TELEMETRY_RULE: &str = "  - name: sensors\n    mqtt:\n      topics: [\"sensors/+/data\"]\n    kafka:\n      topic: telemetry\n";

/// What a SIGKILL may replay: the broker's in-flight limit plus the forwarder's window
/// (`max_inflight` in the tests' config).
const REPLAY_BOUND: usize = ferry_e2e::MOSQUITTO_MAX_INFLIGHT as usize + 1000;

#[test]
fn forwards_100k_qos1_messages_over_50_topics_in_order() {
    let brokers = Brokers::start();
    let rt = runtime();
    rt.block_on(brokers.kafka.create_topic("telemetry", 4))
        .expect("topic");
    let mut fwd = Forwarder::start(&brokers.config("ferry-100k", TELEMETRY_RULE));
    fwd.wait_ready(Duration::from_secs(30));

    let (topics, total) = (50, 100_000);
    let start = Instant::now();
    rt.block_on(ferry_e2e::publish(
        brokers.mqtt.port(),
        "pub-100k",
        QoS::AtLeastOnce,
        numbered_messages(topics, total),
    ))
    .expect("publish");
    let records = brokers
        .kafka
        .read_all(
            "telemetry",
            total,
            Duration::from_secs(2),
            Duration::from_secs(240),
        )
        .expect("read");
    let elapsed = start.elapsed();
    let d = judge(&records, total);
    eprintln!(
        "100k QoS 1 over 50 topics: {d:?}; {:.1} s publish-to-read-back ({:.0} msg/s end to end, publisher on the same 2 cores)",
        elapsed.as_secs_f64(),
        total as f64 / elapsed.as_secs_f64()
    );
    assert_eq!(d.missing, 0, "lost messages");
    assert_eq!(
        d.duplicates, 0,
        "no failure happened, so no duplicates are expected"
    );
    assert_eq!(d.out_of_order, 0, "per-topic order");
    assert!(fwd.running());
    eprintln!("{:?}", common::http_get(fwd.http_port, "/metrics"));
    assert_eq!(
        fwd.metric("ferry_rule_forwarded_messages_total"),
        total as f64
    );
    assert_eq!(fwd.metric("ferry_mqtt_acked_messages_total"), total as f64);
}

#[test]
fn kafka_down_for_20s_mid_stream_loses_nothing_and_forwarder_stays_up() {
    let mut brokers = Brokers::start();
    let rt = runtime();
    rt.block_on(brokers.kafka.create_topic("telemetry", 2))
        .expect("topic");
    let mut fwd = Forwarder::start(&brokers.config("ferry-outage", TELEMETRY_RULE));
    fwd.wait_ready(Duration::from_secs(30));

    let (topics, total) = (10, 30_000);
    let port = brokers.mqtt.port();
    // Publish in three bursts: before, during and after the outage.
    let messages = numbered_messages(topics, total);
    let (first, rest) = messages.split_at(10_000);
    let (second, third) = rest.split_at(10_000);
    rt.block_on(ferry_e2e::publish(
        port,
        "pub-outage",
        QoS::AtLeastOnce,
        first.to_vec(),
    ))
    .expect("publish");

    brokers.kafka.stop();
    eprintln!("kafka stopped");
    let outage = Instant::now();
    rt.block_on(ferry_e2e::publish(
        port,
        "pub-outage",
        QoS::AtLeastOnce,
        second.to_vec(),
    ))
    .expect("publish");
    let mut saw_unreachable = false;
    while outage.elapsed() < Duration::from_secs(20) {
        assert!(
            fwd.running(),
            "forwarder exited during the Kafka outage:\n{}",
            fwd.log()
        );
        // Readiness only gates rollouts: an outage after the start keeps the pod Ready and is
        // reported in /status instead (see Health::ready).
        assert_eq!(fwd.ready_status(), Some(200), "/readyz during the outage");
        saw_unreachable |= fwd.status().is_some_and(|s| !s.kafka.reachable);
        std::thread::sleep(Duration::from_millis(500));
    }
    assert!(saw_unreachable, "/status must report Kafka unreachable");
    let acked_during = fwd.metric("ferry_mqtt_acked_messages_total");
    brokers.kafka.resume().expect("restart kafka");
    eprintln!("kafka back after {:.1} s", outage.elapsed().as_secs_f64());
    rt.block_on(ferry_e2e::publish(
        port,
        "pub-outage",
        QoS::AtLeastOnce,
        third.to_vec(),
    ))
    .expect("publish");

    let d = read_judged(&brokers.kafka, "telemetry", total, Duration::from_secs(240));
    eprintln!("Kafka outage of 20 s: {d:?}; acked before Kafka came back: {acked_during}");
    assert_eq!(d.missing, 0, "lost messages");
    assert_eq!(d.out_of_order, 0, "per-topic order");
    assert!(
        acked_during <= 10_000.0 + 1_000.0,
        "nothing beyond the window may be acked while Kafka is down"
    );
    assert!(fwd.running(), "forwarder never exits on a Kafka outage");
    fwd.wait_ready(Duration::from_secs(30));
}

/// A forwarder on `telemetry` (`partitions` partitions) with a publisher of `total` numbered
/// messages running; returns once the forwarder has forwarded `after` of them.
fn mid_stream(
    brokers: &Brokers,
    rt: &tokio::runtime::Runtime,
    name: &str,
    partitions: i32,
    (topics, total): (usize, usize),
    after: f64,
) -> (Forwarder, tokio::task::JoinHandle<anyhow::Result<()>>) {
    rt.block_on(brokers.kafka.create_topic("telemetry", partitions))
        .expect("topic");
    let mut fwd = Forwarder::start(&brokers.config(name, TELEMETRY_RULE));
    fwd.wait_ready(Duration::from_secs(30));
    let publisher = rt.spawn(ferry_e2e::publish(
        brokers.mqtt.port(),
        format!("pub-{name}"),
        QoS::AtLeastOnce,
        numbered_messages(topics, total),
    ));
    let start = Instant::now();
    while fwd.metric("ferry_rule_forwarded_messages_total") < after {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "forwarding did not start:\n{}",
            fwd.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    (fwd, publisher)
}

#[test]
fn forwarder_sigkilled_mid_stream_and_restarted_loses_nothing() {
    let brokers = Brokers::start();
    let rt = runtime();
    let (topics, total) = (20, 40_000);
    let (mut fwd, publisher) = mid_stream(&brokers, &rt, "kill", 2, (topics, total), 5_000.0);
    fwd.signal(libc::SIGKILL);
    let status = fwd.wait_exit(Duration::from_secs(5)).expect("killed");
    eprintln!("forwarder SIGKILLed mid-stream ({status})");
    fwd.restart();
    rt.block_on(publisher).expect("join").expect("publish");

    let d = read_judged(&brokers.kafka, "telemetry", total, Duration::from_secs(240));
    eprintln!(
        "SIGKILL and restart: {d:?} (duplicates are the at-least-once replay of unacked messages)"
    );
    assert_eq!(d.missing, 0, "lost messages");
    assert_eq!(d.out_of_order, 0, "per-topic order, replays aside");
    // Replays are what the broker had not seen acked when the kill reset the connection: at
    // most its in-flight limit (max_inflight_messages), plus, as Mosquitto reads a flooded
    // subscriber's acks late, up to a window of acks the forwarder had written and the reset
    // discarded (README, "Replays after a crash").
    let bound = REPLAY_BOUND;
    assert!(
        d.duplicates <= bound,
        "replay beyond what was in flight ({bound}): {}",
        d.duplicates
    );
}

#[test]
fn sigterm_drains_and_exits_0_within_its_bound_losing_nothing() {
    let brokers = Brokers::start();
    let rt = runtime();
    let (topics, total) = (5, 20_000);
    let (mut fwd, publisher) = mid_stream(&brokers, &rt, "term", 1, (topics, total), 3_000.0);
    let term = Instant::now();
    fwd.signal(libc::SIGTERM);
    let status = fwd
        .wait_exit(Duration::from_secs(25))
        .expect("forwarder must exit within its drain bound");
    eprintln!(
        "SIGTERM → exit {status} after {:.2} s",
        term.elapsed().as_secs_f64()
    );
    assert!(status.success(), "exit code 0 on SIGTERM:\n{}", fwd.log());
    assert!(
        fwd.log().contains("mqtt disconnected cleanly"),
        "{}",
        fwd.log()
    );
    // The broker closing the connection after our DISCONNECT is the expected end.
    assert!(!fwd.log().contains("mqtt connection lost"), "{}", fwd.log());
    fwd.restart();
    rt.block_on(publisher).expect("join").expect("publish");

    let d = read_judged(&brokers.kafka, "telemetry", total, Duration::from_secs(240));
    eprintln!("SIGTERM and restart: {d:?}");
    assert_eq!(d.missing, 0, "lost messages");
    // Everything produced was acked before DISCONNECT, and the acks reached the broker: what
    // the restarted forwarder receives again was never written to Kafka.
    assert_eq!(d.duplicates, 0, "replayed messages after a clean SIGTERM");
    assert_eq!(d.out_of_order, 0);
}

#[test]
fn qos0_and_qos2_are_forwarded_and_a_message_matching_two_rules_is_written_once_per_target() {
    let brokers = Brokers::start();
    let rt = runtime();
    for t in ["all", "temps"] {
        rt.block_on(brokers.kafka.create_topic(t, 1))
            .expect("topic");
    }
    let rules = "  - name: everything\n    mqtt: { topics: [\"plant/#\"], qos: 2 }\n    kafka: { topic: all }\n\
                 \x20 - name: everything-again\n    mqtt: { topics: [\"plant/+/temp\"], qos: 2 }\n    kafka: { topic: all }\n\
                 \x20 - name: temps\n    mqtt: { topics: [\"plant/+/temp\"], qos: 0 }\n    kafka: { topic: temps, key: { topic_level: 1 } }\n";
    let mut fwd = Forwarder::start(&brokers.config("ferry-qos", rules));
    fwd.wait_ready(Duration::from_secs(30));
    let msgs: Vec<(String, Vec<u8>)> = (0..1000)
        .map(|i| (format!("plant/{}/temp", i % 3), format!("{i}").into_bytes()))
        .collect();
    rt.block_on(ferry_e2e::publish(
        brokers.mqtt.port(),
        "pub-qos2",
        QoS::ExactlyOnce,
        msgs,
    ))
    .expect("publish");
    let all = brokers
        .kafka
        .read_all("all", 1000, Duration::from_secs(2), Duration::from_secs(60))
        .expect("read");
    let temps = brokers
        .kafka
        .read_all(
            "temps",
            1000,
            Duration::from_secs(1),
            Duration::from_secs(60),
        )
        .expect("read");
    assert_eq!(
        all.len(),
        1000,
        "two rules with the same target write each message once"
    );
    let values: Vec<u32> = all
        .iter()
        .map(|r| r.value_str().parse().expect("number"))
        .collect();
    assert_eq!(
        values,
        (0..1000).collect::<Vec<_>>(),
        "order kept on a one-partition topic"
    );
    // QoS 0 delivery toward the forwarder may drop under load by MQTT's rules; on loopback at
    // this volume it does not.
    assert_eq!(temps.len(), 1000);
    assert!(
        temps
            .iter()
            .all(|r| matches!(r.key_str(), Some("0" | "1" | "2"))),
        "key = topic level 1"
    );
    // Both rules of the shared target count the message; the QoS 0 rule counts it too.
    assert_eq!(
        fwd.metric("ferry_rule_forwarded_messages_total{rule=\"everything\"}"),
        1000.0
    );
    assert_eq!(
        fwd.metric("ferry_rule_forwarded_messages_total{rule=\"everything-again\"}"),
        1000.0
    );
    assert_eq!(
        fwd.metric("ferry_rule_forwarded_messages_total{rule=\"temps\"}"),
        1000.0
    );
    assert_eq!(fwd.metric("ferry_mqtt_acked_messages_total"), 1000.0);
}

#[test]
fn replaced_forwarders_config_runs_unchanged_with_byte_identical_wrapped_records() {
    let brokers = Brokers::start();
    let rt = runtime();
    for t in ["foobar", "foobar_wrapped"] {
        rt.block_on(brokers.kafka.create_topic(t, 1))
            .expect("topic");
    }
    // The replaced forwarder's config.yaml shape, with its ${VAR} substitution and CONFIG_FILE.
    let legacy = "mqtt:\n    host: 127.0.0.1\n    port: ${MQTT_PORT}\n    client_id: 'kafka-forwarding-service-1'\n\
                  kafka:\n    bootstrap_server: 127.0.0.1\n    port: ${KAFKA_PORT}\n\
                  forwarding:\n    - name: foobar\n      mqtt:\n        topic: foo/bar/#\n      kafka:\n        topic: foobar\n      wrap_as_json: false\n\
                  \x20   - name: foobar-wrapped\n      mqtt:\n        topic: foo/bar/#\n      kafka:\n        topic: foobar_wrapped\n      wrap_as_json: true\n";
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("config.yaml");
    std::fs::write(&path, legacy).expect("write");
    let http_port = ferry_e2e::free_port().expect("port");
    let log = std::fs::File::create(dir.path().join("log")).expect("log");
    let mut child = std::process::Command::new(Forwarder::bin())
        .env("CONFIG_FILE", &path)
        .env("MQTT_PORT", brokers.mqtt.port().to_string())
        .env("KAFKA_PORT", brokers.kafka.port().to_string())
        .env("FERRY_HTTP_LISTEN", format!("127.0.0.1:{http_port}"))
        .stdout(log.try_clone().expect("log"))
        .stderr(log)
        .spawn()
        .expect("spawn");
    let start = Instant::now();
    while common::http_get(http_port, "/readyz").ok().map(|(s, _)| s) != Some(200) {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "not ready: {}",
            std::fs::read_to_string(dir.path().join("log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let payloads: Vec<Vec<u8>> = vec![
        b"hello".to_vec(),
        vec![0, 159, 146, 150, 255],
        b"{\"t\":21.5}".to_vec(),
    ];
    let msgs = payloads
        .iter()
        .enumerate()
        .map(|(i, p)| (format!("foo/bar/{i}"), p.clone()))
        .collect();
    rt.block_on(ferry_e2e::publish(
        brokers.mqtt.port(),
        "pub-legacy",
        QoS::AtLeastOnce,
        msgs,
    ))
    .expect("publish");
    let raw = brokers
        .kafka
        .read_all("foobar", 3, Duration::from_secs(1), Duration::from_secs(60))
        .expect("read");
    let wrapped = brokers
        .kafka
        .read_all(
            "foobar_wrapped",
            3,
            Duration::from_secs(1),
            Duration::from_secs(60),
        )
        .expect("read");
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(raw.len(), 3);
    assert_eq!(wrapped.len(), 3);
    for (i, p) in payloads.iter().enumerate() {
        let topic = format!("foo/bar/{i}");
        assert_eq!(raw[i].value, *p);
        assert_eq!(
            raw[i].key_str(),
            Some(topic.as_str()),
            "key = MQTT topic, as before"
        );
        // What the replaced forwarder wrote: serde_json of {topic, payload: BASE64_STANDARD}.
        let expected = format!(
            r#"{{"topic":"{topic}","payload":"{}"}}"#,
            base64::engine::general_purpose::STANDARD.encode(p)
        );
        assert_eq!(wrapped[i].value, expected.into_bytes());
        assert_eq!(wrapped[i].key_str(), Some(topic.as_str()));
    }
}

/// Each QoS on a filter of its own, so each subscription really is at that QoS (a filter shared
/// with a higher-QoS rule would be subscribed at the higher one): every message arrives, in
/// order, and only QoS 1 and 2 are acknowledged.
#[test]
fn qos_0_1_and_2_each_on_a_filter_of_its_own_are_forwarded_in_order() {
    let brokers = Brokers::start();
    let rt = runtime();
    let mut rules = String::new();
    for q in 0..3 {
        rt.block_on(brokers.kafka.create_topic(&format!("q{q}"), 1))
            .expect("topic");
        rules.push_str(&format!(
            "  - name: q{q}\n    mqtt: {{ topics: [\"q/{q}/#\"], qos: {q} }}\n    kafka: {{ topic: q{q} }}\n"
        ));
    }
    let mut fwd = Forwarder::start(&brokers.config("ferry-each-qos", &rules));
    fwd.wait_ready(Duration::from_secs(30));
    let per_qos = 500;
    for (q, qos) in [
        (0, QoS::AtMostOnce),
        (1, QoS::AtLeastOnce),
        (2, QoS::ExactlyOnce),
    ] {
        let msgs: Vec<(String, Vec<u8>)> = (0..per_qos)
            .map(|i| (format!("q/{q}/x"), format!("{i}").into_bytes()))
            .collect();
        rt.block_on(ferry_e2e::publish(
            brokers.mqtt.port(),
            format!("pub-q{q}"),
            qos,
            msgs,
        ))
        .expect("publish");
    }
    for q in 0..3 {
        let records = brokers
            .kafka
            .read_all(
                &format!("q{q}"),
                per_qos,
                Duration::from_secs(1),
                Duration::from_secs(60),
            )
            .expect("read");
        let values: Vec<usize> = records
            .iter()
            .map(|r| r.value_str().parse().expect("number"))
            .collect();
        // QoS 0 toward the forwarder may drop under load by MQTT's rules; on loopback at this
        // volume it does not.
        assert_eq!(values, (0..per_qos).collect::<Vec<_>>(), "qos {q}");
        let received = fwd.metric(&format!(
            "ferry_mqtt_received_messages_total{{qos=\"{q}\"}}"
        ));
        assert_eq!(
            received, per_qos as f64,
            "delivered to the forwarder at qos {q}"
        );
    }
    wait_until(&fwd, Duration::from_secs(10), "qos 1 and 2 acked", || {
        fwd.metric("ferry_mqtt_acked_messages_total") >= (2 * per_qos) as f64
    });
    assert_eq!(
        fwd.metric("ferry_mqtt_acked_messages_total"),
        (2 * per_qos) as f64
    );
}
