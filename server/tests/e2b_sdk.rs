//! Specification: the unmodified E2B Python SDK (`e2b` 2.63.0 with
//! `e2b-code-interpreter` 2.11.5, and `e2b` 2.50.0) works against OpenDsec with only
//! its own variables set. Each test starts a real `opendsec up`, issues an E2B API key
//! through the native API and runs one pytest module of `tests/e2b/` with nothing but
//! `E2B_API_KEY`, `E2B_API_URL` and `E2B_SANDBOX_URL` (the TLS test: `E2B_API_KEY`,
//! `E2B_DOMAIN` and `SSL_CERT_FILE`). The modules are the specification; read them.
//!
//! Needs root, crun or runc, the static agent (`./ops/test.sh`), the SDK venvs
//! (`./ops/e2b-venv.sh`, or `OPENDSEC_E2B_VENV`) and the `base` and
//! `code-interpreter-v1` images and, for MCP, `mcp-gateway` (built on first use into
//! /var/lib/opendsec/images).

#[path = "support/e2b_py.rs"]
mod e2b_py;
#[path = "support/internet.rs"]
mod internet;
#[path = "support/up.rs"]
mod up;

use e2b_py::{Sdk, pytest, python, workspace};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;
use up::Up;

/// Where the TLS test's host names live; they resolve through /etc/hosts only.
const TEST_DOMAIN: &str = "e2b-test.opendsec.internal";
/// Marks the /etc/hosts lines of the TLS test (the Python side adds some too).
const HOSTS_MARKER: &str = "# opendsec-e2b-test";
/// What `update-ca-certificates` writes: every CA the system trusts, in one file.
const SYSTEM_CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";
/// A first build of an image (debootstrap, the code interpreter's packages) is slow.
const IMAGE_BUILD_LIMIT: Duration = Duration::from_secs(30 * 60);

/// One module at a time, whatever `--test-threads` says: each starts a server with
/// sandboxes, and two at once on a 2-core machine would make every timing a guess.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The three variables that point the SDK at one port for everything.
fn single_url_vars(up: &Up, key: String) -> Vec<(&'static str, String)> {
    let url = format!("http://{}", up.http);
    vec![
        ("E2B_API_KEY", key),
        ("E2B_API_URL", url.clone()),
        ("E2B_SANDBOX_URL", url),
    ]
}

/// E2B_DOMAIN for a server started with [`TEST_DOMAIN`]: the domain with its TLS port.
fn tls_domain(up: &Up) -> String {
    let tls = up.tls.as_ref().expect("started with a domain");
    let port = tls.listen.rsplit(':').next().unwrap();
    format!("{TEST_DOMAIN}:{port}")
}

