//! The sandbox's agent through the gateway (`/v1/sandboxes/{id}/agent/...`): run
//! commands with their output streamed, drive a PTY session, copy files.
//!
//! The agent speaks E2B's envd protocol (Connect JSON): `process.Process/Start` is a
//! server stream of envelopes `[flags u8][len u32 BE][json]`; `SendInput` and
//! `Update` are unary JSON; `/files` moves raw bytes.

use base64::Engine;
use reqwest::{Method, RequestBuilder};
use serde_json::{Value, json};
use std::collections::BTreeMap;

use crate::{ApiError, Client};

/// Names the user in the sandbox (the gateway turns it into the agent's Basic auth).
pub const USER_HEADER: &str = "x-opendsec-user";

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;
const END_STREAM: u8 = 0x02;

/// A command to run in a sandbox: `cmd` is executed directly with `args` (no shell;
/// pass `cmd: "/bin/sh", args: ["-c", "..."]` for one).
#[derive(Clone, Debug, Default)]
pub struct ExecRequest {
    pub cmd: String,
    pub args: Vec<String>,
    pub envs: BTreeMap<String, String>,
    pub cwd: Option<String>,
    /// The user in the sandbox; the agent's default user when absent.
    pub user: Option<String>,
}

/// A chunk of a process's output, as it arrives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExecOutput {
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
}

/// An interactive process on a pseudo-terminal.
#[derive(Clone, Debug)]
pub struct PtyRequest {
    pub exec: ExecRequest,
    pub cols: u16,
    pub rows: u16,
}

/// What a PTY session yields.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PtyEvent {
    /// Terminal output (stdout and stderr are one stream on a PTY).
    Output(Vec<u8>),
    /// The process ended with this exit code; the session is over.
    Exit(i32),
}

/// A running PTY process: read its events with [`PtySession::next`]; send input and
/// resize through a [`PtyControl`] (cloneable, usable while `next` is pending).
pub struct PtySession {
    frames: Frames,
    control: PtyControl,
}

/// Sends input to and resizes a PTY process.
#[derive(Clone, Debug)]
pub struct PtyControl {
    client: Client,
    sandbox: String,
    pid: u32,
}

impl PtySession {
    pub fn pid(&self) -> u32 {
        self.control.pid
    }

    pub fn control(&self) -> PtyControl {
        self.control.clone()
    }

    /// The next output chunk or the exit. Cancel-safe (usable in `tokio::select!`).
    pub async fn next(&mut self) -> Result<PtyEvent, ApiError> {
        loop {
            match next_event(&mut self.frames).await? {
                Event::Pty(b) | Event::Stdout(b) | Event::Stderr(b) => return Ok(PtyEvent::Output(b)),
                Event::End(code) => return Ok(PtyEvent::Exit(code)),
                Event::Other => continue,
            }
        }
    }
}

impl PtyControl {
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Types `data` into the terminal.
    pub async fn send_input(&self, data: &[u8]) -> Result<(), ApiError> {
        let body = json!({"process": {"pid": self.pid}, "input": {"pty": B64.encode(data)}});
        self.client
            .agent_unary(&self.sandbox, "process.Process/SendInput", &body)
            .await
            .map(drop)
    }

    /// Resizes the terminal.
    pub async fn resize(&self, cols: u16, rows: u16) -> Result<(), ApiError> {
        let body = json!({"process": {"pid": self.pid}, "pty": {"size": {"cols": cols, "rows": rows}}});
        self.client
            .agent_unary(&self.sandbox, "process.Process/Update", &body)
            .await
            .map(drop)
    }
}

enum Event {
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    Pty(Vec<u8>),
    End(i32),
    Other,
}

/// The envelopes of a Connect server stream, read as they arrive.
struct Frames {
    resp: reqwest::Response,
    buf: Vec<u8>,
}

impl Frames {
    async fn next(&mut self) -> Result<Option<(u8, Value)>, ApiError> {
        loop {
            if self.buf.len() >= 5 {
                let len = u32::from_be_bytes(self.buf[1..5].try_into().expect("4 bytes")) as usize;
                if self.buf.len() >= 5 + len {
                    let flags = self.buf[0];
                    let v = serde_json::from_slice(&self.buf[5..5 + len])
                        .map_err(|e| ApiError::local("decode", format!("a stream message does not decode: {e}")))?;
                    self.buf.drain(..5 + len);
                    return Ok(Some((flags, v)));
                }
            }
            match self.resp.chunk().await {
                Ok(Some(c)) => self.buf.extend_from_slice(&c),
                Ok(None) if self.buf.is_empty() => return Ok(None),
                Ok(None) => {
                    return Err(ApiError::local(
                        "unreachable",
                        "the stream was cut off mid-message".into(),
                    ));
                }
                Err(e) => return Err(ApiError::local("unreachable", format!("the stream was cut off: {e}"))),
            }
        }
    }
}

