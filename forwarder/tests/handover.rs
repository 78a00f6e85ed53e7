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

/// The config of `id` with `rules`, and `extra` lines at the top level (`drain`,
/// `retiring`): a replica of group `g` subscribing through `$share/g/` (`Some(true)`), or
/// plainly (`Some(false)`, as a group of one replica does), or of no group (`None`).
fn replica(brokers: &Brokers, id: &str, rules: &str, shared: Option<bool>, extra: &str) -> String {
    let share = match shared {
        Some(shared) => format!("  shared_group: g\n  subscribe_shared: {shared}\n"),
        None => String::new(),
    };
    brokers.config(id, rules).replace(
        &format!("  client_id: {id}\n"),
        &format!("  client_id: {id}\n{share}"),
    ) + extra
}

const MOVED_AND_KEPT: [(&str, &str); 2] = [("moved", "sensors/#"), ("kept", "kept/#")];

fn moved_and_kept() -> String {
    MOVED_AND_KEPT.iter().map(|(n, f)| rule(n, f)).collect()
}

/// `n` numbered messages of `moved` (`sensors/<i>/data`), each followed by one of `kept`.
fn moved_with_kept(n: usize) -> Vec<(String, Vec<u8>)> {
    common::numbered_messages(10, n)
        .into_iter()
        .enumerate()
        .flat_map(|(i, m)| [m, (format!("kept/{i}"), format!("k{i}").into_bytes())])
        .collect()
}

/// The replica `id` of a shared group ran, subscribed through `$share/g/`, and is away
/// (killed, its session kept) while `n` messages of each of its rules are published: its
/// session, the group's only member, holds them.
fn a_session_left_by_a_previous_process(brokers: &Brokers, id: &str, n: usize) -> Forwarder {
    let rt = runtime();
    for (topic, _) in MOVED_AND_KEPT {
        rt.block_on(brokers.kafka.create_topic(topic, 1))
            .expect("topic");
    }
    let mut fwd =
        Forwarder::start_configmap(&replica(brokers, id, &moved_and_kept(), Some(true), ""));
    fwd.wait_ready(Duration::from_secs(30));
    assert!(
        fwd.status().is_some_and(|s| s.mqtt.shared),
        "subscribed through $share"
    );
    fwd.kill();
    rt.block_on(ferry_e2e::publish(
        brokers.mqtt.port(),
        &format!("pub-{id}"),
        QoS::AtLeastOnce,
        moved_with_kept(n),
    ))
    .expect("publish while the replica is away");
    fwd
}

/// `leaving`'s session delivers nothing more: `more` is published and `witness`, subscribed
/// plainly to the same filters, acknowledges every one, so the broker has routed each to every
/// subscription it had; `leaving` received none of them.
fn nothing_more_arrives(
    brokers: &Brokers,
    leaving: &Forwarder,
    witness: &Forwarder,
    more: Vec<(String, Vec<u8>)>,
) {
    let received = leaving.metric("ferry_mqtt_received_messages_total");
    let acked = witness.metric("ferry_mqtt_acked_messages_total") as usize + more.len();
    brokers.publish_acked(witness, "pub-after", more, acked, Duration::from_secs(60));
    assert_eq!(
        leaving.metric("ferry_mqtt_received_messages_total"),
        received,
        "nothing more delivered to the leaving session"
    );
}

