//! MQTT topic filters (MQTT 3.1.1 §4.7 / MQTT 5 §4.7) and Kafka topic names.

use std::borrow::Cow;
use std::fmt;

/// A validated MQTT topic filter, matched level by level. A shared subscription
/// (`$share/<group>/<filter>`, MQTT 5 §4.8.2, also honoured by brokers for 3.1.1) matches what
/// its inner filter matches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicFilter {
    text: String,
    share_group: Option<String>,
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
    #[error(
        "a shared subscription must be $share/<group>/<filter>, the group without '/', '+' or '#'"
    )]
    BadShare,
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
        let (share_group, inner) = match text.strip_prefix("$share/") {
            Some(rest) => {
                let (group, inner) = rest.split_once('/').ok_or(FilterError::BadShare)?;
                if !is_valid_share_group(group) || inner.is_empty() {
                    return Err(FilterError::BadShare);
                }
                (Some(group.to_owned()), inner)
            }
            None => (None, text),
        };
        let parts: Vec<&str> = inner.split('/').collect();
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
            share_group,
            levels,
        })
    }

    /// The whole filter, as subscribed.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    pub fn share_group(&self) -> Option<&str> {
        self.share_group.as_deref()
    }

    /// How many levels every matching topic has at least, and whether it may have more (`#`).
    pub fn depth(&self) -> (usize, bool) {
        match self.levels.last() {
            // `a/#` also matches `a`.
            Some(Level::Multi) => (self.levels.len() - 1, true),
            _ => (self.levels.len(), false),
        }
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

impl TopicFilter {
    /// Whether some topic matches both filters. Shared-subscription prefixes are ignored (they
    /// say who receives, not what).
    pub fn overlaps(&self, other: &TopicFilter) -> bool {
        // Topics starting with '$' are not matched by a leading wildcard (§4.7.2).
        let dollar = |f: &TopicFilter| matches!(f.levels.first(), Some(Level::Exact(e)) if e.starts_with('$'));
        let wild = |f: &TopicFilter| matches!(f.levels.first(), Some(Level::Single | Level::Multi));
        if (dollar(self) && wild(other)) || (dollar(other) && wild(self)) {
            return false;
        }
        let (a, b) = (&self.levels, &other.levels);
        let mut i = 0;
        loop {
            match (a.get(i), b.get(i)) {
                (Some(Level::Multi), _) | (_, Some(Level::Multi)) => return true,
                (None, None) => return true,
                // `a/#` also matches `a`, handled above when the other side ends here.
                (None, Some(_)) | (Some(_), None) => return false,
                (Some(Level::Exact(x)), Some(Level::Exact(y))) if x != y => return false,
                _ => i += 1,
            }
        }
    }
}

impl fmt::Display for TopicFilter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// The longest topic filter the CRD accepts, in characters. The protocol allows 65535 UTF-8
/// bytes (and so does the forwarder); the CRD is bounded lower to keep its CEL rules cheap.
pub const CRD_MAX_FILTER_CHARS: usize = 1024;

/// Topic filters and how [`TopicFilter::parse`] judges them. Shared with the CRD's tests on a
/// real apiserver (`operator/tests/crd_validation.rs`), so the forwarder and admission agree.
pub const FILTER_VECTORS: &[(&str, Option<FilterError>)] = &[
    ("#", None),
    ("+", None),
    ("/", None),
    ("a/b", None),
    ("a//b", None),
    ("a/+/c", None),
    ("+/+", None),
    ("a/#", None),
    ("+/#", None),
    ("$SYS/#", None),
    ("$share", None),
    ("$sharefoo/x", None),
    ("$share/g/#", None),
    ("$share/g/+", None),
    ("$share/group.1/plant/+/t", None),
    ("spaces are allowed/+", None),
    ("\u{65e5}\u{672c}/+/\u{6e29}\u{5ea6}", None),
    ("", Some(FilterError::Empty)),
    ("a/#/b", Some(FilterError::MultiLevelMisplaced)),
    ("a/b#", Some(FilterError::MultiLevelMisplaced)),
    ("#/a", Some(FilterError::MultiLevelMisplaced)),
    ("a/##", Some(FilterError::MultiLevelMisplaced)),
    ("a/b+/c", Some(FilterError::SingleLevelMisplaced)),
    ("+a", Some(FilterError::SingleLevelMisplaced)),
    ("a/++", Some(FilterError::SingleLevelMisplaced)),
    ("a\0b", Some(FilterError::Nul)),
    ("$share/g", Some(FilterError::BadShare)),
    ("$share/g/", Some(FilterError::BadShare)),
    ("$share//a", Some(FilterError::BadShare)),
    ("$share/a+b/x", Some(FilterError::BadShare)),
    ("$share/a#b/x", Some(FilterError::BadShare)),
];

/// A shared-subscription group name: non-empty, without `/`, `+` or `#`.
pub fn is_valid_share_group(group: &str) -> bool {
    !group.is_empty() && !group.contains(['/', '+', '#'])
}

/// A Kafka topic name with optional placeholders for MQTT topic levels, counted from 0:
/// `telemetry.{1}` maps `plant/7/telemetry` to `telemetry.7`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TopicTemplate {
    parts: Vec<TemplatePart>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum TemplatePart {
    Text(String),
    Level(usize),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    #[error("has an unclosed '{{'")]
    Unclosed,
    #[error("has a '}}' without '{{'")]
    Unopened,
    #[error("has {{{0}}}: a placeholder is a topic level number, like {{1}}")]
    BadPlaceholder(String),
    #[error("{0}")]
    Name(KafkaTopicError),
}

/// Why a template gave no legal topic name for one MQTT topic.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    #[error("the MQTT topic has no level {0}")]
    MissingLevel(usize),
    #[error("level {0} of the MQTT topic is empty")]
    EmptyLevel(usize),
    #[error("the resolved name {name:?} is not a legal Kafka topic: it {reason}")]
    Illegal {
        name: String,
        reason: KafkaTopicError,
    },
}

