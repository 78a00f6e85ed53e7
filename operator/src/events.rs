//! Events through the core/v1 API, with `firstTimestamp`, `lastTimestamp` and `count` set.
//!
//! kube-rs's `Recorder` writes events.k8s.io/v1 Events, whose API refuses the deprecated
//! fields those map to: their core/v1 `lastTimestamp` stays empty, so
//! `kubectl get events --sort-by=.lastTimestamp` cannot place them. Written through core/v1
//! (as client-go's recorder does), an Event carries both the old fields and the new
//! (`eventTime`, `reportingComponent`, `action`), and sorts with everyone else's.
//!
//! A repeat of the same Event (same object, type, reason, action and message) within
//! [`REPEAT_WINDOW`] patches the first one's `count` and `lastTimestamp` instead of making
//! another object.

use std::collections::HashMap;
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::api::core::v1::{Event as CoreEvent, EventSource, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, Time};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType};
use kube::{Client, ResourceExt};
use std::sync::Mutex;

/// How long a repeat counts on the first Event rather than making a new one (kube-rs's and
/// client-go's figure).
pub const REPEAT_WINDOW: Duration = Duration::from_secs(6 * 60);

/// Who writes the Events: the controller's name and this replica's.
#[derive(Debug, Clone)]
pub struct Reporter {
    pub controller: String,
    pub instance: String,
}

/// What makes two Events the same one, repeated.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    uid: Option<String>,
    namespace: Option<String>,
    name: Option<String>,
    kind: Option<String>,
    warning: bool,
    reason: String,
    action: String,
    note: Option<String>,
}

/// The Event written last for a key: its name and count, and when.
#[derive(Debug, Clone)]
struct Sent {
    name: String,
    count: i32,
    at: Timestamp,
}

/// Records Events about objects (see the module's documentation).
pub struct Recorder {
    client: Client,
    reporter: Reporter,
    sent: Mutex<HashMap<Key, Sent>>,
}

impl Recorder {
    pub fn new(client: Client, reporter: Reporter) -> Self {
        Self {
            client,
            reporter,
            sent: Mutex::new(HashMap::new()),
        }
    }

    /// Records `event` about `regarding`: a new Event, or the count of the same one sent
    /// within [`REPEAT_WINDOW`] raised.
    pub async fn publish(
        &self,
        event: &Event,
        regarding: &ObjectReference,
    ) -> Result<(), kube::Error> {
        let now = Timestamp::now();
        let key = Key {
            uid: regarding.uid.clone(),
            namespace: regarding.namespace.clone(),
            name: regarding.name.clone(),
            kind: regarding.kind.clone(),
            warning: event.type_ == EventType::Warning,
            reason: event.reason.clone(),
            action: event.action.clone(),
            note: event.note.clone(),
        };
        let ns = regarding.namespace.as_deref().unwrap_or("default");
        let api = Api::<CoreEvent>::namespaced(self.client.clone(), ns);
        let window = jiff::SignedDuration::try_from(REPEAT_WINDOW).unwrap_or_default();
        // Not held across the API calls: Events of many objects go out at once. Two identical
        // Events at the same instant may both be created; nothing is lost.
        let previous = {
            let mut sent = self.sent();
            sent.retain(|_, s| now.duration_since(s.at) < window);
            sent.get(&key).cloned()
        };
        if let Some(previous) = previous {
            let count = previous.count.saturating_add(1);
            let patch = serde_json::json!({
                "count": count,
                "lastTimestamp": Time(truncated(now)),
            });
            match api
                .patch(
                    &previous.name,
                    &PatchParams::default(),
                    &Patch::Merge(&patch),
                )
                .await
            {
                Ok(_) => {
                    let at = now;
                    self.sent().insert(
                        key,
                        Sent {
                            count,
                            at,
                            ..previous
                        },
                    );
                    return Ok(());
                }
                // Deleted meanwhile (Events expire): a new one.
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => return Err(e),
            }
        }
        let created = api
            .create(
                &PostParams::default(),
                &self.core_event(event, regarding, now),
            )
            .await?;
        let name = created.name_any();
        self.sent().insert(
            key,
            Sent {
                name,
                count: 1,
                at: now,
            },
        );
        Ok(())
    }

    fn sent(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Sent>> {
        self.sent
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A new core/v1 Event: the legacy fields and the new ones both.
    fn core_event(&self, event: &Event, regarding: &ObjectReference, now: Timestamp) -> CoreEvent {
        let object = regarding.name.as_deref().unwrap_or("object");
        CoreEvent {
            metadata: ObjectMeta {
                // Unique without a read (the client-go recorder's scheme).
                name: Some(format!("{object}.{:x}", now.as_nanosecond())),
                namespace: regarding.namespace.clone(),
                ..ObjectMeta::default()
            },
            involved_object: regarding.clone(),
            type_: Some(
                match event.type_ {
                    EventType::Normal => "Normal",
                    EventType::Warning => "Warning",
                }
                .to_owned(),
            ),
            reason: Some(event.reason.clone()),
            message: event.note.clone(),
            action: Some(event.action.clone()),
            count: Some(1),
            first_timestamp: Some(Time(truncated(now))),
            last_timestamp: Some(Time(truncated(now))),
            event_time: Some(MicroTime(now)),
            source: Some(EventSource {
                component: Some(self.reporter.controller.clone()),
                host: None,
            }),
            reporting_component: Some(self.reporter.controller.clone()),
            reporting_instance: Some(self.reporter.instance.clone()),
            related: event.secondary.clone(),
            series: None,
        }
    }
}

/// `lastTimestamp` and `firstTimestamp` hold whole seconds.
fn truncated(t: Timestamp) -> Timestamp {
    Timestamp::from_second(t.as_second()).unwrap_or(t)
}
