//! Invariant 7: every logged write, accepted or denied, lands in the audit view with
//! its principal, project, action, target, result and time. Bad input and unknown ids
//! are refused before anything is logged, naming the offending field.

mod support;

use opendsec_commands::{Command, LIMITS, Observation, RejectionKind as K};
use opendsec_projections::{AuditQuery, AuditResult};
use std::collections::BTreeMap;
use support::*;

#[test]
fn an_accepted_write_is_audited_with_who_what_where_when_and_the_result() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    w.advance(1_234);
    let ran = w.run(&admin, create_in(&root)).unwrap();
    let rec = w.last_audit().clone();
    assert_eq!(rec.index, ran.index);
    assert_eq!(rec.time_ms, w.now_ms);
    assert_eq!(rec.principal, format!("token:{admin}"));
    assert_eq!(rec.project, root);
    assert_eq!(rec.action, "sandbox.create");
    assert_eq!(rec.target, ran.decided.target);
    assert_eq!(rec.result, AuditResult::Ok);
    assert_eq!(rec.request_id, format!("req-{}", w.seed));
}

#[test]
fn a_denied_write_is_audited_with_the_code_and_reason() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let team = w.project(&admin, &root, "team");
    let reader = w.issue(&admin, &team, &[], None);
    let len = w.state.audit.records.len();

    let err = w.try_sandbox(&reader, &team).unwrap_err();
    assert_eq!(err.kind, K::Forbidden);
    assert_eq!(w.state.audit.records.len(), len + 1);
    let rec = w.last_audit();
    assert_eq!(
        (
            rec.principal.as_str(),
            rec.project.as_str(),
            rec.action.as_str(),
            rec.target.as_str(),
            rec.time_ms
        ),
        (
            format!("token:{reader}").as_str(),
            team.as_str(),
            "sandbox.create",
            "base",
            w.now_ms
        )
    );
    assert_eq!(
        rec.result,
        AuditResult::Denied {
            code: "forbidden".into(),
            message: err.message.clone()
        }
    );
}

#[test]
fn every_logged_batch_yields_exactly_one_audit_record_in_log_order() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let s = w.sandbox(&admin, &root);
    w.run(
        &admin,
        Command::PauseSandbox {
            sandbox: s.clone(),
            filesystem: false,
        },
    )
    .unwrap();
    w.run(&admin, Command::KillSandbox { sandbox: s.clone() }).unwrap();
    let _ = w.run(&admin, Command::KillSandbox { sandbox: s.clone() }); // denied: already ended
    let _ = w.run(&admin, create_in("nope")); // not found: not logged
    let indexes: Vec<u64> = w.state.audit.records.iter().map(|r| r.index).collect();
    let logged: Vec<u64> = w.log.iter().map(|(i, _)| *i).collect();
    assert_eq!(indexes, logged);
    let actions: Vec<&str> = w.state.audit.records.iter().map(|r| r.action.as_str()).collect();
    assert_eq!(
        actions,
        [
            "cluster.bootstrap",
            "edge.register",
            "sandbox.create",
            "sandbox.pause",
            "sandbox.kill",
            "sandbox.kill"
        ]
    );
}

#[test]
fn the_audit_view_answers_who_did_what_to_what() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let dev = w.issue(&admin, &root, &[opendsec_projections::Right::SandboxWrite], None);
    let s = w.sandbox(&dev, &root);
    w.run(&admin, Command::KillSandbox { sandbox: s.clone() }).unwrap();
    let q = AuditQuery {
        target: Some(s.clone()),
        limit: 10,
        ..Default::default()
    };
    let (recs, next) = w.state.audit.query(&q);
    let who: Vec<(&str, &str)> = recs.iter().map(|r| (r.principal.as_str(), r.action.as_str())).collect();
    assert_eq!(
        who,
        [
            (format!("token:{dev}").as_str(), "sandbox.create"),
            (format!("token:{admin}").as_str(), "sandbox.kill")
        ]
    );
    assert_eq!(next, None);
}

