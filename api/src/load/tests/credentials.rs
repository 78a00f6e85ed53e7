//! Credentials read from files (`username_file`, `password_file`).

use std::collections::BTreeMap;
use std::io;

use crate::config::ConfigError;
use crate::load::load_str_reading;

/// Every character that means something in YAML (and a newline, and a trailing space).
const NASTY: &str = "p: a #b 'c\" {d} [e] *f &g !h |i >j %k @l `m ,n ?o -\n${P} ";

const CONFIG: &str = "mqtt:
  host: localhost
  client_id: ferry-1
  username_file: /run/creds/mqtt-user
  password_file: /run/creds/mqtt-pass
kafka:
  bootstrap_servers: localhost:9092
  sasl: { mechanism: SCRAM-SHA-512, username_file: /run/creds/k-user, password_file: /run/creds/k-pass }
rules:
  - name: r
    mqtt: { topics: [a/#] }
    kafka: { topic: t }
";

fn files(entries: &[(&str, &[u8])]) -> impl Fn(&std::path::Path) -> io::Result<Vec<u8>> + use<> {
    let map: BTreeMap<String, Vec<u8>> = entries
        .iter()
        .map(|(k, v)| ((*k).to_owned(), v.to_vec()))
        .collect();
    move |path| {
        map.get(path.to_str().unwrap_or_default())
            .cloned()
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))
    }
}

fn problems(text: &str, read: impl Fn(&std::path::Path) -> io::Result<Vec<u8>>) -> Vec<String> {
    match load_str_reading(text, |_| None, read) {
        Ok(_) => Vec::new(),
        Err(ConfigError::Invalid(p)) => p.iter().map(ToString::to_string).collect(),
        Err(e) => panic!("unexpected error: {e}"),
    }
}

#[test]
fn file_contents_are_taken_byte_for_byte() {
    let read = files(&[
        ("/run/creds/mqtt-user", b"ferry: user\n"),
        ("/run/creds/mqtt-pass", NASTY.as_bytes()),
        ("/run/creds/k-user", b"k"),
        ("/run/creds/k-pass", NASTY.as_bytes()),
    ]);
    let loaded = load_str_reading(CONFIG, |_| Some("EXPANDED".into()), read).unwrap();
    let c = loaded.config.into_inner();
    assert_eq!(c.mqtt.username.as_deref(), Some("ferry: user\n"));
    assert_eq!(c.mqtt.password.as_ref().map(|p| p.expose()), Some(NASTY));
    let sasl = c.kafka.sasl.unwrap();
    assert_eq!(
        (sasl.username.as_str(), sasl.password.expose()),
        ("k", NASTY)
    );
}

#[test]
fn each_file_problem_names_its_field_and_path_but_not_the_content() {
    let read = files(&[
        ("/run/creds/mqtt-user", b""),
        ("/run/creds/k-user", b"\xff\xfe"),
        ("/run/creds/k-pass", NASTY.as_bytes()),
    ]);
    let got = problems(CONFIG, read);
    assert_eq!(
        got,
        [
            "mqtt.username_file: /run/creds/mqtt-user is empty",
            "mqtt.password_file: cannot read /run/creds/mqtt-pass: entity not found",
            "kafka.sasl.username_file: /run/creds/k-user is not UTF-8 text",
        ]
    );
}

#[test]
fn a_value_set_inline_and_by_file_is_refused() {
    let text = CONFIG
        .replace(
            "username_file: /run/creds/mqtt-user",
            "username: u\n  username_file: /x",
        )
        .replace(
            "password_file: /run/creds/k-pass",
            "password: p, password_file: /y",
        );
    let got = problems(&text, files(&[]));
    assert!(
        got.contains(
            &"mqtt.username_file: set either mqtt.username or mqtt.username_file, not both"
                .to_owned()
        ),
        "{got:?}"
    );
    assert!(
        got.contains(&"kafka.sasl.password_file: set either kafka.sasl.password or kafka.sasl.password_file, not both".to_owned()),
        "{got:?}"
    );
}

#[test]
fn inline_credentials_still_work_and_sasl_needs_one_or_the_other() {
    let text = CONFIG.replace(
        "username_file: /run/creds/k-user, password_file: /run/creds/k-pass",
        "username: k, password: p",
    );
    let read = files(&[
        ("/run/creds/mqtt-user", b"u"),
        ("/run/creds/mqtt-pass", b"p"),
    ]);
    assert_eq!(problems(&text, read), Vec::<String>::new());
    let text = CONFIG.replace(
        "username_file: /run/creds/k-user, password_file: /run/creds/k-pass",
        "username: k",
    );
    let read = files(&[
        ("/run/creds/mqtt-user", b"u"),
        ("/run/creds/mqtt-pass", b"p"),
    ]);
    assert_eq!(
        problems(&text, read),
        ["kafka.sasl.password: must not be empty (set password or password_file)"]
    );
}
