//! The I/O edge of reconciling a connection: reading the Secrets it references, applying its
//! children with server-side apply (one field manager) and pruning what no group needs.

use std::collections::BTreeMap;

use ferry_api::crd::BrokerConnection;
use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{ConfigMap, Secret, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, Preconditions};
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::children::{self, Children, LABEL_CONNECTION};
use crate::context::{At, Error, Step};
use crate::ownership::{self, Holder, Serving};
use crate::validate::{ReadSecret, Secrets, referenced_secrets};
use crate::writer::FIELD_MANAGER;

/// Every Secret the connection references that exists: its data only when it carries the
/// mark ([`crate::validate::SECRET_MARK`]); an unmarked Secret's data is never read.
pub(crate) async fn read_secrets(
    client: &Client,
    ns: &str,
    connection: &BrokerConnection,
) -> Result<Secrets, Error> {
    let mut secrets: Secrets = BTreeMap::new();
    let secret_api = Api::<Secret>::namespaced(client.clone(), ns);
    for s in referenced_secrets(connection) {
        let Some(meta) = secret_api.get_metadata_opt(&s).await.at(Step::Read)? else {
            continue;
        };
        let read = match ReadSecret::new(meta.metadata.labels.as_ref(), None) {
            ReadSecret::Unmarked => ReadSecret::Unmarked,
            // Read again, with the data: the mark is checked on what is used.
            ReadSecret::Marked(_) => match secret_api.get_opt(&s).await.at(Step::Read)? {
                None => continue,
                Some(secret) => ReadSecret::new(secret.metadata.labels.as_ref(), secret.data),
            },
        };
        secrets.insert(s, read);
    }
    Ok(secrets)
}

/// Why a group's children cannot be applied (a name another owner holds, see
/// [`crate::ownership`]), or `None` when each name is free or this connection's.
pub(crate) async fn taken(
    client: &Client,
    ns: &str,
    uid: &str,
    (children, network_policy): (&Children, bool),
) -> Result<Option<String>, Error> {
    let name = children.stateful_set.name_any();
    let policy = if network_policy {
        holder::<NetworkPolicy>(client, ns, &name, uid).await?
    } else {
        Holder::Absent
    };
    let holders = [
        ("NetworkPolicy", policy),
        (
            "ConfigMap",
            holder::<ConfigMap>(client, ns, &name, uid).await?,
        ),
        ("Secret", holder::<Secret>(client, ns, &name, uid).await?),
        ("Service", holder::<Service>(client, ns, &name, uid).await?),
        (
            "PodDisruptionBudget",
            holder::<PodDisruptionBudget>(client, ns, &name, uid).await?,
        ),
        (
            "StatefulSet",
            holder::<StatefulSet>(client, ns, &name, uid).await?,
        ),
    ];
    let named: Vec<(&str, &str, Holder)> = holders
        .into_iter()
        .map(|(kind, h)| (kind, name.as_str(), h))
        .collect();
    Ok(ownership::taken(&named))
}

async fn holder<K>(client: &Client, ns: &str, name: &str, uid: &str) -> Result<Holder, Error>
where
    K: Resource<Scope = NamespaceResourceScope, DynamicType = ()>
        + DeserializeOwned
        + Clone
        + std::fmt::Debug,
{
    let existing = Api::<K>::namespaced(client.clone(), ns)
        .get_metadata_opt(name)
        .await
        .at(Step::Read)?;
    Ok(ownership::holder(
        existing.as_ref().map(|o| &o.metadata),
        uid,
    ))
}

pub(crate) async fn apply<K>(client: &Client, ns: &str, object: &K) -> Result<K, Error>
where
    K: Resource<Scope = NamespaceResourceScope, DynamicType = ()>
        + Serialize
        + DeserializeOwned
        + Clone
        + std::fmt::Debug,
{
    let api = Api::<K>::namespaced(client.clone(), ns);
    api.patch(
        &object.name_any(),
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(object),
    )
    .await
    .at(Step::Apply)
}

/// What pruning did.
#[derive(Debug, Default)]
pub(crate) struct Pruned {
    pub(crate) deleted: usize,
    /// StatefulSets of an earlier name kept running until their group's new one is ready
    /// (name → wanted replicas): their pods' sessions are not to be ended yet.
    pub(crate) earlier: BTreeMap<String, i32>,
}

