//! OpenDsec's Rust client: typed calls to every `/v1` endpoint, and the
//! `opendsecctl` CLI (src/bin) built on them.
//!
//! Read-your-writes: the client remembers the highest log index any response
//! carried (`X-Opendsec-Index`) and sends it as `X-Opendsec-Min-Index`, so a read
//! served by any control node reflects this client's earlier writes.

pub mod agent;
pub mod types;

pub use agent::{ExecOutput, ExecRequest, PtyControl, PtyEvent, PtyRequest, PtySession};

use reqwest::{Method, Url};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use types::*;

pub const INDEX_HEADER: &str = "x-opendsec-index";
pub const MIN_INDEX_HEADER: &str = "x-opendsec-min-index";
pub const DEFAULT_URL: &str = "http://127.0.0.1:7400";

/// Every failure of a call: an error answered by the API (`status` is its HTTP
/// status), or no usable answer at all (`status` 0, `code` "unreachable" or "decode").
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    pub status: u16,
    pub code: String,
    pub message: String,
    pub field: Option<String>,
}

impl ApiError {
    fn local(code: &str, message: String) -> ApiError {
        ApiError {
            status: 0,
            code: code.into(),
            message,
            field: None,
        }
    }
}

/// Which sandboxes `list_sandboxes` returns.
#[derive(Clone, Debug, Default)]
pub struct SandboxFilter {
    pub project: Option<String>,
    /// Every label must match.
    pub labels: BTreeMap<String, String>,
    /// pending, running, pausing, paused, resuming, killed, failed or exited; live ones when absent.
    pub state: Option<String>,
}

/// Which audit records `audit` returns; times are RFC 3339 or ms since the epoch.
#[derive(Clone, Debug, Default)]
pub struct AuditFilter {
    pub principal: Option<String>,
    pub project: Option<String>,
    pub action: Option<String>,
    pub target: Option<String>,
    pub since: Option<String>,
    pub until: Option<String>,
    /// The `next` cursor of the previous page.
    pub after: Option<u64>,
    pub limit: Option<u64>,
}

/// A replay: `to` and `diff_from` are log indexes or RFC 3339 times.
#[derive(Clone, Debug, Default)]
pub struct ReplayRequest {
    pub to: Option<String>,
    pub view: Option<String>,
    pub diff_from: Option<String>,
}

#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    base: Url,
    token: Option<String>,
    seen_index: Arc<AtomicU64>,
    /// What the server said in `X-Opendsec-Warning` on this client's last call (kept for
    /// one call: a client that never asks holds none).
    warnings: Arc<std::sync::Mutex<Vec<String>>>,
}

