//! The reconcile loop, one BrokerConnection at a time: dereference (its rules and Secrets) →
//! validate → build (pure, `render` and `children`) → apply (server-side apply, one field
//! manager) → prune (the children of groups that no longer have rules).
//!
//! Status, Events, metrics and leader election are not written yet.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use ferry_api::crd::{BrokerConnection, ForwardingRule};
use futures::StreamExt;
use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{ConfigMap, Secret, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::{info, warn};

use crate::children::{self, LABEL_CONNECTION, LABEL_GROUP};
use crate::render::{Group, render};
use crate::validate::{self, Secrets};

pub const FIELD_MANAGER: &str = "ferry-operator";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("{0}")]
    Render(#[from] crate::render::RenderError),
    #[error("BrokerConnection has no namespace")]
    NoNamespace,
}

pub struct Context {
    pub client: Client,
}

/// Runs until the process is stopped.
pub async fn run(client: Client) {
    let connections: Api<BrokerConnection> = Api::all(client.clone());
    let rules: Api<ForwardingRule> = Api::all(client.clone());
    let context = Arc::new(Context {
        client: client.clone(),
    });
    let controller = Controller::new(connections, watcher::Config::default());
    let store = controller.store();
    controller
        .owns(
            Api::<StatefulSet>::all(client.clone()),
            watcher::Config::default(),
        )
        .owns(
            Api::<ConfigMap>::all(client.clone()),
            watcher::Config::default(),
        )
        // A rule change reconciles the connection it names.
        .watches(rules, watcher::Config::default(), |rule: ForwardingRule| {
            let ns = rule.namespace()?;
            Some(ObjectRef::new(&rule.spec.connection_ref.name).within(&ns))
        })
        // A created or rotated Secret reconciles the connections that reference it.
        .watches(
            Api::<Secret>::all(client.clone()),
            watcher::Config::default(),
            move |secret: Secret| {
                let ns = secret.namespace();
                let name = secret.name_any();
                store
                    .state()
                    .into_iter()
                    .filter(|c| c.namespace() == ns && referenced_secrets(c).contains(&name))
                    .map(|c| ObjectRef::from_obj(&*c))
                    .collect::<Vec<_>>()
            },
        )
        .run(reconcile, error_policy, context)
        .for_each(|result| async move {
            if let Err(e) = result {
                warn!(error = %e, "reconcile failed");
            }
        })
        .await;
}

fn error_policy(_: Arc<BrokerConnection>, error: &Error, _: Arc<Context>) -> Action {
    warn!(error = %error, "will retry");
    Action::requeue(Duration::from_secs(10))
}

async fn reconcile(connection: Arc<BrokerConnection>, ctx: Arc<Context>) -> Result<Action, Error> {
    let ns = connection.namespace().ok_or(Error::NoNamespace)?;
    let name = connection.name_any();
    let client = &ctx.client;

    // Dereference.
    let all_rules = Api::<ForwardingRule>::namespaced(client.clone(), &ns)
        .list(&ListParams::default())
        .await?;
    let rules: Vec<&ForwardingRule> = all_rules
        .items
        .iter()
        .filter(|r| r.spec.connection_ref.name == name)
        .collect();
    let mut secrets: Secrets = BTreeMap::new();
    let secret_api = Api::<Secret>::namespaced(client.clone(), &ns);
    for s in referenced_secrets(&connection) {
        if let Some(secret) = secret_api.get_opt(&s).await? {
            secrets.insert(s, secret.data.unwrap_or_default());
        }
    }

    // Validate.
    let secret_data = match validate::resolve_secrets(&connection, &secrets) {
        Ok(data) => data,
        Err(missing) => {
            for m in &missing {
                warn!(connection = %name, namespace = %ns, problem = %m, "cannot render forwarders");
            }
            // Creating the Secret triggers a reconcile (Secrets are watched).
            return Ok(Action::requeue(Duration::from_secs(300)));
        }
    };
    let mut groups: BTreeMap<&str, Vec<&ForwardingRule>> = BTreeMap::new();
    for r in &rules {
        groups.entry(r.spec.group.as_str()).or_default().push(r);
    }

    // Build and apply.
    let mut kept = BTreeSet::new();
    for (group, members) in &groups {
        let refused = validate::conflicts(members);
        let accepted: Vec<&ForwardingRule> = members
            .iter()
            .copied()
            .filter(|r| !refused.contains_key(&r.name_any()))
            .collect();
        for (rule, reason) in &refused {
            warn!(rule = %rule, namespace = %ns, reason = %reason, "rule refused");
        }
        let rendered = render(&Group {
            connection: &connection,
            name: group,
            rules: accepted,
        })?;
        let c = children::build(&connection, group, &rendered, secret_data.clone());
        apply(client, &ns, &c.config_map).await?;
        apply(client, &ns, &c.secret).await?;
        apply(client, &ns, &c.service).await?;
        apply(client, &ns, &c.pdb).await?;
        apply(client, &ns, &c.stateful_set).await?;
        kept.insert((*group).to_owned());
    }

    // Prune groups that no longer have rules.
    let pruned = prune(client, &ns, &name, &kept).await?;
    info!(connection = %name, namespace = %ns, groups = kept.len(), pruned, "reconciled");
    Ok(Action::requeue(Duration::from_secs(300)))
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

async fn apply<K>(client: &Client, ns: &str, object: &K) -> Result<(), Error>
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
    .await?;
    Ok(())
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
