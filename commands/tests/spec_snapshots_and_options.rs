//! File-system snapshots, the create options E2B needs (environment, auto-pause and
//! auto-resume, network settings), and where forks and sandboxes from snapshots go.

mod support;

use opendsec_commands::{Command, Observation, RejectionKind as K, SandboxOptions, SnapshotResult};
use opendsec_projections::{Desired, Event, Outcome, SnapshotState};
use std::collections::BTreeMap;
use support::*;

fn create_with(project: &str, image: &str, opts: SandboxOptions) -> Command {
    Command::CreateSandbox {
        project: project.into(),
        image: image.into(),
        cpu_millis: 500,
        memory_mb: 256,
        labels: BTreeMap::new(),
        timeout_seconds: Some(60),
        opts,
    }
}

/// A world with two roomy edges and one running sandbox; returns (world, admin, sandbox).
fn running() -> (World, String, String) {
    let mut w = World::new();
    let admin = w.bootstrap();
    w.edge(&admin, "a", capacity(100, 100_000, 100_000));
    w.edge(&admin, "b", capacity(100, 100_000, 100_000));
    let root = w.root.clone();
    let id = w.sandbox(&admin, &root);
    w.report(&admin, &id, Observation::Ready);
    (w, admin, id)
}

fn snapshot_of(w: &mut World, admin: &str, sandbox: &str) -> String {
    let ran = w
        .run(
            admin,
            Command::CreateSnapshot {
                sandbox: sandbox.into(),
                name: "before".into(),
            },
        )
        .unwrap();
    let snap = ran.decided.target.clone();
    w.run(
        admin,
        Command::ReportSnapshot {
            snapshot: snap.clone(),
            result: SnapshotResult::Ready { size_bytes: 4096 },
        },
    )
    .unwrap();
    snap
}

#[test]
fn a_snapshot_is_pending_until_its_edge_reports_it_then_ready() {
    let (mut w, admin, id) = running();
    let ran = w
        .run(
            &admin,
            Command::CreateSnapshot {
                sandbox: id.clone(),
                name: "v1".into(),
            },
        )
        .unwrap();
    let snap = ran.decided.target.clone();
    let x = &w.state.snapshots.snapshots[&snap];
    assert_eq!(
        (x.state, x.sandbox.as_str(), x.edge.as_str(), x.name.as_str()),
        (
            SnapshotState::Pending,
            id.as_str(),
            w.state.sandboxes.sandboxes[&id].edge.as_str(),
            "v1"
        )
    );
    w.run(
        &admin,
        Command::ReportSnapshot {
            snapshot: snap.clone(),
            result: SnapshotResult::Ready { size_bytes: 123 },
        },
    )
    .unwrap();
    assert_eq!(w.state.snapshots.snapshots[&snap].state, SnapshotState::Ready);
    assert_eq!(w.state.snapshots.snapshots[&snap].size_bytes, 123);
    // A second report is a conflict: the first one stands.
    let err = w
        .run(
            &admin,
            Command::ReportSnapshot {
                snapshot: snap,
                result: SnapshotResult::Failed { reason: "late".into() },
            },
        )
        .unwrap_err();
    assert_eq!(err.kind, K::Conflict);
}

#[test]
fn a_sandbox_started_from_a_snapshot_runs_on_the_snapshot_s_edge_with_its_image() {
    let (mut w, admin, id) = running();
    let snap = snapshot_of(&mut w, &admin, &id);
    let edge = w.state.sandboxes.sandboxes[&id].edge.clone();
    let root = w.root.clone();
    for _ in 0..8 {
        let ran = w
            .run(&admin, create_with(&root, &snap, SandboxOptions::default()))
            .unwrap();
        let [Event::SandboxCreated(c)] = ran.decided.events.as_slice() else {
            panic!()
        };
        assert_eq!(c.edge, edge, "the snapshot's files live on its edge");
        assert_eq!(c.image, "base", "beneath the snapshot is the source's image");
        assert_eq!(c.snapshot, snap);
        assert_eq!(c.template, snap);
    }
}

