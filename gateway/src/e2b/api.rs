//! The E2B control API: its routes (sandboxes on E2B's v1 and v2 paths, snapshots,
//! templates), and what every handler shares: the caller, errors in E2B's shape,
//! submitting commands, the response bodies, waiting for a sandbox, and readying one
//! for traffic. The handlers: `lifecycle.rs` (writes), `listing.rs` (reads),
//! `snapshots.rs`, `templates.rs`. Each write is an OpenDsec command submitted with the
//! caller's own token, so `decide` authorises it exactly as on the native API.

use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put};
use axum::{Json, Router};
use opendsec_commands::Command;
use opendsec_control::{Credential, Principal, SandboxTokenKind};
use opendsec_projections::{Desired, Isolation, Observed, Right, Sandbox};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

use super::lifecycle::{FULLVM_TEMPLATE_SUFFIX, MICROVM_TEMPLATE_SUFFIX};
use super::snapshots::{delete_snapshot, list_snapshots, snapshot};
use super::{CLIENT_ID, ENVD_VERSION};
use super::{lifecycle, listing};
use crate::AppState;
use crate::error::ApiError;
pub(super) use listing::query_pairs;

/// The default lifetime of an E2B sandbox, in seconds (the SDK's default too).
pub const DEFAULT_TIMEOUT_SECONDS: u64 = 300;
/// How long a create, resume or fork waits for its sandboxes to be ready.
pub const READY_WAIT: Duration = Duration::from_secs(120);
/// How long a pause or snapshot waits for the edge to carry it out.
pub const ACTION_WAIT: Duration = Duration::from_secs(60);
pub(super) const LIST_LIMIT_DEFAULT: usize = 100;
pub(super) const LIST_LIMIT_MAX: usize = 1000;

/// The E2B routes, to merge into the gateway's router.
pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/sandboxes", post(lifecycle::create).get(listing::list_v1))
        .route("/v2/sandboxes", post(lifecycle::create).get(listing::list_v2))
        .route("/sandboxes/{id}", get(listing::detail).delete(lifecycle::kill))
        .route("/sandboxes/{id}/connect", post(lifecycle::connect))
        .route("/v2/sandboxes/{id}/connect", post(lifecycle::connect))
        .route("/sandboxes/{id}/resume", post(lifecycle::connect))
        .route("/sandboxes/{id}/timeout", post(lifecycle::set_timeout))
        .route("/sandboxes/{id}/refreshes", post(lifecycle::refresh))
        .route("/sandboxes/{id}/pause", post(lifecycle::pause))
        .route("/sandboxes/{id}/snapshots", post(snapshot))
        .route("/sandboxes/{id}/metrics", get(listing::metrics))
        .route("/sandboxes/{id}/fork", post(lifecycle::fork))
        .route("/sandboxes/{id}/network", put(lifecycle::network))
        .route("/snapshots", get(list_snapshots))
        .route("/templates/{id}", delete(delete_snapshot))
        .merge(super::templates::routes())
}

/// An error as the E2B SDK reads it: `{"code": <status>, "message": …}`.
#[derive(Debug)]
pub struct E2bError {
    pub status: StatusCode,
    pub message: String,
    /// A rate-limited write: `Retry-After`.
    pub retry_after_ms: Option<u64>,
}

impl E2bError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> E2bError {
        E2bError {
            status,
            message: message.into(),
            retry_after_ms: None,
        }
    }
    pub(super) fn bad(message: impl Into<String>) -> E2bError {
        E2bError::new(StatusCode::BAD_REQUEST, message)
    }
    fn not_found(id: &str) -> E2bError {
        E2bError::new(StatusCode::NOT_FOUND, format!("sandbox {id} not found"))
    }
}

impl From<ApiError> for E2bError {
    fn from(e: ApiError) -> E2bError {
        let message = match &e.body.field {
            Some(f) if !e.body.message.contains(f.as_str()) => format!("{f}: {}", e.body.message),
            _ => e.body.message,
        };
        E2bError {
            status: e.status,
            message,
            retry_after_ms: e.retry_after_ms,
        }
    }
}

impl From<opendsec_control::SubmitError> for E2bError {
    fn from(e: opendsec_control::SubmitError) -> E2bError {
        ApiError::from(e).into()
    }
}

impl IntoResponse for E2bError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::warn!(status = %self.status, message = %self.message, "E2B request failed");
        }
        let mut resp = (
            self.status,
            Json(json!({ "code": self.status.as_u16(), "message": self.message })),
        )
            .into_response();
        if let Some(ms) = self.retry_after_ms {
            resp.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from(ms.div_ceil(1000).max(1)),
            );
        }
        resp
    }
}

