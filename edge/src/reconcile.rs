//! Reconciliation: compare what should run here (the slice) with what runs (the
//! backend's observation) and list the actions that close the gap.
//!
//! `plan` is pure: the edge loop observes, plans, acts, and plans again whenever the
//! slice or the observation changes. Every action is idempotent, so a plan repeated
//! after a crash (of the edge or of an action) converges to the same place.
//!
//! What `plan(slice, observed, now, caught_up)` lists: create, pause, resume, stop,
//! remove, report; TTL expiry (stopped and reported with reason `timeout`, or with
//! auto-pause reported `timed_out`, after which the log says paused); lost sandboxes;
//! orphans, only once the slice is past this run's registration index (`caught_up`: a
//! restarted edge's saved slice may lack the sandbox it created just before it died); a
//! sandbox the log says ended while something of it still runs here (stopped).
//! `plan_snapshots`: take pending snapshots (idempotent: existing files are only reported
//! again), fail those whose sandbox ended, remove deleted ones. `plan_transfers`: prepare,
//! fail and remove the state this edge serves to other edges. `plan_pulls`: pull the images
//! the log has this edge pull. `plan_imports`: give up on imports whose upload never came.
//! `plan_packs`: pack the images the log has this edge make
//! from its sandboxes (failed when the sandbox no longer runs here).

use crate::desired::{DesiredSandbox, SliceState};
use opendsec_commands::Observation;
use opendsec_projections::{Desired, Observed};
use std::collections::BTreeMap;

/// A sandbox as the backend sees it on this machine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Running {
    /// Created and running.
    Running,
    /// Paused: frozen with its memory (`memory`), or with only its file system kept (its
    /// processes ended; it boots again on resume).
    Paused { memory: bool },
    /// Its main process ended (`oom_killed`: the OOM killer ended it).
    Exited { exit_code: i32, oom_killed: bool },
    /// It ended without being asked to (a microVM whose QEMU died: the guest panicked or
    /// rebooted, its agent is gone, or the process was killed), and why.
    Failed { reason: String },
}

/// The kernel's OOM killer ended processes inside a sandbox that lives on: how many over
/// its life, and the last one's program ("" when the edge could not tell).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OomKills {
    pub kills: u64,
    pub command: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Prepare storage and network and start the sandbox.
    Create { id: String },
    /// Pause it: everything kept, or (`filesystem`) only its file system, its processes
    /// ended (a sandbox paused with its memory drops it).
    Pause { id: String, filesystem: bool },
    /// Resume it: where it was, or (`cold`) booted again from its file system.
    Resume { id: String, cold: bool },
    /// Stop its processes (the sandbox then shows as exited).
    Stop { id: String, reason: String },
    /// Free everything it holds on this machine.
    Remove { id: String },
    /// Tell the control plane what was observed.
    Report { id: String, observation: Observation },
    /// Pull image `name` from `reference` into the store, and report the result.
    PullImage { name: String, reference: String },
    /// Make image `name` from sandbox `sandbox`'s writable layer (residue and `scrub` left
    /// out) on top of its image, and report the result.
    PackImage {
        name: String,
        sandbox: String,
        scrub: Vec<String>,
    },
    /// Image `name` cannot be made here: report it failed.
    FailImage { name: String, reason: String },
    /// Capture sandbox `sandbox`'s file system as snapshot `id`, and report it.
    TakeSnapshot { id: String, sandbox: String },
    /// Remove a deleted snapshot's files.
    RemoveSnapshot { id: String },
    /// A snapshot cannot be taken (its sandbox ended first).
    FailSnapshot { id: String, reason: String },
    /// Prepare transfer `id` (state this edge holds) for the edges that pull it.
    MakeTransfer { id: String },
    /// The state of transfer `id` cannot be had: say so to the edges that ask.
    FailTransfer { id: String, reason: String },
    /// Every edge has pulled transfer `id`: remove its files.
    RemoveTransfer { id: String },
}

fn report(id: &str, observation: Observation) -> Action {
    Action::Report {
        id: id.to_string(),
        observation,
    }
}

