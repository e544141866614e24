//! Forks and sandboxes started from snapshots across edges: they go to the edge holding
//! their source's state while it has room (and admits them), elsewhere once it has not;
//! the events record that edge (`source_edge`) and, for a copy placed elsewhere, the id
//! under which the source edge serves the state (`transfer`).

mod support;

use opendsec_commands::{
    Caller, Command, MICROVM_LABEL, Observation, RejectionKind as K, SandboxOptions, SnapshotResult, decide_excluding,
};
use opendsec_projections::pb::SandboxCreated;
use opendsec_projections::{Event, Isolation};
use std::collections::{BTreeMap, BTreeSet};
use support::*;

fn created(events: &[Event]) -> Vec<SandboxCreated> {
    events
        .iter()
        .filter_map(|e| {
            if let Event::SandboxCreated(c) = e {
                Some(c.clone())
            } else {
                None
            }
        })
        .collect()
}

/// (edge, transfer) of each copy, in order.
fn where_each(events: &[Event]) -> Vec<(String, String)> {
    created(events).into_iter().map(|c| (c.edge, c.transfer)).collect()
}

fn create(project: &str, image: &str, isolation: Option<Isolation>) -> Command {
    Command::CreateSandbox {
        project: project.into(),
        image: image.into(),
        cpu_millis: 1000,
        memory_mb: 256,
        labels: BTreeMap::new(),
        timeout_seconds: None,
        opts: SandboxOptions {
            isolation,
            ..Default::default()
        },
    }
}

/// Edges `a` (room for `a_room` sandboxes) and `b` (roomy), both running microVMs, and a
/// running sandbox of `isolation` on `a`: (world, admin, sandbox).
fn source_on_a(a_room: u64, isolation: Option<Isolation>) -> (World, String, String) {
    let mut w = World::new();
    let admin = w.bootstrap();
    let vm = labels(&[(MICROVM_LABEL, "qemu")]);
    w.edge_labelled(&admin, "a", capacity(a_room, 100_000, 100_000), vm.clone());
    let root = w.root.clone();
    let src = w.run(&admin, create(&root, "base", isolation)).unwrap().decided.target;
    w.edge_labelled(&admin, "b", capacity(100, 100_000, 100_000), vm);
    w.report(&admin, &src, Observation::Ready);
    (w, admin, src)
}

fn fork(sandbox: &str, count: u32, edge: Option<&str>) -> Command {
    Command::ForkSandbox {
        sandbox: sandbox.into(),
        count,
        edge: edge.map(str::to_string),
    }
}

#[test]
fn fork_copies_fill_the_source_s_edge_first_and_the_rest_pull_from_it_under_one_transfer_id() {
    for isolation in [None, Some(Isolation::Microvm)] {
        let (mut w, admin, src) = source_on_a(3, isolation);
        let ran = w.run(&admin, fork(&src, 4, None)).unwrap();
        let copies = created(&ran.decided.events);
        let at = where_each(&ran.decided.events);
        // Two copies fit beside the source on `a`; the other two go to `b`.
        let transfer = format!("fork-{}", copies[2].id);
        assert_eq!(
            at,
            vec![
                ("a".into(), "".into()),
                ("a".into(), "".into()),
                ("b".into(), transfer.clone()),
                ("b".into(), transfer)
            ],
            "{isolation:?}"
        );
        for c in &copies {
            assert_eq!((c.source_edge.as_str(), c.fork_of.as_str()), ("a", src.as_str()));
            // The id still names the edge that runs it (invariant 4).
            assert_eq!(
                opendsec_commands::edge_ordinal_of(&c.id),
                Some(w.state.placement.edges[&c.edge].ordinal)
            );
        }
        // The views show it, and a replay of the log gives the same state.
        let v = &w.state.sandboxes.sandboxes[&copies[3].id];
        assert_eq!(
            (v.source_edge.as_deref(), v.transfer.as_deref()),
            (Some("a"), Some(format!("fork-{}", copies[2].id).as_str()))
        );
        assert_eq!(w.replayed().to_bytes(), w.state.to_bytes());
    }
}

