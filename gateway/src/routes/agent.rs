//! `ANY /v1/sandboxes/{id}/agent/{*path}`: the sandbox's in-sandbox agent (E2B's envd
//! protocol: `process.Process/*`, `filesystem.Filesystem/*`, `/files`, `/health`),
//! reached through the proxy of the edge the sandbox runs on.
//!
//! The caller's bearer token stops here: the edge gets the cluster key in
//! `x-opendsec-edge-key`, and the agent gets the user from `X-Opendsec-User` as
//! `Authorization: Basic base64("<user>:")`. Bodies stream both ways unbuffered.

use axum::extract::{Request, State};
use axum::http::{HeaderName, HeaderValue, StatusCode, Uri, header};
use axum::response::Response;
use base64::Engine;
use opendsec_projections::Right;
use opendsec_sdk::types as api;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::{Authed, PathParam};

use opendsec_edge_api::headers::{EDGE_KEY_HEADER, PORT_HEADER};
/// Names the sandbox user the agent acts as (default: the agent's default user).
pub const USER_HEADER: &str = "x-opendsec-user";

/// Hop-by-hop headers (RFC 9110 7.6.1) and those the gateway sets itself.
const DROPPED_REQUEST_HEADERS: &[&str] = &[
    "authorization",
    "host",
    USER_HEADER,
    EDGE_KEY_HEADER,
    PORT_HEADER,
    "x-access-token",
    crate::MIN_INDEX_HEADER,
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Forwards any request to the sandbox's agent, streaming both ways. Needs sandbox:write
/// and a live sandbox in the caller's project subtree. `{path}` is the agent's path:
/// `process.Process/Start` (Connect server stream, `application/connect+json`),
/// `process.Process/SendInput`, `process.Process/Update`, `filesystem.Filesystem/*`
/// (Connect unary JSON), `files?path=...` (GET download, POST upload), `health`.
/// `X-Opendsec-User` picks the sandbox user; the bearer token is never forwarded.
/// Every method is forwarded; GET and POST are the ones the agent serves.
#[utoipa::path(method(get, post), path = "/v1/sandboxes/{id}/agent/{path}", tag = "sandboxes",
    params(
        ("id" = String, Path, description = "The sandbox"),
        ("path" = String, Path, description = "The agent's path, e.g. `process.Process/Start` or `files`; the query string is forwarded"),
        ("X-Opendsec-User" = Option<String>, Header, description = "The user in the sandbox to act as"),
    ),
    responses(
        (status = 200, description = "The agent's response, streamed as it comes (status, headers and body are the agent's)"),
        (status = "4XX", body = api::ErrorBody, description = "401 no token, 403 no sandbox:write or outside the token's project, 404 unknown sandbox, 409 the sandbox has ended"),
        (status = 502, body = api::ErrorBody, description = "The sandbox's edge is unreachable"),
    ))]
pub async fn proxy(
    State(st): State<AppState>,
    who: Authed,
    PathParam((id, path)): PathParam<(String, String)>,
    req: Request,
) -> Result<Response, ApiError> {
    who.require(Right::SandboxWrite)?;
    let (address, x) = st.node.read(|s| {
        let x = s
            .sandboxes
            .sandboxes
            .get(&id)
            .ok_or_else(|| ApiError::not_found("id", format!("sandbox {id} does not exist")))?;
        if !who.sees(s, &x.project) {
            return Err(ApiError::forbidden(format!(
                "sandbox {id} is outside this token's project {}",
                who.0.project
            )));
        }
        if !x.is_live() {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "conflict",
                format!("sandbox {id} has ended"),
            ));
        }
        let edge = s
            .placement
            .edges
            .get(&x.edge)
            .ok_or_else(|| edge_unreachable(format!("the edge {} of sandbox {id} is not registered", x.edge)))?;
        Ok((edge.address.clone(), x.clone()))
    })?;
    // A paused sandbox created with auto_resume resumes on this request (a microVM is
    // restored into a new VMM meanwhile); a resume or a start under way is waited for.
    // One created without it stays paused, and the call says how to resume it.
    if x.desired == opendsec_projections::Desired::Paused && !x.auto_resume {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "conflict",
            format!(
                "sandbox {id} is paused and was created without auto-resume: resume it first \
                 (opendsecctl sandbox resume {id})"
            ),
        ));
    }
    let settled = crate::e2b::api::ready_for_traffic(&st, &x).await.map_err(|e| {
        ApiError::new(
            e.status,
            "unavailable",
            format!("waiting for sandbox {id} to run: {}", e.message),
        )
    })?;
    let after = settled.map_or(x.index, |s| s.index);
    let user = match req.headers().get(USER_HEADER) {
        None => None,
        Some(v) => {
            let name = v
                .to_str()
                .ok()
                .map(str::trim)
                .filter(|n| !n.is_empty() && !n.contains(':') && n.len() <= 64);
            Some(
                name.ok_or_else(|| ApiError::invalid(USER_HEADER, format!("{USER_HEADER} must be a user name")))?
                    .to_string(),
            )
        }
    };
    let tail = match req.uri().query() {
        Some(q) => format!("/sandboxes/{id}/{path}?{q}"),
        None => format!("/sandboxes/{id}/{path}"),
    };
    let uri: Uri = tail
        .parse()
        .map_err(|_| ApiError::invalid("path", "the agent path is not a valid URI path"))?;
    let (mut parts, body) = req.into_parts();
    for h in DROPPED_REQUEST_HEADERS {
        parts.headers.remove(*h);
    }
    // The caller proved itself with its bearer token; the agent wants the sandbox's own.
    let token = st.node.sandbox_token(opendsec_control::SandboxTokenKind::Agent, &id);
    parts.headers.insert(
        HeaderName::from_static("x-access-token"),
        HeaderValue::from_str(&token).map_err(|_| ApiError::internal("bad sandbox token"))?,
    );
    if let Some(u) = user {
        let basic = base64::engine::general_purpose::STANDARD.encode(format!("{u}:"));
        let v = HeaderValue::from_str(&format!("Basic {basic}"))
            .map_err(|_| ApiError::invalid(USER_HEADER, "bad user name"))?;
        parts.headers.insert(header::AUTHORIZATION, v);
    }
    parts.headers.insert(
        HeaderName::from_static(opendsec_edge_api::headers::AFTER_HEADER),
        HeaderValue::from(after),
    );
    crate::edge_client::forward(&st, &address, uri, axum::http::Request::from_parts(parts, body))
        .await
        .map_err(|e| edge_unreachable(format!("sandbox {id}: {}", e.0)))
}

fn edge_unreachable(message: String) -> ApiError {
    ApiError::new(StatusCode::BAD_GATEWAY, "edge_unreachable", message)
}
