//! The Kafka side: delivery reports into the pipeline, and which errors are worth retrying (the
//! rest are permanent, `permanent.rs`). The producer's settings, and what librdkafka refuses in
//! them, are `ferry_kafka_settings`'s, shared with the operator.

use std::sync::Arc;
use std::time::Duration;

use ferry_api::config::KafkaConfig;
use ferry_kafka_settings::client_config;
use rdkafka::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{
    BaseProducer, DeliveryResult, Producer, ProducerContext, ThreadedProducer,
};
use tokio::sync::mpsc;
use tracing::{debug, error, info, warn};

use crate::metrics::Metrics;
use crate::permanent::{KafkaFailure, KafkaKind};
use crate::window::{BlockReason, Outcome, PermanentReason, capped_exponential};

/// One delivery report: which (message, target) it is for, and how it went.
#[derive(Debug)]
pub struct Report {
    pub opaque: usize,
    pub result: Result<(), KafkaError>,
}

/// What stops the forwarder using Kafka as it is, on one channel to the pipeline from where it
/// is noticed off the pipeline's task: a producer's librdkafka thread, the reachability probe.
/// (A fatal error a produce call or delivery report returns is the pipeline's own.)
#[derive(Debug)]
pub enum Fatal {
    /// librdkafka's fatal error: producer `generation` is unusable and is to be replaced.
    Producer { generation: u8, error: String },
    /// Kafka failed permanently before it was ever reached: the forwarder stops with it.
    Permanent(PermanentError),
}

pub type FatalSender = mpsc::UnboundedSender<Fatal>;

/// When to create the next producer after librdkafka's fatal error: capped exponential over
/// the fatal errors (and failed creations) in a row, until a record is delivered again.
///
/// The first wait lets the lost producer's requests already at the broker report their real
/// outcome (librdkafka purges only what it had not sent), so fewer records are written twice.
/// The cap bounds how long a fix (a granted ACL) waits to be noticed, while a fatal error that
/// repeats at once (idempotent writes not authorized) costs the broker a new producer id and
/// connections at most twice a minute.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Replacement {
    failures: u32,
}

impl Replacement {
    pub const MIN: Duration = Duration::from_millis(500);
    pub const MAX: Duration = Duration::from_secs(30);

    /// A producer was lost, or could not be created: how long to wait before the next one.
    pub fn failed(&mut self) -> Duration {
        self.failures = self.failures.saturating_add(1);
        capped_exponential(Self::MIN, Self::MAX, self.failures)
    }

    /// A record was delivered: the producer works.
    pub fn delivered(&mut self) {
        self.failures = 0;
    }

    /// Fatal errors and failed creations in a row.
    pub fn failures(&self) -> u32 {
        self.failures
    }
}

/// Routes librdkafka's callbacks: delivery reports to the pipeline, a fatal error to the
/// pipeline's fatal channel, logs and other errors to tracing.
pub struct Context {
    reports: mpsc::UnboundedSender<Report>,
    fatal: FatalSender,
    /// Which producer this is, so that a replaced one's fatal error is ignored.
    generation: u8,
    metrics: Arc<Metrics>,
}

impl ClientContext for Context {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, message: &str) {
        // librdkafka logs each fatal error once, as it raises it, under this facility; its
        // error event carries the underlying code (`ClusterAuthorizationFailed`, ...) with the
        // fatal flag, which rdkafka drops. The pipeline confirms with `fatal_error`.
        if fac == "FATAL" {
            // Gone only while shutting down: nothing is to be replaced then.
            let _ = self.fatal.send(Fatal::Producer {
                generation: self.generation,
                error: message.to_owned(),
            });
        }
        log_librdkafka(level, fac, message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        if matches!(
            error.rdkafka_error_code(),
            Some(RDKafkaErrorCode::AllBrokersDown)
        ) {
            self.metrics.set_kafka_reachable(false);
        }
        self.metrics.kafka_error(reason.to_owned());
        warn!(error = %error, reason, "kafka client error");
    }
}

impl ProducerContext for Context {
    type DeliveryOpaque = usize;

    fn delivery(&self, result: &DeliveryResult<'_>, opaque: usize) {
        let result = result.as_ref().map(|_| ()).map_err(|(e, _)| e.clone());
        // The receiver is gone only while shutting down; nothing is waiting for the report then.
        let _ = self.reports.send(Report { opaque, result });
    }
}

pub type KafkaProducer = ThreadedProducer<Context>;

/// Where a producer's callbacks go.
#[derive(Clone)]
pub struct ProducerWiring {
    pub metrics: Arc<Metrics>,
    pub reports: mpsc::UnboundedSender<Report>,
    pub fatal: FatalSender,
}

