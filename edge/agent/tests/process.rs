//! process.Process against the real agent binary, real processes.

mod common;

use std::time::{Duration, Instant};

use common::*;
use http_body_util::BodyExt;
use serde_json::json;

const START: &str = "/process.Process/Start";

#[tokio::test]
async fn echo_hello_start_data_end() {
    let a = Agent::start().await;
    let mut s = a.stream(START, start_msg("/bin/echo", &["hello"]), &[]).await;
    let first = s.event().await;
    assert!(first["start"]["pid"].as_u64().unwrap() > 0, "start first: {first}");
    let (out, err, _, end) = s.collect().await;
    assert_eq!(out, "hello\n");
    assert_eq!(err, "");
    assert_eq!(end["exitCode"], json!(0));
    assert_eq!(end["exited"], json!(true));
    assert_eq!(end["status"], json!("exit status 0"));
}

#[tokio::test]
async fn exit_code_and_stderr() {
    let a = Agent::start().await;
    let mut s = a.stream(START, sh("echo oops >&2; exit 3"), &[]).await;
    assert!(s.event().await.get("start").is_some());
    let (out, err, _, end) = s.collect().await;
    assert_eq!(out, "");
    assert_eq!(err, "oops\n");
    assert_eq!(end["exitCode"], json!(3));
    assert_eq!(end["status"], json!("exit status 3"));
}

#[tokio::test]
async fn env_and_cwd() {
    let a = Agent::start().await;
    let msg = json!({"process": {"cmd": "/bin/sh", "args": ["-c", "echo $FOO $HOME $USER; pwd"], "envs": {"FOO": "bar baz"}, "cwd": "/tmp"}});
    let mut s = a.stream(START, msg, &[]).await;
    s.event().await;
    let (out, _, _, end) = s.collect().await;
    assert_eq!(out, "bar baz /root root\n/tmp\n");
    assert_eq!(end["exitCode"], json!(0));
    // The default cwd is the user's home.
    let mut s = a.stream(START, sh("pwd"), &[]).await;
    s.event().await;
    assert_eq!(s.collect().await.0, "/root\n");
}

#[tokio::test]
async fn start_errors() {
    let a = Agent::start().await;
    let mut s = a.stream(START, start_msg("/nonexistent/cmd", &[]), &[]).await;
    match s.next().await {
        Some(Frame::End(v)) => assert_eq!(v["error"]["code"], json!("not_found"), "{v}"),
        _ => panic!("expected an error end frame"),
    }
    let mut s = a
        .stream(
            START,
            json!({"process": {"cmd": "/bin/true", "cwd": "/nonexistent-dir"}}),
            &[],
        )
        .await;
    match s.next().await {
        Some(Frame::End(v)) => assert!(v["error"]["code"].is_string(), "{v}"),
        _ => panic!("expected an error end frame"),
    }
    let mut s = a
        .stream("/process.Process/Connect", json!({"process": {"pid": 999999}}), &[])
        .await;
    match s.next().await {
        Some(Frame::End(v)) => assert_eq!(v["error"]["code"], json!("not_found")),
        _ => panic!("expected an error end frame"),
    }
    let (st, v) = a
        .unary(
            "/process.Process/SendSignal",
            json!({"process": {"pid": 999999}, "signal": "SIGNAL_SIGKILL"}),
        )
        .await;
    assert_eq!((st, v["code"].as_str()), (404, Some("not_found")));
    let (st, v) = a.unary("/process.Process/Nope", json!({})).await;
    assert_eq!((st, v["code"].as_str()), (501, Some("unimplemented")));
}

