//! Routing: `/health`, `/files`, and the Connect RPCs of `process.Process`
//! and `filesystem.Filesystem`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use serde_json::json;
use tokio::sync::mpsc;

use crate::connect::{self, Body, Code, EnvelopeReader, RpcError, stream_error, stream_response, unary_response};
use crate::files;
use crate::fs;
use crate::process::{self, Manager};
use crate::tunnel;
use crate::users::{self, User};

const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(50);

pub struct State {
    pub procs: Arc<Manager>,
    pub watchers: fs::Watchers,
    /// What every request but `/health` must carry (replaceable: see `rekey`).
    pub token: crate::rekey::AccessToken,
    /// A warm container's boot state until its sandbox claims it (see `claim`).
    pub claim: crate::claim::Pending,
    pub default_user: String,
    /// The start command's readiness, which `/health` reports.
    pub readiness: crate::start::Shared,
}

fn header<'a>(req: &'a Request<Incoming>, name: &str) -> Option<&'a str> {
    req.headers().get(name).and_then(|v| v.to_str().ok())
}

pub fn query_param<B>(req: &Request<B>, key: &str) -> Option<String> {
    let q = req.uri().query()?;
    for pair in q.split('&') {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if percent_decode(k) == key {
            return Some(percent_decode(v));
        }
    }
    None
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                match u8::from_str_radix(std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("zz"), 16) {
                    Ok(v) => {
                        out.push(v);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn keepalive_interval(req: &Request<Incoming>) -> Duration {
    header(req, "keepalive-ping-interval")
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|v| *v > 0.0 && v.is_finite())
        .map(|v| Duration::from_secs_f64(v.min(86400.0)))
        .unwrap_or(DEFAULT_KEEPALIVE)
}

impl State {
    /// The requesting user: `Authorization: Basic base64("<name>:")`, else
    /// the default user.
    fn user_of(&self, req: &Request<Incoming>, explicit: Option<String>) -> Result<User, RpcError> {
        let name = match explicit.filter(|n| !n.is_empty()) {
            Some(n) => n,
            None => {
                users::name_from_basic_auth(header(req, "authorization"))?.unwrap_or_else(|| self.default_user.clone())
            }
        };
        users::resolve(&name)
    }
}

/// A duplicate of a connection's socket, to notice a client that went away
/// while its stream is idle (hyper only notices when it next writes, and
/// the output it then drops would be lost to the next client).
pub struct ConnFd(pub Option<std::os::fd::OwnedFd>);

impl ConnFd {
    pub fn peer_closed(&self) -> bool {
        use std::os::fd::AsRawFd;
        let Some(fd) = &self.0 else { return false };
        let mut p = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: one valid pollfd, zero timeout.
        let n = unsafe { libc::poll(&mut p, 1, 0) };
        n > 0 && p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
    }
}

/// Every request but `/health` needs the access token (when the agent has
/// one) in `X-Access-Token`; `/files` also takes a signed URL instead.
fn authorize<B>(state: &State, req: &Request<B>, path: &str) -> Result<(), RpcError> {
    let Some(token) = state.token.get() else {
        return Ok(());
    };
    let token = &token;
    let denied = |m: &str| Err(RpcError::new(Code::Unauthenticated, m));
    if let Some(t) = req.headers().get("x-access-token") {
        return if constant_time_eq(t.as_bytes(), token.as_bytes()) {
            Ok(())
        } else {
            denied("invalid access token")
        };
    }
    let Some(signature) = query_param(req, "signature").filter(|_| path == "/files") else {
        return denied("missing access token");
    };
    let operation = match *req.method() {
        Method::GET => "read",
        Method::POST => "write",
        _ => return denied("signed URLs are for GET and POST /files"),
    };
    let expiration = match query_param(req, "signature_expiration") {
        None => None,
        Some(e) => match e.parse::<i64>() {
            Ok(e) => Some(e),
            Err(_) => return denied("invalid signature expiration"),
        },
    };
    let expected = file_signature(
        token,
        &query_param(req, "path").unwrap_or_default(),
        operation,
        &query_param(req, "username").unwrap_or_default(),
        expiration,
    );
    if !constant_time_eq(signature.as_bytes(), expected.as_bytes()) {
        return denied("invalid signature");
    }
    if let Some(e) = expiration {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or(i64::MAX);
        if e < now {
            return denied("signature is already expired");
        }
    }
    Ok(())
}

pub use crate::signature::file_signature;

pub async fn handle(
    state: Arc<State>,
    conn: Arc<ConnFd>,
    req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let path = req.uri().path().to_string();
    if path == "/health" && (req.method() == Method::GET || req.method() == Method::HEAD) {
        let unhealthy = state.readiness.lock().unwrap().unhealthy();
        if let Some(message) = unhealthy {
            return Ok(connect::json_response(
                StatusCode::SERVICE_UNAVAILABLE,
                &json!({"code": 503, "message": message}),
            ));
        }
        return Ok(Response::builder()
            .status(StatusCode::NO_CONTENT)
            .body(Body::empty())
            .expect("valid response"));
    }
    if let Err(e) = authorize(&state, &req, &path) {
        drain_later(req.into_body());
        return Ok(
            if path == "/files" || path == tunnel::PATH || path == crate::rekey::PATH || path == crate::claim::PATH {
                files::http_error(&e)
            } else {
                connect::unary_error(&e)
            },
        );
    }
    if path == crate::rekey::PATH {
        return Ok(crate::rekey::rekey(&state.token, req).await);
    }
    if path == crate::claim::PATH {
        return Ok(crate::claim::claim(&state.claim, &state.token, &state.procs, req).await);
    }
    if path == tunnel::PATH {
        return Ok(tunnel::open(req).await);
    }
    if path == "/files" {
        return Ok(files_route(state, req).await.unwrap_or_else(|e| files::http_error(&e)));
    }
    if req.method() != Method::POST {
        let message = format!("{} {path} is not served", req.method());
        drain_later(req.into_body());
        return Ok(connect::unary_error(&RpcError::new(Code::Unimplemented, message)));
    }
    let Some((service, method)) = path.trim_start_matches('/').split_once('/') else {
        drain_later(req.into_body());
        return Ok(connect::unary_error(&RpcError::new(
            Code::Unimplemented,
            format!("{path} is not served"),
        )));
    };
    let (service, method) = (service.to_string(), method.to_string());
    Ok(match (service.as_str(), method.as_str()) {
        ("process.Process", m) => process_rpc(state, conn, m, req).await,
        ("filesystem.Filesystem", m) => filesystem_rpc(state, m, req).await,
        _ => connect::unary_error(&RpcError::new(Code::Unimplemented, format!("{path} is not served"))),
    })
}

async fn files_route(state: Arc<State>, req: Request<Incoming>) -> Result<Response<Body>, RpcError> {
    let user = state.user_of(&req, query_param(&req, "username"))?;
    let path = query_param(&req, "path");
    match *req.method() {
        Method::GET => {
            let p = path.ok_or_else(|| RpcError::invalid("path is required"))?;
            files::get(user, &p, req.headers()).await
        }
        Method::POST => {
            let headers = req.headers().clone();
            let body = req.into_body();
            files::post(user, path.as_deref(), &headers, body).await
        }
        _ => Err(RpcError::new(Code::Unimplemented, "method not allowed on /files")),
    }
}

/// Most of a request body an answer that did not need it still reads (see
/// [`drain_later`]); a caller sending more loses its connection.
const DRAIN_LIMIT: usize = 1 << 20;

/// Reads the rest of a request body the answer did not need, in the background, up to
/// [`DRAIN_LIMIT`] bytes: hyper closes a connection whose request was not read to the
/// end, and unread bytes in the socket turn that close into a reset that can destroy
/// the answer (a refused caller would see a broken connection instead of its 401).
fn drain_later(mut body: Incoming) {
    use http_body_util::BodyExt;
    tokio::spawn(async move {
        let mut read = 0;
        while let Some(Ok(frame)) = body.frame().await {
            read += frame.data_ref().map_or(0, Bytes::len);
            if read > DRAIN_LIMIT {
                break;
            }
        }
    });
}

/// Reads the single request message of a server-streaming call.
async fn stream_request<T: serde::de::DeserializeOwned>(body: Incoming) -> Result<T, RpcError> {
    let mut r = EnvelopeReader::new(body);
    let msg = r
        .next()
        .await?
        .ok_or_else(|| RpcError::invalid("stream request has no message"))?;
    // Consume the rest of the request body (its end-of-stream envelope or
    // last chunk may still be in flight): hyper closes a connection whose
    // request was not read to the end, and unread bytes in the socket turn
    // that close into a reset that can destroy the response's tail.
    tokio::spawn(async move { while let Ok(Some(_)) = r.next().await {} });
    connect::decode(&msg)
}

async fn process_rpc(state: Arc<State>, conn: Arc<ConnFd>, method: &str, req: Request<Incoming>) -> Response<Body> {
    let procs = state.procs.clone();
    match method {
        "Start" | "Connect" => {
            let ka = keepalive_interval(&req);
            let user = state.user_of(&req, None);
            let body = req.into_body();
            let started = async {
                if method == "Start" {
                    let user = user?;
                    let r: process::StartRequest = stream_request(body).await?;
                    procs.start(r, &user)
                } else {
                    let r: process::SelectorRequest = stream_request(body).await?;
                    procs.attach(r.process.as_ref())
                }
            }
            .await;
            match started {
                Err(e) => stream_error(&e),
                Ok(attached) => {
                    let (tx, resp) = stream_response(4);
                    tokio::spawn(forward_process(attached, tx, ka, conn));
                    resp
                }
            }
        }
        "StreamInput" => {
            let body = req.into_body();
            let r = stream_input(&procs, body).await;
            let (tx, resp) = stream_response(2);
            match r {
                Ok(()) => {
                    let _ = tx.send(connect::message_frame(&json!({}))).await;
                    let _ = tx.send(connect::end_frame(None)).await;
                }
                Err(e) => {
                    let _ = tx.send(connect::end_frame(Some(&e))).await;
                }
            }
            resp
        }
        "List" => {
            let _: Result<serde_json::Value, _> = connect::read_unary(req.into_body()).await;
            unary_response(Ok(json!({ "processes": procs.list() })))
        }
        "SendInput" => {
            let r = async {
                let r: process::SendInputRequest = connect::read_unary(req.into_body()).await?;
                let p = procs.find(r.process.as_ref())?;
                write_input(&p, r.input.as_ref()).await?;
                Ok(json!({}))
            }
            .await;
            unary_response(r)
        }
        "SendSignal" => {
            let r = async {
                let r: process::SendSignalRequest = connect::read_unary(req.into_body()).await?;
                procs.signal(r.process.as_ref(), &r.signal)?;
                Ok(json!({}))
            }
            .await;
            unary_response(r)
        }
        "CloseStdin" => {
            let r = async {
                let r: process::SelectorRequest = connect::read_unary(req.into_body()).await?;
                procs.find(r.process.as_ref())?.close_stdin().await;
                Ok(json!({}))
            }
            .await;
            unary_response(r)
        }
        "Update" => {
            let r = async {
                let r: process::UpdateRequest = connect::read_unary(req.into_body()).await?;
                let p = procs.find(r.process.as_ref())?;
                if let Some(size) = r.pty.as_ref().and_then(|p| p.size.as_ref()) {
                    p.resize(size)?;
                }
                Ok(json!({}))
            }
            .await;
            unary_response(r)
        }
        m => connect::unary_error(&RpcError::new(
            Code::Unimplemented,
            format!("process.Process/{m} is not served"),
        )),
    }
}

async fn write_input(p: &process::Proc, input: Option<&process::Input>) -> Result<(), RpcError> {
    let Some(input) = input else { return Ok(()) };
    if let Some(s) = &input.stdin {
        p.write_stdin(&crate::json::unb64(s)?).await?;
    }
    if let Some(s) = &input.pty {
        p.write_pty(&crate::json::unb64(s)?).await?;
    }
    Ok(())
}

async fn stream_input(procs: &Manager, body: Incoming) -> Result<(), RpcError> {
    let mut r = EnvelopeReader::new(body);
    let mut target = None;
    while let Some(msg) = r.next().await? {
        let m: process::StreamInputRequest = connect::decode(&msg)?;
        if let Some(s) = m.start {
            target = Some(procs.find(s.process.as_ref())?);
        }
        if let Some(d) = m.data {
            let p = target
                .as_ref()
                .ok_or_else(|| RpcError::new(Code::FailedPrecondition, "data before start in StreamInput"))?;
            write_input(p, d.input.as_ref()).await?;
        }
    }
    Ok(())
}

/// Copies a process's events to a client's stream, with keepalives, then
/// the end-of-stream frame. When the client goes away the process keeps
/// running and the output the client did not get goes back to its backlog.
async fn forward_process(mut a: process::Attached, tx: mpsc::Sender<Bytes>, ka: Duration, conn: Arc<ConnFd>) {
    let first = std::mem::take(&mut a.first);
    for ev in first {
        if tx.send(connect::message_frame(&ev.to_json())).await.is_err() {
            return a.detach(None);
        }
    }
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + ka, ka);
    let check = Duration::from_millis(500);
    let mut gone = tokio::time::interval_at(tokio::time::Instant::now() + check, check);
    loop {
        tokio::select! {
            ev = a.rx.recv() => match ev {
                Some(ev) => {
                    if conn.peer_closed() {
                        return a.detach(Some(ev));
                    }
                    if let Err(e) = tx.send(connect::message_frame(&ev.to_json())).await {
                        drop(e);
                        return a.detach(Some(ev));
                    }
                }
                None => break,
            },
            _ = tick.tick() => {
                if tx.send(connect::message_frame(&process::keepalive_json())).await.is_err() {
                    return a.detach(None);
                }
            }
            _ = gone.tick() => {
                if conn.peer_closed() {
                    return a.detach(None);
                }
            }
            _ = tx.closed() => return a.detach(None),
        }
    }
    let _ = tx.send(connect::end_frame(None)).await;
}

async fn filesystem_rpc(state: Arc<State>, method: &str, req: Request<Incoming>) -> Response<Body> {
    let user = match state.user_of(&req, None) {
        Ok(u) => u,
        Err(e) => {
            return if method == "WatchDir" {
                stream_error(&e)
            } else {
                connect::unary_error(&e)
            };
        }
    };
    if method == "WatchDir" {
        let ka = keepalive_interval(&req);
        let w = async {
            let r: fs::WatchRequest = stream_request(req.into_body()).await?;
            fs::Watch::new(&user, &r)
        }
        .await;
        return match w {
            Err(e) => stream_error(&e),
            Ok(w) => {
                let (tx, resp) = stream_response(4);
                tokio::spawn(forward_watch(w, tx, ka));
                resp
            }
        };
    }
    let body = req.into_body();
    let r = async {
        match method {
            "Stat" => fs::stat(&user, connect::read_unary(body).await?).await,
            "MakeDir" => fs::make_dir(&user, connect::read_unary(body).await?).await,
            "Move" => fs::rename(&user, connect::read_unary(body).await?).await,
            "ListDir" => fs::list_dir(&user, connect::read_unary(body).await?).await,
            "Remove" => fs::remove(&user, connect::read_unary(body).await?).await,
            "CreateWatcher" => state.watchers.create(&user, connect::read_unary(body).await?),
            "GetWatcherEvents" => state.watchers.events(&user, connect::read_unary(body).await?),
            "RemoveWatcher" => state.watchers.remove(&user, connect::read_unary(body).await?),
            m => Err(RpcError::new(
                Code::Unimplemented,
                format!("filesystem.Filesystem/{m} is not served"),
            )),
        }
    }
    .await;
    unary_response(r)
}

async fn forward_watch(mut w: fs::Watch, tx: mpsc::Sender<Bytes>, ka: Duration) {
    if tx.send(connect::message_frame(&json!({"start": {}}))).await.is_err() {
        return;
    }
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + ka, ka);
    loop {
        tokio::select! {
            r = w.next() => match r {
                Ok(evs) => {
                    for e in evs {
                        if tx.send(connect::message_frame(&json!({"filesystem": e}))).await.is_err() {
                            return;
                        }
                    }
                }
                Err(e) => {
                    let _ = tx.send(connect::end_frame(Some(&e))).await;
                    return;
                }
            },
            _ = tick.tick() => {
                if tx.send(connect::message_frame(&json!({"keepalive": {}}))).await.is_err() {
                    return;
                }
            }
            _ = tx.closed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::file_signature;

    /// Vectors printed by the unmodified SDK's `e2b.sandbox.signature.get_signature`
    /// (e2b 2.63.0), the last one with the clock at 1700000000 and 60 s to live.
    #[test]
    fn signatures_match_what_the_e2b_sdk_makes() {
        assert_eq!(
            file_signature("tok-123", "/home/user/a b.txt", "read", "", None),
            "v1_iWKP4h+2B8CKBZjd5tQn/grLjOytF6xbAMqPrFOfecI"
        );
        assert_eq!(
            file_signature("tok-123", "data.bin", "write", "root", None),
            "v1_66Zxk2zY0aPaoV7hXHwLaFHJE4aDCke5NNQMr4hakOY"
        );
        assert_eq!(
            file_signature("tok-123", "/x", "read", "user", Some(1700000060)),
            "v1_x+MV3oOQk3Go64to0zGNxXC7/NvZu9tJfpWJMHTiL0A"
        );
    }
}
