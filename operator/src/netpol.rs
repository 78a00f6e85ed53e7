//! The optional NetworkPolicy of each forwarder group (`--forwarder-network-policy`): ingress to
//! the forwarder pods' `http` port (`/status`, `/metrics`, the probes' port) only from the
//! operator's pods and the configured metrics sources; egress is not restricted (the brokers,
//! DNS and whatever a connection's TLS needs are the connection's business).
//!
//! The kubelet's probes are not subject to NetworkPolicies, so the pods stay Ready.

use std::collections::BTreeMap;

use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort,
    NetworkPolicySpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::children::Children;
use crate::render::HTTP_PORT;

/// The namespace label every namespace carries (Kubernetes 1.21+): selects one by name.
const NAMESPACE_NAME_LABEL: &str = "kubernetes.io/metadata.name";

/// The operator's flags for the policy.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct NetworkPolicyArgs {
    /// Render a NetworkPolicy per forwarder group: its pods accept connections on their http
    /// port (/status, /metrics) only from the operator's pods (--operator-pod-labels in the
    /// operator's namespace) and from --forwarder-metrics-from; egress is not restricted.
    /// Turning it off does not delete the policies already rendered (they go with their
    /// connection).
    #[arg(long, env = "FERRY_FORWARDER_NETWORK_POLICY", default_value_t = false, action = clap::ArgAction::Set)]
    pub forwarder_network_policy: bool,
    /// Labels of the operator's own pods, `key=value,...` (the policy lets them read /status).
    #[arg(long, env = "FERRY_OPERATOR_POD_LABELS", value_name = "LABELS", value_parser = parse_labels)]
    pub operator_pod_labels: Option<Labels>,
    /// Namespace of the operator's pods; default: POD_NAMESPACE (the Lease's namespace).
    #[arg(long, env = "FERRY_OPERATOR_NAMESPACE")]
    pub operator_namespace: Option<String>,
    /// Who else may reach the forwarders' http port, e.g. Prometheus: a JSON list of
    /// NetworkPolicyPeer (`[{"namespaceSelector":{"matchLabels":{"kubernetes.io/metadata.name":"monitoring"}}}]`).
    #[arg(long, env = "FERRY_FORWARDER_METRICS_FROM", value_name = "JSON", value_parser = parse_peers)]
    pub forwarder_metrics_from: Option<Peers>,
}

/// Pod labels, from `key=value,...`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Labels(pub BTreeMap<String, String>);

/// NetworkPolicy peers, from JSON.
#[derive(Debug, Clone, PartialEq)]
pub struct Peers(pub Vec<NetworkPolicyPeer>);

fn parse_labels(value: &str) -> Result<Labels, String> {
    let mut labels = BTreeMap::new();
    for pair in value.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let Some((k, v)) = pair.split_once('=') else {
            return Err(format!("{pair:?} is not key=value"));
        };
        if k.trim().is_empty() {
            return Err(format!("{pair:?} has no key"));
        }
        labels.insert(k.trim().to_owned(), v.trim().to_owned());
    }
    if labels.is_empty() {
        return Err("no labels: give key=value,...".to_owned());
    }
    Ok(Labels(labels))
}

fn parse_peers(value: &str) -> Result<Peers, String> {
    serde_json::from_str::<Vec<NetworkPolicyPeer>>(value)
        .map(Peers)
        .map_err(|e| format!("not a JSON list of NetworkPolicyPeer: {e}"))
}

/// Who may reach the forwarders, resolved at start.
#[derive(Debug, Clone, PartialEq)]
pub struct ForwarderNetworkPolicy {
    pub operator_namespace: String,
    pub operator_pods: BTreeMap<String, String>,
    pub metrics_from: Vec<NetworkPolicyPeer>,
}

/// Why the flags do not make a policy.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PolicyError {
    #[error(
        "--forwarder-network-policy needs --operator-pod-labels (the labels of the operator's pods), or the operator could not read the forwarders' /status"
    )]
    NoOperatorLabels,
    #[error(
        "--forwarder-network-policy needs the operator's namespace: --operator-namespace or POD_NAMESPACE"
    )]
    NoOperatorNamespace,
}

