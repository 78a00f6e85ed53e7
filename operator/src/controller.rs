//! The reconcile loops.
//!
//! BrokerConnection, one at a time: dereference (its rules and Secrets) → validate → build
//! (pure, `render` and `children`) → apply (server-side apply, one field manager) → prune (the
//! children of groups that no longer have rules) → status (connection and each rule's
//! `Accepted`/`Ready`, written only when changed) → Events for transitions.
//!
//! ForwardingRule: only what the connection loop cannot see, a rule whose connection does
//! not exist or cannot be read, and a rule this operator cannot read.
//!
//! Triggers are spec changes (generation) and deletions, never status writes, so the operator's
//! own status updates do not wake it: at steady state nothing reconciles.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_api::crd::{
    BrokerConnection, BrokerConnectionStatus, ForwardingRule, ForwardingRuleStatus,
};
use futures::{Stream, StreamExt};
use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use kube::core::{DeserializeGuard, PartialObjectMeta};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::{mpsc, watch};
use tracing::{debug, info, warn};

use crate::children::{self, LABEL_CONNECTION, LABEL_GROUP};
use crate::conditions::{FALSE, Transition};
use crate::image::ForwarderImage;
use crate::metrics::{Kind, Metrics};
use crate::render::{Group, render};
use crate::scope::Scope;
use crate::status::{self, RuleOutcome, Workload};
use crate::validate::{self, Secrets};

/// Field manager of children, connection status and the rules' `Accepted`/`Ready`.
pub const FIELD_MANAGER: &str = "ferry-operator";
/// Field manager of the rules' data-plane status (see `dataplane`).
pub const STATUS_FIELD_MANAGER: &str = "ferry-operator-status";

const CONNECTION: &str = "BrokerConnection";
const RULE: &str = "ForwardingRule";
/// A safety net against drift nobody told us about; changes arrive by watch.
const RESYNC: Duration = Duration::from_secs(600);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("{0}")]
    Render(#[from] crate::render::RenderError),
    #[error("{kind} has no namespace")]
    NoNamespace { kind: &'static str },
    #[error("status of {name}: {source}")]
    Status {
        name: String,
        source: serde_json::Error,
    },
}

impl Error {
    fn reason(&self) -> &'static str {
        match self {
            Error::Kube(_) => "api",
            Error::Render(_) => "render",
            Error::NoNamespace { .. } => "invalid",
            Error::Status { .. } => "status",
        }
    }
}

pub struct Context {
    pub client: Client,
    pub metrics: Arc<Metrics>,
    recorder: Recorder,
    connections: Store<DeserializeGuard<BrokerConnection>>,
    /// True once `connections` holds the whole first list (see [`listed`]).
    connections_listed: watch::Receiver<bool>,
    /// The forwarder image of connections that name none (the operator's flags).
    forwarder_image: ForwarderImage,
    /// Consecutive failures per object, for its backoff.
    failures: Mutex<HashMap<String, u32>>,
    /// Connections to reconcile because the data plane changed whether one of their rules is
    /// `Ready` (a status-only change, which the watches do not treat as a trigger).
    ready_changes: mpsc::Sender<ObjectRef<DeserializeGuard<BrokerConnection>>>,
}

impl Context {
    /// Asks for `connection`'s reconcile: the data plane changed whether one of its rules
    /// forwards. A full queue only delays it until the next change or resync.
    pub(crate) fn data_plane_changed(&self, namespace: &str, connection: &str) {
        let target = ObjectRef::new(connection).within(namespace);
        if self.ready_changes.try_send(target).is_err() {
            warn!(connection = %connection, namespace = %namespace, "reconcile queue full: Ready waits for the next change");
        }
    }
}

/// Room for one poll's transitions of many rules at once.
const READY_CHANGES_QUEUE: usize = 4096;

