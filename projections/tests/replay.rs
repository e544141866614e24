//! Time travel: folding the log to an index or a time, from scratch or from a
//! checkpoint, and diffing the views between two points.

use expect_test::{Expect, expect};
use opendsec_projections::diff::diff;
use opendsec_projections::replay::{Until, fold};
use opendsec_projections::schema::{Batch, Denial, Principal, encode_batch};
use opendsec_projections::{AuditResult, Desired, Event, Observed, Right, State, pb};

const SANDBOX: &str = "00000000000000a10000";
const ROOT: &str = "p000000000001";

fn batch(time_ms: u64, action: &str, target: &str, events: Vec<Event>) -> Batch {
    Batch {
        time_ms,
        request_id: format!("req-{time_ms}"),
        principal: Some(Principal {
            kind: "token".into(),
            id: "tok-admin".into(),
            project: ROOT.into(),
        }),
        action: action.into(),
        project: ROOT.into(),
        target: target.into(),
        events: events.iter().map(Event::to_envelope).collect(),
        denial: None,
        seed: time_ms,
        request_digest: String::new(),
    }
}

/// The story the log tells, one batch a second:
/// 1 bootstrap, 2 an edge, 3 a sandbox, 4 it is ready, 5 a create denied for quota,
/// 6 it is paused, 7 it is killed, 8 the edge reports it exited.
fn the_log() -> Vec<(u64, Vec<u8>)> {
    let id = || SANDBOX.to_string();
    let batches = [
        batch(
            1_000,
            "cluster.bootstrap",
            "tok-admin",
            vec![
                Event::ProjectCreated(pb::ProjectCreated {
                    id: ROOT.into(),
                    name: "root".into(),
                    parent: String::new(),
                }),
                Event::TokenIssued(pb::TokenIssued {
                    id: "tok-admin".into(),
                    project: ROOT.into(),
                    name: "admin".into(),
                    rights: Right::ALL.iter().map(|r| r.as_str().to_string()).collect(),
                    secret_sha256: vec![7; 32],
                    expires_at_ms: 0,
                    issued_by: String::new(),
                }),
            ],
        ),
        batch(
            2_000,
            "edge.register",
            "edge-a",
            vec![Event::EdgeRegistered(pb::EdgeRegistered {
                id: "edge-a".into(),
                ordinal: 0,
                address: "edge-a:7401".into(),
                capacity: Some(pb::Resources {
                    sandboxes: Some(10),
                    cpu_millis: Some(10_000),
                    memory_mb: Some(10_000),
                    metadata_bytes: None,
                }),
                labels: Default::default(),
                token: String::new(),
            })],
        ),
        batch(
            3_000,
            "sandbox.create",
            SANDBOX,
            vec![Event::SandboxCreated(pb::SandboxCreated {
                id: id(),
                project: ROOT.into(),
                edge: "edge-a".into(),
                image: "python:3.12".into(),
                cpu_millis: 500,
                memory_mb: 256,
                labels: Default::default(),
                expires_at_ms: 0,
                fork_of: String::new(),
                placement: Some(pb::Placement {
                    candidates: vec!["edge-a".into()],
                    chosen: "edge-a".into(),
                    refused_by: vec![],
                }),
                ..Default::default()
            })],
        ),
        batch(
            4_000,
            "sandbox.report",
            SANDBOX,
            vec![Event::SandboxReady(pb::SandboxReady {
                id: id(),
                ..Default::default()
            })],
        ),
        Batch {
            denial: Some(Denial {
                code: "quota_exceeded".into(),
                message: "quota of project root exceeded".into(),
                field: String::new(),
            }),
            ..batch(5_000, "sandbox.create", "python:3.12", vec![])
        },
        batch(
            6_000,
            "sandbox.pause",
            SANDBOX,
            vec![Event::SandboxPauseRequested(pb::SandboxPauseRequested {
                id: id(),
                filesystem: false,
            })],
        ),
        batch(
            7_000,
            "sandbox.kill",
            SANDBOX,
            vec![Event::SandboxKillRequested(pb::SandboxKillRequested {
                id: id(),
                reason: "user".into(),
            })],
        ),
        batch(
            8_000,
            "sandbox.report",
            SANDBOX,
            vec![Event::SandboxExited(pb::SandboxExited {
                id: id(),
                exit_code: 137,
                oom_killed: false,
                reason: "killed".into(),
            })],
        ),
    ];
    batches
        .iter()
        .enumerate()
        .map(|(i, b)| (i as u64 + 1, encode_batch(b)))
        .collect()
}

fn entries(log: &[(u64, Vec<u8>)]) -> impl Iterator<Item = (u64, &[u8])> {
    log.iter().map(|(i, b)| (*i, b.as_slice()))
}

