//! Closed-loop load generator.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A boxed, `Send` future (the trait stays object-safe without `async_trait`).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Something a benchmark appends to. One `write` = one durable, acknowledged append.
pub trait WriteTarget: Send + Sync + 'static {
    /// Human-readable name, e.g. `"redb raw"`.
    fn name(&self) -> String;
    /// Append `payload`. `worker` is the worker index (`0..concurrency`), `seq` is unique
    /// and increasing in issue order across all workers of one run.
    fn write(&self, worker: usize, seq: u64, payload: Vec<u8>) -> BoxFuture<'_, Result<(), String>>;
}

/// Result of one [`run_load`] call (the measured phase only; warm-up excluded).
#[derive(Debug, Clone, serde::Serialize)]
pub struct LoadReport {
    pub target: String,
    pub concurrency: usize,
    pub payload_len: usize,
    /// Ops attempted in the measured phase.
    pub ops: usize,
    /// Successful ops.
    pub ok: usize,
    pub errors: usize,
    /// First error message seen, if any.
    pub first_error: Option<String>,
    pub elapsed: Duration,
    /// Successful ops per second of wall time.
    pub ops_per_sec: f64,
    pub p50: Duration,
    pub p99: Duration,
    pub max: Duration,
}

/// Warm-up ops run (with the same concurrency) before the measured phase.
pub fn warmup_ops(concurrency: usize) -> usize {
    concurrency.max(20)
}

struct Phase {
    latencies: Vec<Duration>,
    errors: usize,
    first_error: Option<String>,
    elapsed: Duration,
}

async fn run_phase(
    target: &Arc<dyn WriteTarget>,
    seq: &Arc<AtomicU64>,
    end_seq: u64,
    concurrency: usize,
    payload_len: usize,
) -> Phase {
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(concurrency);
    for worker in 0..concurrency {
        let target = target.clone();
        let seq = seq.clone();
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut errors = 0usize;
            let mut first_error = None;
            loop {
                let s = seq.fetch_add(1, Ordering::Relaxed);
                if s >= end_seq {
                    break;
                }
                let payload = make_payload(s, payload_len);
                let t0 = Instant::now();
                match target.write(worker, s, payload).await {
                    Ok(()) => lat.push(t0.elapsed()),
                    Err(e) => {
                        errors += 1;
                        first_error.get_or_insert(e);
                    }
                }
            }
            (lat, errors, first_error)
        }));
    }
    let mut phase = Phase {
        latencies: Vec::new(),
        errors: 0,
        first_error: None,
        elapsed: Duration::ZERO,
    };
    for t in tasks {
        match t.await {
            Ok((lat, errors, first_error)) => {
                phase.latencies.extend(lat);
                phase.errors += errors;
                if phase.first_error.is_none() {
                    phase.first_error = first_error;
                }
            }
            Err(e) => {
                phase.errors += 1;
                phase.first_error.get_or_insert(format!("worker task failed: {e}"));
            }
        }
    }
    phase.elapsed = start.elapsed();
    phase
}

/// Deterministic payload of `len` bytes (varies with `seq`, so nothing compresses it away).
pub fn make_payload(seq: u64, len: usize) -> Vec<u8> {
    let mut x = seq.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Run `concurrency` workers (tokio tasks) that together issue `total_ops` writes of
/// `payload_len` bytes, each worker waiting for its write before issuing the next
/// (closed loop). A warm-up of [`warmup_ops`] writes at the same concurrency runs first
/// and is not counted. Latency is per-op from issue to acknowledgement.
pub async fn run_load(
    target: Arc<dyn WriteTarget>,
    concurrency: usize,
    total_ops: usize,
    payload_len: usize,
) -> LoadReport {
    let concurrency = concurrency.max(1);
    let seq = Arc::new(AtomicU64::new(0));
    let warm = warmup_ops(concurrency) as u64;
    let _ = run_phase(&target, &seq, warm, concurrency, payload_len).await;
    // Workers overshoot the counter by one each; restart exactly at `warm`.
    seq.store(warm, Ordering::SeqCst);
    let mut p = run_phase(&target, &seq, warm + total_ops as u64, concurrency, payload_len).await;
    p.latencies.sort_unstable();
    let ok = p.latencies.len();
    LoadReport {
        target: target.name(),
        concurrency,
        payload_len,
        ops: total_ops,
        ok,
        errors: p.errors,
        first_error: p.first_error,
        elapsed: p.elapsed,
        ops_per_sec: ok as f64 / p.elapsed.as_secs_f64().max(1e-9),
        p50: percentile(&p.latencies, 0.50),
        p99: percentile(&p.latencies, 0.99),
        max: p.latencies.last().copied().unwrap_or_default(),
    }
}

/// Nearest-rank percentile of a sorted slice (zero if empty).
pub fn percentile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Sleepy;
    impl WriteTarget for Sleepy {
        fn name(&self) -> String {
            "sleepy".into()
        }
        fn write(&self, _w: usize, seq: u64, p: Vec<u8>) -> BoxFuture<'_, Result<(), String>> {
            Box::pin(async move {
                assert_eq!(p.len(), 8);
                tokio::time::sleep(Duration::from_millis(1)).await;
                if seq % 10 == 3 {
                    Err(format!("fail {seq}"))
                } else {
                    Ok(())
                }
            })
        }
    }

    #[tokio::test]
    async fn counts_ops_and_errors() {
        let r = run_load(Arc::new(Sleepy), 4, 100, 8).await;
        assert_eq!(r.ops, 100);
        assert_eq!(r.ok + r.errors, 100);
        assert_eq!(r.errors, 10); // seqs 20..120: 23,33,...,113
        assert!(r.p50 >= Duration::from_millis(1));
        assert!(r.p99 >= r.p50);
    }

    #[test]
    fn percentile_nearest_rank() {
        let v: Vec<_> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(percentile(&v, 0.5), Duration::from_millis(50));
        assert_eq!(percentile(&v, 0.99), Duration::from_millis(99));
    }
}
