//! The user names and passwords the fixtures accept: the characters every broker's config
//! takes without quoting rules of its own.

use anyhow::{Result, bail};

/// Checks a password given to [`crate::MosquittoOptions::users`] or
/// [`crate::SaslSsl::plain_users`]: 1 to 64 ASCII characters, printable or a newline, tab or
/// space; the fixtures pass it as an argument (`mosquitto_passwd -b`) or escape it (Kafka's
/// JAAS config), so any such character works.
pub fn check_password(what: &str, value: &str) -> Result<()> {
    let bad = |c: char| !(c.is_ascii_graphic() || matches!(c, ' ' | '\n' | '\t'));
    if value.is_empty() || value.len() > 64 || value.chars().any(bad) {
        bail!("{what} is not allowed by the test fixtures: use 1-64 printable ASCII characters");
    }
    Ok(())
}

/// Checks a user name or password given to [`crate::MosquittoOptions`] or [`crate::SaslSsl`]:
/// 1 to 64 printable ASCII characters, none of them space, `"`, `\`, `,`, `=`, `[`, `]` or `:`
/// (they would need quoting in Mosquitto's password file, Kafka's JAAS config or
/// `--add-scram`).
pub fn check_credential(what: &str, value: &str) -> Result<()> {
    let bad = |c: char| !c.is_ascii_graphic() || "\"\\,=[]:".contains(c);
    if value.is_empty() || value.len() > 64 || value.chars().any(bad) {
        bail!(
            "{what} {value:?} is not allowed by the test fixtures: use 1-64 printable ASCII \
             characters without space, '\"', '\\', ',', '=', '[', ']' or ':'"
        );
    }
    Ok(())
}