#[tokio::test]
async fn stdin_send_input_then_close() {
    let a = Agent::start().await;
    let mut s = a
        .stream(START, json!({"process": {"cmd": "/bin/cat"}, "stdin": true}), &[])
        .await;
    let pid = s.event().await["start"]["pid"].as_u64().unwrap();
    let (st, _) = a
        .unary(
            "/process.Process/SendInput",
            json!({"process": {"pid": pid}, "input": {"stdin": b64(b"abc\n")}}),
        )
        .await;
    assert_eq!(st, 200);
    let ev = s.event().await;
    assert_eq!(unb64(ev["data"]["stdout"].as_str().unwrap()), b"abc\n");
    let (st, _) = a
        .unary("/process.Process/CloseStdin", json!({"process": {"pid": pid}}))
        .await;
    assert_eq!(st, 200);
    let (_, _, _, end) = s.collect().await;
    assert_eq!(end["exitCode"], json!(0));
}

#[tokio::test]
async fn stream_input_client_stream() {
    let a = Agent::start().await;
    let mut s = a
        .stream(
            START,
            json!({"process": {"cmd": "/bin/cat"}, "stdin": true, "tag": "cat-1"}),
            &[],
        )
        .await;
    let pid = s.event().await["start"]["pid"].as_u64().unwrap();
    // A chunked request body, sent frame by frame.
    let (mut tx, body) = http_body_util::channel::Channel::<bytes::Bytes, std::convert::Infallible>::new(4);
    let h = [("content-type", "application/connect+json".to_string())];
    let fut = a.send("POST", "/process.Process/StreamInput", &h, body.boxed());
    let sender = async move {
        tx.send_data(envelope(0, &json!({"start": {"process": {"pid": pid}}})))
            .await
            .unwrap();
        tx.send_data(envelope(0, &json!({"data": {"input": {"stdin": b64(b"one\n")}}})))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        tx.send_data(envelope(0, &json!({"keepalive": {}}))).await.unwrap();
        tx.send_data(envelope(0, &json!({"data": {"input": {"stdin": b64(b"two\n")}}})))
            .await
            .unwrap();
        drop(tx);
    };
    let (resp, ()) = tokio::join!(fut, sender);
    let resp = resp.unwrap();
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body.last_chunk::<2>(), Some(b"{}"), "end frame closes the response");
    // Close stdin by tag.
    let (st, _) = a
        .unary("/process.Process/CloseStdin", json!({"process": {"tag": "cat-1"}}))
        .await;
    assert_eq!(st, 200);
    let (out, _, _, _) = s.collect().await;
    assert_eq!(out, "one\ntwo\n");
}

#[tokio::test]
async fn send_signal_kills_sleep() {
    let a = Agent::start().await;
    let mut s = a.stream(START, start_msg("/bin/sleep", &["100"]), &[]).await;
    let pid = s.event().await["start"]["pid"].as_u64().unwrap();
    let t = Instant::now();
    let (st, _) = a
        .unary(
            "/process.Process/SendSignal",
            json!({"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"}),
        )
        .await;
    assert_eq!(st, 200);
    let (_, _, _, end) = s.collect().await;
    assert!(t.elapsed() < Duration::from_secs(5));
    assert_eq!(end["exited"], json!(false));
    assert_eq!(end["status"], json!("signal: killed"));
    assert_ne!(end["exitCode"], json!(0));
}

