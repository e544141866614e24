//! The slice folded: sandboxes, snapshots, transfers and images.

use super::*;
use opendsec_edge_api::pb::{Progress, SliceEdge, SliceEntry};
use opendsec_projections::pb;
use opendsec_projections::{Desired, Observed};

const HERE: &str = "e1";

fn entry(index: u64, events: Vec<Event>) -> SliceMessage {
    SliceMessage {
        body: Some(Body::Entry(SliceEntry {
            index,
            time_ms: 1_000,
            events: events.iter().map(Event::to_envelope).collect(),
        })),
    }
}

fn created(id: &str, edge: &str) -> pb::SandboxCreated {
    pb::SandboxCreated {
        id: id.into(),
        project: "root".into(),
        edge: edge.into(),
        image: "busybox".into(),
        cpu_millis: 100,
        memory_mb: 64,
        ..Default::default()
    }
}

/// A slice that folded `events`, one entry each, from index 1.
fn folded(events: Vec<Event>) -> SliceState {
    let mut s = SliceState::new(HERE);
    for (i, ev) in events.into_iter().enumerate() {
        s.try_apply(&entry(i as u64 + 1, vec![ev])).expect("folds");
    }
    s
}

fn kill(id: &str, reason: &str) -> Event {
    Event::SandboxKillRequested(pb::SandboxKillRequested {
        id: id.into(),
        reason: reason.into(),
    })
}

fn ready(id: &str) -> Event {
    Event::SandboxReady(pb::SandboxReady {
        id: id.into(),
        ..Default::default()
    })
}

fn slice_sandbox(id: &str) -> SliceSandbox {
    SliceSandbox {
        id: id.into(),
        project: "root".into(),
        image: "busybox".into(),
        desired: opendsec_edge_api::pb::Desired::Running.into(),
        observed: opendsec_edge_api::pb::Observed::Ready.into(),
        isolation: opendsec_edge_api::pb::Isolation::Microvm.into(),
        cpu_class: opendsec_edge_api::pb::CpuClass::LatencySensitive.into(),
        edge: HERE.into(),
        ..Default::default()
    }
}

fn snapshot_message(index: u64, sandboxes: Vec<SliceSandbox>) -> SliceMessage {
    SliceMessage {
        body: Some(Body::Snapshot(SliceSnapshot {
            index,
            sandboxes,
            edges: vec![SliceEdge {
                id: "e2".into(),
                address: "e2:1".into(),
            }],
            ..Default::default()
        })),
    }
}

