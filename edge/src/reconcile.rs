//! Reconciliation: compare what should run here (the slice) with what runs (the
//! backend's observation) and list the actions that close the gap.
//!
//! `plan` is pure: the edge loop observes, plans, acts, and plans again whenever the
//! slice or the observation changes. Every action is idempotent, so a plan repeated
//! after a crash (of the edge or of an action) converges to the same place.

use crate::desired::{DesiredSandbox, SliceState};
use opendsec_commands::Observation;
use opendsec_projections::{Desired, Observed};
use std::collections::BTreeMap;

/// A sandbox as the backend sees it on this machine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Running {
    /// Created and running.
    Running,
    /// Frozen.
    Paused,
    /// Its main process ended.
    Exited { exit_code: i32, oom_killed: bool },
    /// Still running, but its memory cgroup has OOM-killed a process: a sandbox that
    /// exceeded its memory limit is ended as a whole, and the log says why.
    OutOfMemory,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Prepare storage and network and start the sandbox.
    Create { id: String },
    Pause { id: String },
    Resume { id: String },
    /// Stop its processes (the sandbox then shows as exited).
    Stop { id: String, reason: String },
    /// Free everything it holds on this machine.
    Remove { id: String },
    /// Tell the control plane what was observed.
    Report { id: String, observation: Observation },
}

fn report(id: &str, observation: Observation) -> Action {
    Action::Report { id: id.to_string(), observation }
}

/// The actions for one sandbox of the slice.
fn plan_one(d: &DesiredSandbox, seen: Option<&Running>, now_ms: u64) -> Vec<Action> {
    let id = d.id.clone();
    let expired = d.expires_at_ms.is_some_and(|at| at <= now_ms);
    let stop_reason = if expired && d.desired != Desired::Killed {
        Some("timeout".to_string())
    } else if d.desired == Desired::Killed {
        Some(d.kill_reason.clone().unwrap_or_else(|| "user".into()))
    } else {
        None
    };
    match (seen, stop_reason) {
        // Ended here: report it once, then free it.
        (Some(Running::Exited { exit_code, oom_killed }), reason) => {
            if d.is_terminal() {
                vec![Action::Remove { id }]
            } else {
                let reason = reason.unwrap_or_else(|| if *oom_killed { "oom".into() } else { "exited".into() });
                vec![report(&id, Observation::Exited { exit_code: *exit_code, oom_killed: *oom_killed, reason })]
            }
        }
        // Must end: stop it; its exit is reported on the next round.
        (Some(_), Some(reason)) => vec![Action::Stop { id, reason }],
        (Some(Running::OutOfMemory), None) => vec![Action::Stop { id, reason: "oom".into() }],
        // Gone, and must end: say so if the log does not know yet.
        (None, Some(reason)) => {
            if d.is_terminal() {
                vec![]
            } else {
                vec![report(&id, Observation::Exited { exit_code: 137, oom_killed: false, reason })]
            }
        }
        (None, None) => match d.observed {
            Observed::Pending => vec![Action::Create { id }],
            Observed::Exited | Observed::Failed => vec![],
            // It ran here once and is gone (the machine rebooted, someone removed it).
            Observed::Ready | Observed::Paused => vec![report(&id, Observation::Failed { reason: "lost: the sandbox no longer exists on its edge".into() })],
        },
        (Some(Running::Running), None) => match (d.desired, d.observed) {
            (Desired::Paused, _) => vec![Action::Pause { id }],
            (_, Observed::Pending) => vec![report(&id, Observation::Ready)],
            (_, Observed::Paused) => vec![report(&id, Observation::Resumed)],
            _ => vec![],
        },
        (Some(Running::Paused), None) => match (d.desired, d.observed) {
            (Desired::Running, _) => vec![Action::Resume { id }],
            (_, Observed::Paused) => vec![],
            _ => vec![report(&id, Observation::Paused)],
        },
    }
}

