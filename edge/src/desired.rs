//! The edge's slice of the log, folded into what should run on this machine.
//!
//! `SliceState` is the edge's intent: every sandbox placed here, its desired state, and
//! the observed state the control plane has recorded (from this edge's own reports).
//! It is rebuilt from slice messages alone (entries, or a snapshot when history is gone)
//! and carries the index to resume the watch from, so it can be persisted and reloaded.
//!
//! A sandbox's desired and observed states move through `opendsec_projections::Lifecycle`,
//! the transitions the control plane's views use, so the edge and the log agree. A value
//! this edge does not know (an enum from a newer control plane, an unknown isolation) is
//! refused and logged, never folded as a guess: a refused snapshot leaves the slice as it
//! was, a refused event is skipped.

use opendsec_edge_api::UnknownEnum;
use opendsec_edge_api::convert::{
    decode_cpu_class, decode_desired, decode_isolation, decode_observed, decode_snapshot_state,
};
use opendsec_edge_api::pb::{SliceMessage, SliceSandbox, SliceSnapshot, SliceSnapshotRecord, slice_message::Body};
use opendsec_projections::{CpuClass, Desired, Event, Isolation, Lifecycle, Observed, SnapshotState};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

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

/// An image this edge is to pack from one of its container sandboxes (`PackSandbox`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DesiredPack {
    pub sandbox: String,
    /// The caller's paths to leave out, beside the residue every pack leaves out.
    pub scrub: Vec<String>,
    /// What the image's config changes from its parent's (a template build's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<opendsec_projections::ConfigOverride>,
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
        self.lifecycle().has_ended()
    }

    fn lifecycle(&self) -> Lifecycle {
        Lifecycle {
            desired: self.desired,
            observed: self.observed,
            expires_at_ms: self.expires_at_ms,
        }
    }

    /// Moves it along its lifecycle by `ev` (when `ev` is a transition of it).
    fn advance(&mut self, ev: &Event) {
        if let Some(next) = self.lifecycle().next(ev) {
            self.desired = next.desired;
            self.observed = next.observed;
            self.expires_at_ms = next.expires_at_ms;
        }
    }

    fn from_snapshot(s: &SliceSandbox) -> Result<DesiredSandbox, UnknownEnum> {
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

impl DesiredSnapshot {
    fn from_snapshot(x: &SliceSnapshotRecord) -> Result<DesiredSnapshot, UnknownEnum> {
        Ok(DesiredSnapshot {
            id: x.id.clone(),
            sandbox: x.sandbox.clone(),
            image: x.image.clone(),
            parent: (!x.parent.is_empty()).then(|| x.parent.clone()),
            phase: match decode_snapshot_state(x.state)? {
                SnapshotState::Pending => SnapshotPhase::Pending,
                SnapshotState::Ready => SnapshotPhase::Ready,
                SnapshotState::Failed => SnapshotPhase::Failed,
            },
            isolation: decode_isolation(x.isolation)?,
        })
    }
}

/// What this edge refused to fold from its slice.
#[derive(Debug, PartialEq, thiserror::Error)]
pub enum Refused {
    /// A snapshot with a value this edge does not know: none of it was folded.
    #[error("the slice snapshot at index {index} is refused, {item}: {source}; upgrade this edge")]
    Snapshot {
        index: u64,
        /// The sandbox or snapshot record carrying the value.
        item: String,
        source: UnknownEnum,
    },
    /// An event this edge cannot interpret: it was skipped, the rest of its entry folded.
    #[error("event {event} at index {index} is skipped: {why}; upgrade this edge")]
    Event { index: u64, event: String, why: String },
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
    /// Images this edge is to pull and report, by name: their reference.
    #[serde(default)]
    pub pulls: BTreeMap<String, String>,
    /// Images this edge is to pack and report, by name.
    #[serde(default)]
    pub packs: BTreeMap<String, DesiredPack>,
    /// Images this edge is to import from a tarball its caller uploads (`node/imports.rs`),
    /// and report, by name.
    #[serde(default)]
    pub imports: BTreeSet<String>,
    /// Images the log deleted (and did not register again since): their records go
    /// from the store, their layers once nothing uses them (`node/image_gc.rs`).
    #[serde(default)]
    pub images_deleted: BTreeSet<String>,
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

    /// Folds one message of the watch stream; what it refuses is logged (see [`Refused`]).
    pub fn apply(&mut self, msg: &SliceMessage) {
        if let Err(refused) = self.try_apply(msg) {
            for r in refused {
                tracing::error!(edge = %self.edge, "{r}");
            }
        }
    }

    /// Folds one message of the watch stream, or says what it refused to fold.
    pub fn try_apply(&mut self, msg: &SliceMessage) -> Result<(), Vec<Refused>> {
        match &msg.body {
            Some(Body::Snapshot(snap)) => self.apply_snapshot(snap).map_err(|r| vec![r]),
            Some(Body::Entry(entry)) => {
                let mut refused = Vec::new();
                for env in &entry.events {
                    // An event this binary cannot decode belongs to a newer schema; the
                    // edge must be upgraded, and skipping it is safer than guessing.
                    let folded = Event::from_envelope(env)
                        .map_err(|e| e.to_string())
                        .and_then(|ev| self.apply_event(&ev));
                    if let Err(why) = folded {
                        refused.push(Refused::Event {
                            index: entry.index,
                            event: env.r#type.clone(),
                            why,
                        });
                    }
                }
                self.next_index = self.next_index.max(entry.index + 1);
                if refused.is_empty() { Ok(()) } else { Err(refused) }
            }
            Some(Body::Progress(p)) => {
                self.next_index = self.next_index.max(p.index + 1);
                Ok(())
            }
            None => Ok(()),
        }
    }

    fn apply_snapshot(&mut self, snap: &SliceSnapshot) -> Result<(), Refused> {
        let refused = |item: String| {
            move |source| Refused::Snapshot {
                index: snap.index,
                item,
                source,
            }
        };
        // Everything is decoded before anything changes: a refused snapshot leaves the
        // slice as it was.
        let sandboxes: BTreeMap<String, DesiredSandbox> = snap
            .sandboxes
            .iter()
            .map(|s| {
                DesiredSandbox::from_snapshot(s)
                    .map(|d| (s.id.clone(), d))
                    .map_err(refused(format!("sandbox {}", s.id)))
            })
            .collect::<Result<_, _>>()?;
        let mut snapshots: BTreeMap<String, DesiredSnapshot> = snap
            .snapshots
            .iter()
            .map(|x| {
                DesiredSnapshot::from_snapshot(x)
                    .map(|d| (x.id.clone(), d))
                    .map_err(refused(format!("snapshot {}", x.id)))
            })
            .collect::<Result<_, _>>()?;
        let served: Vec<(&SliceSandbox, Isolation)> = snap
            .served
            .iter()
            .map(|x| {
                decode_isolation(x.isolation)
                    .map(|i| (x, i))
                    .map_err(refused(format!("served sandbox {}", x.id)))
            })
            .collect::<Result<_, _>>()?;
        // History before the snapshot is gone: the snapshot is the whole truth.
        self.sandboxes = sandboxes;
        // Snapshots the log no longer has are deleted: keep them as such until their
        // files are gone.
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
        for (x, isolation) in served {
            self.serve_created(&x.transfer, &x.snapshot, &x.fork_of, isolation, &x.id, &x.edge);
        }
        for (id, t) in &mut self.served {
            if let Some(o) = old.get(id) {
                t.pulled = o.pulled.clone();
            }
        }
        self.edges
            .extend(snap.edges.iter().map(|e| (e.id.clone(), e.address.clone())));
        self.pulls = snap
            .pulls
            .iter()
            .filter(|p| p.source_sandbox.is_empty() && !p.imported)
            .map(|p| (p.name.clone(), p.reference.clone()))
            .collect();
        self.imports = snap
            .pulls
            .iter()
            .filter(|p| p.imported)
            .map(|p| p.name.clone())
            .collect();
        self.packs = snap
            .pulls
            .iter()
            .filter(|p| !p.source_sandbox.is_empty())
            .map(|p| {
                let pack = DesiredPack {
                    sandbox: p.source_sandbox.clone(),
                    scrub: p.scrub.clone(),
                    config: opendsec_projections::ConfigOverride::from_event(p.config.as_ref()),
                };
                (p.name.clone(), pack)
            })
            .collect();
        self.next_index = self.next_index.max(snap.index + 1);
        Ok(())
    }

    fn serve_created(
        &mut self,
        transfer: &str,
        snapshot: &str,
        fork_of: &str,
        isolation: Isolation,
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
        self.serve(transfer, source, isolation, sandbox, edge);
    }

    /// Folds one event of the slice; `Err` says why it cannot be (and nothing changed).
    fn apply_event(&mut self, ev: &Event) -> Result<(), String> {
        let isolation_of = |name: &str| {
            Isolation::from_event(name).ok_or_else(|| format!("isolation {name:?} is unknown to this edge"))
        };
        if let Event::ImageRequested(r) = ev {
            // Registered again: no longer deleted.
            self.images_deleted.remove(&r.name);
        }
        match ev {
            Event::EdgeRegistered(e) => {
                self.edges.insert(e.id.clone(), e.address.clone());
            }
            // A sandbox of another edge that starts from state held here.
            Event::SandboxCreated(c) if c.edge != self.edge && c.source_edge == self.edge && !c.transfer.is_empty() => {
                let isolation = isolation_of(&c.isolation)?;
                self.serve_created(&c.transfer, &c.snapshot, &c.fork_of, isolation, &c.id, &c.edge);
            }
            Event::SandboxCreated(c) if c.edge == self.edge => {
                let born = Lifecycle::created(c.expires_at_ms);
                let d = DesiredSandbox {
                    id: c.id.clone(),
                    project: c.project.clone(),
                    image: c.image.clone(),
                    cpu_millis: c.cpu_millis,
                    memory_mb: c.memory_mb,
                    labels: c.labels.clone(),
                    expires_at_ms: born.expires_at_ms,
                    fork_of: (!c.fork_of.is_empty()).then(|| c.fork_of.clone()),
                    desired: born.desired,
                    observed: born.observed,
                    kill_reason: None,
                    env: c.env.clone(),
                    auto_pause: c.auto_pause,
                    snapshot: (!c.snapshot.is_empty()).then(|| c.snapshot.clone()),
                    isolation: isolation_of(&c.isolation)?,
                    source_edge: (!c.source_edge.is_empty()).then(|| c.source_edge.clone()),
                    transfer: (!c.transfer.is_empty()).then(|| c.transfer.clone()),
                    oom_kills: 0,
                    cpu_class: CpuClass::from_event(&c.cpu_class)
                        .ok_or_else(|| format!("cpu class {:?} is unknown to this edge", c.cpu_class))?,
                    image_source: (!c.image_source.is_empty()).then(|| c.image_source.clone()),
                    network: (!c.network.is_empty()).then(|| c.network.clone()),
                };
                self.sandboxes.insert(c.id.clone(), d);
            }
            Event::SandboxCreated(_) => {}
            Event::SnapshotRequested(r) if r.edge == self.edge => {
                let d = DesiredSnapshot {
                    id: r.id.clone(),
                    sandbox: r.sandbox.clone(),
                    image: r.image.clone(),
                    parent: (!r.parent.is_empty()).then(|| r.parent.clone()),
                    phase: SnapshotPhase::Pending,
                    isolation: isolation_of(&r.isolation)?,
                };
                self.snapshots.insert(r.id.clone(), d);
            }
            // A second request of a name replaces the first: a pull, a pack or an import.
            Event::ImageRequested(r) if r.edge == self.edge && r.imported => {
                self.packs.remove(&r.name);
                self.pulls.remove(&r.name);
                self.imports.insert(r.name.clone());
            }
            Event::ImageRequested(r) if r.edge == self.edge && r.source_sandbox.is_empty() => {
                self.packs.remove(&r.name);
                self.imports.remove(&r.name);
                self.pulls.insert(r.name.clone(), r.reference.clone());
            }
            Event::ImageRequested(r) if r.edge == self.edge => {
                self.pulls.remove(&r.name);
                self.imports.remove(&r.name);
                let pack = DesiredPack {
                    sandbox: r.source_sandbox.clone(),
                    scrub: r.scrub.clone(),
                    config: opendsec_projections::ConfigOverride::from_event(r.config.as_ref()),
                };
                self.packs.insert(r.name.clone(), pack);
            }
            Event::ImageReady(r) => {
                self.pulls.remove(&r.name);
                self.packs.remove(&r.name);
                self.imports.remove(&r.name);
            }
            Event::ImageFailed(r) => {
                self.pulls.remove(&r.name);
                self.packs.remove(&r.name);
                self.imports.remove(&r.name);
            }
            Event::ImageDeleted(r) => {
                self.images_deleted.insert(r.name.clone());
                self.pulls.remove(&r.name);
                self.packs.remove(&r.name);
                self.imports.remove(&r.name);
            }
            Event::SnapshotReady(r) => self.set_phase(&r.id, SnapshotPhase::Ready),
            Event::SnapshotFailed(r) => self.set_phase(&r.id, SnapshotPhase::Failed),
            Event::SnapshotDeleted(r) => self.set_phase(&r.id, SnapshotPhase::Deleted),
            _ => {
                let Some(s) = ev.sandbox_id().and_then(|id| self.sandboxes.get_mut(id)) else {
                    return Ok(());
                };
                match ev {
                    Event::SandboxKillRequested(k) => {
                        s.kill_reason.get_or_insert_with(|| k.reason.clone());
                    }
                    Event::SandboxLabelsSet(l) => s.labels = l.labels.clone(),
                    Event::SandboxOomKilled(o) => s.oom_kills = s.oom_kills.max(o.kills),
                    Event::SandboxNetworkSet(n) => s.network = (!n.network.is_empty()).then(|| n.network.clone()),
                    _ => {}
                }
                s.advance(ev);
            }
        }
        Ok(())
    }

    fn set_phase(&mut self, snapshot: &str, phase: SnapshotPhase) {
        if let Some(x) = self.snapshots.get_mut(snapshot) {
            x.phase = phase;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opendsec_edge_api::pb::{Progress, SliceEdge, SliceEntry};
    use opendsec_projections::pb;

    const HERE: &str = "e1";

    fn entry(index: u64, events: Vec<Event>) -> SliceMessage {
        SliceMessage {
            body: Some(Body::Entry(SliceEntry {
                index,
                time_ms: 1_000,
                events: events.iter().map(Event::to_envelope).collect(),
            })),
        }
    }

    fn created(id: &str, edge: &str) -> pb::SandboxCreated {
        pb::SandboxCreated {
            id: id.into(),
            project: "root".into(),
            edge: edge.into(),
            image: "busybox".into(),
            cpu_millis: 100,
            memory_mb: 64,
            ..Default::default()
        }
    }

    /// A slice that folded `events`, one entry each, from index 1.
    fn folded(events: Vec<Event>) -> SliceState {
        let mut s = SliceState::new(HERE);
        for (i, ev) in events.into_iter().enumerate() {
            s.try_apply(&entry(i as u64 + 1, vec![ev])).expect("folds");
        }
        s
    }

    fn kill(id: &str, reason: &str) -> Event {
        Event::SandboxKillRequested(pb::SandboxKillRequested {
            id: id.into(),
            reason: reason.into(),
        })
    }

    fn ready(id: &str) -> Event {
        Event::SandboxReady(pb::SandboxReady {
            id: id.into(),
            ..Default::default()
        })
    }

    fn slice_sandbox(id: &str) -> SliceSandbox {
        SliceSandbox {
            id: id.into(),
            project: "root".into(),
            image: "busybox".into(),
            desired: opendsec_edge_api::pb::Desired::Running.into(),
            observed: opendsec_edge_api::pb::Observed::Ready.into(),
            isolation: opendsec_edge_api::pb::Isolation::Microvm.into(),
            cpu_class: opendsec_edge_api::pb::CpuClass::LatencySensitive.into(),
            edge: HERE.into(),
            ..Default::default()
        }
    }

    fn snapshot_message(index: u64, sandboxes: Vec<SliceSandbox>) -> SliceMessage {
        SliceMessage {
            body: Some(Body::Snapshot(SliceSnapshot {
                index,
                sandboxes,
                edges: vec![SliceEdge {
                    id: "e2".into(),
                    address: "e2:1".into(),
                }],
                ..Default::default()
            })),
        }
    }

    #[test]
    fn packs_are_folded_apart_from_pulls_until_reported_and_a_slice_saved_before_packs_loads() {
        let requested = |name: &str, edge: &str, sandbox: &str| {
            Event::ImageRequested(pb::ImageRequested {
                name: name.into(),
                project: "root".into(),
                reference: if sandbox.is_empty() {
                    "127.0.0.1:5000/py:1".into()
                } else {
                    String::new()
                },
                edge: edge.into(),
                source_sandbox: sandbox.into(),
                scrub: if sandbox.is_empty() {
                    vec![]
                } else {
                    vec!["/etc/token".into()]
                },
                config: None,
                imported: false,
            })
        };
        let mut s = folded(vec![
            requested("py", HERE, ""),
            requested("env", HERE, "sb1"),
            requested("theirs", "e2", "sb7"),
        ]);
        assert_eq!(s.pulls.keys().collect::<Vec<_>>(), ["py"]);
        assert_eq!(
            s.packs,
            [(
                "env".to_string(),
                DesiredPack {
                    sandbox: "sb1".into(),
                    scrub: vec!["/etc/token".into()],
                    config: None,
                }
            )]
            .into()
        );
        // What the edge saved before packs existed still loads, with none.
        let mut saved = serde_json::to_value(&s).unwrap();
        saved.as_object_mut().unwrap().remove("packs");
        let loaded: SliceState = serde_json::from_value(saved).unwrap();
        assert_eq!((loaded.pulls.clone(), loaded.packs.len()), (s.pulls.clone(), 0));

        // A pull of the name replaces its pack, and the other way round.
        s.try_apply(&entry(4, vec![requested("env", HERE, "")])).unwrap();
        assert!(s.packs.is_empty() && s.pulls.contains_key("env"));
        s.try_apply(&entry(5, vec![requested("env", HERE, "sb1")])).unwrap();
        assert!(s.packs.contains_key("env") && !s.pulls.contains_key("env"));
        s.try_apply(&entry(
            6,
            vec![Event::ImageFailed(pb::ImageFailed {
                name: "env".into(),
                edge: HERE.into(),
                reason: "no room".into(),
            })],
        ))
        .unwrap();
        assert!(s.packs.is_empty());

        // A slice snapshot lists pulls and packs together.
        let mut snap = snapshot_message(50, vec![]);
        if let Some(Body::Snapshot(x)) = &mut snap.body {
            x.pulls = vec![
                opendsec_edge_api::pb::SliceImage {
                    name: "py".into(),
                    reference: "127.0.0.1:5000/py:1".into(),
                    ..Default::default()
                },
                opendsec_edge_api::pb::SliceImage {
                    name: "env".into(),
                    source_sandbox: "sb1".into(),
                    scrub: vec!["/root/notes".into()],
                    ..Default::default()
                },
            ];
        }
        s.try_apply(&snap).unwrap();
        assert_eq!(s.pulls.keys().collect::<Vec<_>>(), ["py"]);
        assert_eq!(s.packs["env"].scrub, ["/root/notes"]);
    }

    #[test]
    fn an_import_is_awaited_apart_from_pulls_and_packs_until_reported() {
        let import = |name: &str, edge: &str| {
            Event::ImageRequested(pb::ImageRequested {
                name: name.into(),
                project: "root".into(),
                edge: edge.into(),
                imported: true,
                ..Default::default()
            })
        };
        let mut s = folded(vec![import("tar", HERE), import("theirs", "e2")]);
        assert_eq!(s.imports.iter().collect::<Vec<_>>(), ["tar"]);
        assert!(s.pulls.is_empty() && s.packs.is_empty());
        // A pull of the name replaces the import, and the other way round.
        let pull = Event::ImageRequested(pb::ImageRequested {
            name: "tar".into(),
            reference: "127.0.0.1:5000/py:1".into(),
            edge: HERE.into(),
            ..Default::default()
        });
        s.try_apply(&entry(3, vec![pull])).unwrap();
        assert!(s.imports.is_empty() && s.pulls.contains_key("tar"));
        s.try_apply(&entry(4, vec![import("tar", HERE)])).unwrap();
        assert!(s.imports.contains("tar") && s.pulls.is_empty());
        let ready = Event::ImageReady(pb::ImageReady {
            name: "tar".into(),
            edge: HERE.into(),
            ..Default::default()
        });
        s.try_apply(&entry(5, vec![ready])).unwrap();
        assert!(s.imports.is_empty());
        // A slice snapshot lists imports with pulls and packs; what was saved before
        // imports existed loads with none.
        let mut snap = snapshot_message(50, vec![]);
        if let Some(Body::Snapshot(x)) = &mut snap.body {
            x.pulls = vec![opendsec_edge_api::pb::SliceImage {
                name: "up".into(),
                imported: true,
                ..Default::default()
            }];
        }
        s.try_apply(&snap).unwrap();
        assert_eq!(s.imports.iter().collect::<Vec<_>>(), ["up"]);
        assert!(s.pulls.is_empty() && s.packs.is_empty());
        let mut saved = serde_json::to_value(&s).unwrap();
        saved.as_object_mut().unwrap().remove("imports");
        let loaded: SliceState = serde_json::from_value(saved).unwrap();
        assert!(loaded.imports.is_empty());
    }

    #[test]
    fn a_deleted_image_is_remembered_until_its_name_is_requested_again() {
        let deleted = |name: &str| {
            Event::ImageDeleted(pb::ImageDeleted {
                name: name.into(),
                ..Default::default()
            })
        };
        let mut s = folded(vec![deleted("py"), deleted("env")]);
        assert_eq!(s.images_deleted.iter().collect::<Vec<_>>(), ["env", "py"]);
        let again = Event::ImageRequested(pb::ImageRequested {
            name: "py".into(),
            reference: "127.0.0.1:5000/py:2".into(),
            edge: "another-edge".into(),
            ..Default::default()
        });
        s.try_apply(&entry(3, vec![again])).unwrap();
        assert_eq!(s.images_deleted.iter().collect::<Vec<_>>(), ["env"]);
        // What the edge saved before deletions were kept still loads, with none.
        let mut saved = serde_json::to_value(&s).unwrap();
        saved.as_object_mut().unwrap().remove("images_deleted");
        let loaded: SliceState = serde_json::from_value(saved).unwrap();
        assert!(loaded.images_deleted.is_empty());
    }

    #[test]
    fn a_sandbox_created_on_this_edge_is_wanted_running_and_not_reported_yet() {
        let mut c = created("sb1", HERE);
        c.expires_at_ms = 9_000;
        c.isolation = "microvm".into();
        let s = folded(vec![Event::SandboxCreated(c)]);
        let d = &s.sandboxes["sb1"];
        assert_eq!((d.desired, d.observed), (Desired::Running, Observed::Pending));
        assert_eq!((d.expires_at_ms, d.isolation), (Some(9_000), Isolation::Microvm));
        assert_eq!(s.next_index, 2);
    }

    #[test]
    fn a_sandbox_of_another_edge_is_not_run_here_unless_it_starts_from_state_held_here() {
        let mut served = created("sb2", "e2");
        served.source_edge = HERE.into();
        served.fork_of = "sb0".into();
        served.transfer = "fork-sb2".into();
        let s = folded(vec![
            Event::SandboxCreated(created("sb1", "e2")),
            Event::SandboxCreated(served),
        ]);
        assert!(s.sandboxes.is_empty());
        let t = &s.served["fork-sb2"];
        assert_eq!(t.source, TransferSource::Fork { sandbox: "sb0".into() });
        assert!(t.sends_to("e2") && t.is_wanted());
    }

    #[test]
    fn a_kill_keeps_its_first_reason_and_makes_later_reports_of_running_stale() {
        let s = folded(vec![
            Event::SandboxCreated(created("sb1", HERE)),
            kill("sb1", "timeout"),
            kill("sb1", "user"),
            ready("sb1"),
        ]);
        let d = &s.sandboxes["sb1"];
        assert_eq!(d.kill_reason.as_deref(), Some("timeout"));
        // As in the control plane's views: the sandbox is released, its report stale.
        assert_eq!((d.desired, d.observed), (Desired::Killed, Observed::Pending));
        assert!(!d.is_terminal());
    }

    #[test]
    fn an_end_recorded_in_the_log_is_terminal() {
        let s = folded(vec![
            Event::SandboxCreated(created("sb1", HERE)),
            ready("sb1"),
            Event::SandboxExited(pb::SandboxExited {
                id: "sb1".into(),
                ..Default::default()
            }),
            ready("sb1"),
            Event::SandboxPauseRequested(pb::SandboxPauseRequested { id: "sb1".into() }),
        ]);
        let d = &s.sandboxes["sb1"];
        assert_eq!(d.observed, Observed::Exited);
        assert_eq!(
            d.desired,
            Desired::Paused,
            "a pause request still records what is wanted"
        );
        assert!(d.is_terminal());
    }

    #[test]
    fn a_timed_out_sandbox_with_auto_pause_is_wanted_paused_and_its_timeout_spent() {
        let mut c = created("sb1", HERE);
        c.expires_at_ms = 5_000;
        c.auto_pause = true;
        let s = folded(vec![
            Event::SandboxCreated(c),
            Event::SandboxTimedOut(pb::SandboxTimedOut { id: "sb1".into() }),
        ]);
        let d = &s.sandboxes["sb1"];
        assert_eq!((d.desired, d.expires_at_ms), (Desired::Paused, None));
    }

    #[test]
    fn labels_and_timeouts_follow_the_log() {
        let s = folded(vec![
            Event::SandboxCreated(created("sb1", HERE)),
            Event::SandboxLabelsSet(pb::SandboxLabelsSet {
                id: "sb1".into(),
                labels: BTreeMap::from([("team".to_string(), "a".to_string())]),
            }),
            Event::SandboxTimeoutSet(pb::SandboxTimeoutSet {
                id: "sb1".into(),
                expires_at_ms: 7_000,
            }),
        ]);
        let d = &s.sandboxes["sb1"];
        assert_eq!(d.labels["team"], "a");
        assert_eq!(d.expires_at_ms, Some(7_000));
    }

    #[test]
    fn a_snapshot_taken_here_goes_from_pending_to_its_result_and_is_deleted_by_the_log() {
        let requested = |id: &str, edge: &str| {
            Event::SnapshotRequested(pb::SnapshotRequested {
                id: id.into(),
                sandbox: "sb1".into(),
                edge: edge.into(),
                isolation: "microvm".into(),
                ..Default::default()
            })
        };
        let mut s = folded(vec![
            Event::SandboxCreated(created("sb1", HERE)),
            requested("x1", HERE),
            requested("x2", "e2"),
        ]);
        assert_eq!(s.snapshots["x1"].phase, SnapshotPhase::Pending);
        assert_eq!(s.snapshots["x1"].isolation, Isolation::Microvm);
        assert!(!s.snapshots.contains_key("x2"));
        let ready = Event::SnapshotReady(pb::SnapshotReady {
            id: "x1".into(),
            sandbox: "sb1".into(),
            size_bytes: 1,
        });
        let deleted = Event::SnapshotDeleted(pb::SnapshotDeleted {
            id: "x1".into(),
            sandbox: "sb1".into(),
        });
        s.try_apply(&entry(4, vec![ready])).unwrap();
        assert_eq!(s.snapshots["x1"].phase, SnapshotPhase::Ready);
        s.try_apply(&entry(5, vec![deleted])).unwrap();
        assert_eq!(s.snapshots["x1"].phase, SnapshotPhase::Deleted);
    }

    #[test]
    fn a_sandboxs_network_policy_is_the_one_it_was_created_with_until_the_log_replaces_it_whole() {
        let mut c = created("sb1", HERE);
        c.network = r#"{"allow_out":["pkgs.test"]}"#.into();
        let set = |json: &str| {
            Event::SandboxNetworkSet(pb::SandboxNetworkSet {
                id: "sb1".into(),
                network: json.into(),
            })
        };
        let mut s = folded(vec![
            Event::SandboxCreated(c),
            Event::SandboxCreated(created("sb2", HERE)),
        ]);
        assert_eq!(
            s.sandboxes["sb1"].network.as_deref(),
            Some(r#"{"allow_out":["pkgs.test"]}"#)
        );
        assert_eq!(s.sandboxes["sb2"].network, None, "no policy: the default, deny");
        s.try_apply(&entry(3, vec![set(r#"{"allow_internet_access":true}"#)]))
            .unwrap();
        assert_eq!(
            s.sandboxes["sb1"].network.as_deref(),
            Some(r#"{"allow_internet_access":true}"#)
        );
        s.try_apply(&entry(4, vec![set("")])).unwrap();
        assert_eq!(s.sandboxes["sb1"].network, None);

        // A slice snapshot carries it; a slice saved before policies existed loads with none.
        let mut x = slice_sandbox("sb9");
        x.network = r#"{"allow_out":["10.0.0.0/8"]}"#.into();
        s.try_apply(&snapshot_message(50, vec![x])).unwrap();
        assert_eq!(
            s.sandboxes["sb9"].network.as_deref(),
            Some(r#"{"allow_out":["10.0.0.0/8"]}"#)
        );
        let mut saved = serde_json::to_value(&s).unwrap();
        saved["sandboxes"]["sb9"].as_object_mut().unwrap().remove("network");
        let loaded: SliceState = serde_json::from_value(saved).unwrap();
        assert_eq!(loaded.sandboxes["sb9"].network, None);
    }

    #[test]
    fn the_resume_index_follows_entries_progress_and_snapshots_and_never_goes_back() {
        let mut s = SliceState::new(HERE);
        assert_eq!(s.next_index, 1);
        s.try_apply(&SliceMessage {
            body: Some(Body::Progress(Progress { index: 40 })),
        })
        .unwrap();
        assert_eq!(s.next_index, 41);
        s.try_apply(&entry(10, vec![])).unwrap();
        assert_eq!(s.next_index, 41);
        s.try_apply(&snapshot_message(99, vec![])).unwrap();
        assert_eq!(s.next_index, 100);
    }

    #[test]
    fn a_slice_snapshot_is_the_whole_truth_about_sandboxes_and_keeps_vanished_snapshots_as_deleted() {
        let mut s = folded(vec![
            Event::SandboxCreated(created("gone", HERE)),
            Event::SnapshotRequested(pb::SnapshotRequested {
                id: "x1".into(),
                sandbox: "gone".into(),
                edge: HERE.into(),
                ..Default::default()
            }),
        ]);
        s.try_apply(&snapshot_message(50, vec![slice_sandbox("sb9")])).unwrap();
        assert_eq!(s.sandboxes.keys().collect::<Vec<_>>(), ["sb9"]);
        let d = &s.sandboxes["sb9"];
        assert_eq!((d.observed, d.isolation), (Observed::Ready, Isolation::Microvm));
        assert_eq!(s.snapshots["x1"].phase, SnapshotPhase::Deleted);
        assert_eq!(s.edges["e2"], "e2:1");
    }

    #[test]
    fn a_slice_snapshot_with_a_value_this_edge_does_not_know_is_refused_whole() {
        let mut s = folded(vec![Event::SandboxCreated(created("sb1", HERE))]);
        let before = s.clone();
        let mut newer = slice_sandbox("sb9");
        newer.observed = 42;
        let refused = s
            .try_apply(&snapshot_message(50, vec![slice_sandbox("sb8"), newer]))
            .unwrap_err();
        assert_eq!(
            refused,
            vec![Refused::Snapshot {
                index: 50,
                item: "sandbox sb9".into(),
                source: UnknownEnum {
                    field: "Observed",
                    value: 42
                },
            }]
        );
        assert_eq!(s, before, "nothing of a refused snapshot is folded, its index included");
        let mut unspecified = slice_sandbox("sb9");
        unspecified.isolation = 0;
        assert!(s.try_apply(&snapshot_message(50, vec![unspecified])).is_err());
        assert_eq!(s, before);
    }

    #[test]
    fn an_event_this_edge_cannot_interpret_is_skipped_and_the_rest_of_its_entry_folded() {
        let mut s = SliceState::new(HERE);
        let mut unknown = created("sb1", HERE);
        unknown.isolation = "quantum".into();
        let mut msg = entry(
            3,
            vec![
                Event::SandboxCreated(unknown),
                Event::SandboxCreated(created("sb2", HERE)),
            ],
        );
        if let Some(Body::Entry(e)) = &mut msg.body {
            let mut future = e.events[1].clone();
            future.schema_version = 99;
            e.events.push(future);
        }
        let refused = s.try_apply(&msg).unwrap_err();
        assert_eq!(refused.len(), 2, "{refused:?}");
        assert!(refused[0].to_string().contains("\"quantum\""), "{}", refused[0]);
        assert!(matches!(&refused[1], Refused::Event { index: 3, .. }));
        assert_eq!(s.sandboxes.keys().collect::<Vec<_>>(), ["sb2"]);
        assert_eq!(s.next_index, 4);
    }
}
