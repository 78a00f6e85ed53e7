//! The reconcile loops.
//!
//! BrokerConnection, one at a time: dereference (its rules and Secrets) → build the whole
//! connection's plan (pure, [`crate::plan`]: validation, every group's children, every rule's
//! fate) → apply every group (server-side apply, one field manager) → prune (the children of
//! groups that no longer have rules) → end the MQTT sessions of pods gone for good
//! ([`crate::finalize`]) → status (connection and each rule's `Accepted`/`Ready`, written only
//! when changed) → Events for transitions. A deleted connection runs its finalizer instead.
//!
//! ForwardingRule: only what the connection loop cannot see, a rule whose connection does
//! not exist or cannot be read, and a rule this operator cannot read.
//!
//! Triggers are spec changes (generation) and deletions, never status writes, so the operator's
//! own status updates do not wake it: at steady state nothing reconciles.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_api::crd::{
    BrokerConnection, BrokerConnectionStatus, ForwardingRule, ForwardingRuleStatus,
};
use futures::{Stream, StreamExt};
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::Api;
use kube::core::{DeserializeGuard, PartialObjectMeta};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use crate::apply::{apply, prune, read_secrets, taken};
use crate::budget::WriteBudget;
use crate::children;
use crate::conditions::FALSE;
use crate::context::{At, Context, Error, Step, listed, wait_listed};
use crate::events::{Recorder, Reporter};
use crate::finalize::{SessionsOutcome, end_gone_sessions, finalize, set_finalizer};
use crate::handover::{self, Move, MovePhase, Retirement};
use crate::image::ForwarderImage;
use crate::metrics::{Kind, Metrics};
use crate::netpol::ForwarderNetworkPolicy;
use crate::ownership::Serving;
use crate::plan::{self, GroupPlan, RulePlan};
use crate::preflight;
use crate::scope::Scope;
use crate::status::{self, RuleOutcome, Workload, column};
use crate::validate::{MARK_VALUE, SECRET_MARK, referenced_secrets};
use crate::writer::{
    CONCURRENT_WRITES, FIELD_MANAGER, WRITE_BATCH, current_status, event, update_status, warn_event,
};
use kube::runtime::events::EventType;

const CONNECTION: &str = "BrokerConnection";
const RULE: &str = "ForwardingRule";
/// A safety net against drift nobody told us about; changes arrive by watch.
const RESYNC: Duration = Duration::from_secs(600);

/// How soon to reconcile again a connection whose Secrets do not resolve, or one of whose
/// groups has a name another owner holds.
const UNRESOLVED_RETRY: Duration = Duration::from_secs(30);
/// How often a scale-down looks again at the pods it waits for: a pod reports drained a few
/// seconds after its config lists it (the kubelet's ConfigMap sync, then the drain's quiet
/// period).
const DRAIN_POLL: Duration = Duration::from_secs(5);

/// Runs the controllers and the data-plane poller until `shutdown` completes, watching the
/// namespaces of `scope` only.
pub async fn run(
    client: Client,
    scope: Scope,
    metrics: Arc<Metrics>,
    status_polling: crate::dataplane::Polling,
    identity: String,
    (forwarder_image, network_policy, topic_check_interval): (
        ForwarderImage,
        Option<ForwarderNetworkPolicy>,
        Duration,
    ),
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let shutdown = futures::FutureExt::shared(Box::pin(shutdown));
    let unfiltered = watcher::Config::default();
    let (connections, connection_writer) = reflector::store::<DeserializeGuard<BrokerConnection>>();
    let connection_events = scope.reflect(&client, &unfiltered, connection_writer);
    let (connection_events, connections_listed) = listed(connection_events);
    let (rules, rule_writer) = reflector::store::<DeserializeGuard<ForwardingRule>>();
    let rule_events = scope.reflect(&client, &unfiltered, rule_writer);
    let (rule_events, rules_listed) = listed(rule_events);

    metrics.watched().watch(connections.clone(), rules.clone());
    let serving = Arc::clone(&metrics);
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: "ferry-operator".into(),
            instance: identity,
        },
    );
    let (ctx, ready_changes) = Context::new(
        client.clone(),
        metrics,
        recorder,
        (connections.clone(), connections_listed),
        (rules.clone(), rules_listed.clone()),
        forwarder_image,
        WriteBudget::new(status_polling.writes_per_second),
    );
    let mut ctx = ctx;
    ctx.network_policy = network_policy;
    ctx.topics = crate::preflight::TopicCache::new(topic_check_interval);
    let ctx = Arc::new(ctx);
    // The rule loop's own watch, once its store has a rule's change, tells the connection loop
    // (rather than a second watch of every rule, which could run ahead of the store the
    // connection renders from).
    let (rule_changes, rule_changes_rx) = mpsc::unbounded_channel();
    let rule_changes_rx = futures::stream::unfold(rule_changes_rx, |mut rx| async move {
        rx.recv().await.map(|target| (target, rx))
    });

    let connection_loop = connection_loop(
        (&client, &scope),
        connection_events,
        connections,
        futures::stream::select(ready_changes, rule_changes_rx),
        shutdown.clone(),
        Arc::clone(&ctx),
    );
    let rule_loop = rule_loop(
        (&client, &scope),
        rule_events,
        (rules.clone(), rule_changes),
        shutdown,
        Arc::clone(&ctx),
    );
    let poller = crate::dataplane::run(ctx, &scope, rules, rules_listed, status_polling);
    tokio::select! {
        _ = futures::future::join(connection_loop, rule_loop) => {}
        () = poller => {}
    }
    serving.watched().clear();
}

