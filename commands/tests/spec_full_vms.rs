//! Full VM sandboxes (`isolation: vm`, QEMU q35 booting the image as a whole disk):
//! where they go, how much memory they need, what their forks and snapshots are.

mod support;

use opendsec_commands::{
    Command, FULLVM_LABEL, MICROVM_LABEL, Observation, RejectionKind as K, SandboxOptions, SnapshotResult,
};
use opendsec_projections::{AuditResult, Event, Isolation, SnapshotState};
use support::*;

fn create(project: &str, image: &str, memory_mb: u64, isolation: Option<Isolation>) -> Command {
    Command::CreateSandbox {
        project: project.into(),
        image: image.into(),
        cpu_millis: 1000,
        memory_mb,
        labels: Default::default(),
        timeout_seconds: None,
        opts: SandboxOptions {
            isolation,
            ..Default::default()
        },
    }
}

/// Edge `full` runs full VMs and microVMs, `micro` only microVMs, `plain` only containers.
fn three_kinds_of_edge() -> (World, String) {
    let mut w = World::new();
    let admin = w.bootstrap();
    w.edge_labelled(
        &admin,
        "full",
        capacity(100, 100_000, 100_000),
        labels(&[(MICROVM_LABEL, "qemu"), (FULLVM_LABEL, "q35")]),
    );
    w.edge_labelled(
        &admin,
        "micro",
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

#[test]
fn a_full_vm_goes_only_to_an_edge_labelled_for_full_vms_and_its_event_says_vm() {
    let (mut w, admin) = three_kinds_of_edge();
    let root = w.root.clone();
    for _ in 0..8 {
        let ran = w.run(&admin, create(&root, "base", 512, Some(Isolation::Vm))).unwrap();
        let [c] = created(&ran).try_into().unwrap();
        assert_eq!((c.edge.as_str(), c.isolation.as_str()), ("full", "vm"));
        assert_eq!(w.state.sandboxes.sandboxes[&c.id].isolation, Isolation::Vm);
    }
    let view = w.state.view_json("sandboxes").unwrap();
    let vms = view["sandboxes"]
        .as_object()
        .unwrap()
        .values()
        .filter(|s| s["isolation"] == "vm")
        .count();
    assert_eq!(vms, 8, "the view names the isolation");
}

#[test]
fn without_an_edge_that_runs_full_vms_a_full_vm_is_refused_and_the_refusal_logged() {
    let mut w = World::new();
    let admin = w.bootstrap();
    w.edge_labelled(
        &admin,
        "micro",
        capacity(100, 100_000, 100_000),
        labels(&[(MICROVM_LABEL, "qemu")]),
    );
    let root = w.root.clone();
    let err = w
        .run(&admin, create(&root, "base", 512, Some(Isolation::Vm)))
        .unwrap_err();
    assert_eq!(err.kind, K::NoCapacity);
    assert!(err.message.contains("full VM"), "{}", err.message);
    assert!(matches!(w.last_audit().result, AuditResult::Denied { .. }));
}

#[test]
fn when_no_registered_edge_runs_full_vms_the_refusal_names_the_isolation_and_the_tools_it_needs() {
    let mut w = World::new();
    let admin = w.bootstrap();
    w.edge_labelled(
        &admin,
        "micro",
        capacity(100, 100_000, 100_000),
        labels(&[(MICROVM_LABEL, "qemu")]),
    );
    let root = w.root.clone();
    let err = w
        .run(&admin, create(&root, "base", 512, Some(Isolation::Vm)))
        .unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::NoCapacity, Some("isolation")));
    assert!(
        err.message.starts_with("no registered edge runs full VMs: "),
        "{}",
        err.message
    );
    for tool in ["QEMU", "qemu-img", "extlinux", "./ops/up.sh", "restart the edge"] {
        assert!(err.message.contains(tool), "names {tool}: {}", err.message);
    }
}

#[test]
fn a_full_vm_needs_memory_for_its_firmware_kernel_and_agent() {
    let (mut w, admin) = three_kinds_of_edge();
    let root = w.root.clone();
    let before = w.log.len();
    let err = w
        .run(&admin, create(&root, "base", 96, Some(Isolation::Vm)))
        .unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::Invalid, Some("memory_mb")));
    assert!(err.message.contains("full VM needs at least 128"), "{}", err.message);
    assert_eq!(w.log.len(), before, "bad input is not logged");
}

#[test]
fn forks_and_snapshots_of_a_full_vm_are_full_vms_on_its_edge() {
    let (mut w, admin) = three_kinds_of_edge();
    let root = w.root.clone();
    let src = w
        .run(&admin, create(&root, "base", 512, Some(Isolation::Vm)))
        .unwrap()
        .decided
        .target;
    w.report(&admin, &src, Observation::Ready);
    let ran = w
        .run(
            &admin,
            Command::ForkSandbox {
                sandbox: src.clone(),
                count: 2,
                edge: None,
            },
        )
        .unwrap();
    for c in created(&ran) {
        assert_eq!(
            (c.edge.as_str(), c.isolation.as_str(), c.fork_of.as_str()),
            ("full", "vm", src.as_str())
        );
    }
    let err = w
        .run(
            &admin,
            Command::ForkSandbox {
                sandbox: src.clone(),
                count: 65,
                edge: None,
            },
        )
        .unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::Invalid, Some("count")));

    let snap = w
        .run(
            &admin,
            Command::CreateSnapshot {
                sandbox: src.clone(),
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
    let x = &w.state.snapshots.snapshots[&snap];
    assert_eq!((x.isolation, x.state), (Isolation::Vm, SnapshotState::Ready));

    // What starts from it is a full VM of its source's size on its edge; asking for
    // another isolation is refused, naming the field.
    let ran = w.run(&admin, create(&root, &snap, 256, None)).unwrap();
    let [c] = created(&ran).try_into().unwrap();
    assert_eq!(
        (c.edge.as_str(), c.isolation.as_str(), c.memory_mb),
        ("full", "vm", 512)
    );
    for other in [Isolation::Microvm, Isolation::Container] {
        let err = w.run(&admin, create(&root, &snap, 512, Some(other))).unwrap_err();
        assert_eq!(
            (err.kind, err.field.as_deref()),
            (K::Invalid, Some("opts.isolation")),
            "{other:?}"
        );
        assert!(err.message.contains("full VM's memory"), "{}", err.message);
    }
}
