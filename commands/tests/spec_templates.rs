//! Templates (E2B's template builds): a build is asked for under a name, started with
//! its steps (it will pack a named image from a sandbox), and ends ready once its image
//! is, or failed at a step; a ready build takes its tags; a create naming the template
//! (`name`, `name:tag` or its id) starts from the image of the build the tag names; the
//! names of templates and images never collide; deleting a template deletes its images.

mod support;

use opendsec_commands::{Command, ImageResult, Observation, RejectionKind as K};
use opendsec_projections::{BuildStatus, ConfigOverride, Event, ImageState, Outcome, schema};
use support::*;

const DIGEST: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

fn request(project: &str, name: Option<&str>, tags: &[&str]) -> Command {
    Command::RequestTemplateBuild {
        project: project.into(),
        name: name.map(str::to_string),
        tags: tags.iter().map(|t| t.to_string()).collect(),
        cpu_count: 2,
        memory_mb: 1024,
    }
}

fn create(project: &str, image: &str) -> Command {
    create_of(project, image)
}

/// (template id, build id) of a request just run.
fn ids(ran: &support::Ran) -> (String, String) {
    match &ran.decided.events[..] {
        [Event::TemplateBuildRequested(e)] => (e.template_id.clone(), e.build_id.clone()),
        other => panic!("not a build request: {other:?}"),
    }
}

/// The image of the sandbox the last log entry created, and what it was asked for by.
fn last_created(w: &World) -> (String, String) {
    let (_, bytes) = w.log.last().expect("an entry");
    let batch = schema::decode_batch(bytes).unwrap();
    match schema::batch_events(&batch).unwrap().into_iter().next() {
        Some(Event::SandboxCreated(e)) => (e.image, e.template),
        other => panic!("the last entry is not a create: {other:?}"),
    }
}

/// Runs a whole build of template `name` as the builder does: request, start, a
/// sandbox of `base` that runs, its pack (reported ready by its edge), finish. Returns
/// (template id, build id, image).
fn build(w: &mut World, admin: &str, project: &str, name: &str, tags: &[&str]) -> (String, String, String) {
    let (t, b) = ids(&w.run(admin, request(project, Some(name), tags)).unwrap());
    let started = w
        .run(
            admin,
            Command::StartTemplateBuild {
                template: t.clone(),
                build: b.clone(),
                from: "base".into(),
                start_cmd: Some("python3 -m http.server 8000".into()),
                ready_cmd: Some("curl -sf localhost:8000".into()),
                steps: 3,
                runner: "1/run".into(),
            },
        )
        .unwrap();
    let image = match &started.decided.events[..] {
        [Event::TemplateBuildStarted(e)] => e.image.clone(),
        other => panic!("not a start: {other:?}"),
    };
    let sandbox = w.sandbox(admin, project);
    w.report(admin, &sandbox, Observation::Ready);
    let config = ConfigOverride {
        env: [("A".to_string(), "1".to_string())].into(),
        workdir: "/app".into(),
        user: "user".into(),
        start_cmd: "python3 -m http.server 8000".into(),
        ready_cmd: "curl -sf localhost:8000".into(),
    };
    w.run(
        admin,
        Command::PackSandbox {
            sandbox: sandbox.clone(),
            name: image.clone(),
            scrub: vec![],
            config: Some(config),
        },
    )
    .unwrap();
    w.run(
        admin,
        Command::ReportImage {
            name: image.clone(),
            result: ImageResult::Ready {
                digest: DIGEST.into(),
                size_bytes: 1000,
                layers: 3,
            },
        },
    )
    .unwrap();
    w.run(admin, Command::KillSandbox { sandbox }).unwrap();
    w.run(
        admin,
        Command::FinishTemplateBuild {
            template: t.clone(),
            build: b.clone(),
            error: None,
            error_step: None,
        },
    )
    .unwrap();
    (t, b, image)
}

