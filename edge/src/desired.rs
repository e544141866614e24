//! The edge's slice of the log, folded into what should run on this machine.
//!
//! `SliceState` is the edge's intent: every sandbox placed here, its desired state, and
//! the observed state the control plane has recorded (from this edge's own reports).
//! It is rebuilt from slice messages alone (entries, or a snapshot when history is gone)
//! and carries the index to resume the watch from, so it can be persisted and reloaded.

use opendsec_control::pb::{SliceMessage, slice_message::Body};
use opendsec_projections::{Desired, Event, Isolation, Observed};
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
}

/// What a served transfer carries.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TransferSource {
    /// A fork snapshot of this sandbox, taken when the fork is served.
    Fork { sandbox: String },
    /// A stored snapshot of this edge.
    Snapshot { snapshot: String },
}

/// State this edge holds that sandboxes of other edges start from: it prepares and
/// serves it until every copy's edge has pulled it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServedTransfer {
    pub id: String,
    pub source: TransferSource,
    pub isolation: Isolation,
    /// Sandbox -> the edge it is placed on (which pulls the state).
    pub destinations: BTreeMap<String, String>,
    /// Sandboxes whose edge said it has pulled the state.
    #[serde(default)]
    pub pulled: std::collections::BTreeSet<String>,
}

