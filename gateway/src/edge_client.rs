//! Talking to edges: forwarding a request to an edge's proxy (streaming both ways,
//! carrying protocol upgrades such as WebSocket through) and simple GETs. The gateway
//! authenticates to every edge with the cluster key.

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

async fn connect(host: &str) -> Result<hyper::client::conn::http1::SendRequest<Body>, Unreachable> {
    let tcp = match tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(host)).await {
        Ok(Ok(t)) => t,
        Ok(Err(e)) => return Err(Unreachable(format!("cannot reach the edge at {host}: {e}"))),
        Err(_) => {
            return Err(Unreachable(format!(
                "the edge at {host} did not answer within {} s",
                CONNECT_TIMEOUT.as_secs()
            )));
        }
    };
    let _ = tcp.set_nodelay(true);
    let (sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
        .await
        .map_err(|e| Unreachable(format!("HTTP handshake with the edge at {host} failed: {e}")))?;
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!(error = %e, "edge connection ended");
        }
    });
    Ok(sender)
}

/// Forwards `req` to `uri` on the edge at `address`. The caller has already removed
/// the headers the edge must not see and added its own; this sets Host and the edge key,
/// and relays an upgrade (101) in both directions.
pub async fn forward(st: &AppState, address: &str, uri: Uri, mut req: Request<Body>) -> Result<Response, Unreachable> {
    let host = edge_host(address);
    let host_value = HeaderValue::from_str(&host)
        .map_err(|_| Unreachable(format!("the edge address {host:?} is not a host:port")))?;
    let key = HeaderValue::from_str(&st.node.config().cluster_key)
        .map_err(|_| Unreachable("the cluster key is not a valid header value".into()))?;
    let wants_upgrade = req.headers().contains_key(header::UPGRADE);
    let client_side = wants_upgrade.then(|| hyper::upgrade::on(&mut req));
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
    let mut sender = connect(&host).await?;
    let mut resp = sender
        .send_request(Request::from_parts(parts, body))
        .await
        .map_err(|e| Unreachable(format!("the edge at {host} failed to answer: {e}")))?;
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        if let Some(client_side) = client_side {
            let edge_side = hyper::upgrade::on(&mut resp);
            tokio::spawn(async move {
                if let (Ok(c), Ok(e)) = (client_side.await, edge_side.await) {
                    let mut c = hyper_util::rt::TokioIo::new(c);
                    let mut e = hyper_util::rt::TokioIo::new(e);
                    let _ = tokio::io::copy_bidirectional(&mut c, &mut e).await;
                }
            });
        }
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
    use http_body_util::BodyExt;
    let uri: Uri = path.parse().map_err(|_| Unreachable(format!("bad edge path {path}")))?;
    let resp = forward(st, address, uri, Request::new(Body::empty())).await?;
    let status = resp.status().as_u16();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| Unreachable(format!("reading the edge's answer: {e}")))?
        .to_bytes();
    Ok((status, body))
}
