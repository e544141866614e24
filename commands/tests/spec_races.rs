//! Invariant 2: decisions that can conflict are taken against applied state plus the
//! in-flight overlay, and re-validated at apply time; a lost race becomes a recorded
//! rejection, never corrupt state. A retried request (same id, caller and command) is
//! answered with its first outcome and never applied twice.

mod support;

use opendsec_commands::{Caller, Command, InFlight, RejectionKind as K, batch_for, decide};
use opendsec_projections::{AuditResult, Outcome, Right};
use support::*;

/// A project with room for exactly one more sandbox.
fn one_unit_left() -> (World, String, String) {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let team = w.project(&admin, &root, "team");
    w.set_quota(&admin, &team, at_most(2));
    w.sandbox(&admin, &team);
    (w, admin, team)
}

#[test]
fn without_the_overlay_the_loser_of_a_race_for_the_last_unit_is_rejected_at_apply() {
    let (mut w, admin, team) = one_unit_left();
    let first = w.propose(&admin, create_in(&team), Overlay::Ignored);
    let second = w.propose(&admin, create_in(&team), Overlay::Ignored);
    assert!(
        first.decided.is_ok() && second.decided.is_ok(),
        "both look fine against the stale state"
    );
    let loser = second.decided.as_ref().unwrap().target.clone();

    let (_, a) = w.commit(first).unwrap();
    let (i, b) = w.commit(second).unwrap();
    assert!(matches!(a, Outcome::Applied { .. }));
    let Outcome::Rejected { index, message } = b else {
        panic!("expected a rejection, got {b:?}")
    };
    assert_eq!(index, i);
    assert!(message.contains("quota"), "{message}");

    let rec = w.last_audit();
    assert_eq!(
        (
            rec.index,
            rec.action.as_str(),
            rec.project.as_str(),
            rec.target.as_str()
        ),
        (i, "sandbox.create", team.as_str(), loser.as_str())
    );
    assert!(matches!(&rec.result, AuditResult::Rejected { message } if message.contains("quota")));
    assert!(
        !w.state.sandboxes.sandboxes.contains_key(&loser),
        "the loser left no sandbox behind"
    );
    assert_eq!(w.usage(&team).sandboxes, 2, "usage never exceeds the limit");
    assert_eq!(w.state.placement.edges["edge-a"].assigned.sandboxes, 2);
}

#[test]
fn with_the_overlay_the_second_create_is_refused_at_decide_and_logged_as_a_denial() {
    let (mut w, admin, team) = one_unit_left();
    let first = w.propose(&admin, create_in(&team), Overlay::Used);
    let second = w.propose(&admin, create_in(&team), Overlay::Used);
    assert!(first.decided.is_ok());
    let err = second.decided.as_ref().unwrap_err();
    assert_eq!(err.kind, K::QuotaExceeded);
    assert!(second.ticket.is_none(), "a denial reserves nothing");

    w.commit(first);
    let (i, out) = w.commit(second).expect("a quota denial is logged");
    assert!(matches!(&out, Outcome::Denied { code, .. } if code == "quota_exceeded"));
    let rec = w.last_audit();
    assert_eq!((rec.index, rec.project.as_str()), (i, team.as_str()));
    assert!(matches!(&rec.result, AuditResult::Denied { code, .. } if code == "quota_exceeded"));
    assert_eq!(w.usage(&team).sandboxes, 2);
    assert!(w.inflight.is_empty(), "every reservation was released");
}

#[test]
fn once_the_winner_is_applied_and_released_the_overlay_holds_nothing_back() {
    let (mut w, admin, team) = one_unit_left();
    let first = w.propose(&admin, create_in(&team), Overlay::Used);
    assert_eq!(w.inflight.project_usage(&team).sandboxes, 1);
    w.commit(first);
    assert_eq!(w.inflight.project_usage(&team).sandboxes, 0);
    w.run(
        &admin,
        Command::SetQuota {
            project: team.clone(),
            limits: at_most(3),
        },
    )
    .unwrap();
    w.sandbox(&admin, &team);
}