/// Runs `cmd` as `token` and checks it is refused as `kind` naming `field`, with the
/// log (and so every view) unchanged.
fn refused_unlogged(w: &mut World, token: &str, cmd: Command, kind: K, field: &str) {
    let (log_len, before) = (w.log.len(), w.state.to_bytes());
    let p = w.propose(token, cmd.clone(), Overlay::Used);
    let err = p.decided.as_ref().expect_err("refused");
    assert_eq!(
        (err.kind, err.field.as_deref()),
        (kind, Some(field)),
        "{cmd:?}: {}",
        err.message
    );
    assert!(p.batch.is_none(), "{cmd:?} produced a batch");
    assert!(w.commit(p).is_none());
    assert_eq!(w.log.len(), log_len);
    assert_eq!(w.state.to_bytes(), before);
}

#[test]
fn bad_input_is_refused_naming_the_field_and_leaves_the_log_unchanged() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let s = w.sandbox(&admin, &root);
    let long = "a".repeat(LIMITS.name_len + 1);
    let project = |name: &str| Command::CreateProject {
        name: name.into(),
        parent: root.clone(),
    };
    let quota = |l| Command::SetQuota {
        project: root.clone(),
        limits: l,
    };
    let issue = |name: &str, secret: &str, ttl| Command::IssueToken {
        project: root.clone(),
        name: name.into(),
        rights: vec![],
        ttl_seconds: ttl,
        secret_sha256: secret.into(),
    };
    let sandbox = |image: &str, cpu, mem, labels: BTreeMap<String, String>, timeout| Command::CreateSandbox {
        opts: Default::default(),
        project: root.clone(),
        image: image.into(),
        cpu_millis: cpu,
        memory_mb: mem,
        labels,
        timeout_seconds: timeout,
    };
    let too_many_labels: BTreeMap<String, String> = (0..=LIMITS.label_count)
        .map(|i| (format!("k{i}"), "v".into()))
        .collect();

    let cases: Vec<(Command, &str)> = vec![
        (project(""), "name"),
        (project(&long), "name"),
        (project("Web"), "name"),
        (project("-web"), "name"),
        (project("web app"), "name"),
        (quota(at_most(LIMITS.sandboxes + 1)), "limits.sandboxes"),
        (
            quota(limits(None, Some(LIMITS.cpu_millis + 1), None)),
            "limits.cpu_millis",
        ),
        (quota(limits(None, None, Some(u64::MAX))), "limits.memory_mb"),
        (issue("ok", "not-hex", None), "secret_sha256"),
        (issue("ok", &"ab".repeat(31), None), "secret_sha256"),
        (issue("Bad", &secret_hash("x"), None), "name"),
        (
            issue("ok", &secret_hash("x"), Some(LIMITS.timeout_seconds + 1)),
            "ttl_seconds",
        ),
        (sandbox("", 500, 256, labels(&[]), None), "image"),
        (sandbox("img", 0, 256, labels(&[]), None), "cpu_millis"),
        (sandbox("img", 500, 0, labels(&[]), None), "memory_mb"),
        (
            sandbox("img", LIMITS.cpu_millis + 1, 256, labels(&[]), None),
            "cpu_millis",
        ),
        (sandbox("img", 500, 256, labels(&[("", "v")]), None), "labels"),
        (
            sandbox(
                "img",
                500,
                256,
                labels(&[("k", &"v".repeat(LIMITS.label_value_len + 1))]),
                None,
            ),
            "labels",
        ),
        (sandbox("img", 500, 256, too_many_labels, None), "labels"),
        (
            sandbox("img", 500, 256, labels(&[]), Some(LIMITS.timeout_seconds + 1)),
            "timeout_seconds",
        ),
        (
            Command::ForkSandbox {
                sandbox: s.clone(),
                count: 0,
                edge: None,
            },
            "count",
        ),
        (
            Command::ForkSandbox {
                sandbox: s.clone(),
                count: LIMITS.fork_count + 1,
                edge: None,
            },
            "count",
        ),
        (
            Command::SetSandboxTimeout {
                sandbox: s.clone(),
                timeout_seconds: LIMITS.timeout_seconds + 1,
            },
            "timeout_seconds",
        ),
        (
            Command::RegisterEdge {
                edge: "e".into(),
                address: String::new(),
                capacity: capacity(1, 1, 1),
                labels: labels(&[]),
            },
            "address",
        ),
        (
            Command::RegisterEdge {
                edge: "E".into(),
                address: "h:1".into(),
                capacity: capacity(1, 1, 1),
                labels: labels(&[]),
            },
            "edge",
        ),
        (
            Command::RegisterEdge {
                edge: "e".into(),
                address: "h:1".into(),
                capacity: capacity(LIMITS.sandboxes + 1, 1, 1),
                labels: labels(&[]),
            },
            "capacity.sandboxes",
        ),
        (
            Command::RevokeToken {
                token: "t".into(),
                reason: "x".repeat(LIMITS.reason_len + 1),
            },
            "reason",
        ),
        (
            Command::ReportSandbox {
                sandbox: s.clone(),
                observation: Observation::Failed { reason: "\u{0}".into() },
            },
            "observation.reason",
        ),
    ];
    for (cmd, field) in cases {
        refused_unlogged(&mut w, &admin, cmd, K::Invalid, field);
    }
}