#[test]
fn a_build_waits_for_its_steps_runs_and_is_ready_once_its_packed_image_is() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let ran = w.run(&admin, request(&root, Some("py-env"), &[])).unwrap();
    assert!(matches!(ran.outcome, Outcome::Applied { .. }));
    let (t, b) = ids(&ran);
    assert_eq!(t.len(), 20);
    assert_eq!(uuid_version(&b), 4, "E2B's SDK parses build ids as UUIDs: {b}");
    let x = &w.state.images.templates[&t];
    assert_eq!(
        (
            x.name.as_deref(),
            x.cpu_count,
            x.memory_mb,
            x.builds[&b].status,
            x.builds[&b].tags.clone()
        ),
        (
            Some("py-env"),
            2,
            1024,
            BuildStatus::Waiting,
            vec!["default".to_string()]
        )
    );
    assert_eq!(w.last_audit().action, "template.request_build");

    // Finished before its image is packed: refused.
    w.run(
        &admin,
        Command::StartTemplateBuild {
            template: "py-env".into(),
            build: b.clone(),
            from: "base".into(),
            start_cmd: None,
            ready_cmd: None,
            steps: 0,
            runner: "1/run".into(),
        },
    )
    .unwrap();
    let x = &w.state.images.templates[&t].builds[&b];
    assert_eq!(x.status, BuildStatus::Building);
    let image = x.image.clone().unwrap();
    assert!(image.starts_with(&format!("tpl-{t}-")), "{image}");
    let early = Command::FinishTemplateBuild {
        template: t.clone(),
        build: b.clone(),
        error: None,
        error_step: None,
    };
    let err = w.run(&admin, early).unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::Conflict, Some("build")));
    // Started twice: refused.
    let again = Command::StartTemplateBuild {
        template: t.clone(),
        build: b.clone(),
        from: "base".into(),
        start_cmd: None,
        ready_cmd: None,
        steps: 0,
        runner: "1/run".into(),
    };
    assert_eq!(w.run(&admin, again).unwrap_err().kind, K::Conflict);
}

#[test]
fn a_ready_build_takes_its_tags_and_a_create_of_the_template_starts_from_its_image() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let (t, b1, image1) = build(&mut w, &admin, &root, "py-env", &[]);
    let x = &w.state.images.templates[&t];
    assert_eq!(x.builds[&b1].status, BuildStatus::Ready);
    assert_eq!(x.tags, [("default".to_string(), b1.clone())].into());
    // The packed image carries the build's config.
    let img = &w.state.images.images[&image1];
    assert_eq!(img.config.as_ref().unwrap().workdir, "/app");

    // By name, by name:default and by id: the default build's image; the asked name stays.
    for asked in ["py-env", "py-env:default", t.as_str()] {
        w.run(&admin, create(&root, asked)).unwrap();
        assert_eq!(last_created(&w), (image1.clone(), asked.to_string()), "{asked}");
    }

    // A second build tagged v2 leaves `default` where it was.
    let (_, b2, image2) = build(&mut w, &admin, &root, "py-env", &["v2"]);
    assert_eq!(w.state.images.templates[&t].builds.len(), 2, "one template, two builds");
    w.run(&admin, create(&root, "py-env:v2")).unwrap();
    assert_eq!(last_created(&w).0, image2);
    w.run(&admin, create(&root, "py-env")).unwrap();
    assert_eq!(last_created(&w).0, image1);

    // Tags move; removed tags name nothing.
    let tag = |build: Option<&str>, tags: &[&str]| Command::SetTemplateTags {
        template: "py-env".into(),
        build: build.map(str::to_string),
        tags: tags.iter().map(|t| t.to_string()).collect(),
    };
    w.run(&admin, tag(Some(&b2), &["default", "prod"])).unwrap();
    w.run(&admin, create(&root, "py-env:prod")).unwrap();
    assert_eq!(last_created(&w).0, image2);
    w.run(&admin, create(&root, "py-env")).unwrap();
    assert_eq!(last_created(&w).0, image2);
    w.run(&admin, tag(None, &["prod"])).unwrap();
    let err = w.run(&admin, create(&root, "py-env:prod")).unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::Conflict, Some("image")));
    assert!(err.message.contains("no ready build tagged prod"), "{}", err.message);
    let err = w.run(&admin, tag(Some("no-such-build"), &["x"])).unwrap_err();
    assert_eq!(err.kind, K::Conflict);
}

