//! The benchmark's summary: one line per measurement, echoed to stderr as it is made
//! and printed together at the end by `opendsec-bench`; any failure marks the run failed.

use std::time::Duration;

use super::CREATE_VS_CRUN;
use super::burst::Burst;
use super::create::CreateRuns;
use super::memory::mib;
use crate::load::percentile;
use crate::report::fmt_dur;

pub struct Results {
    pub lines: Vec<String>,
    pub failed: bool,
}

impl Results {
    pub(super) fn new() -> Results {
        Results {
            lines: Vec::new(),
            failed: false,
        }
    }

    pub(super) fn line(&mut self, s: String) {
        eprintln!("   {s}");
        self.lines.push(s);
    }

    pub(super) fn failure(&mut self, s: String) {
        self.line(s);
        self.failed = true;
    }

    pub(super) fn create_runs(&mut self, c: &CreateRuns) {
        let api = &c.times;
        self.line(format!(
            "REST create -> first output (POST /v1/sandboxes, exec `echo hi` via agent route): p50 {}, p90 {}, min {}, max {} (n={}, errors {})",
            fmt_dur(percentile(api, 0.5)),
            fmt_dur(percentile(api, 0.9)),
            fmt_dur(api.first().copied().unwrap_or_default()),
            fmt_dur(api.last().copied().unwrap_or_default()),
            api.len(),
            c.errors.len()
        ));
        for e in c.errors.iter().take(3) {
            self.line(format!("  error: {e}"));
        }
        self.failed |= !c.errors.is_empty() || api.is_empty();
    }

    pub(super) fn raw_runs(&mut self, rt: &str, v: &[Duration]) {
        self.line(format!(
            "raw `{rt} run` spawn -> first stdout byte{}: p50 {}, p90 {}, min {}, max {} (n={})",
            if rt == "crun" && super::host::host_is_cgroup_hybrid() {
                " (in `unshare -m` without /sys/fs/cgroup/unified)"
            } else {
                ""
            },
            fmt_dur(percentile(v, 0.5)),
            fmt_dur(percentile(v, 0.9)),
            fmt_dur(v.first().copied().unwrap_or_default()),
            fmt_dur(v.last().copied().unwrap_or_default()),
            v.len()
        ));
    }

    pub(super) fn create_vs_crun(&mut self, api: &[Duration], crun_p50: Option<Duration>) {
        match crun_p50 {
            Some(c) if !api.is_empty() => {
                let api_p50 = percentile(api, 0.5);
                let ratio = api_p50.as_secs_f64() / c.as_secs_f64().max(1e-9);
                self.line(format!(
                    "{}  create->first output p50 {} = {ratio:.2}x raw crun run p50 {} (goal <= {CREATE_VS_CRUN}x)",
                    if ratio <= CREATE_VS_CRUN { "PASS" } else { "MISS" },
                    fmt_dur(api_p50),
                    fmt_dur(c)
                ));
            }
            _ => self.line("n/a   create->first output vs raw crun (not both measured)".into()),
        }
    }

    pub(super) fn pause_resume(&mut self, r: Result<(Vec<Duration>, Vec<Duration>), String>) {
        match r {
            Ok((p, r)) => self.line(format!(
                "pause (POST .../pause until GET says paused): p50 {}, p90 {}; resume (until running): p50 {}, p90 {} (n={}, GET polled every 5 ms)",
                fmt_dur(percentile(&p, 0.5)),
                fmt_dur(percentile(&p, 0.9)),
                fmt_dur(percentile(&r, 0.5)),
                fmt_dur(percentile(&r, 0.9)),
                p.len()
            )),
            Err(e) => self.failure(format!("pause/resume: FAILED: {e}")),
        }
    }

    /// The burst's line (and its first errors); failures mark the run failed.
    pub(super) fn burst(&mut self, n: usize, b: &Burst, timeout: Duration) {
        let f = b.http_errors + b.failed + b.not_settled;
        self.line(format!(
            "burst {n}: all settled in {:.1} s ({} running; failures {f} = {} HTTP errors + {} failed + {} not running after {} s); \
             create requests answered in {:.1} s; \
             `opendsec up` peak RSS {} (VmHWM; polled VmRSS max {}, of it {} transparent huge pages; {} threads at most) \
             from {} before = {:.2} MiB per sandbox; shims+agents summed RSS at peak {} over {} sandboxes; \
             host MemAvailable min {} MB; delete all + freed in {:.1} s{}",
            b.settled.as_secs_f64(),
            b.running,
            b.http_errors,
            b.failed,
            b.not_settled,
            timeout.as_secs(),
            b.accepted.as_secs_f64(),
            mib(b.mem.up_hwm_kb),
            mib(b.mem.up_rss_kb),
            mib(b.mem.up_huge_kb),
            b.mem.up_threads,
            mib(b.mem.up_rss_before_kb),
            b.mem.up_growth_per_sandbox_kb(n) / 1024.0,
            mib(b.mem.sandboxes_rss_kb),
            b.mem.sandboxes_at_peak,
            b.mem.min_mem_available_mb,
            b.freed.as_secs_f64(),
            if b.left_over > 0 {
                format!(", {} NOT freed", b.left_over)
            } else {
                String::new()
            }
        ));
        for e in b.first_errors.iter().take(3) {
            self.line(format!("  burst {n} error: {e}"));
        }
        self.failed |= f > 0 || b.left_over > 0;
    }
}
