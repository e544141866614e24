//! Specification: a write retried with its request id (`X-Request-Id`) is answered with
//! its first outcome and applied once; the same id on another write is another request.
//! Against a real `opendsec up`.
//!
//! Needs root, crun or runc and the static agent (`./ops/test.sh`).

#[path = "support/up.rs"]
mod up;

use reqwest::Method;
use serde_json::{Value, json};
use up::Up;

async fn post(up: &Up, path: &str, request_id: &str, body: Value) -> (u16, Value, String) {
    let r = reqwest::Client::new()
        .request(Method::POST, format!("http://{}{path}", up.http))
        .bearer_auth(&up.token)
        .header("x-request-id", request_id)
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let index = r
        .headers()
        .get("x-opendsec-index")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    (status, r.json().await.unwrap_or(Value::Null), index)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_retried_write_is_applied_once_and_answered_as_the_first_time() {
    let up = Up::start(None).await;
    let body = json!({"image": "busybox", "labels": {"job": "once"}});
    let (s1, v1, i1) = post(&up, "/v1/sandboxes", "retry-me-1", body.clone()).await;
    assert_eq!(s1, 201, "{v1}");
    let (s2, v2, i2) = post(&up, "/v1/sandboxes", "retry-me-1", body.clone()).await;
    assert_eq!(s2, 201, "{v2}");
    assert_eq!(
        v1["sandbox"]["id"], v2["sandbox"]["id"],
        "the retry names the first sandbox"
    );
    assert_eq!(i1, i2, "and the index of the first write");
    let (_, listed) = up.send(Method::GET, "/v1/sandboxes?label=job=once", None).await;
    assert_eq!(listed["sandboxes"].as_array().unwrap().len(), 1, "{listed}");
    // Answered from the log: the retry added nothing to it (a retry racing its first
    // attempt is logged and not applied: commands/tests/spec_races.rs).
    let (_, audit) = up.send(Method::GET, "/v1/audit?action=sandbox.create", None).await;
    let records: Vec<&Value> = audit["records"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["request_id"] == "retry-me-1")
        .collect();
    assert_eq!(records.len(), 1, "{audit}");

    // The same id on another write is a write of its own.
    let other = json!({"image": "busybox", "labels": {"job": "once"}, "memory_mb": 256});
    let (s3, v3, _) = post(&up, "/v1/sandboxes", "retry-me-1", other).await;
    assert_eq!(s3, 201, "{v3}");
    assert_ne!(v3["sandbox"]["id"], v1["sandbox"]["id"]);
}
