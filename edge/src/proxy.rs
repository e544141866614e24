//! The edge's per-sandbox proxy: `ANY /sandboxes/{id}/{path}` is forwarded, streaming in
//! both directions, to the agent of sandbox `id`: a container's over its Unix socket
//! (which lives outside the sandbox), a microVM's over TCP inside the VM's network
//! namespace (connected from a thread that enters it). Only the control plane's gateway
//! may call it: every request must carry the edge key in `x-opendsec-edge-key`.
//! `POST /admit` answers the leader's admission requests (the edge's final word on what
//! it runs). `/transfer/{id}/…` serves state this edge holds to the edges that pull it
//! (`transfer.rs`); those requests carry a per-transfer token instead of the edge key.
//!
//! Requests to agents go through `opendsec_http`: a container's agent through one pooled
//! client per proxy (connections to its Unix socket kept alive between requests), a
//! microVM's over a connection of its own, opened from inside the VM's network namespace.
//! Other ports of a sandbox are reached through the agent's tunnel (an upgraded request),
//! over which the request is then sent.

use bytes::Bytes;
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use std::path::PathBuf;
use std::sync::Arc;
use tokio::net::{TcpListener, UnixStream};

/// The header the gateway authenticates to the edge with.
pub use opendsec_edge_api::headers::EDGE_KEY_HEADER;

/// Where a sandbox's agent is reached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AgentAddr {
    /// A container's agent: a Unix socket outside the sandbox.
    Unix(PathBuf),
    /// A microVM's agent: an address inside the VM's own network namespace.
    MicroVm(crate::vm::AgentChannel),
}

impl From<PathBuf> for AgentAddr {
    fn from(p: PathBuf) -> Self {
        AgentAddr::Unix(p)
    }
}

/// How long connecting to a microVM's agent may take.
const VM_CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

impl AgentAddr {
    /// A byte stream to the agent.
    pub async fn connect(&self) -> std::io::Result<opendsec_http::Stream> {
        match self {
            AgentAddr::Unix(p) => Ok(opendsec_http::Stream::Unix(UnixStream::connect(p).await?)),
            AgentAddr::MicroVm(channel) => {
                let channel = channel.clone();
                // Entering the namespace is a blocking thread's business.
                let stream = tokio::task::spawn_blocking(move || channel.connect(VM_CONNECT_TIMEOUT))
                    .await
                    .map_err(std::io::Error::other)??;
                stream.set_nonblocking(true)?;
                Ok(opendsec_http::Stream::Tcp(tokio::net::TcpStream::from_std(stream)?))
            }
        }
    }

    /// Sends `req` to the agent: a container's through `agents`, the pool of connections
    /// to agents' Unix sockets; a microVM's over a new connection opened from inside its
    /// network namespace.
    async fn send(
        &self,
        agents: &opendsec_http::Client,
        req: Request<opendsec_http::Body>,
    ) -> Result<Response<Incoming>, opendsec_http::Error> {
        match self {
            AgentAddr::Unix(p) => agents.send(&opendsec_http::Endpoint::Unix(p.clone()), req).await,
            AgentAddr::MicroVm(channel) => {
                let to = format!("the agent at {} in {}", channel.addr, channel.netns.display());
                let stream = self.connect().await.map_err(|e| opendsec_http::Error::Connect {
                    to: to.clone(),
                    source: opendsec_http::ConnectError::Io(Arc::new(e)),
                })?;
                opendsec_http::send_on(&to, opendsec_http::TokioIo::new(stream), req).await
            }
        }
    }

    /// [`send`](Self::send) for a request the proxy received: a protocol upgrade the
    /// agent agrees to is passed through ([`opendsec_http::join_upgrade`]).
    async fn forward(
        &self,
        agents: &opendsec_http::Client,
        mut req: Request<Incoming>,
    ) -> Result<Response<Incoming>, opendsec_http::Error> {
        let client_side = opendsec_http::take_upgrade(&mut req);
        let mut resp = self.send(agents, req.map(opendsec_http::body)).await?;
        opendsec_http::join_upgrade(client_side, &mut resp);
        Ok(resp)
    }
}

/// Finds the agent of a sandbox on this edge (None: no such sandbox here).
pub type Resolver = Arc<dyn Fn(&str) -> Option<AgentAddr> + Send + Sync>;

/// Judges an admission request (`POST /admit`): `Err` says why the edge refuses.
pub type Admitter = Arc<dyn Fn(&opendsec_edge_api::admission::AdmitRequest) -> Result<(), String> + Send + Sync>;

type Body = BoxBody<Bytes, hyper::Error>;

