//! Sandboxes: create (placed by `decide`), list with filters, and lifecycle requests.

use axum::Json;
use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use opendsec_commands::{Command, SandboxOptions};
use opendsec_projections::Right;
use opendsec_sdk::types::{
    self as api, CreateSandbox, ForkSandbox, Forked, SandboxList, SandboxWritten, SetLabels, SetTimeout,
};
use std::collections::BTreeMap;

use super::visible_project;
use crate::convert::{self, SANDBOX_STATES};
use crate::error::ApiError;
use crate::extract::{Authed, JsonBody, OptionalJsonBody, PageQuery, Params, PathParam, RequestId};
use crate::{AppState, Written, submit};

pub const DEFAULT_CPU_MILLIS: u64 = 1000;
pub const DEFAULT_MEMORY_MB: u64 = 512;

/// Creates a sandbox (placed on an edge by power-of-k choices): a container, with
/// `isolation: microvm` a QEMU microVM, or with `isolation: vm` a full VM (a q35 PC
/// booting the image as a whole disk), each on an edge that runs them. `image` may name
/// a snapshot: the sandbox then starts from it on its edge (a microVM's or full VM's
/// snapshot gives that machine restored where its source was). Needs sandbox:write.
#[utoipa::path(post, path = "/v1/sandboxes", tag = "sandboxes", request_body = CreateSandbox,
    responses((status = 201, body = SandboxWritten), (status = "4XX", body = api::ErrorBody), (status = 503, body = api::ErrorBody)))]
pub async fn create(
    State(st): State<AppState>,
    who: Authed,
    rid: RequestId,
    JsonBody(req): JsonBody<CreateSandbox>,
) -> Result<(axum::http::HeaderMap, Written<SandboxWritten>), ApiError> {
    let cmd = Command::CreateSandbox {
        project: req.project.unwrap_or_else(|| who.0.project.clone()),
        image: req.image,
        cpu_millis: req.cpu_millis.unwrap_or(DEFAULT_CPU_MILLIS),
        memory_mb: req.memory_mb.unwrap_or(DEFAULT_MEMORY_MB),
        labels: req.labels.unwrap_or_default(),
        timeout_seconds: req.timeout_seconds.filter(|t| *t > 0),
        opts: SandboxOptions {
            isolation: req.isolation.map(convert::isolation_of),
            cpu_class: req.cpu_class.map(convert::cpu_class_of),
            auto_resume: req.auto_resume.unwrap_or(true),
            auto_pause: req.auto_pause.unwrap_or(false),
            auto_pause_filesystem: req.auto_pause_filesystem.unwrap_or(false),
            network: req.network.as_ref().map(|n| convert::network_json(n, None)),
            env: req.env.unwrap_or_default(),
            ..Default::default()
        },
    };
    let s = submit(&st, &who, &rid, cmd).await.map_err(|mut e| {
        // The command's create options are this body's top-level fields.
        if let Some(f) = e.body.field.as_mut().filter(|f| f.starts_with("opts.")) {
            *f = f["opts.".len()..].to_string();
        }
        e
    })?;
    let sandbox = read_sandbox(&st, &s.decided.target)?;
    tracing::debug!(sandbox = %sandbox.id, index = s.index, "create committed");
    let enforced = st.node.read(|s| convert::egress_enforced(s, &sandbox.edge));
    Ok((
        convert::egress_warning(&sandbox.network, enforced),
        Written {
            index: s.index,
            status: StatusCode::CREATED,
            body: SandboxWritten {
                index: s.index,
                sandbox,
            },
        },
    ))
}

/// Sandboxes in the caller's subtree. Without `state`, only live ones. Needs sandbox:read.
#[utoipa::path(get, path = "/v1/sandboxes", tag = "sandboxes",
    params(
        ("project" = Option<String>, Query, description = "Only this project's subtree"),
        ("label" = Option<String>, Query, description = "`key=value`; repeat to require several"),
        ("state" = Option<String>, Query, description = "pending, running, pausing, paused, resuming, killed, failed or exited"),
        ("limit" = Option<usize>, Query, description = "At most this many (1-1000, default 1000)"), ("page_token" = Option<String>, Query, description = "The next_page_token of the page before"),
    ),
    responses((status = 200, body = SandboxList), (status = "4XX", body = api::ErrorBody)))]
