//! Following the kernel log (`/dev/kmsg`) from now on, one record at a time, on a thread
//! of its own: how the edge learns whom the OOM killer ended (`container::oom`) and what
//! sandboxes' policies dropped (`net::drops`).

use std::io::Read;
use std::sync::{Arc, Weak};

/// Calls `take(log, record)` with every kernel log record written from now on (the
/// whole record, `<prefix>;<text>`), on thread `name`, until `log` is dropped. Older
/// records are about a past run. An error: the log cannot be read (no `/dev/kmsg`, no
/// CAP_SYSLOG) or the thread not started.
pub fn follow<T: Send + Sync + 'static>(name: &str, log: &Arc<T>, take: fn(&T, &str)) -> std::io::Result<()> {
    let mut file = std::fs::File::open("/dev/kmsg")?;
    // SAFETY: lseek on an fd we own.
    unsafe { libc::lseek(std::os::fd::AsRawFd::as_raw_fd(&file), 0, libc::SEEK_END) };
    let weak: Weak<T> = Arc::downgrade(log);
    std::thread::Builder::new().name(name.into()).spawn(move || {
        let mut buf = vec![0u8; 8192];
        loop {
            let n = match file.read(&mut buf) {
                Ok(0) => return,
                Ok(n) => n,
                // Records were overwritten before we read them: go on with the next.
                Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::warn!(error = %e, "the kernel log reader stopped");
                    return;
                }
            };
            let Some(log) = weak.upgrade() else { return };
            take(&log, &String::from_utf8_lossy(&buf[..n]));
        }
    })?;
    Ok(())
}
