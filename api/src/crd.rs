//! The Kubernetes API: `BrokerConnection` and `ForwardingRule` in `ferry.dev/v1alpha1`.
//!
//! The schemas carry their own validation (CEL rules with human messages), so `kubectl apply`
//! refuses a bad object before the operator ever sees it. The operator re-checks what CEL
//! cannot (references between objects) and reports it in `status.conditions`.

// `printcolumn(type_ = ...)` repeats keys by design of kube's derive attribute.
#![allow(clippy::duplicated_attributes)]

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Affinity, ResourceRequirements, Toleration};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, KubeSchema};
use schemars::json_schema;
use serde::{Deserialize, Serialize};

use crate::addr::{DNS_NAME_RE, IPV6_RE};
pub use crate::config::SaslMechanism;
use crate::config::{MIN_MESSAGE_BYTES, MQTT_PAYLOAD_MAX};
use crate::defaults;
use crate::expr;
use crate::kafka_props::{self, Weaker};
use kube::core::{Message, Rule};

pub const GROUP: &str = "ferry.dev";
pub const VERSION: &str = "v1alpha1";

/// Where the MQTT broker and Kafka are, how to authenticate to both, and how the forwarder pods
/// serving this connection run.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "ferry.dev",
    version = "v1alpha1",
    kind = "BrokerConnection",
    doc = "Where the MQTT broker and Kafka are, how to authenticate to both, and how the forwarder pods serving this connection run.",
    namespaced,
    shortname = "bc",
    category = "ferry",
    status = "BrokerConnectionStatus",
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(name = "MQTT", type_ = "string", json_path = ".spec.mqtt.host"),
    // The API server prints a list column as JSON (`["a:9092"]`): list columns come from the
    // plain strings the operator writes into the status.
    printcolumn(
        name = "Kafka",
        type_ = "string",
        json_path = ".status.bootstrapServers"
    ),
    printcolumn(name = "Groups", type_ = "string", json_path = ".status.groupNames"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = queue_rule())]
pub struct BrokerConnectionSpec {
    /// The MQTT broker the forwarders subscribe to.
    pub mqtt: MqttEndpoint,
    /// The Kafka cluster the forwarders produce to.
    pub kafka: KafkaEndpoint,
    /// How the forwarder pods run (one StatefulSet per group of rules).
    #[serde(default)]
    pub forwarder: ForwarderPods,
    /// The schema registry (Confluent REST API) of rules that encode their values
    /// (`spec.kafka.value` of a ForwardingRule).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema_registry: Option<SchemaRegistryEndpoint>,
    /// The dead-letter topic of every rule of this connection without its own (a
    /// ForwardingRule's `spec.deadLetter`): where messages go that Kafka can never take as
    /// they are, and records that waited on their topic past their stall budget. Unset: each
    /// rule's own, else its `onUnwritable` decides. A rule with `spec.kafka.value` needs a
    /// dead-letter topic (its own or this one) or `onUnwritable: Drop`. For a connection of
    /// one team: on a shared one, it would put one team's payloads in a topic the others read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dead_letter: Option<DeadLetter>,
    /// How long, in seconds, a rule's records may wait on their Kafka topic for a reason of the
    /// rule's own (not authorized, an unknown topic, a schema the registry cannot give) before
    /// they go to the rule's dead-letter topic with the reason, so that the other rules of its
    /// group (which wait behind them) move on; without a dead-letter topic they keep waiting,
    /// and every rule they hold says so. Kafka outages never count. For every rule without its
    /// own `spec.stallBudgetSeconds`. 0: as long as it takes; at most 604800 (a week: a longer
    /// wait is no budget). Default: 300, long enough for the usual fix (a topic created by a
    /// GitOps sync, an ACL granted during a rollout) to land before anything is dead-lettered,
    /// short enough that one rule's missing topic stops its neighbours for minutes, not until
    /// someone notices.
    #[serde(default = "default_stall_budget_seconds")]
    #[x_kube(validation = stall_budget_rule())]
    pub stall_budget_seconds: i32,
}

/// The largest `stallBudgetSeconds` (a week): records held longer than that are not held on
/// a budget, and 0 says "as long as it takes" plainly.
pub const MAX_STALL_BUDGET_SECONDS: i32 = 7 * 86_400;

/// A schema registry speaking Confluent's REST API: Confluent Schema Registry, Apicurio
/// Registry (`.../apis/ccompat/v7`), Karapace, Redpanda.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("!has(self.tls) || self.url.startsWith('https://')").message("schemaRegistry.tls needs an https:// url"),
    validation = Rule::new("!has(self.credentialsSecretRef) || self.url.startsWith('https://')").message("schemaRegistry.credentialsSecretRef sends the password in clear text over http://: use an https:// url")
)]
pub struct SchemaRegistryEndpoint {
    /// Base URL: `https://registry.kafka:8081`, or Apicurio's
    /// `https://apicurio.kafka:8080/apis/ccompat/v7`. Credentials go in credentialsSecretRef,
    /// not in the URL.
    #[schemars(length(min = 8, max = 2048))]
    #[x_kube(
        validation = Rule::new("self.matches('^https?://[^/@?#\\\\s]+(/[^?#\\\\s]*)?$')").message("schemaRegistry.url must be an http:// or https:// URL with a host, without credentials, query or fragment")
    )]
    pub url: String,
    /// TLS for an `https://` URL; the registry's certificate is always verified.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<TlsRefs>,
    /// Secret with the HTTP basic-auth username and password.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials_secret_ref: Option<CredentialsRef>,
}