/// The BrokerConnection loop. Besides its own spec changes, what decides its children wakes
/// it: the forwarders' StatefulSets and ConfigMaps it owns, the Secrets it references, and
/// `changes`: its rules' (from the rule loop) and a forwarder becoming ready or not.
fn connection_loop(
    (client, scope): (&Client, &Scope),
    events: impl Stream<Item = watcher::Result<watcher::Event<DeserializeGuard<BrokerConnection>>>>
    + Send
    + 'static,
    connections: Store<DeserializeGuard<BrokerConnection>>,
    changes: impl Stream<Item = ObjectRef<DeserializeGuard<BrokerConnection>>> + Send + 'static,
    shutdown: impl Future<Output = ()> + Send + Sync + Clone + 'static,
    ctx: Arc<Context>,
) -> impl Future<Output = ()> {
    let forwarders = watcher::Config::default().labels(children::SELECTOR);
    let secret_index = connections.clone();
    let marked = watcher::Config::default().labels(&format!("{SECRET_MARK}={MARK_VALUE}"));
    Controller::for_stream(spec_changes(events), connections)
        .owns_stream(
            scope
                .watch::<PartialObjectMeta<StatefulSet>>(client, &forwarders)
                .touched_objects(),
        )
        .owns_stream(
            scope
                .watch::<PartialObjectMeta<ConfigMap>>(client, &forwarders)
                .touched_objects(),
        )
        // A created, rotated, marked or unmarked Secret reconciles the connections that
        // reference it. Only marked Secrets are watched: one losing the mark leaves the
        // selection, which the watch reports as a deletion.
        .watches_stream(
            scope
                .watch::<PartialObjectMeta<Secret>>(client, &marked)
                .touched_objects(),
            move |secret| connections_referencing(&secret_index, &secret),
        )
        .reconcile_on(changes)
        .graceful_shutdown_on(shutdown)
        .run(reconcile_connection, error_policy, ctx)
        .for_each(|_| async {})
}

/// The ForwardingRule loop. It also follows connections: a deleted connection strands its
/// rules. Each rule's spec change or deletion goes to `connection_changes` too, for the
/// connection it names, once the store has it.
fn rule_loop(
    (client, scope): (&Client, &Scope),
    events: impl Stream<Item = watcher::Result<watcher::Event<DeserializeGuard<ForwardingRule>>>>
    + Send
    + 'static,
    (rules, connection_changes): (
        Store<DeserializeGuard<ForwardingRule>>,
        mpsc::UnboundedSender<ObjectRef<DeserializeGuard<BrokerConnection>>>,
    ),
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
    ctx: Arc<Context>,
) -> impl Future<Output = ()> {
    // A second watch of the connections, for triggers only (the connection loop reflects them).
    let connection_copy =
        scope.watch::<DeserializeGuard<BrokerConnection>>(client, &watcher::Config::default());
    let rule_index = rules.clone();
    let changed = spec_changes(events).inspect(move |rule| {
        let Ok(rule) = rule else { return };
        let (Ok(r), Some(ns)) = (&rule.0, rule.namespace()) else {
            return;
        };
        let connection = ObjectRef::new(&r.spec.connection_ref.name).within(&ns);
        // Closed only when the connection loop has stopped, at shutdown.
        let _ = connection_changes.send(connection);
    });
    Controller::for_stream(changed, rules)
        .watches_stream(spec_changes(connection_copy), move |connection| {
            rules_of(&rule_index, &connection)
        })
        .graceful_shutdown_on(shutdown)
        .run(reconcile_rule, error_policy, ctx)
        .for_each(|_| async {})
}

/// The connections in `store` that reference `secret` (to re-render when it changes).
fn connections_referencing(
    store: &Store<DeserializeGuard<BrokerConnection>>,
    secret: &PartialObjectMeta<Secret>,
) -> Vec<ObjectRef<DeserializeGuard<BrokerConnection>>> {
    let ns = secret.namespace();
    let name = secret.name_any();
    store
        .state()
        .into_iter()
        .filter(|c| {
            c.namespace() == ns
                && c.0
                    .as_ref()
                    .is_ok_and(|c| referenced_secrets(c).contains(&name))
        })
        .map(|c| ObjectRef::from_obj(&*c))
        .collect()
}

/// The rules in `store` that name `connection` (a deleted connection strands them).
fn rules_of(
    store: &Store<DeserializeGuard<ForwardingRule>>,
    connection: &DeserializeGuard<BrokerConnection>,
) -> Vec<ObjectRef<DeserializeGuard<ForwardingRule>>> {
    let ns = connection.namespace();
    let name = connection.name_any();
    store
        .state()
        .into_iter()
        .filter(|r| {
            r.namespace() == ns
                && r.0
                    .as_ref()
                    .is_ok_and(|r| r.spec.connection_ref.name == name)
        })
        .map(|r| ObjectRef::from_obj(&*r))
        .collect()
}