pub async fn list(
    State(st): State<AppState>,
    who: Authed,
    RawQuery(q): RawQuery,
) -> Result<Json<SandboxList>, ApiError> {
    let params = Params::parse(q.as_deref(), &["project", "label", "state", "limit", "page_token"])?;
    let page = PageQuery::parse(&params)?;
    who.require(Right::SandboxRead)?;
    let mut labels = BTreeMap::new();
    for l in params.all("label") {
        let (k, v) = l
            .split_once('=')
            .ok_or_else(|| ApiError::invalid("label", format!("label filter {l:?} must be key=value")))?;
        labels.insert(k.to_string(), v.to_string());
    }
    let state = params.one("state")?;
    if let Some(w) = state.filter(|w| !SANDBOX_STATES.contains(w)) {
        return Err(ApiError::invalid(
            "state",
            format!("unknown state {w:?}; states are: {}", SANDBOX_STATES.join(", ")),
        ));
    }
    let project = params.one("project")?;
    st.node.read(|s| {
        let scope = match project {
            Some(p) => visible_project(s, &who, "project", p)?.id.clone(),
            None => who.0.project.clone(),
        };
        let sandboxes = s
            .sandboxes
            .sandboxes
            .values()
            .filter(|x| s.within(&x.project, &scope))
            .filter(|x| match state {
                Some(w) => convert::sandbox_state(x) == w,
                None => x.is_live(),
            })
            .filter(|x| labels.iter().all(|(k, v)| x.labels.get(k) == Some(v)))
            .map(|x| (x.id.clone(), convert::sandbox(x)));
        let (sandboxes, next_page_token) = page.take(sandboxes);
        Ok(Json(SandboxList {
            sandboxes,
            next_page_token,
        }))
    })
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}", tag = "sandboxes", params(("id" = String, Path)),
    responses((status = 200, body = api::Sandbox), (status = "4XX", body = api::ErrorBody)))]
pub async fn get(
    State(st): State<AppState>,
    who: Authed,
    PathParam(id): PathParam<String>,
) -> Result<Json<api::Sandbox>, ApiError> {
    who.require(Right::SandboxRead)?;
    st.node.read(|s| {
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
        Ok(Json(convert::sandbox(x)))
    })
}

/// Kills the sandbox; its quota is given back at once. Needs sandbox:write.
#[utoipa::path(delete, path = "/v1/sandboxes/{id}", tag = "sandboxes", params(("id" = String, Path)),
    responses((status = 200, body = SandboxWritten), (status = "4XX", body = api::ErrorBody)))]
pub async fn kill(
    st: State<AppState>,
    who: Authed,
    rid: RequestId,
    PathParam(id): PathParam<String>,
) -> Result<Written<SandboxWritten>, ApiError> {
    lifecycle(st, who, rid, id.clone(), Command::KillSandbox { sandbox: id }).await
}

/// Pauses the sandbox: everything kept, or with `filesystem` only its file system (its
/// processes end; its resume boots it again). The body may be left out.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/pause", tag = "sandboxes", params(("id" = String, Path)), request_body = Option<api::PauseSandbox>,
    responses((status = 200, body = SandboxWritten), (status = "4XX", body = api::ErrorBody)))]
pub async fn pause(
    st: State<AppState>,
    who: Authed,
    rid: RequestId,
    PathParam(id): PathParam<String>,
    OptionalJsonBody(req): OptionalJsonBody<api::PauseSandbox>,
) -> Result<Written<SandboxWritten>, ApiError> {
    let cmd = Command::PauseSandbox {
        sandbox: id.clone(),
        filesystem: req.filesystem,
    };
    lifecycle(st, who, rid, id, cmd).await
}

/// Resumes the sandbox where it was, or with `cold` booted again from its file system.
/// The body may be left out.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/resume", tag = "sandboxes", params(("id" = String, Path)), request_body = Option<api::ResumeSandbox>,
    responses((status = 200, body = SandboxWritten), (status = "4XX", body = api::ErrorBody)))]
