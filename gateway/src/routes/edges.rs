//! Edges: the registered machines, with the watcher's soft heartbeat state.

use axum::Json;
use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use opendsec_commands::Command;
use opendsec_control::EdgeHeartbeat;
use opendsec_projections::Right;
use opendsec_sdk::types::{self as api, EdgeList, EdgeWritten, RegisterEdge};

use crate::convert;
use crate::error::ApiError;
use crate::extract::{Authed, JsonBody, PageQuery, Params, PathParam, RequestId};
use crate::{AppState, Written, submit};

/// Every edge with its capacity, what is assigned to it, and its last heartbeat. Needs sandbox:read.
#[utoipa::path(get, path = "/v1/edges", tag = "edges", params(("limit" = Option<usize>, Query, description = "At most this many (1-1000, default 1000)"), ("page_token" = Option<String>, Query, description = "The next_page_token of the page before"),),
    responses((status = 200, body = EdgeList), (status = "4XX", body = api::ErrorBody)))]
pub async fn list(State(st): State<AppState>, who: Authed, RawQuery(q): RawQuery) -> Result<Json<EdgeList>, ApiError> {
    let page = PageQuery::parse(&Params::parse(q.as_deref(), &["limit", "page_token"])?)?;
    who.require(Right::SandboxRead)?;
    let beats = heartbeats(&st);
    let (edges, next_page_token) = st.node.read(|s| {
        page.take(
            s.placement
                .edges
                .values()
                .map(|e| (e.id.clone(), convert::edge(e, heartbeat_of(&beats, &e.id)))),
        )
    });
    Ok(Json(EdgeList { edges, next_page_token }))
}

/// Registers an edge, or updates its address, capacity and labels. Needs edge:write.
#[utoipa::path(post, path = "/v1/edges", tag = "edges", request_body = RegisterEdge,
    responses((status = 200, body = EdgeWritten), (status = "4XX", body = api::ErrorBody)))]
pub async fn register(
    State(st): State<AppState>,
    who: Authed,
    rid: RequestId,
    JsonBody(req): JsonBody<RegisterEdge>,
) -> Result<Written<EdgeWritten>, ApiError> {
    let id = req.edge.clone();
    let cmd = Command::RegisterEdge {
        edge: req.edge,
        address: req.address,
        capacity: convert::usage(&req.capacity),
        labels: req.labels,
    };
    let s = submit(&st, &who, &rid, cmd).await?;
    let edge = read_edge(&st, &id)?;
    Ok(Written {
        index: s.index,
        status: StatusCode::OK,
        body: EdgeWritten { index: s.index, edge },
    })
}

/// Stops placing sandboxes on the edge. Needs edge:write.
#[utoipa::path(delete, path = "/v1/edges/{id}", tag = "edges", params(("id" = String, Path)),
    responses((status = 200, body = EdgeWritten), (status = "4XX", body = api::ErrorBody)))]
pub async fn deregister(
    State(st): State<AppState>,
    who: Authed,
    rid: RequestId,
    PathParam(id): PathParam<String>,
) -> Result<Written<EdgeWritten>, ApiError> {
    let s = submit(&st, &who, &rid, Command::DeregisterEdge { edge: id.clone() }).await?;
    let edge = read_edge(&st, &id)?;
    Ok(Written {
        index: s.index,
        status: StatusCode::OK,
        body: EdgeWritten { index: s.index, edge },
    })
}

fn read_edge(st: &AppState, id: &str) -> Result<api::Edge, ApiError> {
    let beats = heartbeats(st);
    st.node
        .read(|s| {
            s.placement
                .edges
                .get(id)
                .map(|e| convert::edge(e, heartbeat_of(&beats, id)))
        })
        .ok_or_else(|| ApiError::internal(format!("edge {id} was written but is not in the applied state")))
}

fn heartbeats(st: &AppState) -> Vec<EdgeHeartbeat> {
    st.node.edge_heartbeats()
}

fn heartbeat_of<'a>(beats: &'a [EdgeHeartbeat], edge: &str) -> Option<&'a EdgeHeartbeat> {
    beats.iter().find(|b| b.edge == edge)
}
