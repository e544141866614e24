//! Result table and goals section.

use std::fmt::Write;
use std::time::Duration;

use crate::load::LoadReport;

/// One row of the table: a [`LoadReport`] plus where it came from.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Row {
    pub target: String,
    pub members: usize,
    pub family: String,
    pub report: LoadReport,
}

/// A replay measurement.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ReplayRow {
    pub name: String,
    pub events: u64,
    pub elapsed: Duration,
    pub events_per_sec: f64,
}

pub fn fmt_dur(d: Duration) -> String {
    let us = d.as_secs_f64() * 1e6;
    if us < 1000.0 { format!("{us:.0} µs") } else { format!("{:.2} ms", us / 1000.0) }
}

pub fn fmt_rate(r: f64) -> String {
    let n = r.round() as u64;
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

pub fn table(rows: &[Row]) -> String {
    let head = ["target", "members", "concurrency", "ops/s", "p50", "p99", "errors"];
    let cells: Vec<[String; 7]> = rows
        .iter()
        .map(|r| {
            [
                r.target.clone(),
                r.members.to_string(),
                r.report.concurrency.to_string(),
                fmt_rate(r.report.ops_per_sec),
                fmt_dur(r.report.p50),
                fmt_dur(r.report.p99),
                format!("{}/{}", r.report.errors, r.report.ops),
            ]
        })
        .collect();
    let mut w = head.map(|h| h.chars().count());
    for c in &cells {
        for i in 0..7 {
            w[i] = w[i].max(c[i].chars().count());
        }
    }
    let line = |c: &[String]| {
        let mut s = String::from("|");
        for i in 0..7 {
            let pad = w[i] - c[i].chars().count();
            if i <= 0 {
                let _ = write!(s, " {}{} |", c[i], " ".repeat(pad));
            } else {
                let _ = write!(s, " {}{} |", " ".repeat(pad), c[i]);
            }
        }
        s
    };
    let mut out = line(&head.map(String::from));
    out.push('\n');
    out.push('|');
    for (i, width) in w.iter().enumerate() {
        out.push_str(&"-".repeat(width + 1));
        out.push_str(if i == 0 { "-|" } else { ":|" });
    }
    out.push('\n');
    for c in &cells {
        out.push_str(&line(c));
        out.push('\n');
    }
    out
}

/// The goals section: per concurrency, every measured target's throughput and p50/p99,
/// with throughput relative to the raw redb commit and to etcd with the same number of
/// members (where both were measured).
pub fn goals(rows: &[Row], replays: &[ReplayRow]) -> String {
    let mut out = String::new();
    let mut concs: Vec<usize> = rows.iter().map(|r| r.report.concurrency).collect();
    concs.sort_unstable();
    concs.dedup();
    for c in concs {
        let _ = writeln!(out, "concurrency {c}:");
        let at: Vec<&Row> = rows.iter().filter(|r| r.report.concurrency == c).collect();
        let redb = at.iter().find(|r| r.family == "redb");
        for r in &at {
            let mut rel = Vec::new();
            if r.family != "redb" {
                if let Some(b) = redb {
                    rel.push(format!("{:.2}x redb raw", r.report.ops_per_sec / b.report.ops_per_sec.max(1e-9)));
                }
            }
            if r.family != "etcd" {
                if let Some(e) = at.iter().find(|e| e.family == "etcd" && e.members == r.members) {
                    rel.push(format!(
                        "{:.2}x etcd {}-member",
                        r.report.ops_per_sec / e.report.ops_per_sec.max(1e-9),
                        e.members
                    ));
                }
            }
            let rel = if rel.is_empty() { String::new() } else { format!(" ({})", rel.join(", ")) };
            let err = if r.report.errors > 0 { format!(", {} errors", r.report.errors) } else { String::new() };
            let _ = writeln!(
                out,
                "  {} ({} member{}): {} ops/s, p50 {}, p99 {}{}{}",
                r.target,
                r.members,
                if r.members == 1 { "" } else { "s" },
                fmt_rate(r.report.ops_per_sec),
                fmt_dur(r.report.p50),
                fmt_dur(r.report.p99),
                rel,
                err
            );
        }
    }
    if !replays.is_empty() {
        let _ = writeln!(out, "replay:");
        for r in replays {
            let _ = writeln!(
                out,
                "  {}: {} events/s ({} events in {})",
                r.name,
                fmt_rate(r.events_per_sec),
                r.events,
                fmt_dur(r.elapsed)
            );
        }
    }
    out
}
