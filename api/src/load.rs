//! Reading a config file: `${VAR}` substitution (unless the caller turns it off), format detection, parsing, credential files,
//! then validation. Two input formats are accepted:
//! - Ferry's own (top-level `rules`), documented in docs/configuration.md;
//! - the replaced forwarder's `config.yaml` (top-level `forwarding`), unchanged (see
//!   `legacy.rs`).
//!
//! Both become one [`ValidConfig`]. Loading never stops at the first problem: every invalid
//! field is reported with its path.

use std::collections::BTreeMap;
use std::path::Path;

use crate::config::{ConfigError, ForwarderConfig, Problem};
use crate::credentials;
use crate::env::{self, Substituted};
use crate::kafka_props;
use crate::legacy::LegacyConfig;
use crate::validate::ValidConfig;

/// Which input format a file was written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceFormat {
    Ferry,
    /// The replaced forwarder's `config.yaml`.
    Legacy,
}

/// A loaded, validated config, and what the loader noticed along the way.
#[derive(Debug)]
pub struct Loaded {
    pub config: ValidConfig,
    pub format: SourceFormat,
    /// Non-fatal notes for the log (e.g. unset variables in a legacy file).
    pub warnings: Vec<String>,
}

/// Resolves `${NAME}`: the value, or `None` when it is not set.
pub type LookupEnv<'a> = &'a dyn Fn(&str) -> Option<String>;

/// How a load treats `${NAME}` in the text, and what it takes from outside the file.
pub struct LoadOptions<'a> {
    /// `Some(lookup)`: `${NAME}` is replaced from `lookup` before parsing (a standalone file's
    /// feature, kept from the replaced forwarder). `None`: the text means what it says: a
    /// config rendered from user data (the operator's), where `${` is two characters of a
    /// filter, a header prefix or a librdkafka value, not a variable.
    pub variables: Option<LookupEnv<'a>>,
    /// Replaces `mqtt.client_id`, and is validated as if the file held it (the command line's
    /// `--mqtt-client-id`: one rendered config serves every pod, each with its own id).
    pub mqtt_client_id: Option<String>,
}

/// Parses and validates config text. `lookup_env` resolves `${VAR}`; credential files
/// (`*_file`) are read from the file system.
pub fn load_str(
    text: &str,
    lookup_env: impl Fn(&str) -> Option<String>,
) -> Result<Loaded, ConfigError> {
    load_str_reading(text, lookup_env, |path| std::fs::read(path))
}

/// [`load_str`] with credential files read by `read_file`.
pub fn load_str_reading(
    text: &str,
    lookup_env: impl Fn(&str) -> Option<String>,
    read_file: impl Fn(&Path) -> std::io::Result<Vec<u8>>,
) -> Result<Loaded, ConfigError> {
    let options = LoadOptions {
        variables: Some(&lookup_env),
        mqtt_client_id: None,
    };
    load_with(text, &options, read_file)
}

/// Parses and validates config text as `options` say, credential files read by `read_file`.
pub fn load_with(
    text: &str,
    options: &LoadOptions<'_>,
    read_file: impl Fn(&Path) -> std::io::Result<Vec<u8>>,
) -> Result<Loaded, ConfigError> {
    let substituted = match options.variables {
        Some(lookup) => env::substitute(text, lookup),
        None => Substituted {
            text: text.to_owned(),
            missing: Vec::new(),
        },
    };
    let format = detect_format(&substituted.text)?;
    let mut warnings = Vec::new();
    let mut config = match format {
        SourceFormat::Ferry => {
            if !substituted.missing.is_empty() {
                return Err(ConfigError::Invalid(missing_env_problems(
                    &substituted.missing,
                )));
            }
            parse::<ForwarderConfig>(&substituted.text)?
        }
        SourceFormat::Legacy => load_legacy(&substituted, &mut warnings)?,
    };
    if let Some(id) = &options.mqtt_client_id {
        config.mqtt.client_id.clone_from(id);
    }
    // Credential problems come first, then validation's: both are listed in one error.
    let mut problems = credentials::read_files(&mut config, &read_file);
    match ValidConfig::new(config) {
        Ok(config) if problems.is_empty() => Ok(Loaded {
            config,
            format,
            warnings,
        }),
        Ok(_) => Err(ConfigError::Invalid(problems)),
        Err(invalid) => {
            problems.extend(invalid);
            Err(ConfigError::Invalid(problems))
        }
    }
}

/// A legacy file, mapped to Ferry's config; what it accepts that Ferry's format would not goes
/// into `warnings`.
fn load_legacy(
    substituted: &Substituted,
    warnings: &mut Vec<String>,
) -> Result<ForwarderConfig, ConfigError> {
    // The replaced forwarder substituted unset variables with "" silently; keep accepting such
    // files, but say so.
    for name in &substituted.missing {
        warnings.push(format!(
            "environment variable {name} is not set; substituted an empty string"
        ));
    }
    let mut config = parse::<LegacyConfig>(&substituted.text)?.into_ferry();
    // The replaced forwarder's files are accepted unchanged, so settings that weaken the
    // guarantee are allowed there, and said loudly.
    config.kafka.allow_weaker_delivery = true;
    if config.mqtt.clean_session {
        config.mqtt.allow_weaker_delivery = true;
        warnings.push(
            "mqtt.client_id is empty, so the session is clean: messages published while the forwarder is away, or received and not yet acknowledged, are lost; set a client_id for a persistent session".to_owned(),
        );
    }
    for (key, value) in &config.kafka.config {
        if let Some(w) = kafka_props::weakens(key, value) {
            warnings.push(format!(
                "kafka.config.{key}: {value:?} weakens the delivery guarantee ({}); Ferry's default is {}",
                w.why, w.expected
            ));
        }
    }
    Ok(config)
}

fn missing_env_problems(missing: &[String]) -> Vec<Problem> {
    missing
        .iter()
        .map(|name| {
            Problem::new(
                format!("${{{name}}}"),
                "environment variable is not set (use ${NAME:-default} for a default)",
            )
        })
        .collect()
}

fn detect_format(text: &str) -> Result<SourceFormat, ConfigError> {
    let top: BTreeMap<String, serde::de::IgnoredAny> =
        serde_saphyr::from_str(text).map_err(|e| ConfigError::Syntax(e.to_string()))?;
    match (top.contains_key("rules"), top.contains_key("forwarding")) {
        (true, true) => Err(ConfigError::Invalid(vec![Problem::new(
            "forwarding",
            "a config has either `rules` (Ferry format) or `forwarding` (legacy format), not both",
        )])),
        (false, true) => Ok(SourceFormat::Legacy),
        _ => Ok(SourceFormat::Ferry),
    }
}

fn parse<T: serde::de::DeserializeOwned>(text: &str) -> Result<T, ConfigError> {
    let mut at: Option<(String, String)> = None;
    let result = serde_saphyr::with_deserializer_from_str(text, |de| {
        serde_path_to_error::deserialize::<_, T>(de).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            at = Some((path, inner.to_string()));
            inner
        })
    });
    match result {
        Ok(v) => Ok(v),
        Err(e) => match at {
            // A type or shape error at a known field: report it like a validation problem.
            Some((path, message)) if path != "." && !path.is_empty() => Err(ConfigError::Invalid(
                vec![Problem::new(path, first_line(&message))],
            )),
            _ => Err(ConfigError::Syntax(first_line(&e.to_string()))),
        },
    }
}

fn first_line(s: &str) -> String {
    s.lines().next().unwrap_or_default().trim().to_owned()
}

#[cfg(test)]
mod tests;
