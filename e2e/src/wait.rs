//! Waiting for what a test cannot be told about (a process's state, an object the control plane
//! writes): the condition is polled until it holds or a deadline passes, and the error then
//! names what was awaited and for how long. A caller adds its own context (a log) to the error.

use std::time::{Duration, Instant};

use anyhow::{Result, anyhow};

/// How often to look when a caller has no reason to look more or less often: cheap enough for
/// a condition that runs kubectl, quick enough not to add much to a test.
pub const WAIT_POLL: Duration = Duration::from_millis(250);

/// One look at a condition: `bool`, or `Result<bool>` whose error ends the wait.
pub trait Condition {
    fn holds(self) -> Result<bool>;
}

impl Condition for bool {
    fn holds(self) -> Result<bool> {
        Ok(self)
    }
}

impl Condition for Result<bool> {
    fn holds(self) -> Result<bool> {
        self
    }
}

/// Looks at `cond` every `every` until it holds. Fails once `timeout` passed ("timed out after
/// <timeout> waiting for <what>"), or at once with the error of a `Result<bool>` condition.
pub fn wait_until<C: Condition>(
    what: &str,
    timeout: Duration,
    every: Duration,
    mut cond: impl FnMut() -> C,
) -> Result<()> {
    let deadline = Deadline::new(what, timeout);
    while !cond().holds()? {
        deadline.check(None)?;
        std::thread::sleep(every);
    }
    Ok(())
}

/// [`wait_until`] for async code: sleeps on the runtime's timer between looks.
pub async fn wait_until_async(
    what: &str,
    timeout: Duration,
    every: Duration,
    mut cond: impl FnMut() -> bool,
) -> Result<()> {
    let deadline = Deadline::new(what, timeout);
    while !cond() {
        deadline.check(None)?;
        tokio::time::sleep(every).await;
    }
    Ok(())
}

/// Calls `check` every `every` until it gives `Some`, at most `timeout`, and returns what it
/// gave. An error only means "not yet" (what a check asks a cluster for may not exist yet);
/// the last one is in the error when the time runs out.
pub fn wait_until_some<T>(
    what: &str,
    timeout: Duration,
    every: Duration,
    mut check: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    let deadline = Deadline::new(what, timeout);
    let mut last_error = None;
    loop {
        match check() {
            Ok(Some(value)) => return Ok(value),
            Ok(None) => {}
            Err(e) => last_error = Some(e),
        }
        deadline.check(last_error.as_ref())?;
        std::thread::sleep(every);
    }
}

/// When a wait gives up, and what it then says.
struct Deadline<'a> {
    what: &'a str,
    timeout: Duration,
    start: Instant,
}

impl<'a> Deadline<'a> {
    fn new(what: &'a str, timeout: Duration) -> Self {
        let start = Instant::now();
        Self {
            what,
            timeout,
            start,
        }
    }

    /// An error naming what was awaited (and `last_error`) once the timeout passed.
    fn check(&self, last_error: Option<&anyhow::Error>) -> Result<()> {
        let (what, timeout) = (self.what, self.timeout);
        if self.start.elapsed() <= timeout {
            return Ok(());
        }
        Err(match last_error {
            None => anyhow!("timed out after {timeout:?} waiting for {what}"),
            Some(e) => {
                anyhow!("timed out after {timeout:?} waiting for {what} (last error: {e:#})")
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHORT: Duration = Duration::from_millis(30);
    const EVERY: Duration = Duration::from_millis(5);

    #[test]
    fn returns_once_the_condition_holds() {
        let mut looks = 0;
        wait_until("three looks", Duration::from_secs(5), EVERY, || {
            looks += 1;
            looks == 3
        })
        .expect("holds on the third look");
        assert_eq!(looks, 3);
    }

    #[test]
    fn a_timeout_names_what_and_how_long() {
        let e = wait_until("never", SHORT, EVERY, || false).expect_err("times out");
        assert_eq!(
            e.to_string(),
            format!("timed out after {SHORT:?} waiting for never")
        );
    }

    #[test]
    fn an_error_ends_the_wait_at_once() {
        let start = Instant::now();
        let e = wait_until(
            "failing",
            Duration::from_secs(60),
            EVERY,
            || -> Result<bool> { Err(anyhow!("broken")) },
        )
        .expect_err("fails");
        assert_eq!(e.to_string(), "broken");
        assert!(start.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn some_waits_past_errors_and_reports_the_last() {
        let mut looks = 0;
        let got = wait_until_some("a value", Duration::from_secs(5), EVERY, || {
            looks += 1;
            match looks {
                1 => Err(anyhow!("not there yet")),
                2 => Ok(None),
                n => Ok(Some(n)),
            }
        });
        assert_eq!(got.expect("a value on the third look"), 3);
        let e = wait_until_some("a value", SHORT, EVERY, || -> Result<Option<()>> {
            Err(anyhow!("gone"))
        })
        .expect_err("times out");
        assert_eq!(
            e.to_string(),
            format!("timed out after {SHORT:?} waiting for a value (last error: gone)")
        );
    }

    #[test]
    fn async_waits_on_the_runtime() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime");
        let mut looks = 0;
        rt.block_on(wait_until_async(
            "two looks",
            Duration::from_secs(5),
            EVERY,
            || {
                looks += 1;
                looks == 2
            },
        ))
        .expect("holds");
        let e = rt
            .block_on(wait_until_async("never", SHORT, EVERY, || false))
            .expect_err("times out");
        assert!(e.to_string().starts_with("timed out after"));
    }
}
