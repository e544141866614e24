//! The OCI runtime binary (crun or runc) and how to call it on this host.
//!
//! crun 1.8 refuses cgroup "hybrid" hosts (v1 controllers plus a cgroup2 mount at
//! `/sys/fs/cgroup/unified`). It works, on cgroup v1, when each invocation runs in a
//! private mount namespace with that cgroup2 mount removed: [`Runtime::command`] does
//! exactly that (unshare + rprivate + umount in the child before exec), so the host's
//! mounts are untouched.

use std::fs;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::{Deserialize, Serialize};

use super::ContainerError;

/// Which runtime the operator asked for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RuntimeChoice {
    /// crun when it is installed (with the hybrid-cgroup workaround when needed), else runc.
    #[default]
    Auto,
    Crun,
    Runc,
}

impl std::str::FromStr for RuntimeChoice {
    type Err = ContainerError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self::Auto),
            "crun" => Ok(Self::Crun),
            "runc" => Ok(Self::Runc),
            other => Err(ContainerError::Invalid(format!(
                "unknown runtime {other:?}: use auto, crun or runc"
            ))),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RuntimeKind {
    Crun,
    Runc,
}

/// A resolved runtime: binary, state root and the cgroup workaround. Stored in each
/// sandbox's record so a restarted edge (or the shim) calls the same runtime the
/// sandbox was created with.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Runtime {
    pub kind: RuntimeKind,
    pub binary: PathBuf,
    /// The runtime's `--root` (its state directory).
    pub root: PathBuf,
    /// Run each invocation in a private mount namespace without `/sys/fs/cgroup/unified`.
    pub unmount_unified: bool,
}

const UNIFIED: &str = "/sys/fs/cgroup/unified";

impl Runtime {
    /// Resolves `choice` on this host. `root` is the runtime state directory.
    pub fn resolve(choice: RuntimeChoice, root: &Path) -> Result<Self, ContainerError> {
        let crun = find_binary("crun");
        let runc = find_binary("runc");
        let make = |kind, binary: PathBuf| {
            let unmount_unified = kind == RuntimeKind::Crun && host_is_cgroup_hybrid();
            Runtime {
                kind,
                binary,
                root: root.join(kind_name(kind)),
                unmount_unified,
            }
        };
        let rt = match choice {
            RuntimeChoice::Crun => make(RuntimeKind::Crun, crun.ok_or_else(|| missing("crun"))?),
            RuntimeChoice::Runc => make(RuntimeKind::Runc, runc.ok_or_else(|| missing("runc"))?),
            RuntimeChoice::Auto => match (crun, runc) {
                (Some(c), _) if crun_usable(&c) => make(RuntimeKind::Crun, c),
                (_, Some(r)) => make(RuntimeKind::Runc, r),
                (Some(c), None) => make(RuntimeKind::Crun, c),
                (None, None) => return Err(missing("crun or runc")),
            },
        };
        fs::create_dir_all(&rt.root).map_err(|e| ContainerError::io(format!("creating {}", rt.root.display()), e))?;
        Ok(rt)
    }

    pub fn name(&self) -> &'static str {
        kind_name(self.kind)
    }

    /// A command for `runtime --root ROOT <args>`, with the cgroup workaround if needed.
    pub fn command<I, S>(&self, args: I) -> Command
    where
        I: IntoIterator<Item = S>,
        S: AsRef<std::ffi::OsStr>,
    {
        let mut cmd = Command::new(&self.binary);
        cmd.arg("--root").arg(&self.root).args(args);
        if self.unmount_unified {
            hide_unified_cgroup(&mut cmd);
        }
        cmd
    }

    /// Runs a short runtime command and returns its stdout, or its stderr as the error.
    pub fn run(&self, args: &[&str]) -> Result<Vec<u8>, ContainerError> {
        let out = self
            .command(args)
            .stdin(std::process::Stdio::null())
            .output()
            .map_err(|e| ContainerError::io(format!("running {}", self.binary.display()), e))?;
        if out.status.success() {
            Ok(out.stdout)
        } else {
            Err(ContainerError::Runtime {
                runtime: self.name(),
                command: args.join(" "),
                message: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            })
        }
    }
}

fn kind_name(kind: RuntimeKind) -> &'static str {
    match kind {
        RuntimeKind::Crun => "crun",
        RuntimeKind::Runc => "runc",
    }
}

fn missing(what: &str) -> ContainerError {
    ContainerError::Prerequisite(format!("no OCI runtime: install the {what} package"))
}

pub(crate) fn find_binary(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/sbin:/usr/bin:/sbin:/bin".into());
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/usr/bin", "/sbin", "/bin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// Runs `cmd` in a private mount namespace without the host's `/sys/fs/cgroup/unified`
/// (crun refuses a host that mixes cgroup v1 controllers with that cgroup2 mount). The
/// host keeps its mount; only the runtime's namespace loses it.
pub fn hide_unified_cgroup(cmd: &mut Command) {
    // SAFETY: only raw syscalls (async-signal-safe) between fork and exec.
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

/// True when the host mixes cgroup v1 controllers with a cgroup2 mount (what crun rejects).
pub fn host_is_cgroup_hybrid() -> bool {
    !super::cgroup::is_unified() && is_cgroup2_mount(Path::new(UNIFIED))
}

fn is_cgroup2_mount(path: &Path) -> bool {
    nix::sys::statfs::statfs(path)
        .map(|s| s.filesystem_type() == nix::sys::statfs::CGROUP2_SUPER_MAGIC)
        .unwrap_or(false)
}

/// crun answers `--version` (a broken install is skipped in `auto`). Whether it can
/// create containers on a hybrid host is handled by the workaround, and a create
/// that still fails with crun's hybrid-mode error is reported as such.
fn crun_usable(binary: &Path) -> bool {
    Command::new(binary)
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}