/// The MQTT broker.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("!has(self.sessionExpirySeconds) || self.protocol == '5'").message("sessionExpirySeconds is an MQTT 5 setting: set protocol: \"5\" or remove it"),
    validation = Rule::new("!has(self.sessionExpirySeconds) || self.sessionExpirySeconds != 0 || (has(self.allowWeakerDelivery) && self.allowWeakerDelivery)").message("sessionExpirySeconds 0 ends the session at every disconnect: messages published while a forwarder is away, and those it received and had not acknowledged yet, are lost; set allowWeakerDelivery: true to accept that"),
    validation = window_rule()
)]
pub struct MqttEndpoint {
    /// Host name or address of the broker (also the name checked against its TLS certificate):
    /// a DNS name, an IPv4 address or an IPv6 address without brackets; no scheme or port.
    #[schemars(length(min = 1, max = 253))]
    #[x_kube(validation = host_rule())]
    pub host: String,
    /// TCP port.
    #[serde(default = "default_mqtt_port")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 65535").message("port must be between 1 and 65535"))]
    pub port: i32,
    /// MQTT protocol version: "3.1.1" or "5".
    #[serde(default)]
    pub protocol: MqttProtocolVersion,
    /// TLS to the broker. Its certificate is always verified.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<TlsRefs>,
    /// Secret with the MQTT username and password.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials_secret_ref: Option<CredentialsRef>,
    /// MQTT 5: how long the broker keeps a forwarder's session, and queues its messages, after
    /// it disconnected. Unset: 86400 (one day); 4294967295: never expires.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 0 && self <= 4294967295").message("sessionExpirySeconds must be between 0 and 4294967295 (MQTT 5's largest session expiry interval)"))]
    pub session_expiry_seconds: Option<i64>,
    /// The in-flight window per forwarder: messages received and not yet acknowledged (MQTT 5:
    /// announced as Receive Maximum).
    #[serde(default = "default_max_inflight")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 65535").message("maxInflight must be between 1 and 65535"))]
    pub max_inflight: i32,
    /// The in-flight window per forwarder in bytes: the payloads (and topics) of the messages
    /// received and not yet acknowledged; a forwarder reads no further message while the next
    /// would pass it. Kafka's producer queue is bounded by the same, so a forwarder holds about
    /// twice this at most, and its pods' default memory limit is 128 MiB plus twice this (see
    /// forwarder.resources). At least maxMessageBytes, at most 2199023254528 (librdkafka's
    /// largest producer queue). Default: 16777216 (16 MiB).
    #[serde(default = "default_max_inflight_bytes")]
    #[x_kube(validation = inflight_bytes_rule())]
    pub max_inflight_bytes: i64,
    /// The largest MQTT message a forwarder reads, in bytes of payload: 1024 to 268435455
    /// (MQTT's largest). A larger message is not read into memory: it fails on each rule it
    /// matches, going to the rule's dead-letter topic with the reason and without the payload,
    /// or else as the rule's onUnwritable says. Expressions' cost is estimated for payloads of
    /// this size at most. Default: 1048576 (1 MiB, about Kafka's default max.message.bytes).
    #[serde(default = "default_max_message_bytes")]
    #[x_kube(validation = message_bytes_rule("maxMessageBytes"))]
    pub max_message_bytes: i32,
    /// Accept `sessionExpirySeconds: 0`, which loses messages across a disconnect.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_weaker_delivery: bool,
}

#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
pub enum MqttProtocolVersion {
    #[default]
    #[serde(rename = "3.1.1")]
    V311,
    #[serde(rename = "5")]
    V5,
}

/// Kafka.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("!has(self.sasl) || self.sasl.mechanism != 'PLAIN' || has(self.tls)").message("SASL PLAIN sends the password in clear text: it needs tls"),
    validation = weaker_rule(&kafka_props::ACKS),
    validation = weaker_rule(&kafka_props::IDEMPOTENCE),
    validation = weaker_rule(&kafka_props::MESSAGE_TIMEOUT),
    validation = weaker_rule(&kafka_props::PARTITIONER)
)]
pub struct KafkaEndpoint {
    /// `host:port` of one or more brokers: a DNS name or IPv4 address, or an IPv6 address in
    /// brackets (`[::1]:9092`), and a port from 1 to 65535.
    #[schemars(length(min = 1, max = 32))]
    #[x_kube(validation = bootstrap_rule())]
    pub bootstrap_servers: Vec<BoundedString>,
    /// TLS to the brokers; their certificates are always verified.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<TlsRefs>,
    /// SASL authentication.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sasl: Option<Sasl>,
    /// librdkafka producer properties, passed through (they override Ferry's defaults).
    /// Settings that weaken at-least-once or in-order delivery (`acks` other than `all`,
    /// `enable.idempotence` other than `true`, `message.timeout.ms` other than `0`,
    /// `partitioner: random`) need `allowWeakerDelivery`; some (`transactional.id`, `delivery.report.only.error`,
    /// consumer properties) are never accepted. The operator also asks librdkafka, as the
    /// forwarder does, and refuses the connection (Ready False, InvalidSpec) over a property
    /// it does not know or a value it refuses, including when creating the producer
    /// (`max.in.flight.requests.per.connection` above 5 with idempotence, `retries` 0, ...).
    /// Values are passed as written: `${NAME}` is not substituted.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(schema_with = "kafka_config_schema")]
    #[x_kube(
        validation = Rule::new("self.all(k, k != 'bootstrap.servers' && k != 'security.protocol' && !k.startsWith('ssl.') && !k.startsWith('sasl.'))").message("bootstrap.servers, security.protocol, ssl.* and sasl.* are set from bootstrapServers, tls and sasl"),
        validation = Rule::new("self.all(k, k.matches('^[a-z][a-z0-9._]*$'))").message("config keys are librdkafka property names: lower-case letters, digits, '.' and '_'"),
        validation = unsupported_rule(&["transactional.id"]),
        validation = unsupported_rule(&["delivery.report.only.error"]),
        validation = unsupported_rule(&["group.id", "group.instance.id", "enable.auto.commit", "auto.offset.reset", "isolation.level"])
    )]
    pub config: BTreeMap<String, String>,
    /// Accept `config` settings that weaken the delivery guarantee (see `config`): Kafka may
    /// then lose or reorder records the forwarder already acknowledged to MQTT.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_weaker_delivery: bool,
}

/// A string of at most 253 characters (keeps CEL rules over it cheap).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, schemars::JsonSchema)]
#[serde(transparent)]
pub struct BoundedString(#[schemars(length(min = 1, max = 253))] pub String);

// Bounded by `crate::topic::CRD_MAX_FILTER_CHARS` (a test keeps the two equal).
/// An MQTT topic filter of 1 to 1024 characters.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, schemars::JsonSchema)]
#[serde(transparent)]
pub struct TopicFilterText(#[schemars(length(min = 1, max = 1024))] pub String);

/// Certificates in Secrets, as PEM.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.caSecretRef) || has(self.clientCertSecretRef) || self.useSystemRoots").message("tls needs caSecretRef, clientCertSecretRef or useSystemRoots: true"))]
pub struct TlsRefs {
    /// Secret key holding the CA certificate(s) that sign the broker's certificate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_secret_ref: Option<SecretKeyRef>,
    /// A Secret with the client certificate and its key: a `kubernetes.io/tls` Secret
    /// (`tls.crt`, `tls.key`) by default; `certKey`/`keyKey` name other keys (a Strimzi
    /// KafkaUser's Secret: `user.crt`, `user.key`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_cert_secret_ref: Option<ClientCertRef>,
    /// Trust the system's root certificates (what happens anyway without caSecretRef): set it
    /// to use TLS with neither a CA nor a client certificate from a Secret.
    #[serde(default)]
    pub use_system_roots: bool,
}

/// SASL to Kafka.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Sasl {
    /// SCRAM-SHA-512, SCRAM-SHA-256 or PLAIN (PLAIN only with tls).
    pub mechanism: SaslMechanism,
    /// Secret with the username and password.
    pub credentials_secret_ref: CredentialsRef,
}

/// A Secret in the same namespace and the keys of a username and a password in it.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.username) || self.usernameKey == 'username'").message("username is given literally: remove usernameKey, which would name the username's key in the Secret"))]
pub struct CredentialsRef {
    /// Name of the Secret.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// The username itself, for a Secret that holds only the password (a Strimzi KafkaUser's
    /// Secret has `password` and `sasl.jaas.config`; the username is the KafkaUser's name).
    /// When set, the Secret's `usernameKey` is not read. Not a secret: it is shown by `kubectl
    /// get -o yaml`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024))]
    pub username: Option<String>,
    /// Key of the username in the Secret (unless `username` is set).
    #[serde(default = "default_username_key")]
    pub username_key: String,
    /// Key of the password in the Secret.
    #[serde(default = "default_password_key")]
    pub password_key: String,
}

/// One key of a Secret in the same namespace.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct SecretKeyRef {
    /// Name of the Secret.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// Key in the Secret.
    #[schemars(length(min = 1, max = 253))]
    pub key: String,
}

