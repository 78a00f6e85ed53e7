//! Build, the pure step of reconciling: a group of rules (one connection, one group name)
//! becomes the forwarder config its pods run. No I/O; unit-tested from YAML fixtures.
//!
//! Secrets never enter the config: credentials and certificates are files mounted from the
//! group's Secret, and the config holds only their paths. Credentials are never substituted into
//! the config text, where a password holding `: ` or a newline would change the YAML.

use std::collections::BTreeMap;

use ferry_api::config::{
    BasicAuth, DeadLetter, DrainOnShutdown, ForwarderConfig, Headers, HttpConfig, KafkaConfig,
    KeyStrategy, LogConfig, LogFormat, MqttConfig, MqttProtocol, OnUnwritable, PayloadFormat, Rule,
    RuleKafka, RuleMqtt, Sasl, SchemaFormat, SchemaRegistry, Secret, Tls, ValueEncoding,
};
use ferry_api::crd::{
    self, BrokerConnection, ForwardingRule, GroupReplicas, MqttProtocolVersion, Payload, TlsRefs,
};
use ferry_api::defaults;
use kube::ResourceExt;
use sha2::{Digest, Sha256};

use crate::sessions::{SessionPrefix, client_id};

/// Where the group's Secret is mounted in the forwarder pods.
pub const MQTT_TLS_DIR: &str = "/etc/ferry/mqtt-tls";
pub const KAFKA_TLS_DIR: &str = "/etc/ferry/kafka-tls";
pub const REGISTRY_TLS_DIR: &str = "/etc/ferry/registry-tls";
/// The credentials, one file per key of the group's Secret (`mqtt-password`, ...).
pub const CREDENTIALS_DIR: &str = "/etc/ferry/credentials";
/// Environment variables the pod template sets from the downward API, for its arguments'
/// `$(VAR)` (Kubernetes expands them; the forwarder's config is read as written).
pub const ENV_POD_NAME: &str = "POD_NAME";
pub const ENV_POD_NAMESPACE: &str = "POD_NAMESPACE";
/// Keys of the group's Secret, filled by the dereference step from the referenced Secrets.
pub mod keys {
    pub const MQTT_USERNAME: &str = "mqtt-username";
    pub const MQTT_PASSWORD: &str = "mqtt-password";
    pub const KAFKA_USERNAME: &str = "kafka-username";
    pub const KAFKA_PASSWORD: &str = "kafka-password";
    pub const MQTT_CA: &str = "mqtt-ca.crt";
    pub const MQTT_CERT: &str = "mqtt-tls.crt";
    pub const MQTT_KEY: &str = "mqtt-tls.key";
    pub const KAFKA_CA: &str = "kafka-ca.crt";
    pub const KAFKA_CERT: &str = "kafka-tls.crt";
    pub const KAFKA_KEY: &str = "kafka-tls.key";
    pub const REGISTRY_USERNAME: &str = "registry-username";
    pub const REGISTRY_PASSWORD: &str = "registry-password";
    pub const REGISTRY_CA: &str = "registry-ca.crt";
    pub const REGISTRY_CERT: &str = "registry-tls.crt";
    pub const REGISTRY_KEY: &str = "registry-tls.key";
}

/// MQTT 5 session expiry of operator-managed forwarders when the connection sets none: long
/// enough to ride out a node outage or a paused group over a night, short enough that a
/// session the operator could not end (see [`crate::sessions`]) does not queue for ever.
pub const DEFAULT_SESSION_EXPIRY_SECS: u32 = 86_400;

/// The forwarder's HTTP port (probes, metrics, `/status`): its config's default, which the
/// rendered config keeps.
pub use ferry_api::defaults::HTTP_PORT;
/// Longest forwarder rule name (it is a metric label).
const MAX_RULE_NAME: usize = 63;

/// One connection's rules of one group name: served by one forwarder StatefulSet.
#[derive(Debug)]
pub struct Group<'a> {
    pub connection: &'a BrokerConnection,
    pub name: &'a str,
    /// The group's rules; paused ones are left out of the config.
    pub rules: Vec<&'a ForwardingRule>,
}

/// What the build step produced for a group.
#[derive(Debug, Clone, PartialEq)]
pub struct Rendered {
    pub workload: String,
    pub config: ForwarderConfig,
    /// The config file the pods mount.
    pub config_yaml: String,
    /// Changes only with the settings a forwarder applies at start; goes on the pod template
    /// so those roll the pods, while rule changes are reloaded live without a restart.
    pub restart_checksum: String,
    /// How the pods name their sessions and the group's shared subscription.
    pub session_prefix: SessionPrefix,
}

