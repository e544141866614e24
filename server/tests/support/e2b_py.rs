//! Running a pytest module of `server/tests/e2b/` with a pinned E2B SDK venv (from
//! `./ops/e2b-venv.sh`, or `OPENDSEC_E2B_VENV`) and exactly the variables given, plus
//! `OPENDSEC_E2B_CALLS`: where it records the SDK calls of its passing tests
//! (`support/e2b_calls.rs`).

#[path = "e2b_calls.rs"]
mod e2b_calls;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

const DEFAULT_VENV: &str = "/var/lib/opendsec/test/e2b";
const PYTEST_LIMIT: Duration = Duration::from_secs(15 * 60);

#[derive(Clone, Copy)]
#[allow(dead_code)]
pub enum Sdk {
    /// e2b 2.63.0 + e2b-code-interpreter 2.11.5 (`POST /v2/sandboxes`).
    Current,
    /// e2b 2.50.0 (`POST /sandboxes`).
    V250,
}

pub fn python(sdk: Sdk) -> PathBuf {
    let root = std::env::var_os("OPENDSEC_E2B_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_VENV));
    let venv = root.join(match sdk {
        Sdk::Current => "2.63",
        Sdk::V250 => "2.50",
    });
    let python = venv.join("bin/python");
    assert!(
        python.is_file(),
        "the E2B SDK venv {} is missing: run ./ops/e2b-venv.sh {}",
        venv.display(),
        root.display()
    );
    python
}

pub fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Runs one module of tests/e2b with exactly `vars` (plus PATH, HOME and the record file
/// of its SDK calls) and fails with pytest's output unless every test passed.
pub async fn pytest(python: &Path, module: &str, vars: &[(&str, String)]) {
    let mut cmd = tokio::process::Command::new(python);
    cmd.args(["-B", "-m", "pytest"])
        .arg(format!("server/tests/e2b/{module}"))
        .args(["-x", "-q", "--durations=5"])
        .current_dir(workspace())
        .env_clear()
        .env(
            "PATH",
            std::env::var("PATH").unwrap_or_else(|_| "/usr/local/bin:/usr/bin:/bin".into()),
        )
        .env("HOME", std::env::var("HOME").unwrap_or_else(|_| "/root".into()))
        .env("OPENDSEC_E2B_CALLS", e2b_calls::record_file(&format!("py-{module}")))
        .stdin(Stdio::null())
        .kill_on_drop(true);
    for (k, v) in vars {
        cmd.env(k, v);
    }
    let out = match tokio::time::timeout(PYTEST_LIMIT, cmd.output()).await {
        Ok(out) => out.expect("run pytest"),
        Err(_) => panic!("{module} did not finish within {PYTEST_LIMIT:?}"),
    };
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("--- pytest {module} ---\n{text}");
    assert!(out.status.success(), "pytest {module} failed ({}):\n{text}", out.status);
}
