//! The AppArmor profile stacked on every process the agent starts, where the edge says so
//! (`apparmor_profile` in its configuration, sent only on hosts where it loaded the
//! profiles: see the edge's `container/apparmor.rs`). The agent runs under the edge's
//! `opendsec-agent`; each child asks the kernel, between fork and exec, to stack the
//! sandbox's profile on it at its exec. A stack, not a change: under no_new_privs (every
//! container has it) AppArmor refuses a change to another profile and allows a stack. A
//! child whose request fails is not started: with the profile on, nothing runs without it.

use std::ffi::CStr;
use std::io;

/// Where the request is written: AppArmor's own file (Linux 5.8 and later), then the one
/// all security modules shared before.
pub const EXEC_ATTR: [&CStr; 2] = [c"/proc/self/attr/apparmor/exec", c"/proc/self/attr/exec"];

/// What a child writes before its exec, decided once from the configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OnExec {
    profile: String,
    request: Vec<u8>,
}

impl OnExec {
    /// The request for `profile` (`None`: no profile, nothing is written).
    pub fn new(profile: Option<&str>) -> Option<OnExec> {
        profile.map(|p| OnExec {
            profile: p.to_string(),
            request: format!("stack {p}").into_bytes(),
        })
    }

    pub fn profile(&self) -> &str {
        &self.profile
    }

    /// Writes the request into this process's exec attribute. Async-signal-safe (open,
    /// write and close on memory allocated beforehand): for a child between fork and exec.
    pub fn apply(&self) -> io::Result<()> {
        write_first(&EXEC_ATTR, &self.request)
    }
}

/// Writes `bytes` whole to the first of `paths` that exists.
fn write_first(paths: &[&CStr], bytes: &[u8]) -> io::Result<()> {
    let mut err = io::Error::from_raw_os_error(libc::ENOENT);
    for path in paths {
        // SAFETY: a NUL-terminated path; the fd is closed below.
        let fd = unsafe { libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC) };
        if fd < 0 {
            err = io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::ENOENT) {
                continue;
            }
            return Err(err);
        }
        // SAFETY: the buffer is live for its length; fd is ours.
        let n = unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) };
        let result = if n < 0 {
            Err(io::Error::last_os_error())
        } else if n as usize != bytes.len() {
            Err(io::Error::from_raw_os_error(libc::EIO))
        } else {
            Ok(())
        };
        // SAFETY: closing the fd opened above.
        unsafe { libc::close(fd) };
        return result;
    }
    Err(err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CString;

    #[test]
    fn nothing_is_asked_without_a_profile() {
        assert_eq!(OnExec::new(None), None);
        let on = OnExec::new(Some("opendsec-sandbox")).unwrap();
        assert_eq!(on.request, b"stack opendsec-sandbox");
        assert_eq!(on.profile(), "opendsec-sandbox");
    }

    #[test]
    fn the_request_goes_to_the_first_attribute_file_that_exists() {
        let dir = tempfile::tempdir().unwrap();
        let c = |name: &str| CString::new(dir.path().join(name).to_str().unwrap()).unwrap();
        let (missing, older, newer) = (c("missing"), c("attr-exec"), c("attr-apparmor-exec"));
        std::fs::write(dir.path().join("attr-exec"), "").unwrap();
        // Only the older file (a kernel before 5.8): the request goes there.
        write_first(&[&missing, &older], b"stack p").unwrap();
        assert_eq!(std::fs::read(dir.path().join("attr-exec")).unwrap(), b"stack p");
        // Both: only AppArmor's own.
        std::fs::write(dir.path().join("attr-apparmor-exec"), "").unwrap();
        std::fs::write(dir.path().join("attr-exec"), "").unwrap();
        write_first(&[&newer, &older], b"stack q").unwrap();
        assert_eq!(
            std::fs::read(dir.path().join("attr-apparmor-exec")).unwrap(),
            b"stack q"
        );
        assert_eq!(std::fs::read(dir.path().join("attr-exec")).unwrap(), b"");
        // Neither: an error, never silence.
        let e = write_first(&[&missing], b"stack p").unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOENT));
    }

    #[test]
    fn a_refused_request_is_an_error() {
        // /dev/full refuses every write (as the kernel refuses a profile it does not have).
        let e = write_first(&[c"/dev/full"], b"stack p").unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
    }
}
