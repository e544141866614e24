//! `POST /.opendsec/claim` with `{"access_token": "<sandbox's>", "env": {...}}`: a warm
//! container started ahead of its sandbox (`BootConfig::warm`) becomes that sandbox. Its
//! agent and start command (a code interpreter with its kernels up) run already, under
//! the edge's token for the warm container and the image's variables. The claim, which
//! must carry that token like every request, gives every process started from now on
//! the sandbox's variables, writes them to a start command that reads its stdin
//! (`StartCommand::claim_stdin`) and closes that stdin, and last replaces the token: a
//! request with the sandbox's token finds the sandbox's variables in force. The new
//! boot state goes to the supervisor, so that a restarted server keeps it. A second
//! claim, or one to an agent that was not warm, answers 409 and changes nothing.

use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};

use crate::config::{START_TAG, SandboxEnv};
use crate::connect::Body;
use crate::process::Manager;
use crate::rekey::{AccessToken, error};

pub const PATH: &str = "/.opendsec/claim";
/// Largest claim body: the environment (at most 256 KiB) escaped, and the token.
const MAX_BODY: usize = 2 << 20;

/// The boot state of a warm agent not yet claimed (None once claimed, or never warm).
pub struct Pending(tokio::sync::Mutex<Option<crate::BootParts>>);

impl Pending {
    pub fn new(boot: crate::BootParts) -> Self {
        Self(tokio::sync::Mutex::new(boot.warm.then_some(boot)))
    }
}

/// The line a `claim_stdin` start command reads: `{"env": {...}}` and a newline.
pub fn line(env: &SandboxEnv) -> Vec<u8> {
    let mut out = serde_json::to_vec(&serde_json::json!({ "env": env })).expect("a map of strings");
    out.push(b'\n');
    out
}

/// Writes the claim line to the start command's stdin and closes it (once).
pub async fn tell_start_command(procs: &Manager, env: &SandboxEnv) {
    let Some(start) = procs.find_tag(START_TAG) else {
        return;
    };
    if let Err(e) = start.write_stdin(&line(env)).await {
        eprintln!(
            "opendsec-agent: writing the sandbox's variables to the start command: {}",
            e.message
        );
    }
    start.close_stdin().await;
}

/// Serves an already authorised claim request.
pub async fn claim(pending: &Pending, token: &AccessToken, procs: &Manager, req: Request<Incoming>) -> Response<Body> {
    if req.method() != hyper::Method::POST {
        return error(StatusCode::METHOD_NOT_ALLOWED, "use POST");
    }
    let body = match http_body_util::Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("reading the body: {e}")),
    };
    let body = match serde_json::from_slice::<serde_json::Value>(&body) {
        Ok(v) => v,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("the body is not JSON: {e}")),
    };
    let Some(new) = crate::rekey::access_token(&body) else {
        return error(StatusCode::BAD_REQUEST, crate::rekey::TOKEN_RULE);
    };
    let env: SandboxEnv = match body.get("env").cloned().map(serde_json::from_value) {
        None => SandboxEnv::new(),
        Some(Ok(env)) => env,
        Some(Err(_)) => {
            return error(
                StatusCode::BAD_REQUEST,
                "env must be an object of names to string values",
            );
        }
    };
    if let Err(e) = crate::config::check_env(&env, "env") {
        return error(StatusCode::BAD_REQUEST, e);
    }
    let mut pending = pending.0.lock().await;
    let Some(mut boot) = pending.take() else {
        return error(
            StatusCode::CONFLICT,
            "this agent is not a warm container's, or its sandbox has claimed it already",
        );
    };
    procs.set_env(env.clone());
    boot.env = env;
    boot.warm = false;
    if let Some(link) = crate::chronus::link() {
        link.save_state("boot", serde_json::to_value(&boot).expect("boot state serialises"));
    }
    if boot.start.as_ref().is_some_and(|s| s.claim_stdin) {
        tell_start_command(procs, &boot.env).await;
    }
    token.replace(new);
    Response::builder()
        .status(StatusCode::NO_CONTENT)
        .body(Body::empty())
        .expect("valid response")
}
