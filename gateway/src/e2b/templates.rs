//! E2B's template build API (what `Template.build` in the unmodified SDKs calls):
//! `POST /v3/templates` asks for a build, `GET /templates/{id}/files/{hash}` says whether
//! a COPY step's files are here and where to upload them (a signed URL on this gateway:
//! `PUT /templates/{id}/files/{hash}/upload`), `POST /v2/templates/{id}/builds/{build}`
//! gives the steps and starts the build (run by [`super::builder`] on this node), and
//! `GET /templates/{id}/builds/{build}/status` reports it with its log entries from
//! `logsOffset`. Names and tags: `GET /templates/aliases/{name}`, `POST` and `DELETE
//! /templates/tags`, `GET /templates/{id}/tags`; `DELETE /templates/{id}` removes a
//! template (or a snapshot, as before).
//!
//! What a build is and how it is decided lives in the log (`commands`' templates); its
//! log entries are kept by the node that runs it (in memory, bounded): another node
//! reports the build's state with no entries.

use axum::body::{Body, Bytes};
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use opendsec_commands::Command;
use opendsec_control::Principal;
use opendsec_projections::{BuildStatus, Event, Right, Template};
use serde_json::{Map, Value, json};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;

use super::api::{E2bError, R, caller, require, rfc3339, submit};
use super::body::{body_object, opt_str, opt_u64};
use crate::AppState;

/// How long an upload URL stays valid.
const UPLOAD_URL_SECONDS: u64 = 3600;
/// The largest file archive one COPY step may upload.
pub const MAX_UPLOAD_BYTES: u64 = 4 << 30;
/// Log entries one build keeps (later ones are dropped, saying so).
const MAX_LOG_ENTRIES: usize = 20_000;
/// The most entries one status answer carries.
const MAX_STATUS_ENTRIES: usize = 1000;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v3/templates", post(request_build))
        .route("/templates/aliases/{name}", get(alias))
        .route("/templates/tags", post(assign_tags).delete(remove_tags))
        .route("/templates/{id}/tags", get(list_tags))
        .route("/templates/{id}/files/{hash}", get(files))
        .route(
            "/templates/{id}/files/{hash}/upload",
            put(upload).layer(axum::extract::DefaultBodyLimit::disable()),
        )
        .route("/v2/templates/{id}/builds/{build}", post(start_build))
        .route("/templates/{id}/builds/{build}/status", get(status))
}

/// One log entry of a build, as E2B's status answer carries it.
#[derive(Clone, Debug)]
pub struct LogEntry {
    pub at_ms: u64,
    pub level: &'static str,
    pub message: String,
    pub step: Option<String>,
}

/// What this node keeps of the builds it runs: their log entries, and the files their
/// COPY steps uploaded (`<files>/<template>/<hash>`).
pub struct Builds {
    logs: Mutex<HashMap<String, Vec<LogEntry>>>,
    pub files: PathBuf,
    /// What this process writes as its builds' runner: `<node id>/<a run id of its own>`.
    pub runner: String,
}

impl Builds {
    pub fn new(files: PathBuf, node_id: u64) -> Builds {
        Builds {
            logs: Mutex::new(HashMap::new()),
            files,
            runner: format!("{node_id}/{}", uuid::Uuid::new_v4().simple()),
        }
    }

    /// Adds an entry to build `build`'s log (past the bound, one last entry says so).
    pub fn log(&self, build: &str, level: &'static str, step: Option<&str>, message: impl Into<String>) {
        let mut logs = self.logs.lock().expect("build logs");
        let entries = logs.entry(build.to_string()).or_default();
        if entries.len() > MAX_LOG_ENTRIES {
            return;
        }
        let message = if entries.len() == MAX_LOG_ENTRIES {
            format!("the build's log is over {MAX_LOG_ENTRIES} entries: later ones are left out")
        } else {
            message.into()
        };
        entries.push(LogEntry {
            at_ms: opendsec_edge_api::now_ms(),
            level,
            message,
            step: step.map(str::to_string),
        });
    }