fn json_error(status: StatusCode, code: &str, message: &str) -> Response<Body> {
    let body = serde_json::json!({ "code": code, "message": message }).to_string();
    let mut resp = json_ok(body);
    *resp.status_mut() = status;
    resp
}

/// A 200 with a JSON body.
fn json_ok(body: impl Into<Bytes>) -> Response<Body> {
    Response::builder()
        .header("content-type", "application/json")
        .body(Full::new(body.into()).map_err(|never| match never {}).boxed())
        .expect("static response parts are valid")
}

fn key_matches(expected: &str, got: Option<&str>) -> bool {
    let got = got.unwrap_or("");
    expected.len() == got.len() && expected.bytes().zip(got.bytes()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

async fn admit(req: Request<Incoming>, admitter: Option<Admitter>) -> Response<Body> {
    let Some(admitter) = admitter else {
        return json_error(
            StatusCode::NOT_FOUND,
            "not_found",
            "this edge does not answer admission requests",
        );
    };
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            return json_error(
                StatusCode::BAD_REQUEST,
                "invalid_argument",
                &format!("admission body: {e}"),
            );
        }
    };
    let ask: opendsec_edge_api::admission::AdmitRequest = match serde_json::from_slice(&body) {
        Ok(a) => a,
        Err(e) => {
            return json_error(
                StatusCode::BAD_REQUEST,
                "invalid_argument",
                &format!("admission body: {e}"),
            );
        }
    };
    match admitter(&ask) {
        Ok(()) => Response::new(
            Full::new(Bytes::from_static(b"{}"))
                .map_err(|never| match never {})
                .boxed(),
        ),
        Err(why) => json_error(StatusCode::CONFLICT, "refused", &why),
    }
}

/// What the proxy can do beyond forwarding to agents.
#[derive(Clone, Default)]
pub struct Hooks {
    /// Answers `POST /admit`.
    pub admitter: Option<Admitter>,
    /// Reads a sandbox's counters for `GET /metrics/{id}`.
    pub sampler: Option<Sampler>,
    /// Reads the end of a sandbox's PID 1 output for `GET /logs/{id}?max_bytes=N`.
    pub logs: Option<LogReader>,
    /// Reads a sandbox's recent metrics for `GET /metrics/{id}/history?start_ms&end_ms`.
    pub history: Option<HistoryReader>,
    /// Serves transfers (`/transfer/{id}/manifest`, `/transfer/{id}/files/{name}`,
    /// `DELETE /transfer/{id}`).
    pub transfers: Option<Transfers>,
    /// Collects the image store now for `POST /images/prune`: (layers, VM disks,
    /// scratch entries, bytes) removed, or why not.
    pub prune: Option<Pruner>,
    /// Receives image tarballs (`PUT /images/import`).
    pub imports: Option<Imports>,
    /// Pushes a stored image to a registry for `POST /images/push` (blocking): what
    /// it wrote, or (status, why).
    pub push: Option<Pusher>,
    /// The progress of a push under way for `GET /images/push/{id}`.
    pub push_progress: Option<PushProgress>,
    /// Whether a sandbox's pause or resume is still being carried out here (see
    /// [`Settling`]): requests to it wait for that first.
    pub settling: Option<Settling>,
}

/// Whether sandbox `id` is between states on this edge: the slice does not yet hold the
/// log index the request names ([`AFTER_HEADER`]), or the sandbox's pause or resume is
/// being carried out, or the slice wants it running and it is still paused here (or the
/// reverse). A request to it waits (up to [`SETTLE_WAIT`]) rather than meet an agent
/// that a pause is ending or that a resume has not started again: the control plane may
/// record a resume before this edge has carried out, or even heard of, the pause before it.
pub type Settling = Arc<dyn Fn(&str, Option<u64>) -> bool + Send + Sync>;

pub use opendsec_edge_api::headers::AFTER_HEADER;

/// How long a request waits for its sandbox to settle before a 503.
pub const SETTLE_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// (JSON `{"name", "reference", "id"?}`) -> what was pushed, or (status, why). Blocking.
/// A push with an `id` reports its progress under it while it runs ([`PushProgress`]).
pub type Pusher = Arc<dyn Fn(&serde_json::Value) -> Result<serde_json::Value, (u16, String)> + Send + Sync>;

/// A push's id -> its progress (JSON: layers and bytes done and in all, the current
/// step), while it runs.
pub type PushProgress = Arc<dyn Fn(&str) -> Option<serde_json::Value> + Send + Sync>;

/// Why an upload of an image cannot start.
#[derive(Debug)]
pub enum ImportRefused {
    /// The slice does not hold the import request yet: asked again shortly.
    NotYet,
    /// (status, why).
    Refused(u16, String),
}

