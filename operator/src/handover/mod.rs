//! The session hand-over, operator side: everything that moves what the broker holds for the
//! forwarders' persistent sessions from one place to another without losing it.
//!
//! - A scale-down: the leaving pods are listed in their config's `drain`; each unsubscribes,
//!   forwards what its session still holds, and reports `drained`; only then does the
//!   StatefulSet shrink, and the operator ends the session ([`crate::sessions`]).
//! - A rule moved to another group (`spec.group` changed, reversed or redirected half-way):
//!   the workloads that list it keep serving it until its new group runs it (every answering
//!   pod has its filters subscribed), then list it in `retiring` until each of their pods
//!   forwarded what its session held for it.
//! - A group removed or renamed: its workload serves its rules until their new groups run
//!   them, then drains, then goes.
//!
//! [`observe`] reads what runs once per reconcile (one pod list, one `/status` per pod its
//! group's StatefulSet owns, the configs as applied); [`machine::decide`] decides, pure; the
//! plan renders what it decided into each workload's config (`drain`, `retiring`, the
//! subscription's form) and replicas. Every order of events is checked by the model in
//! `model.rs`. The forwarder's side is `forwarder/src/handover.rs`.

pub mod machine;
#[cfg(test)]
mod model;
pub mod observe;

pub use machine::{
    Applied, Decision, GroupSpec, Move, MovePhase, PodSeen, Replicas, Report, Retirement, Seen,
    Spec, Step, decide,
};