#[test]
fn packs_are_folded_apart_from_pulls_until_reported_and_a_slice_saved_before_packs_loads() {
    let requested = |name: &str, edge: &str, sandbox: &str| {
        Event::ImageRequested(pb::ImageRequested {
            name: name.into(),
            project: "root".into(),
            reference: if sandbox.is_empty() {
                "127.0.0.1:5000/py:1".into()
            } else {
                String::new()
            },
            edge: edge.into(),
            source_sandbox: sandbox.into(),
            scrub: if sandbox.is_empty() {
                vec![]
            } else {
                vec!["/etc/token".into()]
            },
            config: None,
            imported: false,
        })
    };
    let mut s = folded(vec![
        requested("py", HERE, ""),
        requested("env", HERE, "sb1"),
        requested("theirs", "e2", "sb7"),
    ]);
    assert_eq!(s.pulls.keys().collect::<Vec<_>>(), ["py"]);
    assert_eq!(
        s.packs,
        [(
            "env".to_string(),
            DesiredPack {
                sandbox: "sb1".into(),
                scrub: vec!["/etc/token".into()],
                config: None,
            }
        )]
        .into()
    );
    // What the edge saved before packs existed still loads, with none.
    let mut saved = serde_json::to_value(&s).unwrap();
    saved.as_object_mut().unwrap().remove("packs");
    let loaded: SliceState = serde_json::from_value(saved).unwrap();
    assert_eq!((loaded.pulls.clone(), loaded.packs.len()), (s.pulls.clone(), 0));

    // A pull of the name replaces its pack, and the other way round.
    s.try_apply(&entry(4, vec![requested("env", HERE, "")])).unwrap();
    assert!(s.packs.is_empty() && s.pulls.contains_key("env"));
    s.try_apply(&entry(5, vec![requested("env", HERE, "sb1")])).unwrap();
    assert!(s.packs.contains_key("env") && !s.pulls.contains_key("env"));
    s.try_apply(&entry(
        6,
        vec![Event::ImageFailed(pb::ImageFailed {
            name: "env".into(),
            edge: HERE.into(),
            reason: "no room".into(),
        })],
    ))
    .unwrap();
    assert!(s.packs.is_empty());

    // A slice snapshot lists pulls and packs together.
    let mut snap = snapshot_message(50, vec![]);
    if let Some(Body::Snapshot(x)) = &mut snap.body {
        x.pulls = vec![
            opendsec_edge_api::pb::SliceImage {
                name: "py".into(),
                reference: "127.0.0.1:5000/py:1".into(),
                ..Default::default()
            },
            opendsec_edge_api::pb::SliceImage {
                name: "env".into(),
                source_sandbox: "sb1".into(),
                scrub: vec!["/root/notes".into()],
                ..Default::default()
            },
        ];
    }
    s.try_apply(&snap).unwrap();
    assert_eq!(s.pulls.keys().collect::<Vec<_>>(), ["py"]);
    assert_eq!(s.packs["env"].scrub, ["/root/notes"]);
}

#[test]
fn an_import_is_awaited_apart_from_pulls_and_packs_until_reported() {
    let import = |name: &str, edge: &str| {
        Event::ImageRequested(pb::ImageRequested {
            name: name.into(),
            project: "root".into(),
            edge: edge.into(),
            imported: true,
            ..Default::default()
        })
    };
    let mut s = folded(vec![import("tar", HERE), import("theirs", "e2")]);
    assert_eq!(s.imports.iter().collect::<Vec<_>>(), ["tar"]);
    assert!(s.pulls.is_empty() && s.packs.is_empty());
    // A pull of the name replaces the import, and the other way round.
    let pull = Event::ImageRequested(pb::ImageRequested {
        name: "tar".into(),
        reference: "127.0.0.1:5000/py:1".into(),
        edge: HERE.into(),
        ..Default::default()
    });
    s.try_apply(&entry(3, vec![pull])).unwrap();
    assert!(s.imports.is_empty() && s.pulls.contains_key("tar"));
    s.try_apply(&entry(4, vec![import("tar", HERE)])).unwrap();
    assert!(s.imports.contains("tar") && s.pulls.is_empty());
    let ready = Event::ImageReady(pb::ImageReady {
        name: "tar".into(),
        edge: HERE.into(),
        ..Default::default()
    });
    s.try_apply(&entry(5, vec![ready])).unwrap();
    assert!(s.imports.is_empty());
    // A slice snapshot lists imports with pulls and packs; what was saved before
    // imports existed loads with none.
    let mut snap = snapshot_message(50, vec![]);
    if let Some(Body::Snapshot(x)) = &mut snap.body {
        x.pulls = vec![opendsec_edge_api::pb::SliceImage {
            name: "up".into(),
            imported: true,
            ..Default::default()
        }];
    }
    s.try_apply(&snap).unwrap();
    assert_eq!(s.imports.iter().collect::<Vec<_>>(), ["up"]);
    assert!(s.pulls.is_empty() && s.packs.is_empty());
    let mut saved = serde_json::to_value(&s).unwrap();
    saved.as_object_mut().unwrap().remove("imports");
    let loaded: SliceState = serde_json::from_value(saved).unwrap();
    assert!(loaded.imports.is_empty());
}

