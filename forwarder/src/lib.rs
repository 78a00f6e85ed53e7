//! Ferry's forwarder: MQTT in, Kafka out, at least once and in order. `run` is the whole data
//! plane; the binary adds config loading, logging and signals.

pub mod http;
pub mod kafka;
pub mod metrics;
pub mod mqtt;
pub mod pipeline;
pub mod reload;
pub mod route;
pub mod tls;
pub mod window;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_api::ValidConfig;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tracing::{info, warn};

use crate::metrics::Metrics;
use crate::mqtt::ReaderExit;
use crate::pipeline::{Pipeline, Wiring};
use crate::reload::ConfigSource;
use crate::route::Router;

/// How long the reader gets, after the pipeline finished, to write the last acks and DISCONNECT.
const DISCONNECT_BOUND: Duration = Duration::from_secs(5);
const KAFKA_PROBE_INTERVAL: Duration = Duration::from_secs(5);
const RATE_SAMPLE_INTERVAL: Duration = Duration::from_secs(5);

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
    /// Before the first successful connection, an error retrying cannot fix (a certificate that
    /// does not verify, refused credentials).
    #[error("{0}")]
    Unrecoverable(String),
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
    let subscriptions = Arc::new(Mutex::new(config.subscriptions()));
    // The driver's window bounds what is in this channel, so it never fills.
    let (to_pipeline, inbound) = mpsc::channel(max_inflight.max(1));
    let (link, reader) = mqtt::start(
        &config.mqtt,
        Arc::clone(&subscriptions),
        Arc::clone(&metrics),
        to_pipeline,
    )?;

    let mut background = tokio::task::JoinSet::new();
    background.spawn(http::serve(listener, Arc::clone(&metrics)));
    let sampler = Arc::clone(&metrics);
    background.spawn(async move {
        loop {
            sampler.sample_rates();
            tokio::time::sleep(RATE_SAMPLE_INTERVAL).await;
        }
    });
    let kafka_fatal = tokio::spawn(kafka::probe_reachability(
        config.kafka.clone(),
        Arc::clone(&metrics),
        KAFKA_PROBE_INTERVAL,
    ));
    let (reload_tx, reloads) = mpsc::channel(1);
    if let Some(source) = source {
        background.spawn(reload::watch(
            source,
            config.clone(),
            Arc::clone(&metrics),
            reload_tx,
        ));
    }

    let pipeline = Pipeline::new(
        router,
        config.kafka.clone(),
        Wiring {
            metrics: Arc::clone(&metrics),
            link,
            subscriptions,
        },
        max_inflight,
    )?;
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

    // A Kafka setting that can never work stops the forwarder like a signal, with the reason.
    let kafka_unrecoverable: Arc<Mutex<Option<String>>> = Arc::default();
    let noted = Arc::clone(&kafka_unrecoverable);
    let stop = async move {
        tokio::select! {
            () = shutdown => {}
            reason = kafka_fatal => {
                if let Ok(reason) = reason {
                    tracing::error!(error = %reason, "cannot use kafka, and retrying will not help");
                    *noted.lock().unwrap_or_else(|p| p.into_inner()) = Some(reason);
                }
            }
        }
    };
    let exit = pipeline
        .run(
            inbound,
            reloads,
            stop,
            Duration::from_secs(config.shutdown_timeout_secs),
        )
        .await;
    let reader_exit = match tokio::time::timeout(DISCONNECT_BOUND, reader).await {
        Ok(Ok(exit)) => Some(exit),
        Ok(Err(e)) => {
            warn!(error = %e, "mqtt reader task failed");
            None
        }
        Err(_) => {
            warn!("mqtt disconnect did not complete in time");
            None
        }
    };
    background.abort_all();
    if let Some(ReaderExit::Fatal(reason)) = reader_exit {
        return Err(RunError::Unrecoverable(reason));
    }
    if let Some(reason) = kafka_unrecoverable
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take()
    {
        return Err(RunError::Unrecoverable(reason));
    }
    let disconnected_cleanly = reader_exit == Some(ReaderExit::Disconnected);
    info!(
        abandoned = exit.abandoned,
        disconnected_cleanly, "forwarder stopped"
    );
    Ok(RunSummary {
        abandoned: exit.abandoned,
        disconnected_cleanly,
    })
}