impl TopicTemplate {
    pub fn parse(text: &str) -> Result<Self, TemplateError> {
        let mut parts = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            match rest.find(['{', '}']) {
                Some(i) if rest.as_bytes()[i] == b'}' => return Err(TemplateError::Unopened),
                Some(i) => {
                    if i > 0 {
                        parts.push(TemplatePart::Text(rest[..i].to_owned()));
                    }
                    let after = &rest[i + 1..];
                    let end = after.find('}').ok_or(TemplateError::Unclosed)?;
                    let inner = &after[..end];
                    let level = inner
                        .parse::<usize>()
                        .ok()
                        .filter(|_| inner.bytes().all(|b| b.is_ascii_digit()))
                        .ok_or_else(|| TemplateError::BadPlaceholder(inner.to_owned()))?;
                    parts.push(TemplatePart::Level(level));
                    rest = &after[end + 1..];
                }
                None => {
                    parts.push(TemplatePart::Text(rest.to_owned()));
                    rest = "";
                }
            }
        }
        let template = Self { parts };
        // The static parts must be legal on their own; a placeholder stands for at least one
        // legal character.
        let sample: String = template
            .parts
            .iter()
            .map(|p| match p {
                TemplatePart::Text(t) => t.as_str(),
                TemplatePart::Level(_) => "x",
            })
            .collect();
        validate_kafka_topic(&sample).map_err(TemplateError::Name)?;
        Ok(template)
    }

    /// The topic levels the template uses.
    pub fn levels(&self) -> impl Iterator<Item = usize> + '_ {
        self.parts.iter().filter_map(|p| match p {
            TemplatePart::Level(n) => Some(*n),
            TemplatePart::Text(_) => None,
        })
    }

    /// The name when the template has no placeholder.
    pub fn as_static(&self) -> Option<&str> {
        match self.parts.as_slice() {
            [TemplatePart::Text(t)] => Some(t),
            _ => None,
        }
    }

    pub fn resolve(&self, mqtt_topic: &str) -> Result<Cow<'_, str>, ResolveError> {
        if let Some(name) = self.as_static() {
            return Ok(Cow::Borrowed(name));
        }
        let levels: Vec<&str> = mqtt_topic.split('/').collect();
        let mut name = String::new();
        for part in &self.parts {
            match part {
                TemplatePart::Text(t) => name.push_str(t),
                TemplatePart::Level(n) => match levels.get(*n) {
                    None => return Err(ResolveError::MissingLevel(*n)),
                    Some(&"") => return Err(ResolveError::EmptyLevel(*n)),
                    Some(level) => name.push_str(level),
                },
            }
        }
        match validate_kafka_topic(&name) {
            Ok(()) => Ok(Cow::Owned(name)),
            Err(reason) => Err(ResolveError::Illegal { name, reason }),
        }
    }
}

