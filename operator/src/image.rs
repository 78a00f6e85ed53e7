//! The forwarder pods' container image: the operator's defaults (its flags), a connection's
//! override (`spec.forwarder.image`, `imagePullPolicy`, `imagePullSecrets`), and the
//! validation of image references that both go through.
//!
//! A reference is `[registry[:port]/]repository[:tag][@digest]`, the grammar of the
//! distribution project that the kubelet's runtimes parse. The CRD checks the same grammar
//! with a CEL rule (a test keeps the two identical); this parser exists for the flags and to
//! say precisely what is wrong.

use std::fmt;
use std::str::FromStr;

use ferry_api::crd::{ForwarderPods, ImagePullPolicy};

/// The repository the project publishes the forwarder image to (the chart's default too).
pub const DEFAULT_FORWARDER_REPOSITORY: &str = "ghcr.io/ferry-dev/ferry-forwarder";
/// The forwarder image when neither a flag nor a connection names one: the published build
/// matching this operator.
pub const DEFAULT_FORWARDER_IMAGE: &str = concat!(
    "ghcr.io/ferry-dev/ferry-forwarder:",
    env!("CARGO_PKG_VERSION")
);
/// The tag of a reference that names neither a tag nor a digest. Not `latest`: the forwarder
/// and the config the operator renders for it must come from the same release.
pub const DEFAULT_TAG: &str = env!("CARGO_PKG_VERSION");
/// Longest `[registry/]repository`, as the distribution project allows.
const MAX_NAME: usize = 255;
const MAX_TAG: usize = 128;

/// A validated image reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRef {
    /// `[registry[:port]/]repository`.
    name: String,
    tag: Option<String>,
    /// `algorithm:hex`.
    digest: Option<String>,
}

/// What is wrong with an image reference (the caller names where it came from).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ImageRefError {
    #[error("the image reference is empty")]
    Empty,
    #[error(
        "{0:?} has no repository: expected [registry[:port]/]repository[:tag][@sha256:<digest>]"
    )]
    NoRepository(String),
    #[error(
        "the registry {0:?} is not a host name with an optional :port (letters, digits, '-' and '.')"
    )]
    Registry(String),
    #[error(
        "the repository {0:?} must be lower-case letters and digits in '/'-separated parts, each part joined only by '.', '_', '__' or '-' (and not starting or ending with one)"
    )]
    Repository(String),
    #[error(
        "the repository {name:?} is {len} characters long; a registry and repository may have at most {MAX_NAME}"
    )]
    NameTooLong { name: String, len: usize },
    #[error(
        "the tag {0:?} must be 1 to 128 letters, digits, '_', '.' or '-', not starting with '.' or '-'"
    )]
    Tag(String),
    #[error(
        "the digest {0:?} must be sha256:<64 lower-case hex digits> or sha512:<128 lower-case hex digits>"
    )]
    Digest(String),
}

impl ImageRef {
    /// The build matching this operator.
    pub fn default_forwarder() -> Self {
        Self {
            name: DEFAULT_FORWARDER_REPOSITORY.to_owned(),
            tag: Some(DEFAULT_TAG.to_owned()),
            digest: None,
        }
    }

    pub fn parse(reference: &str) -> Result<Self, ImageRefError> {
        if reference.is_empty() {
            return Err(ImageRefError::Empty);
        }
        let (rest, digest) = match reference.split_once('@') {
            Some((rest, digest)) => {
                check_digest(digest)?;
                (rest, Some(digest.to_owned()))
            }
            None => (reference, None),
        };
        // A ':' after the last '/' starts the tag; one before it is a registry's port.
        let (name, tag) = match rest.rsplit_once(':') {
            Some((name, tag)) if !tag.contains('/') => {
                check_tag(tag)?;
                (name, Some(tag.to_owned()))
            }
            _ => (rest, None),
        };
        check_name(name, reference)?;
        // Pinned to this operator's release rather than `latest`.
        let tag = match (&tag, &digest) {
            (None, None) => Some(DEFAULT_TAG.to_owned()),
            _ => tag,
        };
        Ok(Self {
            name: name.to_owned(),
            tag,
            digest,
        })
    }
}

impl FromStr for ImageRef {
    type Err = ImageRefError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl fmt::Display for ImageRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)?;
        if let Some(tag) = &self.tag {
            write!(f, ":{tag}")?;
        }
        if let Some(digest) = &self.digest {
            write!(f, "@{digest}")?;
        }
        Ok(())
    }
}

