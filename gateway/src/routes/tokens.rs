//! Tokens: issue (the secret is generated here and shown once), list, revoke, whoami.

use axum::Json;
use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use opendsec_commands::Command;
use opendsec_control::{format_e2b_key, format_token, new_e2b_secret, new_token_secret};
use opendsec_projections::Right;
use opendsec_sdk::types::{self as api, Done, IssueToken, TokenIssued, TokenList, Whoami};

use super::visible_project;
use crate::convert;
use crate::error::ApiError;
use crate::extract::{Authed, JsonBody, PageQuery, Params, PathParam, RequestId};
use crate::{AppState, Written, submit};

/// Issues a token with rights the caller holds, in its subtree, expiring no later
/// than the caller's. The bearer secret is in `token`, shown only in this response.
#[utoipa::path(post, path = "/v1/tokens", tag = "tokens", request_body = IssueToken,
    responses((status = 201, body = TokenIssued), (status = "4XX", body = api::ErrorBody)))]
pub async fn issue(
    State(st): State<AppState>,
    who: Authed,
    rid: RequestId,
    JsonBody(req): JsonBody<IssueToken>,
) -> Result<Written<TokenIssued>, ApiError> {
    let mut rights = Vec::with_capacity(req.rights.len());
    for (i, r) in req.rights.iter().enumerate() {
        let right = Right::parse(r).ok_or_else(|| {
            let known: Vec<&str> = Right::ALL.iter().map(|r| r.as_str()).collect();
            ApiError::invalid(
                &format!("rights[{i}]"),
                format!("unknown right {r:?}; rights are: {}", known.join(", ")),
            )
        })?;
        rights.push(right);
    }
    let project = req.project.unwrap_or_else(|| who.0.project.clone());
    let e2b = match req.format.as_deref() {
        None | Some("opendsec") => false,
        Some("e2b") => true,
        Some(other) => {
            return Err(ApiError::invalid(
                "format",
                format!("unknown token format {other:?}; formats are: opendsec, e2b"),
            ));
        }
    };
    let (secret, secret_sha256) = if e2b { new_e2b_secret() } else { new_token_secret() };
    let cmd = Command::IssueToken {
        project: project.clone(),
        name: req.name,
        rights,
        ttl_seconds: req.ttl_seconds,
        secret_sha256,
    };
    let s = submit(&st, &who, &rid, cmd).await?;
    let id = s.decided.target.clone();
    let issued = st.node.read(|state| state.iam.tokens.get(&id).map(convert::token));
    let issued = issued.ok_or_else(|| ApiError::internal("the token was issued but is not in the applied state"))?;
    let token = if e2b {
        format_e2b_key(&id, &secret)
    } else {
        format_token(&id, &secret)
    };
    let body = TokenIssued {
        index: s.index,
        token,
        id,
        project,
        rights: issued.rights,
        expires_at_ms: issued.expires_at_ms,
    };
    Ok(Written {
        index: s.index,
        status: StatusCode::CREATED,
        body,
    })
}

/// Tokens in the caller's subtree (or under `project`), without secrets. Needs token:write.
#[utoipa::path(get, path = "/v1/tokens", tag = "tokens",
    params(("project" = Option<String>, Query, description = "Only tokens of this project's subtree"), ("limit" = Option<usize>, Query, description = "At most this many (1-1000, default 1000)"), ("page_token" = Option<String>, Query, description = "The next_page_token of the page before"),),
    responses((status = 200, body = TokenList), (status = "4XX", body = api::ErrorBody)))]
pub async fn list(State(st): State<AppState>, who: Authed, RawQuery(q): RawQuery) -> Result<Json<TokenList>, ApiError> {
    let params = Params::parse(q.as_deref(), &["project", "limit", "page_token"])?;
    let page = PageQuery::parse(&params)?;
    who.require(Right::TokenWrite)?;
    let project = params.one("project")?.map(str::to_string);
    st.node.read(|s| {
        let scope = match &project {
            Some(p) => visible_project(s, &who, "project", p)?.id.clone(),
            None => who.0.project.clone(),
        };
        let tokens = s
            .iam
            .tokens
            .values()
            .filter(|t| s.within(&t.project, &scope))
            .map(|t| (t.id.clone(), convert::token(t)));
        let (tokens, next_page_token) = page.take(tokens);
        Ok(Json(TokenList {
            tokens,
            next_page_token,
        }))
    })
}

/// Revokes a token in the caller's subtree. Needs token:write.
#[utoipa::path(delete, path = "/v1/tokens/{id}", tag = "tokens",
    params(("id" = String, Path), ("reason" = Option<String>, Query, description = "Recorded with the revocation")),
    responses((status = 200, body = Done), (status = "4XX", body = api::ErrorBody)))]
pub async fn revoke(
    State(st): State<AppState>,
    who: Authed,
    rid: RequestId,
    PathParam(id): PathParam<String>,
    RawQuery(q): RawQuery,
) -> Result<Written<Done>, ApiError> {
    let params = Params::parse(q.as_deref(), &["reason"])?;
    let reason = params.one("reason")?.unwrap_or("revoked through the API").to_string();
    let s = submit(&st, &who, &rid, Command::RevokeToken { token: id, reason }).await?;
    Ok(Written {
        index: s.index,
        status: StatusCode::OK,
        body: Done { index: s.index },
    })
}

/// The calling token: its project and rights.
#[utoipa::path(get, path = "/v1/whoami", tag = "tokens",
    responses((status = 200, body = Whoami), (status = "4XX", body = api::ErrorBody)))]
pub async fn whoami(State(st): State<AppState>, who: Authed) -> Json<Whoami> {
    let project_name = st.node.read(|s| {
        s.iam
            .projects
            .get(&who.0.project)
            .map(|p| p.name.clone())
            .unwrap_or_default()
    });
    Json(Whoami {
        token_id: who.0.token_id.clone(),
        project: who.0.project.clone(),
        project_name,
        rights: who.0.rights.iter().map(|r| r.as_str().to_string()).collect(),
        expires_at_ms: who.0.expires_at_ms,
    })
}
