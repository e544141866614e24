//! OpenDsec's commands: what can be asked of the control plane, and the one pure
//! function that turns a request into events.
//!
//! `decide(state, in_flight, cmd, ctx)` authorises the principal, validates the
//! input and chooses (placement, ids) using only its arguments: the time, the random
//! seed and the principal arrive in `ctx` and the choices are recorded in the events.
//! Architecture invariant: no IO, no clock, no randomness of its own.

mod decide;
pub mod images;
mod inflight;
mod placement;
pub mod validate;

pub use decide::network;
pub use decide::{Decided, batch_for, decide, decide_excluding, request_digest};
pub use inflight::InFlight;
pub use placement::{Candidate, DEFAULT_K, Rng, edge_ordinal_of, place_power_of_k, sandbox_id};
pub use validate::LIMITS;

use opendsec_projections::{CpuClass, Isolation, Limits, Right, Usage};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The edge label saying the edge answers admission requests (`POST /admit` on its proxy):
/// a sandbox placed there is admitted by the edge itself before it is logged.
pub const ADMISSION_LABEL: &str = "opendsec.io/admission";

/// The edge label saying the edge runs microVMs (its value names the VMM, e.g. `qemu`):
/// microVM sandboxes are placed only on edges that carry it.
pub const MICROVM_LABEL: &str = "opendsec.io/microvm";

/// The edge label saying the edge enforces its container sandboxes' network policies
/// (value: `nftables`): they get a link out, default deny. An edge without it (started
/// with `--no-sandbox-network`) gives them none, whatever their policy says.
pub const EGRESS_LABEL: &str = "opendsec.io/egress";

/// The edge label saying the edge runs full VMs (`isolation: vm`; its value names the
/// machine, `q35`): they are placed only on edges that carry it.
pub const FULLVM_LABEL: &str = "opendsec.io/fullvm";

/// The sandbox label that names the task a sandbox works for: `PauseTask` and
/// `ResumeTask` act on every sandbox carrying `task=<name>`.
pub const TASK_LABEL: &str = "task";

/// The least memory a microVM may have (its kernel and agent need it).
pub const MICROVM_MIN_MEMORY_MB: u64 = 64;

/// The least memory a full VM may have (firmware, bootloader, its kernel and agent).
pub const FULLVM_MIN_MEMORY_MB: u64 = 128;

/// The most copies one fork of a microVM makes (they are restored together on its edge).
pub const MICROVM_MAX_FORK_COUNT: u32 = 64;

