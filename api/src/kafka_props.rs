//! librdkafka producer properties in `kafka.config` (the CRD's `spec.kafka.config`) that the
//! forwarder or its guarantee cannot live with. One list, read by the forwarder's config
//! validation and turned into the CRD's CEL rules, so both refuse the same settings.
//!
//! Three kinds:
//! - [`MANAGED`]: set from other fields (bootstrap servers, TLS, SASL).
//! - [`UNSUPPORTED`]: the forwarder cannot work with them at all; always refused.
//! - [`WEAKER`]: they weaken at-least-once or in-order delivery; refused unless the opt-out
//!   (`kafka.allow_weaker_delivery`, CRD `spec.kafka.allowWeakerDelivery`) is set.
//!
//! Everything else passes through; librdkafka itself refuses unknown properties and bad values
//! when the producer is configured (the forwarder checks that before it starts).

/// A property the forwarder cannot work with, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unsupported {
    pub key: &'static str,
    pub why: &'static str,
}

const CONSUMER_ONLY: &str = "is a consumer property: the forwarder only produces";

/// Always refused. Consumer-only properties are refused rather than ignored (as librdkafka
/// does, with a warning) because setting one means the config was written for something else.
pub const UNSUPPORTED: &[Unsupported] = &[
    Unsupported {
        key: "transactional.id",
        why: "makes a transactional producer, and the forwarder runs no transactions: every record would wait forever",
    },
    Unsupported {
        key: "delivery.report.only.error",
        why: "stops the delivery reports of records Kafka took, and the forwarder acknowledges MQTT only on those: nothing would ever be acknowledged",
    },
    Unsupported {
        key: "group.id",
        why: CONSUMER_ONLY,
    },
    Unsupported {
        key: "group.instance.id",
        why: CONSUMER_ONLY,
    },
    Unsupported {
        key: "enable.auto.commit",
        why: CONSUMER_ONLY,
    },
    Unsupported {
        key: "auto.offset.reset",
        why: CONSUMER_ONLY,
    },
    Unsupported {
        key: "isolation.level",
        why: CONSUMER_ONLY,
    },
];

/// A setting that weakens the guarantee unless its value is one of `safe`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Weaker {
    /// The property and its librdkafka aliases.
    pub keys: &'static [&'static str],
    /// Values that keep the guarantee, compared ASCII case-insensitively (librdkafka does).
    pub safe: &'static [&'static str],
    /// What the safe values are, for messages.
    pub expected: &'static str,
    /// What is lost otherwise.
    pub why: &'static str,
}

/// `acks` below `all` lets Kafka confirm a record only one replica (or none) has: a leader
/// failure loses it after the forwarder acknowledged the message to MQTT.
pub const ACKS: Weaker = Weaker {
    keys: &["acks", "request.required.acks"],
    safe: &["all", "-1"],
    expected: "all (or -1)",
    why: "with fewer, a record Kafka confirmed is lost when its partition leader fails, after the message was acknowledged to MQTT",
};

/// Without idempotence, librdkafka's own retries can duplicate and reorder records of a
/// partition: the in-order guarantee is gone.
pub const IDEMPOTENCE: Weaker = Weaker {
    keys: &["enable.idempotence"],
    safe: &["true", "t", "1"],
    expected: "true",
    why: "without it, retries inside librdkafka duplicate and reorder records of a partition",
};

/// A record that times out inside librdkafka fails; the forwarder then produces it again
/// (`forwarder/src/kafka.rs` classifies a timeout as retriable), so nothing is lost, but the
/// records of its partition already handed over after it land before it, and one the broker
/// did take is written twice. Ferry's default `0` never times out.
pub const MESSAGE_TIMEOUT: Weaker = Weaker {
    keys: &["message.timeout.ms", "delivery.timeout.ms"],
    safe: &["0"],
    expected: "0 (never time out)",
    why: "a record that times out is produced again by the forwarder, after later records of its partition and possibly twice",
};

/// `random` puts each record on any partition, whatever its key: records of one key (one MQTT
/// topic, by default) land in different partitions, out of order. The other partitioners hash
/// the key (the `*_random` ones spread only records without a key, which have no order).
pub const PARTITIONER: Weaker = Weaker {
    keys: &["partitioner"],
    safe: &[
        "consistent_random",
        "consistent",
        "murmur2_random",
        "murmur2",
        "fnv1a_random",
        "fnv1a",
    ],
    expected: "a partitioner that hashes the key (consistent_random, the default, consistent, murmur2, murmur2_random, fnv1a or fnv1a_random)",
    why: "random spreads the records of one key over partitions, so they are no longer in order",
};

