//! A minimal client of the agent in a guest, over the VM's channel: `/health` (the
//! readiness check) and `process.Process/Start` to completion (Connect's envelope
//! framing, JSON messages; stdout and stderr arrive base64-encoded). The edge's proxy
//! forwards bytes and needs none of this; the driver's readiness check, the tests and
//! the benchmark do. `exec` goes through `opendsec_http::send_on`; `health` and
//! `rekey` are blocking exchanges (`crate::agent_http`) over std's `TcpStream`, because
//! the VM driver calls them from its own threads, where no async runtime runs.

use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use http_body_util::BodyExt;
use opendsec_http::TokioIo;
use serde_json::{Value, json};

use super::VmError;

/// Where a guest's agent listens: an address inside the VM's network namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentChannel {
    pub netns: PathBuf,
    pub addr: SocketAddr,
}

/// What a process printed and how it ended.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExecOutput {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub exit_code: i32,
}

impl ExecOutput {
    pub fn stdout_text(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
}

impl AgentChannel {
    /// A TCP connection to the agent (blocking socket).
    pub fn connect(&self, timeout: Duration) -> std::io::Result<TcpStream> {
        super::net::connect_in(&self.netns, self.addr, timeout)
    }

    /// The HTTP status of `GET /health`.
    pub fn health(&self, timeout: Duration) -> std::io::Result<u16> {
        let stream = self.connect(timeout)?;
        stream.set_read_timeout(Some(timeout))?;
        crate::agent_http::status(stream, crate::agent_http::HEALTH)
    }

    /// Gives the agent a new access token (`POST /.opendsec/rekey`), proving the current
    /// one, with `entropy` for the guest kernel's generator (mixed in and reseeded from
    /// before the token changes). Returns the agent's HTTP status: 204 when it took both
    /// (or already had the token), 401 when `current` is not its token, 500 when the
    /// guest could not be reseeded.
    pub fn rekey(&self, current: &str, new: &str, entropy: &[u8], timeout: Duration) -> std::io::Result<u16> {
        let stream = self.connect(timeout)?;
        stream.set_read_timeout(Some(timeout))?;
        let body = json!({"access_token": new, "entropy": hex::encode(entropy)});
        crate::agent_http::status(
            stream,
            crate::agent_http::post_json("/.opendsec/rekey", current, &body).as_bytes(),
        )
    }

