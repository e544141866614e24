//! Images a project brings: registered by name with `PullImage`, pulled by one edge,
//! reported by it, used by creates of the project and its descendants, deleted by name;
//! which names a create may use at all; and images packed from a container sandbox with
//! `PackSandbox` (made by its edge, started there).

mod support;

use opendsec_commands::{Command, ImageResult, Observation, RejectionKind as K};
use opendsec_projections::{Event, ImageState, Outcome, Right, schema};
use support::*;

const DIGEST: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

fn pull(project: &str, name: &str, reference: &str) -> Command {
    Command::PullImage {
        project: project.into(),
        name: name.into(),
        reference: reference.into(),
        edge: None,
    }
}

fn create(project: &str, image: &str) -> Command {
    create_of(project, image)
}

fn ready(name: &str) -> Command {
    Command::ReportImage {
        name: name.into(),
        result: ImageResult::Ready {
            digest: DIGEST.into(),
            size_bytes: 52_000_000,
            layers: 4,
        },
    }
}

/// The image and image source of the sandbox the last log entry created.
fn created_source(w: &World) -> (String, String) {
    let (_, bytes) = w.log.last().expect("an entry");
    let batch = schema::decode_batch(bytes).unwrap();
    match schema::batch_events(&batch).unwrap().first() {
        Some(Event::SandboxCreated(e)) => (e.image.clone(), e.image_source.clone()),
        other => panic!("the last entry is not a create: {other:?}"),
    }
}

#[test]
fn a_pulled_image_is_pending_on_one_edge_until_it_reports_the_digest() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let ran = w
        .run(&admin, pull(&root, "py312", "127.0.0.1:5000/python:3.12-slim"))
        .unwrap();
    assert!(matches!(ran.outcome, Outcome::Applied { .. }));
    let x = &w.state.images.images["py312"];
    assert_eq!(
        (x.state, x.edge.as_str(), x.reference.as_str(), x.digest.as_deref()),
        (ImageState::Pending, "edge-a", "127.0.0.1:5000/python:3.12-slim", None)
    );

    w.run(&admin, ready("py312")).unwrap();
    let x = &w.state.images.images["py312"];
    assert_eq!(
        (x.state, x.digest.as_deref(), x.layers),
        (ImageState::Ready, Some(DIGEST), 4)
    );
    assert_eq!(w.last_audit().action, "image.report");

    let err = w.run(&admin, ready("py312")).unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::Conflict, Some("name")));
}

#[test]
fn a_create_of_a_registered_image_tells_the_edge_where_to_fetch_it_pinned_to_its_digest() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    w.run(&admin, pull(&root, "py312", "127.0.0.1:5000/python:3.12-slim"))
        .unwrap();
    // While the first pull runs, a create may go ahead: its edge pulls by the tag.
    w.run(&admin, create(&root, "py312")).unwrap();
    assert_eq!(
        created_source(&w),
        ("py312".into(), "127.0.0.1:5000/python:3.12-slim".into())
    );
    // Once pulled, by the digest: a moved tag does not change what a create runs.
    w.run(&admin, ready("py312")).unwrap();
    w.run(&admin, create(&root, "py312")).unwrap();
    assert_eq!(
        created_source(&w),
        ("py312".into(), format!("127.0.0.1:5000/python:3.12-slim@{DIGEST}"))
    );
}

#[test]
fn a_create_naming_no_image_is_not_found_and_leaves_the_log_unchanged() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let before = w.log.len();
    for missing in ["bsae", "python:3.12", "org/env", "snap-0123456789abcdef"] {
        let err = w.run(&admin, create(&root, missing)).unwrap_err();
        assert_eq!(
            (err.kind, err.field.as_deref()),
            (K::NotFound, Some("image")),
            "{missing}"
        );
    }
    assert_eq!(w.log.len(), before);
    let err = w.run(&admin, create(&root, "bsae")).unwrap_err();
    assert!(err.message.contains("opendsecctl image pull"), "{}", err.message);
}