/// Creates producer `generation`. The report channel is unbounded in type but bounded in
/// fact: every report answers one produce call, and produce calls are bounded by the in-flight
/// window. The fatal channel carries one message per producer (librdkafka raises its fatal
/// error once) and one from the probe.
pub fn producer(
    kafka: &KafkaConfig,
    wiring: &ProducerWiring,
    generation: u8,
) -> Result<KafkaProducer, KafkaError> {
    client_config(kafka).create_with_context(Context {
        reports: wiring.reports.clone(),
        fatal: wiring.fatal.clone(),
        generation,
        metrics: Arc::clone(&wiring.metrics),
    })
}

/// What a failed produce means.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Classified {
    /// For the window: retry (blocked), or a permanent failure of the record.
    Outcome(Outcome),
    /// The producer instance is unusable (librdkafka's "fatal" error): replace it and re-send
    /// its unconfirmed records. Not permanent: nothing is given up.
    ReplaceProducer,
}

/// The failure rule, in one place: only errors that can never succeed for *that record* are
/// permanent. Authorization, unknown topics and everything not known to be permanent are
/// retried: an operator can fix them, and giving up would be silent loss.
pub fn classify(error: &KafkaError) -> Classified {
    use RDKafkaErrorCode as C;
    let judged = match error.rdkafka_error_code() {
        Some(C::MessageSizeTooLarge | C::InvalidMessageSize | C::MessageBatchTooLarge) => {
            Ok(PermanentReason::TooLarge)
        }
        Some(C::InvalidTopic) => Ok(PermanentReason::InvalidTopic),
        Some(C::InvalidRecord) => Ok(PermanentReason::InvalidRecord),
        Some(C::TopicAuthorizationFailed | C::ClusterAuthorizationFailed) => {
            Err(BlockReason::Unauthorized)
        }
        Some(C::UnknownTopic | C::UnknownTopicOrPartition | C::UnknownPartition) => {
            Err(BlockReason::UnknownTopic)
        }
        Some(C::QueueFull) => Err(BlockReason::QueueFull),
        Some(C::Fatal) => return Classified::ReplaceProducer,
        _ => Err(BlockReason::Unavailable),
    };
    let error = error.to_string();
    Classified::Outcome(match judged {
        Ok(reason) => Outcome::Permanent { reason, error },
        Err(reason) => Outcome::Blocked { reason, error },
    })
}

/// The metadata probe's context: hands permanent errors (the broker's certificate does not
/// verify, authentication refused) to the probe loop.
struct ProbeContext {
    permanent: std::sync::mpsc::Sender<KafkaFailure>,
}

impl ClientContext for ProbeContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, message: &str) {
        log_librdkafka(level, fac, message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        if let Some(failure) = permanent(&error, reason) {
            // The probe loop outlives its client.
            let _ = self.permanent.send(failure);
        }
    }
}

