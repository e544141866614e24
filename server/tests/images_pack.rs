//! Specification (the DSec paper's §6.1, pack_diff): a sandbox installs a package, is
//! packed into an image, and a new sandbox from the packed image has the package and none
//! of the scrubbed residue; E2B clients start it as a template. Through the whole path
//! with a real `opendsec up` (the SDK, REST and E2B's API -> log -> edge -> crun/runc ->
//! agent). Needs root, crun or runc, the built `busybox`
//! image and the static agent (`./ops/test.sh` installs and builds them).

#[path = "support/up.rs"]
mod up;

use opendsec_sdk::types::{CreateSandbox, Image, PackSandbox};
use opendsec_sdk::{Client, ExecOutput, ExecRequest};
use serde_json::Value;
use std::path::Path;
use std::time::{Duration, Instant};
use up::Up;

/// Where `opendsec up` keeps images (the edge's default store).
const STORE: &str = "/var/lib/opendsec/images";

/// Runs `script` with `/bin/sh -c` in `sandbox` as root: (exit code, stdout).
async fn root_sh(client: &Client, sandbox: &str, script: &str) -> (i32, String) {
    let req = ExecRequest {
        cmd: "/bin/sh".into(),
        args: vec!["-c".into(), script.into()],
        user: Some("root".into()),
        ..Default::default()
    };
    let mut out = Vec::new();
    let code = client
        .exec(sandbox, &req, |o| {
            if let ExecOutput::Stdout(b) = o {
                out.extend(b)
            }
        })
        .await
        .unwrap_or_else(|e| panic!("exec in {sandbox}: {e}"));
    (code, String::from_utf8_lossy(&out).into_owned())
}

/// Creates a sandbox of `image` and waits until it runs; returns its id.
async fn running(client: &Client, image: &str) -> String {
    let req = CreateSandbox {
        image: image.into(),
        memory_mb: Some(256),
        ..Default::default()
    };
    let id = client.create_sandbox(&req).await.expect("create").sandbox.id;
    wait_state(client, &id, "running").await;
    id
}

