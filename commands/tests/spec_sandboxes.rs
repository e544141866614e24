//! Placement (power-of-k over edges with room) and the sandbox lifecycle: desired
//! state from commands, observed state from the edge's reports.

mod support;

use opendsec_commands::{Command, Observation, RejectionKind as K, edge_ordinal_of};
use opendsec_projections::{AuditResult, CpuClass, Desired, Event, Observed, Outcome};
use std::collections::BTreeMap;
use support::*;

#[test]
fn with_no_edge_a_create_is_refused_for_lack_of_capacity_and_logged() {
    let mut w = World::new();
    let admin = w.bootstrap();
    let root = w.root.clone();
    let err = w.try_sandbox(&admin, &root).unwrap_err();
    assert_eq!(err.kind, K::NoCapacity);
    assert!(matches!(&w.last_audit().result, AuditResult::Denied { code, .. } if code == "no_capacity"));
}

#[test]
fn a_deregistered_edge_takes_no_new_sandboxes() {
    let mut w = World::new();
    let admin = w.bootstrap();
    let root = w.root.clone();
    w.edge(&admin, "a", capacity(10, 10_000, 10_000));
    w.run(&admin, Command::DeregisterEdge { edge: "a".into() }).unwrap();
    assert_eq!(w.try_sandbox(&admin, &root).unwrap_err().kind, K::NoCapacity);
    // Registering it again brings it back under its old ordinal.
    assert_eq!(w.edge(&admin, "a", capacity(10, 10_000, 10_000)), 0);
    w.sandbox(&admin, &root);
}

#[test]
fn a_create_records_the_sampled_candidates_and_the_chosen_edge() {
    let mut w = World::new();
    let admin = w.bootstrap();
    let root = w.root.clone();
    for e in ["a", "b", "c"] {
        w.edge(&admin, e, capacity(10, 10_000, 10_000));
    }
    let ran = w.run(&admin, create_in(&root)).unwrap();
    let [Event::SandboxCreated(created)] = ran.decided.events.as_slice() else {
        panic!("{:?}", ran.decided.events)
    };
    let placement = created.placement.as_ref().unwrap();
    assert_eq!(placement.candidates.len(), opendsec_commands::DEFAULT_K);
    assert!(placement.candidates.contains(&placement.chosen));
    assert_eq!(created.edge, placement.chosen);
    assert_eq!(w.state.sandboxes.sandboxes[&created.id].edge, created.edge);
}

#[test]
fn power_of_k_spreads_sandboxes_evenly_over_roomy_edges() {
    let mut w = World::new();
    let admin = w.bootstrap();
    let root = w.root.clone();
    for e in ["a", "b", "c", "d"] {
        w.edge(&admin, e, capacity(1_000, 1_000_000, 1_000_000));
    }
    for _ in 0..40 {
        w.sandbox(&admin, &root);
    }
    let loads: Vec<u64> = w.state.placement.edges.values().map(|e| e.assigned.sandboxes).collect();
    let (lo, hi) = (*loads.iter().min().unwrap(), *loads.iter().max().unwrap());
    assert_eq!(loads.iter().sum::<u64>(), 40);
    assert!(
        hi - lo <= 2,
        "sampling two edges and taking the emptier keeps them level: {loads:?}"
    );
}

#[test]
fn power_of_k_fills_edges_to_capacity_and_never_beyond() {
    let mut w = World::new();
    let admin = w.bootstrap();
    let root = w.root.clone();
    // 4 edges, 5 slots each: 20 sandboxes fit, the 21st does not.
    for e in ["a", "b", "c", "d"] {
        w.edge(&admin, e, capacity(5, 100_000, 5 * 256));
    }
    let mut per_edge: BTreeMap<String, u64> = BTreeMap::new();
    for _ in 0..20 {
        let s = w.sandbox(&admin, &root);
        *per_edge
            .entry(w.state.sandboxes.sandboxes[&s].edge.clone())
            .or_default() += 1;
    }
    assert_eq!(per_edge.values().copied().collect::<Vec<_>>(), [5, 5, 5, 5]);
    for e in w.state.placement.edges.values() {
        assert_eq!(
            e.assigned.sandboxes, e.capacity.sandboxes,
            "edge {} is exactly full",
            e.id
        );
    }
    assert_eq!(w.try_sandbox(&admin, &root).unwrap_err().kind, K::NoCapacity);
}

