//! Tasks: every sandbox labelled `task=<name>` paused or resumed by one call (one logged
//! decision). Containers freeze; microVMs snapshot and end their VMM, then resume where
//! they were.

use axum::extract::State;
use axum::http::StatusCode;
use opendsec_commands::{Command, TASK_LABEL};
use opendsec_projections::Event;
use opendsec_sdk::types::{self as api, TaskWritten};

use crate::convert;
use crate::error::ApiError;
use crate::extract::{Authed, PathParam, RequestId};
use crate::{AppState, Written, submit};

/// Pauses every running sandbox of the caller's subtree labelled `task=<task>`. The
/// answer comes once it is logged; each sandbox's `state` is `pausing` until its edge
/// has paused it. 404 when no live sandbox carries the label. Needs sandbox:write.
#[utoipa::path(post, path = "/v1/tasks/{task}/pause", tag = "tasks", params(("task" = String, Path, description = "The value of the sandboxes' `task` label")),
    responses((status = 200, body = TaskWritten), (status = "4XX", body = api::ErrorBody)))]
pub async fn pause(
    st: State<AppState>,
    who: Authed,
    rid: RequestId,
    PathParam(task): PathParam<String>,
) -> Result<Written<TaskWritten>, ApiError> {
    act(st, who, rid, task.clone(), Command::PauseTask { task }).await
}

/// Resumes every paused sandbox of the caller's subtree labelled `task=<task>`.
/// Needs sandbox:write.
#[utoipa::path(post, path = "/v1/tasks/{task}/resume", tag = "tasks", params(("task" = String, Path, description = "The value of the sandboxes' `task` label")),
    responses((status = 200, body = TaskWritten), (status = "4XX", body = api::ErrorBody)))]
pub async fn resume(
    st: State<AppState>,
    who: Authed,
    rid: RequestId,
    PathParam(task): PathParam<String>,
) -> Result<Written<TaskWritten>, ApiError> {
    act(st, who, rid, task.clone(), Command::ResumeTask { task }).await
}

async fn act(
    State(st): State<AppState>,
    who: Authed,
    rid: RequestId,
    task: String,
    cmd: Command,
) -> Result<Written<TaskWritten>, ApiError> {
    let s = submit(&st, &who, &rid, cmd).await?;
    let changed = s
        .decided
        .events
        .iter()
        .filter_map(|e| match e {
            Event::SandboxPauseRequested(p) => Some(p.id.clone()),
            Event::SandboxResumeRequested(r) => Some(r.id.clone()),
            _ => None,
        })
        .collect();
    let sandboxes = st.node.read(|state| {
        state
            .sandboxes
            .sandboxes
            .values()
            .filter(|x| x.is_live() && who.sees(state, &x.project) && x.labels.get(TASK_LABEL) == Some(&task))
            .map(convert::sandbox)
            .collect()
    });
    Ok(Written {
        index: s.index,
        status: StatusCode::OK,
        body: TaskWritten {
            index: s.index,
            task,
            changed,
            sandboxes,
        },
    })
}