/// `[registry[:port]/]path`: the first part is a registry only if the rest still is a
/// repository path (as in the grammar: `localhost/x` and `team/x` are both fine).
fn check_name(name: &str, reference: &str) -> Result<(), ImageRefError> {
    if name.is_empty() {
        return Err(ImageRefError::NoRepository(reference.to_owned()));
    }
    if name.len() > MAX_NAME {
        return Err(ImageRefError::NameTooLong {
            name: name.to_owned(),
            len: name.len(),
        });
    }
    if is_path(name) {
        return Ok(());
    }
    let Some((registry, path)) = name.split_once('/') else {
        return Err(ImageRefError::Repository(name.to_owned()));
    };
    if is_registry(registry) && is_path(path) {
        return Ok(());
    }
    // Blame the part a human meant: the registry when the first part looks like a host.
    let looks_like_host = registry.contains(['.', ':']) || registry == "localhost";
    Err(match (looks_like_host, is_registry(registry)) {
        (true, true) => ImageRefError::Repository(path.to_owned()),
        (true, false) => ImageRefError::Registry(registry.to_owned()),
        (false, _) => ImageRefError::Repository(name.to_owned()),
    })
}

fn is_registry(registry: &str) -> bool {
    let (host, port) = match registry.split_once(':') {
        Some((host, port)) => (host, Some(port)),
        None => (registry, None),
    };
    let port_ok = port.is_none_or(|p| (1..=5).contains(&p.len()) && all(p, is_digit));
    port_ok && !host.is_empty() && host.split('.').all(is_host_label)
}

/// `[a-zA-Z0-9]([a-zA-Z0-9-]*[a-zA-Z0-9])?`
fn is_host_label(label: &str) -> bool {
    let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    edge(label.chars().next())
        && edge(label.chars().last())
        && all(label, |c| c.is_ascii_alphanumeric() || c == '-')
}

/// Path components separated by '/'.
fn is_path(path: &str) -> bool {
    path.split('/').all(is_path_component)
}

/// `[a-z0-9]+(([._]|__|-+)[a-z0-9]+)*`
fn is_path_component(component: &str) -> bool {
    let alnum = |c: char| c.is_ascii_lowercase() || is_digit(c);
    let mut separator = String::new();
    let mut started = false;
    for c in component.chars() {
        if alnum(c) {
            let ok = separator.is_empty()
                || separator == "."
                || separator == "_"
                || separator == "__"
                || all(&separator, |s| s == '-');
            if !ok {
                return false;
            }
            separator.clear();
            started = true;
        } else if started && matches!(c, '.' | '_' | '-') {
            separator.push(c);
        } else {
            return false;
        }
    }
    started && separator.is_empty()
}

fn check_tag(tag: &str) -> Result<(), ImageRefError> {
    let first_ok = tag
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
    let ok = first_ok
        && tag.len() <= MAX_TAG
        && all(tag, |c| {
            c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-')
        });
    if ok {
        Ok(())
    } else {
        Err(ImageRefError::Tag(tag.to_owned()))
    }
}

fn check_digest(digest: &str) -> Result<(), ImageRefError> {
    let lower_hex = |c: char| is_digit(c) || ('a'..='f').contains(&c);
    let ok = match digest.split_once(':') {
        Some(("sha256", hex)) => hex.len() == 64 && all(hex, lower_hex),
        Some(("sha512", hex)) => hex.len() == 128 && all(hex, lower_hex),
        _ => false,
    };
    if ok {
        Ok(())
    } else {
        Err(ImageRefError::Digest(digest.to_owned()))
    }
}

fn is_digit(c: char) -> bool {
    c.is_ascii_digit()
}

fn all(s: &str, f: impl Fn(char) -> bool) -> bool {
    s.chars().all(f)
}

/// `--forwarder-image-pull-policy` (clap names the flag in the error).
pub fn parse_pull_policy(value: &str) -> Result<ImagePullPolicy, String> {
    match value {
        "Always" => Ok(ImagePullPolicy::Always),
        "IfNotPresent" => Ok(ImagePullPolicy::IfNotPresent),
        "Never" => Ok(ImagePullPolicy::Never),
        _ => Err("must be Always, IfNotPresent or Never".to_owned()),
    }
}

