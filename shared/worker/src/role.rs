//! A worker's role at run time, and the gate that lets work of that role in.
//!
//! A worker starts as prefill or decode and can be told to become the other in place
//! ([`crate::membership::Membership::change_role`]): the engine, its weights, its KV pool and its
//! prefix cache stay. While it leaves a role the gate refuses *new* work of that role (a Prefill
//! call; a Reserve, or a Decode that does not continue a reservation) with UNAVAILABLE, which a
//! router answers by placing the request elsewhere, and lets work already begun finish: the
//! Decode call of a reservation made before, page pushes into it, running decodes. Every call
//! the gate let in holds a [`Pass`] until it ends, so "drained" is exact: no pass out, no
//! reservation pending.

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};
use std::sync::Arc;

use nibble_proto::v1;

use crate::error::{Error, Result};

/// The role and the gate; one per worker, shared by its services.
#[derive(Debug)]
pub struct RoleGate {
    role: AtomicI32,
    leaving: AtomicBool,
    passes: Arc<AtomicUsize>,
}

/// A call the gate let in; it counts until dropped.
#[derive(Debug)]
pub struct Pass(Arc<AtomicUsize>);

impl Drop for Pass {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl RoleGate {
    pub fn new(role: v1::WorkerRole) -> Self {
        Self {
            role: AtomicI32::new(role as i32),
            leaving: AtomicBool::new(false),
            passes: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// The role now (the old one until a change completes).
    pub fn role(&self) -> v1::WorkerRole {
        v1::WorkerRole::try_from(self.role.load(Ordering::Acquire))
            .unwrap_or(v1::WorkerRole::Unspecified)
    }

    /// Whether the worker is leaving its role.
    pub fn leaving(&self) -> bool {
        self.leaving.load(Ordering::Acquire)
    }

    /// Lets in new work of `role`: refused while the worker is leaving that role (or has
    /// another).
    pub fn admit(&self, role: v1::WorkerRole, worker: &str) -> Result<Pass> {
        let pass = self.pass();
        let now = self.role();
        if now != role {
            return Err(Error::WrongRole {
                worker: worker.to_string(),
                role: role_name(now),
                wanted: role_name(role),
            });
        }
        if self.leaving() {
            return Err(Error::LeavingRole {
                worker: worker.to_string(),
                role: role_name(now),
            });
        }
        Ok(pass)
    }

    /// Lets in the continuation of work already admitted (a reservation's Decode), whatever
    /// the role now.
    pub fn resume(&self) -> Pass {
        self.pass()
    }

    /// Counted before the checks, so a change that starts between them and the call's end
    /// still waits for it.
    fn pass(&self) -> Pass {
        self.passes.fetch_add(1, Ordering::AcqRel);
        Pass(Arc::clone(&self.passes))
    }

    /// Calls let in and not ended.
    pub fn open_passes(&self) -> usize {
        self.passes.load(Ordering::Acquire)
    }

    /// Starts leaving the role: new work of it is refused from now on. False if a change is
    /// already under way.
    pub(crate) fn start_leaving(&self) -> bool {
        !self.leaving.swap(true, Ordering::AcqRel)
    }

    /// Ends a change: the worker has `role` (the new one, or the old one if the change was
    /// abandoned) and takes its work.
    pub(crate) fn settle(&self, role: v1::WorkerRole) {
        self.role.store(role as i32, Ordering::Release);
        self.leaving.store(false, Ordering::Release);
    }
}

/// The role's name as flags and registrations spell it.
pub fn role_name(role: v1::WorkerRole) -> &'static str {
    match role {
        v1::WorkerRole::Prefill => "prefill",
        v1::WorkerRole::Decode => "decode",
        v1::WorkerRole::Router => "router",
        v1::WorkerRole::Unspecified => "unspecified",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_work_of_a_role_being_left_is_refused_and_begun_work_counts() {
        let gate = RoleGate::new(v1::WorkerRole::Decode);
        let decode = gate.admit(v1::WorkerRole::Decode, "w").unwrap();
        let err = gate.admit(v1::WorkerRole::Prefill, "w").unwrap_err();
        assert_eq!(
            err.to_string(),
            "worker w is a decode worker, not prefill (it may have changed role)"
        );
        assert_eq!(gate.open_passes(), 1, "a refused call holds no pass");
        assert!(gate.start_leaving());
        assert!(!gate.start_leaving(), "one change at a time");
        let err = gate.admit(v1::WorkerRole::Decode, "w").unwrap_err();
        assert_eq!(
            err.to_string(),
            "worker w is leaving the decode role: it takes no new decode work"
        );
        // A reservation's Decode continues.
        let resumed = gate.resume();
        assert_eq!(gate.open_passes(), 2);
        drop((decode, resumed));
        assert_eq!(gate.open_passes(), 0);
        gate.settle(v1::WorkerRole::Prefill);
        assert_eq!(gate.role(), v1::WorkerRole::Prefill);
        assert!(!gate.leaving());
        assert!(gate.admit(v1::WorkerRole::Prefill, "w").is_ok());
        assert!(gate.admit(v1::WorkerRole::Decode, "w").is_err());
    }
}
