//! The network benchmark's figures: gathered as the steps finish (each echoed to
//! stderr), then printed as one table (OpenDsec's figure, the raw path's or the
//! no-network figure beside it, the ratio, the goal) with notes, and written whole as
//! JSON for `--json`.

use std::fmt::Write;
use std::time::Duration;

use serde_json::{Value, json};

use super::create::Creates;
use super::enforce::{Enforcement, Update};
use super::lookup::Lookups;
use super::throughput::Throughput;
use super::{ENFORCE_GOAL, THROUGHPUT_GOAL};
use crate::load::percentile;
use crate::report::{fmt_dur, markdown_table};
use crate::sandboxes::create::CreateRuns;

#[derive(Default)]
pub struct Report {
    enforcement: Option<Enforcement>,
    throughput: Option<Throughput>,
    lookups: Option<Lookups>,
    /// Create -> first output with networking, and with `--no-sandbox-network`.
    create_networked: Option<Creates>,
    create_plain: Option<Creates>,
    notes: Vec<String>,
    pub failures: Vec<String>,
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

fn sorted(v: impl IntoIterator<Item = Duration>) -> Vec<Duration> {
    let mut v: Vec<Duration> = v.into_iter().collect();
    v.sort_unstable();
    v
}

/// Nearest-rank percentile, `None` for no samples.
fn pct(v: &[Duration], q: f64) -> Option<Duration> {
    (!v.is_empty()).then(|| percentile(v, q))
}

/// The median of `v` (the mean of the middle two for an even count).
fn median_f64(v: &[f64]) -> Option<f64> {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => None,
        n if n % 2 == 1 => Some(v[n / 2]),
        n => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

fn ratio(ours: f64, beside: f64) -> String {
    match ours / beside {
        r if !r.is_finite() => String::new(),
        r => format!("{r:.2}x"),
    }
}

fn opt_dur(d: Option<Duration>) -> String {
    d.map(fmt_dur).unwrap_or_else(|| "n/a".into())
}

/// A row of durations: what, ours, beside, ratio, goal.
fn dur_row(what: &str, ours: Option<Duration>, beside: Option<Duration>, goal: String) -> Vec<String> {
    vec![
        what.to_string(),
        opt_dur(ours),
        beside.map(fmt_dur).unwrap_or_default(),
        match (ours, beside) {
            (Some(o), Some(b)) => ratio(o.as_secs_f64(), b.as_secs_f64()),
            _ => String::new(),
        },
        goal,
    ]
}

/// `p50 < 100 ms: PASS` (or MISS) for a p50 row.
fn enforce_goal(p50: Option<Duration>) -> String {
    match p50 {
        Some(d) => format!(
            "< {} ms: {}",
            ENFORCE_GOAL.as_millis(),
            if d < ENFORCE_GOAL { "PASS" } else { "MISS" }
        ),
        None => format!("< {} ms: n/a", ENFORCE_GOAL.as_millis()),
    }
}

fn gbits(bps: f64) -> String {
    format!("{:.2} Gbit/s", bps / 1e9)
}

impl Report {
    pub fn failed(&self) -> bool {
        !self.failures.is_empty()
    }

    pub(super) fn fail(&mut self, s: String) {
        eprintln!("   FAILED: {s}");
        self.failures.push(s);
    }

    pub(super) fn note(&mut self, s: String) {
        eprintln!("   note: {s}");
        self.notes.push(s);
    }

    pub(super) fn enforcement(&mut self, e: Enforcement) {
        let a = sorted(e.allow_to_deny.iter().map(Update::enforced));
        let d = sorted(e.deny_to_allow.iter().map(Update::enforced));
        eprintln!(
            "   allow -> deny p50 {}, p99 {} (n={}); deny -> allow p50 {}, p99 {} (n={}); errors {}",
            opt_dur(pct(&a, 0.5)),
            opt_dur(pct(&a, 0.99)),
            a.len(),
            opt_dur(pct(&d, 0.5)),
            opt_dur(pct(&d, 0.99)),
            d.len(),
            e.errors.len()
        );
        for err in e.errors.iter().take(3) {
            self.fail(format!("policy update: {err}"));
        }
        if a.is_empty() || d.is_empty() {
            self.fail("policy update: no update measured one of the ways".into());
        }
        self.enforcement = Some(e);
    }

    pub(super) fn throughput(&mut self, t: Throughput) {
        for err in t.errors.iter().take(3) {
            self.fail(format!("iperf3: {err}"));
        }
        self.throughput = Some(t);
    }

    pub(super) fn lookups(&mut self, l: Lookups) {
        eprintln!(
            "   proxy first answer p50 {}, repeated p50 {}, refused p50 {}; direct p50 {} (n={}; errors {})",
            opt_dur(pct(&l.first, 0.5)),
            opt_dur(pct(&l.repeated, 0.5)),
            opt_dur(pct(&l.refused, 0.5)),
            opt_dur(pct(&l.direct, 0.5)),
            l.first.len(),
            l.errors.len()
        );
        for err in l.errors.iter().take(3) {
            self.fail(format!("DNS: {err}"));
        }
        self.lookups = Some(l);
    }

    pub(super) fn creates(&mut self, networked: bool, c: Creates) {
        let what = if networked {
            "create, networking"
        } else {
            "create, --no-sandbox-network"
        };
        for (series, r) in [("back to back", &c.back_to_back), ("spaced", &c.spaced)] {
            eprintln!(
                "   {series}: create -> first output p50 {}, p90 {} (n={}, errors {})",
                opt_dur(pct(&r.times, 0.5)),
                opt_dur(pct(&r.times, 0.9)),
                r.times.len(),
                r.errors.len()
            );
            for err in r.errors.iter().take(3) {
                self.fail(format!("{what}, {series}: {err}"));
            }
            if r.times.is_empty() {
                self.fail(format!("{what}, {series}: no run succeeded"));
            }
        }
        if networked {
            self.create_networked = Some(c);
        } else {
            self.create_plain = Some(c);
        }
    }

    fn rows(&self) -> Vec<Vec<String>> {
        let mut rows = Vec::new();
        if let Some(e) = &self.enforcement {
            for (way, updates, what) in [
                (
                    "allow -> deny",
                    &e.allow_to_deny,
                    "PUT sent -> new connects refused and the open connection stopped",
                ),
                ("deny -> allow", &e.deny_to_allow, "PUT sent -> new connects pass"),
            ] {
                let all = sorted(updates.iter().map(Update::enforced));
                rows.push(dur_row(
                    &format!("policy {way}, p50: {what}"),
                    pct(&all, 0.5),
                    None,
                    enforce_goal(pct(&all, 0.5)),
                ));
                rows.push(dur_row(
                    &format!("policy {way}, p99"),
                    pct(&all, 0.99),
                    None,
                    String::new(),
                ));
                if way == "allow -> deny" {
                    let c = sorted(updates.iter().map(|u| u.connects));
                    let o = sorted(updates.iter().filter_map(|u| u.open_connection));
                    rows.push(dur_row(
                        "  of which new connects refused, p50 (p99)",
                        pct(&c, 0.5),
                        None,
                        format!("(p99 {})", opt_dur(pct(&c, 0.99))),
                    ));
                    rows.push(dur_row(
                        "  of which the open connection stopped, p50 (p99)",
                        pct(&o, 0.5),
                        None,
                        format!("(p99 {})", opt_dur(pct(&o, 0.99))),
                    ));
                }
                let put = sorted(updates.iter().map(|u| u.put_answered));
                rows.push(dur_row(
                    "  the PUT's answer (200) came after, p50 (p99)",
                    pct(&put, 0.5),
                    None,
                    format!("(p99 {})", opt_dur(pct(&put, 0.99))),
                ));
            }
        }
        if let Some(t) = &self.throughput {
            for (what, ours, raw) in [
                (
                    "iperf3 TCP sandbox -> internet (vs raw veth path), median",
                    &t.sandbox_up,
                    &t.raw_up,
                ),
                (
                    "iperf3 TCP -R internet -> sandbox (vs raw veth path), median",
                    &t.sandbox_down,
                    &t.raw_down,
                ),
            ] {
                let (o, r) = (median_f64(ours), median_f64(raw));
                rows.push(vec![
                    what.to_string(),
                    o.map(gbits).unwrap_or_else(|| "n/a".into()),
                    r.map(gbits).unwrap_or_else(|| "n/a".into()),
                    match (o, r) {
                        (Some(o), Some(r)) => ratio(o, r),
                        _ => String::new(),
                    },
                    match (o, r) {
                        (Some(o), Some(r)) => format!(
                            "within {:.0}%: {}",
                            (1.0 - THROUGHPUT_GOAL) * 100.0,
                            if o >= r * THROUGHPUT_GOAL { "PASS" } else { "MISS" }
                        ),
                        _ => "n/a".into(),
                    },
                ]);
            }
        }
        if let Some(l) = &self.lookups {
            for (what, v) in [("first answer for a name", &l.first), ("repeated name", &l.repeated)] {
                for q in [0.5, 0.99] {
                    rows.push(dur_row(
                        &format!(
                            "DNS A via the proxy, {what}, p{} (vs direct to the server)",
                            (q * 100.0) as u32
                        ),
                        pct(v, q),
                        pct(&l.direct, q),
                        String::new(),
                    ));
                }
            }
            rows.push(dur_row(
                "  the proxy refusing a name (no upstream, no nftables), p50 (p99)",
                pct(&l.refused, 0.5),
                None,
                format!("(p99 {})", opt_dur(pct(&l.refused, 0.99))),
            ));
        }
        if self.create_networked.is_some() || self.create_plain.is_some() {
            type Series = fn(&Creates) -> &CreateRuns;
            let series: [(&str, Series); 2] = [("back to back", |c| &c.back_to_back), ("spaced", |c| &c.spaced)];
            for (name, of) in series {
                let times = |c: &Option<Creates>| c.as_ref().map(|c| of(c).times.clone()).unwrap_or_default();
                let (n, p) = (times(&self.create_networked), times(&self.create_plain));
                for q in [0.5, 0.9] {
                    rows.push(dur_row(
                        &format!(
                            "create -> first output, {name}, p{} (networking vs --no-sandbox-network)",
                            (q * 100.0) as u32
                        ),
                        pct(&n, q),
                        pct(&p, q),
                        String::new(),
                    ));
                }
            }
        }
        rows
    }

    /// The figures as a table with notes.
    pub fn summary(&self) -> String {
        let mut out = String::new();
        let count = |v: Option<usize>| v.map(|n| n.to_string()).unwrap_or_else(|| "0".into());
        let _ = writeln!(
            out,
            "policy updates: n={} allow -> deny, n={} deny -> allow; iperf3: {} round(s) of -t {}; DNS: n={}; creates: n={} per series with networking, n={} without",
            count(self.enforcement.as_ref().map(|e| e.allow_to_deny.len())),
            count(self.enforcement.as_ref().map(|e| e.deny_to_allow.len())),
            count(self.throughput.as_ref().map(|t| t.sandbox_up.len())),
            self.throughput.as_ref().map(|t| t.seconds).unwrap_or(0),
            count(self.lookups.as_ref().map(|l| l.first.len())),
            count(self.create_networked.as_ref().map(|c| c.back_to_back.times.len())),
            count(self.create_plain.as_ref().map(|c| c.back_to_back.times.len())),
        );
        out.push_str(&markdown_table(
            &["measurement", "opendsec", "beside", "ratio", "goal"],
            &self.rows(),
        ));
        out.push_str(
            "notes: policy updates are timed from just before the PUT is sent to the start of the first TCP connect (one \
             every 1 ms from the sandbox's namespace, 20 ms each to complete) from which on every connect obeys the new \
             policy; allow -> deny also waits for the open connection (one byte every 1 ms to an echo server) to lose its \
             first byte, and takes the later of the two; the figures are good to about 1 ms; p99 is nearest-rank (of 100 samples or fewer, the largest). The raw veth path is a plain \
             namespace behind the edge's, routed and masqueraded there like the sandboxes, without OpenDsec's table; \
             iperf3 is the host's, run by `ip netns exec` in the sandbox's namespace or the raw one, one TCP stream, the \
             receiver's rate. DNS: one UDP A query per fresh socket; the proxy asks the upstream every time and applies \
             one nftables transaction for the learned set before it answers; direct = from the edge's namespace to the same server. Creates: \
             `opendsec up` with its default --warm-sandboxes 2 (a create claims a warm container: with networking that \
             is a namespace hand-over and the policy's first nftables transaction), both in the edge's namespace, one after \
             the other; back to back = the next create as soon as the last sandbox is freed (the edge still refilling \
             its pool, and removing the last sandbox's network whenever no create runs), spaced = each create once the pool holds 2 \
             warm containers again and 300 ms have passed.\n",
        );
        for n in &self.notes {
            let _ = writeln!(out, "note: {n}");
        }
        for f in &self.failures {
            let _ = writeln!(out, "FAILED: {f}");
        }
        out
    }

    pub fn json(&self) -> Value {
        let durs = |v: &[Duration]| v.iter().map(|d| ms(*d)).collect::<Vec<_>>();
        let summary = |v: &[Duration]| {
            let v = sorted(v.iter().copied());
            json!({"n": v.len(), "p50_ms": pct(&v, 0.5).map(ms), "p90_ms": pct(&v, 0.9).map(ms), "p99_ms": pct(&v, 0.99).map(ms)})
        };
        let updates = |u: &[Update]| {
            let enforced: Vec<Duration> = u.iter().map(Update::enforced).collect();
            json!({
                "enforced": summary(&enforced),
                "connects": summary(&u.iter().map(|x| x.connects).collect::<Vec<_>>()),
                "open_connection": summary(&u.iter().filter_map(|x| x.open_connection).collect::<Vec<_>>()),
                "put_answered": summary(&u.iter().map(|x| x.put_answered).collect::<Vec<_>>()),
                "runs": u.iter().map(|x| json!({
                    "enforced_ms": ms(x.enforced()),
                    "connects_ms": ms(x.connects),
                    "open_connection_ms": x.open_connection.map(ms),
                    "put_answered_ms": ms(x.put_answered),
                    "early_attempts": x.early,
                })).collect::<Vec<_>>(),
            })
        };
        let runs = |c: &CreateRuns| {
            json!({
                "summary": summary(&c.times),
                "runs_ms": durs(&c.times),
                "errors": c.errors,
            })
        };
        let creates = |c: &Option<Creates>| {
            c.as_ref()
                .map(|c| json!({"back_to_back": runs(&c.back_to_back), "spaced": runs(&c.spaced)}))
        };
        json!({
            "goals": {
                "policy_update_p50_ms_below": ENFORCE_GOAL.as_millis(),
                "throughput_at_least_fraction_of_raw": THROUGHPUT_GOAL,
            },
            "policy_update": self.enforcement.as_ref().map(|e| json!({
                "allow_to_deny": updates(&e.allow_to_deny),
                "deny_to_allow": updates(&e.deny_to_allow),
                "errors": e.errors,
            })),
            "throughput": self.throughput.as_ref().map(|t| json!({
                "seconds": t.seconds,
                "sandbox_up_bps": t.sandbox_up,
                "raw_up_bps": t.raw_up,
                "sandbox_down_bps": t.sandbox_down,
                "raw_down_bps": t.raw_down,
                "sandbox_up_median_bps": median_f64(&t.sandbox_up),
                "raw_up_median_bps": median_f64(&t.raw_up),
                "sandbox_down_median_bps": median_f64(&t.sandbox_down),
                "raw_down_median_bps": median_f64(&t.raw_down),
                "errors": t.errors,
            })),
            "dns": self.lookups.as_ref().map(|l| json!({
                "proxy_first_answer": summary(&l.first),
                "proxy_repeated": summary(&l.repeated),
                "direct": summary(&l.direct),
                "proxy_refused": summary(&l.refused),
                "proxy_first_answer_ms": durs(&l.first),
                "proxy_repeated_ms": durs(&l.repeated),
                "direct_ms": durs(&l.direct),
                "proxy_refused_ms": durs(&l.refused),
                "errors": l.errors,
            })),
            "create_to_first_output": {
                "networking": creates(&self.create_networked),
                "no_sandbox_network": creates(&self.create_plain),
                "warm_sandboxes": 2,
                "spaced_waits_for_warm_containers": 2,
                "spaced_quiet_ms": 300,
            },
            "notes": self.notes,
            "failed": self.failures,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_enforcement_goal_is_judged_on_the_p50() {
        assert_eq!(enforce_goal(Some(Duration::from_millis(40))), "< 100 ms: PASS");
        assert_eq!(enforce_goal(Some(Duration::from_millis(100))), "< 100 ms: MISS");
        assert_eq!(enforce_goal(None), "< 100 ms: n/a");
    }

    #[test]
    fn medians_of_rates() {
        assert_eq!(median_f64(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median_f64(&[4.0, 1.0]), Some(2.5));
        assert_eq!(median_f64(&[]), None);
    }
}
