//! `opendsec-bench sandboxes`: container sandboxes through the REST API of a real
//! `opendsec up` (control plane, gateway and embedded edge in one process), beside the
//! raw OCI runtime. [`run`] measures, in order, each in its own module:
//!
//! 1. [`create`]: create to first exec output through the REST API; beside it [`raw`]:
//!    `crun run` and `runc run` of the bundle the edge wrote.
//! 2. [`pause`]: pause and resume latency.
//! 3. [`burst`]: bursts of N concurrent creates (total time, failures) with [`memory`]
//!    sampling `opendsec up`'s peak RSS and the sandboxes' shims and agents meanwhile.
//!
//! [`report`] turns each measurement into a summary line. Everything it starts is torn
//! down by [`up::UpGuard`] and the raw bundles on drop (also on error).

pub(crate) mod burst;
pub(crate) mod create;
pub(crate) mod host;
mod memory;
mod pause;
pub(crate) mod raw;
mod report;
mod up;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;

pub use host::mounts_under;
pub use report::Results;
pub use up::{FORGET_NETWORK_CMD, UpConfig, UpGuard, UpNetns, emergency_teardown, forget_network_here};

use crate::log_tail;

/// Goal: p50 create-to-first-output within this many times raw `crun run`.
pub const CREATE_VS_CRUN: f64 = 3.0;

#[derive(Clone, Debug)]
pub struct Options {
    pub runs: usize,
    pub pause_runs: usize,
    pub bursts: Vec<usize>,
    pub image: String,
    pub data_dir: PathBuf,
    pub opendsec_bin: PathBuf,
    pub agent_bin: PathBuf,
    pub image_dir: PathBuf,
    pub burst_timeout: Duration,
    pub skip_runc: bool,
}

pub async fn run(o: Options) -> Results {
    let mut report = Results::new();
    let max_burst = o.bursts.iter().copied().max().unwrap_or(0);
    let capacity = (max_burst + 16) as u64;
    eprintln!(
        "== starting opendsec up (edge capacity {capacity} sandboxes, 64 MB disks) under {}",
        o.data_dir.display()
    );
    let up_config = UpConfig {
        dir: o.data_dir.join(format!("sandboxes-{}", std::process::id())),
        opendsec_bin: o.opendsec_bin.clone(),
        agent_bin: o.agent_bin.clone(),
        image_dir: o.image_dir.clone(),
        extra_args: Vec::new(),
        netns: None,
    };
    let up = match UpGuard::start(&up_config, capacity).await {
        Ok(u) => Arc::new(u),
        Err(e) => {
            report.lines.push(format!("FAILED: {e}"));
            report.failed = true;
            return report;
        }
    };
    let body = json!({"image": o.image, "memory_mb": 64, "cpu_millis": 100});

    // 1. create -> first output, and the raw runtime beside it.
    eprintln!(
        "== create to first exec output through the REST API, {} runs (+1 warm-up)",
        o.runs
    );
    let created = create::first_output_runs(&up, &body, o.runs).await;
    report.create_runs(&created);
    let crun_p50 = raw::baseline(
        &up.dir.join("raw"),
        &o.image_dir,
        &o.image,
        o.runs,
        o.skip_runc,
        created.config.as_ref(),
        &mut report,
    )
    .await;
    report.create_vs_crun(&created.times, crun_p50);

    // 2. pause / resume.
    eprintln!("== pause and resume through the API, {} rounds", o.pause_runs);
    report.pause_resume(pause::pause_resume(&up, &body, o.pause_runs).await);

    // 3. bursts.
    let mut largest_ok = None;
    for &n in &o.bursts {
        eprintln!("== burst of {n} concurrent creates");
        match burst::burst(&up, &o, &body, n).await {
            Ok(b) => {
                report.burst(n, &b, o.burst_timeout);
                if b.http_errors + b.failed + b.not_settled == 0 {
                    largest_ok = Some(n);
                }
                if b.left_over > 0 {
                    report.line(format!(
                        "burst {n}: {} sandboxes not freed within 300 s; larger bursts skipped",
                        b.left_over
                    ));
                    break;
                }
                if b.not_settled > 0 {
                    report.line(format!(
                        "burst {n} did not settle within {} s; larger bursts skipped (they cannot settle either)",
                        o.burst_timeout.as_secs()
                    ));
                    break;
                }
            }
            Err(e) => {
                report.failure(format!("burst {n}: FAILED: {e}"));
                break;
            }
        }
    }
    report.line(match largest_ok {
        Some(n) => format!("largest burst with 0 failures: {n}"),
        None => "no burst ran with 0 failures".into(),
    });
    let up_log = up.log.clone();
    let warnings = std::fs::read_to_string(&up_log)
        .map(|s| s.lines().filter(|l| l.contains("WARN") || l.contains("ERROR")).count())
        .unwrap_or(0);
    if warnings > 0 {
        eprintln!(
            "(`opendsec up` logged {warnings} warnings/errors; last lines:\n{})",
            log_tail(&up_log, 5)
        );
    }
    // Graceful: remove whatever is left through the API first.
    if let Ok((200, v)) = up.send(reqwest::Method::GET, "/v1/sandboxes", None).await {
        for s in v["sandboxes"].as_array().into_iter().flatten() {
            if let Some(id) = s["id"].as_str() {
                let _ = up.delete(id).await;
            }
        }
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    while !up.sandbox_dirs().is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(up);
    report
}
