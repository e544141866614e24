//! The AppArmor profile an edge names in the agent's configuration (`apparmor_profile`,
//! on `--config-fd`): every process the agent starts asks the kernel for it before its
//! exec, and one whose request fails is not started. The profile named here exists on no
//! host, so the kernel refuses it whether it has AppArmor (no such profile) or not (no
//! module takes the request): this runs the same everywhere.

mod common;

use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;

use common::*;
use serde_json::json;

const START: &str = "/process.Process/Start";

/// The agent, configured with `config` through a pipe, as an edge starts it.
async fn agent_configured(config: serde_json::Value) -> Agent {
    let mut fds = [0; 2];
    // Close-on-exec both: no other child may hold the write end (the agent reads to its end).
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    std::fs::File::from(write)
        .write_all(&serde_json::to_vec(&config).unwrap())
        .unwrap();
    let fd = read.as_raw_fd();
    let mut cmd = agent_command();
    // SAFETY: fcntl is async-signal-safe; the agent alone inherits the read end.
    unsafe {
        cmd.pre_exec(move || {
            if libc::fcntl(fd, libc::F_SETFD, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let dir = tempfile::tempdir().unwrap();
    let mut a = Agent::start_command(cmd, dir, None, &["--config-fd", &fd.to_string()], |_| {}).await;
    drop(read);
    a.token = config["access_token"].as_str().map(String::from);
    a
}

#[tokio::test]
async fn a_process_whose_profile_cannot_be_stacked_is_not_started() {
    let a = agent_configured(json!({"access_token": "t", "apparmor_profile": "opendsec-test-no-such-profile"})).await;
    let marker = a.dir.path().join("ran");
    for pty in [false, true] {
        let mut msg = sh(&format!("touch {}", marker.display()));
        if pty {
            msg["pty"] = json!({"size": {"cols": 80, "rows": 24}});
        }
        let mut s = a.stream(START, msg, &[]).await;
        match s.next().await {
            Some(Frame::End(v)) => {
                let m = v["error"]["message"].as_str().unwrap_or_default();
                assert!(
                    m.contains("under the AppArmor profile opendsec-test-no-such-profile"),
                    "pty {pty}: {v}"
                );
            }
            _ => panic!("pty {pty}: expected an error end frame"),
        }
    }
    assert!(!exists(&marker), "a process ran without its profile");
}

#[tokio::test]
async fn without_a_profile_processes_start_as_before() {
    let a = agent_configured(json!({"access_token": "t"})).await;
    let mut s = a.stream(START, sh("echo ran"), &[]).await;
    s.event().await;
    assert_eq!(s.collect().await.0, "ran\n");
}