/// Objects whose spec changed (generation), or that were deleted; status-only writes, ours
/// included, are not triggers.
fn spec_changes<K>(
    events: impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
) -> impl Stream<Item = Result<K, watcher::Error>> + Send + 'static
where
    K: Resource + Clone + Send + 'static,
{
    let mut seen: HashMap<(Option<String>, String), (Option<i64>, bool)> = HashMap::new();
    events.flat_map(move |event| {
        let out: Vec<Result<K, watcher::Error>> = match event {
            Err(e) => vec![Err(e)],
            Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => {
                let key = (
                    o.meta().namespace.clone(),
                    o.meta().name.clone().unwrap_or_default(),
                );
                // Deletion (a finalizer to run) is a change too.
                let generation = (o.meta().generation, o.meta().deletion_timestamp.is_some());
                if seen.insert(key, generation) == Some(generation) {
                    Vec::new()
                } else {
                    vec![Ok(o)]
                }
            }
            Ok(watcher::Event::Delete(o)) => {
                seen.remove(&(
                    o.meta().namespace.clone(),
                    o.meta().name.clone().unwrap_or_default(),
                ));
                vec![Ok(o)]
            }
            Ok(watcher::Event::Init | watcher::Event::InitDone) => Vec::new(),
        };
        futures::stream::iter(out)
    })
}

fn error_policy<K>(object: Arc<K>, error: &Error, ctx: Arc<Context>) -> Action
where
    K: Resource<DynamicType = ()>,
{
    let kind_name = K::kind(&());
    let kind = if kind_name == CONNECTION {
        Kind::BrokerConnection
    } else {
        Kind::ForwardingRule
    };
    ctx.metrics.failed(kind, error.reason());
    let key = key_of(&*object);
    let failures = {
        let mut map = ctx
            .failures
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = map.entry(key.clone()).or_insert(0);
        *n = n.saturating_add(1);
        *n
    };
    let conflict = error.is_conflict();
    let delay = retry_delay(conflict, failures);
    if conflict {
        // Expected whenever the watch cache lags a write; not a failure worth a warning.
        info!(object = %key, kind = %kind_name, error = %error, retry_in = ?delay, "object changed since it was read; reconciling again");
    } else {
        warn!(object = %key, kind = %kind_name, error = %error, retry_in = ?delay, "reconcile failed");
    }
    Action::requeue(delay)
}

/// Per object, doubling from 5 s up to 5 min; after a conflict, which the next read resolves
/// unless something keeps changing the object, from 500 ms up to 256 s.
fn retry_delay(conflict: bool, failures: u32) -> Duration {
    let first = if conflict {
        Duration::from_millis(500)
    } else {
        Duration::from_secs(5)
    };
    first
        .saturating_mul(1 << failures.clamp(1, 10).saturating_sub(1))
        .min(Duration::from_secs(300))
}

fn key_of<K: Resource<DynamicType = ()>>(object: &K) -> String {
    format!(
        "{}/{}/{}",
        K::kind(&()),
        object.meta().namespace.as_deref().unwrap_or_default(),
        object.meta().name.as_deref().unwrap_or_default()
    )
}

fn succeeded<K: Resource<DynamicType = ()>>(
    ctx: &Context,
    object: &K,
    kind: Kind,
    started: Instant,
) {
    ctx.failures
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .remove(&key_of(object));
    ctx.metrics.reconciled(kind, started.elapsed());
}

async fn reconcile_connection(
    guarded: Arc<DeserializeGuard<BrokerConnection>>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    let started = Instant::now();
    let ns = guarded
        .namespace()
        .ok_or(Error::NoNamespace { kind: CONNECTION })?;
    let action = if guarded.meta().deletion_timestamp.is_some() {
        // No group failing any more: their backoff is forgotten.
        groups_retry(&ctx, &*guarded, &BTreeMap::new());
        ctx.topics.forget(&key_of(&*guarded));
        finalize(&ctx, &guarded, &ns).await?
    } else if !wait_listed(&ctx.rules_listed).await {
        // Rendering from a store still filling would drop the rules not yet in it.
        return Ok(Action::requeue(Duration::from_secs(1)));
    } else {
        set_finalizer(&ctx.client, &guarded, &ns, true).await?;
        match readable(&ctx, &guarded, &ns).await? {
            Some((connection, image)) => reconcile_readable(&ctx, connection, &image, &ns).await?,
            None => Action::requeue(RESYNC),
        }
    };
    succeeded(&ctx, &*guarded, Kind::BrokerConnection, started);
    Ok(action)
}

/// The connection and the forwarder image it runs, or `None` once `Ready` False with
/// `InvalidSpec` says why it cannot be rendered as it stands.
async fn readable<'a>(
    ctx: &Context,
    guarded: &'a DeserializeGuard<BrokerConnection>,
    ns: &str,
) -> Result<Option<(&'a BrokerConnection, ForwarderImage)>, Error> {
    let name = guarded.name_any();
    let problem = match &guarded.0 {
        Err(invalid) => {
            warn!(connection = %name, namespace = %ns, error = %invalid, "cannot read BrokerConnection");
            invalid.error.clone()
        }
        Ok(c) => match ctx.forwarder_image.for_connection(&c.spec.forwarder) {
            Err(invalid) => {
                warn!(connection = %name, namespace = %ns, error = %invalid, "invalid forwarder image");
                invalid.to_string()
            }
            Ok(image) => match plan::connection_refused(c)? {
                None => return Ok(Some((c, image))),
                Some(message) => {
                    warn!(connection = %name, namespace = %ns, error = %message, "invalid connection");
                    message
                }
            },
        },
    };
    report_invalid_spec(ctx, guarded, ns, problem).await?;
    Ok(None)
}

