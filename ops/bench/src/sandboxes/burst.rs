//! Bursts: N concurrent `POST /v1/sandboxes` (N tokio tasks), then polling the list
//! until every sandbox is running or has failed, with [`MemWatch`] sampling memory all
//! along; then delete them all (64 requests in flight) and wait until the edge freed them.

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

pub(super) async fn burst(up: &Arc<UpGuard>, o: &Options, body: &Value, n: usize) -> Result<Burst, String> {
    let pid = up.pid().ok_or("opendsec up is not running")?;
    let watch = MemWatch::start(pid, up.sandboxes_dir());
    let label = format!("{n}-{}", std::process::id());
    let mut b = body.clone();
    b["labels"] = json!({"burst": label});
    let t0 = Instant::now();
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
    let accepted = t0.elapsed();
    let deadline = t0 + o.burst_timeout;
    let (mut running, mut failed);
    let mut last_print = Instant::now();
    loop {
        running = count_state(up, &label, "running").await?.len();
        let f = count_state(up, &label, "failed").await?;
        failed = f.len() + count_state(up, &label, "exited").await?.len();
        if running + failed >= ids.len() || Instant::now() > deadline {
            if failed > 0
                && let Ok((200, v)) = up
                    .send(
                        reqwest::Method::GET,
                        &format!("/v1/sandboxes/{}", f.first().cloned().unwrap_or_default()),
                        None,
                    )
                    .await
            {
                first_errors.push(format!(
                    "failed sandbox: {}",
                    v.to_string().chars().take(400).collect::<String>()
                ));
            }
            break;
        }
        if last_print.elapsed() > Duration::from_secs(15) {
            last_print = Instant::now();
            eprintln!(
                "   ... {:.0} s: {running} running, {failed} failed of {}",
                t0.elapsed().as_secs_f64(),
                ids.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let settled = t0.elapsed();
    let not_settled = ids.len() - running - failed;
    let mem = watch.finish(&up.sandbox_dirs());
    eprintln!(
        "   settled in {:.1} s: {running} running, {failed} failed, {not_settled} not settled; deleting all",
        settled.as_secs_f64()
    );

    // Delete all (64 requests in flight), then wait until the edge has freed them.
    let t1 = Instant::now();
    let sem = Arc::new(tokio::sync::Semaphore::new(64));
    let mut tasks = Vec::new();
    for id in ids.clone() {
        let (up, sem) = (up.clone(), sem.clone());
        tasks.push(tokio::spawn(async move {
            let _p = sem.acquire().await;
            up.delete(&id).await
        }));
    }
    for t in tasks {
        if let Ok(Err(e)) = t.await {
            first_errors.push(e);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut left_over;
    loop {
        left_over = ids.iter().filter(|id| up.sandboxes_dir().join(id).exists()).count();
        if left_over == 0 || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
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