#[test]
fn built_in_images_and_references_that_name_their_registry_need_no_registration() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    for image in [
        "base",
        "busybox",
        "code-interpreter-v1",
        "code-interpreter:latest",
        "127.0.0.1:5000/python:3.12-slim",
        "ghcr.io/org/env@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
    ] {
        w.run(&admin, create(&root, image)).unwrap();
        assert_eq!(created_source(&w), (image.to_string(), String::new()), "{image}");
    }
}

#[test]
fn a_projects_images_serve_its_descendants_but_not_its_siblings() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let team = w.project(&admin, &root, "team");
    let rl = w.project(&admin, &team, "rl");
    let other = w.project(&admin, &root, "other");
    w.run(&admin, pull(&team, "swe-env", "127.0.0.1:5000/swe:1")).unwrap();
    w.run(&admin, ready("swe-env")).unwrap();

    w.run(&admin, create(&team, "swe-env")).unwrap();
    w.run(&admin, create(&rl, "swe-env")).unwrap();
    let err = w.run(&admin, create(&other, "swe-env")).unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::NotFound, Some("image")));

    // The name is the team's: another project cannot take it over.
    let err = w
        .run(&admin, pull(&other, "swe-env", "127.0.0.1:5000/evil:1"))
        .unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::Conflict, Some("name")));
    assert_eq!(w.state.images.images["swe-env"].reference, "127.0.0.1:5000/swe:1");
}

#[test]
fn a_failed_pull_makes_creates_of_it_a_conflict_until_it_is_pulled_again() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    w.run(&admin, pull(&root, "env", "127.0.0.1:5000/env:1")).unwrap();
    w.run(
        &admin,
        Command::ReportImage {
            name: "env".into(),
            result: ImageResult::Failed {
                reason: "manifest unknown".into(),
            },
        },
    )
    .unwrap();
    let err = w.run(&admin, create(&root, "env")).unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::Conflict, Some("image")));
    assert!(err.message.contains("manifest unknown"), "{}", err.message);

    w.run(&admin, pull(&root, "env", "127.0.0.1:5000/env:2")).unwrap();
    let x = &w.state.images.images["env"];
    assert_eq!((x.state, x.reason.as_deref()), (ImageState::Pending, None));
    w.run(&admin, create(&root, "env")).unwrap();
}

#[test]
fn a_deleted_image_is_gone_for_creates_and_only_its_projects_may_delete_it() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let team = w.project(&admin, &root, "team");
    let other = w.project(&admin, &root, "other");
    let outsider = w.issue(&admin, &other, &[Right::SandboxWrite], None);
    w.run(&admin, pull(&team, "env", "127.0.0.1:5000/env:1")).unwrap();

    let err = w
        .run(&outsider, Command::DeleteImage { name: "env".into() })
        .unwrap_err();
    assert_eq!(err.kind, K::Forbidden);

    w.run(&admin, Command::DeleteImage { name: "env".into() }).unwrap();
    assert!(w.state.images.images.is_empty());
    let err = w.run(&admin, create(&team, "env")).unwrap_err();
    assert_eq!(err.kind, K::NotFound);
    let err = w.run(&admin, Command::DeleteImage { name: "env".into() }).unwrap_err();
    assert_eq!(err.kind, K::NotFound);
}

#[test]
fn only_edges_report_pulls() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let user = w.issue(&admin, &root, &[Right::SandboxWrite], None);
    w.run(&user, pull(&root, "env", "127.0.0.1:5000/env:1")).unwrap();
    let err = w.run(&user, ready("env")).unwrap_err();
    assert_eq!(err.kind, K::Forbidden);
    assert_eq!(w.state.images.images["env"].state, ImageState::Pending);
}

#[test]
fn bad_pulls_are_refused_naming_the_field_and_leave_the_log_unchanged() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let before = w.log.len();
    for (name, reference, field) in [
        ("env", "", "reference"),
        ("env", "Python:3.12", "reference"),
        ("env", "127.0.0.1:5000/x@sha256:00", "reference"),
        ("env", "reg.io:port/x", "reference"),
        ("base", "127.0.0.1:5000/x", "name"),
        ("my-vm", "127.0.0.1:5000/x", "name"),
        ("Upper", "127.0.0.1:5000/x", "name"),
        ("snap-0123456789abcdef", "127.0.0.1:5000/x", "name"),
    ] {
        let err = w.run(&admin, pull(&root, name, reference)).unwrap_err();
        assert_eq!(
            (err.kind, err.field.as_deref()),
            (K::Invalid, Some(field)),
            "{name} {reference}"
        );
    }
    let err = w
        .run(
            &admin,
            Command::PullImage {
                project: root.clone(),
                name: "env".into(),
                reference: "127.0.0.1:5000/x".into(),
                edge: Some("edge-zz".into()),
            },
        )
        .unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::NotFound, Some("edge")));
    assert_eq!(w.log.len(), before);
}

