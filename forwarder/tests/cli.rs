//! The binary's contract for bad input: exit code 2 and every problem named by its field path,
//! before anything starts.

use std::process::Command;

fn run_with_config(text: &str) -> (Option<i32>, String) {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("config.yaml");
    std::fs::write(&path, text).expect("write");
    let out = Command::new(env!("CARGO_BIN_EXE_ferry-forwarder"))
        .arg("--config")
        .arg(&path)
        .output()
        .expect("run");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn invalid_config_exits_2_naming_every_field() {
    let (code, stderr) = run_with_config(
        "mqtt: { host: localhost, client_id: c, password: hunter2 }\n\
         kafka: { bootstrap_servers: \"localhost\" }\n\
         rules:\n\
         \x20 - name: ok\n    mqtt: { topics: [\"a/#\"] }\n    kafka: { topic: ok }\n\
         \x20 - name: bad\n    mqtt: { topics: [\"a/#/b\"], qos: 3 }\n    kafka: { topic: \"a b\" }\n",
    );
    assert_eq!(code, Some(2), "{stderr}");
    for expected in [
        "mqtt.password: is set but mqtt.username (or mqtt.username_file) is not",
        "kafka.bootstrap_servers: \"localhost\" is not host:port",
        "rules[1].mqtt.topics[0]: \"a/#/b\" is not a valid MQTT topic filter",
        "rules[1].mqtt.qos: 3 is not an MQTT QoS",
        "rules[1].kafka.topic: \"a b\" is not a valid Kafka topic name",
    ] {
        assert!(
            stderr.contains(expected),
            "missing {expected:?} in:\n{stderr}"
        );
    }
    assert!(
        !stderr.contains("hunter2"),
        "secrets never appear in errors"
    );
}

#[test]
fn legacy_config_errors_use_legacy_field_names_where_types_are_wrong() {
    let (code, stderr) = run_with_config(
        "mqtt: { host: h, port: notaport, client_id: c }\nkafka: { bootstrap_server: k, port: 9092 }\nforwarding: []\n",
    );
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("mqtt.port"), "{stderr}");
}

#[test]
fn missing_config_file_exits_2_with_its_path() {
    let out = Command::new(env!("CARGO_BIN_EXE_ferry-forwarder"))
        .arg("--config")
        .arg("/nonexistent/ferry.yaml")
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/ferry.yaml"));
}

#[test]
fn check_flag_validates_without_connecting() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("config.yaml");
    std::fs::write(
        &path,
        "mqtt: { host: 192.0.2.1, client_id: c }\nkafka: { bootstrap_servers: \"192.0.2.1:9092\" }\nrules:\n  - name: r\n    mqtt: { topics: [t] }\n    kafka: { topic: t }\n",
    )
    .expect("write");
    let out = Command::new(env!("CARGO_BIN_EXE_ferry-forwarder"))
        .arg("--check")
        .arg("--config")
        .arg(&path)
        .output()
        .expect("run");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("valid (1 rules)"));
}

