//! What each target topic refuses, learned from Kafka: its `max.message.bytes`, and whether
//! it is compacted (a record without a key is invalid there). A record that may be refused is
//! produced alone (`window::TargetSpec::alone`): Kafka then never refuses a batch holding
//! other records of the topic, and no later record lands first.
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
    /// Its `max.message.bytes` (the topic's, else the broker's `message.max.bytes`), and
    /// whether its `cleanup.policy` compacts.
    Known { max_bytes: usize, compacted: bool },
    /// Kafka would not say (not authorized to describe the topic, it does not exist yet, a
    /// timeout): asked again at the next refresh.
    Unavailable,
}

/// How a record of a topic is judged before it is produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Judgement {
    /// Go alone if the record may exceed `above` bytes (`None`: nothing the producer sends
    /// can), or, on a compacted topic, has no key.
    Check {
        above: Option<usize>,
        compacted: bool,
    },
    /// Unavailable: as any record (a refusal is then judged again alone, after the fact).
    Never,
    /// Being asked: every record goes alone until it is known (then the records still
    /// waiting are judged again: `window::Window::limit_known`).
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
            Some(&Learned::Known {
                max_bytes,
                compacted,
            }) => Judgement::Check {
                // A batch of one record at the producer's limit fits: no record can exceed it.
                above: (max_bytes < self.producer_max.saturating_add(2 * BATCH_OVERHEAD))
                    .then_some(max_bytes),
                compacted,
            },
            Some(Learned::Unavailable) => Judgement::Never,
            None => {
                if self.asked.insert(Arc::clone(topic)) {
                    self.to_ask.push(Arc::clone(topic));
                }
                Judgement::Always
            }
        }
    }

    /// Kafka refused a record of `topic` as too large or invalid: its config may have changed.
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

    /// Kafka's answer about `topic`; true when it is the first (its records were judged
    /// `Always` until now).
    pub fn learned(&mut self, topic: Arc<str>, learned: Learned) -> bool {
        self.asked.remove(&topic);
        self.learned.insert(topic, learned).is_none()
    }
}

/// The learning task's ends: the pipeline's asks (topics, in batches) and its answers.
pub type Asks = mpsc::UnboundedReceiver<Vec<Arc<str>>>;
pub type Answers = mpsc::UnboundedSender<(Arc<str>, Learned)>;

/// Answers the pipeline's questions about topics until either side is gone: each batch of
/// asks is one DescribeConfigs request (its answer, per topic, is the topic's
/// `max.message.bytes`, or the broker's `message.max.bytes` it inherits, and its
/// `cleanup.policy`).
pub async fn learn(kafka: KafkaConfig, mut asks: Asks, answers: Answers) {
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
        let specifiers: Vec<ResourceSpecifier<'_>> =
            topics.iter().map(|t| ResourceSpecifier::Topic(t)).collect();
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
            let learned = result
                .and_then(Result::ok)
                .and_then(|resource| {
                    let value = |name| resource.get(name).and_then(|e| e.value.as_deref());
                    Some(Learned::Known {
                        max_bytes: value("max.message.bytes")?.parse().ok()?,
                        compacted: value("cleanup.policy").is_some_and(|p| p.contains("compact")),
                    })
                })
                .unwrap_or(Learned::Unavailable);
            if answers.send((topic, learned)).is_err() {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn known(max_bytes: usize, compacted: bool) -> Learned {
        Learned::Known {
            max_bytes,
            compacted,
        }
    }

    #[test]
    fn a_topic_is_asked_about_once_and_its_records_go_alone_until_its_limit_is_known() {
        let mut limits = TopicLimits::new(1_000_000);
        let a: Arc<str> = Arc::from("a");
        assert_eq!(limits.judge(&a), Judgement::Always);
        assert_eq!(limits.judge(&a), Judgement::Always);
        assert_eq!(limits.take_asks(), vec![Arc::clone(&a)], "asked once");
        limits.learned(Arc::clone(&a), known(65_536, true));
        assert_eq!(
            limits.judge(&a),
            Judgement::Check {
                above: Some(65_536),
                compacted: true
            }
        );
        assert!(limits.take_asks().is_empty());
    }

    #[test]
    fn a_limit_the_producer_cannot_reach_or_cannot_learn_judges_nothing() {
        let mut limits = TopicLimits::new(1_000_000);
        let (big, secret): (Arc<str>, Arc<str>) = (Arc::from("big"), Arc::from("secret"));
        limits.judge(&big);
        limits.judge(&secret);
        limits.learned(Arc::clone(&big), known(1_048_588, false));
        limits.learned(Arc::clone(&secret), Learned::Unavailable);
        assert_eq!(
            limits.judge(&big),
            Judgement::Check {
                above: None,
                compacted: false
            }
        );
        assert_eq!(limits.judge(&secret), Judgement::Never);
    }

    #[test]
    fn a_refusal_and_the_refresh_ask_again() {
        let mut limits = TopicLimits::new(1_000_000);
        let a: Arc<str> = Arc::from("a");
        limits.judge(&a);
        limits.take_asks();
        limits.learned(Arc::clone(&a), known(65_536, false));
        limits.refused(&a);
        limits.refused(&a);
        assert_eq!(limits.take_asks(), vec![Arc::clone(&a)], "once while asked");
        limits.refresh();
        assert!(limits.take_asks().is_empty(), "still asked");
        limits.learned(Arc::clone(&a), known(1000, false));
        limits.refresh();
        assert_eq!(limits.take_asks(), vec![Arc::clone(&a)]);
        assert_eq!(
            limits.judge(&a),
            Judgement::Check {
                above: Some(1000),
                compacted: false
            },
            "the old answer meanwhile"
        );
    }
}
