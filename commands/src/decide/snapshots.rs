//! Snapshots: requested of a running sandbox's edge, reported by that edge, deleted
//! once no other snapshot stands on them. Sandboxes start from them in `sandboxes`.

use super::Decided;
use super::scope::{Scope, not_found};
use crate::validate::{self, LIMITS};
use crate::{Rejection, RejectionKind as K, SnapshotResult};
use opendsec_projections::pb;
use opendsec_projections::{Event, Observed, Right, Snapshot, SnapshotState};

/// `CreateSnapshot`.
pub(super) fn create(s: &Scope, sandbox: &str, name: &str) -> Result<Decided, Rejection> {
    validate::text("name", name, LIMITS.name_len)?;
    let src = s.live_sandbox(sandbox, Right::SandboxWrite)?;
    if src.observed != Observed::Ready && src.observed != Observed::Paused {
        return Err(Rejection::field(
            K::Conflict,
            "sandbox",
            format!("sandbox {sandbox} is not running yet"),
        ));
    }
    let mut rng = s.rng();
    let mut id = format!("snap-{:016x}", rng.next_u64());
    while s.state.snapshots.snapshots.contains_key(&id) {
        id = format!("snap-{:016x}", rng.next_u64());
    }
    Ok(Decided::one(
        &src.project,
        &id,
        Event::SnapshotRequested(pb::SnapshotRequested {
            id: id.clone(),
            sandbox: sandbox.to_string(),
            project: src.project.clone(),
            edge: src.edge.clone(),
            name: name.to_string(),
            image: src.image.clone(),
            // A microVM's snapshot holds its whole disk: it stands on no other.
            parent: if src.isolation.is_machine() {
                String::new()
            } else {
                src.snapshot.clone().unwrap_or_default()
            },
            isolation: src.isolation.to_event(),
        }),
    ))
}

/// `DeleteSnapshot`.
pub(super) fn delete(s: &Scope, snapshot: &str) -> Result<Decided, Rejection> {
    let x = snapshot_in_scope(s, snapshot, Right::SandboxWrite)?;
    let in_use = s
        .state
        .snapshots
        .snapshots
        .values()
        .any(|o| o.parent.as_deref() == Some(snapshot));
    if in_use {
        return Err(Rejection::field(
            K::Conflict,
            "snapshot",
            format!("snapshot {snapshot} lies beneath another snapshot; delete that one first"),
        ));
    }
    Ok(Decided::one(
        &x.project,
        snapshot,
        Event::SnapshotDeleted(pb::SnapshotDeleted {
            id: snapshot.to_string(),
            sandbox: x.sandbox.clone(),
        }),
    ))
}

/// `ReportSnapshot`: what the sandbox's edge made of the request.
pub(super) fn report(s: &Scope, snapshot: &str, result: &SnapshotResult) -> Result<Decided, Rejection> {
    let x = snapshot_in_scope(s, snapshot, Right::EdgeWrite)?;
    s.acts_for_edge("snapshot", &x.edge)?;
    if x.state != SnapshotState::Pending {
        return Err(Rejection::field(
            K::Conflict,
            "snapshot",
            format!("snapshot {snapshot} was already reported"),
        ));
    }
    let ev = match result {
        SnapshotResult::Ready { size_bytes } => Event::SnapshotReady(pb::SnapshotReady {
            id: snapshot.to_string(),
            sandbox: x.sandbox.clone(),
            size_bytes: *size_bytes,
        }),
        SnapshotResult::Failed { reason } => {
            validate::text("result.reason", reason, LIMITS.reason_len)?;
            Event::SnapshotFailed(pb::SnapshotFailed {
                id: snapshot.to_string(),
                sandbox: x.sandbox.clone(),
                reason: reason.clone(),
            })
        }
    };
    Ok(Decided::one(&x.project, snapshot, ev))
}

/// The snapshot `id` of the caller's subtree, once the caller holds `right`.
fn snapshot_in_scope<'a>(s: &Scope<'a>, id: &str, right: Right) -> Result<&'a Snapshot, Rejection> {
    validate::id("snapshot", id)?;
    let x = s
        .state
        .snapshots
        .snapshots
        .get(id)
        .ok_or_else(|| not_found("snapshot", "snapshot", id))?;
    s.who.require(right)?;
    if !s.state.within(&x.project, &s.who.project) {
        return Err(Rejection::field(
            K::Forbidden,
            "snapshot",
            format!("snapshot {id} is outside the caller's project"),
        ));
    }
    Ok(x)
}
