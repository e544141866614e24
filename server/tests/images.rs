//! Specification: images from a registry, through the whole path (REST -> log -> edge
//! pull -> overlayfs -> agent), against Debian's `docker-registry` on loopback seeded by
//! `skopeo` with an image this test builds: the busybox image's files under a layer of
//! its own (a program, an `/etc/passwd` without E2B's `user`, a config with Env,
//! WorkingDir and Cmd). Needs root, crun or runc, busybox-static, docker-registry, skopeo
//! and the static agent (`./ops/test.sh` installs and builds them).

#[path = "support/e2b_py.rs"]
mod e2b_py;
#[path = "../../edge/tests/oci_support/mod.rs"]
mod oci_support;
#[path = "support/up.rs"]
mod up;
#[path = "support/vms.rs"]
mod vms;

use oci_support::{LayerTar, Registry, TestImage, write_layout};
use reqwest::Method;
use serde_json::{Value, json};
use std::time::{Duration, Instant};
use up::Up;

/// The busybox image's files as one layer, then a layer that adds `hello`, replaces
/// `/etc/passwd` with one that has no `user`, and a directory for the WorkingDir; pushed
/// to `registry` as `repo:v1`.
async fn hello_image(up: &Up, registry: &Registry, repo: &str) -> String {
    let image = hello_test_image(up, repo).await;
    let layout = write_layout(&image);
    registry.push(layout.dir.path(), repo, "v1");
    format!("{}/{repo}:v1", registry.host())
}

/// The image [`hello_image`] pushes.
async fn hello_test_image(up: &Up, repo: &str) -> TestImage {
    up.ensure_image("busybox", Duration::from_secs(300)).await;
    let store = opendsec_edge::images::ImageStore::open(opendsec_edge::images::DEFAULT_STORE).unwrap();
    let busybox = store.get("busybox").unwrap();
    let mut base = tar::Builder::new(Vec::new());
    base.follow_symlinks(false);
    base.append_dir_all(".", store.layer_path(&busybox.layers[0])).unwrap();
    let base = base.into_inner().unwrap();
    let top = LayerTar::new()
        .entry(
            tar::EntryType::Regular,
            "usr/local/bin/hello",
            "",
            b"#!/bin/sh\necho \"hello from $GREETING in $(pwd)\"\n",
            0o755,
        )
        .entry(
            tar::EntryType::Regular,
            "etc/passwd",
            "",
            b"root:x:0:0:root:/root:/bin/sh\n",
            0o644,
        )
        .dir("srv/app")
        // Each test's image has a top layer of its own (GC tests watch it go).
        .entry(
            tar::EntryType::Regular,
            "etc/opendsec-test-repo",
            "",
            repo.as_bytes(),
            0o644,
        )
        .bytes();
    let mut image = TestImage::new(vec![base, top]);
    image.run = json!({
        "Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "GREETING=the-image-config"],
        "WorkingDir": "/srv/app",
        "Cmd": ["/usr/local/bin/hello"],
    });
    image
}

