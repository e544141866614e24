//! Network: a sandbox's egress policy and upstream proxy, and a project's ceiling and
//! default policy.

use super::*;

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
    /// At its timeout it pauses instead of ending (`auto_pause`), keeping only its file
    /// system (`auto_pause_filesystem`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub auto_pause: bool,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub auto_pause_filesystem: bool,
    /// Its pause keeps only its file system: paused, its processes are gone; its resume
    /// boots it again.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pause_filesystem: bool,
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

/// `POST /v1/sandboxes/{id}/pause` (the body may be left out: everything is kept).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PauseSandbox {
    /// Keep only the file system: the sandbox's processes end and their memory is given
    /// back; its resume boots it again from that file system (containers only).
    #[serde(default)]
    pub filesystem: bool,
}

/// `POST /v1/sandboxes/{id}/resume` (the body may be left out: where it was).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ResumeSandbox {
    /// Boot it again from its file system, dropping the memory its pause kept
    /// (containers only).
    #[serde(default)]
    pub cold: bool,
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