/// The label selector of `connection`'s children.
fn selector(connection: &BrokerConnection) -> String {
    format!(
        "{},{LABEL_CONNECTION}={}",
        children::SELECTOR,
        connection.name_any()
    )
}

/// Deletes the children of `connection` that [`ownership::prunable`] says may go: found by
/// its labels, deleted only when its UID controls them, each delete conditioned on the UID
/// of the object read (a replacement of the same name is left alone). A workload whose group
/// the spec no longer has is in `serving` until its hand-over is done ([`crate::handover`]).
/// NetworkPolicies only with `network_policies` (the operator renders them and may list them).
pub(crate) async fn prune(
    client: &Client,
    ns: &str,
    connection: &BrokerConnection,
    (serving, network_policies): (&BTreeMap<String, Serving>, bool),
) -> Result<Pruned, Error> {
    let selector = selector(connection);
    let uid = connection.uid().unwrap_or_default();
    let mut out = Pruned::default();
    let only = Only { uid: &uid, serving };
    let sets = prune_kind::<StatefulSet>(client, ns, &selector, &only).await?;
    out.deleted += sets.deleted;
    out.earlier = sets
        .kept
        .iter()
        .filter(|s| !is_current(*s, serving))
        .map(|s| {
            let wanted = s.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
            (s.name_any(), wanted)
        })
        .collect();
    out.deleted += prune_kind::<ConfigMap>(client, ns, &selector, &only)
        .await?
        .deleted;
    out.deleted += prune_kind::<Secret>(client, ns, &selector, &only)
        .await?
        .deleted;
    out.deleted += prune_kind::<Service>(client, ns, &selector, &only)
        .await?
        .deleted;
    out.deleted += prune_kind::<PodDisruptionBudget>(client, ns, &selector, &only)
        .await?
        .deleted;
    if network_policies {
        out.deleted += prune_kind::<NetworkPolicy>(client, ns, &selector, &only)
            .await?
            .deleted;
    }
    Ok(out)
}

/// Whether `object` is its group's workload under the name the plan gives it now.
fn is_current<K: Resource>(object: &K, serving: &BTreeMap<String, Serving>) -> bool {
    serving.values().any(|s| {
        matches!(s, Serving::Applied { workload, .. } if object.meta().name.as_deref() == Some(workload.as_str()))
    })
}

struct KindPruned<K> {
    deleted: usize,
    /// This connection's objects left in place.
    kept: Vec<K>,
}

/// What [`prune_kind`] may delete: what [`ownership::prunable`] allows.
struct Only<'a> {
    uid: &'a str,
    serving: &'a BTreeMap<String, Serving>,
}

impl Only<'_> {
    fn prunable(&self, meta: &ObjectMeta) -> bool {
        ownership::prunable(meta, self.uid, self.serving)
    }
}

async fn prune_kind<K>(
    client: &Client,
    ns: &str,
    selector: &str,
    only: &Only<'_>,
) -> Result<KindPruned<K>, Error>
where
    K: Resource<Scope = NamespaceResourceScope, DynamicType = ()>
        + DeserializeOwned
        + Clone
        + std::fmt::Debug,
{
    let api = Api::<K>::namespaced(client.clone(), ns);
    let mut out = KindPruned {
        deleted: 0,
        kept: Vec::new(),
    };
    for object in api
        .list(&ListParams::default().labels(selector))
        .await
        .at(Step::Prune)?
        .items
    {
        if only.prunable(object.meta()) {
            let only_this = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: object.meta().uid.clone(),
                    resource_version: None,
                }),
                ..DeleteParams::default()
            };
            match api.delete(&object.name_any(), &only_this).await {
                Ok(_) => out.deleted += 1,
                // Gone meanwhile, or replaced by another object of that name: not ours to
                // delete any more.
                Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
                Err(e) => return Err(e).at(Step::Prune),
            }
        } else if ownership::holder(Some(object.meta()), only.uid) == Holder::Ours {
            out.kept.push(object);
        }
    }
    Ok(out)
}
