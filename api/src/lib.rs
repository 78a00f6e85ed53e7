//! Types shared by Ferry's operator and forwarder, with no dependency on librdkafka or on
//! Kubernetes client code: the forwarder's config contract, its status contract, and topic
//! rules.

pub mod addr;
pub mod config;
#[cfg(feature = "crd")]
pub mod crd;
pub mod credentials;
pub mod defaults;
pub mod env;
pub mod expr;
pub mod kafka_props;
mod legacy;
pub mod load;
#[cfg(feature = "metrics")]
pub mod metrics;
pub mod status;
pub mod topic;
pub mod validate;

pub use config::{
    ConfigError, ForwarderConfig, KeyStrategy, PayloadFormat, Problem, ProblemKind, Rule,
    SchemaFormat, SchemaRegistry, ValueEncoding,
};
pub use load::{LoadOptions, Loaded, SourceFormat, load_str, load_str_reading, load_with};
pub use topic::{TopicFilter, TopicTemplate, validate_kafka_topic};
pub use validate::{KafkaTopic, RuleExpressions, ValidConfig};