/// Everything to do to bring this machine to the slice. Sandboxes running here that the
/// slice does not know (orphans) are stopped and removed.
pub fn plan(slice: &SliceState, observed: &BTreeMap<String, Running>, now_ms: u64) -> Vec<Action> {
    let mut actions = Vec::new();
    for d in slice.sandboxes.values() {
        actions.extend(plan_one(d, observed.get(&d.id), now_ms));
    }
    for (id, state) in observed {
        if !slice.sandboxes.contains_key(id) {
            match state {
                Running::Exited { .. } => actions.push(Action::Remove { id: id.clone() }),
                Running::OutOfMemory => actions.push(Action::Stop { id: id.clone(), reason: "orphan".into() }),
                _ => actions.push(Action::Stop { id: id.clone(), reason: "orphan".into() }),
            }
        }
    }
    actions
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sandbox(desired: Desired, observed: Observed) -> DesiredSandbox {
        DesiredSandbox {
            id: "s1".into(),
            project: "p".into(),
            image: "busybox".into(),
            cpu_millis: 100,
            memory_mb: 64,
            labels: BTreeMap::new(),
            expires_at_ms: None,
            fork_of: None,
            desired,
            observed,
            kill_reason: None,
        }
    }

    fn check(d: DesiredSandbox, seen: Option<Running>, now: u64) -> Vec<Action> {
        let mut slice = SliceState::new("e");
        slice.sandboxes.insert(d.id.clone(), d);
        let observed: BTreeMap<_, _> = seen.into_iter().map(|r| ("s1".to_string(), r)).collect();
        plan(&slice, &observed, now)
    }

    fn rep(o: Observation) -> Vec<Action> {
        vec![Action::Report { id: "s1".into(), observation: o }]
    }

    #[test]
    fn a_new_sandbox_is_created_then_reported_ready() {
        assert_eq!(check(sandbox(Desired::Running, Observed::Pending), None, 0), vec![Action::Create { id: "s1".into() }]);
        assert_eq!(check(sandbox(Desired::Running, Observed::Pending), Some(Running::Running), 0), rep(Observation::Ready));
        assert_eq!(check(sandbox(Desired::Running, Observed::Ready), Some(Running::Running), 0), vec![]);
    }

    #[test]
    fn pause_and_resume_follow_the_desired_state() {
        assert_eq!(check(sandbox(Desired::Paused, Observed::Ready), Some(Running::Running), 0), vec![Action::Pause { id: "s1".into() }]);
        assert_eq!(check(sandbox(Desired::Paused, Observed::Ready), Some(Running::Paused), 0), rep(Observation::Paused));
        assert_eq!(check(sandbox(Desired::Paused, Observed::Paused), Some(Running::Paused), 0), vec![]);
        assert_eq!(check(sandbox(Desired::Running, Observed::Paused), Some(Running::Paused), 0), vec![Action::Resume { id: "s1".into() }]);
        assert_eq!(check(sandbox(Desired::Running, Observed::Paused), Some(Running::Running), 0), rep(Observation::Resumed));
    }

    #[test]
    fn a_kill_stops_reports_once_and_frees() {
        let mut d = sandbox(Desired::Killed, Observed::Ready);
        d.kill_reason = Some("user".into());
        assert_eq!(check(d.clone(), Some(Running::Running), 0), vec![Action::Stop { id: "s1".into(), reason: "user".into() }]);
        let exited = Some(Running::Exited { exit_code: 137, oom_killed: false });
        assert_eq!(check(d.clone(), exited.clone(), 0), rep(Observation::Exited { exit_code: 137, oom_killed: false, reason: "user".into() }));
        d.observed = Observed::Exited;
        assert_eq!(check(d.clone(), exited, 0), vec![Action::Remove { id: "s1".into() }]);
        assert_eq!(check(d, None, 0), vec![]);
    }

    #[test]
    fn an_expired_sandbox_is_stopped_for_timeout() {
        let mut d = sandbox(Desired::Running, Observed::Ready);
        d.expires_at_ms = Some(1_000);
        assert_eq!(check(d.clone(), Some(Running::Running), 999), vec![]);
        assert_eq!(check(d.clone(), Some(Running::Running), 1_000), vec![Action::Stop { id: "s1".into(), reason: "timeout".into() }]);
        assert_eq!(
            check(d, Some(Running::Exited { exit_code: 137, oom_killed: false }), 1_001),
            rep(Observation::Exited { exit_code: 137, oom_killed: false, reason: "timeout".into() })
        );
    }

    #[test]
    fn an_oom_kill_is_reported_as_such() {
        let d = sandbox(Desired::Running, Observed::Ready);
        assert_eq!(
            check(d, Some(Running::Exited { exit_code: 137, oom_killed: true }), 0),
            rep(Observation::Exited { exit_code: 137, oom_killed: true, reason: "oom".into() })
        );
    }

    #[test]
    fn a_sandbox_over_its_memory_is_ended_as_a_whole() {
        let d = sandbox(Desired::Running, Observed::Ready);
        assert_eq!(check(d, Some(Running::OutOfMemory), 0), vec![Action::Stop { id: "s1".into(), reason: "oom".into() }]);
    }

    #[test]
    fn a_sandbox_that_vanished_is_reported_lost() {
        let actions = check(sandbox(Desired::Running, Observed::Ready), None, 0);
        assert!(matches!(&actions[..], [Action::Report { observation: Observation::Failed { .. }, .. }]));
    }

    #[test]
    fn orphans_are_stopped_and_removed() {
        let slice = SliceState::new("e");
        let observed = BTreeMap::from([
            ("x".to_string(), Running::Running),
            ("y".to_string(), Running::Exited { exit_code: 0, oom_killed: false }),
        ]);
        assert_eq!(
            plan(&slice, &observed, 0),
            vec![Action::Stop { id: "x".into(), reason: "orphan".into() }, Action::Remove { id: "y".into() }]
        );
    }
}