/// Every write the control plane accepts. Each variant says when it is legal in `decide`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "command", rename_all = "snake_case", deny_unknown_fields)]
pub enum Command {
    /// Creates the root project and its first admin token. Legal once, by the system principal.
    Bootstrap {
        project_name: String,
        token_name: String,
        secret_sha256: String,
    },
    /// Creates a project under `parent`. Needs project:write on the parent.
    CreateProject {
        name: String,
        parent: String,
    },
    /// Deletes an empty project strictly below the principal's own. Needs project:write.
    DeleteProject {
        project: String,
    },
    /// Sets a project's egress ceiling and its sandboxes' default network policy (JSON;
    /// none: deny). A ceiling is never above the parent's; a caller may lower, not raise,
    /// its own project's. Needs quota:write.
    SetProjectNetwork {
        project: String,
        ceiling: opendsec_projections::Egress,
        #[serde(default)]
        default_network: Option<String>,
    },
    /// Sets a project's limits; a child's can never exceed its parent's. Needs quota:write
    /// on a strict ancestor (or on the root project, for the root itself).
    SetQuota {
        project: String,
        limits: Limits,
    },
    /// Sets a project's write rates (writes a second by its whole subtree, and by each of
    /// its tokens; `None`: none of its own); never above the parent's. Needs quota:write
    /// on a strict ancestor (or on the root project, for the root itself).
    SetRateLimits {
        project: String,
        #[serde(default)]
        writes_per_second: Option<u64>,
        #[serde(default)]
        token_writes_per_second: Option<u64>,
    },
    /// Issues a token with rights the issuer holds, in its subtree, expiring no later than it.
    IssueToken {
        project: String,
        name: String,
        rights: Vec<Right>,
        ttl_seconds: Option<u64>,
        /// Hex SHA-256 of the secret the caller generated; the secret never reaches the log.
        secret_sha256: String,
    },
    /// Revokes a token in the principal's subtree. Needs token:write.
    RevokeToken {
        token: String,
        reason: String,
    },
    /// Registers or updates an edge. Needs edge:write.
    RegisterEdge {
        edge: String,
        address: String,
        capacity: Usage,
        labels: BTreeMap<String, String>,
    },
    /// Stops placing on an edge. Needs edge:write.
    DeregisterEdge {
        edge: String,
    },
    /// Places a sandbox on an edge (power-of-k over free capacity). Needs sandbox:write.
    CreateSandbox {
        project: String,
        image: String,
        cpu_millis: u64,
        memory_mb: u64,
        labels: BTreeMap<String, String>,
        timeout_seconds: Option<u64>,
        /// Everything else a create may ask for (E2B's create options).
        #[serde(default)]
        opts: SandboxOptions,
    },
    /// Creates `count` copies of a live sandbox: a container's copies start from its file
    /// system, a microVM's from its memory and disk. They go to the source's edge while it
    /// has room, else to other edges (which pull the source's state from the source's
    /// edge); `edge` places every copy on that edge. Needs sandbox:write.
    ForkSandbox {
        sandbox: String,
        count: u32,
        /// Place the copies on this edge (a placement hint that must be followed).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        edge: Option<String>,
    },
    /// Pauses a running sandbox: everything kept (a container freezes, a microVM's memory
    /// is snapshotted), or with `filesystem` only its file system (its processes end; a
    /// resume boots it again). Needs sandbox:write.
    PauseSandbox {
        sandbox: String,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        filesystem: bool,
    },
    /// Resumes a paused sandbox; with `cold` it boots again from its file system, dropping
    /// the memory its pause kept. Needs sandbox:write.
    ResumeSandbox {
        sandbox: String,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        cold: bool,
    },
    KillSandbox {
        sandbox: String,
    },
    /// Sets the sandbox's lifetime from now (0 = none).
    SetSandboxTimeout {
        sandbox: String,
        timeout_seconds: u64,
    },
    SetSandboxLabels {
        sandbox: String,
        labels: BTreeMap<String, String>,
    },
    /// Captures a live sandbox on its edge: a container's file system, or a microVM's
    /// memory, device state and disk. Legal once it has run. Needs sandbox:write.
    CreateSnapshot {
        sandbox: String,
        name: String,
    },
    /// Deletes a snapshot (sandboxes started from it keep running). Needs sandbox:write.
    DeleteSnapshot {
        snapshot: String,
    },
    /// What an edge made of a snapshot request. Needs edge:write.
    ReportSnapshot {
        snapshot: String,
        result: SnapshotResult,
    },
    /// Replaces a sandbox's whole network policy (JSON, see `network`); it never exceeds
    /// its project's egress ceiling. Needs sandbox:write.
    SetSandboxNetwork {
        sandbox: String,
        network: String,
    },
    /// Pauses every live, running sandbox of the caller's project subtree labelled
    /// `task=<task>` (containers freeze, microVMs snapshot and end their VMM), in one
    /// logged decision. Needs sandbox:write; some such sandbox must exist.
    PauseTask {
        task: String,
    },
    /// Resumes every paused sandbox of the caller's subtree labelled `task=<task>`.
    ResumeTask {
        task: String,
    },
    /// Adds a control node to the Raft cluster. Needs cluster:admin in the root project.
    AddClusterMember {
        node_id: u64,
        address: String,
    },
    /// Removes a control node from the Raft cluster. Needs cluster:admin in the root project.
    RemoveClusterMember {
        node_id: u64,
    },
    /// Sets how long the live views keep ended sandboxes and audit records (a setting left
    /// out keeps its value). Needs cluster:admin in the root project.
    SetRetention {
        #[serde(default)]
        ended_sandboxes_seconds: Option<u64>,
        #[serde(default)]
        audit_seconds: Option<u64>,
        #[serde(default)]
        audit_records: Option<u64>,
    },
    /// Registers image `name` in `project` (its descendants' sandboxes start from it too)
    /// and has one edge (`edge`, or one chosen) pull it from `reference`. Pulling a name
    /// the project already has pulls it again (a moved tag). Needs sandbox:write.
    PullImage {
        project: String,
        name: String,
        reference: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        edge: Option<String>,
    },
    /// Registers image `name` in `project`, imported by one edge (`edge`, or one chosen)
    /// from a docker-archive or OCI-layout tarball the caller then uploads to that edge
    /// (`PUT /v1/images/{name}`). The image lives in that edge's store only, so creates
    /// of it go there. Importing a name the project has replaces it. Needs sandbox:write.
    /// The edge reports it with `ReportImage` (failed when no upload arrives).
    ImportImage {
        project: String,
        name: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        edge: Option<String>,
    },
    /// Removes a registered image's name (sandboxes running it keep their files; edges
    /// collect its layers once nothing uses them). Needs sandbox:write.
    DeleteImage {
        name: String,
    },
    /// Registers image `name` in the sandbox's project, made by the sandbox's edge from
    /// the sandbox's writable layer on top of its image (residue and the `scrub` paths
    /// left out). Legal for a live container sandbox that has run (running or paused); a
    /// microVM's or full VM's disk is not a layer (snapshot it instead). Needs
    /// sandbox:write. Its edge reports it with `ReportImage`.
    PackSandbox {
        sandbox: String,
        name: String,
        /// Absolute paths to leave out too (files, or directories with all they hold).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        scrub: Vec<String>,
        /// What the image's config changes from its parent's (a template build's).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        config: Option<opendsec_projections::ConfigOverride>,
    },
    /// Asks for a build of a template of `project` (E2B's `POST /v3/templates`): of the
    /// template named `name` if the project has one, else of a new template (named
    /// `name` when given: unique among templates and images). The build waits for its
    /// steps (`StartTemplateBuild`); once ready it takes `tags` (the default tag when
    /// none). Needs sandbox:write.
    RequestTemplateBuild {
        project: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        name: Option<String>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        tags: Vec<String>,
        #[serde(default)]
        cpu_count: u32,
        #[serde(default)]
        memory_mb: u32,
    },
    /// The build's steps came and run: it will pack image `image` from a sandbox of
    /// `from`. Legal for a waiting build. Needs sandbox:write in the template's project.
    StartTemplateBuild {
        template: String,
        build: String,
        from: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        start_cmd: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ready_cmd: Option<String>,
        steps: u32,
        /// Who runs the steps: `<control node id>/<that gateway process's run id>`.
        #[serde(default)]
        runner: String,
    },
    /// The build ended: ready (`error` none; its image is packed and ready) or failed
    /// at `error_step`. Legal for a build that has not ended. Needs sandbox:write.
    FinishTemplateBuild {
        template: String,
        build: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error_step: Option<String>,
    },
    /// Points `tags` of a template (named `name` or by id) at build `build` (a ready
    /// one), or (`build` none) removes them. Needs sandbox:write.
    SetTemplateTags {
        template: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        build: Option<String>,
        tags: Vec<String>,
    },
    /// Removes a template and its names, and the images of its builds. Needs
    /// sandbox:write.
    DeleteTemplate {
        template: String,
    },
    /// What an edge made of a pull, a pack or an import. Needs edge:write.
    ReportImage {
        name: String,
        result: ImageResult,
    },
    /// What an edge observed about one of its sandboxes. Needs edge:write.
    ReportSandbox {
        sandbox: String,
        observation: Observation,
    },
}

