//! What the unmodified E2B SDK 2.63.0 relies on beyond the basics: the envd
//! version we report and every feature it switches on (file metadata, watch
//! options), and the status codes the SDK maps (507, 404, 400).

mod common;

use bytes::Bytes;
use common::*;
use serde_json::{Value, json};

fn q(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"/-_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

#[test]
fn envd_version_is_printed() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_opendsec-agent"))
        .arg("--envd-version")
        .output()
        .unwrap();
    assert!(out.status.success());
    // The highest feature switch in e2b/envd/versions.py (2.63.0) is 0.6.4.
    assert_eq!(String::from_utf8(out.stdout).unwrap(), "0.6.4\n");
}

async fn upload(a: &Agent, path: &str, headers: &[(&str, String)], body: &'static [u8]) -> (u16, Value) {
    let mut h = vec![("content-type", "application/octet-stream".to_string())];
    h.extend(headers.iter().cloned());
    let (st, _, b) = a
        .raw(
            "POST",
            &format!("/files?path={}", q(path)),
            &h,
            Bytes::from_static(body),
        )
        .await
        .unwrap();
    (st, serde_json::from_slice(&b).unwrap_or(json!(null)))
}

#[tokio::test]
async fn file_metadata_is_stored_returned_and_replaced() {
    let a = Agent::start().await;
    let p = a.path("meta.txt");
    let (st, v) = upload(
        &a,
        &p,
        &[("x-metadata-Owner", "alice".into()), ("x-metadata-build", "42".into())],
        b"data",
    )
    .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        v,
        json!([{"name": "meta.txt", "type": "file", "path": p,
                "metadata": {"owner": "alice", "build": "42"}}])
    );
    // Stored as user.e2b.* extended attributes, seen by Stat and ListDir.
    let (_, v) = a.unary("/filesystem.Filesystem/Stat", json!({"path": p})).await;
    assert_eq!(v["entry"]["metadata"], json!({"owner": "alice", "build": "42"}));
    let (_, v) = a
        .unary(
            "/filesystem.Filesystem/ListDir",
            json!({"path": a.path(""), "depth": 1}),
        )
        .await;
    let e = v["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "meta.txt")
        .unwrap();
    assert_eq!(e["metadata"]["owner"], "alice");
    // A new upload replaces the whole set; one without metadata clears it.
    let (_, v) = upload(&a, &p, &[("x-metadata-owner", "bob".into())], b"data").await;
    assert_eq!(v[0]["metadata"], json!({"owner": "bob"}));
    let (_, v) = a.unary("/filesystem.Filesystem/Stat", json!({"path": p})).await;
    assert_eq!(v["entry"]["metadata"], json!({"owner": "bob"}));
    let (_, v) = upload(&a, &p, &[], b"data").await;
    assert!(v[0].get("metadata").is_none(), "{v}");
    let (_, v) = a.unary("/filesystem.Filesystem/Stat", json!({"path": p})).await;
    assert!(v["entry"].get("metadata").is_none(), "{v}");
    // Bad metadata is a 400 and writes nothing.
    let p2 = a.path("not-written.txt");
    let big = "v".repeat(5000);
    let (st, v) = upload(&a, &p2, &[("x-metadata-k", big)], b"data").await;
    assert_eq!((st, v["code"].as_u64()), (400, Some(400)), "{v}");
    assert!(!exists(std::path::Path::new(&p2)));
}

#[tokio::test]
async fn watch_accepts_allow_network_mounts_on_local_disks() {
    let a = Agent::start().await;
    let dir = a.path("");
    for allow in [false, true] {
        let (st, v) = a
            .unary(
                "/filesystem.Filesystem/CreateWatcher",
                json!({"path": dir, "recursive": true, "includeEntry": true, "allowNetworkMounts": allow}),
            )
            .await;
        assert_eq!(st, 200, "{v}");
        assert!(v["watcherId"].is_string());
    }
}

/// A small tmpfs, to run out of space on. Mounting needs root: without it the test
/// fails and says so.
struct SmallFs(tempfile::TempDir);

