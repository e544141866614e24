//! The QEMU microVM driver: sandboxes as `-M microvm` guests that boot Debian's kernel,
//! our own initramfs and the same image layers and agent as containers, driven over QMP,
//! with guest RAM in a file so that pause, resume and fork with memory are cheap. The
//! same driver runs full VMs (`-M q35`: SeaBIOS boots the image as a whole disk through
//! extlinux) through the same code paths; the VM's record says which machine it is.
//!
//! The pieces, each in its own file:
//! - `kernel`: the guest kernel (Debian's `linux-image-amd64`, vmlinux extracted from the
//!   bzImage) and the modules the guest needs, in load order; cached in the image store.
//! - `cpio` and `initramfs`: the initramfs (busybox, the modules, `init.sh`, the agent)
//!   and the small per-VM archive appended to it (the agent's configuration).
//! - `disks`: the read-only root disk of an image (EROFS, one per list of layers) and
//!   the per-VM writable ext4 disk; sparse copies.
//! - `machine` and `bootdisk`: full VMs (`-M q35`): the machine's devices, and the whole
//!   disk (MBR, ext4, extlinux, kernel, initramfs) a full VM of an image boots, cached
//!   as a qcow2 base under per-VM overlays.
//! - `net`: the agent channel, a tap device in a network namespace of its own per VM.
//! - `qmp`: a small QMP client (capabilities, commands, events, fds over SCM_RIGHTS).
//! - `shim`: the detached parent of each QEMU process (`opendsec-vm-shim`).
//! - `accel`: honest KVM detection (a probe guest must reach user space in time).
//! - `driver`: [`MicroVmDriver`] and [`VmHandle`]: create, pause, resume, fork, kill;
//!   each VMM in a cgroup of its own (`driver/cgroup.rs`: CPU quota, memory, IO weight).
//! - `agent`: a minimal client of the in-guest agent (health, exec) for readiness checks,
//!   tests and the benchmark.
//! - `firecracker`: Firecracker and its jailer (API client, jail, Diff merging);
//!   `driver/fc.rs` runs VMs under it behind the same [`VmHandle`].
//! - `vmm`: which VMM a driver gives new VMs ([`Vmm`]: QEMU or Firecracker).
//!
//! The agent channel: no vsock on these hosts, so each VM has a network namespace of its
//! own holding one tap; every namespace is identical (guest 169.254.100.2:49983), so a
//! restored or forked guest's network configuration stays valid. QEMU (`-accel kvm` only
//! when `accel` says so, else TCG with a 64 MiB translation cache) runs with `-sandbox on`
//! (no spawn, no new privileges) and `-nodefaults`. Kernel, initramfs and disks are cached
//! in the image store (`kernels/`, `initramfs/`, `vmdisks/`), built once per machine under
//! its locks.
//!
//! Not yet: full VMs under Firecracker (they always run under QEMU), OVMF/UEFI boot,
//! iterating the disk's dirty bitmap (a guest that writes its disk fast during a fork makes
//! the pause longer: its blocks are copied while stopped), a bound on a fork's total time
//! when a guest dirties RAM faster than it is copied (after 10 s QEMU may stop it for up
//! to 1 s).
//!
//! Tests: `edge/tests/vm_microvm.rs` (real QEMU, a few minutes under TCG: snapshot and
//! restore, shared restore pages, re-keying, a corrupt snapshot refused with nothing left
//! behind, forks of a busy guest checked page by page); `edge/tests/vm_fullvm.rs` (real
//! q35 + SeaBIOS + extlinux); `edge/tests/vm_firecracker.rs`; figures beside raw QEMU:
//! `sudo ops/vm-bench.sh` (`opendsec-vm-bench`).

mod accel;
pub mod agent;
mod bootdisk;
mod cpio;
mod disks;
mod driver;
pub mod firecracker;
mod initramfs;
mod kernel;
mod machine;
mod net;
mod qmp;
pub mod shim;
mod vmm;

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use serde::Serialize;

pub use accel::{Accel, AccelVerdict, detect_accel, host_tsc_khz};
pub use agent::{AgentChannel, ExecOutput};
pub use bootdisk::{BootDiskManifest, FREE_SPACE_MB, ensure_boot_disk, host_can_build_boot_disks};
pub use disks::{build_root_disk, sparse_copy};
pub use driver::{
    ForkReport, MAX_FORK_COUNT, MemoryUsage, MicroVmDriver, PauseReport, RamMode, ResumeReport, SNAPSHOT_META,
    SnapshotReport, VmConfig, VmFiles, VmHandle, VmSpec, VmState, VmStatus, agent_channel_at, vmm_memory_limit,
    vmm_overhead_mb,
};
pub use initramfs::{GuestBoot, ensure_guest_boot};
pub use kernel::{GuestKernel, ensure_kernel};
pub use machine::Machine;
pub use net::{GUEST_MAC, TAP};
/// The agent channel's namespaces, for tools that run QEMU beside the driver (the
/// benchmark's raw QEMU): the same tap and addresses as a VM's.
pub mod netns {
    pub use super::net::{agent_addr, create, delete, netns_path};
}
pub use qmp::{Qmp, QmpError};
pub use vmm::{Vmm, VmmChoice, VmmVerdict, choose_vmm};

use crate::images::ImageError;

