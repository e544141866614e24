//! MicroVM sandboxes (the isolation a create may ask for, where they go, what their
//! forks and snapshots are) and tasks (one command pauses or resumes every sandbox of
//! a task).

mod support;

use opendsec_commands::{
    Command, MICROVM_LABEL, Observation, RejectionKind as K, SandboxOptions, SnapshotResult, TASK_LABEL,
};
use opendsec_projections::{AuditResult, Desired, Event, Isolation, Right};
use support::*;

fn create(project: &str, image: &str, memory_mb: u64, isolation: Option<Isolation>, task: Option<&str>) -> Command {
    Command::CreateSandbox {
        project: project.into(),
        image: image.into(),
        cpu_millis: 1000,
        memory_mb,
        labels: task.map(|t| labels(&[(TASK_LABEL, t)])).unwrap_or_default(),
        timeout_seconds: None,
        opts: SandboxOptions {
            isolation,
            ..Default::default()
        },
    }
}

fn microvm(project: &str) -> Command {
    create(project, "base", 256, Some(Isolation::Microvm), None)
}

/// Edge `vm` runs microVMs, edge `plain` only containers; returns (world, admin).
fn two_kinds_of_edge() -> (World, String) {
    let mut w = World::new();
    let admin = w.bootstrap();
    w.edge_labelled(
        &admin,
        "vm",
        capacity(100, 100_000, 100_000),
        labels(&[(MICROVM_LABEL, "qemu")]),
    );
    w.edge(&admin, "plain", capacity(100, 100_000, 100_000));
    (w, admin)
}

fn created(ran: &support::Ran) -> Vec<opendsec_projections::pb::SandboxCreated> {
    ran.decided
        .events
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

/// A running microVM and a ready snapshot of it: (world, admin, sandbox, snapshot).
fn microvm_snapshot() -> (World, String, String, String) {
    let (mut w, admin) = two_kinds_of_edge();
    let root = w.root.clone();
    let id = w
        .run(&admin, create(&root, "base", 384, Some(Isolation::Microvm), None))
        .unwrap()
        .decided
        .target;
    w.report(&admin, &id, Observation::Ready);
    let snap = w
        .run(
            &admin,
            Command::CreateSnapshot {
                sandbox: id.clone(),
                name: "warm".into(),
            },
        )
        .unwrap()
        .decided
        .target;
    w.run(
        &admin,
        Command::ReportSnapshot {
            snapshot: snap.clone(),
            result: SnapshotResult::Ready { size_bytes: 1 << 20 },
        },
    )
    .unwrap();
    (w, admin, id, snap)
}

#[test]
fn a_create_may_ask_for_a_microvm_and_it_goes_only_to_an_edge_that_runs_them() {
    let (mut w, admin) = two_kinds_of_edge();
    let root = w.root.clone();
    for _ in 0..8 {
        let ran = w.run(&admin, microvm(&root)).unwrap();
        let [c] = created(&ran).try_into().unwrap();
        assert_eq!((c.edge.as_str(), c.isolation.as_str()), ("vm", "microvm"));
        assert_eq!(w.state.sandboxes.sandboxes[&c.id].isolation, Isolation::Microvm);
    }
    // Containers stay the default, go anywhere, and their events and views read as before.
    let mut edges = std::collections::BTreeSet::new();
    for _ in 0..16 {
        let ran = w.run(&admin, create(&root, "base", 256, None, None)).unwrap();
        let [c] = created(&ran).try_into().unwrap();
        assert_eq!(c.isolation, "", "a container's event carries no isolation");
        edges.insert(c.edge);
    }
    assert_eq!(edges.len(), 2, "containers are placed on both edges");
    let view = w.state.view_json("sandboxes").unwrap();
    let isolations: Vec<_> = view["sandboxes"]
        .as_object()
        .unwrap()
        .values()
        .map(|s| s.get("isolation").cloned())
        .collect();
    assert_eq!(
        isolations.iter().filter(|i| i.is_none()).count(),
        16,
        "containers' views leave the field out"
    );
    assert_eq!(
        isolations
            .iter()
            .filter(|i| i.as_ref().is_some_and(|v| v == "microvm"))
            .count(),
        8
    );
}

#[test]
fn without_an_edge_that_runs_microvms_a_microvm_is_refused_and_the_refusal_logged() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let err = w.run(&admin, microvm(&root)).unwrap_err();
    assert_eq!(err.kind, K::NoCapacity);
    assert!(err.message.contains("microVM"), "{}", err.message);
    assert!(matches!(w.last_audit().result, AuditResult::Denied { .. }));
}

