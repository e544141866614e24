//! The claim (`POST /.opendsec/claim`): a warm container started ahead of its sandbox
//! (`"warm": true` in the edge's configuration) becomes the sandbox in one request. Its
//! processes started from then on get the sandbox's variables, a start command that
//! reads its stdin (`claim_stdin`) gets them there, and the sandbox's token replaces the
//! warm one; a restarted server keeps all of it. A sandbox is claimed once.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::json;

const START: &str = "/process.Process/Start";
const CLAIM: &str = "/.opendsec/claim";

async fn output(a: &Agent, script: &str) -> String {
    let mut s = a.stream(START, sh(script), &[]).await;
    s.event().await;
    s.collect().await.0
}

fn body(v: serde_json::Value) -> bytes::Bytes {
    bytes::Bytes::from(v.to_string())
}

/// Waits until `path` exists and returns what it holds.
async fn file_appears(path: &std::path::Path) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(text) = std::fs::read_to_string(path)
            && text.ends_with('\n')
        {
            return text;
        }
        assert!(Instant::now() < deadline, "{} never appeared", path.display());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A start command that copies the line it reads on stdin to `<dir>/claimed`, then sleeps.
fn start_reading_stdin(dir: &std::path::Path) -> serde_json::Value {
    json!({
        "cmd": "/bin/sh",
        "args": ["-c", format!("read -r line; echo \"$line\" > {0}/claimed.tmp; mv {0}/claimed.tmp {0}/claimed; exec sleep 60", dir.display())],
        "user": "root",
        "claim_stdin": true,
    })
}

#[tokio::test]
async fn a_warm_agent_takes_its_sandboxs_token_and_variables_in_one_claim_once() {
    let shared = tempfile::tempdir().unwrap();
    let mut a = agent_configured(json!({
        "access_token": "warm-token",
        "env": {"IMAGE_VAR": "from-image"},
        "warm": true,
        "start": start_reading_stdin(shared.path()),
    }))
    .await;
    let claimed = shared.path().join("claimed");
    // Before the claim: the image's variables, and the start command still waits.
    assert_eq!(
        output(&a, "echo \"$IMAGE_VAR|${TASK-unset}\"").await,
        "from-image|unset\n"
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!claimed.exists(), "the start command reads nothing before the claim");

    // Only the warm token's holder may claim it; a bad body changes nothing.
    a.token = Some("guess".into());
    let good = json!({"access_token": "sandbox-token", "env": {"IMAGE_VAR": "from-image", "TASK": "t-7"}});
    let (status, _, _) = a.raw("POST", CLAIM, &[], body(good.clone())).await.unwrap();
    assert_eq!(status, 401);
    a.token = Some("warm-token".into());
    for (bad, names) in [
        (json!({"env": {}}), "access_token"),
        (json!({"access_token": "sandbox-token", "env": {"A": 1}}), "env"),
        (json!({"access_token": "sandbox-token", "env": {"A=B": "x"}}), "env"),
    ] {
        let (status, _, answer) = a.raw("POST", CLAIM, &[], body(bad.clone())).await.unwrap();
        let answer = String::from_utf8_lossy(&answer).into_owned();
        assert_eq!(status, 400, "{bad}: {answer}");
        assert!(answer.contains(names), "{bad}: {answer}");
    }
    assert_eq!(output(&a, "echo ${TASK-unset}").await, "unset\n");

    let (status, _, _) = a.raw("POST", CLAIM, &[], body(good.clone())).await.unwrap();
    assert_eq!(status, 204);
    // The warm token is refused from now on; the sandbox's works and its variables are in.
    let (status, _) = a.unary("/filesystem.Filesystem/Stat", json!({"path": "/"})).await;
    assert_eq!(status, 401);
    a.token = Some("sandbox-token".into());
    assert_eq!(output(&a, "echo \"$IMAGE_VAR|$TASK\"").await, "from-image|t-7\n");
    let told: serde_json::Value = serde_json::from_str(&file_appears(&claimed).await).unwrap();
    assert_eq!(told, json!({"env": {"IMAGE_VAR": "from-image", "TASK": "t-7"}}));

    // Claimed once: a second claim, even by the sandbox's own token, is refused.
    let again = json!({"access_token": "other", "env": {"TASK": "stolen"}});
    let (status, _, _) = a.raw("POST", CLAIM, &[], body(again.clone())).await.unwrap();
    assert_eq!(status, 409);
    // A new server (the old one crashed) keeps the sandbox's token and variables, and
    // the claim stays spent.
    kill_server(&a).await;
    assert_eq!(output(&a, "echo $TASK").await, "t-7\n");
    let (status, _, _) = a.raw("POST", CLAIM, &[], body(again)).await.unwrap();
    assert_eq!(status, 409);
    a.token = Some("warm-token".into());
    let (status, _) = a.unary("/filesystem.Filesystem/Stat", json!({"path": "/"})).await;
    assert_eq!(status, 401);
}

#[tokio::test]
async fn an_agent_that_was_not_warm_tells_its_start_command_at_boot_and_refuses_a_claim() {
    let shared = tempfile::tempdir().unwrap();
    let a = agent_configured(json!({
        "access_token": "own-token",
        "env": {"TASK": "t-1"},
        "start": start_reading_stdin(shared.path()),
    }))
    .await;
    let told: serde_json::Value = serde_json::from_str(&file_appears(&shared.path().join("claimed")).await).unwrap();
    assert_eq!(told, json!({"env": {"TASK": "t-1"}}));
    let claim = json!({"access_token": "other", "env": {"TASK": "stolen"}});
    let (status, _, answer) = a.raw("POST", CLAIM, &[], body(claim)).await.unwrap();
    assert_eq!(status, 409, "{}", String::from_utf8_lossy(&answer));
    assert_eq!(output(&a, "echo $TASK").await, "t-1\n");
}
