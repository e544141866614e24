//! IAM: bootstrap, nested projects, subtree scoping and bounded delegation of tokens.

mod support;

use opendsec_commands::{Caller, Command, Observation, RejectionKind as K};
use opendsec_projections::{AuditResult, Outcome, Right};
use support::*;

fn bootstrap_cmd() -> Command {
    Command::Bootstrap {
        project_name: "again".into(),
        token_name: "admin2".into(),
        secret_sha256: secret_hash("x"),
    }
}

#[test]
fn bootstrap_creates_the_root_project_and_an_admin_token_holding_every_right() {
    let mut w = World::new();
    let admin = w.bootstrap();

    let root = &w.state.iam.projects[&w.root];
    assert_eq!((root.name.as_str(), root.parent.as_ref()), ("root", None));
    let tok = &w.state.iam.tokens[&admin];
    assert_eq!(tok.project, w.root);
    assert_eq!(tok.rights.iter().copied().collect::<Vec<_>>(), Right::ALL.to_vec());
    assert_eq!((tok.expires_at_ms, tok.issued_by.as_ref()), (None, None));
    assert_eq!(
        tok.secret_sha256,
        secret_hash("admin"),
        "only the hash of the secret is kept"
    );
    assert_eq!(w.last_audit().principal, "system:");
    assert_eq!(w.last_audit().action, "cluster.bootstrap");
}

#[test]
fn bootstrap_is_legal_once_only_and_the_second_attempt_is_a_logged_conflict() {
    let mut w = World::new();
    w.bootstrap();
    let err = w.run_as(Caller::System, bootstrap_cmd()).unwrap_err();
    assert_eq!(err.kind, K::Conflict);
    assert_eq!(w.state.iam.projects.len(), 1);
    assert_eq!(w.state.iam.tokens.len(), 1);
    assert!(matches!(&w.last_audit().result, AuditResult::Denied { code, .. } if code == "conflict"));
}

#[test]
fn only_the_system_may_bootstrap() {
    let mut w = World::new();
    let admin = w.bootstrap();
    let err = w.run(&admin, bootstrap_cmd()).unwrap_err();
    assert_eq!(err.kind, K::Forbidden);
}

#[test]
fn two_bootstraps_in_flight_cannot_both_win() {
    let mut w = World::new();
    let cmd = |name: &str| Command::Bootstrap {
        project_name: name.into(),
        token_name: "admin".into(),
        secret_sha256: secret_hash("s"),
    };
    // Same name: the overlay already refuses the second one.
    let a = w.propose_as(Caller::System, cmd("root"), Overlay::Used);
    let b = w.propose_as(Caller::System, cmd("root"), Overlay::Used);
    assert_eq!(b.decided.as_ref().unwrap_err().kind, K::Conflict);
    // Different names slip past the overlay, but apply refuses a second root.
    let c = w.propose_as(Caller::System, cmd("other"), Overlay::Used);
    assert!(c.decided.is_ok());
    assert!(matches!(w.commit(a), Some((_, Outcome::Applied { .. }))));
    w.commit(b);
    assert!(matches!(w.commit(c), Some((_, Outcome::Rejected { .. }))));
    assert_eq!(w.state.iam.projects.len(), 1);
}

#[test]
fn projects_nest_and_the_view_links_parents_and_children() {
    let mut w = World::new();
    let admin = w.bootstrap();
    let root = w.root.clone();
    let team = w.project(&admin, &root, "team");
    let sub = w.project(&admin, &team, "sub");

    let p = &w.state.iam.projects;
    assert_eq!(p[&team].parent.as_deref(), Some(root.as_str()));
    assert_eq!(p[&sub].parent.as_deref(), Some(team.as_str()));
    assert!(p[&root].children.contains(&team));
    assert!(p[&team].children.contains(&sub));
    let ancestry: Vec<_> = w.state.ancestry(&sub).iter().map(|p| p.name.clone()).collect();
    assert_eq!(ancestry, ["sub", "team", "root"]);
}

#[test]
fn sibling_projects_have_distinct_names_but_cousins_may_share_one() {
    let mut w = World::new();
    let admin = w.bootstrap();
    let root = w.root.clone();
    let a = w.project(&admin, &root, "a");
    let b = w.project(&admin, &root, "b");
    w.project(&admin, &a, "web");
    w.project(&admin, &b, "web");
    let err = w
        .run(
            &admin,
            Command::CreateProject {
                name: "web".into(),
                parent: a.clone(),
            },
        )
        .unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::Conflict, Some("name")));
}