/// Runs the controllers and the data-plane poller until `shutdown` completes, watching the
/// namespaces of `scope` only.
pub async fn run(
    client: Client,
    scope: Scope,
    metrics: Arc<Metrics>,
    status_polling: crate::dataplane::Polling,
    identity: String,
    forwarder_image: ForwarderImage,
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
    // The rule loop also follows connections (a deleted connection strands its rules) and the
    // connection loop follows rules: a second watch of each, for triggers only.
    let connection_copy = scope.watch::<DeserializeGuard<BrokerConnection>>(&client, &unfiltered);
    let rule_copy = scope.watch::<DeserializeGuard<ForwardingRule>>(&client, &unfiltered);

    let (ready_changes, ready_changes_rx) = mpsc::channel(READY_CHANGES_QUEUE);
    let ctx = Arc::new(Context {
        client: client.clone(),
        metrics: metrics.clone(),
        recorder: Recorder::new(
            client.clone(),
            Reporter {
                controller: "ferry-operator".into(),
                instance: Some(identity),
            },
        ),
        connections: connections.clone(),
        connections_listed,
        forwarder_image,
        failures: Mutex::new(HashMap::new()),
        ready_changes,
    });
    let ready_changes = futures::stream::unfold(ready_changes_rx, |mut rx| async move {
        rx.recv().await.map(|target| (target, rx))
    });

    let forwarders = watcher::Config::default().labels(children::SELECTOR);
    let secret_index = connections.clone();
    let connection_loop =
        Controller::for_stream(spec_changes(connection_events), connections.clone())
            .owns_stream(
                scope
                    .watch::<PartialObjectMeta<StatefulSet>>(&client, &forwarders)
                    .touched_objects(),
            )
            .owns_stream(
                scope
                    .watch::<PartialObjectMeta<ConfigMap>>(&client, &forwarders)
                    .touched_objects(),
            )
            .watches_stream(spec_changes(rule_copy), |rule| {
                let rule = rule.0.ok()?;
                let ns = rule.namespace()?;
                Some(ObjectRef::new(&rule.spec.connection_ref.name).within(&ns))
            })
            // A created or rotated Secret reconciles the connections that reference it.
            .watches_stream(
                scope
                    .watch::<PartialObjectMeta<Secret>>(&client, &unfiltered)
                    .touched_objects(),
                move |secret| {
                    let ns = secret.namespace();
                    let name = secret.name_any();
                    secret_index
                        .state()
                        .into_iter()
                        .filter(|c| {
                            c.namespace() == ns
                                && c.0
                                    .as_ref()
                                    .is_ok_and(|c| referenced_secrets(c).contains(&name))
                        })
                        .map(|c| ObjectRef::from_obj(&*c))
                        .collect::<Vec<_>>()
                },
            )
            .reconcile_on(ready_changes)
            .graceful_shutdown_on(shutdown.clone())
            .run(reconcile_connection, error_policy, ctx.clone())
            .for_each(|_| async {});

    let rule_index = rules.clone();
    let rule_loop = Controller::for_stream(spec_changes(rule_events), rules.clone())
        .watches_stream(spec_changes(connection_copy), move |connection| {
            let ns = connection.namespace();
            let name = connection.name_any();
            rule_index
                .state()
                .into_iter()
                .filter(|r| {
                    r.namespace() == ns
                        && r.0
                            .as_ref()
                            .is_ok_and(|r| r.spec.connection_ref.name == name)
                })
                .map(|r| ObjectRef::from_obj(&*r))
                .collect::<Vec<_>>()
        })
        .graceful_shutdown_on(shutdown.clone())
        .run(reconcile_rule, error_policy, ctx.clone())
        .for_each(|_| async {});

    let poller = crate::dataplane::run(ctx, &scope, rules, rules_listed, status_polling);
    tokio::select! {
        _ = futures::future::join(connection_loop, rule_loop) => {}
        () = poller => {}
    }
}

/// The events as they are, and a flag that turns true once the store they fill holds the
/// whole first list.
///
/// Tasks other than the controller itself wait on this rather than on
/// `Store::wait_until_ready`: the store's readiness keeps one waker, so of several tasks waiting
/// at once all but one can sleep forever (it hung every rule's reconcile while the controller's
/// own applier, waiting on the same store, was woken).
fn listed<K>(
    events: impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
) -> (
    impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
    watch::Receiver<bool>,
)
where
    K: Send + 'static,
{
    let (tx, rx) = watch::channel(false);
    let events = events.inspect(move |event| {
        if matches!(event, Ok(watcher::Event::InitDone)) {
            tx.send_replace(true);
        }
    });
    (events, rx)
}

