//! The sandboxes placed on this edge, as its slice says: what should run, and what the
//! control plane has recorded of them.

use opendsec_edge_api::UnknownEnum;
use opendsec_edge_api::convert::{decode_cpu_class, decode_desired, decode_isolation, decode_observed};
use opendsec_edge_api::pb::SliceSandbox;
use opendsec_projections::{CpuClass, Desired, Event, Isolation, Lifecycle, Observed};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DesiredSandbox {
    pub id: String,
    pub project: String,
    pub image: String,
    pub cpu_millis: u64,
    pub memory_mb: u64,
    pub labels: BTreeMap<String, String>,
    pub expires_at_ms: Option<u64>,
    pub fork_of: Option<String>,
    pub desired: Desired,
    /// What the log says this edge last reported.
    pub observed: Observed,
    /// Why it was killed ("user", "timeout"), once it was.
    pub kill_reason: Option<String>,
    /// Environment of every process in it.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Paused instead of stopped at its timeout.
    #[serde(default)]
    pub auto_pause: bool,
    /// That pause keeps only its file system.
    #[serde(default)]
    pub auto_pause_filesystem: bool,
    /// Its pause keeps only its file system: paused, its processes are gone; resumed, it
    /// boots again (the lifecycle's `filesystem`).
    #[serde(default)]
    pub pause_filesystem: bool,
    /// The snapshot it starts from (a file system, or a microVM's memory and disk).
    #[serde(default)]
    pub snapshot: Option<String>,
    /// A container or a microVM.
    #[serde(default)]
    pub isolation: Isolation,
    /// The edge holding the state it starts from (its fork source's, or its snapshot's).
    #[serde(default)]
    pub source_edge: Option<String>,
    /// When that edge is another one: the transfer to pull the state by.
    #[serde(default)]
    pub transfer: Option<String>,
    /// OOM kills inside it that the log records (the edge reports when it sees more).
    #[serde(default)]
    pub oom_kills: u64,
    /// How its processes are scheduled.
    #[serde(default)]
    pub cpu_class: CpuClass,
    /// Where to fetch its image when the store lacks it (a registered image's pinned
    /// reference); none for built-in images and references pulled by their own name.
    #[serde(default)]
    pub image_source: Option<String>,
    /// Its network policy as logged (JSON, `SandboxCreated.network`, replaced whole by
    /// each `SandboxNetworkSet`); `None`: the default, deny. Enforced by `crate::net`.
    #[serde(default)]
    pub network: Option<String>,
}

impl DesiredSandbox {
    /// The log already records an end for it: nothing more to report.
    pub fn is_terminal(&self) -> bool {
        self.lifecycle().has_ended()
    }

    fn lifecycle(&self) -> Lifecycle {
        Lifecycle {
            desired: self.desired,
            observed: self.observed,
            expires_at_ms: self.expires_at_ms,
            filesystem: self.pause_filesystem,
        }
    }

    /// Moves it along its lifecycle by `ev` (when `ev` is a transition of it).
    pub(super) fn advance(&mut self, ev: &Event) {
        if let Some(next) = self.lifecycle().next(ev) {
            self.desired = next.desired;
            self.observed = next.observed;
            self.expires_at_ms = next.expires_at_ms;
            self.pause_filesystem = next.filesystem;
        }
    }

    pub(super) fn from_snapshot(s: &SliceSandbox) -> Result<DesiredSandbox, UnknownEnum> {
        Ok(DesiredSandbox {
            id: s.id.clone(),
            project: s.project.clone(),
            image: s.image.clone(),
            cpu_millis: s.cpu_millis,
            memory_mb: s.memory_mb,
            labels: s.labels.clone(),
            expires_at_ms: (s.expires_at_ms != 0).then_some(s.expires_at_ms),
            fork_of: (!s.fork_of.is_empty()).then(|| s.fork_of.clone()),
            desired: decode_desired(s.desired)?,
            observed: decode_observed(s.observed)?,
            kill_reason: None,
            env: s.env.clone(),
            auto_pause: s.auto_pause,
            auto_pause_filesystem: s.auto_pause_filesystem,
            pause_filesystem: s.pause_filesystem,
            snapshot: (!s.snapshot.is_empty()).then(|| s.snapshot.clone()),
            isolation: decode_isolation(s.isolation)?,
            source_edge: (!s.source_edge.is_empty()).then(|| s.source_edge.clone()),
            transfer: (!s.transfer.is_empty()).then(|| s.transfer.clone()),
            oom_kills: s.oom_kills,
            cpu_class: decode_cpu_class(s.cpu_class)?,
            image_source: (!s.image_source.is_empty()).then(|| s.image_source.clone()),
            network: (!s.network.is_empty()).then(|| s.network.clone()),
        })
    }
}