/// Dereference → build (the pure [`plan::connection`]) → apply every group → prune → end the
/// sessions of pods gone for good → status, once.
async fn reconcile_readable(
    ctx: &Context,
    connection: &BrokerConnection,
    image: &ForwarderImage,
    ns: &str,
) -> Result<Action, Error> {
    let client = &ctx.client;
    let name = connection.name_any();
    // From the rule loop's store: a rule's change reaches this loop only once the store has it.
    let all_rules = ctx.rules.state();
    // Unreadable rules are the rule loop's to report; they are not rendered.
    let mut rules: Vec<&ForwardingRule> = all_rules
        .iter()
        .filter_map(|r| r.0.as_ref().ok())
        .filter(|r| r.namespace().as_deref() == Some(ns) && r.spec.connection_ref.name == name)
        .collect();
    // In name order, as a list returns them: the plan (and the rendered config) must not
    // depend on the store's order.
    rules.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    let secrets = read_secrets(client, ns, connection).await?;

    let recorded = connection
        .status
        .as_ref()
        .map(|s| s.mqtt_sessions.clone())
        .unwrap_or_default();
    // Rules not served yet whose literal Kafka topic is missing are refused alone.
    let topic_missing = topics_missing(ctx, connection, &rules, &secrets).await?;
    let checked: Vec<&ForwardingRule> = rules
        .iter()
        .copied()
        .filter(|r| !topic_missing.contains_key(&r.name_any()))
        .collect();
    let spec = plan::handover_spec(connection, &checked);
    let observed = handover::observe::observe(client, ns, connection, &recorded, &spec).await?;
    let mut plan = plan::connection(connection, &checked, &secrets, image, &observed)?;
    plan.rules.extend(rules.iter().filter_map(|r| {
        let message = topic_missing.get(&r.name_any())?.clone();
        Some((*r, RulePlan::Refused(RuleOutcome::TopicMissing(message))))
    }));
    report_moves(ctx, connection, &plan.moves).await;
    let mut draining = report_scale_downs(ctx, connection, &plan.groups).await;
    draining |= report_retiring(ctx, connection, &plan.groups).await;
    draining |= !plan.moves.is_empty();

    let applied = apply_groups(ctx, connection, &plan.groups).await;
    let sessions = match &plan.secret_data {
        // What runs keeps running (with the credentials it has) until the Secret is back.
        None => SessionsOutcome::unchanged(recorded),
        Some(secret_data) => {
            let serving = (&applied.serving(), ctx.network_policy.is_some());
            let pruned = prune(client, ns, connection, serving).await?;
            debug!(connection = %name, namespace = %ns, groups = applied.workloads.len(), pruned = pruned.deleted, "applied");
            // An earlier name's StatefulSet still running keeps its sessions; so do the pods of
            // a group that failed to apply (0 replicas: none of its sessions is ended).
            let replicas: BTreeMap<String, i32> = applied
                .workloads
                .values()
                .map(|w| (w.name.clone(), w.wanted))
                .chain(applied.failed.values().map(|f| (f.workload.clone(), 0)))
                .chain(pruned.earlier)
                .collect();
            end_gone_sessions(ctx, connection, secret_data, &recorded, &replicas).await?
        }
    };

    write_statuses(ctx, connection, &plan, &applied, sessions.recorded).await?;
    info!(connection = %name, namespace = %ns, groups = applied.workloads.len(), refused = applied.taken.len(), failed = applied.failed.len(), rules = plan.rules.len(), "reconciled");
    // Looked at again soon: only marked Secrets are watched, so one created or changed without
    // the mark is seen here; and the removal of another owner's object is no trigger.
    let unresolved = !plan.missing_secrets.is_empty() || !applied.taken.is_empty();
    let retries = [
        (!topic_missing.is_empty()).then_some(ctx.topics.interval),
        draining.then_some(DRAIN_POLL),
        sessions.retry_in,
        unresolved.then_some(UNRESOLVED_RETRY),
        groups_retry(ctx, connection, &applied.failed),
    ];
    Ok(Action::requeue(
        retries.into_iter().flatten().min().unwrap_or(RESYNC),
    ))
}

/// The rules of `connection` to refuse because a literal Kafka topic of theirs is missing
/// (rule name → message; see [`crate::preflight`]): only rules not served now, and none when
/// the Secrets do not resolve or Kafka cannot be asked (unknown is not missing).
async fn topics_missing(
    ctx: &Context,
    connection: &BrokerConnection,
    rules: &[&ForwardingRule],
    secrets: &crate::validate::Secrets,
) -> Result<BTreeMap<String, String>, Error> {
    let Ok(secret_data) = crate::validate::resolve_secrets(connection, secrets) else {
        return Ok(BTreeMap::new());
    };
    // Served as its status says: it names a workload, and it was not paused (a paused rule
    // is not in its group's config, so nothing is subscribed for it).
    let mut served: BTreeSet<String> = rules
        .iter()
        .filter(|r| {
            r.status.as_ref().is_some_and(|s| {
                s.workload.is_some()
                    && !s
                        .conditions
                        .iter()
                        .any(|c| c.type_ == status::READY && c.reason == "Paused")
            })
        })
        .map(|r| r.name_any())
        .collect();
    if preflight::candidates(connection, rules, &served).is_empty() {
        return Ok(BTreeMap::new());
    }
    // And as the groups' configs say (a status write may have failed after an apply).
    served.extend(rendered_rules(&ctx.client, connection).await?);
    let candidates = preflight::candidates(connection, rules, &served);
    if candidates.is_empty() {
        return Ok(BTreeMap::new());
    }
    let key = key_of(connection);
    let existing =
        preflight::existing_topics(&ctx.topics, &key, connection, &secret_data, &candidates).await;
    Ok(existing.map_or_else(BTreeMap::new, |existing| {
        preflight::refusals(connection, rules, &served, &existing, ctx.topics.interval)
    }))
}