/// A Secret in the same namespace with a client certificate (PEM, the chain from the leaf) and
/// its private key (PEM).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ClientCertRef {
    /// Name of the Secret.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// Key of the certificate in the Secret.
    #[serde(default = "default_cert_key")]
    #[schemars(length(min = 1, max = 253))]
    pub cert_key: String,
    /// Key of the private key in the Secret.
    #[serde(default = "default_key_key")]
    #[schemars(length(min = 1, max = 253))]
    pub key_key: String,
}

/// An object in the same namespace, by name.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct LocalRef {
    /// Name of the object.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
}

/// How the forwarder pods of this connection run.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ForwarderPods {
    /// Forwarder image, `[registry[:port]/]repository[:tag][@digest]`; without a tag or a
    /// digest the operator's version is the tag. Default: the operator's `--forwarder-image`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 512))]
    // Kept identical to the operator's parser (`ferry_operator::image`): a test compares them.
    #[x_kube(validation = Rule::new("self.matches('^([a-zA-Z0-9]([a-zA-Z0-9-]*[a-zA-Z0-9])?([.][a-zA-Z0-9]([a-zA-Z0-9-]*[a-zA-Z0-9])?)*(:[0-9]{1,5})?/)?[a-z0-9]+(([._]|__|-+)[a-z0-9]+)*(/[a-z0-9]+(([._]|__|-+)[a-z0-9]+)*)*(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@(sha256:[0-9a-f]{64}|sha512:[0-9a-f]{128}))?$')").message("image must be [registry[:port]/]repository[:tag][@sha256:<64 hex digits>], the repository in lower case"))]
    pub image: Option<String>,
    /// When the kubelet pulls the image: `Always`, `IfNotPresent` or `Never`. Default: the
    /// operator's `--forwarder-image-pull-policy`, else Kubernetes' own default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<ImagePullPolicy>,
    /// Secrets in this namespace with the credentials of the image's registry. Default: the
    /// operator's `--forwarder-image-pull-secrets`; an empty list means none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 16))]
    pub image_pull_secrets: Option<Vec<LocalRef>>,
    /// Replicas per group (unless `groups` says otherwise for a group). More than one splits
    /// the messages through a shared subscription.
    #[serde(default = "default_replicas")]
    #[x_kube(validation = Rule::new("self >= 0 && self <= 64").message("replicas must be between 0 and 64"))]
    pub replicas: i32,
    /// Settings of named groups, overriding the connection's: replicas, or an autoscaler
    /// (HorizontalPodAutoscaler, KEDA) owning them. A name no rule uses is kept, unused.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub groups: Vec<GroupPods>,
    /// CPU and memory requests and limits of the forwarder container; when set, they replace
    /// the default whole. Default: requests of 50m CPU and 64Mi memory, a memory limit of
    /// 128 MiB plus twice mqtt.maxInflightBytes (rounded up to Mi: 160Mi by default), no CPU
    /// limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// Node labels the forwarder pods must be scheduled on.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Tolerations of the forwarder pods.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
    /// Affinity of the forwarder pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
    /// Extra annotations on the forwarder pods (e.g. for a service mesh or log shipper).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub pod_annotations: BTreeMap<String, String>,
}

/// How the forwarder pods of one group run, where it differs from the connection's.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!(has(self.replicas) && has(self.autoscaled) && self.autoscaled)").message("replicas and autoscaled: true both decide the group's replicas: set one"))]
pub struct GroupPods {
    /// The group (a ForwardingRule's `spec.group`).
    #[schemars(length(min = 1, max = 40))]
    #[x_kube(validation = Rule::new("self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')").message("name must be a group name: a DNS label of at most 40 characters"))]
    pub name: String,
    /// This group's replicas. Unset: the connection's `replicas` (unless autoscaled).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 0 && self <= 64").message("replicas must be between 0 and 64"))]
    pub replicas: Option<i32>,
    /// An autoscaler owns the replicas of this group's StatefulSet (`<connection>-<group>`):
    /// the operator neither sets nor restores them, and every pod but the first (ordinal 0)
    /// drains into Kafka before it stops, so a scale-down loses nothing.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub autoscaled: bool,
}

/// Who decides a group's replicas.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupReplicas {
    /// The operator, to this count.
    Fixed(i32),
    /// An autoscaler.
    Autoscaled,
}

impl ForwarderPods {
    /// The replicas of group `group`: its own setting, else the connection's.
    pub fn replicas_of(&self, group: &str) -> GroupReplicas {
        match self.groups.iter().find(|g| g.name == group) {
            Some(g) if g.autoscaled => GroupReplicas::Autoscaled,
            Some(GroupPods {
                replicas: Some(n), ..
            }) => GroupReplicas::Fixed(*n),
            _ => GroupReplicas::Fixed(self.replicas),
        }
    }
}

impl Default for ForwarderPods {
    fn default() -> Self {
        Self {
            image: None,
            image_pull_policy: None,
            image_pull_secrets: None,
            replicas: default_replicas(),
            groups: Vec::new(),
            resources: None,
            node_selector: BTreeMap::new(),
            tolerations: Vec::new(),
            affinity: None,
            pod_annotations: BTreeMap::new(),
        }
    }
}