/// What the proxy does with an image upload (`PUT /images/import`, the image's name in
/// [`IMAGE_HEADER`], the log index of its `ImportImage` in [`IMPORT_INDEX_HEADER`], the
/// tarball as the body): `begin` (the file to write it to, the import marked under way),
/// `received` as bytes arrive (done, the length announced), then `finish` with the
/// bytes written or why the upload failed; it answers the caller.
#[derive(Clone)]
pub struct Imports {
    pub begin: ImportBegin,
    pub received: ImportReceived,
    pub finish: Arc<dyn Fn(String, Result<u64, String>) -> ImportFinish + Send + Sync>,
}

/// (image name, log index of its request) -> the file to write the upload to.
pub type ImportBegin = Arc<dyn Fn(&str, u64) -> Result<PathBuf, ImportRefused> + Send + Sync>;
/// (image name, bytes received, bytes announced).
pub type ImportReceived = Arc<dyn Fn(&str, u64, Option<u64>) + Send + Sync>;

/// The end of an import: the JSON answer, or (status, why).
pub type ImportFinish =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<serde_json::Value, (u16, String)>> + Send>>;

/// How long an upload waits for the edge's slice to show the import it is for (the
/// gateway sends it as soon as the log has the request; the edge may not have it yet).
const IMPORT_SLICE_WAIT: std::time::Duration = std::time::Duration::from_secs(15);

/// The largest tarball an upload may carry.
pub const MAX_IMPORT_BYTES: u64 = 64 << 30;

use opendsec_edge_api::headers::{IMAGE_HEADER, IMPORT_INDEX_HEADER};

/// `PUT /images/import`: writes the body to the file `begin` gives, then has `finish`
/// import it. Runs on a task of its own, so a caller that goes away mid-import does not
/// cut the import (or its report) short.
async fn import(req: Request<Incoming>, imports: Option<Imports>) -> Response<Body> {
    let Some(imports) = imports else {
        return json_error(StatusCode::NOT_FOUND, "not_found", "this edge takes no image uploads");
    };
    let header = |name: &str| req.headers().get(name).and_then(|v| v.to_str().ok());
    let (Some(name), Some(index)) = (
        header(IMAGE_HEADER).map(str::to_string),
        header(IMPORT_INDEX_HEADER).and_then(|v| v.parse::<u64>().ok()),
    ) else {
        return json_error(
            StatusCode::BAD_REQUEST,
            "invalid_argument",
            &format!(
                "an image upload names the image ({IMAGE_HEADER}) and its request's log index ({IMPORT_INDEX_HEADER})"
            ),
        );
    };
    let total = header(hyper::header::CONTENT_LENGTH.as_str()).and_then(|v| v.parse::<u64>().ok());
    if total.is_some_and(|t| t > MAX_IMPORT_BYTES) {
        return json_error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too_large",
            &format!("an image tarball may hold at most {MAX_IMPORT_BYTES} bytes"),
        );
    }
    let waited = std::time::Instant::now();
    let path = loop {
        match (imports.begin)(&name, index) {
            Ok(path) => break path,
            Err(ImportRefused::NotYet) if waited.elapsed() < IMPORT_SLICE_WAIT => {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            Err(ImportRefused::NotYet) => {
                return json_error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "unavailable",
                    &format!("this edge has not seen the import of image {name} (log index {index}) yet; try again"),
                );
            }
            Err(ImportRefused::Refused(code, why)) => {
                let status = StatusCode::from_u16(code).unwrap_or(StatusCode::CONFLICT);
                return json_error(status, "conflict", &why);
            }
        }
    };
    let body = req.into_body();
    let task = tokio::spawn(async move {
        let written = receive(body, &path, total, |done| (imports.received)(&name, done, total)).await;
        (imports.finish)(name, written).await
    });
    match task.await {
        Ok(Ok(v)) => json_ok(v.to_string()),
        Ok(Err((code, why))) => json_error(
            StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            "import_failed",
            &why,
        ),
        Err(e) => json_error(StatusCode::INTERNAL_SERVER_ERROR, "import_failed", &e.to_string()),
    }
}

/// Writes an upload's body to `path` (a new file): the bytes written, or why it failed
/// (cut off, longer than announced or than [`MAX_IMPORT_BYTES`], the disk).
async fn receive(
    mut body: Incoming,
    path: &std::path::Path,
    total: Option<u64>,
    progress: impl Fn(u64),
) -> Result<u64, String> {
    use tokio::io::AsyncWriteExt;
    let mut file = tokio::fs::File::create_new(path)
        .await
        .map_err(|e| format!("creating {}: {e}", path.display()))?;
    let limit = total.unwrap_or(MAX_IMPORT_BYTES);
    let mut done = 0u64;
    let mut reported = 0u64;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| format!("the upload was cut off after {done} bytes: {e}"))?;
        let Ok(data) = frame.into_data() else { continue };
        done += data.len() as u64;
        if done > limit {
            return Err(format!("the upload is longer than {limit} bytes"));
        }
        file.write_all(&data)
            .await
            .map_err(|e| format!("writing {}: {e}", path.display()))?;
        if done - reported >= 4 << 20 {
            reported = done;
            progress(done);
        }
    }
    if total.is_some_and(|t| t != done) {
        return Err(format!("the upload ended after {done} of {} bytes", total.unwrap_or(0)));
    }
    file.flush()
        .await
        .map_err(|e| format!("writing {}: {e}", path.display()))?;
    progress(done);
    Ok(done)
}