async fn wait_state(client: &Client, id: &str, state: &str) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let s = client.get_sandbox(id).await.expect("get sandbox");
        if s.state == state {
            return;
        }
        assert!(
            !matches!(s.state.as_str(), "failed" | "exited" | "killed"),
            "sandbox {id} is {} (waiting for {state}): {s:?}",
            s.state
        );
        assert!(
            Instant::now() < deadline,
            "sandbox {id} is not {state} within 120 s: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until image `name` is made (panics if it failed).
async fn wait_ready(client: &Client, name: &str) -> Image {
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let x = client.get_image(name).await.expect("get image");
        match x.state.as_str() {
            "ready" => return x,
            "failed" => panic!("packing {name} failed: {x:?}"),
            _ => assert!(Instant::now() < deadline, "{name} was not packed within 180 s: {x:?}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The image records and packed layers this test wrote in the shared store, removed at
/// the end whatever happens.
struct StoreCleanup(Vec<String>);

impl Drop for StoreCleanup {
    fn drop(&mut self) {
        for name in &self.0 {
            let record = Path::new(STORE).join("images").join(format!("{name}.json"));
            if let Some(layer) = std::fs::read(&record)
                .ok()
                .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
                .and_then(|v| v["layers"].as_array().and_then(|l| l.last().cloned()))
                .and_then(|l| l.as_str().map(str::to_string))
                .filter(|l| l.starts_with("sha256-"))
            {
                let _ = std::fs::remove_dir_all(Path::new(STORE).join("layers").join(layer));
            }
            let _ = std::fs::remove_file(record);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_packed_sandbox_starts_new_sandboxes_with_its_package_and_none_of_its_residue() {
    let up = Up::start(None).await;
    up.ensure_image("busybox", Duration::from_secs(600)).await;
    let client = Client::new(&format!("http://{}", up.http), up.token.clone()).unwrap();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    let tag = format!("{:08x}", std::process::id().rotate_left(16) ^ nanos);
    let (name, paused_name) = (format!("pack-test-{tag}"), format!("pack-test-{tag}-paused"));
    let word = format!("packed-{tag}");
    let _cleanup = StoreCleanup(vec![name.clone(), paused_name.clone()]);

    // The sandbox "installs a package", deletes a file of its image, and leaves residue.
    let src = running(&client, "busybox").await;
    let script = format!(
        "set -e
         mkdir -p /usr/local/bin
         printf '#!/bin/sh\\necho {word}\\n' > /usr/local/bin/hello
         chmod 755 /usr/local/bin/hello
         printf '#!/bin/sh\\nid\\n' > /usr/local/bin/rootshell
         chmod 4755 /usr/local/bin/rootshell
         rm /linuxrc
         echo secret > /tmp/secret
         echo 'echo secret' > /root/.bash_history
         mkdir -p /root/.cache && echo x > /root/.cache/x
         echo t0ken > /etc/token
         echo kept > /etc/kept
         stat -c %a /usr/local/bin/rootshell"
    );
    let (code, out) = root_sh(&client, &src, &script).await;
    assert_eq!((code, out.trim()), (0, "4755"), "installing in the source");

    // Packed through the SDK, /etc/token scrubbed at the caller's word.
    let req = PackSandbox {
        name: name.clone(),
        scrub: vec!["/etc/token".into()],
    };
    let w = client.pack_sandbox(&src, &req).await.expect("pack");
    assert_eq!(
        (w.image.state.as_str(), w.image.source_sandbox.as_deref()),
        ("pending", Some(src.as_str()))
    );
    let image = wait_ready(&client, &name).await;
    assert!(
        image.digest.as_deref().is_some_and(|d| d.starts_with("sha256:")),
        "{image:?}"
    );
    assert_eq!(
        (image.layers, image.scrub.clone(), image.reference.as_str()),
        (2, vec!["/etc/token".to_string()], ""),
        "busybox's layer plus the packed one: {image:?}"
    );
    // The source was frozen only while read: it runs on.
    let (code, out) = root_sh(&client, &src, "cat /etc/token").await;
    assert_eq!((code, out.trim()), (0, "t0ken"));

    // Where it came from is on the record the edge wrote.
    let record: Value =
        serde_json::from_slice(&std::fs::read(Path::new(STORE).join("images").join(format!("{name}.json"))).unwrap())
            .unwrap();
    let labels = &record["config"]["labels"];
    assert_eq!(labels["org.opendsec.pack.sandbox"], src.as_str(), "{record}");
    assert_eq!(labels["org.opendsec.pack.image"], "busybox", "{record}");
    assert_eq!(labels["org.opendsec.pack.scrubbed"], r#"["/etc/token"]"#, "{record}");
    assert!(labels["org.opendsec.pack.created-ms"].as_str().is_some(), "{record}");
    assert!(labels["org.opendsec.pack.project"].as_str().is_some(), "{record}");
    assert_eq!(record["digest"].as_str(), image.digest.as_deref());

    // A new sandbox from the packed image has the package and none of the residue.
    let new = running(&client, &name).await;
    let got = client.get_sandbox(&new).await.unwrap();
    assert_eq!(
        (got.image.as_str(), got.source_edge.as_deref()),
        (name.as_str(), Some(image.edge.as_str()))
    );
    let (code, out) = root_sh(&client, &new, "hello").await;
    assert_eq!((code, out.trim()), (0, word.as_str()), "the package runs");
    let (code, out) = root_sh(
        &client,
        &new,
        "for p in /tmp/secret /root/.bash_history /root/.cache/x /etc/token /linuxrc; do
             [ -e $p ] && echo $p
         done
         cat /etc/kept
         stat -c %a /usr/local/bin/rootshell
         [ -d /tmp ] && echo tmp-is-there",
    )
    .await;
    assert_eq!(
        (code, out.split_whitespace().collect::<Vec<_>>()),
        (0, vec!["kept", "755", "tmp-is-there"]),
        "residue, the scrubbed path or the deleted file came back, or setuid stayed"
    );

    // An E2B client starts it as a template, by name.
    let key = up.issue_e2b_key().await;
    let (status, v) = up::send_json(
        up.client
            .post(format!("http://{}/sandboxes", up.http))
            .header("x-api-key", &key),
        Some(serde_json::json!({"templateID": name})),
    )
    .await;
    assert_eq!(status, 201, "E2B create from the packed template: {v}");
    assert_eq!(v["templateID"], name.as_str(), "{v}");
    let from_e2b = v["sandboxID"].as_str().expect("sandboxID").to_string();
    wait_state(&client, &from_e2b, "running").await;
    let (code, out) = root_sh(&client, &from_e2b, "hello").await;
    assert_eq!((code, out.trim()), (0, word.as_str()));

    // A paused sandbox is packed too, and stays paused.
    client.pause_sandbox(&src).await.unwrap();
    wait_state(&client, &src, "paused").await;
    let req = PackSandbox {
        name: paused_name.clone(),
        scrub: vec![],
    };
    client.pack_sandbox(&src, &req).await.expect("pack while paused");
    wait_ready(&client, &paused_name).await;
    assert_eq!(client.get_sandbox(&src).await.unwrap().state, "paused");
    client.resume_sandbox(&src).await.unwrap();
    wait_state(&client, &src, "running").await;
    // Without the caller's scrub, /etc/token is in that one.
    let third = running(&client, &paused_name).await;
    let (_, out) = root_sh(&client, &third, "cat /etc/token; [ -e /tmp/secret ] || echo no-secret").await;
    assert_eq!(out.split_whitespace().collect::<Vec<_>>(), ["t0ken", "no-secret"]);

    for id in [&src, &new, &from_e2b, &third] {
        let _ = client.kill_sandbox(id).await;
    }
    for n in [&name, &paused_name] {
        client.delete_image(n).await.unwrap();
    }
}
