//! The data plane as the forwarders see it: every interval, `GET /status` on each forwarder
//! pod that has an IP (ready or not) and is its group's StatefulSet's (see [`counted_group`]),
//! summed per rule into its status (`Forwarding`, rate, counters, last error)
//! under a field manager of its own; `Forwarding` is True only once every pod serving the
//! rule's group reports its current filters subscribed (see `Filters` and
//! `status::rule_data`), which is what makes the rule `Ready`. Outside the reconcile loop on
//! purpose: rates change all the time, and a poll must not cost a reconcile. A condition change is written at once;
//! moving counters at most once per rule per write interval (see `status::data_write_due`).

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use ferry_api::crd::{ForwardingRule, ForwardingRuleStatus};
use futures::StreamExt;
use http_body_util::Empty;
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
use crate::podstatus::{fetch, owned_by, status_url};
use crate::render::{rule_name, workload_name};
use crate::scope::Scope;
use crate::status::{self, ACCEPTED, PodSeen, RuleSeen};
use crate::writer::{STATUS_FIELD_MANAGER, WRITE_BATCH, update_status, update_status_with};

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
            filters: Filters::default(),
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

/// When each rule's data-plane status was last written by this process, and what it remembers
/// of the rules' filters.
struct Writes {
    min_interval: jiff::SignedDuration,
    last: HashMap<RuleKey, jiff::Timestamp>,
    filters: Filters,
}

/// Each group's forwarder pods as one poll saw them, sorted by name.
type Reports = BTreeMap<GroupKey, Vec<PodSeen>>;

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
    writes.filters.observe_pods(&by_group);
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
    writes.filters.forget_rules(now);
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

/// Every forwarder pod its group's StatefulSet owns (`workloads`) and not being deleted, by
/// group and sorted by name: whether its kubelet says Ready, and its `GET /status` if it has an
/// IP and answered (a few asked at a time).
async fn fetch_reports(
    ctx: &Context,
    http: &HttpClient<HttpConnector, Empty<Bytes>>,
    pods: &Store<Pod>,
    workloads: &WorkloadUids,
) -> Reports {
    let targets: Vec<(GroupKey, String, bool, Option<String>)> = pods
        .state()
        .iter()
        .filter(|pod| pod.meta().deletion_timestamp.is_none())
        .filter_map(|pod| {
            let key = counted_group(pod, workloads)?;
            Some((key, pod.name_any(), kubelet_ready(pod), status_url(pod)))
        })
        .collect();
    let seen: Vec<(GroupKey, PodSeen)> = futures::stream::iter(targets)
        .map(|(key, name, ready, url)| async move {
            let report = match url {
                Some(url) => match fetch(http, &url).await {
                    Ok(report) => {
                        ctx.metrics.polled("ok");
                        Some(report)
                    }
                    Err(e) => {
                        ctx.metrics.polled("error");
                        debug!(pod = %name, url = %url, error = %e, "no /status");
                        None
                    }
                },
                None => None,
            };
            (
                key,
                PodSeen {
                    name,
                    ready,
                    report,
                },
            )
        })
        .buffer_unordered(CONCURRENT_REQUESTS)
        .collect()
        .await;
    let mut by_group = Reports::new();
    for (key, pod) in seen {
        by_group.entry(key).or_default().push(pod);
    }
    for pods in by_group.values_mut() {
        pods.sort_by(|a, b| a.name.cmp(&b.name));
    }
    by_group
}