#[derive(Debug, thiserror::Error)]
pub enum RenderError {
    #[error("cannot render the forwarder config of group {group}: {reason}")]
    Yaml { group: String, reason: String },
}

/// A group's workload name, distinct for every (connection, group) pair that fits:
/// - `<connection>-<group>` when the group has no `-` and the connection no `--`: the last `-`
///   splits it, and it never holds `--`;
/// - otherwise `<connection>-<group>--<length of the connection>`, which always holds `--` and
///   ends with the split (`plant` + `east-bulk` is `plant-east-bulk--5`, while `plant-east` +
///   `bulk` stays `plant-east-bulk`);
/// - longer than a StatefulSet name may be (its pods' names, and its `controller-revision-hash`
///   label `<name>-<10 characters>`, must fit in 63): the first characters, `--` and 8 hex
///   characters of SHA-256 over the name, which meets another only by a hash collision.
///
/// Whatever the name, the reconciler never takes over an object it does not own (see
/// [`crate::ownership`]).
pub fn workload_name(connection: &str, group: &str) -> String {
    let name = if group.contains('-') || connection.contains("--") {
        format!("{connection}-{group}--{}", connection.len())
    } else {
        format!("{connection}-{group}")
    };
    if name.len() <= MAX_WORKLOAD_NAME {
        return name;
    }
    let hash = hex(&Sha256::digest(name.as_bytes()));
    let keep = name[..MAX_WORKLOAD_NAME - 10].trim_end_matches(['-', '.']);
    format!("{keep}--{}", &hash[..8])
}

/// Longest StatefulSet name: its `controller-revision-hash` label adds up to 11 characters.
const MAX_WORKLOAD_NAME: usize = 52;

/// A rule's name in the forwarder (a metric label): the ForwardingRule's name, shortened with a
/// hash when longer than 63 characters.
pub fn rule_name(rule: &ForwardingRule) -> String {
    bounded(&rule.name_any(), MAX_RULE_NAME)
}

fn bounded(name: &str, max: usize) -> String {
    if name.len() <= max {
        return name.to_owned();
    }
    let hash = hex(&Sha256::digest(name.as_bytes()))[..8].to_owned();
    let keep = name[..max - 9].trim_end_matches(['-', '.']);
    format!("{keep}-{hash}")
}

