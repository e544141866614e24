//! The view types: what each projection holds. Plain data, ordered maps only, so
//! that serialising a view is deterministic byte for byte.

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// A right a token can hold. Rights apply within the token's project subtree.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Right {
    #[serde(rename = "project:write")]
    ProjectWrite,
    #[serde(rename = "quota:write")]
    QuotaWrite,
    #[serde(rename = "token:write")]
    TokenWrite,
    #[serde(rename = "sandbox:write")]
    SandboxWrite,
    #[serde(rename = "sandbox:read")]
    SandboxRead,
    #[serde(rename = "edge:write")]
    EdgeWrite,
    #[serde(rename = "audit:read")]
    AuditRead,
    #[serde(rename = "cluster:admin")]
    ClusterAdmin,
}

impl Right {
    pub const ALL: [Right; 8] = [
        Right::ProjectWrite,
        Right::QuotaWrite,
        Right::TokenWrite,
        Right::SandboxWrite,
        Right::SandboxRead,
        Right::EdgeWrite,
        Right::AuditRead,
        Right::ClusterAdmin,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Right::ProjectWrite => "project:write",
            Right::QuotaWrite => "quota:write",
            Right::TokenWrite => "token:write",
            Right::SandboxWrite => "sandbox:write",
            Right::SandboxRead => "sandbox:read",
            Right::EdgeWrite => "edge:write",
            Right::AuditRead => "audit:read",
            Right::ClusterAdmin => "cluster:admin",
        }
    }

    pub fn parse(s: &str) -> Option<Right> {
        Right::ALL.into_iter().find(|r| r.as_str() == s)
    }
}

/// Resource amounts in use or reserved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub sandboxes: u64,
    pub cpu_millis: u64,
    pub memory_mb: u64,
    /// Bytes of environment variables and labels (names and values) that live sandboxes
    /// hold in every node's state: a quota can bound them like any other resource.
    /// Derived from the sandboxes, so left out of the state's encoding (and its hash,
    /// which old logs keep) and counted again when a state is read back.
    #[serde(skip)]
    pub metadata_bytes: u64,
}

/// The quota's resources, as the API, errors and events name them.
pub const RESOURCES: [&str; 4] = ["sandboxes", "cpu_millis", "memory_mb", "metadata_bytes"];

impl Usage {
    /// The amount of resource `name` (one of [`RESOURCES`]).
    pub fn get(&self, name: &str) -> u64 {
        match name {
            "sandboxes" => self.sandboxes,
            "cpu_millis" => self.cpu_millis,
            "memory_mb" => self.memory_mb,
            "metadata_bytes" => self.metadata_bytes,
            _ => 0,
        }
    }
    pub fn add(&mut self, o: &Usage) {
        self.sandboxes += o.sandboxes;
        self.cpu_millis += o.cpu_millis;
        self.memory_mb += o.memory_mb;
        self.metadata_bytes += o.metadata_bytes;
    }
    pub fn sub(&mut self, o: &Usage) {
        self.sandboxes = self.sandboxes.saturating_sub(o.sandboxes);
        self.cpu_millis = self.cpu_millis.saturating_sub(o.cpu_millis);
        self.memory_mb = self.memory_mb.saturating_sub(o.memory_mb);
        self.metadata_bytes = self.metadata_bytes.saturating_sub(o.metadata_bytes);
    }
    pub fn plus(mut self, o: &Usage) -> Usage {
        self.add(o);
        self
    }
    /// `n` times this.
    pub fn times(&self, n: u64) -> Usage {
        Usage {
            sandboxes: self.sandboxes * n,
            cpu_millis: self.cpu_millis * n,
            memory_mb: self.memory_mb * n,
            metadata_bytes: self.metadata_bytes * n,
        }
    }
}

