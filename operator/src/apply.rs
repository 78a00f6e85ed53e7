//! The I/O edge of reconciling a connection: reading the Secrets it references, applying its
//! children with server-side apply (one field manager) and pruning what no group needs.

use std::collections::{BTreeMap, BTreeSet};

use ferry_api::crd::BrokerConnection;
use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{ConfigMap, Secret, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::children::{LABEL_CONNECTION, LABEL_GROUP};
use crate::context::Error;
use crate::validate::{Secrets, referenced_secrets};
use crate::writer::FIELD_MANAGER;

/// The data of every Secret the connection references that exists.
pub(crate) async fn read_secrets(
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

pub(crate) async fn apply<K>(client: &Client, ns: &str, object: &K) -> Result<K, Error>
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
pub(crate) async fn prune(
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