/// Whether the pod's kubelet reports it Ready.
fn kubelet_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// What this poll writes of `rule`'s data-plane status (see [`RuleWrite`]).
fn decide(
    rule: &ForwardingRule,
    rule_key: &RuleKey,
    by_group: &Reports,
    writes: &mut Writes,
    now: jiff::Timestamp,
) -> RuleWrite {
    let current = rule.status.clone().unwrap_or_default();
    let current_view = status::rule_data_view(&current);
    let groups = rule_groups(rule, &rule_key.0, by_group);
    let name = rule_name(rule);
    let generation = rule.meta().generation;
    // The reconciler has rendered this generation into the group's config.
    let rendered = current.observed_generation == generation;
    let filters = filters_hash(rule);
    let stale = (writes.filters).stale(rule_key, &name, (filters, rendered), &groups, now);
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
    let seen = RuleSeen {
        name: &name,
        generation,
        groups: &groups,
        stale: &stale,
    };
    let (desired, transitions) = status::rule_data(Some(&current), &seen, now);
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

/// The pods of the groups serving `rule` (in namespace `ns`): its own group, and while it
/// moves, the one it leaves, whose workload its status still names (that group serves it
/// until the new one runs it).
fn rule_groups<'a>(rule: &ForwardingRule, ns: &str, by_group: &'a Reports) -> Vec<&'a [PodSeen]> {
    let connection = &rule.spec.connection_ref.name;
    let own = (ns.to_owned(), connection.clone(), rule.spec.group.clone());
    let mut groups = vec![by_group.get(&own).map(Vec::as_slice).unwrap_or_default()];
    let leaving = rule
        .status
        .as_ref()
        .and_then(|s| s.workload.as_deref())
        .filter(|w| *w != workload_name(connection, &rule.spec.group));
    if let Some(workload) = leaving {
        groups.extend(
            by_group
                .iter()
                .filter(|((n, c, g), _)| {
                    n == ns && c == connection && workload_name(c, g) == workload
                })
                .map(|(_, pods)| pods.as_slice()),
        );
    }
    groups
}

/// A rule's filters, in any order, as one number.
fn filters_hash(rule: &ForwardingRule) -> u64 {
    let sorted: BTreeSet<&str> = rule.spec.mqtt.topics.iter().map(|t| t.0.as_str()).collect();
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    sorted.hash(&mut hasher);
    hasher.finish()
}

/// How long the filters of a rule no longer seen are remembered: a rule deleted and made again
/// under its name within it is compared with them (pods may still run the old one). Longer
/// than kubelets take to sync a ConfigMap (about a minute by default).
const FORGET_RULES_AFTER: jiff::SignedDuration = jiff::SignedDuration::from_secs(600);

/// (started at, config generation) of a forwarder: it changes with every config it loads.
type Loaded = (jiff::Timestamp, u64);

/// What the poller remembers to tell whether a pod's config has a rule's current filters: a
/// pod's report names its rules and says whether they are subscribed, not with which filters.
/// When a rule's filters change, each pod of its groups is behind on that rule until it has
/// loaded a config (or restarted) since and the reconciler has rendered the change. Kept in
/// memory: after a restart of the operator every pod counts as current.
#[derive(Default)]
struct Filters {
    /// Each rule's filters as last seen ([`filters_hash`]), and when.
    rules: HashMap<RuleKey, (u64, jiff::Timestamp)>,
    /// By (namespace, pod): what each forwarder pod had loaded when last seen.
    pods: HashMap<(String, String), PodFilters>,
}

/// A forwarder pod's config as last seen, and the rules (by config name) whose filters changed
/// while it had it: the config it had then, and the filters it has.
type PodFilters = (Loaded, HashMap<String, (Loaded, u64)>);

impl Filters {
    /// Notes which config each pod that answered has loaded; forgets the pods gone.
    fn observe_pods(&mut self, by_group: &Reports) {
        let mut present = HashSet::new();
        for ((ns, _, _), pods) in by_group {
            for pod in pods {
                let key = (ns.clone(), pod.name.clone());
                present.insert(key.clone());
                let Some(report) = &pod.report else { continue };
                let loaded = (report.started_at, report.config.generation);
                match self.pods.entry(key) {
                    Entry::Occupied(mut e) => e.get_mut().0 = loaded,
                    Entry::Vacant(e) => {
                        e.insert((loaded, HashMap::new()));
                    }
                }
            }
        }
        self.pods.retain(|key, _| present.contains(key));
    }

    /// The pods of `groups` whose config may still have earlier filters of rule `name`; notes
    /// `filters` as its filters now, and whether the reconciler has `rendered` them.
    fn stale(
        &mut self,
        rule: &RuleKey,
        name: &str,
        (filters, rendered): (u64, bool),
        groups: &[&[PodSeen]],
        now: jiff::Timestamp,
    ) -> BTreeSet<String> {
        let changed_from = self
            .rules
            .insert(rule.clone(), (filters, now))
            .map(|(before, _)| before)
            .filter(|before| *before != filters);
        let mut stale = BTreeSet::new();
        for pod in groups.iter().flat_map(|g| g.iter()) {
            let Some((loaded, behind)) = self.pods.get_mut(&(rule.0.clone(), pod.name.clone()))
            else {
                continue;
            };
            if let Some(before) = changed_from {
                // Behind until it loads a config after this change; it still has what it had.
                let entry = behind.entry(name.to_owned()).or_insert((*loaded, before));
                entry.0 = *loaded;
            }
            let Some((then, has)) = behind.get(name).copied() else {
                continue;
            };
            if has == filters || (rendered && then != *loaded) {
                behind.remove(name);
            } else {
                stale.insert(pod.name.clone());
            }
        }
        stale
    }