/// The header a server warns in (a write that succeeded but will not do all it says).
pub const WARNING_HEADER: &str = "x-opendsec-warning";

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("base", &self.base.as_str())
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl Client {
    /// A client of the API at `base_url` (e.g. `http://127.0.0.1:7400`), authenticating with `token`.
    pub fn new(base_url: &str, token: impl Into<Option<String>>) -> Result<Client, ApiError> {
        let base = Url::parse(base_url)
            .map_err(|e| ApiError::local("invalid_url", format!("{base_url:?} is not a URL: {e}")))?;
        if base.cannot_be_a_base() {
            return Err(ApiError::local(
                "invalid_url",
                format!("{base_url:?} cannot be a base URL"),
            ));
        }
        let http = reqwest::Client::builder()
            .user_agent(concat!("opendsec-sdk/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| ApiError::local("unreachable", e.to_string()))?;
        Ok(Client {
            http,
            base,
            token: token.into(),
            seen_index: Arc::new(AtomicU64::new(0)),
            warnings: Default::default(),
        })
    }

    pub fn base_url(&self) -> &str {
        self.base.as_str()
    }

    /// The highest log index this client has seen; reads wait for it.
    pub fn seen_index(&self) -> u64 {
        self.seen_index.load(Ordering::Relaxed)
    }

    /// The server's warnings (`X-Opendsec-Warning`) on this client's last call, if not
    /// taken yet: e.g. a network policy allowing egress its sandbox will not get.
    pub fn take_warnings(&self) -> Vec<String> {
        std::mem::take(&mut *self.warnings.lock().expect("warnings lock"))
    }

    /// Makes later reads wait for `index` (e.g. one learned by another client).
    pub fn observe_index(&self, index: u64) {
        self.seen_index.fetch_max(index, Ordering::Relaxed);
    }

    fn url(&self, segments: &[&str], query: &[(&str, String)]) -> Url {
        let mut url = self.base.clone();
        url.path_segments_mut()
            .expect("checked in new")
            .pop_if_empty()
            .extend(segments);
        if !query.is_empty() {
            let mut q = url.query_pairs_mut();
            for (k, v) in query {
                q.append_pair(k, v);
            }
        }
        url
    }

    async fn call<B: Serialize, T: DeserializeOwned>(
        &self,
        method: Method,
        segments: &[&str],
        query: &[(&str, String)],
        body: Option<&B>,
    ) -> Result<T, ApiError> {
        let bytes = self.call_raw(method, segments, query, body).await?;
        serde_json::from_slice(&bytes)
            .map_err(|e| ApiError::local("decode", format!("the response does not decode: {e}")))
    }

    /// A request to `segments` carrying this client's token and the least log index it
    /// has seen (so a follower answers no older than what this client already read).
    fn request(&self, method: Method, segments: &[&str], query: &[(&str, String)]) -> reqwest::RequestBuilder {
        let mut req = self.http.request(method, self.url(segments, query));
        if let Some(t) = &self.token {
            req = req.bearer_auth(t);
        }
        let seen = self.seen_index();
        if seen > 0 {
            req = req.header(MIN_INDEX_HEADER, seen);
        }
        req
    }

    /// Sends `req` and notes the log index its answer was read at; an answer that is
    /// not a success becomes its decoded error.
    async fn send(&self, req: reqwest::RequestBuilder) -> Result<reqwest::Response, ApiError> {
        let resp = req
            .send()
            .await
            .map_err(|e| ApiError::local("unreachable", format!("cannot reach {}: {e}", self.base)))?;
        if let Some(i) = resp
            .headers()
            .get(INDEX_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
        {
            self.observe_index(i);
        }
        let warned = resp
            .headers()
            .get_all(WARNING_HEADER)
            .iter()
            .filter_map(|v| v.to_str().ok().map(str::to_string))
            .collect();
        *self.warnings.lock().expect("warnings lock") = warned;
        if !resp.status().is_success() {
            return Err(error_of(resp).await);
        }
        Ok(resp)
    }

    /// A call whose successful answer is returned as it came (errors decoded).
    async fn call_raw<B: Serialize>(
        &self,
        method: Method,
        segments: &[&str],
        query: &[(&str, String)],
        body: Option<&B>,
    ) -> Result<Vec<u8>, ApiError> {
        let mut req = self.request(method, segments, query);
        if let Some(b) = body {
            req = req.json(b);
        }
        let bytes = self
            .send(req)
            .await?
            .bytes()
            .await
            .map_err(|e| ApiError::local("unreachable", format!("the response was cut off: {e}")))?;
        Ok(bytes.to_vec())
    }

    async fn get<T: DeserializeOwned>(&self, segments: &[&str], query: &[(&str, String)]) -> Result<T, ApiError> {
        self.call::<(), T>(Method::GET, segments, query, None).await
    }

    /// Every page of a list, asked for in turn.
    async fn get_all<T: DeserializeOwned + Paged>(
        &self,
        segments: &[&str],
        query: &[(&str, String)],
    ) -> Result<T, ApiError> {
        let mut all: T = self.get(segments, query).await?;
        while let Some(token) = all.take_next() {
            let mut q = query.to_vec();
            q.push(("page_token", token));
            let page: T = self.get(segments, &q).await?;
            all.extend(page);
        }
        Ok(all)
    }

    // ---- meta ----

    pub async fn health(&self) -> Result<Health, ApiError> {
        self.get(&["health"], &[]).await
    }

    /// The OpenAPI document.
    pub async fn openapi(&self) -> Result<serde_json::Value, ApiError> {
        self.get(&["v1", "openapi.json"], &[]).await
    }

    // ---- projects and quotas ----

    pub async fn create_project(&self, name: &str, parent: Option<&str>) -> Result<ProjectWritten, ApiError> {
        let body = CreateProject {
            name: name.into(),
            parent: parent.map(Into::into),
        };
        self.call(Method::POST, &["v1", "projects"], &[], Some(&body)).await
    }

    pub async fn list_projects(&self) -> Result<ProjectList, ApiError> {
        self.get_all(&["v1", "projects"], &[]).await
    }

    pub async fn get_project(&self, id: &str) -> Result<Project, ApiError> {
        self.get(&["v1", "projects", id], &[]).await
    }

    pub async fn delete_project(&self, id: &str) -> Result<Done, ApiError> {
        self.call::<(), _>(Method::DELETE, &["v1", "projects", id], &[], None)
            .await
    }

    pub async fn set_quota(&self, project: &str, limits: &Limits) -> Result<Quota, ApiError> {
        self.call(Method::PUT, &["v1", "projects", project, "quota"], &[], Some(limits))
            .await
    }

    pub async fn get_quota(&self, project: &str) -> Result<Quota, ApiError> {
        self.get(&["v1", "projects", project, "quota"], &[]).await
    }

    /// A project's write rates: its own and those in force.
    pub async fn get_rate_limits(&self, project: &str) -> Result<ProjectRates, ApiError> {
        self.get(&["v1", "projects", project, "rate-limits"], &[]).await
    }

    pub async fn set_rate_limits(&self, project: &str, rates: &RateLimits) -> Result<ProjectRates, ApiError> {
        self.call(
            Method::PUT,
            &["v1", "projects", project, "rate-limits"],
            &[],
            Some(rates),
        )
        .await
    }

    /// A project's egress ceiling and its sandboxes' default policy.
    pub async fn get_project_network(&self, project: &str) -> Result<ProjectNetwork, ApiError> {
        self.get(&["v1", "projects", project, "network"], &[]).await
    }

    pub async fn set_project_network(
        &self,
        project: &str,
        settings: &ProjectNetwork,
    ) -> Result<ProjectNetwork, ApiError> {
        self.call(
            Method::PUT,
            &["v1", "projects", project, "network"],
            &[],
            Some(settings),
        )
        .await
    }

    // ---- tokens ----

    pub async fn issue_token(&self, req: &IssueToken) -> Result<TokenIssued, ApiError> {
        self.call(Method::POST, &["v1", "tokens"], &[], Some(req)).await
    }

    pub async fn list_tokens(&self, project: Option<&str>) -> Result<TokenList, ApiError> {
        let q: Vec<(&str, String)> = project.map(|p| ("project", p.to_string())).into_iter().collect();
        self.get_all(&["v1", "tokens"], &q).await
    }

    pub async fn revoke_token(&self, id: &str, reason: Option<&str>) -> Result<Done, ApiError> {
        let q: Vec<(&str, String)> = reason.map(|r| ("reason", r.to_string())).into_iter().collect();
        self.call::<(), _>(Method::DELETE, &["v1", "tokens", id], &q, None)
            .await
    }

    pub async fn whoami(&self) -> Result<Whoami, ApiError> {
        self.get(&["v1", "whoami"], &[]).await
    }

    // ---- sandboxes ----

    pub async fn create_sandbox(&self, req: &CreateSandbox) -> Result<SandboxWritten, ApiError> {
        self.call(Method::POST, &["v1", "sandboxes"], &[], Some(req)).await
    }

    pub async fn list_sandboxes(&self, f: &SandboxFilter) -> Result<SandboxList, ApiError> {
        let mut q: Vec<(&str, String)> = Vec::new();
        if let Some(p) = &f.project {
            q.push(("project", p.clone()));
        }
        for (k, v) in &f.labels {
            q.push(("label", format!("{k}={v}")));
        }
        if let Some(s) = &f.state {
            q.push(("state", s.clone()));
        }
        self.get_all(&["v1", "sandboxes"], &q).await
    }

    pub async fn get_sandbox(&self, id: &str) -> Result<Sandbox, ApiError> {
        self.get(&["v1", "sandboxes", id], &[]).await
    }

    /// The last `max_bytes` of the sandbox's console (its PID 1 output).
    pub async fn sandbox_logs(&self, id: &str, max_bytes: Option<u64>) -> Result<Vec<u8>, ApiError> {
        let q: Vec<(&str, String)> = max_bytes.map(|m| ("max_bytes", m.to_string())).into_iter().collect();
        self.call_raw::<()>(Method::GET, &["v1", "sandboxes", id, "logs"], &q, None)
            .await
    }

    /// One sample of the sandbox's resources, taken now by its edge.
    pub async fn sandbox_metrics(&self, id: &str) -> Result<SandboxMetrics, ApiError> {
        self.get(&["v1", "sandboxes", id, "metrics"], &[]).await
    }

    /// The sandbox's metrics history from `start_ms` to `end_ms` (ms since the Unix
    /// epoch, both included; either absent: from the first point, to the last).
    pub async fn sandbox_metrics_history(
        &self,
        id: &str,
        start_ms: Option<u64>,
        end_ms: Option<u64>,
    ) -> Result<MetricsHistory, ApiError> {
        let mut q: Vec<(&str, String)> = Vec::new();
        if let Some(s) = start_ms {
            q.push(("start_ms", s.to_string()));
        }
        if let Some(e) = end_ms {
            q.push(("end_ms", e.to_string()));
        }
        self.get(&["v1", "sandboxes", id, "metrics", "history"], &q).await
    }

    pub async fn kill_sandbox(&self, id: &str) -> Result<SandboxWritten, ApiError> {
        self.call::<(), _>(Method::DELETE, &["v1", "sandboxes", id], &[], None)
            .await
    }

    pub async fn pause_sandbox(&self, id: &str) -> Result<SandboxWritten, ApiError> {
        self.call::<(), _>(Method::POST, &["v1", "sandboxes", id, "pause"], &[], None)
            .await
    }

    /// Pauses keeping only the file system: its processes end; a resume boots it again.
    pub async fn pause_sandbox_filesystem(&self, id: &str) -> Result<SandboxWritten, ApiError> {
        let body = PauseSandbox { filesystem: true };
        self.call(Method::POST, &["v1", "sandboxes", id, "pause"], &[], Some(&body))
            .await
    }

    pub async fn resume_sandbox(&self, id: &str) -> Result<SandboxWritten, ApiError> {
        self.call::<(), _>(Method::POST, &["v1", "sandboxes", id, "resume"], &[], None)
            .await
    }

    /// Resumes by booting again from the file system (the memory a pause kept is dropped).
    pub async fn resume_sandbox_cold(&self, id: &str) -> Result<SandboxWritten, ApiError> {
        let body = ResumeSandbox { cold: true };
        self.call(Method::POST, &["v1", "sandboxes", id, "resume"], &[], Some(&body))
            .await
    }

    pub async fn fork_sandbox(&self, id: &str, count: u32) -> Result<Forked, ApiError> {
        self.fork_sandbox_to(id, count, None).await
    }

    /// Forks onto edge `edge` (every copy there), or wherever placement puts them.
    pub async fn fork_sandbox_to(&self, id: &str, count: u32, edge: Option<&str>) -> Result<Forked, ApiError> {
        let body = ForkSandbox {
            count,
            edge: edge.map(str::to_string),
        };
        self.call(Method::POST, &["v1", "sandboxes", id, "fork"], &[], Some(&body))
            .await
    }

    pub async fn set_sandbox_timeout(&self, id: &str, timeout_seconds: u64) -> Result<SandboxWritten, ApiError> {
        self.call(
            Method::PUT,
            &["v1", "sandboxes", id, "timeout"],
            &[],
            Some(&SetTimeout { timeout_seconds }),
        )
        .await
    }

    /// What the sandbox may reach.
    pub async fn get_sandbox_network(&self, id: &str) -> Result<NetworkPolicy, ApiError> {
        self.get(&["v1", "sandboxes", id, "network"], &[]).await
    }

    /// Replaces the sandbox's whole egress policy; its edge applies it at once.
    pub async fn set_sandbox_network(&self, id: &str, policy: &NetworkPolicy) -> Result<SandboxWritten, ApiError> {
        self.call(Method::PUT, &["v1", "sandboxes", id, "network"], &[], Some(policy))
            .await
    }

    pub async fn set_sandbox_labels(
        &self,
        id: &str,
        labels: BTreeMap<String, String>,
    ) -> Result<SandboxWritten, ApiError> {
        self.call(
            Method::PUT,
            &["v1", "sandboxes", id, "labels"],
            &[],
            Some(&SetLabels { labels }),
        )
        .await
    }

    // ---- snapshots ----

    /// Takes a snapshot; it is `pending` until its edge has taken it.
    pub async fn create_snapshot(&self, sandbox: &str, name: Option<&str>) -> Result<SnapshotWritten, ApiError> {
        let req = CreateSnapshot {
            name: name.map(str::to_string),
        };
        self.call(
            Method::POST,
            &["v1", "sandboxes", sandbox, "snapshots"],
            &[],
            Some(&req),
        )
        .await
    }

    pub async fn get_snapshot(&self, id: &str) -> Result<Snapshot, ApiError> {
        self.get(&["v1", "snapshots", id], &[]).await
    }

    pub async fn list_snapshots(&self, sandbox: Option<&str>) -> Result<SnapshotList, ApiError> {
        let q: Vec<(&str, String)> = sandbox.map(|s| ("sandbox", s.to_string())).into_iter().collect();
        self.get_all(&["v1", "snapshots"], &q).await
    }

    pub async fn delete_snapshot(&self, id: &str) -> Result<Done, ApiError> {
        self.call::<(), _>(Method::DELETE, &["v1", "snapshots", id], &[], None)
            .await
    }

    // ---- images ----

    /// Registers an image and has an edge pull it; it is `pending` until pulled.
    pub async fn pull_image(&self, req: &PullImage) -> Result<ImageWritten, ApiError> {
        self.call(Method::POST, &["v1", "images"], &[], Some(req)).await
    }

    /// Imports image `name` from the tarball at `path` (a docker-archive or an OCI image
    /// layout, gzipped or not), streamed to one edge (`edge`, or one chosen) which verifies
    /// and stores it; the answer comes once it is `ready` (a refused tarball is an error
    /// naming `body`, and the image is `failed`). `sent` is called with the bytes sent so
    /// far and the tarball's size as the upload goes.
    pub async fn import_image(
        &self,
        name: &str,
        path: &std::path::Path,
        project: Option<&str>,
        edge: Option<&str>,
        sent: impl Fn(u64, u64) + Send + Sync + 'static,
    ) -> Result<ImageWritten, ApiError> {
        use tokio::io::AsyncReadExt;
        let file = tokio::fs::File::open(path)
            .await
            .map_err(|e| ApiError::local("local_file", format!("cannot open {}: {e}", path.display())))?;
        let size = file
            .metadata()
            .await
            .map_err(|e| ApiError::local("local_file", format!("cannot read {}: {e}", path.display())))?
            .len();
        let sent = std::sync::Arc::new(sent);
        let chunks = futures::stream::try_unfold((file, 0u64), move |(mut file, done)| {
            let sent = sent.clone();
            async move {
                let mut buf = vec![0u8; 1 << 20];
                let n = file.read(&mut buf).await?;
                if n == 0 {
                    return Ok::<_, std::io::Error>(None);
                }
                buf.truncate(n);
                let done = done + n as u64;
                sent(done, size);
                Ok(Some((buf, (file, done))))
            }
        });
        let mut query: Vec<(&str, String)> = Vec::new();
        if let Some(p) = project {
            query.push(("project", p.to_string()));
        }
        if let Some(e) = edge {
            query.push(("edge", e.to_string()));
        }
        let req = self
            .request(Method::PUT, &["v1", "images", name], &query)
            .header(reqwest::header::CONTENT_TYPE, "application/x-tar")
            .header(reqwest::header::CONTENT_LENGTH, size)
            .body(reqwest::Body::wrap_stream(chunks));
        let bytes = self
            .send(req)
            .await?
            .bytes()
            .await
            .map_err(|e| ApiError::local("unreachable", format!("the response was cut off: {e}")))?;
        serde_json::from_slice(&bytes)
            .map_err(|e| ApiError::local("decode", format!("the response does not decode: {e}")))
    }

    /// Pushes image `req.image` to the registry `req.reference` names; the answer comes
    /// once the manifest is written (its digest pins exactly this image).
    pub async fn push_image(&self, req: &PushImage) -> Result<ImagePushed, ApiError> {
        self.call(Method::POST, &["v1", "image-pushes"], &[], Some(req)).await
    }

    /// The progress of the push of `image` asked with id `id`, while it runs (404 before
    /// it starts and once it ended).
    pub async fn push_progress(&self, image: &str, id: &str) -> Result<ImagePushProgress, ApiError> {
        self.get(&["v1", "image-pushes", id], &[("image", image.to_string())])
            .await
    }

    /// Makes image `req.name` of container sandbox `sandbox` (its writable layer on top of
    /// its image, residue and `req.scrub` left out), on the sandbox's edge; it is `pending`
    /// until made (poll [`Client::get_image`]). Sandboxes start from it by name, on that edge.
    pub async fn pack_sandbox(&self, sandbox: &str, req: &PackSandbox) -> Result<ImageWritten, ApiError> {
        self.call(Method::POST, &["v1", "sandboxes", sandbox, "pack"], &[], Some(req))
            .await
    }

    /// One image, with the pull's progress while it is pending.
    pub async fn get_image(&self, name: &str) -> Result<Image, ApiError> {
        self.get(&["v1", "images", name], &[]).await
    }

    pub async fn list_images(&self) -> Result<ImageList, ApiError> {
        self.get_all(&["v1", "images"], &[]).await
    }

    pub async fn delete_image(&self, name: &str) -> Result<Done, ApiError> {
        self.call::<(), _>(Method::DELETE, &["v1", "images", name], &[], None)
            .await
    }

    /// Collects every edge's image store now (root project, edge:write).
    pub async fn prune_images(&self) -> Result<Pruned, ApiError> {
        self.call::<(), _>(Method::POST, &["v1", "image-store", "prune"], &[], None)
            .await
    }

    // ---- tasks ----

    /// Pauses every running sandbox labelled `task=<task>` in the caller's subtree.
    pub async fn pause_task(&self, task: &str) -> Result<TaskWritten, ApiError> {
        self.call::<(), _>(Method::POST, &["v1", "tasks", task, "pause"], &[], None)
            .await
    }

    /// Resumes every paused sandbox labelled `task=<task>` in the caller's subtree.
    pub async fn resume_task(&self, task: &str) -> Result<TaskWritten, ApiError> {
        self.call::<(), _>(Method::POST, &["v1", "tasks", task, "resume"], &[], None)
            .await
    }

    // ---- edges ----

    pub async fn list_edges(&self) -> Result<EdgeList, ApiError> {
        self.get_all(&["v1", "edges"], &[]).await
    }

    pub async fn register_edge(&self, req: &RegisterEdge) -> Result<EdgeWritten, ApiError> {
        self.call(Method::POST, &["v1", "edges"], &[], Some(req)).await
    }

    pub async fn deregister_edge(&self, id: &str) -> Result<EdgeWritten, ApiError> {
        self.call::<(), _>(Method::DELETE, &["v1", "edges", id], &[], None)
            .await
    }

    // ---- audit and replay ----

    /// One page of audit records; pass `next` back as `after` for the following page.
    pub async fn audit(&self, f: &AuditFilter) -> Result<AuditPage, ApiError> {
        let mut q: Vec<(&str, String)> = Vec::new();
        for (k, v) in [
            ("principal", &f.principal),
            ("project", &f.project),
            ("action", &f.action),
            ("target", &f.target),
            ("since", &f.since),
            ("until", &f.until),
        ] {
            if let Some(v) = v {
                q.push((k, v.clone()));
            }
        }
        if let Some(a) = f.after {
            q.push(("after", a.to_string()));
        }
        if let Some(l) = f.limit {
            q.push(("limit", l.to_string()));
        }
        self.get(&["v1", "audit"], &q).await
    }

    pub async fn replay(&self, r: &ReplayRequest) -> Result<Replay, ApiError> {
        let q: Vec<(&str, String)> = [("to", &r.to), ("view", &r.view), ("diff_from", &r.diff_from)]
            .into_iter()
            .filter_map(|(k, v)| v.clone().map(|v| (k, v)))
            .collect();
        self.get(&["v1", "replay"], &q).await
    }

    // ---- cluster ----

    pub async fn cluster_status(&self) -> Result<ClusterStatus, ApiError> {
        self.get(&["v1", "cluster"], &[]).await
    }

    /// How long the live views keep ended sandboxes and audit records.
    pub async fn get_retention(&self) -> Result<Retention, ApiError> {
        self.get(&["v1", "cluster", "retention"], &[]).await
    }

    /// Sets the retention (a setting left out keeps its value); answers it as it now is.
    pub async fn set_retention(&self, retention: &Retention) -> Result<Retention, ApiError> {
        self.call(Method::PUT, &["v1", "cluster", "retention"], &[], Some(retention))
            .await
    }

    /// A fresh key and certificate for every control node and its gateway (edges renew
    /// theirs at their next heartbeat). Needs cluster:admin in the root project.
    pub async fn rotate_certificates(&self) -> Result<types::CertificateRotation, ApiError> {
        self.call::<(), _>(Method::POST, &["v1", "cluster", "certificates", "rotate"], &[], None)
            .await
    }

    pub async fn add_member(&self, id: u64, addr: &str) -> Result<ClusterStatus, ApiError> {
        self.call(
            Method::POST,
            &["v1", "cluster", "members"],
            &[],
            Some(&AddMember { id, addr: addr.into() }),
        )
        .await
    }

    pub async fn remove_member(&self, id: u64) -> Result<ClusterStatus, ApiError> {
        self.call::<(), _>(
            Method::DELETE,
            &["v1", "cluster", "members", &id.to_string()],
            &[],
            None,
        )
        .await
    }
}

/// The error of a non-2xx answer: the gateway's `{code,message,field}`, the agent's
/// Connect error, or its `/files` error (`{"code": 404, "message"}`); otherwise its
/// status and the start of its body.
async fn error_of(resp: reqwest::Response) -> ApiError {
    use serde_json::Value;
    let status = resp.status();
    let bytes = resp.bytes().await.unwrap_or_default();
    let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    let code = match &v["code"] {
        Value::String(s) => s.clone(),
        _ => status
            .canonical_reason()
            .unwrap_or("http")
            .to_lowercase()
            .replace(' ', "_"),
    };
    let message = match v["message"].as_str() {
        Some(m) => m.to_string(),
        None => format!(
            "HTTP {status}: {}",
            String::from_utf8_lossy(&bytes).chars().take(200).collect::<String>()
        ),
    };
    ApiError {
        status: status.as_u16(),
        code,
        message,
        field: v["field"].as_str().map(Into::into),
    }
}
