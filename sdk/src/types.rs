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
    /// What it may reach. Absent: its project's default policy, which is deny (nothing at
    /// all) unless the project's owner set another.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkPolicy>,
}

// ---- network ----

/// A sandbox's egress policy. Nothing is allowed unless a rule or
/// `allow_internet_access` allows it; an allow beats a deny; the public internet never
/// includes private, loopback, link-local or metadata addresses (169.254.169.254): only
/// a CIDR rule inside those names them, and only under a project ceiling of `any`.
/// Names are resolved by the edge's DNS proxy, which answers only the names the policy
/// allows.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct NetworkPolicy {
    /// The public internet, on every port.
    #[serde(default)]
    pub allow_internet_access: bool,
    /// Rules, each a string (`pkgs.example.com`, `*.example.com:443`, `10.1.0.0/16`,
    /// `[2001:db8::1]:53`) or an object `{"to": TARGET, "ports": [443, "8000-8100"],
    /// "protocol": "tcp" | "udp" | "any"}`; at most 256 rules in all.
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(value_type = Vec<Object>))]
    pub allow_out: Vec<serde_json::Value>,
    /// Rules as in `allow_out`, taking away from `allow_internet_access`.
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(value_type = Vec<Object>))]
    pub deny_out: Vec<serde_json::Value>,
    /// Resolvers the sandbox may query directly (DNS to any other address is dropped;
    /// the edge's DNS proxy is always reachable).
    #[serde(default)]
    pub dns_servers: Vec<String>,
    /// An upstream proxy that the sandbox's allowed TCP goes through (for sites whose only
    /// way out is a proxy): `{"address": "[socks5://|http://]host:port", "username",
    /// "password", "tls": {"enabled": true, "server_name", "ca_cert"}}`. Shown without
    /// its password and CA certificate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    pub egress_proxy: Option<serde_json::Value>,
}

impl NetworkPolicy {
    /// Allows nothing: the default.
    pub fn is_deny(&self) -> bool {
        *self == NetworkPolicy::default()
    }
}

/// A project's write rates (writes a second): all its subtree's tokens together, and each
/// token alone. Absent: none of its own (a parent's still holds).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RateLimits {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub writes_per_second: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_writes_per_second: Option<u64>,
}

/// A project's own rates and those in force (the least on its line). A write over them
/// gets 429 with `Retry-After` and is not logged.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct ProjectRates {
    pub project: String,
    pub own: RateLimits,
    pub effective: RateLimits,
}

/// A project's network settings: the most its sandboxes may be allowed, and the policy
/// of those that name none.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ProjectNetwork {
    /// `none` (no egress), `public` (the public internet: the default) or `any` (also
    /// private networks that a rule names); never above the parent project's.
    pub ceiling: String,
    /// The policy of the project's sandboxes that name none (absent: deny), inherited by
    /// its sub-projects that set none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_network: Option<NetworkPolicy>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct Sandbox {
    pub id: String,
    pub project: String,
    pub edge: String,
    pub image: String,
    pub cpu_millis: u64,
    pub memory_mb: u64,
    pub labels: BTreeMap<String, String>,
    pub expires_at_ms: Option<u64>,
    pub fork_of: Option<String>,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
    /// One word for desired and observed together: pending, running, pausing, paused,
    /// resuming, killed, failed or exited.
    pub state: String,
    /// What was asked: running, paused or killed.
    pub desired: String,
    /// What the edge last reported: pending, ready, paused, failed or exited.
    pub observed: String,
    pub exit_code: Option<i32>,
    /// It ended because the OOM killer ended its init.
    pub oom_killed: bool,
    pub reason: Option<String>,
    /// Processes the OOM killer ended inside it while it lived on (as in a VM, one
    /// process's OOM does not end the sandbox).
    #[serde(default)]
    pub oom_kills: u64,
    /// The program of the last of them, when its edge could tell.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_oom_command: Option<String>,
    /// How its processes are scheduled.
    #[serde(default, skip_serializing_if = "CpuClass::is_default")]
    pub cpu_class: CpuClass,
    /// False once it has ended and given its quota back.
    pub live: bool,
    /// While paused, the next call to it resumes it (else the call gets a 409).
    #[serde(default)]
    pub auto_resume: bool,
    /// Log index of the last change.
    pub index: u64,
    pub isolation: Isolation,
    /// The snapshot it started from.
    #[serde(default)]
    pub snapshot: Option<String>,
    /// The edge that held the state it started from (its fork source's or its snapshot's);
    /// when not `edge`, its edge pulled that state from there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_edge: Option<String>,
    /// How a VM sandbox runs, as its edge reported it ready (absent for containers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<SandboxRuntime>,
    /// What it may reach (see `NetworkPolicy`); all empty: nothing.
    #[serde(default)]
    pub network: NetworkPolicy,
}