pub(super) type R<T> = Result<T, E2bError>;

/// The caller: an E2B API key in `X-API-KEY`, or an OpenDsec bearer token.
pub(super) async fn caller(st: &AppState, headers: &HeaderMap) -> R<Principal> {
    let key = headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|k| !k.is_empty());
    let bearer = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
        .map(str::trim);
    let token = key
        .or(bearer)
        .ok_or_else(|| E2bError::new(StatusCode::UNAUTHORIZED, "missing API key: send X-API-KEY: e2b_…"))?;
    let p = st
        .node
        .authenticate(token)
        .map_err(|r| E2bError::new(StatusCode::UNAUTHORIZED, format!("invalid API key: {}", r.message)))?;
    // A lagging or partitioned node never serves authority the leader has revoked.
    st.node.confirm_current(token).await.map_err(|e| match e {
        opendsec_control::SubmitError::Rejected { rejection, .. } => E2bError::new(
            StatusCode::UNAUTHORIZED,
            format!("invalid API key: {}", rejection.message),
        ),
        other => E2bError::from(other),
    })?;
    Ok(p)
}

pub(super) fn require(p: &Principal, r: Right) -> R<()> {
    if p.has(r) {
        Ok(())
    } else {
        Err(E2bError::new(
            StatusCode::FORBIDDEN,
            format!("this API key lacks the right {}", r.as_str()),
        ))
    }
}

pub(super) fn request_id(headers: &HeaderMap) -> String {
    headers
        .get("idempotency-key")
        .or_else(|| headers.get(crate::REQUEST_ID_HEADER))
        .and_then(|v| v.to_str().ok())
        .filter(|s| !s.is_empty() && s.len() <= 128 && s.bytes().all(|b| b.is_ascii_graphic()))
        .map(str::to_string)
        .unwrap_or_else(|| uuid::Uuid::new_v4().to_string())
}

pub(super) async fn submit(
    st: &AppState,
    who: &Principal,
    headers: &HeaderMap,
    cmd: Command,
) -> R<opendsec_control::Submitted> {
    submit_as(st, who.credential(), headers, cmd).await
}

pub(super) async fn submit_as(
    st: &AppState,
    cred: Credential,
    headers: &HeaderMap,
    cmd: Command,
) -> R<opendsec_control::Submitted> {
    let action = cmd.action();
    let s = st
        .node
        .submit(cred, request_id(headers), cmd)
        .await
        .inspect_err(|e| tracing::info!(action, error = %e, "E2B write refused"))?;
    st.node
        .wait_applied(s.index, crate::extract::MIN_INDEX_WAIT)
        .await
        .map_err(|_| {
            E2bError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "the write was committed but this node has not applied it yet",
            )
        })?;
    Ok(s)
}

// ---- responses ----

pub(super) fn rfc3339(ms: u64) -> String {
    time::OffsetDateTime::from_unix_timestamp_nanos(ms as i128 * 1_000_000)
        .ok()
        .and_then(|t| t.format(&time::format_description::well_known::Rfc3339).ok())
        .unwrap_or_default()
}

/// E2B's state is what was last asked: a sandbox asked to resume reads `running` at once,
/// even while its edge is still thawing it (requests to it wait for that).
pub(super) fn e2b_state(x: &Sandbox) -> &'static str {
    if x.desired == Desired::Paused {
        "paused"
    } else {
        "running"
    }
}

/// The sandbox's `templateID`: what it was asked for by; an image run as a microVM is
/// the image's `-vm` template, as a full VM its `-fullvm` template (a snapshot id stays
/// itself).
pub(super) fn template_of(x: &Sandbox) -> String {
    let asked = x.template.clone().unwrap_or_else(|| x.image.clone());
    let suffix = match x.isolation {
        Isolation::Microvm => MICROVM_TEMPLATE_SUFFIX,
        Isolation::Vm => FULLVM_TEMPLATE_SUFFIX,
        Isolation::Container => return asked,
    };
    if x.snapshot.is_none() {
        let (name, tag) = asked
            .split_once(':')
            .map_or((asked.as_str(), None), |(n, t)| (n, Some(t)));
        return match tag {
            Some(t) => format!("{name}{suffix}:{t}"),
            None => format!("{name}{suffix}"),
        };
    }
    asked
}

