//! Ferry's forwarder: MQTT in, Kafka out, at least once and in order. `run` is the whole data
//! plane; the binary adds config loading, logging and signals.

pub mod encode;
pub mod eval;
pub mod handover;
pub mod http;
pub mod kafka;
pub mod limits;
pub mod load;
pub mod metrics;
pub mod mqtt;
pub mod path;
pub mod permanent;
pub mod pipeline;
pub mod record;
pub mod registry;
pub mod reload;
pub mod route;
pub mod schemas;
pub mod tls;
pub mod window;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_api::{ForwarderConfig, ValidConfig};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio::task::{JoinHandle, JoinSet};
use tracing::{info, warn};

use crate::metrics::Metrics;
use crate::mqtt::ReaderExit;
use crate::pipeline::{Pipeline, PipelineExit, Reload, Wiring};
use crate::reload::ConfigSource;
use crate::route::Router;

/// How long the reader gets, after the pipeline finished, to write the last acks and DISCONNECT.
const DISCONNECT_BOUND: Duration = Duration::from_secs(5);
const KAFKA_PROBE_INTERVAL: Duration = Duration::from_secs(5);
const RATE_SAMPLE_INTERVAL: Duration = Duration::from_secs(5);
/// How often a forwarder draining before it stops looks whether it is drained.
const DRAIN_CHECK_INTERVAL: Duration = Duration::from_millis(100);

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("cannot listen for http on {addr}: {source}")]
    Http {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot create the kafka producer: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
    #[error("{0}")]
    Tls(#[from] tls::TlsSetupError),
    /// Before the first successful connection, the MQTT broker failed it permanently (a
    /// certificate that does not verify, refused credentials).
    #[error(transparent)]
    MqttPermanent(#[from] mqtt::PermanentError),
    /// Before Kafka was first reached, it failed permanently (a certificate that does not
    /// verify, authentication refused).
    #[error(transparent)]
    KafkaPermanent(#[from] kafka::PermanentError),
}

/// What a finished run left behind.
#[derive(Debug)]
pub struct RunSummary {
    /// Messages unconfirmed when the drain bound passed (the broker redelivers them).
    pub abandoned: usize,
    pub disconnected_cleanly: bool,
}

/// Forwards until `shutdown` resolves, then drains: stops reading, finishes in-flight messages,
/// acks them, disconnects. With a `source`, changes to the config file apply while running.
pub async fn run(
    config: ValidConfig,
    source: Option<ConfigSource>,
    shutdown: impl Future<Output = ()>,
) -> Result<RunSummary, RunError> {
    let metrics = Arc::new(Metrics::new());
    let router = Router::new(&config, &metrics);
    let addr = config.http.listen;
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| RunError::Http { addr, source })?;
    let max_inflight = usize::from(config.mqtt.max_inflight);
    let subscriptions = Arc::new(Mutex::new(config.subscription_plan()));
    metrics.handover(|h| {
        h.set_draining(config.draining());
        h.set_retiring(config.retiring.iter().map(String::as_str), Instant::now());
    });
    metrics.set_subscribed_shared(config.shares_subscriptions());
    // The driver's window bounds what is in this channel, so it never fills.
    let (to_pipeline, inbound) = mpsc::channel(max_inflight.max(1));
    let (link, reader) = mqtt::start(
        &config.mqtt,
        Arc::clone(&subscriptions),
        Arc::clone(&metrics),
        to_pipeline,
    )?;
    // Unbounded in type, bounded in fact: one message per producer and one from the probe.
    let (fatal_tx, fatal_rx) = mpsc::unbounded_channel();
    let (leave_tx, leave_rx) = oneshot::channel();
    let shutdown = drain_before_stopping(
        shutdown,
        config.drains_on_shutdown().then_some(leave_tx),
        Arc::clone(&metrics),
        Duration::from_secs(config.shutdown_timeout_secs),
    );
    let mut background =
        Background::spawn(&config, source, listener, &metrics, &fatal_tx, leave_rx);
    let pipeline = Pipeline::new(
        router,
        ferry_kafka_settings::with_queue_bound(&config.kafka, config.mqtt.max_inflight_bytes),
        Wiring {
            metrics: Arc::clone(&metrics),
            link,
            subscriptions,
            fatal: (fatal_tx, fatal_rx),
            schema_registry: config.schema_registry.clone(),
        },
        max_inflight,
    )?;
    log_started(&config, max_inflight);
    let exit = pipeline
        .run(
            inbound,
            background.reloads,
            shutdown,
            Duration::from_secs(config.shutdown_timeout_secs),
        )
        .await;
    let reader_exit = join_reader(reader).await;
    background.tasks.abort_all();
    summarize(exit, reader_exit)
}

/// Resolves once `shutdown` has and, for a forwarder that drains on shutdown (`leave` is
/// set), once it has drained or `bound` passed: until then the pipeline forwards as usual what
/// the broker still delivers, and then stops as always (finishing what is in flight).
async fn drain_before_stopping(
    shutdown: impl Future<Output = ()>,
    leave: Option<oneshot::Sender<()>>,
    metrics: Arc<Metrics>,
    bound: Duration,
) {
    shutdown.await;
    let Some(leave) = leave else { return };
    if leave.send(()).is_err() {
        return; // Nothing applies the drain: stop as usual.
    }
    info!("draining before stopping (drain_on_shutdown)");
    let drained = async {
        while !metrics.drained() {
            tokio::time::sleep(DRAIN_CHECK_INTERVAL).await;
        }
    };
    match tokio::time::timeout(bound, drained).await {
        Ok(()) => info!("drained; stopping"),
        Err(_) => warn!(
            bound_secs = bound.as_secs(),
            "not drained within shutdown_timeout_secs; stopping with what the session still holds"
        ),
    }
}

/// The tasks that run beside the pipeline until the forwarder stops.
struct Background {
    /// /metrics and /status, the rate sampler, the Kafka reachability probe, the config
    /// watcher.
    tasks: JoinSet<()>,
    /// New rules from the config watcher (none without a `source`).
    reloads: mpsc::Receiver<Reload>,
}

impl Background {
    fn spawn(
        config: &ValidConfig,
        source: Option<ConfigSource>,
        listener: TcpListener,
        metrics: &Arc<Metrics>,
        fatal: &kafka::FatalSender,
        leave: oneshot::Receiver<()>,
    ) -> Self {
        let mut tasks = JoinSet::new();
        tasks.spawn(http::serve(listener, Arc::clone(metrics)));
        let sampler = Arc::clone(metrics);
        tasks.spawn(async move {
            loop {
                sampler.sample_rates();
                tokio::time::sleep(RATE_SAMPLE_INTERVAL).await;
            }
        });
        // A permanent failure before Kafka was ever reached goes to the pipeline's fatal
        // channel, which stops the forwarder with it.
        tasks.spawn(kafka::probe_reachability(
            config.kafka.clone(),
            Arc::clone(metrics),
            KAFKA_PROBE_INTERVAL,
            fatal.clone(),
        ));
        let (reload_tx, reloads) = mpsc::channel(1);
        match source {
            Some(source) => {
                tasks.spawn(reload::watch(
                    source,
                    config.clone(),
                    Arc::clone(metrics),
                    reload_tx,
                    leave,
                ));
            }
            None => {
                tasks.spawn(reload::drain_when_leaving(
                    config.clone(),
                    Arc::clone(metrics),
                    reload_tx,
                    leave,
                ));
            }
        }
        Self { tasks, reloads }
    }
}

fn log_started(config: &ForwarderConfig, max_inflight: usize) {
    info!(
        mqtt = %format!("{}:{}", config.mqtt.host, config.mqtt.port),
        protocol = ?config.mqtt.protocol,
        tls = config.mqtt.tls.is_some(),
        client_id = %config.mqtt.client_id,
        kafka = %config.kafka.bootstrap_servers,
        rules = config.rules.len(),
        max_inflight,
        "forwarder started"
    );
}

/// Gives the reader `DISCONNECT_BOUND` to write the last acks and disconnect; None when it
/// failed or did not finish in time.
async fn join_reader(reader: JoinHandle<ReaderExit>) -> Option<ReaderExit> {
    match tokio::time::timeout(DISCONNECT_BOUND, reader).await {
        Ok(Ok(exit)) => Some(exit),
        Ok(Err(e)) => {
            warn!(error = %e, "mqtt reader task failed");
            None
        }
        Err(_) => {
            warn!("mqtt disconnect did not complete in time");
            None
        }
    }
}

/// How the run ends: a permanent error (MQTT's first) fails it, otherwise what was left behind.
fn summarize(exit: PipelineExit, reader_exit: Option<ReaderExit>) -> Result<RunSummary, RunError> {
    if let Some(ReaderExit::Permanent(e)) = reader_exit {
        return Err(e.into());
    }
    if let Some(e) = exit.kafka_permanent {
        return Err(e.into());
    }
    let disconnected_cleanly = matches!(reader_exit, Some(ReaderExit::Disconnected));
    info!(
        abandoned = exit.abandoned,
        disconnected_cleanly, "forwarder stopped"
    );
    Ok(RunSummary {
        abandoned: exit.abandoned,
        disconnected_cleanly,
    })
}
