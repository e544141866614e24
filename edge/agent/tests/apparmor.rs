//! The AppArmor profile an edge names in the agent's configuration (`apparmor_profile`,
//! on `--config-fd`): every process the agent starts asks the kernel for it before its
//! exec, and one whose request fails is not started. The profile named here exists on no
//! host, so the kernel refuses it whether it has AppArmor (no such profile) or not (no
//! module takes the request): this runs the same everywhere.

mod common;

use common::*;
use serde_json::json;

const START: &str = "/process.Process/Start";

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
