//! OpenDsec's native REST API (`/v1`) over a control node.
//!
//! Writes become [`Command`]s submitted with the caller's token, so `decide` does
//! the authorisation of every write; reads check the token's rights here and show
//! only the caller's project subtree. Wire types live in `opendsec_sdk::types`, so
//! the client and the server cannot drift apart.
//!
//! API boundary: [`router`] is the whole surface; everything else is private.

mod convert;
pub mod e2b;
mod edge_client;
mod error;
mod extract;
mod openapi;
mod routes;
pub mod tls;

pub use error::ApiError;
pub use extract::decode_json;
pub use openapi::ApiDoc;

use axum::extract::DefaultBodyLimit;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, delete, get, post, put};
use axum::{Json, Router};
use opendsec_commands::Command;
use opendsec_control::{ControlNode, Submitted};
use serde::Serialize;

use extract::{Authed, RequestId};

/// The log index a write was applied at (on every write response).
pub const INDEX_HEADER: &str = "x-opendsec-index";
/// A read waits until this node has applied at least this index (read-your-writes).
pub const MIN_INDEX_HEADER: &str = "x-opendsec-min-index";
pub const REQUEST_ID_HEADER: &str = "x-request-id";
/// Request bodies above this are refused with 413.
pub const MAX_BODY_BYTES: usize = 1 << 20;

#[derive(Clone)]
pub struct AppState {
    pub node: ControlNode,
    pub e2b: std::sync::Arc<e2b::E2bSettings>,
    /// Requests to edges' proxies go through this one pooled client.
    pub edges: opendsec_http::Client,
    /// The template builds this node runs (their logs and uploaded files).
    pub builds: std::sync::Arc<e2b::templates::Builds>,
}

/// Every route, as (method, path): the router and the OpenAPI test both use it.
pub const ROUTES: &[(&str, &str)] = &[
    ("get", "/health"),
    ("get", "/v1/openapi.json"),
    ("post", "/v1/projects"),
    ("get", "/v1/projects"),
    ("get", "/v1/projects/{id}"),
    ("delete", "/v1/projects/{id}"),
    ("put", "/v1/projects/{id}/quota"),
    ("get", "/v1/projects/{id}/quota"),
    ("put", "/v1/projects/{id}/rate-limits"),
    ("get", "/v1/projects/{id}/rate-limits"),
    ("put", "/v1/projects/{id}/network"),
    ("get", "/v1/projects/{id}/network"),
    ("post", "/v1/tokens"),
    ("get", "/v1/tokens"),
    ("delete", "/v1/tokens/{id}"),
    ("get", "/v1/whoami"),
    ("post", "/v1/sandboxes"),
    ("get", "/v1/sandboxes"),
    ("get", "/v1/sandboxes/{id}"),
    ("delete", "/v1/sandboxes/{id}"),
    ("post", "/v1/sandboxes/{id}/pause"),
    ("post", "/v1/sandboxes/{id}/resume"),
    ("post", "/v1/sandboxes/{id}/fork"),
    ("post", "/v1/sandboxes/{id}/snapshots"),
    ("post", "/v1/sandboxes/{id}/pack"),
    ("put", "/v1/sandboxes/{id}/timeout"),
    ("put", "/v1/sandboxes/{id}/labels"),
    ("put", "/v1/sandboxes/{id}/network"),
    ("get", "/v1/sandboxes/{id}/network"),
    ("get", "/v1/sandboxes/{id}/logs"),
    ("get", "/v1/sandboxes/{id}/metrics"),
    ("get", "/v1/sandboxes/{id}/metrics/history"),
    ("get", "/v1/sandboxes/{id}/agent/{path}"),
    ("post", "/v1/sandboxes/{id}/agent/{path}"),
    ("get", "/v1/snapshots"),
    ("get", "/v1/snapshots/{id}"),
    ("delete", "/v1/snapshots/{id}"),
    ("post", "/v1/images"),
    ("get", "/v1/images"),
    ("get", "/v1/images/{name}"),
    ("delete", "/v1/images/{name}"),
    ("put", "/v1/images/{name}"),
    ("post", "/v1/image-store/prune"),
    ("post", "/v1/image-pushes"),
    ("get", "/v1/image-pushes/{id}"),
    ("post", "/v1/tasks/{task}/pause"),
    ("post", "/v1/tasks/{task}/resume"),
    ("get", "/v1/edges"),
    ("post", "/v1/edges"),
    ("delete", "/v1/edges/{id}"),
    ("get", "/v1/audit"),
    ("get", "/v1/replay"),
    ("get", "/v1/cluster"),
    ("post", "/v1/cluster/members"),
    ("get", "/v1/cluster/retention"),
    ("put", "/v1/cluster/retention"),
    ("delete", "/v1/cluster/members/{id}"),
    ("post", "/v1/cluster/certificates/rotate"),
];