#[test]
fn unknown_ids_are_refused_as_not_found_naming_the_field_and_leave_the_log_unchanged() {
    let (mut w, admin) = World::with_admin_and_edge();
    let ghost = "00000000000000000000".to_string();
    let cases: Vec<(Command, &str)> = vec![
        (
            Command::CreateProject {
                name: "x".into(),
                parent: "p-nope".into(),
            },
            "parent",
        ),
        (
            Command::DeleteProject {
                project: "p-nope".into(),
            },
            "project",
        ),
        (
            Command::SetQuota {
                project: "p-nope".into(),
                limits: at_most(1),
            },
            "project",
        ),
        (create_in("p-nope"), "project"),
        (
            Command::IssueToken {
                project: "p-nope".into(),
                name: "x".into(),
                rights: vec![],
                ttl_seconds: None,
                secret_sha256: secret_hash("x"),
            },
            "project",
        ),
        (
            Command::RevokeToken {
                token: "nope".into(),
                reason: String::new(),
            },
            "token",
        ),
        (Command::DeregisterEdge { edge: "nope".into() }, "edge"),
        (
            Command::ForkSandbox {
                sandbox: ghost.clone(),
                count: 1,
                edge: None,
            },
            "sandbox",
        ),
        (
            Command::PauseSandbox {
                sandbox: ghost.clone(),
                filesystem: false,
            },
            "sandbox",
        ),
        (
            Command::ResumeSandbox {
                sandbox: ghost.clone(),
                cold: false,
            },
            "sandbox",
        ),
        (Command::KillSandbox { sandbox: ghost.clone() }, "sandbox"),
        (
            Command::SetSandboxTimeout {
                sandbox: ghost.clone(),
                timeout_seconds: 1,
            },
            "sandbox",
        ),
        (
            Command::SetSandboxLabels {
                sandbox: ghost.clone(),
                labels: labels(&[]),
            },
            "sandbox",
        ),
        (
            Command::ReportSandbox {
                sandbox: ghost.clone(),
                observation: Observation::Ready,
            },
            "sandbox",
        ),
    ];
    for (cmd, field) in cases {
        refused_unlogged(&mut w, &admin, cmd, K::NotFound, field);
    }
}

#[test]
fn commands_arrive_as_tagged_json_and_unknown_fields_are_refused() {
    let cmd: Command =
        serde_json::from_value(serde_json::json!({"command": "fork_sandbox", "sandbox": "s", "count": 3})).unwrap();
    assert_eq!(
        cmd,
        Command::ForkSandbox {
            sandbox: "s".into(),
            count: 3,
            edge: None
        }
    );
    assert_eq!(cmd.action(), "sandbox.fork");
    let err = serde_json::from_value::<Command>(
        serde_json::json!({"command": "kill_sandbox", "sandbox": "s", "force": true}),
    );
    assert!(err.is_err());
}
