//! Work inside another process's namespace, from a short-lived thread: a thread's
//! namespaces are its own, so joining one with `setns` changes nothing else of the edge.

use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;

/// Runs `f` on a new thread named `name` that has joined the namespace at `ns` (e.g.
/// `/proc/<pid>/ns/uts`, or a named network namespace) of kind `nstype`
/// (`libc::CLONE_NEWNET`, `libc::CLONE_NEWUTS`, ...), and returns what it returns.
pub(crate) fn in_namespace<T: Send + 'static>(
    ns: &Path,
    nstype: libc::c_int,
    name: &str,
    f: impl FnOnce() -> io::Result<T> + Send + 'static,
) -> io::Result<T> {
    let ns = std::fs::File::open(ns)?;
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            // SAFETY: setns on an fd we own; it changes only this thread's namespace.
            if unsafe { libc::setns(ns.as_raw_fd(), nstype) } != 0 {
                return Err(io::Error::last_os_error());
            }
            f()
        })?
        .join()
        .unwrap_or_else(|_| Err(io::Error::other(format!("the {name} thread panicked"))))
}
