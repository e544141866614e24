//! Per-sandbox traffic on the gateway's port: a request is for a sandbox when it carries
//! `E2b-Sandbox-Id` (and `E2b-Sandbox-Port`, default envd's 49983) or when its host is
//! `{port}-{sandboxId}.{domain}`. It goes to the sandbox's edge (the id encodes it) and
//! on to the agent (49983) or, through the agent's tunnel, to that port inside the
//! sandbox. Bodies stream both ways; upgrades (WebSocket) pass through.
//!
//! Who may: envd checks the sandbox's access token itself (`X-Access-Token` or a signed
//! URL; `/health` is open, as in E2B). The code interpreter (49999) needs the access or
//! traffic token. Other ports are public unless the sandbox's network settings say
//! `allowPublicTraffic: false`, when they need `E2B-Traffic-Access-Token` — E2B's rules.

use axum::Json;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use opendsec_control::SandboxTokenKind;
use opendsec_projections::Desired;
use serde_json::json;

use super::api::E2bError;
use super::{CODE_INTERPRETER_PORT, ENVD_PORT};
use crate::AppState;

const SANDBOX_ID_HEADER: &str = "e2b-sandbox-id";
const SANDBOX_PORT_HEADER: &str = "e2b-sandbox-port";
const ACCESS_TOKEN_HEADER: &str = "x-access-token";
const TRAFFIC_TOKEN_HEADER: &str = "e2b-traffic-access-token";

enum Target {
    Control,
    Sandbox { id: String, port: u16 },
    Bad(String),
}

fn valid_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 64 && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

fn target_of(st: &AppState, req: &Request) -> Target {
    let h = |n: &str| req.headers().get(n).and_then(|v| v.to_str().ok()).map(str::trim);
    match (h(SANDBOX_ID_HEADER), h(SANDBOX_PORT_HEADER)) {
        (None, None) => {}
        (Some(id), port) => {
            if !valid_id(id) {
                return Target::Bad(format!("{SANDBOX_ID_HEADER} {id:?} is not a sandbox id"));
            }
            let port = match port {
                None => ENVD_PORT,
                Some(p) => match p.parse::<u16>() {
                    Ok(p) if p != 0 => p,
                    _ => return Target::Bad(format!("{SANDBOX_PORT_HEADER} {p:?} is not a port")),
                },
            };
            return Target::Sandbox {
                id: id.to_string(),
                port,
            };
        }
        (None, Some(_)) => return Target::Bad(format!("{SANDBOX_PORT_HEADER} needs {SANDBOX_ID_HEADER}")),
    }
    let Some(domain) = st.e2b.domain_host() else {
        return Target::Control;
    };
    let host = req
        .headers()
        .get(axum::http::header::HOST)
        .and_then(|v| v.to_str().ok())
        .or_else(|| req.uri().host())
        .unwrap_or("");
    let host = host
        .rsplit_once(':')
        .filter(|(_, p)| p.chars().all(|c| c.is_ascii_digit()))
        .map(|(h, _)| h)
        .unwrap_or(host)
        .to_ascii_lowercase();
    let Some(label) = host.strip_suffix(&domain).and_then(|l| l.strip_suffix('.')) else {
        return Target::Control;
    };
    if label.contains('.') {
        return Target::Control;
    }
    match label.split_once('-') {
        Some((port, id)) if port.chars().all(|c| c.is_ascii_digit()) && !port.is_empty() => match port.parse::<u16>() {
            Ok(p) if p != 0 && valid_id(id) => Target::Sandbox {
                id: id.to_string(),
                port: p,
            },
            _ => Target::Bad(format!("{host} is not {{port}}-{{sandboxId}}.{domain}")),
        },
        _ => Target::Control,
    }
}

/// E2B's answer for a sandbox that does not exist (the SDK's probes look for "was not found").
fn not_found(id: &str) -> Response {
    (
        StatusCode::BAD_GATEWAY,
        Json(json!({ "sandboxId": id, "message": "The sandbox was not found", "code": 502 })),
    )
        .into_response()
}

fn token_is(req: &Request, header: &str, expected: &str) -> Option<bool> {
    let got = req.headers().get(header)?.to_str().ok()?;
    Some(got.len() == expected.len() && got.bytes().zip(expected.bytes()).fold(0u8, |a, (x, y)| a | (x ^ y)) == 0)
}

