//! The wire types of the REST API `/v1`: the one definition of every request and
//! response body, used by the gateway (which documents them in its OpenAPI
//! document, feature `openapi`) and by this crate's client.
//!
//! Every request type refuses unknown fields, so a typo is a 400 naming the field
//! rather than a silently ignored option.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[cfg(feature = "openapi")]
use utoipa::ToSchema;

/// The body of every error response.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct ErrorBody {
    /// Machine-readable: invalid, not_found, unauthenticated, forbidden, conflict,
    /// quota_exceeded, no_capacity, payload_too_large, unavailable, internal.
    pub code: String,
    pub message: String,
    /// The request field at fault, as a path (`limits.cpu_millis`, `labels`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
}

/// The answer to a write that has nothing else to say: the log index it was applied at.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct Done {
    pub index: u64,
}

// ---- projects ----

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateProject {
    /// 1-63 characters of a-z, 0-9, '-', '_', '.'; unique among its siblings.
    pub name: String,
    /// The parent project's id; the caller's own project when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct Project {
    pub id: String,
    pub name: String,
    pub parent: Option<String>,
    pub children: Vec<String>,
    pub created_at_ms: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct ProjectList {
    pub projects: Vec<Project>,
    /// There is more: ask again with `page_token` set to this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_page_token: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct ProjectWritten {
    pub index: u64,
    pub project: Project,
}

// ---- quotas ----

/// Limits; an absent resource is unlimited here, which a project may have only
/// where its parent is unlimited in that resource too.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Limits {
    #[serde(default)]
    pub sandboxes: Option<u64>,
    #[serde(default)]
    pub cpu_millis: Option<u64>,
    #[serde(default)]
    pub memory_mb: Option<u64>,
    /// Bytes of environment variables and labels (names and values) of live sandboxes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata_bytes: Option<u64>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Amounts of resources (capacity, usage).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Resources {
    pub sandboxes: u64,
    pub cpu_millis: u64,
    pub memory_mb: u64,
    /// Bytes of environment variables and labels (names and values) of live sandboxes.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub metadata_bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct Quota {
    pub project: String,
    /// The project's own limits.
    pub limits: Limits,
    /// Its own limits tightened by every ancestor's: what is enforced.
    pub effective: Limits,
    /// What the project's whole subtree uses now.
    pub usage: Resources,
}

// ---- tokens ----

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct IssueToken {
    /// The token's project; the caller's own when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project: Option<String>,
    pub name: String,
    /// Rights such as `sandbox:write`; only rights the caller holds can be granted.
    pub rights: Vec<String>,
    /// Lifetime; never past the issuer's own expiry. Absent or 0: no expiry of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_seconds: Option<u64>,
    /// `opendsec` (default: `odsec_<id>.<secret>`) or `e2b` (an E2B API key, `e2b_` +
    /// 40 hex, for `E2B_API_KEY`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<String>,
}

/// A freshly issued token. `token` is the bearer secret and is shown only here, once.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct TokenIssued {
    pub index: u64,
    pub id: String,
    pub token: String,
    pub project: String,
    pub rights: Vec<String>,
    pub expires_at_ms: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct Revocation {
    pub at_ms: u64,
    pub reason: String,
}

/// A token as listed: never its secret or the secret's hash.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct Token {
    pub id: String,
    pub project: String,
    pub name: String,
    pub rights: Vec<String>,
    pub expires_at_ms: Option<u64>,
    pub issued_by: Option<String>,
    pub issued_at_ms: u64,
    pub revoked: Option<Revocation>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct TokenList {
    pub tokens: Vec<Token>,
    /// There is more: ask again with `page_token` set to this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_page_token: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct Whoami {
    pub token_id: String,
    pub project: String,
    pub project_name: String,
    pub rights: Vec<String>,
    pub expires_at_ms: Option<u64>,
}

// ---- sandboxes ----

/// How a sandbox's processes are scheduled on its edge's CPUs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
#[serde(rename_all = "kebab-case")]
pub enum CpuClass {
    /// Its CPU quota at normal priority and, where the kernel has core scheduling, no
    /// other tenant's thread on its cores' SMT siblings. The default.
    #[default]
    LatencySensitive,
    /// Runs under SCHED_IDLE with the least CPU weight: only on CPU time other sandboxes
    /// leave, never beyond its own quota (batch work, background evaluation).
    BestEffort,
}

