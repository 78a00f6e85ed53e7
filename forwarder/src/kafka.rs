//! The Kafka side: librdkafka producer settings, delivery reports into the pipeline, and which
//! errors are worth retrying (the rest are permanent, `permanent.rs`).

use std::sync::Arc;
use std::time::Duration;

use ferry_api::config::{KafkaConfig, Problem, ProblemKind};
use ferry_api::kafka_props::QUEUE_MAX_KBYTES;
use rdkafka::ClientContext;
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{
    BaseProducer, DeliveryResult, Producer, ProducerContext, ThreadedProducer,
};
use tokio::sync::mpsc;
use tracing::{debug, error, info, warn};

use crate::metrics::Metrics;
use crate::permanent::{KafkaFailure, KafkaKind};
use crate::window::{BlockReason, Outcome, PermanentReason, capped_exponential};

/// Ferry's producer defaults; anything in `kafka.config` overrides them.
pub const DEFAULTS: &[(&str, &str)] = &[
    ("acks", "all"),
    ("enable.idempotence", "true"),
    ("compression.type", "lz4"),
    // The forwarder holds at most `max_inflight` messages, so its throughput is the window
    // divided by the produce round trip, of which linger is most: 2 ms instead of 5 raised a
    // 1000-message window's drain from ~130k to ~210k msg/s (ferry-bench); 1 ms made requests
    // so small that the five in flight per connection (idempotence) became the limit.
    ("linger.ms", "2"),
    // Never give up on a record inside librdkafka: a Kafka outage must hold messages (and so
    // the MQTT acks) rather than fail them. librdkafka keeps retrying with capped backoff and,
    // with idempotence, keeps per-partition order.
    ("message.timeout.ms", "0"),
    ("retry.backoff.ms", "100"),
    ("retry.backoff.max.ms", "5000"),
    ("socket.keepalive.enable", "true"),
];

/// librdkafka's queue bounded in bytes by the window's bytes (`mqtt.max_inflight_bytes`),
/// unless `kafka.config` sets it: its default (1 GiB) would let the records of one window of
/// large messages, once per target, pass any pod's memory. A full queue holds the records
/// (`queue_full`), as a full window holds the messages.
pub fn with_queue_bound(kafka: &KafkaConfig, max_inflight_bytes: u64) -> KafkaConfig {
    let mut kafka = kafka.clone();
    kafka
        .config
        .entry(QUEUE_MAX_KBYTES.to_owned())
        .or_insert_with(|| max_inflight_bytes.div_ceil(1024).max(1).to_string());
    kafka
}

pub fn client_config(kafka: &KafkaConfig) -> ClientConfig {
    let mut cc = ClientConfig::new();
    cc.set("bootstrap.servers", &kafka.bootstrap_servers);
    for (k, v) in DEFAULTS {
        cc.set(*k, *v);
    }
    if let Some(p) = kafka.security_protocol() {
        cc.set("security.protocol", p);
    }
    if let Some(tls) = &kafka.tls {
        // Verify the broker's name against its certificate, not only the chain.
        cc.set("ssl.endpoint.identification.algorithm", "https");
        if let Some(ca) = &tls.ca_file {
            cc.set("ssl.ca.location", ca);
        }
        if let (Some(cert), Some(key)) = (&tls.cert_file, &tls.key_file) {
            cc.set("ssl.certificate.location", cert);
            cc.set("ssl.key.location", key);
        }
    }
    if let Some(sasl) = &kafka.sasl {
        cc.set("sasl.mechanism", sasl.mechanism.as_str());
        cc.set("sasl.username", &sasl.username);
        cc.set("sasl.password", sasl.password.expose());
    }
    for (k, v) in &kafka.config {
        cc.set(k, v);
    }
    // librdkafka's `debug` contexts only log at Debug level: honour them when asked for.
    cc.set_log_level(if kafka.config.contains_key("debug") {
        RDKafkaLogLevel::Debug
    } else {
        RDKafkaLogLevel::Warning
    });
    cc
}