/// What a sandbox's environment and labels weigh against [`Usage::metadata_bytes`]:
/// every name and value, in bytes.
pub fn metadata_bytes(env: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> u64 {
    env.iter()
        .chain(labels.iter())
        .map(|(k, v)| (k.len() + v.len()) as u64)
        .sum()
}

/// What replacing labels `old` with `new` adds to a sandbox's usage (nothing when they
/// shrink: the fold gives the difference back).
pub fn labels_growth(old: &BTreeMap<String, String>, new: &BTreeMap<String, String>) -> Usage {
    let none = BTreeMap::new();
    Usage {
        metadata_bytes: metadata_bytes(&none, new).saturating_sub(metadata_bytes(&none, old)),
        ..Usage::default()
    }
}

/// Quota limits; `None` means "no limit of its own" (the ancestors' still apply).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    pub sandboxes: Option<u64>,
    pub cpu_millis: Option<u64>,
    pub memory_mb: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata_bytes: Option<u64>,
}

impl Limits {
    /// The limit on resource `name` (one of [`RESOURCES`]).
    pub fn get(&self, name: &str) -> Option<u64> {
        match name {
            "sandboxes" => self.sandboxes,
            "cpu_millis" => self.cpu_millis,
            "memory_mb" => self.memory_mb,
            "metadata_bytes" => self.metadata_bytes,
            _ => None,
        }
    }

    /// The first resource of `usage` over these limits, with its limit.
    pub fn exceeded_by(&self, usage: &Usage) -> Option<(&'static str, u64)> {
        RESOURCES.into_iter().find_map(|name| match self.get(name) {
            Some(l) if usage.get(name) > l => Some((name, l)),
            _ => None,
        })
    }

    /// Resources set here that exceed the corresponding resource of `bound`.
    pub fn exceeds(&self, bound: &Limits) -> Option<(&'static str, u64, u64)> {
        RESOURCES
            .into_iter()
            .find_map(|name| match (self.get(name), bound.get(name)) {
                (Some(m), Some(t)) if m > t => Some((name, m, t)),
                (None, Some(t)) => Some((name, u64::MAX, t)),
                _ => None,
            })
    }

    /// The tighter of two limits, resource by resource.
    pub fn tightest(&self, o: &Limits) -> Limits {
        fn min(a: Option<u64>, b: Option<u64>) -> Option<u64> {
            match (a, b) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, None) => a,
                (None, b) => b,
            }
        }
        Limits {
            sandboxes: min(self.sandboxes, o.sandboxes),
            cpu_millis: min(self.cpu_millis, o.cpu_millis),
            memory_mb: min(self.memory_mb, o.memory_mb),
            metadata_bytes: min(self.metadata_bytes, o.metadata_bytes),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Project {
    pub id: String,
    pub name: String,
    pub parent: Option<String>,
    pub children: BTreeSet<String>,
    pub created_at_ms: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Token {
    pub id: String,
    pub project: String,
    pub name: String,
    pub rights: BTreeSet<Right>,
    /// Hex SHA-256 of the secret. Never shown by the API.
    pub secret_sha256: String,
    pub expires_at_ms: Option<u64>,
    pub issued_by: Option<String>,
    pub issued_at_ms: u64,
    pub revoked: Option<Revocation>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Revocation {
    pub at_ms: u64,
    pub reason: String,
}

/// Projects and principals.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct IamView {
    pub projects: BTreeMap<String, Project>,
    pub tokens: BTreeMap<String, Token>,
}

/// Hierarchical quota: each project's own limits and its subtree's usage.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct QuotaView {
    pub limits: BTreeMap<String, Limits>,
    /// Usage of the project's whole subtree (a sandbox counts against every ancestor).
    pub usage: BTreeMap<String, Usage>,
    /// Egress ceilings and default network policies set by projects' owners.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub network: BTreeMap<String, ProjectNetwork>,
    /// Write rates set on projects (their own; see `State::effective_rates`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub rates: BTreeMap<String, Rates>,
}

/// A project's write rates: all its subtree's tokens together, and each token.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rates {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub writes_per_second: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_writes_per_second: Option<u64>,
}

