//! Which namespaces the operator sees: every namespace (cluster-wide watches, which need a
//! ClusterRole), or only those of `--watch-namespaces`, which a Role in each of them is enough
//! for. Every Api the operator lists or watches with comes from [`Scope::apis`].
//!
//! kube-runtime has no multi-namespace watcher, so in namespace mode each namespace has its own
//! watcher and their streams are merged. A store cannot be fed the merged events as they come:
//! a watcher's `Init`/`InitDone` (its first list, and every re-list after a watch gap) replace
//! the whole store, which would drop the other namespaces' objects. [`Scope::reflect`] merges
//! them the way a single watcher of those namespaces would behave.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt;

use futures::stream::BoxStream;
use futures::{StreamExt, stream};
use k8s_openapi::NamespaceResourceScope;
use kube::api::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::reflector::{Store, store::Writer};
use kube::runtime::watcher::{self, Event};
use kube::{Client, Resource};
use serde::de::DeserializeOwned;

/// Longest namespace name (a DNS label).
const MAX_NAMESPACE: usize = 63;

/// The namespaces the operator watches.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Scope {
    /// Every namespace.
    #[default]
    Cluster,
    /// Only these (never empty).
    Namespaces(BTreeSet<String>),
}

/// What an object in scope needs from its type: namespaced, readable, shareable by a store.
pub trait Watched:
    Resource<DynamicType = (), Scope = NamespaceResourceScope>
    + Clone
    + DeserializeOwned
    + fmt::Debug
    + Send
    + Sync
    + 'static
{
}

impl<K> Watched for K where
    K: Resource<DynamicType = (), Scope = NamespaceResourceScope>
        + Clone
        + DeserializeOwned
        + fmt::Debug
        + Send
        + Sync
        + 'static
{
}

type Events<K> = BoxStream<'static, watcher::Result<Event<K>>>;

impl Scope {
    /// `--watch-namespaces`: namespace names separated by ','; empty means every namespace.
    pub fn parse(value: &str) -> Result<Self, String> {
        if value.trim().is_empty() {
            return Ok(Scope::Cluster);
        }
        let mut names = BTreeSet::new();
        for name in value.split(',').map(str::trim) {
            if !is_namespace_name(name) {
                return Err(format!(
                    "{name:?} is not a namespace name: 1 to {MAX_NAMESPACE} lower-case letters, \
                     digits and '-', starting and ending with a letter or digit (names are \
                     separated by ','; an empty value watches every namespace)"
                ));
            }
            names.insert(name.to_owned());
        }
        Ok(Scope::Namespaces(names))
    }

    /// The Apis to list or watch `K` with: one cluster-wide, or one per watched namespace.
    pub fn apis<K: Watched>(&self, client: &Client) -> Vec<Api<K>> {
        match self {
            Scope::Cluster => vec![Api::all(client.clone())],
            Scope::Namespaces(names) => names
                .iter()
                .map(|ns| Api::namespaced(client.clone(), ns))
                .collect(),
        }
    }

    /// The events of `K` in scope, for triggers: the namespaces' streams interleaved, each
    /// with its own `Init`/`InitDone` (which trigger streams ignore). Not for a store: see
    /// [`Scope::reflect`].
    pub fn watch<K: Watched>(&self, client: &Client, config: &watcher::Config) -> Events<K> {
        stream::select_all(
            self.apis::<K>(client)
                .into_iter()
                .map(|api| watch_one(api, config)),
        )
        .boxed()
    }

