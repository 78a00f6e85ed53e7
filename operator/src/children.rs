//! Build, continued: the Kubernetes objects a group owns. That is its ConfigMap (the forwarder
//! config), its Secret (credentials and certificates copied from the Secrets the connection
//! references), the forwarder StatefulSet, a headless Service and a PodDisruptionBudget. All are
//! pure functions of the rendered group, so they are unit-tested without a cluster.
//!
//! Why a StatefulSet: each forwarder keeps a persistent MQTT session under a stable client id
//! (its connection's session prefix and the pod's name). A StatefulSet's pods keep their names
//! (`<group>-0`, `<group>-1`) across restarts, so a replaced pod resumes its session and the
//! messages the broker held for it. A Deployment's pods get new random names: the old session,
//! and what it held, would be orphaned until it expires.

use std::collections::BTreeMap;

use ferry_api::crd::{BrokerConnection, ForwarderPods, GroupReplicas};
use k8s_openapi::ByteString;
use k8s_openapi::api::apps::v1::{StatefulSet, StatefulSetSpec};
use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMap, ConfigMapVolumeSource, Container, ContainerPort, EnvVar, EnvVarSource,
    HTTPGetAction, KeyToPath, LocalObjectReference, ObjectFieldSelector, PodSecurityContext,
    PodSpec, PodTemplateSpec, Probe, ResourceRequirements, SeccompProfile, Secret,
    SecretVolumeSource, SecurityContext, Service, ServicePort, ServiceSpec, Volume, VolumeMount,
};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::{Resource, ResourceExt};
use sha2::{Digest, Sha256};

use crate::image::ForwarderImage;
use crate::render::{
    CREDENTIALS_DIR, ENV_POD_NAME, ENV_POD_NAMESPACE, HTTP_PORT, KAFKA_TLS_DIR, MQTT_TLS_DIR,
    REGISTRY_TLS_DIR, Rendered, hex,
};

pub const CONFIG_DIR: &str = "/etc/ferry/config";
/// The ConfigMap's one key: the forwarder config.
pub const CONFIG_FILE: &str = "config.yaml";
pub const LABEL_CONNECTION: &str = "ferry.dev/connection";
pub const LABEL_GROUP: &str = "ferry.dev/group";
/// Label selector matching every forwarder child and pod.
pub const SELECTOR: &str = "app.kubernetes.io/name=ferry-forwarder";
pub const ANNOTATION_RESTART: &str = "ferry.dev/restart-checksum";
pub const ANNOTATION_SECRETS: &str = "ferry.dev/secret-checksum";
/// The non-root user the forwarder image runs as.
const RUN_AS: i64 = 65532;
/// Requests of forwarder containers whose connection sets no `resources` (see [`resources`]).
const DEFAULT_CPU_REQUEST: &str = "50m";
const DEFAULT_MEMORY_REQUEST: &str = "64Mi";
/// Their default memory limit is this base plus twice the window's bytes (see [`resources`]).
const MEMORY_LIMIT_BASE_BYTES: u64 = 128 * MIB;
const MIB: u64 = 1024 * 1024;

pub use crate::render::keys;

/// Everything a group owns, ready for server-side apply.
#[derive(Debug, Clone)]
pub struct Children {
    pub config_map: ConfigMap,
    pub secret: Secret,
    pub stateful_set: StatefulSet,
    pub service: Service,
    pub pdb: PodDisruptionBudget,
}