/// Collects the image store (blocking); what it removed, or why it could not.
pub type Pruner = Arc<dyn Fn() -> Result<serde_json::Value, String> + Send + Sync>;

/// The directory of transfer `id` for pulling edge `edge` once it is prepared, or why
/// not: (404) unknown here, (403) not for that edge, (503) not prepared yet, (410)
/// cannot be had.
pub type TransferLookup = Arc<dyn Fn(&str, &str) -> Result<PathBuf, (u16, String)> + Send + Sync>;
/// Called with (transfer id, edge) once that edge has pulled the transfer.
pub type TransferPulled = Arc<dyn Fn(&str, &str) + Send + Sync>;

/// What the edge serves to other edges.
#[derive(Clone)]
pub struct Transfers {
    pub lookup: TransferLookup,
    pub pulled: TransferPulled,
}

async fn transfer(req: Request<Incoming>, key: &str, transfers: Option<Transfers>) -> Response<Body> {
    use crate::transfer as t;
    let Some(transfers) = transfers else {
        return json_error(StatusCode::NOT_FOUND, "not_found", "this edge serves no transfers");
    };
    let path = req.uri().path().trim_start_matches("/transfer/").to_string();
    let (id, rest) = path.split_once('/').unwrap_or((path.as_str(), ""));
    if !t::valid_transfer(id) {
        return json_error(
            StatusCode::BAD_REQUEST,
            "invalid_argument",
            "the transfer id in the path is malformed",
        );
    }
    let header = |name: &str| req.headers().get(name).and_then(|v| v.to_str().ok());
    let edge = match t::check_token(key, id, header(t::EDGE_HEADER), header(t::TOKEN_HEADER)) {
        Ok(edge) => edge,
        Err((401, why)) => return json_error(StatusCode::UNAUTHORIZED, "unauthenticated", &why),
        Err((_, why)) => return json_error(StatusCode::FORBIDDEN, "forbidden", &why),
    };
    let status = |code: u16| StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let word = |code: u16| match code {
        403 => "forbidden",
        404 => "not_found",
        410 => "gone",
        503 => "not_ready",
        _ => "error",
    };
    if req.method() == hyper::Method::DELETE && rest.is_empty() {
        return match (transfers.lookup)(id, &edge) {
            Err((code, why)) if code == 403 || code == 404 => json_error(status(code), word(code), &why),
            _ => {
                (transfers.pulled)(id, &edge);
                Response::builder()
                    .status(StatusCode::NO_CONTENT)
                    .body(empty())
                    .expect("valid response")
            }
        };
    }
    if req.method() != hyper::Method::GET {
        return json_error(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_argument",
            "transfers are read with GET and ended with DELETE",
        );
    }
    let dir = match (transfers.lookup)(id, &edge) {
        Ok(dir) => dir,
        Err((code, why)) => return json_error(status(code), word(code), &why),
    };
    let file = if rest == "manifest" {
        t::MANIFEST.to_string()
    } else if let Some(name) = rest.strip_prefix("files/") {
        let listed = t::read_manifest(&dir)
            .map(|m| m.files.iter().any(|f| f.name == name))
            .unwrap_or(false);
        if !t::valid_name(name) || !listed {
            return json_error(
                StatusCode::NOT_FOUND,
                "not_found",
                &format!("transfer {id} has no file {name:?}"),
            );
        }
        name.to_string()
    } else {
        return json_error(
            StatusCode::NOT_FOUND,
            "not_found",
            "use /transfer/{id}/manifest or /transfer/{id}/files/{name}",
        );
    };
    if file == t::MANIFEST {
        return match std::fs::read(dir.join(t::MANIFEST)) {
            Ok(bytes) => json_ok(bytes),
            Err(e) => json_error(
                StatusCode::SERVICE_UNAVAILABLE,
                "not_ready",
                &format!("the manifest of transfer {id}: {e}"),
            ),
        };
    }
    tracing::info!(transfer = %id, %file, to = %edge, "serving a transfer file");
    Response::builder()
        .header("content-type", "application/octet-stream")
        .body(t::serve_file(dir.join(file)).map_err(|never| match never {}).boxed())
        .expect("valid response")
}

