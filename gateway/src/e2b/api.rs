//! The E2B control API: sandboxes (create, connect/resume, get, list, kill, timeout,
//! refresh, pause, metrics, fork, network) and snapshots, on E2B's v1 and v2 paths.
//! Each write is an OpenDsec command submitted with the caller's own token, so
//! `decide` authorises it exactly as on the native API.

use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put};
use axum::{Json, Router};
use opendsec_commands::{Command, SandboxOptions};
use opendsec_control::{Credential, Principal, SandboxTokenKind};
use opendsec_projections::{Desired, Isolation, Observed, Right, Sandbox};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::body::{body_object, check_network, opt_bool, opt_str, opt_u64, string_map, unsupported};
use super::snapshots::{delete_snapshot, list_snapshots, snapshot};
use super::{CLIENT_ID, ENVD_VERSION};
use crate::AppState;
use crate::error::ApiError;

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
        .route("/sandboxes", post(create).get(list_v1))
        .route("/v2/sandboxes", post(create).get(list_v2))
        .route("/sandboxes/{id}", get(detail).delete(kill))
        .route("/sandboxes/{id}/connect", post(connect))
        .route("/v2/sandboxes/{id}/connect", post(connect))
        .route("/sandboxes/{id}/resume", post(connect))
        .route("/sandboxes/{id}/timeout", post(set_timeout))
        .route("/sandboxes/{id}/refreshes", post(refresh))
        .route("/sandboxes/{id}/pause", post(pause))
        .route("/sandboxes/{id}/snapshots", post(snapshot))
        .route("/sandboxes/{id}/metrics", get(metrics))
        .route("/sandboxes/{id}/fork", post(fork))
        .route("/sandboxes/{id}/network", put(network))
        .route("/snapshots", get(list_snapshots))
        .route("/templates/{id}", delete(delete_snapshot))
        .merge(super::templates::routes())
}

/// An error as the E2B SDK reads it: `{"code": <status>, "message": …}`.
#[derive(Debug)]
pub struct E2bError {
    pub status: StatusCode,
    pub message: String,
}

impl E2bError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> E2bError {
        E2bError {
            status,
            message: message.into(),
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
        (
            self.status,
            Json(json!({ "code": self.status.as_u16(), "message": self.message })),
        )
            .into_response()
    }
}

pub(super) type R<T> = Result<T, E2bError>;

