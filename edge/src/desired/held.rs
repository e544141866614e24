//! What this edge holds: snapshots it takes, keeps or removes, and the state it serves to
//! sandboxes of other edges (transfers) until their edges have pulled it.

use super::SliceState;
use opendsec_edge_api::UnknownEnum;
use opendsec_edge_api::convert::{decode_isolation, decode_snapshot_state};
use opendsec_edge_api::pb::SliceSnapshotRecord;
use opendsec_projections::{Isolation, SnapshotState};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

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

impl DesiredSnapshot {
    pub(super) fn from_snapshot(x: &SliceSnapshotRecord) -> Result<DesiredSnapshot, UnknownEnum> {
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

impl SliceState {
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

    pub(super) fn serve_created(
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

    pub(super) fn set_phase(&mut self, snapshot: &str, phase: SnapshotPhase) {
        if let Some(x) = self.snapshots.get_mut(snapshot) {
            x.phase = phase;
        }
    }
}
