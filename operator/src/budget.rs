//! The operator's status-write budget: how many status writes a second the whole operator
//! sends the API server, shared by every loop (see `writer::update_status`).
//!
//! A token bucket with two kinds of write. A condition transition, and whatever the control
//! plane writes (`Accepted`, `Ready`, a connection's status), is news a user waits for: it is
//! written at once and paid for, into debt if need be. A write of moving counters only (the
//! data plane's counters and rates) is deferrable: it waits for a token, so while transitions
//! run the budget down, counters wait, and at steady state their writes are spread out at the
//! budget's rate. The debt is bounded so that counters resume within [`MAX_DEBT`] of a storm of
//! transitions ending.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The most a storm of transitions can delay the counters' writes after it ends.
pub const MAX_DEBT: Duration = Duration::from_secs(60);

/// A token bucket filled at `rate` tokens a second, holding at most `burst`, down to a debt of
/// [`MAX_DEBT`] worth of tokens. Pure: the caller passes the time.
#[derive(Debug, Clone)]
pub struct Bucket {
    /// Tokens a second; `None` is no budget at all.
    rate: Option<f64>,
    burst: f64,
    tokens: f64,
    at: Instant,
}

impl Bucket {
    /// `rate` writes a second (0 or less: no budget); `burst` writes at most at once, one or
    /// more. Starts full.
    pub fn new(rate: f64, burst: f64, now: Instant) -> Self {
        let burst = burst.max(1.0);
        Self {
            rate: (rate > 0.0 && rate.is_finite()).then_some(rate),
            burst,
            tokens: burst,
            at: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let Some(rate) = self.rate else { return };
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * rate).min(self.burst);
        self.at = self.at.max(now);
    }

    /// A write that does not wait (a transition): always allowed, paid for.
    pub fn spend(&mut self, now: Instant) {
        let Some(rate) = self.rate else { return };
        self.refill(now);
        let floor = -rate * MAX_DEBT.as_secs_f64();
        self.tokens = (self.tokens - 1.0).max(floor);
    }

    /// A write that may wait (counters only): `Ok` and paid for when a token is there, else how
    /// long until one is.
    pub fn take(&mut self, now: Instant) -> Result<(), Duration> {
        let Some(rate) = self.rate else {
            return Ok(());
        };
        self.refill(now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - self.tokens) / rate))
        }
    }
}

/// The budget the operator's loops share.
#[derive(Debug)]
pub struct WriteBudget(Mutex<Bucket>);

/// Whether a status write may wait for the budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Urgency {
    /// A condition transition or a control-plane status: written at once, paid for.
    Now,
    /// Moving counters only: written when the budget has room, else deferred.
    Deferrable,
}

impl WriteBudget {
    /// `rate` status writes a second for the whole operator (0: no budget). The burst is one
    /// second's worth, so writes leave evenly rather than in batches.
    pub fn new(rate: f64) -> Self {
        Self(Mutex::new(Bucket::new(rate, rate, Instant::now())))
    }

    fn bucket(&self) -> std::sync::MutexGuard<'_, Bucket> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Pays for a write that does not wait.
    pub fn spend(&self) {
        self.bucket().spend(Instant::now());
    }

    /// A token for a deferrable write, or how long until there is one.
    pub fn take(&self) -> Result<(), Duration> {
        self.bucket().take(Instant::now())
    }

    /// Waits for a token for a deferrable write, unless none comes before `deadline`: then
    /// `false`, and the write is left for later.
    pub async fn wait_until(&self, deadline: tokio::time::Instant) -> bool {
        loop {
            let wait = match self.take() {
                Ok(()) => return true,
                Err(wait) => wait,
            };
            let at = tokio::time::Instant::now() + wait;
            if at > deadline {
                return false;
            }
            tokio::time::sleep_until(at).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    /// A bucket of `rate` a second (burst: one second's worth) after `n` transitions at `t0`.
    fn after_transitions(rate: f64, n: usize) -> (Instant, Bucket) {
        let t0 = Instant::now();
        let mut b = Bucket::new(rate, rate, t0);
        for _ in 0..n {
            b.spend(t0);
        }
        (t0, b)
    }

    #[test]
    fn deferrable_writes_leave_at_the_rate_after_the_burst() {
        let t0 = Instant::now();
        let mut b = Bucket::new(2.0, 2.0, t0);
        assert_eq!(b.take(t0), Ok(()));
        assert_eq!(b.take(t0), Ok(()));
        assert_eq!(b.take(t0), Err(S / 2), "the third waits half a second");
        let mut written = 0;
        for tenth in 1..=100 {
            if b.take(t0 + S * tenth / 10).is_ok() {
                written += 1;
            }
        }
        assert_eq!(written, 20, "2 a second over 10 s");
    }

    #[test]
    fn transitions_are_never_refused_and_defer_the_counters() {
        let (t0, mut b) = after_transitions(1.0, 10);
        // Ten transitions at once put the budget 9 writes in debt: counters wait 10 s.
        assert_eq!(b.take(t0), Err(S * 10));
        assert!(b.take(t0 + S * 9).is_err());
        assert_eq!(b.take(t0 + S * 10), Ok(()));
    }

    #[test]
    fn a_storm_of_transitions_defers_the_counters_at_most_max_debt() {
        let (t0, mut b) = after_transitions(20.0, 100_000);
        let after = MAX_DEBT + S / 20;
        assert!(
            b.take(t0 + after).is_ok(),
            "counters resume within MAX_DEBT"
        );
    }

    #[test]
    fn an_idle_budget_holds_only_its_burst() {
        let t0 = Instant::now();
        let mut b = Bucket::new(5.0, 5.0, t0);
        let later = t0 + S * 3600;
        let taken = (0..100).filter(|_| b.take(later).is_ok()).count();
        assert_eq!(taken, 5);
    }

    #[test]
    fn rate_zero_is_no_budget() {
        let (t0, mut b) = after_transitions(0.0, 1000);
        assert!((0..1000).all(|_| b.take(t0).is_ok()));
    }

    #[test]
    fn a_fraction_of_a_write_a_second_is_a_budget_too() {
        let t0 = Instant::now();
        let mut b = Bucket::new(0.1, 0.1, t0);
        assert_eq!(b.take(t0), Ok(()), "the burst is at least one write");
        assert_eq!(b.take(t0), Err(S * 10));
    }
}
