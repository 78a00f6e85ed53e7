//! The kube side of the MQTT session lifecycle (see [`crate::sessions`]): which forwarder pods
//! exist, ending the sessions of those gone for good, and the connection's finalizer.

use std::collections::BTreeMap;
use std::time::Duration;

use ferry_api::crd::{BrokerConnection, BrokerConnectionStatus};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource, DynamicObject, ListParams, Patch, PatchParams};
use kube::core::DeserializeGuard;
use kube::runtime::controller::Action;
use kube::{Client, Resource, ResourceExt};
use tracing::{info, warn};

use crate::apply::{prune, read_secrets};
use crate::children::{LABEL_CONNECTION, SELECTOR};
use crate::context::{At, Context, Error, Step};
use crate::release::RELEASED_ANNOTATION;
use crate::validate;
use crate::writer::{FIELD_MANAGER, current_status, update_status, warn_event};

/// What became of a connection's recorded MQTT sessions in one reconcile.
pub(crate) struct SessionsOutcome {
    /// What the status records from now on.
    pub(crate) recorded: Vec<String>,
    /// Sooner than the resync: pods still terminating, or a session the broker did not let
    /// us end.
    pub(crate) retry_in: Option<Duration>,
    /// Sessions that could not be ended, with the error.
    pub(crate) failed: Vec<(String, String)>,
}