impl Rates {
    /// The lower of two bounds (`None`: unbounded).
    pub fn min(self, other: Rates) -> Rates {
        let m = |a: Option<u64>, b: Option<u64>| match (a, b) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        Rates {
            writes_per_second: m(self.writes_per_second, other.writes_per_second),
            token_writes_per_second: m(self.token_writes_per_second, other.token_writes_per_second),
        }
    }
}

/// How far a project's sandboxes may reach out, at most. Ordered: a child's ceiling is
/// never above its parent's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Egress {
    /// No egress at all.
    None,
    /// The public internet (never private, loopback, link-local or metadata addresses).
    #[default]
    Public,
    /// The public internet and private networks that a rule names.
    Any,
}

impl Egress {
    pub const ALL: [Egress; 3] = [Egress::None, Egress::Public, Egress::Any];

    pub fn as_str(self) -> &'static str {
        match self {
            Egress::None => "none",
            Egress::Public => "public",
            Egress::Any => "any",
        }
    }

    pub fn parse(s: &str) -> Option<Egress> {
        Egress::ALL.into_iter().find(|e| e.as_str() == s)
    }
}

/// A project's network settings: its ceiling and its sandboxes' default policy (JSON).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProjectNetwork {
    pub ceiling: Egress,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_network: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Edge {
    pub id: String,
    pub ordinal: u32,
    pub address: String,
    pub capacity: Usage,
    pub assigned: Usage,
    pub labels: BTreeMap<String, String>,
    pub registered_at_ms: u64,
    pub deregistered: bool,
    /// The token that registered it, the only one that acts for it (watches its slice,
    /// reports on its sandboxes, heartbeats, registers it again); `None`: registered by
    /// the system, or before edges were bound to their tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
}

impl Edge {
    pub fn free(&self) -> Usage {
        let mut f = self.capacity;
        f.sub(&self.assigned);
        f
    }
}

/// Edges, their capacity and what is assigned to them.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PlacementView {
    pub edges: BTreeMap<String, Edge>,
    pub next_ordinal: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Desired {
    Running,
    Paused,
    Killed,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Observed {
    Pending,
    Ready,
    Paused,
    Failed,
    Exited,
}

/// How a sandbox's processes are scheduled on its edge's CPUs (the DSec paper's §5.2).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CpuClass {
    /// Interactive and RL rollouts: its quota at normal priority and, where the kernel
    /// has core scheduling, no other tenant's thread on its cores' SMT siblings.
    #[default]
    LatencySensitive,
    /// Batch work: runs under SCHED_IDLE with the least CPU weight, only on CPU time
    /// that latency-sensitive sandboxes leave (and never beyond its own quota).
    BestEffort,
}

impl CpuClass {
    pub const ALL: [CpuClass; 2] = [CpuClass::LatencySensitive, CpuClass::BestEffort];

    /// The API's name: `latency-sensitive` or `best-effort`.
    pub fn as_str(self) -> &'static str {
        match self {
            CpuClass::LatencySensitive => "latency-sensitive",
            CpuClass::BestEffort => "best-effort",
        }
    }

    pub fn parse(s: &str) -> Option<CpuClass> {
        CpuClass::ALL.into_iter().find(|c| c.as_str() == s)
    }

    /// An event's field: "" for latency-sensitive (what every event before it meant).
    pub fn to_event(self) -> String {
        match self {
            CpuClass::LatencySensitive => String::new(),
            other => other.as_str().to_string(),
        }
    }

    /// From an event's field; `None` for a name this binary does not know.
    pub fn from_event(s: &str) -> Option<CpuClass> {
        if s.is_empty() {
            Some(CpuClass::LatencySensitive)
        } else {
            CpuClass::parse(s)
        }
    }

    pub fn is_default(&self) -> bool {
        *self == CpuClass::LatencySensitive
    }
}