#[test]
fn a_deleted_image_is_remembered_until_its_name_is_requested_again() {
    let deleted = |name: &str| {
        Event::ImageDeleted(pb::ImageDeleted {
            name: name.into(),
            ..Default::default()
        })
    };
    let mut s = folded(vec![deleted("py"), deleted("env")]);
    assert_eq!(s.images_deleted.iter().collect::<Vec<_>>(), ["env", "py"]);
    let again = Event::ImageRequested(pb::ImageRequested {
        name: "py".into(),
        reference: "127.0.0.1:5000/py:2".into(),
        edge: "another-edge".into(),
        ..Default::default()
    });
    s.try_apply(&entry(3, vec![again])).unwrap();
    assert_eq!(s.images_deleted.iter().collect::<Vec<_>>(), ["env"]);
    // What the edge saved before deletions were kept still loads, with none.
    let mut saved = serde_json::to_value(&s).unwrap();
    saved.as_object_mut().unwrap().remove("images_deleted");
    let loaded: SliceState = serde_json::from_value(saved).unwrap();
    assert!(loaded.images_deleted.is_empty());
}

#[test]
fn a_sandbox_created_on_this_edge_is_wanted_running_and_not_reported_yet() {
    let mut c = created("sb1", HERE);
    c.expires_at_ms = 9_000;
    c.isolation = "microvm".into();
    let s = folded(vec![Event::SandboxCreated(c)]);
    let d = &s.sandboxes["sb1"];
    assert_eq!((d.desired, d.observed), (Desired::Running, Observed::Pending));
    assert_eq!((d.expires_at_ms, d.isolation), (Some(9_000), Isolation::Microvm));
    assert_eq!(s.next_index, 2);
}

#[test]
fn a_sandbox_of_another_edge_is_not_run_here_unless_it_starts_from_state_held_here() {
    let mut served = created("sb2", "e2");
    served.source_edge = HERE.into();
    served.fork_of = "sb0".into();
    served.transfer = "fork-sb2".into();
    let s = folded(vec![
        Event::SandboxCreated(created("sb1", "e2")),
        Event::SandboxCreated(served),
    ]);
    assert!(s.sandboxes.is_empty());
    let t = &s.served["fork-sb2"];
    assert_eq!(t.source, TransferSource::Fork { sandbox: "sb0".into() });
    assert!(t.sends_to("e2") && t.is_wanted());
}

#[test]
fn a_kill_keeps_its_first_reason_and_makes_later_reports_of_running_stale() {
    let s = folded(vec![
        Event::SandboxCreated(created("sb1", HERE)),
        kill("sb1", "timeout"),
        kill("sb1", "user"),
        ready("sb1"),
    ]);
    let d = &s.sandboxes["sb1"];
    assert_eq!(d.kill_reason.as_deref(), Some("timeout"));
    // As in the control plane's views: the sandbox is released, its report stale.
    assert_eq!((d.desired, d.observed), (Desired::Killed, Observed::Pending));
    assert!(!d.is_terminal());
}

#[test]
fn an_end_recorded_in_the_log_is_terminal() {
    let s = folded(vec![
        Event::SandboxCreated(created("sb1", HERE)),
        ready("sb1"),
        Event::SandboxExited(pb::SandboxExited {
            id: "sb1".into(),
            ..Default::default()
        }),
        ready("sb1"),
        Event::SandboxPauseRequested(pb::SandboxPauseRequested {
            id: "sb1".into(),
            filesystem: false,
        }),
    ]);
    let d = &s.sandboxes["sb1"];
    assert_eq!(d.observed, Observed::Exited);
    assert_eq!(
        d.desired,
        Desired::Paused,
        "a pause request still records what is wanted"
    );
    assert!(d.is_terminal());
}

#[test]
fn a_timed_out_sandbox_with_auto_pause_is_wanted_paused_and_its_timeout_spent() {
    let mut c = created("sb1", HERE);
    c.expires_at_ms = 5_000;
    c.auto_pause = true;
    let s = folded(vec![
        Event::SandboxCreated(c),
        Event::SandboxTimedOut(pb::SandboxTimedOut {
            id: "sb1".into(),
            filesystem: false,
        }),
    ]);
    let d = &s.sandboxes["sb1"];
    assert_eq!((d.desired, d.expires_at_ms), (Desired::Paused, None));
}

