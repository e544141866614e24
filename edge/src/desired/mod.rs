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
//! was, a refused event is left out.
//!
//! The rooms, by job: this file folds messages (entries, snapshots) into [`SliceState`];
//! `sandboxes.rs` the sandboxes placed here ([`DesiredSandbox`]); `held.rs` the state this
//! edge holds for itself and for other edges (snapshots, served transfers); `images.rs`
//! the images it is to pull, pack or import, and those the log deleted.

mod held;
mod images;
mod sandboxes;
#[cfg(test)]
mod tests;

pub use held::{DesiredSnapshot, ServedTransfer, SnapshotPhase, TransferSource};
pub use images::DesiredPack;
pub use sandboxes::DesiredSandbox;

use opendsec_edge_api::UnknownEnum;
use opendsec_edge_api::convert::decode_isolation;
use opendsec_edge_api::pb::{SliceMessage, SliceSandbox, SliceSnapshot, slice_message::Body};
use opendsec_projections::{CpuClass, Event, Isolation, Lifecycle};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

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
        self.images_from_snapshot(snap);
        self.next_index = self.next_index.max(snap.index + 1);
        Ok(())
    }

    /// Folds one event of the slice; `Err` says why it cannot be (and nothing changed).
    fn apply_event(&mut self, ev: &Event) -> Result<(), String> {
        let isolation_of = |name: &str| {
            Isolation::from_event(name).ok_or_else(|| format!("isolation {name:?} is unknown to this edge"))
        };
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
                    auto_pause_filesystem: c.auto_pause_filesystem,
                    pause_filesystem: born.filesystem,
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
            Event::ImageRequested(_) | Event::ImageReady(_) | Event::ImageFailed(_) | Event::ImageDeleted(_) => {
                self.apply_image_event(ev)
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
}