/// The state after the first `n` batches, applied one by one without `fold`.
fn applied(log: &[(u64, Vec<u8>)], n: usize) -> State {
    let mut s = State::new();
    for (i, b) in &log[..n] {
        s.apply_encoded(*i, b);
    }
    s
}

#[test]
fn every_batch_of_the_story_applies() {
    let log = the_log();
    let s = applied(&log, log.len());
    let results: Vec<&str> = s
        .audit
        .records
        .iter()
        .map(|r| match r.result {
            AuditResult::Ok => "ok",
            AuditResult::Denied { .. } => "denied",
            AuditResult::Rejected { .. } => "rejected",
        })
        .collect();
    assert_eq!(results, ["ok", "ok", "ok", "ok", "denied", "ok", "ok", "ok"]);
}

#[test]
fn folding_to_an_index_includes_every_batch_up_to_and_including_it() {
    let log = the_log();
    for n in 0..=log.len() {
        let (s, folded) = fold(State::new(), entries(&log), Until::Index(n as u64));
        assert_eq!(folded, n as u64);
        assert_eq!(s.index, n as u64);
        assert_eq!(s, applied(&log, n), "to index {n}");
    }
    let (s, folded) = fold(State::new(), entries(&log), Until::Index(999));
    assert_eq!((folded, s.index), (8, 8), "an index past the end folds everything");
}

#[test]
fn folding_to_a_time_includes_every_batch_decided_at_or_before_it() {
    let log = the_log();
    // (until time, batches folded)
    for (t, n) in [
        (0, 0),
        (999, 0),
        (1_000, 1),
        (3_500, 3),
        (4_999, 4),
        (5_000, 5),
        (8_000, 8),
        (u64::MAX, 8),
    ] {
        let (s, folded) = fold(State::new(), entries(&log), Until::Time(t));
        assert_eq!(folded, n, "until {t}");
        assert_eq!(s, applied(&log, n as usize), "until {t}");
        assert!(s.time_ms <= t);
    }
}

#[test]
fn the_sandbox_as_it_was_at_each_point_of_the_log() {
    let log = the_log();
    let at = |n: u64| {
        let (s, _) = fold(State::new(), entries(&log), Until::Index(n));
        s.sandboxes
            .sandboxes
            .get(SANDBOX)
            .map(|x| (x.desired, x.observed, x.released, s.quota.usage[ROOT].sandboxes))
    };
    // (index, (desired, observed, released, root's sandbox usage))
    let expected = [
        (2, None),
        (3, Some((Desired::Running, Observed::Pending, false, 1))),
        (4, Some((Desired::Running, Observed::Ready, false, 1))),
        (5, Some((Desired::Running, Observed::Ready, false, 1))),
        (6, Some((Desired::Paused, Observed::Ready, false, 1))),
        (7, Some((Desired::Killed, Observed::Ready, true, 0))),
        (8, Some((Desired::Killed, Observed::Exited, true, 0))),
    ];
    for (n, want) in expected {
        assert_eq!(at(n), want, "at index {n}");
    }
}

#[test]
fn folding_from_a_checkpoint_then_the_rest_equals_folding_everything() {
    let log = the_log();
    let (everything, _) = fold(State::new(), entries(&log), Until::Index(u64::MAX));
    for k in 0..=log.len() as u64 {
        let (at_k, _) = fold(State::new(), entries(&log), Until::Index(k));
        let checkpoint = State::from_bytes(&at_k.to_bytes()).expect("a checkpoint reads back");
        assert_eq!(checkpoint.hash(), at_k.hash());
        // The whole log is passed: batches the checkpoint already holds are skipped.
        let (s, folded) = fold(checkpoint, entries(&log), Until::Index(u64::MAX));
        assert_eq!(folded, log.len() as u64 - k, "from checkpoint {k}");
        assert_eq!(s.to_bytes(), everything.to_bytes(), "from checkpoint {k}");
    }
}

#[test]
fn a_checkpoint_that_does_not_decode_is_refused_by_name() {
    let err = State::from_bytes(b"{\"index\": \"seven\"}").unwrap_err();
    assert!(err.starts_with("state snapshot does not decode"), "{err}");
}

#[test]
fn an_undecodable_entry_is_recorded_as_rejected_and_the_fold_goes_on() {
    let mut log = the_log();
    log.insert(3, (4, b"\xff\xff not protobuf".to_vec()));
    for (i, entry) in log.iter_mut().enumerate() {
        entry.0 = i as u64 + 1;
    }
    let (s, folded) = fold(State::new(), entries(&log), Until::Index(u64::MAX));
    assert_eq!(folded, 9);
    let bad = &s.audit.records[3];
    assert_eq!((bad.index, bad.action.as_str()), (4, "undecodable"));
    assert!(matches!(bad.result, AuditResult::Rejected { .. }));
    assert_eq!(
        s.sandboxes.sandboxes[SANDBOX].observed,
        Observed::Exited,
        "later batches still applied"
    );
}