/// How an edge runs a VM sandbox.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct SandboxRuntime {
    /// The VMM: `qemu` or `firecracker`.
    pub vmm: String,
    /// What the guest runs under: `kvm` (hardware speed) or `tcg` (QEMU's emulation, on
    /// hosts where KVM is not usable).
    pub accelerator: String,
}

/// One sample of a sandbox's resources, taken by its edge.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct SandboxMetrics {
    pub cpu_count: u64,
    /// CPU used over the 100 ms sample, in percent of `cpu_count` CPUs.
    pub cpu_used_pct: f64,
    pub mem_used: u64,
    pub mem_total: u64,
    pub mem_cache: u64,
    pub disk_used: u64,
    pub disk_total: u64,
    /// Processes the OOM killer ended inside a container sandbox, which lived on (0 for
    /// a VM).
    #[serde(default)]
    pub oom_kills: u64,
    /// A VM's VMM (`qemu`, `firecracker`); absent for a container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vmm: Option<String>,
    /// What a VM's guest runs under (`kvm`, `tcg`); absent for a container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accelerator: Option<String>,
    /// A container's traffic since it started, and what its policy refused; absent for a
    /// sandbox without a network of its own (a VM, or on an edge without sandbox networking).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkMetrics>,
}

/// A sandbox's traffic through its own link, and its drops.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct NetworkMetrics {
    /// Received by the sandbox.
    pub in_bytes: u64,
    pub in_packets: u64,
    /// Sent by the sandbox (what its policy dropped included).
    pub out_bytes: u64,
    pub out_packets: u64,
    /// Packets its policy dropped.
    pub dropped_packets: u64,
    /// The last connections its policy refused (sampled: at most 5 a second), oldest first.
    #[serde(default)]
    pub recent_drops: Vec<DroppedConnection>,
}

/// A connection a sandbox's policy refused.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct DroppedConnection {
    /// When (ms since the Unix epoch).
    pub at_ms: u64,
    /// `tcp`, `udp`, `icmp`, ...
    pub protocol: String,
    pub destination: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// `deny_out` (a deny rule dropped it) or `default` (no rule allowed it).
    pub rule: String,
    /// Packets logged for it (a connection's retries within 5 s count here).
    #[serde(default)]
    pub packets: u32,
}

/// One point of a sandbox's metrics history: its edge samples each running sandbox
/// every 5 s and keeps the last 8 h in memory.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct MetricsPoint {
    /// When it was taken (ms since the Unix epoch).
    pub timestamp_ms: u64,
    pub cpu_count: u64,
    /// CPU used since the point before, in percent of `cpu_count` CPUs.
    pub cpu_used_pct: f64,
    pub mem_used: u64,
    pub mem_total: u64,
    pub mem_cache: u64,
    pub disk_used: u64,
    pub disk_total: u64,
}

