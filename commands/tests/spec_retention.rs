//! Bounded growth: what has ended leaves the live views, and what live sandboxes hold
//! counts against quota.
//!
//! - An ended sandbox keeps no environment (its values are often secrets) and leaves the
//!   live views `ended_sandboxes_seconds` after it ended (an hour by default); its
//!   history stays in the log, and the state folded from the log as of then still shows it.
//! - The audit view keeps records for `audit_seconds` (30 days) and at most
//!   `audit_records` (200 000) of them, but never one younger than the request window,
//!   which answers retries.
//! - A cluster admin in the root project sets these (`SetRetention`); a setting left out
//!   keeps its value; a bad one is refused, naming its field.
//! - Environment variables and labels (names and values) of live sandboxes count as
//!   `metadata_bytes` against a project's quota, labels set later too.
//!
//! Sweeps run on log time (once a second of it), so every node sweeps the same.

mod support;

use opendsec_commands::{Command, Observation, RejectionKind as K, SandboxOptions};
use opendsec_projections::{
    Limits, Outcome, REQUEST_WINDOW_MS, Retention, Right, State, metadata_bytes, state::DEFAULT_AUDIT_RECORDS,
};
use std::collections::BTreeMap;
use support::*;

const MINUTE: u64 = 60_000;

fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    labels(pairs)
}

/// A small sandbox of `base` in `project` with these variables and labels.
fn create_with(project: &str, vars: BTreeMap<String, String>, l: BTreeMap<String, String>) -> Command {
    Command::CreateSandbox {
        opts: SandboxOptions {
            env: vars,
            ..Default::default()
        },
        project: project.into(),
        image: "base".into(),
        cpu_millis: 500,
        memory_mb: 256,
        labels: l,
        timeout_seconds: None,
    }
}

fn retention(ended: Option<u64>, audit: Option<u64>, records: Option<u64>) -> Command {
    Command::SetRetention {
        ended_sandboxes_seconds: ended,
        audit_seconds: audit,
        audit_records: records,
    }
}

fn kill(sandbox: &str) -> Command {
    Command::KillSandbox {
        sandbox: sandbox.into(),
    }
}

#[test]
fn an_ended_sandbox_keeps_no_environment_and_leaves_the_live_views_an_hour_after_it_ended() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let secret = "s".repeat(4000);
    let ran = w
        .run(
            &admin,
            create_with(&root, env(&[("API_KEY", &secret)]), labels(&[("task", "t1")])),
        )
        .unwrap();
    let gone = ran.decided.target;
    let kept = w.sandbox(&admin, &root);
    assert_eq!(w.state.sandboxes.sandboxes[&gone].env["API_KEY"], secret);

    w.advance(MINUTE);
    w.run(&admin, kill(&gone)).unwrap();
    let killed_at = w.state.index;
    let ended = &w.state.sandboxes.sandboxes[&gone];
    assert!(!ended.is_live());
    assert!(ended.env.is_empty(), "an ended sandbox keeps no environment");
    assert_eq!(
        ended.labels,
        labels(&[("task", "t1")]),
        "how it was labelled is still shown"
    );

    // 59 minutes later it is still listed, with how it ended...
    w.advance(59 * MINUTE);
    w.sandbox(&admin, &root);
    assert!(w.state.sandboxes.sandboxes.contains_key(&gone));
    // ...and an hour after it ended it has left the live views; the live one stays,
    // however old.
    w.advance(MINUTE + 1000);
    w.sandbox(&admin, &root);
    assert!(
        !w.state.sandboxes.sandboxes.contains_key(&gone),
        "swept an hour after it ended"
    );
    assert!(w.state.sandboxes.sandboxes.contains_key(&kept));
    // The audit view still says who created and killed it.
    let actions: Vec<_> = w
        .state
        .audit
        .records
        .iter()
        .filter(|r| r.target == gone)
        .map(|r| r.action.as_str())
        .collect();
    assert_eq!(actions, ["sandbox.create", "sandbox.kill"]);
    // The log still holds it: folded as of its kill, it is there.
    let mut then = State::new();
    for (i, b) in w.log.iter().filter(|(i, _)| *i <= killed_at) {
        then.apply_encoded(*i, b);
    }
    assert!(then.sandboxes.sandboxes.contains_key(&gone));
    // Every node folding the same log sweeps the same.
    assert_eq!(w.replayed(), w.state);
}

#[test]
fn a_sandbox_its_edge_reported_exited_leaves_by_the_same_clock_and_a_late_report_finds_nothing() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    // The admin registered the edge: its token speaks for it.
    let a = w.sandbox(&admin, &root);
    w.report(&admin, &a, Observation::Ready);
    // Reported exited by its edge: released then.
    w.report(
        &admin,
        &a,
        Observation::Exited {
            exit_code: 0,
            oom_killed: false,
            reason: String::new(),
        },
    );
    assert!(!w.state.sandboxes.sandboxes[&a].is_live());
    w.advance(61 * MINUTE);
    w.sandbox(&admin, &root);
    assert!(!w.state.sandboxes.sandboxes.contains_key(&a));
    // A late report of it finds nothing to change, and says so.
    let err = w.run(
        &admin,
        Command::ReportSandbox {
            sandbox: a.clone(),
            observation: Observation::Ready,
        },
    );
    assert_eq!(err.unwrap_err().kind, K::NotFound);
}