async fn next_event(frames: &mut Frames) -> Result<Event, ApiError> {
    let Some((flags, v)) = frames.next().await? else {
        return Err(ApiError::local(
            "unreachable",
            "the stream ended before the process did".into(),
        ));
    };
    if flags & END_STREAM != 0 {
        return Err(match v.get("error") {
            Some(e) => connect_error(e),
            None => ApiError::local("unreachable", "the stream ended before the process did".into()),
        });
    }
    let ev = &v["event"];
    let bytes = |s: &Value| {
        B64.decode(s.as_str().unwrap_or(""))
            .map_err(|e| ApiError::local("decode", format!("output is not base64: {e}")))
    };
    let data = &ev["data"];
    Ok(if data.is_object() {
        if data["stdout"].is_string() {
            Event::Stdout(bytes(&data["stdout"])?)
        } else if data["stderr"].is_string() {
            Event::Stderr(bytes(&data["stderr"])?)
        } else if data["pty"].is_string() {
            Event::Pty(bytes(&data["pty"])?)
        } else {
            Event::Other
        }
    } else if ev["end"].is_object() {
        let end = &ev["end"];
        match end["exitCode"].as_i64() {
            Some(c) => Event::End(c as i32),
            // protojson leaves out zero values.
            None if end["error"].is_string() && end["exited"] != json!(true) => {
                return Err(ApiError {
                    status: 500,
                    code: "process_failed".into(),
                    message: end["error"].as_str().unwrap_or("").into(),
                    field: None,
                });
            }
            None => Event::End(0),
        }
    } else {
        Event::Other
    })
}

/// A Connect error (`{"code": "not_found", "message"}`) as an [`ApiError`].
fn connect_error(e: &Value) -> ApiError {
    let code = e["code"].as_str().unwrap_or("unknown").to_string();
    let status = match code.as_str() {
        "invalid_argument" | "out_of_range" | "failed_precondition" => 400,
        "unauthenticated" => 401,
        "permission_denied" => 403,
        "not_found" => 404,
        "already_exists" | "aborted" => 409,
        "resource_exhausted" => 429,
        "unimplemented" => 501,
        "unavailable" => 503,
        "deadline_exceeded" => 504,
        _ => 500,
    };
    ApiError {
        status,
        code,
        message: e["message"].as_str().unwrap_or("").to_string(),
        field: None,
    }
}

fn start_body(r: &ExecRequest, pty: Option<(u16, u16)>) -> Value {
    let mut process = json!({"cmd": r.cmd, "args": r.args, "envs": r.envs});
    if let Some(cwd) = &r.cwd {
        process["cwd"] = json!(cwd);
    }
    let mut body = json!({"process": process, "stdin": false});
    if let Some((cols, rows)) = pty {
        body["pty"] = json!({"size": {"cols": cols, "rows": rows}});
    }
    body
}

impl Client {
    /// A request to the sandbox's agent at `path` (e.g. `process.Process/Start`).
    fn agent_request(
        &self,
        method: Method,
        sandbox: &str,
        path: &str,
        query: &[(&str, String)],
        user: Option<&str>,
    ) -> RequestBuilder {
        let mut segments = vec!["v1", "sandboxes", sandbox, "agent"];
        segments.extend(path.split('/'));
        let mut req = self.request(method, &segments, query);
        if let Some(u) = user {
            req = req.header(USER_HEADER, u);
        }
        req
    }

    /// A unary Connect call to the agent.
    async fn agent_unary(&self, sandbox: &str, path: &str, body: &Value) -> Result<Value, ApiError> {
        let req = self
            .agent_request(Method::POST, sandbox, path, &[], None)
            .header("content-type", "application/json")
            .header("connect-protocol-version", "1")
            .body(body.to_string());
        let bytes = self
            .send(req)
            .await?
            .bytes()
            .await
            .map_err(|e| ApiError::local("unreachable", format!("the response was cut off: {e}")))?;
        Ok(serde_json::from_slice(&bytes).unwrap_or(Value::Null))
    }

