//! Forks: copies of a live sandbox, placed on its edge while it has room and elsewhere
//! after, where they pull the source's state from the source's edge under one transfer id
//! (`fork-<first copy placed off the source edge>`, shared by the fork's copies), recorded
//! with the source edge in each `SandboxCreated` so a replay shows who served whom.
//! `edge` puts every copy on that one edge. A machine's copies carry its memory, at most
//! [`MICROVM_MAX_FORK_COUNT`] at a time.

use super::Decided;
use super::place::{Placed, Where, place};
use super::scope::Scope;
use crate::validate::{self, LIMITS};
use crate::{MICROVM_MAX_FORK_COUNT, Rejection, RejectionKind as K};
use opendsec_projections::pb;
use opendsec_projections::{Event, Right};

/// The id under which `source_edge` serves a fork's source state to the copies placed on
/// other edges: named after the first such copy, shared by all of them ("" when none is).
fn fork_transfer_id(placed: &[Placed], source_edge: &str) -> String {
    placed
        .iter()
        .find(|(_, edge, _)| edge != source_edge)
        .map(|(id, _, _)| format!("fork-{id}"))
        .unwrap_or_default()
}

/// `ForkSandbox`.
pub(super) fn fork(s: &Scope, sandbox: &str, count: u32, edge: Option<&str>) -> Result<Decided, Rejection> {
    if let Some(e) = edge {
        validate::id("edge", e)?;
    }
    if count == 0 || count > LIMITS.fork_count {
        return Err(Rejection::field(
            K::Invalid,
            "count",
            format!("count must be 1 to {}", LIMITS.fork_count),
        ));
    }
    let src = s.live_sandbox(sandbox, Right::SandboxWrite)?;
    if src.isolation.is_machine() && count > MICROVM_MAX_FORK_COUNT {
        return Err(Rejection::field(
            K::Invalid,
            "count",
            format!(
                "a {} forks into 1 to {MICROVM_MAX_FORK_COUNT} copies at a time",
                src.isolation.noun()
            ),
        ));
    }
    // The copies start from the source's file system (and a microVM's memory), which
    // live on its edge: copies go there while it has room; copies placed elsewhere
    // pull that state from it (`transfer`).
    let to = edge.map_or(Where::Prefer(&src.edge), Where::Only);
    let placed = place(s, &mut s.rng(), &src.project, src.usage(), count, to, src.isolation)?;
    let transfer = fork_transfer_id(&placed, &src.edge);
    let mut events = vec![Event::SandboxForkRequested(pb::SandboxForkRequested {
        id: sandbox.to_string(),
        children: placed.iter().map(|(id, _, _)| id.clone()).collect(),
    })];
    for (id, copy_edge, placement) in placed {
        let copy_transfer = if copy_edge == src.edge {
            String::new()
        } else {
            transfer.clone()
        };
        events.push(Event::SandboxCreated(pb::SandboxCreated {
            id,
            project: src.project.clone(),
            edge: copy_edge,
            image: src.image.clone(),
            cpu_millis: src.cpu_millis,
            memory_mb: src.memory_mb,
            labels: src.labels.clone(),
            expires_at_ms: src.expires_at_ms.unwrap_or(0),
            fork_of: sandbox.to_string(),
            placement: Some(placement),
            env: src.env.clone(),
            auto_pause: src.auto_pause,
            auto_pause_filesystem: src.auto_pause_filesystem,
            auto_resume: src.auto_resume,
            snapshot: src.snapshot.clone().unwrap_or_default(),
            template: src.template.clone().unwrap_or_default(),
            network: src.network.clone().unwrap_or_default(),
            isolation: src.isolation.to_event(),
            // A copy is not the create the key named.
            idempotency_key: String::new(),
            source_edge: src.edge.clone(),
            transfer: copy_transfer,
            cpu_class: src.cpu_class.to_event(),
            image_source: super::images::source_of(s.state, &src.image),
        }));
    }
    Ok(Decided {
        events,
        project: src.project.clone(),
        target: sandbox.to_string(),
    })
}
