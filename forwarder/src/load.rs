//! The one way the forwarder reads its config file: at start, with `--check` and on every
//! reload. ferry-api's loader (with or without `${VAR}` substitution, the command line's client
//! id), then what librdkafka refuses, including what it checks only when it creates a
//! producer, then the command line's `--http-listen`.

use std::net::SocketAddr;

use ferry_api::config::ConfigError;
use ferry_api::{LoadOptions, Loaded};
use ferry_kafka_settings::config_problem;

/// What the command line says about reading the config.
#[derive(Debug, Clone, Default)]
pub struct LoadSettings {
    /// Substitute `${VAR}` from the environment (a standalone file's feature). Off for a
    /// config rendered by the operator: there `${` is part of a rule's filter or a librdkafka
    /// value, and means just that.
    pub substitute_env: bool,
    /// Replaces `mqtt.client_id` (one rendered config serves every pod of a group).
    pub mqtt_client_id: Option<String>,
    /// Replaces `http.listen`.
    pub http_listen: Option<SocketAddr>,
}

/// Loads and validates `text` as `settings` say; every problem is named by its field.
pub fn load(text: &str, settings: &LoadSettings) -> Result<Loaded, ConfigError> {
    let lookup = |name: &str| std::env::var(name).ok();
    let options = LoadOptions {
        variables: settings
            .substitute_env
            .then_some(&lookup as ferry_api::load::LookupEnv<'_>),
        mqtt_client_id: settings.mqtt_client_id.clone(),
    };
    let mut loaded = ferry_api::load_with(text, &options, |path| std::fs::read(path))?;
    if let Some(problem) = config_problem(&loaded.config.kafka) {
        return Err(ConfigError::Invalid(vec![problem]));
    }
    if let Some(addr) = settings.http_listen {
        loaded.config.set_http_listen(addr);
    }
    Ok(loaded)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG: &str = "mqtt: { host: h, client_id: from-file }\nkafka: { bootstrap_servers: \"k:9092\", config: { client.rack: \"${FERRY_TEST_UNSET_RACK}\" } }\nrules:\n  - name: r\n    mqtt: { topics: [\"c/${HOME}/x\"] }\n    kafka: { topic: t }\n";

    #[test]
    fn without_substitution_the_file_means_what_it_says() {
        let settings = LoadSettings {
            mqtt_client_id: Some("ferry.ns.pod-0".into()),
            ..LoadSettings::default()
        };
        let loaded = load(CONFIG, &settings).expect("loads as written");
        assert_eq!(loaded.config.rules[0].mqtt.topics, ["c/${HOME}/x"]);
        assert_eq!(loaded.config.mqtt.client_id, "ferry.ns.pod-0");
        let substituted = LoadSettings {
            substitute_env: true,
            ..settings
        };
        let Err(ConfigError::Invalid(problems)) = load(CONFIG, &substituted) else {
            panic!("an unset variable is refused when substituting");
        };
        assert_eq!(problems[0].path, "${FERRY_TEST_UNSET_RACK}");
    }

    #[test]
    fn what_librdkafka_refuses_at_producer_creation_is_a_config_problem() {
        let text = CONFIG.replace(
            "client.rack: \"${FERRY_TEST_UNSET_RACK}\"",
            "retries: \"0\"",
        );
        let Err(ConfigError::Invalid(problems)) = load(&text, &LoadSettings::default()) else {
            panic!("retries 0 with idempotence is refused");
        };
        assert_eq!(problems[0].path, "kafka.config.retries");
    }
}