    fn entries(&self, build: &str, from: usize, limit: usize) -> Vec<LogEntry> {
        let logs = self.logs.lock().expect("build logs");
        logs.get(build)
            .map(|e| e.iter().skip(from).take(limit).cloned().collect())
            .unwrap_or_default()
    }

    /// Where the files of `hash` for `template` are kept.
    pub fn file_path(&self, template: &str, hash: &str) -> PathBuf {
        self.files.join(template).join(hash)
    }
}

/// A files hash as the SDK makes it: lowercase hex SHA-256.
fn check_hash(hash: &str) -> R<()> {
    if hash.len() == 64 && hash.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        Ok(())
    } else {
        Err(E2bError::bad("filesHash must be 64 lowercase hex digits (a SHA-256)"))
    }
}

/// The template `id` (an id or a name) the caller may see.
fn template(st: &AppState, who: &Principal, id: &str) -> R<Template> {
    st.node.read(|s| {
        let t = s
            .images
            .template_named(id)
            .ok_or_else(|| E2bError::new(StatusCode::NOT_FOUND, format!("template {id} not found")))?;
        if !s.within(&t.project, &who.project) {
            return Err(E2bError::new(StatusCode::NOT_FOUND, format!("template {id} not found")));
        }
        Ok(t.clone())
    })
}

fn accepted(v: Value) -> Response {
    (StatusCode::ACCEPTED, Json(v)).into_response()
}

/// `POST /v3/templates`: `{name?: "name[:tag]", tags?, cpuCount?, memoryMB?}` → 202
/// `{templateID, buildID, public, names, tags, aliases}`.
async fn request_build(State(st): State<AppState>, headers: HeaderMap, body: Bytes) -> R<Response> {
    let who = caller(&st, &headers).await?;
    require(&who, Right::SandboxWrite)?;
    let m = body_object(&body)?;
    let given = opt_str(&m, "name")?.or(opt_str(&m, "alias")?).filter(|n| !n.is_empty());
    let (name, name_tag) = match given.map(|n| n.split_once(':').map_or((n, None), |(a, t)| (a, Some(t)))) {
        Some((n, t)) => (Some(n.to_string()), t.map(str::to_string)),
        None => (None, None),
    };
    let mut tags: Vec<String> = match m.get("tags") {
        None | Some(Value::Null) => vec![],
        Some(Value::Array(a)) => a
            .iter()
            .map(|t| {
                t.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| E2bError::bad("tags must be strings"))
            })
            .collect::<R<_>>()?,
        Some(_) => return Err(E2bError::bad("tags must be a list of strings")),
    };
    if let Some(t) = name_tag {
        tags.insert(0, t);
    }
    tags.dedup();
    let cpu_count = opt_u64(&m, "cpuCount")?.unwrap_or(0);
    let memory_mb = opt_u64(&m, "memoryMB")?.unwrap_or(0);
    if cpu_count > 256 {
        return Err(E2bError::bad("cpuCount: at most 256"));
    }
    if memory_mb > u32::MAX as u64 {
        return Err(E2bError::bad("memoryMB is too large"));
    }
    let cmd = Command::RequestTemplateBuild {
        project: who.project.clone(),
        name: name.clone(),
        tags: tags.clone(),
        cpu_count: cpu_count as u32,
        memory_mb: memory_mb as u32,
    };
    let done = submit(&st, &who, &headers, cmd).await?;
    let Some(Event::TemplateBuildRequested(e)) = done.decided.events.first() else {
        return Err(E2bError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the build was not requested",
        ));
    };
    st.builds.log(
        &e.build_id,
        "info",
        None,
        format!("build {} of template {} requested", e.build_id, e.template_id),
    );
    Ok(accepted(json!({
        "templateID": e.template_id,
        "buildID": e.build_id,
        "public": false,
        "names": name.iter().collect::<Vec<_>>(),
        "tags": e.tags,
        "aliases": name.iter().collect::<Vec<_>>(),
    })))
}