/// The last `max_bytes` of a sandbox's PID 1 output (None: no such sandbox here).
pub type LogReader = Arc<dyn Fn(&str, usize) -> Option<Vec<u8>> + Send + Sync>;

/// A sandbox's counters at one instant (see [`Hooks::sampler`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Sample {
    pub cpu_usec: u64,
    pub cpu_count: u64,
    pub mem_used: u64,
    pub mem_total: u64,
    pub mem_cache: u64,
    pub disk_used: u64,
    pub disk_total: u64,
    /// Processes the OOM killer ended inside it (a container's memory cgroup counts them;
    /// 0 for a VM, whose guest kernel kills on its own).
    pub oom_kills: u64,
    /// A VM's VMM and accelerator (see `MicroVms::runtime`); `None` for a container.
    pub runtime: Option<(String, String)>,
    /// A container's traffic and sampled drops (`None`: no network of its own).
    pub network: Option<crate::net::NetSample>,
}

/// Reads a sandbox's counters (None: no such sandbox here).
pub type Sampler = Arc<dyn Fn(&str) -> Option<Sample> + Send + Sync>;

/// Reads the points of a sandbox's history from `start_ms` to `end_ms` (None: no
/// series for it here). See [`crate::metrics_history`].
pub type HistoryReader = Arc<dyn Fn(&str, u64, u64) -> Option<Vec<crate::metrics_history::Point>> + Send + Sync>;

/// The header naming the port inside the sandbox a request is for (absent or
/// [`AGENT_PORT`]: the agent itself).
pub use opendsec_edge_api::headers::PORT_HEADER;
/// The port the agent answers on, in E2B's numbering (envd).
pub const AGENT_PORT: u16 = 49983;

fn empty() -> Body {
    http_body_util::Empty::new().map_err(|never| match never {}).boxed()
}

/// `GET /health` of the agent at `addr`: its HTTP status. Over a connection of its own,
/// so that a readiness check leaves no idle connection behind.
pub async fn agent_health(addr: &AgentAddr) -> Result<u16, String> {
    let stream = addr
        .connect()
        .await
        .map_err(|e| format!("connecting to the agent: {e}"))?;
    let req = Request::get("/health")
        .header(hyper::header::HOST, "agent")
        .body(opendsec_http::empty())
        .expect("static request");
    let resp = tokio::time::timeout(
        std::time::Duration::from_secs(5),
        opendsec_http::send_on("the agent", opendsec_http::TokioIo::new(stream), req),
    )
    .await
    .map_err(|_| "the agent did not answer /health within 5 s".to_string())?
    .map_err(|e| match e {
        opendsec_http::Error::Handshake { source, .. } => format!("agent handshake: {source}"),
        opendsec_http::Error::Request { source, .. } => format!("agent /health: {source}"),
        other => other.to_string(),
    })?;
    Ok(resp.status().as_u16())
}

fn unavailable(message: &str) -> Response<Body> {
    json_error(StatusCode::BAD_GATEWAY, "unavailable", message)
}

/// Opens a byte stream to `port` inside the sandbox through its agent
/// (`GET /.opendsec/tunnel`, upgraded). On refusal, the agent's answer is returned.
async fn open_tunnel(
    agents: &opendsec_http::Client,
    addr: &AgentAddr,
    token: &str,
    port: u16,
) -> Result<hyper::upgrade::Upgraded, Response<Body>> {
    let req = Request::get(format!("/.opendsec/tunnel?port={port}"))
        .header(hyper::header::HOST, "agent")
        .header(hyper::header::CONNECTION, "Upgrade")
        .header(hyper::header::UPGRADE, "opendsec-tcp")
        .header("x-access-token", token)
        .body(opendsec_http::empty())
        .expect("valid tunnel request");
    let resp = addr.send(agents, req).await.map_err(|e| {
        unavailable(&match e {
            opendsec_http::Error::Connect { source, .. } => format!("the sandbox's agent does not answer: {source}"),
            opendsec_http::Error::Handshake { source, .. } => format!("agent handshake failed: {source}"),
            other => format!("the sandbox's agent failed: {other}"),
        })
    })?;
    if resp.status() != StatusCode::SWITCHING_PROTOCOLS {
        return Err(resp.map(|b| b.boxed()));
    }
    hyper::upgrade::on(resp)
        .await
        .map_err(|e| unavailable(&format!("tunnel upgrade failed: {e}")))
}

