//! Namespace plumbing: `ip` commands, and running code on a thread inside a named
//! network namespace (sockets made there stay there, wherever they are used later).

use std::os::fd::AsRawFd;
use std::process::{Command, Stdio};

/// `ip args...`; its stderr on failure.
pub(super) fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("run ip (iproute2): {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// `ip -n ns args...`.
pub(super) fn ip_in(ns: &str, args: &[&str]) -> Result<(), String> {
    let mut all = vec!["-n", ns];
    all.extend_from_slice(args);
    ip(&all)
}

/// The path of named namespace `ns`.
pub(super) fn path(ns: &str) -> String {
    format!("/run/netns/{ns}")
}

/// Runs `f` on a new thread inside network namespace `ns` (a name under /run/netns) and
/// returns what it returns. A new thread, never a pooled one: `setns` changes only the
/// calling thread, which then stays in `ns` until it ends.
pub(super) fn run_in<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> Result<T, String> {
    let file = std::fs::File::open(path(ns)).map_err(|e| format!("open {}: {e}", path(ns)))?;
    std::thread::Builder::new()
        .name(format!("in-{ns}"))
        .spawn(move || {
            // SAFETY: setns on an fd we own; it changes only this thread's namespace.
            if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(format!("setns: {}", std::io::Error::last_os_error()));
            }
            Ok(f())
        })
        .map_err(|e| format!("spawn a thread: {e}"))?
        .join()
        .map_err(|_| format!("the thread in {ns} panicked"))?
}

/// [`run_in`] from async code: the waiting happens on the blocking pool.
pub(super) async fn run_in_async<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, String> {
    let ns = ns.to_string();
    tokio::task::spawn_blocking(move || run_in(&ns, f))
        .await
        .map_err(|e| format!("the blocking task: {e}"))?
}