/// An edge's observation of a sandbox.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case", deny_unknown_fields)]
pub enum Observation {
    Ready,
    /// A VM sandbox is ready: [`Observation::Ready`] plus how its edge runs it, the VMM
    /// (`qemu`, `firecracker`) and the accelerator its guest runs under (`kvm`, `tcg`).
    VmReady {
        vmm: String,
        accelerator: String,
    },
    /// Past its timeout, a sandbox with auto-pause is to pause instead of dying.
    TimedOut,
    Paused,
    Resumed,
    Failed {
        reason: String,
    },
    Exited {
        exit_code: i32,
        oom_killed: bool,
        reason: String,
    },
    /// The kernel's OOM killer ended a process inside a running sandbox, which lives on:
    /// `kills` is the count over the sandbox's life (so a repeated report changes
    /// nothing), `command` the last one's program ("" when the edge could not tell).
    OomKilled {
        kills: u64,
        command: String,
    },
}

impl Command {
    /// The audit view's action name.
    pub fn action(&self) -> &'static str {
        match self {
            Command::Bootstrap { .. } => "cluster.bootstrap",
            Command::CreateProject { .. } => "project.create",
            Command::DeleteProject { .. } => "project.delete",
            Command::SetQuota { .. } => "quota.set",
            Command::SetProjectNetwork { .. } => "project.set_network",
            Command::SetRateLimits { .. } => "project.set_rate_limits",
            Command::IssueToken { .. } => "token.issue",
            Command::RevokeToken { .. } => "token.revoke",
            Command::RegisterEdge { .. } => "edge.register",
            Command::DeregisterEdge { .. } => "edge.deregister",
            Command::CreateSandbox { .. } => "sandbox.create",
            Command::ForkSandbox { .. } => "sandbox.fork",
            Command::PauseSandbox { .. } => "sandbox.pause",
            Command::ResumeSandbox { .. } => "sandbox.resume",
            Command::KillSandbox { .. } => "sandbox.kill",
            Command::SetSandboxTimeout { .. } => "sandbox.set_timeout",
            Command::SetSandboxLabels { .. } => "sandbox.set_labels",
            Command::ReportSandbox { .. } => "sandbox.report",
            Command::CreateSnapshot { .. } => "snapshot.create",
            Command::DeleteSnapshot { .. } => "snapshot.delete",
            Command::ReportSnapshot { .. } => "snapshot.report",
            Command::SetSandboxNetwork { .. } => "sandbox.set_network",
            Command::PauseTask { .. } => "task.pause",
            Command::ResumeTask { .. } => "task.resume",
            Command::AddClusterMember { .. } => "cluster.add_member",
            Command::RemoveClusterMember { .. } => "cluster.remove_member",
            Command::SetRetention { .. } => "cluster.set_retention",
            Command::PullImage { .. } => "image.pull",
            Command::ImportImage { .. } => "image.import",
            Command::DeleteImage { .. } => "image.delete",
            Command::PackSandbox { .. } => "image.pack",
            Command::ReportImage { .. } => "image.report",
            Command::RequestTemplateBuild { .. } => "template.request_build",
            Command::StartTemplateBuild { .. } => "template.start_build",
            Command::FinishTemplateBuild { .. } => "template.finish_build",
            Command::SetTemplateTags { .. } => "template.set_tags",
            Command::DeleteTemplate { .. } => "template.delete",
        }
    }
}