/// How a sandbox is isolated from its host.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Isolation {
    /// Namespaces, cgroups and seccomp under the host's kernel (crun/runc). Pausing
    /// freezes it; its snapshots are file systems.
    #[default]
    Container,
    /// A QEMU microVM with a kernel of its own. Pausing snapshots it and ends its VMM;
    /// its snapshots and forks carry its memory.
    Microvm,
    /// A full VM (QEMU `q35`): a PC whose firmware boots the image as a whole disk
    /// through its bootloader, for software that needs a whole machine. Pausing,
    /// snapshots and forks carry its memory, as a microVM's do.
    Vm,
}

impl Isolation {
    pub const ALL: [Isolation; 3] = [Isolation::Container, Isolation::Microvm, Isolation::Vm];

    /// The API's name: `container`, `microvm` or `vm`.
    pub fn as_str(self) -> &'static str {
        match self {
            Isolation::Container => "container",
            Isolation::Microvm => "microvm",
            Isolation::Vm => "vm",
        }
    }

    /// A virtual machine (microVM or full VM): its own kernel; pausing snapshots its
    /// memory and ends its VMM; its snapshots and forks carry its memory and stay on its
    /// edge.
    pub fn is_machine(self) -> bool {
        matches!(self, Isolation::Microvm | Isolation::Vm)
    }

    /// What people call it in messages.
    pub fn noun(self) -> &'static str {
        match self {
            Isolation::Container => "container",
            Isolation::Microvm => "microVM",
            Isolation::Vm => "full VM",
        }
    }

    pub fn parse(s: &str) -> Option<Isolation> {
        Isolation::ALL.into_iter().find(|i| i.as_str() == s)
    }

    /// The value an event carries: "" for a container (what every event before this
    /// field meant), the name otherwise.
    pub fn to_event(self) -> String {
        match self {
            Isolation::Container => String::new(),
            other => other.as_str().to_string(),
        }
    }

    /// From an event's field ("" is a container); `None` for a name this binary does not know.
    pub fn from_event(s: &str) -> Option<Isolation> {
        if s.is_empty() {
            Some(Isolation::Container)
        } else {
            Isolation::parse(s)
        }
    }

    pub fn is_container(&self) -> bool {
        *self == Isolation::Container
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
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
    pub desired: Desired,
    pub observed: Observed,
    pub exit_code: Option<i32>,
    pub oom_killed: bool,
    pub reason: Option<String>,
    /// Its quota and edge capacity have been given back.
    pub released: bool,
    /// Log index of the last event that changed it.
    pub index: u64,
    /// Environment of every process in it. Views shown to users carry only the names.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Paused rather than killed at its timeout.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub auto_pause: bool,
    /// Resumed by the next request made to it while paused.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub auto_resume: bool,
    /// The file-system snapshot it started from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<String>,
    /// What it was asked for by (an image name or a snapshot id), when not the image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// Network settings as asked (JSON); stored and reported, not yet enforced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<String>,
    /// A container unless it says otherwise (left out then, so older views read the same).
    #[serde(default, skip_serializing_if = "Isolation::is_container")]
    pub isolation: Isolation,
    /// The client's idempotency key, if it gave one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    /// The edge holding the state it started from (its fork source's, its snapshot's, or
    /// its packed image's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_edge: Option<String>,
    /// When that edge is not its own: the id under which the state was served to its edge.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transfer: Option<String>,
    /// How a VM runs, as its edge last reported it ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<Runtime>,
    /// Processes the kernel's OOM killer ended inside it while it lived on.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub oom_kills: u64,
    /// The program of the last of them, when its edge could tell.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_oom_command: Option<String>,
    /// Latency-sensitive unless asked otherwise (left out then).
    #[serde(default, skip_serializing_if = "CpuClass::is_default")]
    pub cpu_class: CpuClass,
    /// Where its edge fetches its image if the store lacks it (`SandboxCreated.image_source`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_source: Option<String>,
    /// With auto-pause: its pause at its timeout keeps only its file system.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub auto_pause_filesystem: bool,
    /// Its pause keeps only its file system (see [`crate::Lifecycle::filesystem`]): while
    /// paused its processes are gone, and its resume boots it again.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pause_filesystem: bool,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// How an edge runs a VM sandbox.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Runtime {
    /// `qemu` or `firecracker`.
    pub vmm: String,
    /// `kvm` (hardware speed) or `tcg` (QEMU's emulation, where KVM is not usable).
    pub accelerator: String,
}