/// The base URL the caller reached this gateway at (for the upload URL, which the SDK
/// uses as it is).
fn base_url(st: &AppState, headers: &HeaderMap) -> R<String> {
    let host = headers
        .get("host")
        .and_then(|v| v.to_str().ok())
        .filter(|h| !h.is_empty() && h.bytes().all(|b| b.is_ascii_graphic()))
        .ok_or_else(|| E2bError::bad("the request has no Host header"))?;
    let forwarded = headers
        .get("x-forwarded-proto")
        .and_then(|v| v.to_str().ok())
        .filter(|p| matches!(*p, "http" | "https"));
    let on_domain = st
        .e2b
        .domain
        .as_deref()
        .is_some_and(|d| host.eq_ignore_ascii_case(&format!("api.{d}")));
    let scheme = forwarded.unwrap_or(if on_domain { "https" } else { "http" });
    Ok(format!("{scheme}://{host}"))
}

/// `GET /templates/{id}/files/{hash}` → 201 `{present, url?}`.
async fn files(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path((id, hash)): Path<(String, String)>,
) -> R<Response> {
    let who = caller(&st, &headers).await?;
    require(&who, Right::SandboxWrite)?;
    check_hash(&hash)?;
    let t = template(&st, &who, &id)?;
    if st.builds.file_path(&t.id, &hash).is_file() {
        return Ok((StatusCode::CREATED, Json(json!({"present": true}))).into_response());
    }
    let expires = opendsec_edge_api::now_ms() / 1000 + UPLOAD_URL_SECONDS;
    let signature = opendsec_edge_api::tokens::upload_signature(&st.node.config().cluster_key, &t.id, &hash, expires);
    let url = format!(
        "{}/templates/{}/files/{hash}/upload?expires={expires}&signature={signature}",
        base_url(&st, &headers)?,
        t.id
    );
    Ok((StatusCode::CREATED, Json(json!({"present": false, "url": url}))).into_response())
}

