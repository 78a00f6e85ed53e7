//! What every loop of the operator shares: the API client, metrics, the Event recorder, the
//! connection store, the backoff bookkeeping, and the queue through which the data-plane
//! poller asks for a connection's reconcile. Also the one error type of the reconcilers.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use ferry_api::crd::{BrokerConnection, ForwardingRule};
use futures::{Stream, StreamExt};
use kube::Client;
use kube::core::DeserializeGuard;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use tokio::sync::{mpsc, watch};
use tracing::warn;

use crate::budget::WriteBudget;
use crate::events::Recorder;
use crate::image::ForwarderImage;
use crate::metrics::Metrics;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{step}: {source}")]
    Kube { step: Step, source: kube::Error },
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
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            _ if self.is_conflict() => "conflict",
            Error::Kube { step, .. } => step.as_str(),
            Error::Render(_) => "render",
            Error::NoNamespace { .. } => "invalid",
            Error::Status { .. } => "unreadable_status",
        }
    }

    /// A write refused because it was computed from an older `resourceVersion` than the
    /// apiserver's: the watch cache had not yet seen a change (often this operator's own).
    /// Reading again and recomputing is the whole remedy. Not a server-side apply conflict
    /// over who owns a field (also reason `Conflict`): that does not go away by itself.
    pub(crate) fn is_conflict(&self) -> bool {
        let Error::Kube {
            source: kube::Error::Api(status),
            ..
        } = self
        else {
            return false;
        };
        let over_fields = status
            .details
            .as_ref()
            .is_some_and(|d| d.causes.iter().any(|c| c.reason == "FieldManagerConflict"));
        status.is_conflict() && !over_fields
    }
}

/// The step of a reconcile whose Kubernetes API call failed: an error's `reason` (in the
/// metrics) and the start of its message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Reading the objects a reconcile starts from (rules, Secrets, statuses, names in use).
    Read,
    /// Applying a group's children.
    Apply,
    /// Deleting what is no longer rendered.
    Prune,
    /// Ending the MQTT sessions of forwarder pods gone for good.
    Sessions,
    /// Writing a status, or a finalizer.
    Status,
}

impl Step {
    pub fn as_str(self) -> &'static str {
        match self {
            Step::Read => "read",
            Step::Apply => "apply",
            Step::Prune => "prune",
            Step::Sessions => "sessions",
            Step::Status => "status",
        }
    }
}

impl std::fmt::Display for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let doing = match self {
            Step::Read => "reading",
            Step::Apply => "applying",
            Step::Prune => "pruning",
            Step::Sessions => "ending sessions",
            Step::Status => "writing status",
        };
        f.write_str(doing)
    }
}

/// Names the step of a failed API call.
pub(crate) trait At<T> {
    fn at(self, step: Step) -> Result<T, Error>;
}

impl<T> At<T> for Result<T, kube::Error> {
    fn at(self, step: Step) -> Result<T, Error> {
        self.map_err(|source| Error::Kube { step, source })
    }
}

pub struct Context {
    pub client: Client,
    pub metrics: Arc<Metrics>,
    pub(crate) recorder: Recorder,
    pub(crate) connections: Store<DeserializeGuard<BrokerConnection>>,
    /// True once `connections` holds the whole first list (see [`listed`]).
    pub(crate) connections_listed: watch::Receiver<bool>,
    /// Every rule in scope, as the rule loop's watch has them (managed fields dropped): what a
    /// connection's reconcile renders, rather than a list of them all each time.
    pub(crate) rules: Store<DeserializeGuard<ForwardingRule>>,
    /// True once `rules` holds the whole first list.
    pub(crate) rules_listed: watch::Receiver<bool>,
    /// The forwarder image of connections that name none (the operator's flags).
    pub(crate) forwarder_image: ForwarderImage,
    /// The NetworkPolicy each forwarder group gets, if the operator renders them.
    pub(crate) network_policy: Option<crate::netpol::ForwarderNetworkPolicy>,
    /// The status writes a second the whole operator may send (see [`crate::budget`]).
    pub(crate) budget: WriteBudget,
    /// Consecutive failures per object, for its backoff.
    pub(crate) failures: Mutex<HashMap<String, u32>>,
    /// The Kafka topics found per connection, and how often they are checked again (see
    /// [`crate::preflight`]).
    pub(crate) topics: crate::preflight::TopicCache,
    /// Groups whose scale-down waits for leaving pods to drain (so the Event is sent once).
    pub(crate) draining: Mutex<std::collections::HashSet<String>>,
    /// Connections to reconcile because the data plane changed whether one of their rules is
    /// `Ready` (a status-only change, which the watches do not treat as a trigger).
    ready_changes: mpsc::Sender<ObjectRef<DeserializeGuard<BrokerConnection>>>,
}

