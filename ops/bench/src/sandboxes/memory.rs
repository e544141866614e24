//! Memory sampling during a burst: a thread polls `opendsec up`'s RSS every 100 ms and
//! the summed RSS of the sandboxes' shims and agents once a second; VmHWM (reset through
//! `/proc/<pid>/clear_refs` when the watch starts) catches a peak between polls.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::host::read_pid;

#[derive(Default, Debug, Clone)]
pub struct MemPeak {
    /// `opendsec up`'s VmRSS when the watch started (before the burst), KiB.
    pub up_rss_before_kb: u64,
    /// Max VmRSS seen by polling, KiB.
    pub up_rss_kb: u64,
    /// AnonHugePages (transparent huge pages) of `opendsec up` at the polled max, KiB.
    pub up_huge_kb: u64,
    /// Most threads `opendsec up` had at one poll.
    pub up_threads: u64,
    /// VmHWM at the end (reset before the burst), KiB.
    pub up_hwm_kb: u64,
    /// Largest summed RSS of shims + agents (PID 1 of each sandbox), KiB, and how many
    /// sandboxes that sum covered.
    pub sandboxes_rss_kb: u64,
    pub sandboxes_at_peak: usize,
    pub min_mem_available_mb: u64,
}

/// A number field of `/proc/<pid>/status` (`VmRSS:`, `VmHWM:` in KiB, `Threads:`).
pub(super) fn proc_status_kb(pid: i32, field: &str) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = s.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// A field of `/proc/<pid>/smaps_rollup` in KiB (`AnonHugePages:`, ...).
fn smaps_rollup_kb(pid: i32, field: &str) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    let line = s.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn mem_available_mb() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? / 1024)
}

pub(super) fn mib(kb: u64) -> String {
    format!("{:.1} MiB", kb as f64 / 1024.0)
}

impl MemPeak {
    /// What `opendsec up` grew by per sandbox of an `n`-sandbox burst: (peak RSS - RSS
    /// before) / n, in KiB; the peak is VmHWM (it sees between polls) or the polled max.
    pub fn up_growth_per_sandbox_kb(&self, n: usize) -> f64 {
        let peak = self.up_hwm_kb.max(self.up_rss_kb);
        peak.saturating_sub(self.up_rss_before_kb) as f64 / n.max(1) as f64
    }
}

/// Summed VmRSS of the shim and PID 1 of each sandbox directory, and how many
/// sandboxes had at least one of them alive.
pub(super) fn sandboxes_rss(dirs: &[PathBuf]) -> (u64, usize) {
    let mut sum = 0;
    let mut n = 0;
    for d in dirs {
        let mut any = false;
        for f in ["shim.pid", "init.pid"] {
            if let Some(pid) = read_pid(&d.join(f))
                && let Some(kb) = proc_status_kb(pid, "VmRSS:")
            {
                sum += kb;
                any = true;
            }
        }
        n += any as usize;
    }
    (sum, n)
}

/// The sampling thread; [`MemWatch::finish`] stops it and returns the peaks.
pub(super) struct MemWatch {
    pid: i32,
    stop: Arc<AtomicBool>,
    peak: Arc<Mutex<MemPeak>>,
    thread: std::thread::JoinHandle<()>,
}

impl MemWatch {
    /// Resets `pid`'s VmHWM and starts polling it and the sandboxes under `sandboxes_dir`.
    pub(super) fn start(pid: i32, sandboxes_dir: PathBuf) -> MemWatch {
        let _ = std::fs::write(format!("/proc/{pid}/clear_refs"), "5");
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(Mutex::new(MemPeak {
            up_rss_before_kb: proc_status_kb(pid, "VmRSS:").unwrap_or(0),
            min_mem_available_mb: u64::MAX,
            ..Default::default()
        }));
        let thread = {
            let (stop, peak) = (stop.clone(), peak.clone());
            std::thread::spawn(move || {
                let mut last_scan = Instant::now() - Duration::from_secs(10);
                while !stop.load(Ordering::Relaxed) {
                    let rss = proc_status_kb(pid, "VmRSS:").unwrap_or(0);
                    let threads = proc_status_kb(pid, "Threads:").unwrap_or(0);
                    let mut p = peak.lock().unwrap();
                    if rss > p.up_rss_kb {
                        p.up_rss_kb = rss;
                        p.up_huge_kb = smaps_rollup_kb(pid, "AnonHugePages:").unwrap_or(0);
                    }
                    p.up_threads = p.up_threads.max(threads);
                    if let Some(a) = mem_available_mb() {
                        p.min_mem_available_mb = p.min_mem_available_mb.min(a);
                    }
                    drop(p);
                    if last_scan.elapsed() > Duration::from_secs(1) {
                        last_scan = Instant::now();
                        let dirs: Vec<PathBuf> = std::fs::read_dir(&sandboxes_dir)
                            .into_iter()
                            .flatten()
                            .flatten()
                            .map(|e| e.path())
                            .collect();
                        let (sum, k) = sandboxes_rss(&dirs);
                        let mut p = peak.lock().unwrap();
                        if sum > p.sandboxes_rss_kb {
                            p.sandboxes_rss_kb = sum;
                            p.sandboxes_at_peak = k;
                        }
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            })
        };
        MemWatch {
            pid,
            stop,
            peak,
            thread,
        }
    }

    /// Stops the thread; one last scan of `sandbox_dirs` (the thread scans once a
    /// second) and VmHWM complete the peaks.
    pub(super) fn finish(self, sandbox_dirs: &[PathBuf]) -> MemPeak {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.thread.join();
        let (sum, k) = sandboxes_rss(sandbox_dirs);
        let mut mem = self.peak.lock().unwrap().clone();
        if sum > mem.sandboxes_rss_kb {
            mem.sandboxes_rss_kb = sum;
            mem.sandboxes_at_peak = k;
        }
        mem.up_hwm_kb = proc_status_kb(self.pid, "VmHWM:").unwrap_or(0);
        mem
    }
}