async fn wait_image(up: &Up, name: &str, within: Duration) -> Value {
    let deadline = Instant::now() + within;
    loop {
        let (s, v) = up.send(Method::GET, &format!("/v1/images/{name}"), None).await;
        assert_eq!(s, 200, "GET /v1/images/{name}: {v}");
        if v["state"] != "pending" {
            return v;
        }
        assert!(Instant::now() < deadline, "the pull did not end within {within:?}: {v}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn running_sandbox(up: &Up, image: &str) -> String {
    let (s, v) = up
        .send(Method::POST, "/v1/sandboxes", Some(json!({"image": image})))
        .await;
    assert_eq!(s, 201, "creating a sandbox of {image}: {v}");
    let id = v["sandbox"]["id"].as_str().unwrap().to_string();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let (_, v) = up.send(Method::GET, &format!("/v1/sandboxes/{id}"), None).await;
        match v["state"].as_str() {
            Some("running") => return id,
            Some("pending") => assert!(Instant::now() < deadline, "not running after 120 s: {v}"),
            _ => panic!("the sandbox of {image} did not start: {v}\n{}", up.log_tail(30)),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The E2B SDK's `Template.build` from an image in a registry (`from_image`): the
/// pytest module is the specification.
#[tokio::test(flavor = "multi_thread")]
async fn an_e2b_template_is_built_from_a_registry_image_with_the_unmodified_sdk() {
    oci_support::require("the registry suite");
    let registry = Registry::start();
    let up = Up::start(None).await;
    let reference = hello_image(&up, &registry, "e2e/template-base").await;
    let key = up.issue_e2b_key().await;
    let url = format!("http://{}", up.http);
    let vars = [
        ("E2B_API_KEY", key),
        ("E2B_API_URL", url.clone()),
        ("E2B_SANDBOX_URL", url),
        ("OPENDSEC_TEST_IMAGE", reference),
    ];
    let python = e2b_py::python(e2b_py::Sdk::Current);
    e2b_py::pytest(&python, "test_template_from_image.py", &vars).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_image_pulled_by_name_runs_with_its_config_and_an_account_for_user() {
    oci_support::require("the registry suite");
    let registry = Registry::start();
    let up = Up::start(None).await;
    let reference = hello_image(&up, &registry, "e2e/hello").await;

    let (s, v) = up
        .send(
            Method::POST,
            "/v1/images",
            Some(json!({"reference": reference, "name": "hello-env"})),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    assert_eq!(v["image"]["state"], "pending");
    let x = wait_image(&up, "hello-env", Duration::from_secs(120)).await;
    assert_eq!(x["state"], "ready", "{x}");
    assert_eq!(x["layers"], 2);
    assert!(x["digest"].as_str().unwrap().starts_with("sha256:"), "{x}");
    let (_, listed) = up.send(Method::GET, "/v1/images", None).await;
    assert!(
        listed["images"]
            .as_array()
            .unwrap()
            .iter()
            .any(|i| i["name"] == "hello-env"),
        "{listed}"
    );

    let id = running_sandbox(&up, "hello-env").await;
    let (out, code) = up.exec(&id, "hello", &[]).await.unwrap();
    assert_eq!(
        (out.trim(), code),
        ("hello from the-image-config in /srv/app", 0),
        "the image's Env and WorkingDir hold for commands"
    );
    // E2B's SDKs run commands as `/bin/bash -l -c`: an image without bash runs them in sh.
    let (out, code) = up.exec(&id, "/bin/bash", &["-l", "-c", "hello"]).await.unwrap();
    assert_eq!((out.trim(), code), ("hello from the-image-config in /srv/app", 0));
    // The image had no `user`: the agent made one as E2B's template build does.
    let (out, _) = up.exec(&id, "id", &["-un"]).await.unwrap();
    assert_eq!(out.trim(), "user");
    let (out, _) = up.exec(&id, "sh", &["-c", "echo ~"]).await.unwrap();
    assert_eq!(out.trim(), "/home/user");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_reference_naming_its_registry_is_pulled_at_create_and_unknown_names_are_404() {
    oci_support::require("the registry suite");
    let registry = Registry::start();
    let up = Up::start(None).await;
    let reference = hello_image(&up, &registry, "e2e/direct").await;

    // Not registered: the edge pulls it at create, once for both sandboxes.
    let (a, b) = tokio::join!(running_sandbox(&up, &reference), running_sandbox(&up, &reference));
    for id in [a, b] {
        let (out, _) = up.exec(&id, "hello", &[]).await.unwrap();
        assert_eq!(out.trim(), "hello from the-image-config in /srv/app");
    }

    for (image, field) in [("no-such-image", "image"), ("python:3.12", "image")] {
        let (s, v) = up
            .send(Method::POST, "/v1/sandboxes", Some(json!({"image": image})))
            .await;
        assert_eq!((s, v["field"].as_str()), (404, Some(field)), "{image}: {v}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failed_pull_says_why_and_a_deleted_image_is_gone() {
    oci_support::require("the registry suite");
    let registry = Registry::start();
    let up = Up::start(None).await;
    let missing = format!("{}/e2e/nothing:v1", registry.host());
    let (s, v) = up
        .send(
            Method::POST,
            "/v1/images",
            Some(json!({"reference": missing, "name": "nothing"})),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let x = wait_image(&up, "nothing", Duration::from_secs(60)).await;
    assert_eq!(x["state"], "failed", "{x}");
    assert!(!x["reason"].as_str().unwrap_or_default().is_empty(), "{x}");
    let (s, v) = up
        .send(Method::POST, "/v1/sandboxes", Some(json!({"image": "nothing"})))
        .await;
    assert_eq!((s, v["field"].as_str()), (409, Some("image")), "{v}");

    for (body, field) in [
        (json!({"reference": "Bad Ref"}), "reference"),
        (json!({"reference": missing, "name": "base"}), "name"),
        (json!({"reference": 7}), "reference"),
    ] {
        let (s, v) = up.send(Method::POST, "/v1/images", Some(body.clone())).await;
        assert_eq!((s, v["field"].as_str()), (400, Some(field)), "{body}: {v}");
    }

    let (s, v) = up.send(Method::DELETE, "/v1/images/nothing", None).await;
    assert_eq!(s, 200, "{v}");
    let (s, _) = up.send(Method::GET, "/v1/images/nothing", None).await;
    assert_eq!(s, 404);
    let (s, v) = up
        .send(Method::POST, "/v1/sandboxes", Some(json!({"image": "nothing"})))
        .await;
    assert_eq!(s, 404, "{v}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_removed_image_keeps_its_layers_while_a_sandbox_runs_and_loses_them_after() {
    oci_support::require("the registry suite");
    // Collect at once: no grace for young layers (the default waits 10 minutes).
    // SAFETY: set before the server starts, read by the child processes only.
    unsafe { std::env::set_var("OPENDSEC_IMAGE_GC_GRACE_SECS", "0") };
    let registry = Registry::start();
    let up = Up::start(None).await;
    let reference = hello_image(&up, &registry, "e2e/collected").await;
    let (s, v) = up
        .send(
            Method::POST,
            "/v1/images",
            Some(json!({"reference": reference, "name": "gc-hello"})),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    assert_eq!(
        wait_image(&up, "gc-hello", Duration::from_secs(120)).await["state"],
        "ready"
    );
    let store = opendsec_edge::images::ImageStore::open(opendsec_edge::images::DEFAULT_STORE).unwrap();
    let image = store.get("gc-hello").unwrap();
    // The top layer is this test's own; the bottom one (busybox's files) other tests share.
    let top = store.layer_path(image.layers.last().unwrap());
    assert!(top.is_dir());
    let id = running_sandbox(&up, "gc-hello").await;

    let (s, v) = up.send(Method::DELETE, "/v1/images/gc-hello", None).await;
    assert_eq!(s, 200, "{v}");
    let deadline = Instant::now() + Duration::from_secs(30);
    while store.get("gc-hello").is_ok() {
        assert!(Instant::now() < deadline, "the edge did not remove the record");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Collected since (the record went first), and pruned on demand: yet the running
    // sandbox's layers stay.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (s, pruned) = up.send(Method::POST, "/v1/image-store/prune", None).await;
    assert_eq!(s, 200, "{pruned}");
    assert_eq!(pruned["edges"][0]["error"], Value::Null, "{pruned}");
    assert!(top.is_dir(), "a running sandbox's layer was collected");
    let (out, code) = up.exec(&id, "hello", &[]).await.unwrap();
    assert_eq!((out.trim(), code), ("hello from the-image-config in /srv/app", 0));

    // The sandbox goes; `image prune` frees the layer (the edge would, hourly or after the
    // next deletion).
    let (s, v) = up.send(Method::DELETE, &format!("/v1/sandboxes/{id}"), None).await;
    assert!(s == 200 || s == 204, "{s} {v}");
    let deadline = Instant::now() + Duration::from_secs(60);
    while top.is_dir() {
        assert!(
            Instant::now() < deadline,
            "the layer of a removed image no sandbox uses was not collected\n{}",
            up.log_tail(40)
        );
        let (s, pruned) = up.send(Method::POST, "/v1/image-store/prune", None).await;
        assert_eq!(s, 200, "{pruned}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// `opendsecctl image import` and `PUT /v1/images/{name}`: a docker-archive and a gzipped
/// OCI layout are uploaded to the edge, which verifies and stores them; sandboxes start
/// from them with their config; a tarball of neither format, and an upload cut off
/// midway, leave the image failed with the reason and nothing half-stored.
#[tokio::test(flavor = "multi_thread")]
async fn an_image_imported_from_a_tarball_runs_and_a_bad_or_cut_off_upload_fails_saying_why() {
    oci_support::require("the registry suite");
    let up = Up::start(None).await;
    let image = hello_test_image(&up, "e2e/imported").await;
    let layout = write_layout(&image);
    let files = tempfile::tempdir().unwrap();

    // A docker-archive, as `docker save` writes it (made by skopeo from the layout),
    // imported through the CLI as a user would.
    let archive = files.path().join("hello.tar");
    let out = std::process::Command::new("skopeo")
        .args(["copy", "--quiet", "--insecure-policy"])
        .arg(format!("oci:{}:v1", layout.dir.path().display()))
        .arg(format!("docker-archive:{}:e2e/imported:v1", archive.display()))
        .output()
        .expect("running skopeo (the skopeo package)");
    assert!(out.status.success(), "skopeo: {}", String::from_utf8_lossy(&out.stderr));
    let ctl = std::path::Path::new(env!("CARGO_BIN_EXE_opendsec")).with_file_name("opendsecctl");
    assert!(
        ctl.is_file(),
        "opendsecctl is not built beside opendsec: cargo build -p opendsec-sdk --bins"
    );
    let opendsecctl = |args: &[&str]| {
        let out = std::process::Command::new(&ctl)
            .args(args)
            .env("OPENDSEC_URL", format!("http://{}", up.http))
            .env("OPENDSEC_TOKEN", &up.token)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let archive_arg = archive.to_str().unwrap();
    let (code, stdout, stderr) = opendsecctl(&[
        "image",
        "import",
        archive_arg,
        "--name",
        "hello-tar",
        "--output",
        "json",
    ]);
    assert_eq!(code, Some(0), "opendsecctl image import: {stdout}{stderr}");
    let x: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(
        (
            x["state"].as_str(),
            x["imported"].as_bool(),
            x["layers"].as_u64(),
            x["reference"].as_str()
        ),
        (Some("ready"), Some(true), Some(2), Some("")),
        "{x}"
    );
    // A docker-archive has no manifest: its digest is its config's (Docker's image id).
    assert!(x["digest"].as_str().is_some_and(|d| d.starts_with("sha256:")), "{x}");
    let (code, stdout, _) = opendsecctl(&["image", "list"]);
    assert_eq!(code, Some(0));
    assert!(
        stdout.contains("hello-tar") && stdout.contains("imported on"),
        "{stdout}"
    );

    let id = running_sandbox(&up, "hello-tar").await;
    let (out, code) = up.exec(&id, "hello", &[]).await.unwrap();
    assert_eq!(
        (out.trim(), code),
        ("hello from the-image-config in /srv/app", 0),
        "the imported image's Env and WorkingDir hold"
    );
    let (out, _) = up.exec(&id, "id", &["-un"]).await.unwrap();
    assert_eq!(out.trim(), "user");

    // A gzipped OCI layout (`skopeo copy … oci-archive:`), through REST: the answer comes
    // once the edge has it.
    let mut oci = tar::Builder::new(Vec::new());
    oci.append_dir_all(".", layout.dir.path()).unwrap();
    let oci = oci_support::gzip(&oci.into_inner().unwrap());
    let (s, v) = put_tarball(&up, "/v1/images/hello-oci", oci).await;
    assert_eq!(s, 201, "{v}");
    assert_eq!(
        (
            v["image"]["state"].as_str(),
            v["image"]["layers"].as_u64(),
            v["image"]["digest"].as_str()
        ),
        (Some("ready"), Some(2), Some(layout.manifest.as_str())),
        "{v}"
    );

    // Neither format: 400 naming the body; the image is failed, with the reason.
    let mut junk = tar::Builder::new(Vec::new());
    let mut header = tar::Header::new_gnu();
    header.set_size(5);
    header.set_mode(0o644);
    junk.append_data(&mut header, "readme", &b"hello"[..]).unwrap();
    let (s, v) = put_tarball(&up, "/v1/images/junk", junk.into_inner().unwrap()).await;
    assert_eq!((s, v["field"].as_str()), (400, Some("body")), "{v}");
    assert!(v["message"].as_str().unwrap().contains("neither an OCI layout"), "{v}");
    let x = wait_image(&up, "junk", Duration::from_secs(10)).await;
    assert_eq!(x["state"], "failed", "{x}");
    let (s, v) = up
        .send(Method::POST, "/v1/sandboxes", Some(json!({"image": "junk"})))
        .await;
    assert_eq!((s, v["field"].as_str()), (409, Some("image")), "{v}");
    assert!(v["message"].as_str().unwrap().contains("import it again"), "{v}");

    // An upload cut off midway (the client announced more than it sent, then went away):
    // the edge reports the import failed and keeps nothing of it.
    let request = format!(
        "PUT /v1/images/cut-off HTTP/1.1\r\nhost: {}\r\nauthorization: Bearer {}\r\n\
         content-type: application/x-tar\r\ncontent-length: 1000000\r\n\r\n",
        up.http, up.token
    );
    {
        use tokio::io::AsyncWriteExt;
        let mut tcp = tokio::net::TcpStream::connect(&up.http).await.unwrap();
        tcp.write_all(request.as_bytes()).await.unwrap();
        tcp.write_all(&[0u8; 4096]).await.unwrap();
        // Until the import is registered, then away.
        let deadline = Instant::now() + Duration::from_secs(10);
        while up.send(Method::GET, "/v1/images/cut-off", None).await.0 != 200 {
            assert!(Instant::now() < deadline, "the import was not registered");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let x = wait_image(&up, "cut-off", Duration::from_secs(30)).await;
    assert_eq!(x["state"], "failed", "{x}");
    assert!(x["reason"].as_str().unwrap().contains("upload"), "{x}");
    let tmp = std::path::Path::new(opendsec_edge::images::DEFAULT_STORE).join("tmp");
    let left: Vec<String> = std::fs::read_dir(&tmp)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    assert!(
        !left.iter().any(|n| n.starts_with(&format!("import.{}.", up.pid()))),
        "an upload's file was left in the store: {left:?}"
    );

    // Bad input: a name that is not one, a parameter the endpoint does not take.
    for (path, field) in [
        ("/v1/images/Bad%20Name", "name"),
        ("/v1/images/fine?bogus=1", "bogus"),
        ("/v1/images/base", "name"),
    ] {
        let (s, v) = put_tarball(&up, path, b"x".to_vec()).await;
        assert_eq!((s, v["field"].as_str()), (400, Some(field)), "{path}: {v}");
    }
    let (code, _, stderr) = opendsecctl(&["image", "import", "/no/such/file.tar", "--name", "x"]);
    assert_ne!(code, Some(0));
    assert!(stderr.contains("/no/such/file.tar"), "{stderr}");
}

/// `PUT path` with `body` as the tarball: (status, JSON answer).
async fn put_tarball(up: &Up, path: &str, body: Vec<u8>) -> (u16, Value) {
    let resp = up
        .client
        .put(format!("http://{}{path}", up.http))
        .bearer_auth(&up.token)
        .header("content-type", "application/x-tar")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

/// `opendsecctl image push` and `POST /v1/image-pushes`: an imported image goes to a
/// registry as an OCI image and comes back through a pull with the same digest, layers
/// and config; bad pushes say what is wrong.
#[tokio::test(flavor = "multi_thread")]
async fn an_imported_image_is_pushed_to_a_registry_and_pulled_back_the_same() {
    oci_support::require("the registry suite");
    let registry = Registry::start();
    let up = Up::start(None).await;
    let image = hello_test_image(&up, "e2e/to-push").await;
    let layout = write_layout(&image);
    let mut oci = tar::Builder::new(Vec::new());
    oci.append_dir_all(".", layout.dir.path()).unwrap();
    let (s, v) = put_tarball(&up, "/v1/images/to-push", oci.into_inner().unwrap()).await;
    assert_eq!(s, 201, "{v}");

    let target = format!("{}/e2e/pushed:v1", registry.host());
    let ctl = std::path::Path::new(env!("CARGO_BIN_EXE_opendsec")).with_file_name("opendsecctl");
    let out = std::process::Command::new(&ctl)
        .args(["image", "push", "to-push", &target, "--output", "json"])
        .env("OPENDSEC_URL", format!("http://{}", up.http))
        .env("OPENDSEC_TOKEN", &up.token)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "opendsecctl image push: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let pushed: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (pushed["layers"].as_u64(), pushed["reference"].as_str()),
        (Some(2), Some(target.as_str())),
        "{pushed}"
    );
    let digest = pushed["digest"].as_str().unwrap().to_string();

    // Pulled back through the edge, it is the same image: its digest, its config.
    let (s, v) = up
        .send(
            Method::POST,
            "/v1/images",
            Some(json!({"reference": target, "name": "pulled-back"})),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let x = wait_image(&up, "pulled-back", Duration::from_secs(60)).await;
    assert_eq!(
        (x["state"].as_str(), x["digest"].as_str(), x["layers"].as_u64()),
        (Some("ready"), Some(digest.as_str()), Some(2)),
        "{x}"
    );
    let id = running_sandbox(&up, "pulled-back").await;
    let (out, code) = up.exec(&id, "hello", &[]).await.unwrap();
    assert_eq!((out.trim(), code), ("hello from the-image-config in /srv/app", 0));

    // Pushing it again sends no layer twice and gives the same digest.
    let (s, v) = up
        .send(
            Method::POST,
            "/v1/image-pushes",
            Some(json!({"image": "to-push", "reference": target})),
        )
        .await;
    assert_eq!((s, v["digest"].as_str()), (200, Some(digest.as_str())), "{v}");

    // Bad pushes: no such image, a malformed or pinned reference, a registry that is not there.
    for (body, status, field) in [
        (
            json!({"image": "no-such-image", "reference": target}),
            404,
            Some("image"),
        ),
        (
            json!({"image": "to-push", "reference": "Bad Ref"}),
            400,
            Some("reference"),
        ),
        (
            json!({"image": "to-push", "reference": format!("{target}@{digest}")}),
            400,
            Some("reference"),
        ),
        (json!({"image": "to-push"}), 400, Some("reference")),
        (
            json!({"image": "to-push", "reference": "127.0.0.1:1/e2e/x:v1"}),
            502,
            None,
        ),
        (
            json!({"image": "to-push", "reference": target, "id": "not an id!"}),
            400,
            Some("id"),
        ),
    ] {
        let (s, v) = up.send(Method::POST, "/v1/image-pushes", Some(body.clone())).await;
        assert_eq!((s, v["field"].as_str()), (status, field), "{body}: {v}");
        assert!(!v["message"].as_str().unwrap_or_default().is_empty(), "{v}");
    }

    // A push's progress can be read under the id it was asked with, while it runs: here
    // to a "registry" that takes connections and never answers, until it drops them.
    let hole = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let hole_addr = hole.local_addr().unwrap();
    let release = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let held = release.clone();
    std::thread::spawn(move || {
        hole.set_nonblocking(true).unwrap();
        let mut conns = Vec::new();
        while !held.load(std::sync::atomic::Ordering::Relaxed) {
            if let Ok((c, _)) = hole.accept() {
                conns.push(c);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    });
    let slow = json!({"image": "to-push", "reference": format!("{hole_addr}/e2e/slow:v1"), "id": "progress-1"});
    let pushing = {
        let (http, token) = (up.http.clone(), up.token.clone());
        tokio::spawn(async move {
            let resp = reqwest::Client::new()
                .post(format!("http://{http}/v1/image-pushes"))
                .bearer_auth(token)
                .json(&slow)
                .send()
                .await
                .unwrap();
            resp.status().as_u16()
        })
    };
    let progress_path = "/v1/image-pushes/progress-1?image=to-push";
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let seen = loop {
        let (s, v) = up.send(Method::GET, progress_path, None).await;
        // Its layers written, it waits on the registry.
        if s == 200 && v["layers_total"] == 2 && v["current"].as_str().is_some_and(|c| c.starts_with("reaching ")) {
            break v;
        }
        assert!(std::time::Instant::now() < deadline, "no progress of the push: {s} {v}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(seen["bytes_total"].as_u64() > Some(0), "{seen}");
    assert_eq!(seen["layers_done"], 0, "{seen}");
    release.store(true, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(pushing.await.unwrap(), 502, "a registry that drops the connection");
    // Once it has ended, its progress is gone; an unknown image or a bad id is said so.
    let (s, v) = up.send(Method::GET, progress_path, None).await;
    assert_eq!((s, v["field"].as_str()), (404, Some("id")), "{v}");
    let (s, v) = up
        .send(Method::GET, "/v1/image-pushes/progress-1?image=nope", None)
        .await;
    assert_eq!((s, v["field"].as_str()), (404, Some("image")), "{v}");
    let (s, v) = up
        .send(Method::GET, "/v1/image-pushes/bad%20id?image=to-push", None)
        .await;
    assert_eq!((s, v["field"].as_str()), (400, Some("id")), "{v}");
}

/// An OCI image in a microVM (its own kernel, the image as its root file system): the
/// image's Env, WorkingDir and User hold for commands there as in a container, and an
/// image without `user` gets one.
#[tokio::test(flavor = "multi_thread")]
async fn an_imported_image_runs_in_a_microvm_with_its_env_working_directory_and_user() {
    oci_support::require("the registry suite");
    let up = vms::start().await;
    let image = hello_test_image(&up, "e2e/in-a-vm").await;
    let layout = write_layout(&image);
    let mut oci = tar::Builder::new(Vec::new());
    oci.append_dir_all(".", layout.dir.path()).unwrap();
    let (s, v) = put_tarball(&up, "/v1/images/hello-vm-test", oci.into_inner().unwrap()).await;
    assert_eq!(s, 201, "{v}");
    let (s, v) = up
        .send(
            Method::POST,
            "/v1/sandboxes",
            Some(json!({"image": "hello-vm-test", "isolation": "microvm", "memory_mb": 256})),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let id = v["sandbox"]["id"].as_str().unwrap().to_string();
    vms::wait_state(&up, &id, "running", Duration::from_secs(300)).await;
    let out = vms::exec(&up, &id, "hello", &[]).await;
    assert_eq!(
        out.trim(),
        "hello from the-image-config in /srv/app",
        "Env and WorkingDir in the guest"
    );
    assert_eq!(vms::exec(&up, &id, "id", &["-un"]).await.trim(), "user");
}
