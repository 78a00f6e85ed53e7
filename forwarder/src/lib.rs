//! Ferry's forwarder: MQTT in, Kafka out, at least once and in order. `run` is the whole data
//! plane; the binary adds config loading, logging and signals.

pub mod http;
pub mod kafka;
pub mod metrics;
pub mod mqtt;
pub mod pipeline;
pub mod route;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use ferry_api::ForwarderConfig;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tracing::{info, warn};

use crate::metrics::Metrics;
use crate::mqtt::{Reader, ReaderExit};
use crate::pipeline::Pipeline;
use crate::route::Router;

/// Capacity of the hand-over from the MQTT reader to the pipeline; the window is the real buffer.
const HANDOVER_CAPACITY: usize = 128;
/// How long the reader gets, after the pipeline finished, to write the last acks and DISCONNECT.
const DISCONNECT_BOUND: Duration = Duration::from_secs(5);
const KAFKA_PROBE_INTERVAL: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("cannot listen for http on {addr}: {source}")]
    Http {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot create the kafka producer: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
}

/// What a finished run left behind.
#[derive(Debug)]
pub struct RunSummary {
    /// Messages unconfirmed when the drain bound passed (the broker redelivers them).
    pub abandoned: usize,
    pub disconnected_cleanly: bool,
}

/// Forwards until `shutdown` resolves, then drains: stops reading, finishes in-flight messages,
/// acks them, disconnects.
pub async fn run(
    config: ForwarderConfig,
    shutdown: impl Future<Output = ()>,
) -> Result<RunSummary, RunError> {
    let router = Router::new(&config);
    let metrics = Arc::new(Metrics::new(router.rule_names()));
    let addr = config.http.listen;
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| RunError::Http { addr, source })?;
    let http = tokio::spawn(http::serve(listener, Arc::clone(&metrics)));
    let probe = tokio::spawn(kafka::probe_reachability(
        config.kafka.clone(),
        Arc::clone(&metrics),
        KAFKA_PROBE_INTERVAL,
    ));

    let max_inflight = usize::from(config.mqtt.max_inflight);
    // +1: the message the reader holds a hand-over permit for.
    let (client, eventloop) = mqtt::client(&config.mqtt, max_inflight + HANDOVER_CAPACITY + 1);
    let reader = Reader::new(
        eventloop,
        client.clone(),
        &config.mqtt,
        config.subscriptions(),
        Arc::clone(&metrics),
    );
    let pipeline = Pipeline::new(
        router,
        config.kafka.clone(),
        Arc::clone(&metrics),
        client,
        Arc::clone(&reader.gone),
        max_inflight,
    )?;
    let (to_pipeline, inbound) = mpsc::channel(HANDOVER_CAPACITY);
    let reader = tokio::spawn(reader.run(to_pipeline));
    info!(
        mqtt = %format!("{}:{}", config.mqtt.host, config.mqtt.port),
        client_id = %config.mqtt.client_id,
        kafka = %config.kafka.bootstrap_servers,
        rules = config.rules.len(),
        max_inflight,
        "forwarder started"
    );

    let exit = pipeline
        .run(
            inbound,
            shutdown,
            Duration::from_secs(config.shutdown_timeout_secs),
        )
        .await;
    let disconnected_cleanly = match tokio::time::timeout(DISCONNECT_BOUND, reader).await {
        Ok(Ok(ReaderExit::Disconnected)) => true,
        Ok(Ok(ReaderExit::ConnectionLost)) => false,
        Ok(Err(e)) => {
            warn!(error = %e, "mqtt reader task failed");
            false
        }
        Err(_) => {
            warn!("mqtt disconnect did not complete in time");
            false
        }
    };
    http.abort();
    probe.abort();
    info!(
        abandoned = exit.abandoned,
        disconnected_cleanly, "forwarder stopped"
    );
    Ok(RunSummary {
        abandoned: exit.abandoned,
        disconnected_cleanly,
    })
}
