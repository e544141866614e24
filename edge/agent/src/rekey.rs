//! `POST /.opendsec/rekey` with `{"access_token": "<new>"}`: replaces the access token
//! every later request must carry. A microVM restored from another's memory (a fork
//! copy, a sandbox started from a snapshot) wakes up holding its source's token; its
//! edge proves it knows that token (the request needs it, like every other) and gives
//! the copy its own. The new token is handed to every later server of this agent (the
//! supervisor keeps it in the state it hands over), so a restarted server keeps it.
//! Asked again with the new token itself, it changes nothing: the edge may repeat it.
//!
//! The body may carry `"entropy": "<hex>"`, bytes from the edge's generator: they are
//! mixed into the guest kernel's pool and its generator reseeded (see `entropy.rs`)
//! before the token changes, so a copy never draws its source's random numbers. If that
//! fails the answer is 500 and nothing changes: the edge fails the copy rather than run
//! it with a generator it shares.

use std::sync::RwLock;

use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use serde_json::json;

use crate::connect::{Body, json_response};

pub const PATH: &str = "/.opendsec/rekey";
/// A token longer than this is not one of ours.
const MAX_TOKEN: usize = 512;

/// The access token, replaceable at run time.
pub struct AccessToken(RwLock<Option<String>>);

impl AccessToken {
    pub fn new(token: Option<String>) -> Self {
        Self(RwLock::new(token))
    }

    pub fn get(&self) -> Option<String> {
        self.0.read().unwrap().clone()
    }

    /// Replaces the token, and tells the supervisor, which hands it to the next server.
    pub fn replace(&self, token: String) {
        if self.get().as_deref() == Some(token.as_str()) {
            return;
        }
        *self.0.write().unwrap() = Some(token.clone());
        if let Some(link) = crate::chronus::link() {
            link.save_state("access_token", json!(token));
        }
    }
}

/// What [`access_token`] accepts, as a 400 says it.
pub const TOKEN_RULE: &str = "access_token must be 1 to 512 printable characters";

/// The body's `access_token`, if it is one the agent takes.
pub fn access_token(body: &serde_json::Value) -> Option<String> {
    let t = body.get("access_token")?.as_str()?;
    (!t.is_empty() && t.len() <= MAX_TOKEN && t.bytes().all(|b| b.is_ascii_graphic())).then(|| t.to_string())
}

pub fn error(status: StatusCode, message: impl Into<String>) -> Response<Body> {
    json_response(status, &json!({"code": status.as_u16(), "message": message.into()}))
}

/// Serves an already authorised rekey request.
pub async fn rekey(token: &AccessToken, req: Request<Incoming>) -> Response<Body> {
    if req.method() != hyper::Method::POST {
        return error(StatusCode::METHOD_NOT_ALLOWED, "use POST");
    }
    let body = match http_body_util::Limited::new(req.into_body(), 4096).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("reading the body: {e}")),
    };
    let body = match serde_json::from_slice::<serde_json::Value>(&body) {
        Ok(v) => v,
        Err(e) => {
            return error(StatusCode::BAD_REQUEST, format!("the body is not JSON: {e}"));
        }
    };
    let Some(new) = access_token(&body) else {
        return error(StatusCode::BAD_REQUEST, TOKEN_RULE);
    };
    if let Some(entropy) = body.get("entropy") {
        let Some(bytes) = entropy
            .as_str()
            .and_then(|h| hex::decode(h).ok())
            .filter(|b| !b.is_empty() && b.len() <= crate::entropy::MAX_BYTES)
        else {
            return error(
                StatusCode::BAD_REQUEST,
                format!("entropy must be 1 to {} bytes in hex", crate::entropy::MAX_BYTES),
            );
        };
        if let Err(e) = crate::entropy::mix_and_reseed(&bytes) {
            return error(StatusCode::INTERNAL_SERVER_ERROR, format!("entropy: {e}"));
        }
    }
    if token.get().as_deref() != Some(new.as_str()) {
        token.replace(new);
        eprintln!("opendsec-agent: the access token was replaced");
    }
    Response::builder()
        .status(StatusCode::NO_CONTENT)
        .body(Body::empty())
        .expect("valid response")
}