/// Builds a group's children. `secret_data` is what the dereference step copied from the
/// Secrets the connection references, under the names in [`keys`]; `image` is the
/// connection's (see [`ForwarderImage::for_connection`]).
pub fn build(
    connection: &BrokerConnection,
    group: &str,
    rendered: &Rendered,
    secret_data: BTreeMap<String, ByteString>,
    image: &ForwarderImage,
) -> Children {
    let name = rendered.workload.clone();
    let labels = labels(connection, group, &name);
    let meta = ObjectMeta {
        name: Some(name.clone()),
        namespace: connection.namespace(),
        labels: Some(labels.clone()),
        owner_references: owner(connection).map(|o| vec![o]),
        ..ObjectMeta::default()
    };
    let config_map = ConfigMap {
        metadata: meta.clone(),
        data: Some(BTreeMap::from([(
            CONFIG_FILE.to_owned(),
            rendered.config_yaml.clone(),
        )])),
        ..ConfigMap::default()
    };
    let secret_checksum = checksum(&secret_data);
    let secret = Secret {
        metadata: meta.clone(),
        data: Some(secret_data.clone()),
        type_: Some("Opaque".to_owned()),
        ..Secret::default()
    };
    let selector = LabelSelector {
        match_labels: Some(selector_labels(connection, group)),
        ..LabelSelector::default()
    };
    let pods = &connection.spec.forwarder;
    let stateful_set = StatefulSet {
        metadata: meta.clone(),
        spec: Some(StatefulSetSpec {
            replicas: replicas(rendered, pods, group),
            service_name: Some(name.clone()),
            // Replicas are independent (shared subscription); no need to start them in order.
            pod_management_policy: Some("Parallel".to_owned()),
            selector: selector.clone(),
            template: pod_template(
                &name,
                labels.clone(),
                pods,
                image,
                rendered,
                &secret_data,
                secret_checksum,
            ),
            ..StatefulSetSpec::default()
        }),
        ..StatefulSet::default()
    };
    Children {
        config_map,
        secret,
        stateful_set,
        service: headless_service(meta.clone(), &selector),
        pdb: disruption_budget(meta, selector),
    }
}

/// The StatefulSet's replicas while a scale-down waits for its leaving pods to drain (see
/// [`crate::handover`]).
pub fn set_replicas(children: &mut Children, replicas: i32) {
    if let Some(spec) = children.stateful_set.spec.as_mut() {
        spec.replicas = Some(replicas);
    }
}

/// The StatefulSet's replicas: none (left to an autoscaler) for an autoscaled group. Every rule
/// paused or refused: no pods (a forwarder refuses a config without rules), and the persistent
/// sessions keep the messages until a rule is back.
pub fn replicas(rendered: &Rendered, pods: &ForwarderPods, group: &str) -> Option<i32> {
    if rendered.config.rules.is_empty() {
        return Some(0);
    }
    match pods.replicas_of(group) {
        GroupReplicas::Fixed(n) => Some(n),
        GroupReplicas::Autoscaled => None,
    }
}