#[tokio::test]
async fn list_and_connect_reattach() {
    let a = Agent::start().await;
    let msg = json!({"process": {"cmd": "/bin/sh", "args": ["-c", "read x; echo later $x; sleep 100"]}, "stdin": true, "tag": "job"});
    let mut s = a.stream(START, msg, &[]).await;
    let pid = s.event().await["start"]["pid"].as_u64().unwrap();
    drop(s); // the client goes away; the process keeps running

    let (st, v) = a.unary("/process.Process/List", json!({})).await;
    assert_eq!(st, 200);
    let procs = v["processes"].as_array().unwrap();
    let p = procs.iter().find(|p| p["pid"] == json!(pid)).expect("listed");
    assert_eq!(p["tag"], json!("job"));
    assert_eq!(p["config"]["cmd"], json!("/bin/sh"));

    let mut c = a
        .stream("/process.Process/Connect", json!({"process": {"pid": pid}}), &[])
        .await;
    assert_eq!(c.event().await["start"]["pid"], json!(pid));
    a.unary(
        "/process.Process/SendInput",
        json!({"process": {"pid": pid}, "input": {"stdin": b64(b"now\n")}}),
    )
    .await;
    let ev = c.event().await;
    assert_eq!(unb64(ev["data"]["stdout"].as_str().unwrap()), b"later now\n");

    // A second client by tag sees the end too.
    let mut c2 = a
        .stream("/process.Process/Connect", json!({"process": {"tag": "job"}}), &[])
        .await;
    assert_eq!(c2.event().await["start"]["pid"], json!(pid));
    a.unary(
        "/process.Process/SendSignal",
        json!({"process": {"tag": "job"}, "signal": "SIGNAL_SIGTERM"}),
    )
    .await;
    let end = c.collect().await.3;
    assert_eq!(end["status"], json!("signal: terminated"));
    assert_eq!(c2.collect().await.3["status"], json!("signal: terminated"));
    let (_, v) = a.unary("/process.Process/List", json!({})).await;
    assert!(
        !v["processes"]
            .as_array()
            .map(|p| p.iter().any(|p| p["pid"] == json!(pid)))
            .unwrap_or(false)
    );
}

#[tokio::test]
async fn backlog_delivered_on_connect() {
    let a = Agent::start().await;
    let mut s = a.stream(START, sh("echo early; sleep 100"), &[]).await;
    let pid = s.event().await["start"]["pid"].as_u64().unwrap();
    let first = s.event().await; // "early" reached the attached client
    assert_eq!(unb64(first["data"]["stdout"].as_str().unwrap()), b"early\n");
    drop(s);
    let mut s = a.stream(START, json!({"process": {"cmd": "/bin/sh", "args": ["-c", "sleep 0.3; echo while-detached; sleep 100"]}, "tag": "bl"}), &[]).await;
    let pid2 = s.event().await["start"]["pid"].as_u64().unwrap();
    drop(s);
    tokio::time::sleep(Duration::from_millis(800)).await;
    let mut c = a
        .stream("/process.Process/Connect", json!({"process": {"pid": pid2}}), &[])
        .await;
    c.event().await;
    let ev = c.event().await;
    assert_eq!(unb64(ev["data"]["stdout"].as_str().unwrap()), b"while-detached\n");
    for p in [pid, pid2] {
        a.unary(
            "/process.Process/SendSignal",
            json!({"process": {"pid": p}, "signal": 9}),
        )
        .await;
    }
}

#[tokio::test]
async fn pty_echo_and_resize() {
    let a = Agent::start().await;
    let msg = json!({
        "process": {"cmd": "/bin/bash", "args": ["-i", "-l"], "envs": {"TERM": "xterm-256color", "PS1": "$ "}},
        "pty": {"size": {"cols": 80, "rows": 24}},
    });
    let mut s = a.stream(START, msg, &[]).await;
    let pid = s.event().await["start"]["pid"].as_u64().unwrap();
    let send = |data: &'static [u8]| {
        let a = &a;
        async move {
            let (st, v) = a
                .unary(
                    "/process.Process/SendInput",
                    json!({"process": {"pid": pid}, "input": {"pty": b64(data)}}),
                )
                .await;
            assert_eq!(st, 200, "{v}");
        }
    };
    let mut seen = String::new();
    async fn read_until(s: &mut Stream, seen: &mut String, needle: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !seen.contains(needle) {
            assert!(Instant::now() < deadline, "never saw {needle:?} in {seen:?}");
            let ev = s.event().await;
            let d = ev["data"]["pty"]
                .as_str()
                .unwrap_or_else(|| panic!("pty data expected, got {ev}"));
            seen.push_str(&String::from_utf8_lossy(&unb64(d)));
        }
    }
    send(b"echo h''i\n").await;
    read_until(&mut s, &mut seen, "hi\r\n").await; // the echoed input is "h''i"
    seen.clear();
    send(b"stty size\n").await;
    read_until(&mut s, &mut seen, "24 80").await;
    let (st, _) = a
        .unary(
            "/process.Process/Update",
            json!({"process": {"pid": pid}, "pty": {"size": {"cols": 100, "rows": 40}}}),
        )
        .await;
    assert_eq!(st, 200);
    seen.clear();
    send(b"stty size\n").await;
    read_until(&mut s, &mut seen, "40 100").await;
    send(b"exit 7\n").await;
    let (_, _, _, end) = s.collect().await;
    assert_eq!(end["exitCode"], json!(7));
}

