//! The operator's Prometheus metrics and its HTTP endpoints: `/metrics`, `/healthz` (the
//! process serves), `/readyz` (it reached the API server: leading or standing by).
//!
//! Label values are lower-case snake_case words, the vocabulary docs/metrics.md documents (alerts
//! are written from there): `kind` is [`Kind::label`], `reason` the reconcile error's,
//! `result` `ok` or `error`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tracing::error;

/// What a metric counts by `kind`.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Kind {
    BrokerConnection,
    ForwardingRule,
}

impl Kind {
    /// The `kind` label value (not the Kubernetes kind: label values are snake_case).
    pub const fn label(self) -> &'static str {
        match self {
            Self::BrokerConnection => "broker_connection",
            Self::ForwardingRule => "forwarding_rule",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabel {
    pub kind: &'static str,
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    pub result: &'static str,
}

pub struct Metrics {
    registry: Registry,
    reconciles: Family<KindLabel, Counter>,
    errors: Family<ErrorLabel, Counter>,
    durations: Family<KindLabel, Histogram>,
    status_writes: Family<KindLabel, Counter>,
    polls: Family<ResultLabel, Counter>,
    sessions_ended: Family<ResultLabel, Counter>,
    events_skipped: Counter,
    leader: Gauge,
    ready: AtomicBool,
    /// The objects behind `ferry_rule_ready` and `ferry_connection_ready`.
    watched: crate::readiness::Watched,
}

impl Metrics {
    pub fn new() -> Self {
        let mut root = Registry::default();
        ferry_api::metrics::register(&mut root, "ferry_operator", env!("CARGO_PKG_VERSION"));
        let watched = crate::readiness::Watched::default();
        root.register_collector(Box::new(watched.clone()));
        let registry = root.sub_registry_with_prefix("ferry_operator");
        let reconciles = Family::<KindLabel, Counter>::default();
        let errors = Family::<ErrorLabel, Counter>::default();
        let durations = Family::<KindLabel, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.001, 2.0, 14))
        });
        let status_writes = Family::<KindLabel, Counter>::default();
        let polls = Family::<ResultLabel, Counter>::default();
        let sessions_ended = Family::<ResultLabel, Counter>::default();
        let events_skipped = Counter::default();
        let leader = Gauge::default();
        registry.register("reconciles", "Reconciles run, by kind", reconciles.clone());
        registry.register(
            "reconcile_errors",
            "Reconciles that failed, by kind and reason",
            errors.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "Time a reconcile took, by kind",
            durations.clone(),
        );
        registry.register(
            "status_writes",
            "Status updates written (unchanged statuses are not written), by kind",
            status_writes.clone(),
        );
        registry.register(
            "forwarder_status_polls",
            "GET /status requests to forwarder pods, by result",
            polls.clone(),
        );
        registry.register(
            "mqtt_sessions_ended",
            "Attempts to end the MQTT session of a forwarder pod that is gone, by result",
            sessions_ended.clone(),
        );
        registry.register(
            "events_skipped",
            "Normal Events of transitions not sent because the status-write budget had no room",
            events_skipped.clone(),
        );
        registry.register(
            "leader",
            "1 while this replica holds the leader Lease",
            leader.clone(),
        );
        Self {
            registry: root,
            reconciles,
            errors,
            durations,
            status_writes,
            polls,
            sessions_ended,
            events_skipped,
            leader,
            ready: AtomicBool::new(false),
            watched,
        }
    }

    pub fn reconciled(&self, kind: Kind, took: Duration) {
        let kind = kind.label();
        self.reconciles.get_or_create(&KindLabel { kind }).inc();
        self.durations
            .get_or_create(&KindLabel { kind })
            .observe(took.as_secs_f64());
    }

    pub fn failed(&self, kind: Kind, reason: &'static str) {
        let kind = kind.label();
        self.errors
            .get_or_create(&ErrorLabel { kind, reason })
            .inc();
    }

    pub fn status_written(&self, kind: Kind) {
        let kind = kind.label();
        self.status_writes.get_or_create(&KindLabel { kind }).inc();
    }

    pub fn polled(&self, result: &'static str) {
        self.polls.get_or_create(&ResultLabel { result }).inc();
    }

    /// `result`: `ended` or `failed`.
    pub fn session_ended(&self, result: &'static str) {
        self.sessions_ended
            .get_or_create(&ResultLabel { result })
            .inc();
    }

    pub fn event_skipped(&self) {
        self.events_skipped.inc();
    }

    pub fn set_leader(&self, leading: bool) {
        self.leader.set(i64::from(leading));
    }

    /// The objects whose `Ready` the per-object series report (see [`crate::readiness`]).
    pub fn watched(&self) -> &crate::readiness::Watched {
        &self.watched
    }

    pub fn set_ready(&self) {
        self.ready.store(true, Ordering::Relaxed);
    }

    fn encode(&self) -> String {
        let mut out = String::new();
        if let Err(e) = encode(&mut out, &self.registry) {
            error!(error = %e, "cannot encode metrics");
        }
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

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
    if m.ready.load(Ordering::Relaxed) {
        (StatusCode::OK, "ok\n")
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not connected to the API server yet\n",
        )
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn the_metrics_page_lists_every_kind_and_only_those() {
        let kinds: BTreeSet<String> = [Kind::BrokerConnection, Kind::ForwardingRule]
            .map(|k| k.label().to_owned())
            .into();
        for metric in [
            "ferry_operator_reconciles_total",
            "ferry_operator_reconcile_errors_total",
            "ferry_operator_reconcile_duration_seconds",
            "ferry_operator_status_writes_total",
        ] {
            let documented = ferry_e2e::metrics::documented(
                include_str!("../../docs/metrics.md"),
                metric,
                "kind",
            );
            assert_eq!(documented, kinds, "{metric}");
        }
    }
}
