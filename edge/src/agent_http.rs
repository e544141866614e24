//! The few blocking requests the edge makes to an agent from threads of its own, where
//! no async runtime runs (the VM driver's readiness check and re-key, the warm filler's
//! health check and claim): one short HTTP/1.1 exchange each, `Connection: close`, of
//! which only the status matters, over a container agent's Unix socket or a guest
//! agent's TCP stream. Written out rather than through hyper for that reason; the
//! proxy's and `exec`'s requests go through `opendsec_http`.

use std::io::{Read, Write};

/// `GET /health`: 204 once the sandbox's start command is ready.
pub const HEALTH: &[u8] = b"GET /health HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n";

/// `POST path` with JSON `body`, authenticated with the agent's access `token`.
pub fn post_json(path: &str, token: &str, body: &serde_json::Value) -> String {
    let body = body.to_string();
    format!(
        "POST {path} HTTP/1.1\r\nHost: agent\r\nConnection: close\r\nX-Access-Token: {token}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// Writes `request` on `stream` and returns the status of the answer.
pub fn status(mut stream: impl Read + Write, request: &[u8]) -> std::io::Result<u16> {
    stream.write_all(request)?;
    let mut head = [0u8; 12];
    stream.read_exact(&mut head)?;
    std::str::from_utf8(&head[9..12])
        .ok()
        .filter(|_| head.starts_with(b"HTTP/1.1 "))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other("the agent's answer is not HTTP"))
}