impl NetworkPolicyArgs {
    /// The policy to render, if enabled; `namespace` is the operator's own when the flag
    /// names none.
    pub fn resolve(
        &self,
        namespace: Option<&str>,
    ) -> Result<Option<ForwarderNetworkPolicy>, PolicyError> {
        if !self.forwarder_network_policy {
            return Ok(None);
        }
        let operator_pods = self
            .operator_pod_labels
            .clone()
            .ok_or(PolicyError::NoOperatorLabels)?
            .0;
        let operator_namespace = self
            .operator_namespace
            .as_deref()
            .or(namespace)
            .filter(|n| !n.is_empty())
            .ok_or(PolicyError::NoOperatorNamespace)?
            .to_owned();
        Ok(Some(ForwarderNetworkPolicy {
            operator_namespace,
            operator_pods,
            metrics_from: self
                .forwarder_metrics_from
                .clone()
                .map(|p| p.0)
                .unwrap_or_default(),
        }))
    }
}

/// The group's policy: named, labelled and owned as its other children, selecting its pods.
pub fn build(children: &Children, policy: &ForwarderNetworkPolicy) -> NetworkPolicy {
    let set = &children.stateful_set;
    let pods = set
        .spec
        .as_ref()
        .map(|s| s.selector.clone())
        .unwrap_or_default();
    let operator = NetworkPolicyPeer {
        namespace_selector: Some(LabelSelector {
            match_labels: Some(BTreeMap::from([(
                NAMESPACE_NAME_LABEL.to_owned(),
                policy.operator_namespace.clone(),
            )])),
            ..LabelSelector::default()
        }),
        pod_selector: Some(LabelSelector {
            match_labels: Some(policy.operator_pods.clone()),
            ..LabelSelector::default()
        }),
        ip_block: None,
    };
    let from = std::iter::once(operator)
        .chain(policy.metrics_from.iter().cloned())
        .collect();
    NetworkPolicy {
        metadata: ObjectMeta {
            name: set.metadata.name.clone(),
            namespace: set.metadata.namespace.clone(),
            labels: set.metadata.labels.clone(),
            owner_references: set.metadata.owner_references.clone(),
            ..ObjectMeta::default()
        },
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(pods),
            // Ingress only: egress (brokers, DNS) stays open.
            policy_types: Some(vec!["Ingress".to_owned()]),
            ingress: Some(vec![NetworkPolicyIngressRule {
                from: Some(from),
                ports: Some(vec![NetworkPolicyPort {
                    port: Some(IntOrString::Int(i32::from(HTTP_PORT))),
                    protocol: Some("TCP".to_owned()),
                    end_port: None,
                }]),
            }]),
            egress: None,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(enabled: bool, labels: Option<&str>, ns: Option<&str>) -> NetworkPolicyArgs {
        NetworkPolicyArgs {
            forwarder_network_policy: enabled,
            operator_pod_labels: labels.map(|l| parse_labels(l).expect("labels")),
            operator_namespace: ns.map(str::to_owned),
            forwarder_metrics_from: None,
        }
    }

    #[test]
    fn the_flags_name_what_is_missing() {
        assert_eq!(args(false, None, None).resolve(None), Ok(None));
        assert_eq!(
            args(true, None, Some("ops")).resolve(None),
            Err(PolicyError::NoOperatorLabels)
        );
        assert_eq!(
            args(true, Some("app=ferry"), None).resolve(None),
            Err(PolicyError::NoOperatorNamespace)
        );
        let p = args(true, Some("app=ferry, component=operator"), None)
            .resolve(Some("ferry-system"))
            .expect("valid")
            .expect("enabled");
        assert_eq!(p.operator_namespace, "ferry-system");
        assert_eq!(p.operator_pods.len(), 2);
        assert!(parse_labels("app").is_err() && parse_labels("=x").is_err());
        assert!(parse_labels("").is_err());
        let peers = parse_peers(r#"[{"namespaceSelector":{"matchLabels":{"team":"obs"}}}]"#)
            .expect("peers");
        assert_eq!(peers.0.len(), 1);
        assert!(parse_peers(r#"{"namespaceSelector":{}}"#).is_err());
    }
}