/// The actions for one sandbox of the slice.
fn plan_one(d: &DesiredSandbox, seen: Option<&Running>, now_ms: u64) -> Vec<Action> {
    let id = d.id.clone();
    // The log says it ended (reported failed), yet something of it still runs here:
    // end that too, so nothing the log does not count runs on.
    if d.is_terminal() && matches!(seen, Some(Running::Running | Running::Paused { .. })) {
        return vec![Action::Stop {
            id,
            reason: "ended".into(),
        }];
    }
    let expired = d.expires_at_ms.is_some_and(|at| at <= now_ms);
    // Auto-pause: past its timeout it pauses instead of dying, once the log says so.
    if expired
        && d.auto_pause
        && d.desired == Desired::Running
        && matches!(seen, Some(Running::Running | Running::Paused { .. }))
    {
        return vec![report(&id, Observation::TimedOut)];
    }
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
                vec![report(
                    &id,
                    Observation::Exited {
                        exit_code: *exit_code,
                        oom_killed: *oom_killed,
                        reason,
                    },
                )]
            }
        }
        // Ended on its own: report why once (as an exit, if it was to end anyway), then free it.
        (Some(Running::Failed { reason: why }), reason) => {
            if d.is_terminal() {
                vec![Action::Remove { id }]
            } else if let Some(reason) = reason {
                vec![report(
                    &id,
                    Observation::Exited {
                        exit_code: 137,
                        oom_killed: false,
                        reason,
                    },
                )]
            } else {
                vec![report(&id, Observation::Failed { reason: why.clone() })]
            }
        }
        // Must end: stop it; its exit is reported on the next round.
        (Some(_), Some(reason)) => vec![Action::Stop { id, reason }],
        // Gone, and must end: say so if the log does not know yet.
        (None, Some(reason)) => {
            if d.is_terminal() {
                vec![]
            } else {
                vec![report(
                    &id,
                    Observation::Exited {
                        exit_code: 137,
                        oom_killed: false,
                        reason,
                    },
                )]
            }
        }
        (None, None) => match d.observed {
            Observed::Pending => vec![Action::Create { id }],
            Observed::Exited | Observed::Failed => vec![],
            // It ran here once and is gone (the machine rebooted, someone removed it).
            Observed::Ready | Observed::Paused => vec![report(
                &id,
                Observation::Failed {
                    reason: "lost: the sandbox no longer exists on its edge".into(),
                },
            )],
        },
        (Some(Running::Running), None) => match (d.desired, d.observed) {
            (Desired::Paused, _) => vec![Action::Pause {
                id,
                filesystem: d.pause_filesystem,
            }],
            (_, Observed::Pending) => vec![report(&id, Observation::Ready)],
            (_, Observed::Paused) => vec![report(&id, Observation::Resumed)],
            _ => vec![],
        },
        (Some(Running::Paused { memory }), None) => match (d.desired, d.observed) {
            (Desired::Running, _) => vec![Action::Resume {
                id,
                cold: d.pause_filesystem,
            }],
            // Its pause is to keep only the file system, yet it holds its memory (a resume
            // that drops memory was asked, then a pause, before this edge acted): drop it.
            (Desired::Paused, _) if d.pause_filesystem && *memory => vec![Action::Pause { id, filesystem: true }],
            (_, Observed::Paused) => vec![],
            _ => vec![report(&id, Observation::Paused)],
        },
    }
}

/// The OOM kills to report: those seen inside a sandbox that the log does not count yet.
/// The sandbox lives on (as a VM would); one that is ending has nothing more to say.
pub fn plan_oom(slice: &SliceState, seen: &BTreeMap<String, OomKills>) -> Vec<Action> {
    seen.iter()
        .filter_map(|(id, o)| {
            let d = slice.sandboxes.get(id)?;
            (o.kills > d.oom_kills && !d.is_terminal() && d.desired != Desired::Killed).then(|| {
                report(
                    id,
                    Observation::OomKilled {
                        kills: o.kills,
                        command: o.command.clone(),
                    },
                )
            })
        })
        .collect()
}

/// The pulls this edge is to make: every image the log has it pull and that has not been
/// reported, unless it is already being pulled (`pulling`). A pull that failed here is
/// reported failed and leaves the slice; one whose report was lost is made again (its
/// layers are stored, so that is quick).
pub fn plan_pulls(slice: &SliceState, pulling: &std::collections::BTreeSet<String>) -> Vec<Action> {
    slice
        .pulls
        .iter()
        .filter(|(name, _)| !pulling.contains(*name))
        .map(|(name, reference)| Action::PullImage {
            name: name.clone(),
            reference: reference.clone(),
        })
        .collect()
}

