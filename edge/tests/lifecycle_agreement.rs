//! Property: the edge's desired state and the control plane's views agree on every
//! sandbox of the edge, whatever the sequence of events (creations on either edge, forks
//! and starts from snapshots across edges, pause and resume requests and their results,
//! kills, timeouts, ready/exited/failed reports, snapshots), and whether the edge
//! follows its slice entry by entry or restarts from a slice snapshot at any point.
//! Both fold through `opendsec_projections::Lifecycle`; this checks they cannot drift.

use opendsec_edge::desired::{SliceState, SnapshotPhase};
use opendsec_edge_api::pb::{SliceEntry, SliceMessage, slice_message::Body};
use opendsec_edge_api::slice::{slice_events, slice_snapshot};
use opendsec_projections::pb;
use opendsec_projections::schema::Batch;
use opendsec_projections::{Event, Isolation, Lifecycle, Observed, Outcome, SnapshotState, State};
use proptest::prelude::*;
use std::collections::BTreeMap;

/// The edge under test; "e2" is another edge, to create on, fork to and serve.
const EDGE: &str = "e1";
const ROOT: &str = "root";

/// An event to make, its references left abstract: indexes are resolved, modulo the
/// length, against the sandboxes and snapshots that exist when it is made.
#[derive(Clone, Debug)]
enum Op {
    Create {
        here: bool,
        timeout: bool,
        vm: bool,
    },
    Fork {
        source: usize,
        here: bool,
    },
    StartFromSnapshot {
        snapshot: usize,
        here: bool,
    },
    Sandbox {
        sandbox: usize,
        what: u8,
    },
    TakeSnapshot {
        sandbox: usize,
    },
    SnapshotResult {
        snapshot: usize,
        what: u8,
    },
    /// The edge restarts from a slice snapshot (its history was compacted away).
    Resync,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (any::<bool>(), any::<bool>(), any::<bool>())
            .prop_map(|(here, timeout, vm)| Op::Create { here, timeout, vm }),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(source, here)| Op::Fork { source, here }),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(snapshot, here)| Op::StartFromSnapshot { snapshot, here }),
        10 => (any::<usize>(), 0u8..14).prop_map(|(sandbox, what)| Op::Sandbox { sandbox, what }),
        1 => any::<usize>().prop_map(|sandbox| Op::TakeSnapshot { sandbox }),
        2 => (any::<usize>(), 0u8..3).prop_map(|(snapshot, what)| Op::SnapshotResult { snapshot, what }),
        1 => Just(Op::Resync),
    ]
}

struct World {
    state: State,
    edge: SliceState,
    next_id: u64,
}

impl World {
    fn new() -> World {
        let mut w = World {
            state: State::new(),
            edge: SliceState::new(EDGE),
            next_id: 0,
        };
        w.log(vec![Event::ProjectCreated(pb::ProjectCreated {
            id: ROOT.into(),
            name: "root".into(),
            parent: String::new(),
        })]);
        for edge in [EDGE, "e2"] {
            let ordinal = w.state.placement.next_ordinal;
            w.log(vec![Event::EdgeRegistered(pb::EdgeRegistered {
                id: edge.into(),
                ordinal,
                address: format!("{edge}:1"),
                capacity: Some(pb::Resources {
                    sandboxes: Some(1_000_000),
                    cpu_millis: Some(u64::MAX / 4),
                    memory_mb: Some(u64::MAX / 4),
                    metadata_bytes: None,
                }),
                labels: BTreeMap::new(),
                token: String::new(),
            })]);
        }
        w
    }

    fn fresh(&mut self, prefix: &str) -> String {
        self.next_id += 1;
        format!("{prefix}{}", self.next_id)
    }

    /// Logs one batch: the views fold it, and the edge gets its slice of it, as the
    /// `EdgeSlice` service streams it.
    fn log(&mut self, events: Vec<Event>) {
        let index = self.state.index + 1;
        let batch = Batch {
            time_ms: 1_000 + index,
            events: events.iter().map(Event::to_envelope).collect(),
            ..Default::default()
        };
        let outcome = self.state.apply_batch(index, &batch);
        // The generator makes only events valid against the views: the property is
        // about what the log applies.
        assert_eq!(outcome, Outcome::Applied { index }, "{events:?}");
        let mine = slice_events(&self.state, EDGE, index, &batch);
        if !mine.is_empty() {
            let entry = SliceEntry {
                index,
                time_ms: batch.time_ms,
                events: mine,
            };
            self.edge
                .try_apply(&SliceMessage {
                    body: Some(Body::Entry(entry)),
                })
                .expect("the edge folds every event the log applied");
        }
    }

    fn sandbox_ids(&self) -> Vec<String> {
        self.state.sandboxes.sandboxes.keys().cloned().collect()
    }