impl Sandbox {
    pub fn usage(&self) -> Usage {
        Usage {
            sandboxes: 1,
            cpu_millis: self.cpu_millis,
            memory_mb: self.memory_mb,
            metadata_bytes: metadata_bytes(&self.env, &self.labels),
        }
    }
    pub fn is_live(&self) -> bool {
        !self.released
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SnapshotState {
    Pending,
    Ready,
    Failed,
}

/// A sandbox captured on its edge; sandboxes can start from it. A container's snapshot is
/// its file system (a layer); a microVM's is its memory, device state and disk.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    pub id: String,
    pub sandbox: String,
    pub project: String,
    pub edge: String,
    pub name: String,
    /// The image beneath it.
    pub image: String,
    /// The snapshot the sandbox had started from, beneath this one.
    pub parent: Option<String>,
    pub state: SnapshotState,
    pub size_bytes: u64,
    pub reason: Option<String>,
    pub created_at_ms: u64,
    pub index: u64,
    /// Of a container (its file system) unless it says otherwise.
    #[serde(default, skip_serializing_if = "Isolation::is_container")]
    pub isolation: Isolation,
}

/// Snapshots that exist (deleted ones leave only their audit records).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotView {
    pub snapshots: BTreeMap<String, Snapshot>,
}

impl SnapshotView {
    pub fn is_empty(&self) -> bool {
        self.snapshots.is_empty()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ImageState {
    /// Its edge is pulling it.
    Pending,
    Ready,
    Failed,
}

/// An image registered by a project: pulled from a registry by one edge, and fetched by
/// any other edge from the same reference pinned to its digest; or packed by one edge
/// from a sandbox's file system, and then only on that edge. Sandboxes of the project
/// and of its descendants start from it by name.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Image {
    /// A store name (`my-env`) or an OCI reference (`registry:5000/python:3.12-slim`).
    pub name: String,
    pub project: String,
    /// Where it is pulled from ("" for a packed or imported image).
    pub reference: String,
    /// The edge that pulls (or packs) it, and holds it.
    pub edge: String,
    /// The sandbox it was packed from (left out for a pulled image, so older views read
    /// the same).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_sandbox: Option<String>,
    /// What its pack was asked to leave out beside the usual residue (left out when none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub scrub: Vec<String>,
    /// What a packed image's config changes from its parent's (left out when nothing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<ConfigOverride>,
    /// Imported from a tarball uploaded to its edge (left out when not, so older views
    /// read the same).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub imported: bool,
    pub state: ImageState,
    /// The manifest's digest, once pulled.
    pub digest: Option<String>,
    /// What its layers take unpacked.
    pub size_bytes: u64,
    pub layers: u32,
    pub reason: Option<String>,
    pub created_at_ms: u64,
    pub index: u64,
}

impl Image {
    /// What another edge pulls to get exactly this image: the reference pinned to its
    /// digest once known (a tag may move), else the reference itself; "" for a packed or
    /// imported image, which no registry has.
    pub fn source(&self) -> String {
        if self.is_local() {
            return String::new();
        }
        match &self.digest {
            Some(d) => format!("{}@{d}", self.reference.split('@').next().unwrap_or(&self.reference)),
            None => self.reference.clone(),
        }
    }

    /// Whether it was packed from a sandbox (it exists only in its edge's store).
    pub fn is_packed(&self) -> bool {
        self.source_sandbox.is_some()
    }

    /// Whether it exists only in its edge's store (packed, or imported from a tarball):
    /// no registry has it, so creates of it go to that edge.
    pub fn is_local(&self) -> bool {
        self.is_packed() || self.imported
    }
}

/// What a packed image's config changes from the image it was packed on (a template
/// build's ENV, WORKDIR, USER, start and ready commands); "" leaves the parent's.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConfigOverride {
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub workdir: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub user: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub start_cmd: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub ready_cmd: String,
}