#[test]
fn a_pending_snapshot_cannot_be_started_from_and_a_failed_one_never_can() {
    let (mut w, admin, id) = running();
    let root = w.root.clone();
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
    assert_eq!(
        w.run(&admin, create_with(&root, &snap, SandboxOptions::default()))
            .unwrap_err()
            .kind,
        K::Conflict
    );
    w.run(
        &admin,
        Command::ReportSnapshot {
            snapshot: snap.clone(),
            result: SnapshotResult::Failed {
                reason: "disk full".into(),
            },
        },
    )
    .unwrap();
    assert_eq!(w.state.snapshots.snapshots[&snap].reason.as_deref(), Some("disk full"));
    assert_eq!(
        w.run(&admin, create_with(&root, &snap, SandboxOptions::default()))
            .unwrap_err()
            .kind,
        K::Conflict
    );
}

#[test]
fn a_deleted_snapshot_is_gone_but_its_history_stays_in_the_audit() {
    let (mut w, admin, id) = running();
    let snap = snapshot_of(&mut w, &admin, &id);
    w.run(&admin, Command::DeleteSnapshot { snapshot: snap.clone() })
        .unwrap();
    assert!(!w.state.snapshots.snapshots.contains_key(&snap));
    assert_eq!(w.last_audit().action, "snapshot.delete");
    assert_eq!(
        w.run(&admin, Command::DeleteSnapshot { snapshot: snap })
            .unwrap_err()
            .kind,
        K::NotFound
    );
}

#[test]
fn a_snapshot_beneath_another_cannot_be_deleted_first() {
    let (mut w, admin, id) = running();
    let root = w.root.clone();
    let first = snapshot_of(&mut w, &admin, &id);
    let child = w
        .run(&admin, create_with(&root, &first, SandboxOptions::default()))
        .unwrap()
        .decided
        .target;
    w.report(&admin, &child, Observation::Ready);
    let second = snapshot_of(&mut w, &admin, &child);
    assert_eq!(
        w.state.snapshots.snapshots[&second].parent.as_deref(),
        Some(first.as_str())
    );
    assert_eq!(
        w.run(
            &admin,
            Command::DeleteSnapshot {
                snapshot: first.clone()
            }
        )
        .unwrap_err()
        .kind,
        K::Conflict
    );
    w.run(&admin, Command::DeleteSnapshot { snapshot: second }).unwrap();
    w.run(&admin, Command::DeleteSnapshot { snapshot: first }).unwrap();
}

#[test]
fn starting_from_a_deleted_snapshot_is_refused_naming_it() {
    let (mut w, admin, id) = running();
    let root = w.root.clone();
    let snap = snapshot_of(&mut w, &admin, &id);
    w.run(&admin, Command::DeleteSnapshot { snapshot: snap.clone() })
        .unwrap();
    let err = w
        .run(&admin, create_with(&root, &snap, SandboxOptions::default()))
        .unwrap_err();
    assert_eq!(
        (err.kind, err.field.as_deref()),
        (K::NotFound, Some("image")),
        "{err:?}"
    );
    assert!(
        err.message.contains(&snap) && err.message.contains("deleted"),
        "{}",
        err.message
    );
}

#[test]
fn a_sandbox_not_yet_running_cannot_be_snapshotted() {
    let mut w = World::new();
    let admin = w.bootstrap();
    w.edge(&admin, "a", capacity(100, 100_000, 100_000));
    let root = w.root.clone();
    let id = w.sandbox(&admin, &root);
    let err = w
        .run(
            &admin,
            Command::CreateSnapshot {
                sandbox: id,
                name: String::new(),
            },
        )
        .unwrap_err();
    assert_eq!(err.kind, K::Conflict);
}

#[test]
fn another_project_can_neither_snapshot_nor_start_from_nor_delete_a_snapshot() {
    let (mut w, admin, id) = running();
    let root = w.root.clone();
    let snap = snapshot_of(&mut w, &admin, &id);
    let other = w.project(&admin, &root, "other");
    let stranger = w.issue(&admin, &other, &[opendsec_projections::Right::SandboxWrite], None);
    assert_eq!(
        w.run(
            &stranger,
            Command::CreateSnapshot {
                sandbox: id,
                name: String::new()
            }
        )
        .unwrap_err()
        .kind,
        K::Forbidden
    );
    assert_eq!(
        w.run(&stranger, Command::DeleteSnapshot { snapshot: snap.clone() })
            .unwrap_err()
            .kind,
        K::Forbidden
    );
    // To a stranger a snapshot id is just an unknown image name: nothing of it is used.
    let ran = w.run(&stranger, create_with(&other, &snap, SandboxOptions::default()));
    if let Ok(r) = ran {
        let [Event::SandboxCreated(c)] = r.decided.events.as_slice() else {
            panic!()
        };
        assert!(c.snapshot.is_empty() && c.image == snap);
    }
}