fn check(text: &str) -> (Option<i32>, String) {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("config.yaml");
    std::fs::write(&path, text).expect("write");
    let out = Command::new(env!("CARGO_BIN_EXE_ferry-forwarder"))
        .arg("--check")
        .arg("--config")
        .arg(&path)
        .output()
        .expect("run");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn with_kafka(kafka: &str) -> String {
    format!(
        "mqtt: {{ host: 192.0.2.1, client_id: c }}\nkafka: {{ bootstrap_servers: \"192.0.2.1:9092\", {kafka} }}\nrules:\n  - name: r\n    mqtt: {{ topics: [t] }}\n    kafka: {{ topic: t }}\n"
    )
}

#[test]
fn kafka_settings_that_weaken_the_guarantee_exit_2_unless_allowed() {
    let (code, stderr) = check(&with_kafka(
        "config: { acks: 1, enable.idempotence: false, message.timeout.ms: 30000, transactional.id: x }",
    ));
    assert_eq!(code, Some(2), "{stderr}");
    for expected in [
        "kafka.config.acks: \"1\" weakens the delivery guarantee: it must be all (or -1)",
        "kafka.config.enable.idempotence: \"false\" weakens the delivery guarantee: it must be true",
        "kafka.config.message.timeout.ms: \"30000\" weakens the delivery guarantee: it must be 0 (never time out)",
        "kafka.config.transactional.id: cannot be used: it makes a transactional producer",
        "set kafka.allow_weaker_delivery: true to accept that",
    ] {
        assert!(
            stderr.contains(expected),
            "missing {expected:?} in:\n{stderr}"
        );
    }
    let (code, stderr) = check(&with_kafka(
        "allow_weaker_delivery: true, config: { acks: 1, enable.idempotence: false, message.timeout.ms: 30000 }",
    ));
    assert_eq!(code, Some(0), "the opt-out: {stderr}");
}

#[test]
fn an_expression_that_does_not_compile_exits_2_with_its_field_and_position() {
    let config = "mqtt: { host: 192.0.2.1, client_id: c }\nkafka: { bootstrap_servers: \"192.0.2.1:9092\" }\nrules:\n\
                  \x20 - name: r\n    mqtt: { topics: [\"plant/+\"] }\n    filter: \"json.temp >\"\n\
                  \x20   kafka:\n      topic_expression: \"'t.' + lvls[1]\"\n      key: { expression: \"lower(topic)\" }\n\
                  \x20   payload: { transform: \"json.items.map(x, json.items)\" }\n";
    let (code, stderr) = check(config);
    assert_eq!(code, Some(2), "{stderr}");
    for expected in [
        "rules[0].filter: does not compile: Syntax error",
        "(at line 1, column 12)",
        "rules[0].kafka.topic_expression: does not compile: undeclared reference \"lvls\"",
        "(at line 1, column 8)",
        "rules[0].kafka.key.expression: does not compile: undeclared function \"lower\"",
        "rules[0].payload.transform: does not compile: \"json\" inside a comprehension",
    ] {
        assert!(
            stderr.contains(expected),
            "missing {expected:?} in:\n{stderr}"
        );
    }
}

#[test]
fn a_property_librdkafka_refuses_exits_2_naming_it() {
    let (code, stderr) = check(&with_kafka("config: { lingr.ms: 5 }"));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains(
            "kafka.config.lingr.ms: librdkafka refuses it: No such configuration property"
        ),
        "{stderr}"
    );
    let (code, stderr) = check(&with_kafka("config: { linger.ms: soon }"));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("kafka.config.linger.ms: librdkafka refuses it"),
        "{stderr}"
    );
}

#[test]
fn settings_librdkafka_refuses_only_when_creating_a_producer_exit_2_naming_them() {
    for (setting, property, says) in [
        (
            "max.in.flight.requests.per.connection: 6",
            "max.in.flight.requests.per.connection",
            "`max.in.flight` must be set <= 5 when `enable.idempotence` is true",
        ),
        (
            "retries: 0",
            "retries",
            "`retries` must be set >= 1 when `enable.idempotence` is true",
        ),
        (
            "queue.buffering.backpressure.threshold: 2",
            "queue.buffering.backpressure.threshold",
            "`queue.buffering.backpressure.threshold` must be set to 1 when `enable.idempotence` is true",
        ),
    ] {
        let (code, stderr) = check(&with_kafka(&format!("config: {{ {setting} }}")));
        assert_eq!(code, Some(2), "{setting}: {stderr}");
        let expected =
            format!("kafka.config.{property}: librdkafka refuses to create a producer with it");
        assert!(
            stderr.contains(&expected) && stderr.contains(says),
            "missing {expected:?} and {says:?} in:\n{stderr}"
        );
    }
}

