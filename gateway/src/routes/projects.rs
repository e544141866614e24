//! Projects and their quotas.

use axum::Json;
use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use opendsec_commands::Command;
use opendsec_projections::{Egress, Limits, Right};
use opendsec_sdk::types::{self as api, CreateProject, Done, ProjectList, ProjectWritten, Quota};

use super::visible_project;
use crate::convert;
use crate::error::ApiError;
use crate::extract::{Authed, JsonBody, PageQuery, Params, PathParam, RequestId};
use crate::{AppState, Written, submit};

/// Creates a project under `parent` (default: the caller's project). Needs project:write.
#[utoipa::path(post, path = "/v1/projects", tag = "projects", request_body = CreateProject,
    responses((status = 201, body = ProjectWritten), (status = "4XX", body = api::ErrorBody)))]
pub async fn create(
    State(st): State<AppState>,
    who: Authed,
    rid: RequestId,
    JsonBody(req): JsonBody<CreateProject>,
) -> Result<Written<ProjectWritten>, ApiError> {
    let parent = req.parent.unwrap_or_else(|| who.0.project.clone());
    let s = submit(&st, &who, &rid, Command::CreateProject { name: req.name, parent }).await?;
    let project = st
        .node
        .read(|state| state.iam.projects.get(&s.decided.target).map(convert::project));
    let project =
        project.ok_or_else(|| ApiError::internal("the project was created but is not in the applied state"))?;
    Ok(Written {
        index: s.index,
        status: StatusCode::CREATED,
        body: ProjectWritten {
            index: s.index,
            project,
        },
    })
}

/// The projects in the caller's subtree. Needs sandbox:read.
#[utoipa::path(get, path = "/v1/projects", tag = "projects", params(("limit" = Option<usize>, Query, description = "At most this many (1-1000, default 1000)"), ("page_token" = Option<String>, Query, description = "The next_page_token of the page before"),),
    responses((status = 200, body = ProjectList), (status = "4XX", body = api::ErrorBody)))]
pub async fn list(
    State(st): State<AppState>,
    who: Authed,
    RawQuery(q): RawQuery,
) -> Result<Json<ProjectList>, ApiError> {
    let page = PageQuery::parse(&Params::parse(q.as_deref(), &["limit", "page_token"])?)?;
    who.require(Right::SandboxRead)?;
    let (projects, next_page_token) = st.node.read(|s| {
        page.take(
            s.iam
                .projects
                .values()
                .filter(|p| who.sees(s, &p.id))
                .map(|p| (p.id.clone(), convert::project(p))),
        )
    });
    Ok(Json(ProjectList {
        projects,
        next_page_token,
    }))
}

#[utoipa::path(get, path = "/v1/projects/{id}", tag = "projects", params(("id" = String, Path)),
    responses((status = 200, body = api::Project), (status = "4XX", body = api::ErrorBody)))]
pub async fn get(
    State(st): State<AppState>,
    who: Authed,
    PathParam(id): PathParam<String>,
) -> Result<Json<api::Project>, ApiError> {
    who.require(Right::SandboxRead)?;
    st.node
        .read(|s| visible_project(s, &who, "id", &id).map(convert::project))
        .map(Json)
}

/// Deletes an empty project strictly below the caller's own. Needs project:write.
#[utoipa::path(delete, path = "/v1/projects/{id}", tag = "projects", params(("id" = String, Path)),
    responses((status = 200, body = Done), (status = "4XX", body = api::ErrorBody)))]
pub async fn delete(
    State(st): State<AppState>,
    who: Authed,
    rid: RequestId,
    PathParam(id): PathParam<String>,
) -> Result<Written<Done>, ApiError> {
    let s = submit(&st, &who, &rid, Command::DeleteProject { project: id }).await?;
    Ok(Written {
        index: s.index,
        status: StatusCode::OK,
        body: Done { index: s.index },
    })
}

/// Sets the project's own limits (an absent resource: no limit of its own). Needs
/// quota:write on a strict ancestor; a child's limits never exceed its parent's.
#[utoipa::path(put, path = "/v1/projects/{id}/quota", tag = "projects", params(("id" = String, Path)), request_body = api::Limits,
    responses((status = 200, body = Quota), (status = "4XX", body = api::ErrorBody)))]
pub async fn set_quota(
    State(st): State<AppState>,
    who: Authed,
    rid: RequestId,
    PathParam(id): PathParam<String>,
    JsonBody(req): JsonBody<api::Limits>,
) -> Result<Written<Quota>, ApiError> {
    let limits = Limits {
        sandboxes: req.sandboxes,
        cpu_millis: req.cpu_millis,
        memory_mb: req.memory_mb,
        metadata_bytes: req.metadata_bytes,
    };
    let s = submit(
        &st,
        &who,
        &rid,
        Command::SetQuota {
            project: id.clone(),
            limits,
        },
    )
    .await?;
    let quota = st.node.read(|state| quota_of(state, &id));
    Ok(Written {
        index: s.index,
        status: StatusCode::OK,
        body: quota,
    })
}

/// The project's own limits, the effective (inherited) limits, and its subtree's usage.
#[utoipa::path(get, path = "/v1/projects/{id}/quota", tag = "projects", params(("id" = String, Path)),
    responses((status = 200, body = Quota), (status = "4XX", body = api::ErrorBody)))]
