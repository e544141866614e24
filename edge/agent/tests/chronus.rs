//! chronus: sessions survive the death of the agent's server. The
//! supervisor (the agent's pid) keeps every session's fds and hands them to
//! the new server it starts.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::{Value, json};

const START: &str = "/process.Process/Start";

async fn connect(a: &Agent, pid: u64) -> Stream {
    a.stream("/process.Process/Connect", json!({"process": {"pid": pid}}), &[])
        .await
}

/// The counter values in some stdout.
fn numbers(out: &str) -> Vec<u32> {
    out.lines().map(|l| l.parse().unwrap()).collect()
}

#[tokio::test]
async fn a_counter_continues_after_kill_9_of_the_server_and_its_exit_code_arrives() {
    let a = Agent::start().await;
    let mut s = a
        .stream(
            START,
            sh("i=0; while [ $i -lt 60 ]; do echo $i; i=$((i+1)); sleep 0.02; done; exit 3"),
            &[],
        )
        .await;
    let pid = s.event().await["start"]["pid"].as_u64().unwrap();
    let mut before = String::new();
    while numbers(&before).len() < 5 {
        let e = s.event().await;
        before.push_str(&String::from_utf8_lossy(&unb64(e["data"]["stdout"].as_str().unwrap())));
    }
    kill_server(&a).await;
    drop(s);
    // The counter goes on while we are away; its output waits for us.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut c = connect(&a, pid as u64).await;
    assert_eq!(c.event().await["start"]["pid"], json!(pid));
    let (after, _, _, end) = c.collect().await;
    assert_eq!(end["exitCode"], json!(3), "{end}");
    assert_eq!(end["status"], json!("exit status 3"));
    let (b, n) = (numbers(&before), numbers(&after));
    // Everything printed after the restart arrived, in order, to the end.
    assert!(n.windows(2).all(|w| w[1] == w[0] + 1), "gap after the restart: {n:?}");
    assert_eq!(*n.last().unwrap(), 59);
    // At most what the dead server held in flight is missing.
    let gap = n[0] as i64 - *b.last().unwrap() as i64;
    assert!((1..=4).contains(&gap), "before {b:?}, after {n:?}");
}

