//! `/healthz` (the process is serving), `/readyz` (has been subscribed to MQTT and reached Kafka
//! since it started; see [`crate::metrics::Health::ready`]),
//! `/metrics` (Prometheus text format), `/status` (per-rule JSON for the operator).

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
        .route(ferry_api::status::STATUS_PATH, get(status))
        .with_state(metrics);
    if let Err(e) = axum::serve(listener, app).await {
        error!(error = %e, "http server stopped");
    }
}

async fn readyz(State(m): State<Arc<Metrics>>) -> impl IntoResponse {
    let h = &m.health;
    let body = format!(
        "started={} mqtt_connected={} mqtt_subscribed={} kafka_reachable={}\n",
        h.ready(),
        h.mqtt_connected(),
        h.mqtt_subscribed(),
        h.kafka_reachable()
    );
    if h.ready() {
        (StatusCode::OK, body)
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, body)
    }
}

async fn status(State(m): State<Arc<Metrics>>) -> impl IntoResponse {
    axum::Json(m.status())
}

async fn metrics_text(State(m): State<Arc<Metrics>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        m.encode(),
    )
}
