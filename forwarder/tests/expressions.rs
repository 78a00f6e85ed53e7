//! CEL rules against real Mosquitto and Kafka: filters, keys, topics, headers and transforms
//! over JSON payloads, and what happens to the payloads that break them (not JSON, a missing
//! field, a wrong type, nesting too deep where an expression reads): the dead-letter topic with
//! the error, never a stall, never a silent drop.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use common::{Brokers, Forwarder, runtime};
use ferry_e2e::Record;

const RULES: &str = r#"  - name: readings
    mqtt: { topics: ["plant/+/readings"] }
    filter: "json.type != 'heartbeat'"
    kafka:
      topic_expression: "'readings.' + levels[1]"
      key: { expression: "json.device" }
      headers:
        expressions:
          site: "levels[1]"
          unit: "has(json.unit) ? json.unit : null"
    payload:
      transform: "{'device': json.device, 'value': json.value, 'site': levels[1], 'n': json.n}"
    dead_letter: { topic: readings.dlq }
  - name: audit-all
    mqtt: { topics: ["plant/#"] }
    kafka: { topic: audit }
  - name: audit-readings
    mqtt: { topics: ["plant/+/readings"] }
    kafka: { topic: audit }
"#;

/// What a message is, and where it must end up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Reading,
    Heartbeat,
    NotJson,
    NoDevice,
    NumericDevice,
    TooDeep,
    Deep,
    /// A reading with a field nested too deep for `json`, which no expression reads.
    DeepUnread,
    Large,
    /// Larger than `json` parses.
    Huge,
}

fn nested(depth: usize, inner: &str) -> String {
    format!("{}{inner}{}", "{\"a\":".repeat(depth), "}".repeat(depth))
}