    /// Starts a process; returns its pid and the rest of its event stream.
    async fn start_process(&self, sandbox: &str, user: Option<&str>, body: &Value) -> Result<(u32, Frames), ApiError> {
        let msg = body.to_string();
        let mut frame = Vec::with_capacity(5 + msg.len());
        frame.push(0);
        frame.extend_from_slice(&(msg.len() as u32).to_be_bytes());
        frame.extend_from_slice(msg.as_bytes());
        let req = self
            .agent_request(Method::POST, sandbox, "process.Process/Start", &[], user)
            .header("content-type", "application/connect+json")
            .header("connect-protocol-version", "1")
            .body(frame);
        let resp = self.send(req).await?;
        let mut frames = Frames { resp, buf: Vec::new() };
        loop {
            let Some((flags, v)) = frames.next().await? else {
                return Err(ApiError::local(
                    "unreachable",
                    "the stream ended before the process started".into(),
                ));
            };
            if flags & END_STREAM != 0 {
                return Err(v.get("error").map(connect_error).unwrap_or_else(|| {
                    ApiError::local("decode", "the stream ended before the process started".into())
                }));
            }
            if let Some(pid) = v["event"]["start"]["pid"].as_u64() {
                return Ok((pid as u32, frames));
            }
            if v["event"]["start"].is_object() {
                // protojson leaves out a zero pid; the agent never reports one.
                return Ok((0, frames));
            }
        }
    }

    /// Runs a command in the sandbox, handing each stdout/stderr chunk to `on_output`
    /// as it arrives; returns the exit code.
    pub async fn exec(
        &self,
        sandbox: &str,
        req: &ExecRequest,
        mut on_output: impl FnMut(ExecOutput),
    ) -> Result<i32, ApiError> {
        let (_, mut frames) = self
            .start_process(sandbox, req.user.as_deref(), &start_body(req, None))
            .await?;
        loop {
            match next_event(&mut frames).await? {
                Event::Stdout(b) | Event::Pty(b) => on_output(ExecOutput::Stdout(b)),
                Event::Stderr(b) => on_output(ExecOutput::Stderr(b)),
                Event::End(code) => return Ok(code),
                Event::Other => {}
            }
        }
    }

    /// Starts an interactive process on a pseudo-terminal of `cols` x `rows`.
    pub async fn pty(&self, sandbox: &str, req: &PtyRequest) -> Result<PtySession, ApiError> {
        let (pid, frames) = self
            .start_process(
                sandbox,
                req.exec.user.as_deref(),
                &start_body(&req.exec, Some((req.cols, req.rows))),
            )
            .await?;
        Ok(PtySession {
            frames,
            control: PtyControl {
                client: self.clone(),
                sandbox: sandbox.to_string(),
                pid,
            },
        })
    }

    /// Writes `data` to `path` in the sandbox (parents are created) as the default user.
    pub async fn upload(&self, sandbox: &str, path: &str, data: impl Into<Vec<u8>>) -> Result<(), ApiError> {
        self.upload_body(sandbox, path, None, reqwest::Body::from(data.into()))
            .await
    }

    /// Writes a streamed body to `path` in the sandbox as `user`.
    pub async fn upload_body(
        &self,
        sandbox: &str,
        path: &str,
        user: Option<&str>,
        body: reqwest::Body,
    ) -> Result<(), ApiError> {
        let req = self
            .agent_request(Method::POST, sandbox, "files", &[("path", path.to_string())], user)
            .header("content-type", "application/octet-stream")
            .body(body);
        let resp = self.send(req).await?;
        let _ = resp.bytes().await;
        Ok(())
    }

    /// Reads the file at `path` in the sandbox as the default user.
    pub async fn download(&self, sandbox: &str, path: &str) -> Result<Vec<u8>, ApiError> {
        let mut out = Vec::new();
        self.download_with(sandbox, path, None, |chunk, _, _| {
            out.extend_from_slice(chunk);
            Ok(())
        })
        .await?;
        Ok(out)
    }

    /// Streams the file at `path` in the sandbox, as `user`, chunk by chunk to
    /// `on_chunk(chunk, bytes so far, total size if known)`; returns the byte count.
    pub async fn download_with(
        &self,
        sandbox: &str,
        path: &str,
        user: Option<&str>,
        mut on_chunk: impl FnMut(&[u8], u64, Option<u64>) -> std::io::Result<()>,
    ) -> Result<u64, ApiError> {
        let req = self.agent_request(Method::GET, sandbox, "files", &[("path", path.to_string())], user);
        let mut resp = self.send(req).await?;
        let total = resp.content_length();
        let mut done = 0u64;
        loop {
            match resp.chunk().await {
                Ok(Some(c)) => {
                    done += c.len() as u64;
                    on_chunk(&c, done, total)
                        .map_err(|e| ApiError::local("io", format!("cannot write the download: {e}")))?;
                }
                Ok(None) => break,
                Err(e) => return Err(ApiError::local("unreachable", format!("the download was cut off: {e}"))),
            }
        }
        if let Some(t) = total.filter(|t| *t != done) {
            return Err(ApiError::local(
                "unreachable",
                format!("the download was cut off at {done} of {t} bytes"),
            ));
        }
        Ok(done)
    }
}