#[tokio::test]
async fn keepalive_events_with_short_interval() {
    let a = Agent::start().await;
    let mut s = a
        .stream(
            START,
            start_msg("/bin/sleep", &["2.5"]),
            &[("keepalive-ping-interval", "1".into())],
        )
        .await;
    let mut keepalives = 0;
    loop {
        match s.next().await {
            Some(Frame::Msg(v)) if v["event"].get("keepalive").is_some() => keepalives += 1,
            Some(Frame::Msg(v)) if v["event"].get("end").is_some() => break,
            Some(Frame::Msg(_)) => {}
            _ => panic!("stream ended early"),
        }
    }
    assert!(keepalives >= 2, "got {keepalives} keepalives");
}

#[tokio::test]
async fn access_token_required() {
    let mut a = Agent::start_with(Some("s3cret")).await;
    let (st, v) = a.unary("/process.Process/List", json!({})).await;
    assert_eq!(st, 200, "{v}");
    let mut s = a.stream(START, start_msg("/bin/echo", &["ok"]), &[]).await;
    s.event().await;
    assert_eq!(s.collect().await.0, "ok\n");
    a.token = None;
    let (st, v) = a.unary("/process.Process/List", json!({})).await;
    assert_eq!((st, v["code"].as_str()), (401, Some("unauthenticated")));
    let (st, _, _) = a
        .raw("GET", "/files?path=/etc/hostname", &[], bytes::Bytes::new())
        .await
        .unwrap();
    assert_eq!(st, 401);
    let (st, _, _) = a.raw("GET", "/health", &[], bytes::Bytes::new()).await.unwrap();
    assert_eq!(st, 204);
    a.token = Some("wrong".into());
    let (st, _) = a.unary("/process.Process/List", json!({})).await;
    assert_eq!(st, 401);
}

#[tokio::test]
async fn runs_as_requested_user() {
    let user = test_user();
    let mut a = Agent::start().await;
    a.user = Some(user.into());
    let mut s = a
        .stream(
            START,
            sh("id -un; echo $HOME; pwd; cat /etc/shadow >/dev/null 2>&1 || echo denied"),
            &[],
        )
        .await;
    s.event().await;
    let (out, _, _, _) = s.collect().await;
    assert_eq!(out, format!("{user}\n/home/{user}\n/home/{user}\ndenied\n"));
    // An unknown user is refused.
    a.user = Some("no-such-user-xyz".into());
    let mut s = a.stream(START, sh("true"), &[]).await;
    match s.next().await {
        Some(Frame::End(v)) => assert_eq!(v["error"]["code"], json!("unauthenticated")),
        _ => panic!("expected an error"),
    }
}

