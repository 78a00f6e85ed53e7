//! A subscription tree, as MQTT brokers (Mosquitto, EMQX) route with: topic filters stored
//! level by level, so that matching a topic costs in proportion to its levels and to the
//! filters it matches, whatever the number of filters.

use std::collections::HashMap;
use std::fmt;

/// Values stored under MQTT topic filters (MQTT 5 §4.7), found by the topic names they match.
/// Nothing walks it recursively (a filter may have thousands of levels): not matching, not
/// dropping it.
pub struct FilterTree<V> {
    root: Node<V>,
}

struct Node<V> {
    exact: HashMap<Box<str>, Node<V>>,
    /// `+` at this level.
    single: Option<Box<Node<V>>>,
    /// Filters ending in `#` at this level: they match this level's topic and all below it.
    multi: Vec<V>,
    /// Filters ending at this level.
    end: Vec<V>,
}

impl<V> Default for Node<V> {
    fn default() -> Self {
        Self {
            exact: HashMap::new(),
            single: None,
            multi: Vec::new(),
            end: Vec::new(),
        }
    }
}

impl<V> Default for FilterTree<V> {
    fn default() -> Self {
        Self {
            root: Node::default(),
        }
    }
}

impl<V> Drop for FilterTree<V> {
    fn drop(&mut self) {
        let mut nodes = vec![std::mem::take(&mut self.root)];
        while let Some(mut node) = nodes.pop() {
            nodes.extend(node.exact.drain().map(|(_, child)| child));
            nodes.extend(node.single.take().map(|child| *child));
        }
    }
}

impl<V> fmt::Debug for FilterTree<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FilterTree").finish_non_exhaustive()
    }
}

impl<V: Copy> FilterTree<V> {
    /// Stores `value` under `filter`: a valid topic filter's levels, without any
    /// `$share/<group>/` prefix (a shared filter matches what its inner filter matches).
    pub fn insert(&mut self, filter: &str, value: V) {
        let mut node = &mut self.root;
        let mut levels = filter.split('/').peekable();
        while let Some(level) = levels.next() {
            node = match level {
                "#" if levels.peek().is_none() => {
                    node.multi.push(value);
                    return;
                }
                "+" => node.single.get_or_insert_with(Box::default),
                exact => node.exact.entry(Box::from(exact)).or_default(),
            };
        }
        node.end.push(value);
    }

    /// Appends to `out` the value of every filter that matches `topic` (a topic name), each
    /// once, in no particular order. A topic starting with `$` is not matched by a filter
    /// whose first level is a wildcard (§4.7.2).
    pub fn matches(&self, topic: &str, out: &mut Vec<V>) {
        // The nodes still to visit, with what remains of the topic at each (`None`: all of it
        // was matched). A stack rather than recursion: a topic may have thousands of levels.
        let mut pending: Vec<(&Node<V>, Option<&str>)> = Vec::new();
        let mut at = (&self.root, Some(topic));
        let mut wildcards = !topic.starts_with('$');
        loop {
            let (node, rest) = at;
            match rest {
                None => {
                    out.extend_from_slice(&node.end);
                    // `a/#` matches `a` too.
                    out.extend_from_slice(&node.multi);
                }
                Some(rest) => {
                    let (level, below) = match rest.split_once('/') {
                        Some((level, below)) => (level, Some(below)),
                        None => (rest, None),
                    };
                    if wildcards {
                        out.extend_from_slice(&node.multi);
                        if let Some(single) = &node.single {
                            pending.push((single, below));
                        }
                    }
                    if let Some(child) = node.exact.get(level) {
                        pending.push((child, below));
                    }
                }
            }
            wildcards = true;
            match pending.pop() {
                Some(next) => at = next,
                None => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_api::TopicFilter;
    use proptest::prelude::*;

    fn matching(filters: &[&str], topic: &str) -> Vec<usize> {
        let mut tree = FilterTree::default();
        for (i, f) in filters.iter().enumerate() {
            tree.insert(f, i);
        }
        let mut out = Vec::new();
        tree.matches(topic, &mut out);
        out.sort_unstable();
        out
    }

    #[test]
    fn wildcards_and_dollar_topics_follow_the_spec() {
        let filters = [
            "#", "+", "+/+", "a/#", "a/+", "a/b", "a/b/#", "$SYS/#", "$SYS/+", "+/b", "/", "a//b",
        ];
        let cases: &[(&str, &[usize])] = &[
            ("a", &[0, 1, 3]),
            ("a/b", &[0, 2, 3, 4, 5, 6, 9]),
            ("a/b/c", &[0, 3, 6]),
            ("a/", &[0, 2, 3, 4]),
            ("/", &[0, 2, 10]),
            ("/b", &[0, 2, 9]),
            ("a//b", &[0, 3, 11]),
            ("$SYS", &[7]),
            ("$SYS/x", &[7, 8]),
            ("$SYS/b", &[7, 8]),
            ("b", &[0, 1]),
        ];
        for (topic, want) in cases {
            assert_eq!(matching(&filters, topic), *want, "{topic}");
        }
    }

    #[test]
    fn a_topic_of_many_levels_does_not_recurse() {
        let deep = vec!["x"; 30_000].join("/");
        assert_eq!(matching(&[&deep, "#"], &deep), [0, 1]);
    }

    fn level() -> impl Strategy<Value = String> {
        prop::sample::select(vec!["a", "b", "", "$a", "$SYS", "+", "#"]).prop_map(str::to_owned)
    }

    fn filter() -> impl Strategy<Value = String> {
        prop::collection::vec(level(), 1..5).prop_filter_map("a valid filter", |levels| {
            let text = levels.join("/");
            TopicFilter::parse(&text).ok().map(|_| text)
        })
    }

    fn topic() -> impl Strategy<Value = String> {
        prop::collection::vec(prop::sample::select(vec!["a", "b", "", "$a", "$SYS"]), 1..6)
            .prop_map(|levels| levels.join("/"))
    }

    proptest! {
        /// The tree finds exactly the filters the filter-by-filter matcher says match.
        #[test]
        fn finds_what_matching_each_filter_finds(
            filters in prop::collection::vec(filter(), 0..24),
            topics in prop::collection::vec(topic(), 1..16),
        ) {
            let parsed: Vec<TopicFilter> =
                filters.iter().map(|f| TopicFilter::parse(f).expect("valid")).collect();
            let texts: Vec<&str> = filters.iter().map(String::as_str).collect();
            for topic in &topics {
                let want: Vec<usize> = parsed
                    .iter()
                    .enumerate()
                    .filter(|(_, f)| f.matches(topic))
                    .map(|(i, _)| i)
                    .collect();
                prop_assert_eq!(matching(&texts, topic), want, "topic {:?}", topic);
            }
        }
    }
}
