//! `ANY /v1/sandboxes/{id}/agent/{*path}` through the whole path: the gateway (a real
//! single control node), a real edge proxy (`opendsec_edge::proxy::serve`) on a
//! loopback port, and a real `opendsec-agent` process on a Unix socket.
//!
//! The agent binary must be built first (`cargo build --workspace`).

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use opendsec_control::testing::{TestNode, single_node};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use tower::ServiceExt;

struct Env {
    app: Router,
    t: TestNode,
    sockets: Arc<Mutex<HashMap<String, PathBuf>>>,
    agent_socket: PathBuf,
    edge_addr: String,
    dir: tempfile::TempDir,
    _agent: tokio::process::Child,
}

use opendsec_edge::testing::start_agent;

impl Env {
    async fn new() -> Env {
        let t = single_node().await;
        let dir = tempfile::tempdir().unwrap();
        let agent_socket = dir.path().join("agent.sock");
        let agent = start_agent(&agent_socket).await;
        let sockets: Arc<Mutex<HashMap<String, PathBuf>>> = Arc::default();
        let map = sockets.clone();
        let resolver: opendsec_edge::proxy::Resolver =
            Arc::new(move |id: &str| map.lock().unwrap().get(id).cloned().map(Into::into));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let edge_addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(opendsec_edge::proxy::serve(
            listener,
            // Edge edge-a's certificate from the node's CA (the gateway checks it).
            t.peer_trust(opendsec_trust::Identity::edge("edge-a")),
            // The edge holds its own key, as every edge does (never the cluster key).
            opendsec_control::edge_key(&t.node.config().cluster_key, "edge-a"),
            resolver,
        ));
        let app = opendsec_gateway::router(t.node.clone());
        let env = Env {
            app,
            t,
            sockets,
            agent_socket,
            edge_addr,
            dir,
            _agent: agent,
        };
        env.register_edge(&env.edge_addr.clone()).await;
        env
    }

    async fn register_edge(&self, address: &str) {
        let body = json!({"edge": "edge-a", "address": address, "capacity": {"sandboxes": 10, "cpu_millis": 64000, "memory_mb": 65536}, "labels": {}});
        let (s, b) = self
            .json("POST", "/v1/edges", Some(&self.t.admin_token.clone()), Some(body))
            .await;
        assert_eq!(s, 200, "{b}");
    }

    /// Creates a sandbox in the admin's project whose agent is at `socket`.
    async fn sandbox(&self, socket: &Path) -> String {
        let (s, b) = self
            .json(
                "POST",
                "/v1/sandboxes",
                Some(&self.t.admin_token.clone()),
                Some(json!({"image": "base"})),
            )
            .await;
        assert_eq!(s, 201, "{b}");
        let id = b["sandbox"]["id"].as_str().unwrap().to_string();
        self.sockets.lock().unwrap().insert(id.clone(), socket.to_path_buf());
        // Its edge reports it running (a call to a sandbox still starting waits for that).
        opendsec_control::testing::report_ready(&self.t.node, &id).await;
        id
    }

    async fn send(&self, req: Request<Body>) -> (StatusCode, axum::http::HeaderMap, Vec<u8>) {
        let resp = self.app.clone().oneshot(req).await.unwrap();
        let (status, headers) = (resp.status(), resp.headers().clone());
        (
            status,
            headers,
            resp.into_body().collect().await.unwrap().to_bytes().to_vec(),
        )
    }

    async fn json(&self, method: &str, path: &str, token: Option<&str>, body: Option<Value>) -> (u16, Value) {
        let mut req = Request::builder().method(method).uri(path);
        if let Some(t) = token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        let body = match body {
            Some(b) => {
                req = req.header("content-type", "application/json");
                Body::from(b.to_string())
            }
            None => Body::empty(),
        };
        let (s, _, bytes) = self.send(req.body(body).unwrap()).await;
        (s.as_u16(), serde_json::from_slice(&bytes).unwrap_or(Value::Null))
    }

