//! Pause and resume through the API: `POST .../pause`, then poll `GET` every 5 ms
//! until `paused`; `POST .../resume`, until `running`; then the sandbox must still run
//! a command.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::up::UpGuard;

pub(super) async fn pause_resume(
    up: &UpGuard,
    body: &Value,
    rounds: usize,
) -> Result<(Vec<Duration>, Vec<Duration>), String> {
    let id = up.create(body).await?;
    let r = async {
        up.wait_state(&id, "running", Duration::from_millis(20), Duration::from_secs(60))
            .await?;
        let (mut p, mut r) = (Vec::new(), Vec::new());
        let poll = Duration::from_millis(5);
        for _ in 0..rounds {
            let t0 = Instant::now();
            let (st, v) = up
                .send(
                    reqwest::Method::POST,
                    &format!("/v1/sandboxes/{id}/pause"),
                    Some(json!({})),
                )
                .await?;
            if st >= 300 {
                return Err(format!("pause: HTTP {st}: {v}"));
            }
            up.wait_state(&id, "paused", poll, Duration::from_secs(30)).await?;
            p.push(t0.elapsed());
            let t0 = Instant::now();
            let (st, v) = up
                .send(
                    reqwest::Method::POST,
                    &format!("/v1/sandboxes/{id}/resume"),
                    Some(json!({})),
                )
                .await?;
            if st >= 300 {
                return Err(format!("resume: HTTP {st}: {v}"));
            }
            up.wait_state(&id, "running", poll, Duration::from_secs(30)).await?;
            r.push(t0.elapsed());
        }
        // It still runs commands after all that.
        let (_, out) = up.exec_first_output(&id, "echo hi", Duration::from_secs(30)).await?;
        if out != "hi\n" {
            return Err(format!("exec after pause/resume printed {out:?}"));
        }
        p.sort_unstable();
        r.sort_unstable();
        Ok((p, r))
    }
    .await;
    let _ = up.delete(&id).await;
    let _ = up.wait_freed(&id, Duration::from_secs(60)).await;
    r
}
