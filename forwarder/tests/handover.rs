//! The forwarder's side of the hand-over between groups, against real Mosquitto (and Kafka
//! where records must land): what `/status` says of each rule's subscription, which the
//! operator waits on before it lets another group stop serving a rule.

mod common;

use std::time::{Duration, Instant};

use common::{Brokers, Forwarder, end_session, runtime, wait_until};
use ferry_e2e::rumqttc::QoS;
use ferry_e2e::{FaultProxy, Mosquitto, MosquittoOptions, ProxyMode, free_port};

/// How often the test reads `/status`: the forwarder's states change within milliseconds.
const STATUS_POLL: Duration = Duration::from_millis(50);
/// The forwarder reads its config file again every second (`reload::POLL_INTERVAL`).
const CONFIG_POLL: Duration = Duration::from_secs(1);

fn rule(name: &str, filter: &str) -> String {
    format!(
        "  - name: {name}\n    mqtt: {{ topics: [\"{filter}\"] }}\n    kafka: {{ topic: {name} }}\n"
    )
}

/// Each rule's `subscribed`, by name, as `/status` says it now.
fn subscribed(fwd: &Forwarder) -> Vec<(String, bool)> {
    fwd.status()
        .map(|s| {
            s.rules
                .into_iter()
                .map(|r| (r.name, r.subscribed))
                .collect()
        })
        .unwrap_or_default()
}

fn pairs(of: &[(&str, bool)]) -> Vec<(String, bool)> {
    of.iter().map(|(n, s)| ((*n).to_owned(), *s)).collect()
}

/// A rule is `subscribed` exactly while the broker has granted every one of its filters on
/// the current connection: Mosquitto's ACL refusing a rule's filter keeps it false while its
/// neighbour is true; a rule added by a reload stays false while its SUBSCRIBE is held
/// (a partition between the forwarder and the broker) and turns true with its SUBACK; every
/// rule is false while the connection is down or being made, and true again once the new
/// connection's SUBACKs came.
#[test]
fn a_rule_is_subscribed_only_once_the_broker_granted_its_every_filter_on_this_connection() {
    let mqtt = Mosquitto::start_with(MosquittoOptions {
        deny_subscribe: vec!["secret/#".into()],
        ..Default::default()
    })
    .expect("mosquitto");
    let proxy = FaultProxy::start(std::net::SocketAddr::from(([127, 0, 0, 1], mqtt.port())))
        .expect("proxy");
    // No Kafka: what is subscribed does not depend on it.
    let kafka = format!("127.0.0.1:{}", free_port().expect("port"));
    let config = |rules: &str| {
        common::config(&mqtt, &kafka, "ferry-subscribed", rules).replace(
            &format!("  port: {}\n", mqtt.port()),
            &format!("  port: {}\n", proxy.port()),
        )
    };
    let first = rule("open", "open/#") + &rule("secret", "secret/#");
    let mut fwd = Forwarder::start_configmap(&config(&first));
    wait_until(&fwd, Duration::from_secs(30), "open subscribed", || {
        subscribed(&fwd) == pairs(&[("open", true), ("secret", false)])
    });
    let status = fwd.status().expect("status");
    assert!(
        status
            .rule("secret")
            .is_some_and(|r| r.subscription_refused.is_some()),
        "secret/# was refused, not merely unanswered: {status:?}"
    );

    // The SUBSCRIBE for the added rule is held with every other byte.
    proxy.set_mode(ProxyMode::Blackhole);
    fwd.swap_config(&config(&(first.clone() + &rule("added", "added/#"))));
    wait_until(&fwd, CONFIG_POLL * 10, "the reload applied", || {
        fwd.status()
            .is_some_and(|s| s.rule("added").is_some() && s.config.generation == 2)
    });
    // Long enough for a SUBACK many times over, were the broker reachable.
    for _ in 0..(CONFIG_POLL.as_millis() / STATUS_POLL.as_millis()) {
        assert_eq!(
            subscribed(&fwd),
            pairs(&[("open", true), ("secret", false), ("added", false)]),
            "no SUBACK for added/# yet"
        );
        std::thread::sleep(STATUS_POLL);
    }
    proxy.set_mode(ProxyMode::Pass);
    wait_until(&fwd, Duration::from_secs(10), "added subscribed", || {
        subscribed(&fwd) == pairs(&[("open", true), ("secret", false), ("added", true)])
    });

    // The connection reset, then every new one held before its CONNACK.
    proxy.set_mode(ProxyMode::Reset);
    wait_until(&fwd, Duration::from_secs(10), "disconnected", || {
        fwd.status().is_some_and(|s| !s.mqtt.connected)
    });
    proxy.set_mode(ProxyMode::Blackhole);
    let none = pairs(&[("open", false), ("secret", false), ("added", false)]);
    assert_eq!(subscribed(&fwd), none, "disconnected");
    // A reconnect attempt is under way (backoff of the test config at most 1 s) and held.
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(subscribed(&fwd), none, "connecting");
    proxy.set_mode(ProxyMode::Pass);
    wait_until(
        &fwd,
        Duration::from_secs(30),
        "subscribed again on the new connection",
        || subscribed(&fwd) == pairs(&[("open", true), ("secret", false), ("added", true)]),
    );
    fwd.kill();
}