/// Every guarded setting, in the order the CRD's rules are generated.
pub const WEAKER: [Weaker; 4] = [ACKS, IDEMPOTENCE, MESSAGE_TIMEOUT, PARTITIONER];

/// Set from `bootstrap_servers`, `tls` and `sasl`.
pub fn is_managed(key: &str) -> bool {
    key == "bootstrap.servers"
        || key == "security.protocol"
        || key.starts_with("ssl.")
        || key.starts_with("sasl.")
}

/// Why `key` can never be set, if it cannot.
pub fn unsupported(key: &str) -> Option<&'static str> {
    UNSUPPORTED.iter().find(|u| u.key == key).map(|u| u.why)
}

/// The guard a `key = value` breaks, if any.
pub fn weakens(key: &str, value: &str) -> Option<&'static Weaker> {
    WEAKER
        .iter()
        .find(|w| w.keys.contains(&key) && !w.safe.iter().any(|s| s.eq_ignore_ascii_case(value)))
}

/// `queue.buffering.max.messages` below the in-flight window: the window alone would fill the
/// producer queue, and every message beyond it waits on a full queue. `0` means no limit.
pub const QUEUE_MAX_MESSAGES: &str = "queue.buffering.max.messages";

/// librdkafka's queue in kilobytes: Ferry sets it from `mqtt.max_inflight_bytes`.
pub const QUEUE_MAX_KBYTES: &str = "queue.buffering.max.kbytes";

/// Why a `queue.buffering.max.kbytes` value cannot hold a message of `max_message_bytes`.
pub fn queue_bytes_too_small(value: &str, max_message_bytes: u32) -> Option<String> {
    let kbytes = value.parse::<u64>().ok()?;
    (kbytes.saturating_mul(1024) < u64::from(max_message_bytes)).then(|| {
        format!(
            "{kbytes} KiB cannot hold the largest message (mqtt.max_message_bytes, {max_message_bytes} bytes): its records would wait on a full producer queue forever; leave it unset (Ferry sets it from mqtt.max_inflight_bytes) or raise it"
        )
    })
}

/// Why a `queue.buffering.max.messages` value does not fit a window of `max_inflight`.
pub fn queue_too_small(value: &str, max_inflight: u16) -> Option<String> {
    let n = (!value.is_empty() && value.len() <= 10 && value.bytes().all(|b| b.is_ascii_digit()))
        .then(|| value.parse::<u64>().ok())
        .flatten();
    match n {
        None => Some(format!("{value:?} is not a whole number")),
        Some(n) if n != 0 && n < u64::from(max_inflight) => Some(format!(
            "{n} is smaller than the in-flight window ({max_inflight}): messages beyond it would wait on a full producer queue; use 0 (no limit) or at least the window"
        )),
        Some(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weaker_settings_are_recognised_by_every_alias_and_case() {
        assert_eq!(weakens("acks", "1"), Some(&ACKS));
        assert_eq!(weakens("request.required.acks", "0"), Some(&ACKS));
        assert_eq!(weakens("acks", "ALL"), None);
        assert_eq!(weakens("acks", "-1"), None);
        assert_eq!(weakens("enable.idempotence", "false"), Some(&IDEMPOTENCE));
        assert_eq!(weakens("enable.idempotence", "True"), None);
        assert_eq!(
            weakens("delivery.timeout.ms", "30000"),
            Some(&MESSAGE_TIMEOUT)
        );
        assert_eq!(weakens("message.timeout.ms", "0"), None);
        assert_eq!(weakens("linger.ms", "0"), None);
        assert_eq!(weakens("partitioner", "random"), Some(&PARTITIONER));
        assert_eq!(weakens("partitioner", "murmur2_random"), None);
        assert_eq!(weakens("partitioner", "Consistent"), None);
    }

    #[test]
    fn unsupported_and_managed_keys() {
        assert!(unsupported("transactional.id").is_some());
        assert!(unsupported("group.id").is_some());
        assert!(unsupported("linger.ms").is_none());
        assert!(is_managed("sasl.password") && is_managed("ssl.ca.location"));
        assert!(!is_managed("socket.keepalive.enable"));
    }

    #[test]
    fn queue_must_hold_the_window() {
        assert_eq!(queue_too_small("100000", 1000), None);
        assert_eq!(queue_too_small("1000", 1000), None);
        assert_eq!(queue_too_small("0", 1000), None);
        assert!(queue_too_small("999", 1000).is_some());
        assert!(queue_too_small("lots", 1000).is_some());
        assert!(queue_too_small("-5", 1000).is_some());
    }
}