/// One name of `--forwarder-image-pull-secrets`: a Secret name, a DNS subdomain.
pub fn parse_secret_name(value: &str) -> Result<String, String> {
    let ok = (1..=253).contains(&value.len())
        && value.split('.').all(|label| {
            let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || is_digit(c));
            edge(label.chars().next())
                && edge(label.chars().last())
                && all(label, |c| c.is_ascii_lowercase() || is_digit(c) || c == '-')
        });
    if ok {
        Ok(value.to_owned())
    } else {
        Err(format!(
            "{value:?} is not a Secret name: lower-case letters, digits, '-' and '.', at most 253, \
             starting and ending with a letter or digit (names are separated by ',')"
        ))
    }
}

/// What forwarder pods run and how the kubelet gets it: the operator's flags, and after
/// [`ForwarderImage::for_connection`] one connection's.
#[derive(clap::Args, Debug, Clone, PartialEq, Eq)]
pub struct ForwarderImage {
    /// Image of the forwarder pods, `[registry[:port]/]repository[:tag][@digest]`; without a
    /// tag or digest the operator's version is the tag. A connection's
    /// `spec.forwarder.image` overrides it.
    #[arg(
        long = "forwarder-image",
        env = "FERRY_FORWARDER_IMAGE",
        value_name = "REFERENCE",
        default_value = DEFAULT_FORWARDER_IMAGE
    )]
    pub image: ImageRef,
    /// `Always`, `IfNotPresent` or `Never`; default: Kubernetes' (`IfNotPresent` unless the
    /// tag is `latest`). A connection's `spec.forwarder.imagePullPolicy` overrides it.
    #[arg(
        long = "forwarder-image-pull-policy",
        env = "FERRY_FORWARDER_IMAGE_PULL_POLICY",
        value_name = "POLICY",
        value_parser = parse_pull_policy
    )]
    pub pull_policy: Option<ImagePullPolicy>,
    /// Secrets with registry credentials for the forwarder pods, comma-separated; they must
    /// exist in each namespace with forwarders. A connection's
    /// `spec.forwarder.imagePullSecrets` overrides them.
    #[arg(
        long = "forwarder-image-pull-secrets",
        env = "FERRY_FORWARDER_IMAGE_PULL_SECRETS",
        value_name = "NAMES",
        value_delimiter = ',',
        value_parser = parse_secret_name
    )]
    pub pull_secrets: Vec<String>,
}

impl Default for ForwarderImage {
    fn default() -> Self {
        Self {
            image: ImageRef::default_forwarder(),
            pull_policy: None,
            pull_secrets: Vec::new(),
        }
    }
}