pub async fn resume(
    st: State<AppState>,
    who: Authed,
    rid: RequestId,
    PathParam(id): PathParam<String>,
    OptionalJsonBody(req): OptionalJsonBody<api::ResumeSandbox>,
) -> Result<Written<SandboxWritten>, ApiError> {
    let cmd = Command::ResumeSandbox {
        sandbox: id.clone(),
        cold: req.cold,
    };
    lifecycle(st, who, rid, id, cmd).await
}

/// Sets the sandbox's lifetime from now; 0 removes it.
#[utoipa::path(put, path = "/v1/sandboxes/{id}/timeout", tag = "sandboxes", params(("id" = String, Path)), request_body = SetTimeout,
    responses((status = 200, body = SandboxWritten), (status = "4XX", body = api::ErrorBody)))]
pub async fn set_timeout(
    st: State<AppState>,
    who: Authed,
    rid: RequestId,
    PathParam(id): PathParam<String>,
    JsonBody(req): JsonBody<SetTimeout>,
) -> Result<Written<SandboxWritten>, ApiError> {
    lifecycle(
        st,
        who,
        rid,
        id.clone(),
        Command::SetSandboxTimeout {
            sandbox: id,
            timeout_seconds: req.timeout_seconds,
        },
    )
    .await
}

/// Replaces the sandbox's labels.
#[utoipa::path(put, path = "/v1/sandboxes/{id}/labels", tag = "sandboxes", params(("id" = String, Path)), request_body = SetLabels,
    responses((status = 200, body = SandboxWritten), (status = "4XX", body = api::ErrorBody)))]
pub async fn set_labels(
    st: State<AppState>,
    who: Authed,
    rid: RequestId,
    PathParam(id): PathParam<String>,
    JsonBody(req): JsonBody<SetLabels>,
) -> Result<Written<SandboxWritten>, ApiError> {
    lifecycle(
        st,
        who,
        rid,
        id.clone(),
        Command::SetSandboxLabels {
            sandbox: id,
            labels: req.labels,
        },
    )
    .await
}

/// What the sandbox may reach: its egress policy as its edge enforces it.
/// Needs sandbox:read.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/network", tag = "sandboxes", params(("id" = String, Path)),
    responses((status = 200, body = api::NetworkPolicy), (status = "4XX", body = api::ErrorBody)))]
pub async fn get_network(
    st: State<AppState>,
    who: Authed,
    id: PathParam<String>,
) -> Result<Json<api::NetworkPolicy>, ApiError> {
    let Json(x) = get(st, who, id).await?;
    Ok(Json(x.network))
}

/// Replaces the sandbox's whole egress policy while it runs: its edge applies it at once,
/// and connections the new policy forbids stop. It never exceeds the project's egress
/// ceiling (a 403 naming the rule). Needs sandbox:write.
#[utoipa::path(put, path = "/v1/sandboxes/{id}/network", tag = "sandboxes", params(("id" = String, Path)), request_body = api::NetworkPolicy,
    responses((status = 200, body = SandboxWritten), (status = "4XX", body = api::ErrorBody)))]
pub async fn set_network(
    st: State<AppState>,
    who: Authed,
    rid: RequestId,
    PathParam(id): PathParam<String>,
    JsonBody(req): JsonBody<api::NetworkPolicy>,
) -> Result<(axum::http::HeaderMap, Written<SandboxWritten>), ApiError> {
    let current = st
        .node
        .read(|s| s.sandboxes.sandboxes.get(&id).and_then(|x| x.network.clone()));
    let cmd = Command::SetSandboxNetwork {
        sandbox: id.clone(),
        network: convert::network_json(&req, current.as_deref()),
    };
    let written = lifecycle(State(st.0.clone()), who, rid, id, cmd)
        .await
        .map_err(|mut e| {
            // The command names the policy `network`; here it is the whole body.
            if let Some(f) = e.body.field.as_mut().filter(|f| f.starts_with("network.")) {
                *f = f["network.".len()..].to_string();
            }
            e
        })?;
    let x = &written.body.sandbox;
    let enforced = st.node.read(|s| convert::egress_enforced(s, &x.edge));
    Ok((convert::egress_warning(&x.network, enforced), written))
}