/// A token of project `a` (with every right) against things in its sibling `b`.
#[test]
fn a_token_acts_only_within_its_project_subtree() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let a = w.project(&admin, &root, "a");
    let b = w.project(&admin, &root, "b");
    let a_child = w.project(&admin, &a, "a-child");
    let in_b = w.sandbox(&admin, &b);
    let b_token = w.issue(&admin, &b, &[Right::SandboxRead], None);
    let all: Vec<Right> = Right::ALL.to_vec();
    let a_token = w.issue(&admin, &a, &all, None);

    // Within its subtree it may act.
    w.project(&a_token, &a_child, "deeper");
    w.sandbox(&a_token, &a_child);

    let outside: Vec<(Command, &str)> = vec![
        (
            Command::CreateProject {
                name: "x".into(),
                parent: b.clone(),
            },
            "parent",
        ),
        (
            Command::CreateProject {
                name: "x".into(),
                parent: root.clone(),
            },
            "parent",
        ),
        (create_in(&b), "project"),
        (
            Command::SetQuota {
                project: b.clone(),
                limits: at_most(1),
            },
            "project",
        ),
        (Command::DeleteProject { project: b.clone() }, "project"),
        (Command::KillSandbox { sandbox: in_b.clone() }, "sandbox"),
        (
            Command::PauseSandbox {
                sandbox: in_b.clone(),
                filesystem: false,
            },
            "sandbox",
        ),
        (
            Command::ForkSandbox {
                sandbox: in_b.clone(),
                count: 1,
                edge: None,
            },
            "sandbox",
        ),
        (
            Command::ReportSandbox {
                sandbox: in_b.clone(),
                observation: Observation::Exited {
                    exit_code: 0,
                    oom_killed: false,
                    reason: String::new(),
                },
            },
            "sandbox",
        ),
        (
            Command::RevokeToken {
                token: b_token.clone(),
                reason: String::new(),
            },
            "token",
        ),
        (
            Command::IssueToken {
                project: b.clone(),
                name: "x".into(),
                rights: vec![],
                ttl_seconds: None,
                secret_sha256: secret_hash("x"),
            },
            "project",
        ),
    ];
    for (cmd, field) in outside {
        let before = w.state.clone();
        let err = w.run(&a_token, cmd.clone()).unwrap_err();
        assert_eq!((err.kind, err.field.as_deref()), (K::Forbidden, Some(field)), "{cmd:?}");
        assert_eq!(w.state.sandboxes, before.sandboxes, "{cmd:?} changed nothing");
        assert_eq!(w.state.iam, before.iam, "{cmd:?} changed nothing");
        assert!(
            matches!(w.last_audit().result, AuditResult::Denied { .. }),
            "{cmd:?} is audited as denied"
        );
    }
}

#[test]
fn a_token_holds_only_the_rights_it_was_given() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let reader = w.issue(&admin, &root, &[Right::SandboxRead], None);
    let err = w.try_sandbox(&reader, &root).unwrap_err();
    assert_eq!(err.kind, K::Forbidden);
    assert!(err.message.contains("sandbox:write"), "{}", err.message);
}

#[test]
fn a_principal_cannot_grant_a_right_it_lacks() {
    let mut w = World::new();
    let admin = w.bootstrap();
    let root = w.root.clone();
    let team = w.project(&admin, &root, "team");
    let lead = w.issue(&admin, &team, &[Right::TokenWrite, Right::SandboxWrite], None);

    let ok = w.issue(&lead, &team, &[Right::SandboxWrite], None);
    assert_eq!(w.state.iam.tokens[&ok].issued_by.as_deref(), Some(lead.as_str()));

    let err = w
        .try_issue(&lead, &team, &[Right::SandboxWrite, Right::QuotaWrite], None)
        .unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::Forbidden, Some("rights")));
    assert!(err.message.contains("quota:write"), "{}", err.message);
}

#[test]
fn a_principal_cannot_issue_a_token_for_a_project_outside_its_subtree() {
    let mut w = World::new();
    let admin = w.bootstrap();
    let root = w.root.clone();
    let team = w.project(&admin, &root, "team");
    let other = w.project(&admin, &root, "other");
    let sub = w.project(&admin, &team, "sub");
    let lead = w.issue(&admin, &team, &[Right::TokenWrite], None);

    w.issue(&lead, &sub, &[Right::TokenWrite], None);
    for outside in [&other, &root] {
        let err = w.try_issue(&lead, outside, &[], None).unwrap_err();
        assert_eq!((err.kind, err.field.as_deref()), (K::Forbidden, Some("project")));
    }
}