/// A sandbox's metrics history over a range, oldest first.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct MetricsHistory {
    pub points: Vec<MetricsPoint>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct SandboxList {
    pub sandboxes: Vec<Sandbox>,
    /// There is more: ask again with `page_token` set to this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_page_token: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct SandboxWritten {
    pub index: u64,
    pub sandbox: Sandbox,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ForkSandbox {
    /// 1 to 1024 copies.
    pub count: u32,
    /// The edge to place every copy on. Without it the copies go to the source's edge
    /// while it has room, then to other edges; a copy on another edge pulls the source's
    /// state from the source's edge.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub edge: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct Forked {
    pub index: u64,
    pub sandboxes: Vec<Sandbox>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SetTimeout {
    /// From now; 0 removes the timeout.
    pub timeout_seconds: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SetLabels {
    /// Replaces every label.
    pub labels: BTreeMap<String, String>,
}

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

// ---- images ----

/// `POST /v1/images`: register an image and have an edge pull it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PullImage {
    /// An OCI reference: `[registry[:port]/]repository[:tag][@sha256:digest]`. Without a
    /// registry, Docker Hub; a registry on loopback is spoken to over plain HTTP.
    pub reference: String,
    /// The name sandboxes start it by (default: the reference as given).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The project it belongs to (default: the token's); its descendants use it too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project: Option<String>,
    /// The edge that pulls it (default: one chosen).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub edge: Option<String>,
}

/// `POST /v1/image-pushes`: push an image to an OCI registry.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PushImage {
    /// The image to push: one the caller's sandboxes can start from (pulled, imported,
    /// packed, or a built-in one).
    pub image: String,
    /// Where to: `registry[:port]/repository[:tag]` (a registry on loopback is spoken to
    /// over plain HTTP; credentials and other plain-HTTP registries are the edges').
    pub reference: String,
    /// An id of the caller's choosing (1 to 64 letters, digits, `-` and `_`; a random one)
    /// under which the push's progress can be read while it runs
    /// (`GET /v1/image-pushes/{id}?image=`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
}

/// A push's progress while it runs: its layers are written, then sent.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct ImagePushProgress {
    pub layers_done: u64,
    pub layers_total: u64,
    /// Compressed bytes sent (or found at the registry already) and in all, as the layers
    /// are written.
    pub bytes_done: u64,
    pub bytes_total: u64,
    /// The current step, for people.
    pub current: String,
}

/// What a push wrote.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct ImagePushed {
    pub image: String,
    /// The reference pushed to, canonical.
    pub reference: String,
    /// The manifest's digest: `reference@digest` pulls exactly this image.
    pub digest: String,
    pub layers: u64,
    /// The compressed layers' size.
    pub bytes: u64,
    /// The edge that pushed it.
    pub edge: String,
}

/// `POST /v1/sandboxes/{id}/pack`: make an image of a container sandbox's file system (its
/// writable layer on top of its image), made and kept by the sandbox's edge.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PackSandbox {
    /// The name sandboxes (and E2B templates) start it by, in the sandbox's project.
    pub name: String,
    /// Absolute paths to leave out (a file, or a directory with all it holds), beside the
    /// residue every pack leaves out: the agent's files, what `/tmp`, `/var/tmp` and `/run`
    /// hold, shell histories, caches. At most 64.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub scrub: Vec<String>,
}

/// How far a pull has come, as its edge last said (soft state, not logged).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct PullProgress {
    pub layers_total: u32,
    pub layers_done: u32,
    pub bytes_total: u64,
    pub bytes_done: u64,
    /// What the edge is doing now.
    pub phase: String,
    pub started_ms: u64,
}

/// A registered image.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct Image {
    pub name: String,
    pub project: String,
    /// Where it is pulled from ("" for a packed or imported image).
    pub reference: String,
    /// The edge that pulls (or packs, or imports) it. A packed or imported image starts
    /// only there.
    pub edge: String,
    /// The sandbox it was packed from (absent for a pulled image).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_sandbox: Option<String>,
    /// Imported from a tarball uploaded to its edge (absent when not).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub imported: bool,
    /// The paths its pack was asked to leave out (absent when none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub scrub: Vec<String>,
    /// pending, ready or failed.
    pub state: String,
    /// The manifest's digest, once pulled (a packed image's: its edge's image record's).
    pub digest: Option<String>,
    pub size_bytes: u64,
    pub layers: u32,
    pub reason: Option<String>,
    pub created_at_ms: u64,
    pub index: u64,
    /// While pending: how far its edge has come.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<PullProgress>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct ImageWritten {
    pub index: u64,
    pub image: Image,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct ImageList {
    pub images: Vec<Image>,
    /// There is more: ask again with `page_token` set to this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_page_token: Option<String>,
}

/// What one edge's image store gave back to `POST /v1/image-store/prune`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct EdgePruned {
    pub edge: String,
    /// Layers, VM disks and scratch entries removed (0 when the edge failed).
    pub layers: u64,
    pub disks: u64,
    pub scratch: u64,
    /// Bytes of the files removed (apparent sizes).
    pub bytes: u64,
    /// Why this edge pruned nothing (unreachable, or its store refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The answer to `POST /v1/image-store/prune`: every registered edge's.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct Pruned {
    pub edges: Vec<EdgePruned>,
}

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