/// What librdkafka itself refuses in `kafka.config`: an unknown property or a value out of
/// range (found by configuring a client), then what it checks only when it creates one
/// (`max.in.flight.requests.per.connection` above 5 or `retries` 0 with idempotence, ...),
/// found by creating a producer with no broker to connect to, dropped at once. Without this,
/// such a config passed `--check` and failed only when the forwarder started.
pub fn config_problem(kafka: &KafkaConfig) -> Option<Problem> {
    match client_config(kafka).create_native_config() {
        Ok(_) => {}
        // The value is left out: it may be a credential.
        Err(KafkaError::ClientConfig(_, description, key, _)) => {
            return Some(Problem {
                path: format!("kafka.config.{key}"),
                message: format!("librdkafka refuses it: {description}"),
                kind: ProblemKind::Setting,
            });
        }
        Err(other) => {
            return Some(Problem {
                path: "kafka.config".into(),
                message: format!("librdkafka refuses it: {other}"),
                kind: ProblemKind::Setting,
            });
        }
    }
    // `kafka.config` over the defaults, without `tls` and `sasl`: their files are the
    // environment's (the pod's Secret), checked when the forwarder starts, and this check must
    // also run where they are not (the operator). No bootstrap server: librdkafka starts no
    // broker thread and so connects to nothing.
    let mut config = client_config(&KafkaConfig {
        tls: None,
        sasl: None,
        ..kafka.clone()
    });
    config.set("bootstrap.servers", "");
    match config.create_with_context::<_, BaseProducer<Unconnected>>(Unconnected) {
        Ok(_) => None,
        Err(KafkaError::ClientCreation(reason)) => Some(Problem {
            path: property_named(&reason, kafka),
            message: format!("librdkafka refuses to create a producer with it: {reason}"),
            kind: ProblemKind::Setting,
        }),
        Err(other) => Some(Problem {
            path: "kafka.config".into(),
            message: format!("librdkafka refuses to create a producer with it: {other}"),
            kind: ProblemKind::Setting,
        }),
    }
}

/// librdkafka's aliases of producer properties (`rdkafka_conf.c`): its messages use one name,
/// a config may use the other.
const ALIASES: &[(&str, &str)] = &[
    ("max.in.flight", "max.in.flight.requests.per.connection"),
    ("linger.ms", "queue.buffering.max.ms"),
    ("retries", "message.send.max.retries"),
    ("compression.type", "compression.codec"),
    ("acks", "request.required.acks"),
    ("delivery.timeout.ms", "message.timeout.ms"),
];

/// The `kafka.config` entry a producer-creation error names (librdkafka quotes properties in
/// backticks, by one of their aliases), else `kafka.config`.
fn property_named(reason: &str, kafka: &KafkaConfig) -> String {
    let same = |quoted: &str, key: &str| {
        quoted == key
            || ALIASES
                .iter()
                .any(|&(a, b)| (a, b) == (quoted, key) || (b, a) == (quoted, key))
    };
    reason
        .split('`')
        .skip(1)
        .step_by(2)
        .find_map(|quoted| kafka.config.keys().find(|key| same(quoted, key)))
        .map_or_else(
            || "kafka.config".to_owned(),
            |key| format!("kafka.config.{key}"),
        )
}

/// The context of the producer [`config_problem`] creates: it has nothing to say.
struct Unconnected;

impl ClientContext for Unconnected {
    fn log(&self, _: RDKafkaLogLevel, _: &str, _: &str) {}
}

impl ProducerContext for Unconnected {
    type DeliveryOpaque = ();
    fn delivery(&self, _: &DeliveryResult<'_>, _: ()) {}
}

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