    /// Runs `cmd args` through process.Process/Start; returns (status, stdout, stderr, exit code).
    async fn exec(
        &self,
        id: &str,
        token: Option<&str>,
        user: Option<&str>,
        cmd: &str,
        args: &[&str],
    ) -> (u16, String, String, Option<i64>, Value) {
        let msg = json!({"process": {"cmd": cmd, "args": args, "envs": {}}, "stdin": false}).to_string();
        let mut frame = vec![0u8];
        frame.extend_from_slice(&(msg.len() as u32).to_be_bytes());
        frame.extend_from_slice(msg.as_bytes());
        let mut req = Request::builder()
            .method("POST")
            .uri(format!("/v1/sandboxes/{id}/agent/process.Process/Start"))
            .header("content-type", "application/connect+json")
            .header("connect-protocol-version", "1");
        if let Some(t) = token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        if let Some(u) = user {
            req = req.header("x-opendsec-user", u);
        }
        let (status, _, body) = self.send(req.body(Body::from(frame)).unwrap()).await;
        if status != StatusCode::OK {
            return (
                status.as_u16(),
                String::new(),
                String::new(),
                None,
                serde_json::from_slice(&body).unwrap_or(Value::Null),
            );
        }
        let (mut out, mut err, mut code, mut end) = (Vec::new(), Vec::new(), None, Value::Null);
        let mut rest = &body[..];
        while rest.len() >= 5 {
            let (flags, len) = (rest[0], u32::from_be_bytes(rest[1..5].try_into().unwrap()) as usize);
            let v: Value = serde_json::from_slice(&rest[5..5 + len]).unwrap();
            rest = &rest[5 + len..];
            if flags & 2 != 0 {
                end = v;
                continue;
            }
            let ev = &v["event"];
            let b64 = |s: &Value| base64_decode(s.as_str().unwrap_or(""));
            if ev["data"]["stdout"].is_string() {
                out.extend(b64(&ev["data"]["stdout"]));
            }
            if ev["data"]["stderr"].is_string() {
                err.extend(b64(&ev["data"]["stderr"]));
            }
            if ev["end"].is_object() {
                code = Some(ev["end"]["exitCode"].as_i64().unwrap_or(0));
            }
        }
        (
            200,
            String::from_utf8_lossy(&out).into(),
            String::from_utf8_lossy(&err).into(),
            code,
            end,
        )
    }
}