impl ServedTransfer {
    /// Some sandbox's edge has yet to pull it.
    pub fn is_wanted(&self) -> bool {
        self.destinations.keys().any(|s| !self.pulled.contains(s))
    }
    /// Whether `edge` is an edge this state is to be sent to.
    pub fn sends_to(&self, edge: &str) -> bool {
        self.destinations.values().any(|e| e == edge)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SnapshotPhase {
    Pending,
    Ready,
    Failed,
    /// Deleted in the log: its files are to be removed.
    Deleted,
}

/// A snapshot this edge is to take, keeps or is to remove.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DesiredSnapshot {
    pub id: String,
    pub sandbox: String,
    pub image: String,
    pub parent: Option<String>,
    pub phase: SnapshotPhase,
    /// A container's file system, or a microVM's memory, device state and disk.
    #[serde(default)]
    pub isolation: Isolation,
}

impl DesiredSandbox {
    /// The log already records an end for it: nothing more to report.
    pub fn is_terminal(&self) -> bool {
        matches!(self.observed, Observed::Exited | Observed::Failed)
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SliceState {
    pub edge: String,
    /// The first log index not folded in yet: where the watch resumes.
    pub next_index: u64,
    pub sandboxes: BTreeMap<String, DesiredSandbox>,
    #[serde(default)]
    pub snapshots: BTreeMap<String, DesiredSnapshot>,
    /// Transfers this edge serves, by id.
    #[serde(default)]
    pub served: BTreeMap<String, ServedTransfer>,
    /// Every registered edge's proxy address (where its transfers are pulled from).
    #[serde(default)]
    pub edges: BTreeMap<String, String>,
}

fn parse_desired(s: &str) -> Desired {
    match s {
        "paused" => Desired::Paused,
        "killed" => Desired::Killed,
        _ => Desired::Running,
    }
}

fn parse_observed(s: &str) -> Observed {
    match s {
        "ready" => Observed::Ready,
        "paused" => Observed::Paused,
        "failed" => Observed::Failed,
        "exited" => Observed::Exited,
        _ => Observed::Pending,
    }
}

impl SliceState {
    pub fn new(edge: &str) -> SliceState {
        SliceState {
            edge: edge.to_string(),
            next_index: 1,
            ..Default::default()
        }
    }

    /// Records that sandbox `sandbox`, placed on `edge`, starts from state this edge
    /// serves as `transfer`.
    fn serve(&mut self, transfer: &str, source: TransferSource, isolation: Isolation, sandbox: &str, edge: &str) {
        let t = self
            .served
            .entry(transfer.to_string())
            .or_insert_with(|| ServedTransfer {
                id: transfer.to_string(),
                source,
                isolation,
                destinations: BTreeMap::new(),
                pulled: Default::default(),
            });
        t.destinations.insert(sandbox.to_string(), edge.to_string());
    }

    /// Folds one message of the watch stream.
    pub fn apply(&mut self, msg: &SliceMessage) {
        match &msg.body {
            Some(Body::Snapshot(snap)) => {
                // History before the snapshot is gone: the snapshot is the whole truth.
                self.sandboxes = snap
                    .sandboxes
                    .iter()
                    .map(|s| {
                        let d = DesiredSandbox {
                            id: s.id.clone(),
                            project: s.project.clone(),
                            image: s.image.clone(),
                            cpu_millis: s.cpu_millis,
                            memory_mb: s.memory_mb,
                            labels: s.labels.clone(),
                            expires_at_ms: (s.expires_at_ms != 0).then_some(s.expires_at_ms),
                            fork_of: (!s.fork_of.is_empty()).then(|| s.fork_of.clone()),
                            desired: parse_desired(&s.desired),
                            observed: parse_observed(&s.observed),
                            kill_reason: None,
                            env: s.env.clone(),
                            auto_pause: s.auto_pause,
                            snapshot: (!s.snapshot.is_empty()).then(|| s.snapshot.clone()),
                            isolation: Isolation::from_event(&s.isolation).unwrap_or_default(),
                            source_edge: (!s.source_edge.is_empty()).then(|| s.source_edge.clone()),
                            transfer: (!s.transfer.is_empty()).then(|| s.transfer.clone()),
                        };
                        (s.id.clone(), d)
                    })
                    .collect();
                // Snapshots the log no longer has are deleted: keep them as such until
                // their files are gone.
                let mut snapshots: BTreeMap<String, DesiredSnapshot> = snap
                    .snapshots
                    .iter()
                    .map(|x| {
                        let phase = match x.state.as_str() {
                            "ready" => SnapshotPhase::Ready,
                            "failed" => SnapshotPhase::Failed,
                            _ => SnapshotPhase::Pending,
                        };
                        let d = DesiredSnapshot {
                            id: x.id.clone(),
                            sandbox: x.sandbox.clone(),
                            image: x.image.clone(),
                            parent: (!x.parent.is_empty()).then(|| x.parent.clone()),
                            phase,
                            isolation: Isolation::from_event(&x.isolation).unwrap_or_default(),
                        };
                        (x.id.clone(), d)
                    })
                    .collect();
                for (id, old) in &self.snapshots {
                    if !snapshots.contains_key(id) {
                        snapshots.insert(
                            id.clone(),
                            DesiredSnapshot {
                                phase: SnapshotPhase::Deleted,
                                ..old.clone()
                            },
                        );
                    }
                }
                self.snapshots = snapshots;
                // What is still to be served; what the other edges already pulled stays known.
                let old = std::mem::take(&mut self.served);
                for x in &snap.served {
                    self.serve_created(&x.transfer, &x.snapshot, &x.fork_of, &x.isolation, &x.id, &x.edge);
                }
                for (id, t) in &mut self.served {
                    if let Some(o) = old.get(id) {
                        t.pulled = o.pulled.clone();
                    }
                }
                self.edges
                    .extend(snap.edges.iter().map(|e| (e.id.clone(), e.address.clone())));
                self.next_index = self.next_index.max(snap.index + 1);
            }
            Some(Body::Entry(entry)) => {
                for env in &entry.events {
                    // An event this binary cannot decode belongs to a newer schema; the
                    // edge must be upgraded, and skipping it is safer than guessing.
                    if let Ok(ev) = Event::from_envelope(env) {
                        self.apply_event(&ev);
                    } else {
                        tracing::warn!(event = %env.r#type, index = entry.index, "undecodable event in the slice; upgrade this edge");
                    }
                }
                self.next_index = self.next_index.max(entry.index + 1);
            }
            Some(Body::Progress(p)) => self.next_index = self.next_index.max(p.index + 1),
            None => {}
        }
    }

    fn serve_created(
        &mut self,
        transfer: &str,
        snapshot: &str,
        fork_of: &str,
        isolation: &str,
        sandbox: &str,
        edge: &str,
    ) {
        let source = if !snapshot.is_empty() && transfer == snapshot {
            TransferSource::Snapshot {
                snapshot: snapshot.to_string(),
            }
        } else {
            TransferSource::Fork {
                sandbox: fork_of.to_string(),
            }
        };
        self.serve(
            transfer,
            source,
            Isolation::from_event(isolation).unwrap_or_default(),
            sandbox,
            edge,
        );
    }

    fn apply_event(&mut self, ev: &Event) {
        match ev {
            Event::EdgeRegistered(e) => {
                self.edges.insert(e.id.clone(), e.address.clone());
                return;
            }
            // A sandbox of another edge that starts from state held here.
            Event::SandboxCreated(c) if c.edge != self.edge && c.source_edge == self.edge && !c.transfer.is_empty() => {
                self.serve_created(&c.transfer, &c.snapshot, &c.fork_of, &c.isolation, &c.id, &c.edge);
                return;
            }
            _ => {}
        }
        if let Event::SandboxCreated(c) = ev {
            if c.edge == self.edge {
                self.sandboxes.insert(
                    c.id.clone(),
                    DesiredSandbox {
                        id: c.id.clone(),
                        project: c.project.clone(),
                        image: c.image.clone(),
                        cpu_millis: c.cpu_millis,
                        memory_mb: c.memory_mb,
                        labels: c.labels.clone(),
                        expires_at_ms: (c.expires_at_ms != 0).then_some(c.expires_at_ms),
                        fork_of: (!c.fork_of.is_empty()).then(|| c.fork_of.clone()),
                        desired: Desired::Running,
                        observed: Observed::Pending,
                        kill_reason: None,
                        env: c.env.clone(),
                        auto_pause: c.auto_pause,
                        snapshot: (!c.snapshot.is_empty()).then(|| c.snapshot.clone()),
                        isolation: Isolation::from_event(&c.isolation).unwrap_or_default(),
                        source_edge: (!c.source_edge.is_empty()).then(|| c.source_edge.clone()),
                        transfer: (!c.transfer.is_empty()).then(|| c.transfer.clone()),
                    },
                );
            }
            return;
        }
        match ev {
            Event::SnapshotRequested(r) if r.edge == self.edge => {
                self.snapshots.insert(
                    r.id.clone(),
                    DesiredSnapshot {
                        id: r.id.clone(),
                        sandbox: r.sandbox.clone(),
                        image: r.image.clone(),
                        parent: (!r.parent.is_empty()).then(|| r.parent.clone()),
                        phase: SnapshotPhase::Pending,
                        isolation: Isolation::from_event(&r.isolation).unwrap_or_default(),
                    },
                );
                return;
            }
            Event::SnapshotReady(r) => {
                if let Some(x) = self.snapshots.get_mut(&r.id) {
                    x.phase = SnapshotPhase::Ready;
                }
                return;
            }
            Event::SnapshotFailed(r) => {
                if let Some(x) = self.snapshots.get_mut(&r.id) {
                    x.phase = SnapshotPhase::Failed;
                }
                return;
            }
            Event::SnapshotDeleted(r) => {
                if let Some(x) = self.snapshots.get_mut(&r.id) {
                    x.phase = SnapshotPhase::Deleted;
                }
                return;
            }
            _ => {}
        }
        let Some(s) = ev.sandbox_id().and_then(|id| self.sandboxes.get_mut(id)) else {
            return;
        };
        match ev {
            Event::SandboxPauseRequested(_) if s.desired == Desired::Running => s.desired = Desired::Paused,
            Event::SandboxResumeRequested(_) if s.desired == Desired::Paused => s.desired = Desired::Running,
            Event::SandboxKillRequested(k) => {
                s.desired = Desired::Killed;
                s.kill_reason.get_or_insert_with(|| k.reason.clone());
            }
            Event::SandboxTimeoutSet(t) => s.expires_at_ms = (t.expires_at_ms != 0).then_some(t.expires_at_ms),
            Event::SandboxLabelsSet(l) => s.labels = l.labels.clone(),
            Event::SandboxTimedOut(_) => {
                s.expires_at_ms = None;
                if s.desired == Desired::Running {
                    s.desired = Desired::Paused;
                }
            }
            Event::SandboxReady(_) | Event::SandboxResumed(_) if !s.is_terminal() => s.observed = Observed::Ready,
            Event::SandboxPaused(_) if !s.is_terminal() => s.observed = Observed::Paused,
            Event::SandboxFailed(_) => s.observed = Observed::Failed,
            Event::SandboxExited(_) => s.observed = Observed::Exited,
            _ => {}
        }
    }
}
