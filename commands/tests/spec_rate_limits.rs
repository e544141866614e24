//! Write rates: a parent project's admin sets a project's writes a second (its whole
//! subtree together, and each token); a rate is at least 1 and never above the parent's;
//! a project's own tokens cannot set its rates; the rates in force are the least on the
//! project's line. (Enforcement is the leader's: `control/src/rates.rs`, and
//! `sdk/tests/client_and_cli.rs` through the API.)

mod support;

use opendsec_commands::{Command, RejectionKind as K};
use opendsec_projections::{Event, Rates, Right};
use support::*;

fn rates(project: &str, all: Option<u64>, each: Option<u64>) -> Command {
    Command::SetRateLimits {
        project: project.into(),
        writes_per_second: all,
        token_writes_per_second: each,
    }
}

#[test]
fn a_parent_sets_a_projects_rates_and_its_line_bounds_them() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let team = w.project(&admin, &root, "team");
    let sub = w.project(&admin, &team, "sub");

    let ran = w.run(&admin, rates(&team, Some(100), Some(10))).unwrap();
    assert!(
        matches!(&ran.decided.events[..], [Event::ProjectRateLimitsSet(e)] if e.writes_per_second == 100 && e.token_writes_per_second == 10)
    );
    assert_eq!(w.last_audit().action, "project.set_rate_limits");
    // A sub-project has the team's rates in force until its own are lower.
    let team_rates = Rates {
        writes_per_second: Some(100),
        token_writes_per_second: Some(10),
    };
    assert_eq!(w.state.effective_rates(&sub), team_rates);
    w.run(&admin, rates(&sub, Some(20), None)).unwrap();
    assert_eq!(
        w.state.effective_rates(&sub),
        Rates {
            writes_per_second: Some(20),
            token_writes_per_second: Some(10),
        }
    );
    assert_eq!(
        w.state.rate_lines(&sub),
        vec![(sub.clone(), 20), (team.clone(), 100)],
        "a write in sub counts against sub's and team's"
    );

    // Above the parent's, zero, or beyond the maximum: refused, naming the field.
    for (cmd, field) in [
        (rates(&sub, Some(200), None), "writes_per_second"),
        (rates(&sub, None, Some(11)), "token_writes_per_second"),
        (rates(&sub, Some(0), None), "writes_per_second"),
        (rates(&team, None, Some(2_000_000)), "token_writes_per_second"),
    ] {
        let err = w.run(&admin, cmd).unwrap_err();
        assert_eq!((err.kind, err.field.as_deref()), (K::Invalid, Some(field)));
    }

    // The team's own admin cannot loosen (or set) its own rates.
    let team_admin = w.issue(&admin, &team, &[Right::QuotaWrite], None);
    let err = w.run(&team_admin, rates(&team, None, None)).unwrap_err();
    assert_eq!(err.kind, K::Forbidden);
    // Cleared (both left out): none of its own.
    w.run(&admin, rates(&sub, None, None)).unwrap();
    assert_eq!(w.state.effective_rates(&sub), team_rates);
    assert!(!w.state.quota.rates.contains_key(&sub));
}

#[test]
fn a_child_rate_decided_against_a_stale_parent_is_rejected_at_apply() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let team = w.project(&admin, &root, "team");
    let sub = w.project(&admin, &team, "sub");
    // Decided while the team has no rate, applied after the team got a lower one.
    let child = w.propose(&admin, rates(&sub, Some(50), None), Overlay::Ignored);
    w.run(&admin, rates(&team, Some(10), None)).unwrap();
    assert!(matches!(
        w.commit(child),
        Some((_, opendsec_projections::Outcome::Rejected { .. }))
    ));
    assert_eq!(w.state.effective_rates(&sub).writes_per_second, Some(10));
}