/// Middleware in front of every route: sandbox traffic goes to its sandbox, the rest on.
pub async fn route_sandbox_traffic(State(st): State<AppState>, req: Request, next: Next) -> Response {
    match target_of(&st, &req) {
        Target::Control => next.run(req).await,
        Target::Bad(m) => E2bError::new(StatusCode::BAD_REQUEST, m).into_response(),
        Target::Sandbox { id, port } => match to_sandbox(&st, id, port, req).await {
            Ok(r) => r,
            Err(r) => r,
        },
    }
}

/// Answers a refused request after reading (a bounded part of) its body: a client still
/// sending a body it was not allowed to send would otherwise see the connection close
/// under it instead of the answer.
async fn refuse(req: Request, answer: Response) -> Response {
    use http_body_util::BodyExt;
    let body = http_body_util::Limited::new(req.into_body(), 1 << 20);
    let _ = tokio::time::timeout(std::time::Duration::from_secs(2), body.collect()).await;
    answer
}

async fn to_sandbox(st: &AppState, id: String, port: u16, req: Request) -> Result<Response, Response> {
    match admit(st, &id, port, &req) {
        Ok(()) => forward(st, id, port, req).await,
        Err(answer) => Err(refuse(req, answer).await),
    }
}

/// Whether the request may reach the sandbox's port (the sandbox exists, the tokens fit).
// The refusal is the finished answer, built once on the refusing path; boxing it would
// only add an allocation there.
#[allow(clippy::result_large_err)]
fn admit(st: &AppState, id: &str, port: u16, req: &Request) -> Result<(), Response> {
    let found = st
        .node
        .read(|s| s.sandboxes.sandboxes.get(id).filter(|x| x.is_live()).cloned());
    let Some(x) = found else { return Err(not_found(id)) };
    let agent_token = st.node.sandbox_token(SandboxTokenKind::Agent, id);
    let traffic_token = st.node.sandbox_token(SandboxTokenKind::Traffic, id);
    match port {
        ENVD_PORT => {
            // The agent checks the token (or a signed URL); a wrong one stops here,
            // except on /health, which envd answers to anyone.
            if req.uri().path() != "/health" && token_is(req, ACCESS_TOKEN_HEADER, &agent_token) == Some(false) {
                return Err(E2bError::new(StatusCode::UNAUTHORIZED, "invalid access token").into_response());
            }
        }
        _ => {
            let access = token_is(req, ACCESS_TOKEN_HEADER, &agent_token) == Some(true);
            let traffic = token_is(req, TRAFFIC_TOKEN_HEADER, &traffic_token) == Some(true);
            let public = x
                .network
                .as_deref()
                .and_then(|n| serde_json::from_str::<serde_json::Value>(n).ok())
                .and_then(|n| n.get("allowPublicTraffic").and_then(|v| v.as_bool()))
                .unwrap_or(true);
            let needs_token = port == CODE_INTERPRETER_PORT || !public;
            if needs_token && !access && !traffic {
                return Err(E2bError::new(
                    StatusCode::FORBIDDEN,
                    format!("port {port} of sandbox {id} needs its access or traffic token"),
                )
                .into_response());
            }
        }
    }
    // Observed paused while desired running is a resume under way: the request waits
    // for it in forward(), it is not refused.
    if x.desired == Desired::Paused && !x.auto_resume {
        return Err(paused(id));
    }
    Ok(())
}

/// E2B's answer for traffic to a paused sandbox.
fn paused(id: &str) -> Response {
    (
        StatusCode::BAD_GATEWAY,
        Json(json!({ "sandboxId": id, "message": format!("The sandbox {id} is paused"), "code": 502 })),
    )
        .into_response()
}