// When the kubelet pulls a container image (a pod spec's `imagePullPolicy`). A comment, not a
// doc comment: the schema of an optional field would show it instead of the field's own.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, schemars::JsonSchema)]
pub enum ImagePullPolicy {
    /// On every container start.
    Always,
    /// Only when the node does not have it.
    IfNotPresent,
    /// Never: the node must have it.
    Never,
}

impl ImagePullPolicy {
    /// The name in a pod spec.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Always => "Always",
            Self::IfNotPresent => "IfNotPresent",
            Self::Never => "Never",
        }
    }
}

/// What the operator reports about a connection.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct BrokerConnectionStatus {
    /// The generation of the spec this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `SecretsResolved` and `Ready`.
    #[serde(default)]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
    /// The groups of rules this connection serves, one forwarder StatefulSet each.
    #[serde(default)]
    pub groups: Vec<String>,
    /// `groups` joined with commas, for `kubectl get`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_names: Option<String>,
    /// `spec.kafka.bootstrapServers` joined with commas, for `kubectl get`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_servers: Option<String>,
    /// MQTT client ids of this connection's forwarder pods whose sessions the broker may hold.
    /// The operator ends each one at the broker once its pod is gone for good (group removed,
    /// replicas scaled down, connection deleted).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mqtt_sessions: Vec<String>,
    /// How this connection's forwarders name their MQTT sessions: each pod's client id is this
    /// prefix and the pod's name, each group's shared-subscription group this prefix and the
    /// StatefulSet's name. `ferry.<namespace>.<first 8 hex digits of metadata.uid>.`, so a
    /// connection deleted and created again under the same name never resumes, nor shares, the
    /// sessions of the one before; `ferry.<namespace>.` for a connection whose forwarders
    /// already had sessions under that older scheme (they keep them). Set when the connection is
    /// first rendered, never changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_prefix: Option<String>,
}

/// What to forward from MQTT to Kafka, through which connection.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "ferry.dev",
    version = "v1alpha1",
    kind = "ForwardingRule",
    doc = "What to forward from MQTT to Kafka, through which BrokerConnection.",
    namespaced,
    shortname = "fr",
    category = "ferry",
    status = "ForwardingRuleStatus",
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "Reason",
        type_ = "string",
        description = "Why the rule is (not) Ready: e.g. Held (it holds a record Kafka can never take), BlockedByRule (its messages wait behind one another rule holds)",
        json_path = ".status.conditions[?(@.type==\"Ready\")].reason"
    ),
    printcolumn(
        name = "MQTT Topics",
        type_ = "string",
        json_path = ".status.mqttTopics"
    ),
    printcolumn(
        name = "Kafka Topic",
        type_ = "string",
        json_path = ".status.kafkaTopic"
    ),
    printcolumn(
        name = "Rate",
        type_ = "number",
        description = "Records forwarded per second over the last minute",
        json_path = ".status.ratePerSecond"
    ),
    printcolumn(
        name = "Last Forwarded",
        type_ = "date",
        json_path = ".status.lastForwardedAt"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    printcolumn(
        name = "Schema ID",
        type_ = "integer",
        description = "The registered schema id values are encoded with (spec.kafka.value)",
        json_path = ".status.schema.id",
        priority = 1
    ),
    printcolumn(
        name = "Schema Version",
        type_ = "integer",
        json_path = ".status.schema.version",
        priority = 1
    )
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.payloadTransform) || self.payload == 'raw'").message("payloadTransform makes the record's value itself: it needs payload raw (the default), not wrappedJson"))]
#[x_kube(validation = Rule::new("!has(self.kafka.value) || self.payload == 'raw'").message("kafka.value encodes the payload or payloadTransform's result: it needs payload raw (the default), not wrappedJson"))]
#[x_kube(validation = Rule::new("!has(self.kafka.value) || has(self.kafka.value.subject) || self.kafka.value.subjectNameStrategy == 'RecordName' || (has(self.kafka.topic) && !self.kafka.topic.contains('{'))").message("kafka.value: the topic name strategies need kafka.topic to be one name (no {N} placeholders, no topicExpression): set kafka.value.subject"))]
pub struct ForwardingRuleSpec {
    /// The BrokerConnection (same namespace) this rule forwards through.
    pub connection_ref: LocalRef,
    /// Rules of one connection and group are served by the same forwarder pods. A group holds
    /// at most 10,000 rules and a 1 MiB config; rules are admitted oldest first, and one that
    /// does not fit is refused (Accepted False, GroupFull).
    #[serde(default = "default_group")]
    #[x_kube(validation = Rule::new("size(self) <= 40 && self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')").message("group must be a DNS label of at most 40 characters (lower-case letters, digits, '-')"))]
    pub group: String,
    /// What to read from MQTT.
    pub mqtt: RuleMqtt,
    /// A CEL expression returning a bool: only messages it is true for are forwarded; the
    /// others are acknowledged and counted as filtered. Example: `json.temp > 50.0 &&
    /// levels[1] == 'north'`. Variables: topic, levels (the topic's levels from 0), qos,
    /// retain, properties (MQTT 5 user properties), contentType, payload (bytes), json (the
    /// payload parsed as JSON), receivedAt. A message whose payload is not JSON goes to the
    /// dead-letter path of a rule that uses json.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = expr::MAX_LEN))]
    #[x_kube(validation = no_substitution_rule(false))]
    pub filter: Option<String>,
    /// Where and how to write it in Kafka.
    pub kafka: RuleKafka,
    /// What the record's value is: the MQTT payload (`raw`) or `wrappedJson`; see also
    /// payloadTransform.
    #[serde(default)]
    pub payload: Payload,
    /// A CEL expression whose result (a map, list or value) becomes the record's value as
    /// JSON, with payload raw (the default). Example: `{'device': levels[1], 'temp':
    /// json.t, 'at': string(receivedAt)}`. Variables: topic, levels, qos, retain,
    /// properties, contentType, payload, json, receivedAt (see spec.filter).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = expr::MAX_LEN))]
    #[x_kube(validation = no_substitution_rule(false))]
    pub payload_transform: Option<String>,
    /// Where messages go that Kafka can never take as they are (too large, an illegal topic
    /// name from a template, rejected as invalid, a value that does not fit its schema), and
    /// records that waited on their topic past the stall budget. Unset: the BrokerConnection's
    /// `spec.deadLetter`, else `onUnwritable` decides. With `spec.kafka.value`, a rule needs
    /// one (its own or its connection's) or `onUnwritable: Drop`: otherwise the operator
    /// refuses it (Accepted False, Invalid), since a value that does not fit the schema would
    /// hold every rule of its group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dead_letter: Option<DeadLetter>,
    /// What happens to a message Kafka can never take when no dead-letter topic took it:
    /// `Hold` (default) keeps it unacknowledged and retried, stalling the rule until fixed;
    /// `Drop` acknowledges it unwritten, counted (the message is lost, by choice).
    /// Authorization errors, unknown topics and outages are always retried, never dropped.
    #[serde(default)]
    pub on_unwritable: OnUnwritable,
    /// This rule's stall budget, in seconds: how long its records may wait on their Kafka
    /// topic for a reason of its own (not authorized, an unknown topic, a schema the registry
    /// cannot give) before they go to its dead-letter topic; see the BrokerConnection's
    /// `spec.stallBudgetSeconds`. 0: as long as it takes; at most 604800 (a week). Unset: the
    /// connection's (default 300).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = stall_budget_rule())]
    pub stall_budget_seconds: Option<i32>,
    /// A paused rule is kept but not forwarded (its filters are unsubscribed).
    #[serde(default)]
    pub paused: bool,
}