#[tokio::test]
async fn output_and_exit_of_a_process_that_ended_while_no_client_was_there_wait_for_connect() {
    let a = Agent::start().await;
    let mut s = a
        .stream(START, sh("sleep 0.3; echo done-while-away; exit 4"), &[])
        .await;
    let pid = s.event().await["start"]["pid"].as_u64().unwrap();
    kill_server(&a).await;
    drop(s);
    tokio::time::sleep(Duration::from_millis(800)).await;
    // It ended meanwhile; the supervisor reaped it and kept its status.
    let (_, v) = a.unary("/process.Process/List", json!({})).await;
    assert!(
        !v["processes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["pid"] == json!(pid))
    );
    let mut c = connect(&a, pid).await;
    c.event().await;
    let (out, _, _, end) = c.collect().await;
    assert_eq!(out, "done-while-away\n");
    assert_eq!(end["exitCode"], json!(4));
    // Once delivered, it is gone.
    let mut c = connect(&a, pid).await;
    match c.next().await {
        Some(Frame::End(v)) => assert_eq!(v["error"]["code"], "not_found", "{v}"),
        _ => panic!("expected not_found"),
    }
}

fn pty_text(e: &Value) -> String {
    e["data"]["pty"]
        .as_str()
        .map(|s| String::from_utf8_lossy(&unb64(s)).into_owned())
        .unwrap_or_default()
}

/// Reads PTY output until it contains `want`.
async fn pty_until(s: &mut Stream, want: &str) -> String {
    let mut all = String::new();
    while !all.contains(want) {
        let e = s.event().await;
        assert!(e.get("end").is_none(), "ended before {want:?}: {all:?}");
        all.push_str(&pty_text(&e));
    }
    all
}

#[tokio::test]
async fn a_pty_session_survives_and_can_be_typed_into_and_resized() {
    let a = Agent::start().await;
    let msg = json!({
        "process": {"cmd": "/bin/sh", "args": ["-c",
            "while read line; do echo \"got:$line\"; stty size; done; exit 5"]},
        "pty": {"size": {"cols": 80, "rows": 24}},
    });
    let mut s = a.stream(START, msg, &[]).await;
    let pid = s.event().await["start"]["pid"].as_u64().unwrap();
    let input = |text: &str| json!({"process": {"pid": pid}, "input": {"pty": b64(text.as_bytes())}});
    a.unary("/process.Process/SendInput", input("one\n")).await;
    pty_until(&mut s, "24 80").await;
    kill_server(&a).await;
    drop(s);
    let mut c = connect(&a, pid).await;
    c.event().await;
    let (st, v) = a
        .unary(
            "/process.Process/Update",
            json!({"process": {"pid": pid}, "pty": {"size": {"cols": 100, "rows": 30}}}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    let (st, v) = a.unary("/process.Process/SendInput", input("two\n")).await;
    assert_eq!(st, 200, "{v}");
    let out = pty_until(&mut c, "30 100").await;
    assert!(out.contains("got:two"), "{out:?}");
    a.unary("/process.Process/SendInput", input("\x04")).await; // ^D: end of input
    let (_, _, _, end) = c.collect().await;
    assert_eq!(end["exitCode"], json!(5));
}

#[tokio::test]
async fn stdin_survives_and_close_stdin_still_ends_the_input() {
    let a = Agent::start().await;
    let msg = json!({"process": {"cmd": "/bin/cat"}, "stdin": true});
    let mut s = a.stream(START, msg, &[]).await;
    let pid = s.event().await["start"]["pid"].as_u64().unwrap();
    let send = |t: &str| json!({"process": {"pid": pid}, "input": {"stdin": b64(t.as_bytes())}});
    a.unary("/process.Process/SendInput", send("before\n")).await;
    assert_eq!(unb64(s.event().await["data"]["stdout"].as_str().unwrap()), b"before\n");
    kill_server(&a).await;
    drop(s);
    let mut c = connect(&a, pid).await;
    c.event().await;
    let (st, v) = a.unary("/process.Process/SendInput", send("after\n")).await;
    assert_eq!(st, 200, "{v}");
    let e = c.event().await;
    let out = e["data"]["stdout"].as_str().unwrap_or_else(|| panic!("{e}"));
    assert_eq!(unb64(out), b"after\n");
    // cat ends only if no copy of its stdin's write end is left open anywhere.
    let (st, v) = a
        .unary("/process.Process/CloseStdin", json!({"process": {"pid": pid}}))
        .await;
    assert_eq!(st, 200, "{v}");
    let (_, _, _, end) = c.collect().await;
    assert_eq!(end["exitCode"], json!(0));
}

#[tokio::test]
async fn the_start_command_runs_once_across_restarts_and_readiness_carries_over() {
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let a = Agent::start_in(dir, None, &["--start-file", "{dir}/start.json"], |d| {
        std::fs::write(
            d.join("start.json"),
            json!({"cmd": "/bin/sleep", "args": ["30"], "ready_port": port}).to_string(),
        )
        .unwrap()
    })
    .await;
    let start_pid = |v: &Value| -> Vec<Value> {
        v["processes"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|p| p["tag"] == "start")
            .map(|p| p["pid"].clone())
            .collect()
    };
    let (_, v) = a.unary("/process.Process/List", json!({})).await;
    let first = start_pid(&v);
    assert_eq!(first.len(), 1);
    // Still waiting for its port after a restart.
    let old = a.server_pid().await;
    unsafe { libc::kill(old as i32, libc::SIGKILL) };
    let deadline = Instant::now() + Duration::from_secs(10);
    let body = loop {
        if a.server_pid().await != old
            && let Ok((503, _, b)) = a.raw("GET", "/health", &[], bytes::Bytes::new()).await
        {
            break b;
        }
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["message"], format!("starting: waiting for port {port}"));
    let (_, v) = a.unary("/process.Process/List", json!({})).await;
    assert_eq!(start_pid(&v), first, "the start command must not start again");
    // The new server notices the port.
    let _l = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while a.raw("GET", "/health", &[], bytes::Bytes::new()).await.unwrap().0 != 204 {
        assert!(Instant::now() < deadline, "never ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Ready stays ready across another restart.
    kill_server(&a).await;
}

/// The agent swap: sandbox root renames the agent's directory, plants a program at the
/// agent's path that would run first and then exec the real agent, and kills the
/// server. The supervisor restarts the agent it runs, never what is at the path now.
#[tokio::test]
async fn a_program_planted_at_the_agents_path_is_never_started_as_its_server() {
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    let exe = bin.join("agent");
    std::fs::copy(env!("CARGO_BIN_EXE_opendsec-agent"), &exe).unwrap();
    let a = Agent::start_command(agent_command_of(&exe), dir, None, &[], |_| {}).await;

    let moved = a.dir.path().join("bin.old");
    std::fs::rename(&bin, &moved).unwrap();
    std::fs::create_dir(&bin).unwrap();
    let marker = a.dir.path().join("planted-ran");
    let planted = format!(
        "#!/bin/sh\necho ran > {}\nexec {} \"$@\"\n",
        marker.display(),
        moved.join("agent").display()
    );
    std::fs::write(&exe, planted).unwrap();
    std::fs::set_permissions(&exe, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();

    let new = kill_server(&a).await;
    let exe_of_new = std::fs::read_link(format!("/proc/{new}/exe")).unwrap();
    assert!(!exists(&marker), "the planted program ran");
    assert_eq!(
        exe_of_new,
        moved.join("agent"),
        "the new server runs the agent's own image"
    );
    let comm = std::fs::read_to_string(format!("/proc/{new}/comm")).unwrap();
    assert_eq!(comm, "agent\n", "the server keeps the agent's name for ps");
    // And it still answers as the agent.
    let (out, _, _, end) = a.stream(START, sh("echo still-me"), &[]).await.collect().await;
    assert_eq!((out.as_str(), &end["exitCode"]), ("still-me\n", &json!(0)));
}

/// Sandbox root may rewrite the token file the agent booted with; a restarted server
/// keeps the token the first one read at boot.
#[tokio::test]
async fn a_token_planted_in_the_token_file_is_not_taken_by_a_restarted_server() {
    let mut a = Agent::start_with(Some("boot-token")).await;
    std::fs::write(a.dir.path().join("token"), "planted").unwrap();
    kill_server(&a).await;
    a.token = Some("planted".into());
    assert_eq!(a.unary("/process.Process/List", json!({})).await.0, 401);
    a.token = Some("boot-token".into());
    assert_eq!(a.unary("/process.Process/List", json!({})).await.0, 200);
}

#[tokio::test]
async fn sighup_restarts_the_server_and_sigterm_still_ends_everything() {
    let mut a = Agent::start().await;
    let mut s = a
        .stream(
            START,
            sh("trap 'echo bye; exit 0' TERM; while :; do sleep 0.05; done"),
            &[],
        )
        .await;
    let pid = s.event().await["start"]["pid"].as_u64().unwrap();
    let old = a.server_pid().await;
    unsafe { libc::kill(a.pid() as i32, libc::SIGHUP) };
    let deadline = Instant::now() + Duration::from_secs(10);
    while a.server_pid().await == old {
        assert!(Instant::now() < deadline, "SIGHUP did not restart the server");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(s);
    let mut c = connect(&a, pid).await;
    c.event().await;
    // The process is the supervisor's child now; SIGTERM to the agent reaches it.
    unsafe { libc::kill(a.pid() as i32, libc::SIGTERM) };
    let (out, _, _, end) = c.collect().await;
    assert_eq!(out, "bye\n");
    assert_eq!(end["exitCode"], json!(0));
    let deadline = Instant::now() + Duration::from_secs(10);
    while a.child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "agent did not exit");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_rekeyed_token_replaces_the_old_one_and_survives_a_server_restart() {
    let mut a = Agent::start_with(Some("parent-token")).await;
    let rekey = |token: &str| bytes::Bytes::from(json!({"access_token": token}).to_string());
    // Only a caller that knows the current token may replace it.
    a.token = Some("guess".into());
    let (status, _, _) = a.raw("POST", "/.opendsec/rekey", &[], rekey("mine")).await.unwrap();
    assert_eq!(status, 401);
    a.token = Some("parent-token".into());
    for bad in [
        json!({"access_token": ""}),
        json!({"token": "x"}),
        json!({"access_token": "has space"}),
    ] {
        let (status, _, body) = a
            .raw("POST", "/.opendsec/rekey", &[], bytes::Bytes::from(bad.to_string()))
            .await
            .unwrap();
        assert_eq!(status, 400, "{}", String::from_utf8_lossy(&body));
    }
    let (status, _, _) = a
        .raw("POST", "/.opendsec/rekey", &[], rekey("copy-token"))
        .await
        .unwrap();
    assert_eq!(status, 204);
    // The old token is refused from now on, the new one works, and asking again with
    // the new token changes nothing.
    let (status, _) = a.unary("/filesystem.Filesystem/Stat", json!({"path": "/"})).await;
    assert_eq!(status, 401);
    a.token = Some("copy-token".into());
    let (status, _, _) = a
        .raw("POST", "/.opendsec/rekey", &[], rekey("copy-token"))
        .await
        .unwrap();
    assert_eq!(status, 204);
    let (status, _) = a.unary("/filesystem.Filesystem/Stat", json!({"path": "/"})).await;
    assert_eq!(status, 200);
    // A new server (the old one crashed) keeps the new token, not the file's.
    kill_server(&a).await;
    let (status, _) = a.unary("/filesystem.Filesystem/Stat", json!({"path": "/"})).await;
    assert_eq!(status, 200, "{}", a.stderr());
    a.token = Some("parent-token".into());
    let (status, _) = a.unary("/filesystem.Filesystem/Stat", json!({"path": "/"})).await;
    assert_eq!(status, 401);
}

#[tokio::test]
async fn a_refused_caller_gets_its_401_even_while_it_still_sends_a_body() {
    let mut a = Agent::start_with(Some("the-token")).await;
    a.token = Some("guess".into());
    // More than the socket buffers hold: the agent answers before it has the body.
    let body = bytes::Bytes::from(vec![b'x'; 512 << 10]);
    for round in 0..20 {
        let answer = a.raw("POST", "/process.Process/Start", &[], body.clone()).await;
        let (status, _, _) = answer.unwrap_or_else(|e| panic!("round {round}: no answer: {e}"));
        assert_eq!(status, 401, "round {round}");
    }
}