/// Options of a sandbox create beyond its image and size.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SandboxOptions {
    /// Environment variables of every process in the sandbox.
    pub env: BTreeMap<String, String>,
    /// Pause instead of kill at the timeout.
    pub auto_pause: bool,
    /// With `auto_pause`: that pause keeps only the file system (E2B's
    /// `autoPauseMemory: false`).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub auto_pause_filesystem: bool,
    /// A request to the paused sandbox resumes it.
    pub auto_resume: bool,
    /// Network policy as JSON (checked by `network::parse`; none: the default, deny).
    pub network: Option<String>,
    /// A container unless asked otherwise (or started from a microVM's or full VM's
    /// snapshot).
    pub isolation: Option<Isolation>,
    /// A client's idempotency key: while a sandbox created with it lives, another create
    /// with the same key in the same project is refused as a conflict naming that sandbox.
    pub idempotency_key: Option<String>,
    /// Latency-sensitive unless asked otherwise.
    pub cpu_class: Option<CpuClass>,
}

/// An edge's answer to a snapshot request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case", deny_unknown_fields)]
pub enum SnapshotResult {
    Ready { size_bytes: u64 },
    Failed { reason: String },
}

/// An edge's answer to a pull or a pack.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case", deny_unknown_fields)]
pub enum ImageResult {
    Ready {
        /// The manifest's digest (`sha256:...`); for a packed image, of the image record
        /// its edge wrote.
        digest: String,
        size_bytes: u64,
        layers: u32,
    },
    Failed {
        reason: String,
    },
}