/// What to read from MQTT.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RuleMqtt {
    /// MQTT topic filters: `+` matches one level, `#` the rest; `$share/<group>/<filter>` for a
    /// shared subscription. At most 1024 characters each (the protocol allows 65535 bytes; the
    /// bound keeps validation cheap).
    #[schemars(length(min = 1, max = 32))]
    #[x_kube(
        validation = Rule::new("self.all(t, !t.contains('#') || (t.indexOf('#') == size(t) - 1 && (size(t) == 1 || t.endsWith('/#'))))").message("'#' may only be the last level of a topic filter, standing alone (like a/#)"),
        validation = Rule::new("self.all(t, !t.matches('[^/][+]|[+][^/]'))").message("'+' must be a whole level of a topic filter (like a/+/c)"),
        validation = Rule::new("self.all(t, !t.contains('\\u0000'))").message("a topic filter may not contain the NUL character (U+0000)"),
        validation = Rule::new("self.all(t, !t.startsWith('$share/') || (t.matches('^[$]share/[^/+#]+/') && !t.matches('^[$]share/[^/+#]+/$')))").message("a shared subscription must be $share/<group>/<filter>: the group not empty and without '/', '+' or '#', and a filter after it")
    )]
    pub topics: Vec<TopicFilterText>,
    /// Subscription QoS: 0, 1 or 2.
    #[serde(default = "default_qos")]
    #[x_kube(validation = Rule::new("self >= 0 && self <= 2").message("qos must be 0, 1 or 2"))]
    pub qos: i32,
    /// The largest payload this rule takes, in bytes: 1024 to its BrokerConnection's
    /// spec.mqtt.maxMessageBytes (unset: that). A larger message fails on this rule only (its
    /// dead-letter topic, without the payload, or onUnwritable), as one over the connection's
    /// limit does on every rule. Its expressions' cost is estimated for payloads of this size,
    /// so a rule on small payloads can have a costlier transform. Over the connection's limit,
    /// the rule is refused (Accepted False, Invalid).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = message_bytes_rule("mqtt.maxMessageBytes"))]
    pub max_message_bytes: Option<i32>,
}

/// Where to write in Kafka.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.topic) != has(self.topicExpression)").message("set exactly one of kafka.topic and kafka.topicExpression"))]
pub struct RuleKafka {
    /// A topic name, or a template with MQTT topic levels counted from 0 (`telemetry.{1}`).
    /// Exactly one of topic and topicExpression is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(
        validation = Rule::new("size(self) >= 1 && size(self) <= 249").message("the Kafka topic must be 1 to 249 characters"),
        // At most 3 digits: the forwarder refuses a level that does not fit a usize.
        validation = Rule::new("self.matches('^([A-Za-z0-9._-]|\\\\{[0-9]{1,3}\\\\})+$')").message("the Kafka topic may contain only letters, digits, '.', '_', '-' and {N} placeholders for MQTT topic levels (N from 0 to 999)"),
        validation = Rule::new("self != '.' && self != '..'").message("the Kafka topic may not be '.' or '..'")
    )]
    pub topic: Option<String>,
    /// A CEL expression returning the topic name as a string, instead of topic; a result that
    /// is not a valid Kafka topic name sends the message to the dead-letter path. Example:
    /// `'telemetry.' + json.site`. Variables: topic, levels, qos, retain, properties,
    /// contentType, payload, json, receivedAt (see spec.filter).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = expr::MAX_LEN))]
    #[x_kube(validation = no_substitution_rule(false))]
    pub topic_expression: Option<String>,
    /// The record key; default: the MQTT topic.
    #[serde(default)]
    pub key: Key,
    /// Kafka headers from MQTT metadata, MQTT 5 user properties and CEL expressions; default:
    /// none.
    #[serde(default)]
    pub headers: Headers,
    /// Encode the record's value with a schema from the connection's schema registry (Avro,
    /// Protobuf or JSON Schema, in Confluent's wire format); unset: the value as `payload`
    /// makes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<ValueFormat>,
}

/// A record value encoded through the schema registry.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("self.subjectNameStrategy == 'TopicName' || has(self.recordName) || has(self.subject)").message("value.recordName is needed by the RecordName and TopicRecordName strategies (or set value.subject)"),
    validation = Rule::new("!has(self.message) || self.format == 'protobuf'").message("value.message names a Protobuf message: set it only with format protobuf")
)]
pub struct ValueFormat {
    /// `avro`, `protobuf` or `jsonSchema`: the registered schema's type. The value (the
    /// payload, or payloadTransform's result) is JSON, validated and encoded against it.
    pub format: ValueFormatKind,
    /// The registry subject; unset: derived by subjectNameStrategy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 255))]
    pub subject: Option<String>,
    /// `TopicName` (default: `<kafka.topic>-value`, needs a topic without placeholders),
    /// `RecordName` (`<recordName>`) or `TopicRecordName` (`<kafka.topic>-<recordName>`).
    #[serde(default)]
    pub subject_name_strategy: SubjectNameStrategy,
    /// The fully-qualified record name for the RecordName strategies (`com.acme.Reading`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 255))]
    pub record_name: Option<String>,
    /// A version of the subject; unset: its latest, looked up again every 5 minutes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 4294967295").message("value.version must be between 1 and 4294967295"))]
    pub version: Option<i64>,
    /// Protobuf: the fully-qualified message to encode; unset: the schema's first message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 255))]
    pub message: Option<String>,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum ValueFormatKind {
    Avro,
    Protobuf,
    JsonSchema,
}

/// How the subject follows from the topic and the record name (Confluent's strategies).
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
pub enum SubjectNameStrategy {
    #[default]
    TopicName,
    RecordName,
    TopicRecordName,
}

impl RuleKafka {
    /// The registry subject of the value's schema, or why there is none (a topic strategy
    /// over a topic that is not one name).
    pub fn value_subject(&self) -> Option<Result<String, &'static str>> {
        let v = self.value.as_ref()?;
        if let Some(subject) = &v.subject {
            return Some(Ok(subject.clone()));
        }
        let topic = self.topic.as_deref().filter(|t| !t.contains('{'));
        let record = v.record_name.as_deref();
        Some(match (v.subject_name_strategy, topic, record) {
            (SubjectNameStrategy::RecordName, _, Some(r)) => Ok(r.to_owned()),
            (SubjectNameStrategy::TopicName, Some(t), _) => Ok(format!("{t}-value")),
            (SubjectNameStrategy::TopicRecordName, Some(t), Some(r)) => Ok(format!("{t}-{r}")),
            (_, _, None) if v.subject_name_strategy != SubjectNameStrategy::TopicName => {
                Err("value.recordName is needed by the RecordName and TopicRecordName strategies")
            }
            _ => Err(
                "the topic name strategies need kafka.topic to be one name (no {N} placeholders, \
                 no topicExpression): set value.subject",
            ),
        })
    }
}

