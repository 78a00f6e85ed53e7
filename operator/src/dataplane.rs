//! The data plane as the forwarders see it: every interval, `GET /status` on each forwarder
//! pod that has an IP (ready or not) and is its group's StatefulSet's (see [`counted_group`]),
//! summed per rule into its status (`Forwarding`, rate, counters, last error)
//! under a field manager of its own. Outside the reconcile loop on purpose: rates change all
//! the time, and a poll must not cost a reconcile. A condition change is written at once;
//! moving counters at most once per rule per write interval (see `status::data_write_due`).

use std::collections::{BTreeMap, HashMap, HashSet};
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
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PartialObjectMeta};
use kube::core::DeserializeGuard;
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use tracing::{debug, warn};

use crate::budget::Urgency;
use crate::children::{LABEL_CONNECTION, LABEL_GROUP, SELECTOR};
use crate::context::{Context, wait_listed};
use crate::controller::WRITE_BATCH;
use crate::render::{HTTP_PORT, rule_name, workload_name};
use crate::scope::Scope;
use crate::status::{self, ACCEPTED};
use crate::writer::{STATUS_FIELD_MANAGER, update_status, update_status_with};

const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// A `/status` body is a few KiB, a few MiB for thousands of rules in an outage; see
/// `STATUS_MAX_BYTES` for the bound (only pods of the group's StatefulSet are read).
const MAX_BODY: usize = ferry_api::status::STATUS_MAX_BYTES;
const CONCURRENT_REQUESTS: usize = 16;

/// (namespace, connection, group): the pods of one forwarder StatefulSet.
type GroupKey = (String, String, String);
/// (namespace, name) of a rule.
type RuleKey = (String, String);
/// The uid of each forwarder StatefulSet, by (namespace, name).
type WorkloadUids = HashMap<(String, String), String>;

/// How often the pods are polled, and how often a rule's moving counters may be written.
#[derive(Debug, Clone, Copy)]
pub struct Polling {
    pub interval: Duration,
    pub min_write_interval: Duration,
    /// The status writes a second the whole operator may send (0: no budget); see
    /// [`crate::budget`].
    pub writes_per_second: f64,
}

pub async fn run(
    ctx: Arc<Context>,
    scope: &Scope,
    rules: Store<DeserializeGuard<ForwardingRule>>,
    rules_listed: tokio::sync::watch::Receiver<bool>,
    polling: Polling,
) {
    let (pods, writer) = reflector::store();
    let pod_watch = scope
        .reflect::<Pod>(
            &ctx.client,
            &watcher::Config::default().labels(SELECTOR),
            writer,
        )
        .for_each(|_| async {});
    // The StatefulSets' uids, which a pod's owner reference must name for its report to count.
    let (workloads, writer) = reflector::store();
    let workload_watch = scope
        .reflect::<PartialObjectMeta<StatefulSet>>(
            &ctx.client,
            &watcher::Config::default().labels(SELECTOR),
            writer,
        )
        .for_each(|_| async {});
    let http: HttpClient<HttpConnector, Empty<Bytes>> =
        HttpClient::builder(TokioExecutor::new()).build_http();
    let polls = async {
        // The pod and StatefulSet stores have no other waiter; the rule controller's applier
        // waits on `rules`.
        if pods.wait_until_ready().await.is_err()
            || workloads.wait_until_ready().await.is_err()
            || !wait_listed(&rules_listed).await
        {
            return;
        }
        let mut tick = tokio::time::interval(polling.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut writes = Writes {
            min_interval: jiff::SignedDuration::try_from(polling.min_write_interval)
                .unwrap_or(jiff::SignedDuration::MAX),
            last: HashMap::new(),
        };
        loop {
            tick.tick().await;
            // Counters-only writes the budget has no room for before the next poll wait for
            // it: that poll has newer figures.
            let next_poll = tokio::time::Instant::now() + polling.interval;
            let stores = (&pods, &workloads, &rules);
            poll_once(&ctx, &http, stores, &mut writes, next_poll).await;
        }
    };
    tokio::select! {
        () = pod_watch => {}
        () = workload_watch => {}
        () = polls => {}
    }
}

/// The pods, the forwarder StatefulSets and the rules, as watched.
type Stores<'a> = (
    &'a Store<Pod>,
    &'a Store<PartialObjectMeta<StatefulSet>>,
    &'a Store<DeserializeGuard<ForwardingRule>>,
);

/// When each rule's data-plane status was last written by this process.
struct Writes {
    min_interval: jiff::SignedDuration,
    last: HashMap<RuleKey, jiff::Timestamp>,
}

/// Reports per group.
type Reports = BTreeMap<GroupKey, Vec<(String, ForwarderStatus)>>;