/// Who is asking. Authentication (checking a secret) happens before `decide`; `decide`
/// still checks that the token exists, is not revoked and has not expired.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "id", rename_all = "snake_case")]
pub enum Caller {
    /// A token, by id.
    Token(String),
    /// The control plane itself (bootstrap, TTL enforcement).
    System,
}

/// Everything `decide` may not find out for itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ctx {
    pub time_ms: u64,
    pub seed: u64,
    pub request_id: String,
    pub caller: Caller,
}

/// Why a command was refused. `kind` decides the HTTP status and whether the refusal
/// is logged: bad input is not (the log stays unchanged), a denial is (the audit view
/// shows every write, accepted or denied).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct Rejection {
    pub kind: RejectionKind,
    pub message: String,
    pub field: Option<String>,
    /// For `RateLimited`: when a retry may succeed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RejectionKind {
    /// The request is malformed (400); not logged.
    Invalid,
    /// It names something that does not exist (404); not logged.
    NotFound,
    /// The caller's token is unknown, revoked or expired (401); not logged.
    Unauthenticated,
    /// The caller lacks the right (403); logged.
    Forbidden,
    /// It conflicts with existing state (409); logged.
    Conflict,
    /// A quota would be exceeded (429); logged.
    QuotaExceeded,
    /// No edge can take it (503); logged.
    NoCapacity,
    /// The caller's project or token wrote faster than its rate (429 with Retry-After);
    /// not logged.
    RateLimited,
}

impl RejectionKind {
    pub fn code(self) -> &'static str {
        match self {
            RejectionKind::Invalid => "invalid",
            RejectionKind::NotFound => "not_found",
            RejectionKind::Unauthenticated => "unauthenticated",
            RejectionKind::Forbidden => "forbidden",
            RejectionKind::Conflict => "conflict",
            RejectionKind::QuotaExceeded => "quota_exceeded",
            RejectionKind::NoCapacity => "no_capacity",
            RejectionKind::RateLimited => "rate_limited",
        }
    }

    /// The kind a logged denial's code names.
    pub fn from_code(code: &str) -> Option<RejectionKind> {
        [
            RejectionKind::Invalid,
            RejectionKind::NotFound,
            RejectionKind::Unauthenticated,
            RejectionKind::Forbidden,
            RejectionKind::Conflict,
            RejectionKind::QuotaExceeded,
            RejectionKind::NoCapacity,
            RejectionKind::RateLimited,
        ]
        .into_iter()
        .find(|k| k.code() == code)
    }

    /// Whether a refusal of this kind is written to the log (and so to the audit view).
    pub fn is_logged(self) -> bool {
        !matches!(
            self,
            RejectionKind::Invalid
                | RejectionKind::NotFound
                | RejectionKind::Unauthenticated
                | RejectionKind::RateLimited
        )
    }
}

impl Rejection {
    pub fn new(kind: RejectionKind, message: impl Into<String>) -> Rejection {
        Rejection {
            kind,
            message: message.into(),
            field: None,
            retry_after_ms: None,
        }
    }
    pub fn field(kind: RejectionKind, field: &str, message: impl Into<String>) -> Rejection {
        Rejection {
            kind,
            message: message.into(),
            field: Some(field.to_string()),
            retry_after_ms: None,
        }
    }
}
