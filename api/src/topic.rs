//! MQTT topic filters (MQTT 3.1.1 §4.7 / MQTT 5 §4.7) and Kafka topic names.

use std::fmt;

/// A validated MQTT topic filter, matched level by level.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicFilter {
    text: String,
    levels: Vec<Level>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Level {
    Exact(String),
    /// `+`: exactly one level.
    Single,
    /// `#`: this level and every level below it (also the parent itself).
    Multi,
}

/// Why a string is not a valid MQTT topic filter.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FilterError {
    #[error("is empty")]
    Empty,
    #[error("is longer than 65535 bytes")]
    TooLong,
    #[error("contains a NUL character")]
    Nul,
    #[error("'#' must be the last level and stand alone in its level")]
    MultiLevelMisplaced,
    #[error("'+' must occupy a whole level")]
    SingleLevelMisplaced,
}

impl TopicFilter {
    pub fn parse(text: &str) -> Result<Self, FilterError> {
        if text.is_empty() {
            return Err(FilterError::Empty);
        }
        if text.len() > 65535 {
            return Err(FilterError::TooLong);
        }
        if text.contains('\0') {
            return Err(FilterError::Nul);
        }
        let parts: Vec<&str> = text.split('/').collect();
        let last = parts.len() - 1;
        let mut levels = Vec::with_capacity(parts.len());
        for (i, part) in parts.iter().enumerate() {
            let level = match *part {
                "#" if i == last => Level::Multi,
                "+" => Level::Single,
                p if p.contains('#') => return Err(FilterError::MultiLevelMisplaced),
                p if p.contains('+') => return Err(FilterError::SingleLevelMisplaced),
                p => Level::Exact(p.to_owned()),
            };
            levels.push(level);
        }
        Ok(Self {
            text: text.to_owned(),
            levels,
        })
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// Whether a concrete topic name matches this filter. Topics starting with `$` are not
    /// matched by a filter whose first level is a wildcard (§4.7.2).
    pub fn matches(&self, topic: &str) -> bool {
        if topic.starts_with('$')
            && matches!(self.levels.first(), Some(Level::Single | Level::Multi))
        {
            return false;
        }
        let mut parts = topic.split('/');
        for level in &self.levels {
            match level {
                Level::Multi => return true,
                Level::Single => {
                    if parts.next().is_none() {
                        return false;
                    }
                }
                Level::Exact(expected) => match parts.next() {
                    Some(part) if part == expected => {}
                    _ => return false,
                },
            }
        }
        parts.next().is_none()
    }
}

impl fmt::Display for TopicFilter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// Why a string is not a legal Kafka topic name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KafkaTopicError {
    #[error("is empty")]
    Empty,
    #[error("is longer than 249 characters")]
    TooLong,
    #[error("may not be '.' or '..'")]
    Dots,
    #[error("may contain only ASCII letters, digits, '.', '_' and '-'")]
    IllegalCharacter,
}

/// Kafka's own rule for topic names (`org.apache.kafka.common.internals.Topic.validate`).
pub fn validate_kafka_topic(name: &str) -> Result<(), KafkaTopicError> {
    if name.is_empty() {
        return Err(KafkaTopicError::Empty);
    }
    if name.len() > 249 {
        return Err(KafkaTopicError::TooLong);
    }
    if name == "." || name == ".." {
        return Err(KafkaTopicError::Dots);
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        return Err(KafkaTopicError::IllegalCharacter);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(filter: &str, topic: &str) -> bool {
        TopicFilter::parse(filter)
            .map(|f| f.matches(topic))
            .unwrap_or_else(|e| panic!("{filter}: {e}"))
    }

    #[test]
    fn exact_and_single_level() {
        assert!(m("a/b", "a/b"));
        assert!(!m("a/b", "a/b/c"));
        assert!(!m("a/b", "a"));
        assert!(m("a/+/c", "a/x/c"));
        assert!(m("a/+", "a/"));
        assert!(!m("a/+", "a"));
        assert!(!m("a/+/c", "a/x/y/c"));
        assert!(m("+/+", "/x"));
        assert!(m("+", "x"));
        assert!(!m("+", "x/y"));
    }

    #[test]
    fn multi_level_includes_parent() {
        assert!(m("a/#", "a"));
        assert!(m("a/#", "a/b/c"));
        assert!(m("#", "a/b"));
        assert!(m("#", "/"));
        assert!(!m("a/#", "b/a"));
    }

    #[test]
    fn dollar_topics_not_matched_by_leading_wildcards() {
        assert!(!m("#", "$SYS/broker/load"));
        assert!(!m("+/broker/load", "$SYS/broker/load"));
        assert!(m("$SYS/#", "$SYS/broker/load"));
        assert!(m("$SYS/+/load", "$SYS/broker/load"));
    }

    #[test]
    fn invalid_filters_say_why() {
        assert_eq!(TopicFilter::parse(""), Err(FilterError::Empty));
        assert_eq!(
            TopicFilter::parse("a/#/b"),
            Err(FilterError::MultiLevelMisplaced)
        );
        assert_eq!(
            TopicFilter::parse("a/b#"),
            Err(FilterError::MultiLevelMisplaced)
        );
        assert_eq!(
            TopicFilter::parse("a/b+/c"),
            Err(FilterError::SingleLevelMisplaced)
        );
        assert_eq!(TopicFilter::parse("a\0"), Err(FilterError::Nul));
    }

    #[test]
    fn kafka_topic_names() {
        assert!(validate_kafka_topic("telemetry.plant-1_raw").is_ok());
        assert_eq!(
            validate_kafka_topic("a b"),
            Err(KafkaTopicError::IllegalCharacter)
        );
        assert_eq!(
            validate_kafka_topic("a/b"),
            Err(KafkaTopicError::IllegalCharacter)
        );
        assert_eq!(validate_kafka_topic(".."), Err(KafkaTopicError::Dots));
        assert_eq!(validate_kafka_topic(""), Err(KafkaTopicError::Empty));
        assert_eq!(
            validate_kafka_topic(&"x".repeat(250)),
            Err(KafkaTopicError::TooLong)
        );
    }
}