/// What one poll writes of one rule's data-plane status.
enum RuleWrite {
    /// Nothing changed, or only counters not yet due.
    Nothing,
    /// Not served (paused, or not accepted): take back what this writer said.
    TakeBack,
    /// News (a condition change, the counters appearing or going): written at once.
    Now {
        desired: ForwardingRuleStatus,
        transitions: Vec<crate::conditions::Transition>,
    },
    /// Moving counters only, due: written when the budget has room, the rules written longest
    /// ago (`last`) first.
    Counters {
        last: Option<jiff::Timestamp>,
        desired: ForwardingRuleStatus,
    },
}

/// One poll: every forwarder pod's report, then every rule's data-plane status from them:
/// news at once (a few writes in flight), then moving counters as the operator's write budget
/// allows until `next_poll`, the rules written longest ago first (the others wait for a later
/// poll, which has newer figures).
async fn poll_once(
    ctx: &Context,
    http: &HttpClient<HttpConnector, Empty<Bytes>>,
    (pods, workloads, rules): Stores<'_>,
    writes: &mut Writes,
    next_poll: tokio::time::Instant,
) {
    let by_group = fetch_reports(ctx, http, pods, &workload_uids(workloads)).await;
    let now = jiff::Timestamp::now();
    let mut seen = HashSet::new();
    let mut at_once = Vec::new();
    let mut deferred = Vec::new();
    for guarded in rules.state() {
        let Ok(rule) = &guarded.0 else { continue };
        let Some(ns) = rule.namespace() else { continue };
        let rule_key = (ns, rule.name_any());
        seen.insert(rule_key.clone());
        if rule.status.as_ref().is_some_and(status::ready_stale) {
            ctx.data_plane_changed(&rule_key.0, &rule.spec.connection_ref.name);
        }
        match decide(rule, &rule_key, &by_group, writes, now) {
            RuleWrite::Nothing => {}
            RuleWrite::TakeBack => {
                writes.last.remove(&rule_key);
                at_once.push(AtOnce::TakeBack(Arc::clone(&guarded)));
            }
            RuleWrite::Now {
                desired,
                transitions,
            } => {
                let guarded = Arc::clone(&guarded);
                let desired = Box::new(desired);
                at_once.push(AtOnce::Write(guarded, rule_key, desired, transitions));
            }
            RuleWrite::Counters { last, desired } => {
                deferred.push((last, Arc::clone(&guarded), rule_key, desired));
            }
        }
    }
    writes.last.retain(|key, _| seen.contains(key));
    // In batches: thousands of writes' futures made up front would hold thousands of request
    // states at once.
    let mut at_once = at_once.into_iter().peekable();
    while at_once.peek().is_some() {
        let batch: Vec<_> = at_once
            .by_ref()
            .take(WRITE_BATCH)
            .map(|w| w.start(ctx))
            .collect();
        let written: Vec<Option<RuleKey>> = futures::stream::iter(batch)
            .buffer_unordered(CONCURRENT_REQUESTS)
            .collect()
            .await;
        writes
            .last
            .extend(written.into_iter().flatten().map(|key| (key, now)));
    }
    deferred.sort_by_key(|d| d.0);
    for (_, guarded, rule_key, desired) in deferred {
        if !ctx.budget.wait_until(next_poll).await {
            break;
        }
        let update = (desired, Vec::new());
        if let Some(key) = write_rule(ctx, guarded, rule_key, update, Urgency::Deferrable).await {
            writes.last.insert(key, now);
        }
    }
}

