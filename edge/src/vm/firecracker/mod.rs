//! Firecracker, the microVM driver's VMM where hardware KVM works. This module knows
//! Firecracker and its jailer and nothing of our VMs: finding the binaries (`tools`),
//! its HTTP API over a Unix socket (`api`), a jailed process's chroot, cgroups and
//! command line (`jail`), and merging a Diff snapshot's memory onto a full memory file
//! (`memfile`). `driver/fc.rs` turns these into VMs behind the same [`VmHandle`] as QEMU.
//!
//! [`VmHandle`]: super::VmHandle

mod api;
mod jail;
mod memfile;

use std::path::{Path, PathBuf};
use std::process::Command;

pub use api::{FcApi, InstanceState, SnapshotKind};
pub use jail::{CgroupVersion, JailSpec, cgroup_version};
pub use memfile::{DiffMerge, merge_diff, merge_diff_into_copy};

use super::{VmError, find_tool};

/// The Firecracker release line the driver speaks (API and snapshot format).
pub const SUPPORTED_VERSION: &str = "1.12.";

/// The Firecracker and jailer binaries the driver runs.
#[derive(Clone, Debug)]
pub struct FirecrackerTools {
    pub firecracker: PathBuf,
    pub jailer: PathBuf,
    /// What `firecracker --version` says, e.g. `1.12.1`.
    pub version: String,
}

const INSTALL_HINT: &str = "run ./ops/test.sh (it installs firecracker and jailer v1.12.1 \
     to /usr/local/bin) or put firecracker and jailer v1.12.x on PATH";

/// Finds firecracker and jailer (the given paths, else PATH, else /usr/local/bin) and
/// checks that both are v1.12.x.
pub fn find_firecracker(firecracker: Option<&Path>, jailer: Option<&Path>) -> Result<FirecrackerTools, VmError> {
    let locate = |given: Option<&Path>, name: &str| -> Result<PathBuf, VmError> {
        let found = match given {
            Some(p) => p.is_file().then(|| p.to_path_buf()),
            None => on_path(name).or_else(|| find_tool(name)),
        };
        found.ok_or_else(|| {
            VmError::Prerequisite(format!(
                "{name} is missing{}: {INSTALL_HINT}",
                given
                    .map(|p| format!(" (looked for {})", p.display()))
                    .unwrap_or_default()
            ))
        })
    };
    let firecracker = locate(firecracker, "firecracker")?;
    let jailer = locate(jailer, "jailer")?;
    let version = tool_version(&firecracker, "Firecracker v")?;
    let jailer_version = tool_version(&jailer, "Jailer v")?;
    for (name, v) in [("firecracker", &version), ("jailer", &jailer_version)] {
        if !v.starts_with(SUPPORTED_VERSION) {
            return Err(VmError::Prerequisite(format!(
                "{name} is v{v}, the driver speaks v{SUPPORTED_VERSION}x: {INSTALL_HINT}"
            )));
        }
    }
    // The jailer execs only a file whose name contains "firecracker".
    if !firecracker
        .file_name()
        .is_some_and(|n| n.to_string_lossy().contains("firecracker"))
    {
        return Err(VmError::Prerequisite(format!(
            "the jailer runs only a binary named *firecracker*, not {}",
            firecracker.display()
        )));
    }
    Ok(FirecrackerTools {
        firecracker,
        jailer,
        version,
    })
}

fn on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_string_lossy()
        .split(':')
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
}

/// The version `binary --version` prints after `prefix` (`Firecracker v1.12.1` -> `1.12.1`).
fn tool_version(binary: &Path, prefix: &str) -> Result<String, VmError> {
    let out = Command::new(binary)
        .arg("--version")
        .env_clear()
        .output()
        .map_err(|e| VmError::Prerequisite(format!("cannot run {}: {e}: {INSTALL_HINT}", binary.display())))?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.trim().strip_prefix(prefix))
        .map(|v| v.trim().to_string())
        .ok_or_else(|| {
            VmError::Prerequisite(format!(
                "{} --version did not say {prefix}...: {:?}",
                binary.display(),
                text.trim()
            ))
        })
}