impl ProducerContext for ProbeContext {
    type DeliveryOpaque = ();
    fn delivery(&self, _: &DeliveryResult<'_>, _: ()) {}
}

/// librdkafka reports certificate and authentication failures as errors it keeps retrying:
/// which of its errors are permanent.
fn permanent(error: &KafkaError, reason: &str) -> Option<KafkaFailure> {
    let kind = match error.rdkafka_error_code() {
        Some(RDKafkaErrorCode::SSL) if reason.contains("certificate verify failed") => {
            KafkaKind::Certificate
        }
        Some(RDKafkaErrorCode::Authentication) => KafkaKind::Authentication,
        _ => return None,
    };
    Some(KafkaFailure {
        kind,
        reason: reason.to_owned(),
    })
}

/// A permanent Kafka error met before Kafka was first reached: the forwarder stops with it.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("kafka {bootstrap_servers}: {source}")]
pub struct PermanentError {
    pub bootstrap_servers: String,
    pub source: KafkaFailure,
}

/// Asks Kafka for metadata every `interval` and sets `kafka_reachable`. Runs until dropped,
/// or until, before Kafka was ever reached, it failed permanently: that goes to `fatal`.
pub async fn probe_reachability(
    kafka: KafkaConfig,
    metrics: Arc<Metrics>,
    interval: Duration,
    fatal: FatalSender,
) {
    let (permanent, failures) = std::sync::mpsc::channel();
    let context = ProbeContext { permanent };
    let probe: Result<BaseProducer<ProbeContext>, _> =
        client_config(&kafka).create_with_context(context);
    let probe = match probe {
        Ok(p) => Arc::new(p),
        Err(e) => {
            error!(error = %e, "cannot create kafka metadata probe; readiness will stay false");
            return std::future::pending().await;
        }
    };
    let mut was: Option<bool> = None;
    let mut ever_reached = false;
    loop {
        let p = Arc::clone(&probe);
        let result = tokio::task::spawn_blocking(move || {
            let r = p.client().fetch_metadata(None, Duration::from_secs(3));
            // Serves the error callbacks (a BaseProducer only runs them when polled). A zero
            // timeout serves one event, and with `debug` on the queue is mostly log lines:
            // poll for a while so the errors behind them are seen.
            p.poll(Duration::from_millis(200));
            r
        })
        .await;
        let ok = matches!(result, Ok(Ok(_)));
        metrics.set_kafka_reachable(ok);
        ever_reached |= ok;
        // The first of what the callbacks reported during this round.
        let failure = failures.try_iter().fold(None, |first, f| first.or(Some(f)));
        if !ok {
            if let Some(failure) = failure {
                metrics.kafka_error(failure.to_string());
                if !ever_reached {
                    // The pipeline is gone only while shutting down.
                    let _ = fatal.send(Fatal::Permanent(PermanentError {
                        bootstrap_servers: kafka.bootstrap_servers,
                        source: failure,
                    }));
                    return;
                }
                error!(bootstrap_servers = %kafka.bootstrap_servers, error = %failure, "kafka refuses the forwarder");
            } else if let Ok(Err(e)) = &result {
                metrics.kafka_error(e.to_string());
            }
        }
        if was != Some(ok) {
            if ok {
                info!(bootstrap_servers = %kafka.bootstrap_servers, "kafka reachable");
            } else {
                warn!(bootstrap_servers = %kafka.bootstrap_servers, "kafka not reachable");
            }
            was = Some(ok);
        }
        tokio::time::sleep(interval).await;
    }
}

fn log_librdkafka(level: RDKafkaLogLevel, fac: &str, message: &str) {
    match level {
        RDKafkaLogLevel::Emerg
        | RDKafkaLogLevel::Alert
        | RDKafkaLogLevel::Critical
        | RDKafkaLogLevel::Error => {
            error!(target: "librdkafka", facility = fac, "{message}")
        }
        RDKafkaLogLevel::Warning => warn!(target: "librdkafka", facility = fac, "{message}"),
        RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => {
            info!(target: "librdkafka", facility = fac, "{message}")
        }
        RDKafkaLogLevel::Debug => debug!(target: "librdkafka", facility = fac, "{message}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_record_level_errors_are_permanent() {
        use RDKafkaErrorCode as C;
        let reason = |c| match classify(&KafkaError::MessageProduction(c)) {
            Classified::Outcome(Outcome::Permanent { reason, .. }) => Some(Ok(reason)),
            Classified::Outcome(Outcome::Blocked { reason, .. }) => Some(Err(reason)),
            Classified::Outcome(Outcome::Delivered) | Classified::ReplaceProducer => None,
        };
        assert_eq!(
            reason(C::MessageSizeTooLarge),
            Some(Ok(PermanentReason::TooLarge))
        );
        assert_eq!(
            reason(C::InvalidRecord),
            Some(Ok(PermanentReason::InvalidRecord))
        );
        // librdkafka's answer for a valid record whose batch held an invalid one (KIP-467):
        // retried, never given up.
        assert_eq!(
            reason(C::InvalidDifferentRecord),
            Some(Err(BlockReason::Unavailable))
        );
        // Fixable by an operator: retried, never given up.
        assert_eq!(
            reason(C::TopicAuthorizationFailed),
            Some(Err(BlockReason::Unauthorized))
        );
        assert_eq!(
            reason(C::UnknownTopicOrPartition),
            Some(Err(BlockReason::UnknownTopic))
        );
        assert_eq!(
            reason(C::InvalidArgument),
            Some(Err(BlockReason::Unavailable))
        );
        assert_eq!(
            reason(C::PolicyViolation),
            Some(Err(BlockReason::Unavailable))
        );
        assert_eq!(
            reason(C::MessageTimedOut),
            Some(Err(BlockReason::Unavailable))
        );
        assert_eq!(reason(C::QueueFull), Some(Err(BlockReason::QueueFull)));
        assert_eq!(
            classify(&KafkaError::MessageProduction(C::Fatal)),
            Classified::ReplaceProducer
        );
    }

    #[test]
    fn producer_replacement_backs_off_from_half_a_second_to_thirty_and_starts_over_on_a_delivery() {
        let mut r = Replacement::default();
        let waits: Vec<Duration> = (0..9).map(|_| r.failed()).collect();
        let ms = |n| Duration::from_millis(n);
        assert_eq!(
            waits,
            [
                ms(500),
                ms(1000),
                ms(2000),
                ms(4000),
                ms(8000),
                ms(16_000),
                ms(30_000),
                ms(30_000),
                ms(30_000)
            ]
        );
        assert_eq!(r.failures(), 9);
        r.delivered();
        assert_eq!(r.failed(), ms(500));
    }
}
