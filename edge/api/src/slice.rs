//! What an edge's slice of the log is, as pure functions of the views: the control
//! plane streams it, and tests fold it exactly as an edge receives it.
//!
//! An edge's slice is every event about a sandbox placed on it, the creation of
//! sandboxes placed elsewhere that start from state it holds (it serves them that
//! state), the images it is to pull or pack, plus the edge registrations. When the history an edge asks for is no longer
//! retained, it gets [`slice_snapshot`] first, then the entries after it.

use crate::pb::{self, SliceEdge, SliceImage, SliceSandbox, SliceSnapshot, SliceSnapshotRecord};
use opendsec_projections::schema::{self, Batch, Envelope};
use opendsec_projections::{AuditResult, Event, ImageState, Observed, Sandbox, State};

/// The events of `batch`, logged at `index`, that belong to `edge`'s slice (`state`:
/// the views the batch was folded into). A batch the views did not apply (denied when
/// decided, or rejected when applied because it lost a race) has none: an edge never
/// acts on what the views do not hold.
pub fn slice_events(state: &State, edge: &str, index: u64, batch: &Batch) -> Vec<Envelope> {
    if state.audit.result_at(index).is_some_and(|r| *r != AuditResult::Ok) {
        return vec![];
    }
    let Ok(events) = schema::batch_events(batch) else {
        return vec![];
    };
    let mut out = Vec::new();
    for (ev, env) in events.iter().zip(&batch.events) {
        let mine = match ev {
            Event::SandboxCreated(e) => e.edge == edge || (e.source_edge == edge && !e.transfer.is_empty()),
            Event::EdgeRegistered(_) | Event::EdgeDeregistered(_) => true,
            Event::ImageRequested(e) => e.edge == edge,
            Event::ImageReady(e) => e.edge == edge,
            Event::ImageFailed(e) => e.edge == edge,
            Event::ImageDeleted(e) => e.edge == edge,
            other => other
                .sandbox_id()
                .is_some_and(|id| state.sandbox_edge(id) == Some(edge)),
        };
        if mine {
            out.push(env.clone());
        }
    }
    out
}

/// One sandbox as a slice snapshot carries it.
pub fn slice_sandbox(s: &Sandbox) -> SliceSandbox {
    SliceSandbox {
        id: s.id.clone(),
        project: s.project.clone(),
        image: s.image.clone(),
        cpu_millis: s.cpu_millis,
        memory_mb: s.memory_mb,
        labels: s.labels.clone(),
        expires_at_ms: s.expires_at_ms.unwrap_or(0),
        desired: pb::Desired::from(s.desired).into(),
        observed: pb::Observed::from(s.observed).into(),
        fork_of: s.fork_of.clone().unwrap_or_default(),
        env: s.env.clone(),
        auto_pause: s.auto_pause,
        snapshot: s.snapshot.clone().unwrap_or_default(),
        isolation: pb::Isolation::from(s.isolation).into(),
        source_edge: s.source_edge.clone().unwrap_or_default(),
        transfer: s.transfer.clone().unwrap_or_default(),
        edge: s.edge.clone(),
        oom_kills: s.oom_kills,
        cpu_class: pb::CpuClass::from(s.cpu_class).into(),
        image_source: s.image_source.clone().unwrap_or_default(),
        network: s.network.clone().unwrap_or_default(),
        auto_pause_filesystem: s.auto_pause_filesystem,
        pause_filesystem: s.pause_filesystem,
    }
}