impl SmallFs {
    fn mount(kib: u32) -> SmallFs {
        let d = tempfile::tempdir().unwrap();
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={kib}k"), "tmpfs"])
            .arg(d.path())
            .output()
            .unwrap_or_else(|e| panic!("cannot run mount ({e}): this test needs root and util-linux's mount"));
        assert!(
            out.status.success(),
            "mounting a {kib} KiB tmpfs failed ({}): {}; this test needs root (./ops/test.sh runs as root)",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
        SmallFs(d)
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(self.0.path()).status();
    }
}

#[tokio::test]
async fn upload_larger_than_the_disk_is_507() {
    let fs = SmallFs::mount(256);
    let a = Agent::start().await;
    let p = fs.0.path().join("big.bin").display().to_string();
    static BIG: [u8; 1 << 20] = [7u8; 1 << 20];
    let (st, v) = upload(&a, &p, &[], &BIG).await;
    assert_eq!(st, 507, "{v}");
    assert_eq!(v["code"], 507);
    // Multipart too.
    let body = format!(
        "--XB\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{p}\"\r\n\r\n{}\r\n--XB--\r\n",
        "x".repeat(1 << 20)
    );
    let (st, _, b) = a
        .raw(
            "POST",
            "/files",
            &[("content-type", "multipart/form-data; boundary=XB".into())],
            Bytes::from(body),
        )
        .await
        .unwrap();
    assert_eq!(st, 507, "{}", String::from_utf8_lossy(&b));
}

#[tokio::test]
async fn status_codes_the_sdk_maps() {
    let a = Agent::start().await;
    // Missing file: 404 on /files, not_found on the RPCs.
    let missing = a.path("no-such-file");
    let (st, _, b) = a
        .raw("GET", &format!("/files?path={}", q(&missing)), &[], Bytes::new())
        .await
        .unwrap();
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!((st, v["code"].as_u64()), (404, Some(404)), "{v}");
    let (st, v) = a.unary("/filesystem.Filesystem/Stat", json!({"path": missing})).await;
    assert_eq!((st, v["code"].as_str()), (404, Some("not_found")));
    let (st, v) = a.unary("/filesystem.Filesystem/Remove", json!({"path": missing})).await;
    assert_eq!((st, v["code"].as_str()), (404, Some("not_found")));
    // A directory where a file is wanted, and a file where a directory is: invalid_argument / 400.
    let (st, _, _) = a
        .raw("GET", &format!("/files?path={}", q(&a.path(""))), &[], Bytes::new())
        .await
        .unwrap();
    assert_eq!(st, 400);
    std::fs::write(a.path("plain"), "x").unwrap();
    let (st, v) = a
        .unary("/filesystem.Filesystem/ListDir", json!({"path": a.path("plain")}))
        .await;
    assert_eq!((st, v["code"].as_str()), (400, Some("invalid_argument")));
    // An unknown user: 401 on /files, unauthenticated on the RPCs.
    let (st, _, _) = a
        .raw(
            "GET",
            &format!("/files?path={}&username=no-such-user-xyz", q(&a.path("plain"))),
            &[],
            Bytes::new(),
        )
        .await
        .unwrap();
    assert_eq!(st, 401);
    // A process that is gone.
    let (st, v) = a
        .unary(
            "/process.Process/SendInput",
            json!({"process": {"pid": 999999}, "input": {"stdin": "eA=="}}),
        )
        .await;
    assert_eq!((st, v["code"].as_str()), (404, Some("not_found")));
}

#[tokio::test]
async fn relative_paths_cannot_climb_out_of_a_users_permissions() {
    let user = test_user();
    let a = Agent::start().await;
    // "../../../etc/x" from the user's home is /etc/x, which the user may not write.
    let (st, _, b) = a
        .raw(
            "POST",
            &format!("/files?path={}&username={user}", q("../../../etc/odagent-traversal")),
            &[("content-type", "application/octet-stream".into())],
            Bytes::from_static(b"nope"),
        )
        .await
        .unwrap();
    assert_eq!(st, 403, "{}", String::from_utf8_lossy(&b));
    assert!(!exists(std::path::Path::new("/etc/odagent-traversal")));
    // Reading a root-only file by climbing is refused the same way.
    let (st, _, _) = a
        .raw(
            "GET",
            &format!("/files?path={}&username={user}", q("../../etc/shadow")),
            &[],
            Bytes::new(),
        )
        .await
        .unwrap();
    assert_eq!(st, 403);
}

#[tokio::test]
async fn recursive_watch_reports_what_a_new_directory_already_holds() {
    let a = Agent::start().await;
    let root = a.path("watched");
    std::fs::create_dir(&root).unwrap();
    let (_, v) = a
        .unary(
            "/filesystem.Filesystem/CreateWatcher",
            json!({"path": root, "recursive": true}),
        )
        .await;
    let id = v["watcherId"].as_str().unwrap().to_string();
    // Faster than the watch on "x" can be added: x, x/y and x/y/f appear at once.
    std::fs::create_dir_all(format!("{root}/x/y")).unwrap();
    std::fs::write(format!("{root}/x/y/f"), "data").unwrap();
    let mut created = std::collections::BTreeSet::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while created.len() < 3 {
        assert!(std::time::Instant::now() < deadline, "created so far: {created:?}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let (_, v) = a
            .unary("/filesystem.Filesystem/GetWatcherEvents", json!({"watcherId": id}))
            .await;
        for e in v["events"].as_array().unwrap() {
            if e["type"] == "EVENT_TYPE_CREATE" {
                created.insert(e["name"].as_str().unwrap().to_string());
            }
        }
    }
    assert_eq!(created.into_iter().collect::<Vec<_>>(), ["x", "x/y", "x/y/f"]);
}