/// Creates `count` copies of a live sandbox: a container's copies start from its file
/// system as it is now, a microVM's from its memory and disk (the source stops only while
/// they are captured; copies on its edge share its pages). Copies go to the source's edge
/// while it has room, else to other edges, which pull the state from the source's edge;
/// `edge` places them all on one edge. Needs sandbox:write.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/fork", tag = "sandboxes", params(("id" = String, Path)), request_body = ForkSandbox,
    responses((status = 201, body = Forked), (status = "4XX", body = api::ErrorBody), (status = 503, body = api::ErrorBody)))]
pub async fn fork(
    State(st): State<AppState>,
    who: Authed,
    rid: RequestId,
    PathParam(id): PathParam<String>,
    JsonBody(req): JsonBody<ForkSandbox>,
) -> Result<Written<Forked>, ApiError> {
    let s = submit(
        &st,
        &who,
        &rid,
        Command::ForkSandbox {
            sandbox: id,
            count: req.count,
            edge: req.edge,
        },
    )
    .await?;
    let children = s.decided.created_sandboxes();
    let sandboxes = children
        .iter()
        .map(|c| read_sandbox(&st, c))
        .collect::<Result<_, _>>()?;
    Ok(Written {
        index: s.index,
        status: StatusCode::CREATED,
        body: Forked {
            index: s.index,
            sandboxes,
        },
    })
}

async fn lifecycle(
    State(st): State<AppState>,
    who: Authed,
    rid: RequestId,
    id: String,
    cmd: Command,
) -> Result<Written<SandboxWritten>, ApiError> {
    let s = submit(&st, &who, &rid, cmd).await?;
    let sandbox = read_sandbox(&st, &id)?;
    Ok(Written {
        index: s.index,
        status: StatusCode::OK,
        body: SandboxWritten {
            index: s.index,
            sandbox,
        },
    })
}

/// The end of the sandbox's console: its PID 1 output (the agent's log and the
/// template's start command), as plain text. Needs sandbox:read.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/logs", tag = "sandboxes",
    params(("id" = String, Path), ("max_bytes" = Option<u64>, Query, description = "At most this many of the last bytes (default 65536, at most 16 MiB)")),
    responses((status = 200, description = "The last bytes of the log", content_type = "text/plain"), (status = "4XX", body = api::ErrorBody), (status = 502, body = api::ErrorBody)))]
pub async fn logs(
    State(st): State<AppState>,
    who: Authed,
    PathParam(id): PathParam<String>,
    RawQuery(q): RawQuery,
) -> Result<axum::response::Response, ApiError> {
    use axum::response::IntoResponse;
    let params = Params::parse(q.as_deref(), &["max_bytes"])?;
    let max: u64 = match params.one("max_bytes")? {
        None => 64 << 10,
        Some(v) => v
            .parse()
            .ok()
            .filter(|m| *m > 0 && *m <= 16 << 20)
            .ok_or_else(|| ApiError::invalid("max_bytes", "max_bytes must be 1 to 16777216"))?,
    };
    let body = from_edge(
        &st,
        &who,
        &id,
        &format!("/logs/{id}?max_bytes={max}"),
        "has no files on its edge any more (it ended and was removed)",
    )
    .await?;
    Ok(([(axum::http::header::CONTENT_TYPE, "text/plain; charset=utf-8")], body).into_response())
}

/// GETs `path` from the edge of sandbox `id` (visible to `who`, who needs sandbox:read);
/// the edge not knowing it is a 404 saying the sandbox `gone`.
async fn from_edge(
    st: &AppState,
    who: &Authed,
    id: &str,
    path: &str,
    gone: &str,
) -> Result<axum::body::Bytes, ApiError> {
    who.require(Right::SandboxRead)?;
    let address = st.node.read(|s| {
        let x = s
            .sandboxes
            .sandboxes
            .get(id)
            .ok_or_else(|| ApiError::not_found("id", format!("sandbox {id} does not exist")))?;
        if !who.sees(s, &x.project) {
            return Err(ApiError::forbidden(format!(
                "sandbox {id} is outside this token's project {}",
                who.0.project
            )));
        }
        let edge = s.placement.edges.get(&x.edge).ok_or_else(|| {
            ApiError::new(
                StatusCode::BAD_GATEWAY,
                "edge_unreachable",
                format!("the edge {} is not registered", x.edge),
            )
        })?;
        Ok(edge.address.clone())
    })?;
    let (status, body) = crate::edge_client::get(st, &address, path)
        .await
        .map_err(|e| ApiError::new(StatusCode::BAD_GATEWAY, "edge_unreachable", e.0))?;
    match status {
        200 => Ok(body),
        404 => Err(ApiError::not_found("id", format!("sandbox {id} {gone}"))),
        _ => Err(ApiError::new(
            StatusCode::BAD_GATEWAY,
            "edge_unreachable",
            format!("the edge answered {status}: {}", String::from_utf8_lossy(&body)),
        )),
    }
}