impl ConfigOverride {
    pub fn is_empty(&self) -> bool {
        *self == ConfigOverride::default()
    }

    /// From the event's message; `None` when it changes nothing.
    pub fn from_event(m: Option<&crate::pb::ImageConfigOverride>) -> Option<ConfigOverride> {
        let m = m?;
        let c = ConfigOverride {
            env: m.env.clone().into_iter().collect(),
            workdir: m.workdir.clone(),
            user: m.user.clone(),
            start_cmd: m.start_cmd.clone(),
            ready_cmd: m.ready_cmd.clone(),
        };
        (!c.is_empty()).then_some(c)
    }

    /// As the event's message.
    pub fn to_event(&self) -> crate::pb::ImageConfigOverride {
        crate::pb::ImageConfigOverride {
            env: self.env.clone().into_iter().collect(),
            workdir: self.workdir.clone(),
            user: self.user.clone(),
            start_cmd: self.start_cmd.clone(),
            ready_cmd: self.ready_cmd.clone(),
        }
    }
}

/// Registered images (deleted ones leave only their audit records), and the templates
/// built into images (E2B's template builds).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageView {
    pub images: BTreeMap<String, Image>,
    /// By template id; left out when there are none, so older views read the same.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub templates: BTreeMap<String, Template>,
}

impl ImageView {
    pub fn is_empty(&self) -> bool {
        self.images.is_empty() && self.templates.is_empty()
    }

    /// The template named `name` (its name, or its id).
    pub fn template_named(&self, name: &str) -> Option<&Template> {
        self.templates
            .get(name)
            .or_else(|| self.templates.values().find(|t| t.name.as_deref() == Some(name)))
    }
}

/// The tag a template name without one means (E2B's: `my-template` is `my-template:default`).
pub const DEFAULT_TEMPLATE_TAG: &str = "default";

/// A template of a project: a name, builds (each an image packed from a sandbox that ran
/// the build's steps), and tags naming builds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Template {
    pub id: String,
    pub project: String,
    /// Its name (E2B's alias), unique among templates and images.
    pub name: Option<String>,
    /// The size its sandboxes get when a create does not say (0: the defaults).
    pub cpu_count: u32,
    pub memory_mb: u32,
    pub builds: BTreeMap<String, TemplateBuild>,
    /// Tag -> build id.
    pub tags: BTreeMap<String, String>,
    pub created_at_ms: u64,
    pub index: u64,
}

impl Template {
    /// The ready build a reference to this template means: the build `tag` names (the
    /// default tag when none is given, else the newest ready build), if it is ready.
    pub fn build_for(&self, tag: Option<&str>) -> Option<&TemplateBuild> {
        let ready = |id: &String| self.builds.get(id).filter(|b| b.status == BuildStatus::Ready);
        match tag {
            Some(t) => self.tags.get(t).and_then(ready),
            None => self.tags.get(DEFAULT_TEMPLATE_TAG).and_then(ready).or_else(|| {
                self.builds
                    .values()
                    .filter(|b| b.status == BuildStatus::Ready)
                    .max_by_key(|b| (b.finished_at_ms, b.index))
            }),
        }
    }

    /// The tags naming build `id`.
    pub fn tags_of(&self, id: &str) -> Vec<String> {
        self.tags
            .iter()
            .filter(|(_, b)| *b == id)
            .map(|(t, _)| t.clone())
            .collect()
    }
}

/// E2B's build statuses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BuildStatus {
    /// Asked for; its steps have not come yet.
    Waiting,
    Building,
    Ready,
    Error,
}

/// One build of a template.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateBuild {
    pub id: String,
    pub status: BuildStatus,
    /// The tags it takes once ready.
    pub tags: Vec<String>,
    /// The image it makes (named once its steps are given).
    pub image: Option<String>,
    /// What it starts from (an image or another template).
    pub from: Option<String>,
    pub start_cmd: Option<String>,
    pub ready_cmd: Option<String>,
    pub steps: u32,
    /// Who runs its steps: `<control node id>/<that gateway process's run id>`.
    pub runner: String,
    pub error: Option<String>,
    /// Where it failed, as E2B's SDK reads it (`base`, `finalize` or a step number).
    pub error_step: Option<String>,
    pub created_at_ms: u64,
    pub finished_at_ms: u64,
    pub index: u64,
}

