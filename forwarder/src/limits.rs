//! Each target topic's `max.message.bytes`, learned from Kafka, so that a record that may be
//! too large for its topic is produced alone (`window::TargetSpec::alone`): Kafka then never
//! refuses a batch holding other records of the topic, and no later record lands first.
//!
//! `TopicLimits` is the pipeline's pure cache; `learn` (at the bottom) asks Kafka.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use ferry_api::config::KafkaConfig;
use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
use rdkafka::client::DefaultClientContext;
use tokio::sync::mpsc;
use tracing::warn;

use crate::record::BATCH_OVERHEAD;

/// How often the known limits are asked again (a topic's limit may be changed live).
pub const REFRESH_INTERVAL: Duration = Duration::from_secs(60);

/// What Kafka answered about a topic's limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Learned {
    /// Its `max.message.bytes` (the topic's, else the broker's `message.max.bytes`).
    Limit(usize),
    /// Kafka would not say (not authorized to describe the topic, it does not exist yet, a
    /// timeout): asked again at the next refresh.
    Unavailable,
}

/// How a record of a topic is judged before it is produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Judgement {
    /// Go alone if the record may exceed this many bytes.
    Above(usize),
    /// Nothing the producer sends can exceed the topic's limit, or the limit is unavailable:
    /// as any record (a refusal is then judged again alone, after the fact).
    Never,
    /// The limit is being asked: every record goes alone until it is known.
    Always,
}

#[derive(Debug)]
pub struct TopicLimits {
    learned: HashMap<Arc<str>, Learned>,
    /// Asked, not yet answered.
    asked: HashSet<Arc<str>>,
    /// To ask: taken by `take_asks`.
    to_ask: Vec<Arc<str>>,
    /// The producer's `message.max.bytes`: librdkafka refuses a larger record itself, alone.
    producer_max: usize,
}

impl TopicLimits {
    pub fn new(producer_max: usize) -> Self {
        Self {
            learned: HashMap::new(),
            asked: HashSet::new(),
            to_ask: Vec::new(),
            producer_max,
        }
    }

    /// How a record of `topic` is judged; a topic never seen is asked about.
    pub fn judge(&mut self, topic: &Arc<str>) -> Judgement {
        match self.learned.get(topic) {
            // A batch of one record at the producer's limit fits: no record can be refused.
            Some(Learned::Limit(limit))
                if *limit >= self.producer_max.saturating_add(2 * BATCH_OVERHEAD) =>
            {
                Judgement::Never
            }
            Some(Learned::Limit(limit)) => Judgement::Above(*limit),
            Some(Learned::Unavailable) => Judgement::Never,
            None => {
                if self.asked.insert(Arc::clone(topic)) {
                    self.to_ask.push(Arc::clone(topic));
                }
                Judgement::Always
            }
        }
    }

    /// Kafka refused a record of `topic` as too large: its limit may have been lowered.
    pub fn refused(&mut self, topic: &Arc<str>) {
        if self.learned.contains_key(topic) && self.asked.insert(Arc::clone(topic)) {
            self.to_ask.push(Arc::clone(topic));
        }
    }

    /// Every topic learned, to ask again (`REFRESH_INTERVAL`); a topic asked already is not.
    pub fn refresh(&mut self) {
        for topic in self.learned.keys() {
            if self.asked.insert(Arc::clone(topic)) {
                self.to_ask.push(Arc::clone(topic));
            }
        }
    }

    pub fn take_asks(&mut self) -> Vec<Arc<str>> {
        std::mem::take(&mut self.to_ask)
    }

    pub fn learned(&mut self, topic: Arc<str>, learned: Learned) {
        self.asked.remove(&topic);
        self.learned.insert(topic, learned);
    }
}