#[test]
fn forks_go_to_their_source_s_edge_and_keep_its_options() {
    let (mut w, admin, _) = running();
    let root = w.root.clone();
    let env = BTreeMap::from([("API_URL".to_string(), "http://x".to_string())]);
    let src = w
        .run(
            &admin,
            create_with(
                &root,
                "base",
                SandboxOptions {
                    env: env.clone(),
                    auto_pause: true,
                    auto_resume: true,
                    ..Default::default()
                },
            ),
        )
        .unwrap()
        .decided
        .target;
    w.report(&admin, &src, Observation::Ready);
    let edge = w.state.sandboxes.sandboxes[&src].edge.clone();
    let ran = w
        .run(
            &admin,
            Command::ForkSandbox {
                sandbox: src.clone(),
                count: 6,
                edge: None,
            },
        )
        .unwrap();
    let copies: Vec<_> = ran
        .decided
        .events
        .iter()
        .filter_map(|e| {
            if let Event::SandboxCreated(c) = e {
                Some(c.clone())
            } else {
                None
            }
        })
        .collect();
    assert_eq!(copies.len(), 6);
    for c in copies {
        assert_eq!(c.edge, edge);
        assert_eq!(c.fork_of, src);
        assert_eq!((c.env.clone(), c.auto_pause, c.auto_resume), (env.clone(), true, true));
    }
}

#[test]
fn environment_names_and_sizes_are_checked_and_values_never_appear_in_views() {
    let (mut w, admin, _) = running();
    let root = w.root.clone();
    let bad = BTreeMap::from([("1BAD".to_string(), "x".to_string())]);
    let err = w
        .run(
            &admin,
            create_with(
                &root,
                "base",
                SandboxOptions {
                    env: bad,
                    ..Default::default()
                },
            ),
        )
        .unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::Invalid, Some("opts.env")));
    let huge = BTreeMap::from([("BIG".to_string(), "x".repeat(300 * 1024))]);
    assert_eq!(
        w.run(
            &admin,
            create_with(
                &root,
                "base",
                SandboxOptions {
                    env: huge,
                    ..Default::default()
                }
            )
        )
        .unwrap_err()
        .kind,
        K::Invalid
    );
    let secret = BTreeMap::from([("TOKEN".to_string(), "s3cr3t-value".to_string())]);
    let id = w
        .run(
            &admin,
            create_with(
                &root,
                "base",
                SandboxOptions {
                    env: secret,
                    ..Default::default()
                },
            ),
        )
        .unwrap()
        .decided
        .target;
    assert_eq!(
        w.state.sandboxes.sandboxes[&id].env["TOKEN"], "s3cr3t-value",
        "the edge needs the value"
    );
    let view = w.state.view_json("sandboxes").unwrap().to_string();
    assert!(view.contains("TOKEN") && !view.contains("s3cr3t-value"), "{view}");
}

