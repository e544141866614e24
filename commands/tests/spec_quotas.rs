//! Hierarchical quotas: a child's limits never exceed its parent's, usage counts
//! against every ancestor, and ending a sandbox gives its share back exactly once.

mod support;

use opendsec_commands::{Command, Observation, RejectionKind as K};
use opendsec_projections::{AuditResult, Usage};
use support::*;

/// root -> team -> sub, with one roomy edge and the root admin.
fn three_levels() -> (World, String, [String; 3]) {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let team = w.project(&admin, &root, "team");
    let sub = w.project(&admin, &team, "sub");
    (w, admin, [root, team, sub])
}

fn set_quota(
    w: &mut World,
    token: &str,
    project: &str,
    l: opendsec_projections::Limits,
) -> Result<(), opendsec_commands::Rejection> {
    w.run(
        token,
        Command::SetQuota {
            project: project.into(),
            limits: l,
        },
    )
    .map(|_| ())
}

#[test]
fn a_childs_limit_can_never_exceed_its_parents_and_the_refusal_names_the_field() {
    let (mut w, admin, [root, team, sub]) = three_levels();
    w.set_quota(&admin, &root, limits(Some(10), Some(8_000), Some(4_096)));
    w.set_quota(&admin, &team, limits(Some(5), Some(4_000), Some(2_048)));

    // (limits asked for `sub`, field named in the refusal); `sub`'s bound is `team`'s limits.
    let cases = [
        (limits(Some(6), Some(4_000), Some(2_048)), "limits.sandboxes"),
        (limits(Some(5), Some(4_001), Some(2_048)), "limits.cpu_millis"),
        (limits(Some(5), Some(4_000), Some(9_999)), "limits.memory_mb"),
        // "No limit of its own" would be more than the parent allows.
        (limits(Some(5), None, Some(2_048)), "limits.cpu_millis"),
    ];
    for (l, field) in cases {
        let err = set_quota(&mut w, &admin, &sub, l).unwrap_err();
        assert_eq!(
            (err.kind, err.field.as_deref()),
            (K::Invalid, Some(field)),
            "{l:?}: {}",
            err.message
        );
    }
    assert!(!w.state.quota.limits.contains_key(&sub));
    w.set_quota(&admin, &sub, limits(Some(5), Some(4_000), Some(2_048)));
}

#[test]
fn a_parent_cannot_be_lowered_below_a_childs_limit() {
    let (mut w, admin, [root, team, sub]) = three_levels();
    w.set_quota(&admin, &root, at_most(10));
    w.set_quota(&admin, &team, at_most(8));
    w.set_quota(&admin, &sub, at_most(6));

    let err = set_quota(&mut w, &admin, &team, at_most(5)).unwrap_err();
    assert_eq!(
        (err.kind, err.field.as_deref()),
        (K::Conflict, Some("limits.sandboxes"))
    );
    // Not even from two levels up.
    let err = set_quota(&mut w, &admin, &root, at_most(5)).unwrap_err();
    assert_eq!(
        (err.kind, err.field.as_deref()),
        (K::Conflict, Some("limits.sandboxes"))
    );
    w.set_quota(&admin, &team, at_most(6));
    assert_eq!(w.state.quota.limits[&team].sandboxes, Some(6));
}

#[test]
fn a_parent_cannot_be_lowered_below_a_grandchilds_limit_on_any_resource() {
    let (mut w, admin, [_, team, sub]) = three_levels();
    // `sub` limits CPU only, while nothing above it is limited yet.
    w.set_quota(&admin, &sub, limits(None, Some(5_000), None));
    let err = set_quota(&mut w, &admin, &team, limits(Some(5), Some(1_000), None)).unwrap_err();
    assert_eq!(
        (err.kind, err.field.as_deref()),
        (K::Conflict, Some("limits.cpu_millis")),
        "{}",
        err.message
    );
    w.set_quota(&admin, &team, limits(Some(5), Some(5_000), None));
}

#[test]
fn a_parent_can_be_lowered_while_its_children_have_no_limits_of_their_own() {
    let (mut w, admin, [root, team, sub]) = three_levels();
    w.set_quota(&admin, &root, at_most(10));
    // `team` and `sub` inherit the root's limit; that is not a limit of their own.
    w.set_quota(&admin, &team, at_most(4));
    w.set_quota(&admin, &root, at_most(6));
    w.set_quota(&admin, &team, at_most(3));
    assert_eq!(w.state.effective_limits(&sub).sandboxes, Some(3));
}