#[test]
fn a_pull_with_no_edge_registered_says_to_start_one() {
    let mut w = World::new();
    let admin = w.bootstrap();
    let root = w.root.clone();
    let err = w.run(&admin, pull(&root, "env", "127.0.0.1:5000/env:1")).unwrap_err();
    assert_eq!(err.kind, K::NoCapacity);
    assert!(err.message.contains("opendsec edge"), "{}", err.message);
}

#[test]
fn a_docker_hub_shorthand_is_pulled_by_its_full_name() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    w.run(&admin, pull(&root, "python:3.12-slim", "python:3.12-slim"))
        .unwrap();
    assert_eq!(
        w.state.images.images["python:3.12-slim"].reference,
        "docker.io/library/python:3.12-slim"
    );
    // Registered under the short name, a create may now use it.
    w.run(&admin, create(&root, "python:3.12-slim")).unwrap();
}

// ---- packing a sandbox into an image (`PackSandbox`) ----

fn pack(sandbox: &str, name: &str, scrub: &[&str]) -> Command {
    Command::PackSandbox {
        sandbox: sandbox.into(),
        name: name.into(),
        scrub: scrub.iter().map(|p| p.to_string()).collect(),
        config: None,
    }
}

/// The `SandboxCreated` of the last log entry.
fn last_created(w: &World) -> opendsec_projections::pb::SandboxCreated {
    let (_, bytes) = w.log.last().expect("an entry");
    let batch = schema::decode_batch(bytes).unwrap();
    match schema::batch_events(&batch).unwrap().into_iter().next() {
        Some(Event::SandboxCreated(e)) => e,
        other => panic!("the last entry is not a create: {other:?}"),
    }
}

/// Edges `a` (room for `a_room` sandboxes) and `b`, and a running container sandbox of
/// project `team` on `a`: (world, admin, team, sandbox).
fn running_on_a(a_room: u64) -> (World, String, String, String) {
    let mut w = World::new();
    let admin = w.bootstrap();
    w.edge(&admin, "a", capacity(a_room, 100_000, 100_000));
    let root = w.root.clone();
    let team = w.project(&admin, &root, "team");
    let id = w.sandbox(&admin, &team);
    w.edge(&admin, "b", capacity(100, 100_000, 100_000));
    w.report(&admin, &id, Observation::Ready);
    (w, admin, team, id)
}

#[test]
fn a_running_container_is_packed_by_its_edge_into_an_image_of_its_project() {
    let (mut w, admin, team, id) = running_on_a(10);
    let ran = w.run(&admin, pack(&id, "swe-env", &["/etc/token"])).unwrap();
    assert!(matches!(ran.outcome, Outcome::Applied { .. }));
    match &ran.decided.events[..] {
        [Event::ImageRequested(e)] => assert_eq!(
            (
                e.name.as_str(),
                e.project.as_str(),
                e.reference.as_str(),
                e.edge.as_str(),
                e.source_sandbox.as_str(),
                e.scrub.clone()
            ),
            (
                "swe-env",
                team.as_str(),
                "",
                "a",
                id.as_str(),
                vec!["/etc/token".to_string()]
            )
        ),
        other => panic!("{other:?}"),
    }
    assert_eq!(w.last_audit().action, "image.pack");
    let x = &w.state.images.images["swe-env"];
    assert_eq!(
        (x.state, x.source_sandbox.as_deref(), x.edge.as_str(), x.source()),
        (ImageState::Pending, Some(id.as_str()), "a", String::new())
    );

    // The same report as a pull's ends it.
    w.run(&admin, ready("swe-env")).unwrap();
    let x = &w.state.images.images["swe-env"];
    assert_eq!(
        (x.state, x.digest.as_deref(), x.source()),
        (ImageState::Ready, Some(DIGEST), String::new())
    );
    // Packing again under the same name makes it anew (its sandbox has changed since).
    w.run(&admin, pack(&id, "swe-env", &[])).unwrap();
    assert_eq!(w.state.images.images["swe-env"].state, ImageState::Pending);
}