#[tokio::test]
async fn runaway_output_without_client_stays_bounded() {
    let a = Agent::start().await;
    let before = a.rss_kib().await;
    let mut s = a.stream(START, start_msg("/usr/bin/yes", &[]), &[]).await;
    let pid = s.event().await["start"]["pid"].as_u64().unwrap();
    s.event().await; // some output flowed
    drop(s);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let during = a.rss_kib().await;
    // Still alive and producing.
    let (_, v) = a.unary("/process.Process/List", json!({})).await;
    assert!(
        v["processes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["pid"] == json!(pid))
    );
    a.unary(
        "/process.Process/SendSignal",
        json!({"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"}),
    )
    .await;
    eprintln!("agent RSS: {before} KiB before, {during} KiB after 3 s of `yes` with no client");
    assert!(during < 40 * 1024, "agent RSS {during} KiB");
}

#[tokio::test]
async fn large_output_streams_completely() {
    let a = Agent::start().await;
    let mut s = a.stream(START, sh("head -c 3000000 /dev/zero | tr '\\0' x"), &[]).await;
    s.event().await;
    let (out, _, _, end) = s.collect().await;
    assert_eq!(out.len(), 3_000_000);
    assert_eq!(end["exitCode"], json!(0));
}

#[tokio::test]
async fn background_child_does_not_hold_end() {
    let a = Agent::start().await;
    let t = Instant::now();
    let mut s = a.stream(START, sh("sleep 30 & echo done"), &[]).await;
    s.event().await;
    let (out, _, _, end) = s.collect().await;
    assert_eq!(out, "done\n");
    assert_eq!(end["exitCode"], json!(0));
    assert!(t.elapsed() < Duration::from_secs(5));
}

#[tokio::test]
async fn start_request_body_still_open_and_large_output() {
    // As the Python SDK does: the Start request body is chunked and its end
    // arrives after the agent has begun answering.
    let a = Agent::start().await;
    let (mut tx, body) = http_body_util::channel::Channel::<bytes::Bytes, std::convert::Infallible>::new(4);
    tx.send_data(envelope(0, &sh("head -c 1300000 /dev/zero | tr '\\0' y")))
        .await
        .unwrap();
    let h = [("content-type", "application/connect+json".to_string())];
    let resp = a.send("POST", START, &h, body.boxed()).await.unwrap();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        drop(tx);
    });
    let mut s = Stream::new(resp.into_body());
    s.event().await;
    let (out, _, _, end) = s.collect().await;
    assert_eq!(out.len(), 1_300_000);
    assert_eq!(end["exitCode"], json!(0));
}

#[tokio::test]
async fn sigterm_is_forwarded_and_agent_exits() {
    let mut a = Agent::start().await;
    let mut s = a
        .stream(
            START,
            sh("trap 'echo got-term; exit 0' TERM; while :; do sleep 0.05; done"),
            &[],
        )
        .await;
    s.event().await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    unsafe { libc::kill(a.pid() as i32, libc::SIGTERM) };
    let (out, _, _, _) = s.collect().await;
    assert_eq!(out, "got-term\n");
    let deadline = Instant::now() + Duration::from_secs(5);
    while a.child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "agent did not exit");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn inherited_listen_fd_is_not_leaked_to_children() {
    use std::os::fd::AsRawFd;
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("edge.sock");
    let l = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let fd = l.as_raw_fd();
    unsafe { libc::fcntl(fd, libc::F_SETFD, 0) }; // inheritable, as the edge hands it over
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_opendsec-agent"))
        .args(["serve", "--listen-fd", &fd.to_string(), "--default-user", "root"])
        .spawn()
        .unwrap();
    drop(l);
    let a = Agent {
        child,
        dir,
        sock: sock.clone(),
        token: None,
        user: None,
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while a
        .raw("GET", "/health", &[], bytes::Bytes::new())
        .await
        .map(|r| r.0)
        .ok()
        != Some(204)
    {
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A sandbox process sees its stdio only: no socket, nothing the agent inherited.
    let mut s = a
        .stream(START, sh("for f in /proc/self/fd/*; do readlink $f; done"), &[])
        .await;
    s.event().await;
    let (out, _, _, _) = s.collect().await;
    assert!(!out.contains("socket:"), "fds seen by a child: {out}");
    assert_eq!(
        out.lines().filter(|l| l.starts_with("pipe:")).count(),
        2,
        "fds seen by a child: {out}"
    );
}