/// The REST API over `node` with default E2B settings. Serve it with `axum::serve`.
pub fn router(node: ControlNode) -> Router {
    router_with(node, e2b::E2bSettings::default())
}

/// Everything on one port: the native API (`/v1`), the E2B control API, and per-sandbox
/// traffic (E2B routing headers or `{port}-{id}.{domain}` host names).
pub fn router_with(node: ControlNode, e2b: e2b::E2bSettings) -> Router {
    use routes::*;
    let files = e2b
        .template_files
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join(format!("opendsec-template-files-{}", std::process::id())));
    let node_id = node.config().node_id;
    let edges = edge_client::client(node.gateway_trust().clone());
    let state = AppState {
        node,
        e2b: std::sync::Arc::new(e2b),
        edges,
        builds: std::sync::Arc::new(e2b::templates::Builds::new(files, node_id)),
    };
    e2b::templates::fail_interrupted_builds(state.clone());
    Router::new()
        .route("/health", get(health))
        .route("/v1/openapi.json", get(openapi::serve))
        .route("/v1/projects", post(projects::create).get(projects::list))
        .route(
            "/v1/projects/{id}/rate-limits",
            put(projects::set_rate_limits).get(projects::get_rate_limits),
        )
        .route(
            "/v1/projects/{id}/network",
            put(projects::set_network).get(projects::get_network),
        )
        .route("/v1/projects/{id}", get(projects::get).delete(projects::delete))
        .route(
            "/v1/projects/{id}/quota",
            put(projects::set_quota).get(projects::get_quota),
        )
        .route("/v1/tokens", post(tokens::issue).get(tokens::list))
        .route("/v1/tokens/{id}", delete(tokens::revoke))
        .route("/v1/whoami", get(tokens::whoami))
        .route("/v1/sandboxes", post(sandboxes::create).get(sandboxes::list))
        .route("/v1/sandboxes/{id}", get(sandboxes::get).delete(sandboxes::kill))
        .route("/v1/sandboxes/{id}/pause", post(sandboxes::pause))
        .route("/v1/sandboxes/{id}/resume", post(sandboxes::resume))
        .route("/v1/sandboxes/{id}/fork", post(sandboxes::fork))
        .route("/v1/sandboxes/{id}/snapshots", post(snapshots::create))
        .route("/v1/sandboxes/{id}/pack", post(images::pack))
        .route("/v1/sandboxes/{id}/timeout", put(sandboxes::set_timeout))
        .route("/v1/sandboxes/{id}/labels", put(sandboxes::set_labels))
        .route(
            "/v1/sandboxes/{id}/network",
            put(sandboxes::set_network).get(sandboxes::get_network),
        )
        .route("/v1/sandboxes/{id}/logs", get(sandboxes::logs))
        .route("/v1/sandboxes/{id}/metrics", get(sandboxes::metrics))
        .route("/v1/sandboxes/{id}/metrics/history", get(sandboxes::metrics_history))
        // Any method; bodies stream through unbuffered, so no body limit applies.
        .route(
            "/v1/sandboxes/{id}/agent/{*path}",
            any(agent::proxy).layer(DefaultBodyLimit::disable()),
        )
        .route("/v1/snapshots", get(snapshots::list))
        .route("/v1/snapshots/{id}", get(snapshots::get).delete(snapshots::delete))
        .route("/v1/images", post(images::pull).get(images::list))
        // Image names may hold '/' (references are names too).
        // A PUT (an import) streams its tarball to the edge: no body limit.
        .route(
            "/v1/images/{*name}",
            get(images::get)
                .delete(images::delete)
                .merge(put(images::import).layer(DefaultBodyLimit::disable())),
        )
        .route("/v1/image-store/prune", post(images::prune))
        .route("/v1/image-pushes", post(images::push))
        .route("/v1/image-pushes/{id}", get(images::push_progress))
        .route("/v1/tasks/{task}/pause", post(tasks::pause))
        .route("/v1/tasks/{task}/resume", post(tasks::resume))
        .route("/v1/edges", get(edges::list).post(edges::register))
        .route("/v1/edges/{id}", delete(edges::deregister))
        .route("/v1/audit", get(audit::query))
        .route("/v1/replay", get(replay::replay))
        .route("/v1/cluster", get(cluster::status))
        .route("/v1/cluster/members", post(cluster::add_member))
        .route(
            "/v1/cluster/retention",
            get(cluster::get_retention).put(cluster::set_retention),
        )
        .route("/v1/cluster/members/{id}", delete(cluster::remove_member))
        .route("/v1/cluster/certificates/rotate", post(cluster::rotate_certificates))
        .merge(e2b::routes())
        .fallback(no_route)
        .method_not_allowed_fallback(wrong_method)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        // Sandbox traffic is routed before any route matches, and streams without a body limit.
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            e2b::route_sandbox_traffic,
        ))
        .layer(axum::middleware::from_fn(extract::request_context))
        .with_state(state)
}

