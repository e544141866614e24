//! What a detached shim (containers' and microVMs') shares: detaching from the edge,
//! the one-line status it writes to the edge on its stdout, the pipe the edge reads
//! until it closes, and the process plumbing of waiting for what it started.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

/// Writes the status line on stdout and points stdout at /dev/null, so the edge's read
/// ends.
pub(crate) fn report(line: &str) {
    // SAFETY: fd 1 is the status pipe (or already /dev/null, then this is harmless).
    let mut out = unsafe { File::from_raw_fd(1) };
    let _ = out.write_all(format!("{line}\n").as_bytes());
    std::mem::forget(out);
    if let Ok(null) = OpenOptions::new().write(true).open("/dev/null") {
        // SAFETY: dup2 onto fd 1.
        unsafe { libc::dup2(null.as_raw_fd(), 1) };
    }
}

/// A pidfd for `pid` (a process that has not been reaped), or `None`.
pub(crate) fn pidfd_open(pid: i32) -> Option<OwnedFd> {
    // SAFETY: pidfd_open returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    // SAFETY: the fd was just returned to us.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// A `waitpid` status as (exit code, signal): the code is 128 + the signal when one
/// ended the process.
pub(crate) fn exit_of(status: i32) -> (i32, Option<i32>) {
    if libc::WIFSIGNALED(status) {
        let sig = libc::WTERMSIG(status);
        (128 + sig, Some(sig))
    } else {
        (libc::WEXITSTATUS(status), None)
    }
}

/// Reports that `what` failed (with the last OS error) and exits.
pub(crate) fn fail(what: &str) -> ! {
    report(&format!("error {what}: {}", std::io::Error::last_os_error()));
    std::process::exit(1)
}

/// Points stderr at `log` (appended; nobody reads the shim's terminal), then detaches:
/// fork, setsid, fork. The first process exits once the middle one is reaped, so the
/// edge reaps it and no zombie is left to init; the caller continues as the grandchild,
/// in a session of its own. Call while single-threaded.
pub(crate) fn detach(log: &Path) {
    if let Ok(log) = OpenOptions::new().create(true).append(true).open(log) {
        // SAFETY: dup2 onto fd 2.
        unsafe { libc::dup2(log.as_raw_fd(), 2) };
    }
    // SAFETY: plain syscalls in a single-threaded process.
    match unsafe { libc::fork() } {
        -1 => fail("fork"),
        0 => {}
        child => {
            let mut status = 0;
            // SAFETY: reaping our own child.
            unsafe { libc::waitpid(child, &mut status, 0) };
            std::process::exit(0)
        }
    }
    // SAFETY: as above.
    unsafe { libc::setsid() };
    match unsafe { libc::fork() } {
        -1 => fail("fork"),
        0 => {}
        _ => unsafe { libc::_exit(0) },
    }
}