/// The record key.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(
    validation = Rule::new("(self.strategy == 'topicLevel') == has(self.level)").message("key.level is set with strategy topicLevel, and only then"),
    validation = Rule::new("(self.strategy == 'expression') == has(self.expression)").message("key.expression is set with strategy expression, and only then")
)]
pub struct Key {
    /// `mqttTopic` (default), `none`, `topicLevel` or `expression`.
    #[serde(default)]
    pub strategy: KeyStrategy,
    /// With `topicLevel`: the MQTT topic level (from 0) that becomes the key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 0 && self <= 64").message("key.level must be between 0 and 64"))]
    pub level: Option<i32>,
    /// With `expression`: a CEL expression returning the key as a string or bytes (null: no
    /// key). Example: `json.device`. Variables: topic, levels, qos, retain, properties,
    /// contentType, payload, json, receivedAt (see spec.filter).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = expr::MAX_LEN))]
    #[x_kube(validation = no_substitution_rule(false))]
    pub expression: Option<String>,
}

impl Default for Key {
    fn default() -> Self {
        Self {
            strategy: KeyStrategy::MqttTopic,
            level: None,
            expression: None,
        }
    }
}

#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub enum KeyStrategy {
    /// The MQTT topic: one MQTT topic stays in one partition, in order.
    #[default]
    MqttTopic,
    /// No key.
    None,
    /// One level of the MQTT topic (`level`).
    TopicLevel,
    /// A CEL expression (`expression`).
    Expression,
}

/// Kafka headers on each record.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct Headers {
    /// `<prefix>topic`, `<prefix>qos`, `<prefix>retain`, and `<prefix>content_type` from MQTT 5.
    #[serde(default)]
    pub metadata: bool,
    /// MQTT 5 user properties, one header each.
    #[serde(default)]
    pub user_properties: bool,
    /// Prefix of the metadata headers; default `mqtt.`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    // As the forwarder: `char::is_control` is Unicode category Cc.
    #[x_kube(validation = Rule::new("!self.matches('\\\\p{Cc}')").message("headers.prefix must not contain control characters"))]
    pub prefix: Option<String>,
    /// Header name → a CEL expression returning the header's value as a string or bytes
    /// (null leaves the header out). Example: `{"site": "levels[1]", "device": "json.id"}`.
    /// Variables: topic, levels, qos, retain, properties, contentType, payload, json,
    /// receivedAt (see spec.filter).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(schema_with = "header_expressions_schema")]
    // As the forwarder: a header name is not empty and has no Unicode category Cc.
    #[x_kube(validation = Rule::new("self.all(k, size(k) >= 1 && !k.matches('\\\\p{Cc}'))").message("headers.expressions names must be non-empty, without control characters"))]
    #[x_kube(validation = no_substitution_rule(true))]
    pub expressions: BTreeMap<String, String>,
}

#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub enum Payload {
    /// The MQTT payload bytes unchanged.
    #[default]
    Raw,
    /// `{"topic":"<mqtt topic>","payload":"<base64>"}`.
    WrappedJson,
}

/// See `ForwardingRuleSpec::on_unwritable`.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
pub enum OnUnwritable {
    #[default]
    Hold,
    Drop,
}

/// A Kafka topic for the messages Kafka can never take.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct DeadLetter {
    /// The dead-letter Kafka topic; records carry `ferry.*` headers saying why.
    #[x_kube(
        validation = Rule::new("size(self) >= 1 && size(self) <= 249 && self.matches('^[A-Za-z0-9._-]+$') && self != '.' && self != '..'").message("deadLetter.topic must be a Kafka topic name: 1 to 249 letters, digits, '.', '_' or '-'")
    )]
    pub topic: String,
}

/// What the operator and the forwarder pods report about a rule.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ForwardingRuleStatus {
    /// The generation of the spec this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Accepted`, `Ready`, and `Forwarding` (False with a reason when degraded).
    #[serde(default)]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
    /// The forwarder StatefulSet serving this rule.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload: Option<String>,
    /// Records forwarded, summed over the forwarder pods (since they started).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forwarded: Option<i64>,
    /// Messages `spec.filter` was false for: acknowledged, not forwarded (summed like
    /// `forwarded`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filtered: Option<i64>,
    /// Messages written to the dead-letter topic instead (summed like `forwarded`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dead_lettered: Option<i64>,
    /// Messages acknowledged unwritten: Kafka could never take them and `onUnwritable` is
    /// `drop`, or this rule's filter failed on a message another rule of the same Kafka target
    /// forwarded (summed like `forwarded`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed: Option<i64>,
    /// Records per second over the last minute, summed over the pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_per_second: Option<f64>,
    /// When a forwarder pod last had a record of this rule confirmed by Kafka.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "time_schema")]
    pub last_forwarded_at: Option<Time>,
    /// The most recent error of this rule on any pod within the last minute (why a record
    /// failed or was dead-lettered).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// Forwarder pods ready / wanted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_replicas: Option<String>,
    /// `spec.mqtt.topics` joined with commas, for `kubectl get`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mqtt_topics: Option<String>,
    /// `spec.kafka.topic`, or the `spec.kafka.topicExpression` that names it, for `kubectl get`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kafka_topic: Option<String>,
    /// The registered schema the forwarder pods encode values with (`spec.kafka.value`), once
    /// they found it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema: Option<crate::status::SchemaInUse>,
}

/// Conditions as a list-map keyed by `type`, so server-side apply merges them per type.
fn conditions_schema(generator: &mut schemars::generate::SchemaGenerator) -> schemars::Schema {
    let item = generator.subschema_for::<Condition>();
    json_schema!({
        "type": "array",
        "items": item,
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["type"]
    })
}

