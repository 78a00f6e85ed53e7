//! The schemas rules encode their values with, each looked up in the registry by a task of its
//! own: until one is found (registry unreachable, credentials refused, subject missing), the
//! records that need it wait, unacknowledged, and the rule says why; a version found stays in
//! use when a later lookup of `latest` fails. A reload hands each encoding over to the new
//! config's slot (records in flight follow it) and every lookup uses the registry settings of
//! the latest config.

use std::sync::{Arc, RwLock, Weak};
use std::time::Duration;

use ferry_api::config::{LATEST_SCHEMA_REFRESH_SECS, SchemaRegistry, ValueEncoding};
use tracing::{info, warn};

use crate::encode::{Encoder, RegisteredSchema};
use crate::metrics::RuleStats;
use crate::registry::{Fetched, RegistryClient, RegistryError};
use crate::window::capped_exponential;

const RETRY_MIN: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(30);

/// One encoding of the config (rules with the same `kafka.value` share it).
#[derive(Debug)]
pub struct SchemaSlot {
    pub spec: ValueEncoding,
    state: RwLock<State>,
    /// The rules encoding with it, told which schema they use.
    rules: RwLock<Vec<Arc<RuleStats>>>,
    /// The same encoding in the config that replaced this one: records routed before the
    /// reload take their schema from it, and this slot's lookup ends.
    successor: RwLock<Option<Arc<SchemaSlot>>>,
}

/// The registry client of the latest config (or why there is none), read by every lookup.
#[derive(Debug)]
pub struct RegistryCell(RwLock<Result<Arc<RegistryClient>, String>>);

impl RegistryCell {
    pub fn new(config: Option<&SchemaRegistry>) -> Arc<Self> {
        Arc::new(Self(RwLock::new(client_of(config))))
    }

    /// Takes the registry of a new config; true when it is another registry than before (its
    /// schema ids are not the old one's).
    pub fn set(&self, config: Option<&SchemaRegistry>) -> bool {
        let new = client_of(config);
        let mut cell = write(&self.0);
        let base =
            |c: &Result<Arc<RegistryClient>, String>| c.as_ref().ok().map(|c| c.base().to_owned());
        let changed = base(&cell) != base(&new);
        *cell = new;
        changed
    }

    fn get(&self) -> Result<Arc<RegistryClient>, String> {
        read(&self.0).clone()
    }
}

fn client_of(config: Option<&SchemaRegistry>) -> Result<Arc<RegistryClient>, String> {
    match config.map(RegistryClient::new) {
        Some(Ok(client)) => Ok(Arc::new(client)),
        Some(Err(e)) => Err(e.to_string()),
        // Validation refuses encodings without a registry; kept total.
        None => Err("no schema_registry is configured".to_owned()),
    }
}

#[derive(Debug, Clone)]
enum State {
    Pending {
        why: Option<String>,
    },
    Ready(Arc<Ready>),
    /// A reload left no rule encoding with it.
    Retired,
}

/// A schema found and compiled.
#[derive(Debug)]
pub struct Ready {
    pub encoder: Encoder,
    pub subject: String,
    pub version: u32,
    pub id: u32,
}

/// Why a record cannot be encoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotYet {
    /// The schema is not there yet, and why: the record waits.
    Waiting(String),
    /// No rule encodes with it any more: the record never will be.
    Retired(String),
}

impl SchemaSlot {
    pub fn new(spec: ValueEncoding) -> Arc<Self> {
        Arc::new(Self {
            spec,
            state: RwLock::new(State::Pending { why: None }),
            rules: RwLock::new(Vec::new()),
            successor: RwLock::new(None),
        })
    }

    pub fn add_rule(&self, rule: Arc<RuleStats>) {
        write(&self.rules).push(rule);
    }

    /// The schema to encode with, or why there is none yet.
    pub fn ready(&self) -> Result<Arc<Ready>, NotYet> {
        if let Some(next) = read(&self.successor).as_ref() {
            return next.ready();
        }
        match &*read(&self.state) {
            State::Ready(r) => Ok(Arc::clone(r)),
            State::Pending { why } => Err(NotYet::Waiting(why.clone().unwrap_or_else(|| {
                format!(
                    "looking up the schema of subject {:?} in the schema registry",
                    self.spec.subject
                )
            }))),
            State::Retired => Err(NotYet::Retired(format!(
                "its rule no longer encodes with subject {:?}, whose schema it waited for",
                self.spec.subject
            ))),
        }
    }

