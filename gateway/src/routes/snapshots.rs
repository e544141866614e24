//! Snapshots: a sandbox captured on its edge (a container's file system, a microVM's
//! memory, device state and disk). Sandboxes start from one with `image` = its id.

use axum::Json;
use axum::body::Bytes;
use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use opendsec_commands::Command;
use opendsec_projections::Right;
use opendsec_sdk::types::{self as api, CreateSnapshot, SnapshotList, SnapshotWritten};

use crate::convert;
use crate::error::ApiError;
use crate::extract::{Authed, PageQuery, Params, PathParam, RequestId, decode_json};
use crate::{AppState, Written, submit};

/// Takes a snapshot of a sandbox that has run (running or paused). The answer comes
/// once it is logged: `state` is `pending` until the edge has taken it (then `ready`, or
/// `failed` with a reason); poll `GET /v1/snapshots/{id}`. The body may be empty.
/// Needs sandbox:write.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/snapshots", tag = "snapshots", params(("id" = String, Path)), request_body = CreateSnapshot,
    responses((status = 201, body = SnapshotWritten), (status = "4XX", body = api::ErrorBody)))]
pub async fn create(
    State(st): State<AppState>,
    who: Authed,
    rid: RequestId,
    PathParam(id): PathParam<String>,
    body: Bytes,
) -> Result<Written<SnapshotWritten>, ApiError> {
    let req: CreateSnapshot = if body.iter().all(u8::is_ascii_whitespace) {
        CreateSnapshot::default()
    } else {
        decode_json(&body)?
    };
    let cmd = Command::CreateSnapshot {
        sandbox: id,
        name: req.name.unwrap_or_default(),
    };
    let s = submit(&st, &who, &rid, cmd).await?;
    let snapshot = read(&st, &s.decided.target)?;
    Ok(Written {
        index: s.index,
        status: StatusCode::CREATED,
        body: SnapshotWritten {
            index: s.index,
            snapshot,
        },
    })
}

/// Snapshots in the caller's subtree (deleted ones are gone). Needs sandbox:read.
#[utoipa::path(get, path = "/v1/snapshots", tag = "snapshots",
    params(("sandbox" = Option<String>, Query, description = "Only those taken of this sandbox"), ("limit" = Option<usize>, Query, description = "At most this many (1-1000, default 1000)"), ("page_token" = Option<String>, Query, description = "The next_page_token of the page before"),),
    responses((status = 200, body = SnapshotList), (status = "4XX", body = api::ErrorBody)))]
pub async fn list(
    State(st): State<AppState>,
    who: Authed,
    RawQuery(q): RawQuery,
) -> Result<Json<SnapshotList>, ApiError> {
    let params = Params::parse(q.as_deref(), &["sandbox", "limit", "page_token"])?;
    let page = PageQuery::parse(&params)?;
    let sandbox = params.one("sandbox")?;
    who.require(Right::SandboxRead)?;
    let snapshots = st.node.read(|s| {
        let snapshots = s
            .snapshots
            .snapshots
            .values()
            .filter(|x| who.sees(s, &x.project))
            .filter(|x| sandbox.is_none_or(|w| x.sandbox == w))
            .map(|x| (x.id.clone(), convert::snapshot(x)));
        page.take(snapshots)
    });
    Ok(Json(SnapshotList {
        snapshots: snapshots.0,
        next_page_token: snapshots.1,
    }))
}

#[utoipa::path(get, path = "/v1/snapshots/{id}", tag = "snapshots", params(("id" = String, Path)),
    responses((status = 200, body = api::Snapshot), (status = "4XX", body = api::ErrorBody)))]
pub async fn get(
    State(st): State<AppState>,
    who: Authed,
    PathParam(id): PathParam<String>,
) -> Result<Json<api::Snapshot>, ApiError> {
    who.require(Right::SandboxRead)?;
    st.node.read(|s| {
        let x = s
            .snapshots
            .snapshots
            .get(&id)
            .ok_or_else(|| ApiError::not_found("id", format!("snapshot {id} does not exist")))?;
        if !who.sees(s, &x.project) {
            return Err(ApiError::forbidden(format!(
                "snapshot {id} is outside this token's project {}",
                who.0.project
            )));
        }
        Ok(Json(convert::snapshot(x)))
    })
}

/// Deletes a snapshot; its edge removes its files. Sandboxes started from it run on.
/// Needs sandbox:write.
#[utoipa::path(delete, path = "/v1/snapshots/{id}", tag = "snapshots", params(("id" = String, Path)),
    responses((status = 200, body = api::Done), (status = "4XX", body = api::ErrorBody)))]
pub async fn delete(
    State(st): State<AppState>,
    who: Authed,
    rid: RequestId,
    PathParam(id): PathParam<String>,
) -> Result<Written<api::Done>, ApiError> {
    let s = submit(&st, &who, &rid, Command::DeleteSnapshot { snapshot: id }).await?;
    Ok(Written {
        index: s.index,
        status: StatusCode::OK,
        body: api::Done { index: s.index },
    })
}

fn read(st: &AppState, id: &str) -> Result<api::Snapshot, ApiError> {
    st.node
        .read(|s| s.snapshots.snapshots.get(id).map(convert::snapshot))
        .ok_or_else(|| ApiError::internal(format!("snapshot {id} was written but is not in the applied state")))
}