#[test]
fn when_no_registered_edge_runs_microvms_the_refusal_names_the_isolation_and_how_to_add_it() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let err = w.run(&admin, microvm(&root)).unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::NoCapacity, Some("isolation")));
    assert!(
        err.message.starts_with("no registered edge runs microVMs: "),
        "{}",
        err.message
    );
    assert!(err.message.contains("QEMU is installed"), "{}", err.message);
    assert!(err.message.contains("./ops/up.sh"), "{}", err.message);
    assert!(err.message.contains("restart the edge"), "{}", err.message);
    assert!(
        matches!(&w.last_audit().result, AuditResult::Denied { code, .. } if code == "no_capacity"),
        "the refusal is logged as before"
    );
}

#[test]
fn when_the_edges_that_run_microvms_are_full_the_refusal_says_they_have_no_room() {
    let mut w = World::new();
    let admin = w.bootstrap();
    w.edge_labelled(
        &admin,
        "vm",
        capacity(100, 100_000, 128),
        labels(&[(MICROVM_LABEL, "qemu")]),
    );
    w.edge(&admin, "plain", capacity(100, 100_000, 100_000));
    let root = w.root.clone();
    let err = w.run(&admin, microvm(&root)).unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::NoCapacity, None));
    assert_eq!(
        err.message,
        "no registered edge that runs microVMs has room for this sandbox"
    );
}

#[test]
fn a_deregistered_edge_offers_no_microvms() {
    let mut w = World::new();
    let admin = w.bootstrap();
    w.edge_labelled(
        &admin,
        "vm",
        capacity(100, 100_000, 100_000),
        labels(&[(MICROVM_LABEL, "qemu")]),
    );
    w.edge(&admin, "plain", capacity(100, 100_000, 100_000));
    w.run(&admin, Command::DeregisterEdge { edge: "vm".into() }).unwrap();
    let root = w.root.clone();
    let err = w.run(&admin, microvm(&root)).unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::NoCapacity, Some("isolation")));
    assert!(
        err.message.starts_with("no registered edge runs microVMs"),
        "{}",
        err.message
    );
}

#[test]
fn a_microvm_needs_enough_memory_for_its_kernel() {
    let (mut w, admin) = two_kinds_of_edge();
    let root = w.root.clone();
    let before = w.log.len();
    let err = w
        .run(&admin, create(&root, "base", 32, Some(Isolation::Microvm), None))
        .unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::Invalid, Some("memory_mb")));
    assert_eq!(w.log.len(), before, "bad input is not logged");
}

#[test]
fn forks_of_a_microvm_are_microvms_on_its_edge() {
    let (mut w, admin) = two_kinds_of_edge();
    let root = w.root.clone();
    let src = w.run(&admin, microvm(&root)).unwrap().decided.target;
    w.report(&admin, &src, Observation::Ready);
    let ran = w
        .run(
            &admin,
            Command::ForkSandbox {
                sandbox: src.clone(),
                count: 4,
                edge: None,
            },
        )
        .unwrap();
    let copies = created(&ran);
    assert_eq!(copies.len(), 4);
    for c in copies {
        assert_eq!(
            (c.edge.as_str(), c.isolation.as_str(), c.fork_of.as_str(), c.memory_mb),
            ("vm", "microvm", src.as_str(), 256)
        );
    }
    // Bad counts are refused, naming the field, and change nothing.
    let before = w.log.len();
    for count in [0, 65, 10_000] {
        let err = w
            .run(
                &admin,
                Command::ForkSandbox {
                    sandbox: src.clone(),
                    count,
                    edge: None,
                },
            )
            .unwrap_err();
        assert_eq!(
            (err.kind, err.field.as_deref()),
            (K::Invalid, Some("count")),
            "count {count}"
        );
    }
    assert_eq!(w.log.len(), before);
}