    /// Takes what `other` (the same encoding, of the config before a reload) already found,
    /// so a reload does not make its records wait for a new lookup.
    pub fn adopt(&self, other: &SchemaSlot) {
        if other.spec != self.spec {
            return;
        }
        let found = match &*read(&other.state) {
            State::Ready(r) => Arc::clone(r),
            State::Pending { .. } | State::Retired => return,
        };
        let mut state = write(&self.state);
        if matches!(*state, State::Pending { .. }) {
            self.tell_rules(&found);
            *state = State::Ready(found);
        }
    }

    /// A schema found: by the registry lookup, or given (the cost benchmark has no registry).
    pub fn set_ready(&self, found: Arc<Ready>) {
        let mut state = write(&self.state);
        if matches!(*state, State::Retired) {
            return;
        }
        self.tell_rules(&found);
        *state = State::Ready(found);
    }

    /// A failed lookup: records wait only while nothing was found before.
    fn set_failed(&self, why: String) {
        let mut state = write(&self.state);
        if let State::Pending { why: w } = &mut *state {
            *w = Some(why);
        }
    }

    fn shares_a_rule_with(&self, other: &SchemaSlot) -> bool {
        let theirs = read(&other.rules);
        read(&self.rules)
            .iter()
            .any(|r| theirs.iter().any(|t| t.name == r.name))
    }

    fn tell_rules(&self, found: &Ready) {
        for rule in read(&self.rules).iter() {
            rule.set_schema(Some(ferry_api::status::SchemaInUse {
                subject: found.subject.clone(),
                version: found.version,
                id: found.id,
            }));
        }
    }
}

/// Starts the lookups of `slots` (the ones of a new config), each taking over from the
/// previous config's slot of the same encoding the records waiting on it, and what it found
/// unless the registry is another one now (`same_registry` false: the schema ids found are
/// the old registry's, so everything is looked up again there). Each lookup runs while its
/// slot is in use and has no successor.
pub fn resolve(
    slots: &[Arc<SchemaSlot>],
    previous: &[Arc<SchemaSlot>],
    registry: &Arc<RegistryCell>,
    same_registry: bool,
) {
    for old in previous {
        let same = slots.iter().find(|s| s.spec == old.spec);
        if let Some(slot) = same
            && same_registry
        {
            slot.adopt(old);
        }
        // Otherwise its rules' encoding changed (a fixed subject, another version): their
        // waiting records take the new one. A slot none of whose rules encodes any more is
        // retired: its waiting records fail as their rule now says (dead letter, hold, drop).
        let next = same.or_else(|| slots.iter().find(|s| s.shares_a_rule_with(old)));
        match next {
            Some(slot) => *write(&old.successor) = Some(Arc::clone(slot)),
            None => *write(&old.state) = State::Retired,
        }
    }
    for slot in slots {
        tokio::spawn(look_up(Arc::downgrade(slot), Arc::clone(registry)));
    }
}

/// Looks the slot's schema up until found (pinned) or for as long as the slot lives
/// (`latest`, again every `LATEST_SCHEMA_REFRESH_SECS`).
async fn look_up(slot: Weak<SchemaSlot>, registry: Arc<RegistryCell>) {
    let mut failures = 0u32;
    loop {
        let Some(spec) = slot
            .upgrade()
            .filter(|s| read(&s.successor).is_none() && !matches!(*read(&s.state), State::Retired))
            .map(|s| s.spec.clone())
        else {
            return;
        };
        let result = match registry.get() {
            Ok(client) => fetch_and_compile(&client, &spec).await,
            Err(why) => Err(why),
        };
        let Some(s) = slot.upgrade() else { return };
        let wait = match result {
            Ok(found) => {
                failures = 0;
                let changed = s.ready().map_or(true, |r| r.id != found.id);
                if changed {
                    info!(
                        subject = %found.subject,
                        version = found.version,
                        id = found.id,
                        "schema in use"
                    );
                }
                s.set_ready(Arc::new(found));
                match spec.version {
                    Some(_) => return,
                    None => Duration::from_secs(LATEST_SCHEMA_REFRESH_SECS),
                }
            }
            Err(why) => {
                failures = failures.saturating_add(1);
                if failures == 1 || failures.is_multiple_of(10) {
                    warn!(subject = %spec.subject, error = %why, failures, "schema lookup failed; retrying");
                }
                s.set_failed(why);
                capped_exponential(RETRY_MIN, RETRY_MAX, failures)
            }
        };
        drop(s);
        tokio::time::sleep(wait).await;
    }
}