/// The StatefulSet's governing Service: no cluster IP, the pods' `http` port.
fn headless_service(meta: ObjectMeta, selector: &LabelSelector) -> Service {
    Service {
        metadata: meta,
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".to_owned()),
            selector: selector.match_labels.clone(),
            ports: Some(vec![ServicePort {
                name: Some("http".to_owned()),
                port: i32::from(HTTP_PORT),
                target_port: Some(IntOrString::String("http".to_owned())),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    }
}

fn disruption_budget(meta: ObjectMeta, selector: LabelSelector) -> PodDisruptionBudget {
    PodDisruptionBudget {
        metadata: meta,
        spec: Some(PodDisruptionBudgetSpec {
            // One forwarder at a time may be drained; its session waits for it meanwhile.
            max_unavailable: Some(IntOrString::Int(1)),
            selector: Some(selector),
            ..PodDisruptionBudgetSpec::default()
        }),
        ..PodDisruptionBudget::default()
    }
}

fn pod_template(
    name: &str,
    labels: BTreeMap<String, String>,
    pods: &ForwarderPods,
    image: &ForwarderImage,
    rendered: &Rendered,
    secret_data: &BTreeMap<String, ByteString>,
    secret_checksum: String,
) -> PodTemplateSpec {
    let mut annotations = pods.pod_annotations.clone();
    annotations.insert(
        ANNOTATION_RESTART.to_owned(),
        rendered.restart_checksum.clone(),
    );
    // Credentials reach the forwarder as environment variables, read at start: a rotated
    // Secret must restart the pods.
    annotations.insert(ANNOTATION_SECRETS.to_owned(), secret_checksum);
    let (volumes, mounts) = volumes(name, secret_data);
    PodTemplateSpec {
        metadata: Some(ObjectMeta {
            labels: Some(labels),
            annotations: Some(annotations),
            ..ObjectMeta::default()
        }),
        spec: Some(PodSpec {
            // The forwarder never talks to the Kubernetes API.
            automount_service_account_token: Some(false),
            // The drain bound (twice when it drains its session first) plus time to
            // disconnect.
            termination_grace_period_seconds: Some(
                i64::try_from(rendered.config.shutdown_timeout_secs).unwrap_or(30)
                    * if rendered.config.drain_on_shutdown.is_some() {
                        2
                    } else {
                        1
                    }
                    + 10,
            ),
            security_context: Some(PodSecurityContext {
                run_as_non_root: Some(true),
                run_as_user: Some(RUN_AS),
                run_as_group: Some(RUN_AS),
                fs_group: Some(RUN_AS),
                seccomp_profile: Some(SeccompProfile {
                    type_: "RuntimeDefault".to_owned(),
                    ..SeccompProfile::default()
                }),
                ..PodSecurityContext::default()
            }),
            containers: vec![container(
                pods,
                rendered.config.mqtt.max_inflight_bytes,
                image,
                (forwarder_args(&rendered.session_prefix), env()),
                mounts,
            )],
            volumes: Some(volumes),
            // Secrets of the pod's namespace: the registry credentials must exist next to the
            // connection, not in the operator's namespace.
            image_pull_secrets: (!image.pull_secrets.is_empty()).then(|| {
                image
                    .pull_secrets
                    .iter()
                    .map(|name| LocalObjectReference { name: name.clone() })
                    .collect()
            }),
            node_selector: (!pods.node_selector.is_empty()).then(|| pods.node_selector.clone()),
            tolerations: (!pods.tolerations.is_empty()).then(|| pods.tolerations.clone()),
            affinity: pods.affinity.clone(),
            ..PodSpec::default()
        }),
    }
}

/// The forwarder container: locked down, probed, its image from the connection or the
/// operator; `inflight_bytes`: its window's bytes (for its default memory limit).
fn container(
    pods: &ForwarderPods,
    inflight_bytes: u64,
    image: &ForwarderImage,
    (args, env): (Vec<String>, Vec<EnvVar>),
    mounts: Vec<VolumeMount>,
) -> Container {
    let probe = |path: &str| Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.to_owned()),
            port: IntOrString::String("http".to_owned()),
            ..HTTPGetAction::default()
        }),
        period_seconds: Some(5),
        failure_threshold: Some(3),
        ..Probe::default()
    };
    Container {
        name: "forwarder".to_owned(),
        image: Some(image.image.to_string()),
        image_pull_policy: image.pull_policy.map(|p| p.as_str().to_owned()),
        args: Some(args),
        env: Some(env),
        ports: Some(vec![ContainerPort {
            name: Some("http".to_owned()),
            container_port: i32::from(HTTP_PORT),
            ..ContainerPort::default()
        }]),
        readiness_probe: Some(probe("/readyz")),
        liveness_probe: Some(Probe {
            initial_delay_seconds: Some(10),
            ..probe("/healthz")
        }),
        resources: Some(resources(pods, inflight_bytes)),
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            read_only_root_filesystem: Some(true),
            run_as_non_root: Some(true),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".to_owned()]),
                ..Capabilities::default()
            }),
            ..SecurityContext::default()
        }),
        volume_mounts: Some(mounts),
        ..Container::default()
    }
}

/// The connection's `spec.forwarder.resources` (replacing all of this), else requests and a
/// memory limit. A forwarder peaks at about 25 MiB resident under load (docs/performance.md)
/// and a few millicores at rest, so 50m and 64Mi schedule it as Burstable (BestEffort pods are
/// evicted first under node pressure) without reserving much.
///
/// The memory limit is safe because a forwarder's messages are bounded in bytes:
/// `inflight_bytes` (`mqtt.max_inflight_bytes`) bounds the window, and librdkafka's queue by
/// the same, so they hold at most twice it; the rest is the forwarder itself, about 55 MiB at
/// 10,000 rules (docs/performance.md), within the limit's base of 128 MiB. So the limit,
/// 128 MiB plus twice the budget, stops a leak before it presses the node, not a forwarder
/// doing its work. No CPU limit: a throttled forwarder stalls every rule of its group.
fn resources(pods: &ForwarderPods, inflight_bytes: u64) -> ResourceRequirements {
    pods.resources
        .clone()
        .unwrap_or_else(|| ResourceRequirements {
            requests: Some(BTreeMap::from([
                ("cpu".to_owned(), Quantity(DEFAULT_CPU_REQUEST.to_owned())),
                (
                    "memory".to_owned(),
                    Quantity(DEFAULT_MEMORY_REQUEST.to_owned()),
                ),
            ])),
            limits: Some(BTreeMap::from([(
                "memory".to_owned(),
                memory_limit(inflight_bytes),
            )])),
            ..ResourceRequirements::default()
        })
}

/// 128 MiB plus twice `inflight_bytes`, in Mi rounded up.
fn memory_limit(inflight_bytes: u64) -> Quantity {
    let bytes = inflight_bytes
        .saturating_mul(2)
        .saturating_add(MEMORY_LIMIT_BASE_BYTES);
    Quantity(format!("{}Mi", bytes.div_ceil(MIB)))
}

