//! Specification: the unmodified E2B JS SDK works against OpenDsec with only its own
//! variables set. Each test starts a real `opendsec up`, issues an E2B API key through
//! the native API and runs `tests/e2b-js/sdk.test.mjs` with `node --test`, against one
//! installed SDK (`current`: e2b 2.51.0 with @e2b/code-interpreter 2.8.0; `previous`:
//! e2b 2.50.0 with @e2b/code-interpreter 2.7.2), with nothing but `E2B_API_KEY`,
//! `E2B_API_URL` and `E2B_SANDBOX_URL` (and PATH, HOME) in its environment. The module
//! is the specification; read it. `e2b_js_network` runs `tests/e2b-js/network.test.mjs`
//! (egress policies and an upstream proxy) against an `opendsec up` inside a test
//! internet of its own (`support/internet.rs`).
//!
//! Each run preloads `tests/e2b-js/record-calls.mjs`, which records the SDK calls of the
//! passing tests (`support/e2b_calls.rs`) for docs/e2b-compatibility.md's table.
//!
//! Needs root, crun or runc, the static agent, node 18 or later with the SDKs installed
//! by `./ops/e2b-js.sh` (or `OPENDSEC_E2B_JS`), and the `base` image; the network suite
//! also nftables, microsocks and tinyproxy.

#[path = "support/e2b_calls.rs"]
mod e2b_calls;
#[path = "support/internet.rs"]
mod internet;
#[path = "support/up.rs"]
mod up;

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;
use up::Up;

const DEFAULT_DIR: &str = "/var/lib/opendsec/test/e2b-js";
const IMAGE_BUILD_LIMIT: Duration = Duration::from_secs(30 * 60);
const NODE_LIMIT: Duration = Duration::from_secs(10 * 60);
/// Preloaded into every run: records which SDK calls the passing tests made.
const RECORDER: &str = "record-calls.mjs";

/// One suite at a time: each starts a server with sandboxes.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The installed SDK `set`, checked against its lockfile: a stale install would test
/// other versions than the lockfile says.
fn installed(set: &str) -> PathBuf {
    let root = std::env::var_os("OPENDSEC_E2B_JS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_DIR));
    let dir = root.join(set);
    let lock = workspace().join(format!("server/tests/e2b-js/{set}/package-lock.json"));
    let want = std::fs::read(&lock).unwrap_or_else(|e| panic!("read {}: {e}", lock.display()));
    let have = std::fs::read(dir.join("package-lock.json")).unwrap_or_default();
    assert!(
        dir.join("node_modules/e2b/package.json").is_file() && have == want,
        "the E2B JS SDK ({set}) is not installed as locked in {}: run ./ops/e2b-js.sh {}",
        dir.display(),
        root.display()
    );
    dir
}

async fn run_suite(set: &str) {
    let _one = ONE_AT_A_TIME.lock().await;
    let up = Up::start(None).await;
    run_module(set, "sdk.test.mjs", &up).await;
}

/// Runs `module` of tests/e2b-js with SDK `set` against `up`.
async fn run_module(set: &str, module: &str, up: &Up) {
    let sdk = installed(set);
    // The module runs from a directory of its own whose node_modules is the installed
    // SDK's: node resolves `e2b` from where the module (and the recorder) lies.
    let work = tempfile::tempdir().unwrap();
    for file in [module, RECORDER] {
        let from = workspace().join("server/tests/e2b-js").join(file);
        std::fs::copy(&from, work.path().join(file)).unwrap_or_else(|e| panic!("copy {}: {e}", from.display()));
    }
    std::fs::copy(sdk.join("package.json"), work.path().join("package.json")).unwrap();
    std::os::unix::fs::symlink(sdk.join("node_modules"), work.path().join("node_modules")).unwrap();

    up.ensure_image("base", IMAGE_BUILD_LIMIT).await;
    up.ensure_image("mcp-gateway", IMAGE_BUILD_LIMIT).await;
    let key = up.issue_e2b_key().await;
    let url = format!("http://{}", up.http);
    let calls = e2b_calls::record_file(&format!("js-{set}-{module}"));
    let mut cmd = tokio::process::Command::new("node");
    let recorder = format!("./{RECORDER}");
    cmd.args(["--import", &recorder, "--test", "--test-concurrency=1", module])
        .current_dir(work.path())
        .env_clear()
        .env(
            "PATH",
            std::env::var("PATH").unwrap_or_else(|_| "/usr/local/bin:/usr/bin:/bin".into()),
        )
        .env("HOME", std::env::var("HOME").unwrap_or_else(|_| "/root".into()))
        .env("E2B_API_KEY", key)
        .env("E2B_API_URL", &url)
        .env("E2B_SANDBOX_URL", &url)
        .env("OPENDSEC_E2B_CALLS", calls)
        .stdin(Stdio::null())
        .kill_on_drop(true);
    let out = match tokio::time::timeout(NODE_LIMIT, cmd.output()).await {
        Ok(out) => out.expect("run node (install it with ./ops/e2b-js.sh)"),
        Err(_) => panic!("the JS suite ({set}) did not finish within {NODE_LIMIT:?}"),
    };
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("--- node --test ({set}) ---\n{text}");
    assert!(
        out.status.success(),
        "the JS suite ({set}) failed ({}):\n{text}",
        out.status
    );
    assert!(
        text.contains("# fail 0") && !text.contains("# pass 0"),
        "no test ran:\n{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_js_sdk_current() {
    run_suite("current").await;
}

/// Egress policies and an upstream proxy, through the SDK, in a test internet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_js_network() {
    let _one = ONE_AT_A_TIME.lock().await;
    let inet = internet::Internet::start();
    inet.start_proxies();
    let up = Up::start_in_netns(&inet.edge_ns, inet.mgmt, &internet::DNS.to_string()).await;
    run_module("current", "network.test.mjs", &up).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_js_sdk_previous() {
    run_suite("previous").await;
}
