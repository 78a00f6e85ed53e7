//! The data plane as the forwarders see it: every interval, `GET /status` on each ready
//! forwarder pod, summed per rule into its status (`Forwarding`, rate, counters, last error)
//! under a field manager of its own. Outside the reconcile loop on purpose: rates change all
//! the time, and a poll must not cost a reconcile.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use ferry_api::crd::{ForwardingRule, ForwardingRuleStatus};
use ferry_api::status::{ForwarderStatus, STATUS_PATH};
use futures::StreamExt;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::core::DeserializeGuard;
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use tracing::{debug, warn};

use crate::children::{LABEL_CONNECTION, LABEL_GROUP, SELECTOR};
use crate::controller::{Context, STATUS_FIELD_MANAGER, publish, wait_listed, write_status};
use crate::render::{HTTP_PORT, rule_name};
use crate::scope::Scope;
use crate::status::{self, ACCEPTED};

const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// A `/status` body is a few KiB; anything far larger is not a forwarder.
const MAX_BODY: usize = 4 << 20;
const CONCURRENT_REQUESTS: usize = 16;

/// (namespace, connection, group): the pods of one forwarder StatefulSet.
type GroupKey = (String, String, String);

pub async fn run(
    ctx: Arc<Context>,
    scope: &Scope,
    rules: Store<DeserializeGuard<ForwardingRule>>,
    rules_listed: tokio::sync::watch::Receiver<bool>,
    interval: Duration,
) {
    let (pods, writer) = reflector::store();
    let pod_watch = scope
        .reflect::<Pod>(
            &ctx.client,
            &watcher::Config::default().labels(SELECTOR),
            writer,
        )
        .for_each(|_| async {});
    let http: HttpClient<HttpConnector, Empty<Bytes>> =
        HttpClient::builder(TokioExecutor::new()).build_http();
    let polls = async {
        // The pod store has no other waiter; the rule controller's applier waits on `rules`.
        if pods.wait_until_ready().await.is_err() || !wait_listed(&rules_listed).await {
            return;
        }
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            poll_once(&ctx, &http, &pods, &rules).await;
        }
    };
    tokio::select! {
        () = pod_watch => {}
        () = polls => {}
    }
}

async fn poll_once(
    ctx: &Context,
    http: &HttpClient<HttpConnector, Empty<Bytes>>,
    pods: &Store<Pod>,
    rules: &Store<DeserializeGuard<ForwardingRule>>,
) {
    let targets: Vec<(GroupKey, String, String)> = pods
        .state()
        .iter()
        .filter_map(|pod| {
            let key = group_key(pod)?;
            let url = status_url(pod)?;
            Some((key, pod.name_any(), url))
        })
        .collect();
    let reports: Vec<(GroupKey, String, Option<ForwarderStatus>)> = futures::stream::iter(targets)
        .map(|(key, pod, url)| async move {
            let report = fetch(http, &url).await;
            match &report {
                Ok(_) => ctx.metrics.polled("ok"),
                Err(e) => {
                    ctx.metrics.polled("error");
                    debug!(pod = %pod, url = %url, error = %e, "no /status");
                }
            }
            (key, pod, report.ok())
        })
        .buffer_unordered(CONCURRENT_REQUESTS)
        .collect()
        .await;
    let mut by_group: BTreeMap<GroupKey, Vec<(String, ForwarderStatus)>> = BTreeMap::new();
    for (key, pod, report) in reports {
        let entry = by_group.entry(key).or_default();
        if let Some(r) = report {
            entry.push((pod, r));
        }
    }
    for (_, reports) in by_group.iter_mut() {
        reports.sort_by(|a, b| a.0.cmp(&b.0));
    }

    let now = jiff::Timestamp::now();
    for guarded in rules.state() {
        let Ok(rule) = &guarded.0 else { continue };
        let Some(ns) = rule.namespace() else { continue };
        let current = rule.status.clone().unwrap_or_default();
        let current_view = status::rule_data_view(&current);
        let serving = !rule.spec.paused
            && status::condition(&current.conditions, ACCEPTED)
                .is_some_and(|c| c.status == crate::conditions::TRUE);
        let api = Api::<ForwardingRule>::namespaced(ctx.client.clone(), &ns);
        if !serving {
            // Not served: take back what this writer said, if anything.
            if current_view != ForwardingRuleStatus::default() {
                write(ctx, &api, rule, &serde_json::json!({})).await;
            }
            continue;
        }
        let key = (
            ns.clone(),
            rule.spec.connection_ref.name.clone(),
            rule.spec.group.clone(),
        );
        let reports = by_group.get(&key).map(Vec::as_slice).unwrap_or_default();
        let (desired, transitions) =
            status::rule_data(Some(&current), &rule_name(rule), reports, now);
        if desired != current_view {
            write(ctx, &api, rule, &desired).await;
        }
        publish(ctx, &rule.object_ref(&()), &transitions).await;
    }
}

