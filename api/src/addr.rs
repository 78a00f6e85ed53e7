//! Host names and `host:port` addresses, as the forwarder accepts them (`mqtt.host`,
//! `kafka.bootstrap_servers`). The regular expressions below are the same rules for the CRD's
//! CEL; [`HOST_VECTORS`] and [`SERVER_VECTORS`] are checked against both (the unit tests here
//! and `operator/tests/crd_validation.rs` on a real apiserver).

use std::net::Ipv6Addr;

/// A DNS name (or an IPv4 address, which has the same shape): dot-separated labels of 1–63
/// letters, digits, '-' or '_', not starting or ending with '-'. Underscores are allowed
/// because container platforms hand out such names (`my_broker`) and resolvers accept them.
pub const DNS_NAME_RE: &str = "[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?([.][A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*";

/// An IPv6 address in its text forms with hexadecimal groups (RFC 4291 §2.2 forms 1 and 2);
/// the form with an embedded IPv4 address and zone ids are not accepted.
pub const IPV6_RE: &str = "(([0-9a-fA-F]{1,4}:){7}[0-9a-fA-F]{1,4}|([0-9a-fA-F]{1,4}:){1,7}:|([0-9a-fA-F]{1,4}:){1,6}:[0-9a-fA-F]{1,4}|([0-9a-fA-F]{1,4}:){1,5}(:[0-9a-fA-F]{1,4}){1,2}|([0-9a-fA-F]{1,4}:){1,4}(:[0-9a-fA-F]{1,4}){1,3}|([0-9a-fA-F]{1,4}:){1,3}(:[0-9a-fA-F]{1,4}){1,4}|([0-9a-fA-F]{1,4}:){1,2}(:[0-9a-fA-F]{1,4}){1,5}|[0-9a-fA-F]{1,4}:(:[0-9a-fA-F]{1,4}){1,6}|:((:[0-9a-fA-F]{1,4}){1,7}|:))";

/// The longest host name (DNS) accepted.
pub const MAX_HOST_LEN: usize = 253;

/// Whether `host` is a DNS name of [`DNS_NAME_RE`], at most [`MAX_HOST_LEN`] characters.
pub fn is_dns_name(host: &str) -> bool {
    host.len() <= MAX_HOST_LEN
        && host.split('.').all(|label| {
            (1..=63).contains(&label.len())
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        })
}

/// Whether `text` is an IPv6 address of [`IPV6_RE`] (no embedded IPv4, no zone).
pub fn is_ipv6(text: &str) -> bool {
    !text.contains(['.', '%']) && text.parse::<Ipv6Addr>().is_ok()
}

/// Why `host` is not a host the forwarder can connect to (`mqtt.host`): a DNS name, an IPv4
/// address or a bare IPv6 address; no scheme, port, brackets or spaces.
pub fn host_problem(host: &str) -> Option<&'static str> {
    if host.is_empty() {
        Some("must not be empty")
    } else if is_dns_name(host) || is_ipv6(host) {
        None
    } else {
        Some(
            "is not a host name or IP address (a DNS name, an IPv4 address or an IPv6 address without brackets; no scheme, port or spaces)",
        )
    }
}

/// Why `server` is not `host:port` (one of `kafka.bootstrap_servers`): a DNS name or IPv4
/// address, or an IPv6 address in brackets, then a port from 1 to 65535; no scheme.
pub fn server_problem(server: &str) -> Option<&'static str> {
    let parsed = match server.strip_prefix('[') {
        Some(rest) => rest
            .split_once("]:")
            .filter(|(ip, _)| is_ipv6(ip))
            .map(|(_, port)| port),
        None => server
            .rsplit_once(':')
            .filter(|(host, _)| is_dns_name(host))
            .map(|(_, port)| port),
    };
    let Some(port) = parsed else {
        return Some(
            "is not host:port (a DNS name or IPv4 address, or an IPv6 address in brackets, then ':' and the port; no scheme)",
        );
    };
    let number = (!port.is_empty() && port.len() <= 5 && port.bytes().all(|b| b.is_ascii_digit()))
        .then(|| port.parse::<u32>().ok())
        .flatten();
    match number {
        Some(1..=65535) => None,
        _ => Some("has a port outside 1-65535"),
    }
}

/// Host names for `mqtt.host`, and whether they are accepted. Shared by the forwarder's tests
/// and the CRD's tests on a real apiserver, so both sides agree.
pub const HOST_VECTORS: &[(&str, bool)] = &[
    ("localhost", true),
    ("mqtt.example.com", true),
    ("mqtt-0.mqtt.ferry.svc.cluster.local", true),
    ("my_broker", true),
    ("10.0.0.1", true),
    ("::1", true),
    ("2001:db8::8:800:200c:417a", true),
    ("fe80::", true),
    ("", false),
    ("mqtt://broker", false),
    ("broker:1883", false),
    ("[::1]", false),
    ("bro ker", false),
    ("-broker", false),
    ("broker-", false),
    ("a..b", false),
    ("broker.", false),
    ("2001:db8::1::2", false),
    ("::ffff:10.0.0.1", false),
];

/// Entries of `kafka.bootstrap_servers`, and whether they are accepted (see [`HOST_VECTORS`]).
pub const SERVER_VECTORS: &[(&str, bool)] = &[
    ("kafka:9092", true),
    ("kafka-0.kafka.ferry.svc:9093", true),
    ("10.0.0.1:1", true),
    ("[::1]:9092", true),
    ("[2001:db8::1]:65535", true),
    ("kafka", false),
    ("kafka:", false),
    ("kafka:0", false),
    ("kafka:65536", false),
    ("kafka:+9092", false),
    ("kafka:9092x", false),
    ("::1:9092", false),
    ("[::1]", false),
    ("[kafka]:9092", false),
    ("PLAINTEXT://kafka:9092", false),
    ("kaf ka:9092", false),
    (":9092", false),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_follow_the_shared_vectors() {
        for (host, ok) in HOST_VECTORS {
            assert_eq!(host_problem(host).is_none(), *ok, "{host:?}");
        }
        assert!(host_problem(&"a".repeat(254)).is_some());
        assert!(host_problem(&"a".repeat(64)).is_some(), "a label of 64");
        assert!(host_problem(&["a".repeat(63), "b".into()].join(".")).is_none());
    }

    #[test]
    fn servers_follow_the_shared_vectors() {
        for (server, ok) in SERVER_VECTORS {
            assert_eq!(server_problem(server).is_none(), *ok, "{server:?}");
        }
    }
}
