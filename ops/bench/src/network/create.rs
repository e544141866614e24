//! Create to first output, with and without sandbox networking: the sandboxes
//! benchmark's create path (`crate::sandboxes::create`: `POST /v1/sandboxes
//! {"image": "busybox"}`, then at once the agent's `process.Process/Start` of `echo
//! hi`, the clock stopping at the first stdout bytes; one warm-up run; each sandbox
//! deleted and freed before the next) on an `opendsec up` with networking and on one
//! with `--no-sandbox-network`, both in the edge's namespace, one after the other.
//!
//! `opendsec up` keeps its default `--warm-sandboxes 2`: a create claims a warm
//! container, so with networking its path holds the hand-over of the warm container's
//! namespace and the first application of the sandbox's policy (one `nft` transaction),
//! not the making of the namespace and veth (the warm container had them made). Before
//! the runs, one busybox sandbox is made and removed and the pool is waited for.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::sandboxes::UpGuard;
use crate::sandboxes::create::{CreateRuns, first_output_runs};

/// Warm containers in the pool (`<sandboxes>/.warmc-*`).
fn warm_containers(up: &UpGuard) -> usize {
    std::fs::read_dir(up.sandboxes_dir())
        .map(|d| {
            d.flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with(".warmc-"))
                .count()
        })
        .unwrap_or(0)
}

/// `runs` creates (+1 warm-up) of a plain busybox sandbox on `up`, after its warm pool
/// has been filled for busybox.
pub(super) async fn measure(up: &UpGuard, runs: usize) -> CreateRuns {
    let body = json!({"image": "busybox"});
    let (id, _) = up.create_then_echo(&body, Duration::from_secs(120)).await;
    if let Some(id) = id {
        let _ = up.remove(&id).await;
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    while warm_containers(up) < 2 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    first_output_runs(up, &body, runs).await
}