/// The rules the connection's groups' ConfigMaps list now: what their forwarders serve.
async fn rendered_rules(
    client: &Client,
    connection: &BrokerConnection,
) -> Result<BTreeSet<String>, Error> {
    let ns = connection.namespace().unwrap_or_default();
    let selector = format!(
        "{},{}={}",
        children::SELECTOR,
        children::LABEL_CONNECTION,
        connection.name_any()
    );
    let maps = Api::<ConfigMap>::namespaced(client.clone(), &ns)
        .list(&kube::api::ListParams::default().labels(&selector))
        .await
        .at(Step::Read)?;
    Ok(maps
        .items
        .iter()
        .filter_map(|m| m.data.as_ref()?.get(children::CONFIG_FILE))
        .flat_map(|yaml| preflight::rules_in_config(yaml))
        .collect())
}

/// Says which groups wait for leaving pods to drain before they shrink (a log line, and a
/// Normal Event when a scale-down starts waiting); whether any does.
async fn report_scale_downs(
    ctx: &Context,
    connection: &BrokerConnection,
    groups: &[GroupPlan],
) -> bool {
    let mut any = false;
    for group in groups.iter().filter(|g| g.scale.retirement.is_none()) {
        let key = format!("{}#{}", key_of(connection), group.name);
        if group.scale.waiting.is_empty() {
            if let Ok(mut d) = ctx.draining.lock() {
                d.remove(&key);
            }
            continue;
        }
        any = true;
        let pods = waiting_pods(group);
        let leaving = !group.scale.drain.is_empty();
        info!(connection = %connection.name_any(), group = %group.name, waiting = ?pods, leaving, "changing replicas: waiting for pods to report");
        let note = if leaving {
            format!(
                "group {:?} scales down once {} drained (forwarded what the broker holds for them)",
                group.name,
                pods.join(", ")
            )
        } else {
            format!(
                "group {:?} changes its replicas once {} subscribes in the group's new form (through $share, or plainly when alone)",
                group.name,
                pods.join(", ")
            )
        };
        event_once(ctx, connection, key, ("ScaleDown", "Draining"), note).await;
    }
    any
}

/// The pods a group's hand-over waits for, by name.
fn waiting_pods(group: &GroupPlan) -> Vec<String> {
    let workload = group.children.stateful_set.name_any();
    group
        .scale
        .waiting
        .iter()
        .map(|o| format!("{workload}-{o}"))
        .collect()
}

/// A Normal Event on `connection`, once while `key` stays in [`Context::draining`].
async fn event_once(
    ctx: &Context,
    connection: &BrokerConnection,
    key: String,
    action_reason: (&str, &str),
    note: String,
) {
    if ctx.draining.lock().is_ok_and(|mut d| d.insert(key)) {
        let reference = connection.object_ref(&());
        event(ctx, &reference, EventType::Normal, action_reason, note).await;
    }
}

/// Says which workloads of groups no longer served wait, and for what (a log line, and a
/// Normal Event when one starts waiting); whether any does.
async fn report_retiring(
    ctx: &Context,
    connection: &BrokerConnection,
    groups: &[GroupPlan],
) -> bool {
    let prefix = format!("{}#retiring/", key_of(connection));
    let retiring: BTreeMap<String, &GroupPlan> = groups
        .iter()
        .filter(|g| g.scale.retirement.is_some())
        .map(|g| (g.children.stateful_set.name_any(), g))
        .collect();
    if let Ok(mut d) = ctx.draining.lock() {
        d.retain(|k| {
            k.strip_prefix(&prefix)
                .is_none_or(|w| retiring.contains_key(w.split('/').next().unwrap_or(w)))
        });
    }
    for (workload, group) in &retiring {
        let pods = waiting_pods(group);
        let (phase, note) = match group.scale.retirement {
            Some(Retirement::Serving) => (
                "Serving",
                format!(
                    "{workload} is no longer served by a group of the spec; it serves {} until their new groups run them, then drains",
                    column(group.scale.rules.iter().map(String::as_str)).unwrap_or_default()
                ),
            ),
            _ => (
                "Draining",
                format!(
                    "{workload} is no longer served; it is removed once {} drained (forwarded what the broker holds for them)",
                    pods.join(", ")
                ),
            ),
        };
        info!(connection = %connection.name_any(), workload = %workload, phase, waiting = ?pods, "group no longer in the spec: handing over");
        let key = format!("{prefix}{workload}/{phase}");
        event_once(ctx, connection, key, ("Retire", phase), note).await;
    }
    !retiring.is_empty()
}

