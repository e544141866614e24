//! The edge's per-sandbox proxy: `ANY /sandboxes/{id}/{path}` is forwarded, streaming in
//! both directions, to the agent of sandbox `id` over its Unix socket (which lives
//! outside the sandbox). Only the control plane's gateway may call it: every request
//! must carry the edge key in `x-opendsec-edge-key`. `POST /admit` answers the
//! leader's admission requests (the edge's final word on what it runs).

use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use std::path::PathBuf;
use std::sync::Arc;
use tokio::net::{TcpListener, UnixStream};

/// The header the gateway authenticates to the edge with.
pub const EDGE_KEY_HEADER: &str = "x-opendsec-edge-key";

/// Finds the agent socket of a sandbox on this edge (None: no such sandbox here).
pub type Resolver = Arc<dyn Fn(&str) -> Option<PathBuf> + Send + Sync>;

/// Judges an admission request (`POST /admit`): `Err` says why the edge refuses.
pub type Admitter = Arc<dyn Fn(&opendsec_control::admission::AdmitRequest) -> Result<(), String> + Send + Sync>;

type Body = BoxBody<Bytes, hyper::Error>;

fn json_error(status: StatusCode, code: &str, message: &str) -> Response<Body> {
    let body = serde_json::json!({ "code": code, "message": message }).to_string();
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)).map_err(|never| match never {}).boxed())
        .expect("static response parts are valid")
}

fn key_matches(expected: &str, got: Option<&str>) -> bool {
    let got = got.unwrap_or("");
    expected.len() == got.len() && expected.bytes().zip(got.bytes()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

async fn admit(req: Request<Incoming>, admitter: Option<Admitter>) -> Response<Body> {
    let Some(admitter) = admitter else {
        return json_error(StatusCode::NOT_FOUND, "not_found", "this edge does not answer admission requests");
    };
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return json_error(StatusCode::BAD_REQUEST, "invalid_argument", &format!("admission body: {e}")),
    };
    let ask: opendsec_control::admission::AdmitRequest = match serde_json::from_slice(&body) {
        Ok(a) => a,
        Err(e) => return json_error(StatusCode::BAD_REQUEST, "invalid_argument", &format!("admission body: {e}")),
    };
    match admitter(&ask) {
        Ok(()) => Response::new(Full::new(Bytes::from_static(b"{}")).map_err(|never| match never {}).boxed()),
        Err(why) => json_error(StatusCode::CONFLICT, "refused", &why),
    }
}

async fn handle(req: Request<Incoming>, key: Arc<str>, resolve: Resolver, admitter: Option<Admitter>) -> Response<Body> {
    let got = req.headers().get(EDGE_KEY_HEADER).and_then(|v| v.to_str().ok());
    if !key_matches(&key, got) {
        return json_error(StatusCode::UNAUTHORIZED, "unauthenticated", "the edge proxy needs the edge key");
    }
    if req.uri().path() == "/admit" && req.method() == hyper::Method::POST {
        return admit(req, admitter).await;
    }
    let path = req.uri().path().to_string();
    let Some(rest) = path.strip_prefix("/sandboxes/") else {
        return json_error(StatusCode::NOT_FOUND, "not_found", "use /sandboxes/{id}/{agent path}");
    };
    let (id, tail) = rest.split_once('/').map(|(a, b)| (a.to_string(), format!("/{b}"))).unwrap_or((rest.to_string(), "/".to_string()));
    let id = id.as_str();
    let Some(socket) = resolve(id) else {
        return json_error(StatusCode::BAD_GATEWAY, "not_found", &format!("The sandbox {id} was not found on this edge"));
    };
    let stream = match UnixStream::connect(&socket).await {
        Ok(s) => s,
        Err(e) => {
            return json_error(StatusCode::BAD_GATEWAY, "unavailable", &format!("the agent of sandbox {id} does not answer: {e}"));
        }
    };
    let (mut sender, conn) = match hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await {
        Ok(x) => x,
        Err(e) => return json_error(StatusCode::BAD_GATEWAY, "unavailable", &format!("agent handshake failed: {e}")),
    };
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "agent connection ended");
        }
    });
    let path_and_query = match req.uri().query() {
        Some(q) => format!("{tail}?{q}"),
        None => tail,
    };
    let (mut parts, body) = req.into_parts();
    parts.headers.remove(EDGE_KEY_HEADER);
    parts.headers.insert(hyper::header::HOST, hyper::header::HeaderValue::from_static("agent"));
    parts.uri = match path_and_query.parse() {
        Ok(u) => u,
        Err(_) => return json_error(StatusCode::BAD_REQUEST, "invalid_argument", "malformed path"),
    };
    match sender.send_request(Request::from_parts(parts, body)).await {
        Ok(resp) => resp.map(|b| b.boxed()),
        Err(e) => json_error(StatusCode::BAD_GATEWAY, "unavailable", &format!("the agent of sandbox {id} failed: {e}")),
    }
}

/// Serves the proxy on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, key: String, resolve: Resolver) {
    serve_with_admission(listener, key, resolve, None).await
}

/// Serves the proxy, answering `POST /admit` with `admitter` when given.
pub async fn serve_with_admission(listener: TcpListener, key: String, resolve: Resolver, admitter: Option<Admitter>) {
    let key: Arc<str> = Arc::from(key);
    loop {
        let (tcp, _) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "edge proxy accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = tcp.set_nodelay(true);
        let (key, resolve, admitter) = (key.clone(), resolve.clone(), admitter.clone());
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| {
                let (key, resolve, admitter) = (key.clone(), resolve.clone(), admitter.clone());
                async move { Ok::<_, std::convert::Infallible>(handle(req, key, resolve, admitter).await) }
            });
            if let Err(e) = hyper::server::conn::http1::Builder::new().serve_connection(hyper_util::rt::TokioIo::new(tcp), svc).await {
                tracing::debug!(error = %e, "edge proxy connection ended");
            }
        });
    }
}