#[test]
fn no_env_substitution_reads_the_file_as_written_and_the_client_id_from_the_command_line() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("config.yaml");
    std::fs::write(
        &path,
        "mqtt: { host: 192.0.2.1, client_id: from-file }
kafka: { bootstrap_servers: \"192.0.2.1:9092\" }
\
         rules:\n  - name: r\n    mqtt: { topics: [\"c/${FERRY_TEST_TENANT_X}/x\"] }\n    kafka: { topic: t }\n",
    )
    .expect("write");
    let check = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_ferry-forwarder"))
            .arg("--check")
            .arg("--config")
            .arg(&path)
            .args(args)
            .env_remove("FERRY_TEST_TENANT_X")
            .output()
            .expect("run");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, stderr) = check(&[]);
    assert_eq!(code, Some(2), "a template by default: {stderr}");
    assert!(stderr.contains("${FERRY_TEST_TENANT_X}"), "{stderr}");
    let (code, stderr) = check(&["--no-env-substitution", "--mqtt-client-id", "ferry.ns.p-0"]);
    assert_eq!(code, Some(0), "{stderr}");
    let (code, stderr) = check(&["--no-env-substitution", "--mqtt-client-id", ""]);
    assert_eq!(
        code,
        Some(2),
        "the command line's id is validated: {stderr}"
    );
    assert!(stderr.contains("mqtt.client_id"), "{stderr}");
}

#[test]
fn shipped_examples_are_valid() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/");
    for file in [
        "forwarder.yaml",
        "forwarder-secure.yaml",
        "legacy-config.yaml",
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_ferry-forwarder"))
            .arg("--check")
            .arg("--config")
            .arg(format!("{root}{file}"))
            // The secure example takes its secrets from the environment, as documented.
            .env("MQTT_PASSWORD", "example")
            .env("KAFKA_PASSWORD", "example")
            .output()
            .expect("run");
        assert_eq!(
            out.status.code(),
            Some(0),
            "{file}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn log_format_and_level_come_from_the_config() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("config.yaml");
    let mqtt_port = ferry_e2e::free_port().expect("port");
    let http_port = ferry_e2e::free_port().expect("port");
    // Nothing listens on the MQTT port: the forwarder keeps retrying and logs each attempt at
    // debug level.
    std::fs::write(
        &path,
        format!(
            "mqtt: {{ host: 127.0.0.1, port: {mqtt_port}, client_id: c, reconnect_max_ms: 200 }}\n\
             kafka: {{ bootstrap_servers: \"127.0.0.1:1\" }}\n\
             http: {{ listen: \"127.0.0.1:{http_port}\" }}\n\
             log: {{ format: json, level: debug }}\n\
             rules:\n  - name: r\n    mqtt: {{ topics: [\"a/#\"] }}\n    kafka: {{ topic: t }}\n"
        ),
    )
    .expect("write");
    let child = Command::new(env!("CARGO_BIN_EXE_ferry-forwarder"))
        .arg("--config")
        .arg(&path)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run");
    std::thread::sleep(std::time::Duration::from_millis(1500));
    // SAFETY: kill(2) on our own child.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let out = child.wait_with_output().expect("wait");
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Flat: the message and the event's own fields at the top level, nothing nested.
    let lines = ferry_e2e::flat_json_log(stderr.lines().filter(|l| !l.trim().is_empty()))
        .unwrap_or_else(|e| panic!("{e:#}\n{stderr}"));
    assert!(
        lines
            .iter()
            .any(|l| l["level"] == "DEBUG" && l["message"] == "mqtt connect failed; retrying"),
        "{stderr}"
    );
    let started = lines
        .iter()
        .find(|l| l["message"] == "forwarder started")
        .unwrap_or_else(|| panic!("{stderr}"));
    assert_eq!(started["level"], "INFO");
    assert_eq!(started["target"], "ferry_forwarder");
    assert!(started["timestamp"].is_string(), "{started}");
    assert_eq!(started["client_id"], "c");
    assert_eq!(started["rules"], 1);
}

#[test]
fn a_bad_log_level_is_a_config_error() {
    let (code, stderr) = run_with_config(
        "mqtt: { host: h, client_id: c }\nkafka: { bootstrap_servers: \"k:9092\" }\nlog: { level: \"info,[\" }\n\
         rules:\n  - name: r\n    mqtt: { topics: [\"a/#\"] }\n    kafka: { topic: t }\n",
    );
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("log.level"), "{stderr}");
}

/// Issue 21's 281-byte filter (nine nested `all` over ten literals: 10^9 evaluations of its
/// body) is refused by `--check`, naming the field, the estimate and the budget; one that fits
/// beside it in the same config passes once the other is removed.
#[test]
fn check_refuses_an_expression_over_its_cost_budget() {
    let nested = (0..9).fold("topic != ''".to_owned(), |e, i| {
        format!("[0,1,2,3,4,5,6,7,8,9].all(v{i}, {e})")
    });
    let rule = |name: &str, filter: &str| {
        format!(
            "  - name: {name}\n    mqtt: {{ topics: [t/{name}] }}\n    filter: \"{filter}\"\n    kafka: {{ topic: {name} }}\n"
        )
    };
    let head = "mqtt: { host: 192.0.2.1, client_id: c }\nkafka: { bootstrap_servers: \"192.0.2.1:9092\" }\nrules:\n";
    let fits = rule("fits", "json.items.map(x, x > 0, x * 2).size() > 0");
    let (code, stderr) = check(&format!("{head}{fits}{}", rule("hostile", &nested)));
    assert_eq!(code, Some(2), "{stderr}");
    let budget = ferry_api::expr::COST_BUDGET;
    assert!(
        stderr.contains("rules[1].filter: does not compile: one evaluation may cost an estimated"),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!("over the budget of {budget}")),
        "{stderr}"
    );
    assert!(
        !stderr.contains("rules[0]"),
        "the rule that fits is not named: {stderr}"
    );
    let (code, stderr) = check(&format!("{head}{fits}"));
    assert_eq!(code, Some(0), "{stderr}");
}