    /// Forgets the filters of rules not seen for [`FORGET_RULES_AFTER`].
    fn forget_rules(&mut self, now: jiff::Timestamp) {
        self.rules
            .retain(|_, (_, seen)| now.duration_since(*seen) < FORGET_RULES_AFTER);
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

    /// A pod of group `default` of connection `plant` that answered: (started at second
    /// `started`, config `generation`).
    fn answered(name: &str, started: i64, generation: u64) -> PodSeen {
        let report = serde_json::json!({
            "version": "0", "startedAt": jiff::Timestamp::from_second(started).unwrap(),
            "config": {"generation": generation, "appliedAt": "2026-11-22T10:00:00Z"},
            "mqtt": {"connected": true, "subscribed": true}, "kafka": {"reachable": true},
            "inflight": 0, "rules": [],
        });
        PodSeen {
            name: name.into(),
            ready: true,
            report: Some(serde_json::from_value(report).unwrap()),
        }
    }

    /// A rule's changed filters make each pod of its group behind on that rule until it has
    /// loaded a config since and the reconciler has rendered the change (a report does not say
    /// which filters a rule has); a pod that reloaded before the render is not stuck behind,
    /// filters changed back need no reload, a pod first seen after the change is current.
    #[test]
    fn a_pod_is_behind_on_changed_filters_until_it_loads_a_config_after_the_render() {
        let key = ("plant".to_owned(), "telemetry".to_owned());
        let group_key = ("plant".to_owned(), "plant".to_owned(), "default".to_owned());
        let now = jiff::Timestamp::from_second(1000).unwrap();
        let mut f = Filters::default();
        let poll = |f: &mut Filters, pods: Vec<PodSeen>, filters, rendered| {
            let by_group = Reports::from([(group_key.clone(), pods)]);
            f.observe_pods(&by_group);
            let groups = [by_group[&group_key].as_slice()];
            f.stale(&key, "telemetry", (filters, rendered), &groups, now)
        };
        let none = BTreeSet::new();
        let p0 = BTreeSet::from(["p-0".to_owned()]);
        assert_eq!(poll(&mut f, vec![answered("p-0", 1, 1)], 10, true), none);
        // Changed: behind, rendered or not, until it loads a config.
        assert_eq!(poll(&mut f, vec![answered("p-0", 1, 1)], 20, false), p0);
        assert_eq!(poll(&mut f, vec![answered("p-0", 1, 1)], 20, true), p0);
        // A pod first seen now started with the config as it is.
        let both = || vec![answered("p-0", 1, 1), answered("p-1", 5, 1)];
        assert_eq!(poll(&mut f, both(), 20, true), p0);
        assert_eq!(poll(&mut f, vec![answered("p-0", 1, 2)], 20, true), none);
        // Changed again and back before any reload: nothing to wait for.
        assert_eq!(poll(&mut f, vec![answered("p-0", 1, 2)], 30, true), p0);
        assert_eq!(poll(&mut f, vec![answered("p-0", 1, 2)], 20, true), none);
        // A reload seen before the render still counts once it is rendered.
        assert_eq!(poll(&mut f, vec![answered("p-0", 1, 2)], 40, false), p0);
        assert_eq!(poll(&mut f, vec![answered("p-0", 1, 3)], 40, false), p0);
        assert_eq!(poll(&mut f, vec![answered("p-0", 1, 3)], 40, true), none);
        // A restart loads the config as it is, like a reload.
        assert_eq!(poll(&mut f, vec![answered("p-0", 1, 3)], 50, true), p0);
        assert_eq!(poll(&mut f, vec![answered("p-0", 9, 1)], 50, true), none);
        // A rule not seen for a while is forgotten: its filters are taken as they come.
        f.forget_rules(now + FORGET_RULES_AFTER);
        assert!(f.rules.is_empty());
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
