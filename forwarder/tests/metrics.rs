//! What a running forwarder serves on `/metrics`, read as Prometheus reads it: every name and
//! label value is one docs/metrics.md documents (alerts are written from there), and the standard
//! `process_*` and build-info metrics are there.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::{Brokers, Forwarder, runtime, wait_until};
use ferry_e2e::metrics::Scrape;
use rumqttc::QoS;

const METRICS_DOC: &str = include_str!("../../docs/metrics.md");

fn set(values: &[&str]) -> BTreeSet<String> {
    values.iter().map(|v| (*v).to_owned()).collect()
}

#[test]
fn metrics_serve_exactly_the_documented_names_and_label_values() {
    let brokers = Brokers::start();
    let rt = runtime();
    rt.block_on(brokers.kafka.create_topic("ok", 1))
        .expect("topic");
    rt.block_on(common::create_topic_with_limit(
        &brokers.kafka.bootstrap(),
        "small",
        1000,
    ));
    // Each rule makes one label value appear: records too large for their topic and topic
    // names a template cannot make are dropped (`reason` of the failures), a topic that does
    // not exist is retried (`reason` of the retries).
    let rules = "  - name: ok\n    mqtt: { topics: [\"ok/#\"] }\n    kafka: { topic: ok }\n\
                 \x20 - name: small\n    mqtt: { topics: [\"small/#\"] }\n    kafka: { topic: small }\n    on_unwritable: drop\n\
                 \x20 - name: templated\n    mqtt: { topics: [\"t/+\"] }\n    kafka: { topic: \"x.{1}\" }\n    on_unwritable: drop\n\
                 \x20 - name: missing\n    mqtt: { topics: [\"missing/#\"] }\n    kafka: { topic: missing }\n";
    let config = brokers.config("ferry-metrics", rules).replace(
        "  bootstrap_servers:",
        "  config: { topic.metadata.propagation.max.ms: 500 }\n  bootstrap_servers:",
    );
    let started = std::time::Instant::now();
    let mut fwd = Forwarder::start_configmap(&config);
    fwd.wait_ready(Duration::from_secs(30));

    // Incompressible, so the topic's limit applies after lz4.
    let big: Vec<u8> = (0..5000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    for (qos, messages) in [
        (QoS::AtMostOnce, vec![("ok/0".to_owned(), b"zero".to_vec())]),
        (
            QoS::AtLeastOnce,
            vec![
                ("ok/1".to_owned(), b"one".to_vec()),
                ("small/1".to_owned(), big),
                ("t/bad level".to_owned(), b"no topic".to_vec()),
                ("missing/1".to_owned(), b"waits".to_vec()),
            ],
        ),
    ] {
        rt.block_on(ferry_e2e::publish(
            brokers.mqtt.port(),
            "pub-metrics",
            qos,
            messages,
        ))
        .expect("publish");
    }
    wait_until(
        &fwd,
        Duration::from_secs(30),
        "two drops and a retry",
        || {
            fwd.metric("ferry_rule_failed_messages_total") >= 2.0
                && fwd.metric("ferry_rule_produce_retries_total") >= 1.0
        },
    );
    // A reload applied (a rule added), then one rejected (a duplicate name).
    let added = format!(
        "{config}  - name: more\n    mqtt: {{ topics: [\"more/#\"] }}\n    kafka: {{ topic: ok }}\n"
    );
    fwd.swap_config(&added);
    wait_until(&fwd, Duration::from_secs(10), "reload applied", || {
        fwd.status().is_some_and(|s| s.config.generation == 2)
    });
    fwd.swap_config(&added.replace("name: more", "name: ok"));
    wait_until(&fwd, Duration::from_secs(10), "reload rejected", || {
        fwd.status()
            .is_some_and(|s| s.config.reload_error.is_some())
    });

    let scrape = Scrape::get(fwd.http_port).expect("scrape");
    eprintln!("{}", scrape.text);
    assert_eq!(
        scrape.undocumented(METRICS_DOC, &["rule", "version"]),
        Vec::<String>::new(),
        "served but not in docs/metrics.md's metrics table"
    );
    assert_eq!(
        scrape.label_values("ferry_rule_failed_messages_total", "reason"),
        set(&["too_large", "invalid_topic"])
    );
    let retries = scrape.label_values("ferry_rule_produce_retries_total", "reason");
    assert!(retries.contains("unknown_topic"), "{retries:?}");
    assert_eq!(
        scrape.label_values("ferry_config_reloads_total", "result"),
        set(&["applied", "rejected"])
    );
    assert_eq!(
        scrape.label_values("ferry_mqtt_received_messages_total", "qos"),
        set(&["0", "1", "2"])
    );
    assert_eq!(
        scrape.label_values("ferry_rule_forwarded_messages_total", "rule"),
        set(&["ok", "small", "templated", "missing", "more"])
    );
    // Only rule ok had a record confirmed: only it has a last-forwarded time, and a recent one.
    assert_eq!(
        scrape.label_values("ferry_rule_last_forwarded_timestamp_seconds", "rule"),
        set(&["ok"])
    );
    let last = scrape
        .value(
            "ferry_rule_last_forwarded_timestamp_seconds",
            &[("rule", "ok")],
        )
        .expect("rule ok's last forwarded time");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_secs_f64();
    assert!(
        last <= now && now - last < started.elapsed().as_secs_f64() + 1.0,
        "last forwarded at {last}, now {now}"
    );
    for (metric, labels) in [
        (
            "ferry_rule_failed_messages_total",
            [("rule", "small"), ("reason", "too_large")],
        ),
        (
            "ferry_rule_failed_messages_total",
            [("rule", "templated"), ("reason", "invalid_topic")],
        ),
    ] {
        assert_eq!(
            scrape.value(metric, &labels),
            Some(1.0),
            "{metric}{labels:?}"
        );
    }
    for result in ["applied", "rejected"] {
        assert_eq!(
            scrape.value("ferry_config_reloads_total", &[("result", result)]),
            Some(1.0),
            "{result}"
        );
    }

    assert_eq!(
        scrape.value(
            "ferry_forwarder_build_info",
            &[("version", env!("CARGO_PKG_VERSION"))]
        ),
        Some(1.0)
    );
    scrape.check_process_metrics().expect("process metrics");
    assert!(
        scrape.value("process_threads", &[]) >= Some(2.0),
        "the forwarder runs its Tokio workers and librdkafka's threads"
    );
}