/// `GET /status` on every forwarder pod with an IP that its group's StatefulSet owns
/// (`workloads`), a few at a time; the answers by group, sorted by pod name. A group whose pods
/// all failed to answer has an empty list.
async fn fetch_reports(
    ctx: &Context,
    http: &HttpClient<HttpConnector, Empty<Bytes>>,
    pods: &Store<Pod>,
    workloads: &WorkloadUids,
) -> Reports {
    let targets: Vec<(GroupKey, String, String)> = pods
        .state()
        .iter()
        .filter_map(|pod| {
            let key = counted_group(pod, workloads)?;
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
    let mut by_group = Reports::new();
    for (key, pod, report) in reports {
        let entry = by_group.entry(key).or_default();
        if let Some(r) = report {
            entry.push((pod, r));
        }
    }
    for (_, reports) in by_group.iter_mut() {
        reports.sort_by(|a, b| a.0.cmp(&b.0));
    }
    by_group
}

/// What this poll writes of `rule`'s data-plane status (see [`RuleWrite`]).
fn decide(
    rule: &ForwardingRule,
    rule_key: &RuleKey,
    by_group: &Reports,
    writes: &Writes,
    now: jiff::Timestamp,
) -> RuleWrite {
    let current = rule.status.clone().unwrap_or_default();
    let current_view = status::rule_data_view(&current);
    let serving = !rule.spec.paused
        && status::condition(&current.conditions, ACCEPTED)
            .is_some_and(|c| c.status == crate::conditions::TRUE);
    if !serving {
        return if current_view == ForwardingRuleStatus::default() {
            RuleWrite::Nothing
        } else {
            RuleWrite::TakeBack
        };
    }
    let key = (
        rule_key.0.clone(),
        rule.spec.connection_ref.name.clone(),
        rule.spec.group.clone(),
    );
    let reports = by_group.get(&key).map(Vec::as_slice).unwrap_or_default();
    let (desired, transitions) = status::rule_data(Some(&current), &rule_name(rule), reports, now);
    let last = writes.last.get(rule_key).copied();
    if !status::data_write_due(&current_view, &desired, last, now, writes.min_interval) {
        RuleWrite::Nothing
    } else if status::data_write_urgent(&current_view, &desired) {
        RuleWrite::Now {
            desired,
            transitions,
        }
    } else {
        RuleWrite::Counters { last, desired }
    }
}

type Written<'a> =
    std::pin::Pin<Box<dyn std::future::Future<Output = Option<RuleKey>> + Send + 'a>>;

/// A write of this poll that does not wait for the budget.
enum AtOnce {
    TakeBack(Arc<DeserializeGuard<ForwardingRule>>),
    Write(
        Arc<DeserializeGuard<ForwardingRule>>,
        RuleKey,
        Box<ForwardingRuleStatus>,
        Vec<crate::conditions::Transition>,
    ),
}

impl AtOnce {
    fn start(self, ctx: &Context) -> Written<'_> {
        match self {
            AtOnce::TakeBack(guarded) => take_back(ctx, guarded),
            AtOnce::Write(guarded, key, desired, transitions) => {
                let update = (*desired, transitions);
                Box::pin(write_rule(ctx, guarded, key, update, Urgency::Now))
            }
        }
    }
}

/// Takes back this writer's status of a rule not served. Never counts as a write of its
/// counters.
fn take_back(ctx: &Context, guarded: Arc<DeserializeGuard<ForwardingRule>>) -> Written<'_> {
    Box::pin(async move {
        let Ok(rule) = &guarded.0 else { return None };
        let ns = rule.namespace().unwrap_or_default();
        let api = Api::<ForwardingRule>::namespaced(ctx.client.clone(), &ns);
        let update = (&serde_json::json!({}), true);
        if let Err(e) = update_status(ctx, &api, rule, STATUS_FIELD_MANAGER, update, &[]).await {
            warn!(rule = %rule.name_any(), error = %e, "cannot take back data-plane status");
        }
        None
    })
}