/// Says which rules are moving to another group and how far (a log line, and a Normal Event on
/// the connection when a move enters each step).
async fn report_moves(
    ctx: &Context,
    connection: &BrokerConnection,
    moves: &BTreeMap<String, Move>,
) {
    let prefix = format!("{}#move/", key_of(connection));
    let keys: BTreeMap<String, (&String, &Move)> = moves
        .iter()
        .map(|(rule, m)| (format!("{prefix}{rule}/{:?}", m.phase), (rule, m)))
        .collect();
    if let Ok(mut d) = ctx.draining.lock() {
        d.retain(|k| !k.starts_with(&prefix) || keys.contains_key(k));
    }
    if !moves.is_empty() {
        info!(connection = %connection.name_any(), moving = ?moves, "rules moving to another group: kept in their old group until the new one runs them and the old one has handed over what its sessions hold for them");
    }
    for (key, (rule, m)) in keys {
        let from = column(m.from.iter().map(String::as_str)).unwrap_or_default();
        let note = match m.phase {
            MovePhase::Subscribing => format!(
                "rule {rule:?} moves to group {:?}: served by group {from:?} until the new group's pods run it",
                m.to
            ),
            MovePhase::HandingOver => format!(
                "rule {rule:?} runs in group {:?}; group {from:?} hands over what its sessions still hold for it, then drops it",
                m.to
            ),
        };
        event_once(ctx, connection, key, ("Move", "MovingRule"), note).await;
    }
}

/// When to apply again the groups the API refused: each on a backoff of its own, as a failed
/// reconcile would be, so that a group the API keeps refusing neither holds back the
/// connection's other retries (sessions to end, Secrets to resolve) nor counts against them.
/// Forgets the groups that applied since.
fn groups_retry<K: Resource<DynamicType = ()>>(
    ctx: &Context,
    connection: &K,
    failed: &BTreeMap<String, GroupFailure>,
) -> Option<Duration> {
    let prefix = group_key_prefix(connection);
    let mut failures = ctx
        .failures
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    failures.retain(|key, _| {
        key.strip_prefix(&prefix)
            .is_none_or(|group| failed.contains_key(group))
    });
    failed
        .iter()
        .map(|(group, failure)| {
            ctx.metrics
                .failed(Kind::BrokerConnection, failure.error.reason());
            let n = failures.entry(format!("{prefix}{group}")).or_insert(0);
            *n = n.saturating_add(1);
            retry_delay(failure.error.is_conflict(), *n)
        })
        .min()
}

/// What keys a connection's groups' failures in [`Context::failures`].
fn group_key_prefix<K: Resource<DynamicType = ()>>(connection: &K) -> String {
    format!("{}#group/", key_of(connection))
}

/// What applying the groups made of them.
#[derive(Default)]
struct Applied {
    /// The applied groups' StatefulSets, by group name.
    workloads: BTreeMap<String, Workload>,
    /// The groups not applied because another owner holds a name of theirs: group → why.
    taken: BTreeMap<String, String>,
    /// The groups whose children the API refused (or whose names could not be read).
    failed: BTreeMap<String, GroupFailure>,
}

/// A group whose children could not be applied.
struct GroupFailure {
    workload: String,
    error: Error,
}

impl Applied {
    /// What pruning must keep: a group refused or failed keeps what it runs.
    fn serving(&self) -> BTreeMap<String, Serving> {
        let applied = self.workloads.iter().map(|(g, w)| {
            let settled = w.ready >= w.wanted;
            let workload = w.name.clone();
            (g.clone(), Serving::Applied { workload, settled })
        });
        let refused = self
            .taken
            .keys()
            .chain(self.failed.keys())
            .map(|g| (g.clone(), Serving::Refused));
        applied.chain(refused).collect()
    }
}

/// Applies every group's children, except a group one of whose names another owner holds
/// (refused on its rules, with a Warning Event on the connection); the StatefulSets as applied
/// say how many pods each wants and has ready. One group's failure (the API refusing a child)
/// stops that group only.
async fn apply_groups(
    ctx: &Context,
    connection: &BrokerConnection,
    groups: &[GroupPlan],
) -> Applied {
    let client = &ctx.client;
    let ns = connection.namespace().unwrap_or_default();
    let ns = ns.as_str();
    let uid = connection.uid().unwrap_or_default();
    let uid = uid.as_str();
    // A few groups at once: one after the other, a connection of many groups waits on the
    // API server's round trips, not on its work.
    // The futures made first, then run: a closure making them inside the stream trips the
    // compiler's proof that the reconcile is `Send`.
    let applies: Vec<_> = groups
        .iter()
        .map(|group| apply_unless_taken(client, ns, uid, group, ctx.network_policy.as_ref()))
        .collect();
    let results: Vec<GroupApplied> = futures::stream::iter(applies)
        .buffer_unordered(CONCURRENT_WRITES)
        .collect()
        .await;
    let mut out = Applied::default();
    for (group, result) in results {
        match result {
            Err(why) => {
                warn!(connection = %connection.name_any(), namespace = %ns, group = %group.name, reason = %why, "group not applied");
                let note = format!("group {:?} is not applied: {why}", group.name);
                warn_event(
                    ctx,
                    &connection.object_ref(&()),
                    "ApplyGroup",
                    "NameTaken",
                    note,
                )
                .await;
                out.taken.insert(group.name.clone(), why);
            }
            Ok(Ok(workload)) => {
                out.workloads.insert(group.name.clone(), workload);
            }
            Ok(Err(error)) => {
                warn!(group = %group.name, namespace = %ns, error = %error, "cannot apply the group's children");
                let workload = group.children.stateful_set.name_any();
                out.failed
                    .insert(group.name.clone(), GroupFailure { workload, error });
            }
        }
    }
    out
}

/// A group, and its children applied, or why not: `Err` when one of its names is taken.
type GroupApplied<'a> = (&'a GroupPlan, Result<Result<Workload, Error>, String>);