/// Issue 35, item 2 (the forwarder's part). A replica of a shared group comes back, a fresh
/// process on its resumed session, with its rule `moved` listed in `retiring` (the rule moved
/// to another group while it was away, and its group is down to this one replica, which
/// subscribes plainly; its session, subscribed through `$share/g/` by the previous process,
/// holds the rule's messages). It unsubscribes the rule's filter in both forms on connect,
/// forwards everything its session held for the rule, acknowledges nothing unmatched, and
/// reports the rule handed over; from then on nothing more reaches it through that filter
/// (the new group's forwarder takes what follows), while its other rule goes on.
#[test]
fn a_rule_retiring_when_its_forwarder_starts_is_unsubscribed_in_both_forms_and_handed_over() {
    let brokers = Brokers::start();
    let held = 300;
    let mut old = a_session_left_by_a_previous_process(&brokers, "ferry-old", held);
    let new = Forwarder::start_configmap(&replica(
        &brokers,
        "ferry-new",
        &rule("moved", "sensors/#"),
        None,
        "",
    ));
    old.swap_config(&replica(
        &brokers,
        "ferry-old",
        &moved_and_kept(),
        Some(false),
        "retiring: [moved]\n",
    ));
    old.restart();
    let started = Instant::now();
    let moved = |fwd: &Forwarder| fwd.status().and_then(|s| s.rule("moved").cloned());
    wait_until(&old, Duration::from_secs(60), "moved handed over", || {
        moved(&old).is_some_and(|r| r.retiring.is_some_and(|d| d.drained))
    });
    eprintln!("handed over {:.1?} after the start", started.elapsed());
    let status = old.status().expect("status");
    assert_eq!(
        status.rule("moved").map(|r| (r.forwarded, r.subscribed)),
        Some((held as u64, false)),
        "every message its session held forwarded, and unsubscribed: {status:?}"
    );
    assert!(
        status.rule("kept").is_some_and(|r| r.subscribed),
        "kept stays subscribed: {status:?}"
    );
    assert_eq!(old.metric("ferry_mqtt_unmatched_messages_total"), 0.0);
    let mut new = new;
    new.wait_ready(Duration::from_secs(30));
    let more = 100;
    let after: Vec<_> = common::numbered_messages(10, held + more).split_off(held);
    nothing_more_arrives(&brokers, &old, &new, after);
    let d = common::read_judged(
        &brokers.kafka,
        "moved",
        held + more,
        Duration::from_secs(60),
    );
    assert_eq!(d.missing, 0, "every message of the rule in Kafka: {d:?}");
    let kept = brokers.read(
        "kept",
        held,
        Duration::from_secs(2),
        Duration::from_secs(30),
    );
    assert_eq!(kept.len(), held, "the kept rule's messages, each once");
}

/// Issue 35, item 2 (the forwarder's part), for a scale-down: a replica of a shared group
/// comes back, a fresh process on its resumed session (subscribed through `$share/g/` by the
/// previous process), listed in `drain`. It unsubscribes everything on connect, forwards what
/// its session held, and says drained; from then on nothing more reaches it (a replica that
/// stays takes what follows), and ending its session then loses nothing.
#[test]
fn a_replica_draining_when_it_starts_unsubscribes_everything_and_forwards_what_it_held() {
    let brokers = Brokers::start();
    let held = 300;
    let id = "ferry-leaving";
    let mut leaving = a_session_left_by_a_previous_process(&brokers, id, held);
    leaving.swap_config(&replica(
        &brokers,
        id,
        &moved_and_kept(),
        Some(true),
        &format!("drain: [{id}]\n"),
    ));
    leaving.restart();
    let started = Instant::now();
    wait_until(&leaving, Duration::from_secs(60), "drained", || {
        leaving
            .status()
            .and_then(|s| s.drain)
            .is_some_and(|d| d.drained)
    });
    eprintln!("drained {:.1?} after the start", started.elapsed());
    let status = leaving.status().expect("status");
    assert!(
        status.rules.iter().all(|r| !r.subscribed),
        "draining, nothing subscribed: {status:?}"
    );
    assert_eq!(
        leaving.metric("ferry_mqtt_acked_messages_total"),
        (2 * held) as f64,
        "what its session held, all acknowledged"
    );
    let mut stays = Forwarder::start_configmap(&replica(
        &brokers,
        "ferry-stays",
        &moved_and_kept(),
        Some(true),
        "",
    ));
    stays.wait_ready(Duration::from_secs(30));
    nothing_more_arrives(&brokers, &leaving, &stays, moved_with_kept(50));
    leaving.kill();
    end_session(brokers.mqtt.port(), id);
    let moved = brokers.read(
        "moved",
        held,
        Duration::from_secs(2),
        Duration::from_secs(30),
    );
    let kept = brokers.read(
        "kept",
        held,
        Duration::from_secs(2),
        Duration::from_secs(30),
    );
    assert_eq!(
        (moved.len(), kept.len()),
        (held + 50, held + 50),
        "what the session held and what followed, once each"
    );
}