pub async fn get_quota(
    State(st): State<AppState>,
    who: Authed,
    PathParam(id): PathParam<String>,
) -> Result<Json<Quota>, ApiError> {
    who.require(Right::SandboxRead)?;
    st.node.read(|s| {
        visible_project(s, &who, "id", &id)?;
        Ok(Json(quota_of(s, &id)))
    })
}

fn quota_of(s: &opendsec_projections::State, id: &str) -> Quota {
    Quota {
        project: id.to_string(),
        limits: convert::limits(&s.quota.limits.get(id).copied().unwrap_or_default()),
        effective: convert::limits(&s.effective_limits(id)),
        usage: convert::resources(&s.quota.usage.get(id).copied().unwrap_or_default()),
    }
}

/// The project's network settings: its egress ceiling (the least on its line) and the
/// default policy of its sandboxes (the nearest set on its line; absent: deny).
/// Needs sandbox:read.
#[utoipa::path(get, path = "/v1/projects/{id}/network", tag = "projects", params(("id" = String, Path)),
    responses((status = 200, body = api::ProjectNetwork), (status = "4XX", body = api::ErrorBody)))]
pub async fn get_network(
    State(st): State<AppState>,
    who: Authed,
    PathParam(id): PathParam<String>,
) -> Result<Json<api::ProjectNetwork>, ApiError> {
    who.require(Right::SandboxRead)?;
    st.node.read(|s| {
        visible_project(s, &who, "id", &id)?;
        Ok(Json(network_of(s, &id)))
    })
}

/// Sets the project's egress ceiling (`none`, `public` or `any`; never above its
/// parent's, and a caller may lower but not raise its own project's) and the default
/// policy of its sandboxes that name none. Needs quota:write.
#[utoipa::path(put, path = "/v1/projects/{id}/network", tag = "projects", params(("id" = String, Path)), request_body = api::ProjectNetwork,
    responses((status = 200, body = api::ProjectNetwork), (status = "4XX", body = api::ErrorBody)))]
pub async fn set_network(
    State(st): State<AppState>,
    who: Authed,
    rid: RequestId,
    PathParam(id): PathParam<String>,
    JsonBody(req): JsonBody<api::ProjectNetwork>,
) -> Result<Written<api::ProjectNetwork>, ApiError> {
    let ceiling = Egress::parse(&req.ceiling).ok_or_else(|| {
        ApiError::invalid(
            "ceiling",
            format!(
                "unknown egress ceiling {:?}; ceilings are: none, public, any",
                req.ceiling
            ),
        )
    })?;
    let cmd = Command::SetProjectNetwork {
        project: id.clone(),
        ceiling,
        default_network: req.default_network.as_ref().map(|n| convert::network_json(n, None)),
    };
    let s = submit(&st, &who, &rid, cmd).await?;
    let body = st.node.read(|state| network_of(state, &id));
    Ok(Written {
        index: s.index,
        status: StatusCode::OK,
        body,
    })
}

fn network_of(s: &opendsec_projections::State, id: &str) -> api::ProjectNetwork {
    api::ProjectNetwork {
        ceiling: s.egress_ceiling(id).as_str().to_string(),
        default_network: s.default_network(id).map(|d| convert::network(Some(d))),
    }
}

/// The project's write rates: its own, and those in force (the least on its line).
/// Needs sandbox:read.
#[utoipa::path(get, path = "/v1/projects/{id}/rate-limits", tag = "projects", params(("id" = String, Path)),
    responses((status = 200, body = api::ProjectRates), (status = "4XX", body = api::ErrorBody)))]
pub async fn get_rate_limits(
    State(st): State<AppState>,
    who: Authed,
    PathParam(id): PathParam<String>,
) -> Result<Json<api::ProjectRates>, ApiError> {
    who.require(Right::SandboxRead)?;
    st.node.read(|s| {
        visible_project(s, &who, "id", &id)?;
        Ok(Json(rates_of(s, &id)))
    })
}

/// Sets the project's write rates: writes a second by all its subtree's tokens together
/// (`writes_per_second`) and by each of them (`token_writes_per_second`); absent: none
/// of its own. Never above the parent's. Writes over a rate get 429 with `Retry-After`
/// and are not logged. Needs quota:write on a strict ancestor.
#[utoipa::path(put, path = "/v1/projects/{id}/rate-limits", tag = "projects", params(("id" = String, Path)), request_body = api::RateLimits,
    responses((status = 200, body = api::ProjectRates), (status = "4XX", body = api::ErrorBody)))]
pub async fn set_rate_limits(
    State(st): State<AppState>,
    who: Authed,
    rid: RequestId,
    PathParam(id): PathParam<String>,
    JsonBody(req): JsonBody<api::RateLimits>,
) -> Result<Written<api::ProjectRates>, ApiError> {
    let cmd = Command::SetRateLimits {
        project: id.clone(),
        writes_per_second: req.writes_per_second,
        token_writes_per_second: req.token_writes_per_second,
    };
    let s = submit(&st, &who, &rid, cmd).await?;
    let body = st.node.read(|state| rates_of(state, &id));
    Ok(Written {
        index: s.index,
        status: StatusCode::OK,
        body,
    })
}

fn rates_of(s: &opendsec_projections::State, id: &str) -> api::ProjectRates {
    let conv = |r: opendsec_projections::Rates| api::RateLimits {
        writes_per_second: r.writes_per_second,
        token_writes_per_second: r.token_writes_per_second,
    };
    api::ProjectRates {
        project: id.to_string(),
        own: conv(s.quota.rates.get(id).copied().unwrap_or_default()),
        effective: conv(s.effective_rates(id)),
    }
}