/// At most 64 properties, values of at most 4096 characters: bounds that keep the CEL rules
/// over them within the apiserver's cost budget.
fn kafka_config_schema(_: &mut schemars::generate::SchemaGenerator) -> schemars::Schema {
    json_schema!({
        "type": "object",
        "maxProperties": 64,
        "additionalProperties": { "type": "string", "maxLength": 4096 }
    })
}

/// At most 32 headers, each expression of 1 to [`expr::MAX_LEN`] characters.
fn header_expressions_schema(_: &mut schemars::generate::SchemaGenerator) -> schemars::Schema {
    json_schema!({
        "type": "object",
        "maxProperties": 32,
        "additionalProperties": { "type": "string", "minLength": 1, "maxLength": expr::MAX_LEN }
    })
}

/// A timestamp without the generic description of `Time` (the field's own doc applies).
fn time_schema(_: &mut schemars::generate::SchemaGenerator) -> schemars::Schema {
    json_schema!({ "type": "string", "format": "date-time" })
}

// The forwarder config's defaults ([`crate::defaults`]), as the CRD's integer type.
fn default_mqtt_port() -> i32 {
    i32::from(defaults::MQTT_PORT)
}
fn default_max_inflight() -> i32 {
    i32::from(defaults::MAX_INFLIGHT)
}
fn default_max_inflight_bytes() -> i64 {
    i64::try_from(defaults::MAX_INFLIGHT_BYTES).unwrap_or(i64::MAX)
}
fn default_max_message_bytes() -> i32 {
    i32::try_from(defaults::MAX_MESSAGE_BYTES).unwrap_or(i32::MAX)
}
fn default_stall_budget_seconds() -> i32 {
    i32::try_from(defaults::STALL_BUDGET_SECS).unwrap_or(MAX_STALL_BUDGET_SECONDS)
}
fn default_replicas() -> i32 {
    1
}
fn default_qos() -> i32 {
    i32::from(defaults::QOS)
}
fn default_group() -> String {
    "default".into()
}
fn default_username_key() -> String {
    "username".into()
}
fn default_cert_key() -> String {
    "tls.crt".into()
}
fn default_key_key() -> String {
    "tls.key".into()
}
fn default_password_key() -> String {
    "password".into()
}

/// `spec.mqtt.host`: [`crate::addr::host_problem`] in CEL.
fn host_rule() -> Rule {
    Rule::new(format!(
        "self.matches('^{DNS_NAME_RE}$') || self.matches('^{IPV6_RE}$')"
    ))
    .message("host must be a DNS name, an IPv4 address or an IPv6 address without brackets (no scheme, port or spaces)")
}

/// A `maxMessageBytes` (`field`, as the message names it): what the forwarder accepts, from
/// [`MIN_MESSAGE_BYTES`] to MQTT's largest payload.
fn message_bytes_rule(field: &str) -> Rule {
    Rule::new(format!(
        "self >= {MIN_MESSAGE_BYTES} && self <= {MQTT_PAYLOAD_MAX}"
    ))
    .message(Message::Message(format!(
        "{field} must be between {MIN_MESSAGE_BYTES} and {MQTT_PAYLOAD_MAX} (MQTT's largest payload)"
    )))
}

/// A `stallBudgetSeconds`: 0 (as long as it takes) to [`MAX_STALL_BUDGET_SECONDS`].
fn stall_budget_rule() -> Rule {
    Rule::new(format!(
        "self >= 0 && self <= {MAX_STALL_BUDGET_SECONDS}"
    ))
    .message(Message::Message(format!(
        "stallBudgetSeconds must be between 0 (as long as it takes) and {MAX_STALL_BUDGET_SECONDS} (a week)"
    )))
}

/// The largest `spec.mqtt.maxInflightBytes`: librdkafka's largest producer queue
/// (`queue.buffering.max.kbytes`, at most 2147483647 KiB), which the forwarder bounds by it.
const INFLIGHT_BYTES_MAX: i64 = 2_147_483_647 * 1024;

/// `spec.mqtt.maxInflightBytes`: its own bounds (against `maxMessageBytes`: the object's rule).
fn inflight_bytes_rule() -> Rule {
    Rule::new(format!(
        "self >= {MIN_MESSAGE_BYTES} && self <= {INFLIGHT_BYTES_MAX}"
    ))
    .message(Message::Message(format!(
        "maxInflightBytes must be between {MIN_MESSAGE_BYTES} and {INFLIGHT_BYTES_MAX} (librdkafka's largest producer queue)"
    )))
}

/// `spec.mqtt`: the window's bytes hold the largest message. Both fields have defaults in the
/// schema, so both are always set.
fn window_rule() -> Rule {
    Rule::new("self.maxInflightBytes >= self.maxMessageBytes").message(Message::Message(format!(
        "maxInflightBytes must be at least maxMessageBytes (defaults: {} and {}): a window smaller than the largest message could never read it",
        defaults::MAX_INFLIGHT_BYTES,
        defaults::MAX_MESSAGE_BYTES
    )))
}

/// `spec.kafka.bootstrapServers`: [`crate::addr::server_problem`] in CEL.
fn bootstrap_rule() -> Rule {
    Rule::new(format!(
        "self.all(s, s.matches('^({DNS_NAME_RE}|\\\\[{IPV6_RE}\\\\]):[0-9]{{1,5}}$') && int(s.substring(s.lastIndexOf(':') + 1)) >= 1 && int(s.substring(s.lastIndexOf(':') + 1)) <= 65535)"
    ))
    .message("every bootstrap server must be host:port: a DNS name or IPv4 address, or an IPv6 address in brackets, and a port from 1 to 65535 (no scheme)")
}

/// A CEL list literal of strings.
fn cel_list(items: impl IntoIterator<Item = &'static str>) -> String {
    let quoted: Vec<String> = items.into_iter().map(|i| format!("'{i}'")).collect();
    format!("[{}]", quoted.join(", "))
}

/// `spec.kafka`: one [`Weaker`] setting, refused unless `allowWeakerDelivery` is true.
fn weaker_rule(w: &Weaker) -> Rule {
    let safe = cel_list(w.safe.iter().copied());
    // A lookup per key, not a walk over the map: CEL's cost estimate of a walk exceeds the
    // apiserver's budget.
    let checks: Vec<String> = w
        .keys
        .iter()
        .map(|k| format!("(!('{k}' in self.config) || self.config['{k}'].lowerAscii() in {safe})"))
        .collect();
    Rule::new(format!(
        "(has(self.allowWeakerDelivery) && self.allowWeakerDelivery) || !has(self.config) || ({})",
        checks.join(" && ")
    ))
    .message(Message::Message(format!(
        "config {} must be {}: {}; set allowWeakerDelivery: true to accept that",
        w.keys.join(" / "),
        w.expected,
        w.why
    )))
}