/// Public liveness probe: says only that the process serves.
#[utoipa::path(get, path = "/health", tag = "meta", security(()),
    responses((status = 200, description = "The gateway serves", body = opendsec_sdk::types::Health)))]
pub async fn health() -> Json<opendsec_sdk::types::Health> {
    Json(opendsec_sdk::types::Health { status: "ok".into() })
}

async fn no_route(req: axum::extract::Request) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found",
        format!("no such endpoint: {} {}", req.method(), req.uri().path()),
    )
}

async fn wrong_method(req: axum::extract::Request) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!("{} is not allowed on {}", req.method(), req.uri().path()),
    )
}

/// A write's response: its status, body, and the log index in `X-Opendsec-Index`.
pub(crate) struct Written<T> {
    pub index: u64,
    pub status: StatusCode,
    pub body: T,
}

impl<T: Serialize> IntoResponse for Written<T> {
    fn into_response(self) -> Response {
        let mut resp = (self.status, Json(self.body)).into_response();
        resp.headers_mut().insert(INDEX_HEADER, HeaderValue::from(self.index));
        resp
    }
}

/// Submits a command as the caller and waits until this node has applied it, so
/// the handler can read its result from local state.
pub(crate) async fn submit(st: &AppState, who: &Authed, rid: &RequestId, cmd: Command) -> Result<Submitted, ApiError> {
    let action = cmd.action();
    let submitted = st
        .node
        .submit(who.credential(), rid.0.clone(), cmd)
        .await
        .inspect_err(|e| {
            tracing::info!(action, error = ?error_kind(e), "write refused");
        })?;
    tracing::info!(action, index = submitted.index, "write applied");
    st.node
        .wait_applied(submitted.index, extract::MIN_INDEX_WAIT)
        .await
        .map_err(|_| {
            ApiError::unavailable(format!(
                "the write was committed at index {} but this node has not applied it yet",
                submitted.index
            ))
        })?;
    Ok(submitted)
}

fn error_kind(e: &opendsec_control::SubmitError) -> &'static str {
    match e {
        opendsec_control::SubmitError::Rejected { rejection, .. } => rejection.kind.code(),
        opendsec_control::SubmitError::Unavailable(_) => "unavailable",
        opendsec_control::SubmitError::Internal(_) => "internal",
    }
}
