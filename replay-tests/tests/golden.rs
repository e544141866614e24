//! Every golden log ever recorded must still replay to its frozen views.

use opendsec_projections::diff::diff;
use opendsec_projections::schema::{CURRENT_SCHEMA_VERSION, decode_batch};
use opendsec_projections::{AuditResult, State, VIEW_NAMES};
use opendsec_replay_tests::{
    Entries, GoldenLog, golden_logs, read_expected_hash, read_expected_view, read_golden_log, replay, replay_from,
};
use std::collections::BTreeSet;

fn all_logs() -> Vec<(GoldenLog, Entries)> {
    let logs = golden_logs().expect("list golden/");
    assert!(!logs.is_empty(), "golden/ holds no log at all");
    logs.into_iter()
        .map(|g| {
            let entries = read_golden_log(&g.log).unwrap_or_else(|e| panic!("{e}"));
            assert!(!entries.is_empty(), "{} is empty", g.log.display());
            (g, entries)
        })
        .collect()
}

fn name(g: &GoldenLog) -> String {
    format!("v{}/{}", g.schema_version, g.scenario)
}

/// The first differing JSON paths of a view, readably.
fn describe(view: &str, expected: &serde_json::Value, actual: &serde_json::Value) -> String {
    let changes = diff(expected, actual);
    let mut out = format!(
        "view `{view}`: {} differing paths (expected -> replayed)\n",
        changes.len()
    );
    for c in changes.iter().take(15) {
        let show = |v: &Option<serde_json::Value>| v.as_ref().map_or("<absent>".to_string(), |v| v.to_string());
        out.push_str(&format!("  {}: {} -> {}\n", c.path, show(&c.before), show(&c.after)));
    }
    if changes.len() > 15 {
        out.push_str(&format!("  ... and {} more\n", changes.len() - 15));
    }
    out
}

#[test]
fn every_golden_log_replays_to_its_expected_views_and_hash() {
    let mut failures = String::new();
    for (g, entries) in all_logs() {
        let state = replay(&entries);
        assert_eq!(
            state.index,
            entries.last().unwrap().0,
            "{}: the replay stops at the last entry",
            name(&g)
        );
        for view in VIEW_NAMES {
            let expected = read_expected_view(&g.expected, view).unwrap_or_else(|e| panic!("{}: {e}", name(&g)));
            let actual = state.view_json(view).expect("a known view");
            if expected != actual {
                failures.push_str(&format!("{}: {}", name(&g), describe(view, &expected, &actual)));
            }
        }
        let hash = read_expected_hash(&g.expected).unwrap_or_else(|e| panic!("{}: {e}", name(&g)));
        if state.hash() != hash {
            failures.push_str(&format!(
                "{}: state hash {} differs from the expected {hash}\n",
                name(&g),
                state.hash()
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "golden replays differ from their expected views:\n{failures}"
    );
}

#[test]
fn replaying_a_golden_log_twice_is_byte_identical() {
    for (g, entries) in all_logs() {
        let (a, b) = (replay(&entries).to_bytes(), replay(&entries).to_bytes());
        assert!(a == b, "{}: two replays of the same log differ", name(&g));
    }
}

#[test]
fn replaying_through_a_checkpoint_gives_the_same_state() {
    for (g, entries) in all_logs() {
        let whole = replay(&entries).to_bytes();
        let middle = entries[entries.len() / 2].0;
        // The middle as asked, and every other split point too: each is cheap.
        let splits = std::iter::once(middle).chain(entries.iter().map(|(i, _)| *i));
        for at in splits {
            let first: Vec<_> = entries.iter().filter(|(i, _)| *i <= at).cloned().collect();
            let checkpoint = replay(&first).to_bytes();
            let restored = State::from_bytes(&checkpoint).unwrap_or_else(|e| panic!("{}: {e}", name(&g)));
            assert_eq!(restored.index, at);
            let resumed = replay_from(restored, &entries).to_bytes();
            assert!(
                resumed == whole,
                "{}: resuming from a checkpoint at index {at} gives a different state",
                name(&g)
            );
        }
    }
}

#[test]
fn golden_holds_a_log_for_the_current_schema_version() {
    let versions: BTreeSet<u32> = golden_logs()
        .expect("list golden/")
        .iter()
        .map(|g| g.schema_version)
        .collect();
    assert!(
        versions.contains(&CURRENT_SCHEMA_VERSION),
        "golden/ has no log of schema version {CURRENT_SCHEMA_VERSION} (it has {versions:?}): run \
         `cargo run -p opendsec-replay-tests --bin record-golden` and commit its output"
    );
    // Every version ever written keeps its log: no gaps below the current one.
    for v in 1..=CURRENT_SCHEMA_VERSION {
        assert!(
            versions.contains(&v),
            "golden/ lost the log of schema version {v}; old logs must never be removed"
        );
    }
}

#[test]
fn every_golden_log_is_filed_under_the_schema_version_of_its_events() {
    for (g, entries) in all_logs() {
        let mut seen = BTreeSet::new();
        for (index, bytes) in &entries {
            let batch = decode_batch(bytes).unwrap_or_else(|e| panic!("{} entry {index}: {e}", name(&g)));
            seen.extend(batch.events.iter().map(|e| e.schema_version));
        }
        assert_eq!(
            seen,
            BTreeSet::from([g.schema_version]),
            "{}: its events carry schema versions {seen:?}, but it is filed under v{}",
            name(&g),
            g.schema_version
        );
    }
}

#[test]
fn every_golden_log_holds_applied_and_refused_writes() {
    for (g, entries) in all_logs() {
        let state = replay(&entries);
        let records = &state.audit.records;
        assert_eq!(records.len(), entries.len(), "{}: one audit record per entry", name(&g));
        assert!(
            records.iter().any(|r| r.result == AuditResult::Ok),
            "{}: nothing applied",
            name(&g)
        );
        assert!(
            records.iter().any(|r| matches!(r.result, AuditResult::Denied { .. })),
            "{}: no denial in the log; a golden log must exercise refusals too",
            name(&g)
        );
        assert!(
            !records.iter().any(|r| matches!(r.result, AuditResult::Rejected { .. })),
            "{}: entries rejected on replay (undecodable or conflicting): {:?}",
            name(&g),
            records
                .iter()
                .filter(|r| matches!(r.result, AuditResult::Rejected { .. }))
                .collect::<Vec<_>>()
        );
    }
}