/// E2B's `Sandbox`: what create and connect return.
pub(super) fn sandbox_json(st: &AppState, x: &Sandbox) -> Value {
    let mut v = json!({
        "sandboxID": x.id,
        "templateID": template_of(x),
        "clientID": CLIENT_ID,
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": st.node.sandbox_token(SandboxTokenKind::Agent, &x.id),
        "trafficAccessToken": st.node.sandbox_token(SandboxTokenKind::Traffic, &x.id),
    });
    if let Some(d) = &st.e2b.domain {
        v["domain"] = json!(d);
    }
    v
}

/// E2B's `SandboxDetail` (also `ListedSandbox`).
pub(super) fn detail_json(st: &AppState, x: &Sandbox) -> Value {
    let end = x.expires_at_ms.unwrap_or(x.created_at_ms + 366 * 24 * 3600 * 1000);
    let mut v = json!({
        "sandboxID": x.id,
        "templateID": template_of(x),
        "clientID": CLIENT_ID,
        "startedAt": rfc3339(x.created_at_ms),
        "endAt": rfc3339(end),
        "envdVersion": ENVD_VERSION,
        "cpuCount": x.cpu_millis.div_ceil(1000).max(1),
        "memoryMB": x.memory_mb,
        "diskSizeMB": st.e2b.disk_size_mb,
        "state": e2b_state(x),
        "metadata": x.labels,
        "envdAccessToken": st.node.sandbox_token(SandboxTokenKind::Agent, &x.id),
        "allowInternetAccess": opendsec_commands::network::Policy::of_logged(x.network.as_deref()).allow_internet,
        "lifecycle": { "autoResume": x.auto_resume, "onTimeout": if x.auto_pause { "pause" } else { "kill" } },
    });
    if let Some(d) = &st.e2b.domain {
        v["domain"] = json!(d);
    }
    if let Some(n) = e2b_network_json(x.network.as_deref()) {
        v["network"] = n;
    }
    if e2b_state(x) == "paused" {
        v["pauseMode"] = json!(if x.pause_filesystem { "filesystem" } else { "full" });
    }
    v
}

pub(super) fn created(v: Value) -> Response {
    (StatusCode::CREATED, Json(v)).into_response()
}

pub(super) fn no_content() -> Response {
    StatusCode::NO_CONTENT.into_response()
}

// ---- reading and waiting ----

/// A sandbox the caller may see, that has not ended (E2B forgets ended sandboxes).
pub(super) fn visible(st: &AppState, who: &Principal, id: &str) -> R<Sandbox> {
    st.node.read(|s| {
        let x = s.sandboxes.sandboxes.get(id).ok_or_else(|| E2bError::not_found(id))?;
        if !s.within(&x.project, &who.project) || !x.is_live() {
            return Err(E2bError::not_found(id));
        }
        Ok(x.clone())
    })
}

