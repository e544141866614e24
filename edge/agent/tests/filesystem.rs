//! filesystem.Filesystem and /files against the real agent binary.

mod common;

use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::time::{Duration, Instant};

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

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

fn gunzip(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(data).read_to_end(&mut out).unwrap();
    out
}

#[tokio::test]
async fn upload_and_download() {
    let a = Agent::start().await;
    let p = a.path("up/nested/a.txt");
    // octet-stream upload creates parent dirs
    let (st, _, body) = a
        .raw(
            "POST",
            &format!("/files?path={}", q(&p)),
            &[("content-type", "application/octet-stream".into())],
            Bytes::from_static(b"hello file"),
        )
        .await
        .unwrap();
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v, json!([{"name": "a.txt", "type": "file", "path": p}]));
    assert_eq!(std::fs::read(&p).unwrap(), b"hello file");

    // plain download
    let (st, h, body) = a
        .raw("GET", &format!("/files?path={}", q(&p)), &[], Bytes::new())
        .await
        .unwrap();
    assert_eq!(st, 200);
    assert_eq!(&body[..], b"hello file");
    assert_eq!(h["content-length"], "10");

    // gzip download
    let big: Vec<u8> = (0..300_000u32).flat_map(|i| i.to_le_bytes()).collect();
    std::fs::write(&p, &big).unwrap();
    let (st, h, body) = a
        .raw(
            "GET",
            &format!("/files?path={}", q(&p)),
            &[("accept-encoding", "gzip".into())],
            Bytes::new(),
        )
        .await
        .unwrap();
    assert_eq!(st, 200);
    assert_eq!(h["content-encoding"], "gzip");
    assert_eq!(gunzip(&body), big);

    // gzip upload
    let p2 = a.path("gz.bin");
    let (st, _, _) = a
        .raw(
            "POST",
            &format!("/files?path={}", q(&p2)),
            &[
                ("content-type", "application/octet-stream".into()),
                ("content-encoding", "gzip".into()),
            ],
            Bytes::from(gzip(&big)),
        )
        .await
        .unwrap();
    assert_eq!(st, 200);
    assert_eq!(std::fs::read(&p2).unwrap(), big);

    // missing file and directory
    let (st, _, body) = a
        .raw("GET", &format!("/files?path={}", q(&a.path("nope"))), &[], Bytes::new())
        .await
        .unwrap();
    assert_eq!(st, 404, "{}", String::from_utf8_lossy(&body));
    let (st, _, _) = a
        .raw("GET", &format!("/files?path={}", q(&a.path("up"))), &[], Bytes::new())
        .await
        .unwrap();
    assert_eq!(st, 400);
}

#[tokio::test]
async fn multipart_upload_several_files_and_relative_path() {
    let a = Agent::start().await;
    let (p1, p2) = (a.path("m/one.txt"), a.path("m/two.txt"));
    let boundary = "XbOuNdArYx";
    let mut body = Vec::new();
    for (p, data) in [(&p1, &b"first\r\n--Xb not a boundary"[..]), (&p2, &b"second"[..])] {
        write!(body, "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{p}\"\r\nContent-Type: application/octet-stream\r\n\r\n").unwrap();
        body.extend_from_slice(data);
        body.extend_from_slice(b"\r\n");
    }
    write!(body, "--{boundary}--\r\n").unwrap();
    let (st, _, resp) = a
        .raw(
            "POST",
            "/files",
            &[("content-type", format!("multipart/form-data; boundary={boundary}"))],
            Bytes::from(body),
        )
        .await
        .unwrap();
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&resp));
    let v: Value = serde_json::from_slice(&resp).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 2);
    assert_eq!(std::fs::read(&p1).unwrap(), b"first\r\n--Xb not a boundary");
    assert_eq!(std::fs::read(&p2).unwrap(), b"second");

    // A relative path resolves against the user's home (root here).
    let rel = format!("odagent-test-{}.txt", std::process::id());
    let (st, _, _) = a
        .raw(
            "POST",
            &format!("/files?path={rel}"),
            &[("content-type", "application/octet-stream".into())],
            Bytes::from_static(b"x"),
        )
        .await
        .unwrap();
    assert_eq!(st, 200);
    let home_file = format!("/root/{rel}");
    assert_eq!(std::fs::read(&home_file).unwrap(), b"x");
    std::fs::remove_file(home_file).unwrap();
}

