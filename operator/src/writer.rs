//! Writing what the operator observed: status through server-side apply (each writer under its
//! own field manager, so one never erases the other's fields) and Events for transitions.

use ferry_api::crd::BrokerConnection;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams};
use kube::runtime::events::{Event, EventType};
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::warn;

use crate::budget::Urgency;
use crate::conditions::Transition;
use crate::context::{At, Context, Error, Step};
use crate::events::Recorder;
use crate::metrics::Kind;

/// API writes a reconcile has in flight at once (groups applied, rule statuses written).
pub(crate) const CONCURRENT_WRITES: usize = 16;
/// Writes whose futures exist at once: a few rounds of [`CONCURRENT_WRITES`]. Thousands of
/// writes' futures made up front would hold thousands of request states at once.
pub(crate) const WRITE_BATCH: usize = 4 * CONCURRENT_WRITES;

/// Field manager of children, connection status and the rules' `Accepted`/`Ready`.
pub const FIELD_MANAGER: &str = "ferry-operator";
/// Field manager of the rules' data-plane status (see `dataplane`).
pub const STATUS_FIELD_MANAGER: &str = "ferry-operator-status";

/// The status of an object whose spec this operator cannot read.
pub(crate) async fn current_status<K, S>(
    client: &Client,
    ns: &str,
    name: &str,
) -> Result<Option<S>, Error>
where
    K: Resource<DynamicType = ()>,
    S: DeserializeOwned,
{
    let api =
        Api::<DynamicObject>::namespaced_with(client.clone(), ns, &ApiResource::erase::<K>(&()));
    let Some(object) = api.get_opt(name).await.at(Step::Read)? else {
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

/// The one way the operator writes a status: `desired` under field manager `manager` when
/// `changed` (the caller compares what it owns of the status; unchanged writes are skipped, so
/// reconciles do not feed themselves), counted, then the transitions as Events. Nothing is
/// published when the write fails: the next reconcile computes the same transitions again.
/// Returns whether it wrote.
///
/// Paid for from the operator's status-write budget at once, into debt if need be: see
/// [`update_status_with`] for a write that waited for its turn.
pub(crate) async fn update_status<K, S>(
    ctx: &Context,
    api: &Api<K>,
    object: &K,
    manager: &str,
    update: (&S, bool),
    transitions: &[Transition],
) -> Result<bool, Error>
where
    K: Resource<DynamicType = ()> + DeserializeOwned + Clone + std::fmt::Debug,
    S: Serialize,
{
    update_status_with(ctx, api, object, manager, update, transitions, Urgency::Now).await
}

/// [`update_status`], for a write of `urgency`: a [`Urgency::Deferrable`] one has already
/// taken its token from `ctx.budget` (see `WriteBudget::wait_until`), so it is not paid twice.
pub(crate) async fn update_status_with<K, S>(
    ctx: &Context,
    api: &Api<K>,
    object: &K,
    manager: &str,
    (desired, changed): (&S, bool),
    transitions: &[Transition],
    urgency: Urgency,
) -> Result<bool, Error>
where
    K: Resource<DynamicType = ()> + DeserializeOwned + Clone + std::fmt::Debug,
    S: Serialize,
{
    if changed {
        if urgency == Urgency::Now {
            ctx.budget.spend();
        }
        let patch = serde_json::json!({
            "apiVersion": K::api_version(&()),
            "kind": K::kind(&()),
            "status": desired,
        });
        api.patch_status(
            &object.name_any(),
            &PatchParams::apply(manager).force(),
            &Patch::Apply(&patch),
        )
        .await
        .at(Step::Status)?;
        let kind = if K::kind(&()) == BrokerConnection::kind(&()) {
            Kind::BrokerConnection
        } else {
            Kind::ForwardingRule
        };
        ctx.metrics.status_written(kind);
    }
    publish(ctx, &object.object_ref(&()), transitions).await;
    Ok(changed)
}

/// The transitions' Events, each an API write paid from the status-write budget: a Warning
/// always (someone has something to do), a Normal one only when the budget has room, so that
/// thousands of rules turning Ready at once do not send thousands of Events (their conditions
/// say it all the same).
pub(crate) async fn publish(
    ctx: &Context,
    reference: &ObjectReference,
    transitions: &[Transition],
) {
    let mut told = Vec::new();
    for t in transitions.iter().filter(|t| t.noteworthy()) {
        if t.warns() {
            ctx.budget.spend();
        } else if ctx.budget.take().is_err() {
            ctx.metrics.event_skipped();
            continue;
        }
        told.push(t.clone());
    }
    publish_with(&ctx.recorder, reference, &told).await;
}

/// Records the noteworthy `transitions` as Events.
pub(crate) async fn publish_with(
    recorder: &Recorder,
    reference: &ObjectReference,
    transitions: &[Transition],
) {
    for t in transitions.iter().filter(|t| t.noteworthy()) {
        let event = Event {
            type_: if t.warns() {
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

/// A Warning Event that is not a condition's transition.
pub(crate) async fn warn_event(
    ctx: &Context,
    reference: &ObjectReference,
    action: &str,
    reason: &str,
    note: String,
) {
    event(ctx, reference, EventType::Warning, (action, reason), note).await;
}

/// An Event that is not a condition's transition: `(action, reason)`.
pub(crate) async fn event(
    ctx: &Context,
    reference: &ObjectReference,
    type_: EventType,
    (action, reason): (&str, &str),
    note: String,
) {
    let event = Event {
        type_,
        reason: reason.to_owned(),
        note: Some(note),
        action: action.to_owned(),
        secondary: None,
    };
    // An Event is a courtesy: failing to record one must not fail the reconcile.
    if let Err(e) = ctx.recorder.publish(&event, reference).await {
        warn!(error = %e, "cannot record Event");
    }
}