/// Whether `listed` (from [`listed`]) says the first list is in; waits for it.
pub(crate) async fn wait_listed(listed: &watch::Receiver<bool>) -> bool {
    listed.clone().wait_for(|done| *done).await.is_ok()
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
    // 5 s, 10 s, 20 s … at most 5 min, per object.
    let delay = Duration::from_secs(5u64.saturating_mul(1 << failures.min(6).saturating_sub(1)))
        .min(Duration::from_secs(300));
    warn!(object = %key, kind = %kind_name, error = %error, retry_in = ?delay, "reconcile failed");
    Action::requeue(delay)
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
    let name = guarded.name_any();
    if guarded.meta().deletion_timestamp.is_some() {
        let action = finalize(&ctx, &guarded, &ns).await?;
        succeeded(&ctx, &*guarded, Kind::BrokerConnection, started);
        return Ok(action);
    }
    set_finalizer(&ctx.client, &guarded, &ns, true).await?;
    let (connection, image) = match &guarded.0 {
        Ok(c) => match ctx.forwarder_image.for_connection(&c.spec.forwarder) {
            Ok(image) => (c, image),
            Err(invalid) => {
                warn!(connection = %name, namespace = %ns, error = %invalid, "invalid forwarder image");
                report_invalid_spec(&ctx, &guarded, &ns, invalid.to_string()).await?;
                succeeded(&ctx, &*guarded, Kind::BrokerConnection, started);
                return Ok(Action::requeue(RESYNC));
            }
        },
        Err(invalid) => {
            warn!(connection = %name, namespace = %ns, error = %invalid, "cannot read BrokerConnection");
            report_invalid_spec(&ctx, &guarded, &ns, invalid.error.clone()).await?;
            succeeded(&ctx, &*guarded, Kind::BrokerConnection, started);
            return Ok(Action::requeue(RESYNC));
        }
    };
    if let Some(message) = connection_refused(connection)? {
        warn!(connection = %name, namespace = %ns, error = %message, "invalid connection");
        report_invalid_spec(&ctx, &guarded, &ns, message).await?;
        succeeded(&ctx, &*guarded, Kind::BrokerConnection, started);
        return Ok(Action::requeue(RESYNC));
    }
    let client = &ctx.client;

    // Dereference.
    let all_rules = Api::<DeserializeGuard<ForwardingRule>>::namespaced(client.clone(), &ns)
        .list(&ListParams::default())
        .await?;
    // Unreadable rules are the rule loop's to report; they are not rendered.
    let rules: Vec<&ForwardingRule> = all_rules
        .items
        .iter()
        .filter_map(|r| r.0.as_ref().ok())
        .filter(|r| r.spec.connection_ref.name == name)
        .collect();
    let secrets = read_secrets(client, &ns, connection).await?;

    // Validate, build, apply.
    let mut outcomes: Vec<(&ForwardingRule, RuleOutcome)> = Vec::new();
    let mut workloads: Vec<(String, Workload)> = Vec::new();
    let recorded = connection
        .status
        .as_ref()
        .map(|s| s.mqtt_sessions.clone())
        .unwrap_or_default();
    let mut sessions = SessionsOutcome::unchanged(recorded.clone());
    let missing: Vec<String> = match validate::resolve_secrets(connection, &secrets) {
        Err(missing) => {
            // What runs keeps running (with the credentials it has) until the Secret is back.
            let missing: Vec<String> = missing.iter().map(ToString::to_string).collect();
            let message = format!(
                "BrokerConnection {name:?} cannot be rendered: {}",
                missing.join("; ")
            );
            outcomes.extend(
                rules
                    .iter()
                    .map(|r| (*r, RuleOutcome::SecretMissing(message.clone()))),
            );
            missing
        }
        Ok(secret_data) => {
            let mut groups: BTreeMap<&str, Vec<&ForwardingRule>> = BTreeMap::new();
            for r in &rules {
                groups.entry(r.spec.group.as_str()).or_default().push(r);
            }
            let mut kept = BTreeSet::new();
            for (group, members) in &groups {
                let mut refused: BTreeMap<String, RuleOutcome> = validate::conflicts(members)
                    .into_iter()
                    .map(|(rule, reason)| (rule, RuleOutcome::Conflict(reason)))
                    .collect();
                for r in members {
                    if refused.contains_key(&r.name_any()) {
                        continue;
                    }
                    if let Some(problem) = forwarder_refuses(connection, group, r)? {
                        refused.insert(r.name_any(), RuleOutcome::Invalid(problem));
                    }
                }
                let accepted: Vec<&ForwardingRule> = members
                    .iter()
                    .copied()
                    .filter(|r| !refused.contains_key(&r.name_any()))
                    .collect();
                let rendered = render(&Group {
                    connection,
                    name: group,
                    rules: accepted.clone(),
                })?;
                let c = children::build(connection, group, &rendered, secret_data.clone(), &image);
                apply(client, &ns, &c.config_map).await?;
                apply(client, &ns, &c.secret).await?;
                apply(client, &ns, &c.service).await?;
                apply(client, &ns, &c.pdb).await?;
                let applied = apply(client, &ns, &c.stateful_set).await?;
                let workload = Workload {
                    name: rendered.workload.clone(),
                    wanted: applied.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1),
                    ready: applied
                        .status
                        .as_ref()
                        .and_then(|s| s.ready_replicas)
                        .unwrap_or(0),
                };
                for r in members {
                    let outcome = match refused.get(&r.name_any()) {
                        Some(outcome) => outcome.clone(),
                        None => RuleOutcome::Rendered {
                            workload: workload.clone(),
                            paused: r.spec.paused,
                        },
                    };
                    outcomes.push((r, outcome));
                }
                workloads.push(((*group).to_owned(), workload));
                kept.insert((*group).to_owned());
            }
            let pruned = prune(client, &ns, &name, &kept).await?;
            debug!(connection = %name, namespace = %ns, groups = kept.len(), pruned, "applied");
            let groups: BTreeMap<String, i32> = workloads
                .iter()
                .map(|(_, w)| (w.name.clone(), w.wanted))
                .collect();
            sessions =
                end_gone_sessions(&ctx, connection, &secret_data, &recorded, &groups).await?;
            Vec::new()
        }
    };

    // Status.
    let now = jiff::Timestamp::now();
    let (mut desired, transitions) = status::connection(
        connection.status.as_ref(),
        connection.meta().generation,
        &connection.spec.kafka.bootstrap_servers,
        &missing,
        &workloads,
        now,
    );
    desired.mqtt_sessions = sessions.recorded;
    if connection.status.as_ref() != Some(&desired) {
        let api = Api::<BrokerConnection>::namespaced(client.clone(), &ns);
        write_status(&api, &name, FIELD_MANAGER, &desired).await?;
        ctx.metrics.status_written(Kind::BrokerConnection);
    }
    publish(&ctx, &connection.object_ref(&()), &transitions).await;
    let rule_api = Api::<ForwardingRule>::namespaced(client.clone(), &ns);
    for (rule, outcome) in &outcomes {
        write_rule_control(&ctx, &rule_api, rule, outcome, now).await?;
    }
    succeeded(&ctx, connection, Kind::BrokerConnection, started);
    info!(connection = %name, namespace = %ns, groups = workloads.len(), rules = outcomes.len(), "reconciled");
    Ok(Action::requeue(sessions.retry_in.unwrap_or(RESYNC)))
}

