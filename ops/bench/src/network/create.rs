//! Create to first output, with and without sandbox networking: the sandboxes
//! benchmark's create path (`crate::sandboxes::create`: `POST /v1/sandboxes
//! {"image": "busybox"}`, then at once the agent's `process.Process/Start` of `echo
//! hi`, the clock stopping at the first stdout bytes; one warm-up run; each sandbox
//! deleted and freed before the next) on an `opendsec up` with networking and on one
//! with `--no-sandbox-network`, both in the edge's namespace, one after the other.
//!
//! `opendsec up` keeps its default `--warm-sandboxes 2`: a create claims a warm
//! container, so with networking its path holds the hand-over of the warm container's
//! namespace and the first application of the sandbox's policy (one nftables transaction),
//! not the making of the namespace and veth (the warm container had them made). Before
//! the runs, one busybox sandbox is made and removed and the pool is waited for.
//!
//! Two series per `opendsec up`: back to back (the next create as soon as the last
//! sandbox is freed, as the sandboxes benchmark does: the edge is then still refilling
//! its pool, with networking a namespace, veth and nft chain each, and removes the last
//! sandbox's network whenever no create runs), and spaced (each create once the pool holds [`POOL`] warm
//! containers again and [`QUIET`] has passed, so only the create's own path is timed).

use std::time::{Duration, Instant};

use serde_json::json;

use crate::sandboxes::UpGuard;
use crate::sandboxes::create::{CreateRuns, first_output_runs, first_output_runs_paced};

/// Warm containers per image (`opendsec up`'s default `--warm-sandboxes`).
const POOL: usize = 2;
/// How long a spaced create waits once the pool is full.
const QUIET: Duration = Duration::from_millis(300);

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

/// Waits (at most 15 s) until the pool holds [`POOL`] warm containers.
async fn pool_full(up: &UpGuard) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while warm_containers(up) < POOL && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Both series on one `opendsec up`.
pub(super) struct Creates {
    pub(super) back_to_back: CreateRuns,
    pub(super) spaced: CreateRuns,
}

/// `runs` creates (+1 warm-up) of a plain busybox sandbox on `up`, back to back, then
/// as many spaced, after its warm pool has been filled for busybox.
pub(super) async fn measure(up: &UpGuard, runs: usize) -> Creates {
    let body = json!({"image": "busybox"});
    let (id, _) = up.create_then_echo(&body, Duration::from_secs(120)).await;
    if let Some(id) = id {
        let _ = up.remove(&id).await;
    }
    pool_full(up).await;
    let back_to_back = first_output_runs(up, &body, runs).await;
    let spaced = first_output_runs_paced(up, &body, runs, async |up| {
        pool_full(up).await;
        tokio::time::sleep(QUIET).await;
    })
    .await;
    Creates { back_to_back, spaced }
}
