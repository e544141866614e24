//! The sandbox's configuration files: `--env-file` and `--start-file`.

mod common;

use std::process::Stdio;

use common::*;
use serde_json::json;

const START: &str = "/process.Process/Start";

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
async fn bad_env_file_stops_the_agent_with_a_message() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("missing.json", None, "reading"),
        (
            "list.json",
            Some(r#"["A=1"]"#),
            "is not a JSON object of string values",
        ),
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
        let out = agent_command()
            .arg("--listen")
            .arg(format!("unix:{}", dir.path().join("a.sock").display()))
            .arg("--env-file")
            .arg(&f)
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{name}: {err}");
        assert!(
            err.contains("--env-file") && err.contains(expect),
            "{name}: {err}"
        );
        assert!(
            !dir.path().join("a.sock").exists(),
            "{name}: it must not serve"
        );
    }
}