    fn created(&mut self, here: bool, isolation: Isolation, from: Option<(String, String, String)>) -> Event {
        let edge = if here { EDGE } else { "e2" }.to_string();
        let id = self.fresh("sb");
        let (fork_of, snapshot, source_edge) = from.unwrap_or_default();
        let transfer = if source_edge.is_empty() || source_edge == edge {
            String::new()
        } else if !snapshot.is_empty() {
            snapshot.clone()
        } else {
            format!("fork-{id}")
        };
        Event::SandboxCreated(pb::SandboxCreated {
            id,
            project: ROOT.into(),
            edge,
            image: "busybox".into(),
            cpu_millis: 100,
            memory_mb: 64,
            fork_of,
            snapshot,
            isolation: isolation.to_event(),
            source_edge,
            transfer,
            ..Default::default()
        })
    }

    fn step(&mut self, op: &Op) {
        let sandboxes = self.sandbox_ids();
        let pick = |i: usize| (!sandboxes.is_empty()).then(|| sandboxes[i % sandboxes.len()].clone());
        match op {
            Op::Create { here, timeout, vm } => {
                let isolation = if *vm { Isolation::Microvm } else { Isolation::Container };
                let mut ev = self.created(*here, isolation, None);
                if let (Event::SandboxCreated(c), true) = (&mut ev, timeout) {
                    c.expires_at_ms = 50_000;
                }
                self.log(vec![ev]);
            }
            Op::Fork { source, here } => {
                let Some(src) = pick(*source) else { return };
                let s = &self.state.sandboxes.sandboxes[&src];
                if !s.is_live() {
                    return;
                }
                let (isolation, source_edge) = (s.isolation, s.edge.clone());
                let child = self.created(*here, isolation, Some((src.clone(), String::new(), source_edge)));
                let children = vec![child.sandbox_id().expect("a creation names its sandbox").to_string()];
                self.log(vec![
                    Event::SandboxForkRequested(pb::SandboxForkRequested { id: src, children }),
                    child,
                ]);
            }
            Op::StartFromSnapshot { snapshot, here } => {
                let ready: Vec<_> = self
                    .state
                    .snapshots
                    .snapshots
                    .values()
                    .filter(|x| x.state == SnapshotState::Ready)
                    .map(|x| (x.id.clone(), x.edge.clone(), x.isolation))
                    .collect();
                if ready.is_empty() {
                    return;
                }
                let (id, edge, isolation) = ready[snapshot % ready.len()].clone();
                let ev = self.created(*here, isolation, Some((String::new(), id, edge)));
                self.log(vec![ev]);
            }
            Op::Sandbox { sandbox, what } => {
                let Some(id) = pick(*sandbox) else { return };
                let ev = match what {
                    0 => Event::SandboxPauseRequested(pb::SandboxPauseRequested { id, filesystem: false }),
                    1 => Event::SandboxResumeRequested(pb::SandboxResumeRequested { id, cold: false }),
                    2 => Event::SandboxKillRequested(pb::SandboxKillRequested {
                        id,
                        reason: "user".into(),
                    }),
                    3 => Event::SandboxTimeoutSet(pb::SandboxTimeoutSet {
                        id,
                        expires_at_ms: 90_000,
                    }),
                    4 => Event::SandboxTimedOut(pb::SandboxTimedOut { id, filesystem: false }),
                    5 => Event::SandboxLabelsSet(pb::SandboxLabelsSet {
                        id,
                        labels: BTreeMap::from([("at".to_string(), self.state.index.to_string())]),
                    }),
                    6 => Event::SandboxReady(pb::SandboxReady {
                        id,
                        ..Default::default()
                    }),
                    7 => Event::SandboxPaused(pb::SandboxPaused { id }),
                    8 => Event::SandboxResumed(pb::SandboxResumed { id }),
                    9 => Event::SandboxFailed(pb::SandboxFailed {
                        id,
                        reason: "lost".into(),
                    }),
                    11 => Event::SandboxPauseRequested(pb::SandboxPauseRequested { id, filesystem: true }),
                    12 => Event::SandboxResumeRequested(pb::SandboxResumeRequested { id, cold: true }),
                    13 => Event::SandboxTimedOut(pb::SandboxTimedOut { id, filesystem: true }),
                    _ => Event::SandboxExited(pb::SandboxExited {
                        id,
                        exit_code: 0,
                        ..Default::default()
                    }),
                };
                self.log(vec![ev]);
            }
            Op::TakeSnapshot { sandbox } => {
                let Some(id) = pick(*sandbox) else { return };
                let snapshot = self.fresh("snap");
                let s = &self.state.sandboxes.sandboxes[&id];
                if !s.is_live() {
                    return;
                }
                let ev = Event::SnapshotRequested(pb::SnapshotRequested {
                    id: snapshot,
                    sandbox: id,
                    project: ROOT.into(),
                    edge: s.edge.clone(),
                    name: String::new(),
                    image: s.image.clone(),
                    parent: s.snapshot.clone().unwrap_or_default(),
                    isolation: s.isolation.to_event(),
                });
                self.log(vec![ev]);
            }
            Op::SnapshotResult { snapshot, what } => {
                let all: Vec<_> = self.state.snapshots.snapshots.values().cloned().collect();
                if all.is_empty() {
                    return;
                }
                let x = &all[snapshot % all.len()];
                let (id, sandbox) = (x.id.clone(), x.sandbox.clone());
                let ev = match what {
                    0 => Event::SnapshotReady(pb::SnapshotReady {
                        id,
                        sandbox,
                        size_bytes: 1,
                    }),
                    1 => Event::SnapshotFailed(pb::SnapshotFailed {
                        id,
                        sandbox,
                        reason: "disk".into(),
                    }),
                    _ => Event::SnapshotDeleted(pb::SnapshotDeleted { id, sandbox }),
                };
                self.log(vec![ev]);
            }
            Op::Resync => {
                let snap = slice_snapshot(&self.state, EDGE);
                self.edge
                    .try_apply(&SliceMessage {
                        body: Some(Body::Snapshot(snap)),
                    })
                    .expect("the edge folds a slice snapshot");
            }
        }
    }
}

