//! `ferry-operator release-finalizers`: what the chart's `pre-delete` hook runs so that
//! uninstalling the operator never leaves a BrokerConnection that cannot be deleted.
//!
//! The operator's finalizer ([`crate::sessions::FINALIZER`]) makes a deleted connection wait
//! until its forwarders are gone and their MQTT sessions ended. Without an operator nothing
//! removes it: `kubectl delete bc` would hang, and with it the namespace (and, with
//! `crds.keep=false`, the CRD). So, as Strimzi leaves its operands running, the hook first
//! stops the operator (its Deployment scaled to zero, its pods gone: a running operator would
//! put the finalizer straight back), then removes the finalizer from every connection in scope
//! and marks each with [`RELEASED_ANNOTATION`]. The forwarders keep forwarding; deleting a
//! connection later completes at once and the garbage collector removes its forwarders, but
//! nobody ends their sessions (they end by their expiry). An operator installed again puts its
//! finalizer back and removes the mark.

use std::time::{Duration, Instant};

use ferry_api::crd::BrokerConnection;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, PartialObjectMeta, Patch, PatchParams};
use kube::{Client, ResourceExt};
use tracing::info;

use crate::scope::Scope;

/// Set on a connection whose finalizer was released by an uninstall: the time, RFC 3339.
/// Deleting it no longer ends its forwarders' MQTT sessions.
pub const RELEASED_ANNOTATION: &str = "ferry.dev/finalizer-released-at";

/// How often to look whether the operator's pods are gone.
const POLL: Duration = Duration::from_millis(500);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("scaling Deployment {namespace}/{name} to 0: {source}")]
    Scale {
        namespace: String,
        name: String,
        source: kube::Error,
    },
    #[error("listing the operator pods ({selector}) in {namespace}: {source}")]
    Pods {
        namespace: String,
        selector: String,
        source: kube::Error,
    },
    #[error(
        "the operator pods ({selector}) in {namespace} are still there after {waited:?}: \
         removing the finalizers while one runs would be undone"
    )]
    OperatorStillRunning {
        namespace: String,
        selector: String,
        waited: Duration,
    },
    #[error("listing BrokerConnections{}: {source}", in_namespace(namespace.as_deref()))]
    List {
        namespace: Option<String>,
        source: kube::Error,
    },
    #[error("releasing BrokerConnection {namespace}/{name}: {source}")]
    Release {
        namespace: String,
        name: String,
        source: kube::Error,
    },
}

fn in_namespace(namespace: Option<&str>) -> String {
    namespace.map(|ns| format!(" in {ns}")).unwrap_or_default()
}

/// The operator Deployment to stop before releasing.
#[derive(Debug, Clone)]
pub struct Operator {
    pub namespace: String,
    pub deployment: String,
    /// Label selector of its pods.
    pub selector: String,
}

/// Scales the operator's Deployment to zero and waits, up to `timeout`, until none of its pods
/// is left (terminating ones included: they may still reconcile).
pub async fn stop_operator(
    client: &Client,
    operator: &Operator,
    timeout: Duration,
) -> Result<(), Error> {
    let deployments = Api::<Deployment>::namespaced(client.clone(), &operator.namespace);
    deployments
        .patch_scale(
            &operator.deployment,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({ "spec": { "replicas": 0 } })),
        )
        .await
        .map_err(|source| Error::Scale {
            namespace: operator.namespace.clone(),
            name: operator.deployment.clone(),
            source,
        })?;
    info!(deployment = %operator.deployment, namespace = %operator.namespace, "scaled the operator to 0; waiting for its pods to stop");
    let pods = Api::<Pod>::namespaced(client.clone(), &operator.namespace);
    let started = Instant::now();
    loop {
        let left = pods
            .list_metadata(&ListParams::default().labels(&operator.selector))
            .await
            .map_err(|source| Error::Pods {
                namespace: operator.namespace.clone(),
                selector: operator.selector.clone(),
                source,
            })?
            .items
            .len();
        if left == 0 {
            return Ok(());
        }
        if started.elapsed() >= timeout {
            return Err(Error::OperatorStillRunning {
                namespace: operator.namespace.clone(),
                selector: operator.selector.clone(),
                waited: timeout,
            });
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Removes the operator's finalizer from every BrokerConnection in `scope` that has it, marking
/// each with [`RELEASED_ANNOTATION`]; returns their `namespace/name`s.
pub async fn release_finalizers(client: &Client, scope: &Scope) -> Result<Vec<String>, Error> {
    let namespaces: Vec<Option<String>> = match scope {
        Scope::Cluster => vec![None],
        Scope::Namespaces(names) => names.iter().cloned().map(Some).collect(),
    };
    let now = jiff::Timestamp::now().to_string();
    let mut released = Vec::new();
    for namespace in namespaces {
        let api: Api<BrokerConnection> = match &namespace {
            Some(ns) => Api::namespaced(client.clone(), ns),
            None => Api::all(client.clone()),
        };
        // Metadata only: a connection whose spec no longer parses is released too.
        let connections = api
            .list_metadata(&ListParams::default())
            .await
            .map_err(|source| Error::List {
                namespace: namespace.clone(),
                source,
            })?;
        for connection in connections.items {
            if let Some(name) = release_one(client, connection, &now).await? {
                released.push(name);
            }
        }
    }
    Ok(released)
}

/// How often a release refused because the connection changed meanwhile is retried.
const CONFLICT_RETRIES: usize = 3;

/// Releases one connection if it carries the finalizer; its `namespace/name` if it did.
async fn release_one(
    client: &Client,
    mut connection: PartialObjectMeta<BrokerConnection>,
    now: &str,
) -> Result<Option<String>, Error> {
    let ns = connection.namespace().unwrap_or_default();
    let name = connection.name_any();
    let api = Api::<BrokerConnection>::namespaced(client.clone(), &ns);
    let error = |source| Error::Release {
        namespace: ns.clone(),
        name: name.clone(),
        source,
    };
    let mut attempt = 0;
    loop {
        let finalizers = connection.finalizers();
        if !finalizers.iter().any(|f| f == crate::sessions::FINALIZER) {
            return Ok(None);
        }
        let kept: Vec<&String> = finalizers
            .iter()
            .filter(|f| *f != crate::sessions::FINALIZER)
            .collect();
        // The resourceVersion it was read at: a concurrent change fails the patch (409) rather
        // than dropping another finalizer added meanwhile.
        let patch = serde_json::json!({
            "metadata": {
                "resourceVersion": connection.resource_version(),
                "finalizers": kept,
                "annotations": { RELEASED_ANNOTATION: now },
            }
        });
        match api
            .patch_metadata(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => break,
            // Gone meanwhile: nothing left to release.
            Err(kube::Error::Api(e)) if e.code == 404 => return Ok(None),
            Err(kube::Error::Api(e)) if e.code == 409 && attempt < CONFLICT_RETRIES => {
                attempt += 1;
                match api.get_metadata_opt(&name).await.map_err(error)? {
                    Some(fresh) => connection = fresh,
                    None => return Ok(None),
                }
            }
            Err(e) => return Err(error(e)),
        }
    }
    info!(connection = %name, namespace = %ns, "released the finalizer: deleting this connection no longer ends its forwarders' MQTT sessions");
    Ok(Some(format!("{ns}/{name}")))
}