/// The group's children applied, unless one of its names is taken.
async fn apply_unless_taken<'a>(
    client: &Client,
    ns: &str,
    uid: &str,
    group: &'a GroupPlan,
    policy: Option<&ForwarderNetworkPolicy>,
) -> GroupApplied<'a> {
    let result = match taken(client, ns, uid, (&group.children, policy.is_some())).await {
        Ok(Some(why)) => Err(why),
        Ok(None) => Ok(apply_group(client, ns, group, policy).await),
        Err(error) => Ok(Err(error)),
    };
    (group, result)
}

async fn apply_group(
    client: &Client,
    ns: &str,
    group: &GroupPlan,
    policy: Option<&ForwarderNetworkPolicy>,
) -> Result<Workload, Error> {
    let c = &group.children;
    apply(client, ns, &c.config_map).await?;
    apply(client, ns, &c.secret).await?;
    apply(client, ns, &c.service).await?;
    apply(client, ns, &c.pdb).await?;
    if let Some(policy) = policy {
        apply(client, ns, &crate::netpol::build(c, policy)).await?;
    }
    let applied = apply(client, ns, &c.stateful_set).await?;
    Ok(Workload {
        name: applied.name_any(),
        wanted: applied.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1),
        ready: applied
            .status
            .as_ref()
            .and_then(|s| s.ready_replicas)
            .unwrap_or(0),
    })
}

/// The connection's status and each rule's `Accepted`/`Ready`, each written only when it
/// changed, and Events for their transitions.
async fn write_statuses(
    ctx: &Context,
    connection: &BrokerConnection,
    plan: &plan::ConnectionPlan<'_>,
    applied: &Applied,
    sessions: Vec<String>,
) -> Result<(), Error> {
    let now = jiff::Timestamp::now();
    let groups: Vec<(String, Workload)> = applied
        .workloads
        .iter()
        .map(|(g, w)| (g.clone(), w.clone()))
        .collect();
    let (mut desired, transitions) = status::connection(
        connection.status.as_ref(),
        connection.meta().generation,
        &connection.spec.kafka.bootstrap_servers,
        &plan.missing_secrets,
        &groups,
        now,
    );
    desired.mqtt_sessions = sessions;
    desired.session_prefix = Some(crate::sessions::SessionPrefix::of(connection).into());
    let ns = connection.namespace().unwrap_or_default();
    let changed = connection.status.as_ref() != Some(&desired);
    let api = Api::<BrokerConnection>::namespaced(ctx.client.clone(), &ns);
    let update = (&desired, changed);
    update_status(ctx, &api, connection, FIELD_MANAGER, update, &transitions).await?;
    let rule_api = Api::<ForwardingRule>::namespaced(ctx.client.clone(), &ns);
    let outcomes = plan.rules.iter().filter_map(|(rule, fate)| {
        let outcome = match fate {
            plan::RulePlan::Served { group, .. } => match applied.failed.get(group) {
                // Read again and retried at once: the rule's status stays as it is.
                Some(f) if f.error.is_conflict() => return None,
                Some(f) => RuleOutcome::GroupNotApplied(format!(
                    "the children of group {group:?} could not be applied: {}",
                    f.error
                )),
                None => fate.outcome(rule, &applied.workloads, &applied.taken),
            },
            plan::RulePlan::Refused(_) => fate.outcome(rule, &applied.workloads, &applied.taken),
        };
        let moving = match fate {
            plan::RulePlan::Served { moving, .. } => moving.clone(),
            plan::RulePlan::Refused(_) => None,
        };
        Some((*rule, outcome, moving))
    });
    // A few at once, as for the groups: thousands of rules accepted at once are thousands of
    // writes. Every rule's write is tried; the first failure fails the reconcile.
    // In batches: thousands of writes' futures made up front would hold thousands of request
    // states at once.
    let outcomes: Vec<(&ForwardingRule, RuleOutcome, Option<Move>)> = outcomes.collect();
    let mut outcomes = outcomes.into_iter().peekable();
    let mut written: Vec<Result<(), Error>> = Vec::new();
    while outcomes.peek().is_some() {
        let batch: Vec<_> = outcomes
            .by_ref()
            .take(WRITE_BATCH)
            .map(|(rule, outcome, moving)| {
                write_rule_control(ctx, &rule_api, rule, (outcome, moving), now)
            })
            .collect();
        let done: Vec<Result<(), Error>> = futures::stream::iter(batch)
            .buffer_unordered(CONCURRENT_WRITES)
            .collect()
            .await;
        written.extend(done.into_iter().filter(Result::is_err));
    }
    written.into_iter().collect()
}

/// `Ready` False with reason `InvalidSpec` on a connection the operator cannot render as it
/// stands. Its children keep running as they are: nothing is torn down for a bad spec.
async fn report_invalid_spec(
    ctx: &Context,
    guarded: &DeserializeGuard<BrokerConnection>,
    ns: &str,
    message: String,
) -> Result<(), Error> {
    let name = guarded.name_any();
    let current =
        current_status::<BrokerConnection, BrokerConnectionStatus>(&ctx.client, ns, &name).await?;
    let current_conditions = current
        .as_ref()
        .map(|s| s.conditions.as_slice())
        .unwrap_or_default();
    let (conditions, mut transitions) = crate::conditions::merge(
        current_conditions,
        &[crate::conditions::Desired::new(
            status::READY,
            FALSE,
            "InvalidSpec",
            message.clone(),
        )],
        guarded.meta().generation,
        jiff::Timestamp::now(),
    );
    // Ready may already be False for another reason (pods not ready): a spec now refused is
    // news all the same, and said in an Event.
    let was = current_conditions.iter().find(|c| c.type_ == status::READY);
    if transitions.is_empty()
        && was.is_some_and(|c| c.reason != "InvalidSpec" || c.message != message)
    {
        transitions.push(crate::conditions::Transition {
            type_: status::READY.to_owned(),
            status: FALSE.to_owned(),
            reason: "InvalidSpec".to_owned(),
            message,
            first: false,
        });
    }
    // The rest (groups, what `kubectl get` prints) stays as last rendered.
    let status = BrokerConnectionStatus {
        conditions,
        observed_generation: guarded.meta().generation,
        ..current.clone().unwrap_or_default()
    };
    // Through the guard: the answer carries the same spec, which may be unreadable.
    let api = Api::<DeserializeGuard<BrokerConnection>>::namespaced(ctx.client.clone(), ns);
    let update = (&status, current.as_ref() != Some(&status));
    update_status(ctx, &api, guarded, FIELD_MANAGER, update, &transitions).await?;
    Ok(())
}

