//! The REST API against a real single-node control plane (Raft + redb in a temp
//! dir), called in-process through the router. Each test reads as a specification.

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, Method, Request, StatusCode};
use expect_test::{Expect, expect};
use http_body_util::BodyExt;
use opendsec_control::testing::{TestNode, single_node};
use opendsec_gateway::{ROUTES, router};
use serde_json::{Value, json};
use tower::ServiceExt;

struct Api {
    app: Router,
    t: TestNode,
}

struct Resp {
    status: StatusCode,
    headers: HeaderMap,
    body: Value,
}

impl Resp {
    fn index_header(&self) -> Option<u64> {
        self.headers
            .get("x-opendsec-index")
            .map(|v| v.to_str().unwrap().parse().unwrap())
    }
}

impl Api {
    async fn new() -> Api {
        let t = single_node().await;
        Api {
            app: router(t.node.clone()),
            t,
        }
    }

    fn admin(&self) -> &str {
        &self.t.admin_token
    }

    fn root(&self) -> &str {
        &self.t.root_project
    }

    async fn raw(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Vec<u8>,
        headers: &[(&str, &str)],
    ) -> Resp {
        let mut req = Request::builder()
            .method(Method::from_bytes(method.as_bytes()).unwrap())
            .uri(path);
        if let Some(t) = token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        if !body.is_empty() {
            req = req.header("content-type", "application/json");
        }
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let resp = self
            .app
            .clone()
            .oneshot(req.body(Body::from(body)).unwrap())
            .await
            .unwrap();
        let status = resp.status();
        let headers = resp.headers().clone();
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).unwrap_or_else(|_| panic!("{method} {path}: body is not JSON: {bytes:?}"))
        };
        Resp { status, headers, body }
    }

    async fn call(&self, method: &str, path: &str, token: &str, body: Option<Value>) -> Resp {
        let bytes = body.map(|b| serde_json::to_vec(&b).unwrap()).unwrap_or_default();
        self.raw(method, path, Some(token), bytes, &[]).await
    }

    /// A call that must succeed with `status`; returns the body.
    async fn ok(&self, method: &str, path: &str, token: &str, body: Option<Value>, status: u16) -> Value {
        let r = self.call(method, path, token, body).await;
        assert_eq!(r.status.as_u16(), status, "{method} {path}: {}", r.body);
        r.body
    }

    async fn register_edge(&self, name: &str, sandboxes: u64) {
        let body = json!({"edge": name, "address": "127.0.0.1:7500", "capacity": {"sandboxes": sandboxes, "cpu_millis": 64000, "memory_mb": 65536}, "labels": {"zone": "a"}});
        self.ok("POST", "/v1/edges", self.admin(), Some(body), 200).await;
    }

    /// Issues a token in `project` with `rights`; returns (id, bearer).
    async fn token(&self, project: &str, rights: &[&str]) -> (String, String) {
        let b = self
            .ok(
                "POST",
                "/v1/tokens",
                self.admin(),
                Some(json!({"project": project, "name": "t", "rights": rights})),
                201,
            )
            .await;
        (
            b["id"].as_str().unwrap().to_string(),
            b["token"].as_str().unwrap().to_string(),
        )
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_endpoint_but_health_and_openapi_requires_a_valid_token() {
    let api = Api::new().await;
    for (method, path) in ROUTES {
        let path = path.replace("{id}", "x1").replace("{name}", "x1");
        let body = if matches!(*method, "post" | "put") {
            b"{}".to_vec()
        } else {
            vec![]
        };
        let m = method.to_uppercase();
        let public = path == "/health" || path == "/v1/openapi.json";
        let none = api.raw(&m, &path, None, body.clone(), &[]).await;
        let forged = api
            .raw(
                &m,
                &path,
                Some("odsec_0123456789abcdef.not-the-secret"),
                body.clone(),
                &[],
            )
            .await;
        let junk = api.raw(&m, &path, Some("hunter2"), body, &[]).await;
        if public {
            assert_eq!(none.status, StatusCode::OK, "{m} {path}");
            continue;
        }
        for r in [&none, &forged, &junk] {
            assert_eq!(r.status, StatusCode::UNAUTHORIZED, "{m} {path}: {}", r.body);
            assert_eq!(r.body["code"], "unauthenticated", "{m} {path}");
            assert_eq!(r.headers["www-authenticate"], "Bearer");
        }
    }
    let health = api.raw("GET", "/health", None, vec![], &[]).await;
    assert_eq!(health.body, json!({"status": "ok"}));
}

/// Sends a bad request as the admin and renders `status body` with the root id masked.
async fn check_bad(api: &Api, method: &str, path: &str, body: &[u8], expect: Expect) {
    let path = path.replace("{root}", api.root());
    let r = api.raw(method, &path, Some(api.admin()), body.to_vec(), &[]).await;
    assert!(r.status.is_client_error(), "{method} {path}: {} {}", r.status, r.body);
    assert_eq!(r.index_header(), None, "a refused bad input must not be logged");
    let applied = format!("applied index {}", api.t.node.applied_index());
    let text = format!("{} {}", r.status.as_u16(), r.body)
        .replace(api.root(), "<root>")
        .replace(&applied, "applied index <n>");
    expect.assert_eq(&text);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_a_4xx_json_naming_the_problem_and_the_log_is_unchanged() {
    let api = Api::new().await;
    api.register_edge("edge-a", 10).await;
    let before = api.t.node.applied_index();

    // malformed JSON, unknown fields, wrong types, missing fields, invalid UTF-8
    check_bad(&api, "POST", "/v1/projects", br#"{"name":"#, expect![[r#"400 {"code":"invalid","field":"name","message":"the body is not valid JSON: EOF while parsing a value at line 1 column 8"}"#]]).await;
    check_bad(
        &api,
        "POST",
        "/v1/projects",
        b"",
        expect![[r#"400 {"code":"invalid","message":"the body is empty; send a JSON object"}"#]],
    )
    .await;
    check_bad(&api, "POST", "/v1/projects", br#"{"name":"a"} {}"#, expect![[r#"400 {"code":"invalid","message":"the body is not valid JSON: trailing data (trailing characters at line 1 column 14)"}"#]]).await;
    check_bad(&api, "POST", "/v1/projects", br#"{"name":"a","colour":"red"}"#, expect![[r#"400 {"code":"invalid","field":"colour","message":"colour: unknown field `colour`, expected `name` or `parent` at line 1 column 20"}"#]]).await;
    check_bad(&api, "POST", "/v1/projects", br#"{"name":5}"#, expect![[r#"400 {"code":"invalid","field":"name","message":"name: invalid type: integer `5`, expected a string at line 1 column 9"}"#]]).await;
    check_bad(
        &api,
        "POST",
        "/v1/projects",
        br#"{}"#,
        expect![[r#"400 {"code":"invalid","field":"name","message":"name: missing field `name` at line 1 column 2"}"#]],
    )
    .await;
    check_bad(
        &api,
        "POST",
        "/v1/projects",
        b"{\"name\":\"caf\xff\"}",
        expect![[r#"400 {"code":"invalid","message":"the body is not valid UTF-8 (bad byte at offset 12)"}"#]],
    )
    .await;
    check_bad(
        &api,
        "POST",
        "/v1/projects",
        b"[1,2]",
        expect![[r#"400 {"code":"invalid","message":"the body must be a JSON object"}"#]],
    )
    .await;
    check_bad(&api, "POST", "/v1/sandboxes", br#"{"image":"base","cpu_millis":"lots"}"#, expect![[r#"400 {"code":"invalid","field":"cpu_millis","message":"cpu_millis: invalid type: string \"lots\", expected u64 at line 1 column 35"}"#]]).await;
    check_bad(&api, "POST", "/v1/sandboxes", br#"{"image":"base","labels":{"team":1}}"#, expect![[r#"400 {"code":"invalid","field":"labels.team","message":"labels.team: invalid type: integer `1`, expected a string at line 1 column 34"}"#]]).await;
    check_bad(&api, "POST", "/v1/edges", br#"{"edge":"e","address":"h:1","capacity":{"sandboxes":1,"cpu_millis":1}}"#, expect![[r#"400 {"code":"invalid","field":"capacity.memory_mb","message":"capacity.memory_mb: missing field `memory_mb` at line 1 column 69"}"#]]).await;
    // names and amounts that decide() refuses
    let long = format!(r#"{{"name":"{}"}}"#, "a".repeat(64));
    check_bad(
        &api,
        "POST",
        "/v1/projects",
        long.as_bytes(),
        expect![[r#"400 {"code":"invalid","field":"name","message":"name must be 1 to 63 characters long"}"#]],
    )
    .await;
    check_bad(&api, "POST", "/v1/projects", br#"{"name":"Bad Name!"}"#, expect![[r#"400 {"code":"invalid","field":"name","message":"name may hold only a-z, 0-9, '-', '_' and '.', and must start with a letter or digit"}"#]]).await;
    check_bad(&api, "PUT", "/v1/projects/{root}/quota", br#"{"sandboxes":-1}"#, expect![[r#"400 {"code":"invalid","field":"sandboxes","message":"sandboxes: invalid value: integer `-1`, expected u64 at line 1 column 15"}"#]]).await;
    check_bad(&api, "PUT", "/v1/projects/{root}/quota", br#"{"cpu_millis":99999999999999}"#, expect![[r#"400 {"code":"invalid","field":"limits.cpu_millis","message":"limits.cpu_millis = 99999999999999 is over the maximum 1000000000"}"#]]).await;
    check_bad(&api, "PUT", "/v1/projects/{root}/quota", br#"{"memory_mb":1e30}"#, expect![[r#"400 {"code":"invalid","field":"memory_mb","message":"memory_mb: invalid type: floating point `1e+30`, expected u64 at line 1 column 17"}"#]]).await;
    check_bad(
        &api,
        "POST",
        "/v1/sandboxes",
        br#"{"image":"base","memory_mb":0}"#,
        expect![[r#"400 {"code":"invalid","field":"memory_mb","message":"a sandbox needs some CPU and memory"}"#]],
    )
    .await;
    check_bad(&api, "POST", "/v1/tokens", br#"{"name":"t","rights":["root:everything"]}"#, expect![[r#"400 {"code":"invalid","field":"rights[0]","message":"unknown right \"root:everything\"; rights are: project:write, quota:write, token:write, sandbox:write, sandbox:read, edge:write, audit:read, cluster:admin"}"#]]).await;
    check_bad(
        &api,
        "POST",
        "/v1/sandboxes/whatever/fork",
        br#"{"count":0}"#,
        expect![[r#"400 {"code":"invalid","field":"count","message":"count must be 1 to 1024"}"#]],
    )
    .await;
    check_bad(&api, "POST", "/v1/sandboxes/whatever/fork", br#"{"count":1,"edge":"no such edge"}"#, expect![[r#"400 {"code":"invalid","field":"edge","message":"edge must be a non-empty id without spaces, at most 128 characters"}"#]]).await;
    check_bad(
        &api,
        "POST",
        "/v1/cluster/members",
        br#"{"id":2,"addr":""}"#,
        expect![[
            r#"400 {"code":"invalid","field":"addr","message":"addr must be host:port, at most 255 characters"}"#
        ]],
    )
    .await;
    // unknown ids
    check_bad(
        &api,
        "GET",
        "/v1/sandboxes/nope",
        b"",
        expect![[r#"404 {"code":"not_found","field":"id","message":"sandbox nope does not exist"}"#]],
    )
    .await;
    check_bad(
        &api,
        "DELETE",
        "/v1/sandboxes/nope",
        b"",
        expect![[r#"404 {"code":"not_found","field":"sandbox","message":"sandbox nope does not exist"}"#]],
    )
    .await;
    check_bad(
        &api,
        "POST",
        "/v1/sandboxes/nope/pause",
        b"",
        expect![[r#"404 {"code":"not_found","field":"sandbox","message":"sandbox nope does not exist"}"#]],
    )
    .await;
    check_bad(&api, "GET", "/v1/sandboxes/%FF%FE", b"", expect![[r#"400 {"code":"invalid","field":"path","message":"bad path parameter: Invalid URL: Invalid UTF-8 in `id`"}"#]]).await;
    check_bad(
        &api,
        "GET",
        "/v1/projects/pnope",
        b"",
        expect![[r#"404 {"code":"not_found","field":"id","message":"project pnope does not exist"}"#]],
    )
    .await;
    check_bad(
        &api,
        "DELETE",
        "/v1/projects/pnope",
        b"",
        expect![[r#"404 {"code":"not_found","field":"project","message":"project pnope does not exist"}"#]],
    )
    .await;
    check_bad(
        &api,
        "DELETE",
        "/v1/tokens/nope",
        b"",
        expect![[r#"404 {"code":"not_found","field":"token","message":"token nope does not exist"}"#]],
    )
    .await;
    check_bad(
        &api,
        "DELETE",
        "/v1/edges/nope",
        b"",
        expect![[r#"404 {"code":"not_found","field":"edge","message":"edge nope does not exist"}"#]],
    )
    .await;
    check_bad(
        &api,
        "POST",
        "/v1/sandboxes",
        br#"{"image":"base","project":"pnope"}"#,
        expect![[r#"404 {"code":"not_found","field":"project","message":"project pnope does not exist"}"#]],
    )
    .await;
    // query parameters
    check_bad(
        &api,
        "GET",
        "/v1/audit?limit=0",
        b"",
        expect![[r#"400 {"code":"invalid","field":"limit","message":"limit must be 1 to 1000, not 0"}"#]],
    )
    .await;
    check_bad(
        &api,
        "GET",
        "/v1/audit?limit=many",
        b"",
        expect![[
            r#"400 {"code":"invalid","field":"limit","message":"limit must be an unsigned integer, not \"many\""}"#
        ]],
    )
    .await;
    check_bad(&api, "GET", "/v1/audit?since=yesterday", b"", expect![[r#"400 {"code":"invalid","field":"since","message":"since must be milliseconds since the epoch or an RFC 3339 time, not \"yesterday\""}"#]]).await;
    check_bad(&api, "GET", "/v1/audit?colour=red", b"", expect![[r#"400 {"code":"invalid","field":"colour","message":"unknown query parameter \"colour\"; this endpoint takes: principal, project, action, target, since, until, after, limit"}"#]]).await;
    check_bad(
        &api,
        "GET",
        "/v1/audit?action=%FF",
        b"",
        expect![[
            r#"400 {"code":"invalid","field":"action","message":"query parameter \"action\" is not valid UTF-8"}"#
        ]],
    )
    .await;
    check_bad(&api, "GET", "/v1/sandboxes?state=sleepy", b"", expect![[r#"400 {"code":"invalid","field":"state","message":"unknown state \"sleepy\"; states are: pending, running, pausing, paused, resuming, killed, failed, exited"}"#]]).await;
    check_bad(
        &api,
        "GET",
        "/v1/sandboxes?label=novalue",
        b"",
        expect![[r#"400 {"code":"invalid","field":"label","message":"label filter \"novalue\" must be key=value"}"#]],
    )
    .await;
    check_bad(&api, "GET", "/v1/replay?view=everything", b"", expect![[r#"400 {"code":"invalid","field":"view","message":"unknown view \"everything\"; views are: sandboxes, placement, quota, iam, audit, snapshots, images"}"#]]).await;
    check_bad(
        &api,
        "GET",
        "/v1/replay?to=999999",
        b"",
        expect![[
            r#"400 {"code":"invalid","field":"to","message":"to index 999999 is past the last applied index <n>"}"#
        ]],
    )
    .await;
    check_bad(&api, "GET", "/v1/replay?to=soon", b"", expect![[r#"400 {"code":"invalid","field":"to","message":"to must be a log index or an RFC 3339 time, not \"soon\""}"#]]).await;
    check_bad(&api, "DELETE", "/v1/cluster/members/abc", b"", expect![[r#"400 {"code":"invalid","field":"path","message":"bad path parameter: Invalid URL: Cannot parse `abc` to a `u64`"}"#]]).await;
    // routes and methods that do not exist
    check_bad(
        &api,
        "GET",
        "/v1/nothing",
        b"",
        expect![[r#"404 {"code":"not_found","message":"no such endpoint: GET /v1/nothing"}"#]],
    )
    .await;
    check_bad(
        &api,
        "PATCH",
        "/v1/projects",
        b"",
        expect![[r#"405 {"code":"method_not_allowed","message":"PATCH is not allowed on /v1/projects"}"#]],
    )
    .await;

    // a body over 1 MiB
    let huge = format!(r#"{{"name":"{}"}}"#, "a".repeat(1 << 20));
    let r = api
        .raw("POST", "/v1/projects", Some(api.admin()), huge.into_bytes(), &[])
        .await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(r.body["code"], "payload_too_large");
    // a malformed read-your-writes header
    let r = api
        .raw(
            "GET",
            "/v1/projects",
            Some(api.admin()),
            vec![],
            &[("x-opendsec-min-index", "soon")],
        )
        .await;
    assert_eq!(
        (r.status.as_u16(), r.body["field"].as_str()),
        (400, Some("x-opendsec-min-index"))
    );

    assert_eq!(api.t.node.applied_index(), before, "no bad input may reach the log");
    let projects = api.ok("GET", "/v1/projects", api.admin(), None, 200).await;
    assert_eq!(
        projects["projects"].as_array().unwrap().len(),
        1,
        "nothing was created: {projects}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn projects_quotas_and_tokens_round_trip() {
    let api = Api::new().await;
    let admin = api.admin().to_string();
    let root = api.root().to_string();

    let r = api
        .call("POST", "/v1/projects", &admin, Some(json!({"name": "team-a"})))
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    assert_eq!(r.index_header(), r.body["index"].as_u64());
    let team = r.body["project"]["id"].as_str().unwrap().to_string();
    assert_eq!(r.body["project"]["parent"], root.as_str());
    let dup = api
        .call(
            "POST",
            "/v1/projects",
            &admin,
            Some(json!({"name": "team-a", "parent": root})),
        )
        .await;
    assert_eq!(
        (dup.status.as_u16(), dup.body["code"].as_str()),
        (409, Some("conflict"))
    );

    let list = api.ok("GET", "/v1/projects", &admin, None, 200).await;
    assert_eq!(list["projects"].as_array().unwrap().len(), 2);
    let got = api.ok("GET", &format!("/v1/projects/{team}"), &admin, None, 200).await;
    assert_eq!(got["name"], "team-a");

    // quotas: own, effective, usage
    api.ok(
        "PUT",
        &format!("/v1/projects/{root}/quota"),
        &admin,
        Some(json!({"sandboxes": 100, "cpu_millis": 100000, "memory_mb": 100000})),
        200,
    )
    .await;
    // below a limited parent, every resource must be limited (unlimited would exceed it)
    let r = api
        .call(
            "PUT",
            &format!("/v1/projects/{team}/quota"),
            &admin,
            Some(json!({"sandboxes": 2})),
        )
        .await;
    assert_eq!(
        (r.status.as_u16(), r.body["field"].as_str()),
        (400, Some("limits.cpu_millis")),
        "{}",
        r.body
    );
    let q = api
        .ok(
            "PUT",
            &format!("/v1/projects/{team}/quota"),
            &admin,
            Some(json!({"sandboxes": 2, "cpu_millis": 4000, "memory_mb": 100000})),
            200,
        )
        .await;
    assert_eq!(
        q["limits"],
        json!({"sandboxes": 2, "cpu_millis": 4000, "memory_mb": 100000})
    );
    let q = api
        .ok("GET", &format!("/v1/projects/{team}/quota"), &admin, None, 200)
        .await;
    assert_eq!(
        q["effective"],
        json!({"sandboxes": 2, "cpu_millis": 4000, "memory_mb": 100000})
    );
    assert_eq!(q["usage"], json!({"sandboxes": 0, "cpu_millis": 0, "memory_mb": 0}));
    let over = api
        .call(
            "PUT",
            &format!("/v1/projects/{team}/quota"),
            &admin,
            Some(json!({"sandboxes": 1000, "cpu_millis": 1, "memory_mb": 1})),
        )
        .await;
    assert_eq!(
        (over.status.as_u16(), over.body["field"].as_str()),
        (400, Some("limits.sandboxes")),
        "{}",
        over.body
    );

    // a token of the child project sees only its subtree
    let issued = api
        .call(
            "POST",
            "/v1/tokens",
            &admin,
            Some(json!({"project": team, "name": "ci", "rights": ["sandbox:read"], "ttl_seconds": 3600})),
        )
        .await;
    assert_eq!(issued.status, StatusCode::CREATED);
    let child = issued.body["token"].as_str().unwrap().to_string();
    let child_id = issued.body["id"].as_str().unwrap().to_string();
    assert!(child.starts_with(&format!("odsec_{child_id}.")));
    assert!(issued.body["expires_at_ms"].as_u64().is_some());

    let who = api.ok("GET", "/v1/whoami", &child, None, 200).await;
    assert_eq!(who["project"], team.as_str());
    assert_eq!(who["project_name"], "team-a");
    assert_eq!(who["rights"], json!(["sandbox:read"]));
    let seen = api.ok("GET", "/v1/projects", &child, None, 200).await;
    assert_eq!(seen["projects"].as_array().unwrap().len(), 1);
    let r = api.call("GET", &format!("/v1/projects/{root}"), &child, None).await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    let r = api.call("GET", "/v1/tokens", &child, None).await;
    assert_eq!(
        (r.status.as_u16(), r.body["message"].as_str()),
        (403, Some("this token lacks the right token:write"))
    );

    // listing never shows a secret or its hash
    let tokens = api
        .ok("GET", &format!("/v1/tokens?project={team}"), &admin, None, 200)
        .await;
    assert_eq!(tokens["tokens"].as_array().unwrap().len(), 1);
    let text = tokens.to_string();
    assert!(!text.contains("secret") && !text.contains(child.split('.').nth(1).unwrap()));

    // revoke: the token stops working at once
    api.ok(
        "DELETE",
        &format!("/v1/tokens/{child_id}?reason=leaked"),
        &admin,
        None,
        200,
    )
    .await;
    let r = api.call("GET", "/v1/whoami", &child, None).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    let tokens = api.ok("GET", "/v1/tokens", &admin, None, 200).await;
    let revoked = tokens["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["id"] == child_id.as_str())
        .unwrap();
    assert_eq!(revoked["revoked"]["reason"], "leaked");

    // delete
    let d = api
        .ok("DELETE", &format!("/v1/projects/{team}"), &admin, None, 200)
        .await;
    assert!(d["index"].as_u64().unwrap() > 0);
    let r = api.call("GET", &format!("/v1/projects/{team}"), &admin, None).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_lifecycle_filters_fork_and_quota() {
    let api = Api::new().await;
    let admin = api.admin().to_string();
    let root = api.root().to_string();
    let r = api
        .call("POST", "/v1/sandboxes", &admin, Some(json!({"image": "base"})))
        .await;
    assert_eq!(
        (r.status.as_u16(), r.body["code"].as_str()),
        (503, Some("no_capacity")),
        "no edge yet: {}",
        r.body
    );
    api.register_edge("edge-a", 10).await;
    let edges = api.ok("GET", "/v1/edges", &admin, None, 200).await;
    assert_eq!(edges["edges"][0]["id"], "edge-a");
    assert_eq!(edges["edges"][0]["capacity"]["sandboxes"], 10);

    let r = api
        .call(
            "POST",
            "/v1/sandboxes",
            &admin,
            Some(json!({"image": "base", "labels": {"job": "rl-1"}, "timeout_seconds": 600})),
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    assert_eq!(r.index_header(), r.body["index"].as_u64());
    let sb = &r.body["sandbox"];
    let id = sb["id"].as_str().unwrap().to_string();
    assert_eq!(
        (sb["cpu_millis"].as_u64(), sb["memory_mb"].as_u64()),
        (Some(1000), Some(512)),
        "defaults"
    );
    assert_eq!(sb["project"], root.as_str());
    assert_eq!(sb["edge"], "edge-a");
    assert_eq!(sb["state"], "pending");
    assert!(sb["expires_at_ms"].as_u64().is_some());
    api.ok(
        "POST",
        "/v1/sandboxes",
        &admin,
        Some(json!({"image": "busybox", "cpu_millis": 250, "memory_mb": 128, "labels": {"job": "other"}})),
        201,
    )
    .await;

    let ids = |v: &Value| -> Vec<String> {
        v["sandboxes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["id"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(ids(&api.ok("GET", "/v1/sandboxes", &admin, None, 200).await).len(), 2);
    assert_eq!(
        ids(&api.ok("GET", "/v1/sandboxes?label=job=rl-1", &admin, None, 200).await),
        vec![id.clone()]
    );
    assert_eq!(
        ids(&api
            .ok("GET", "/v1/sandboxes?state=pending&label=job=rl-1", &admin, None, 200)
            .await),
        vec![id.clone()]
    );
    assert!(ids(&api.ok("GET", "/v1/sandboxes?state=running", &admin, None, 200).await).is_empty());

    let p = api
        .ok("POST", &format!("/v1/sandboxes/{id}/pause"), &admin, None, 200)
        .await;
    assert_eq!(
        (p["sandbox"]["desired"].as_str(), p["sandbox"]["state"].as_str()),
        (Some("paused"), Some("pausing"))
    );
    let p = api
        .ok("POST", &format!("/v1/sandboxes/{id}/resume"), &admin, None, 200)
        .await;
    assert_eq!(p["sandbox"]["desired"], "running");
    let t = api
        .ok(
            "PUT",
            &format!("/v1/sandboxes/{id}/timeout"),
            &admin,
            Some(json!({"timeout_seconds": 0})),
            200,
        )
        .await;
    assert_eq!(t["sandbox"]["expires_at_ms"], Value::Null);
    let l = api
        .ok(
            "PUT",
            &format!("/v1/sandboxes/{id}/labels"),
            &admin,
            Some(json!({"labels": {"job": "rl-2", "gpu": "no"}})),
            200,
        )
        .await;
    assert_eq!(l["sandbox"]["labels"], json!({"job": "rl-2", "gpu": "no"}));

    let f = api
        .ok(
            "POST",
            &format!("/v1/sandboxes/{id}/fork"),
            &admin,
            Some(json!({"count": 2})),
            201,
        )
        .await;
    let children = f["sandboxes"].as_array().unwrap();
    assert_eq!(children.len(), 2);
    assert!(
        children
            .iter()
            .all(|c| c["fork_of"] == id.as_str() && c["labels"]["gpu"] == "no")
    );
    let got = api
        .ok(
            "GET",
            &format!("/v1/sandboxes/{}", children[0]["id"].as_str().unwrap()),
            &admin,
            None,
            200,
        )
        .await;
    assert_eq!(got["fork_of"], id.as_str());

    let k = api
        .ok("DELETE", &format!("/v1/sandboxes/{id}"), &admin, None, 200)
        .await;
    assert_eq!(
        (k["sandbox"]["state"].as_str(), k["sandbox"]["live"].as_bool()),
        (Some("killed"), Some(false))
    );
    assert!(!ids(&api.ok("GET", "/v1/sandboxes", &admin, None, 200).await).contains(&id));
    assert_eq!(
        ids(&api.ok("GET", "/v1/sandboxes?state=killed", &admin, None, 200).await),
        vec![id.clone()]
    );
    let again = api
        .call("POST", &format!("/v1/sandboxes/{id}/pause"), &admin, None)
        .await;
    assert_eq!(again.status, StatusCode::CONFLICT);
    assert!(
        again.index_header().is_some(),
        "a conflict is logged, and the response says where"
    );

    // quota: 3 live sandboxes, a limit of 3, one more is refused with 429
    api.ok(
        "PUT",
        &format!("/v1/projects/{root}/quota"),
        &admin,
        Some(json!({"sandboxes": 3})),
        200,
    )
    .await;
    let q = api
        .ok("GET", &format!("/v1/projects/{root}/quota"), &admin, None, 200)
        .await;
    assert_eq!(q["usage"]["sandboxes"], 3);
    let r = api
        .call("POST", "/v1/sandboxes", &admin, Some(json!({"image": "base"})))
        .await;
    assert_eq!(
        (r.status.as_u16(), r.body["code"].as_str()),
        (429, Some("quota_exceeded")),
        "{}",
        r.body
    );

    // edges: deregister stops placement
    let d = api.ok("DELETE", "/v1/edges/edge-a", &admin, None, 200).await;
    assert_eq!(d["edge"]["deregistered"], true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn microvms_snapshots_and_tasks_through_rest() {
    let api = Api::new().await;
    let admin = api.admin().to_string();
    api.register_edge("plain", 10).await;
    let vm_edge = json!({"edge": "vm", "address": "127.0.0.1:7501", "capacity": {"sandboxes": 10, "cpu_millis": 64000, "memory_mb": 65536}, "labels": {"opendsec.io/microvm": "qemu"}});
    api.ok("POST", "/v1/edges", &admin, Some(vm_edge), 200).await;
    let ready = |id: String| {
        let node = api.t.node.clone();
        async move { opendsec_control::testing::report_ready(&node, &id).await }
    };

    // The isolation is a create option; bad values and sizes are 400s naming the field.
    let r = api
        .call(
            "POST",
            "/v1/sandboxes",
            &admin,
            Some(json!({"image": "base", "isolation": "gvisor"})),
        )
        .await;
    assert_eq!(
        (r.status.as_u16(), r.body["field"].as_str()),
        (400, Some("isolation")),
        "{}",
        r.body
    );
    // A full VM needs an edge labelled for them: neither edge here is.
    let r = api
        .call(
            "POST",
            "/v1/sandboxes",
            &admin,
            Some(json!({"image": "base", "isolation": "vm"})),
        )
        .await;
    assert!(
        r.body["message"].as_str().unwrap_or("").contains("full VM"),
        "{} {}",
        r.status,
        r.body
    );
    assert!(!r.status.is_success(), "{}", r.body);
    let r = api
        .call(
            "POST",
            "/v1/sandboxes",
            &admin,
            Some(json!({"image": "base", "isolation": "microvm", "memory_mb": 32})),
        )
        .await;
    assert_eq!(
        (r.status.as_u16(), r.body["field"].as_str()),
        (400, Some("memory_mb")),
        "{}",
        r.body
    );
    let vm = api
        .ok(
            "POST",
            "/v1/sandboxes",
            &admin,
            Some(json!({"image": "base", "isolation": "microvm", "memory_mb": 256, "labels": {"task": "t1"}})),
            201,
        )
        .await;
    let vm = &vm["sandbox"];
    assert_eq!(
        (vm["isolation"].as_str(), vm["edge"].as_str()),
        (Some("microvm"), Some("vm"))
    );
    let vm_id = vm["id"].as_str().unwrap().to_string();
    let ct = api
        .ok(
            "POST",
            "/v1/sandboxes",
            &admin,
            Some(json!({"image": "base", "labels": {"task": "t1"}})),
            201,
        )
        .await;
    assert_eq!(ct["sandbox"]["isolation"], "container");
    let ct_id = ct["sandbox"]["id"].as_str().unwrap().to_string();

    // Snapshots: of a sandbox that has run; the body may be empty.
    let r = api
        .call("POST", &format!("/v1/sandboxes/{vm_id}/snapshots"), &admin, None)
        .await;
    assert_eq!(r.status, StatusCode::CONFLICT, "not running yet: {}", r.body);
    ready(vm_id.clone()).await;
    let r = api
        .call(
            "POST",
            &format!("/v1/sandboxes/{vm_id}/snapshots"),
            &admin,
            Some(json!({"label": "x"})),
        )
        .await;
    assert_eq!(
        (r.status.as_u16(), r.body["field"].as_str()),
        (400, Some("label")),
        "{}",
        r.body
    );
    let snap = api
        .ok("POST", &format!("/v1/sandboxes/{vm_id}/snapshots"), &admin, None, 201)
        .await;
    let snap = &snap["snapshot"];
    assert_eq!(
        (
            snap["state"].as_str(),
            snap["isolation"].as_str(),
            snap["sandbox"].as_str()
        ),
        (Some("pending"), Some("microvm"), Some(vm_id.as_str()))
    );
    let snap_id = snap["id"].as_str().unwrap().to_string();
    let named = api
        .ok(
            "POST",
            &format!("/v1/sandboxes/{vm_id}/snapshots"),
            &admin,
            Some(json!({"name": "warm"})),
            201,
        )
        .await;
    assert_eq!(named["snapshot"]["name"], "warm");
    let listed = api
        .ok("GET", &format!("/v1/snapshots?sandbox={vm_id}"), &admin, None, 200)
        .await;
    assert_eq!(listed["snapshots"].as_array().unwrap().len(), 2);
    assert_eq!(
        api.ok("GET", &format!("/v1/snapshots/{snap_id}"), &admin, None, 200)
            .await["id"],
        snap_id.as_str()
    );
    assert_eq!(
        api.call("GET", "/v1/snapshots?colour=red", &admin, None).await.status,
        StatusCode::BAD_REQUEST
    );

    // A task pause: one call, one audit record, every sandbox of the task.
    let t = api.ok("POST", "/v1/tasks/t1/pause", &admin, None, 200).await;
    let mut changed: Vec<&str> = t["changed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    changed.sort();
    let mut both = vec![vm_id.as_str(), ct_id.as_str()];
    both.sort();
    assert_eq!(changed, both);
    assert!(
        t["sandboxes"]
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s["desired"] == "paused"),
        "{t}"
    );
    let audit = api.ok("GET", "/v1/audit?action=task.pause", &admin, None, 200).await;
    assert_eq!(audit["records"][0]["target"], "task:t1");
    assert_eq!(
        api.ok("POST", "/v1/tasks/t1/pause", &admin, None, 200).await["changed"],
        json!([])
    );
    let r = api.call("POST", "/v1/tasks/nobody/pause", &admin, None).await;
    assert_eq!(
        (r.status.as_u16(), r.body["field"].as_str()),
        (404, Some("task")),
        "{}",
        r.body
    );
    let t = api.ok("POST", "/v1/tasks/t1/resume", &admin, None, 200).await;
    assert_eq!(t["changed"].as_array().unwrap().len(), 2);

    api.ok("DELETE", &format!("/v1/snapshots/{snap_id}"), &admin, None, 200)
        .await;
    assert_eq!(
        api.call("GET", &format!("/v1/snapshots/{snap_id}"), &admin, None)
            .await
            .status,
        StatusCode::NOT_FOUND
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_filters_paginates_and_records_denied_writes() {
    let api = Api::new().await;
    let admin = api.admin().to_string();
    let started = api.t.node.read(|s| s.time_ms);
    for name in ["a", "b", "c", "d"] {
        api.ok("POST", "/v1/projects", &admin, Some(json!({"name": name})), 201)
            .await;
    }
    // a token that may only read sandboxes tries to create a project: denied, and audited
    let (reader_id, reader) = api.token(api.root(), &["sandbox:read"]).await;
    let r = api
        .raw(
            "POST",
            "/v1/projects",
            Some(&reader),
            br#"{"name":"sneaky"}"#.to_vec(),
            &[("x-request-id", "req-denied-1")],
        )
        .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    assert_eq!(r.headers["x-request-id"], "req-denied-1");
    let denied_at = r.index_header().expect("a denial is logged");

    let page = api
        .ok("GET", &format!("/v1/audit?principal={reader_id}"), &admin, None, 200)
        .await;
    let recs = page["records"].as_array().unwrap();
    assert_eq!(recs.len(), 1, "{page}");
    assert_eq!(recs[0]["index"], denied_at);
    assert_eq!(recs[0]["action"], "project.create");
    assert_eq!(recs[0]["result"], "denied");
    assert_eq!(recs[0]["code"], "forbidden");
    assert_eq!(recs[0]["request_id"], "req-denied-1");
    assert_eq!(recs[0]["principal"], format!("token:{reader_id}"));

    // filters
    let creates = api
        .ok("GET", "/v1/audit?action=project.create", &admin, None, 200)
        .await;
    assert_eq!(creates["records"].as_array().unwrap().len(), 5);
    let ok_only: Vec<_> = creates["records"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["result"] == "ok")
        .collect();
    assert_eq!(ok_only.len(), 4);
    let none = api
        .ok("GET", "/v1/audit?since=2999-01-01T00:00:00Z", &admin, None, 200)
        .await;
    assert!(none["records"].as_array().unwrap().is_empty());
    let all_since = api
        .ok(
            "GET",
            &format!("/v1/audit?since={started}&until=2999-01-01T00:00:00Z"),
            &admin,
            None,
            200,
        )
        .await;
    assert!(all_since["records"].as_array().unwrap().len() >= 6);

    // pagination: pages of 2 cover exactly the full list, in order
    let full: Vec<u64> = api.ok("GET", "/v1/audit", &admin, None, 200).await["records"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["index"].as_u64().unwrap())
        .collect();
    let mut paged = Vec::new();
    let mut after: Option<u64> = None;
    loop {
        let q = match after {
            Some(a) => format!("/v1/audit?limit=2&after={a}"),
            None => "/v1/audit?limit=2".to_string(),
        };
        let page = api.ok("GET", &q, &admin, None, 200).await;
        let recs = page["records"].as_array().unwrap();
        assert!(recs.len() <= 2);
        paged.extend(recs.iter().map(|r| r["index"].as_u64().unwrap()));
        match page["next"].as_u64() {
            Some(n) => after = Some(n),
            None => break,
        }
    }
    assert_eq!(paged, full);
    assert!(full.len() >= 7);

    // audit needs audit:read
    let r = api.call("GET", "/v1/audit", &reader, None).await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_shows_views_at_a_past_index_and_diffs_two_points() {
    let api = Api::new().await;
    let admin = api.admin().to_string();
    api.register_edge("edge-a", 10).await;
    let before = api.t.node.applied_index();
    let created = api
        .ok("POST", "/v1/sandboxes", &admin, Some(json!({"image": "base"})), 201)
        .await;
    let id = created["sandbox"]["id"].as_str().unwrap().to_string();
    api.ok("POST", &format!("/v1/sandboxes/{id}/pause"), &admin, None, 200)
        .await;

    let then = api
        .ok(
            "GET",
            &format!("/v1/replay?to={before}&view=sandboxes"),
            &admin,
            None,
            200,
        )
        .await;
    assert_eq!(then["index"], before);
    assert_eq!(then["views"]["sandboxes"]["sandboxes"], json!({}));
    assert!(then["views"].get("iam").is_none());
    let now = api.ok("GET", "/v1/replay", &admin, None, 200).await;
    assert_eq!(now["views"]["sandboxes"]["sandboxes"][&id]["desired"], "paused");
    assert!(
        !now.to_string().contains("secret_sha256"),
        "replayed IAM never shows secret hashes"
    );
    let at_time = api
        .ok(
            "GET",
            "/v1/replay?to=2999-01-01T00:00:00Z&view=sandboxes",
            &admin,
            None,
            200,
        )
        .await;
    assert_eq!(at_time["index"], api.t.node.applied_index());

    let diff = api
        .ok(
            "GET",
            &format!("/v1/replay?diff_from={before}&view=sandboxes"),
            &admin,
            None,
            200,
        )
        .await;
    assert_eq!(diff["from_index"], before);
    let paths: Vec<&str> = diff["changes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["path"].as_str().unwrap())
        .collect();
    assert_eq!(
        paths,
        vec![format!("/sandboxes/sandboxes/{id}")],
        "the sandbox appeared between the two points"
    );

    // replay is whole-cluster: a token below the root may not use it
    let team = api
        .ok("POST", "/v1/projects", &admin, Some(json!({"name": "team"})), 201)
        .await["project"]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let (_, child) = api.token(&team, &["audit:read"]).await;
    let r = api.call("GET", "/v1/replay", &child, None).await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_ids_and_read_your_writes() {
    let api = Api::new().await;
    let admin = api.admin().to_string();
    let r = api.raw("GET", "/v1/whoami", Some(&admin), vec![], &[]).await;
    let generated = r.headers["x-request-id"].to_str().unwrap();
    assert_eq!(generated.len(), 36, "a UUID: {generated}");
    let r = api
        .raw(
            "GET",
            "/v1/whoami",
            Some(&admin),
            vec![],
            &[("x-request-id", "bad id with spaces")],
        )
        .await;
    assert_ne!(r.headers["x-request-id"], "bad id with spaces");

    let applied = api.t.node.applied_index();
    let r = api
        .raw(
            "GET",
            "/v1/projects",
            Some(&admin),
            vec![],
            &[("x-opendsec-min-index", &applied.to_string())],
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let started = std::time::Instant::now();
    let r = api
        .raw(
            "GET",
            "/v1/projects",
            Some(&admin),
            vec![],
            &[("x-opendsec-min-index", &(applied + 1000).to_string())],
        )
        .await;
    assert_eq!((r.status.as_u16(), r.body["code"].as_str()), (503, Some("unavailable")));
    assert!(
        started.elapsed() >= std::time::Duration::from_secs(4),
        "waited for the index before giving up"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_status_and_membership_rights() {
    let api = Api::new().await;
    let admin = api.admin().to_string();
    let s = api.ok("GET", "/v1/cluster", &admin, None, 200).await;
    assert_eq!(s["node_id"], 1);
    assert_eq!(s["leader_id"], 1);
    assert_eq!(s["members"]["1"], api.t.peer_addr.as_str());
    assert!(s["applied_index"].as_u64().is_some() && s["state_hash"].as_str().is_some_and(|h| h.len() == 64));
    let (_, reader) = api.token(api.root(), &["sandbox:read"]).await;
    let r = api
        .call(
            "POST",
            "/v1/cluster/members",
            &reader,
            Some(json!({"id": 2, "addr": "127.0.0.1:1"})),
        )
        .await;
    assert_eq!(
        (r.status.as_u16(), r.body["message"].as_str()),
        (403, Some("this token lacks the right cluster:admin"))
    );
    let r = api.call("DELETE", "/v1/cluster/members/2", &reader, None).await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openapi_document_covers_every_route_and_its_schemas() {
    let api = Api::new().await;
    let r = api.raw("GET", "/v1/openapi.json", None, vec![], &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    let doc = r.body;
    for (method, path) in ROUTES {
        assert!(
            doc["paths"][path][method].is_object(),
            "{method} {path} is not documented"
        );
        let public = *path == "/health" || *path == "/v1/openapi.json";
        assert_eq!(
            doc["paths"][path][method]["security"] == json!([{}]),
            public,
            "{method} {path}: security"
        );
    }
    let documented: usize = doc["paths"]
        .as_object()
        .unwrap()
        .values()
        .map(|p| p.as_object().unwrap().len())
        .sum();
    assert_eq!(documented, ROUTES.len(), "no undocumented extras");
    for schema in [
        "CreateSandbox",
        "Sandbox",
        "ErrorBody",
        "AuditPage",
        "IssueToken",
        "TokenIssued",
        "Quota",
        "NetworkPolicy",
        "RateLimits",
        "ProjectRates",
        "ProjectNetwork",
        "Replay",
        "ClusterStatus",
        "RegisterEdge",
    ] {
        assert!(
            doc["components"]["schemas"][schema].is_object(),
            "schema {schema} missing"
        );
    }
    assert_eq!(doc["components"]["securitySchemes"]["bearer"]["scheme"], "bearer");
    // The isolations a create may ask for, full VMs included.
    let isolation = doc["components"]["schemas"]["Isolation"].to_string();
    for name in ["\"container\"", "\"microvm\"", "\"vm\""] {
        assert!(isolation.contains(name), "{name} missing from {isolation}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_is_packed_into_an_image_through_rest() {
    let api = Api::new().await;
    let admin = api.admin().to_string();
    api.register_edge("edge-a", 10).await;
    let created = api
        .ok("POST", "/v1/sandboxes", &admin, Some(json!({"image": "busybox"})), 201)
        .await;
    let id = created["sandbox"]["id"].as_str().unwrap().to_string();
    let path = format!("/v1/sandboxes/{id}/pack");

    // Not running yet: a conflict; then bad bodies are 400s naming the field, not logged.
    let r = api.call("POST", &path, &admin, Some(json!({"name": "env"}))).await;
    assert_eq!(
        (r.status, r.body["field"].as_str()),
        (StatusCode::CONFLICT, Some("sandbox"))
    );
    opendsec_control::testing::report_ready(&api.t.node, &id).await;
    check_bad(&api, "POST", &path, br#"{"name":"env","scrub":["etc/token"]}"#, expect![[r#"400 {"code":"invalid","field":"scrub","message":"scrub: \"etc/token\" is not an absolute path of at most 4096 bytes without '.', '..' or empty components (e.g. /etc/token)"}"#]]).await;
    check_bad(
        &api,
        "POST",
        &path,
        br#"{"name":"base"}"#,
        expect![[r#"400 {"code":"invalid","field":"name","message":"\"base\" is a built-in image"}"#]],
    )
    .await;
    check_bad(&api, "POST", &path, br#"{"name":"env","paths":[]}"#, expect![[r#"400 {"code":"invalid","field":"paths","message":"paths: unknown field `paths`, expected `name` or `scrub` at line 1 column 21"}"#]]).await;

    let w = api
        .ok(
            "POST",
            &path,
            &admin,
            Some(json!({"name": "env", "scrub": ["/etc/token"]})),
            201,
        )
        .await;
    let image = &w["image"];
    assert_eq!(
        (
            image["state"].as_str(),
            image["reference"].as_str(),
            image["edge"].as_str(),
            image["source_sandbox"].as_str(),
            image["scrub"].clone()
        ),
        (
            Some("pending"),
            Some(""),
            Some("edge-a"),
            Some(id.as_str()),
            json!(["/etc/token"])
        ),
        "{w}"
    );
    let got = api.ok("GET", "/v1/images/env", &admin, None, 200).await;
    assert_eq!(got["source_sandbox"], id.as_str());
    // Until its edge has made it, nothing starts from it.
    let r = api
        .call("POST", "/v1/sandboxes", &admin, Some(json!({"image": "env"})))
        .await;
    assert_eq!(
        (r.status, r.body["field"].as_str()),
        (StatusCode::CONFLICT, Some("image")),
        "{}",
        r.body
    );
    assert!(
        r.body["message"].as_str().unwrap().contains("still being packed"),
        "{}",
        r.body
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_list_comes_in_pages_in_id_order() {
    let api = Api::new().await;
    let admin = api.admin().to_string();
    for n in 0..7 {
        let r = api
            .call(
                "POST",
                "/v1/projects",
                &admin,
                Some(json!({"name": format!("team-{n}")})),
            )
            .await;
        assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    }
    // 8 projects (the root and 7) in pages of 3: 3, 3, 2; each id once, in order.
    let mut seen = Vec::new();
    let mut token: Option<String> = None;
    let mut pages = 0;
    loop {
        let path = match &token {
            None => "/v1/projects?limit=3".to_string(),
            Some(t) => format!("/v1/projects?limit=3&page_token={t}"),
        };
        let r = api.call("GET", &path, &admin, None).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.body);
        pages += 1;
        seen.extend(
            r.body["projects"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| p["id"].as_str().unwrap().to_string()),
        );
        match r.body["next_page_token"].as_str() {
            Some(t) => token = Some(t.to_string()),
            None => break,
        }
    }
    assert_eq!((pages, seen.len()), (3, 8));
    let mut sorted = seen.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(seen, sorted, "in id order, each once");
    // Without a limit: one page of all, no token.
    let r = api.call("GET", "/v1/projects", &admin, None).await;
    assert_eq!(r.body["projects"].as_array().unwrap().len(), 8);
    assert!(r.body.get("next_page_token").is_none(), "{}", r.body);
    // A bad limit names it; so does it on every list.
    for list in ["projects", "sandboxes", "snapshots", "tokens", "images", "edges"] {
        for bad in ["0", "1001", "x"] {
            let r = api.call("GET", &format!("/v1/{list}?limit={bad}"), &admin, None).await;
            assert_eq!(r.status, StatusCode::BAD_REQUEST, "{list} {bad}: {}", r.body);
            assert_eq!(r.body["field"], "limit");
        }
        let r = api.call("GET", &format!("/v1/{list}?limit=1"), &admin, None).await;
        assert_eq!(r.status, StatusCode::OK, "{list}: {}", r.body);
    }
}