async fn read_secrets(
    client: &Client,
    ns: &str,
    connection: &BrokerConnection,
) -> Result<Secrets, Error> {
    let mut secrets: Secrets = BTreeMap::new();
    let secret_api = Api::<Secret>::namespaced(client.clone(), ns);
    for s in referenced_secrets(connection) {
        if let Some(secret) = secret_api.get_opt(&s).await? {
            secrets.insert(s, secret.data.unwrap_or_default());
        }
    }
    Ok(secrets)
}

/// What became of a connection's recorded MQTT sessions in one reconcile.
struct SessionsOutcome {
    /// What the status records from now on.
    recorded: Vec<String>,
    /// Sooner than the resync: pods still terminating, or a session the broker did not let
    /// us end.
    retry_in: Option<Duration>,
    /// Sessions that could not be ended, with the error.
    failed: Vec<(String, String)>,
}

impl SessionsOutcome {
    fn unchanged(recorded: Vec<String>) -> Self {
        SessionsOutcome {
            recorded,
            retry_in: None,
            failed: Vec::new(),
        }
    }
}

/// How soon to look again while a removed forwarder pod is still terminating (it drains for
/// up to its shutdown timeout).
const SESSIONS_POD_WAIT: Duration = Duration::from_secs(5);
/// How soon to retry ending a session the broker did not let us end.
const SESSIONS_RETRY: Duration = Duration::from_secs(30);