#[test]
fn a_quota_cut_decided_before_a_create_landed_is_rejected_when_applied() {
    let (mut w, admin, team) = one_unit_left();
    let cut = w.propose(
        &admin,
        Command::SetQuota {
            project: team.clone(),
            limits: at_most(1),
        },
        Overlay::Ignored,
    );
    let create = w.propose(&admin, create_in(&team), Overlay::Ignored);
    assert!(cut.decided.is_ok());
    w.commit(create);
    let (_, out) = w.commit(cut).unwrap();
    assert!(
        matches!(&out, Outcome::Rejected { message, .. } if message.contains("usage")),
        "{out:?}"
    );
    assert_eq!(w.state.quota.limits[&team].sandboxes, Some(2));
}

#[test]
fn with_the_overlay_a_quota_cut_sees_creates_in_flight() {
    let (mut w, admin, team) = one_unit_left();
    let create = w.propose(&admin, create_in(&team), Overlay::Used);
    let cut = w.propose(
        &admin,
        Command::SetQuota {
            project: team.clone(),
            limits: at_most(1),
        },
        Overlay::Used,
    );
    assert_eq!(cut.decided.as_ref().unwrap_err().kind, K::Conflict);
    w.commit(create);
    w.commit(cut);
    assert_eq!(w.usage(&team).sandboxes, 2);
}

#[test]
fn the_last_slot_of_an_edge_goes_to_one_sandbox_only() {
    let mut w = World::new();
    let admin = w.bootstrap();
    let root = w.root.clone();
    w.edge(&admin, "tiny", capacity(1, 10_000, 10_000));
    let a = w.propose(&admin, create_in(&root), Overlay::Ignored);
    let b = w.propose(&admin, create_in(&root), Overlay::Ignored);
    let c = w.propose(&admin, create_in(&root), Overlay::Used);
    let d = w.propose(&admin, create_in(&root), Overlay::Used);
    assert_eq!(
        d.decided.as_ref().unwrap_err().kind,
        K::NoCapacity,
        "c's reservation filled the edge"
    );
    let outcomes: Vec<_> = [a, b, c, d].into_iter().map(|p| w.commit(p).unwrap().1).collect();
    assert!(matches!(outcomes[0], Outcome::Applied { .. }));
    assert!(
        matches!(&outcomes[1], Outcome::Rejected { message, .. } if message.contains("no room")),
        "{:?}",
        outcomes[1]
    );
    assert!(
        matches!(&outcomes[2], Outcome::Rejected { message, .. } if message.contains("no room")),
        "{:?}",
        outcomes[2]
    );
    assert!(matches!(&outcomes[3], Outcome::Denied { code, .. } if code == "no_capacity"));
    assert_eq!(w.state.placement.edges["tiny"].assigned.sandboxes, 1);
    assert_eq!(w.state.sandboxes.sandboxes.len(), 1);
}

#[test]
fn two_new_edges_decided_together_get_distinct_ordinals_only_through_the_overlay() {
    let mut w = World::new();
    let admin = w.bootstrap();
    let reg = |name: &str| Command::RegisterEdge {
        edge: name.into(),
        address: "h:1".into(),
        capacity: capacity(1, 1, 1),
        labels: labels(&[]),
    };
    let a = w.propose(&admin, reg("a"), Overlay::Used);
    let b = w.propose(&admin, reg("b"), Overlay::Used);
    let a_again = w.propose(&admin, reg("a"), Overlay::Used);
    assert_eq!(
        a_again.decided.as_ref().unwrap_err().kind,
        K::Conflict,
        "a is being registered"
    );
    let c = w.propose(&admin, reg("c"), Overlay::Ignored);
    for p in [a, b, a_again] {
        w.commit(p);
    }
    let (_, out) = w.commit(c).unwrap();
    assert!(
        matches!(&out, Outcome::Rejected { message, .. } if message.contains("ordinal")),
        "{out:?}"
    );
    let ordinals: Vec<_> = w
        .state
        .placement
        .edges
        .values()
        .map(|e| (e.id.as_str(), e.ordinal))
        .collect();
    assert_eq!(ordinals, [("a", 0), ("b", 1)]);
}

