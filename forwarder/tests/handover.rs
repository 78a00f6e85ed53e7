//! The forwarder's side of the hand-over between groups, against real Mosquitto (and Kafka
//! where records must land): what `/status` says of each rule's subscription, which the
//! operator waits on before it lets another group stop serving a rule.

mod common;

use std::time::Duration;

use common::{Forwarder, wait_until};
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
