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
use ferry_kafka_settings::client_config;
use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
use rdkafka::client::DefaultClientContext;
use tokio::sync::mpsc;
use tracing::warn;

use crate::record::BATCH_OVERHEAD;

/// How often the known limits are asked again (a topic's limit may be changed live): those of
/// the topics written to since the last refresh only.
pub const REFRESH_INTERVAL: Duration = Duration::from_secs(60);
/// A topic not written to for this many refreshes is forgotten (asked again if it comes
/// back): with templated topics the topics met have no bound, the cache does.
const FORGET_AFTER_REFRESHES: u64 = 10;
/// Most topics in one DescribeConfigs request.
const TOPICS_PER_REQUEST: usize = 100;

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
    /// Each topic's answer, and the refresh round it was last judged in.
    learned: HashMap<Arc<str>, (Learned, u64)>,
    /// Counts refreshes.
    round: u64,
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
            round: 0,
            asked: HashSet::new(),
            to_ask: Vec::new(),
            producer_max,
        }
    }

    /// How a record of `topic` is judged; a topic never seen is asked about.
    pub fn judge(&mut self, topic: &Arc<str>) -> Judgement {
        let round = self.round;
        match self.learned.get_mut(topic).map(|(learned, used)| {
            *used = round;
            *learned
        }) {
            Some(Learned::Known {
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

    /// Every `REFRESH_INTERVAL`: the topics written to since the last refresh are asked again
    /// (not one asked already); those not written to for `FORGET_AFTER_REFRESHES` are
    /// forgotten.
    pub fn refresh(&mut self) {
        let round = self.round;
        self.round += 1;
        self.learned
            .retain(|_, (_, used)| round.saturating_sub(*used) < FORGET_AFTER_REFRESHES);
        for (topic, (_, used)) in &self.learned {
            if *used == round && self.asked.insert(Arc::clone(topic)) {
                self.to_ask.push(Arc::clone(topic));
            }
        }
    }

    /// Topics whose answer is kept.
    pub fn known(&self) -> usize {
        self.learned.len()
    }

    pub fn take_asks(&mut self) -> Vec<Arc<str>> {
        std::mem::take(&mut self.to_ask)
    }

    /// Kafka's answer about `topic`; true when it is the first (its records were judged
    /// `Always` until now).
    pub fn learned(&mut self, topic: Arc<str>, learned: Learned) -> bool {
        self.asked.remove(&topic);
        match self.learned.get_mut(&topic) {
            // An answer to a refresh says nothing of whether the topic is written to.
            Some((known, _)) => {
                *known = learned;
                false
            }
            None => {
                self.learned.insert(topic, (learned, self.round));
                true
            }
        }
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
    let admin: AdminClient<DefaultClientContext> = match client_config(&kafka).create() {
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
        while !topics.is_empty() {
            let rest = topics.split_off(topics.len().min(TOPICS_PER_REQUEST));
            if !describe(&admin, &options, topics, &answers).await {
                return;
            }
            topics = rest;
        }
    }
}

/// One DescribeConfigs request for `topics`, each answered; false when the pipeline is gone.
async fn describe(
    admin: &AdminClient<DefaultClientContext>,
    options: &AdminOptions,
    topics: Vec<Arc<str>>,
    answers: &Answers,
) -> bool {
    {
        let specifiers: Vec<ResourceSpecifier<'_>> =
            topics.iter().map(|t| ResourceSpecifier::Topic(t)).collect();
        let described = admin.describe_configs(&specifiers, options).await;
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
                return false;
            }
        }
    }
    true
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

    /// Templated topics have no bound: only those written to since the last refresh are asked
    /// again, and one unused for `FORGET_AFTER_REFRESHES` refreshes is forgotten.
    #[test]
    fn the_refresh_asks_about_recent_topics_and_forgets_unused_ones() {
        let mut limits = TopicLimits::new(1_000_000);
        let topics: Vec<Arc<str>> = (0..1000)
            .map(|i| Arc::from(format!("devices.{i}")))
            .collect();
        for t in &topics {
            limits.judge(t);
        }
        for t in limits.take_asks() {
            limits.learned(t, known(65_536, false));
        }
        limits.refresh();
        assert_eq!(limits.take_asks().len(), 1000, "all written to since");
        for t in &topics {
            limits.learned(Arc::clone(t), known(65_536, false));
        }
        // Only one topic is written to from now on.
        for _ in 0..FORGET_AFTER_REFRESHES {
            limits.judge(&topics[7]);
            limits.refresh();
            assert_eq!(limits.take_asks(), vec![Arc::clone(&topics[7])]);
            limits.learned(Arc::clone(&topics[7]), known(65_536, false));
        }
        assert_eq!(limits.known(), 1, "the unused ones forgotten");
        assert_eq!(
            limits.judge(&topics[8]),
            Judgement::Always,
            "asked again when met"
        );
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
        limits.judge(&a);
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