    /// The events of `K` in scope, reflected into `writer`'s store, as one watcher of all the
    /// namespaces would produce them: the store holds every namespace's objects, `InitDone`
    /// comes once, when all of them have listed, and a namespace's re-list deletes only the
    /// objects of that namespace that are gone.
    pub fn reflect<K: Watched>(
        &self,
        client: &Client,
        config: &watcher::Config,
        writer: Writer<K>,
    ) -> Events<K> {
        if let Scope::Cluster = self {
            return self.watch(client, config).reflect(writer).boxed();
        }
        let apis = self.apis::<K>(client);
        let mut merge = Merge::new(
            apis.iter()
                .filter_map(|api| api.namespace())
                .map(str::to_owned),
            writer.as_reader(),
        );
        let tagged = apis.into_iter().map(|api| {
            let ns = api.namespace().unwrap_or_default().to_owned();
            watch_one(api, config)
                .map(move |event| (ns.clone(), event))
                .boxed()
        });
        stream::select_all(tagged)
            .flat_map(move |(ns, event)| stream::iter(merge.step(&ns, event)))
            .reflect(writer)
            .boxed()
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Scope::Cluster => f.write_str("all namespaces"),
            Scope::Namespaces(names) => {
                let names: Vec<&str> = names.iter().map(String::as_str).collect();
                write!(f, "namespaces {}", names.join(", "))
            }
        }
    }
}

/// One Api's watch, retried with backoff (kube-runtime logs each failure, e.g. a namespace
/// the operator has no rights in). What no reconcile reads is dropped from every object as it
/// arrives (see [`slim`]), so stores hold only what the operator uses.
fn watch_one<K: Watched>(api: Api<K>, config: &watcher::Config) -> Events<K> {
    watcher::watcher(api, config.clone())
        .default_backoff()
        .modify(slim)
        .boxed()
}

/// The annotation `kubectl apply` keeps a whole copy of the object in.
const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

/// Drops what the operator never reads from a watched object: `managedFields` (often larger
/// than the spec, one entry per writer) and `kubectl apply`'s copy of the object. The operator
/// writes with server-side apply under its own field manager, which needs neither.
pub fn slim<K: Resource>(object: &mut K) {
    let meta = object.meta_mut();
    meta.managed_fields = None;
    if let Some(annotations) = meta.annotations.as_mut() {
        annotations.remove(LAST_APPLIED);
    }
}

/// `[a-z0-9]([-a-z0-9]*[a-z0-9])?`, at most 63 characters.
fn is_namespace_name(name: &str) -> bool {
    let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    (1..=MAX_NAMESPACE).contains(&name.len())
        && edge(name.chars().next())
        && edge(name.chars().last())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
}

/// One namespace's objects while the first lists are in.
struct Listing<K> {
    listed: bool,
    objects: BTreeMap<String, K>,
    /// A list in progress (the first, or a re-list before the others are done).
    next: Option<BTreeMap<String, K>>,
}

/// Turns several namespaces' watch events into those of one watcher (see [`Scope::reflect`]).
struct Merge<K: Watched> {
    /// The store the merged events go into, read to find what a re-list no longer has.
    store: Store<K>,
    /// Until every namespace has listed once, their objects, kept here rather than in the
    /// store's buffer, which one namespace's restarted list would clear for all of them.
    first: Option<BTreeMap<String, Listing<K>>>,
    /// Per namespace re-listing after the first lists: the names listed so far.
    relisting: HashMap<String, HashSet<String>>,
}

impl<K: Watched> Merge<K> {
    fn new(namespaces: impl IntoIterator<Item = String>, store: Store<K>) -> Self {
        let first = namespaces
            .into_iter()
            .map(|ns| {
                let listing = Listing {
                    listed: false,
                    objects: BTreeMap::new(),
                    next: None,
                };
                (ns, listing)
            })
            .collect();
        Merge {
            store,
            first: Some(first),
            relisting: HashMap::new(),
        }
    }

    /// The merged events that one namespace's `event` becomes.
    fn step(
        &mut self,
        ns: &str,
        event: watcher::Result<Event<K>>,
    ) -> Vec<watcher::Result<Event<K>>> {
        let event = match event {
            Ok(event) => event,
            Err(e) => return vec![Err(e)],
        };
        match self.first.as_mut() {
            Some(first) => {
                if let Some(listing) = first.get_mut(ns) {
                    listing.apply(event);
                }
                if first.values().all(|l| l.listed) {
                    return self.first_list_done();
                }
                Vec::new()
            }
            None => self.relist_step(ns, event),
        }
    }