impl SessionsOutcome {
    pub(crate) fn unchanged(recorded: Vec<String>) -> Self {
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
pub(crate) async fn end_gone_sessions(
    ctx: &Context,
    connection: &BrokerConnection,
    secret_data: &BTreeMap<String, ByteString>,
    recorded: &[String],
    groups: &BTreeMap<String, i32>,
) -> Result<SessionsOutcome, Error> {
    let ns = connection.namespace().unwrap_or_default();
    let name = connection.name_any();
    // Every forwarder pod of the namespace: another connection's pod of a recorded name runs
    // that session now, and is not this connection's to end.
    let pods: BTreeMap<String, crate::sessions::PodState> =
        Api::<Pod>::namespaced(ctx.client.clone(), &ns)
            .list(&ListParams::default().labels(SELECTOR))
            .await
            .at(Step::Sessions)?
            .items
            .iter()
            .map(|pod| {
                let started = crate::sessions::started(pod);
                let ours = pod.labels().get(LABEL_CONNECTION) == Some(&name);
                (pod.name_any(), crate::sessions::PodState { started, ours })
            })
            .collect();
    let prefix = crate::sessions::SessionPrefix::of(connection);
    let mut plan = crate::sessions::plan(&prefix, recorded, groups, &pods);
    if !plan.end.is_empty() {
        // The watch cache may not yet hold this operator's own last write of the record (a
        // reconcile right after another): ending a session twice could end the one a new pod
        // of the same name has just opened. The record as the apiserver has it decides.
        let fresh =
            current_status::<BrokerConnection, BrokerConnectionStatus>(&ctx.client, &ns, &name)
                .await?
                .map(|s| s.mqtt_sessions)
                .unwrap_or_default();
        if fresh != recorded {
            plan = crate::sessions::plan(&prefix, &fresh, groups, &pods);
        }
    }
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
pub(crate) async fn finalize(
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
        warn_event(ctx, &reference, "EndSessions", "SessionsNotEnded", "the connection cannot be read, so its broker cannot be reached: its forwarders' MQTT sessions end by their expiry".to_owned()).await;
        set_finalizer(&ctx.client, guarded, ns, false).await?;
        return Ok(Action::await_change());
    };
    // Pods that started since the last reconcile are not recorded yet, and once gone nothing
    // would name their sessions: record them before they go.
    let recorded = record_running(ctx, connection, ns).await?;
    // The garbage collector would remove the forwarders only after the object is gone; their
    // sessions must end after the pods, so remove every child now.
    // NetworkPolicies stay: they keep nothing running, and the garbage collector takes them.
    prune(&ctx.client, ns, connection, (&BTreeMap::new(), false)).await?;
    let secrets = read_secrets(&ctx.client, ns, connection).await?;
    let outcome = match validate::resolve_secrets(connection, &secrets) {
        Ok(secret_data) => {
            end_gone_sessions(ctx, connection, &secret_data, &recorded, &BTreeMap::new()).await?
        }
        Err(missing) => {
            let missing: Vec<String> = missing.iter().map(ToString::to_string).collect();
            warn_event(ctx, &reference, "EndSessions", "SessionsNotEnded", format!("cannot authenticate to the MQTT broker ({}): the forwarders' sessions end by their expiry", missing.join("; "))).await;
            SessionsOutcome::unchanged(Vec::new())
        }
    };
    if outcome.retry_in.is_some() && outcome.failed.is_empty() {
        // Pods still terminating.
        record(ctx, connection, ns, (&recorded, outcome.recorded)).await?;
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
            record(ctx, connection, ns, (&recorded, outcome.recorded)).await?;
            return Ok(Action::requeue(SESSIONS_RETRY));
        }
        warn_event(ctx, &reference, "EndSessions", "SessionsNotEnded", format!("gave up ending {} MQTT sessions after {FINALIZE_GIVE_UP:?} ({id}: {e}); they end by their expiry", outcome.failed.len())).await;
    }
    set_finalizer(&ctx.client, guarded, ns, false).await?;
    info!(connection = %name, namespace = %ns, "forwarders stopped and their MQTT sessions ended; released");
    Ok(Action::await_change())
}

/// The client ids a connection being deleted has sessions under: those its status records (as
/// the API server has it, not the watch cache, which may lag behind the last pass's write) and
/// those of its forwarder pods that have started, recorded from now on.
async fn record_running(
    ctx: &Context,
    connection: &BrokerConnection,
    ns: &str,
) -> Result<Vec<String>, Error> {
    let name = connection.name_any();
    let recorded =
        current_status::<BrokerConnection, BrokerConnectionStatus>(&ctx.client, ns, &name)
            .await?
            .map(|s| s.mqtt_sessions)
            .unwrap_or_default();
    let prefix = crate::sessions::SessionPrefix::of(connection);
    let mut all = recorded.clone();
    let selector = format!("{SELECTOR},{LABEL_CONNECTION}={name}");
    let pods = Api::<Pod>::namespaced(ctx.client.clone(), ns)
        .list(&ListParams::default().labels(&selector))
        .await
        .at(Step::Sessions)?;
    for pod in pods.items.iter().filter(|p| crate::sessions::started(p)) {
        all.push(crate::sessions::client_id(&prefix, &pod.name_any()));
    }
    all.sort();
    all.dedup();
    record(ctx, connection, ns, (&recorded, all.clone())).await?;
    Ok(all)
}

/// Writes `now` as the connection's recorded sessions when it differs from `was`.
async fn record(
    ctx: &Context,
    connection: &BrokerConnection,
    ns: &str,
    (was, now): (&[String], Vec<String>),
) -> Result<(), Error> {
    if was == now.as_slice() {
        return Ok(());
    }
    let status = BrokerConnectionStatus {
        mqtt_sessions: now,
        session_prefix: Some(crate::sessions::SessionPrefix::of(connection).into()),
        ..connection.status.clone().unwrap_or_default()
    };
    let api = Api::<BrokerConnection>::namespaced(ctx.client.clone(), ns);
    update_status(ctx, &api, connection, FIELD_MANAGER, (&status, true), &[]).await?;
    Ok(())
}

/// Adds (`present`) or removes [`crate::sessions::FINALIZER`], leaving other finalizers as
/// they are; adding it also removes [`RELEASED_ANNOTATION`]. A merge patch carrying the `resourceVersion` it was computed from: a concurrent
/// change fails it (409) and the reconcile is retried, and it can never create the object.
pub(crate) async fn set_finalizer(
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
    let mut patch = serde_json::json!({
        "metadata": {
            "resourceVersion": guarded.meta().resource_version,
            "finalizers": finalizers,
        }
    });
    if present && guarded.annotations().contains_key(RELEASED_ANNOTATION) {
        // Managed again after an uninstall released it (see crate::release).
        patch["metadata"]["annotations"] = serde_json::json!({ RELEASED_ANNOTATION: null });
    }
    let resource = ApiResource::erase::<BrokerConnection>(&());
    Api::<DynamicObject>::namespaced_with(client.clone(), ns, &resource)
        .patch(
            &guarded.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
        .at(Step::Status)?;
    Ok(())
}