#[test]
fn a_parent_cannot_be_lowered_below_its_usage() {
    let (mut w, admin, [root, team, sub]) = three_levels();
    w.set_quota(&admin, &root, at_most(10));
    w.set_quota(&admin, &team, at_most(5));
    w.sandbox(&admin, &sub);
    w.sandbox(&admin, &team);
    w.sandbox(&admin, &team);

    let err = set_quota(&mut w, &admin, &team, at_most(2)).unwrap_err();
    assert_eq!(
        (err.kind, err.field.as_deref()),
        (K::Conflict, Some("limits.sandboxes"))
    );
    let err = set_quota(&mut w, &admin, &team, limits(Some(5), Some(1_000), None)).unwrap_err();
    assert_eq!(
        err.field.as_deref(),
        Some("limits.cpu_millis"),
        "3 x 500 mCPU are in use"
    );
    w.set_quota(&admin, &team, at_most(3));
}

#[test]
fn usage_counts_against_every_ancestor() {
    let (mut w, admin, [root, team, sub]) = three_levels();
    w.sandbox(&admin, &sub);
    w.sandbox(&admin, &team);
    let one = Usage {
        sandboxes: 1,
        cpu_millis: 500,
        memory_mb: 256,
        metadata_bytes: 0,
    };
    let two = one.plus(&one);
    assert_eq!([w.usage(&root), w.usage(&team), w.usage(&sub)], [two, two, one]);
}

#[test]
fn a_grandchild_create_is_refused_by_the_grandparents_limit() {
    let (mut w, admin, [root, team, sub]) = three_levels();
    w.set_quota(&admin, &root, at_most(2));
    w.sandbox(&admin, &root);
    w.sandbox(&admin, &team);

    let err = w.try_sandbox(&admin, &sub).unwrap_err();
    assert_eq!(err.kind, K::QuotaExceeded);
    assert!(
        err.message.contains(&root),
        "names the project whose limit is hit: {}",
        err.message
    );
    assert!(matches!(&w.last_audit().result, AuditResult::Denied { code, .. } if code == "quota_exceeded"));
    assert_eq!(w.usage(&sub), Usage::default());
}

#[test]
fn ending_a_sandbox_gives_its_quota_back_exactly_once() {
    let (mut w, admin, [root, team, sub]) = three_levels();
    w.set_quota(&admin, &team, at_most(1));
    let s = w.sandbox(&admin, &sub);
    assert_eq!(w.try_sandbox(&admin, &team).unwrap_err().kind, K::QuotaExceeded);

    w.run(&admin, Command::KillSandbox { sandbox: s.clone() }).unwrap();
    assert_eq!([w.usage(&root), w.usage(&team), w.usage(&sub)], [Usage::default(); 3]);
    // The edge then reports it gone; that must not give the quota back a second time.
    let held = w.sandbox(&admin, &team);
    w.report(
        &admin,
        &s,
        Observation::Exited {
            exit_code: 137,
            oom_killed: false,
            reason: "killed".into(),
        },
    );
    w.report(
        &admin,
        &s,
        Observation::Failed {
            reason: "late report".into(),
        },
    );
    assert_eq!(w.usage(&team).sandboxes, 1, "{held} still counts");
    assert_eq!(w.usage(&root).sandboxes, 1);
    assert_eq!(w.state.placement.edges["edge-a"].assigned.sandboxes, 1);
}

#[test]
fn a_sandbox_that_exits_on_its_own_gives_its_quota_back() {
    let (mut w, admin, [_, team, _]) = three_levels();
    w.set_quota(&admin, &team, at_most(1));
    let s = w.sandbox(&admin, &team);
    w.report(
        &admin,
        &s,
        Observation::Exited {
            exit_code: 0,
            oom_killed: false,
            reason: String::new(),
        },
    );
    assert_eq!(w.usage(&team), Usage::default());
    w.sandbox(&admin, &team);
    let err = w.run(&admin, Command::KillSandbox { sandbox: s }).unwrap_err();
    assert_eq!(err.kind, K::Conflict, "an ended sandbox cannot be killed again");
}

#[test]
fn a_caller_cannot_raise_its_own_projects_quota() {
    let (mut w, admin, [root, team, _]) = three_levels();
    w.set_quota(&admin, &team, at_most(2));
    let lead = w.issue(&admin, &team, &[opendsec_projections::Right::QuotaWrite], None);

    let err = set_quota(&mut w, &lead, &team, at_most(50)).unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::Forbidden, Some("project")));
    assert_eq!(w.state.quota.limits[&team].sandboxes, Some(2));
    // The root's admins are the exception: nobody is above them.
    w.set_quota(&admin, &root, at_most(50));
}

#[test]
fn a_caller_may_share_out_its_projects_quota_among_its_children() {
    let (mut w, admin, [_, team, sub]) = three_levels();
    w.set_quota(&admin, &team, at_most(4));
    let lead = w.issue(&admin, &team, &[opendsec_projections::Right::QuotaWrite], None);
    w.set_quota(&lead, &sub, at_most(3));
    let err = set_quota(&mut w, &lead, &sub, at_most(5)).unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::Invalid, Some("limits.sandboxes")));
}