#[test]
fn labels_and_timeouts_follow_the_log() {
    let s = folded(vec![
        Event::SandboxCreated(created("sb1", HERE)),
        Event::SandboxLabelsSet(pb::SandboxLabelsSet {
            id: "sb1".into(),
            labels: BTreeMap::from([("team".to_string(), "a".to_string())]),
        }),
        Event::SandboxTimeoutSet(pb::SandboxTimeoutSet {
            id: "sb1".into(),
            expires_at_ms: 7_000,
        }),
    ]);
    let d = &s.sandboxes["sb1"];
    assert_eq!(d.labels["team"], "a");
    assert_eq!(d.expires_at_ms, Some(7_000));
}

#[test]
fn a_snapshot_taken_here_goes_from_pending_to_its_result_and_is_deleted_by_the_log() {
    let requested = |id: &str, edge: &str| {
        Event::SnapshotRequested(pb::SnapshotRequested {
            id: id.into(),
            sandbox: "sb1".into(),
            edge: edge.into(),
            isolation: "microvm".into(),
            ..Default::default()
        })
    };
    let mut s = folded(vec![
        Event::SandboxCreated(created("sb1", HERE)),
        requested("x1", HERE),
        requested("x2", "e2"),
    ]);
    assert_eq!(s.snapshots["x1"].phase, SnapshotPhase::Pending);
    assert_eq!(s.snapshots["x1"].isolation, Isolation::Microvm);
    assert!(!s.snapshots.contains_key("x2"));
    let ready = Event::SnapshotReady(pb::SnapshotReady {
        id: "x1".into(),
        sandbox: "sb1".into(),
        size_bytes: 1,
    });
    let deleted = Event::SnapshotDeleted(pb::SnapshotDeleted {
        id: "x1".into(),
        sandbox: "sb1".into(),
    });
    s.try_apply(&entry(4, vec![ready])).unwrap();
    assert_eq!(s.snapshots["x1"].phase, SnapshotPhase::Ready);
    s.try_apply(&entry(5, vec![deleted])).unwrap();
    assert_eq!(s.snapshots["x1"].phase, SnapshotPhase::Deleted);
}