/// What `--check` refuses that used to pass and then fail later: session settings that lose
/// messages, a random partitioner (without the opt-outs), a `matches` pattern that is no
/// regular expression, a filter that can never be a bool, and a drain bound that overflowed
/// the clock on SIGTERM; each named by its field.
#[test]
fn settings_that_fail_later_or_weaken_delivery_exit_2_at_check() {
    let config = "mqtt: { host: 192.0.2.1, client_id: c, protocol: 5, session_expiry_secs: 0 }\n\
                  kafka: { bootstrap_servers: \"192.0.2.1:9092\", config: { partitioner: random } }\n\
                  shutdown_timeout_secs: 18446744073709551615\n\
                  rules:\n\
                  \x20 - name: r\n    mqtt: { topics: [\"plant/+\"] }\n    filter: \"topic + '/x'\"\n    kafka: { topic: t }\n\
                  \x20 - name: s\n    mqtt: { topics: [\"plant/+\"] }\n    filter: \"topic.matches('(+')\"\n    kafka: { topic: t }\n";
    let (code, stderr) = check(config);
    assert_eq!(code, Some(2), "{stderr}");
    for expected in [
        "mqtt.session_expiry_secs: 0 weakens the delivery guarantee",
        "set mqtt.allow_weaker_delivery: true to accept that",
        "kafka.config.partitioner: \"random\" weakens the delivery guarantee",
        "shutdown_timeout_secs: 18446744073709551615 is over the bound of 86400 (a day)",
        "rules[0].filter: does not compile: returns a string, never a bool",
        "rules[1].filter: does not compile: matches' pattern \"(+\" is not a valid regular expression: repetition operator missing expression",
    ] {
        assert!(
            stderr.contains(expected),
            "missing {expected:?} in:\n{stderr}"
        );
    }
    let clean = "mqtt: { host: 192.0.2.1, client_id: c, clean_session: true }\n\
                 kafka: { bootstrap_servers: \"192.0.2.1:9092\" }\n\
                 rules:\n  - name: r\n    mqtt: { topics: [t] }\n    kafka: { topic: t }\n";
    let (code, stderr) = check(clean);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("mqtt.clean_session: true weakens the delivery guarantee"),
        "{stderr}"
    );
    let allowed = clean.replace(
        "clean_session: true",
        "clean_session: true, allow_weaker_delivery: true",
    );
    let (code, stderr) = check(&allowed);
    assert_eq!(code, Some(0), "the opt-out: {stderr}");
}

/// What `--check` can see of a schema-encoded value without reaching the registry.
#[test]
fn check_refuses_a_schema_encoding_it_can_judge_offline() {
    let rules = "rules:\n  - name: r\n    mqtt: { topics: [t] }\n    kafka: { topic: t, value: { format: avro, subject: t-value } }\n  - name: s\n    mqtt: { topics: [u] }\n    kafka: { topic: u, value: { format: json_schema, subject: \"\", message: a.B } }\n    payload: wrapped_json\n";
    let base = "mqtt: { host: 192.0.2.1, client_id: c }\nkafka: { bootstrap_servers: \"192.0.2.1:9092\" }\n";
    let (code, stderr) = check(&format!("{base}{rules}"));
    assert_eq!(code, Some(2), "{stderr}");
    for expected in [
        "rules[0].kafka.value: encodes through a schema registry, and none is configured",
        "rules[1].kafka.value.subject: must not be empty",
        "rules[1].kafka.value.message: names a Protobuf message",
        "rules[1].payload: wrapped_json is Ferry's own JSON envelope",
        "rules[0].dead_letter: must be set (or the top-level dead_letter, or on_unwritable: drop) when kafka.value is set",
    ] {
        assert!(
            stderr.contains(expected),
            "missing {expected:?} in:\n{stderr}"
        );
    }
    let registry = "schema_registry: { url: \"https://registry:8081\", basic_auth: { username: u, password_file: /nonexistent/registry-password } }\n";
    let (code, stderr) = check(&format!(
        "{base}dead_letter: {{ topic: dlq }}\n{registry}{}",
        &rules[..rules.find("  - name: s").unwrap_or(rules.len())]
    ));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains(
            "schema_registry.basic_auth.password_file: cannot read /nonexistent/registry-password"
        ),
        "{stderr}"
    );
}