#[test]
fn a_cluster_admin_sets_the_retention_a_setting_left_out_keeps_its_value_and_bad_ones_name_their_field() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    assert_eq!(w.state.retention, Retention::default());
    assert_eq!(w.state.retention.ended_sandboxes_ms, 3_600_000);
    assert_eq!(w.state.retention.audit_records, DEFAULT_AUDIT_RECORDS);

    w.run(&admin, retention(Some(0), None, None)).unwrap();
    assert_eq!(w.last_audit().action, "cluster.set_retention");
    assert_eq!(w.state.retention.ended_sandboxes_ms, 0);
    assert_eq!(w.state.retention.audit_ms, 30 * 24 * 60 * MINUTE, "left out: kept");

    // With no retention, an ended sandbox leaves at the next sweep (a second of log time).
    let a = w.sandbox(&admin, &root);
    w.run(&admin, kill(&a)).unwrap();
    w.advance(1000);
    w.sandbox(&admin, &root);
    assert!(!w.state.sandboxes.sandboxes.contains_key(&a));

    for (cmd, field) in [
        (retention(None, Some(60), None), "audit_seconds"),
        (retention(None, Some(u64::MAX), None), "audit_seconds"),
        (retention(None, None, Some(10)), "audit_records"),
        (retention(None, None, Some(u64::MAX)), "audit_records"),
        (retention(Some(u64::MAX), None, None), "ended_sandboxes_seconds"),
    ] {
        let err = w.run(&admin, cmd).unwrap_err();
        assert_eq!(
            (err.kind, err.field.as_deref()),
            (K::Invalid, Some(field)),
            "{}",
            err.message
        );
    }

    // Only a cluster admin, and only in the root project.
    let team = w.project(&admin, &root, "team");
    let team_admin = w.issue(&admin, &team, &Right::ALL, None);
    assert_eq!(
        w.run(&team_admin, retention(Some(60), None, None)).unwrap_err().kind,
        K::Forbidden
    );
    let operator = w.issue(&admin, &root, &[Right::ProjectWrite, Right::QuotaWrite], None);
    assert_eq!(
        w.run(&operator, retention(Some(60), None, None)).unwrap_err().kind,
        K::Forbidden
    );
}

#[test]
fn the_audit_view_keeps_its_retention_but_never_a_record_a_retry_may_need() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    w.run(&admin, retention(None, None, Some(1000))).unwrap();
    // 1500 writes within a minute: over the count, but all inside the request window.
    for i in 0..1500 {
        w.advance(40);
        w.project(&admin, &root, &format!("p{i}"));
    }
    assert!(w.state.audit.records.len() > 1500, "a retry may still need every one");
    assert_eq!(w.state.audit.first_index(), None, "nothing taken yet");

    // Past the window, the oldest go, down to the count.
    w.advance(REQUEST_WINDOW_MS);
    w.sandbox(&admin, &root);
    assert_eq!(w.state.audit.records.len(), 1001, "1000 kept, then this write's");
    let first = w.state.audit.records[0].index;
    assert_eq!(w.state.audit.first_index(), Some(first));
    assert_eq!(w.state.audit.result_at(first - 1), None);

    // By age: with the least age (the request window), everything older goes.
    w.run(&admin, retention(None, Some(REQUEST_WINDOW_MS / 1000), None))
        .unwrap();
    w.advance(REQUEST_WINDOW_MS + 1000);
    w.sandbox(&admin, &root);
    assert_eq!(w.state.audit.records.len(), 1, "only this write's record is younger");
    assert_eq!(w.replayed(), w.state);
}

#[test]
fn environment_and_labels_count_against_a_metadata_quota() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let team = w.project(&admin, &root, "team");
    w.set_quota(
        &admin,
        &team,
        Limits {
            metadata_bytes: Some(10_000),
            ..Limits::default()
        },
    );
    let big = "v".repeat(5_993); // "KEY" + 5 993 + "a" + "b" = 5 998 bytes
    let vars = env(&[("KEY", &big)]);
    let l = labels(&[("a", "b")]);
    assert_eq!(metadata_bytes(&vars, &l), 5_998);

    let first = w.run(&admin, create_with(&team, vars.clone(), l.clone())).unwrap();
    assert!(matches!(first.outcome, Outcome::Applied { .. }));
    assert_eq!(w.usage(&team).metadata_bytes, 5_998);
    assert_eq!(w.usage(&root).metadata_bytes, 5_998, "counted against every ancestor");

    let err = w.run(&admin, create_with(&team, vars.clone(), l.clone())).unwrap_err();
    assert_eq!(err.kind, K::QuotaExceeded);
    assert!(err.message.contains("metadata_bytes"), "{}", err.message);

    // Labels set later count too: growing past the quota is refused, shrinking frees.
    let id = first.decided.target;
    let huge: BTreeMap<String, String> = (0..20).map(|i| (format!("k{i:02}"), "x".repeat(250))).collect();
    let err = w
        .run(
            &admin,
            Command::SetSandboxLabels {
                sandbox: id.clone(),
                labels: huge,
            },
        )
        .unwrap_err();
    assert_eq!(err.kind, K::QuotaExceeded);
    w.run(
        &admin,
        Command::SetSandboxLabels {
            sandbox: id.clone(),
            labels: BTreeMap::new(),
        },
    )
    .unwrap();
    assert_eq!(w.usage(&team).metadata_bytes, 5_996);

    // Ended, it holds nothing: the next one fits.
    w.run(&admin, kill(&id)).unwrap();
    assert_eq!(w.usage(&team).metadata_bytes, 0);
    w.run(&admin, create_with(&team, vars, l)).unwrap();
    assert_eq!(w.usage(&team).metadata_bytes, 5_998);
    assert_eq!(w.replayed(), w.state);
    // Derived from the sandboxes, it is counted again in a state read back (a snapshot).
    assert_eq!(State::from_bytes(&w.state.to_bytes()).unwrap(), w.state);
}