impl CpuClass {
    pub fn is_default(&self) -> bool {
        *self == CpuClass::LatencySensitive
    }
}

/// How a sandbox is isolated from its host.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum Isolation {
    /// Namespaces and cgroups under the host's kernel (crun/runc). Pause freezes it; its
    /// snapshots and forks carry its file system.
    #[default]
    Container,
    /// A QEMU microVM with a kernel of its own. Pause snapshots it and ends its VMM;
    /// its snapshots and forks carry its memory, device state and disk.
    Microvm,
    /// A full VM: a QEMU q35 PC whose firmware (SeaBIOS) boots the image as a whole disk
    /// through its bootloader, for software that needs a whole machine. Pause, snapshots
    /// and forks carry its memory, device state and disk, as a microVM's.
    Vm,
}

impl Isolation {
    pub fn as_str(self) -> &'static str {
        match self {
            Isolation::Container => "container",
            Isolation::Microvm => "microvm",
            Isolation::Vm => "vm",
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateSandbox {
    /// The caller's own project when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project: Option<String>,
    pub image: String,
    /// Default 1000.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_millis: Option<u64>,
    /// Default 512.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mb: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
    /// The environment of every process in it (at most 256 variables, 256 KiB). Views
    /// show the names only; the values leave the state when the sandbox ends. With the
    /// labels, it counts against the project's `metadata_bytes` quota.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<BTreeMap<String, String>>,
    /// Lifetime from creation; absent or 0: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<u64>,
    /// `container` (the default), `microvm` or `vm` (a full VM). A sandbox started from a
    /// microVM's or full VM's snapshot (`image` = the snapshot id) is that machine again,
    /// of its source's size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub isolation: Option<Isolation>,
    /// `latency-sensitive` (the default) or `best-effort` (SCHED_IDLE, least CPU weight).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_class: Option<CpuClass>,
    /// While paused, the next request to its agent (`/v1/sandboxes/{id}/agent/...`, or
    /// E2B's traffic path) resumes it first. Default true; with false such a request gets
    /// a 409 saying how to resume it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auto_resume: Option<bool>,
    /// At its timeout it pauses instead of ending. Default false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auto_pause: Option<bool>,
    /// With `auto_pause`: that pause keeps only its file system (its processes end; its
    /// resume boots it again). Containers only. Default false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auto_pause_filesystem: Option<bool>,
    /// What it may reach. Absent: its project's default policy, which is deny (nothing at
    /// all) unless the project's owner set another.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkPolicy>,
}

// ---- network: types/network.rs ----
mod network;
pub use network::*;

// ---- snapshots ----

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateSnapshot {
    /// A name to find it by (up to 63 characters); none when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// A sandbox captured on its edge: a container's file system, or a microVM's memory,
/// device state and disk. Start sandboxes from it with `image` = its id.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct Snapshot {
    pub id: String,
    pub sandbox: String,
    pub project: String,
    pub edge: String,
    pub name: String,
    pub image: String,
    /// The snapshot beneath it (file-system snapshots of sandboxes started from one).
    pub parent: Option<String>,
    /// Of a container (its file system) or of a microVM (memory, device state, disk).
    pub isolation: Isolation,
    /// pending, ready or failed.
    pub state: String,
    pub size_bytes: u64,
    pub reason: Option<String>,
    pub created_at_ms: u64,
    pub index: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct SnapshotWritten {
    pub index: u64,
    pub snapshot: Snapshot,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct SnapshotList {
    pub snapshots: Vec<Snapshot>,
    /// There is more: ask again with `page_token` set to this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_page_token: Option<String>,
}

// ---- images: types/images.rs ----
mod images;
pub use images::*;

// ---- tasks ----

/// The answer to a task pause or resume.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct TaskWritten {
    pub index: u64,
    pub task: String,
    /// The sandboxes this call asked to pause (or resume); the others were there already.
    pub changed: Vec<String>,
    /// Every live sandbox of the task in the caller's subtree, as of the write.
    pub sandboxes: Vec<Sandbox>,
}

// ---- edges ----

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RegisterEdge {
    /// The edge's name (a-z, 0-9, '-', '_', '.').
    pub edge: String,
    /// host:port of its API.
    pub address: String,
    pub capacity: Resources,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct Edge {
    pub id: String,
    pub ordinal: u32,
    pub address: String,
    pub capacity: Resources,
    pub assigned: Resources,
    pub labels: BTreeMap<String, String>,
    pub registered_at_ms: u64,
    pub deregistered: bool,
    /// The last heartbeat this node holds (soft state, not logged), if any.
    pub heartbeat: Option<Heartbeat>,
}

/// What an edge last reported about itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct Heartbeat {
    pub at_ms: u64,
    pub running_sandboxes: u64,
    pub cpu_millis_used: u64,
    pub memory_mb_used: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct EdgeList {
    pub edges: Vec<Edge>,
    /// There is more: ask again with `page_token` set to this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_page_token: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct EdgeWritten {
    pub index: u64,
    pub edge: Edge,
}

// ---- audit ----

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct AuditRecord {
    pub index: u64,
    pub time_ms: u64,
    /// `token:<id>` or `system:`.
    pub principal: String,
    pub project: String,
    pub action: String,
    pub target: String,
    /// ok, denied (refused when decided) or rejected (lost a race when applied).
    pub result: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    pub request_id: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct AuditPage {
    pub records: Vec<AuditRecord>,
    /// Pass as `after` to get the next page; absent on the last page.
    pub next: Option<u64>,
}

// ---- replay ----

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct Change {
    /// JSON pointer into the view(s), e.g. `/sandboxes/sandboxes/<id>/desired`.
    pub path: String,
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    pub before: Option<serde_json::Value>,
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    pub after: Option<serde_json::Value>,
}

/// The views as they were at `index`, or (with `diff_from`) what changed since then.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct Replay {
    /// The log index the replay reached.
    pub index: u64,
    /// The leader time of the last batch folded in.
    pub time_ms: u64,
    /// With `diff_from`: the index the diff starts from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_index: Option<u64>,
    /// Without `diff_from`: view name -> its JSON.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    pub views: Option<BTreeMap<String, serde_json::Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub changes: Option<Vec<Change>>,
}

// ---- cluster ----

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct ClusterStatus {
    pub node_id: u64,
    pub leader_id: Option<u64>,
    pub is_leader: bool,
    pub term: u64,
    pub last_log_index: u64,
    pub applied_index: u64,
    pub first_available_index: u64,
    /// Node id -> Raft address.
    pub members: BTreeMap<u64, String>,
    /// The members that vote (the others are learners catching up).
    pub voters: Vec<u64>,
    /// SHA-256 of the applied state: equal on nodes at the same index.
    pub state_hash: String,
}

/// What a certificate rotation did on one control node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct RotatedNode {
    pub node_id: u64,
    /// When the node's new certificate expires (ms since the epoch), if it was rotated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_after_ms: Option<u64>,
    /// Why it was not, if it was not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The result of `POST /v1/cluster/certificates/rotate`: every member, and what edges do.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct CertificateRotation {
    pub nodes: Vec<RotatedNode>,
    /// Edges renew their own certificates when they hear of the rotation (their next
    /// heartbeat, within seconds).
    pub edges: String,
}

/// How long the live views keep what has ended; older entries stay in the log's archive
/// (replay and time travel read them). Every setting is optional when set: one left out
/// keeps its value.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Retention {
    /// How long an ended sandbox stays in the sandbox views and lists after it ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_sandboxes_seconds: Option<u64>,
    /// How long the audit view keeps a record (at least the 15 minutes retries need).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audit_seconds: Option<u64>,
    /// The most records the audit view keeps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audit_records: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct AddMember {
    pub id: u64,
    /// host:port of the node's Raft service.
    pub addr: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct Health {
    pub status: String,
}

/// A list the API answers in pages (`limit`, `page_token`, `next_page_token`).
pub trait Paged: Sized {
    /// The token of the page after this one, taken out.
    fn take_next(&mut self) -> Option<String>;
    /// Adds a later page's items.
    fn extend(&mut self, later: Self);
}

macro_rules! paged {
    ($($list:ident . $items:ident),*) => {$(
        impl Paged for $list {
            fn take_next(&mut self) -> Option<String> {
                self.next_page_token.take()
            }
            fn extend(&mut self, later: Self) {
                self.$items.extend(later.$items);
                self.next_page_token = later.next_page_token;
            }
        }
    )*};
}
paged!(
    ProjectList.projects,
    TokenList.tokens,
    SandboxList.sandboxes,
    SnapshotList.snapshots,
    ImageList.images,
    EdgeList.edges
);