/// Where the pods find a credential of the group's Secret.
pub fn credential_file(key: &str) -> String {
    format!("{CREDENTIALS_DIR}/{key}")
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The group's forwarder config, as the pods will read it; paused rules are left out and the
/// others sorted by name, so the output does not depend on listing order.
pub fn render(group: &Group<'_>) -> Result<Rendered, RenderError> {
    let spec = &group.connection.spec;
    let session_prefix = SessionPrefix::of(group.connection);
    let workload = workload_name(&group.connection.name_any(), group.name);
    let mut rules: Vec<&ForwardingRule> = group
        .rules
        .iter()
        .copied()
        .filter(|r| !r.spec.paused)
        .collect();
    rules.sort_by_key(|r| r.name_any());
    let shared_group = session_prefix.shared_group(&workload);
    let replicas = spec.forwarder.replicas_of(group.name);
    // An autoscaler stops pods without asking the operator: each but the first drains on
    // SIGTERM, while the first stays subscribed for the others.
    let drain_on_shutdown = (replicas == GroupReplicas::Autoscaled).then(|| DrainOnShutdown {
        except: vec![client_id(&session_prefix, &format!("{workload}-0"))],
    });
    let encodes = rules.iter().any(|r| r.spec.kafka.value.is_some());
    let config = ForwarderConfig {
        // Shared by two replicas or more, and whenever an autoscaler may add some; one (or
        // none, keeping pod 0's session) subscribes plainly, which Mosquitto restores after a
        // restart. A reload switches live.
        mqtt: mqtt_config(
            &spec.mqtt,
            shared_group,
            match replicas {
                GroupReplicas::Fixed(n) => n > 1,
                GroupReplicas::Autoscaled => true,
            },
        ),
        kafka: kafka_config(&spec.kafka),
        rules: rules.into_iter().map(rule).collect(),
        http: HttpConfig::default(),
        shutdown_timeout_secs: defaults::SHUTDOWN_TIMEOUT_SECS,
        dead_letter: spec.dead_letter.as_ref().map(dead_letter),
        stall_budget_secs: stall_budget(spec.stall_budget_seconds),
        log: LogConfig {
            format: LogFormat::Json,
            ..LogConfig::default()
        },
        drain: Vec::new(),
        revision: 0,
        retiring: Vec::new(),
        drain_on_shutdown,
        // Only where a rule encodes: the other groups neither need nor depend on it.
        schema_registry: spec
            .schema_registry
            .as_ref()
            .filter(|_| encodes)
            .map(schema_registry),
    };
    let config_yaml = serde_saphyr::to_string(&config).map_err(|e| RenderError::Yaml {
        group: workload.clone(),
        reason: e.to_string(),
    })?;
    let restart_checksum = restart_checksum(&config);
    Ok(Rendered {
        workload,
        config,
        config_yaml,
        restart_checksum,
        session_prefix,
    })
}

impl Rendered {
    /// The same config with the revision of `applied` (the config as applied), one more when
    /// the content differs: no two versions a pod may read in turn look the same.
    pub fn revised(mut self, applied: Option<&ForwarderConfig>) -> Result<Self, RenderError> {
        let Some(applied) = applied else {
            return Ok(self);
        };
        let same = ForwarderConfig {
            revision: self.config.revision,
            ..applied.clone()
        } == self.config;
        let revision = if same {
            applied.revision
        } else {
            applied.revision.wrapping_add(1)
        };
        if revision == self.config.revision {
            return Ok(self);
        }
        self.config.revision = revision;
        self.written_again()
    }

    /// The same config with the pods of `client_ids` listed in `drain`, the rules named in
    /// `retiring` listed there (they moved to another group, or were deleted), and subscribing
    /// through `$share` or not (`shared`): what the hand-over decided
    /// ([`crate::handover`]).
    pub fn handing_over(
        mut self,
        client_ids: Vec<String>,
        retiring: Vec<String>,
        shared: bool,
    ) -> Result<Self, RenderError> {
        let mqtt = &self.config.mqtt;
        if self.config.drain == client_ids
            && self.config.retiring == retiring
            && mqtt.subscribe_shared == shared
        {
            return Ok(self);
        }
        self.config.drain = client_ids;
        self.config.retiring = retiring;
        self.config.mqtt.subscribe_shared = shared;
        self.written_again()
    }

    /// `config_yaml` from the changed `config`.
    fn written_again(mut self) -> Result<Self, RenderError> {
        self.config_yaml =
            serde_saphyr::to_string(&self.config).map_err(|e| RenderError::Yaml {
                group: self.workload.clone(),
                reason: e.to_string(),
            })?;
        Ok(self)
    }
}

/// The connection's MQTT side; with `shared`, every replica subscribes as a member of
/// `shared_group`.
fn mqtt_config(m: &crd::MqttEndpoint, shared_group: String, shared: bool) -> MqttConfig {
    // Credential files exist only when the connection references a Secret.
    let credentials = |key| {
        m.credentials_secret_ref
            .as_ref()
            .map(|_| credential_file(key))
    };
    MqttConfig {
        host: m.host.clone(),
        port: u16::try_from(m.port).unwrap_or(defaults::MQTT_PORT),
        protocol: match m.protocol {
            MqttProtocolVersion::V311 => MqttProtocol::V311,
            MqttProtocolVersion::V5 => MqttProtocol::V5,
        },
        // Each pod replaces it with its own (`--mqtt-client-id`, see
        // [`crate::children`]): the config is one file for every replica, and never a
        // template (the pods read it with `--no-env-substitution`, so `${` in a rule means
        // those characters).
        client_id: shared_group.clone(),
        clean_session: false,
        session_expiry_secs: match m.protocol {
            MqttProtocolVersion::V5 => Some(
                m.session_expiry_seconds
                    .map_or(DEFAULT_SESSION_EXPIRY_SECS, |s| {
                        u32::try_from(s).unwrap_or(u32::MAX)
                    }),
            ),
            MqttProtocolVersion::V311 => None,
        },
        shared_group: Some(shared_group),
        subscribe_shared: shared,
        keep_alive_secs: defaults::KEEP_ALIVE_SECS,
        max_inflight: u16::try_from(m.max_inflight).unwrap_or(defaults::MAX_INFLIGHT),
        // A negative size (only past CEL) becomes 0, which validation refuses by name.
        max_inflight_bytes: u64::try_from(m.max_inflight_bytes).unwrap_or(0),
        max_message_bytes: u32::try_from(m.max_message_bytes).unwrap_or(0),
        username: None,
        username_file: credentials(keys::MQTT_USERNAME),
        password: None,
        password_file: credentials(keys::MQTT_PASSWORD),
        tls: m.tls.as_ref().map(|t| tls_files(t, MQTT_TLS_DIR)),
        reconnect_min_ms: defaults::RECONNECT_MIN_MS,
        reconnect_max_ms: defaults::RECONNECT_MAX_MS,
        allow_weaker_delivery: m.allow_weaker_delivery,
    }
}

fn kafka_config(k: &crd::KafkaEndpoint) -> KafkaConfig {
    KafkaConfig {
        bootstrap_servers: k
            .bootstrap_servers
            .iter()
            .map(|s| s.0.as_str())
            .collect::<Vec<_>>()
            .join(","),
        tls: k.tls.as_ref().map(|t| tls_files(t, KAFKA_TLS_DIR)),
        sasl: k.sasl.as_ref().map(|s| Sasl {
            mechanism: s.mechanism,
            username: String::new(),
            username_file: Some(credential_file(keys::KAFKA_USERNAME)),
            password: Secret::default(),
            password_file: Some(credential_file(keys::KAFKA_PASSWORD)),
        }),
        config: k.config.clone(),
        allow_weaker_delivery: k.allow_weaker_delivery,
    }
}

pub fn schema_registry(r: &crd::SchemaRegistryEndpoint) -> SchemaRegistry {
    SchemaRegistry {
        url: r.url.clone(),
        tls: r.tls.as_ref().map(|t| tls_files(t, REGISTRY_TLS_DIR)),
        basic_auth: r.credentials_secret_ref.as_ref().map(|_| BasicAuth {
            username: String::new(),
            username_file: Some(credential_file(keys::REGISTRY_USERNAME)),
            password: Secret::default(),
            password_file: Some(credential_file(keys::REGISTRY_PASSWORD)),
        }),
    }
}

/// The rule's `kafka.value` as the forwarder takes it; `None` without one, or when its subject
/// cannot be derived (validation refuses such a rule before it is rendered).
fn value_encoding(k: &crd::RuleKafka) -> Option<ValueEncoding> {
    let v = k.value.as_ref()?;
    let subject = k.value_subject()?.ok()?;
    Some(ValueEncoding {
        format: match v.format {
            crd::ValueFormatKind::Avro => SchemaFormat::Avro,
            crd::ValueFormatKind::Protobuf => SchemaFormat::Protobuf,
            crd::ValueFormatKind::JsonSchema => SchemaFormat::JsonSchema,
        },
        subject,
        version: v.version.and_then(|n| u32::try_from(n).ok()),
        message: v.message.clone(),
    })
}

fn rule(fr: &ForwardingRule) -> Rule {
    let s = &fr.spec;
    Rule {
        name: rule_name(fr),
        mqtt: RuleMqtt {
            topics: s.mqtt.topics.iter().map(|t| t.0.clone()).collect(),
            qos: u8::try_from(s.mqtt.qos).unwrap_or(defaults::QOS),
            // Over the connection's, validation refuses the rule alone (see
            // `plan::forwarder_refuses`).
            max_message_bytes: s
                .mqtt
                .max_message_bytes
                .map(|b| u32::try_from(b).unwrap_or(0)),
        },
        filter: s.filter.clone(),
        kafka: RuleKafka {
            topic: s.kafka.topic.clone().unwrap_or_default(),
            topic_expression: s.kafka.topic_expression.clone(),
            key: key(&s.kafka.key),
            headers: Headers {
                metadata: s.kafka.headers.metadata,
                user_properties: s.kafka.headers.user_properties,
                prefix: s
                    .kafka
                    .headers
                    .prefix
                    .clone()
                    .unwrap_or_else(|| Headers::default().prefix),
                expressions: s.kafka.headers.expressions.clone(),
            },
            value: value_encoding(&s.kafka),
        },
        payload: match (&s.payload_transform, s.payload) {
            // CEL refuses a transform with wrappedJson; should one get through, the
            // transform wins: it is the more specific setting.
            (Some(transform), _) => PayloadFormat::Transform(transform.clone()),
            (None, Payload::Raw) => PayloadFormat::Raw,
            (None, Payload::WrappedJson) => PayloadFormat::WrappedJson,
        },
        dead_letter: s.dead_letter.as_ref().map(dead_letter),
        on_unwritable: match s.on_unwritable {
            crd::OnUnwritable::Hold => OnUnwritable::Hold,
            crd::OnUnwritable::Drop => OnUnwritable::Drop,
        },
        stall_budget_secs: s.stall_budget_seconds.map(stall_budget),
    }
}

fn dead_letter(d: &crd::DeadLetter) -> DeadLetter {
    DeadLetter {
        topic: d.topic.clone(),
    }
}

/// A `stallBudgetSeconds` in the forwarder's terms. CEL bounds it; one out of its bounds (only
/// past CEL) is refused before it is rendered (see `plan::stall_budget_problem`), and a
/// negative one renders as the longest.
fn stall_budget(seconds: i32) -> u64 {
    u64::try_from(seconds).unwrap_or(u64::MAX)
}

/// A missing `level` or `expression` (CEL requires them) renders as level 0 or an empty
/// expression, which the forwarder's validation then refuses by name.
fn key(k: &crd::Key) -> KeyStrategy {
    match k.strategy {
        crd::KeyStrategy::MqttTopic => KeyStrategy::MqttTopic,
        crd::KeyStrategy::None => KeyStrategy::None,
        crd::KeyStrategy::TopicLevel => {
            KeyStrategy::TopicLevel(usize::try_from(k.level.unwrap_or(0)).unwrap_or(0))
        }
        crd::KeyStrategy::Expression => {
            KeyStrategy::Expression(k.expression.clone().unwrap_or_default())
        }
    }
}

/// The group's Secret holds the certificates under these names.
fn tls_files(t: &TlsRefs, dir: &str) -> Tls {
    Tls {
        ca_file: t.ca_secret_ref.as_ref().map(|_| format!("{dir}/ca.crt")),
        cert_file: t
            .client_cert_secret_ref
            .as_ref()
            .map(|_| format!("{dir}/tls.crt")),
        key_file: t
            .client_cert_secret_ref
            .as_ref()
            .map(|_| format!("{dir}/tls.key")),
    }
}

/// SHA-256 over the settings a running forwarder does not reload (see the forwarder's
/// `reload::restart_required`).
pub fn restart_checksum(config: &ForwarderConfig) -> String {
    let mut parts: BTreeMap<&str, String> = BTreeMap::new();
    // Credentials are file paths here: rotating a Secret rolls the pods through the
    // children's secret checksum instead.
    // How the filters are subscribed changes by a live reload, not a restart.
    let mqtt = MqttConfig {
        subscribe_shared: true,
        ..config.mqtt.clone()
    };
    parts.insert("mqtt", format!("{mqtt:?}"));
    parts.insert("kafka", format!("{:?}", config.kafka));
    parts.insert("http", format!("{:?}", config.http));
    parts.insert("shutdown", config.shutdown_timeout_secs.to_string());
    parts.insert("log.format", format!("{:?}", config.log.format));
    let mut hasher = Sha256::new();
    for (k, v) in parts {
        hasher.update(k.as_bytes());
        hasher.update([0]);
        hasher.update(v.as_bytes());
        hasher.update([0]);
    }
    hex(&hasher.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn connection(yaml: &str) -> BrokerConnection {
        serde_saphyr::from_str(yaml).unwrap_or_else(|e| panic!("{e}\n{yaml}"))
    }

    fn rule_from(yaml: &str) -> ForwardingRule {
        serde_saphyr::from_str(yaml).unwrap_or_else(|e| panic!("{e}\n{yaml}"))
    }

    const CONNECTION: &str = r#"
apiVersion: ferry.dev/v1alpha1
kind: BrokerConnection
metadata: { name: plant, namespace: factory, uid: 0c8e51a7-5b1d-4c2e-9f00-000000000001 }
spec:
  mqtt:
    host: mqtt.factory.svc
    port: 8883
    protocol: "5"
    tls: { caSecretRef: { name: mqtt-ca, key: ca.crt }, clientCertSecretRef: { name: mqtt-client } }
    credentialsSecretRef: { name: mqtt-credentials }
  kafka:
    bootstrapServers: ["kafka-0:9093", "kafka-1:9093"]
    tls: { useSystemRoots: true }
    sasl: { mechanism: SCRAM-SHA-512, credentialsSecretRef: { name: kafka-credentials } }
    config: { linger.ms: "10" }
"#;

    fn rules() -> Vec<ForwardingRule> {
        vec![
            rule_from(
                r#"
apiVersion: ferry.dev/v1alpha1
kind: ForwardingRule
metadata: { name: telemetry, namespace: factory }
spec:
  connectionRef: { name: plant }
  mqtt: { topics: ["plant/+/telemetry"] }
  kafka: { topic: "telemetry.{1}", key: { strategy: topicLevel, level: 1 }, headers: { metadata: true } }
  deadLetter: { topic: telemetry.dlq }
"#,
            ),
            rule_from(
                r#"
apiVersion: ferry.dev/v1alpha1
kind: ForwardingRule
metadata: { name: alarms, namespace: factory }
spec:
  connectionRef: { name: plant }
  mqtt: { topics: ["plant/+/alarm"], qos: 2 }
  kafka: { topic: alarms }
  payload: wrappedJson
"#,
            ),
            rule_from(
                r#"
apiVersion: ferry.dev/v1alpha1
kind: ForwardingRule
metadata: { name: paused-one, namespace: factory }
spec:
  connectionRef: { name: plant }
  paused: true
  mqtt: { topics: ["x/#"] }
  kafka: { topic: x }
"#,
            ),
        ]
    }

    fn render_default(conn: &BrokerConnection, rules: &[ForwardingRule]) -> Rendered {
        render(&Group {
            connection: conn,
            name: "default",
            rules: rules.iter().collect(),
        })
        .expect("render")
    }

    #[test]
    fn a_group_renders_a_valid_forwarder_config_without_secrets() {
        let conn = connection(CONNECTION);
        let r = render_default(&conn, &rules());
        assert_eq!(r.workload, "plant-default");
        let names: Vec<&str> = r.config.rules.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(
            names,
            vec!["alarms", "telemetry"],
            "sorted, paused left out"
        );
        let c = &r.config;
        assert_eq!(
            c.mqtt.client_id, "ferry.factory.0c8e51a7.plant-default",
            "no template: each pod's --mqtt-client-id replaces it"
        );
        assert_eq!(
            c.mqtt.shared_group.as_deref(),
            Some("ferry.factory.0c8e51a7.plant-default"),
            "the connection's identity: a re-created one never joins this share group"
        );
        assert_eq!(c.mqtt.protocol, MqttProtocol::V5);
        assert_eq!(
            c.mqtt.tls.as_ref().and_then(|t| t.key_file.as_deref()),
            Some("/etc/ferry/mqtt-tls/tls.key")
        );
        assert_eq!(c.kafka.bootstrap_servers, "kafka-0:9093,kafka-1:9093");
        assert_eq!(
            c.kafka.tls.as_ref().and_then(|t| t.ca_file.as_deref()),
            None
        );
        assert_eq!(c.rules[1].kafka.key, KeyStrategy::TopicLevel(1));
        assert_eq!(
            c.rules[1].dead_letter.as_ref().map(|d| d.topic.as_str()),
            Some("telemetry.dlq")
        );
        assert_eq!(c.rules[0].payload, PayloadFormat::WrappedJson);
        assert!(
            !r.config_yaml.contains("password:") && !r.config_yaml.contains("username:"),
            "credentials are only file paths:\n{}",
            r.config_yaml
        );

        // What the pod will load: the YAML as written, its own client id from the command
        // line, the credential files mounted from the group's Secret.
        let password = "a: b #c\n'd\"{e}\n";
        let files = |path: &std::path::Path| {
            let key = path
                .strip_prefix(CREDENTIALS_DIR)
                .map_err(std::io::Error::other)?;
            match key.to_str() {
                Some(keys::MQTT_USERNAME | keys::KAFKA_USERNAME) => Ok(b"user".to_vec()),
                Some(keys::MQTT_PASSWORD | keys::KAFKA_PASSWORD) => Ok(password.into()),
                _ => Err(std::io::ErrorKind::NotFound.into()),
            }
        };
        let options = ferry_api::LoadOptions {
            variables: None,
            mqtt_client_id: Some("ferry.factory.0c8e51a7.plant-default-0".to_owned()),
        };
        let loaded = ferry_api::load_with(&r.config_yaml, &options, files).unwrap_or_else(|e| {
            panic!(
                "the forwarder refuses the rendered config: {e}\n{}",
                r.config_yaml
            )
        });
        let c = loaded.config;
        assert_eq!(c.mqtt.client_id, "ferry.factory.0c8e51a7.plant-default-0");
        assert_eq!(c.rules.len(), 2);
        assert_eq!(c.mqtt.password.as_ref().map(Secret::expose), Some(password));
        let sasl = c
            .kafka
            .sasl
            .as_ref()
            .map(|s| (s.username.as_str(), s.password.expose()));
        assert_eq!(sasl, Some(("user", password)));
    }

    #[test]
    fn a_connection_with_sessions_of_the_older_scheme_keeps_their_names() {
        // Recorded by an operator from before `status.sessionPrefix`: the pods keep their
        // sessions and the group its share group, so nothing queued there is left behind.
        let legacy = format!(
            "{CONNECTION}  forwarder: {{ groups: [{{ name: default, autoscaled: true }}] }}\n\
             status: {{ mqttSessions: [ferry.factory.plant-default-0] }}\n"
        );
        let r = render_default(&connection(&legacy), &rules());
        assert_eq!(
            r.config.mqtt.shared_group.as_deref(),
            Some("ferry.factory.plant-default")
        );
        let except = r.config.drain_on_shutdown.map(|d| d.except);
        assert_eq!(
            except,
            Some(vec!["ferry.factory.plant-default-0".to_owned()])
        );
        assert_eq!(r.session_prefix.as_str(), "ferry.factory.");
    }

    #[test]
    fn rule_changes_keep_the_restart_checksum_connection_changes_do_not() {
        let conn = connection(CONNECTION);
        let mut rs = rules();
        let before = render_default(&conn, &rs);
        rs[0].spec.kafka.topic = Some("telemetry.v2.{1}".into());
        rs.pop();
        let after_rules = render_default(&conn, &rs);
        assert_ne!(before.config_yaml, after_rules.config_yaml);
        assert_eq!(
            before.restart_checksum, after_rules.restart_checksum,
            "reloaded live"
        );
        let moved = connection(&CONNECTION.replace("mqtt.factory.svc", "mqtt2.factory.svc"));
        assert_ne!(
            before.restart_checksum,
            render_default(&moved, &rs).restart_checksum,
            "a new broker address rolls the pods"
        );
    }

    #[test]
    fn expressions_render_into_the_forwarder_rule_and_load() {
        let conn = connection(CONNECTION);
        let with_expressions = rule_from(
            r#"
apiVersion: ferry.dev/v1alpha1
kind: ForwardingRule
metadata: { name: hot, namespace: factory }
spec:
  connectionRef: { name: plant }
  mqtt: { topics: ["plant/+/temp"] }
  filter: "json.temp > 50.0"
  kafka:
    topicExpression: "'hot.' + levels[1]"
    key: { strategy: expression, expression: json.device }
    headers: { expressions: { site: "levels[1]" } }
  payloadTransform: "{'t': json.temp}"
"#,
        );
        let r = render_default(&conn, &[with_expressions]);
        let rule = &r.config.rules[0];
        assert_eq!(rule.filter.as_deref(), Some("json.temp > 50.0"));
        assert_eq!(
            rule.kafka.topic, "",
            "unset: the expression names the topic"
        );
        assert_eq!(
            rule.kafka.topic_expression.as_deref(),
            Some("'hot.' + levels[1]")
        );
        assert_eq!(
            rule.kafka.key,
            KeyStrategy::Expression("json.device".into())
        );
        assert_eq!(
            rule.kafka.headers.expressions,
            BTreeMap::from([("site".to_owned(), "levels[1]".to_owned())])
        );
        assert_eq!(
            rule.payload,
            PayloadFormat::Transform("{'t': json.temp}".into())
        );
        assert_eq!(r.config.validate(), [], "{}", r.config_yaml);
        // The YAML the pods read says the same.
        let reread: ForwarderConfig =
            serde_saphyr::from_str(&r.config_yaml).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(reread.rules, r.config.rules);
    }

    #[test]
    fn message_sizes_render_from_the_connection_and_the_rule() {
        let defaults = render_default(&connection(CONNECTION), &rules());
        assert_eq!(
            (
                defaults.config.mqtt.max_inflight_bytes,
                defaults.config.mqtt.max_message_bytes
            ),
            (defaults::MAX_INFLIGHT_BYTES, defaults::MAX_MESSAGE_BYTES),
            "unset: the forwarder's defaults"
        );
        assert!(
            defaults
                .config
                .rules
                .iter()
                .all(|r| r.mqtt.max_message_bytes.is_none())
        );

        let conn = connection(&CONNECTION.replace(
            "    protocol: \"5\"\n",
            "    protocol: \"5\"\n    maxInflightBytes: 67108864\n    maxMessageBytes: 4194304\n",
        ));
        let mut rs = rules();
        rs[1].spec.mqtt.max_message_bytes = Some(2048);
        let r = render_default(&conn, &rs);
        assert_eq!(r.config.mqtt.max_inflight_bytes, 64 * 1024 * 1024);
        assert_eq!(r.config.mqtt.max_message_bytes, 4 * 1024 * 1024);
        let sizes: Vec<(&str, Option<u32>)> = r
            .config
            .rules
            .iter()
            .map(|r| (r.name.as_str(), r.mqtt.max_message_bytes))
            .collect();
        assert_eq!(sizes, [("alarms", Some(2048)), ("telemetry", None)]);
        assert_eq!(r.config.validate(), [], "{}", r.config_yaml);
        let reread: ForwarderConfig =
            serde_saphyr::from_str(&r.config_yaml).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(reread.mqtt, r.config.mqtt);
        assert_eq!(reread.rules, r.config.rules);
        // The window is read at start: a new one rolls the pods (and their memory limit).
        assert_ne!(
            r.restart_checksum,
            render_default(&connection(CONNECTION), &rs).restart_checksum
        );
    }

    #[test]
    fn dead_letter_topics_and_stall_budgets_render_from_the_connection_and_the_rule() {
        let defaults = render_default(&connection(CONNECTION), &rules());
        assert_eq!(defaults.config.dead_letter, None);
        assert_eq!(
            defaults.config.stall_budget_secs,
            defaults::STALL_BUDGET_SECS,
            "unset: the forwarder's default"
        );
        assert!(
            defaults
                .config
                .rules
                .iter()
                .all(|r| r.stall_budget_secs.is_none())
        );

        let conn = connection(&CONNECTION.replace(
            "  kafka:\n",
            "  deadLetter: { topic: ferry.dead-letters }\n  stallBudgetSeconds: 0\n  kafka:\n",
        ));
        let mut rs = rules();
        rs[1].spec.stall_budget_seconds = Some(60);
        let r = render_default(&conn, &rs);
        assert_eq!(
            r.config.dead_letter.as_ref().map(|d| d.topic.as_str()),
            Some("ferry.dead-letters")
        );
        assert_eq!(r.config.stall_budget_secs, 0, "0: as long as it takes");
        let own: Vec<(&str, Option<u64>, Option<&str>)> = r
            .config
            .rules
            .iter()
            .map(|r| {
                let dead_letter = r.dead_letter.as_ref().map(|d| d.topic.as_str());
                (r.name.as_str(), r.stall_budget_secs, dead_letter)
            })
            .collect();
        assert_eq!(
            own,
            [
                ("alarms", Some(60), None),
                ("telemetry", None, Some("telemetry.dlq"))
            ]
        );
        let (alarms, telemetry) = (&r.config.rules[0], &r.config.rules[1]);
        assert_eq!(
            r.config.stall_budget_of(alarms),
            Some(std::time::Duration::from_secs(60))
        );
        assert_eq!(r.config.stall_budget_of(telemetry), None);
        assert_eq!(
            r.config.dead_letter_of(alarms).map(|d| d.topic.as_str()),
            Some("ferry.dead-letters"),
            "the connection's, for a rule without its own"
        );
        assert_eq!(r.config.validate(), [], "{}", r.config_yaml);
        let reread: ForwarderConfig =
            serde_saphyr::from_str(&r.config_yaml).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(reread, r.config);
        // Both are reloaded live: no restart.
        assert_eq!(r.restart_checksum, defaults.restart_checksum);
    }

    #[test]
    fn a_rule_without_expressions_renders_none() {
        let conn = connection(CONNECTION);
        let r = render_default(&conn, &rules());
        for rule in &r.config.rules {
            assert_eq!(rule.filter, None);
            assert_eq!(rule.kafka.topic_expression, None);
            assert!(rule.kafka.headers.expressions.is_empty());
            assert!(!r.config_yaml.contains("transform"));
        }
    }

    #[test]
    fn long_names_are_shortened_stably() {
        let long = "a".repeat(80);
        let w = workload_name(&long, "default");
        assert_eq!(w.len(), 52);
        assert_eq!(w, workload_name(&long, "default"), "stable");
        assert_ne!(w, workload_name(&long, "other"));
        let mut r = rules().remove(0);
        r.metadata.name = Some(format!("{}.x", "b".repeat(70)));
        assert!(rule_name(&r).len() <= 63);
        assert_eq!(workload_name("plant", "default"), "plant-default");
    }

    #[test]
    fn pairs_that_read_the_same_joined_by_a_dash_get_different_names() {
        assert_eq!(workload_name("plant", "east-bulk"), "plant-east-bulk--5");
        assert_eq!(workload_name("plant-east", "bulk"), "plant-east-bulk");
        assert_eq!(workload_name("a--b", "c"), "a--b-c--4");
        // Every split of a few names that read alike: all distinct, all within bounds.
        let parts = ["a", "b", "a-b", "b-a", "a--b", "b-2", "2", "5", "a-b--3"];
        let mut seen = std::collections::BTreeMap::new();
        for c in parts {
            for g in parts {
                let w = workload_name(c, g);
                if let Some(other) = seen.insert(w.clone(), (c, g)) {
                    panic!("{c:?} + {g:?} and {other:?} are both {w}");
                }
            }
        }
        // The longest pair (a 253-character connection, a 40-character group) and ones around
        // the bound: every pod name and revision label fits in 63.
        for (c, g) in [
            ("c".repeat(253), "g".repeat(40)),
            ("c".repeat(45), "g-g".to_owned()),
            ("c".repeat(44), "g-g".to_owned()),
            ("c".repeat(50), "g".to_owned()),
        ] {
            let w = workload_name(&c, &g);
            assert!(w.len() <= 52, "{w}");
            assert!(format!("{w}-{}", "9".repeat(10)).len() <= 63);
            assert_ne!(w, workload_name(&c, &format!("{g}x")));
        }
    }
}
