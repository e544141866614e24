//! The sandbox's configuration files: `--env-file`, `--start-file`, `--workdir-file` and
//! `--user-file` (a VM's: its guest's `init.sh` passes those its edge wrote).

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::*;
use serde_json::json;

const START: &str = "/process.Process/Start";

/// Starts the agent (listening in `dir`) with `flag file`, expecting it to stop at
/// once: its exit code and what it said.
fn stops_on(dir: &tempfile::TempDir, flag: &str, file: &std::path::Path) -> (Option<i32>, String) {
    let out = agent_command()
        .arg("--listen")
        .arg(format!("unix:{}", dir.path().join("a.sock").display()))
        .arg(flag)
        .arg(file)
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

async fn run(a: &Agent, msg: serde_json::Value) -> String {
    let mut s = a.stream(START, msg, &[]).await;
    s.event().await;
    s.collect().await.0
}

#[tokio::test]
async fn env_file_vars_reach_every_process_and_requests_override_them() {
    let dir = tempfile::tempdir().unwrap();
    let a = Agent::start_in(dir, None, &["--env-file", "{dir}/env.json"], |d| {
        std::fs::write(
            d.join("env.json"),
            r#"{"SANDBOX_A": "from env file", "SHARED": "sandbox", "HOME": "/sandbox-home"}"#,
        )
        .unwrap()
    })
    .await;
    // Sandbox vars come after the defaults (HOME here) and before the request's envs.
    let out = run(&a, sh("echo \"$SANDBOX_A|$SHARED|$HOME|$USER\"")).await;
    assert_eq!(out, "from env file|sandbox|/sandbox-home|root\n");
    let msg = json!({"process": {"cmd": "/bin/sh", "args": ["-c", "echo \"$SANDBOX_A|$SHARED\""],
        "envs": {"SHARED": "request"}}});
    assert_eq!(run(&a, msg).await, "from env file|request\n");
    // A PTY process gets them too.
    let mut s = a
        .stream(
            START,
            json!({"process": {"cmd": "/bin/sh", "args": ["-c", "echo pty:$SANDBOX_A"]},
                "pty": {"size": {"cols": 80, "rows": 24}}}),
            &[],
        )
        .await;
    s.event().await;
    assert!(s.collect().await.2.contains("pty:from env file"));
}

#[tokio::test]
async fn a_workdir_file_is_where_processes_naming_no_directory_start() {
    let dir = tempfile::tempdir().unwrap();
    let a = Agent::start_in(dir, None, &["--workdir-file", "{dir}/workdir"], |d| {
        std::fs::create_dir(d.join("app")).unwrap();
        std::fs::write(d.join("workdir"), format!("{}\n", d.join("app").display())).unwrap();
    })
    .await;
    let app = a.path("app");
    assert_eq!(run(&a, sh("pwd")).await, format!("{app}\n"));
    // A process naming its directory starts there.
    let msg = json!({"process": {"cmd": "/bin/sh", "args": ["-c", "pwd"], "cwd": "/"}});
    assert_eq!(run(&a, msg).await, "/\n");

    // Not one absolute path: the agent stops and says so.
    let bad = tempfile::tempdir().unwrap();
    for (name, text) in [("relative", "srv/app"), ("two", "/a\n/b"), ("missing", "")] {
        let f = bad.path().join(name);
        if !text.is_empty() {
            std::fs::write(&f, text).unwrap();
        }
        let (code, err) = stops_on(&bad, "--workdir-file", &f);
        assert_eq!(code, Some(2), "{name}: {err}");
        assert!(err.contains("--workdir-file"), "{name}: {err}");
    }
}

#[tokio::test]
async fn a_user_file_names_who_processes_naming_no_user_run_as_when_the_account_exists() {
    let user = test_user();
    let dir = tempfile::tempdir().unwrap();
    let a = Agent::start_in(dir, None, &["--user-file", "{dir}/user"], |d| {
        std::fs::write(d.join("user"), format!("{user}\n")).unwrap()
    })
    .await;
    assert_eq!(run(&a, sh("id -un")).await, format!("{user}\n"));

    // An image User the sandbox has no account for: processes run as the default user
    // (root in these tests) and the agent says why.
    let dir = tempfile::tempdir().unwrap();
    let a = Agent::start_in(dir, None, &["--user-file", "{dir}/user"], |d| {
        std::fs::write(d.join("user"), "no-such-account").unwrap()
    })
    .await;
    assert_eq!(run(&a, sh("id -un")).await, "root\n");
    assert!(a.stderr().contains("no-such-account"), "{}", a.stderr());

    // Not an account name: refused at start.
    let bad = tempfile::tempdir().unwrap();
    let f = bad.path().join("user");
    std::fs::write(&f, "1000:1000").unwrap();
    let (code, err) = stops_on(&bad, "--user-file", &f);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--user-file"), "{err}");
}

#[tokio::test]
async fn bad_env_file_stops_the_agent_with_a_message() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("missing.json", None, "reading"),
        ("list.json", Some(r#"["A=1"]"#), "is not a JSON object of string values"),
        (
            "number.json",
            Some(r#"{"A": 1}"#),
            "is not a JSON object of string values",
        ),
        (
            "name.json",
            Some(r#"{"A=B": "1"}"#),
            "is not a valid environment variable name",
        ),
    ];
    for (name, text, expect) in cases {
        let f = dir.path().join(name);
        if let Some(t) = text {
            std::fs::write(&f, t).unwrap();
        }
        let (code, err) = stops_on(&dir, "--env-file", &f);
        assert_eq!(code, Some(2), "{name}: {err}");
        assert!(err.contains("--env-file") && err.contains(expect), "{name}: {err}");
        assert!(!dir.path().join("a.sock").exists(), "{name}: it must not serve");
    }
}

async fn health(a: &Agent) -> (u16, serde_json::Value) {
    let (st, _, b) = a.raw("GET", "/health", &[], bytes::Bytes::new()).await.unwrap();
    let v = if b.is_empty() {
        json!(null)
    } else {
        serde_json::from_slice(&b).unwrap()
    };
    (st, v)
}

/// Polls `/health` until it answers `status`, within 10 s.
async fn health_becomes(a: &Agent, status: u16) -> serde_json::Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (st, v) = health(a).await;
        if st == status {
            return v;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "health stayed {st} {v}, wanted {status}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn start_agent(start_json: serde_json::Value) -> Agent {
    let dir = tempfile::tempdir().unwrap();
    Agent::start_in(
        dir,
        None,
        &["--env-file", "{dir}/env.json", "--start-file", "{dir}/start.json"],
        |d| {
            std::fs::write(d.join("env.json"), r#"{"FROM_ENV_FILE": "yes"}"#).unwrap();
            std::fs::write(d.join("start.json"), start_json.to_string()).unwrap();
        },
    )
    .await
}

#[tokio::test]
async fn start_command_is_a_managed_process_tagged_start() {
    let a = start_agent(json!({
        "cmd": "/bin/sh",
        "args": ["-c", "echo \"started $FROM_ENV_FILE $OWN $(pwd)\"; exec sleep 30"],
        "envs": {"OWN": "own-var"},
        "cwd": "/tmp",
        "user": "root",
    }))
    .await;
    // No ready_port: healthy at once.
    assert_eq!(health(&a).await.0, 204);
    let (_, v) = a.unary("/process.Process/List", json!({})).await;
    let procs = v["processes"].as_array().unwrap();
    let p = procs
        .iter()
        .find(|p| p["tag"] == "start")
        .unwrap_or_else(|| panic!("no start process in {v}"));
    assert_eq!(p["config"]["cmd"], "/bin/sh");
    // Its output waited in its backlog; Connect by tag gets it.
    let mut s = a
        .stream("/process.Process/Connect", json!({"process": {"tag": "start"}}), &[])
        .await;
    assert_eq!(s.event().await["start"]["pid"], p["pid"]);
    let data = s.event().await;
    let out = unb64(data["data"]["stdout"].as_str().unwrap());
    assert_eq!(String::from_utf8_lossy(&out), "started yes own-var /tmp\n");
    a.unary(
        "/process.Process/SendSignal",
        json!({"process": {"tag": "start"}, "signal": "SIGNAL_SIGKILL"}),
    )
    .await;
    let (_, _, _, end) = s.collect().await;
    assert_eq!(end["status"], "signal: killed");
}

#[tokio::test]
async fn health_is_503_until_the_ready_port_accepts() {
    let port = free_port();
    let a = start_agent(json!({"cmd": "/bin/sleep", "args": ["30"], "ready_port": port})).await;
    let (st, v) = health(&a).await;
    assert_eq!(st, 503);
    assert_eq!(
        v,
        json!({"code": 503, "message": format!("starting: waiting for port {port}")})
    );
    // Other endpoints already answer.
    let (st, _) = a.unary("/process.Process/List", json!({})).await;
    assert_eq!(st, 200);
    let l = tokio::net::TcpListener::bind(("127.0.0.1", port)).await.unwrap();
    assert_eq!(health_becomes(&a, 204).await, json!(null));
    // Once ready, ready for good: the port closing later changes nothing.
    drop(l);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(health(&a).await.0, 204);
}

#[tokio::test]
async fn health_is_503_until_the_ready_command_exits_0() {
    let flag = tempfile::tempdir().unwrap();
    let ready = flag.path().join("ready");
    let a = start_agent(json!({
        "cmd": "/bin/sleep", "args": ["30"], "user": "root",
        "ready_cmd": format!("[ -f {} ]", ready.display()),
    }))
    .await;
    let (st, v) = health(&a).await;
    assert_eq!(st, 503);
    assert!(v["message"].as_str().unwrap().contains("ready command"), "{v}");
    // It is run again and again until it succeeds.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(health(&a).await.0, 503);
    std::fs::write(&ready, "").unwrap();
    assert_eq!(health_becomes(&a, 204).await, json!(null));
    // Once ready, ready for good.
    std::fs::remove_file(&ready).unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(health(&a).await.0, 204);
}

#[tokio::test]
async fn start_command_that_ends_before_its_ready_command_succeeds_fails_health() {
    let a = start_agent(json!({
        "cmd": "/bin/sh", "args": ["-c", "sleep 1; exit 3"], "user": "root", "ready_cmd": "false",
    }))
    .await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let v = health(&a).await.1;
        let msg = v["message"].as_str().unwrap_or_default().to_string();
        if msg.contains("exit code 3") {
            assert!(msg.contains("ready command"), "{msg}");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{v}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn start_command_that_ends_before_ready_fails_health_with_its_exit_code() {
    let port = free_port();
    let a = start_agent(json!({
        "cmd": "/bin/sh", "args": ["-c", "echo boom >&2; exit 7"], "ready_port": port
    }))
    .await;
    let v = health_becomes(&a, 503).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut v = v;
    while !v["message"].as_str().unwrap().contains("exit code") {
        assert!(std::time::Instant::now() < deadline, "{v}");
        tokio::time::sleep(Duration::from_millis(20)).await;
        v = health(&a).await.1;
    }
    let msg = v["message"].as_str().unwrap();
    assert!(msg.contains("exit code 7"), "{msg}");
    assert!(msg.contains(&format!("port {port}")), "{msg}");
    assert!(a.stderr().contains(msg), "agent log: {}", a.stderr());
}

#[tokio::test]
async fn start_command_that_cannot_start_fails_health() {
    let a = start_agent(json!({"cmd": "/nonexistent/server", "ready_port": 1234})).await;
    let (st, v) = health(&a).await;
    assert_eq!(st, 503);
    let msg = v["message"].as_str().unwrap();
    assert!(msg.contains("'/nonexistent/server' could not start"), "{msg}");
    assert!(a.stderr().contains(msg));
}

#[tokio::test]
async fn bad_start_file_stops_the_agent_with_a_message() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("start.json");
    std::fs::write(&f, r#"{"cmd": "/bin/true", "ready_port": "soon"}"#).unwrap();
    let (code, err) = stops_on(&dir, "--start-file", &f);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--start-file") && err.contains("start.json"), "{err}");
}