/// The packs this edge is to make: every image the log has it pack from one of its
/// sandboxes and that has not been reported, unless it is under way (`under_way`, shared
/// with pulls: one name is made once at a time). A pack whose sandbox is neither running
/// nor paused here is reported failed. One whose report was lost is made again.
pub fn plan_packs(
    slice: &SliceState,
    observed: &BTreeMap<String, Running>,
    under_way: &std::collections::BTreeSet<String>,
) -> Vec<Action> {
    slice
        .packs
        .iter()
        .filter(|(name, _)| !under_way.contains(*name))
        .map(|(name, p)| match observed.get(&p.sandbox) {
            Some(Running::Running | Running::Paused { .. }) => Action::PackImage {
                name: name.clone(),
                sandbox: p.sandbox.clone(),
                scrub: p.scrub.clone(),
            },
            _ => Action::FailImage {
                name: name.clone(),
                reason: format!("sandbox {} ended before it was packed", p.sandbox),
            },
        })
        .collect()
}

/// The imports this edge gives up on: every image the log has it import whose upload is
/// not under way (`under_way`) and was awaited too long (`overdue`: the caller's upload
/// was cut off, or never came, e.g. the gateway died in between) is reported failed. An
/// upload that arrives later is refused; the caller imports again.
pub fn plan_imports(
    slice: &SliceState,
    under_way: &std::collections::BTreeSet<String>,
    overdue: impl Fn(&str) -> bool,
) -> Vec<Action> {
    slice
        .imports
        .iter()
        .filter(|name| !under_way.contains(*name) && overdue(name))
        .map(|name| Action::FailImage {
            name: name.clone(),
            reason: format!(
                "no tarball of image {name} reached edge {} in time (the upload was cut off, or never \
                 started); import it again (opendsecctl image import)",
                slice.edge
            ),
        })
        .collect()
}

/// The snapshot actions: take the pending ones whose sandbox still runs here (a snapshot
/// of a sandbox that ended is reported failed), remove the files of deleted ones.
/// `present`: the snapshots whose files exist on this machine.
pub fn plan_snapshots(
    slice: &SliceState,
    observed: &BTreeMap<String, Running>,
    present: &std::collections::BTreeSet<String>,
) -> Vec<Action> {
    use crate::desired::SnapshotPhase;
    let mut out = Vec::new();
    for x in slice.snapshots.values() {
        match x.phase {
            // Taken: (re)report it until the log shows it ready.
            SnapshotPhase::Pending if present.contains(&x.id) => out.push(Action::TakeSnapshot {
                id: x.id.clone(),
                sandbox: x.sandbox.clone(),
            }),
            SnapshotPhase::Pending => match observed.get(&x.sandbox) {
                Some(Running::Running | Running::Paused { .. }) => out.push(Action::TakeSnapshot {
                    id: x.id.clone(),
                    sandbox: x.sandbox.clone(),
                }),
                _ => out.push(Action::FailSnapshot {
                    id: x.id.clone(),
                    reason: format!("sandbox {} ended before its snapshot was taken", x.sandbox),
                }),
            },
            SnapshotPhase::Deleted if present.contains(&x.id) => out.push(Action::RemoveSnapshot { id: x.id.clone() }),
            _ => {}
        }
    }
    out
}

/// The actions for the state this edge serves to others: prepare what some edge still has
/// to pull (a fork's source must run here, a snapshot must be ready), say why it cannot be
/// had, remove what every edge has pulled. `present`: the transfers prepared or failed.
pub fn plan_transfers(
    slice: &SliceState,
    observed: &BTreeMap<String, Running>,
    present: &std::collections::BTreeSet<String>,
) -> Vec<Action> {
    use crate::desired::{SnapshotPhase, TransferSource};
    let mut out = Vec::new();
    for t in slice.served.values() {
        let id = t.id.clone();
        if !t.is_wanted() {
            if present.contains(&id) {
                out.push(Action::RemoveTransfer { id });
            }
            continue;
        }
        if present.contains(&id) {
            continue;
        }
        match &t.source {
            TransferSource::Fork { sandbox } => match (observed.get(sandbox), slice.sandboxes.get(sandbox)) {
                (Some(Running::Running | Running::Paused { .. }), _) => out.push(Action::MakeTransfer { id }),
                // Not created yet here: it will be.
                (None, Some(d)) if d.observed == Observed::Pending && d.desired != Desired::Killed => {}
                _ => out.push(Action::FailTransfer {
                    id,
                    reason: format!("sandbox {sandbox}, the fork's source, no longer runs on its edge"),
                }),
            },
            TransferSource::Snapshot { snapshot } => match slice.snapshots.get(snapshot).map(|x| x.phase) {
                Some(SnapshotPhase::Ready) => out.push(Action::MakeTransfer { id }),
                Some(SnapshotPhase::Pending) => {}
                _ => out.push(Action::FailTransfer {
                    id,
                    reason: format!("snapshot {snapshot} no longer exists on its edge"),
                }),
            },
        }
    }
    out
}