/// Waits until `done` says the sandbox got where it should (Ok) or cannot (Err).
pub(super) async fn wait_for(
    st: &AppState,
    id: &str,
    within: Duration,
    done: impl Fn(&Sandbox) -> Option<R<()>>,
) -> R<Sandbox> {
    let deadline = Instant::now() + within;
    let mut pause = Duration::from_millis(2);
    loop {
        let x = st
            .node
            .read(|s| s.sandboxes.sandboxes.get(id).cloned())
            .ok_or_else(|| E2bError::not_found(id))?;
        if let Some(r) = done(&x) {
            return r.map(|_| x);
        }
        if Instant::now() >= deadline {
            return Err(E2bError::new(
                StatusCode::GATEWAY_TIMEOUT,
                format!("sandbox {id} did not get there within {} s", within.as_secs()),
            ));
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

pub(super) fn ended(x: &Sandbox) -> Option<R<()>> {
    match x.observed {
        Observed::Failed | Observed::Exited => {
            let why = x.reason.clone().unwrap_or_else(|| "it ended".into());
            Some(Err(E2bError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("sandbox {} failed to start: {why}", x.id),
            )))
        }
        _ if x.desired == Desired::Killed => Some(Err(E2bError::not_found(&x.id))),
        _ => None,
    }
}

/// Until the edge reports it running.
pub(crate) async fn wait_ready(st: &AppState, id: &str) -> R<Sandbox> {
    wait_for(st, id, READY_WAIT, |x| {
        ended(x).or_else(|| (x.observed == Observed::Ready && x.desired == Desired::Running).then_some(Ok(())))
    })
    .await
}

/// Readies sandbox `x` for a request to it: a paused one created with auto-resume is
/// resumed (through the log), and one whose resume or start is under way (desired
/// running, observed paused or pending) is waited for, rather than the request meeting a
/// frozen sandbox or one its edge does not run yet. Returns its state once it runs, or
/// `None` if nothing was needed.
pub(crate) async fn ready_for_traffic(st: &AppState, x: &Sandbox) -> R<Option<Sandbox>> {
    if x.desired == Desired::Paused && x.auto_resume {
        auto_resume(st, &x.id).await.map(Some)
    } else if x.desired == Desired::Running && matches!(x.observed, Observed::Paused | Observed::Pending) {
        // Resuming, or still starting (a call right after a create or fork that did not
        // wait): the call waits until the sandbox runs, rather than failing.
        wait_ready(st, &x.id).await.map(Some)
    } else {
        Ok(None)
    }
}

/// Waits until a pause its edge is still carrying out is done (bounded): a resume asked
/// before the edge reports the pause would let calls through while that pause ends the
/// agent (a file-system pause) or the resume boots it again. The next call and E2B's
/// connect wait so (REST's `/resume` records the wish at once, as every REST write; a
/// call after it is held by the edge instead, until the pause and the resume are both
/// carried out: `x-opendsec-after`).
/// Nothing to wait for (no such sandbox, one ended, one not pausing) is Ok: the resume's
/// own command says what is wrong with it.
pub(crate) async fn pause_settled(st: &AppState, id: &str) -> R<()> {
    let settled = |x: &Sandbox| x.desired != Desired::Paused || x.observed == Observed::Paused || ended(x).is_some();
    if st.node.read(|s| s.sandboxes.sandboxes.get(id).is_none_or(settled)) {
        return Ok(());
    }
    wait_for(st, id, ACTION_WAIT, |x| settled(x).then_some(Ok(())))
        .await
        .map(drop)
}

/// Resumes a paused sandbox on behalf of a request made to it (E2B auto-resume). The
/// gateway acts as the control plane here: the request proved it holds the sandbox's
/// access token.
pub(crate) async fn auto_resume(st: &AppState, id: &str) -> R<Sandbox> {
    pause_settled(st, id).await?;
    let headers = HeaderMap::new();
    let spent = st.node.read(|s| {
        s.sandboxes
            .sandboxes
            .get(id)
            .is_some_and(|x| x.expires_at_ms.is_none() && x.auto_pause)
    });
    submit_as(
        st,
        Credential::System,
        &headers,
        Command::ResumeSandbox {
            sandbox: id.to_string(),
            cold: false,
        },
    )
    .await?;
    // Its timeout was spent pausing it: it runs on with a default lifetime, and pauses
    // again at its end.
    if spent {
        let cmd = Command::SetSandboxTimeout {
            sandbox: id.to_string(),
            timeout_seconds: DEFAULT_TIMEOUT_SECONDS,
        };
        submit_as(st, Credential::System, &headers, cmd).await?;
    }
    wait_ready(st, id).await
}

/// A sandbox's network settings as E2B shows them: its egress rules (`allowOut`,
/// `denyOut`, `dnsServers`, as the edge enforces them) and the settings of traffic into
/// it, as asked; nothing when none were ever set.
fn e2b_network_json(logged: Option<&str>) -> Option<Value> {
    let Ok(Value::Object(raw)) = serde_json::from_str::<Value>(logged?) else {
        return None;
    };
    let canonical = opendsec_commands::network::Policy::of_logged(logged).to_json();
    let mut out: serde_json::Map<String, Value> = raw
        .into_iter()
        .filter(|(k, _)| {
            !matches!(
                k.as_str(),
                "allow_out"
                    | "allowOut"
                    | "deny_out"
                    | "denyOut"
                    | "dns_servers"
                    | "dnsServers"
                    | "allow_internet_access"
                    | "allowInternetAccess"
                    | "egress_proxy"
                    | "egressProxy"
            )
        })
        .collect();
    // The proxy in E2B's shape, its password and CA certificate never shown.
    if let Some(p) = opendsec_commands::network::Policy::of_logged(logged).egress_proxy {
        let mut proxy = serde_json::json!({"address": p.authority()});
        if let Some(u) = p.username {
            proxy["username"] = Value::String(u);
        }
        if let Some(t) = p.tls {
            proxy["tls"] = serde_json::json!({"enabled": true});
            if let Some(n) = t.server_name {
                proxy["tls"]["serverName"] = Value::String(n);
            }
        }
        out.insert("egressProxy".into(), proxy);
    }
    for (camel, canonical_key) in [
        ("allowOut", "allow_out"),
        ("denyOut", "deny_out"),
        ("dnsServers", "dns_servers"),
    ] {
        if canonical[canonical_key].as_array().is_some_and(|a| !a.is_empty()) {
            out.insert(camel.into(), canonical[canonical_key].clone());
        }
    }
    Some(Value::Object(out))
}