fn check_diff(view: &str, from: u64, to: u64, expect: Expect) {
    let log = the_log();
    let (a, _) = fold(State::new(), entries(&log), Until::Index(from));
    let (b, _) = fold(State::new(), entries(&log), Until::Index(to));
    let changes = diff(&a.view_json(view).unwrap(), &b.view_json(view).unwrap());
    let text: String = changes
        .iter()
        .map(|c| {
            format!(
                "{}: {} -> {}\n",
                c.path,
                c.before.as_ref().map_or("-".into(), |v| v.to_string()),
                c.after.as_ref().map_or("-".into(), |v| v.to_string())
            )
        })
        .collect();
    expect.assert_eq(&text);
}

#[test]
fn diff_lists_the_paths_that_changed_between_two_points() {
    check_diff(
        "sandboxes",
        4,
        8,
        expect![[r#"
            /sandboxes/00000000000000a10000/desired: "running" -> "killed"
            /sandboxes/00000000000000a10000/exit_code: null -> 137
            /sandboxes/00000000000000a10000/index: 4 -> 8
            /sandboxes/00000000000000a10000/observed: "ready" -> "exited"
            /sandboxes/00000000000000a10000/reason: null -> "killed"
            /sandboxes/00000000000000a10000/released: false -> true
            /sandboxes/00000000000000a10000/updated_at_ms: 4000 -> 8000
        "#]],
    );
    check_diff(
        "quota",
        2,
        3,
        expect![[r#"
            /usage/p000000000001: - -> {"cpu_millis":500,"memory_mb":256,"sandboxes":1}
        "#]],
    );
    check_diff(
        "placement",
        6,
        7,
        expect![[r#"
            /edges/edge-a/assigned/cpu_millis: 500 -> 0
            /edges/edge-a/assigned/memory_mb: 256 -> 0
            /edges/edge-a/assigned/sandboxes: 1 -> 0
        "#]],
    );
}

#[test]
fn diff_of_the_audit_view_lists_the_records_added() {
    check_diff(
        "audit",
        4,
        5,
        expect![[r#"
            /records/4: - -> {"action":"sandbox.create","code":"quota_exceeded","index":5,"message":"quota of project root exceeded","principal":"token:tok-admin","project":"p000000000001","request_id":"req-5000","result":"denied","target":"python:3.12","time_ms":5000}
        "#]],
    );
}

#[test]
fn diff_between_a_point_and_itself_is_empty() {
    check_diff("sandboxes", 6, 6, expect![[""]]);
    check_diff("iam", 1, 8, expect![[""]]);
}

#[test]
fn the_iam_view_never_shows_token_secret_hashes() {
    let log = the_log();
    let s = applied(&log, 1);
    let iam = s.view_json("iam").unwrap();
    assert!(iam["tokens"]["tok-admin"].get("secret_sha256").is_none());
    assert!(iam["tokens"]["tok-admin"].get("rights").is_some());
    assert!(s.view_json("nope").is_none());
}

#[test]
fn views_never_show_an_egress_proxys_password_or_ca_certificate() {
    let log = the_log();
    let mut s = applied(&log, 6);
    let proxy = r#"{"allow_out":["pkgs.example.com"],"egressProxy":{"address":"p.example.com:1080","username":"u","password":"hunter2","tls":{"caCert":"-----BEGIN CERTIFICATE-----"}}}"#;
    let id = s.sandboxes.sandboxes.keys().next().expect("a sandbox").clone();
    s.sandboxes.sandboxes.get_mut(&id).unwrap().network = Some(proxy.to_string());
    s.quota.network.insert(
        "p000000000001".into(),
        opendsec_projections::views::ProjectNetwork {
            ceiling: Default::default(),
            default_network: Some(proxy.to_string()),
        },
    );
    let shown = format!("{}{}", s.view_json("sandboxes").unwrap(), s.view_json("quota").unwrap());
    assert!(
        !shown.contains("hunter2") && !shown.contains("BEGIN CERTIFICATE"),
        "{shown}"
    );
    assert!(
        shown.contains("p.example.com:1080") && shown.contains("<redacted>"),
        "{shown}"
    );
    // The state itself (what the edge applies) keeps them.
    assert!(
        s.sandboxes.sandboxes[&id]
            .network
            .as_deref()
            .unwrap()
            .contains("hunter2")
    );
}
