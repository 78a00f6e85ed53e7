//! Real Mosquitto and Apache Kafka processes for Ferry's integration tests, demo and benchmarks.
//!
//! Each broker runs on a free loopback port with its own data dir and is stopped when its value
//! is dropped — also when a test panics — and, through `PR_SET_PDEATHSIG`, when the process that
//! started it dies. `e2e/install.sh` installs Mosquitto and fetches Kafka's jars (cached).
//!
//! For fault injection: [`FaultProxy`] breaks and heals the network between a client and a
//! broker ([`KafkaOptions::proxy`] puts a Kafka behind one), [`KafkaOptions::acls`] lets a test
//! grant and revoke a user's rights, and [`KafkaCluster`] runs several Kafka nodes to kill.

pub use rumqttc;

pub mod cluster;
mod credentials;
pub mod fault_proxy;
mod http;
mod kafka;
mod kafka_cluster;
mod kafka_node;
pub mod kube;
mod logs;
pub mod manifests;
mod messages;
pub mod metrics;
mod mosquitto;
mod pki;
mod process;
pub mod registry;
pub mod schema_registry;
mod wait;

pub use credentials::{check_credential, check_password};
pub use fault_proxy::{FaultProxy, ProxyMode};
pub use http::{HttpOptions, http_get, http_get_at, http_get_ok, http_request};
pub use kafka::{
    KAFKA_ACL_PROPS, KAFKA_SASL_MECHANISMS, KAFKA_VERSION, Kafka, KafkaOptions, SaslSsl,
};
pub use kafka_cluster::{ClusterOptions, KafkaCluster};
pub use logs::flat_json_log;
pub use messages::{Record, disconnect, probe_session, publish, publish_as};
pub use mosquitto::{
    MOSQUITTO_MAX_INFLIGHT, MOSQUITTO_MAX_QUEUED, Mosquitto, MosquittoOptions, TlsListener,
};
pub use pki::{CLIENT_CN, KeyType, Pki};
pub use process::{Placement, cache_dir, free_port};
pub use registry::Registry;
pub use schema_registry::{SchemaRegistry, SchemaRegistryOptions, SchemaType};
pub use wait::{Condition, WAIT_POLL, wait_until, wait_until_async, wait_until_some};
