//! FERRY-PATCH: an evaluation budget, counted per thread: each expression node evaluated costs
//! one step, and an evaluation that runs out fails with [`ExecutionError::CostLimitExceeded`]
//! instead of running on (cel-go's `CostLimit`, in its simplest form).

use std::cell::Cell;

use crate::ExecutionError;

thread_local! {
    /// Steps left to the evaluation running on this thread; `None` when it has no budget.
    static REMAINING: Cell<Option<u64>> = const { Cell::new(None) };
}

/// Runs `evaluate` with at most `steps` steps; returns its result and the steps it used.
/// Budgets do not nest: an inner call replaces the outer one's until it returns.
pub fn with_budget<T>(steps: u64, evaluate: impl FnOnce() -> T) -> (T, u64) {
    let before = REMAINING.with(|r| r.replace(Some(steps)));
    let result = evaluate();
    let left = REMAINING.with(|r| r.replace(before)).unwrap_or(0);
    (result, steps - left)
}

/// Charges `steps` to the running evaluation's budget, if it has one.
#[inline]
pub(crate) fn charge(steps: u64) -> Result<(), ExecutionError> {
    REMAINING.with(|r| match r.get() {
        None => Ok(()),
        Some(left) if left >= steps => {
            r.set(Some(left - steps));
            Ok(())
        }
        Some(_) => Err(ExecutionError::CostLimitExceeded),
    })
}