async fn fetch_and_compile(client: &RegistryClient, spec: &ValueEncoding) -> Result<Ready, String> {
    let fetched = client
        .fetch(&spec.subject, spec.version)
        .await
        .map_err(|e: RegistryError| e.to_string())?;
    compile(fetched, spec)
}

/// The fetched schema as an encoder of the rule's format.
pub fn compile(fetched: Fetched, spec: &ValueEncoding) -> Result<Ready, String> {
    if fetched.format != spec.format {
        return Err(format!(
            "subject {:?} version {} is a {} schema, and the rule encodes {}",
            fetched.subject,
            fetched.version,
            fetched.format.registry_type(),
            spec.format.registry_type()
        ));
    }
    let schema = RegisteredSchema {
        id: fetched.id,
        kind: fetched.format,
        text: fetched.text,
    };
    let encoder = Encoder::compile(&schema, spec.message.as_deref()).map_err(|e| {
        format!(
            "subject {:?} version {} (id {}): {e}",
            fetched.subject, fetched.version, fetched.id
        )
    })?;
    Ok(Ready {
        encoder,
        subject: fetched.subject,
        version: fetched.version,
        id: fetched.id,
    })
}

fn read<T>(lock: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn write<T>(lock: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    lock.write()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_api::config::SchemaFormat;

    fn spec(format: SchemaFormat) -> ValueEncoding {
        ValueEncoding {
            format,
            subject: "t-value".into(),
            version: None,
            message: None,
        }
    }

    fn fetched(format: SchemaFormat, id: u32, text: &str) -> Fetched {
        Fetched {
            subject: "t-value".into(),
            version: id,
            id,
            format,
            text: text.into(),
        }
    }

    const READING: &str =
        r#"{"type":"record","name":"Reading","fields":[{"name":"t","type":"double"}]}"#;

    #[test]
    fn a_slot_waits_saying_why_until_found_and_keeps_what_it_found() {
        let slot = SchemaSlot::new(spec(SchemaFormat::Avro));
        let waiting = slot.ready().err().and_then(|n| match n {
            NotYet::Waiting(why) => Some(why),
            NotYet::Retired(_) => None,
        });
        assert!(waiting.is_some_and(|w| w.contains("t-value")));
        slot.set_failed("schema registry http://r unreachable: refused".into());
        assert_eq!(
            slot.ready().err(),
            Some(NotYet::Waiting(
                "schema registry http://r unreachable: refused".into()
            ))
        );
        let found = compile(fetched(SchemaFormat::Avro, 7, READING), &slot.spec);
        slot.set_ready(Arc::new(found.unwrap_or_else(|e| panic!("{e}"))));
        // A later lookup of `latest` failing does not take the schema away.
        slot.set_failed("unreachable".into());
        assert_eq!(slot.ready().map(|r| r.id).ok(), Some(7));
        // The config after a reload takes it over at once; another encoding does not.
        let same = SchemaSlot::new(spec(SchemaFormat::Avro));
        same.adopt(&slot);
        assert_eq!(same.ready().map(|r| r.version).ok(), Some(7));
        let other = SchemaSlot::new(spec(SchemaFormat::JsonSchema));
        other.adopt(&slot);
        assert!(other.ready().is_err());
    }

    /// Polls `cond` (a spawned lookup must have run) for at most a second.
    async fn eventually(cond: impl Fn() -> bool) -> bool {
        for _ in 0..100 {
            if cond() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    }

    fn slot_of(spec: ValueEncoding, rule: &Arc<RuleStats>) -> Arc<SchemaSlot> {
        let slot = SchemaSlot::new(spec);
        slot.add_rule(Arc::clone(rule));
        slot
    }

    #[tokio::test]
    async fn records_routed_before_a_reload_follow_their_rules_new_slot_or_fail() {
        let registry = RegistryCell::new(None);
        let metrics = crate::metrics::Metrics::new();
        let rules = metrics.set_rules(&["a".to_owned(), "b".to_owned()]);
        let (a, b) = (&rules[0], &rules[1]);
        let old_a = slot_of(spec(SchemaFormat::Avro), a);
        let old_b = slot_of(spec(SchemaFormat::JsonSchema), b);
        resolve(
            &[Arc::clone(&old_a), Arc::clone(&old_b)],
            &[],
            &registry,
            true,
        );
        // Rule a's subject fixed by a reload; rule b no longer encodes.
        let fixed = ValueEncoding {
            subject: "fixed-value".into(),
            ..spec(SchemaFormat::Avro)
        };
        let new_a = slot_of(fixed, a);
        resolve(
            std::slice::from_ref(&new_a),
            &[Arc::clone(&old_a), Arc::clone(&old_b)],
            &registry,
            true,
        );
        let found = compile(fetched(SchemaFormat::Avro, 9, READING), &new_a.spec);
        new_a.set_ready(Arc::new(found.unwrap_or_else(|e| panic!("{e}"))));
        assert_eq!(
            old_a.ready().map(|r| r.id).ok(),
            Some(9),
            "a's waiting records follow"
        );
        assert!(
            matches!(old_b.ready(), Err(NotYet::Retired(why)) if why.contains("no longer encodes")),
            "b's waiting records fail as b now says"
        );
        // The same encoding after a reload takes over what was found at once.
        let same = slot_of(new_a.spec.clone(), a);
        resolve(
            std::slice::from_ref(&same),
            std::slice::from_ref(&new_a),
            &registry,
            true,
        );
        assert_eq!(same.ready().map(|r| r.id).ok(), Some(9));
        // Unless the registry is another one: its ids are not the old one's. The records
        // waiting on the old slot follow the new one, which looks the schema up again.
        let moved = slot_of(new_a.spec.clone(), a);
        resolve(
            std::slice::from_ref(&moved),
            std::slice::from_ref(&same),
            &registry,
            false,
        );
        assert!(moved.ready().is_err(), "not adopted from another registry");
        let again = compile(fetched(SchemaFormat::Avro, 21, READING), &moved.spec);
        moved.set_ready(Arc::new(again.unwrap_or_else(|e| panic!("{e}"))));
        assert_eq!(
            same.ready().map(|r| r.id).ok(),
            Some(21),
            "the waiting follow"
        );
        // Without a registry, lookups say why rather than wait silently.
        let waiting = SchemaSlot::new(spec(SchemaFormat::JsonSchema));
        resolve(std::slice::from_ref(&waiting), &[], &registry, true);
        let says = || {
            waiting.ready().err()
                == Some(NotYet::Waiting("no schema_registry is configured".into()))
        };
        assert!(eventually(says).await, "{:?}", waiting.ready());
    }

    #[test]
    fn a_registry_at_another_url_is_another_registry() {
        let at = |url: &str| SchemaRegistry {
            url: url.into(),
            tls: None,
            basic_auth: None,
        };
        let cell = RegistryCell::new(Some(&at("http://one:8081")));
        assert!(!cell.set(Some(&at("http://one:8081"))), "the same");
        assert!(cell.set(Some(&at("http://two:8081"))), "another");
        assert!(cell.set(None), "none");
    }

    #[test]
    fn a_schema_of_another_type_or_that_does_not_compile_is_refused_naming_it() {
        let e = compile(
            fetched(SchemaFormat::JsonSchema, 3, "{}"),
            &spec(SchemaFormat::Avro),
        )
        .err();
        assert_eq!(
            e.as_deref(),
            Some("subject \"t-value\" version 3 is a JSON schema, and the rule encodes AVRO")
        );
        let e = compile(
            fetched(SchemaFormat::Avro, 4, "{\"type\":\"recrd\"}"),
            &spec(SchemaFormat::Avro),
        )
        .err();
        assert!(
            e.as_deref()
                .is_some_and(|e| e.starts_with("subject \"t-value\" version 4 (id 4): ")),
            "{e:?}"
        );
    }
}
