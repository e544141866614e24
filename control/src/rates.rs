//! Write rates (`SetRateLimits`, in the log): enforced by the leader, which decides every
//! write, so a project's rate holds across the cluster whichever node a client calls.
//! The buckets themselves are soft state in the leader's memory (a new leader starts
//! them full): a write counts against every project on its caller's line that set
//! `writes_per_second`, and against its token at the line's `token_writes_per_second`.
//! Each bucket is a GCRA cell (one "theoretical arrival time" per key) allowing a burst
//! of one second's worth; a write over any of them is refused whole (429, Retry-After,
//! not logged) and counts against none. Edges' reports and registrations are never
//! limited: they say what happened, and refusing them would only delay the truth.

use opendsec_commands::{Command, Rejection, RejectionKind};
use opendsec_projections::State;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Buckets kept at most; past this, those already full again are dropped.
const MAX_BUCKETS: usize = 100_000;
/// The burst each rate allows: this long's worth of writes at once.
const BURST: Duration = Duration::from_secs(1);

#[derive(Default)]
pub struct RateLimiter {
    /// Per key, when its bucket is full again (its theoretical arrival time).
    cells: Mutex<HashMap<String, Instant>>,
}

impl RateLimiter {
    /// Admits one write to every `(key, per_second)` bucket, or none: then the bucket
    /// that refused it longest, and how long to wait.
    pub fn admit<'a>(&self, buckets: &'a [(String, u64)], now: Instant) -> Result<(), (&'a str, Duration)> {
        let mut cells = self.cells.lock().unwrap_or_else(|e| e.into_inner());
        let mut refused: Option<(&str, Duration)> = None;
        let mut next = Vec::with_capacity(buckets.len());
        for (key, rate) in buckets {
            let interval = Duration::from_secs(1) / (*rate).max(1) as u32;
            let tat = cells.get(key).copied().unwrap_or(now).max(now) + interval;
            let limit = now + BURST.max(interval);
            if tat > limit && refused.is_none_or(|(_, w)| tat - limit > w) {
                refused = Some((key, tat - limit));
            }
            next.push((key, tat));
        }
        if let Some(r) = refused {
            return Err(r);
        }
        for (key, tat) in next {
            cells.insert(key.clone(), tat);
        }
        if cells.len() > MAX_BUCKETS {
            cells.retain(|_, tat| *tat > now);
        }
        Ok(())
    }

    /// Admits a write of `cmd` by the token `token` of `project`, as `state` sets the rates.
    pub fn admit_write(&self, state: &State, project: &str, token: &str, cmd: &Command) -> Result<(), Rejection> {
        if matches!(
            cmd,
            Command::ReportSandbox { .. }
                | Command::ReportSnapshot { .. }
                | Command::ReportImage { .. }
                | Command::RegisterEdge { .. }
                | Command::DeregisterEdge { .. }
        ) {
            return Ok(());
        }
        let mut buckets: Vec<(String, u64)> = state
            .rate_lines(project)
            .into_iter()
            .map(|(p, r)| (format!("project {p}"), r))
            .collect();
        if let Some(r) = state.effective_rates(project).token_writes_per_second {
            buckets.push((format!("token {token}"), r));
        }
        if buckets.is_empty() {
            return Ok(());
        }
        let rate_of = |key: &str| buckets.iter().find(|(k, _)| k == key).map_or(0, |(_, r)| *r);
        self.admit(&buckets, Instant::now()).map_err(|(key, wait)| {
            let ms = wait.as_millis().max(1) as u64;
            let mut r = Rejection::new(
                RejectionKind::RateLimited,
                format!(
                    "{key} writes faster than its rate of {} a second; retry in {ms} ms (rates are set with `opendsecctl project rate-limits`)",
                    rate_of(key)
                ),
            );
            r.retry_after_ms = Some(ms);
            r
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_allows_a_seconds_burst_then_its_rate_and_refuses_whole() {
        let l = RateLimiter::default();
        let t0 = Instant::now();
        let b = |k: &str, r| vec![(k.to_string(), r)];
        for _ in 0..10 {
            l.admit(&b("p", 10), t0).unwrap();
        }
        let p10 = b("p", 10);
        let (key, wait) = l.admit(&p10, t0).unwrap_err();
        assert_eq!(key, "p");
        assert!(wait <= Duration::from_millis(100) && !wait.is_zero(), "{wait:?}");
        // After the wait, one more.
        l.admit(&b("p", 10), t0 + wait).unwrap();
        // A write over one bucket counts against none of the others.
        let both = vec![("p".to_string(), 10), ("q".to_string(), 10)];
        assert_eq!(l.admit(&both, t0 + wait).unwrap_err().0, "p");
        for _ in 0..10 {
            l.admit(&b("q", 10), t0 + wait).unwrap();
        }
    }
}