/// Ends the sessions of `recorded` client ids whose pods are gone for good (see
/// [`crate::sessions::plan`]); `groups` are the connection's StatefulSets now (name → wanted
/// replicas), none when it is being deleted.
async fn end_gone_sessions(
    ctx: &Context,
    connection: &BrokerConnection,
    secret_data: &BTreeMap<String, k8s_openapi::ByteString>,
    recorded: &[String],
    groups: &BTreeMap<String, i32>,
) -> Result<SessionsOutcome, Error> {
    let ns = connection.namespace().unwrap_or_default();
    let name = connection.name_any();
    let pods: BTreeMap<String, crate::sessions::PodState> =
        Api::<Pod>::namespaced(ctx.client.clone(), &ns)
            .list(&ListParams::default().labels(&format!("{LABEL_CONNECTION}={name}")))
            .await?
            .items
            .iter()
            .map(|pod| {
                let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
                let started = !matches!(phase, None | Some("Pending"));
                (pod.name_any(), crate::sessions::PodState { started })
            })
            .collect();
    let plan = crate::sessions::plan(&ns, recorded, groups, &pods);
    let mut out = SessionsOutcome {
        recorded: plan.keep.iter().cloned().collect(),
        retry_in: plan.waiting_for_pods.then_some(SESSIONS_POD_WAIT),
        failed: Vec::new(),
    };
    if plan.end.is_empty() {
        return Ok(out);
    }
    let broker = match crate::sessions::Broker::new(&connection.spec.mqtt, secret_data) {
        Ok(b) => b,
        Err(e) => {
            warn!(connection = %name, namespace = %ns, error = %e, "cannot reach the MQTT broker to end sessions; retrying");
            out.failed = plan
                .end
                .iter()
                .map(|id| (id.clone(), e.to_string()))
                .collect();
            out.recorded.extend(plan.end);
            out.recorded.sort();
            out.retry_in = Some(SESSIONS_RETRY);
            return Ok(out);
        }
    };
    for id in plan.end {
        match crate::sessions::end_session(&broker, &id).await {
            Ok(()) => {
                info!(connection = %name, namespace = %ns, client_id = %id, "ended the MQTT session of a forwarder that is gone");
                ctx.metrics.session_ended("ended");
            }
            Err(e) => {
                warn!(connection = %name, namespace = %ns, client_id = %id, error = %e, "cannot end an MQTT session; retrying");
                ctx.metrics.session_ended("failed");
                out.recorded.push(id.clone());
                out.failed.push((id, e.to_string()));
                out.retry_in = Some(SESSIONS_RETRY);
            }
        }
    }
    out.recorded.sort();
    Ok(out)
}

/// How long a deleted connection waits for its sessions to be ended before the operator lets
/// it go anyway (with a Warning Event): an unreachable broker must not block a namespace's
/// deletion for ever. The sessions then end by their expiry (MQTT 5).
const FINALIZE_GIVE_UP: Duration = Duration::from_secs(300);

/// A connection being deleted: stop its forwarders, wait for their pods to be gone, end every
/// recorded session, then release the object.
async fn finalize(
    ctx: &Context,
    guarded: &DeserializeGuard<BrokerConnection>,
    ns: &str,
) -> Result<Action, Error> {
    if !guarded
        .finalizers()
        .iter()
        .any(|f| f == crate::sessions::FINALIZER)
    {
        return Ok(Action::await_change());
    }
    let name = guarded.name_any();
    let reference = guarded.object_ref(&());
    let Ok(connection) = &guarded.0 else {
        warn_event(ctx, &reference, "SessionsNotEnded", "the connection cannot be read, so its broker cannot be reached: its forwarders' MQTT sessions end by their expiry".to_owned()).await;
        set_finalizer(&ctx.client, guarded, ns, false).await?;
        return Ok(Action::await_change());
    };
    // The garbage collector would remove the forwarders only after the object is gone; their
    // sessions must end after the pods, so remove every child now.
    prune(&ctx.client, ns, &name, &BTreeSet::new()).await?;
    let recorded = connection
        .status
        .as_ref()
        .map(|s| s.mqtt_sessions.clone())
        .unwrap_or_default();
    let secrets = read_secrets(&ctx.client, ns, connection).await?;
    let outcome = match validate::resolve_secrets(connection, &secrets) {
        Ok(secret_data) => {
            end_gone_sessions(ctx, connection, &secret_data, &recorded, &BTreeMap::new()).await?
        }
        Err(missing) => {
            let missing: Vec<String> = missing.iter().map(ToString::to_string).collect();
            warn_event(ctx, &reference, "SessionsNotEnded", format!("cannot authenticate to the MQTT broker ({}): the forwarders' sessions end by their expiry", missing.join("; "))).await;
            SessionsOutcome::unchanged(Vec::new())
        }
    };
    if outcome.retry_in.is_some() && outcome.failed.is_empty() {
        // Pods still terminating.
        return Ok(Action::requeue(SESSIONS_POD_WAIT));
    }
    if let Some((id, e)) = outcome.failed.first() {
        let deleting_for = guarded
            .meta()
            .deletion_timestamp
            .as_ref()
            .map(|t| jiff::Timestamp::now().duration_since(t.0))
            .unwrap_or_default();
        if deleting_for < jiff::SignedDuration::try_from(FINALIZE_GIVE_UP).unwrap_or_default() {
            return Ok(Action::requeue(SESSIONS_RETRY));
        }
        warn_event(ctx, &reference, "SessionsNotEnded", format!("gave up ending {} MQTT sessions after {FINALIZE_GIVE_UP:?} ({id}: {e}); they end by their expiry", outcome.failed.len())).await;
    }
    set_finalizer(&ctx.client, guarded, ns, false).await?;
    info!(connection = %name, namespace = %ns, "forwarders stopped and their MQTT sessions ended; released");
    Ok(Action::await_change())
}