async fn run_module(module: &str, sdk: Sdk, images: &[&str]) {
    let _one = ONE_AT_A_TIME.lock().await;
    let python = python(sdk);
    let up = Up::start(None).await;
    for image in images {
        up.ensure_image(image, IMAGE_BUILD_LIMIT).await;
    }
    let key = up.issue_e2b_key().await;
    pytest(&python, module, &single_url_vars(&up, key)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_sdk_sync_commands() {
    run_module("test_sync_commands.py", Sdk::Current, &["base"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_sdk_async() {
    run_module("test_async.py", Sdk::Current, &["base"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_sdk_files() {
    run_module("test_files.py", Sdk::Current, &["base"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_sdk_errors() {
    run_module("test_errors.py", Sdk::Current, &["base"]).await;
}

/// `Sandbox.git` (git in the `base` image, remotes in the sandbox).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_sdk_git() {
    run_module("test_git.py", Sdk::Current, &["base"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_sdk_lifecycle() {
    run_module("test_lifecycle.py", Sdk::Current, &["base"]).await;
}

/// Network egress (`allow_internet_access`, `network`, `update_network`) against a test
/// internet of the harness's own (`support/internet.rs`), with `opendsec up` in its
/// edge namespace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_sdk_network() {
    let _one = ONE_AT_A_TIME.lock().await;
    let python = python(Sdk::Current);
    let inet = internet::Internet::start();
    inet.start_proxies();
    let up = Up::start_in_netns(&inet.edge_ns, inet.mgmt, &internet::DNS.to_string()).await;
    up.ensure_image("base", IMAGE_BUILD_LIMIT).await;
    let key = up.issue_e2b_key().await;
    pytest(&python, "test_network.py", &single_url_vars(&up, key)).await;
}

/// `base-vm`: microVMs under the SDK (pause with memory, snapshots, fork).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_sdk_microvm() {
    run_module("test_microvm.py", Sdk::Current, &["base"]).await;
}

/// Templates built with the SDK's `Template` builder, then started.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_sdk_templates() {
    run_module("test_templates.py", Sdk::Current, &["base"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_sdk_code_interpreter() {
    run_module("test_code_interpreter.py", Sdk::Current, &["code-interpreter-v1"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_sdk_v250_smoke() {
    run_module("test_v250_smoke.py", Sdk::V250, &["base"]).await;
}

/// Trusts a CA in the system store (`update-ca-certificates`) for as long as it lives.
struct SystemTrust {
    installed: PathBuf,
}

impl SystemTrust {
    fn install(ca: &Path) -> SystemTrust {
        if Command::new("update-ca-certificates").arg("--help").output().is_err() {
            let ok = Command::new("bash")
                .args(["-c", "source ops/lib.sh && ensure_packages ca-certificates"])
                .current_dir(workspace())
                .status()
                .is_ok_and(|s| s.success());
            assert!(ok, "could not install the ca-certificates package");
        }
        let installed = PathBuf::from(format!(
            "/usr/local/share/ca-certificates/opendsec-test-{}.crt",
            std::process::id()
        ));
        std::fs::create_dir_all(installed.parent().unwrap()).unwrap();
        std::fs::copy(ca, &installed)
            .unwrap_or_else(|e| panic!("copy {} to {}: {e}", ca.display(), installed.display()));
        let trust = SystemTrust { installed };
        update_ca_certificates();
        let pem = std::fs::read_to_string(ca).unwrap_or_default();
        let bundle = std::fs::read_to_string(SYSTEM_CA_BUNDLE).unwrap_or_default();
        assert!(
            !pem.trim().is_empty() && bundle.contains(pem.trim()),
            "update-ca-certificates did not add {} to {SYSTEM_CA_BUNDLE}",
            ca.display()
        );
        trust
    }
}

impl Drop for SystemTrust {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.installed);
        update_ca_certificates();
    }
}

fn update_ca_certificates() {
    let out = Command::new("update-ca-certificates")
        .output()
        .expect("run update-ca-certificates");
    assert!(
        out.status.success() || std::thread::panicking(),
        "update-ca-certificates: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// /etc/hosts lines carrying HOSTS_MARKER, removed (with those the Python side added)
/// when it is dropped.
struct HostsEntries;

impl HostsEntries {
    fn add(names: &[String]) -> HostsEntries {
        let hosts = Path::new("/etc/hosts");
        up::retain_lines(hosts, |l| !l.contains(HOSTS_MARKER)); // a crashed run's leftovers
        let mut text = std::fs::read_to_string(hosts).unwrap_or_default();
        if !text.is_empty() && !text.ends_with('\n') {
            text.push('\n');
        }
        for n in names {
            text.push_str(&format!("127.0.0.1 {n} {HOSTS_MARKER}\n"));
        }
        std::fs::write(hosts, text).expect("write /etc/hosts (the TLS test runs as root)");
        HostsEntries
    }
}

impl Drop for HostsEntries {
    fn drop(&mut self) {
        up::retain_lines(Path::new("/etc/hosts"), |l| !l.contains(HOSTS_MARKER));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_sdk_tls_domain() {
    let _one = ONE_AT_A_TIME.lock().await;
    let python = python(Sdk::Current);
    let up = Up::start(Some(TEST_DOMAIN)).await;
    up.ensure_image("base", IMAGE_BUILD_LIMIT).await;
    let key = up.issue_e2b_key().await;

    let _trust = SystemTrust::install(&up.ca_cert());
    let _hosts = HostsEntries::add(&[format!("api.{TEST_DOMAIN}")]);
    let vars = [
        ("E2B_API_KEY", key),
        ("E2B_DOMAIN", tls_domain(&up)),
        // The system bundle, which holds the CA only because SystemTrust put it there:
        // httpx (which otherwise trusts certifi's list) reads SSL_CERT_FILE, and so does
        // the SDK's own transport (rustls-native-certs); curl reads the bundle itself.
        // Naming the CA file alone here would let the SDK pass without the system store.
        ("SSL_CERT_FILE", SYSTEM_CA_BUNDLE.to_string()),
    ];
    pytest(&python, "test_domain.py", &vars).await;
}

/// MCP (`Sandbox.create(mcp=...)`, the `mcp-gateway` image): the SDK's API and envd
/// calls go to one URL as in the other modules; the MCP URL it hands out is a host name
/// on the TLS port (E2B_DOMAIN), which the module maps in /etc/hosts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_sdk_mcp() {
    let _one = ONE_AT_A_TIME.lock().await;
    let python = python(Sdk::Current);
    let up = Up::start(Some(TEST_DOMAIN)).await;
    up.ensure_image("mcp-gateway", IMAGE_BUILD_LIMIT).await;
    let key = up.issue_e2b_key().await;

    let _trust = SystemTrust::install(&up.ca_cert());
    let _hosts = HostsEntries::add(&[]);
    let mut vars = single_url_vars(&up, key);
    vars.push(("E2B_DOMAIN", tls_domain(&up)));
    vars.push(("SSL_CERT_FILE", SYSTEM_CA_BUNDLE.to_string()));
    pytest(&python, "test_mcp.py", &vars).await;
}