/// Everything to do to bring this machine to the slice. Sandboxes running here that the
/// slice does not know (orphans) are stopped and removed, but only once `caught_up`: the
/// slice holds every entry committed before this edge (re)started. A restarted edge's
/// saved slice can lack a sandbox it created just before it died (it acts on an entry,
/// then saves); that sandbox is no orphan, and the log will say so.
pub fn plan(slice: &SliceState, observed: &BTreeMap<String, Running>, now_ms: u64, caught_up: bool) -> Vec<Action> {
    let mut actions = Vec::new();
    for d in slice.sandboxes.values() {
        actions.extend(plan_one(d, observed.get(&d.id), now_ms));
    }
    if !caught_up {
        return actions;
    }
    for (id, state) in observed {
        if !slice.sandboxes.contains_key(id) {
            match state {
                Running::Exited { .. } | Running::Failed { .. } => actions.push(Action::Remove { id: id.clone() }),
                _ => actions.push(Action::Stop {
                    id: id.clone(),
                    reason: "orphan".into(),
                }),
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
            env: BTreeMap::new(),
            auto_pause: false,
            auto_pause_filesystem: false,
            pause_filesystem: false,
            snapshot: None,
            isolation: Default::default(),
            source_edge: None,
            transfer: None,
            oom_kills: 0,
            cpu_class: Default::default(),
            image_source: None,
            network: None,
        }
    }

    #[test]
    fn a_sandbox_the_log_says_failed_is_not_left_running_or_resumed() {
        let d = sandbox(Desired::Running, Observed::Failed);
        for seen in [Running::Running, Running::Paused { memory: true }] {
            assert_eq!(
                check(d.clone(), Some(seen), 0),
                vec![Action::Stop {
                    id: "s1".into(),
                    reason: "ended".into()
                }]
            );
        }
        assert_eq!(
            check(
                d.clone(),
                Some(Running::Exited {
                    exit_code: 137,
                    oom_killed: false
                }),
                0
            ),
            vec![Action::Remove { id: "s1".into() }]
        );
        assert_eq!(check(d, None, 0), vec![]);
    }

    #[test]
    fn a_sandbox_that_ended_on_its_own_is_reported_failed_with_why_once_then_freed() {
        let died = Some(Running::Failed {
            reason: "the microVM ended: its QEMU exited with code 0".into(),
        });
        let mut d = sandbox(Desired::Running, Observed::Ready);
        assert_eq!(
            check(d.clone(), died.clone(), 0),
            rep(Observation::Failed {
                reason: "the microVM ended: its QEMU exited with code 0".into()
            })
        );
        // Killed on purpose (a stop kills a running VM's QEMU): that is an exit for the asked reason.
        d.desired = Desired::Killed;
        d.kill_reason = Some("user".into());
        assert_eq!(
            check(d.clone(), died.clone(), 0),
            rep(Observation::Exited {
                exit_code: 137,
                oom_killed: false,
                reason: "user".into()
            })
        );
        d.observed = Observed::Exited;
        assert_eq!(check(d, died, 0), vec![Action::Remove { id: "s1".into() }]);
    }

    #[test]
    fn an_expired_sandbox_with_auto_pause_asks_to_pause_instead_of_stopping() {
        let mut d = sandbox(Desired::Running, Observed::Ready);
        d.auto_pause = true;
        d.expires_at_ms = Some(1_000);
        assert_eq!(check(d.clone(), Some(Running::Running), 999), vec![]);
        assert_eq!(
            check(d.clone(), Some(Running::Running), 1_000),
            rep(Observation::TimedOut)
        );
        // Once the log recorded it (desired paused, timeout spent), it is simply paused.
        d.desired = Desired::Paused;
        d.expires_at_ms = None;
        assert_eq!(
            check(d, Some(Running::Running), 5_000),
            vec![Action::Pause {
                id: "s1".into(),
                filesystem: false
            }]
        );
    }

    #[test]
    fn requested_pulls_are_made_once_at_a_time_until_reported() {
        let mut slice = SliceState::new("e1");
        slice
            .pulls
            .insert("py".into(), "127.0.0.1:5000/python:3.12-slim".into());
        slice.pulls.insert("env".into(), "127.0.0.1:5000/env:1".into());
        let pulling: std::collections::BTreeSet<String> = ["env".to_string()].into();
        assert_eq!(
            plan_pulls(&slice, &pulling),
            vec![Action::PullImage {
                name: "py".into(),
                reference: "127.0.0.1:5000/python:3.12-slim".into()
            }]
        );
        slice.pulls.clear();
        assert_eq!(plan_pulls(&slice, &Default::default()), vec![]);
    }

    #[test]
    fn requested_packs_are_made_once_at_a_time_while_their_sandbox_runs_here() {
        use crate::desired::DesiredPack;
        let mut slice = SliceState::new("e1");
        for (name, sandbox) in [("env", "s1"), ("busy", "s2"), ("late", "s3"), ("gone", "s4")] {
            let pack = DesiredPack {
                sandbox: sandbox.into(),
                scrub: vec!["/etc/token".into()],
                config: None,
            };
            slice.packs.insert(name.into(), pack);
        }
        let observed: BTreeMap<String, Running> = [
            ("s1".to_string(), Running::Paused { memory: true }),
            ("s2".to_string(), Running::Running),
            (
                "s3".to_string(),
                Running::Exited {
                    exit_code: 0,
                    oom_killed: false,
                },
            ),
        ]
        .into();
        let under_way: std::collections::BTreeSet<String> = ["busy".to_string()].into();
        assert_eq!(
            plan_packs(&slice, &observed, &under_way),
            vec![
                Action::PackImage {
                    name: "env".into(),
                    sandbox: "s1".into(),
                    scrub: vec!["/etc/token".into()]
                },
                Action::FailImage {
                    name: "gone".into(),
                    reason: "sandbox s4 ended before it was packed".into()
                },
                Action::FailImage {
                    name: "late".into(),
                    reason: "sandbox s3 ended before it was packed".into()
                },
            ]
        );
        slice.packs.clear();
        assert_eq!(plan_packs(&slice, &observed, &Default::default()), vec![]);
    }

    #[test]
    fn an_import_whose_upload_never_comes_is_reported_failed_once_overdue() {
        let mut slice = SliceState::new("e1");
        slice
            .imports
            .extend(["late".to_string(), "fresh".into(), "receiving".into()]);
        let under_way: std::collections::BTreeSet<String> = ["receiving".to_string()].into();
        let actions = plan_imports(&slice, &under_way, |name| name != "fresh");
        assert_eq!(actions.len(), 1, "{actions:?}");
        match &actions[0] {
            Action::FailImage { name, reason } => {
                assert_eq!(name, "late");
                assert!(reason.contains("import it again"), "{reason}");
            }
            other => panic!("not a failure: {other:?}"),
        }
        assert_eq!(plan_imports(&slice, &under_way, |_| false), vec![]);
    }

    #[test]
    fn snapshots_are_taken_while_their_sandbox_runs_and_removed_once_deleted() {
        use crate::desired::{DesiredSnapshot, SnapshotPhase};
        use std::collections::BTreeSet;
        let mut slice = SliceState::new("e");
        let snap = |id: &str, phase| DesiredSnapshot {
            id: id.into(),
            sandbox: "s1".into(),
            image: "busybox".into(),
            parent: None,
            phase,
            isolation: Default::default(),
        };
        slice.snapshots.insert("a".into(), snap("a", SnapshotPhase::Pending));
        slice.snapshots.insert("b".into(), snap("b", SnapshotPhase::Deleted));
        slice.snapshots.insert("c".into(), snap("c", SnapshotPhase::Ready));
        let running: BTreeMap<_, _> = [("s1".to_string(), Running::Running)].into();
        let present: BTreeSet<String> = ["b".to_string(), "c".to_string()].into();
        assert_eq!(
            plan_snapshots(&slice, &running, &present),
            vec![
                Action::TakeSnapshot {
                    id: "a".into(),
                    sandbox: "s1".into()
                },
                Action::RemoveSnapshot { id: "b".into() }
            ]
        );
        // Taken (its files exist) but not yet shown ready: reported again, even if its
        // sandbox has ended since (taking is idempotent: existing files are not retaken).
        let taken: BTreeSet<String> = ["a".to_string()].into();
        assert_eq!(
            plan_snapshots(&slice, &BTreeMap::new(), &taken),
            vec![Action::TakeSnapshot {
                id: "a".into(),
                sandbox: "s1".into()
            }]
        );
        // Its sandbox is gone: the snapshot fails rather than waiting for ever.
        let gone = BTreeMap::new();
        assert!(
            matches!(&plan_snapshots(&slice, &gone, &BTreeSet::new())[0], Action::FailSnapshot { id, .. } if id == "a")
        );
    }

    #[test]
    fn served_state_is_prepared_while_an_edge_still_has_to_pull_it_then_removed() {
        use crate::desired::{DesiredSnapshot, ServedTransfer, SnapshotPhase, TransferSource};
        use std::collections::BTreeSet;
        let mut slice = SliceState::new("e1");
        slice
            .sandboxes
            .insert("s1".into(), sandbox(Desired::Running, Observed::Ready));
        let served = |id: &str, source| ServedTransfer {
            id: id.into(),
            source,
            isolation: Default::default(),
            destinations: [("c1".to_string(), "e2".to_string())].into(),
            pulled: BTreeSet::new(),
        };
        slice.served.insert(
            "fork-c1".into(),
            served("fork-c1", TransferSource::Fork { sandbox: "s1".into() }),
        );
        slice.served.insert(
            "snap-1".into(),
            served(
                "snap-1",
                TransferSource::Snapshot {
                    snapshot: "snap-1".into(),
                },
            ),
        );
        slice.snapshots.insert(
            "snap-1".into(),
            DesiredSnapshot {
                id: "snap-1".into(),
                sandbox: "s1".into(),
                image: "busybox".into(),
                parent: None,
                phase: SnapshotPhase::Ready,
                isolation: Default::default(),
            },
        );
        let running: BTreeMap<_, _> = [("s1".to_string(), Running::Running)].into();
        let none = BTreeSet::new();
        assert_eq!(
            plan_transfers(&slice, &running, &none),
            vec![
                Action::MakeTransfer { id: "fork-c1".into() },
                Action::MakeTransfer { id: "snap-1".into() }
            ]
        );
        // Prepared: nothing to do until it is pulled; then its files go.
        let both: BTreeSet<String> = ["fork-c1".to_string(), "snap-1".to_string()].into();
        assert_eq!(plan_transfers(&slice, &running, &both), vec![]);
        slice.served.get_mut("fork-c1").unwrap().pulled.insert("c1".into());
        assert_eq!(
            plan_transfers(&slice, &running, &both),
            vec![Action::RemoveTransfer { id: "fork-c1".into() }]
        );
        // A fork whose source ended, a snapshot deleted: the pulling edge is told why.
        slice.served.get_mut("fork-c1").unwrap().pulled.clear();
        slice.snapshots.get_mut("snap-1").unwrap().phase = SnapshotPhase::Deleted;
        let actions = plan_transfers(&slice, &BTreeMap::new(), &none);
        assert!(
            matches!(&actions[..], [Action::FailTransfer { id: a, reason: ra }, Action::FailTransfer { id: b, .. }]
            if a == "fork-c1" && b == "snap-1" && ra.contains("no longer runs")),
            "{actions:?}"
        );
    }

    fn check(d: DesiredSandbox, seen: Option<Running>, now: u64) -> Vec<Action> {
        let mut slice = SliceState::new("e");
        slice.sandboxes.insert(d.id.clone(), d);
        let observed: BTreeMap<_, _> = seen.into_iter().map(|r| ("s1".to_string(), r)).collect();
        plan(&slice, &observed, now, true)
    }

    fn rep(o: Observation) -> Vec<Action> {
        vec![Action::Report {
            id: "s1".into(),
            observation: o,
        }]
    }

    #[test]
    fn a_new_sandbox_is_created_then_reported_ready() {
        assert_eq!(
            check(sandbox(Desired::Running, Observed::Pending), None, 0),
            vec![Action::Create { id: "s1".into() }]
        );
        assert_eq!(
            check(sandbox(Desired::Running, Observed::Pending), Some(Running::Running), 0),
            rep(Observation::Ready)
        );
        assert_eq!(
            check(sandbox(Desired::Running, Observed::Ready), Some(Running::Running), 0),
            vec![]
        );
    }

    #[test]
    fn pause_and_resume_follow_the_desired_state() {
        let frozen = Some(Running::Paused { memory: true });
        assert_eq!(
            check(sandbox(Desired::Paused, Observed::Ready), Some(Running::Running), 0),
            vec![Action::Pause {
                id: "s1".into(),
                filesystem: false
            }]
        );
        assert_eq!(
            check(sandbox(Desired::Paused, Observed::Ready), frozen.clone(), 0),
            rep(Observation::Paused)
        );
        assert_eq!(
            check(sandbox(Desired::Paused, Observed::Paused), frozen.clone(), 0),
            vec![]
        );
        assert_eq!(
            check(sandbox(Desired::Running, Observed::Paused), frozen, 0),
            vec![Action::Resume {
                id: "s1".into(),
                cold: false
            }]
        );
        assert_eq!(
            check(sandbox(Desired::Running, Observed::Paused), Some(Running::Running), 0),
            rep(Observation::Resumed)
        );
    }

    #[test]
    fn a_file_system_pause_ends_the_processes_and_its_resume_boots_again() {
        let fs = |desired, observed| DesiredSandbox {
            pause_filesystem: true,
            ..sandbox(desired, observed)
        };
        let stored = Some(Running::Paused { memory: false });
        assert_eq!(
            check(fs(Desired::Paused, Observed::Ready), Some(Running::Running), 0),
            vec![Action::Pause {
                id: "s1".into(),
                filesystem: true
            }]
        );
        assert_eq!(
            check(fs(Desired::Paused, Observed::Ready), stored.clone(), 0),
            rep(Observation::Paused)
        );
        assert_eq!(check(fs(Desired::Paused, Observed::Paused), stored.clone(), 0), vec![]);
        assert_eq!(
            check(fs(Desired::Running, Observed::Paused), stored, 0),
            vec![Action::Resume {
                id: "s1".into(),
                cold: true
            }]
        );
        // Frozen with its memory while its pause is to keep only the file system: the
        // memory goes; and a resume that drops memory boots it again.
        let frozen = Some(Running::Paused { memory: true });
        assert_eq!(
            check(fs(Desired::Paused, Observed::Paused), frozen.clone(), 0),
            vec![Action::Pause {
                id: "s1".into(),
                filesystem: true
            }]
        );
        assert_eq!(
            check(fs(Desired::Running, Observed::Paused), frozen, 0),
            vec![Action::Resume {
                id: "s1".into(),
                cold: true
            }]
        );
    }

    #[test]
    fn a_kill_stops_reports_once_and_frees() {
        let mut d = sandbox(Desired::Killed, Observed::Ready);
        d.kill_reason = Some("user".into());
        assert_eq!(
            check(d.clone(), Some(Running::Running), 0),
            vec![Action::Stop {
                id: "s1".into(),
                reason: "user".into()
            }]
        );
        let exited = Some(Running::Exited {
            exit_code: 137,
            oom_killed: false,
        });
        assert_eq!(
            check(d.clone(), exited.clone(), 0),
            rep(Observation::Exited {
                exit_code: 137,
                oom_killed: false,
                reason: "user".into()
            })
        );
        d.observed = Observed::Exited;
        assert_eq!(check(d.clone(), exited, 0), vec![Action::Remove { id: "s1".into() }]);
        assert_eq!(check(d, None, 0), vec![]);
    }

    #[test]
    fn an_expired_sandbox_is_stopped_for_timeout() {
        let mut d = sandbox(Desired::Running, Observed::Ready);
        d.expires_at_ms = Some(1_000);
        assert_eq!(check(d.clone(), Some(Running::Running), 999), vec![]);
        assert_eq!(
            check(d.clone(), Some(Running::Running), 1_000),
            vec![Action::Stop {
                id: "s1".into(),
                reason: "timeout".into()
            }]
        );
        assert_eq!(
            check(
                d,
                Some(Running::Exited {
                    exit_code: 137,
                    oom_killed: false
                }),
                1_001
            ),
            rep(Observation::Exited {
                exit_code: 137,
                oom_killed: false,
                reason: "timeout".into()
            })
        );
    }

    #[test]
    fn an_oom_kill_is_reported_as_such() {
        let d = sandbox(Desired::Running, Observed::Ready);
        assert_eq!(
            check(
                d,
                Some(Running::Exited {
                    exit_code: 137,
                    oom_killed: true
                }),
                0
            ),
            rep(Observation::Exited {
                exit_code: 137,
                oom_killed: true,
                reason: "oom".into()
            })
        );
    }

    fn oom_seen(id: &str, kills: u64, command: &str) -> BTreeMap<String, OomKills> {
        BTreeMap::from([(
            id.to_string(),
            OomKills {
                kills,
                command: command.into(),
            },
        )])
    }

    #[test]
    fn a_process_killed_for_memory_is_reported_and_the_sandbox_runs_on() {
        let d = sandbox(Desired::Running, Observed::Ready);
        // Running, with one kill seen: nothing is stopped...
        assert_eq!(check(d.clone(), Some(Running::Running), 0), vec![]);
        // ...and the kill is reported until the log counts it.
        let mut slice = SliceState::default();
        slice.sandboxes.insert("s1".into(), d);
        assert_eq!(
            plan_oom(&slice, &oom_seen("s1", 1, "python3")),
            rep(Observation::OomKilled {
                kills: 1,
                command: "python3".into()
            })
        );
        slice.sandboxes.get_mut("s1").unwrap().oom_kills = 1;
        assert_eq!(plan_oom(&slice, &oom_seen("s1", 1, "python3")), vec![]);
        assert_eq!(
            plan_oom(&slice, &oom_seen("s1", 3, "node")),
            rep(Observation::OomKilled {
                kills: 3,
                command: "node".into()
            })
        );
    }

    #[test]
    fn a_sandbox_that_is_ending_reports_no_more_oom_kills() {
        let mut slice = SliceState::default();
        slice
            .sandboxes
            .insert("s1".into(), sandbox(Desired::Killed, Observed::Ready));
        assert_eq!(plan_oom(&slice, &oom_seen("s1", 1, "x")), vec![]);
        slice
            .sandboxes
            .insert("s1".into(), sandbox(Desired::Running, Observed::Exited));
        assert_eq!(plan_oom(&slice, &oom_seen("s1", 1, "x")), vec![]);
        // Not in the slice at all (an orphan): nothing to report either.
        assert_eq!(plan_oom(&SliceState::default(), &oom_seen("s1", 1, "x")), vec![]);
    }

    #[test]
    fn a_sandbox_that_vanished_is_reported_lost() {
        let actions = check(sandbox(Desired::Running, Observed::Ready), None, 0);
        assert!(matches!(
            &actions[..],
            [Action::Report {
                observation: Observation::Failed { .. },
                ..
            }]
        ));
    }

    #[test]
    fn orphans_are_stopped_and_removed() {
        let slice = SliceState::new("e");
        let observed = BTreeMap::from([
            ("x".to_string(), Running::Running),
            (
                "y".to_string(),
                Running::Exited {
                    exit_code: 0,
                    oom_killed: false,
                },
            ),
        ]);
        assert_eq!(
            plan(&slice, &observed, 0, true),
            vec![
                Action::Stop {
                    id: "x".into(),
                    reason: "orphan".into()
                },
                Action::Remove { id: "y".into() }
            ]
        );
    }

    #[test]
    fn a_slice_behind_the_log_leaves_unknown_sandboxes_alone() {
        // A restarted edge whose saved slice predates its last create: until the slice has
        // caught up, what it does not know may be in the log.
        let slice = SliceState::new("e");
        let observed = BTreeMap::from([
            ("x".to_string(), Running::Running),
            (
                "y".to_string(),
                Running::Exited {
                    exit_code: 0,
                    oom_killed: false,
                },
            ),
        ]);
        assert_eq!(plan(&slice, &observed, 0, false), vec![]);
    }
}
