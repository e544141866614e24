//! Cluster status and Raft membership.

use axum::Json;
use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use opendsec_commands::Command;
use opendsec_projections::Right;
use opendsec_sdk::types::{self as api, AddMember, ClusterStatus};

use crate::error::ApiError;
use crate::extract::{Authed, JsonBody, Params, PathParam, RequestId};
use crate::{AppState, Written, submit};

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

/// How long the live views keep ended sandboxes and audit records (older ones stay in
/// the log's archive). Needs cluster:admin.
#[utoipa::path(get, path = "/v1/cluster/retention", tag = "cluster",
    responses((status = 200, body = api::Retention), (status = "4XX", body = api::ErrorBody)))]
pub async fn get_retention(State(st): State<AppState>, who: Authed) -> Result<Json<api::Retention>, ApiError> {
    who.require(Right::ClusterAdmin)?;
    Ok(Json(st.node.read(retention_of)))
}

/// Sets the retention; a setting left out keeps its value. Needs cluster:admin in the
/// root project.
#[utoipa::path(put, path = "/v1/cluster/retention", tag = "cluster", request_body = api::Retention,
    responses((status = 200, body = api::Retention), (status = "4XX", body = api::ErrorBody)))]
pub async fn set_retention(
    State(st): State<AppState>,
    who: Authed,
    rid: RequestId,
    JsonBody(req): JsonBody<api::Retention>,
) -> Result<Written<api::Retention>, ApiError> {
    let cmd = Command::SetRetention {
        ended_sandboxes_seconds: req.ended_sandboxes_seconds,
        audit_seconds: req.audit_seconds,
        audit_records: req.audit_records,
    };
    let s = submit(&st, &who, &rid, cmd).await?;
    Ok(Written {
        index: s.index,
        status: StatusCode::OK,
        body: st.node.read(retention_of),
    })
}

fn retention_of(s: &opendsec_projections::State) -> api::Retention {
    let r = s.retention.to_event();
    api::Retention {
        ended_sandboxes_seconds: Some(r.ended_sandboxes_seconds),
        audit_seconds: Some(r.audit_seconds),
        audit_records: Some(r.audit_records),
    }
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

/// Rotates the cluster's certificates without downtime: every control node and its
/// gateway get a fresh key and certificate from the CA (connections opened after
/// present them, open ones keep theirs), and edges renew theirs when their next
/// heartbeat's reply tells them. Needs cluster:admin in the root project.
#[utoipa::path(post, path = "/v1/cluster/certificates/rotate", tag = "cluster",
    responses((status = 200, body = api::CertificateRotation), (status = "4XX", body = api::ErrorBody), (status = 503, body = api::ErrorBody)))]
pub async fn rotate_certificates(
    State(st): State<AppState>,
    who: Authed,
) -> Result<Json<api::CertificateRotation>, ApiError> {
    who.require(Right::ClusterAdmin)?;
    let root = st.node.read(|s| s.root_project().map(|p| p.id.clone()));
    if root.as_deref() != Some(who.0.project.as_str()) {
        return Err(ApiError::forbidden(
            "rotating the cluster's certificates needs cluster:admin in the root project",
        ));
    }
    tracing::info!(by = %who.0.token_id, "rotating the cluster's certificates");
    let nodes = st
        .node
        .rotate_certificates()
        .await
        .into_iter()
        .map(|(node_id, r)| match r {
            Ok(ms) => api::RotatedNode {
                node_id,
                not_after_ms: Some(ms),
                error: None,
            },
            Err(e) => api::RotatedNode {
                node_id,
                not_after_ms: None,
                error: Some(e),
            },
        })
        .collect();
    Ok(Json(api::CertificateRotation {
        nodes,
        edges: "each edge renews its certificate at its next heartbeat (within seconds)".into(),
    }))
}