/// The caller: an E2B API key in `X-API-KEY`, or an OpenDsec bearer token.
pub(super) fn caller(st: &AppState, headers: &HeaderMap) -> R<Principal> {
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
    st.node
        .authenticate(token)
        .map_err(|r| E2bError::new(StatusCode::UNAUTHORIZED, format!("invalid API key: {}", r.message)))
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

fn request_id(headers: &HeaderMap) -> String {
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
fn e2b_state(x: &Sandbox) -> &'static str {
    if x.desired == Desired::Paused {
        "paused"
    } else {
        "running"
    }
}

/// The sandbox's `templateID`: what it was asked for by; an image run as a microVM is
/// the image's `-vm` template, as a full VM its `-fullvm` template (a snapshot id stays
/// itself).
fn template_of(x: &Sandbox) -> String {
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
fn sandbox_json(st: &AppState, x: &Sandbox) -> Value {
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
fn detail_json(st: &AppState, x: &Sandbox) -> Value {
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
        "allowInternetAccess": false,
        "lifecycle": { "autoResume": x.auto_resume, "onTimeout": if x.auto_pause { "pause" } else { "kill" } },
    });
    if let Some(d) = &st.e2b.domain {
        v["domain"] = json!(d);
    }
    if let Some(n) = x.network.as_deref().and_then(|n| serde_json::from_str::<Value>(n).ok()) {
        v["network"] = n;
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
async fn wait_for(st: &AppState, id: &str, within: Duration, done: impl Fn(&Sandbox) -> Option<R<()>>) -> R<Sandbox> {
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

fn ended(x: &Sandbox) -> Option<R<()>> {
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

// ---- handlers ----

async fn create(State(st): State<AppState>, headers: HeaderMap, body: Bytes) -> R<Response> {
    let who = caller(&st, &headers)?;
    let m = body_object(&body)?;
    let template = opt_str(&m, "templateID")?
        .filter(|t| !t.is_empty())
        .ok_or_else(|| E2bError::bad("templateID is required"))?;
    let timeout = opt_u64(&m, "timeout")?.unwrap_or(DEFAULT_TIMEOUT_SECONDS);
    let auto_pause = opt_bool(&m, "autoPause")?.unwrap_or(false);
    // The next call to a paused sandbox resumes it unless the create says otherwise.
    let auto_resume = match m.get("autoResume") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(Value::Object(o)) => match o.get("enabled") {
            None | Some(Value::Null) => true,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(E2bError::bad("autoResume.enabled must be a boolean")),
        },
        Some(_) => return Err(E2bError::bad("autoResume must be an object {\"enabled\": bool}")),
    };
    // Older SDKs (2.50) ask for internet access on every create. Nothing opens: the
    // sandbox has no egress, the answer says so in a warning header, and get/list report
    // `allowInternetAccess: false`.
    let asked_internet = opt_bool(&m, "allow_internet_access")? == Some(true);
    let _ = opt_bool(&m, "secure")?; // every sandbox is secured by its access token
    let _ = opt_bool(&m, "autoPauseMemory")?; // frozen containers keep their memory; microVMs snapshot theirs
    for f in ["mcp", "iam", "volumeMounts"] {
        unsupported(&m, f)?;
    }
    let network = match m.get("network") {
        None | Some(Value::Null) => None,
        Some(n) => {
            check_network(n, "network")?;
            Some(n.to_string())
        }
    };
    let metadata = string_map(&m, "metadata")?;
    let env = string_map(&m, "envVars")?;
    require(&who, Right::SandboxWrite)?;
    let (image, isolation) = template_image(template);
    let idempotency_key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|k| !k.is_empty())
        .map(str::to_string);
    // A create repeated with its idempotency key (a retry after a lost answer) is the
    // sandbox the first one made.
    if let Some(key) = &idempotency_key {
        let existing = st
            .node
            .read(|s| s.sandboxes.by_idempotency_key(&who.project, key).map(|x| x.id.clone()));
        if let Some(id) = existing {
            let x = wait_ready(&st, &id).await?;
            return Ok(created(sandbox_json(&st, &x)));
        }
    }
    // A template built with a size gives its sandboxes that size.
    let (cpu_count, memory_mb) = st.node.read(|s| {
        let name = image.split_once(':').map_or(image.as_str(), |(n, _)| n);
        s.images
            .template_named(name)
            .filter(|t| s.within(&who.project, &t.project))
            .map_or((0, 0), |t| (t.cpu_count, t.memory_mb))
    });
    let cmd = Command::CreateSandbox {
        project: who.project.clone(),
        image,
        cpu_millis: match cpu_count {
            0 => crate::routes::sandboxes::DEFAULT_CPU_MILLIS,
            n => n as u64 * 1000,
        },
        memory_mb: match memory_mb {
            0 => crate::routes::sandboxes::DEFAULT_MEMORY_MB,
            n => n as u64,
        },
        labels: metadata,
        timeout_seconds: (timeout > 0).then_some(timeout),
        opts: SandboxOptions {
            env,
            auto_pause,
            auto_resume,
            network,
            idempotency_key: idempotency_key.clone(),
            isolation,
            cpu_class: None,
        },
    };
    let s = match submit(&st, &who, &headers, cmd).await {
        Ok(s) => s.decided.target,
        // Two creates with one key raced: the other one's sandbox is the answer.
        Err(e) if e.status == StatusCode::CONFLICT && idempotency_key.is_some() => {
            let key = idempotency_key.as_deref().unwrap_or_default();
            st.node
                .read(|s| s.sandboxes.by_idempotency_key(&who.project, key).map(|x| x.id.clone()))
                .ok_or(e)?
        }
        Err(e) => return Err(e),
    };
    let x = wait_ready(&st, &s).await?;
    let mut resp = created(sandbox_json(&st, &x));
    if asked_internet {
        tracing::info!(sandbox = %x.id, "internet access was asked for; this release gives sandboxes no egress");
        resp.headers_mut()
            .insert("x-opendsec-warning", HeaderValue::from_static(NO_EGRESS_WARNING));
    }
    Ok(resp)
}

/// The suffix of a template name that asks for a microVM of the image: `base-vm` is the
/// `base` image in a QEMU microVM, whose pause, snapshots and forks carry its memory.
pub const MICROVM_TEMPLATE_SUFFIX: &str = "-vm";

/// The suffix of a template name that asks for a full VM of the image: `base-fullvm` is
/// the `base` image booted as a whole disk in a QEMU q35 PC (memory carried as a microVM's).
pub const FULLVM_TEMPLATE_SUFFIX: &str = "-fullvm";

/// The image a template name means, and the isolation it asks for (none: a container,
/// or whatever a snapshot id is a snapshot of). A tag (`base-vm:latest`) stays on the image.
pub fn template_image(template: &str) -> (String, Option<Isolation>) {
    let (name, tag) = match template.split_once(':') {
        Some((n, t)) => (n, Some(t)),
        None => (template, None),
    };
    let asked = [
        (FULLVM_TEMPLATE_SUFFIX, Isolation::Vm),
        (MICROVM_TEMPLATE_SUFFIX, Isolation::Microvm),
    ]
    .into_iter()
    .find_map(|(suffix, isolation)| {
        name.strip_suffix(suffix)
            .filter(|n| !n.is_empty())
            .map(|image| (image, isolation))
    });
    match asked {
        Some((image, isolation)) => (
            tag.map_or_else(|| image.to_string(), |t| format!("{image}:{t}")),
            Some(isolation),
        ),
        None => (template.to_string(), None),
    }
}

/// Said whenever a request asks for egress that this release cannot give.
pub const NO_EGRESS_WARNING: &str = "sandboxes have no network egress in this OpenDsec release (network policy is not implemented yet); allow_internet_access was not granted";

async fn connect(State(st): State<AppState>, headers: HeaderMap, Path(id): Path<String>, body: Bytes) -> R<Response> {
    let who = caller(&st, &headers)?;
    let m = body_object(&body)?;
    let timeout = opt_u64(&m, "timeout")?;
    let x = visible(&st, &who, &id)?;
    let resumed = x.desired == Desired::Paused || x.observed == Observed::Paused;
    if resumed {
        submit(&st, &who, &headers, Command::ResumeSandbox { sandbox: id.clone() }).await?;
    }
    // A connect only extends the lifetime (E2B's rule): a running sandbox whose end is
    // later than `timeout` from now keeps it. A resumed one gets the timeout it asks
    // for, and one whose timeout was spent pausing it runs on with a default lifetime.
    let wanted_end = |t: u64| opendsec_control::now_ms() + t * 1000;
    let lifetime = timeout
        .filter(|t| *t > 0)
        .filter(|t| resumed || x.expires_at_ms.is_some_and(|e| e < wanted_end(*t)))
        .or_else(|| (resumed && x.expires_at_ms.is_none() && x.auto_pause).then_some(DEFAULT_TIMEOUT_SECONDS));
    if let Some(t) = lifetime {
        submit(
            &st,
            &who,
            &headers,
            Command::SetSandboxTimeout {
                sandbox: id.clone(),
                timeout_seconds: t,
            },
        )
        .await?;
    }
    let x = wait_ready(&st, &id).await?;
    let status = if resumed { StatusCode::CREATED } else { StatusCode::OK };
    Ok((status, Json(sandbox_json(&st, &x))).into_response())
}

async fn detail(State(st): State<AppState>, headers: HeaderMap, Path(id): Path<String>) -> R<Json<Value>> {
    let who = caller(&st, &headers)?;
    require(&who, Right::SandboxRead)?;
    let x = visible(&st, &who, &id)?;
    Ok(Json(detail_json(&st, &x)))
}

/// Query parameters as (name, value) pairs, percent-decoded.
pub(super) fn query_pairs(q: Option<&str>) -> Vec<(String, String)> {
    form_urlencoded::parse(q.unwrap_or("").as_bytes())
        .into_owned()
        .collect()
}

async fn list_v1(st: State<AppState>, headers: HeaderMap, q: RawQuery) -> R<Response> {
    list(st, headers, q, true).await
}

async fn list_v2(st: State<AppState>, headers: HeaderMap, q: RawQuery) -> R<Response> {
    list(st, headers, q, false).await
}

/// Sandboxes of the caller's project subtree, newest first (`order=asc`: oldest first),
/// filtered by metadata (`metadata=k%3Dv%26k2%3Dv2`) and state (`state=running,paused`),
/// paginated with `limit` and `nextToken` (the next page's token comes in
/// `X-Next-Token`). A token names a position, (start time, id), not an index: a page
/// goes on after it even when the sandbox it names was killed in between.
async fn list(State(st): State<AppState>, headers: HeaderMap, RawQuery(q): RawQuery, v1: bool) -> R<Response> {
    let who = caller(&st, &headers)?;
    require(&who, Right::SandboxRead)?;
    let mut metadata = BTreeMap::new();
    let mut states: Vec<String> = Vec::new();
    let mut limit = LIST_LIMIT_DEFAULT;
    let mut after: Option<(u64, String)> = None;
    let (mut template, mut descending, mut started_after) = (None::<String>, true, None::<u64>);
    for (k, v) in query_pairs(q.as_deref()) {
        match k.as_str() {
            "metadata" | "query" => {
                // The SDK quotes each key and value before encoding the pairs, and the
                // whole again as a query value: one more decode than the query's own.
                for (mk, mv) in form_urlencoded::parse(v.as_bytes()) {
                    let once_more = |s: &str| percent_encoding::percent_decode_str(s).decode_utf8_lossy().into_owned();
                    metadata.insert(once_more(&mk), once_more(&mv));
                }
            }
            "template" => template = Some(v),
            "order" => match v.as_str() {
                "asc" => descending = false,
                "desc" => descending = true,
                other => return Err(E2bError::bad(format!("order {other:?} is not asc or desc"))),
            },
            "startedAfter" => {
                let t = time::OffsetDateTime::parse(&v, &time::format_description::well_known::Rfc3339)
                    .map_err(|e| E2bError::bad(format!("startedAfter {v:?} is not an RFC 3339 time: {e}")))?;
                started_after = Some(u64::try_from(t.unix_timestamp_nanos() / 1_000_000).unwrap_or(0));
            }
            "state" => {
                for s in v.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                    if s != "running" && s != "paused" {
                        return Err(E2bError::bad(format!("state {s:?} is not running or paused")));
                    }
                    states.push(s.to_string());
                }
            }
            "limit" => {
                limit = v
                    .parse::<usize>()
                    .ok()
                    .filter(|l| (1..=LIST_LIMIT_MAX).contains(l))
                    .ok_or_else(|| E2bError::bad(format!("limit must be 1 to {LIST_LIMIT_MAX}")))?;
            }
            "nextToken" if v.is_empty() => {}
            "nextToken" => {
                after = Some(
                    parse_token(&v)
                        .ok_or_else(|| E2bError::bad(format!("nextToken {v:?} is not a token this API handed out")))?,
                )
            }
            _ => {}
        }
    }
    if v1 && states.is_empty() {
        states.push("running".into());
    }
    let (page, next) = st.node.read(|s| {
        let mut all: Vec<&Sandbox> = s
            .sandboxes
            .sandboxes
            .values()
            .filter(|x| x.is_live() && s.within(&x.project, &who.project))
            .filter(|x| states.is_empty() || states.iter().any(|w| w == e2b_state(x)))
            .filter(|x| metadata.iter().all(|(k, v)| x.labels.get(k) == Some(v)))
            .filter(|x| template.as_ref().is_none_or(|t| *t == template_of(x) || *t == x.image))
            .filter(|x| started_after.is_none_or(|t| x.created_at_ms >= t))
            .collect();
        all.sort_by(|a, b| (a.created_at_ms, &a.id).cmp(&(b.created_at_ms, &b.id)));
        if descending {
            all.reverse();
        }
        // The first sandbox past the token's position in this order, whether or not the
        // sandbox the token names is still there.
        let start = match &after {
            Some((ms, id)) => all
                .iter()
                .position(|x| {
                    let here = (x.created_at_ms, x.id.as_str());
                    let mark = (*ms, id.as_str());
                    if descending { here < mark } else { here > mark }
                })
                .unwrap_or(all.len()),
            None => 0,
        };
        let rest = &all[start..];
        let page: Vec<Value> = rest.iter().take(limit).map(|x| detail_json(&st, x)).collect();
        let next = (rest.len() > limit).then(|| token_of(rest[limit - 1]));
        (page, next)
    });
    let mut resp = Json(Value::Array(page)).into_response();
    if let Some(n) = next.and_then(|n| HeaderValue::from_str(&n).ok()) {
        resp.headers_mut().insert("x-next-token", n);
    }
    Ok(resp)
}

/// A page's position: the start time (ms) and id of its last sandbox.
fn token_of(x: &Sandbox) -> String {
    format!("{}.{}", x.created_at_ms, x.id)
}

fn parse_token(t: &str) -> Option<(u64, String)> {
    let (ms, id) = t.split_once('.')?;
    let ms = ms.parse::<u64>().ok()?;
    (!id.is_empty()).then(|| (ms, id.to_string()))
}

async fn kill(State(st): State<AppState>, headers: HeaderMap, Path(id): Path<String>) -> R<Response> {
    let who = caller(&st, &headers)?;
    visible(&st, &who, &id)?;
    submit(&st, &who, &headers, Command::KillSandbox { sandbox: id }).await?;
    Ok(no_content())
}

async fn set_timeout(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> R<Response> {
    let who = caller(&st, &headers)?;
    let m = body_object(&body)?;
    let t = opt_u64(&m, "timeout")?.ok_or_else(|| E2bError::bad("timeout is required (seconds from now)"))?;
    visible(&st, &who, &id)?;
    submit(
        &st,
        &who,
        &headers,
        Command::SetSandboxTimeout {
            sandbox: id,
            timeout_seconds: t,
        },
    )
    .await?;
    Ok(no_content())
}

/// Extends the lifetime to at least `duration` seconds from now (never shortens it).
async fn refresh(State(st): State<AppState>, headers: HeaderMap, Path(id): Path<String>, body: Bytes) -> R<Response> {
    let who = caller(&st, &headers)?;
    let m = body_object(&body)?;
    let d = opt_u64(&m, "duration")?.unwrap_or(60);
    let x = visible(&st, &who, &id)?;
    let wanted = opendsec_control::now_ms() + d * 1000;
    if x.expires_at_ms.is_some_and(|e| e < wanted) {
        submit(
            &st,
            &who,
            &headers,
            Command::SetSandboxTimeout {
                sandbox: id,
                timeout_seconds: d,
            },
        )
        .await?;
    }
    Ok(no_content())
}

async fn pause(State(st): State<AppState>, headers: HeaderMap, Path(id): Path<String>) -> R<Response> {
    let who = caller(&st, &headers)?;
    let x = visible(&st, &who, &id)?;
    if x.desired == Desired::Paused {
        return Err(E2bError::new(
            StatusCode::CONFLICT,
            format!("sandbox {id} is already paused"),
        ));
    }
    submit(&st, &who, &headers, Command::PauseSandbox { sandbox: id.clone() }).await?;
    wait_for(&st, &id, ACTION_WAIT, |x| {
        ended(x).or_else(|| (x.observed == Observed::Paused).then_some(Ok(())))
    })
    .await?;
    Ok(no_content())
}

/// Without `start`/`end`: one sample of the sandbox's CPU, memory and disk, taken now by
/// its edge. With either (Unix seconds, both included): the points of its history kept
/// by the edge (one every 5 s while it runs, the last 8 h), oldest first; an empty list
/// when there are none.
async fn metrics(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> R<Response> {
    let who = caller(&st, &headers)?;
    require(&who, Right::SandboxRead)?;
    let (mut start, mut end) = (None::<u64>, None::<u64>);
    for (k, v) in query_pairs(q.as_deref()) {
        let slot = match k.as_str() {
            "start" => &mut start,
            "end" => &mut end,
            _ => continue,
        };
        *slot = Some(
            v.parse::<u64>()
                .map_err(|_| E2bError::bad(format!("{k} must be a Unix time in seconds, not {v:?}")))?,
        );
    }
    let x = visible(&st, &who, &id)?;
    if start.is_some() || end.is_some() {
        return metrics_history(&st, &x, start, end).await;
    }
    let address = st
        .node
        .read(|s| s.placement.edges.get(&x.edge).map(|e| e.address.clone()));
    let address = address.ok_or_else(|| {
        E2bError::new(
            StatusCode::BAD_GATEWAY,
            format!("the edge of sandbox {id} is not registered"),
        )
    })?;
    let (status, body) = super::traffic::edge_get(&st, &address, &format!("/metrics/{id}")).await?;
    if status != 200 {
        return Err(E2bError::new(
            StatusCode::BAD_GATEWAY,
            format!(
                "the edge could not sample sandbox {id}: {}",
                String::from_utf8_lossy(&body)
            ),
        ));
    }
    let m: Value = serde_json::from_slice(&body).map_err(|e| {
        E2bError::new(
            StatusCode::BAD_GATEWAY,
            format!("the edge's metrics are malformed: {e}"),
        )
    })?;
    let now = opendsec_control::now_ms();
    Ok(Json(json!([{
        "timestamp": rfc3339(now),
        "timestampUnix": now / 1000,
        "cpuCount": m["cpu_count"],
        "cpuUsedPct": m["cpu_used_pct"],
        "memUsed": m["mem_used"],
        "memTotal": m["mem_total"],
        "memCache": m["mem_cache"],
        "diskUsed": m["disk_used"],
        "diskTotal": m["disk_total"],
    }]))
    .into_response())
}

async fn metrics_history(st: &AppState, x: &Sandbox, start: Option<u64>, end: Option<u64>) -> R<Response> {
    let id = &x.id;
    let start_ms = start.map_or(0, |s| s.saturating_mul(1000));
    let end_ms = end.map_or(u64::MAX, |e| e.saturating_mul(1000).saturating_add(999));
    if start_ms > end_ms {
        return Err(E2bError::bad("end is before start"));
    }
    let address = st
        .node
        .read(|s| s.placement.edges.get(&x.edge).map(|e| e.address.clone()))
        .ok_or_else(|| {
            E2bError::new(
                StatusCode::BAD_GATEWAY,
                format!("the edge of sandbox {id} is not registered"),
            )
        })?;
    let path = format!("/metrics/{id}/history?start_ms={start_ms}&end_ms={end_ms}");
    let (status, body) = super::traffic::edge_get(st, &address, &path).await?;
    let points: Vec<opendsec_sdk::types::MetricsPoint> = match status {
        200 => serde_json::from_slice(&body).map_err(|e| {
            E2bError::new(
                StatusCode::BAD_GATEWAY,
                format!("the edge's metrics history is malformed: {e}"),
            )
        })?,
        // The edge does not run it (yet, or any more: a paused microVM, a sandbox
        // being moved): no points.
        404 => Vec::new(),
        _ => {
            return Err(E2bError::new(
                StatusCode::BAD_GATEWAY,
                format!(
                    "the edge could not read the history of sandbox {id}: {}",
                    String::from_utf8_lossy(&body)
                ),
            ));
        }
    };
    let out: Vec<Value> = points
        .iter()
        .map(|p| {
            json!({
                "timestamp": rfc3339(p.timestamp_ms),
                "timestampUnix": p.timestamp_ms / 1000,
                "cpuCount": p.cpu_count,
                "cpuUsedPct": p.cpu_used_pct,
                "memUsed": p.mem_used,
                "memTotal": p.mem_total,
                "memCache": p.mem_cache,
                "diskUsed": p.disk_used,
                "diskTotal": p.disk_total,
            })
        })
        .collect();
    Ok(Json(Value::Array(out)).into_response())
}

/// `count` copies of the sandbox as it is now: a container's with its file system, a
/// microVM's (`-vm` templates) with its memory and disk.
async fn fork(State(st): State<AppState>, headers: HeaderMap, Path(id): Path<String>, body: Bytes) -> R<Response> {
    let who = caller(&st, &headers)?;
    let m = body_object(&body)?;
    let count = opt_u64(&m, "count")?.unwrap_or(1);
    let timeout = opt_u64(&m, "timeout")?;
    if count == 0 || count > opendsec_commands::LIMITS.fork_count as u64 {
        return Err(E2bError::bad(format!(
            "count must be 1 to {}",
            opendsec_commands::LIMITS.fork_count
        )));
    }
    visible(&st, &who, &id)?;
    let s = submit(
        &st,
        &who,
        &headers,
        Command::ForkSandbox {
            sandbox: id,
            count: count as u32,
            edge: None,
        },
    )
    .await?;
    let children = s.decided.created_sandboxes();
    let mut out = Vec::new();
    for c in children {
        let r = async {
            if let Some(t) = timeout.filter(|t| *t > 0) {
                submit(
                    &st,
                    &who,
                    &headers,
                    Command::SetSandboxTimeout {
                        sandbox: c.clone(),
                        timeout_seconds: t,
                    },
                )
                .await?;
            }
            wait_ready(&st, &c).await
        }
        .await;
        out.push(match r {
            Ok(x) => json!({ "sandbox": sandbox_json(&st, &x) }),
            Err(e) => json!({ "error": { "code": e.status.as_u16(), "message": e.message } }),
        });
    }
    Ok(created(Value::Array(out)))
}

async fn network(State(st): State<AppState>, headers: HeaderMap, Path(id): Path<String>, body: Bytes) -> R<Response> {
    let who = caller(&st, &headers)?;
    let m = body_object(&body)?;
    let v = Value::Object(m);
    check_network(&v, "network")?;
    visible(&st, &who, &id)?;
    submit(
        &st,
        &who,
        &headers,
        Command::SetSandboxNetwork {
            sandbox: id,
            network: v.to_string(),
        },
    )
    .await?;
    Ok(no_content())
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

/// Resumes a paused sandbox on behalf of a request made to it (E2B auto-resume). The
/// gateway acts as the control plane here: the request proved it holds the sandbox's
/// access token.
pub(crate) async fn auto_resume(st: &AppState, id: &str) -> R<Sandbox> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_token_names_a_start_time_and_an_id() {
        assert_eq!(
            parse_token("1700000000123.sbx-a.b"),
            Some((1700000000123, "sbx-a.b".to_string()))
        );
        assert_eq!(parse_token("12"), None, "no id");
        assert_eq!(parse_token("12."), None, "an empty id");
        assert_eq!(parse_token("x.sbx"), None, "no time");
        assert_eq!(parse_token("-1.sbx"), None, "a negative time");
    }

    #[test]
    fn a_vm_suffix_asks_for_a_microvm_of_the_image() {
        assert_eq!(
            template_image("base-vm"),
            ("base".to_string(), Some(Isolation::Microvm))
        );
        assert_eq!(
            template_image("code-interpreter-v1-vm:latest"),
            ("code-interpreter-v1:latest".to_string(), Some(Isolation::Microvm))
        );
        assert_eq!(template_image("base-fullvm"), ("base".to_string(), Some(Isolation::Vm)));
        assert_eq!(
            template_image("base-fullvm:latest"),
            ("base:latest".to_string(), Some(Isolation::Vm))
        );
        assert_eq!(template_image("-fullvm"), ("-fullvm".to_string(), None));
        assert_eq!(template_image("base"), ("base".to_string(), None));
        assert_eq!(
            template_image("snap-0123456789abcdef"),
            ("snap-0123456789abcdef".to_string(), None)
        );
        assert_eq!(
            template_image("-vm"),
            ("-vm".to_string(), None),
            "a suffix alone names no image"
        );
    }
}