/// The edge ordinal encoded in a sandbox id (its last 4 hex digits: the ordinal's low 16
/// bits), if it is one: routing to a sandbox's edge needs no lookup (invariant 4), even
/// once the sandbox has ended and left the views.
pub fn edge_ordinal_of(sandbox_id: &str) -> Option<u32> {
    if sandbox_id.len() != 20 || !sandbox_id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u32::from_str_radix(&sandbox_id[16..], 16).ok()
}

/// Every sandbox, with its desired and observed state.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SandboxView {
    pub sandboxes: BTreeMap<String, Sandbox>,
}

impl SandboxView {
    /// The live sandbox of `project` created with idempotency key `key`.
    pub fn by_idempotency_key(&self, project: &str, key: &str) -> Option<&Sandbox> {
        self.sandboxes
            .values()
            .find(|s| s.is_live() && s.project == project && s.idempotency_key.as_deref() == Some(key))
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum AuditResult {
    /// Decided and applied.
    Ok,
    /// Refused when decided (rights, quota, conflict).
    Denied { code: String, message: String },
    /// Decided, but found conflicting when applied (it lost a race).
    Rejected { message: String },
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditRecord {
    pub index: u64,
    pub time_ms: u64,
    pub principal: String,
    pub project: String,
    pub action: String,
    pub target: String,
    #[serde(flatten)]
    pub result: AuditResult,
    pub request_id: String,
}

/// Who did what, when, to what, with what result: one record per logged command.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct AuditView {
    pub records: Vec<AuditRecord>,
    /// Records before this index were taken by retention (0: none).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub swept_before: u64,
}

/// A filter over the audit view. Every field narrows; `None` matches all.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct AuditQuery {
    pub principal: Option<String>,
    pub project: Option<String>,
    pub action: Option<String>,
    pub target: Option<String>,
    pub since_ms: Option<u64>,
    pub until_ms: Option<u64>,
    /// Only records with an index greater than this (pagination cursor).
    pub after_index: Option<u64>,
    pub limit: usize,
}

impl AuditView {
    /// Where the records begin once retention has taken older ones: before this index,
    /// what became of a batch is no longer known here (`None`: nothing was taken).
    pub fn first_index(&self) -> Option<u64> {
        (self.swept_before > 0).then_some(self.swept_before)
    }

    /// What became of the batch at `index`, if it is recorded here.
    pub fn result_at(&self, index: u64) -> Option<&AuditResult> {
        let at = self.records.partition_point(|r| r.index < index);
        self.records.get(at).filter(|r| r.index == index).map(|r| &r.result)
    }

    /// Records matching `q` in log order, at most `q.limit`, and the cursor for the next page.
    pub fn query(&self, q: &AuditQuery) -> (Vec<&AuditRecord>, Option<u64>) {
        let start = match q.after_index {
            Some(after) => self.records.partition_point(|r| r.index <= after),
            None => 0,
        };
        let limit = q.limit.max(1);
        let mut out = Vec::new();
        let mut next = None;
        for r in &self.records[start..] {
            let keep = q.principal.as_deref().is_none_or(|p| r.principal == p)
                && q.project.as_deref().is_none_or(|p| r.project == p)
                && q.action.as_deref().is_none_or(|a| r.action == a)
                && q.target.as_deref().is_none_or(|t| r.target == t)
                && q.since_ms.is_none_or(|s| r.time_ms >= s)
                && q.until_ms.is_none_or(|u| r.time_ms <= u);
            if keep {
                if out.len() == limit {
                    next = out.last().map(|l: &&AuditRecord| l.index);
                    break;
                }
                out.push(r);
            }
        }
        (out, next)
    }
}