impl Context {
    /// The context, and the stream of connections the data-plane poller asks to reconcile
    /// (for the connection controller's `reconcile_on`).
    pub fn new(
        client: Client,
        metrics: Arc<Metrics>,
        recorder: Recorder,
        (connections, connections_listed): Listed<BrokerConnection>,
        (rules, rules_listed): Listed<ForwardingRule>,
        forwarder_image: ForwarderImage,
        budget: WriteBudget,
    ) -> (
        Context,
        impl Stream<Item = ObjectRef<DeserializeGuard<BrokerConnection>>> + Send + 'static,
    ) {
        let (ready_changes, ready_changes_rx) = mpsc::channel(READY_CHANGES_QUEUE);
        let ctx = Context {
            client,
            metrics,
            recorder,
            connections,
            connections_listed,
            rules,
            rules_listed,
            forwarder_image,
            network_policy: None,
            budget,
            failures: Mutex::new(HashMap::new()),
            topics: crate::preflight::TopicCache::new(crate::preflight::DEFAULT_INTERVAL),
            draining: Mutex::new(std::collections::HashSet::new()),
            ready_changes,
        };
        let requests = futures::stream::unfold(ready_changes_rx, |mut rx| async move {
            rx.recv().await.map(|target| (target, rx))
        });
        (ctx, requests)
    }

    /// Asks for `connection`'s reconcile: the data plane changed whether one of its rules
    /// forwards. A full queue only delays it until the next change or resync.
    pub(crate) fn data_plane_changed(&self, namespace: &str, connection: &str) {
        let target = ObjectRef::new(connection).within(namespace);
        if self.ready_changes.try_send(target).is_err() {
            warn!(connection = %connection, namespace = %namespace, "reconcile queue full: Ready waits for the next change");
        }
    }
}

/// A store, and whether it holds the whole first list (see [`listed`]).
pub type Listed<K> = (Store<DeserializeGuard<K>>, watch::Receiver<bool>);

/// Room for one poll's transitions of many rules at once.
const READY_CHANGES_QUEUE: usize = 4096;

/// The events as they are, and a flag that turns true once the store they fill holds the
/// whole first list.
///
/// Tasks other than the controller itself wait on this rather than on
/// `Store::wait_until_ready`: the store's readiness keeps one waker, so of several tasks waiting
/// at once all but one can sleep forever (it hung every rule's reconcile while the controller's
/// own applier, waiting on the same store, was woken).
pub(crate) fn listed<K>(
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

#[cfg(test)]
mod tests {
    use super::{Error, Step};
    use kube::core::Status;
    use kube::core::response::{StatusCause, StatusDetails};

    fn api(reason: &str, code: u16) -> Error {
        Error::Kube {
            step: Step::Apply,
            source: kube::Error::Api(Status::failure("refused", reason).with_code(code).boxed()),
        }
    }

    #[test]
    fn only_a_stale_write_counts_as_a_conflict() {
        let conflict = api("Conflict", 409);
        assert!(conflict.is_conflict());
        assert_eq!(conflict.reason(), "conflict");
        let field_owner = Error::Kube {
            step: Step::Apply,
            source: kube::Error::Api(
                Status::failure("Apply failed with 1 conflict", "Conflict")
                    .with_code(409)
                    .with_details(StatusDetails {
                        causes: vec![StatusCause {
                            reason: "FieldManagerConflict".into(),
                            message: "conflict with \"kubectl\"".into(),
                            field: ".spec.replicas".into(),
                        }],
                        name: "plant-default".into(),
                        group: "apps".into(),
                        kind: "statefulsets".into(),
                        uid: String::new(),
                        retry_after_seconds: 0,
                    })
                    .boxed(),
            ),
        };
        for other in [
            api("AlreadyExists", 409),
            api("Forbidden", 403),
            field_owner,
        ] {
            assert!(!other.is_conflict(), "{other}");
            assert_eq!(other.reason(), "apply", "named by its step");
        }
    }
}