/// The proxy's answer when forwarding to a sandbox failed.
fn forwarding_failed(id: &str, e: opendsec_http::Error) -> Response<Body> {
    unavailable(&match e {
        opendsec_http::Error::Connect { source, .. } => format!("the agent of sandbox {id} does not answer: {source}"),
        opendsec_http::Error::Handshake { source, .. } => format!("handshake failed: {source}"),
        opendsec_http::Error::Request { source, .. } => format!("the sandbox failed: {source}"),
        other => other.to_string(),
    })
}

/// `GET /metrics/{id}/history?start_ms=&end_ms=`: the points of the sandbox's history
/// in that range (both optional: from the first, to the last), oldest first; an empty
/// list when the edge runs the sandbox but has no points for it yet.
fn history(id: &str, query: Option<&str>, reader: Option<HistoryReader>) -> Response<Body> {
    let Some(reader) = reader else {
        return json_error(
            StatusCode::NOT_FOUND,
            "not_found",
            "this edge does not keep metrics history",
        );
    };
    let (mut start_ms, mut end_ms) = (0u64, u64::MAX);
    for kv in query.unwrap_or("").split('&').filter(|kv| !kv.is_empty()) {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        let slot = match k {
            "start_ms" => &mut start_ms,
            "end_ms" => &mut end_ms,
            _ => continue,
        };
        match v.parse::<u64>() {
            Ok(n) => *slot = n,
            Err(_) => {
                return json_error(
                    StatusCode::BAD_REQUEST,
                    "invalid_argument",
                    &format!("{k} must be milliseconds since the Unix epoch"),
                );
            }
        }
    }
    let Some(points) = reader(id, start_ms, end_ms) else {
        return json_error(
            StatusCode::NOT_FOUND,
            "not_found",
            &format!("The sandbox {id} was not found on this edge"),
        );
    };
    json_ok(serde_json::to_vec(&points).unwrap_or_default())
}

async fn metrics(id: &str, sampler: Option<Sampler>) -> Response<Body> {
    let Some(sampler) = sampler else {
        return json_error(StatusCode::NOT_FOUND, "not_found", "this edge does not serve metrics");
    };
    let Some(a) = sampler(id) else {
        return json_error(
            StatusCode::NOT_FOUND,
            "not_found",
            &format!("The sandbox {id} was not found on this edge"),
        );
    };
    let window = std::time::Duration::from_millis(100);
    tokio::time::sleep(window).await;
    let a_cpu_usec = a.cpu_usec;
    let b = sampler(id).unwrap_or(a);
    let cpus = b.cpu_count.max(1) as f64;
    let pct =
        (b.cpu_usec.saturating_sub(a_cpu_usec) as f64 / window.as_micros() as f64 / cpus * 100.0).clamp(0.0, 100.0);
    let mut body = serde_json::json!({
        "cpu_count": b.cpu_count,
        "cpu_used_pct": (pct * 100.0).round() / 100.0,
        "mem_used": b.mem_used,
        "mem_total": b.mem_total,
        "mem_cache": b.mem_cache,
        "disk_used": b.disk_used,
        "disk_total": b.disk_total,
        "oom_kills": b.oom_kills,
    });
    if let Some((vmm, accelerator)) = &b.runtime {
        body["vmm"] = vmm.as_str().into();
        body["accelerator"] = accelerator.as_str().into();
    }
    if let Some(n) = &b.network {
        body["network"] = serde_json::json!({
            "in_bytes": n.counters.link.in_bytes,
            "in_packets": n.counters.link.in_packets,
            "out_bytes": n.counters.link.out_bytes,
            "out_packets": n.counters.link.out_packets,
            "dropped_packets": n.counters.dropped_packets,
            "recent_drops": n.recent_drops,
        });
    }
    json_ok(body.to_string())
}