#[test]
fn two_projects_of_the_same_name_in_flight_under_one_parent() {
    let mut w = World::new();
    let admin = w.bootstrap();
    let root = w.root.clone();
    let mk = || Command::CreateProject {
        name: "web".into(),
        parent: root.clone(),
    };
    let a = w.propose(&admin, mk(), Overlay::Ignored);
    let b = w.propose(&admin, mk(), Overlay::Ignored);
    let c = w.propose(&admin, mk(), Overlay::Used);
    let d = w.propose(&admin, mk(), Overlay::Used);
    assert_eq!(d.decided.as_ref().unwrap_err().kind, K::Conflict);
    let outcomes: Vec<_> = [a, b, c, d].into_iter().map(|p| w.commit(p).unwrap().1).collect();
    assert!(matches!(outcomes[0], Outcome::Applied { .. }));
    assert!(
        outcomes[1..3].iter().all(|o| matches!(o, Outcome::Rejected { .. })),
        "{outcomes:?}"
    );
    assert_eq!(w.state.iam.projects[&root].children.len(), 1);
}

// ---- exactly once: a retried request is answered with its first outcome ----

/// Decides `cmd` as a client's request `request_id` (a retry decides again, with a new
/// seed, as a leader does) and appends it to the log.
fn request(w: &mut World, token: &str, request_id: &str, cmd: &Command) -> (u64, Outcome) {
    let mut ctx = w.ctx(Caller::Token(token.to_string()));
    ctx.request_id = request_id.to_string();
    let decided = decide(&w.state, &InFlight::new(), cmd, &ctx);
    let batch = batch_for(cmd, &ctx, &w.state, &decided);
    w.commit(Proposal {
        decided,
        batch,
        ticket: None,
    })
    .expect("a logged request")
}

#[test]
fn a_retried_request_is_not_applied_twice_and_an_id_reused_for_another_request_is() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let create = create_in(&root);
    let (first, outcome) = request(&mut w, &admin, "client-req-1", &create);
    assert_eq!(outcome, Outcome::Applied { index: first });
    assert_eq!(w.state.sandboxes.sandboxes.len(), 1);

    // The retry (a lost answer, a follower's second try) is decided again but not applied.
    let (again, outcome) = request(&mut w, &admin, "client-req-1", &create);
    assert_eq!(outcome, Outcome::Duplicate { index: again, first });
    assert_eq!(w.state.sandboxes.sandboxes.len(), 1, "one sandbox for one request");
    assert!(
        matches!(&w.last_audit().result, AuditResult::Rejected { message } if message.contains("not applied again")),
        "{:?}",
        w.last_audit()
    );

    // The same id with another command, or by another caller, is another request.
    let other = Command::CreateSandbox {
        project: root.clone(),
        image: "base".into(),
        cpu_millis: 250,
        memory_mb: 128,
        labels: Default::default(),
        timeout_seconds: None,
        opts: Default::default(),
    };
    let (i, outcome) = request(&mut w, &admin, "client-req-1", &other);
    assert_eq!(outcome, Outcome::Applied { index: i });
    let second = w.issue(&admin, &root, &[Right::SandboxWrite], None);
    let (i, outcome) = request(&mut w, &second, "client-req-1", &create);
    assert_eq!(outcome, Outcome::Applied { index: i });
    assert_eq!(w.state.sandboxes.sandboxes.len(), 3);

    // Remembered for the window, then forgotten.
    w.advance(opendsec_projections::REQUEST_WINDOW_MS + 1);
    let (i, outcome) = request(&mut w, &admin, "client-req-1", &create);
    assert_eq!(outcome, Outcome::Applied { index: i });
    assert_eq!(w.state.sandboxes.sandboxes.len(), 4);
    // Replaying the log gives the same state, the window included.
    assert_eq!(w.replayed().hash(), w.state.hash());
}

#[test]
fn a_retried_denial_is_denied_once() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    w.set_quota(&admin, &root, at_most(0));
    let create = create_in(&root);
    let (first, outcome) = request(&mut w, &admin, "client-req-9", &create);
    assert!(matches!(outcome, Outcome::Denied { .. }), "{outcome:?}");
    let (again, outcome) = request(&mut w, &admin, "client-req-9", &create);
    assert_eq!(outcome, Outcome::Duplicate { index: again, first });
}