    /// All namespaces listed: their objects as the one first list of the merged watch.
    fn first_list_done(&mut self) -> Vec<watcher::Result<Event<K>>> {
        let objects = self
            .first
            .take()
            .into_iter()
            .flat_map(BTreeMap::into_values)
            .flat_map(|listing| listing.objects.into_values());
        std::iter::once(Event::Init)
            .chain(objects.map(Event::InitApply))
            .chain(std::iter::once(Event::InitDone))
            .map(Ok)
            .collect()
    }

    /// After the first lists: a namespace's re-list becomes applies, then deletions of what it
    /// no longer lists in that namespace; everything else passes as it is.
    fn relist_step(&mut self, ns: &str, event: Event<K>) -> Vec<watcher::Result<Event<K>>> {
        match event {
            Event::Init => {
                self.relisting.insert(ns.to_owned(), HashSet::new());
                Vec::new()
            }
            Event::InitApply(object) => {
                self.relisting
                    .entry(ns.to_owned())
                    .or_default()
                    .insert(name(&object));
                vec![Ok(Event::Apply(object))]
            }
            Event::InitDone => {
                let listed = self.relisting.remove(ns).unwrap_or_default();
                self.store
                    .state()
                    .into_iter()
                    .filter(|o| {
                        o.meta().namespace.as_deref() == Some(ns)
                            && !listed.contains(&name(o.as_ref()))
                    })
                    .map(|o| Ok(Event::Delete((*o).clone())))
                    .collect()
            }
            event @ (Event::Apply(_) | Event::Delete(_)) => vec![Ok(event)],
        }
    }
}

impl<K: Watched> Listing<K> {
    /// What one watcher's store would do with `event`.
    fn apply(&mut self, event: Event<K>) {
        match event {
            Event::Init => self.next = Some(BTreeMap::new()),
            Event::InitApply(o) => {
                self.next.get_or_insert_default().insert(name(&o), o);
            }
            Event::InitDone => {
                self.objects = self.next.take().unwrap_or_default();
                self.listed = true;
            }
            Event::Apply(o) => {
                self.objects.insert(name(&o), o);
            }
            Event::Delete(o) => {
                self.objects.remove(&name(&o));
            }
        }
    }
}