#[test]
fn creates_of_a_packed_image_go_to_the_edge_holding_it_which_is_named_as_their_source() {
    let (mut w, admin, team, id) = running_on_a(3);
    w.run(&admin, pack(&id, "swe-env", &[])).unwrap();
    w.run(&admin, ready("swe-env")).unwrap();
    let sub = w.project(&admin, &team, "rl");
    for project in [&team, &sub] {
        w.run(&admin, create(project, "swe-env")).unwrap();
        let c = last_created(&w);
        assert_eq!(
            (
                c.edge.as_str(),
                c.image.as_str(),
                c.image_source.as_str(),
                c.source_edge.as_str(),
                c.transfer.as_str()
            ),
            ("a", "swe-env", "", "a", "")
        );
    }
    // `a` is full: the create goes elsewhere, still naming `a` as where the image is, so
    // that edge can say why it cannot start it.
    w.run(&admin, create(&team, "swe-env")).unwrap();
    let c = last_created(&w);
    assert_eq!(
        (c.edge.as_str(), c.source_edge.as_str(), c.transfer.as_str()),
        ("b", "a", "")
    );
    // A pulled image names no source edge.
    w.run(&admin, pull(&team, "py", "127.0.0.1:5000/python:3.12-slim"))
        .unwrap();
    w.run(&admin, create(&team, "py")).unwrap();
    assert_eq!(last_created(&w).source_edge, "");
}

#[test]
fn a_packed_image_starts_nothing_until_it_is_ready_and_nothing_once_it_failed() {
    let (mut w, admin, team, id) = running_on_a(10);
    w.run(&admin, pack(&id, "swe-env", &[])).unwrap();
    let err = w.run(&admin, create(&team, "swe-env")).unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::Conflict, Some("image")));
    assert!(err.message.contains("still being packed on edge a"), "{}", err.message);

    w.run(
        &admin,
        Command::ReportImage {
            name: "swe-env".into(),
            result: ImageResult::Failed {
                reason: "no space left on device".into(),
            },
        },
    )
    .unwrap();
    let err = w.run(&admin, create(&team, "swe-env")).unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::Conflict, Some("image")));
    assert!(
        err.message.contains("failed to pack: no space left on device") && err.message.contains("sandbox pack"),
        "{}",
        err.message
    );
}

#[test]
fn only_a_container_that_has_run_and_lives_can_be_packed() {
    let mut w = World::new();
    let admin = w.bootstrap();
    w.edge_labelled(
        &admin,
        "a",
        capacity(100, 100_000, 100_000),
        labels(&[(opendsec_commands::MICROVM_LABEL, "qemu")]),
    );
    let root = w.root.clone();
    // Not running yet.
    let fresh = w.sandbox(&admin, &root);
    let err = w.run(&admin, pack(&fresh, "env", &[])).unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::Conflict, Some("sandbox")));
    // Paused is fine: it stays paused.
    w.report(&admin, &fresh, Observation::Ready);
    w.run(
        &admin,
        Command::PauseSandbox {
            sandbox: fresh.clone(),
            filesystem: false,
        },
    )
    .unwrap();
    w.report(&admin, &fresh, Observation::Paused);
    w.run(&admin, pack(&fresh, "env", &[])).unwrap();
    // Ended.
    w.run(&admin, Command::KillSandbox { sandbox: fresh.clone() }).unwrap();
    let err = w.run(&admin, pack(&fresh, "env2", &[])).unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::Conflict, Some("sandbox")));
    // A microVM's disk is not a layer: snapshot it.
    let mut vm = create(&root, "base");
    if let Command::CreateSandbox { opts, .. } = &mut vm {
        opts.isolation = Some(opendsec_projections::Isolation::Microvm);
    }
    let vm = w.run(&admin, vm).unwrap().decided.target;
    w.report(&admin, &vm, Observation::Ready);
    let before = w.log.len();
    let err = w.run(&admin, pack(&vm, "env3", &[])).unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::Invalid, Some("sandbox")));
    assert!(err.message.contains("snapshot it instead"), "{}", err.message);
    assert_eq!(w.log.len(), before);
    let err = w.run(&admin, pack("0123456789abcdef0001", "env3", &[])).unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::NotFound, Some("sandbox")));
}

