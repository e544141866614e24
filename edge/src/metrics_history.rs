//! The recent metrics of the sandboxes an edge runs: one point every [`INTERVAL`] per
//! running sandbox, the last [`KEPT`] (8 h) of each kept in memory, served by the edge
//! proxy at `GET /metrics/{id}/history?start_ms&end_ms`. A paused sandbox gets no
//! points while it is paused; a sandbox gone from the edge is forgotten. An edge
//! restarted starts empty: the history is a view of the last hours, not a record.

use crate::proxy::Sample;
use serde::Serialize;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

/// How often a running sandbox is sampled.
pub const INTERVAL: Duration = Duration::from_secs(5);
/// Points kept per sandbox: 8 hours of them.
pub const KEPT: usize = 8 * 3600 / 5;

/// One point of a sandbox's history.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Point {
    /// When it was taken (ms since the Unix epoch).
    pub timestamp_ms: u64,
    pub cpu_count: u64,
    /// CPU used since the point before, in percent of the sandbox's CPUs (0–100).
    pub cpu_used_pct: f64,
    pub mem_used: u64,
    pub mem_total: u64,
    pub mem_cache: u64,
    pub disk_used: u64,
    pub disk_total: u64,
}

#[derive(Default)]
struct Series {
    points: VecDeque<Point>,
    /// The CPU time counted at the last sample (µs) and when (ms): the next point's
    /// CPU share is measured from it.
    last_cpu: Option<(u64, u64)>,
}

/// Every sandbox's series on this edge.
#[derive(Default)]
pub struct MetricsHistory {
    series: Mutex<BTreeMap<String, Series>>,
    kept: usize,
}

impl MetricsHistory {
    pub fn new() -> MetricsHistory {
        MetricsHistory::keeping(KEPT)
    }

    /// A history keeping the last `kept` points of each sandbox.
    pub fn keeping(kept: usize) -> MetricsHistory {
        MetricsHistory {
            series: Mutex::new(BTreeMap::new()),
            kept: kept.max(1),
        }
    }

    /// Records `sample`, taken at `now_ms`, for sandbox `id`. The first sample of a
    /// sandbox (or the first after a pause) only sets the CPU baseline: a share of CPU
    /// needs two readings.
    pub fn record(&self, id: &str, now_ms: u64, sample: &Sample) {
        let mut all = self.series.lock().expect("metrics history lock");
        let s = all.entry(id.to_string()).or_default();
        let before = s.last_cpu.replace((sample.cpu_usec, now_ms));
        let Some((cpu_before, at_before)) = before.filter(|(_, at)| *at < now_ms) else {
            return;
        };
        let elapsed_us = (now_ms - at_before) as f64 * 1000.0;
        let cpus = sample.cpu_count.max(1) as f64;
        let pct = (sample.cpu_usec.saturating_sub(cpu_before) as f64 / elapsed_us / cpus * 100.0).clamp(0.0, 100.0);
        if s.points.len() == self.kept {
            s.points.pop_front();
        }
        s.points.push_back(Point {
            timestamp_ms: now_ms,
            cpu_count: sample.cpu_count,
            cpu_used_pct: (pct * 100.0).round() / 100.0,
            mem_used: sample.mem_used,
            mem_total: sample.mem_total,
            mem_cache: sample.mem_cache,
            disk_used: sample.disk_used,
            disk_total: sample.disk_total,
        });
    }

    /// Keeps the series of the sandboxes `running` says run (sampled on), forgets those
    /// `here` says are gone from the edge; a sandbox here but not running (paused)
    /// keeps its points and loses its CPU baseline, so its first point after the pause
    /// does not count the pause as idle time.
    pub fn retain(&self, here: impl Fn(&str) -> bool, running: impl Fn(&str) -> bool) {
        let mut all = self.series.lock().expect("metrics history lock");
        all.retain(|id, _| here(id));
        for (id, s) in all.iter_mut() {
            if !running(id) {
                s.last_cpu = None;
            }
        }
    }

    /// The points of sandbox `id` taken from `start_ms` to `end_ms` (both included),
    /// oldest first; `None` when the edge has no series for it.
    pub fn range(&self, id: &str, start_ms: u64, end_ms: u64) -> Option<Vec<Point>> {
        let all = self.series.lock().expect("metrics history lock");
        let s = all.get(id)?;
        Some(
            s.points
                .iter()
                .filter(|p| (start_ms..=end_ms).contains(&p.timestamp_ms))
                .cloned()
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(cpu_usec: u64) -> Sample {
        Sample {
            cpu_usec,
            cpu_count: 2,
            mem_used: 10,
            mem_total: 100,
            disk_used: 5,
            disk_total: 50,
            ..Sample::default()
        }
    }

    #[test]
    fn a_point_measures_the_cpu_used_since_the_sample_before() {
        let h = MetricsHistory::new();
        h.record("a", 10_000, &sample(0));
        assert_eq!(
            h.range("a", 0, u64::MAX),
            Some(vec![]),
            "one reading is only a baseline"
        );
        // 5 s on 2 CPUs is 10 s of CPU time; 2.5 s of it is 25 %.
        h.record("a", 15_000, &sample(2_500_000));
        let points = h.range("a", 0, u64::MAX).unwrap();
        assert_eq!(points.len(), 1);
        assert_eq!(points[0].timestamp_ms, 15_000);
        assert_eq!(points[0].cpu_used_pct, 25.0);
        assert_eq!((points[0].mem_used, points[0].disk_total), (10, 50));
        assert_eq!(h.range("b", 0, u64::MAX), None, "no series for a sandbox never sampled");
    }

    #[test]
    fn a_range_includes_both_ends_and_the_oldest_points_go_first() {
        let h = MetricsHistory::keeping(3);
        for i in 0..=5u64 {
            h.record("a", i * 5000, &sample(i * 1000));
        }
        let all: Vec<u64> = h
            .range("a", 0, u64::MAX)
            .unwrap()
            .iter()
            .map(|p| p.timestamp_ms)
            .collect();
        assert_eq!(all, vec![15_000, 20_000, 25_000], "only the last 3 are kept");
        let some: Vec<u64> = h
            .range("a", 20_000, 25_000)
            .unwrap()
            .iter()
            .map(|p| p.timestamp_ms)
            .collect();
        assert_eq!(some, vec![20_000, 25_000]);
        assert_eq!(h.range("a", 26_000, 30_000), Some(vec![]));
    }

    #[test]
    fn a_paused_sandbox_keeps_its_points_and_a_gone_one_is_forgotten() {
        let h = MetricsHistory::new();
        for id in ["paused", "gone"] {
            h.record(id, 0, &sample(0));
            h.record(id, 5000, &sample(1000));
        }
        h.retain(|id| id != "gone", |_| false);
        assert_eq!(h.range("gone", 0, u64::MAX), None);
        assert_eq!(h.range("paused", 0, u64::MAX).unwrap().len(), 1);
        // After the pause, the first reading is a new baseline, not a point spanning it.
        h.record("paused", 600_000, &sample(2000));
        assert_eq!(h.range("paused", 0, u64::MAX).unwrap().len(), 1);
        h.record("paused", 605_000, &sample(3000));
        assert_eq!(h.range("paused", 0, u64::MAX).unwrap().len(), 2);
    }

    #[test]
    fn eight_hours_of_points_are_kept() {
        assert_eq!(KEPT, 5760);
    }
}