#[test]
fn an_edge_without_enough_memory_or_cpu_is_never_chosen() {
    let mut w = World::new();
    let admin = w.bootstrap();
    let root = w.root.clone();
    w.edge(&admin, "small-mem", capacity(100, 100_000, 100));
    w.edge(&admin, "small-cpu", capacity(100, 100, 100_000));
    w.edge(&admin, "fits", capacity(100, 100_000, 100_000));
    for _ in 0..10 {
        let s = w.sandbox(&admin, &root);
        assert_eq!(w.state.sandboxes.sandboxes[&s].edge, "fits");
    }
}

#[test]
fn a_sandbox_ids_last_four_hex_digits_are_its_edges_ordinal() {
    let mut w = World::new();
    let admin = w.bootstrap();
    let root = w.root.clone();
    for i in 0..12 {
        let ord = w.edge(&admin, &format!("e{i}"), capacity(3, 100_000, 100_000));
        assert_eq!(ord, i);
    }
    for _ in 0..30 {
        let s = w.sandbox(&admin, &root);
        assert_eq!(s.len(), 20);
        let edge = &w.state.sandboxes.sandboxes[&s].edge;
        let ord = w.state.placement.edges[edge].ordinal;
        assert_eq!(edge_ordinal_of(&s), Some(ord), "{s} on {edge}");
        assert_eq!(&s[16..], format!("{ord:04x}"));
    }
}

#[test]
fn fork_creates_count_sandboxes_each_remembering_its_origin() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let origin = w.sandbox(&admin, &root);
    w.run(
        &admin,
        Command::SetSandboxLabels {
            sandbox: origin.clone(),
            labels: labels(&[("app", "web")]),
        },
    )
    .unwrap();
    let ran = w
        .run(
            &admin,
            Command::ForkSandbox {
                sandbox: origin.clone(),
                count: 3,
                edge: None,
            },
        )
        .unwrap();
    assert!(matches!(ran.outcome, Outcome::Applied { .. }));

    let Event::SandboxForkRequested(req) = &ran.decided.events[0] else {
        panic!()
    };
    assert_eq!(req.children.len(), 3);
    let created: Vec<_> = ran.decided.events[1..]
        .iter()
        .filter_map(|e| {
            if let Event::SandboxCreated(c) = e {
                Some(c.id.clone())
            } else {
                None
            }
        })
        .collect();
    assert_eq!(created, req.children);
    for child in &req.children {
        let c = &w.state.sandboxes.sandboxes[child];
        assert_eq!(c.fork_of.as_deref(), Some(origin.as_str()));
        assert_eq!(
            (
                c.project.as_str(),
                c.image.as_str(),
                c.labels.get("app").map(String::as_str)
            ),
            (root.as_str(), "base", Some("web"))
        );
    }
    assert_eq!(w.usage(&root).sandboxes, 4);
}

#[test]
fn a_fork_that_does_not_fit_the_quota_creates_nothing() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let team = w.project(&admin, &root, "team");
    w.set_quota(&admin, &team, at_most(3));
    let origin = w.sandbox(&admin, &team);
    let err = w
        .run(
            &admin,
            Command::ForkSandbox {
                sandbox: origin,
                count: 3,
                edge: None,
            },
        )
        .unwrap_err();
    assert_eq!(err.kind, K::QuotaExceeded);
    assert_eq!(w.state.sandboxes.sandboxes.len(), 1);
}