async fn warn_event(
    ctx: &Context,
    reference: &k8s_openapi::api::core::v1::ObjectReference,
    reason: &str,
    note: String,
) {
    let event = Event {
        type_: EventType::Warning,
        reason: reason.to_owned(),
        note: Some(note),
        action: "EndSessions".to_owned(),
        secondary: None,
    };
    // An Event is a courtesy: failing to record one must not fail the reconcile.
    if let Err(e) = ctx.recorder.publish(&event, reference).await {
        warn!(error = %e, "cannot record Event");
    }
}

/// Adds (`present`) or removes [`crate::sessions::FINALIZER`], leaving other finalizers as
/// they are. A merge patch carrying the `resourceVersion` it was computed from: a concurrent
/// change fails it (409) and the reconcile is retried, and it can never create the object.
async fn set_finalizer(
    client: &Client,
    guarded: &DeserializeGuard<BrokerConnection>,
    ns: &str,
    present: bool,
) -> Result<(), Error> {
    let ours = crate::sessions::FINALIZER;
    let current = guarded.finalizers();
    if current.iter().any(|f| f == ours) == present {
        return Ok(());
    }
    let mut finalizers: Vec<&str> = current
        .iter()
        .map(String::as_str)
        .filter(|f| *f != ours)
        .collect();
    if present {
        finalizers.push(ours);
    }
    let patch = serde_json::json!({
        "metadata": {
            "resourceVersion": guarded.meta().resource_version,
            "finalizers": finalizers,
        }
    });
    let resource = ApiResource::erase::<BrokerConnection>(&());
    Api::<DynamicObject>::namespaced_with(client.clone(), ns, &resource)
        .patch(
            &guarded.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await?;
    Ok(())
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
    let (conditions, transitions) = crate::conditions::merge(
        current
            .as_ref()
            .map(|s| s.conditions.as_slice())
            .unwrap_or_default(),
        &[crate::conditions::Desired::new(
            status::READY,
            FALSE,
            "InvalidSpec",
            message,
        )],
        guarded.meta().generation,
        jiff::Timestamp::now(),
    );
    // The rest (groups, what `kubectl get` prints) stays as last rendered.
    let status = BrokerConnectionStatus {
        conditions,
        observed_generation: guarded.meta().generation,
        ..current.clone().unwrap_or_default()
    };
    if current.as_ref() != Some(&status) {
        // Through the guard: the answer carries the same spec, which may be unreadable.
        let api = Api::<DeserializeGuard<BrokerConnection>>::namespaced(ctx.client.clone(), ns);
        write_status(&api, &name, FIELD_MANAGER, &status).await?;
        ctx.metrics.status_written(Kind::BrokerConnection);
    }
    publish(ctx, &guarded.object_ref(&()), &transitions).await;
    Ok(())
}

/// What the forwarder would say about the connection's own settings (what CEL cannot judge,
/// such as a value librdkafka or Rust's address parser refuses), each named by its spec field.
/// What already runs keeps running: nothing is rendered from a refused spec.
fn connection_refused(connection: &BrokerConnection) -> Result<Option<String>, Error> {
    let alone = render(&Group {
        connection,
        name: "default",
        rules: Vec::new(),
    })?;
    let problems: Vec<String> = alone
        .config
        .validate()
        .iter()
        .filter(|p| p.path.starts_with("mqtt.") || p.path.starts_with("kafka."))
        .map(|p| {
            let message = p.message.replace(
                "kafka.allow_weaker_delivery",
                "spec.kafka.allowWeakerDelivery",
            );
            format!("{}: {message}", spec_field(&p.path))
        })
        .collect();
    Ok((!problems.is_empty()).then(|| {
        format!(
            "the forwarder would refuse this connection: {}",
            problems.join("; ")
        )
    }))
}

/// The BrokerConnection field a forwarder config path comes from.
fn spec_field(path: &str) -> String {
    const FIELDS: &[(&str, &str)] = &[
        ("mqtt.session_expiry_secs", "spec.mqtt.sessionExpirySeconds"),
        ("mqtt.max_inflight", "spec.mqtt.maxInflight"),
        ("kafka.bootstrap_servers", "spec.kafka.bootstrapServers"),
        (
            "kafka.allow_weaker_delivery",
            "spec.kafka.allowWeakerDelivery",
        ),
    ];
    FIELDS
        .iter()
        .find(|(from, _)| path == *from)
        .map(|(_, to)| (*to).to_owned())
        .unwrap_or_else(|| format!("spec.{path}"))
}

/// What the forwarder would say about this rule alone (a problem CEL cannot see, such as a
/// template level deeper than the rule's filters), so one bad rule cannot take its group down.
fn forwarder_refuses(
    connection: &BrokerConnection,
    group: &str,
    rule: &ForwardingRule,
) -> Result<Option<String>, Error> {
    if rule.spec.paused {
        return Ok(None);
    }
    let alone = render(&Group {
        connection,
        name: group,
        rules: vec![rule],
    })?;
    let problems: Vec<String> = alone
        .config
        .validate()
        .iter()
        .filter(|p| p.path.starts_with("rules") || p.path.starts_with("dead_letter"))
        .map(|p| format!("the forwarder refuses it: {p}"))
        .collect();
    Ok((!problems.is_empty()).then(|| problems.join("; ")))
}

async fn write_rule_control(
    ctx: &Context,
    api: &Api<ForwardingRule>,
    rule: &ForwardingRule,
    outcome: &RuleOutcome,
    now: jiff::Timestamp,
) -> Result<(), Error> {
    if let RuleOutcome::Conflict(reason)
    | RuleOutcome::SecretMissing(reason)
    | RuleOutcome::Invalid(reason) = outcome
    {
        warn!(rule = %rule.name_any(), namespace = ?rule.namespace(), reason = %reason, "rule not rendered");
    }
    let (mut desired, transitions) =
        status::rule_control(rule.status.as_ref(), rule.meta().generation, outcome, now);
    desired.mqtt_topics = status::column(rule.spec.mqtt.topics.iter().map(|t| t.0.as_str()));
    let current = rule.status.as_ref().map(status::rule_control_view);
    if current.as_ref() != Some(&desired) {
        write_status(api, &rule.name_any(), FIELD_MANAGER, &desired).await?;
        ctx.metrics.status_written(Kind::ForwardingRule);
    }
    publish(ctx, &rule.object_ref(&()), &transitions).await;
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
            Ok(rule) => write_rule_control(&ctx, &api, rule, &outcome, now).await?,
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
                if current.as_ref().map(status::rule_control_view) != Some(desired.clone()) {
                    // Through the guard: the answer carries the same unreadable spec.
                    let api = Api::<DeserializeGuard<ForwardingRule>>::namespaced(
                        ctx.client.clone(),
                        &ns,
                    );
                    write_status(&api, &name, FIELD_MANAGER, &desired).await?;
                    ctx.metrics.status_written(Kind::ForwardingRule);
                }
                publish(&ctx, &guarded.object_ref(&()), &transitions).await;
            }
        }
    }
    succeeded(&ctx, &*guarded, Kind::ForwardingRule, started);
    Ok(Action::await_change())
}

