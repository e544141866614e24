//! Where the E2B suites record which public SDK calls their passing tests made (Python:
//! `tests/e2b/conftest.py`; JS: `tests/e2b-js/record-calls.mjs`), one JSON file per
//! module run: `$OPENDSEC_E2B_CALLS_DIR` (`./ops/test.sh` sets it), else `e2b-calls/` in
//! cargo's target tmp dir. `ops/e2b-compat.py` builds docs/e2b-compatibility.md's table
//! from these files.

use std::path::PathBuf;

/// The file a module run records into (`OPENDSEC_E2B_CALLS` of the suite), its directory
/// made; a record left by an earlier run of the same module is removed first.
pub fn record_file(name: &str) -> PathBuf {
    let dir = std::env::var_os("OPENDSEC_E2B_CALLS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("e2b-calls"));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
    let file = dir.join(format!("{name}.json"));
    let _ = std::fs::remove_file(&file);
    file
}