impl fmt::Display for TopicTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for part in &self.parts {
            match part {
                TemplatePart::Text(t) => f.write_str(t)?,
                TemplatePart::Level(n) => write!(f, "{{{n}}}")?,
            }
        }
        Ok(())
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
    fn filters_follow_the_shared_vectors() {
        for (filter, expected) in FILTER_VECTORS {
            assert_eq!(
                TopicFilter::parse(filter).err(),
                expected.clone(),
                "{filter:?}"
            );
        }
        assert_eq!(
            TopicFilter::parse(&"a".repeat(65535)).err(),
            None,
            "the protocol's limit"
        );
        assert_eq!(
            TopicFilter::parse(&"a".repeat(65536)),
            Err(FilterError::TooLong)
        );
    }

    #[test]
    fn shared_subscriptions_match_their_inner_filter() {
        let f = TopicFilter::parse("$share/ferry/plant/+/temp").unwrap();
        assert_eq!(f.share_group(), Some("ferry"));
        assert_eq!(f.as_str(), "$share/ferry/plant/+/temp");
        assert!(f.matches("plant/7/temp"));
        assert!(!f.matches("$share/ferry/plant/7/temp"));
        for bad in ["$share/ferry", "$share//a", "$share/a+b/x", "$share/g/"] {
            assert_eq!(TopicFilter::parse(bad), Err(FilterError::BadShare), "{bad}");
        }
    }

    #[test]
    fn filter_overlap() {
        let o = |a: &str, b: &str| {
            let (fa, fb) = (
                TopicFilter::parse(a).unwrap(),
                TopicFilter::parse(b).unwrap(),
            );
            assert_eq!(fa.overlaps(&fb), fb.overlaps(&fa), "symmetric: {a} {b}");
            fa.overlaps(&fb)
        };
        assert!(o("a/+/c", "a/b/+"));
        assert!(o("a/#", "a"));
        assert!(o("#", "x/y/z"));
        assert!(o("a/b", "a/b"));
        assert!(o("$share/g/a/+", "a/b"));
        assert!(!o("a/b", "a/c"));
        assert!(!o("a/+", "a/b/c"));
        assert!(!o("a/+/c", "a/b/d"));
        assert!(!o("#", "$SYS/x"));
        assert!(o("$SYS/#", "$SYS/x"));
    }

    #[test]
    fn topic_templates_resolve_levels() {
        let t = TopicTemplate::parse("telemetry.{1}").unwrap();
        assert_eq!(t.resolve("plant/7/telemetry").unwrap(), "telemetry.7");
        assert_eq!(t.levels().collect::<Vec<_>>(), vec![1]);
        assert_eq!(t.to_string(), "telemetry.{1}");
        assert_eq!(
            t.resolve("plant"),
            Err(ResolveError::MissingLevel(1)),
            "a level the topic does not have"
        );
        assert!(matches!(
            t.resolve("plant/a b/telemetry"),
            Err(ResolveError::Illegal { .. })
        ));
        assert_eq!(t.resolve("plant//x"), Err(ResolveError::EmptyLevel(1)));
        let fixed = TopicTemplate::parse("plain").unwrap();
        assert_eq!(fixed.as_static(), Some("plain"));
        assert_eq!(fixed.resolve("any/thing").unwrap(), "plain");
        assert_eq!(
            TopicTemplate::parse("{0}.{2}-raw")
                .unwrap()
                .resolve("a/b/c")
                .unwrap(),
            "a.c-raw"
        );
    }

    #[test]
    fn bad_templates_say_why() {
        assert_eq!(TopicTemplate::parse("t.{1"), Err(TemplateError::Unclosed));
        assert_eq!(TopicTemplate::parse("t.1}"), Err(TemplateError::Unopened));
        assert_eq!(
            TopicTemplate::parse("t.{x}"),
            Err(TemplateError::BadPlaceholder("x".into()))
        );
        assert_eq!(
            TopicTemplate::parse("t.{+1}"),
            Err(TemplateError::BadPlaceholder("+1".into()))
        );
        assert_eq!(
            TopicTemplate::parse("a b.{1}"),
            Err(TemplateError::Name(KafkaTopicError::IllegalCharacter))
        );
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