/// The status of an object whose spec this operator cannot read.
async fn current_status<K, S>(client: &Client, ns: &str, name: &str) -> Result<Option<S>, Error>
where
    K: Resource<DynamicType = ()>,
    S: DeserializeOwned,
{
    let api =
        Api::<DynamicObject>::namespaced_with(client.clone(), ns, &ApiResource::erase::<K>(&()));
    let Some(object) = api.get_opt(name).await? else {
        return Ok(None);
    };
    match object.data.get("status") {
        None => Ok(None),
        Some(s) => serde_json::from_value(s.clone())
            .map(Some)
            .map_err(|source| Error::Status {
                name: name.to_owned(),
                source,
            }),
    }
}

pub(crate) async fn write_status<K, S>(
    api: &Api<K>,
    name: &str,
    manager: &str,
    status: &S,
) -> Result<(), Error>
where
    K: Resource<DynamicType = ()> + DeserializeOwned + Clone + std::fmt::Debug,
    S: Serialize,
{
    let patch = serde_json::json!({
        "apiVersion": K::api_version(&()),
        "kind": K::kind(&()),
        "status": status,
    });
    api.patch_status(
        name,
        &PatchParams::apply(manager).force(),
        &Patch::Apply(&patch),
    )
    .await?;
    Ok(())
}

pub(crate) async fn publish(
    ctx: &Context,
    reference: &k8s_openapi::api::core::v1::ObjectReference,
    transitions: &[Transition],
) {
    publish_with(&ctx.recorder, reference, transitions).await;
}

