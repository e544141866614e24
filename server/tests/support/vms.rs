//! What the VM sandbox suites share (`microvm_sandboxes`, `fullvm_sandboxes`): an
//! `opendsec up` whose edge's VM driver is ready, waiting for a sandbox's state, exec
//! through the API, an in-guest counter, and how figures are printed. Include beside
//! `support/up.rs` as `mod up;` and `mod vms;`.

#![allow(dead_code)]

use crate::up::Up;
use reqwest::Method;
use serde_json::Value;
use std::time::{Duration, Instant};

pub fn figure(name: &str, value: impl std::fmt::Display) {
    eprintln!("figure: {name} = {value}");
}

pub fn ms(d: Duration) -> String {
    format!("{} ms", d.as_millis())
}

/// `opendsec up`, once its edge's VM driver is ready (the kernel and initramfs are built
/// once per machine; the KVM verdict is kept for the host boot). A host where the driver
/// cannot start fails here, saying why: VMs are part of what is tested.
pub async fn start() -> Up {
    start_with_disk(256).await
}

/// As [`start`], with `disk_mb` of disk per sandbox.
pub async fn start_with_disk(disk_mb: u64) -> Up {
    let up = Up::start_with_disk(None, disk_mb).await;
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let log = up.log_tail(100_000);
        if let Some(line) = log.lines().find(|l| l.contains("microVMs ready")) {
            let verdict = line.split("accelerator=").nth(1).unwrap_or(line);
            eprintln!("VM accelerator: {verdict}");
            if !verdict.starts_with("\"kvm\"") {
                eprintln!(
                    "KVM is not usable here: guests run under TCG (figures are TCG's, about 15x slower than the host)"
                );
            }
            return up;
        }
        if let Some(line) = log
            .lines()
            .find(|l| l.contains("cannot run microVMs") || l.contains("no microVMs on this edge"))
        {
            panic!("this host cannot run VMs, so these tests could not run: {line}");
        }
        assert!(
            Instant::now() < deadline,
            "the edge's VM driver was not ready within 600 s:\n{}",
            up.log_tail(20)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// How the edge of `up` runs its VMs, as it said when its VM driver was ready:
/// (`vmm`, `accelerator`), e.g. ("qemu", "tcg").
#[allow(dead_code)]
pub fn edge_runtime(up: &Up) -> (String, String) {
    let log = up.log_tail(1_000_000);
    let line = log
        .lines()
        .find(|l| l.contains("microVMs ready"))
        .expect("the edge said its VM driver is ready");
    let field = |name: &str| {
        let rest = line
            .split(&format!(" {name}=\""))
            .nth(1)
            .unwrap_or_else(|| panic!("no {name} in {line}"));
        rest.split('"').next().unwrap().to_string()
    };
    (field("vmm"), field("accelerator"))
}

/// Waits until sandbox `id` is `want`; one that ended instead fails the test.
pub async fn wait_state(up: &Up, id: &str, want: &str, within: Duration) -> Value {
    let deadline = Instant::now() + within;
    loop {
        let (_, v) = up.send(Method::GET, &format!("/v1/sandboxes/{id}"), None).await;
        if v["state"] == want {
            return v;
        }
        if matches!(v["state"].as_str(), Some("failed" | "exited" | "killed")) {
            panic!("sandbox {id} ended instead of being {want}: {v}\n{}", up.log_tail(30));
        }
        assert!(
            Instant::now() < deadline,
            "sandbox {id} was not {want} within {within:?}: {v}\n{}",
            up.log_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Runs `cmd args` in sandbox `id` through the API; it must exit 0. Returns stdout.
pub async fn exec(up: &Up, id: &str, cmd: &str, args: &[&str]) -> String {
    let (out, code) = up
        .exec(id, cmd, args)
        .await
        .unwrap_or_else(|e| panic!("exec {cmd} {args:?} in {id}: {e}\n{}", up.log_tail(20)));
    assert_eq!(code, 0, "{cmd} {args:?} in {id} exited {code}: {out}");
    out
}

pub use opendsec_edge::testing::COUNTER;

/// Starts the counter and waits until it listens (its first count is that probe's: 1).
pub async fn start_counter(up: &Up, id: &str) {
    exec(up, id, "setsid", &["-f", "python3", "-c", COUNTER]).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (out, _) = up
            .exec(id, "bash", &["-c", "exec 3<>/dev/tcp/127.0.0.1/7777 && echo up"])
            .await
            .unwrap_or_default();
        if out.contains("up") {
            return;
        }
        assert!(Instant::now() < deadline, "the counter in {id} never listened");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// One more on the counter of sandbox `id`, as read back.
pub async fn count(up: &Up, id: &str) -> u64 {
    let out = exec(up, id, "bash", &["-c", "exec 3<>/dev/tcp/127.0.0.1/7777 && cat <&3"]).await;
    out.trim()
        .parse()
        .unwrap_or_else(|_| panic!("the counter of {id} said {out:?}"))
}