#[test]
fn bad_packs_are_refused_naming_the_field_and_leave_the_log_unchanged() {
    let (mut w, admin, _, id) = running_on_a(10);
    let before = w.log.len();
    let long = format!("/{}", "a".repeat(4096));
    let many: Vec<String> = (0..65).map(|i| format!("/p{i}")).collect();
    let many: Vec<&str> = many.iter().map(String::as_str).collect();
    for (name, scrub, field) in [
        ("base", &[][..], "name"),
        ("Upper", &[][..], "name"),
        ("my-vm", &[][..], "name"),
        ("snap-0123456789abcdef", &[][..], "name"),
        ("env", &["etc/token"][..], "scrub"),
        ("env", &["/"][..], "scrub"),
        ("env", &["/a/../etc/shadow"][..], "scrub"),
        ("env", &["/a//b"][..], "scrub"),
        ("env", &["/a/./b"][..], "scrub"),
        ("env", &["/a/"][..], "scrub"),
        ("env", &["/a\nb"][..], "scrub"),
        ("env", &[long.as_str()][..], "scrub"),
        ("env", &many[..], "scrub"),
    ] {
        let err = w.run(&admin, pack(&id, name, scrub)).unwrap_err();
        assert_eq!(
            (err.kind, err.field.as_deref()),
            (K::Invalid, Some(field)),
            "{name} {scrub:?}: {}",
            err.message
        );
    }
    assert_eq!(w.log.len(), before);
    // The most it takes.
    let most: Vec<String> = (0..64).map(|i| format!("/home/user/p{i}")).collect();
    let most: Vec<&str> = most.iter().map(String::as_str).collect();
    w.run(&admin, pack(&id, "env", &most)).unwrap();
    w.run(&admin, pack(&id, "env", &[&format!("/{}", "a".repeat(4095))]))
        .unwrap();
}

#[test]
fn a_sandbox_is_packed_only_by_its_projects_and_never_under_another_projects_name() {
    let (mut w, admin, team, id) = running_on_a(10);
    let root = w.root.clone();
    let other = w.project(&admin, &root, "other");
    let outsider = w.issue(&admin, &other, &[Right::SandboxWrite], None);
    let err = w.run(&outsider, pack(&id, "env", &[])).unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::Forbidden, Some("sandbox")));
    let reader = w.issue(&admin, &team, &[Right::SandboxRead], None);
    let err = w.run(&reader, pack(&id, "env", &[])).unwrap_err();
    assert_eq!(err.kind, K::Forbidden);

    w.run(&admin, pull(&other, "theirs", "127.0.0.1:5000/x:1")).unwrap();
    let err = w.run(&admin, pack(&id, "theirs", &[])).unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::Conflict, Some("name")));
    assert_eq!(w.state.images.images["theirs"].source_sandbox, None);
    // A denial is logged against the sandbox's project.
    assert_eq!(
        (w.last_audit().action.as_str(), w.last_audit().project.as_str()),
        ("image.pack", team.as_str())
    );
}

#[test]
fn a_pack_decided_before_its_sandbox_ended_is_rejected_when_applied() {
    let (mut w, admin, _, id) = running_on_a(10);
    let p = w.propose(&admin, pack(&id, "env", &[]), Overlay::Used);
    assert!(p.decided.is_ok());
    w.run(&admin, Command::KillSandbox { sandbox: id.clone() }).unwrap();
    assert!(matches!(w.commit(p), Some((_, Outcome::Rejected { .. }))));
    assert!(w.state.images.images.is_empty());
}

