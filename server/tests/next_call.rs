//! Specification: the next call to a paused sandbox resumes it (the seed's promise), a
//! sandbox created not to stays paused and the call says how to resume it, and a call
//! to a sandbox still starting waits for it. Through the REST agent route, as
//! `opendsecctl sandbox exec` calls it, against a real `opendsec up`.
//!
//! Needs root, crun or runc, the static agent and the `busybox` image (`./ops/test.sh`).

#[path = "support/up.rs"]
mod up;

use reqwest::Method;
use serde_json::{Value, json};
use std::time::{Duration, Instant};
use up::Up;

async fn state_becomes(up: &Up, id: &str, want: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (_, v) = up.send(Method::GET, &format!("/v1/sandboxes/{id}"), None).await;
        if v["state"] == want {
            return v;
        }
        assert!(Instant::now() < deadline, "sandbox {id} is not {want}: {v}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn create(up: &Up, body: Value) -> String {
    let (s, v) = up.send(Method::POST, "/v1/sandboxes", Some(body)).await;
    assert_eq!(s, 201, "{v}");
    v["sandbox"]["id"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_call_to_a_paused_sandbox_resumes_it_by_default_and_one_still_starting_is_waited_for() {
    let up = Up::start(None).await;
    up.ensure_image("busybox", Duration::from_secs(300)).await;
    // Called at once after the create: the call waits for the start.
    let id = create(&up, json!({"image": "busybox"})).await;
    let (out, code) = up
        .exec(&id, "sh", &["-c", "echo 1 > /tmp/counter; cat /tmp/counter"])
        .await
        .unwrap();
    assert_eq!((out.trim(), code), ("1", 0));
    let (_, v) = up.send(Method::GET, &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(v["auto_resume"], true, "the default: {v}");

    let (s, v) = up.send(Method::POST, &format!("/v1/sandboxes/{id}/pause"), None).await;
    assert_eq!(s, 200, "{v}");
    state_becomes(&up, &id, "paused").await;
    // The next call resumes it, and its processes' state is where it was.
    let (out, code) = up.exec(&id, "cat", &["/tmp/counter"]).await.unwrap();
    assert_eq!((out.trim(), code), ("1", 0));
    state_becomes(&up, &id, "running").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sandbox_created_without_auto_resume_stays_paused_and_the_call_says_how_to_resume_it() {
    let up = Up::start(None).await;
    up.ensure_image("busybox", Duration::from_secs(300)).await;
    let id = create(&up, json!({"image": "busybox", "auto_resume": false})).await;
    state_becomes(&up, &id, "running").await;
    let (s, v) = up.send(Method::POST, &format!("/v1/sandboxes/{id}/pause"), None).await;
    assert_eq!(s, 200, "{v}");
    state_becomes(&up, &id, "paused").await;
    let (s, v) = up
        .send(
            Method::POST,
            &format!("/v1/sandboxes/{id}/agent/process.Process/List"),
            Some(json!({})),
        )
        .await;
    assert_eq!(s, 409, "{v}");
    let message = v["message"].as_str().unwrap();
    assert!(
        message.contains(&format!("opendsecctl sandbox resume {id}")),
        "{message}"
    );
    state_becomes(&up, &id, "paused").await;
    let (s, v) = up.send(Method::POST, &format!("/v1/sandboxes/{id}/resume"), None).await;
    assert_eq!(s, 200, "{v}");
    state_becomes(&up, &id, "running").await;
    let (out, code) = up.exec(&id, "echo", &["back"]).await.unwrap();
    assert_eq!((out.trim(), code), ("back", 0));
}

#[tokio::test(flavor = "multi_thread")]
async fn only_a_caller_holding_its_tokens_wakes_a_paused_sandbox_through_e2b_traffic() {
    let up = Up::start(None).await;
    up.ensure_image("busybox", Duration::from_secs(300)).await;
    let id = create(&up, json!({"image": "busybox"})).await;
    state_becomes(&up, &id, "running").await;
    let (s, v) = up.send(Method::POST, &format!("/v1/sandboxes/{id}/pause"), None).await;
    assert_eq!(s, 200, "{v}");
    state_becomes(&up, &id, "paused").await;
    let knock = |port: &str, token: Option<String>| {
        let mut r = reqwest::Client::new()
            .get(format!("http://{}/health", up.http))
            .header("E2b-Sandbox-Id", &id)
            .header("E2b-Sandbox-Port", port);
        if let Some(t) = token {
            r = r.header("X-Access-Token", t);
        }
        r.send()
    };
    // No token, a wrong one, or a public port: the sandbox stays paused.
    for (port, token) in [("49983", None), ("8080", None), ("49983", Some("wrong".to_string()))] {
        let r = knock(port, token.clone()).await.unwrap();
        assert!(
            matches!(r.status().as_u16(), 401 | 502),
            "{port} {token:?}: {}",
            r.status()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (_, v) = up.send(Method::GET, &format!("/v1/sandboxes/{id}"), None).await;
        assert_eq!(v["state"], "paused", "{port} {token:?} woke it: {v}");
    }
    // Its access token wakes it.
    let token = opendsec_control::sandbox_token(&up.edge_key(), opendsec_control::SandboxTokenKind::Agent, &id);
    let r = knock("49983", Some(token)).await.unwrap();
    assert_eq!(r.status().as_u16(), 204, "{:?}", r.text().await);
    state_becomes(&up, &id, "running").await;
}

/// The edge says the same words twice (a second pause of one sandbox): each is taken,
/// none is mistaken for a retry of the first.
#[tokio::test(flavor = "multi_thread")]
async fn a_sandbox_paused_resumed_and_paused_again_is_paused() {
    let up = Up::start(None).await;
    up.ensure_image("busybox", Duration::from_secs(300)).await;
    let id = create(&up, json!({"image": "busybox", "auto_resume": false})).await;
    state_becomes(&up, &id, "running").await;
    for _ in 0..2 {
        let (s, v) = up.send(Method::POST, &format!("/v1/sandboxes/{id}/pause"), None).await;
        assert_eq!(s, 200, "{v}");
        state_becomes(&up, &id, "paused").await;
        let (s, v) = up.send(Method::POST, &format!("/v1/sandboxes/{id}/resume"), None).await;
        assert_eq!(s, 200, "{v}");
        state_becomes(&up, &id, "running").await;
    }
}