fn name<K: Resource>(object: &K) -> String {
    object.meta().name.clone().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt;
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::ObjectMeta;
    use kube::runtime::reflector;

    fn cm(ns: &str, name: &str, version: &str) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                namespace: Some(ns.to_owned()),
                name: Some(name.to_owned()),
                resource_version: Some(version.to_owned()),
                ..ObjectMeta::default()
            },
            ..ConfigMap::default()
        }
    }

    /// A merge over `namespaces` feeding a real store; `feed` returns the events it let out.
    struct Harness {
        merge: Merge<ConfigMap>,
        writer: Writer<ConfigMap>,
        store: Store<ConfigMap>,
    }

    impl Harness {
        fn new(namespaces: &[&str]) -> Self {
            let (store, writer) = reflector::store();
            Harness {
                merge: Merge::new(namespaces.iter().map(|s| (*s).to_owned()), store.clone()),
                writer,
                store,
            }
        }

        fn feed(&mut self, ns: &str, event: Event<ConfigMap>) -> Vec<String> {
            let mut out = Vec::new();
            for e in self.merge.step(ns, Ok(event)) {
                let e = e.expect("no error");
                self.writer.apply_watcher_event(&e);
                out.push(match &e {
                    Event::Init => "Init".to_owned(),
                    Event::InitDone => "InitDone".to_owned(),
                    Event::InitApply(o) => format!("InitApply {}", key(o)),
                    Event::Apply(o) => format!("Apply {}", key(o)),
                    Event::Delete(o) => format!("Delete {}", key(o)),
                });
            }
            out
        }

        fn contents(&self) -> Vec<String> {
            let mut keys: Vec<String> = self
                .store
                .state()
                .iter()
                .map(|o| {
                    format!(
                        "{}@{}",
                        key(o),
                        o.metadata.resource_version.as_deref().unwrap_or("")
                    )
                })
                .collect();
            keys.sort();
            keys
        }
    }

    fn key(o: &ConfigMap) -> String {
        format!(
            "{}/{}",
            o.metadata.namespace.as_deref().unwrap_or(""),
            o.metadata.name.as_deref().unwrap_or("")
        )
    }

    #[test]
    fn the_flag_takes_namespace_names_or_nothing() {
        assert_eq!(Scope::parse(""), Ok(Scope::Cluster));
        assert_eq!(Scope::parse(" "), Ok(Scope::Cluster));
        assert_eq!(
            Scope::parse("plant-2, factory,plant-2"),
            Ok(Scope::Namespaces(BTreeSet::from([
                "factory".to_owned(),
                "plant-2".to_owned()
            ])))
        );
        for bad in ["Plant", "a,,b", "-a", "a-", "a_b", "a.b", &"a".repeat(64)] {
            let error = Scope::parse(bad).expect_err(bad);
            assert!(error.contains("is not a namespace name"), "{bad}: {error}");
        }
    }

    #[test]
    fn the_store_is_ready_once_every_namespace_has_listed_and_holds_them_all() {
        let mut h = Harness::new(&["a", "b"]);
        assert!(h.feed("a", Event::Init).is_empty());
        assert!(h.feed("b", Event::Init).is_empty());
        assert!(h.feed("a", Event::InitApply(cm("a", "x", "1"))).is_empty());
        assert!(h.feed("b", Event::InitApply(cm("b", "y", "1"))).is_empty());
        assert!(h.feed("a", Event::InitDone).is_empty(), "b has not listed");
        assert!(h.store.wait_until_ready().now_or_never().is_none());
        // a's changes while b still lists are kept, in order.
        h.feed("a", Event::Apply(cm("a", "x", "2")));
        h.feed("a", Event::Apply(cm("a", "z", "1")));
        h.feed("a", Event::Delete(cm("a", "z", "1")));
        // b's list restarts after an error: what it listed before is forgotten.
        h.feed("b", Event::Init);
        h.feed("b", Event::InitApply(cm("b", "w", "1")));
        let out = h.feed("b", Event::InitDone);
        assert_eq!(
            out,
            ["Init", "InitApply a/x", "InitApply b/w", "InitDone"],
            "one list of both namespaces"
        );
        assert_eq!(h.contents(), ["a/x@2", "b/w@1"]);
        assert!(h.store.wait_until_ready().now_or_never().is_some());
    }

    #[test]
    fn a_relist_of_one_namespace_deletes_only_what_is_gone_from_it() {
        let mut h = Harness::new(&["a", "b"]);
        for (ns, names) in [("a", ["x", "gone"]), ("b", ["y", "gone"])] {
            h.feed(ns, Event::Init);
            for n in names {
                h.feed(ns, Event::InitApply(cm(ns, n, "1")));
            }
            h.feed(ns, Event::InitDone);
        }
        assert_eq!(h.contents(), ["a/gone@1", "a/x@1", "b/gone@1", "b/y@1"]);
        // a's watch expired and re-lists: x changed, "gone" was deleted meanwhile.
        assert!(h.feed("a", Event::Init).is_empty());
        assert_eq!(
            h.feed("a", Event::InitApply(cm("a", "x", "3"))),
            ["Apply a/x"]
        );
        h.feed("b", Event::Apply(cm("b", "y", "2")));
        assert_eq!(h.feed("a", Event::InitDone), ["Delete a/gone"]);
        assert_eq!(h.contents(), ["a/x@3", "b/gone@1", "b/y@2"]);
    }
}