#[test]
fn a_microvm_snapshot_holds_its_machine_and_what_starts_from_it_is_that_machine() {
    let (mut w, admin, src, snap) = microvm_snapshot();
    let root = w.root.clone();
    let x = &w.state.snapshots.snapshots[&snap];
    assert_eq!((x.isolation, x.parent.as_deref()), (Isolation::Microvm, None));
    // Without asking, with any size: a microVM of its source's size, on its edge.
    let ran = w.run(&admin, create(&root, &snap, 999, None, None)).unwrap();
    let [c] = created(&ran).try_into().unwrap();
    assert_eq!(
        (
            c.isolation.as_str(),
            c.snapshot.as_str(),
            c.edge.as_str(),
            c.memory_mb,
            c.cpu_millis
        ),
        ("microvm", snap.as_str(), "vm", 384, 1000)
    );
    assert_eq!(
        w.state.sandboxes.sandboxes[&c.id].memory_mb, 384,
        "quota counts what it really takes"
    );
    // A snapshot of a sandbox started from a snapshot stands on its own.
    w.report(&admin, &c.id, Observation::Ready);
    let again = w
        .run(
            &admin,
            Command::CreateSnapshot {
                sandbox: c.id.clone(),
                name: String::new(),
            },
        )
        .unwrap()
        .decided
        .target;
    assert_eq!(w.state.snapshots.snapshots[&again].parent, None);
    // Asking for a container from it is refused, naming the field.
    let err = w
        .run(&admin, create(&root, &snap, 256, Some(Isolation::Container), None))
        .unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::Invalid, Some("opts.isolation")));
    let _ = src;
}

#[test]
fn a_container_s_file_system_snapshot_starts_only_containers() {
    let (mut w, admin) = two_kinds_of_edge();
    let root = w.root.clone();
    let id = w
        .run(&admin, create(&root, "base", 256, None, None))
        .unwrap()
        .decided
        .target;
    w.report(&admin, &id, Observation::Ready);
    let snap = w
        .run(
            &admin,
            Command::CreateSnapshot {
                sandbox: id,
                name: String::new(),
            },
        )
        .unwrap()
        .decided
        .target;
    assert_eq!(w.state.snapshots.snapshots[&snap].isolation, Isolation::Container);
    w.run(
        &admin,
        Command::ReportSnapshot {
            snapshot: snap.clone(),
            result: SnapshotResult::Ready { size_bytes: 1 },
        },
    )
    .unwrap();
    let err = w
        .run(&admin, create(&root, &snap, 256, Some(Isolation::Microvm), None))
        .unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::Invalid, Some("opts.isolation")));
}

