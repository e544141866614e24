//! Cluster status and Raft membership.

use axum::Json;
use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use opendsec_projections::Right;
use opendsec_sdk::types::{self as api, AddMember, ClusterStatus};

use crate::error::ApiError;
use crate::extract::{Authed, JsonBody, Params, PathParam, RequestId};
use crate::{AppState, Written};

/// This node's view of the cluster: leader, term, indexes, members, state hash.
#[utoipa::path(get, path = "/v1/cluster", tag = "cluster",
    responses((status = 200, body = ClusterStatus), (status = "4XX", body = api::ErrorBody)))]
pub async fn status(
    State(st): State<AppState>,
    _who: Authed,
    RawQuery(q): RawQuery,
) -> Result<Json<ClusterStatus>, ApiError> {
    Params::parse(q.as_deref(), &[])?;
    Ok(Json(cluster_status(&st)?))
}

/// Adds a node to the Raft cluster (as a learner first, then a voter). Needs cluster:admin.
#[utoipa::path(post, path = "/v1/cluster/members", tag = "cluster", request_body = AddMember,
    responses((status = 200, body = ClusterStatus), (status = "4XX", body = api::ErrorBody), (status = 503, body = api::ErrorBody)))]
pub async fn add_member(
    State(st): State<AppState>,
    who: Authed,
    rid: RequestId,
    JsonBody(req): JsonBody<AddMember>,
) -> Result<Written<ClusterStatus>, ApiError> {
    who.require(Right::ClusterAdmin)?;
    if req.addr.is_empty()
        || req.addr.len() > 255
        || req.addr.chars().any(|c| c.is_whitespace() || c.is_control())
        || !req.addr.contains(':')
    {
        return Err(ApiError::invalid(
            "addr",
            "addr must be host:port, at most 255 characters",
        ));
    }
    tracing::info!(member = req.id, addr = %req.addr, by = %who.0.token_id, "adding cluster member");
    st.node.add_member(who.0.credential(), rid.0, req.id, req.addr).await?;
    let status = cluster_status(&st)?;
    Ok(Written {
        index: status.last_log_index,
        status: StatusCode::OK,
        body: status,
    })
}

/// Removes a node from the Raft cluster. Needs cluster:admin.
#[utoipa::path(delete, path = "/v1/cluster/members/{id}", tag = "cluster", params(("id" = u64, Path)),
    responses((status = 200, body = ClusterStatus), (status = "4XX", body = api::ErrorBody), (status = 503, body = api::ErrorBody)))]
pub async fn remove_member(
    State(st): State<AppState>,
    who: Authed,
    rid: RequestId,
    PathParam(id): PathParam<u64>,
) -> Result<Written<ClusterStatus>, ApiError> {
    who.require(Right::ClusterAdmin)?;
    tracing::info!(member = id, by = %who.0.token_id, "removing cluster member");
    st.node.remove_member(who.0.credential(), rid.0, id).await?;
    let status = cluster_status(&st)?;
    Ok(Written {
        index: status.last_log_index,
        status: StatusCode::OK,
        body: status,
    })
}

fn cluster_status(st: &AppState) -> Result<ClusterStatus, ApiError> {
    let s = st.node.cluster_status();
    Ok(ClusterStatus {
        node_id: s.node_id,
        leader_id: s.leader_id,
        is_leader: s.is_leader,
        term: s.term,
        last_log_index: s.last_log_index,
        applied_index: s.applied_index,
        first_available_index: s.first_available_index,
        members: s.members,
        voters: s.voters.into_iter().collect(),
        state_hash: s.state_hash,
    })
}
