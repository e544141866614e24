//! Bursts: N concurrent `POST /v1/sandboxes` (N tokio tasks, [`create_many`]), then
//! polling the list until every sandbox is running or has failed ([`settle`]), with
//! [`MemWatch`] sampling memory all along; then delete them all (64 requests in flight)
//! and wait until the edge freed them ([`delete_all`]). The images benchmark's disk
//! measurement uses the same three steps.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::Options;
use super::memory::{MemPeak, MemWatch};
use super::up::UpGuard;

pub(super) struct Burst {
    pub(super) accepted: Duration,
    pub(super) settled: Duration,
    pub(super) running: usize,
    pub(super) http_errors: usize,
    pub(super) failed: usize,
    pub(super) not_settled: usize,
    pub(super) first_errors: Vec<String>,
    pub(super) mem: MemPeak,
    pub(super) freed: Duration,
    pub(super) left_over: usize,
}

async fn count_state(up: &UpGuard, label: &str, state: &str) -> Result<Vec<String>, String> {
    let (st, v) = up
        .send(
            reqwest::Method::GET,
            &format!("/v1/sandboxes?label=burst%3D{label}&state={state}"),
            None,
        )
        .await?;
    if st != 200 {
        return Err(format!("list: HTTP {st}: {v}"));
    }
    Ok(v["sandboxes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s["id"].as_str().map(str::to_string))
        .collect())
}

/// What [`settle`] saw last.
pub(crate) struct Settled {
    pub(crate) running: usize,
    /// Failed or exited.
    pub(crate) failed: usize,
    /// One failed sandbox's record, abridged, if any failed.
    pub(crate) first_failure: Option<String>,
}

/// `n` concurrent creates of `body` labelled `burst=<label>`: the ids accepted, and the
/// first errors of those refused with how many were.
pub(crate) async fn create_many(
    up: &Arc<UpGuard>,
    body: &Value,
    label: &str,
    n: usize,
) -> (Vec<String>, usize, Vec<String>) {
    let mut b = body.clone();
    b["labels"] = json!({"burst": label});
    let mut tasks = Vec::with_capacity(n);
    for _ in 0..n {
        let (up, b) = (up.clone(), b.clone());
        tasks.push(tokio::spawn(async move { up.create(&b).await }));
    }
    let mut ids = Vec::new();
    let mut first_errors = Vec::new();
    let mut http_errors = 0;
    for t in tasks {
        match t.await {
            Ok(Ok(id)) => ids.push(id),
            Ok(Err(e)) => {
                http_errors += 1;
                if first_errors.len() < 3 {
                    first_errors.push(e);
                }
            }
            Err(e) => {
                http_errors += 1;
                first_errors.push(format!("task: {e}"));
            }
        }
    }
    (ids, http_errors, first_errors)
}

/// Polls the sandboxes labelled `burst=<label>` until `n` are running or have failed, or
/// `deadline` passes; says how far it is every 15 s.
pub(crate) async fn settle(up: &UpGuard, label: &str, n: usize, deadline: Instant) -> Result<Settled, String> {
    let t0 = Instant::now();
    let mut last_print = Instant::now();
    loop {
        let running = count_state(up, label, "running").await?.len();
        let f = count_state(up, label, "failed").await?;
        let failed = f.len() + count_state(up, label, "exited").await?.len();
        if running + failed >= n || Instant::now() > deadline {
            let mut first_failure = None;
            if failed > 0
                && let Ok((200, v)) = up
                    .send(
                        reqwest::Method::GET,
                        &format!("/v1/sandboxes/{}", f.first().cloned().unwrap_or_default()),
                        None,
                    )
                    .await
            {
                first_failure = Some(v.to_string().chars().take(400).collect::<String>());
            }
            return Ok(Settled {
                running,
                failed,
                first_failure,
            });
        }
        if last_print.elapsed() > Duration::from_secs(15) {
            last_print = Instant::now();
            eprintln!(
                "   ... {:.0} s: {running} running, {failed} failed of {n}",
                t0.elapsed().as_secs_f64()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Deletes `ids` (64 requests in flight), then waits up to 300 s until the edge has
/// freed them; returns how many it had not, and adds errors to `errors`.
pub(crate) async fn delete_all(up: &Arc<UpGuard>, ids: &[String], errors: &mut Vec<String>) -> usize {
    let sem = Arc::new(tokio::sync::Semaphore::new(64));
    let mut tasks = Vec::new();
    for id in ids {
        let (up, sem, id) = (up.clone(), sem.clone(), id.clone());
        tasks.push(tokio::spawn(async move {
            let _p = sem.acquire().await;
            up.delete(&id).await
        }));
    }
    for t in tasks {
        if let Ok(Err(e)) = t.await {
            errors.push(e);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let left_over = ids.iter().filter(|id| up.sandboxes_dir().join(id).exists()).count();
        if left_over == 0 || Instant::now() > deadline {
            return left_over;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

pub(super) async fn burst(up: &Arc<UpGuard>, o: &Options, body: &Value, n: usize) -> Result<Burst, String> {
    let pid = up.pid().ok_or("opendsec up is not running")?;
    let watch = MemWatch::start(pid, up.sandboxes_dir());
    let label = format!("{n}-{}", std::process::id());
    let t0 = Instant::now();
    let (ids, http_errors, mut first_errors) = create_many(up, body, &label, n).await;
    let accepted = t0.elapsed();
    let s = settle(up, &label, ids.len(), t0 + o.burst_timeout).await?;
    first_errors.extend(s.first_failure.map(|f| format!("failed sandbox: {f}")));
    let (running, failed) = (s.running, s.failed);
    let settled = t0.elapsed();
    let not_settled = ids.len().saturating_sub(running + failed);
    let mem = watch.finish(&up.sandbox_dirs());
    eprintln!(
        "   settled in {:.1} s: {running} running, {failed} failed, {not_settled} not settled; deleting all",
        settled.as_secs_f64()
    );
    let t1 = Instant::now();
    let left_over = delete_all(up, &ids, &mut first_errors).await;
    Ok(Burst {
        accepted,
        settled,
        running,
        http_errors,
        failed,
        not_settled,
        first_errors,
        mem,
        freed: t1.elapsed(),
        left_over,
    })
}