pub(crate) async fn publish_with(
    recorder: &Recorder,
    reference: &k8s_openapi::api::core::v1::ObjectReference,
    transitions: &[Transition],
) {
    for t in transitions.iter().filter(|t| t.noteworthy()) {
        let event = Event {
            type_: if t.status == FALSE {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: t.reason.clone(),
            note: Some(format!("{} is {}: {}", t.type_, t.status, t.message)),
            action: format!("Set{}", t.type_),
            secondary: None,
        };
        // An Event is a courtesy: failing to record one must not fail the reconcile.
        if let Err(e) = recorder.publish(&event, reference).await {
            warn!(error = %e, "cannot record Event");
        }
    }
}

fn referenced_secrets(c: &BrokerConnection) -> BTreeSet<String> {
    let s = &c.spec;
    let mut names = BTreeSet::new();
    names.extend(
        s.mqtt
            .credentials_secret_ref
            .as_ref()
            .map(|r| r.name.clone()),
    );
    names.extend(
        s.kafka
            .sasl
            .as_ref()
            .map(|r| r.credentials_secret_ref.name.clone()),
    );
    for tls in [&s.mqtt.tls, &s.kafka.tls].into_iter().flatten() {
        names.extend(tls.ca_secret_ref.as_ref().map(|r| r.name.clone()));
        names.extend(tls.client_cert_secret_ref.as_ref().map(|r| r.name.clone()));
    }
    names
}

async fn apply<K>(client: &Client, ns: &str, object: &K) -> Result<K, Error>
where
    K: Resource<Scope = NamespaceResourceScope, DynamicType = ()>
        + Serialize
        + DeserializeOwned
        + Clone
        + std::fmt::Debug,
{
    let api = Api::<K>::namespaced(client.clone(), ns);
    Ok(api
        .patch(
            &object.name_any(),
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(object),
        )
        .await?)
}

/// Deletes the children of this connection whose group is not in `kept`; returns how many.
async fn prune(
    client: &Client,
    ns: &str,
    connection: &str,
    kept: &BTreeSet<String>,
) -> Result<usize, Error> {
    let selector = format!("{LABEL_CONNECTION}={connection}");
    let mut pruned = 0;
    pruned += prune_kind::<StatefulSet>(client, ns, &selector, kept).await?;
    pruned += prune_kind::<ConfigMap>(client, ns, &selector, kept).await?;
    pruned += prune_kind::<Secret>(client, ns, &selector, kept).await?;
    pruned += prune_kind::<Service>(client, ns, &selector, kept).await?;
    pruned += prune_kind::<PodDisruptionBudget>(client, ns, &selector, kept).await?;
    Ok(pruned)
}

async fn prune_kind<K>(
    client: &Client,
    ns: &str,
    selector: &str,
    kept: &BTreeSet<String>,
) -> Result<usize, Error>
where
    K: Resource<Scope = NamespaceResourceScope, DynamicType = ()>
        + DeserializeOwned
        + Clone
        + std::fmt::Debug,
{
    let api = Api::<K>::namespaced(client.clone(), ns);
    let mut pruned = 0;
    for object in api
        .list(&ListParams::default().labels(selector))
        .await?
        .items
    {
        let group = object
            .labels()
            .get(LABEL_GROUP)
            .cloned()
            .unwrap_or_default();
        if !kept.contains(&group) {
            api.delete(&object.name_any(), &DeleteParams::default())
                .await?;
            pruned += 1;
        }
    }
    Ok(pruned)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn connection(host: &str, servers: &str, config: &str) -> BrokerConnection {
        serde_saphyr::from_str(&format!(
            "apiVersion: ferry.dev/v1alpha1\nkind: BrokerConnection\nmetadata: {{ name: c, namespace: n }}\n\
             spec:\n  mqtt: {{ host: {host} }}\n  kafka: {{ bootstrapServers: {servers}, config: {config} }}\n"
        ))
        .expect("connection")
    }

    #[test]
    fn what_cel_let_through_is_refused_naming_the_spec_fields() {
        // An apiserver still serving older CRDs (Helm never upgrades them) admits these.
        let bad = connection("\"mqtt://b\"", "[\"k:0\"]", "{ acks: \"1\" }");
        let message = connection_refused(&bad).expect("renders").expect("refused");
        for expected in [
            "spec.mqtt.host: \"mqtt://b\" is not a host name",
            "spec.kafka.bootstrapServers: \"k:0\" has a port outside 1-65535",
            "spec.kafka.config.acks: \"1\" weakens the delivery guarantee",
        ] {
            assert!(message.contains(expected), "{expected:?} in {message}");
        }
        let good = connection("mqtt", "[\"k:9092\"]", "{ acks: all }");
        assert_eq!(connection_refused(&good).expect("renders"), None);
    }
}