#[test]
fn commands_change_the_desired_state_and_reports_the_observed_state() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let s = w.sandbox(&admin, &root);
    let state = |w: &World| {
        let x = &w.state.sandboxes.sandboxes[&s];
        (x.desired, x.observed)
    };
    assert_eq!(state(&w), (Desired::Running, Observed::Pending));

    // (what happens, then (desired, observed))
    type Step = fn(&mut World, &str, &str);
    let steps: [(Step, (Desired, Observed)); 6] = [
        (
            |w, a, s| drop(w.report(a, s, Observation::Ready)),
            (Desired::Running, Observed::Ready),
        ),
        (
            |w, a, s| {
                drop(
                    w.run(
                        a,
                        Command::PauseSandbox {
                            sandbox: s.into(),
                            filesystem: false,
                        },
                    )
                    .unwrap(),
                )
            },
            (Desired::Paused, Observed::Ready),
        ),
        (
            |w, a, s| drop(w.report(a, s, Observation::Paused)),
            (Desired::Paused, Observed::Paused),
        ),
        (
            |w, a, s| {
                drop(
                    w.run(
                        a,
                        Command::ResumeSandbox {
                            sandbox: s.into(),
                            cold: false,
                        },
                    )
                    .unwrap(),
                )
            },
            (Desired::Running, Observed::Paused),
        ),
        (
            |w, a, s| drop(w.report(a, s, Observation::Resumed)),
            (Desired::Running, Observed::Ready),
        ),
        (
            |w, a, s| drop(w.run(a, Command::KillSandbox { sandbox: s.into() }).unwrap()),
            (Desired::Killed, Observed::Ready),
        ),
    ];
    for (i, (step, expected)) in steps.into_iter().enumerate() {
        step(&mut w, &admin, &s);
        assert_eq!(state(&w), expected, "after step {i}");
        assert_eq!(
            w.state.sandboxes.sandboxes[&s].index, w.state.index,
            "the sandbox remembers the index that changed it"
        );
    }
    let x = &w.state.sandboxes.sandboxes[&s];
    assert_eq!((x.released, x.reason.as_deref()), (true, Some("user")));
}

#[test]
fn set_timeout_and_set_labels_change_the_sandbox() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let s = w.sandbox(&admin, &root);
    w.advance(5_000);
    w.run(
        &admin,
        Command::SetSandboxTimeout {
            sandbox: s.clone(),
            timeout_seconds: 60,
        },
    )
    .unwrap();
    assert_eq!(w.state.sandboxes.sandboxes[&s].expires_at_ms, Some(w.now_ms + 60_000));
    assert_eq!(w.state.sandboxes.sandboxes[&s].updated_at_ms, w.now_ms);
    w.run(
        &admin,
        Command::SetSandboxTimeout {
            sandbox: s.clone(),
            timeout_seconds: 0,
        },
    )
    .unwrap();
    assert_eq!(
        w.state.sandboxes.sandboxes[&s].expires_at_ms, None,
        "0 means no timeout"
    );

    w.run(
        &admin,
        Command::SetSandboxLabels {
            sandbox: s.clone(),
            labels: labels(&[("a", "1"), ("b", "2")]),
        },
    )
    .unwrap();
    w.run(
        &admin,
        Command::SetSandboxLabels {
            sandbox: s.clone(),
            labels: labels(&[("b", "3")]),
        },
    )
    .unwrap();
    assert_eq!(
        w.state.sandboxes.sandboxes[&s].labels,
        labels(&[("b", "3")]),
        "labels are replaced, not merged"
    );
}

#[test]
fn a_create_with_a_timeout_expires_that_long_after_it_was_decided() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let ran = w
        .run(
            &admin,
            Command::CreateSandbox {
                opts: Default::default(),
                project: root,
                image: "busybox".into(),
                cpu_millis: 1,
                memory_mb: 1,
                labels: labels(&[]),
                timeout_seconds: Some(300),
            },
        )
        .unwrap();
    assert_eq!(
        w.state.sandboxes.sandboxes[&ran.decided.target].expires_at_ms,
        Some(w.now_ms + 300_000)
    );
}

#[test]
fn a_process_killed_for_memory_is_counted_and_the_sandbox_lives_on() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let s = w.sandbox(&admin, &root);
    w.report(&admin, &s, Observation::Ready);
    w.report(
        &admin,
        &s,
        Observation::OomKilled {
            kills: 1,
            command: "python3".into(),
        },
    );
    let x = &w.state.sandboxes.sandboxes[&s];
    assert_eq!(
        (x.observed, x.oom_kills, x.last_oom_command.as_deref(), x.released),
        (Observed::Ready, 1, Some("python3"), false)
    );
    assert_eq!(w.usage(&root).sandboxes, 1, "it still holds its quota");
    // The edge repeats what the log already has (after a restart, say): refused, unchanged.
    let again = Command::ReportSandbox {
        sandbox: s.clone(),
        observation: Observation::OomKilled {
            kills: 1,
            command: "python3".into(),
        },
    };
    assert_eq!(w.run(&admin, again).unwrap_err().kind, K::Conflict);
    // Later kills raise the count; a name the edge could not read is left out.
    w.report(
        &admin,
        &s,
        Observation::OomKilled {
            kills: 3,
            command: String::new(),
        },
    );
    let x = &w.state.sandboxes.sandboxes[&s];
    assert_eq!((x.oom_kills, x.last_oom_command.as_deref()), (3, None));
    let zero = Command::ReportSandbox {
        sandbox: s.clone(),
        observation: Observation::OomKilled {
            kills: 0,
            command: "x".into(),
        },
    };
    let e = w.run(&admin, zero).unwrap_err();
    assert_eq!((e.kind, e.field.as_deref()), (K::Invalid, Some("observation.kills")));
}