async fn write_rule_control(
    ctx: &Context,
    api: &Api<ForwardingRule>,
    rule: &ForwardingRule,
    (outcome, moving): (RuleOutcome, Option<Move>),
    now: jiff::Timestamp,
) -> Result<(), Error> {
    let outcome = &outcome;
    if let RuleOutcome::Conflict(reason)
    | RuleOutcome::NameTaken(reason)
    | RuleOutcome::SecretMissing(reason)
    | RuleOutcome::Invalid(reason)
    | RuleOutcome::InvalidExpression(reason)
    | RuleOutcome::GroupFull(reason)
    | RuleOutcome::GroupNotApplied(reason)
    | RuleOutcome::TopicMissing(reason) = outcome
    {
        warn!(rule = %rule.name_any(), namespace = ?rule.namespace(), reason = %reason, "rule not rendered");
    }
    let (desired, transitions) = status::rule_control_for(rule, outcome, moving.as_ref(), now);
    let current = rule.status.as_ref().map(status::rule_control_view);
    let update = (&desired, current.as_ref() != Some(&desired));
    update_status(ctx, api, rule, FIELD_MANAGER, update, &transitions).await?;
    Ok(())
}

async fn reconcile_rule(
    guarded: Arc<DeserializeGuard<ForwardingRule>>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    let started = Instant::now();
    let ns = guarded
        .namespace()
        .ok_or(Error::NoNamespace { kind: RULE })?;
    let name = guarded.name_any();
    let api = Api::<ForwardingRule>::namespaced(ctx.client.clone(), &ns);
    // Deciding "connection not found" on a store still filling would flap every rule.
    if !wait_listed(&ctx.connections_listed).await {
        return Ok(Action::requeue(Duration::from_secs(1)));
    }
    let outcome = match &guarded.0 {
        Err(invalid) => {
            warn!(rule = %name, namespace = %ns, error = %invalid, "cannot read ForwardingRule");
            Some(RuleOutcome::InvalidSpec(invalid.error.clone()))
        }
        Ok(rule) => {
            let connection = &rule.spec.connection_ref.name;
            match ctx
                .connections
                .get(&ObjectRef::new(connection).within(&ns))
                .map(|c| c.0.as_ref().map(|_| ()).map_err(|e| e.error.clone()))
            {
                None => Some(RuleOutcome::ConnectionNotFound(format!(
                    "BrokerConnection {connection:?} does not exist in namespace {ns:?}"
                ))),
                Some(Err(e)) => Some(RuleOutcome::ConnectionNotFound(format!(
                    "BrokerConnection {connection:?} cannot be read: {e}"
                ))),
                // The connection loop renders it and writes its status.
                Some(Ok(_)) => None,
            }
        }
    };
    if let Some(outcome) = outcome {
        let now = jiff::Timestamp::now();
        match &guarded.0 {
            Ok(rule) => write_rule_control(&ctx, &api, rule, (outcome, None), now).await?,
            Err(_) => {
                let current =
                    current_status::<ForwardingRule, ForwardingRuleStatus>(&ctx.client, &ns, &name)
                        .await?;
                let (desired, transitions) = status::rule_control(
                    current.as_ref(),
                    guarded.meta().generation,
                    &outcome,
                    now,
                );
                let changed =
                    current.as_ref().map(status::rule_control_view) != Some(desired.clone());
                // Through the guard: the answer carries the same unreadable spec.
                let api =
                    Api::<DeserializeGuard<ForwardingRule>>::namespaced(ctx.client.clone(), &ns);
                let update = (&desired, changed);
                update_status(&ctx, &api, &*guarded, FIELD_MANAGER, update, &transitions).await?;
            }
        }
    }
    succeeded(&ctx, &*guarded, Kind::ForwardingRule, started);
    Ok(Action::await_change())
}

#[cfg(test)]
mod tests {
    use super::retry_delay;
    use std::time::Duration;

    #[test]
    fn a_conflict_is_retried_soon_and_other_failures_back_off_from_5_s_to_5_min() {
        let secs = |conflict, n| retry_delay(conflict, n).as_secs_f64();
        assert_eq!(
            [1, 2, 3, 7, 100].map(|n| secs(false, n)),
            [5.0, 10.0, 20.0, 300.0, 300.0]
        );
        assert_eq!(
            [1, 2, 3, 10, 100].map(|n| secs(true, n)),
            [0.5, 1.0, 2.0, 256.0, 256.0]
        );
        assert_eq!(retry_delay(false, 0), Duration::from_secs(5));
    }
}
