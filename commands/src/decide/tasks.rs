//! Tasks: every live sandbox of the caller's subtree labelled `task=<name>`, paused or
//! resumed together in one logged decision.

use super::Decided;
use super::scope::Scope;
use crate::validate;
use crate::{Rejection, RejectionKind as K, TASK_LABEL};
use opendsec_projections::pb;
use opendsec_projections::{Desired, Event, Right, Sandbox};

/// The audit target of a task command.
pub(super) fn task_target(task: &str) -> String {
    format!("task:{task}")
}

/// `PauseTask`.
pub(super) fn pause(s: &Scope, task: &str) -> Result<Decided, Rejection> {
    pause_or_resume(s, task, true)
}

/// `ResumeTask`.
pub(super) fn resume(s: &Scope, task: &str) -> Result<Decided, Rejection> {
    pause_or_resume(s, task, false)
}

fn pause_or_resume(s: &Scope, task: &str, pause: bool) -> Result<Decided, Rejection> {
    validate::task("task", task)?;
    s.who.require(Right::SandboxWrite)?;
    let members: Vec<&Sandbox> = s
        .state
        .sandboxes
        .sandboxes
        .values()
        .filter(|x| x.is_live() && s.state.within(&x.project, &s.who.project))
        .filter(|x| x.labels.get(TASK_LABEL).is_some_and(|t| t == task))
        .collect();
    if members.is_empty() {
        return Err(Rejection::field(
            K::NotFound,
            "task",
            format!(
                "no live sandbox of project {} is labelled {TASK_LABEL}={task}",
                s.who.project
            ),
        ));
    }
    // Those already where they should be are left alone: the command is idempotent.
    let events = members
        .into_iter()
        .filter_map(|x| match (pause, x.desired) {
            (true, Desired::Running) => Some(Event::SandboxPauseRequested(pb::SandboxPauseRequested {
                id: x.id.clone(),
                filesystem: false,
            })),
            (false, Desired::Paused) => Some(Event::SandboxResumeRequested(pb::SandboxResumeRequested {
                id: x.id.clone(),
                cold: false,
            })),
            _ => None,
        })
        .collect();
    Ok(Decided {
        events,
        project: s.who.project.clone(),
        target: task_target(task),
    })
}