async fn handle(
    req: Request<Incoming>,
    key: Arc<str>,
    resolve: Resolver,
    hooks: Hooks,
    agents: opendsec_http::Client,
) -> Response<Body> {
    // Another edge pulling state: it proves itself with a token for that one transfer.
    if req.uri().path().starts_with("/transfer/") {
        return transfer(req, &key, hooks.transfers).await;
    }
    let got = req.headers().get(EDGE_KEY_HEADER).and_then(|v| v.to_str().ok());
    if !key_matches(&key, got) {
        return json_error(
            StatusCode::UNAUTHORIZED,
            "unauthenticated",
            "the edge proxy needs the edge key",
        );
    }
    if req.uri().path() == "/admit" && req.method() == hyper::Method::POST {
        return admit(req, hooks.admitter).await;
    }
    if req.uri().path() == "/images/import" && req.method() == hyper::Method::PUT {
        return import(req, hooks.imports).await;
    }
    if req.uri().path() == "/images/push" && req.method() == hyper::Method::POST {
        let Some(push) = hooks.push else {
            return json_error(StatusCode::NOT_FOUND, "not_found", "this edge keeps no image store");
        };
        let body = match http_body_util::Limited::new(req.into_body(), 64 << 10).collect().await {
            Ok(b) => b.to_bytes(),
            Err(e) => return json_error(StatusCode::BAD_REQUEST, "invalid_argument", &format!("push body: {e}")),
        };
        let ask: serde_json::Value = match serde_json::from_slice(&body) {
            Ok(v) => v,
            Err(e) => return json_error(StatusCode::BAD_REQUEST, "invalid_argument", &format!("push body: {e}")),
        };
        return match tokio::task::spawn_blocking(move || push(&ask)).await {
            Ok(Ok(v)) => json_ok(v.to_string()),
            Ok(Err((code, why))) => json_error(
                StatusCode::from_u16(code).unwrap_or(StatusCode::BAD_GATEWAY),
                "push_failed",
                &why,
            ),
            Err(e) => json_error(StatusCode::INTERNAL_SERVER_ERROR, "push_failed", &e.to_string()),
        };
    }
    if let Some(id) = req.uri().path().strip_prefix("/images/push/")
        && req.method() == hyper::Method::GET
    {
        return match hooks.push_progress.as_ref().and_then(|p| p(id)) {
            Some(v) => json_ok(v.to_string()),
            None => json_error(
                StatusCode::NOT_FOUND,
                "not_found",
                &format!("no push {id} runs on this edge"),
            ),
        };
    }
    if req.uri().path() == "/images/prune" && req.method() == hyper::Method::POST {
        let Some(prune) = hooks.prune else {
            return json_error(StatusCode::NOT_FOUND, "not_found", "this edge keeps no image store");
        };
        return match tokio::task::spawn_blocking(move || prune()).await {
            Ok(Ok(v)) => json_ok(v.to_string()),
            Ok(Err(why)) => json_error(StatusCode::INTERNAL_SERVER_ERROR, "prune_failed", &why),
            Err(e) => json_error(StatusCode::INTERNAL_SERVER_ERROR, "prune_failed", &e.to_string()),
        };
    }
    if let Some(id) = req.uri().path().strip_prefix("/metrics/")
        && req.method() == hyper::Method::GET
    {
        if let Some(id) = id.strip_suffix("/history") {
            return history(id, req.uri().query(), hooks.history);
        }
        return metrics(id, hooks.sampler).await;
    }
    if let Some(id) = req.uri().path().strip_prefix("/logs/")
        && req.method() == hyper::Method::GET
    {
        let max = req
            .uri()
            .query()
            .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("max_bytes=")))
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or(64 << 10)
            .min(16 << 20);
        let found = hooks.logs.as_ref().and_then(|read| read(id, max));
        return match found {
            Some(bytes) => Response::builder()
                .header("content-type", "text/plain; charset=utf-8")
                .body(Full::new(Bytes::from(bytes)).map_err(|never| match never {}).boxed())
                .expect("valid response"),
            None => json_error(
                StatusCode::NOT_FOUND,
                "not_found",
                &format!("The sandbox {id} was not found on this edge"),
            ),
        };
    }
    let path = req.uri().path().to_string();
    let Some(rest) = path.strip_prefix("/sandboxes/") else {
        return json_error(StatusCode::NOT_FOUND, "not_found", "use /sandboxes/{id}/{agent path}");
    };
    let (id, tail) = rest
        .split_once('/')
        .map(|(a, b)| (a.to_string(), format!("/{b}")))
        .unwrap_or((rest.to_string(), "/".to_string()));
    let id = id.as_str();
    let after = req
        .headers()
        .get(AFTER_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(settling) = &hooks.settling {
        let deadline = std::time::Instant::now() + SETTLE_WAIT;
        // Most holds are a call right behind its create or resume, waiting for the
        // slice to bring back the index the gateway saw (a few ms): looked at again
        // after 1, 2, 4, 8 ms, then every 20 ms.
        let mut pause = std::time::Duration::from_millis(1);
        while settling(id, after) {
            if std::time::Instant::now() >= deadline {
                return json_error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "unavailable",
                    &format!(
                        "The sandbox {id} is still pausing or resuming on its edge after {} s; try again",
                        SETTLE_WAIT.as_secs()
                    ),
                );
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(std::time::Duration::from_millis(20));
        }
    }
    let Some(agent) = resolve(id) else {
        return json_error(
            StatusCode::BAD_GATEWAY,
            "not_found",
            &format!("The sandbox {id} was not found on this edge"),
        );
    };
    let port = match req
        .headers()
        .get(PORT_HEADER)
        .map(|v| v.to_str().ok().and_then(|p| p.parse::<u16>().ok()))
    {
        None => AGENT_PORT,
        Some(Some(p)) if p != 0 => p,
        Some(_) => {
            return json_error(
                StatusCode::BAD_REQUEST,
                "invalid_argument",
                "x-opendsec-port must be a port number (1-65535)",
            );
        }
    };
    let path_and_query = match req.uri().query() {
        Some(q) => format!("{tail}?{q}"),
        None => tail,
    };
    let (mut parts, body) = req.into_parts();
    parts.headers.remove(EDGE_KEY_HEADER);
    parts.headers.remove(PORT_HEADER);
    parts.headers.remove(AFTER_HEADER);
    parts.uri = match path_and_query.parse() {
        Ok(u) => u,
        Err(_) => return json_error(StatusCode::BAD_REQUEST, "invalid_argument", "malformed path"),
    };
    let mut req = Request::from_parts(parts, body);
    if port == AGENT_PORT {
        req.headers_mut()
            .insert(hyper::header::HOST, hyper::header::HeaderValue::from_static("agent"));
        return match agent.forward(&agents, req).await {
            Ok(resp) => resp.map(|b| b.boxed()),
            Err(e) => forwarding_failed(id, e),
        };
    }
    // Any other port: through the agent's tunnel to that port inside the sandbox.
    let token = opendsec_edge_api::sandbox_token(&key, opendsec_edge_api::SandboxTokenKind::Agent, id);
    let io = match open_tunnel(&agents, &agent, &token, port).await {
        Ok(io) => io,
        Err(resp) => return resp,
    };
    match opendsec_http::forward_on(&format!("port {port} of sandbox {id}"), io, req).await {
        Ok(resp) => resp.map(|b| b.boxed()),
        Err(e) => forwarding_failed(id, e),
    }
}

