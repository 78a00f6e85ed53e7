//! Credentials read from files (`username_file`, `password_file`), after the config is parsed.
//!
//! `${VAR}` is substituted into the config *text*, so a value holding `: `, ` #`, a quote or a
//! newline changes what the YAML means. A file's bytes never pass through a parser: the operator
//! mounts its Secret as files and renders only their paths, so a password may hold any
//! character. The file is read exactly as it is; a trailing newline is part of the value.

use std::path::Path;

use crate::config::{ForwarderConfig, Problem, Secret};

/// Fills `username`/`password` from their `*_file`s; returns every problem (a value set both
/// inline and by file, an unreadable, empty or non-UTF-8 file), each naming its field.
pub fn read_files(
    config: &mut ForwarderConfig,
    read: &dyn Fn(&Path) -> std::io::Result<Vec<u8>>,
) -> Vec<Problem> {
    let mut problems = Vec::new();
    let mut source = |field: &str, inline_set: bool, file: Option<&str>| {
        let file = file?;
        if inline_set {
            let inline = field.trim_end_matches("_file");
            problems.push(problem(
                field,
                format!("set either {inline} or {field}, not both"),
            ));
            return None;
        }
        match read_one(file, read) {
            Ok(value) => Some(value),
            Err(message) => {
                problems.push(problem(field, message));
                None
            }
        }
    };
    let m = &mut config.mqtt;
    if let Some(v) = source(
        "mqtt.username_file",
        m.username.is_some(),
        m.username_file.as_deref(),
    ) {
        m.username = Some(v);
    }
    if let Some(v) = source(
        "mqtt.password_file",
        m.password.is_some(),
        m.password_file.as_deref(),
    ) {
        m.password = Some(Secret(v));
    }
    // A username and a password, each inline or from a file, as SASL and basic auth have.
    let mut pair = |at: &str,
                    username: &mut String,
                    user_file: Option<&str>,
                    password: &mut Secret,
                    password_file: Option<&str>| {
        let field = format!("{at}.username_file");
        if let Some(v) = source(&field, !username.is_empty(), user_file) {
            *username = v;
        }
        let field = format!("{at}.password_file");
        if let Some(v) = source(&field, !password.is_empty(), password_file) {
            *password = Secret(v);
        }
    };
    if let Some(s) = &mut config.kafka.sasl {
        let (user_file, password_file) = (s.username_file.clone(), s.password_file.clone());
        pair(
            "kafka.sasl",
            &mut s.username,
            user_file.as_deref(),
            &mut s.password,
            password_file.as_deref(),
        );
    }
    let auth = config
        .schema_registry
        .as_mut()
        .and_then(|r| r.basic_auth.as_mut());
    if let Some(a) = auth {
        let (user_file, password_file) = (a.username_file.clone(), a.password_file.clone());
        pair(
            "schema_registry.basic_auth",
            &mut a.username,
            user_file.as_deref(),
            &mut a.password,
            password_file.as_deref(),
        );
    }
    problems
}

/// The file's text; the error names the path and what is wrong, never the content.
fn read_one(
    path: &str,
    read: &dyn Fn(&Path) -> std::io::Result<Vec<u8>>,
) -> Result<String, String> {
    let bytes = read(Path::new(path)).map_err(|e| format!("cannot read {path}: {e}"))?;
    if bytes.is_empty() {
        return Err(format!("{path} is empty"));
    }
    String::from_utf8(bytes).map_err(|_| format!("{path} is not UTF-8 text"))
}

fn problem(path: &str, message: String) -> Problem {
    Problem::new(path, message)
}