fn base64_decode(s: &str) -> Vec<u8> {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.decode(s).expect("base64")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_runs_through_gateway_edge_and_agent() {
    let env = Env::new().await;
    let id = env.sandbox(&env.agent_socket).await;
    let admin = env.t.admin_token.clone();
    let (status, out, err, code, end) = env
        .exec(
            &id,
            Some(&admin),
            None,
            "/bin/sh",
            &["-c", "echo hello; echo oops >&2; exit 3"],
        )
        .await;
    assert_eq!(status, 200, "{end}");
    assert_eq!(out, "hello\n");
    assert_eq!(err, "oops\n");
    assert_eq!(code, Some(3));
    assert_eq!(end, json!({}), "the stream ends cleanly");

    // X-Opendsec-User picks the user (the agent runs as root and switches).
    let (_, out, _, code, _) = env
        .exec(&id, Some(&admin), Some("nobody"), "/bin/sh", &["-c", "id -un"])
        .await;
    assert_eq!((out.trim(), code), ("nobody", Some(0)));

    // Files round-trip through /files (GET and POST, with the query string forwarded).
    let path = env.dir.path().join("up.txt");
    let uri = format!("/v1/sandboxes/{id}/agent/files?path={}", path.display());
    let req = Request::builder()
        .method("POST")
        .uri(&uri)
        .header("authorization", format!("Bearer {admin}"))
        .header("content-type", "application/octet-stream");
    let (s, _, b) = env.send(req.body(Body::from("payload")).unwrap()).await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "payload");
    let req = Request::builder()
        .uri(&uri)
        .header("authorization", format!("Bearer {admin}"));
    let (s, _, b) = env.send(req.body(Body::empty()).unwrap()).await;
    assert_eq!((s.as_u16(), b.as_slice()), (200, &b"payload"[..]));

    // The agent's own errors pass through as they are.
    let req = Request::builder()
        .uri(format!("/v1/sandboxes/{id}/agent/files?path=/nonexistent/x"))
        .header("authorization", format!("Bearer {admin}"));
    let (s, _, _) = env.send(req.body(Body::empty()).unwrap()).await;
    assert_eq!(s, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_route_authenticates_scopes_and_checks_the_sandbox() {
    let env = Env::new().await;
    let id = env.sandbox(&env.agent_socket).await;
    let admin = env.t.admin_token.clone();

    // No token, a forged token.
    let (s, _, _, _, b) = env.exec(&id, None, None, "/bin/true", &[]).await;
    assert_eq!((s, b["code"].as_str()), (401, Some("unauthenticated")));
    let (s, _, _, _, _) = env
        .exec(&id, Some("odsec_0123456789abcdef.nope"), None, "/bin/true", &[])
        .await;
    assert_eq!(s, 401);

    // A token of another project (a child of root: it does not see root's sandboxes).
    let (s, p) = env
        .json("POST", "/v1/projects", Some(&admin), Some(json!({"name": "other"})))
        .await;
    assert_eq!(s, 201, "{p}");
    let project = p["project"]["id"].as_str().unwrap();
    let (s, t) = env
        .json(
            "POST",
            "/v1/tokens",
            Some(&admin),
            Some(json!({"project": project, "name": "w", "rights": ["sandbox:read", "sandbox:write"]})),
        )
        .await;
    assert_eq!(s, 201, "{t}");
    let other = t["token"].as_str().unwrap().to_string();
    let (s, _, _, _, b) = env.exec(&id, Some(&other), None, "/bin/true", &[]).await;
    assert_eq!((s, b["code"].as_str()), (403, Some("forbidden")), "{b}");

    // A token without sandbox:write.
    let (_, t) = env
        .json(
            "POST",
            "/v1/tokens",
            Some(&admin),
            Some(json!({"name": "r", "rights": ["sandbox:read"]})),
        )
        .await;
    let reader = t["token"].as_str().unwrap().to_string();
    let (s, _, _, _, b) = env.exec(&id, Some(&reader), None, "/bin/true", &[]).await;
    assert_eq!(s, 403, "{b}");

    // An unknown sandbox.
    let (s, _, _, _, b) = env
        .exec("00000000000000000000", Some(&admin), None, "/bin/true", &[])
        .await;
    assert_eq!((s, b["code"].as_str()), (404, Some("not_found")), "{b}");

    // The edge is unreachable: 502.
    let dead = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dead_addr = dead.local_addr().unwrap().to_string();
    drop(dead);
    env.register_edge(&dead_addr).await;
    let (s, _, _, _, b) = env.exec(&id, Some(&admin), None, "/bin/true", &[]).await;
    assert_eq!((s, b["code"].as_str()), (502, Some("edge_unreachable")), "{b}");
    env.register_edge(&env.edge_addr.clone()).await;
    let (s, _, _, code, _) = env.exec(&id, Some(&admin), None, "/bin/true", &[]).await;
    assert_eq!((s, code), (200, Some(0)));

    // An ended sandbox: 409.
    let (s, b) = env
        .json("DELETE", &format!("/v1/sandboxes/{id}"), Some(&admin), None)
        .await;
    assert_eq!(s, 200, "{b}");
    let (s, _, _, _, b) = env.exec(&id, Some(&admin), None, "/bin/true", &[]).await;
    assert_eq!((s, b["code"].as_str()), (409, Some("conflict")), "{b}");
}

/// A fake agent that records the head of each request it gets and answers 204.
async fn recording_agent(socket: PathBuf) -> Arc<Mutex<Vec<String>>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let heads: Arc<Mutex<Vec<String>>> = Arc::default();
    let listener = tokio::net::UnixListener::bind(&socket).unwrap();
    let h = heads.clone();
    tokio::spawn(async move {
        loop {
            let (mut s, _) = listener.accept().await.unwrap();
            let h = h.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                h.lock().unwrap().push(String::from_utf8_lossy(&buf).to_lowercase());
                let _ = s.write_all(b"HTTP/1.1 204 No Content\r\nx-agent: fake\r\n\r\n").await;
            });
        }
    });
    heads
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bearer_token_never_reaches_the_agent() {
    let env = Env::new().await;
    let socket = env.dir.path().join("recorder.sock");
    let heads = recording_agent(socket.clone()).await;
    let id = env.sandbox(&socket).await;
    let admin = env.t.admin_token.clone();
    let secret = admin.split('.').nth(1).unwrap().to_lowercase();

    let req = Request::builder()
        .uri(format!("/v1/sandboxes/{id}/agent/health?x=1"))
        .header("authorization", format!("Bearer {admin}"))
        .header("x-opendsec-edge-key", "forged")
        .header("x-opendsec-user", "root");
    let (s, h, _) = env.send(req.body(Body::empty()).unwrap()).await;
    assert_eq!(s, 204);
    assert_eq!(h["x-agent"], "fake", "the agent's headers come back");
    let req = Request::builder()
        .uri(format!("/v1/sandboxes/{id}/agent/health"))
        .header("authorization", format!("Bearer {admin}"));
    let (s, _, _) = env.send(req.body(Body::empty()).unwrap()).await;
    assert_eq!(s, 204);

    let heads = heads.lock().unwrap().clone();
    assert_eq!(heads.len(), 2);
    assert!(heads[0].starts_with("get /health?x=1 http/1.1\r\n"), "{}", heads[0]);
    for head in &heads {
        assert!(
            !head.contains(&secret) && !head.contains("bearer") && !head.contains("odsec_"),
            "the token leaked: {head}"
        );
        assert!(
            !head.contains("x-opendsec-edge-key"),
            "the edge removes its key: {head}"
        );
        assert!(!head.contains("x-opendsec-user"), "{head}");
    }
    // X-Opendsec-User: root becomes Basic base64("root:").
    assert!(heads[0].contains("authorization: basic cm9vddo=\r\n"), "{}", heads[0]);
    assert!(
        !heads[1].contains("authorization"),
        "no user, no Authorization: {}",
        heads[1]
    );
}