#[test]
fn an_edge_asked_for_takes_every_copy_and_a_bad_one_is_refused_naming_the_field() {
    let (mut w, admin, src) = source_on_a(10, Some(Isolation::Microvm));
    let ran = w.run(&admin, fork(&src, 2, Some("b"))).unwrap();
    let copies = created(&ran.decided.events);
    let transfer = format!("fork-{}", copies[0].id);
    assert_eq!(
        where_each(&ran.decided.events),
        vec![("b".into(), transfer.clone()), ("b".into(), transfer)]
    );
    // Asking for the source's own edge needs no transfer.
    let ran = w.run(&admin, fork(&src, 1, Some("a"))).unwrap();
    assert_eq!(where_each(&ran.decided.events), vec![("a".into(), "".into())]);

    let before = w.log.len();
    let err = w.run(&admin, fork(&src, 1, Some("nowhere"))).unwrap_err();
    assert_eq!(
        (err.kind, err.field.as_deref()),
        (K::NotFound, Some("edge")),
        "{}",
        err.message
    );
    let err = w.run(&admin, fork(&src, 1, Some("bad name!"))).unwrap_err();
    assert_eq!(
        (err.kind, err.field.as_deref()),
        (K::Invalid, Some("edge")),
        "{}",
        err.message
    );
    assert_eq!(w.log.len(), before, "bad input is not logged");
    // An edge that runs no microVMs cannot take a microVM's copy: a logged denial naming it.
    w.edge(&admin, "plain", capacity(100, 100_000, 100_000));
    let err = w.run(&admin, fork(&src, 1, Some("plain"))).unwrap_err();
    assert_eq!(
        (err.kind, err.field.as_deref()),
        (K::NoCapacity, Some("edge")),
        "{}",
        err.message
    );
    assert!(err.message.contains("plain"), "{}", err.message);
}

#[test]
fn when_the_source_s_edge_refuses_at_admission_the_copies_are_placed_on_another_edge() {
    let (w, admin, src) = source_on_a(10, None);
    let ctx = opendsec_commands::Ctx {
        time_ms: 1,
        seed: 7,
        request_id: "r".into(),
        caller: Caller::Token(admin),
    };
    let refused: BTreeSet<String> = ["a".to_string()].into();
    let d = decide_excluding(&w.state, &w.inflight, &fork(&src, 2, None), &ctx, &refused).unwrap();
    let copies = created(&d.events);
    assert!(
        copies
            .iter()
            .all(|c| c.edge == "b" && c.source_edge == "a" && c.transfer == format!("fork-{}", copies[0].id))
    );
    assert_eq!(copies[0].placement.as_ref().unwrap().refused_by, vec!["a".to_string()]);
    // The same inputs decide the same way.
    assert_eq!(
        decide_excluding(&w.state, &w.inflight, &fork(&src, 2, None), &ctx, &refused).unwrap(),
        d
    );
}

#[test]
fn a_sandbox_from_a_snapshot_whose_edge_is_full_starts_elsewhere_and_pulls_the_snapshot() {
    for isolation in [None, Some(Isolation::Microvm)] {
        // `a` holds the source and has room for one more: the first sandbox from the
        // snapshot goes there, the second elsewhere.
        let (mut w, admin, src) = source_on_a(2, isolation);
        let root = w.root.clone();
        let snap = w
            .run(
                &admin,
                Command::CreateSnapshot {
                    sandbox: src.clone(),
                    name: "s".into(),
                },
            )
            .unwrap()
            .decided
            .target;
        w.run(
            &admin,
            Command::ReportSnapshot {
                snapshot: snap.clone(),
                result: SnapshotResult::Ready { size_bytes: 1 },
            },
        )
        .unwrap();
        let first = w.run(&admin, create(&root, &snap, None)).unwrap();
        assert_eq!(where_each(&first.decided.events), vec![("a".into(), "".into())]);
        let second = w.run(&admin, create(&root, &snap, None)).unwrap();
        assert_eq!(
            where_each(&second.decided.events),
            vec![("b".into(), snap.clone())],
            "{isolation:?}"
        );
        let [c] = created(&second.decided.events).try_into().unwrap();
        assert_eq!((c.source_edge.as_str(), c.snapshot.as_str()), ("a", snap.as_str()));
        // A sandbox from an image has no source edge.
        let plain = w.run(&admin, create(&root, "base", None)).unwrap();
        assert!(
            created(&plain.decided.events)
                .iter()
                .all(|c| c.source_edge.is_empty() && c.transfer.is_empty())
        );
    }
}