/// The forwarder's command line: the config read as written (it is rendered from user data,
/// never a template), and the pod's own client id, unique per pod and stable across its
/// restarts (a StatefulSet's ordinal names), so each replica resumes its own persistent
/// session. Kubernetes expands `$(VAR)` from [`env`].
fn forwarder_args(sessions: &crate::sessions::SessionPrefix) -> Vec<String> {
    vec![
        "--config".to_owned(),
        format!("{CONFIG_DIR}/{CONFIG_FILE}"),
        "--no-env-substitution".to_owned(),
        "--mqtt-client-id".to_owned(),
        sessions.client_id_arg(),
    ]
}

/// The pod's identity from the downward API (its client id).
fn env() -> Vec<EnvVar> {
    vec![
        field_env(ENV_POD_NAME, "metadata.name"),
        field_env(ENV_POD_NAMESPACE, "metadata.namespace"),
    ]
}

/// The config directory, a directory per broker with the certificates the group's Secret holds,
/// and one with its credentials.
fn volumes(
    name: &str,
    secret_data: &BTreeMap<String, ByteString>,
) -> (Vec<Volume>, Vec<VolumeMount>) {
    let mut volumes = vec![Volume {
        name: "config".to_owned(),
        // A directory mount (not subPath), so the kubelet's symlink swap reaches the running
        // forwarder and rule changes reload live.
        config_map: Some(ConfigMapVolumeSource {
            name: name.to_owned(),
            ..ConfigMapVolumeSource::default()
        }),
        ..Volume::default()
    }];
    let mut mounts = vec![read_only_mount("config", CONFIG_DIR)];
    for (volume, dir, files) in [
        (
            "mqtt-tls",
            MQTT_TLS_DIR,
            &[keys::MQTT_CA, keys::MQTT_CERT, keys::MQTT_KEY][..],
        ),
        (
            "kafka-tls",
            KAFKA_TLS_DIR,
            &[keys::KAFKA_CA, keys::KAFKA_CERT, keys::KAFKA_KEY][..],
        ),
        (
            "registry-tls",
            REGISTRY_TLS_DIR,
            &[keys::REGISTRY_CA, keys::REGISTRY_CERT, keys::REGISTRY_KEY][..],
        ),
        (
            "credentials",
            CREDENTIALS_DIR,
            &[
                keys::MQTT_USERNAME,
                keys::MQTT_PASSWORD,
                keys::KAFKA_USERNAME,
                keys::KAFKA_PASSWORD,
                keys::REGISTRY_USERNAME,
                keys::REGISTRY_PASSWORD,
            ][..],
        ),
    ] {
        let items: Vec<KeyToPath> = files
            .iter()
            .filter(|k| secret_data.contains_key(**k))
            .map(|k| KeyToPath {
                key: (*k).to_owned(),
                path: file_name(dir, k).to_owned(),
                mode: None,
            })
            .collect();
        if items.is_empty() {
            continue;
        }
        volumes.push(Volume {
            name: volume.to_owned(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(name.to_owned()),
                items: Some(items),
                default_mode: Some(0o440),
                ..SecretVolumeSource::default()
            }),
            ..Volume::default()
        });
        mounts.push(read_only_mount(volume, dir));
    }
    (volumes, mounts)
}

/// The file a key of the group's Secret becomes in its directory: `mqtt-ca.crt` → `ca.crt`, the
/// names the rendered config points at; credentials share one directory and keep their key.
fn file_name<'a>(dir: &str, key: &'a str) -> &'a str {
    if dir == CREDENTIALS_DIR {
        return key;
    }
    key.split_once('-').map_or(key, |(_, file)| file)
}

fn field_env(name: &str, path: &str) -> EnvVar {
    EnvVar {
        name: name.to_owned(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: path.to_owned(),
                ..ObjectFieldSelector::default()
            }),
            ..EnvVarSource::default()
        }),
        ..EnvVar::default()
    }
}

fn read_only_mount(name: &str, path: &str) -> VolumeMount {
    VolumeMount {
        name: name.to_owned(),
        mount_path: path.to_owned(),
        read_only: Some(true),
        ..VolumeMount::default()
    }
}

/// The labels that select a group's pods (stable: never include anything that changes).
pub fn selector_labels(connection: &BrokerConnection, group: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (
            "app.kubernetes.io/name".to_owned(),
            "ferry-forwarder".to_owned(),
        ),
        (LABEL_CONNECTION.to_owned(), connection.name_any()),
        (LABEL_GROUP.to_owned(), group.to_owned()),
    ])
}

