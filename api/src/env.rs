//! `${VAR}` substitution in config text, as the replaced forwarder did it (on the raw text,
//! before YAML parsing), so its users' files keep working. `${VAR:-default}` is Ferry's addition.

/// Result of substituting a text: the new text and the names of variables that were unset
/// and had no default (they were replaced by the empty string).
#[derive(Debug, PartialEq, Eq)]
pub struct Substituted {
    pub text: String,
    pub missing: Vec<String>,
}

/// Replaces every `${NAME}` / `${NAME:-default}` using `lookup`. A `$` not followed by `{`,
/// or a `${` without a closing `}` on the same line, is left as it is.
pub fn substitute(text: &str, lookup: impl Fn(&str) -> Option<String>) -> Substituted {
    let mut out = String::with_capacity(text.len());
    let mut missing = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after.find(['}', '\n']);
        match end {
            Some(end) if after.as_bytes()[end] == b'}' => {
                let expr = &after[..end];
                let (name, default) = match expr.split_once(":-") {
                    Some((name, default)) => (name, Some(default)),
                    None => (expr, None),
                };
                match (lookup(name), default) {
                    (Some(value), _) => out.push_str(&value),
                    (None, Some(default)) => out.push_str(default),
                    (None, None) => {
                        if !missing.iter().any(|m| m == name) {
                            missing.push(name.to_owned());
                        }
                    }
                }
                rest = &after[end + 1..];
            }
            _ => {
                out.push_str("${");
                rest = after;
            }
        }
    }
    out.push_str(rest);
    Substituted { text: out, missing }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(name: &str) -> Option<String> {
        match name {
            "HOST" => Some("mqtt.local".into()),
            "EMPTY" => Some(String::new()),
            _ => None,
        }
    }

    #[test]
    fn replaces_set_variables_and_defaults() {
        let s = substitute("host: ${HOST}\nport: ${PORT:-1883}\nx: ${EMPTY}!", env);
        assert_eq!(s.text, "host: mqtt.local\nport: 1883\nx: !");
        assert!(s.missing.is_empty());
    }

    #[test]
    fn reports_unset_variables_once_and_blanks_them() {
        let s = substitute("a: ${NOPE} b: ${NOPE} c: ${HOST}", env);
        assert_eq!(s.text, "a:  b:  c: mqtt.local");
        assert_eq!(s.missing, vec!["NOPE".to_string()]);
    }

    #[test]
    fn leaves_unterminated_and_plain_dollars() {
        let s = substitute("price: $5\nbroken: ${HOST\nok: ${HOST}", env);
        assert_eq!(s.text, "price: $5\nbroken: ${HOST\nok: mqtt.local");
    }
}
