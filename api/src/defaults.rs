//! The forwarder config's defaults, each written once. Serde fills them into a Ferry-format file,
//! the legacy mapping and the operator's renderer use them too, so changing one here changes it
//! everywhere (and docs/configuration.md's table of defaults must follow).

/// `mqtt.port`.
pub const MQTT_PORT: u16 = 1883;
/// `mqtt.keep_alive_secs`.
pub const KEEP_ALIVE_SECS: u16 = 30;
/// `mqtt.max_inflight`: the in-flight window.
pub const MAX_INFLIGHT: u16 = 1000;
/// `mqtt.max_inflight_bytes`: the window in bytes. With librdkafka's queue bounded by the same,
/// a forwarder holds about 32 MiB of messages at most.
pub const MAX_INFLIGHT_BYTES: u64 = 16 * 1024 * 1024;
/// `mqtt.max_message_bytes`: 1 MiB, about Kafka's default `max.message.bytes`, so that nothing
/// a default topic takes is refused.
pub const MAX_MESSAGE_BYTES: u32 = 1024 * 1024;
/// `mqtt.reconnect_min_ms`.
pub const RECONNECT_MIN_MS: u64 = 100;
/// `mqtt.reconnect_max_ms`.
pub const RECONNECT_MAX_MS: u64 = 10_000;
/// `rules[].mqtt.qos`.
pub const QOS: u8 = 1;
/// `rules[].kafka.headers.prefix`.
pub const HEADER_PREFIX: &str = "mqtt.";
/// `stall_budget_secs`: five minutes. Long enough for a fix in the usual course (a topic
/// created by a GitOps sync, an ACL granted during a rollout) to land before anything goes to
/// a dead-letter topic; short enough that one tenant's missing topic stops its neighbours for
/// minutes, not until someone notices.
pub const STALL_BUDGET_SECS: u64 = 300;
/// `shutdown_timeout_secs`.
pub const SHUTDOWN_TIMEOUT_SECS: u64 = 30;
/// `log.level`.
pub const LOG_LEVEL: &str = "info";
/// The port of `http.listen` (`0.0.0.0:8080`): probes, metrics, `/status`.
pub const HTTP_PORT: u16 = 8080;