#[test]
fn network_settings_must_be_json_and_are_recorded() {
    let (mut w, admin, id) = running();
    let err = w
        .run(
            &admin,
            Command::SetSandboxNetwork {
                sandbox: id.clone(),
                network: "{not json".into(),
            },
        )
        .unwrap_err();
    assert_eq!(err.kind, K::Invalid);
    w.run(
        &admin,
        Command::SetSandboxNetwork {
            sandbox: id.clone(),
            network: r#"{"allowPublicTraffic":false}"#.into(),
        },
    )
    .unwrap();
    assert_eq!(
        w.state.sandboxes.sandboxes[&id].network.as_deref(),
        Some(r#"{"allowPublicTraffic":false}"#)
    );
}

#[test]
fn at_its_timeout_an_auto_pause_sandbox_pauses_and_its_timeout_is_spent() {
    let (mut w, admin, _) = running();
    let root = w.root.clone();
    let id = w
        .run(
            &admin,
            create_with(
                &root,
                "base",
                SandboxOptions {
                    auto_pause: true,
                    ..Default::default()
                },
            ),
        )
        .unwrap()
        .decided
        .target;
    w.report(&admin, &id, Observation::Ready);
    let ran = w.report(&admin, &id, Observation::TimedOut);
    assert!(matches!(ran.outcome, Outcome::Applied { .. }));
    let x = &w.state.sandboxes.sandboxes[&id];
    assert_eq!((x.desired, x.expires_at_ms), (Desired::Paused, None));
    // A sandbox without auto-pause cannot be reported so: it is stopped at its timeout.
    let plain = w.sandbox(&admin, &root);
    w.report(&admin, &plain, Observation::Ready);
    let err = w
        .run(
            &admin,
            Command::ReportSandbox {
                sandbox: plain,
                observation: Observation::TimedOut,
            },
        )
        .unwrap_err();
    assert_eq!(err.kind, K::Invalid);
}

#[test]
fn a_pause_may_keep_only_the_file_system_and_a_resume_may_boot_the_sandbox_again() {
    let (mut w, admin, id) = running();
    w.run(
        &admin,
        Command::PauseSandbox {
            sandbox: id.clone(),
            filesystem: true,
        },
    )
    .unwrap();
    let x = &w.state.sandboxes.sandboxes[&id];
    assert_eq!((x.desired, x.pause_filesystem), (Desired::Paused, true));
    // Resumed, it boots again; the mode stays what its last pause kept until the next.
    w.run(
        &admin,
        Command::ResumeSandbox {
            sandbox: id.clone(),
            cold: false,
        },
    )
    .unwrap();
    let x = &w.state.sandboxes.sandboxes[&id];
    assert_eq!((x.desired, x.pause_filesystem), (Desired::Running, true));
    w.run(
        &admin,
        Command::PauseSandbox {
            sandbox: id.clone(),
            filesystem: false,
        },
    )
    .unwrap();
    assert!(!w.state.sandboxes.sandboxes[&id].pause_filesystem);
    // A resume that drops the memory that pause kept.
    w.run(
        &admin,
        Command::ResumeSandbox {
            sandbox: id.clone(),
            cold: true,
        },
    )
    .unwrap();
    assert!(w.state.sandboxes.sandboxes[&id].pause_filesystem);
}

#[test]
fn an_auto_pause_may_keep_only_the_file_system_and_forks_inherit_it() {
    let (mut w, admin, _) = running();
    let root = w.root.clone();
    let id = w
        .run(
            &admin,
            create_with(
                &root,
                "base",
                SandboxOptions {
                    auto_pause: true,
                    auto_pause_filesystem: true,
                    ..Default::default()
                },
            ),
        )
        .unwrap()
        .decided
        .target;
    w.report(&admin, &id, Observation::Ready);
    let forked = w
        .run(
            &admin,
            Command::ForkSandbox {
                sandbox: id.clone(),
                count: 1,
                edge: None,
            },
        )
        .unwrap();
    let copy = forked.decided.events.iter().find_map(|e| match e {
        opendsec_projections::Event::SandboxCreated(c) => Some(c.id.clone()),
        _ => None,
    });
    assert!(w.state.sandboxes.sandboxes[&copy.unwrap()].auto_pause_filesystem);
    w.report(&admin, &id, Observation::TimedOut);
    let x = &w.state.sandboxes.sandboxes[&id];
    assert_eq!((x.desired, x.pause_filesystem), (Desired::Paused, true));
    // Without auto-pause there is no pause at the timeout to keep anything.
    let plain = w
        .run(
            &admin,
            create_with(
                &root,
                "base",
                SandboxOptions {
                    auto_pause_filesystem: true,
                    ..Default::default()
                },
            ),
        )
        .unwrap()
        .decided
        .target;
    assert!(!w.state.sandboxes.sandboxes[&plain].auto_pause_filesystem);
}

#[test]
fn replaying_the_log_of_snapshots_and_options_gives_the_same_state() {
    let (mut w, admin, id) = running();
    let root = w.root.clone();
    let snap = snapshot_of(&mut w, &admin, &id);
    let env = BTreeMap::from([("A".to_string(), "1".to_string())]);
    w.run(
        &admin,
        create_with(
            &root,
            &snap,
            SandboxOptions {
                env,
                auto_pause: true,
                network: Some("{}".into()),
                ..Default::default()
            },
        ),
    )
    .unwrap();
    w.run(
        &admin,
        Command::ForkSandbox {
            sandbox: id,
            count: 2,
            edge: None,
        },
    )
    .unwrap();
    assert_eq!(w.replayed().to_bytes(), w.state.to_bytes());
}

#[test]
fn an_idempotency_key_names_one_live_sandbox_per_project() {
    let (mut w, admin, _) = running();
    let root = w.root.clone();
    let keyed = || SandboxOptions {
        idempotency_key: Some("retry-me".into()),
        ..Default::default()
    };
    let first = w
        .run(&admin, create_with(&root, "base", keyed()))
        .unwrap()
        .decided
        .target;
    let err = w.run(&admin, create_with(&root, "base", keyed())).unwrap_err();
    assert_eq!(
        (err.kind, err.field.as_deref()),
        (K::Conflict, Some("opts.idempotency_key"))
    );
    assert!(err.message.contains(&first), "{}", err.message);
    // Two creates with one key decided before either applied: the second loses at apply.
    let p1 = w.propose(
        &admin,
        create_with(
            &root,
            "base",
            SandboxOptions {
                idempotency_key: Some("race".into()),
                ..Default::default()
            },
        ),
        Overlay::Ignored,
    );
    let p2 = w.propose(
        &admin,
        create_with(
            &root,
            "base",
            SandboxOptions {
                idempotency_key: Some("race".into()),
                ..Default::default()
            },
        ),
        Overlay::Ignored,
    );
    assert!(matches!(w.commit(p1), Some((_, Outcome::Applied { .. }))));
    assert!(matches!(w.commit(p2), Some((_, Outcome::Rejected { .. }))));
    // Once the sandbox has ended, the key is free again.
    w.run(&admin, Command::KillSandbox { sandbox: first.clone() }).unwrap();
    w.report(
        &admin,
        &first,
        Observation::Exited {
            exit_code: 137,
            oom_killed: false,
            reason: "user".into(),
        },
    );
    w.run(&admin, create_with(&root, "base", keyed())).unwrap();
    // A key is printable ASCII of bounded length.
    let bad = SandboxOptions {
        idempotency_key: Some("has space".into()),
        ..Default::default()
    };
    assert_eq!(
        w.run(&admin, create_with(&root, "base", bad)).unwrap_err().kind,
        K::Invalid
    );
}

#[test]
fn a_vm_reported_ready_says_how_its_edge_runs_it_and_a_container_cannot() {
    let (mut w, admin, container) = running();
    let root = w.root.clone();
    w.edge_labelled(
        &admin,
        "vms",
        capacity(100, 100_000, 100_000),
        [(opendsec_commands::MICROVM_LABEL.to_string(), "qemu".to_string())].into(),
    );
    let vm = w
        .run(
            &admin,
            create_with(
                &root,
                "base",
                SandboxOptions {
                    isolation: Some(opendsec_projections::Isolation::Microvm),
                    ..Default::default()
                },
            ),
        )
        .unwrap()
        .decided
        .target;
    let ready = |vmm: &str, accelerator: &str| Observation::VmReady {
        vmm: vmm.into(),
        accelerator: accelerator.into(),
    };
    // A VM's edge reports the VMM and accelerator with its readiness; the view keeps them.
    w.report(&admin, &vm, ready("qemu", "tcg"));
    let s = &w.state.sandboxes.sandboxes[&vm];
    assert_eq!(s.observed, opendsec_projections::Observed::Ready);
    let runtime = s.runtime.clone().expect("the runtime is kept");
    assert_eq!((runtime.vmm.as_str(), runtime.accelerator.as_str()), ("qemu", "tcg"));
    // A container has no VMM to report, and what is reported must be a plain name.
    let err = w
        .run(
            &admin,
            Command::ReportSandbox {
                sandbox: container.clone(),
                observation: ready("qemu", "kvm"),
            },
        )
        .unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::Invalid, Some("observation")));
    let err = w
        .run(
            &admin,
            Command::ReportSandbox {
                sandbox: vm.clone(),
                observation: ready("qemu", "KVM!"),
            },
        )
        .unwrap_err();
    assert_eq!(
        (err.kind, err.field.as_deref()),
        (K::Invalid, Some("observation.accelerator"))
    );
    assert!(w.state.sandboxes.sandboxes[&container].runtime.is_none());
    // The same log read again gives the same view, runtime included.
    assert_eq!(w.replayed().hash(), w.state.hash());
}