/// The costliest filter the compile-time model accepts, on a payload at the model's worst
/// case: evaluated off the read thread, for seconds (see `tests/expressions.rs`).
const COSTLY_FILTER: &str =
    "json.items.filter(x, x > 0).size() > 0 && json.items.map(x, x > 0, x * 2).size() > 0";

/// `n` rules of their own targets (the transforms differ) on `costly/+`, each running
/// [`COSTLY_FILTER`], and `light` on `light/+`.
fn costly_rules(n: usize) -> String {
    let mut rules: String = (0..n)
        .map(|i| {
            format!(
                "  - name: costly-{i}\n    mqtt: {{ topics: [\"costly/+\"] }}\n    filter: \"{COSTLY_FILTER}\"\n    kafka: {{ topic: costly }}\n    payload: {{ transform: \"{{'n': json.n, 'rule': {i}}}\" }}\n"
            )
        })
        .collect();
    rules.push_str(&rule("light", "light/+"));
    rules
}

/// A message whose judgement takes the costly rules seconds: the most items `json` holds.
fn costly_message(n: usize) -> (String, Vec<u8>) {
    let items = (ferry_api::expr::PAYLOAD_MAX_BYTES - 64) / 2;
    let body = format!(r#"{{"n":{n},"items":[{}]}}"#, vec!["1"; items].join(","));
    (format!("costly/{n}"), body.into_bytes())
}

/// Issue 35, item 4. A forwarder listed in `drain` when it starts, its session holding a
/// message whose judgement takes seconds (off the read thread) followed by cheap ones: the
/// cheap ones wait behind that judgement, received from the broker but not yet in the window.
/// It must not say `drained` while they wait: once it does, it is stopped and its session
/// ended, as the operator does, and every message the broker acknowledged to the publisher is
/// in Kafka. (Before, the drain's verdict counted only the window, and the session was ended
/// with the waiting messages.)
#[test]
fn a_draining_forwarder_is_not_drained_while_messages_wait_for_their_judgement() {
    let brokers = Brokers::start();
    let rt = runtime();
    for topic in ["costly", "light"] {
        rt.block_on(brokers.kafka.create_topic(topic, 1))
            .expect("topic");
    }
    let costly_rule_count = 8;
    let rules = costly_rules(costly_rule_count);
    let id = "ferry-judged";
    let mut fwd = Forwarder::start_configmap(&brokers.config(id, &rules));
    fwd.wait_ready(Duration::from_secs(30));
    fwd.kill();
    // Queued in the session while the forwarder is away: the costly message first.
    let light = 200;
    let mut messages = vec![costly_message(0)];
    messages.extend((0..light).map(|n| (format!("light/{}", n % 4), n.to_string().into_bytes())));
    rt.block_on(ferry_e2e::publish(
        brokers.mqtt.port(),
        "pub-judged",
        QoS::AtLeastOnce,
        messages,
    ))
    .expect("publish while the forwarder is away");
    fwd.swap_config(&(brokers.config(id, &rules) + &format!("drain: [{id}]\n")));
    fwd.restart();
    let started = Instant::now();
    wait_until(&fwd, Duration::from_secs(120), "drained", || {
        fwd.status()
            .and_then(|s| s.drain)
            .is_some_and(|d| d.drained)
    });
    let drained_after = started.elapsed();
    // What the operator does with a drained pod: it goes, and so does its session.
    fwd.kill();
    end_session(brokers.mqtt.port(), id);
    let read = |topic: &str, n: usize| {
        brokers.read(topic, n, Duration::from_secs(2), Duration::from_secs(30))
    };
    let costly = read("costly", costly_rule_count).len();
    let lights = read("light", light).len();
    eprintln!(
        "drained {drained_after:.1?} after the start; in Kafka: {costly} of {costly_rule_count} costly records, {lights} of {light} light"
    );
    assert_eq!(
        (costly, lights),
        (costly_rule_count, light),
        "every message the session held is in Kafka"
    );
}
