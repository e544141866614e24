//! Talking to edges: forwarding a request to an edge's proxy (streaming both ways,
//! carrying protocol upgrades such as WebSocket through) and simple GETs. The gateway
//! reaches every edge over mutual TLS (its own certificate; the edge must present that
//! edge's) and also sends that edge's own key. Requests go through the gateway's
//! one `opendsec_http::Client` (`AppState::edges`), which keeps connections to edges
//! alive; what to strip from requests and answers (hop-by-hop headers) is decided here.

use axum::body::Body;
use axum::http::{HeaderName, HeaderValue, Request, StatusCode, Uri, header};
use axum::response::Response;
use std::time::Duration;

use crate::AppState;
use opendsec_edge_api::headers::EDGE_KEY_HEADER;

/// How long connecting to an edge may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Hop-by-hop headers (RFC 9110 7.6.1), dropped when forwarding a response.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "trailer",
    "upgrade",
    "te",
];

/// Why an edge could not be reached.
pub struct Unreachable(pub String);

/// The edge's `host:port` from its registered address.
pub fn edge_host(address: &str) -> String {
    address.trim_start_matches("http://").trim_end_matches('/').to_string()
}

/// The client the gateway reaches edges with, as the component `trust` names:
/// connections are kept alive and reused (every request to a sandbox goes through one),
/// and a connect gives up after [`CONNECT_TIMEOUT`].
pub fn client(trust: std::sync::Arc<opendsec_trust::Trust>) -> opendsec_http::Client {
    opendsec_http::Client::with_trust(Some(CONNECT_TIMEOUT), trust)
}

/// Forwards `req` to `uri` on the edge at `address` (a registered edge's). The caller has
/// already removed the headers the edge must not see and added its own; this sets Host
/// and that edge's key, and relays an upgrade (101) in both directions.
pub async fn forward(st: &AppState, address: &str, uri: Uri, req: Request<Body>) -> Result<Response, Unreachable> {
    let host = edge_host(address);
    let host_value = HeaderValue::from_str(&host)
        .map_err(|_| Unreachable(format!("the edge address {host:?} is not a host:port")))?;
    // The edge's own key (never the cluster key: edges do not hold it).
    let edge = st
        .node
        .read(|s| {
            s.placement
                .edges
                .values()
                .find(|e| e.address == address)
                .map(|e| e.id.clone())
        })
        .ok_or_else(|| Unreachable(format!("no registered edge is at {address}")))?;
    let key = HeaderValue::from_str(&st.node.edge_key(&edge))
        .map_err(|_| Unreachable("the edge key is not a valid header value".into()))?;
    let wants_upgrade = req.headers().contains_key(header::UPGRADE);
    let (mut parts, body) = req.into_parts();
    if !wants_upgrade {
        for h in [
            "connection",
            "keep-alive",
            "proxy-connection",
            "te",
            "trailer",
            "upgrade",
        ] {
            parts.headers.remove(h);
        }
    }
    parts.headers.remove("transfer-encoding");
    parts.headers.insert(header::HOST, host_value);
    parts.headers.insert(HeaderName::from_static(EDGE_KEY_HEADER), key);
    parts.uri = uri;
    parts.version = axum::http::Version::HTTP_11;
    let to = opendsec_http::Endpoint::Edge {
        addr: host.clone(),
        edge,
    };
    let resp = st
        .edges
        .forward(&to, Request::from_parts(parts, body))
        .await
        .map_err(|e| {
            use opendsec_http::{ConnectError, Error};
            Unreachable(match e {
                Error::Connect {
                    source: ConnectError::Timeout(within),
                    ..
                } => format!("the edge at {host} did not answer within {} s", within.as_secs()),
                Error::Connect { source, .. } => format!("cannot reach the edge at {host}: {source}"),
                Error::BadEndpoint(_) => format!("the edge address {host:?} is not a host:port"),
                Error::Handshake { source, .. } => format!("HTTP handshake with the edge at {host} failed: {source}"),
                Error::Request { source, .. } => format!("the edge at {host} failed to answer: {source}"),
            })
        })?;
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        let (parts, body) = resp.into_parts();
        return Ok(Response::from_parts(parts, Body::new(body)));
    }
    let (mut parts, body) = resp.into_parts();
    for h in HOP_BY_HOP {
        parts.headers.remove(*h);
    }
    Ok(Response::from_parts(parts, Body::new(body)))
}

/// `GET path` on the edge's proxy: (status, body).
pub async fn get(st: &AppState, address: &str, path: &str) -> Result<(u16, axum::body::Bytes), Unreachable> {
    call(st, address, axum::http::Method::GET, path).await
}

/// `method path` (no body) on the edge's proxy: (status, body).
pub async fn call(
    st: &AppState,
    address: &str,
    method: axum::http::Method,
    path: &str,
) -> Result<(u16, axum::body::Bytes), Unreachable> {
    call_with_body(st, address, method, path, Vec::new()).await
}

/// `method path` with a JSON `body` on the edge's proxy: (status, body).
pub async fn call_with_body(
    st: &AppState,
    address: &str,
    method: axum::http::Method,
    path: &str,
    body: Vec<u8>,
) -> Result<(u16, axum::body::Bytes), Unreachable> {
    use http_body_util::BodyExt;
    let uri: Uri = path.parse().map_err(|_| Unreachable(format!("bad edge path {path}")))?;
    let with_body = !body.is_empty();
    let mut req = Request::new(Body::from(body));
    *req.method_mut() = method;
    if with_body {
        req.headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    }
    let resp = forward(st, address, uri, req).await?;
    let status = resp.status().as_u16();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| Unreachable(format!("reading the edge's answer: {e}")))?
        .to_bytes();
    Ok((status, body))
}