/// Serves the proxy on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, trust: Arc<opendsec_trust::Trust>, key: String, resolve: Resolver) {
    serve_with(listener, trust, key, resolve, Hooks::default()).await
}

/// Serves the proxy, answering `POST /admit` with `admitter` when given.
pub async fn serve_with_admission(
    listener: TcpListener,
    trust: Arc<opendsec_trust::Trust>,
    key: String,
    resolve: Resolver,
    admitter: Option<Admitter>,
) {
    serve_with(
        listener,
        trust,
        key,
        resolve,
        Hooks {
            admitter,
            ..Hooks::default()
        },
    )
    .await
}

/// How long a connection may take to complete its TLS handshake.
const HANDSHAKE_WITHIN: std::time::Duration = std::time::Duration::from_secs(5);

/// Serves the proxy with its optional abilities. Every connection is mutual TLS as the
/// edge `trust` names, from the cluster's gateways and control nodes (proxied traffic,
/// admission) and other edges (transfers): anyone else's, or no certificate, is closed
/// on before a byte of HTTP is read. Requests then also carry this edge's key.
pub async fn serve_with(
    listener: TcpListener,
    trust: Arc<opendsec_trust::Trust>,
    key: String,
    resolve: Resolver,
    hooks: Hooks,
) {
    let key: Arc<str> = Arc::from(key);
    // Containers' agents are reached over their Unix sockets, connections kept alive
    // between requests (no connect timeout: a local socket answers or refuses at once).
    let agents = opendsec_http::Client::new(None);
    loop {
        let (tcp, _) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "edge proxy accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = tcp.set_nodelay(true);
        let (key, resolve, hooks, agents) = (key.clone(), resolve.clone(), hooks.clone(), agents.clone());
        let trust = trust.clone();
        tokio::spawn(async move {
            let remote = tcp.peer_addr().ok();
            let tls = match tokio::time::timeout(HANDSHAKE_WITHIN, trust.accept(tcp)).await {
                Ok(Ok((tls, Some(peer))))
                    if matches!(
                        peer.role,
                        opendsec_trust::Role::Gateway | opendsec_trust::Role::Control | opendsec_trust::Role::Edge
                    ) =>
                {
                    tls
                }
                Ok(Ok((_, peer))) => {
                    let who = peer.map_or("a peer without a certificate".to_string(), |p| p.to_string());
                    tracing::warn!(?remote, %who, "denied: the edge proxy serves the cluster's components only");
                    return;
                }
                Ok(Err(e)) => {
                    tracing::debug!(?remote, error = %e, "edge proxy: TLS handshake failed");
                    return;
                }
                Err(_) => return,
            };
            let svc = hyper::service::service_fn(move |req| {
                let (key, resolve, hooks, agents) = (key.clone(), resolve.clone(), hooks.clone(), agents.clone());
                async move { Ok::<_, std::convert::Infallible>(handle(req, key, resolve, hooks, agents).await) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(tls), svc)
                .with_upgrades();
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "edge proxy connection ended");
            }
        });
    }
}