/// One sample of the sandbox's CPU, memory and disk, taken now by its edge over 100 ms;
/// for a VM also its VMM and the accelerator its guest runs under. Needs sandbox:read.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/metrics", tag = "sandboxes", params(("id" = String, Path)),
    responses((status = 200, body = api::SandboxMetrics), (status = "4XX", body = api::ErrorBody), (status = 502, body = api::ErrorBody)))]
pub async fn metrics(
    State(st): State<AppState>,
    who: Authed,
    PathParam(id): PathParam<String>,
) -> Result<Json<api::SandboxMetrics>, ApiError> {
    let body = from_edge(
        &st,
        &who,
        &id,
        &format!("/metrics/{id}"),
        "does not run on its edge (it ended, or is still being created)",
    )
    .await?;
    let m: api::SandboxMetrics = serde_json::from_slice(&body).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_GATEWAY,
            "edge_unreachable",
            format!("the edge's metrics are malformed: {e}"),
        )
    })?;
    Ok(Json(m))
}

/// The sandbox's metrics history kept by its edge (a point every 5 s while it runs, the
/// last 8 h), from `start_ms` to `end_ms` (both included; default: all of it), oldest
/// first. Needs sandbox:read.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/metrics/history", tag = "sandboxes",
    params(("id" = String, Path),
        ("start_ms" = Option<u64>, Query, description = "From this time (ms since the Unix epoch)"),
        ("end_ms" = Option<u64>, Query, description = "To this time (ms since the Unix epoch)")),
    responses((status = 200, body = api::MetricsHistory), (status = "4XX", body = api::ErrorBody), (status = 502, body = api::ErrorBody)))]
pub async fn metrics_history(
    State(st): State<AppState>,
    who: Authed,
    PathParam(id): PathParam<String>,
    RawQuery(q): RawQuery,
) -> Result<Json<api::MetricsHistory>, ApiError> {
    let params = Params::parse(q.as_deref(), &["start_ms", "end_ms"])?;
    let ms = |field: &str| -> Result<Option<u64>, ApiError> {
        params
            .one(field)?
            .map(|v| {
                v.parse::<u64>()
                    .map_err(|_| ApiError::invalid(field, format!("{field} must be milliseconds since the Unix epoch")))
            })
            .transpose()
    };
    let (start, end) = (ms("start_ms")?.unwrap_or(0), ms("end_ms")?.unwrap_or(u64::MAX));
    if start > end {
        return Err(ApiError::invalid("end_ms", "end_ms is before start_ms"));
    }
    let points = edge_history(&st, &who, &id, start, end).await?;
    Ok(Json(api::MetricsHistory { points }))
}

/// The points of sandbox `id`'s history on its edge from `start_ms` to `end_ms`.
pub(crate) async fn edge_history(
    st: &AppState,
    who: &Authed,
    id: &str,
    start_ms: u64,
    end_ms: u64,
) -> Result<Vec<api::MetricsPoint>, ApiError> {
    let body = from_edge(
        st,
        who,
        id,
        &format!("/metrics/{id}/history?start_ms={start_ms}&end_ms={end_ms}"),
        "does not run on its edge (it ended, or is still being created)",
    )
    .await?;
    serde_json::from_slice(&body).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_GATEWAY,
            "edge_unreachable",
            format!("the edge's metrics history is malformed: {e}"),
        )
    })
}

fn read_sandbox(st: &AppState, id: &str) -> Result<api::Sandbox, ApiError> {
    st.node
        .read(|s| s.sandboxes.sandboxes.get(id).map(convert::sandbox))
        .ok_or_else(|| ApiError::internal(format!("sandbox {id} was written but is not in the applied state")))
}