/// The message `n` of kind `kind`, published from site `site`.
fn message(kind: Kind, n: usize, site: &str) -> (String, Vec<u8>) {
    let device = format!("dev-{site}-{}", n % 5);
    let body = match kind {
        Kind::Reading => {
            format!(r#"{{"type":"reading","device":"{device}","value":{n}.5,"unit":"C","n":{n}}}"#)
        }
        Kind::Heartbeat => format!(r#"{{"type":"heartbeat","device":"{device}","n":{n}}}"#),
        Kind::NotJson => format!("reading {n} from {device}"),
        Kind::NoDevice => format!(r#"{{"type":"reading","value":1,"n":{n}}}"#),
        Kind::NumericDevice => format!(r#"{{"type":"reading","device":17,"value":1,"n":{n}}}"#),
        // serde_json refuses to build values nested deeper than 128.
        Kind::TooDeep => {
            let inner = nested(200, "1");
            format!(r#"{{"type":"reading","device":"{device}","value":{inner},"n":{n}}}"#)
        }
        // Checked to be JSON, but never built: no expression reads `trace`.
        Kind::DeepUnread => {
            let trace = nested(200, "1");
            format!(
                r#"{{"type":"reading","device":"{device}","trace":{trace},"value":{n}.5,"unit":"C","n":{n}}}"#
            )
        }
        Kind::Deep => {
            let inner = nested(100, "1");
            format!(r#"{{"type":"reading","device":"{device}","value":{inner},"n":{n}}}"#)
        }
        Kind::Large | Kind::Huge => {
            // 5 bytes a sample: just under, or just over, what `json` parses.
            let fits = ferry_api::expr::PAYLOAD_MAX_BYTES / 5;
            let count = if kind == Kind::Huge {
                fits + 100
            } else {
                fits - 100
            };
            let samples = vec!["1.25"; count].join(",");
            format!(r#"{{"type":"reading","device":"{device}","value":[{samples}],"n":{n}}}"#)
        }
    };
    (format!("plant/{site}/readings"), body.into_bytes())
}

fn header<'r>(r: &'r Record, name: &str) -> Option<&'r str> {
    r.headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| std::str::from_utf8(v).expect("utf-8 header"))
}

fn json(r: &Record) -> serde_json::Value {
    serde_json::from_slice(&r.value).expect("a JSON record")
}

#[test]
fn expressions_filter_key_route_and_reshape_and_failures_go_to_the_dead_letter_topic() {
    let brokers = Brokers::start();
    let rt = runtime();
    for topic in ["readings.north", "readings.south", "readings.dlq", "audit"] {
        rt.block_on(brokers.kafka.create_topic(topic, 1))
            .expect("topic");
    }
    let mut fwd = Forwarder::start(&brokers.config("ferry-cel", RULES));
    fwd.wait_ready(Duration::from_secs(30));

    // Mostly readings, the rest of every kind, spread over two sites.
    let mut published: Vec<(Kind, usize, &str)> = Vec::new();
    for n in 0..600 {
        let kind = match n % 20 {
            0 => Kind::Heartbeat,
            1 => Kind::NotJson,
            2 => Kind::NoDevice,
            3 => Kind::NumericDevice,
            4 => Kind::TooDeep,
            5 => Kind::Deep,
            6 if n % 120 == 6 => Kind::Large,
            7 if n % 120 == 7 => Kind::Huge,
            8 => Kind::DeepUnread,
            _ => Kind::Reading,
        };
        published.push((kind, n, if n % 2 == 0 { "north" } else { "south" }));
    }
    let count = |pred: &dyn Fn(Kind) -> bool| published.iter().filter(|(k, ..)| pred(*k)).count();
    let forwarded_kinds = |k: Kind| {
        matches!(
            k,
            Kind::Reading | Kind::DeepUnread | Kind::Deep | Kind::Large
        )
    };
    let failing_kinds = |k: Kind| {
        matches!(
            k,
            Kind::NotJson | Kind::NoDevice | Kind::NumericDevice | Kind::TooDeep | Kind::Huge
        )
    };
    let (forwarded, failing) = (count(&forwarded_kinds), count(&failing_kinds));
    let heartbeats = count(&|k| k == Kind::Heartbeat);
    let msgs = published
        .iter()
        .map(|(kind, n, site)| message(*kind, *n, site))
        .collect();
    let started = Instant::now();
    brokers.publish_acked(
        &fwd,
        "pub-cel",
        msgs,
        published.len(),
        Duration::from_secs(60),
    );
    eprintln!(
        "{} messages ({forwarded} forwarded, {heartbeats} filtered, {failing} dead-lettered) acked in {:.2} s",
        published.len(),
        started.elapsed().as_secs_f64()
    );

    let read = |topic: &str, n: usize| {
        brokers.read(topic, n, Duration::from_secs(2), Duration::from_secs(30))
    };
    // Routed by site, keyed by device, headers from the topic and the payload, reshaped.
    let mut by_n: BTreeMap<usize, Record> = BTreeMap::new();
    for site in ["north", "south"] {
        let want = published
            .iter()
            .filter(|(k, _, s)| forwarded_kinds(*k) && *s == site)
            .count();
        let records = read(&format!("readings.{site}"), want);
        assert_eq!(records.len(), want, "readings.{site}");
        for r in records {
            let v = json(&r);
            assert_eq!(v["site"], site, "{v}");
            assert_eq!(header(&r, "site"), Some(site));
            assert_eq!(r.key_str(), v["device"].as_str(), "keyed by the device");
            let n = v["n"].as_u64().expect("n") as usize;
            assert!(by_n.insert(n, r).is_none(), "message {n} twice");
        }
    }
    for (kind, n, site) in &published {
        let Some(r) = by_n.get(n) else {
            assert!(!forwarded_kinds(*kind), "{kind:?} {n} not forwarded");
            continue;
        };
        let v = json(r);
        let object = v.as_object().expect("an object");
        let fields: BTreeSet<&str> = object.keys().map(String::as_str).collect();
        assert_eq!(
            fields,
            BTreeSet::from(["device", "n", "site", "value"]),
            "{v}"
        );
        assert_eq!(v["device"], format!("dev-{site}-{}", n % 5));
        match kind {
            Kind::Reading | Kind::DeepUnread => {
                assert_eq!(v["value"].as_f64(), Some(*n as f64 + 0.5));
                assert_eq!(header(r, "unit"), Some("C"));
            }
            Kind::Deep => {
                assert_eq!(header(r, "unit"), None, "a null header is left out");
                let mut inner = &v["value"];
                for _ in 0..100 {
                    inner = &inner["a"];
                }
                assert_eq!(inner, 1, "100 levels kept");
            }
            Kind::Large => {
                let want = ferry_api::expr::PAYLOAD_MAX_BYTES / 5 - 100;
                assert_eq!(v["value"].as_array().map(Vec::len), Some(want));
            }
            other => panic!("{other:?} forwarded"),
        }
    }

    // Every failure in the dead-letter topic, untouched, with the error that names the field.
    let dlq = read("readings.dlq", failing);
    assert_eq!(
        dlq.len(),
        failing,
        "every failing message dead-lettered once"
    );
    let mut errors: BTreeMap<&str, usize> = BTreeMap::new();
    for r in &dlq {
        let error = header(r, "ferry.error").expect("ferry.error");
        let why =
            if error.contains("reads json, but the payload (") && error.contains("larger than") {
                "too large for json"
            } else if error.contains("reads json, but the payload is not JSON") {
                if error.contains("recursion limit") {
                    "too deep"
                } else {
                    "not json"
                }
            } else if error.contains("No such key: device") {
                "missing field"
            } else if error.contains("kafka.key.expression failed: returned an int") {
                "wrong type"
            } else {
                panic!("unexpected error {error:?}");
            };
        *errors.entry(why).or_default() += 1;
        assert_eq!(header(r, "ferry.rule"), Some("readings"));
        assert!(header(r, "ferry.mqtt.topic").is_some_and(|t| t.starts_with("plant/")));
    }
    let want_errors = BTreeMap::from([
        ("missing field", count(&|k| k == Kind::NoDevice)),
        ("not json", count(&|k| k == Kind::NotJson)),
        ("too deep", count(&|k| k == Kind::TooDeep)),
        ("too large for json", count(&|k| k == Kind::Huge)),
        ("wrong type", count(&|k| k == Kind::NumericDevice)),
    ]);
    assert_eq!(errors, want_errors);

    // Per rule: the filter's count, and only the rules a message matched credited.
    let status = fwd.status().expect("status");
    let rule = |name: &str| status.rule(name).expect("rule").clone();
    let readings = rule("readings");
    assert_eq!(readings.filtered, heartbeats as u64);
    assert_eq!(readings.dead_lettered, failing as u64);
    assert_eq!(readings.forwarded, forwarded as u64);
    assert_eq!(rule("audit-all").forwarded, published.len() as u64);
    assert_eq!(rule("audit-readings").forwarded, published.len() as u64);
    let audit = read("audit", published.len());
    assert_eq!(
        audit.len(),
        published.len(),
        "a shared target is written once"
    );
    assert_eq!(
        readings.failed, 0,
        "nothing dropped: the dead-letter topic took every failure"
    );
    fwd.kill();
}

/// Rules sharing one Kafka target, some with filters: a message matching several is written
/// once, each rule is credited only with what it matched and passed; one rule's filter failing
/// on a message another rule of the target passes costs that rule a failure, not the message.
/// A rule alone with a failing filter and `on_unwritable: drop` drops it, counted by reason.
#[test]
fn rules_sharing_a_target_are_credited_only_with_what_they_matched_and_passed() {
    let brokers = Brokers::start();
    let rt = runtime();
    for topic in ["audit", "hot"] {
        rt.block_on(brokers.kafka.create_topic(topic, 1))
            .expect("topic");
    }
    let rules = r#"  - name: audit-all
    mqtt: { topics: ["plant/#"] }
    kafka: { topic: audit }
  - name: audit-readings
    mqtt: { topics: ["plant/+/readings"] }
    kafka: { topic: audit }
  - name: audit-hot
    mqtt: { topics: ["plant/+/readings"] }
    filter: "json.temp > 50.0"
    kafka: { topic: audit }
  - name: only-hot
    mqtt: { topics: ["plant/+/readings"] }
    filter: "json.temp > 50.0"
    kafka: { topic: hot }
    on_unwritable: drop
  - name: no-status
    mqtt: { topics: ["plant/+/status"] }
    filter: "size(payload) == 0"
    kafka: { topic: hot }
"#;
    let mut fwd = Forwarder::start(&brokers.config("ferry-credit", rules));
    fwd.wait_ready(Duration::from_secs(30));
    // n % 6 == 0: a hot reading; n % 6 == 3: a cold one; n % 3 == 2: a reading that is not
    // JSON; n % 3 == 1: a status no filter sees.
    let msgs: Vec<(String, Vec<u8>)> = (0..300)
        .map(|n| match n % 3 {
            0 => {
                let temp = if n % 2 == 0 { 60.5 } else { 20.5 };
                let body = format!(r#"{{"n":{n},"temp":{temp}}}"#);
                ("plant/1/readings".to_owned(), body.into_bytes())
            }
            1 => (
                "plant/1/status".to_owned(),
                format!("status {n}").into_bytes(),
            ),
            _ => (
                "plant/1/readings".to_owned(),
                format!("reading {n}").into_bytes(),
            ),
        })
        .collect();
    brokers.publish_acked(&fwd, "pub-credit", msgs, 300, Duration::from_secs(60));
    let audit = brokers.read(
        "audit",
        300,
        Duration::from_secs(2),
        Duration::from_secs(30),
    );
    assert_eq!(
        audit.len(),
        300,
        "every message once: the shared target writes it once"
    );
    let hot = brokers.read("hot", 50, Duration::from_secs(2), Duration::from_secs(30));
    assert_eq!(hot.len(), 50, "only the hot readings");
    assert!(hot.iter().all(|r| json(r)["temp"] == 60.5));

    let status = fwd.status().expect("status");
    let rule = |name: &str| {
        let r = status.rule(name).expect("rule").clone();
        (r.forwarded, r.filtered, r.failed, r.dead_lettered)
    };
    assert_eq!(rule("audit-all"), (300, 0, 0, 0));
    assert_eq!(rule("audit-readings"), (200, 0, 0, 0));
    assert_eq!(
        rule("audit-hot"),
        (50, 50, 100, 0),
        "its hot readings, its cold ones filtered, the other rules' readings written despite its failures"
    );
    assert_eq!(
        rule("only-hot"),
        (50, 50, 100, 0),
        "alone, its failures are dropped"
    );
    let failed = |rule: &str| {
        fwd.metric_with(
            "ferry_rule_failed_messages_total",
            &[&format!("rule=\"{rule}\""), "reason=\"invalid_json\""],
        )
    };
    assert_eq!((failed("audit-hot"), failed("only-hot")), (100.0, 100.0));
    assert_eq!(
        rule("no-status"),
        (0, 100, 0, 0),
        "its filter drops everything"
    );
    // Acked: every message of the rule, whatever became of it (forwarded, filtered, failed);
    // so a rule whose filter drops everything is not stalled (FerryRuleStalled compares
    // received with acked).
    for (name, received) in [
        ("audit-all", 300),
        ("audit-readings", 200),
        ("audit-hot", 200),
        ("only-hot", 200),
        ("no-status", 100),
    ] {
        let label = format!("rule=\"{name}\"");
        let metric = |m: &str| fwd.metric_with(m, &[&label]);
        let r = status.rule(name).expect("rule");
        assert_eq!((r.received, r.acked), (received, received), "{name}");
        assert_eq!(
            (
                metric("ferry_rule_received_messages_total"),
                metric("ferry_rule_acked_messages_total")
            ),
            (received as f64, received as f64),
            "{name}"
        );
    }
    fwd.kill();
}

/// The costliest expression the compile-time rules let through (a comprehension over every
/// element of a large payload) costs in proportion to the payload: while such messages arrive,
/// another rule's stream keeps flowing and every message of both arrives.
#[test]
fn an_expensive_expression_does_not_starve_the_pipeline() {
    let brokers = Brokers::start();
    let rt = runtime();
    for topic in ["heavy", "light"] {
        rt.block_on(brokers.kafka.create_topic(topic, 1))
            .expect("topic");
    }
    let rules = "  - name: heavy\n    mqtt: { topics: [\"heavy/+\"] }\n    filter: \"json.items.map(x, x > 0, x * 2).size() > 0\"\n    kafka: { topic: heavy }\n    payload: { transform: \"{'count': size(json.items), 'n': json.n}\" }\n\
                 \x20 - name: light\n    mqtt: { topics: [\"light/+\"] }\n    kafka: { topic: light }\n";
    let mut fwd = Forwarder::start(&brokers.config("ferry-heavy", rules));
    fwd.wait_ready(Duration::from_secs(30));
    // The most `json` parses: items of "1," fill it.
    let items = (ferry_api::expr::PAYLOAD_MAX_BYTES - 64) / 2;
    let heavy = 10;
    let light = 5_000;
    let mut msgs = Vec::new();
    for n in 0..light {
        if n % (light / heavy) == 0 {
            let body = format!(r#"{{"n":{n},"items":[{}]}}"#, vec!["1"; items].join(","));
            msgs.push((format!("heavy/{n}"), body.into_bytes()));
        }
        msgs.push((format!("light/{}", n % 4), format!("{n}").into_bytes()));
    }
    let total = msgs.len();
    let started = Instant::now();
    brokers.publish_acked(&fwd, "pub-heavy", msgs, total, Duration::from_secs(120));
    let elapsed = started.elapsed();
    let read = |topic: &str, n: usize| {
        brokers.read(topic, n, Duration::from_secs(2), Duration::from_secs(30))
    };
    let heavy_records = read("heavy", heavy);
    assert_eq!(heavy_records.len(), heavy);
    for r in &heavy_records {
        assert_eq!(json(r)["count"], items);
    }
    assert_eq!(
        read("light", light).len(),
        light,
        "the other rule's stream all arrived"
    );
    eprintln!(
        "{heavy} messages of {} KiB through a comprehension over {items} items, among {light} others: all acked in {:.2} s",
        ferry_api::expr::PAYLOAD_MAX_BYTES / 1024,
        elapsed.as_secs_f64()
    );
    fwd.kill();
}

/// Issue 21, case 1. Many rules run about the costliest filter the compile-time model accepts,
/// on payloads at the model's worst case, all matching the same messages; another builds
/// records larger than the producer's `message.max.bytes` (accepted at compile time: what it
/// builds depends on the payload); a neighbour rule streams beside them. The neighbour's every
/// message arrives, `/healthz` answers throughout within the liveness probe's timeout though
/// each costly message takes several times that to evaluate, the oversized records are
/// dead-lettered on their own rule with the error, and each costly rule forwards every message
/// it passes.
#[test]
fn the_costliest_accepted_expression_and_an_oversized_record_stay_on_their_own_rules() {
    let costly =
        "json.items.filter(x, x > 0).size() > 0 && json.items.map(x, x > 0, x * 2).size() > 0";
    let estimate = ferry_api::expr::compile(costly)
        .expect("accepted")
        .cost()
        .steps;
    let budget = ferry_api::expr::COST_BUDGET;
    assert!(
        estimate > budget / 2 && estimate <= budget,
        "the filter costs {estimate} of {budget} steps"
    );
    let brokers = Brokers::start();
    let rt = runtime();
    for topic in ["costly", "big", "big.dlq", "light"] {
        rt.block_on(brokers.kafka.create_topic(topic, 1))
            .expect("topic");
    }
    // Each its own target (the transforms differ): one budget each, spent on one message.
    let costly_rules = 8;
    let mut rules: String = (0..costly_rules)
        .map(|i| {
            format!(
                "  - name: costly-{i}\n    mqtt: {{ topics: [\"costly/+\"] }}\n    filter: \"{costly}\"\n    kafka: {{ topic: costly }}\n    payload: {{ transform: \"{{'n': json.n, 'rule': {i}}}\" }}\n"
            )
        })
        .collect();
    rules.push_str(
        "  - name: big\n    mqtt: { topics: [\"big/+\"] }\n    kafka: { topic: big }\n    payload: { transform: \"[json.s, json.s, json.s, json.s, json.s]\" }\n    dead_letter: { topic: big.dlq }\n\
         \x20 - name: light\n    mqtt: { topics: [\"light/+\"] }\n    kafka: { topic: light }\n"
    );
    let mut fwd = Forwarder::start(&brokers.config("ferry-costly", &rules));
    fwd.wait_ready(Duration::from_secs(30));
    // The most elements `json` holds: items of "1," fill the payload.
    let items = (ferry_api::expr::PAYLOAD_MAX_BYTES - 64) / 2;
    let (costly_n, big_n, light_n) = (2, 3, 3_000);
    let mut msgs = Vec::new();
    for n in 0..light_n {
        if n % (light_n / costly_n) == 0 {
            let body = format!(r#"{{"n":{n},"items":[{}]}}"#, vec!["1"; items].join(","));
            msgs.push((format!("costly/{n}"), body.into_bytes()));
        }
        if n % (light_n / big_n) == 1 {
            // Five copies of 200,000 bytes: more than librdkafka's default 1,000,000.
            let body = format!(r#"{{"n":{n},"s":"{}"}}"#, "x".repeat(200_000));
            msgs.push((format!("big/{n}"), body.into_bytes()));
        }
        msgs.push((format!("light/{}", n % 4), format!("{n}").into_bytes()));
    }
    let total = msgs.len();
    // /healthz is probed all along: every probe must be answered.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let prober = {
        let (stop, port) = (std::sync::Arc::clone(&stop), fwd.http_port);
        std::thread::spawn(move || {
            let mut slowest = Duration::ZERO;
            let mut probes = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let asked = Instant::now();
                let answer = ferry_e2e::http_get(port, "/healthz");
                assert!(
                    matches!(answer, Ok((200, _))),
                    "/healthz did not answer: {answer:?}"
                );
                slowest = slowest.max(asked.elapsed());
                probes += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
            (probes, slowest)
        })
    };
    let started = Instant::now();
    brokers.publish_acked(&fwd, "pub-costly", msgs, total, Duration::from_secs(180));
    let elapsed = started.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (probes, slowest) = prober.join().expect("every /healthz probe answered");
    let read = |topic: &str, n: usize| {
        brokers.read(topic, n, Duration::from_secs(2), Duration::from_secs(30))
    };
    assert_eq!(
        read("light", light_n).len(),
        light_n,
        "the neighbour's stream"
    );
    let costly_records = read("costly", costly_n * costly_rules);
    assert_eq!(costly_records.len(), costly_n * costly_rules);
    let dlq = read("big.dlq", big_n);
    assert_eq!(dlq.len(), big_n, "every oversized record dead-lettered");
    for r in &dlq {
        let error = header(r, "ferry.error").expect("ferry.error");
        assert!(
            error.contains("built") && error.contains("more than the 1000000 bytes"),
            "{error}"
        );
        assert_eq!(header(r, "ferry.rule"), Some("big"));
    }
    let written = brokers.read("big", 1, Duration::from_secs(1), Duration::from_secs(3));
    assert_eq!(written.len(), 0, "nothing oversized was written");
    let status = fwd.status().expect("status");
    let rule = |name: &str| status.rule(name).expect("rule").clone();
    assert_eq!(rule("light").forwarded, light_n as u64);
    for i in 0..costly_rules {
        let costly = rule(&format!("costly-{i}"));
        assert_eq!((costly.forwarded, costly.failed), (costly_n as u64, 0));
    }
    assert_eq!(rule("big").dead_lettered, big_n as u64);
    assert_eq!(rule("light").failed, 0);
    // What the operator renders: Kubernetes' default probe timeout. A costly message's
    // evaluation (its rules' budgets together) takes several times that.
    let probe_timeout = Duration::from_secs(1);
    assert!(
        slowest < probe_timeout,
        "/healthz took {slowest:?} to answer: a liveness probe would have failed"
    );
    eprintln!(
        "{costly_n} messages through {costly_rules} rules' filters estimated at {estimate} of \
         {budget} steps each and {big_n} oversized records among {light_n} others: all acked in {:.2} s; /healthz answered \
         {probes} probes, the slowest in {:.0} ms",
        elapsed.as_secs_f64(),
        slowest.as_secs_f64() * 1e3
    );
    fwd.kill();
}