/// `PUT /templates/{id}/files/{hash}/upload?expires&signature`: the archive, kept once
/// whole (written aside and renamed; a second upload of a hash changes nothing).
async fn upload(
    State(st): State<AppState>,
    Path((id, hash)): Path<(String, String)>,
    RawQuery(query): RawQuery,
    body: Body,
) -> R<Response> {
    use http_body_util::BodyExt;
    use tokio::io::AsyncWriteExt;
    check_hash(&hash)?;
    let q: HashMap<String, String> = form_urlencoded::parse(query.unwrap_or_default().as_bytes())
        .into_owned()
        .collect();
    let expires: u64 = q
        .get("expires")
        .and_then(|e| e.parse().ok())
        .ok_or_else(|| E2bError::new(StatusCode::UNAUTHORIZED, "the upload URL has no expiry"))?;
    let expected = opendsec_edge_api::tokens::upload_signature(&st.node.config().cluster_key, &id, &hash, expires);
    let given = q.get("signature").map(String::as_str).unwrap_or_default();
    if !constant_time_eq(given.as_bytes(), expected.as_bytes()) {
        return Err(E2bError::new(
            StatusCode::UNAUTHORIZED,
            "the upload URL's signature is wrong",
        ));
    }
    if opendsec_edge_api::now_ms() / 1000 > expires {
        return Err(E2bError::new(
            StatusCode::UNAUTHORIZED,
            "the upload URL has expired: ask for the file again",
        ));
    }
    let path = st.builds.file_path(&id, &hash);
    if path.is_file() {
        return Ok(StatusCode::OK.into_response());
    }
    let dir = path.parent().expect("a file path has a parent").to_path_buf();
    let io = |what: &str, e: std::io::Error| E2bError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("{what}: {e}"));
    tokio::fs::create_dir_all(&dir)
        .await
        .map_err(|e| io("keeping the upload", e))?;
    let part = dir.join(format!(".{hash}.{}", uuid::Uuid::new_v4()));
    let mut file = tokio::fs::File::create(&part)
        .await
        .map_err(|e| io("keeping the upload", e))?;
    let mut body = body;
    let mut size = 0u64;
    let result: R<()> = async {
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| E2bError::bad(format!("reading the upload: {e}")))?;
            if let Ok(data) = frame.into_data() {
                size += data.len() as u64;
                if size > MAX_UPLOAD_BYTES {
                    return Err(E2bError::new(
                        StatusCode::PAYLOAD_TOO_LARGE,
                        format!("a COPY step's files are at most {} GiB", MAX_UPLOAD_BYTES >> 30),
                    ));
                }
                file.write_all(&data).await.map_err(|e| io("keeping the upload", e))?;
            }
        }
        file.sync_all().await.map_err(|e| io("keeping the upload", e))?;
        tokio::fs::rename(&part, &path)
            .await
            .map_err(|e| io("keeping the upload", e))
    }
    .await;
    if result.is_err() {
        let _ = tokio::fs::remove_file(&part).await;
    }
    result.map(|_| StatusCode::OK.into_response())
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// `POST /v2/templates/{id}/builds/{build}`: the steps (E2B's `TemplateBuildStartV2`);
/// 202 once the build runs.
async fn start_build(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path((id, build)): Path<(String, String)>,
    body: Bytes,
) -> R<Response> {
    let who = caller(&st, &headers).await?;
    require(&who, Right::SandboxWrite)?;
    let m = body_object(&body)?;
    let t = template(&st, &who, &id)?;
    if !t.builds.contains_key(&build) {
        return Err(E2bError::new(
            StatusCode::NOT_FOUND,
            format!("build {build} of template {id} not found"),
        ));
    }
    let plan = super::builder::Plan::parse(&st, &who, &m)?;
    for (n, step) in plan.steps.iter().enumerate() {
        if let super::builder::Step::Copy { hash, .. } = step
            && !st.builds.file_path(&t.id, hash).is_file()
        {
            return Err(E2bError::bad(format!(
                "steps[{n}]: the files of COPY (hash {hash}) were not uploaded: upload them first"
            )));
        }
    }
    let cmd = Command::StartTemplateBuild {
        template: t.id.clone(),
        build: build.clone(),
        from: plan.from.clone(),
        start_cmd: plan.start_cmd.clone(),
        ready_cmd: plan.ready_cmd.clone(),
        steps: plan.steps.len() as u32,
        runner: st.builds.runner.clone(),
    };
    let done = submit(&st, &who, &headers, cmd).await?;
    let Some(Event::TemplateBuildStarted(e)) = done.decided.events.first() else {
        return Err(E2bError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the build did not start",
        ));
    };
    let run = super::builder::Run {
        template: t.clone(),
        build: build.clone(),
        image: e.image.clone(),
        who,
        plan,
    };
    tokio::spawn(super::builder::run(st.clone(), run));
    Ok(StatusCode::ACCEPTED.into_response())
}

/// `GET /templates/{id}/builds/{build}/status?logsOffset&limit`.
async fn status(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path((id, build)): Path<(String, String)>,
    RawQuery(query): RawQuery,
) -> R<Response> {
    let who = caller(&st, &headers).await?;
    require(&who, Right::SandboxRead)?;
    let t = template(&st, &who, &id)?;
    let b = t.builds.get(&build).ok_or_else(|| {
        E2bError::new(
            StatusCode::NOT_FOUND,
            format!("build {build} of template {id} not found"),
        )
    })?;
    let q: HashMap<String, String> = form_urlencoded::parse(query.unwrap_or_default().as_bytes())
        .into_owned()
        .collect();
    let number = |k: &str, default: usize| -> R<usize> {
        match q.get(k) {
            None => Ok(default),
            Some(v) => v
                .parse()
                .map_err(|_| E2bError::bad(format!("{k} must be a non-negative integer"))),
        }
    };
    let offset = number("logsOffset", 0)?;
    let limit = number("limit", 100)?.clamp(1, MAX_STATUS_ENTRIES);
    let entries = st.builds.entries(&build, offset, limit);
    let status = match b.status {
        BuildStatus::Waiting => "waiting",
        BuildStatus::Building => "building",
        BuildStatus::Ready => "ready",
        BuildStatus::Error => "error",
    };
    let mut v = json!({
        "templateID": t.id,
        "buildID": b.id,
        "status": status,
        "logs": entries.iter().map(|e| format!("[{}] {}", rfc3339(e.at_ms), e.message)).collect::<Vec<_>>(),
        "logEntries": entries.iter().map(|e| {
            let mut x = json!({"timestamp": rfc3339(e.at_ms), "level": e.level, "message": e.message});
            if let Some(s) = &e.step { x["step"] = json!(s); }
            x
        }).collect::<Vec<_>>(),
    });
    if b.status == BuildStatus::Error {
        let mut reason = json!({"message": b.error.clone().unwrap_or_else(|| "the build failed".into())});
        if let Some(s) = &b.error_step {
            reason["step"] = json!(s);
        }
        v["reason"] = reason;
    }
    Ok(Json(v).into_response())
}