    /// Polls `/health` until it answers 2xx; returns how long that took.
    pub fn wait_ready(&self, timeout: Duration, alive: &dyn Fn() -> bool) -> Result<Duration, VmError> {
        let start = Instant::now();
        let mut last = String::from("no answer yet");
        while start.elapsed() < timeout {
            if !alive() {
                return Err(VmError::Agent(format!(
                    "the VM ended before its agent answered ({last})"
                )));
            }
            match self.health(Duration::from_millis(500)) {
                Ok(code) if (200..300).contains(&code) => return Ok(start.elapsed()),
                Ok(code) => last = format!("/health answered {code}"),
                Err(e) => last = e.to_string(),
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(VmError::Timeout {
            what: format!("the guest agent ({last})"),
            seconds: timeout.as_secs(),
        })
    }

    /// Runs `cmd args` in the guest (as the agent's default user) and collects its
    /// output until it ends.
    pub async fn exec(&self, token: &str, cmd: &str, args: &[&str]) -> Result<ExecOutput, VmError> {
        self.exec_inner(token, None, cmd, args).await
    }

    /// Like [`exec`](Self::exec), as `user` (E2B's `Authorization: Basic <user>:`).
    pub async fn exec_as(&self, token: &str, user: &str, cmd: &str, args: &[&str]) -> Result<ExecOutput, VmError> {
        self.exec_inner(token, Some(user), cmd, args).await
    }

    async fn exec_inner(
        &self,
        token: &str,
        user: Option<&str>,
        cmd: &str,
        args: &[&str],
    ) -> Result<ExecOutput, VmError> {
        let agent_err = |e: &dyn std::fmt::Display| VmError::Agent(e.to_string());
        let channel = self.clone();
        let stream = tokio::task::spawn_blocking(move || channel.connect(Duration::from_secs(10)))
            .await
            .map_err(|e| agent_err(&e))?
            .map_err(|e| agent_err(&format!("connecting: {e}")))?;
        stream.set_nonblocking(true).map_err(|e| agent_err(&e))?;
        let stream = tokio::net::TcpStream::from_std(stream).map_err(|e| agent_err(&e))?;
        let message = json!({"process": {"cmd": cmd, "args": args}}).to_string();
        let mut body = vec![0u8];
        body.extend_from_slice(&(message.len() as u32).to_be_bytes());
        body.extend_from_slice(message.as_bytes());
        let mut request = hyper::Request::post("/process.Process/Start")
            .header("host", "agent")
            .header("content-type", "application/connect+json")
            .header("connect-protocol-version", "1")
            .header("x-access-token", token);
        if let Some(user) = user {
            request = request.header(
                "authorization",
                format!("Basic {}", base64_encode(format!("{user}:").as_bytes())),
            );
        }
        let request = request.body(opendsec_http::full(body)).expect("a valid request");
        let response = opendsec_http::send_on("the guest's agent", TokioIo::new(stream), request)
            .await
            .map_err(|e| agent_err(&e))?;
        let status = response.status();
        let bytes = response
            .into_body()
            .collect()
            .await
            .map_err(|e| agent_err(&e))?
            .to_bytes();
        if !status.is_success() {
            return Err(VmError::Agent(format!(
                "process.Process/Start answered {status}: {}",
                String::from_utf8_lossy(&bytes)
            )));
        }
        parse_start_stream(&bytes)
    }
}

/// Folds the envelopes of a `process.Process/Start` response into the output.
pub(crate) fn parse_start_stream(mut bytes: &[u8]) -> Result<ExecOutput, VmError> {
    let mut out = ExecOutput::default();
    let mut ended = false;
    while !bytes.is_empty() {
        if bytes.len() < 5 {
            return Err(VmError::Agent("a truncated Connect envelope".into()));
        }
        let flags = bytes[0];
        let len = u32::from_be_bytes(bytes[1..5].try_into().expect("4 bytes")) as usize;
        let payload = bytes
            .get(5..5 + len)
            .ok_or_else(|| VmError::Agent("a truncated Connect envelope".into()))?;
        bytes = &bytes[5 + len..];
        let message: Value =
            serde_json::from_slice(payload).map_err(|e| VmError::Agent(format!("a bad Connect message: {e}")))?;
        if flags & 0x02 != 0 {
            // End of stream: an error, or {} after a normal end.
            if let Some(err) = message.get("error") {
                return Err(VmError::Agent(format!("the stream ended with {err}")));
            }
            continue;
        }
        let event = &message["event"];
        if let Some(data) = event.get("data") {
            for (key, sink) in [("stdout", &mut out.stdout), ("stderr", &mut out.stderr)] {
                if let Some(b64) = data.get(key).and_then(Value::as_str) {
                    sink.extend(base64_decode(b64).ok_or_else(|| VmError::Agent("bad base64 output".into()))?);
                }
            }
        } else if let Some(end) = event.get("end") {
            // proto3 JSON leaves out a zero exit code.
            out.exit_code = end.get("exitCode").and_then(Value::as_i64).unwrap_or(0) as i32;
            ended = true;
        }
    }
    if !ended {
        return Err(VmError::Agent("the process stream closed without an end event".into()));
    }
    Ok(out)
}

/// Standard base64 with padding.
pub(crate) fn base64_encode(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let n = u32::from_be_bytes([0, b[0], b[1], b[2]]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Standard base64 (padding optional).
pub(crate) fn base64_decode(text: &str) -> Option<Vec<u8>> {
    fn value(c: u8) -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    }
    let text = text.trim_end_matches('=').as_bytes();
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    for chunk in text.chunks(4) {
        let mut acc = 0u32;
        for (i, c) in chunk.iter().enumerate() {
            acc |= value(*c)? << (18 - 6 * i);
        }
        let bytes = acc.to_be_bytes();
        match chunk.len() {
            4 => out.extend_from_slice(&bytes[1..4]),
            3 => out.extend_from_slice(&bytes[1..3]),
            2 => out.push(bytes[1]),
            _ => return None,
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_decodes_with_and_without_padding() {
        assert_eq!(base64_decode("aGkK").unwrap(), b"hi\n");
        assert_eq!(base64_decode("NDIK").unwrap(), b"42\n");
        assert_eq!(base64_decode("YQ==").unwrap(), b"a");
        assert_eq!(base64_decode("YWI").unwrap(), b"ab");
        assert_eq!(base64_decode("").unwrap(), b"");
        assert!(base64_decode("a").is_none());
        assert!(base64_decode("!!!!").is_none());
        for text in [&b""[..], b"a", b"ab", b"abc", b"root:", b"\xff\x00\x10"] {
            assert_eq!(base64_decode(&base64_encode(text)).unwrap(), text);
        }
        assert_eq!(base64_encode(b"root:"), "cm9vdDo=");
    }

    #[test]
    fn a_start_stream_folds_into_output_and_exit_code() {
        let mut stream = Vec::new();
        for (flags, msg) in [
            (0u8, r#"{"event":{"start":{"pid":7}}}"#),
            (0, r#"{"event":{"data":{"stdout":"NDIK"}}}"#),
            (0, r#"{"event":{"data":{"stderr":"b29wcw=="}}}"#),
            (
                0,
                r#"{"event":{"end":{"exitCode":3,"exited":true,"status":"exit status 3"}}}"#,
            ),
            (2, "{}"),
        ] {
            stream.push(flags);
            stream.extend_from_slice(&(msg.len() as u32).to_be_bytes());
            stream.extend_from_slice(msg.as_bytes());
        }
        let out = parse_start_stream(&stream).unwrap();
        assert_eq!(out.stdout, b"42\n");
        assert_eq!(out.stderr, b"oops");
        assert_eq!(out.exit_code, 3);
        assert!(parse_start_stream(&stream[..10]).is_err());
    }
}