#[test]
fn a_delegated_token_never_outlives_its_issuer() {
    let mut w = World::new();
    let admin = w.bootstrap();
    let root = w.root.clone();
    let lead = w.issue(&admin, &root, &[Right::TokenWrite], Some(60));
    let lead_expiry = w.state.iam.tokens[&lead].expires_at_ms.unwrap();
    assert_eq!(lead_expiry, w.now_ms + 60_000);

    // (requested ttl, expected expiry)
    let cases = [
        (None, lead_expiry),
        (Some(0), lead_expiry),
        (Some(3600), lead_expiry),
        (Some(10), w.now_ms + 10_000),
    ];
    for (ttl, expected) in cases {
        let t = w.issue(&lead, &root, &[], ttl);
        assert_eq!(w.state.iam.tokens[&t].expires_at_ms, Some(expected), "ttl {ttl:?}");
    }
}

#[test]
fn a_revoked_token_is_refused_as_unauthenticated_and_nothing_is_logged() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let t = w.issue(&admin, &root, &[Right::SandboxWrite], None);
    w.sandbox(&t, &root);
    w.run(
        &admin,
        Command::RevokeToken {
            token: t.clone(),
            reason: "leaked".into(),
        },
    )
    .unwrap();
    assert_eq!(w.state.iam.tokens[&t].revoked.as_ref().unwrap().reason, "leaked");

    let log_len = w.log.len();
    let err = w.try_sandbox(&t, &root).unwrap_err();
    assert_eq!(err.kind, K::Unauthenticated);
    assert_eq!(w.log.len(), log_len);

    let again = w
        .run(
            &admin,
            Command::RevokeToken {
                token: t.clone(),
                reason: "twice".into(),
            },
        )
        .unwrap_err();
    assert_eq!((again.kind, again.field.as_deref()), (K::Conflict, Some("token")));
}

#[test]
fn an_expired_token_is_refused_from_the_moment_it_expires() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let t = w.issue(&admin, &root, &[Right::SandboxWrite], Some(30));
    w.advance(29_999);
    w.sandbox(&t, &root);
    w.advance(1);
    let log_len = w.log.len();
    assert_eq!(w.try_sandbox(&t, &root).unwrap_err().kind, K::Unauthenticated);
    assert_eq!(w.log.len(), log_len);
}

#[test]
fn an_unknown_token_is_refused_as_unauthenticated() {
    let (mut w, _) = World::with_admin_and_edge();
    let root = w.root.clone();
    assert_eq!(
        w.try_sandbox("feedfacefeedface", &root).unwrap_err().kind,
        K::Unauthenticated
    );
}

#[test]
fn a_revocation_in_flight_already_refuses_the_token() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let t = w.issue(&admin, &root, &[Right::SandboxWrite], None);

    let revoke = w.propose(
        &admin,
        Command::RevokeToken {
            token: t.clone(),
            reason: "leaked".into(),
        },
        Overlay::Used,
    );
    assert!(revoke.decided.is_ok());
    let attempt = w.propose(&t, create_in(&root), Overlay::Used);
    assert_eq!(attempt.decided.unwrap_err().kind, K::Unauthenticated);
    assert!(attempt.batch.is_none());
    let second = w.propose(
        &admin,
        Command::RevokeToken {
            token: t.clone(),
            reason: "again".into(),
        },
        Overlay::Used,
    );
    assert_eq!(second.decided.as_ref().unwrap_err().kind, K::Conflict);

    w.commit(revoke);
    w.commit(second);
    assert!(w.state.iam.tokens[&t].revoked.is_some());
    assert!(w.inflight.is_empty());
}

#[test]
fn projects_nest_at_most_sixteen_deep_and_quota_holds_at_the_deepest() {
    let mut w = World::new();
    let admin = w.bootstrap();
    w.edge(&admin, "e1", capacity(100, 100_000, 100_000));
    let root = w.root.clone();
    w.set_quota(&admin, &root, at_most(1));
    let mut parent = root.clone();
    for depth in 2..=opendsec_projections::MAX_PROJECT_DEPTH {
        parent = w.project(&admin, &parent, &format!("level{depth}"));
    }
    assert_eq!(w.state.ancestry(&parent).len(), opendsec_projections::MAX_PROJECT_DEPTH);
    let before = w.log.len();
    let err = w
        .run(
            &admin,
            Command::CreateProject {
                name: "too-deep".into(),
                parent: parent.clone(),
            },
        )
        .unwrap_err();
    assert_eq!(
        (err.kind, err.field.as_deref()),
        (K::Invalid, Some("parent")),
        "{err:?}"
    );
    assert!(err.message.contains("at most 16 deep"), "{}", err.message);
    assert_eq!(w.log.len(), before, "bad input leaves the log unchanged");
    // The root's quota binds the deepest project: its whole ancestry counts.
    w.sandbox(&admin, &parent);
    let err = w.try_sandbox(&admin, &parent).unwrap_err();
    assert_eq!(err.kind, K::QuotaExceeded, "{err:?}");
    assert_eq!(w.usage(&root).sandboxes, 1);
}
