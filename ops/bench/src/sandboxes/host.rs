//! Host plumbing the sandboxes benchmark shares: free ports, pid files, the OCI
//! runtime's command line (private mount namespace on a cgroup-hybrid host) and mount
//! bookkeeping for teardown.

use std::path::Path;
use std::process::Command;

pub(crate) use opendsec_edge::container::is_mounted;
pub(crate) use opendsec_edge::container::runtime::{hide_unified_cgroup, host_is_cgroup_hybrid};

pub(crate) fn free_port() -> Result<u16, String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| format!("no free port: {e}"))?;
    Ok(l.local_addr().map_err(|e| e.to_string())?.port())
}

pub(crate) fn read_pid(p: &Path) -> Option<i32> {
    std::fs::read_to_string(p).ok()?.trim().parse().ok()
}

/// `rt --root ROOT args...`; for crun on a hybrid host, in a private mount namespace
/// without /sys/fs/cgroup/unified (the same workaround as the edge's runtime).
pub(crate) fn runtime_cmd(rt: &str, root: &Path, hybrid: bool) -> Command {
    let mut cmd = Command::new(rt);
    cmd.arg("--root").arg(root);
    if rt == "crun" && hybrid {
        hide_unified_cgroup(&mut cmd);
    }
    cmd
}

pub(crate) fn umount_detach(p: &Path) {
    if let Ok(c) = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()) {
        // SAFETY: plain syscall on a path we own.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    }
}

/// Mount points under `dir` in this mount namespace.
pub fn mounts_under(dir: &Path) -> Vec<String> {
    let prefix = dir.to_string_lossy().to_string();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(4).map(str::to_string))
        .filter(|m| m.starts_with(&prefix))
        .collect()
}
