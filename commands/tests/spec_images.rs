//! Images a project brings: registered by name with `PullImage`, pulled by one edge,
//! reported by it, used by creates of the project and its descendants, deleted by name;
//! and which names a create may use at all.

mod support;

use opendsec_commands::{Command, ImageResult, RejectionKind as K};
use opendsec_projections::{Event, ImageState, Outcome, Right, schema};
use std::collections::BTreeMap;
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
    Command::CreateSandbox {
        project: project.into(),
        image: image.into(),
        cpu_millis: 500,
        memory_mb: 256,
        labels: BTreeMap::new(),
        timeout_seconds: None,
        opts: Default::default(),
    }
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