/// Where the agent listens inside every guest: the guest's side of its tap's /30. Each
/// VM has a network namespace of its own, so all guests (and every fork copy, whose
/// memory already holds this configuration) use the same addresses.
pub const GUEST_IP: [u8; 4] = [169, 254, 100, 2];
/// The host's side of the tap, inside the VM's namespace.
pub const HOST_IP: [u8; 4] = [169, 254, 100, 1];
/// envd's port, as in E2B.
pub const AGENT_PORT: u16 = 49983;

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// A host tool or file the driver needs is missing.
    #[error("{0}")]
    Prerequisite(String),
    #[error("{context}: {source}")]
    Io { context: String, source: io::Error },
    #[error(transparent)]
    Image(#[from] ImageError),
    /// Building the guest kernel, initramfs or a disk failed.
    #[error("building {what} failed: {message}")]
    Build { what: String, message: String },
    #[error("QMP: {0}")]
    Qmp(#[from] QmpError),
    /// QEMU did not start, or ended while an operation needed it.
    #[error("QEMU of VM {id}: {message}")]
    Qemu { id: String, message: String },
    #[error("invalid VM id {0:?}: use 1-64 letters, digits and '-'")]
    InvalidId(String),
    #[error("VM {0} does not exist")]
    NotFound(String),
    #[error("VM {0} already exists")]
    Exists(String),
    /// The operation is not legal in the VM's current state.
    #[error("VM {id} is {state}: cannot {operation}")]
    BadState {
        id: String,
        state: String,
        operation: &'static str,
    },
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("timed out after {seconds} s waiting for {what}")]
    Timeout { what: String, seconds: u64 },
    /// A VM's files on disk are not what the driver wrote.
    #[error("corrupt VM state {path}: {message}")]
    Corrupt { path: PathBuf, message: String },
    /// The agent in the guest answered unexpectedly.
    #[error("agent: {0}")]
    Agent(String),
    /// A Firecracker API request failed (`status` is the HTTP status, when it answered).
    #[error("Firecracker API {request}: {message}")]
    FirecrackerApi {
        request: String,
        status: Option<u16>,
        message: String,
    },
    /// A Firecracker process did not start, or ended while an operation needed it.
    #[error("Firecracker of VM {id}: {message}")]
    Firecracker { id: String, message: String },
}

impl VmError {
    pub(crate) fn io(context: impl Into<String>, source: io::Error) -> Self {
        VmError::Io {
            context: context.into(),
            source,
        }
    }
}

pub(crate) fn io_err(context: impl Into<String>) -> impl FnOnce(io::Error) -> VmError {
    let context = context.into();
    move |source| VmError::Io { context, source }
}

/// Writes `value` as JSON to a temporary file and renames it over `path`.
pub(crate) fn write_json_atomic<T: Serialize>(path: &Path, value: &T) -> Result<(), VmError> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let json = serde_json::to_vec_pretty(value).expect("serialisable");
    fs::write(&tmp, json).map_err(io_err(format!("writing {}", tmp.display())))?;
    fs::rename(&tmp, path).map_err(io_err(format!("writing {}", path.display())))
}

pub(crate) fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, VmError> {
    let bytes = fs::read(path).map_err(io_err(format!("reading {}", path.display())))?;
    serde_json::from_slice(&bytes).map_err(|e| VmError::Corrupt {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

/// The first of `dirs` that holds an executable `name`.
pub(crate) fn find_tool(name: &str) -> Option<PathBuf> {
    [
        "/usr/local/sbin",
        "/usr/local/bin",
        "/usr/sbin",
        "/usr/bin",
        "/sbin",
        "/bin",
    ]
    .iter()
    .map(|d| Path::new(d).join(name))
    .find(|p| p.is_file())
}

/// Whether QEMU (`qemu-system-x86_64`) is installed where the driver looks for it.
pub fn host_has_qemu() -> bool {
    find_tool("qemu-system-x86_64").is_some()
}

/// Like [`find_tool`], or a [`VmError::Prerequisite`] naming the package to install.
pub(crate) fn require_tool(name: &str, package: &str) -> Result<PathBuf, VmError> {
    find_tool(name).ok_or_else(|| {
        VmError::Prerequisite(format!(
            "{name} is missing: install the {package} package (apt-get install {package})"
        ))
    })
}

/// Takes an exclusive `flock` on `path` (created if needed); released on drop.
pub(crate) fn lock_file(path: &Path) -> Result<fs::File, VmError> {
    use std::os::fd::AsRawFd;
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent).map_err(io_err(format!("creating {}", parent.display())))?;
    }
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(io_err(format!("opening {}", path.display())))?;
    loop {
        // SAFETY: flock on an fd we own.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } == 0 {
            return Ok(file);
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(VmError::io(format!("locking {}", path.display()), err));
        }
    }
}

/// SHA-256 of a file, hex.
pub(crate) fn file_sha256(path: &Path) -> Result<String, VmError> {
    use sha2::{Digest, Sha256};
    let mut file = fs::File::open(path).map_err(io_err(format!("reading {}", path.display())))?;
    let mut digest = Sha256::new();
    io::copy(&mut file, &mut digest).map_err(io_err(format!("reading {}", path.display())))?;
    Ok(hex::encode(digest.finalize()))
}