/// Every child carries these; the operator finds (and prunes) its children by them.
pub fn labels(connection: &BrokerConnection, group: &str, name: &str) -> BTreeMap<String, String> {
    let mut l = selector_labels(connection, group);
    l.insert("app.kubernetes.io/instance".to_owned(), name.to_owned());
    l.insert(
        "app.kubernetes.io/managed-by".to_owned(),
        "ferry-operator".to_owned(),
    );
    l
}

/// Owned by the connection: deleting it deletes every group's children (garbage collector).
fn owner(connection: &BrokerConnection) -> Option<OwnerReference> {
    let mut o = connection.controller_owner_ref(&())?;
    o.block_owner_deletion = Some(true);
    Some(o)
}

fn checksum(data: &BTreeMap<String, ByteString>) -> String {
    let mut h = Sha256::new();
    for (k, v) in data {
        h.update(k.as_bytes());
        h.update([0]);
        h.update(&v.0);
        h.update([0]);
    }
    hex(&h.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::render::{Group, render};
    use ferry_api::crd::{ForwardingRule, ImagePullPolicy, LocalRef};

    fn fixture() -> (BrokerConnection, Vec<ForwardingRule>) {
        let conn: BrokerConnection = serde_saphyr::from_str(
            r#"
apiVersion: ferry.dev/v1alpha1
kind: BrokerConnection
metadata: { name: plant, namespace: factory, uid: 3f1c2d9e-0000-4000-8000-000000000001 }
spec:
  mqtt:
    host: mqtt.factory.svc
    tls: { caSecretRef: { name: mqtt-ca, key: ca.crt } }
    credentialsSecretRef: { name: mqtt-credentials }
  kafka:
    bootstrapServers: ["kafka:9092"]
  forwarder: { replicas: 2, podAnnotations: { team: iot } }
"#,
        )
        .expect("connection");
        let rule: ForwardingRule = serde_saphyr::from_str(
            r#"
apiVersion: ferry.dev/v1alpha1
kind: ForwardingRule
metadata: { name: telemetry, namespace: factory }
spec:
  connectionRef: { name: plant }
  mqtt: { topics: ["plant/+/telemetry"] }
  kafka: { topic: telemetry }
"#,
        )
        .expect("rule");
        (conn, vec![rule])
    }

    fn secrets(password: &str) -> BTreeMap<String, ByteString> {
        BTreeMap::from([
            (
                keys::MQTT_USERNAME.to_owned(),
                ByteString(b"ferry".to_vec()),
            ),
            (
                keys::MQTT_PASSWORD.to_owned(),
                ByteString(password.as_bytes().to_vec()),
            ),
            (keys::MQTT_CA.to_owned(), ByteString(b"-----BEGIN".to_vec())),
        ])
    }

    fn build_fixture(password: &str) -> Children {
        let (conn, rules) = fixture();
        let rendered = render(&Group {
            connection: &conn,
            name: "default",
            rules: rules.iter().collect(),
        })
        .expect("render");
        build(
            &conn,
            "default",
            &rendered,
            secrets(password),
            &ForwarderImage::default(),
        )
    }

    /// The forwarder pod spec of `conn` with the operator started with `flags`.
    fn pod_with(conn: &BrokerConnection, flags: &[&str]) -> PodSpec {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Operator {
            #[command(flatten)]
            image: ForwarderImage,
        }
        let operator = Operator::try_parse_from(
            std::iter::once("ferry-operator").chain(flags.iter().copied()),
        )
        .unwrap_or_else(|e| panic!("{flags:?}: {e}"));
        let image = operator
            .image
            .for_connection(&conn.spec.forwarder)
            .expect("a valid override");
        let (_, rules) = fixture();
        let rendered = render(&Group {
            connection: conn,
            name: "default",
            rules: rules.iter().collect(),
        })
        .expect("render");
        build(conn, "default", &rendered, secrets("pw"), &image)
            .stateful_set
            .spec
            .and_then(|s| s.template.spec)
            .expect("pod spec")
    }

    /// (image, imagePullPolicy, imagePullSecrets) of the forwarder pods.
    fn image_of(pod: &PodSpec) -> (String, Option<String>, Vec<String>) {
        let container = &pod.containers[0];
        (
            container.image.clone().unwrap_or_default(),
            container.image_pull_policy.clone(),
            pod.image_pull_secrets
                .iter()
                .flatten()
                .map(|s| s.name.clone())
                .collect(),
        )
    }

    #[test]
    fn the_forwarder_pods_are_locked_down_and_probed() {
        let c = build_fixture("pw1");
        let sts = c.stateful_set.spec.expect("spec");
        assert_eq!(sts.replicas, Some(2));
        assert_eq!(sts.service_name.as_deref(), Some("plant-default"));
        let pod = sts.template.spec.expect("pod spec");
        assert_eq!(pod.automount_service_account_token, Some(false));
        assert_eq!(
            pod.security_context
                .as_ref()
                .and_then(|s| s.run_as_non_root),
            Some(true)
        );
        let container = &pod.containers[0];
        let sc = container
            .security_context
            .as_ref()
            .expect("container security");
        assert_eq!(sc.read_only_root_filesystem, Some(true));
        assert_eq!(sc.allow_privilege_escalation, Some(false));
        assert_eq!(
            sc.capabilities.as_ref().and_then(|c| c.drop.clone()),
            Some(vec!["ALL".to_string()])
        );
        let path = |p: &Option<Probe>| {
            p.as_ref()
                .and_then(|p| p.http_get.as_ref())
                .and_then(|h| h.path.clone())
        };
        assert_eq!(path(&container.readiness_probe).as_deref(), Some("/readyz"));
        assert_eq!(path(&container.liveness_probe).as_deref(), Some("/healthz"));
        let env: Vec<&str> = container
            .env
            .iter()
            .flatten()
            .map(|e| e.name.as_str())
            .collect();
        assert_eq!(
            env,
            vec!["POD_NAME", "POD_NAMESPACE"],
            "credentials are files, never environment variables"
        );
        assert_eq!(
            container.args.as_deref().unwrap_or_default(),
            [
                "--config",
                "/etc/ferry/config/config.yaml",
                "--no-env-substitution",
                "--mqtt-client-id",
                "ferry.factory.3f1c2d9e.$(POD_NAME)"
            ],
            "the config is read as written; each pod has its own client id"
        );
        let files = |volume: &str| -> Vec<(String, String)> {
            let v = pod.volumes.iter().flatten().find(|v| v.name == volume);
            let items = v
                .and_then(|v| v.secret.as_ref())
                .and_then(|s| s.items.clone());
            let items = items.unwrap_or_else(|| panic!("volume {volume} with items"));
            items.into_iter().map(|i| (i.key, i.path)).collect()
        };
        assert_eq!(
            files("mqtt-tls"),
            [("mqtt-ca.crt".to_owned(), "ca.crt".to_owned())],
            "where the rendered config looks"
        );
        assert_eq!(
            files("credentials"),
            [
                ("mqtt-username".to_owned(), "mqtt-username".to_owned()),
                ("mqtt-password".to_owned(), "mqtt-password".to_owned())
            ],
            "the paths render::credential_file gives the config"
        );
        let mounts = container.volume_mounts.iter().flatten();
        let credentials = mounts
            .filter(|m| m.name == "credentials")
            .collect::<Vec<_>>();
        assert_eq!(credentials.len(), 1);
        assert_eq!(credentials[0].mount_path, CREDENTIALS_DIR);
        assert_eq!(credentials[0].read_only, Some(true));
        assert!(pod.volumes.iter().flatten().all(|v| v.name != "kafka-tls"));
        let annotations = sts
            .template
            .metadata
            .and_then(|m| m.annotations)
            .expect("annotations");
        assert_eq!(annotations.get("team").map(String::as_str), Some("iot"));
        assert!(annotations.contains_key(ANNOTATION_RESTART));
    }

    #[test]
    fn the_schema_registrys_certificate_and_credentials_are_files_the_config_points_at() {
        let (mut conn, mut rules) = fixture();
        rules[0].spec.kafka.value = Some(ferry_api::crd::ValueFormat {
            format: ferry_api::crd::ValueFormatKind::Avro,
            subject: Some("readings-value".into()),
            subject_name_strategy: ferry_api::crd::SubjectNameStrategy::TopicName,
            record_name: None,
            version: None,
            message: None,
        });
        conn.spec.schema_registry = Some(ferry_api::crd::SchemaRegistryEndpoint {
            url: "https://registry.kafka:8081".into(),
            tls: Some(ferry_api::crd::TlsRefs {
                ca_secret_ref: Some(ferry_api::crd::SecretKeyRef {
                    name: "registry-ca".into(),
                    key: "ca.crt".into(),
                }),
                ..Default::default()
            }),
            credentials_secret_ref: Some(ferry_api::crd::CredentialsRef {
                name: "registry-credentials".into(),
                username: None,
                username_key: "username".into(),
                password_key: "password".into(),
            }),
        });
        let rendered = render(&Group {
            connection: &conn,
            name: "default",
            rules: rules.iter().collect(),
        })
        .expect("render");
        let mut data = secrets("pw");
        for key in [
            keys::REGISTRY_CA,
            keys::REGISTRY_USERNAME,
            keys::REGISTRY_PASSWORD,
        ] {
            data.insert(key.to_owned(), ByteString(b"x".to_vec()));
        }
        let children = build(
            &conn,
            "default",
            &rendered,
            data,
            &ForwarderImage::default(),
        );
        let pod = children
            .stateful_set
            .spec
            .and_then(|s| s.template.spec)
            .expect("pod spec");
        let mounted: Vec<String> = pod
            .volumes
            .iter()
            .flatten()
            .flat_map(|v| {
                let dir = pod.containers[0]
                    .volume_mounts
                    .iter()
                    .flatten()
                    .find(|m| m.name == v.name)
                    .map(|m| m.mount_path.clone())
                    .unwrap_or_default();
                v.secret
                    .iter()
                    .flat_map(|s| s.items.iter().flatten())
                    .map(move |i| format!("{dir}/{}", i.path))
                    .collect::<Vec<_>>()
            })
            .collect();
        let registry = rendered.config.schema_registry.as_ref().expect("rendered");
        let ca = registry.tls.as_ref().and_then(|t| t.ca_file.clone());
        let auth = registry.basic_auth.as_ref().expect("basic auth");
        for file in [ca, auth.username_file.clone(), auth.password_file.clone()] {
            let file = file.expect("a file");
            assert!(
                mounted.contains(&file),
                "{file} is not mounted: {mounted:?}"
            );
        }
        assert!(
            auth.password.is_empty(),
            "the password is a file, never inline"
        );
    }

    #[test]
    fn the_forwarder_image_is_the_operators_build_then_its_flags_then_the_connections() {
        let (mut conn, _) = fixture();
        let version = env!("CARGO_PKG_VERSION");
        assert_eq!(
            image_of(&pod_with(&conn, &[])),
            (
                format!("ghcr.io/ferry-dev/ferry-forwarder:{version}"),
                None,
                vec![]
            ),
            "no flag, no override: the published build matching the operator; pulls as \
             Kubernetes does"
        );
        let flags = [
            "--forwarder-image",
            "registry.example.com:5000/team/ferry-forwarder",
            "--forwarder-image-pull-policy",
            "Always",
            "--forwarder-image-pull-secrets",
            "regcred,team-cred",
        ];
        assert_eq!(
            image_of(&pod_with(&conn, &flags)),
            (
                format!("registry.example.com:5000/team/ferry-forwarder:{version}"),
                Some("Always".to_owned()),
                vec!["regcred".to_owned(), "team-cred".to_owned()]
            ),
            "the operator's flags; its version is the tag of a reference without one"
        );

        let digest = format!("sha256:{}", "ab".repeat(32));
        conn.spec.forwarder.image = Some(format!("mirror.example/iot/ferry-forwarder@{digest}"));
        assert_eq!(
            image_of(&pod_with(&conn, &flags)),
            (
                format!("mirror.example/iot/ferry-forwarder@{digest}"),
                Some("Always".to_owned()),
                vec!["regcred".to_owned(), "team-cred".to_owned()]
            ),
            "the connection's image wins; what it leaves unset stays the operator's"
        );
        conn.spec.forwarder.image_pull_policy = Some(ImagePullPolicy::IfNotPresent);
        conn.spec.forwarder.image_pull_secrets = Some(vec![LocalRef {
            name: "mirror-cred".to_owned(),
        }]);
        assert_eq!(
            image_of(&pod_with(&conn, &flags)),
            (
                format!("mirror.example/iot/ferry-forwarder@{digest}"),
                Some("IfNotPresent".to_owned()),
                vec!["mirror-cred".to_owned()]
            ),
            "every field the connection sets wins"
        );
        conn.spec.forwarder.image_pull_secrets = Some(vec![]);
        assert_eq!(
            image_of(&pod_with(&conn, &flags)).2,
            Vec::<String>::new(),
            "an empty list means no pull secrets"
        );

        // One stored before the CRD had its rule: named, not rendered.
        conn.spec.forwarder.image = Some("Ferry Forwarder".to_owned());
        let refused = ForwarderImage::default()
            .for_connection(&conn.spec.forwarder)
            .map_err(|e| e.to_string());
        assert_eq!(
            refused.err().as_deref(),
            Some(
                "spec.forwarder.image: the repository \"Ferry Forwarder\" must be lower-case \
                 letters and digits in '/'-separated parts, each part joined only by '.', '_', \
                 '__' or '-' (and not starting or ending with one)"
            )
        );
    }

    #[test]
    fn children_are_owned_by_the_connection_and_labelled_for_pruning() {
        let c = build_fixture("pw1");
        for meta in [
            &c.config_map.metadata,
            &c.secret.metadata,
            &c.stateful_set.metadata,
            &c.service.metadata,
            &c.pdb.metadata,
        ] {
            assert_eq!(meta.name.as_deref(), Some("plant-default"));
            let owner = &meta.owner_references.as_ref().expect("owner")[0];
            assert_eq!(
                (owner.kind.as_str(), owner.name.as_str()),
                ("BrokerConnection", "plant")
            );
            assert_eq!(owner.controller, Some(true));
            let labels = meta.labels.as_ref().expect("labels");
            assert_eq!(labels.get(LABEL_GROUP).map(String::as_str), Some("default"));
        }
        assert_eq!(
            c.service.spec.and_then(|s| s.cluster_ip).as_deref(),
            Some("None")
        );
        assert!(c.config_map.data.expect("data")["config.yaml"].contains("plant/+/telemetry"));
    }

    #[test]
    fn a_rotated_secret_changes_the_pod_template_but_not_the_restart_checksum() {
        let checksum = |c: &Children| {
            c.stateful_set
                .spec
                .as_ref()
                .and_then(|s| s.template.metadata.as_ref())
                .and_then(|m| m.annotations.clone())
                .expect("annotations")
        };
        let a = checksum(&build_fixture("pw1"));
        let b = checksum(&build_fixture("pw2"));
        assert_ne!(a[ANNOTATION_SECRETS], b[ANNOTATION_SECRETS]);
        assert_eq!(a[ANNOTATION_RESTART], b[ANNOTATION_RESTART]);
        let text = format!("{:?}", build_fixture("hunter2").stateful_set);
        assert!(
            !text.contains("hunter2"),
            "the password lives only in the Secret"
        );
    }

    #[test]
    fn forwarder_pods_request_cpu_and_memory_and_limit_memory_by_the_window_by_default() {
        let (mut conn, _) = fixture();
        let resources = |pod: &PodSpec| pod.containers[0].resources.clone().expect("resources");
        let default = resources(&pod_with(&conn, &[]));
        let requests = default.requests.expect("requests");
        assert_eq!(requests["cpu"], Quantity("50m".into()));
        assert_eq!(requests["memory"], Quantity("64Mi".into()));
        assert_eq!(
            default.limits,
            Some(BTreeMap::from([(
                "memory".to_owned(),
                Quantity("160Mi".into())
            )])),
            "128 MiB and twice the default 16 MiB window; no CPU limit to throttle a forwarder"
        );
        // From the connection's window: 128 MiB + 2 × 1,000,000 bytes = 129.9 MiB, rounded up.
        let limit = |conn: &BrokerConnection| {
            resources(&pod_with(conn, &[])).limits.expect("limits")["memory"].clone()
        };
        let mut window = conn.clone();
        window.spec.mqtt.max_inflight_bytes = 1_000_000;
        assert_eq!(limit(&window), Quantity("130Mi".into()));
        window.spec.mqtt.max_inflight_bytes = 64 * 1024 * 1024;
        assert_eq!(limit(&window), Quantity("256Mi".into()));
        assert_eq!(
            memory_limit(u64::MAX),
            Quantity(format!("{}Mi", u64::MAX.div_ceil(MIB))),
            "saturates"
        );

        let own = ResourceRequirements {
            requests: Some(BTreeMap::from([(
                "memory".into(),
                Quantity("256Mi".into()),
            )])),
            limits: Some(BTreeMap::from([(
                "memory".into(),
                Quantity("512Mi".into()),
            )])),
            ..ResourceRequirements::default()
        };
        conn.spec.forwarder.resources = Some(own.clone());
        assert_eq!(
            resources(&pod_with(&conn, &[])),
            own,
            "replaced, not merged"
        );
    }
}