#[tokio::test]
async fn stat_list_mkdir_move_remove() {
    let a = Agent::start().await;
    let root = a.path("tree");
    std::fs::create_dir_all(format!("{root}/d1/d2")).unwrap();
    std::fs::write(format!("{root}/f.txt"), b"12345").unwrap();
    std::fs::write(format!("{root}/d1/g.txt"), b"1").unwrap();
    std::fs::write(format!("{root}/d1/d2/deep.txt"), b"1").unwrap();
    std::os::unix::fs::symlink(format!("{root}/f.txt"), format!("{root}/link")).unwrap();

    let (st, v) = a
        .unary("/filesystem.Filesystem/Stat", json!({"path": format!("{root}/f.txt")}))
        .await;
    assert_eq!(st, 200, "{v}");
    let e = &v["entry"];
    assert_eq!(e["name"], "f.txt");
    assert_eq!(e["type"], "FILE_TYPE_FILE");
    assert_eq!(e["size"], "5");
    assert_eq!(e["owner"], "root");
    assert_eq!(e["permissions"].as_str().unwrap().len(), 10);
    let mt = e["modifiedTime"].as_str().unwrap();
    assert!(mt.len() >= 20 && mt.ends_with('Z') && mt.as_bytes()[10] == b'T', "{mt}");

    let (_, v) = a
        .unary("/filesystem.Filesystem/Stat", json!({"path": format!("{root}/link")}))
        .await;
    assert_eq!(v["entry"]["isSymlink"], json!(true));
    assert_eq!(v["entry"]["symlinkTarget"], json!(format!("{root}/f.txt")));

    let (st, v) = a
        .unary("/filesystem.Filesystem/ListDir", json!({"path": root, "depth": 1}))
        .await;
    assert_eq!(st, 200);
    let names: Vec<&str> = v["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["d1", "f.txt", "link"]);
    let (_, v) = a
        .unary("/filesystem.Filesystem/ListDir", json!({"path": root, "depth": 2}))
        .await;
    let paths: Vec<String> = v["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["path"].as_str().unwrap().replace(&root, ""))
        .collect();
    assert_eq!(paths, ["/d1", "/d1/d2", "/d1/g.txt", "/f.txt", "/link"]);
    let d1 = &v["entries"][0];
    assert_eq!(d1["type"], "FILE_TYPE_DIRECTORY");

    let (st, v) = a
        .unary(
            "/filesystem.Filesystem/MakeDir",
            json!({"path": format!("{root}/new/a/b")}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    assert!(std::fs::metadata(format!("{root}/new/a/b")).unwrap().is_dir());
    let (st, v) = a
        .unary(
            "/filesystem.Filesystem/MakeDir",
            json!({"path": format!("{root}/new/a/b")}),
        )
        .await;
    assert_eq!((st, v["code"].as_str()), (409, Some("already_exists")));

    let (st, v) = a
        .unary(
            "/filesystem.Filesystem/Move",
            json!({"source": format!("{root}/f.txt"), "destination": format!("{root}/new/moved.txt")}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["entry"]["name"], "moved.txt");
    assert!(!exists(std::path::Path::new(&format!("{root}/f.txt"))));

    let (st, _) = a
        .unary("/filesystem.Filesystem/Remove", json!({"path": format!("{root}/d1")}))
        .await;
    assert_eq!(st, 200);
    assert!(!exists(std::path::Path::new(&format!("{root}/d1"))));
    let (st, v) = a
        .unary("/filesystem.Filesystem/Stat", json!({"path": format!("{root}/d1")}))
        .await;
    assert_eq!((st, v["code"].as_str()), (404, Some("not_found")));
    let (st, v) = a
        .unary(
            "/filesystem.Filesystem/ListDir",
            json!({"path": format!("{root}/new/moved.txt")}),
        )
        .await;
    assert_eq!((st, v["code"].as_str()), (400, Some("invalid_argument")));
}

#[tokio::test]
async fn watch_dir_stream_sees_created_file() {
    let a = Agent::start().await;
    let root = a.path("w");
    std::fs::create_dir_all(format!("{root}/sub")).unwrap();
    let mut s = a
        .stream(
            "/filesystem.Filesystem/WatchDir",
            json!({"path": root, "recursive": true}),
            &[],
        )
        .await;
    match s.next().await {
        Some(Frame::Msg(v)) => assert!(v.get("start").is_some(), "{v}"),
        _ => panic!("expected start"),
    }
    std::fs::write(format!("{root}/created.txt"), b"x").unwrap();
    std::fs::write(format!("{root}/sub/inner.txt"), b"x").unwrap();
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !(seen.contains(&("created.txt".to_string(), "EVENT_TYPE_CREATE".to_string()))
        && seen.contains(&("sub/inner.txt".to_string(), "EVENT_TYPE_CREATE".to_string())))
    {
        assert!(Instant::now() < deadline, "events seen: {seen:?}");
        if let Some(Frame::Msg(v)) = s.next().await
            && let Some(f) = v.get("filesystem")
        {
            seen.push((
                f["name"].as_str().unwrap().to_string(),
                f["type"].as_str().unwrap().to_string(),
            ));
        }
    }
    // Not a directory -> an error end frame.
    let mut s = a
        .stream(
            "/filesystem.Filesystem/WatchDir",
            json!({"path": format!("{root}/created.txt")}),
            &[],
        )
        .await;
    match s.next().await {
        Some(Frame::End(v)) => assert_eq!(v["error"]["code"], "invalid_argument"),
        _ => panic!("expected an error"),
    }
}

#[tokio::test]
async fn polled_watcher() {
    let a = Agent::start().await;
    let root = a.path("pw");
    std::fs::create_dir_all(&root).unwrap();
    let (st, v) = a
        .unary(
            "/filesystem.Filesystem/CreateWatcher",
            json!({"path": root, "recursive": false, "includeEntry": true}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    let id = v["watcherId"].as_str().unwrap().to_string();
    std::fs::write(format!("{root}/x.txt"), b"1").unwrap();
    std::fs::remove_file(format!("{root}/x.txt")).unwrap();
    let mut evs = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !evs.iter().any(|e: &Value| e["type"] == "EVENT_TYPE_REMOVE") {
        assert!(Instant::now() < deadline, "{evs:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
        let (st, v) = a
            .unary("/filesystem.Filesystem/GetWatcherEvents", json!({"watcherId": id}))
            .await;
        assert_eq!(st, 200);
        evs.extend(v["events"].as_array().unwrap().iter().cloned());
    }
    assert_eq!(evs[0]["type"], "EVENT_TYPE_CREATE");
    assert_eq!(evs[0]["name"], "x.txt");
    let (st, _) = a
        .unary("/filesystem.Filesystem/RemoveWatcher", json!({"watcherId": id}))
        .await;
    assert_eq!(st, 200);
    let (st, _) = a
        .unary("/filesystem.Filesystem/GetWatcherEvents", json!({"watcherId": id}))
        .await;
    assert_eq!(st, 404);
}

#[tokio::test]
async fn file_ops_use_the_users_permissions() {
    let user = test_user();
    let mut a = Agent::start().await;
    // The temp dir is 0700 root: make a world-readable area inside.
    let area = a.path("area");
    std::fs::create_dir_all(&area).unwrap();
    for p in [a.dir.path().to_str().unwrap(), area.as_str()] {
        std::fs::set_permissions(p, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    }
    let secret = format!("{area}/secret");
    std::fs::write(&secret, b"root only").unwrap();
    std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();

    let (st, _, _) = a
        .raw(
            "GET",
            &format!("/files?path={}&username={user}", q(&secret)),
            &[],
            Bytes::new(),
        )
        .await
        .unwrap();
    assert_eq!(st, 403);
    let (st, _, b) = a
        .raw(
            "GET",
            &format!("/files?path={}&username=root", q(&secret)),
            &[],
            Bytes::new(),
        )
        .await
        .unwrap();
    assert_eq!((st, &b[..]), (200, &b"root only"[..]));

    // Writing into a root-owned directory is refused; into home it works and the file is the user's.
    let (st, _, _) = a
        .raw(
            "POST",
            &format!("/files?path={}&username={user}", q(&format!("{area}/new"))),
            &[("content-type", "application/octet-stream".into())],
            Bytes::from_static(b"x"),
        )
        .await
        .unwrap();
    assert_eq!(st, 403);
    let (st, _, body) = a
        .raw(
            "POST",
            &format!("/files?path=up/mine.txt&username={user}"),
            &[("content-type", "application/octet-stream".into())],
            Bytes::from_static(b"mine"),
        )
        .await
        .unwrap();
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
    let mine = format!("/home/{user}/up/mine.txt");
    let m = std::fs::metadata(&mine).unwrap();
    let uid = std::fs::metadata(format!("/home/{user}")).unwrap().uid();
    assert_eq!(m.uid(), uid);

    // RPCs take the user from the Authorization header.
    a.user = Some(user.into());
    let (st, v) = a.unary("/filesystem.Filesystem/Stat", json!({"path": secret})).await;
    assert_eq!(st, 200, "stat needs only search permission: {v}");
    let (st, v) = a.unary("/filesystem.Filesystem/Remove", json!({"path": secret})).await;
    assert_eq!((st, v["code"].as_str()), (403, Some("permission_denied")));
    let (st, v) = a.unary("/filesystem.Filesystem/ListDir", json!({"path": "up"})).await;
    assert_eq!(st, 200);
    assert_eq!(v["entries"][0]["owner"], json!(user));
    std::fs::remove_dir_all(format!("/home/{user}/up")).unwrap();
}

/// The signature of a signed `/files` URL, computed here with the system's
/// `sha256sum`, independently of the agent's own SHA-256.
fn sign(token: &str, path: &str, op: &str, user: &str, exp: Option<i64>) -> String {
    use base64::Engine;
    let raw = match exp {
        None => format!("{path}:{op}:{user}:{token}"),
        Some(e) => format!("{path}:{op}:{user}:{token}:{e}"),
    };
    let mut child = std::process::Command::new("sha256sum")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(raw.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let hex = String::from_utf8(out.stdout).unwrap();
    let digest: Vec<u8> = (0..32)
        .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
        .collect();
    format!("v1_{}", base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest))
}

async fn get(a: &Agent, query: String) -> (u16, Bytes) {
    let (st, _, body) = a
        .raw("GET", &format!("/files?{query}"), &[], Bytes::new())
        .await
        .unwrap();
    (st, body)
}

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

#[tokio::test]
async fn signed_urls_read_and_write_files_without_the_token_header() {
    const TOKEN: &str = "envd-token-for-signing";
    let mut a = Agent::start_with(Some(TOKEN)).await;
    let file = a.path("signed.txt");
    std::fs::write(&file, "signed content").unwrap();
    // As the SDK's download_url/upload_url are used: no X-Access-Token at all.
    a.token = None;

    // No username: signed with an empty one, read as the default user.
    let sig = sign(TOKEN, &file, "read", "", None);
    let (st, body) = get(&a, format!("path={}&signature={}", q(&file), q(&sig))).await;
    assert_eq!((st, &body[..]), (200, &b"signed content"[..]));

    // A named user is part of what is signed.
    let sig = sign(TOKEN, &file, "read", "root", None);
    let (st, _) = get(&a, format!("path={}&username=root&signature={}", q(&file), q(&sig))).await;
    assert_eq!(st, 200);
    let (st, _) = get(&a, format!("path={}&signature={}", q(&file), q(&sig))).await;
    assert_eq!(st, 401, "signed for root, used without a username");

    // With an expiration in the future; then one in the past.
    let exp = now() + 60;
    let sig = sign(TOKEN, &file, "read", "", Some(exp));
    let (st, _) = get(
        &a,
        format!("path={}&signature={}&signature_expiration={exp}", q(&file), q(&sig)),
    )
    .await;
    assert_eq!(st, 200);
    let (st, _) = get(
        &a,
        format!(
            "path={}&signature={}&signature_expiration={}",
            q(&file),
            q(&sig),
            exp + 3600
        ),
    )
    .await;
    assert_eq!(st, 401, "a later expiration than the one signed");
    let past = now() - 10;
    let sig = sign(TOKEN, &file, "read", "", Some(past));
    let (st, body) = get(
        &a,
        format!("path={}&signature={}&signature_expiration={past}", q(&file), q(&sig)),
    )
    .await;
    assert_eq!(st, 401);
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["code"], 401);
    assert!(v["message"].as_str().unwrap().contains("expired"), "{v}");

    // Wrong token, another path, or the write operation: refused.
    for sig in [
        sign("other-token", &file, "read", "", None),
        sign(TOKEN, "/etc/passwd", "read", "", None),
        sign(TOKEN, &file, "write", "", None),
        "v1_".to_string(),
    ] {
        let (st, body) = get(&a, format!("path={}&signature={}", q(&file), q(&sig))).await;
        assert_eq!(st, 401, "{sig}");
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            (v["code"].as_u64(), v["message"].as_str()),
            (Some(401), Some("invalid signature"))
        );
    }

    // Upload with a write signature (octet-stream and multipart both).
    let target = a.path("uploaded-signed.bin");
    let sig = sign(TOKEN, &target, "write", "", None);
    let (st, _, body) = a
        .raw(
            "POST",
            &format!("/files?path={}&signature={}", q(&target), q(&sig)),
            &[("content-type", "application/octet-stream".into())],
            Bytes::from_static(b"written via a signed URL"),
        )
        .await
        .unwrap();
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(std::fs::read(&target).unwrap(), b"written via a signed URL");
    let read_sig = sign(TOKEN, &target, "read", "", None);
    let (st, _, _) = a
        .raw(
            "POST",
            &format!("/files?path={}&signature={}", q(&target), q(&read_sig)),
            &[("content-type", "application/octet-stream".into())],
            Bytes::from_static(b"nope"),
        )
        .await
        .unwrap();
    assert_eq!(st, 401, "a read signature cannot write");
    assert_eq!(std::fs::read(&target).unwrap(), b"written via a signed URL");

    // A signature opens /files only, and a wrong header token beats a good signature.
    let (st, _) = a
        .unary(&format!("/process.Process/List?signature={}", q(&sig)), json!({}))
        .await;
    assert_eq!(st, 401);
    a.token = Some("wrong".into());
    let sig = sign(TOKEN, &file, "read", "", None);
    let (st, _) = get(&a, format!("path={}&signature={}", q(&file), q(&sig))).await;
    assert_eq!(st, 401);
}

/// The answer to a multipart upload comes after the whole body, its epilogue included:
/// an answer sent while the client still sends would end the connection under it (the
/// JS SDK saw "Broken pipe"). Here the close delimiter's CRLF and an epilogue come
/// 300 ms after the rest; no answer may come before them, and the connection is kept.
#[tokio::test]
async fn a_multipart_upload_is_answered_after_its_epilogue_and_the_connection_is_kept() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let a = Agent::start().await;
    let p = a.path("epilogue/x.txt");
    let boundary = "EpIlOgUe";
    let head_part = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{p}\"\r\n\r\nxyz\r\n--{boundary}--"
    );
    let tail = "\r\nan epilogue the reader must drop\r\n";
    let request = |len: usize| {
        let mut r = format!(
            "POST /files HTTP/1.1\r\nHost: agent\r\nContent-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: {len}\r\n"
        );
        if let Some(t) = &a.token {
            r.push_str(&format!("X-Access-Token: {t}\r\n"));
        }
        r.push_str("\r\n");
        r
    };
    let mut s = tokio::net::UnixStream::connect(&a.sock).await.unwrap();
    s.write_all(request(head_part.len() + tail.len()).as_bytes())
        .await
        .unwrap();
    s.write_all(head_part.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let early = tokio::time::timeout(Duration::from_millis(300), s.read(&mut buf)).await;
    assert!(early.is_err(), "answered before the body's end: {early:?}");
    s.write_all(tail.as_bytes()).await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
        .await
        .expect("an answer once the body ended")
        .unwrap();
    let answer = String::from_utf8_lossy(&buf[..n]).into_owned();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert_eq!(std::fs::read(&p).unwrap(), b"xyz");

    // The same connection serves the next request.
    let get = format!(
        "GET /files?path={} HTTP/1.1\r\nHost: agent\r\n{}\r\n",
        q(&p),
        a.token
            .as_ref()
            .map(|t| format!("X-Access-Token: {t}\r\n"))
            .unwrap_or_default()
    );
    s.write_all(get.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !answer.ends_with(b"xyz") && Instant::now() < deadline {
        match tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => answer.extend_from_slice(&buf[..n]),
            other => panic!("the kept connection did not answer: {other:?}"),
        }
    }
    let answer = String::from_utf8_lossy(&answer).into_owned();
    assert!(
        answer.starts_with("HTTP/1.1 200") && answer.ends_with("xyz"),
        "{answer}"
    );
}