/// `GET /templates/aliases/{name}`: 200 `{templateID, public}`; 404 when no template of
/// the caller's has it (403 when another project's does: E2B's "exists, not yours").
async fn alias(State(st): State<AppState>, headers: HeaderMap, Path(name): Path<String>) -> R<Response> {
    let who = caller(&st, &headers).await?;
    require(&who, Right::SandboxRead)?;
    let name = name.split_once(':').map_or(name.as_str(), |(n, _)| n).to_string();
    st.node.read(|s| match s.images.template_named(&name) {
        Some(t) if t.name.as_deref() == Some(name.as_str()) && s.within(&t.project, &who.project) => {
            Ok(Json(json!({"templateID": t.id, "public": false})).into_response())
        }
        Some(t) if t.name.as_deref() == Some(name.as_str()) => Err(E2bError::new(
            StatusCode::FORBIDDEN,
            format!("template name {name} belongs to another project"),
        )),
        _ => Err(E2bError::new(
            StatusCode::NOT_FOUND,
            format!("template {name} not found"),
        )),
    })
}

/// `name[:tag]` → (template, the build the tag names: the default tag's, else the
/// newest ready build).
fn target_build(st: &AppState, who: &Principal, target: &str) -> R<(Template, String)> {
    let (name, tag) = target.split_once(':').map_or((target, None), |(n, t)| (n, Some(t)));
    let t = template(st, who, name)?;
    let b = t.build_for(tag).map(|b| b.id.clone()).ok_or_else(|| {
        E2bError::new(
            StatusCode::NOT_FOUND,
            match tag {
                Some(tag) => format!("template {name} has no ready build tagged {tag}"),
                None => format!("template {name} has no ready build"),
            },
        )
    })?;
    Ok((t, b))
}

fn tag_list(m: &Map<String, Value>) -> R<Vec<String>> {
    match m.get("tags") {
        Some(Value::Array(a)) => a
            .iter()
            .map(|t| {
                t.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| E2bError::bad("tags must be strings"))
            })
            .collect(),
        _ => Err(E2bError::bad("tags must be a list of strings")),
    }
}

/// `POST /templates/tags` `{target: "name[:tag]", tags}` → 201 `{tags, buildID}`.
async fn assign_tags(State(st): State<AppState>, headers: HeaderMap, body: Bytes) -> R<Response> {
    let who = caller(&st, &headers).await?;
    let m = body_object(&body)?;
    let target = opt_str(&m, "target")?.ok_or_else(|| E2bError::bad("target is required"))?;
    let tags = tag_list(&m)?;
    let (t, build) = target_build(&st, &who, target)?;
    let cmd = Command::SetTemplateTags {
        template: t.id.clone(),
        build: Some(build.clone()),
        tags: tags.clone(),
    };
    submit(&st, &who, &headers, cmd).await?;
    Ok((StatusCode::CREATED, Json(json!({"tags": tags, "buildID": build}))).into_response())
}

