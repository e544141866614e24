//! `GET /.opendsec/tunnel?port=P[&wait_ms=W]` with `Connection: Upgrade` and
//! `Upgrade: opendsec-tcp`: a raw TCP tunnel to 127.0.0.1:P inside the
//! sandbox (the agent lives in the sandbox's network namespace). After
//! `101 Switching Protocols` the connection carries the port's bytes both
//! ways until both sides have closed; a half-close travels through.

use std::net::Ipv4Addr;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::json;
use tokio::net::TcpStream;

use crate::connect::{Body, json_response};

pub const PATH: &str = "/.opendsec/tunnel";
pub const PROTOCOL: &str = "opendsec-tcp";
/// Longest `wait_ms` honoured.
pub const MAX_WAIT: Duration = Duration::from_secs(30);
/// How often a refused connection is tried again while waiting.
const RETRY_EVERY: Duration = Duration::from_millis(15);
/// Copy buffer per direction.
const BUF: usize = 64 * 1024;

fn error(status: StatusCode, message: impl Into<String>) -> Response<Body> {
    json_response(status, &json!({"code": status.as_u16(), "message": message.into()}))
}

fn has_token(req: &Request<Incoming>, header: &str, token: &str) -> bool {
    req.headers()
        .get_all(header)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case(token))
}

/// What the request asks for: the port and how long to wait for it.
fn parse(req: &Request<Incoming>) -> Result<(u16, Duration), String> {
    if req.method() != hyper::Method::GET {
        return Err(format!("{PATH} takes GET"));
    }
    if !has_token(req, "connection", "upgrade") || !has_token(req, "upgrade", PROTOCOL) {
        return Err(format!(
            "{PATH} needs the headers Connection: Upgrade and Upgrade: {PROTOCOL}"
        ));
    }
    let port = crate::server::query_param(req, "port").ok_or("port is required")?;
    let port = port
        .parse::<u16>()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| format!("port must be a number from 1 to 65535, not {port:?}"))?;
    let wait = match crate::server::query_param(req, "wait_ms") {
        None => Duration::ZERO,
        Some(w) => Duration::from_millis(
            w.parse::<u64>()
                .map_err(|_| format!("wait_ms must be a number of milliseconds, not {w:?}"))?,
        )
        .min(MAX_WAIT),
    };
    Ok((port, wait))
}

/// Connects to the port, trying again while it refuses, until `wait` has passed.
async fn connect(port: u16, wait: Duration) -> Option<TcpStream> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        if let Ok(s) = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).await {
            return Some(s);
        }
        if tokio::time::Instant::now() + RETRY_EVERY > deadline {
            return None;
        }
        tokio::time::sleep(RETRY_EVERY).await;
    }
}

pub async fn open(req: Request<Incoming>) -> Response<Body> {
    let (port, wait) = match parse(&req) {
        Ok(v) => v,
        Err(m) => return error(StatusCode::BAD_REQUEST, m),
    };
    let Some(mut stream) = connect(port, wait).await else {
        return error(
            StatusCode::BAD_GATEWAY,
            format!("port {port} is not open in the sandbox"),
        );
    };
    let _ = stream.set_nodelay(true);
    tokio::spawn(async move {
        // The client's side of the connection, once hyper has sent the 101.
        let Ok(upgraded) = hyper::upgrade::on(req).await else {
            return;
        };
        let mut client = TokioIo::new(upgraded);
        // Each direction ends with a shutdown(Write) of its destination, so a
        // half-close on one side reaches the other while bytes still flow back.
        let _ = tokio::io::copy_bidirectional_with_sizes(&mut client, &mut stream, BUF, BUF).await;
    });
    Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header("connection", "upgrade")
        .header("upgrade", PROTOCOL)
        .body(Body::empty())
        .expect("valid response")
}
