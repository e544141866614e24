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
    /// The in-process, pure fold (the figure the replay goal is about).
    pub pure_fold: bool,
    /// What the figure means, if it is not a plain "events in time".
    pub note: Option<String>,
}

pub fn fmt_dur(d: Duration) -> String {
    let us = d.as_secs_f64() * 1e6;
    if us < 1000.0 {
        format!("{us:.0} µs")
    } else {
        format!("{:.2} ms", us / 1000.0)
    }
}

pub fn fmt_rate(r: f64) -> String {
    let n = r.round() as u64;
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

pub fn table(rows: &[Row]) -> String {
    let head = ["target", "members", "concurrency", "ops/s", "p50", "p99", "errors"];
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
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
    markdown_table(&head, &cells)
}

/// A Markdown table: the first column left-aligned, the others right-aligned; a row
/// shorter than the head is padded with empty cells.
pub fn markdown_table(head: &[&str], rows: &[Vec<String>]) -> String {
    let n = head.len();
    let cell = |r: &[String], i: usize| r.get(i).cloned().unwrap_or_default();
    let mut w: Vec<usize> = head.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (i, width) in w.iter_mut().enumerate() {
            *width = (*width).max(cell(r, i).chars().count());
        }
    }
    let line = |c: &[String]| {
        let mut s = String::from("|");
        for (i, width) in w.iter().enumerate() {
            let text = cell(c, i);
            let pad = " ".repeat(width - text.chars().count());
            if i == 0 {
                let _ = write!(s, " {text}{pad} |");
            } else {
                let _ = write!(s, " {pad}{text} |");
            }
        }
        s
    };
    let head: Vec<String> = head.iter().map(|h| h.to_string()).collect();
    let mut out = line(&head);
    out.push('\n');
    out.push('|');
    for (i, width) in w.iter().enumerate().take(n) {
        out.push_str(&"-".repeat(width + 1));
        out.push_str(if i == 0 { "-|" } else { ":|" });
    }
    out.push('\n');
    for r in rows {
        out.push_str(&line(r));
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
            if r.family != "redb"
                && let Some(b) = redb
            {
                rel.push(format!(
                    "{:.2}x redb raw",
                    r.report.ops_per_sec / b.report.ops_per_sec.max(1e-9)
                ));
            }
            if r.family != "etcd"
                && let Some(e) = at.iter().find(|e| e.family == "etcd" && e.members == r.members)
            {
                rel.push(format!(
                    "{:.2}x etcd {}-member",
                    r.report.ops_per_sec / e.report.ops_per_sec.max(1e-9),
                    e.members
                ));
            }
            let rel = if rel.is_empty() {
                String::new()
            } else {
                format!(" ({})", rel.join(", "))
            };
            let err = if r.report.errors > 0 {
                format!(", {} errors", r.report.errors)
            } else {
                String::new()
            };
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
            match &r.note {
                None => {
                    let _ = writeln!(
                        out,
                        "  {}: {} events/s ({} events in {})",
                        r.name,
                        fmt_rate(r.events_per_sec),
                        r.events,
                        fmt_dur(r.elapsed)
                    );
                }
                Some(n) => {
                    let _ = writeln!(out, "  {}: index {} in {} ({n})", r.name, r.events, fmt_dur(r.elapsed));
                }
            }
        }
    }
    out.push_str(&targets(rows, replays));
    out
}

/// Throughput ratio a goal asks of opendsec 3-node over etcd 3-member.
pub const THROUGHPUT_VS_ETCD: f64 = 1.5;
/// Latency ratio a goal allows opendsec 1-node over the raw redb commit.
pub const LATENCY_VS_REDB: f64 = 2.0;
/// Events/s the in-process replay must reach.
pub const REPLAY_EVENTS_PER_SEC: f64 = 200_000.0;

fn find<'a>(rows: &'a [Row], family: &str, members: usize, c: usize) -> Option<&'a Row> {
    rows.iter()
        .find(|r| r.family == family && r.members == members && r.report.concurrency == c && r.report.ok > 0)
}

fn verdict(ok: bool) -> &'static str {
    if ok { "PASS" } else { "MISS" }
}

/// The PASS/MISS lines: one per goal, `n/a` when a side was not measured.
pub fn targets(rows: &[Row], replays: &[ReplayRow]) -> String {
    let mut out = String::from("targets:\n");
    for c in [16, 256] {
        let line = match (find(rows, "opendsec", 3, c), find(rows, "etcd", 3, c)) {
            (Some(o), Some(e)) => {
                let want = THROUGHPUT_VS_ETCD * e.report.ops_per_sec;
                format!(
                    "{}  c={c}: opendsec 3-node {} ops/s vs {THROUGHPUT_VS_ETCD}x etcd 3-member = {} ops/s ({:.2}x etcd)",
                    verdict(o.report.ops_per_sec >= want && o.report.errors == 0),
                    fmt_rate(o.report.ops_per_sec),
                    fmt_rate(want),
                    o.report.ops_per_sec / e.report.ops_per_sec.max(1e-9)
                )
            }
            _ => {
                format!("n/a   c={c}: opendsec 3-node ops/s vs {THROUGHPUT_VS_ETCD}x etcd 3-member (not both measured)")
            }
        };
        let _ = writeln!(out, "  {line}");
    }
    let line = match (find(rows, "opendsec", 3, 1), find(rows, "etcd", 3, 1)) {
        (Some(o), Some(e)) => format!(
            "{}  c=1: opendsec 3-node p50 {} vs etcd 3-member p50 {} (must be <=)",
            verdict(o.report.p50 <= e.report.p50 && o.report.errors == 0),
            fmt_dur(o.report.p50),
            fmt_dur(e.report.p50)
        ),
        _ => "n/a   c=1: opendsec 3-node p50 vs etcd 3-member p50 (not both measured)".into(),
    };
    let _ = writeln!(out, "  {line}");
    let line = match (find(rows, "opendsec", 1, 1), find(rows, "redb", 1, 1)) {
        (Some(o), Some(b)) => {
            let want = b.report.p50.mul_f64(LATENCY_VS_REDB);
            format!(
                "{}  c=1: opendsec 1-node p50 {} vs {LATENCY_VS_REDB}x redb raw p50 = {} (redb raw p50 {})",
                verdict(o.report.p50 <= want && o.report.errors == 0),
                fmt_dur(o.report.p50),
                fmt_dur(want),
                fmt_dur(b.report.p50)
            )
        }
        _ => "n/a   c=1: opendsec 1-node p50 vs 2x redb raw p50 (not both measured)".into(),
    };
    let _ = writeln!(out, "  {line}");
    let line = match replays.iter().find(|r| r.pure_fold) {
        Some(r) => format!(
            "{}  replay (in-process fold of {} batches): {} events/s vs {} events/s",
            verdict(r.events_per_sec >= REPLAY_EVENTS_PER_SEC),
            r.events,
            fmt_rate(r.events_per_sec),
            fmt_rate(REPLAY_EVENTS_PER_SEC)
        ),
        None => "n/a   replay events/s vs 200,000 (not measured)".into(),
    };
    let _ = writeln!(out, "  {line}");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markdown_table_aligns_the_first_column_left_and_pads_short_rows() {
        let t = markdown_table(
            &["what", "ours"],
            &[vec!["cold".into(), "1.5 s".into()], vec!["warm-up".into()]],
        );
        assert_eq!(
            t,
            "| what    |  ours |\n|---------|------:|\n| cold    | 1.5 s |\n| warm-up |       |\n"
        );
    }
}