#[test]
fn an_oom_kill_reported_by_the_edge_shows_in_the_view() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let s = w.sandbox(&admin, &root);
    w.report(&admin, &s, Observation::Ready);
    w.report(
        &admin,
        &s,
        Observation::Exited {
            exit_code: 137,
            oom_killed: true,
            reason: "out of memory".into(),
        },
    );
    let x = &w.state.sandboxes.sandboxes[&s];
    assert_eq!(
        (x.observed, x.exit_code, x.oom_killed, x.reason.as_deref()),
        (Observed::Exited, Some(137), true, Some("out of memory"))
    );
    assert!(x.released);
    assert_eq!(w.usage(&root).sandboxes, 0);
    // A late "ready" does not bring an exited sandbox back.
    w.report(&admin, &s, Observation::Ready);
    assert_eq!(w.state.sandboxes.sandboxes[&s].observed, Observed::Exited);
    // And an ended sandbox cannot be paused.
    assert_eq!(
        w.run(
            &admin,
            Command::PauseSandbox {
                sandbox: s,
                filesystem: false
            }
        )
        .unwrap_err()
        .kind,
        K::Conflict
    );
}

#[test]
fn a_failure_reported_by_the_edge_ends_the_sandbox() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let s = w.sandbox(&admin, &root);
    w.report(
        &admin,
        &s,
        Observation::Failed {
            reason: "image pull failed".into(),
        },
    );
    let x = &w.state.sandboxes.sandboxes[&s];
    assert_eq!(
        (x.observed, x.reason.as_deref(), x.released),
        (Observed::Failed, Some("image pull failed"), true)
    );
    assert_eq!(w.state.placement.edges["edge-a"].assigned.sandboxes, 0);
}

#[test]
fn the_system_kills_for_timeout_and_the_reason_says_so() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let s = w.sandbox(&admin, &root);
    w.run_as(
        opendsec_commands::Caller::System,
        Command::KillSandbox { sandbox: s.clone() },
    )
    .unwrap();
    assert_eq!(w.state.sandboxes.sandboxes[&s].reason.as_deref(), Some("timeout"));
    assert_eq!(w.last_audit().principal, "system:");
}

#[test]
fn a_best_effort_sandbox_keeps_its_cpu_class_in_the_log_and_its_forks_inherit_it() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let mut create = create_in(&root);
    if let Command::CreateSandbox { opts, .. } = &mut create {
        opts.cpu_class = Some(CpuClass::BestEffort);
    }
    let ran = w.run(&admin, create).unwrap();
    let Event::SandboxCreated(c) = &ran.decided.events[0] else {
        panic!("{:?}", ran.decided.events)
    };
    assert_eq!(c.cpu_class, "best-effort");
    let s = ran.decided.target.clone();
    assert_eq!(w.state.sandboxes.sandboxes[&s].cpu_class, CpuClass::BestEffort);
    w.report(&admin, &s, Observation::Ready);
    let fork = w
        .run(
            &admin,
            Command::ForkSandbox {
                sandbox: s.clone(),
                count: 2,
                edge: None,
            },
        )
        .unwrap();
    for copy in fork.decided.created_sandboxes() {
        assert_eq!(w.state.sandboxes.sandboxes[&copy].cpu_class, CpuClass::BestEffort);
    }
    // A create that says nothing is latency-sensitive, and its event carries "" as every
    // event before the field did.
    let plain = w.run(&admin, create_in(&root)).unwrap();
    let Event::SandboxCreated(c) = &plain.decided.events[0] else {
        panic!()
    };
    assert_eq!(c.cpu_class, "");
    assert_eq!(
        w.state.sandboxes.sandboxes[&plain.decided.target].cpu_class,
        CpuClass::LatencySensitive
    );
}
