//! The one-line status a detached shim (containers' and microVMs') writes to the edge
//! on its stdout, the pipe the edge reads until it closes.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd};

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

/// Reports that `what` failed (with the last OS error) and exits.
pub(crate) fn fail(what: &str) -> ! {
    report(&format!("error {what}: {}", std::io::Error::last_os_error()));
    std::process::exit(1)
}