async fn write<S: serde::Serialize>(
    ctx: &Context,
    api: &Api<ForwardingRule>,
    rule: &ForwardingRule,
    status: &S,
) {
    match write_status(api, &rule.name_any(), STATUS_FIELD_MANAGER, status).await {
        Ok(()) => ctx.metrics.status_written("ForwardingRule"),
        // The next poll writes it again; a deleted rule is no error worth more than a line.
        Err(e) => warn!(rule = %rule.name_any(), error = %e, "cannot write data-plane status"),
    }
}

fn group_key(pod: &Pod) -> Option<GroupKey> {
    let labels = pod.labels();
    Some((
        pod.namespace()?,
        labels.get(LABEL_CONNECTION)?.clone(),
        labels.get(LABEL_GROUP)?.clone(),
    ))
}

/// `http://<pod IP>:<port named http>/status`, for a ready pod.
fn status_url(pod: &Pod) -> Option<String> {
    let status = pod.status.as_ref()?;
    let ready = status
        .conditions
        .as_ref()?
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    if !ready || pod.meta().deletion_timestamp.is_some() {
        return None;
    }
    let ip = status.pod_ip.as_ref()?;
    let port = pod
        .spec
        .as_ref()?
        .containers
        .iter()
        .flat_map(|c| c.ports.iter().flatten())
        .find(|p| p.name.as_deref() == Some("http"))
        .map_or(i32::from(HTTP_PORT), |p| p.container_port);
    let host = if ip.contains(':') {
        format!("[{ip}]")
    } else {
        ip.clone()
    };
    Some(format!("http://{host}:{port}{STATUS_PATH}"))
}

#[derive(Debug, thiserror::Error)]
enum FetchError {
    #[error("bad URL: {0}")]
    Url(#[from] hyper::http::uri::InvalidUri),
    #[error("request: {0}")]
    Request(#[from] hyper_util::client::legacy::Error),
    #[error("no answer within {REQUEST_TIMEOUT:?}")]
    Timeout,
    #[error("HTTP {0}")]
    Status(hyper::StatusCode),
    #[error("body: {0}")]
    Body(String),
    #[error("not a forwarder status: {0}")]
    Json(#[from] serde_json::Error),
}

async fn fetch(
    http: &HttpClient<HttpConnector, Empty<Bytes>>,
    url: &str,
) -> Result<ForwarderStatus, FetchError> {
    let request = async {
        let response = http.get(url.parse()?).await?;
        if !response.status().is_success() {
            return Err(FetchError::Status(response.status()));
        }
        let body = Limited::new(response.into_body(), MAX_BODY)
            .collect()
            .await
            .map_err(|e| FetchError::Body(e.to_string()))?
            .to_bytes();
        Ok(serde_json::from_slice(&body)?)
    };
    tokio::time::timeout(REQUEST_TIMEOUT, request)
        .await
        .map_err(|_| FetchError::Timeout)?
}
