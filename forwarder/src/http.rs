//! `/healthz` (the process is serving), `/readyz` (MQTT connected and Kafka answering metadata),
//! `/metrics` (Prometheus text format).

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::net::TcpListener;
use tracing::error;

use crate::metrics::Metrics;

pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>) {
    let app = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .with_state(metrics);
    if let Err(e) = axum::serve(listener, app).await {
        error!(error = %e, "http server stopped");
    }
}

async fn readyz(State(m): State<Arc<Metrics>>) -> impl IntoResponse {
    let (mqtt, kafka) = (m.health.mqtt_connected(), m.health.kafka_reachable());
    let body = format!("mqtt_connected={mqtt} kafka_reachable={kafka}\n");
    if mqtt && kafka { (StatusCode::OK, body) } else { (StatusCode::SERVICE_UNAVAILABLE, body) }
}

async fn metrics_text(State(m): State<Arc<Metrics>>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")],
        m.encode(),
    )
}
