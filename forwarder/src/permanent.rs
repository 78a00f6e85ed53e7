//! The forwarder's one word for an error retrying cannot fix: *permanent*. Everything else is
//! retried. Where a permanent error meets a decision:
//! - A record Kafka can never take as it is (`window::Outcome::Permanent`): its rule's
//!   dead-letter topic and `on_unwritable` decide.
//! - The MQTT broker's certificate or refusal before the first connection
//!   (`mqtt::PermanentError`), and Kafka's certificate or authentication before Kafka was first
//!   reached (`kafka::PermanentError`): the forwarder stops (exit 1), naming the broker. Later,
//!   the same errors are retried: the configuration worked before.
//!
//! librdkafka's own "fatal" error is not permanent: the producer instance is replaced and its
//! records re-sent (`kafka::Classified::ReplaceProducer`).

/// What librdkafka reports as an error, and keeps retrying, although retrying cannot fix it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum KafkaKind {
    #[error("TLS certificate verification failed")]
    Certificate,
    #[error("authentication failed")]
    Authentication,
}

/// A permanent Kafka failure as librdkafka reported it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind}: {reason}")]
pub struct KafkaFailure {
    pub kind: KafkaKind,
    /// librdkafka's words.
    pub reason: String,
}