/// `spec.kafka.config`: [`kafka_props::UNSUPPORTED`] keys sharing one reason, refused with it.
/// (One rule per reason with a fixed message: a message expression naming the key exceeds the
/// apiserver's cost budget.)
fn unsupported_rule(keys: &[&str]) -> Rule {
    let absent: Vec<String> = keys.iter().map(|k| format!("!('{k}' in self)")).collect();
    let why = keys
        .first()
        .and_then(|k| kafka_props::unsupported(k))
        .unwrap_or_default();
    Rule::new(absent.join(" && ")).message(Message::Message(format!(
        "config {} cannot be used: it {why}",
        keys.join(", ")
    )))
}

/// `spec`: `kafka.config`'s `queue.buffering.max.messages` against `mqtt.maxInflight`
/// ([`kafka_props::queue_too_small`]).
/// An expression may not contain `${`: the forwarder replaces `${VAR}` in its config file
/// before parsing it, so the text would change, or the whole group's config be refused. For a
/// map of expressions (`map`), every value.
fn no_substitution_rule(map: bool) -> Rule {
    let check = if map {
        "self.all(k, !self[k].contains('${'))"
    } else {
        "!self.contains('${')"
    };
    Rule::new(check).message(
        "an expression may not contain '${': the forwarder substitutes environment variables in its config there (write '$' + '{' for the two characters)",
    )
}

fn queue_rule() -> Rule {
    let key = kafka_props::QUEUE_MAX_MESSAGES;
    let value = format!("self.kafka.config['{key}']");
    Rule::new(format!(
        "!has(self.kafka.config) || !('{key}' in self.kafka.config) || ({value}.matches('^[0-9]{{1,10}}$') && (int({value}) == 0 || int({value}) >= self.mqtt.maxInflight))"
    ))
    .message(Message::Message(format!(
        "kafka.config {key} must be 0 (no limit) or a whole number at least mqtt.maxInflight: a smaller producer queue makes messages wait on it"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::CustomResourceExt;

    #[test]
    fn every_guarded_librdkafka_setting_has_its_cel_rule() {
        let crd = serde_json::to_string(&BrokerConnection::crd()).unwrap_or_default();
        for w in kafka_props::WEAKER {
            for key in w.keys {
                assert!(crd.contains(&format!("'{key}'")), "{key}");
            }
        }
        for u in kafka_props::UNSUPPORTED {
            assert!(crd.contains(&format!("'{}'", u.key)), "{}", u.key);
            assert!(!u.why.contains('\''), "a quote would end the CEL string");
        }
    }

    /// The schema of `spec` at a path of property names.
    fn spec_schema(path: &[&str]) -> serde_json::Value {
        let crd = serde_json::to_value(ForwardingRule::crd()).unwrap_or_default();
        let mut at = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
        for name in path {
            at = &at["properties"][name];
        }
        at.clone()
    }

    #[test]
    fn every_expression_field_lists_the_variables_and_has_the_forwarders_bound() {
        let fields: [&[&str]; 4] = [
            &["filter"],
            &["payloadTransform"],
            &["kafka", "topicExpression"],
            &["kafka", "key", "expression"],
        ];
        let headers = spec_schema(&["kafka", "headers", "expressions"]);
        let header_values = &headers["additionalProperties"];
        for (what, schema) in fields
            .iter()
            .map(|f| (f.join("."), spec_schema(f)))
            .chain([("kafka.headers.expressions".to_owned(), headers.clone())])
        {
            let description = schema["description"].as_str().unwrap_or_default();
            for v in crate::expr::VARIABLES {
                assert!(description.contains(v.name), "{what}: {:?}", v.name);
            }
            assert!(description.contains("Example"), "{what}");
            let bound = if what == "kafka.headers.expressions" {
                header_values["maxLength"].as_u64()
            } else {
                schema["maxLength"].as_u64()
            };
            assert_eq!(bound, Some(crate::expr::MAX_LEN as u64), "{what}");
        }
    }

    #[test]
    fn message_sizes_default_to_the_forwarders_and_have_its_bounds() {
        let crd = serde_json::to_value(BrokerConnection::crd()).unwrap_or_default();
        let mqtt = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
            ["mqtt"];
        let field = |name: &str| &mqtt["properties"][name];
        assert_eq!(
            field("maxInflightBytes")["default"].as_u64(),
            Some(defaults::MAX_INFLIGHT_BYTES)
        );
        assert_eq!(
            field("maxMessageBytes")["default"].as_u64(),
            Some(u64::from(defaults::MAX_MESSAGE_BYTES))
        );
        let rules = |schema: &serde_json::Value| schema["x-kubernetes-validations"].to_string();
        let bounds = format!("self >= {MIN_MESSAGE_BYTES} && self <= {MQTT_PAYLOAD_MAX}");
        assert!(rules(field("maxMessageBytes")).contains(&bounds));
        assert!(rules(mqtt).contains("self.maxInflightBytes >= self.maxMessageBytes"));
        // A rule's own limit: optional, no default (unset: the connection's).
        let rule = spec_schema(&["mqtt", "maxMessageBytes"]);
        assert_eq!(rule["default"], serde_json::Value::Null);
        assert!(rules(&rule).contains(&bounds));
    }

    #[test]
    fn the_stall_budget_defaults_to_the_forwarders_and_has_its_bounds() {
        let crd = serde_json::to_value(BrokerConnection::crd()).unwrap_or_default();
        let field = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
            ["properties"]["stallBudgetSeconds"];
        assert_eq!(field["default"].as_u64(), Some(defaults::STALL_BUDGET_SECS));
        let rules = |schema: &serde_json::Value| schema["x-kubernetes-validations"].to_string();
        let bounds = format!("self >= 0 && self <= {MAX_STALL_BUDGET_SECONDS}");
        assert!(rules(field).contains(&bounds));
        // A rule's own: optional, no default (unset: the connection's).
        let rule = spec_schema(&["stallBudgetSeconds"]);
        assert_eq!(rule["default"], serde_json::Value::Null);
        assert!(rules(&rule).contains(&bounds));
    }

    #[test]
    fn the_filter_bound_is_the_documented_one() {
        let crd = serde_json::to_value(ForwardingRule::crd()).unwrap_or_default();
        let items = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
            ["properties"]["mqtt"]["properties"]["topics"]["items"];
        assert_eq!(
            items["maxLength"].as_u64(),
            Some(crate::topic::CRD_MAX_FILTER_CHARS as u64)
        );
    }
}