/// Answers the pipeline's questions about topics' limits until either side is gone: each
/// batch of asks is one DescribeConfigs request (its answer, per topic, is the topic's
/// `max.message.bytes`, or the broker's `message.max.bytes` it inherits).
pub async fn learn(
    kafka: KafkaConfig,
    mut asks: mpsc::UnboundedReceiver<Vec<Arc<str>>>,
    answers: mpsc::UnboundedSender<(Arc<str>, Learned)>,
) {
    let admin: AdminClient<DefaultClientContext> = match crate::kafka::client_config(&kafka)
        .create()
    {
        Ok(admin) => admin,
        Err(e) => {
            warn!(error = %e, "cannot create a kafka admin client; topics' max.message.bytes stay unknown, and a record too large for its topic may be judged only after a batch with others was refused");
            while let Some(topics) = asks.recv().await {
                for topic in topics {
                    let _ = answers.send((topic, Learned::Unavailable));
                }
            }
            return;
        }
    };
    let options = AdminOptions::new().request_timeout(Some(Duration::from_secs(10)));
    while let Some(mut topics) = asks.recv().await {
        while let Ok(more) = asks.try_recv() {
            topics.extend(more);
        }
        let specifiers: Vec<ResourceSpecifier<'_>> = topics
            .iter()
            .map(|t| ResourceSpecifier::Topic(t))
            .collect();
        let described = admin.describe_configs(&specifiers, &options).await;
        let mut results = match described {
            Ok(results) => results.into_iter().map(Some).collect(),
            Err(e) => {
                warn!(error = %e, "cannot describe kafka topics' configs; asked again later");
                Vec::new()
            }
        };
        results.resize_with(topics.len(), || None);
        for (topic, result) in topics.into_iter().zip(results) {
            let limit = result.and_then(Result::ok).and_then(|resource| {
                resource
                    .get("max.message.bytes")
                    .and_then(|e| e.value.as_deref())
                    .and_then(|v| v.parse::<usize>().ok())
            });
            let learned = limit.map_or(Learned::Unavailable, Learned::Limit);
            if answers.send((topic, learned)).is_err() {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_topic_is_asked_about_once_and_its_records_go_alone_until_its_limit_is_known() {
        let mut limits = TopicLimits::new(1_000_000);
        let a: Arc<str> = Arc::from("a");
        assert_eq!(limits.judge(&a), Judgement::Always);
        assert_eq!(limits.judge(&a), Judgement::Always);
        assert_eq!(limits.take_asks(), vec![Arc::clone(&a)], "asked once");
        limits.learned(Arc::clone(&a), Learned::Limit(65_536));
        assert_eq!(limits.judge(&a), Judgement::Above(65_536));
        assert!(limits.take_asks().is_empty());
    }

    #[test]
    fn a_limit_the_producer_cannot_reach_or_cannot_learn_judges_nothing() {
        let mut limits = TopicLimits::new(1_000_000);
        let (big, secret): (Arc<str>, Arc<str>) = (Arc::from("big"), Arc::from("secret"));
        limits.judge(&big);
        limits.judge(&secret);
        limits.learned(Arc::clone(&big), Learned::Limit(1_048_588));
        limits.learned(Arc::clone(&secret), Learned::Unavailable);
        assert_eq!(limits.judge(&big), Judgement::Never);
        assert_eq!(limits.judge(&secret), Judgement::Never);
    }

    #[test]
    fn a_refusal_and_the_refresh_ask_again() {
        let mut limits = TopicLimits::new(1_000_000);
        let a: Arc<str> = Arc::from("a");
        limits.judge(&a);
        limits.take_asks();
        limits.learned(Arc::clone(&a), Learned::Limit(65_536));
        limits.refused(&a);
        limits.refused(&a);
        assert_eq!(limits.take_asks(), vec![Arc::clone(&a)], "once while asked");
        limits.refresh();
        assert!(limits.take_asks().is_empty(), "still asked");
        limits.learned(Arc::clone(&a), Learned::Limit(1000));
        limits.refresh();
        assert_eq!(limits.take_asks(), vec![Arc::clone(&a)]);
        assert_eq!(limits.judge(&a), Judgement::Above(1000), "the old answer meanwhile");
    }
}
