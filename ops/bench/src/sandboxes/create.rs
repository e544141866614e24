//! The REST create path: `POST /v1/sandboxes`, then at once (retrying while the gateway
//! answers 409/502/503) the agent's `process.Process/Start` of `/bin/sh -c 'echo hi'`
//! (Connect streaming JSON); the clock stops at the first stdout bytes. Each run is
//! deleted and freed before the next, so runs do not overlap.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::up::UpGuard;
use base64::Engine as _;

impl UpGuard {
    /// Runs `sh -c cmd` through the gateway's agent route as soon as the sandbox takes it;
    /// returns the instant the first stdout bytes arrived and all of stdout.
    pub async fn exec_first_output(&self, id: &str, cmd: &str, within: Duration) -> Result<(Instant, String), String> {
        let body = serde_json::to_vec(&json!({"process": {"cmd": "/bin/sh", "args": ["-c", cmd]}})).unwrap();
        let mut frame = vec![0u8];
        frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
        frame.extend_from_slice(&body);
        let url = format!("http://{}/v1/sandboxes/{id}/agent/process.Process/Start", self.http);
        let deadline = Instant::now() + within;
        let mut last = String::new();
        let mut resp = loop {
            if Instant::now() > deadline {
                return Err(format!(
                    "exec in {id}: not accepted within {within:?}; last answer: {last}"
                ));
            }
            let r = self
                .client
                .post(&url)
                .bearer_auth(&self.token)
                .header("content-type", "application/connect+json")
                .header("connect-protocol-version", "1")
                .body(frame.clone())
                .send()
                .await;
            match r {
                Ok(r) if r.status().is_success() => break r,
                Ok(r) => {
                    let st = r.status().as_u16();
                    last = format!(
                        "HTTP {st}: {}",
                        r.text().await.unwrap_or_default().chars().take(200).collect::<String>()
                    );
                    if st == 409 {
                        // 409 = ended: retry only while it has not really failed.
                        let s = self.state(id).await.unwrap_or_default();
                        if matches!(s.as_str(), "failed" | "exited" | "killed") {
                            return Err(format!("exec in {id}: sandbox {s} ({last})"));
                        }
                    } else if st != 502 && st != 503 {
                        return Err(format!("exec in {id}: {last}"));
                    }
                }
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        };
        let mut buf: Vec<u8> = Vec::new();
        let mut first: Option<Instant> = None;
        let mut out = Vec::new();
        loop {
            let chunk = match tokio::time::timeout_at(tokio::time::Instant::from_std(deadline), resp.chunk()).await {
                Ok(Ok(Some(c))) => c,
                Ok(Ok(None)) => break,
                Ok(Err(e)) => return Err(format!("exec in {id}: stream cut: {e}")),
                Err(_) => return Err(format!("exec in {id}: no end of stream within {within:?}")),
            };
            buf.extend_from_slice(&chunk);
            while buf.len() >= 5 {
                let n = u32::from_be_bytes(buf[1..5].try_into().unwrap()) as usize;
                if buf.len() < 5 + n {
                    break;
                }
                let flags = buf[0];
                let m: Value = serde_json::from_slice(&buf[5..5 + n]).unwrap_or(Value::Null);
                buf.drain(..5 + n);
                if flags & 2 != 0 {
                    if let Some(e) = m.get("error") {
                        return Err(format!("exec in {id}: {e}"));
                    }
                    continue;
                }
                if let Some(d) = m["event"]["data"]["stdout"].as_str() {
                    first.get_or_insert_with(Instant::now);
                    out.extend(base64::engine::general_purpose::STANDARD.decode(d).unwrap_or_default());
                }
            }
        }
        let first = first.ok_or_else(|| format!("exec in {id}: no stdout"))?;
        Ok((first, String::from_utf8_lossy(&out).to_string()))
    }
}

/// What the create-path runs measured.
pub(crate) struct CreateRuns {
    /// Create -> first stdout, sorted; the warm-up run is not in it.
    pub(crate) times: Vec<Duration>,
    /// The `config.json` the edge wrote for the first sandbox (the raw baseline runs it).
    pub(crate) config: Option<Value>,
    pub(crate) errors: Vec<String>,
}

impl UpGuard {
    /// Creates a sandbox of `body` and runs `echo hi` in it as soon as it takes it: the
    /// sandbox's id (when the create was accepted, so the caller can remove it) and the
    /// time from the create request to the first stdout bytes.
    pub async fn create_then_echo(&self, body: &Value, within: Duration) -> (Option<String>, Result<Duration, String>) {
        let t0 = Instant::now();
        let id = match self.create(body).await {
            Ok(id) => id,
            Err(e) => return (None, Err(e)),
        };
        let r = match self.exec_first_output(&id, "echo hi", within).await {
            Ok((_, out)) if out != "hi\n" => Err(format!("stdout {out:?}, expected \"hi\\n\"")),
            Ok((first, _)) => Ok(first - t0),
            Err(e) => Err(e),
        };
        (Some(id), r)
    }

    /// Deletes sandbox `id` and waits until the edge has freed it.
    pub async fn remove(&self, id: &str) -> Result<(), String> {
        self.delete(id).await?;
        self.wait_freed(id, Duration::from_secs(60)).await
    }
}

/// `runs` creates (+1 warm-up) of `body`, each timed to the first output of `echo hi`,
/// then deleted and freed; stops early after more than 5 errors.
pub(crate) async fn first_output_runs(up: &UpGuard, body: &Value, runs: usize) -> CreateRuns {
    first_output_runs_paced(up, body, runs, async |_| {}).await
}

/// [`first_output_runs`], awaiting `before_each` (not timed) before each create.
pub(crate) async fn first_output_runs_paced(
    up: &UpGuard,
    body: &Value,
    runs: usize,
    before_each: impl AsyncFn(&UpGuard),
) -> CreateRuns {
    let mut api: Vec<Duration> = Vec::new();
    let mut config: Option<Value> = None;
    let mut errors = Vec::new();
    for i in 0..=runs {
        before_each(up).await;
        let (id, r) = up.create_then_echo(body, Duration::from_secs(60)).await;
        match r {
            Ok(d) if i > 0 => api.push(d),
            Ok(_) => {}
            Err(e) => errors.push(format!("run {i}: {e}")),
        }
        let Some(id) = id else { continue };
        if config.is_none()
            && let Ok(b) = std::fs::read(up.sandboxes_dir().join(&id).join("config.json"))
        {
            config = serde_json::from_slice(&b).ok();
        }
        if let Err(e) = up.remove(&id).await {
            errors.push(e);
        }
        if errors.len() > 5 {
            break;
        }
    }
    api.sort_unstable();
    CreateRuns {
        times: api,
        config,
        errors,
    }
}