/// Where `edge` and the views disagree about the edge's sandboxes and snapshots.
fn disagreements(state: &State, edge: &SliceState) -> Vec<String> {
    let mut out = Vec::new();
    for (id, d) in &edge.sandboxes {
        let Some(s) = state.sandboxes.sandboxes.get(id) else {
            out.push(format!("{id}: on the edge, unknown to the views"));
            continue;
        };
        let ours = (
            &s.edge,
            s.desired,
            s.observed,
            s.expires_at_ms,
            s.pause_filesystem,
            &s.labels,
            s.isolation,
            &s.fork_of,
            &s.snapshot,
            &s.source_edge,
            &s.transfer,
        );
        let theirs = (
            &EDGE.to_string(),
            d.desired,
            d.observed,
            d.expires_at_ms,
            d.pause_filesystem,
            &d.labels,
            d.isolation,
            &d.fork_of,
            &d.snapshot,
            &d.source_edge,
            &d.transfer,
        );
        if ours != theirs {
            out.push(format!("{id}: views {ours:?}, edge {theirs:?}"));
        }
        let released = Lifecycle {
            desired: s.desired,
            observed: s.observed,
            expires_at_ms: s.expires_at_ms,
            filesystem: s.pause_filesystem,
        }
        .is_released();
        if released != s.released {
            out.push(format!(
                "{id}: released {} in the views, {released} by its lifecycle",
                s.released
            ));
        }
    }
    for s in state.sandboxes.sandboxes.values() {
        if s.edge == EDGE && s.is_live() && !edge.sandboxes.contains_key(&s.id) {
            out.push(format!(
                "{}: live on the edge in the views, missing from the edge",
                s.id
            ));
        }
        // Still to be served: a slice snapshot carries only these.
        let served_here = s.source_edge.as_deref() == Some(EDGE) && s.edge != EDGE && s.observed == Observed::Pending;
        if let (true, Some(t)) = (served_here && s.is_live(), &s.transfer) {
            let dest = edge.served.get(t).and_then(|t| t.destinations.get(&s.id));
            if dest != Some(&s.edge) {
                out.push(format!(
                    "{}: served by the edge as {t} to {}, edge has {dest:?}",
                    s.id, s.edge
                ));
            }
        }
    }
    for (id, d) in &edge.snapshots {
        let want = match state.snapshots.snapshots.get(id).map(|x| x.state) {
            None => SnapshotPhase::Deleted,
            Some(SnapshotState::Pending) => SnapshotPhase::Pending,
            Some(SnapshotState::Ready) => SnapshotPhase::Ready,
            Some(SnapshotState::Failed) => SnapshotPhase::Failed,
        };
        if d.phase != want {
            out.push(format!("snapshot {id}: views {want:?}, edge {:?}", d.phase));
        }
    }
    for x in state.snapshots.snapshots.values().filter(|x| x.edge == EDGE) {
        if !edge.snapshots.contains_key(&x.id) {
            out.push(format!("snapshot {}: in the views, missing from the edge", x.id));
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn the_edge_and_the_views_agree_on_every_sandbox_of_the_edge(ops in prop::collection::vec(op(), 1..80)) {
        let mut w = World::new();
        for op in &ops {
            w.step(op);
            let wrong = disagreements(&w.state, &w.edge);
            prop_assert!(wrong.is_empty(), "after {:?}: {:#?}", op, wrong);
        }
        // An edge that starts over from a slice snapshot now agrees as well.
        let mut fresh = SliceState::new(EDGE);
        fresh
            .try_apply(&SliceMessage { body: Some(Body::Snapshot(slice_snapshot(&w.state, EDGE))) })
            .expect("the edge folds a slice snapshot");
        let wrong = disagreements(&w.state, &fresh);
        prop_assert!(wrong.is_empty(), "from a snapshot: {:#?}", wrong);
    }
}