    fn plain_kafka() -> KafkaConfig {
        KafkaConfig {
            bootstrap_servers: "k:9092".into(),
            tls: None,
            sasl: None,
            config: Default::default(),
            allow_weaker_delivery: false,
        }
    }

    #[test]
    fn user_config_overrides_defaults() {
        let mut kafka = plain_kafka();
        kafka.config.insert("linger.ms".into(), "50".into());
        let cc = client_config(&kafka);
        assert_eq!(cc.get("linger.ms"), Some("50"));
        assert_eq!(cc.get("acks"), Some("all"));
        assert_eq!(cc.get("enable.idempotence"), Some("true"));
        assert_eq!(cc.get("bootstrap.servers"), Some("k:9092"));
        assert_eq!(cc.get("security.protocol"), None);
    }

    #[test]
    fn tls_and_sasl_set_the_security_protocol() {
        use ferry_api::config::{Sasl, SaslMechanism, Secret, Tls};
        let kafka = KafkaConfig {
            bootstrap_servers: "k:9093".into(),
            tls: Some(Tls {
                ca_file: Some("/ca.pem".into()),
                ..Tls::default()
            }),
            sasl: Some(Sasl {
                mechanism: SaslMechanism::ScramSha512,
                username: "ferry".into(),
                username_file: None,
                password: Secret("pw".into()),
                password_file: None,
            }),
            config: Default::default(),
            allow_weaker_delivery: false,
        };
        let cc = client_config(&kafka);
        assert_eq!(cc.get("security.protocol"), Some("sasl_ssl"));
        assert_eq!(cc.get("sasl.mechanism"), Some("SCRAM-SHA-512"));
        assert_eq!(cc.get("ssl.ca.location"), Some("/ca.pem"));
        assert_eq!(
            cc.get("ssl.endpoint.identification.algorithm"),
            Some("https")
        );
    }

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

    #[test]
    fn librdkafka_refusals_name_the_property() {
        let mut kafka = plain_kafka();
        assert_eq!(config_problem(&kafka), None);
        kafka.config.insert("linger.ms".into(), "10".into());
        assert_eq!(config_problem(&kafka), None);
        kafka.config.insert("lingr.ms".into(), "10".into());
        let problem = config_problem(&kafka).expect("unknown property");
        assert_eq!(problem.path, "kafka.config.lingr.ms", "{problem}");
        kafka.config.remove("lingr.ms");
        kafka.config.insert("linger.ms".into(), "soon".into());
        let problem = config_problem(&kafka).expect("bad value");
        assert_eq!(problem.path, "kafka.config.linger.ms", "{problem}");
    }

    #[test]
    fn what_librdkafka_checks_only_when_creating_a_producer_is_refused_naming_the_property() {
        for (key, value) in [
            ("max.in.flight.requests.per.connection", "6"),
            ("retries", "0"),
            ("queue.buffering.backpressure.threshold", "2"),
        ] {
            let mut kafka = plain_kafka();
            kafka.config.insert(key.into(), value.into());
            let problem = config_problem(&kafka)
                .unwrap_or_else(|| panic!("{key}: {value} with idempotence is refused"));
            assert_eq!(problem.path, format!("kafka.config.{key}"), "{problem}");
            assert!(
                problem.message.contains("refuses to create a producer"),
                "{problem}"
            );
        }
        let mut kafka = plain_kafka();
        kafka
            .config
            .insert("max.in.flight.requests.per.connection".into(), "5".into());
        assert_eq!(config_problem(&kafka), None, "5 is idempotence's limit");
    }

    #[test]
    fn kafka_config_debug_turns_on_librdkafka_debug_logs() {
        let mut kafka = plain_kafka();
        assert!(matches!(
            client_config(&kafka).log_level,
            RDKafkaLogLevel::Warning
        ));
        kafka.config.insert("debug".into(), "broker,msg".into());
        assert!(matches!(
            client_config(&kafka).log_level,
            RDKafkaLogLevel::Debug
        ));
    }
}
