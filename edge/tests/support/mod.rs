//! What the VM driver's test suites share (`vm_microvm`, `vm_fullvm`, `vm_firecracker`):
//! the image store and the static agent they use, the `base` image, a VM spec, cleanup
//! of the VMs a test made, exec through the agent, and how figures are printed.
#![allow(dead_code)] // each suite uses its own part

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use opendsec_edge::images::{Image, ImageStore};
use opendsec_edge::vm::shim::ExitInfo;
use opendsec_edge::vm::{ExecOutput, VmError, VmHandle, VmSpec, VmStatus};

/// Images are built once per machine and shared (as on an edge).
pub fn store_dir() -> PathBuf {
    std::env::var_os("OPENDSEC_IMAGE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(opendsec_edge::images::DEFAULT_STORE))
}

/// The static agent (`OPENDSEC_TEST_AGENT`, else the one `edge/agent/build-static.sh`
/// leaves in `target/agent-static/`).
pub fn static_agent() -> PathBuf {
    let p = std::env::var_os("OPENDSEC_TEST_AGENT")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/agent-static/opendsec-agent"));
    assert!(
        p.is_file(),
        "the static agent {} is missing: run edge/agent/build-static.sh {}",
        p.display(),
        p.display()
    );
    p
}

/// The suite `what` needs root (namespaces, taps, uids per VM).
pub fn require_root(what: &str) {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(unsafe { libc::geteuid() }, 0, "the {what} tests need root");
}

pub fn base_image() -> Image {
    ImageStore::open(store_dir())
        .expect("open the image store")
        .ensure("base", &|p| eprintln!("[base] {}: {}", p.phase, p.message))
        .expect("the base image")
}

/// A VM of `base` with 256 MiB, one vCPU (no CPU quota beyond it), a `disk_mb` writable
/// disk and agent token `token`.
pub fn vm_spec(id: &str, token: &str, disk_mb: u64, env: BTreeMap<String, String>) -> VmSpec {
    VmSpec {
        id: id.into(),
        image: base_image(),
        memory_mb: 256,
        vcpus: 1,
        disk_mb,
        env,
        access_token: token.into(),
        cpu_millis: None,
    }
}

/// Deletes the VMs a test made, also when it fails.
pub struct Cleanup(pub Vec<VmHandle>);

impl Drop for Cleanup {
    fn drop(&mut self) {
        for vm in &self.0 {
            match vm.delete() {
                Ok(()) | Err(VmError::NotFound(_)) => {}
                Err(e) => eprintln!("cleanup of {}: {e}", vm.id()),
            }
        }
    }
}

pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Runs `cmd args` in the guest through its agent with `token`; a failure shows the
/// guest's console.
pub fn exec_as(vm: &VmHandle, token: &str, cmd: &str, args: &[&str]) -> ExecOutput {
    let agent = vm.agent().unwrap();
    rt().block_on(agent.exec(token, cmd, args)).unwrap_or_else(|e| {
        panic!(
            "exec {cmd} {args:?} in {}: {e}; console: {}",
            vm.id(),
            vm.console_tail(2000)
        )
    })
}

/// How `vm`'s process ended, once the driver has it on record; panics after `within`.
pub fn exit_info(vm: &VmHandle, within: Duration) -> ExitInfo {
    let deadline = Instant::now() + within;
    loop {
        match vm.status().unwrap() {
            VmStatus::Exited(Some(info)) => return info,
            other if Instant::now() > deadline => panic!("{}: no exit on record within {within:?}: {other:?}", vm.id()),
            _ => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

pub fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

/// Prints a measured figure as `figure: <name> = <value>` (`--nocapture` shows them).
pub fn figure(name: &str, value: impl std::fmt::Display) {
    eprintln!("figure: {name} = {value}");
}

pub use opendsec_edge::testing::COUNTER;

/// Starts the [`COUNTER`] in the guest and waits until it listens (python starts
/// slowly under TCG); the probe's connection counts once, so the counter starts at 1.
pub fn start_counter(vm: &VmHandle, token: &str, within: Duration) {
    let out = exec_as(vm, token, "setsid", &["-f", "python3", "-c", COUNTER]);
    assert_eq!(out.exit_code, 0, "{out:?}");
    let deadline = std::time::Instant::now() + within;
    loop {
        let probe = exec_as(vm, token, "bash", &["-c", "exec 3<>/dev/tcp/127.0.0.1/7777 && echo up"]);
        if probe.stdout_text().contains("up") {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the counter never listened: {probe:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// One more on the guest's counter, as read back.
pub fn count_as(vm: &VmHandle, token: &str) -> u64 {
    let out = exec_as(vm, token, "bash", &["-c", "exec 3<>/dev/tcp/127.0.0.1/7777 && cat <&3"]);
    out.stdout_text()
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("the counter of {} said {out:?}", vm.id()))
}

/// The file, named by `./ops/test.sh`, that collects the checks which could not run on
/// this host; the script counts and names them in its last lines.
pub const NOT_RUN_FILE_ENV: &str = "OPENDSEC_NOT_RUN_FILE";

/// Records that `check` did not run here because it needs hardware KVM, the one reason a
/// check may not run (a host without it, or with only PVM, cannot boot a stock guest
/// under KVM). Every other missing prerequisite fails its test. Said on stderr past the
/// test harness's capture, so a passing test still shows it, and appended as
/// `check<TAB>reason` to the file in `OPENDSEC_NOT_RUN_FILE` when that is set.
pub fn not_run_needs_hardware_kvm(check: &str, reason: &str) {
    use std::io::Write;
    let reason = reason.replace(['\t', '\n'], " ");
    // io::stderr() itself, not eprintln!: libtest captures only the print macros.
    let _ = std::io::stderr().write_all(format!("NOT RUN (needs hardware KVM): {check}: {reason}\n").as_bytes());
    if let Some(path) = std::env::var_os(NOT_RUN_FILE_ENV) {
        // One short O_APPEND write per line: test processes running at once never interleave.
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| f.write_all(format!("{check}\t{reason}\n").as_bytes()))
            .unwrap_or_else(|e| panic!("cannot record a check not run in {}: {e}", path.to_string_lossy()));
    }
}