#[test]
fn a_task_pause_pauses_every_running_sandbox_of_the_task_in_the_caller_s_subtree_in_one_logged_decision() {
    let (mut w, admin) = two_kinds_of_edge();
    let root = w.root.clone();
    let team = w.project(&admin, &root, "team");
    let other = w.project(&admin, &root, "other");
    let lead = w.issue(&admin, &team, &[Right::SandboxWrite, Right::SandboxRead], None);
    let mut task = Vec::new();
    for isolation in [None, None, Some(Isolation::Microvm)] {
        task.push(
            w.run(&lead, create(&team, "base", 256, isolation, Some("t1")))
                .unwrap()
                .decided
                .target,
        );
    }
    let elsewhere = w
        .run(&admin, create(&other, "base", 256, None, Some("t1")))
        .unwrap()
        .decided
        .target;
    let other_task = w
        .run(&lead, create(&team, "base", 256, None, Some("t2")))
        .unwrap()
        .decided
        .target;
    // One of them was paused on its own already: it is left alone.
    w.run(
        &lead,
        Command::PauseSandbox {
            sandbox: task[0].clone(),
            filesystem: false,
        },
    )
    .unwrap();

    let ran = w.run(&lead, Command::PauseTask { task: "t1".into() }).unwrap();
    let paused: Vec<_> = ran
        .decided
        .events
        .iter()
        .map(|e| match e {
            Event::SandboxPauseRequested(p) => p.id.clone(),
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    assert_eq!(paused, {
        let mut v = task[1..].to_vec();
        v.sort();
        v
    });
    let audit = w.last_audit();
    assert_eq!(
        (audit.action.as_str(), audit.target.as_str(), audit.project.as_str()),
        ("task.pause", "task:t1", team.as_str())
    );
    for id in &task {
        assert_eq!(w.state.sandboxes.sandboxes[id].desired, Desired::Paused);
    }
    for id in [&elsewhere, &other_task] {
        assert_eq!(
            w.state.sandboxes.sandboxes[id].desired,
            Desired::Running,
            "{id} is not part of this task"
        );
    }

    let ran = w.run(&lead, Command::ResumeTask { task: "t1".into() }).unwrap();
    assert_eq!(
        ran.decided.events.len(),
        3,
        "all three resume, the one paused on its own too"
    );
    assert!(
        task.iter()
            .all(|id| w.state.sandboxes.sandboxes[id].desired == Desired::Running)
    );
    // Again: nothing to do, and that is fine.
    assert!(
        w.run(&lead, Command::ResumeTask { task: "t1".into() })
            .unwrap()
            .decided
            .events
            .is_empty()
    );
}

#[test]
fn a_task_nobody_works_for_is_not_found_and_a_caller_without_the_right_is_denied() {
    let (mut w, admin) = two_kinds_of_edge();
    let root = w.root.clone();
    w.run(&admin, create(&root, "base", 256, None, Some("t1"))).unwrap();
    let before = w.log.len();
    let err = w.run(&admin, Command::PauseTask { task: "nobody".into() }).unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::NotFound, Some("task")));
    let err = w.run(&admin, Command::PauseTask { task: String::new() }).unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::Invalid, Some("task")));
    assert_eq!(w.log.len(), before, "neither is logged");
    let reader = w.issue(&admin, &root, &[Right::SandboxRead], None);
    assert_eq!(
        w.run(&reader, Command::PauseTask { task: "t1".into() })
            .unwrap_err()
            .kind,
        K::Forbidden
    );
    assert_eq!(w.last_audit().target, "task:t1", "a denial is audited against the task");
}

#[test]
fn replaying_microvms_snapshots_and_task_pauses_gives_the_same_state() {
    let (mut w, admin, src, snap) = microvm_snapshot();
    let root = w.root.clone();
    w.run(&admin, create(&root, &snap, 256, None, Some("t"))).unwrap();
    w.run(&admin, create(&root, "base", 256, None, Some("t"))).unwrap();
    w.run(
        &admin,
        Command::ForkSandbox {
            sandbox: src,
            count: 2,
            edge: None,
        },
    )
    .unwrap();
    w.run(&admin, Command::PauseTask { task: "t".into() }).unwrap();
    w.run(&admin, Command::ResumeTask { task: "t".into() }).unwrap();
    assert_eq!(w.replayed().to_bytes(), w.state.to_bytes());
}

#[test]
fn a_vm_may_pause_with_its_file_system_only_and_boot_again_whichever_vmm_runs_it() {
    let (mut w, admin) = two_kinds_of_edge();
    let root = w.root.clone();
    for vmm in ["qemu", "firecracker"] {
        let vm = w.run(&admin, microvm(&root)).unwrap().decided.target;
        w.report(
            &admin,
            &vm,
            Observation::VmReady {
                vmm: vmm.into(),
                accelerator: "kvm".into(),
            },
        );
        w.run(
            &admin,
            Command::PauseSandbox {
                sandbox: vm.clone(),
                filesystem: true,
            },
        )
        .unwrap();
        assert!(w.state.sandboxes.sandboxes[&vm].pause_filesystem, "{vmm}");
        w.run(
            &admin,
            Command::ResumeSandbox {
                sandbox: vm.clone(),
                cold: true,
            },
        )
        .unwrap();
    }
    assert_eq!(w.replayed().to_bytes(), w.state.to_bytes());
}