/// Writes a rule's data-plane status and publishes its transitions; a change of whether it
/// forwards asks for its connection's reconcile (its `Ready`). The rule's key when written.
async fn write_rule(
    ctx: &Context,
    guarded: Arc<DeserializeGuard<ForwardingRule>>,
    rule_key: RuleKey,
    (desired, transitions): (ForwardingRuleStatus, Vec<crate::conditions::Transition>),
    urgency: Urgency,
) -> Option<RuleKey> {
    let Ok(rule) = &guarded.0 else { return None };
    let ns = rule_key.0.clone();
    let api = Api::<ForwardingRule>::namespaced(ctx.client.clone(), &ns);
    let update = (&desired, true);
    let written = update_status_with(
        ctx,
        &api,
        rule,
        STATUS_FIELD_MANAGER,
        update,
        &transitions,
        urgency,
    );
    match written.await {
        Ok(_) => {
            let current_view = status::rule_data_view(&rule.status.clone().unwrap_or_default());
            if status::ready_affected(&current_view, &desired) {
                ctx.data_plane_changed(&ns, &rule.spec.connection_ref.name);
            }
            Some(rule_key)
        }
        // The next poll writes it again; a deleted rule is no error worth more than a line.
        Err(e) => {
            warn!(rule = %rule.name_any(), error = %e, "cannot write data-plane status");
            None
        }
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

/// The uid of each StatefulSet in `store`, by namespace and name.
fn workload_uids(store: &Store<PartialObjectMeta<StatefulSet>>) -> WorkloadUids {
    store
        .state()
        .iter()
        .filter_map(|s| Some(((s.namespace()?, s.name_any()), s.uid()?)))
        .collect()
}

/// The group whose rules a forwarder pod's report counts for: the one its labels name, if its
/// controller is that group's StatefulSet (`<connection>-<group>`, by uid in `workloads`).
/// Labels alone are anyone's to set: a pod made with them by anyone else (a copy of a
/// forwarder pod, a debugging pod, another workload) must not speak for the rules.
fn counted_group(pod: &Pod, workloads: &WorkloadUids) -> Option<GroupKey> {
    let key = group_key(pod)?;
    let uid = workloads.get(&(key.0.clone(), workload_name(&key.1, &key.2)))?;
    owned_by(pod, uid).then_some(key)
}

/// Whether `pod`'s controller is the StatefulSet whose uid is `uid` (a pod's owner reference
/// holds the uid; its name alone could be anyone's).
pub(crate) fn owned_by(pod: &Pod, uid: &str) -> bool {
    !uid.is_empty()
        && pod.owner_references().iter().any(|o| {
            o.controller == Some(true)
                && o.kind == "StatefulSet"
                && o.api_version == "apps/v1"
                && o.uid == uid
        })
}

/// `http://<pod IP>:<port named http>/status`, for every pod with an IP that is not being
/// deleted, ready or not: a forwarder that lost its broker is exactly the one whose report
/// says why.
fn status_url(pod: &Pod) -> Option<String> {
    if pod.meta().deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref()?;
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

/// One pod's `/status`, if it has an address and answers.
pub(crate) async fn pod_status(pod: &Pod) -> Option<ForwarderStatus> {
    let http: HttpClient<HttpConnector, Empty<Bytes>> =
        HttpClient::builder(TokioExecutor::new()).build_http();
    fetch(&http, &status_url(pod)?).await.ok()
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

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(yaml: &str) -> Pod {
        serde_saphyr::from_str(yaml).unwrap_or_else(|e| panic!("{e}\n{yaml}"))
    }

    const POD: &str = "
metadata: { name: plant-default-0, namespace: plant }
spec: { containers: [{ name: forwarder, ports: [{ name: http, containerPort: 9090 }] }] }
status:
  podIP: 10.1.2.3
  conditions: [{ type: Ready, status: 'False' }]
";

    /// A pod's report counts for the group its labels name only if that group's StatefulSet
    /// controls it, by uid: labels are anyone's to set.
    #[test]
    fn only_pods_of_their_groups_statefulset_count() {
        let labelled = |owners: &str| {
            pod(&format!(
                "metadata:\n  name: plant-default-0\n  namespace: plant\n  labels: {{ app.kubernetes.io/name: ferry-forwarder, ferry.dev/connection: plant, ferry.dev/group: default }}\n  ownerReferences: {owners}\n"
            ))
        };
        let owner = |kind: &str, name: &str, uid: &str, controller: bool| {
            format!(
                "[{{ apiVersion: apps/v1, kind: {kind}, name: {name}, uid: {uid}, controller: {controller} }}]"
            )
        };
        let workloads = WorkloadUids::from([(
            ("plant".to_owned(), "plant-default".to_owned()),
            "u-1".to_owned(),
        )]);
        let group = Some(("plant".to_owned(), "plant".to_owned(), "default".to_owned()));
        let ours = labelled(&owner("StatefulSet", "plant-default", "u-1", true));
        assert_eq!(counted_group(&ours, &workloads), group);
        for (what, owners) in [
            ("no owner", "[]".to_owned()),
            (
                "another StatefulSet of the same name (since made again)",
                owner("StatefulSet", "plant-default", "u-2", true),
            ),
            (
                "another kind with the uid",
                owner("ReplicaSet", "plant-default", "u-1", true),
            ),
            (
                "an owner that is not its controller",
                owner("StatefulSet", "plant-default", "u-1", false),
            ),
        ] {
            assert_eq!(
                counted_group(&labelled(&owners), &workloads),
                None,
                "{what}"
            );
        }
        // Its group's StatefulSet not (yet) known: nothing to compare with.
        assert_eq!(counted_group(&ours, &WorkloadUids::new()), None);
        // The StatefulSet of another group or namespace does not make it count either.
        let elsewhere = WorkloadUids::from([(
            ("other".to_owned(), "plant-default".to_owned()),
            "u-1".to_owned(),
        )]);
        assert_eq!(counted_group(&ours, &elsewhere), None);
    }

    #[test]
    fn pods_are_polled_ready_or_not_but_not_while_deleted_or_without_an_ip() {
        assert_eq!(
            status_url(&pod(POD)).as_deref(),
            Some("http://10.1.2.3:9090/status"),
            "a NotReady pod is the one whose report says why"
        );
        let deleting = POD.replace(
            "metadata: {",
            "metadata: { deletionTimestamp: '2026-11-23T00:00:00Z',",
        );
        assert_eq!(status_url(&pod(&deleting)), None);
        let pending = POD.replace("  podIP: 10.1.2.3\n", "");
        assert_eq!(status_url(&pod(&pending)), None);
        let v6 = POD.replace("10.1.2.3", "fd00::3");
        assert_eq!(
            status_url(&pod(&v6)).as_deref(),
            Some("http://[fd00::3]:9090/status")
        );
    }
}