#[test]
fn replaying_packs_gives_the_same_state_and_a_pulled_image_s_view_is_unchanged() {
    let (mut w, admin, team, id) = running_on_a(10);
    w.run(&admin, pull(&team, "py", "127.0.0.1:5000/python:3.12-slim"))
        .unwrap();
    w.run(&admin, pack(&id, "env", &["/etc/token"])).unwrap();
    w.run(&admin, ready("env")).unwrap();
    w.run(&admin, create(&team, "env")).unwrap();
    assert_eq!(w.replayed().to_bytes(), w.state.to_bytes());
    let view = serde_json::to_value(&w.state.images).unwrap();
    // A pulled image serialises as it did before packs existed (older logs replay to the
    // same bytes); a packed one says where it came from.
    assert!(view["images"]["py"].get("source_sandbox").is_none(), "{view}");
    assert_eq!(view["images"]["env"]["source_sandbox"], id.as_str());
}

fn import(project: &str, name: &str, edge: Option<&str>) -> Command {
    Command::ImportImage {
        project: project.into(),
        name: name.into(),
        edge: edge.map(str::to_string),
    }
}

#[test]
fn an_imported_image_is_awaited_by_one_edge_and_its_creates_go_there_once_it_is_ready() {
    let mut w = World::new();
    let admin = w.bootstrap();
    w.edge(&admin, "a", capacity(10, 100_000, 100_000));
    w.edge(&admin, "b", capacity(10, 100_000, 100_000));
    let root = w.root.clone();
    let team = w.project(&admin, &root, "team");
    let ran = w.run(&admin, import(&team, "swe-env", Some("b"))).unwrap();
    match &ran.decided.events[..] {
        [Event::ImageRequested(e)] => assert_eq!(
            (
                e.name.as_str(),
                e.project.as_str(),
                e.reference.as_str(),
                e.edge.as_str(),
                e.imported
            ),
            ("swe-env", team.as_str(), "", "b", true)
        ),
        other => panic!("{other:?}"),
    }
    assert_eq!(w.last_audit().action, "image.import");
    let x = &w.state.images.images["swe-env"];
    assert_eq!(
        (x.state, x.imported, x.is_local(), x.source()),
        (ImageState::Pending, true, true, String::new())
    );

    // Nothing starts from it while the upload is under way.
    let err = w.run(&admin, create(&team, "swe-env")).unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::Conflict, Some("image")));
    assert!(
        err.message.contains("still being imported on edge b"),
        "{}",
        err.message
    );

    // Once its edge reports it, creates of the project's go to that edge, which holds it.
    w.run(&admin, ready("swe-env")).unwrap();
    w.run(&admin, create(&team, "swe-env")).unwrap();
    let c = last_created(&w);
    assert_eq!(
        (c.edge.as_str(), c.image_source.as_str(), c.source_edge.as_str()),
        ("b", "", "b")
    );

    // A failed import says so and how to try again.
    w.run(&admin, import(&team, "broken", None)).unwrap();
    w.run(
        &admin,
        Command::ReportImage {
            name: "broken".into(),
            result: ImageResult::Failed {
                reason: "the tarball is neither an OCI layout nor a docker-archive".into(),
            },
        },
    )
    .unwrap();
    let err = w.run(&admin, create(&team, "broken")).unwrap_err();
    assert!(
        err.message.contains("failed to import: the tarball") && err.message.contains("opendsecctl image import"),
        "{}",
        err.message
    );
}

#[test]
fn an_import_names_a_valid_unclaimed_image_and_an_edge_that_is_registered() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let other = w.project(&admin, &root, "other");
    w.run(&admin, pull(&other, "theirs", "127.0.0.1:5000/a:1")).unwrap();
    for (cmd, kind, field) in [
        (import(&root, "Bad Name", None), K::Invalid, "name"),
        (import(&root, "base", None), K::Invalid, "name"),
        (import(&root, "theirs", None), K::Conflict, "name"),
        (import(&root, "mine", Some("no-such-edge")), K::NotFound, "edge"),
        (import("no-such-project", "mine", None), K::NotFound, "project"),
    ] {
        let err = w.run(&admin, cmd.clone()).unwrap_err();
        assert_eq!(
            (err.kind, err.field.as_deref()),
            (kind, Some(field)),
            "{cmd:?}: {}",
            err.message
        );
    }
    assert!(!w.state.images.images.contains_key("mine"), "nothing was registered");
}