/// `edge`'s slice as of `state.index`: its live sandboxes, its snapshots, the sandboxes
/// of other edges it still has to serve state to, and every registered edge.
pub fn slice_snapshot(state: &State, edge: &str) -> SliceSnapshot {
    let sandboxes = state
        .sandboxes
        .sandboxes
        .values()
        .filter(|s| s.edge == edge && s.is_live())
        .map(slice_sandbox)
        .collect();
    let served = state
        .sandboxes
        .sandboxes
        .values()
        .filter(|s| s.is_live() && s.observed == Observed::Pending)
        .filter(|s| s.source_edge.as_deref() == Some(edge) && s.transfer.is_some())
        .map(slice_sandbox)
        .collect();
    let edges = state
        .placement
        .edges
        .values()
        .filter(|e| !e.deregistered)
        .map(|e| SliceEdge {
            id: e.id.clone(),
            address: e.address.clone(),
        })
        .collect();
    let snapshots = state
        .snapshots
        .snapshots
        .values()
        .filter(|x| x.edge == edge)
        .map(|x| SliceSnapshotRecord {
            id: x.id.clone(),
            sandbox: x.sandbox.clone(),
            image: x.image.clone(),
            parent: x.parent.clone().unwrap_or_default(),
            state: pb::SnapshotState::from(x.state).into(),
            isolation: pb::Isolation::from(x.isolation).into(),
        })
        .collect();
    let pulls = state
        .images
        .images
        .values()
        .filter(|x| x.edge == edge && x.state == ImageState::Pending)
        .map(|x| SliceImage {
            name: x.name.clone(),
            reference: x.reference.clone(),
            source_sandbox: x.source_sandbox.clone().unwrap_or_default(),
            scrub: x.scrub.clone(),
            config: x.config.as_ref().map(|c| c.to_event()),
            imported: x.imported,
        })
        .collect();
    SliceSnapshot {
        index: state.index,
        sandboxes,
        snapshots,
        served,
        edges,
        pulls,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opendsec_projections::{Outcome, pb as events};

    fn batch(events: Vec<Event>) -> Batch {
        Batch {
            time_ms: 1,
            events: events.iter().map(Event::to_envelope).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn an_edge_gets_the_events_the_views_applied_and_none_of_a_rejected_batch() {
        let mut state = State::new();
        let registered = batch(vec![Event::EdgeRegistered(events::EdgeRegistered {
            id: "e1".into(),
            ordinal: 0,
            address: "e1:1".into(),
            ..Default::default()
        })]);
        assert_eq!(state.apply_batch(1, &registered), Outcome::Applied { index: 1 });
        assert_eq!(slice_events(&state, "e1", 1, &registered).len(), 1);

        // A sandbox in a project that does not exist: decided once, rejected when applied.
        let lost = batch(vec![Event::SandboxCreated(events::SandboxCreated {
            id: "s1".into(),
            project: "nowhere".into(),
            edge: "e1".into(),
            image: "busybox".into(),
            cpu_millis: 100,
            memory_mb: 64,
            ..Default::default()
        })]);
        assert!(matches!(
            state.apply_batch(2, &lost),
            Outcome::Rejected { index: 2, .. }
        ));
        assert!(slice_events(&state, "e1", 2, &lost).is_empty());
    }

    /// An edge catching up reads old batches against today's views: a sandbox that ended
    /// and left them is still routed to its edge, by the ordinal in its id.
    #[test]
    fn an_edge_catching_up_gets_the_events_of_its_sandboxes_that_left_the_views() {
        let mut state = State::new();
        let t = |ms: u64, events: Vec<Event>| Batch {
            time_ms: ms,
            ..batch(events)
        };
        let root = t(
            1,
            vec![Event::ProjectCreated(events::ProjectCreated {
                id: "root".into(),
                name: "root".into(),
                ..Default::default()
            })],
        );
        assert_eq!(state.apply_batch(1, &root), Outcome::Applied { index: 1 });
        for (i, (edge, ordinal)) in [("e1", 0u32), ("e2", 1)].into_iter().enumerate() {
            let registered = t(
                1,
                vec![Event::EdgeRegistered(events::EdgeRegistered {
                    id: edge.into(),
                    ordinal,
                    address: format!("{edge}:1"),
                    capacity: Some(events::Resources {
                        sandboxes: Some(10),
                        cpu_millis: Some(10_000),
                        memory_mb: Some(10_000),
                        metadata_bytes: None,
                    }),
                    ..Default::default()
                })],
            );
            let index = 2 + i as u64;
            assert_eq!(state.apply_batch(index, &registered), Outcome::Applied { index });
        }
        let id = format!("{:016x}{:04x}", 0xfeed_u64, 1);
        let created = t(
            2,
            vec![Event::SandboxCreated(events::SandboxCreated {
                id: id.clone(),
                project: "root".into(),
                edge: "e2".into(),
                image: "busybox".into(),
                cpu_millis: 100,
                memory_mb: 64,
                ..Default::default()
            })],
        );
        assert_eq!(state.apply_batch(4, &created), Outcome::Applied { index: 4 });
        let killed = t(
            3,
            vec![Event::SandboxKillRequested(events::SandboxKillRequested {
                id: id.clone(),
                reason: "done".into(),
            })],
        );
        assert_eq!(state.apply_batch(5, &killed), Outcome::Applied { index: 5 });
        // Two hours of log time later, it has left the views.
        let later = t(
            2 * 3_600_000,
            vec![Event::SandboxTimedOut(events::SandboxTimedOut {
                id: "other".into(),
                filesystem: false,
            })],
        );
        state.apply_batch(6, &later);
        assert!(!state.sandboxes.sandboxes.contains_key(&id));
        assert_eq!(
            slice_events(&state, "e2", 5, &killed).len(),
            1,
            "its own edge still gets its kill"
        );
        assert!(slice_events(&state, "e1", 5, &killed).is_empty(), "no other edge does");
    }
}