/// A connection's `spec.forwarder.image` that the CRD's rule would refuse today (it may have
/// been stored before the rule existed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("spec.forwarder.image: {0}")]
pub struct InvalidOverride(#[source] pub ImageRefError);

impl ForwarderImage {
    /// The image of one connection's forwarder pods: each of `spec.forwarder.image`,
    /// `imagePullPolicy` and `imagePullSecrets` that is set wins over the operator's default,
    /// on its own.
    pub fn for_connection(&self, pods: &ForwarderPods) -> Result<Self, InvalidOverride> {
        let image = match &pods.image {
            Some(reference) => ImageRef::parse(reference).map_err(InvalidOverride)?,
            None => self.image.clone(),
        };
        Ok(Self {
            image,
            pull_policy: pods.image_pull_policy.or(self.pull_policy),
            pull_secrets: match &pods.image_pull_secrets {
                Some(secrets) => secrets.iter().map(|s| s.name.clone()).collect(),
                None => self.pull_secrets.clone(),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DIGEST: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    /// (reference, what it becomes).
    fn valid() -> Vec<(String, String)> {
        let v = DEFAULT_TAG;
        [
            ("ferry-forwarder", format!("ferry-forwarder:{v}")),
            ("ferry-forwarder:1.2.3", "ferry-forwarder:1.2.3".to_owned()),
            (
                "registry.example.com:5000/team/ferry-forwarder",
                format!("registry.example.com:5000/team/ferry-forwarder:{v}"),
            ),
            (
                "registry.example.com:5000/team/ferry-forwarder:1.2.3",
                "registry.example.com:5000/team/ferry-forwarder:1.2.3".to_owned(),
            ),
            (
                &format!("registry.example.com:5000/team/ferry-forwarder@{DIGEST}"),
                format!("registry.example.com:5000/team/ferry-forwarder@{DIGEST}"),
            ),
            (
                &format!("ghcr.io/acme/ferry-forwarder:0.1.0@{DIGEST}"),
                format!("ghcr.io/acme/ferry-forwarder:0.1.0@{DIGEST}"),
            ),
            (
                "localhost:5000/ferry:dev",
                "localhost:5000/ferry:dev".to_owned(),
            ),
            ("localhost/ferry", format!("localhost/ferry:{v}")),
            (
                "Registry.Example/ferry",
                format!("Registry.Example/ferry:{v}"),
            ),
            (
                "a/b/c/d__e.f-g---h:_T.a-g",
                "a/b/c/d__e.f-g---h:_T.a-g".to_owned(),
            ),
            ("my_mirror.io/x", format!("my_mirror.io/x:{v}")),
        ]
        .into_iter()
        .map(|(a, b)| (a.to_owned(), b))
        .collect()
    }

    fn invalid() -> Vec<(String, ImageRefError)> {
        let tag = |t: &str| ImageRefError::Tag(t.to_owned());
        let repo = |r: &str| ImageRefError::Repository(r.to_owned());
        let digest = |d: &str| ImageRefError::Digest(d.to_owned());
        vec![
            (String::new(), ImageRefError::Empty),
            (":1.0".into(), ImageRefError::NoRepository(":1.0".into())),
            ("Ferry-Forwarder:1".into(), repo("Ferry-Forwarder")),
            ("registry.example.com/Team/ferry".into(), repo("Team/ferry")),
            ("ferry forwarder".into(), repo("ferry forwarder")),
            ("ferry/".into(), repo("ferry/")),
            ("/ferry".into(), repo("/ferry")),
            ("ferry//x".into(), repo("ferry//x")),
            ("-ferry".into(), repo("-ferry")),
            ("ferry.-x".into(), repo("ferry.-x")),
            ("ferry:".into(), tag("")),
            ("ferry:.1".into(), tag(".1")),
            ("ferry:1 2".into(), tag("1 2")),
            (format!("ferry:{}", "t".repeat(129)), tag(&"t".repeat(129))),
            ("ferry:1:2".into(), repo("ferry:1")),
            ("ferry@sha256:abc".into(), digest("sha256:abc")),
            (
                format!(
                    "ferry@{}",
                    DIGEST.to_uppercase().replace("SHA256", "sha256")
                ),
                digest(&DIGEST.to_uppercase().replace("SHA256", "sha256")),
            ),
            (
                format!("ferry@md5:{}", &DIGEST[7..39]),
                digest(&format!("md5:{}", &DIGEST[7..39])),
            ),
            ("ferry@".into(), digest("")),
            (
                "bad_host.example:5000/ferry".into(),
                ImageRefError::Registry("bad_host.example:5000".into()),
            ),
            (
                "registry.example.com:port/ferry".into(),
                ImageRefError::Registry("registry.example.com:port".into()),
            ),
            (
                "registry.example.com:123456/ferry".into(),
                ImageRefError::Registry("registry.example.com:123456".into()),
            ),
        ]
    }

    #[test]
    fn valid_references_parse_and_get_the_operators_version_without_a_tag_or_digest() {
        for (reference, expected) in valid() {
            let parsed = ImageRef::parse(&reference)
                .unwrap_or_else(|e| panic!("{reference:?} refused: {e}"));
            assert_eq!(parsed.to_string(), expected, "{reference:?}");
        }
        assert_eq!(
            ImageRef::default_forwarder().to_string(),
            DEFAULT_FORWARDER_IMAGE
        );
        assert_eq!(
            ImageRef::parse(DEFAULT_FORWARDER_IMAGE),
            Ok(ImageRef::default_forwarder())
        );
    }

    #[test]
    fn invalid_references_say_what_is_wrong() {
        for (reference, expected) in invalid() {
            assert_eq!(ImageRef::parse(&reference), Err(expected), "{reference:?}");
        }
        let long = format!("{}/ferry", "a".repeat(250));
        assert!(matches!(
            ImageRef::parse(&long),
            Err(ImageRefError::NameTooLong { len: 256, .. })
        ));
        let message = ImageRef::parse("registry.example.com/Team/ferry:1")
            .map_err(|e| e.to_string())
            .err();
        assert_eq!(
            message.as_deref(),
            Some(
                "the repository \"Team/ferry\" must be lower-case letters and digits in \
                 '/'-separated parts, each part joined only by '.', '_', '__' or '-' (and not \
                 starting or ending with one)"
            )
        );
    }

    /// The CEL rule on `spec.forwarder.image` in the generated CRD accepts what this parser
    /// accepts and refuses what it refuses (but the name length, which CEL leaves to the
    /// operator).
    #[test]
    fn the_crds_rule_and_the_parser_agree() {
        use kube::CustomResourceExt;
        let crd = serde_json::to_value(ferry_api::crd::BrokerConnection::crd())
            .unwrap_or_else(|e| panic!("CRD as JSON: {e}"));
        let image = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
            ["properties"]["forwarder"]["properties"]["image"];
        assert_eq!(image["maxLength"], 512, "{image}");
        let rule = image["x-kubernetes-validations"][0]["rule"]
            .as_str()
            .unwrap_or_else(|| panic!("no CEL rule on spec.forwarder.image: {image}"));
        let pattern = rule
            .strip_prefix("self.matches('")
            .and_then(|r| r.strip_suffix("')"))
            .unwrap_or_else(|| panic!("not a self.matches rule: {rule}"));
        let cel = regex::Regex::new(pattern).unwrap_or_else(|e| panic!("{pattern}: {e}"));
        for (reference, _) in valid() {
            assert!(cel.is_match(&reference), "CEL refuses {reference:?}");
        }
        for (reference, _) in invalid() {
            assert!(!cel.is_match(&reference), "CEL accepts {reference:?}");
        }
    }

    #[derive(clap::Parser, Debug)]
    struct Flags {
        #[command(flatten)]
        image: ForwarderImage,
    }

    fn flags(args: &[&str]) -> Result<ForwarderImage, String> {
        use clap::Parser;
        Flags::try_parse_from(std::iter::once("ferry-operator").chain(args.iter().copied()))
            .map(|f| f.image)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn the_flags_default_to_the_operators_build_and_refuse_bad_values_by_name() {
        assert_eq!(flags(&[]), Ok(ForwarderImage::default()));
        assert_eq!(
            flags(&[
                "--forwarder-image",
                "registry.example.com:5000/team/ferry-forwarder",
                "--forwarder-image-pull-policy",
                "Always",
                "--forwarder-image-pull-secrets",
                "regcred,team.cred",
            ]),
            Ok(ForwarderImage {
                image: ImageRef {
                    name: "registry.example.com:5000/team/ferry-forwarder".to_owned(),
                    tag: Some(DEFAULT_TAG.to_owned()),
                    digest: None,
                },
                pull_policy: Some(ImagePullPolicy::Always),
                pull_secrets: vec!["regcred".to_owned(), "team.cred".to_owned()],
            })
        );
        for (args, expected) in [
            (
                ["--forwarder-image", "registry.example.com/Team/ferry"],
                "invalid value 'registry.example.com/Team/ferry' for '--forwarder-image \
                 <REFERENCE>': the repository \"Team/ferry\" must be lower-case",
            ),
            (
                ["--forwarder-image", "ferry@sha256:abc"],
                "for '--forwarder-image <REFERENCE>': the digest \"sha256:abc\" must be \
                 sha256:<64 lower-case hex digits>",
            ),
            (
                ["--forwarder-image-pull-policy", "always"],
                "invalid value 'always' for '--forwarder-image-pull-policy <POLICY>': must be \
                 Always, IfNotPresent or Never",
            ),
            (
                ["--forwarder-image-pull-secrets", "regcred,Team"],
                "invalid value 'Team' for '--forwarder-image-pull-secrets <NAMES>': \"Team\" is \
                 not a Secret name",
            ),
        ] {
            let error = flags(&args).err().unwrap_or_default();
            assert!(error.contains(expected), "{args:?}: {error}");
        }
    }

    #[test]
    fn pull_policies_and_secret_names_are_checked() {
        assert_eq!(parse_pull_policy("Never"), Ok(ImagePullPolicy::Never));
        assert!(parse_pull_policy("always").is_err());
        assert_eq!(parse_secret_name("regcred"), Ok("regcred".to_owned()));
        assert_eq!(
            parse_secret_name("team-a.registry"),
            Ok("team-a.registry".to_owned())
        );
        for bad in ["", "RegCred", "-x", "x-", "a..b", "reg cred"] {
            assert!(parse_secret_name(bad).is_err(), "{bad:?}");
        }
    }
}