/// Whether a request may resume a paused sandbox: it carries the sandbox's access or
/// traffic token, or (to envd's `/files`) a signed URL that is valid now.
fn may_resume(st: &AppState, id: &str, port: u16, req: &Request) -> bool {
    let agent_token = st.node.sandbox_token(SandboxTokenKind::Agent, id);
    let traffic_token = st.node.sandbox_token(SandboxTokenKind::Traffic, id);
    if token_is(req, ACCESS_TOKEN_HEADER, &agent_token) == Some(true)
        || token_is(req, TRAFFIC_TOKEN_HEADER, &traffic_token) == Some(true)
    {
        return true;
    }
    if port != ENVD_PORT || req.uri().path() != "/files" {
        return false;
    }
    let q: std::collections::HashMap<String, String> =
        form_urlencoded::parse(req.uri().query().unwrap_or_default().as_bytes())
            .into_owned()
            .collect();
    let Some(signature) = q.get("signature") else {
        return false;
    };
    let operation = match *req.method() {
        axum::http::Method::GET => "read",
        axum::http::Method::POST => "write",
        _ => return false,
    };
    let expiration = match q.get("signature_expiration").map(|e| e.parse::<i64>()) {
        None => None,
        Some(Ok(e)) => Some(e),
        Some(Err(_)) => return false,
    };
    if expiration.is_some_and(|e| e < (opendsec_edge_api::now_ms() / 1000) as i64) {
        return false;
    }
    let expected = signature::file_signature(
        &agent_token,
        q.get("path").map(String::as_str).unwrap_or_default(),
        operation,
        q.get("username").map(String::as_str).unwrap_or_default(),
        expiration,
    );
    signature.len() == expected.len()
        && signature
            .bytes()
            .zip(expected.bytes())
            .fold(0u8, |a, (x, y)| a | (x ^ y))
            == 0
}

/// E2B's signed-URL signature, shared with the agent (which checks it again).
#[path = "../../../edge/agent/src/signature.rs"]
mod signature;

async fn forward(st: &AppState, id: String, port: u16, mut req: Request) -> Result<Response, Response> {
    if port != ENVD_PORT {
        // The sandbox's own servers never see the platform's tokens.
        req.headers_mut().remove(ACCESS_TOKEN_HEADER);
        req.headers_mut().remove(TRAFFIC_TOKEN_HEADER);
    }
    let found = st
        .node
        .read(|s| s.sandboxes.sandboxes.get(&id).filter(|x| x.is_live()).cloned());
    let Some(mut x) = found else { return Err(not_found(&id)) };
    // admit() let a paused one through only with auto-resume: it resumes on this request,
    // if the request proves it may reach the sandbox (anyone may knock on a public port,
    // but only a caller holding its tokens, or a signed URL, wakes it).
    if x.desired == Desired::Paused && !may_resume(st, &id, port, &req) {
        return Err(paused(&id));
    }
    if let Some(running) = super::api::ready_for_traffic(st, &x)
        .await
        .map_err(IntoResponse::into_response)?
    {
        x = running;
    }
    let address = st
        .node
        .read(|s| s.placement.edges.get(&x.edge).map(|e| e.address.clone()));
    let Some(address) = address else {
        return Err(E2bError::new(
            StatusCode::BAD_GATEWAY,
            format!("the edge of sandbox {id} is not registered"),
        )
        .into_response());
    };
    let path_and_query = req.uri().path_and_query().map(|p| p.as_str()).unwrap_or("/");
    let uri: Uri = format!("/sandboxes/{id}{path_and_query}")
        .parse()
        .map_err(|_| E2bError::new(StatusCode::BAD_REQUEST, "malformed request path").into_response())?;
    req.headers_mut().remove(SANDBOX_ID_HEADER);
    req.headers_mut().remove(SANDBOX_PORT_HEADER);
    req.headers_mut().remove(opendsec_edge_api::headers::EDGE_KEY_HEADER);
    req.headers_mut().remove(opendsec_edge_api::headers::PORT_HEADER);
    if port != ENVD_PORT {
        req.headers_mut()
            .insert(opendsec_edge_api::headers::PORT_HEADER, HeaderValue::from(port));
    }
    req.headers_mut()
        .insert(opendsec_edge_api::headers::AFTER_HEADER, HeaderValue::from(x.index));
    let req = req.map(Body::new);
    crate::edge_client::forward(st, &address, uri, req)
        .await
        .map_err(|e| E2bError::new(StatusCode::BAD_GATEWAY, e.0).into_response())
}

/// `GET path` on an edge's proxy, as an E2B result.
pub(super) async fn edge_get(st: &AppState, address: &str, path: &str) -> Result<(u16, axum::body::Bytes), E2bError> {
    crate::edge_client::get(st, address, path)
        .await
        .map_err(|e| E2bError::new(StatusCode::BAD_GATEWAY, e.0))
}