/// `DELETE /templates/tags` `{name, tags}` → 204.
async fn remove_tags(State(st): State<AppState>, headers: HeaderMap, body: Bytes) -> R<Response> {
    let who = caller(&st, &headers).await?;
    let m = body_object(&body)?;
    let name = opt_str(&m, "name")?.ok_or_else(|| E2bError::bad("name is required"))?;
    let tags = tag_list(&m)?;
    let t = template(&st, &who, name.split_once(':').map_or(name, |(n, _)| n))?;
    let cmd = Command::SetTemplateTags {
        template: t.id.clone(),
        build: None,
        tags,
    };
    submit(&st, &who, &headers, cmd).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// `GET /templates/{id}/tags` → `[{tag, buildID, createdAt}]`.
async fn list_tags(State(st): State<AppState>, headers: HeaderMap, Path(id): Path<String>) -> R<Response> {
    let who = caller(&st, &headers).await?;
    require(&who, Right::SandboxRead)?;
    let t = template(&st, &who, &id)?;
    let tags: Vec<Value> = t
        .tags
        .iter()
        .map(|(tag, build)| {
            let at = t.builds.get(build).map(|b| b.finished_at_ms).unwrap_or(t.created_at_ms);
            json!({"tag": tag, "buildID": build, "createdAt": rfc3339(at)})
        })
        .collect();
    Ok(Json(tags).into_response())
}

/// `DELETE /templates/{id}` of a template: it, its names and its builds' images.
pub(super) async fn delete_template(st: &AppState, who: &Principal, headers: &HeaderMap, id: &str) -> R<Response> {
    let t = template(st, who, id)?;
    submit(st, who, headers, Command::DeleteTemplate { template: t.id.clone() }).await?;
    let dir = st.builds.files.join(&t.id);
    let _ = tokio::fs::remove_dir_all(dir).await;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// The builds this node was running when it stopped cannot end by themselves (their
/// steps ran in its memory, and E2B's SDK polls a build until it ends): for a while
/// after it starts (its log is replayed meanwhile), this node looks for builds an
/// earlier run of its gateway was running, fails each, saying so, and kills its sandbox.
pub fn fail_interrupted_builds(st: AppState) {
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let me = st.node.config().node_id;
    let mine = st.builds.runner.clone();
    rt.spawn(async move {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(600);
        while std::time::Instant::now() < deadline {
            let stale: Vec<(String, String)> = st.node.read(|s| {
                s.images
                    .templates
                    .values()
                    .flat_map(|t| t.builds.values().map(move |b| (t, b)))
                    .filter(|(_, b)| {
                        b.status == BuildStatus::Building
                            && b.runner != mine
                            && b.runner.split_once('/').is_some_and(|(node, _)| node == me.to_string())
                    })
                    .map(|(t, b)| (t.id.clone(), b.id.clone()))
                    .collect()
            });
            for (template, build) in stale {
                fail_interrupted(&st, me, template, build).await;
            }
            tokio::time::sleep(std::time::Duration::from_secs(2)).await;
        }
    });
}

async fn fail_interrupted(st: &AppState, me: u64, template: String, build: String) {
    let sandboxes: Vec<String> = st.node.read(|s| {
        s.sandboxes
            .sandboxes
            .values()
            .filter(|x| x.is_live() && x.labels.get(BUILD_LABEL) == Some(&build))
            .map(|x| x.id.clone())
            .collect()
    });
    let mut cmds: Vec<Command> = sandboxes
        .into_iter()
        .map(|sandbox| Command::KillSandbox { sandbox })
        .collect();
    cmds.push(Command::FinishTemplateBuild {
        template: template.clone(),
        build: build.clone(),
        error: Some(format!(
            "the build was interrupted: control node {me}, which ran its steps, restarted; build it again"
        )),
        error_step: Some("finalize".into()),
    });
    for cmd in cmds {
        let done = super::api::submit_as(st, opendsec_control::Credential::System, &HeaderMap::new(), cmd).await;
        if let Err(e) = done {
            tracing::warn!(%build, error = %e.message, "ending an interrupted template build");
        }
    }
    tracing::info!(%template, %build, "a template build an earlier run of this node ran is failed");
}

/// The label that marks a build's sandbox with its build's id.
pub const BUILD_LABEL: &str = "opendsec.io/template-build";

/// Whether `id` names a template the caller may see.
pub(super) fn is_template(st: &AppState, who: &Principal, id: &str) -> bool {
    template(st, who, id).is_ok()
}
