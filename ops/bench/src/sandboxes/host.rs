//! Host plumbing the sandboxes benchmark shares: free ports, base64 of the agent's
//! stream, pid files, the OCI runtime's command line (private mount namespace on a
//! cgroup-hybrid host) and mount bookkeeping for teardown.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

pub(super) fn free_port() -> Result<u16, String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| format!("no free port: {e}"))?;
    Ok(l.local_addr().map_err(|e| e.to_string())?.port())
}

/// Standard base64 (with or without padding).
pub fn b64decode(s: &str) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0u32);
    for c in s.bytes() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            b'=' => break,
            _ => return None,
        };
        acc = (acc << 6) | v as u32;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    Some(out)
}

pub(super) fn read_pid(p: &Path) -> Option<i32> {
    std::fs::read_to_string(p).ok()?.trim().parse().ok()
}

/// The host mixes cgroup v1 with a cgroup2 mount at /sys/fs/cgroup/unified (crun 1.8
/// refuses that unless run in a private mount namespace without it).
pub(super) fn host_is_cgroup_hybrid() -> bool {
    const CGROUP2_MAGIC: i64 = 0x6367_7270;
    let magic = |p: &str| -> Option<i64> {
        let c = std::ffi::CString::new(p).ok()?;
        let mut st: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: statfs fills the struct we own.
        (unsafe { libc::statfs(c.as_ptr(), &mut st) } == 0).then_some(st.f_type as i64)
    };
    magic("/sys/fs/cgroup") != Some(CGROUP2_MAGIC) && magic("/sys/fs/cgroup/unified") == Some(CGROUP2_MAGIC)
}

/// `rt --root ROOT args...`; for crun on a hybrid host, in a private mount namespace
/// without /sys/fs/cgroup/unified (as `opendsec_edge::container::Runtime::command`).
pub(super) fn runtime_cmd(rt: &str, root: &Path, hybrid: bool) -> Command {
    let mut cmd = Command::new(rt);
    cmd.arg("--root").arg(root);
    if rt == "crun" && hybrid {
        // SAFETY: only raw syscalls between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                if libc::unshare(libc::CLONE_NEWNS) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::mount(
                    c"none".as_ptr(),
                    c"/".as_ptr(),
                    std::ptr::null(),
                    libc::MS_REC | libc::MS_PRIVATE,
                    std::ptr::null(),
                ) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::umount2(c"/sys/fs/cgroup/unified".as_ptr(), libc::MNT_DETACH) != 0 {
                    let err = std::io::Error::last_os_error();
                    if err.raw_os_error() != Some(libc::EINVAL) {
                        return Err(err);
                    }
                }
                Ok(())
            });
        }
    }
    cmd
}

pub(super) fn umount_detach(p: &Path) {
    if let Ok(c) = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()) {
        // SAFETY: plain syscall on a path we own.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    }
}

pub(super) fn is_mounted(p: &Path) -> bool {
    let want = p.to_string_lossy().to_string();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split(' ').nth(4).map(|m| m.replace("\\040", " ")) == Some(want.clone()))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_decodes() {
        assert_eq!(b64decode("aGkK").unwrap(), b"hi\n");
        assert_eq!(b64decode("aGk=").unwrap(), b"hi");
        assert_eq!(b64decode("").unwrap(), b"");
    }
}
