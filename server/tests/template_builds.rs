//! Specification: a template build whose node stops mid-build does not hang its
//! caller: once the node is back, the build ends failed, saying why, and its sandbox is
//! killed (E2B's SDK polls a build until it ends, with no timeout of its own).
//!
//! Needs root, crun or runc, the static agent and the `base` image (`./ops/test.sh`).

#[path = "support/up.rs"]
mod up;

use reqwest::Method;
use serde_json::{Value, json};
use std::time::{Duration, Instant};
use up::Up;

async fn wait_for(up: &Up, path: &str, what: &str, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let (s, v) = up.send(Method::GET, path, None).await;
        if s == 200 && done(&v) {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not within 120 s: {s} {v}\n{}",
            up.log_tail(40)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_build_cut_off_by_a_restart_ends_failed_and_its_sandbox_is_killed() {
    let mut up = Up::start(None).await;
    up.ensure_image("base", Duration::from_secs(30 * 60)).await;
    let (s, v) = up
        .send(Method::POST, "/v3/templates", Some(json!({"name": "slow-env"})))
        .await;
    assert_eq!(s, 202, "{v}");
    let (t, b) = (v["templateID"].as_str().unwrap(), v["buildID"].as_str().unwrap());
    let steps = json!({"fromTemplate": "base", "steps": [
        {"type": "RUN", "args": ["echo started; sleep 600"], "force": false},
    ]});
    let (s, v) = up
        .send(Method::POST, &format!("/v2/templates/{t}/builds/{b}"), Some(steps))
        .await;
    assert_eq!(s, 202, "{v}");
    let status = format!("/templates/{t}/builds/{b}/status");
    wait_for(&up, &status, "the step runs", |v| {
        v["logEntries"]
            .as_array()
            .is_some_and(|l| l.iter().any(|e| e["message"] == "started"))
    })
    .await;
    let (_, listed) = up.send(Method::GET, "/v1/sandboxes", None).await;
    let sandbox = listed["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["labels"]["opendsec.io/template-build"] == b)
        .unwrap_or_else(|| panic!("no sandbox of the build in {listed}"))["id"]
        .as_str()
        .unwrap()
        .to_string();

    up.kill9();
    up.restart().await;
    let v = wait_for(&up, &status, "the build ends", |v| v["status"] != "building").await;
    assert_eq!(v["status"], "error", "{v}");
    assert_eq!(v["reason"]["step"], "finalize", "{v}");
    let message = v["reason"]["message"].as_str().unwrap();
    assert!(
        message.contains("interrupted") && message.contains("build it again"),
        "{message}"
    );
    wait_for(
        &up,
        &format!("/v1/sandboxes/{sandbox}"),
        "the build's sandbox is killed",
        |v| v["state"] != "running",
    )
    .await;
}