#[test]
fn a_template_without_a_ready_build_refuses_creates_and_a_failed_build_says_where() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let (t, b) = ids(&w.run(&admin, request(&root, Some("broken"), &[])).unwrap());
    let err = w.run(&admin, create(&root, "broken")).unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::Conflict, Some("image")));
    assert!(err.message.contains("no ready build yet"), "{}", err.message);

    w.run(
        &admin,
        Command::FinishTemplateBuild {
            template: t.clone(),
            build: b.clone(),
            error: Some("RUN exit 3: exited with code 3".into()),
            error_step: Some("1".into()),
        },
    )
    .unwrap();
    let x = &w.state.images.templates[&t].builds[&b];
    assert_eq!(
        (x.status, x.error.as_deref(), x.error_step.as_deref()),
        (BuildStatus::Error, Some("RUN exit 3: exited with code 3"), Some("1"))
    );
    assert!(
        w.state.images.templates[&t].tags.is_empty(),
        "a failed build takes no tag"
    );
    // An ended build ends once.
    let again = Command::FinishTemplateBuild {
        template: t,
        build: b,
        error: Some("again".into()),
        error_step: None,
    };
    assert_eq!(w.run(&admin, again).unwrap_err().kind, K::Conflict);
}

#[test]
fn names_are_checked_and_never_shared_by_templates_images_or_projects() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let before = w.log.len();
    for (name, tags, field) in [
        ("Bad Name", vec![], "name"),
        ("a:b", vec![], "name"),
        ("ok", vec!["no spaces"], "tags"),
        ("base", vec![], "name"),
    ] {
        let err = w.run(&admin, request(&root, Some(name), &tags)).unwrap_err();
        assert_eq!(err.field.as_deref(), Some(field), "{name} {tags:?}: {err:?}");
    }
    assert_eq!(w.log.len(), before, "bad input leaves the log unchanged");

    // An image's name is not a template's, nor the other way round.
    w.run(
        &admin,
        Command::PullImage {
            project: root.clone(),
            name: "py312".into(),
            reference: "127.0.0.1:5000/python:3.12".into(),
            edge: None,
        },
    )
    .unwrap();
    let err = w.run(&admin, request(&root, Some("py312"), &[])).unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::Conflict, Some("name")));
    let team = w.project(&admin, &root, "team");
    w.run(&admin, request(&team, Some("env"), &[])).unwrap();
    let err = w
        .run(
            &admin,
            Command::PullImage {
                project: root.clone(),
                name: "env".into(),
                reference: "127.0.0.1:5000/python:3.12".into(),
                edge: None,
            },
        )
        .unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::Conflict, Some("name")));

    // Another project (a sibling) cannot build under the name, tag the template or start
    // from it; descendants could, as they use their ancestors' images.
    let other = w.project(&admin, &root, "other");
    let theirs = w.issue(&admin, &other, &[opendsec_projections::Right::SandboxWrite], None);
    let err = w.run(&theirs, request(&other, Some("env"), &[])).unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::Conflict, Some("name")));
    let err = w
        .run(
            &theirs,
            Command::SetTemplateTags {
                template: "env".into(),
                build: None,
                tags: vec!["x".into()],
            },
        )
        .unwrap_err();
    assert_eq!(err.kind, K::Forbidden);
    let err = w.run(&theirs, create(&other, "env")).unwrap_err();
    assert_eq!(
        err.kind,
        K::NotFound,
        "another project's template is no image to it: {err:?}"
    );
}

#[test]
fn deleting_a_template_deletes_its_names_and_its_builds_images() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let (t, _, image) = build(&mut w, &admin, &root, "gone", &[]);
    assert_eq!(w.state.images.images[&image].state, ImageState::Ready);
    let ran = w
        .run(
            &admin,
            Command::DeleteTemplate {
                template: "gone".into(),
            },
        )
        .unwrap();
    assert!(matches!(
        ran.decided.events[..],
        [Event::TemplateDeleted(_), Event::ImageDeleted(_)]
    ));
    assert!(!w.state.images.templates.contains_key(&t));
    assert!(!w.state.images.images.contains_key(&image));
    let err = w.run(&admin, create(&root, "gone")).unwrap_err();
    assert_eq!(err.kind, K::NotFound);
    // The name is free again.
    w.run(&admin, request(&root, Some("gone"), &[])).unwrap();
    // Replaying the log gives the same views.
    assert_eq!(w.replayed().images, w.state.images);
}

fn uuid_version(id: &str) -> u8 {
    let parts: Vec<&str> = id.split('-').collect();
    assert_eq!(
        parts.iter().map(|p| p.len()).collect::<Vec<_>>(),
        [8, 4, 4, 4, 12],
        "{id}"
    );
    u8::from_str_radix(&parts[2][..1], 16).unwrap()
}