#[test]
fn a_sandboxs_network_policy_is_the_one_it_was_created_with_until_the_log_replaces_it_whole() {
    let mut c = created("sb1", HERE);
    c.network = r#"{"allow_out":["pkgs.test"]}"#.into();
    let set = |json: &str| {
        Event::SandboxNetworkSet(pb::SandboxNetworkSet {
            id: "sb1".into(),
            network: json.into(),
        })
    };
    let mut s = folded(vec![
        Event::SandboxCreated(c),
        Event::SandboxCreated(created("sb2", HERE)),
    ]);
    assert_eq!(
        s.sandboxes["sb1"].network.as_deref(),
        Some(r#"{"allow_out":["pkgs.test"]}"#)
    );
    assert_eq!(s.sandboxes["sb2"].network, None, "no policy: the default, deny");
    s.try_apply(&entry(3, vec![set(r#"{"allow_internet_access":true}"#)]))
        .unwrap();
    assert_eq!(
        s.sandboxes["sb1"].network.as_deref(),
        Some(r#"{"allow_internet_access":true}"#)
    );
    s.try_apply(&entry(4, vec![set("")])).unwrap();
    assert_eq!(s.sandboxes["sb1"].network, None);

    // A slice snapshot carries it; a slice saved before policies existed loads with none.
    let mut x = slice_sandbox("sb9");
    x.network = r#"{"allow_out":["10.0.0.0/8"]}"#.into();
    s.try_apply(&snapshot_message(50, vec![x])).unwrap();
    assert_eq!(
        s.sandboxes["sb9"].network.as_deref(),
        Some(r#"{"allow_out":["10.0.0.0/8"]}"#)
    );
    let mut saved = serde_json::to_value(&s).unwrap();
    saved["sandboxes"]["sb9"].as_object_mut().unwrap().remove("network");
    let loaded: SliceState = serde_json::from_value(saved).unwrap();
    assert_eq!(loaded.sandboxes["sb9"].network, None);
}

#[test]
fn the_resume_index_follows_entries_progress_and_snapshots_and_never_goes_back() {
    let mut s = SliceState::new(HERE);
    assert_eq!(s.next_index, 1);
    s.try_apply(&SliceMessage {
        body: Some(Body::Progress(Progress { index: 40 })),
    })
    .unwrap();
    assert_eq!(s.next_index, 41);
    s.try_apply(&entry(10, vec![])).unwrap();
    assert_eq!(s.next_index, 41);
    s.try_apply(&snapshot_message(99, vec![])).unwrap();
    assert_eq!(s.next_index, 100);
}

#[test]
fn a_slice_snapshot_is_the_whole_truth_about_sandboxes_and_keeps_vanished_snapshots_as_deleted() {
    let mut s = folded(vec![
        Event::SandboxCreated(created("gone", HERE)),
        Event::SnapshotRequested(pb::SnapshotRequested {
            id: "x1".into(),
            sandbox: "gone".into(),
            edge: HERE.into(),
            ..Default::default()
        }),
    ]);
    s.try_apply(&snapshot_message(50, vec![slice_sandbox("sb9")])).unwrap();
    assert_eq!(s.sandboxes.keys().collect::<Vec<_>>(), ["sb9"]);
    let d = &s.sandboxes["sb9"];
    assert_eq!((d.observed, d.isolation), (Observed::Ready, Isolation::Microvm));
    assert_eq!(s.snapshots["x1"].phase, SnapshotPhase::Deleted);
    assert_eq!(s.edges["e2"], "e2:1");
}

#[test]
fn a_slice_snapshot_with_a_value_this_edge_does_not_know_is_refused_whole() {
    let mut s = folded(vec![Event::SandboxCreated(created("sb1", HERE))]);
    let before = s.clone();
    let mut newer = slice_sandbox("sb9");
    newer.observed = 42;
    let refused = s
        .try_apply(&snapshot_message(50, vec![slice_sandbox("sb8"), newer]))
        .unwrap_err();
    assert_eq!(
        refused,
        vec![Refused::Snapshot {
            index: 50,
            item: "sandbox sb9".into(),
            source: UnknownEnum {
                field: "Observed",
                value: 42
            },
        }]
    );
    assert_eq!(s, before, "nothing of a refused snapshot is folded, its index included");
    let mut unspecified = slice_sandbox("sb9");
    unspecified.isolation = 0;
    assert!(s.try_apply(&snapshot_message(50, vec![unspecified])).is_err());
    assert_eq!(s, before);
}

#[test]
fn an_event_this_edge_cannot_interpret_is_skipped_and_the_rest_of_its_entry_folded() {
    let mut s = SliceState::new(HERE);
    let mut unknown = created("sb1", HERE);
    unknown.isolation = "quantum".into();
    let mut msg = entry(
        3,
        vec![
            Event::SandboxCreated(unknown),
            Event::SandboxCreated(created("sb2", HERE)),
        ],
    );
    if let Some(Body::Entry(e)) = &mut msg.body {
        let mut future = e.events[1].clone();
        future.schema_version = 99;
        e.events.push(future);
    }
    let refused = s.try_apply(&msg).unwrap_err();
    assert_eq!(refused.len(), 2, "{refused:?}");
    assert!(refused[0].to_string().contains("\"quantum\""), "{}", refused[0]);
    assert!(matches!(&refused[1], Refused::Event { index: 3, .. }));
    assert_eq!(s.sandboxes.keys().collect::<Vec<_>>(), ["sb2"]);
    assert_eq!(s.next_index, 4);
}
