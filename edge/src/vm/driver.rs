//! [`MicroVmDriver`]: microVMs as files on disk plus detached QEMU processes.
//!
//! Layout under the driver's root (the edge's `<data>/vms`):
//! - `vms/<id>/vm.json`: [`VmRecord`], the truth about a VM (written atomically, after
//!   the step it records); `lock` serialises operations on the VM across processes.
//! - `vms/<id>/{ram, rw.img, initrd}`: guest RAM (a file, see [`RamMode`]), the
//!   writable disk and the VM's initrd, owned by the VM's uid; `state`: the last
//!   migration stream (root's); `run/qmp.sock`; `launch.json`, `qemu.pid`,
//!   `console.log`, `shim.log`, `exit.json` of the current QEMU run.
//! - `forks/<fork id>/ram`: the frozen RAM of a fork's source, which every copy maps
//!   privately (pages shared until a copy writes them), and `forks/snap-<dev>-<inode>/ram`,
//!   a snapshot's RAM file hard-linked as the base of the VMs restored from it; each with
//!   `gid`, the group of its own that the VMs mapping it carry; removed (and the group
//!   freed) when no VM uses it.
//! - `receivers/<id>/`: the receiver QEMU of a live copy of VM `<id>` (see `precopy`),
//!   while the copy runs.
//! - the uids handed to VMs (one each) are recorded in the image store's `vm-uids/`
//!   (one registry per machine, so that the VMs of several drivers, two edges say, never
//!   share a uid): `vm-uids/<uid>` holds the VM directory that owns it.
//! - `accel.json`: the accelerator verdict, kept for one host boot (or where
//!   [`VmConfig::accel_cache`] says).
//!
//! A full VM (`Machine::Q35`) has the same files: `rw.img` is its whole disk (a qcow2
//! overlay over its image's boot disk, `bootdisk.rs`, which the record's `root_disk`
//! names) and `initrd` its configuration disk; `machine.rs` says how QEMU gets them.
//!
//! Snapshots live wherever the caller puts them ([`VmHandle::snapshot_to`],
//! [`MicroVmDriver::restore_snapshot`]): `snapshot.json`, `state`, `ram`, `rw.img`.
//!
//! Nothing is kept in memory between calls: a restarted edge opens the same VMs with
//! [`MicroVmDriver::open`] (QEMU runs under its shim, not as the edge's child).

use std::collections::BTreeMap;
use std::fs;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{PermissionsExt, chown};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::accel::{Accel, AccelVerdict, detect_accel, host_tsc_khz};
use super::agent::AgentChannel;
use super::bootdisk::{create_overlay, ensure_boot_disk};
use super::disks::{allocated_bytes, build_root_disk, create_rw_disk, sparse_copy};
use super::firecracker::{FirecrackerTools, find_firecracker};
use super::initramfs::{GuestBoot, GuestConfig, ensure_guest_boot, write_config_disk, write_vm_initrd};
use super::machine::{Machine, q35_args};
use super::qmp::{Qmp, QmpError};
use super::shim::{ExitInfo, Launch};
use super::vmm::{Vmm, VmmChoice, VmmVerdict, choose_vmm};
use super::{VmError, io_err, lock_file, net, read_json, require_tool, write_json_atomic};
use crate::images::{Image, ImageStore};
use crate::status_pipe::pidfd_open;

/// VMs under Firecracker: the same handle, another VMM.
mod fc;
mod precopy;

/// The most copies one fork may make.
pub const MAX_FORK_COUNT: usize = 64;
/// Default first uid of the range VMs' QEMU processes run as.
pub const DEFAULT_UID_BASE: u32 = 1_800_000_000;
const UID_SLOTS: u32 = 1 << 20;

/// How long QEMU may take to open its QMP socket, and a migration to finish.
const QEMU_START_TIMEOUT: Duration = Duration::from_secs(30);
const MIGRATION_TIMEOUT: Duration = Duration::from_secs(120);
const QMP_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Clone, Debug)]
pub struct VmConfig {
    /// The driver's state (see the module doc).
    pub root: PathBuf,
    /// The image store: layers, and the cached kernel, initramfs and root disks.
    pub store: ImageStore,
    /// The static `opendsec-agent`.
    pub agent_binary: PathBuf,
    /// `opendsec-vm-shim`.
    pub shim: PathBuf,
    /// `qemu-system-x86_64` (found on PATH when `None`).
    pub qemu: Option<PathBuf>,
    /// QEMU runs as uid (= gid) `uid_base + n`, one per VM; `None` keeps it root.
    pub uid_base: Option<u32>,
    pub console_cap_bytes: u64,
    /// Force an accelerator instead of detecting one.
    pub accel: Option<Accel>,
    /// How long the KVM probe guest may take to reach user space.
    pub kvm_probe_bound: Duration,
    /// Where the accelerator verdict is kept for the host boot (default
    /// `<root>/accel.json`); drivers of one machine may share it.
    pub accel_cache: Option<PathBuf>,
    /// Where handed-out uids are recorded (default: the image store's `vm-uids`, shared by
    /// every driver of the machine). Drivers that share a uid range must share it, or two
    /// VMs could run as one uid.
    pub uid_registry: Option<PathBuf>,
    /// The VMM of new VMs (see [`VmmChoice`]).
    pub vmm: VmmChoice,
    /// `firecracker` and `jailer` (found on PATH or in /usr/local/bin when `None`).
    pub firecracker: Option<PathBuf>,
    pub jailer: Option<PathBuf>,
}

impl VmConfig {
    pub fn new(root: impl Into<PathBuf>, store: ImageStore, agent_binary: PathBuf, shim: PathBuf) -> Self {
        Self {
            root: root.into(),
            store,
            agent_binary,
            shim,
            qemu: None,
            uid_base: Some(DEFAULT_UID_BASE),
            console_cap_bytes: 1 << 20,
            accel: None,
            kvm_probe_bound: Duration::from_secs(8),
            accel_cache: None,
            uid_registry: None,
            vmm: VmmChoice::Auto,
            firecracker: None,
            jailer: None,
        }
    }
}

/// What to run: the sandbox's image and size, and its agent's configuration.
#[derive(Clone, Debug)]
pub struct VmSpec {
    pub id: String,
    pub image: Image,
    pub memory_mb: u64,
    pub vcpus: u32,
    /// Size of the writable disk.
    pub disk_mb: u64,
    /// The sandbox's environment (the agent's `--env-file`).
    pub env: BTreeMap<String, String>,
    /// What every request to the agent must carry (`X-Access-Token`).
    pub access_token: String,
}

/// Under TCG a VM's RAM is this much short of its whole MiBs (`-m` takes multiples of 8 KiB). QEMU 7.2's live migration
/// loses guest writes under TCG when a RAM block's length is a multiple of 64 pages: its
/// fast dirty-bitmap sync clears the bits without making TCG's TLB track the pages
/// again (later QEMU resets the TLB there), so a page written again through a TLB
/// entry filled before is never sent. Any other length takes the page-by-page sync,
/// which resets the TLB of every page it finds dirty. Seen here: pages of guest kernel
/// data missing from live copies of a busy guest.
const TCG_RAM_TRIM_KB: u64 = 8;

/// The guest RAM QEMU is given, in KiB.
fn guest_ram_kb(memory_mb: u64, trimmed: bool) -> u64 {
    (memory_mb << 10) - if trimmed { TCG_RAM_TRIM_KB } else { 0 }
}

/// How a QEMU process starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum QemuStart {
    /// A cold boot.
    Boot,
    /// Waiting for a snapshot (`-incoming defer`); runs once it is loaded.
    Restore,
    /// A live copy's receiver (see `precopy`): waits for a migration stream and never
    /// runs the guest it receives.
    Receive,
}

/// Where a VM's guest RAM lives.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "mode")]
pub enum RamMode {
    /// `vms/<id>/ram`, mapped shared: the file is the memory, so a snapshot leaves it
    /// out of the migration stream (`x-ignore-shared`) and keeps the file.
    Shared,
    /// A fork copy: the fork's frozen RAM file mapped privately (copy-on-write). Its
    /// next pause writes the whole RAM into the stream.
    Private { base: PathBuf },
    /// Paused with the RAM inside `state`; resuming loads it into a fresh shared file.
    InStream,
}

/// The state the driver last put a VM in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VmState {
    /// A QEMU process was started for it (it may have ended since: see [`VmStatus`]).
    Running,
    /// Snapshotted to `state` (+ RAM), no QEMU process.
    Paused,
}

/// What a VM is doing now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VmStatus {
    Running {
        pid: i32,
    },
    Paused,
    /// Its QEMU process ended without the driver asking (guest reboot or panic, a crash,
    /// a kill): the channel to the agent is gone.
    Exited(Option<ExitInfo>),
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct VmRecord {
    id: String,
    image: String,
    layers: Vec<String>,
    memory_mb: u64,
    vcpus: u32,
    disk_mb: u64,
    uid: u32,
    groups: Vec<u32>,
    netns: String,
    vmlinux: PathBuf,
    root_disk: PathBuf,
    accel: Accel,
    tsc_khz: Option<u64>,
    /// The guest's RAM is [`TCG_RAM_TRIM_KB`] short of `memory_mb` (see there). Absent in
    /// records of VMs made before: their RAM is whole MiBs and is never copied live
    /// under TCG.
    #[serde(default)]
    ram_trimmed: bool,
    ram: RamMode,
    state: VmState,
    /// The current QEMU process: its pid and start time (so a reused pid is not ours).
    pid: Option<i32>,
    pid_start: Option<u64>,
    forked_from: Option<String>,
    #[serde(default)]
    vmm: Vmm,
    /// `microvm`, or `q35` for a full VM (see `machine.rs`).
    #[serde(default)]
    machine: Machine,
    /// What only a Firecracker VM has (see `fc.rs`).
    #[serde(default, skip_serializing_if = "fc::FcRecord::is_empty")]
    fc: fc::FcRecord,
}

/// Memory of one QEMU process (from `/proc/<pid>/smaps_rollup`), in KiB.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryUsage {
    pub rss_kb: u64,
    /// Proportional: pages shared with other processes count by their share.
    pub pss_kb: u64,
    pub private_kb: u64,
    /// The part of the above that is the guest's RAM mapping (the rest is QEMU itself:
    /// under TCG mostly its translation cache, and the kernel image it keeps).
    pub guest_ram_rss_kb: u64,
    pub guest_ram_pss_kb: u64,
}

/// Where a VM's pieces are (for diagnostics and for benchmarks that run raw QEMU on
/// the same files).
#[derive(Clone, Debug)]
pub struct VmFiles {
    pub dir: PathBuf,
    pub vmlinux: PathBuf,
    pub initrd: PathBuf,
    pub root_disk: PathBuf,
    pub rw_disk: PathBuf,
    /// The RAM file QEMU maps (a fork copy's is its fork's frozen base).
    pub ram: PathBuf,
    /// The last snapshot's migration stream.
    pub state: PathBuf,
    pub netns: PathBuf,
    pub memory_mb: u64,
    /// The RAM QEMU is given (`-m`), KiB: under TCG a little short of `memory_mb`.
    pub guest_ram_kb: u64,
    pub tsc_khz: Option<u64>,
}

#[derive(Clone, Debug)]
pub struct PauseReport {
    /// `stop` until the migration stream was complete.
    pub snapshot: Duration,
    /// `quit` until the QEMU process was gone.
    pub exit: Duration,
    /// Writing the RAM file back and dropping it from the page cache.
    pub release: Duration,
    pub state_bytes: u64,
    /// Bytes of guest memory the snapshot wrote (QEMU's shared RAM is its own file: 0).
    pub ram_bytes: u64,
    /// Whether only the pages written since the last snapshot were saved (a Diff).
    pub incremental: bool,
}

#[derive(Clone, Debug)]
pub struct ResumeReport {
    /// Spawning QEMU until it listened on QMP.
    pub spawn: Duration,
    /// `migrate-incoming` until the state was loaded and the guest continued.
    pub restore: Duration,
}

#[derive(Clone, Debug)]
pub struct ForkReport {
    pub copies: Vec<VmHandle>,
    /// How long the source's vCPUs were stopped (QEMU's STOP to RESUME).
    pub source_paused: Duration,
    /// The whole call.
    pub total: Duration,
    /// Bytes of RAM data the frozen copy holds.
    pub ram_bytes: u64,
    /// Bytes of disk blocks the source wrote while it was being copied (copied again
    /// while it was stopped).
    pub disk_dirty_bytes: u64,
}

#[derive(Clone, Debug)]
pub struct SnapshotReport {
    /// How long a running source was stopped (zero for a paused one).
    pub source_paused: Duration,
    /// Bytes of data the snapshot holds.
    pub bytes: u64,
}

/// A snapshot's description, `snapshot.json` beside its `state`, `ram` (unless the RAM
/// is in the stream) and `rw.img`: what a VM restored from it must be.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct SnapshotMeta {
    source: String,
    image: String,
    layers: Vec<String>,
    memory_mb: u64,
    vcpus: u32,
    disk_mb: u64,
    vmlinux: PathBuf,
    root_disk: PathBuf,
    accel: Accel,
    tsc_khz: Option<u64>,
    #[serde(default)]
    ram_trimmed: bool,
    ram_in_stream: bool,
    #[serde(default)]
    vmm: Vmm,
    #[serde(default)]
    machine: Machine,
}

/// The file a snapshot directory is recognised by.
pub const SNAPSHOT_META: &str = "snapshot.json";

struct Inner {
    cfg: VmConfig,
    qemu: PathBuf,
    boot: GuestBoot,
    accel: AccelVerdict,
    tsc_khz: Option<(u64, &'static str)>,
    /// Namespaces are named after the root too, so two drivers never collide.
    netns_prefix: String,
    /// The VMM new VMs get, and Firecracker's binaries (or why they are not usable).
    vmm: VmmVerdict,
    firecracker: Result<FirecrackerTools, String>,
}

/// The QEMU microVM driver.
#[derive(Clone)]
pub struct MicroVmDriver {
    inner: Arc<Inner>,
}

/// One VM of a driver; cheap to clone. Every call reads the VM's record from disk.
#[derive(Clone)]
pub struct VmHandle {
    inner: Arc<Inner>,
    id: String,
}

impl std::fmt::Debug for VmHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmHandle").field("id", &self.id).finish()
    }
}

fn validate_id(id: &str) -> Result<(), VmError> {
    let ok = !id.is_empty() && id.len() <= 64 && id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-');
    if ok { Ok(()) } else { Err(VmError::InvalidId(id.into())) }
}

impl MicroVmDriver {
    /// Prepares the driver: the guest kernel and initramfs (built once per machine),
    /// the accelerator verdict (probed once per host boot) and the state directories.
    pub fn new(cfg: VmConfig, progress: &dyn Fn(&str)) -> Result<Self, VmError> {
        let qemu = match &cfg.qemu {
            Some(q) => q.clone(),
            None => require_tool("qemu-system-x86_64", "qemu-system-x86")?,
        };
        if !Path::new("/dev/net/tun").exists() {
            return Err(VmError::Prerequisite(
                "no /dev/net/tun: the tun module is needed for the agent channel".into(),
            ));
        }
        require_tool("ip", "iproute2")?;
        for sub in ["vms", "forks"] {
            let dir = cfg.root.join(sub);
            fs::create_dir_all(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
        }
        // QEMU runs as other uids: they must traverse (never list) the way to their files.
        for dir in [cfg.root.clone(), cfg.root.join("vms"), cfg.root.join("forks")] {
            fs::set_permissions(&dir, fs::Permissions::from_mode(0o711))
                .map_err(io_err(format!("chmod {}", dir.display())))?;
        }
        let boot = ensure_guest_boot(&cfg.store, &cfg.agent_binary, progress)?;
        let accel = match cfg.accel {
            Some(accel) => AccelVerdict {
                accel,
                reason: format!("{} chosen by the configuration", accel.as_str()),
                probe_ms: None,
            },
            None => cached_accel(&cfg, &qemu, &boot, progress)?,
        };
        let netns_prefix = {
            use sha2::{Digest, Sha256};
            let h = Sha256::digest(cfg.root.to_string_lossy().as_bytes());
            format!("odvm-{}-", &hex::encode(h)[..6])
        };
        let firecracker = find_firecracker(cfg.firecracker.as_deref(), cfg.jailer.as_deref());
        let vmm = choose_vmm(cfg.vmm, &accel, &firecracker)?;
        Ok(Self {
            inner: Arc::new(Inner {
                tsc_khz: host_tsc_khz(),
                cfg,
                qemu,
                boot,
                accel,
                netns_prefix,
                vmm,
                firecracker: firecracker.map_err(|e| e.to_string()),
            }),
        })
    }

    pub fn accel(&self) -> &AccelVerdict {
        &self.inner.accel
    }

    pub fn guest_boot(&self) -> &GuestBoot {
        &self.inner.boot
    }

    /// The boot disk full VMs of `image` start from (built once per image and recipe).
    pub fn boot_disk(&self, image: &Image, progress: &dyn Fn(&str)) -> Result<super::BootDiskManifest, VmError> {
        let inner = &self.inner;
        ensure_boot_disk(
            &inner.cfg.store,
            image,
            &inner.boot,
            inner.tsc_khz.map(|(k, _)| k),
            progress,
        )
    }

    /// The host TSC frequency given to guests, and where it was read.
    pub fn tsc_khz(&self) -> Option<(u64, &'static str)> {
        self.inner.tsc_khz
    }

    /// Cold-boots a microVM. Returns once QEMU runs; [`VmHandle::wait_agent`] waits for
    /// the guest's agent.
    pub fn create(&self, spec: &VmSpec, progress: &dyn Fn(&str)) -> Result<VmHandle, VmError> {
        self.create_machine(spec, Machine::Microvm, progress)
    }

    /// Cold-boots a VM of `machine`: a microVM, or a full VM (`q35`) whose firmware boots
    /// the image's boot disk (built once per image) through an overlay of its own. Full
    /// VMs always run under QEMU. `spec.disk_mb` sizes a microVM's writable disk, and a
    /// full VM's whole disk when that is larger than its image's (which has
    /// [`FREE_SPACE_MB`](super::bootdisk::FREE_SPACE_MB) free): its init grows the root
    /// partition and file system to fill it.
    pub fn create_machine(
        &self,
        spec: &VmSpec,
        machine: Machine,
        progress: &dyn Fn(&str),
    ) -> Result<VmHandle, VmError> {
        validate_id(&spec.id)?;
        if spec.memory_mb < 64 || spec.vcpus == 0 || spec.disk_mb < 16 {
            return Err(VmError::Invalid(format!(
                "memory {} MiB (at least 64), {} vCPUs (at least 1), disk {} MiB (at least 16)",
                spec.memory_mb, spec.vcpus, spec.disk_mb
            )));
        }
        let inner = &self.inner;
        if inner.vmm.vmm == Vmm::Firecracker && machine.is_microvm() {
            return fc::create(self, spec, progress);
        }
        let root_disk = match machine {
            Machine::Microvm => build_root_disk(&inner.cfg.store, &spec.image, progress)?,
            Machine::Q35 => self.boot_disk(&spec.image, progress)?.disk,
        };
        let dir = inner.create_vm_dir(&spec.id)?;
        let mut claimed_uid = None;
        let netns = format!("{}{}", inner.netns_prefix, spec.id);
        let result = (|| {
            let _lock = lock_file(&dir.join("lock"))?;
            let uid = inner.allocate_uid(&spec.id)?;
            claimed_uid = Some(uid);
            let record = inner.fresh_record(spec, uid, &netns, root_disk, Vmm::Qemu, machine);
            inner.prepare_dir(&dir, uid)?;
            match machine {
                Machine::Microvm => create_rw_disk(&inner.cfg.store, spec.disk_mb, &dir.join("rw.img"))?,
                Machine::Q35 => create_overlay(&record.root_disk, &dir.join("rw.img"), spec.disk_mb << 20)?,
            }
            inner.write_guest_config(machine, &dir, spec)?;
            new_ram_file(&dir.join("ram"), spec.memory_mb)?;
            for (file, mode) in [("rw.img", 0o600), ("initrd", 0o400), ("ram", 0o600)] {
                give(&dir.join(file), uid, uid, mode)?;
            }
            net::create(&record.netns, uid)?;
            write_json_atomic(&dir.join("vm.json"), &record)?;
            let mut record = record;
            let (_pid, mut qmp) = inner.start_qemu(&dir, &mut record, false)?;
            // A cold boot runs at once (QEMU was not started with -S); make sure.
            let status = qmp.execute("query-status", json!({}))?;
            if status["status"] != "running" {
                return Err(VmError::Qemu {
                    id: spec.id.clone(),
                    message: format!("QEMU is {} after boot", status["status"]),
                });
            }
            Ok(())
        })();
        if let Err(e) = result {
            inner.discard(&dir, Some(&netns), claimed_uid);
            return Err(e);
        }
        Ok(self.handle(&spec.id))
    }

    /// A new VM `spec.id` restored from a snapshot that [`VmHandle::snapshot_to`] wrote
    /// in `snapshot`: the snapshot's machine (memory size, vCPUs, disk, kernel) with a
    /// copy of its disk and its RAM file mapped privately (copy-on-write: the snapshot's
    /// file is never written, and VMs restored from one snapshot share its pages),
    /// continuing where its source was. `spec` gives the id and the image (whose layers
    /// must be the snapshot's); the guest's memory holds the source's configuration and
    /// agent token (see [`AgentChannel::rekey`]). A snapshot that cannot be loaded leaves
    /// nothing behind.
    pub fn restore_snapshot(
        &self,
        spec: &VmSpec,
        snapshot: &Path,
        progress: &dyn Fn(&str),
    ) -> Result<(VmHandle, ResumeReport), VmError> {
        validate_id(&spec.id)?;
        let meta: SnapshotMeta = read_json(&snapshot.join(SNAPSHOT_META))?;
        let corrupt = |message: &str| VmError::Corrupt {
            path: snapshot.to_path_buf(),
            message: message.into(),
        };
        if !snapshot.join("state").is_file() || !snapshot.join("rw.img").is_file() {
            return Err(corrupt("the snapshot's state or disk is missing"));
        }
        if !meta.ram_in_stream && !snapshot.join("ram").is_file() {
            return Err(corrupt("the snapshot's RAM file is missing"));
        }
        let inner = &self.inner;
        let root_disk = if meta.root_disk.is_file() {
            meta.root_disk.clone()
        } else if meta.machine == Machine::Q35 {
            // The snapshot's disk is an overlay over exactly that file: a rebuilt boot
            // disk is another file system.
            return Err(corrupt(&format!(
                "the boot disk {} the snapshot's disk is an overlay of is gone",
                meta.root_disk.display()
            )));
        } else if spec.image.layers == meta.layers {
            build_root_disk(&inner.cfg.store, &spec.image, progress)?
        } else {
            return Err(VmError::Invalid(format!(
                "the layers of image {} changed since the snapshot was taken",
                meta.image
            )));
        };
        let dir = inner.create_vm_dir(&spec.id)?;
        let mut claimed_uid = None;
        let netns = format!("{}{}", inner.netns_prefix, spec.id);
        let prepared = (|| {
            let _lock = lock_file(&dir.join("lock"))?;
            let uid = inner.allocate_uid(&spec.id)?;
            claimed_uid = Some(uid);
            let record = VmRecord {
                id: spec.id.clone(),
                image: meta.image.clone(),
                layers: meta.layers.clone(),
                memory_mb: meta.memory_mb,
                vcpus: meta.vcpus,
                disk_mb: meta.disk_mb,
                uid,
                groups: Vec::new(),
                netns: netns.clone(),
                vmlinux: if meta.vmlinux.is_file() {
                    meta.vmlinux.clone()
                } else {
                    inner.boot.kernel.vmlinux()
                },
                root_disk,
                accel: meta.accel,
                tsc_khz: meta.tsc_khz,
                ram_trimmed: meta.ram_trimmed,
                ram: if meta.ram_in_stream {
                    RamMode::InStream
                } else {
                    RamMode::Shared
                },
                state: VmState::Paused,
                pid: None,
                pid_start: None,
                forked_from: Some(meta.source.clone()),
                vmm: meta.vmm,
                machine: meta.machine,
                fc: Default::default(),
            };
            inner.prepare_dir(&dir, uid)?;
            if meta.machine == Machine::Microvm {
                // A restored microVM never boots: its initramfs is never read (its token
                // is set by re-keying).
                inner.link_restored_initrd(&dir)?;
            } else {
                // A full VM's configuration disk is a device the restored machine has.
                inner.write_guest_config(meta.machine, &dir, spec)?;
                give(&dir.join("initrd"), uid, uid, 0o400)?;
            }
            fs::copy(snapshot.join("state"), dir.join("state")).map_err(io_err("copying the snapshot's state"))?;
            sparse_copy(&snapshot.join("rw.img"), &dir.join("rw.img"))?;
            give(&dir.join("rw.img"), uid, uid, 0o600)?;
            net::create(&netns, uid)?;
            if meta.ram_in_stream {
                return write_json_atomic(&dir.join("vm.json"), &record);
            }
            // The snapshot's RAM file is every restore's base, mapped privately: no copy,
            // and VMs restored from one snapshot share the pages none has written.
            let _forks = lock_file(&inner.cfg.root.join("forks.lock"))?;
            let (base, gid) = inner.snapshot_base(&snapshot.join("ram"))?;
            let record = VmRecord {
                ram: RamMode::Private { base },
                groups: vec![gid],
                ..record
            };
            write_json_atomic(&dir.join("vm.json"), &record)
        })();
        if let Err(e) = prepared {
            inner.discard(&dir, Some(&netns), claimed_uid);
            return Err(e);
        }
        let vm = self.handle(&spec.id);
        match vm.resume() {
            Ok(report) => Ok((vm, report)),
            Err(e) => {
                inner.discard(&dir, Some(&netns), claimed_uid);
                inner.gc_forks();
                Err(e)
            }
        }
    }

    /// A VM that exists on disk (after an edge restart, too).
    pub fn open(&self, id: &str) -> Result<VmHandle, VmError> {
        validate_id(id)?;
        if !self.inner.vm_dir(id).join("vm.json").is_file() {
            return Err(VmError::NotFound(id.into()));
        }
        Ok(self.handle(id))
    }

    /// Every VM on disk, sorted by id.
    pub fn list(&self) -> Result<Vec<VmHandle>, VmError> {
        let dir = self.inner.cfg.root.join("vms");
        let mut ids: Vec<String> = fs::read_dir(&dir)
            .map_err(io_err(format!("listing {}", dir.display())))?
            .filter_map(Result::ok)
            .filter(|e| e.path().join("vm.json").is_file())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        ids.sort();
        Ok(ids.into_iter().map(|id| self.handle(&id)).collect())
    }

    fn handle(&self, id: &str) -> VmHandle {
        VmHandle {
            inner: self.inner.clone(),
            id: id.into(),
        }
    }
}

/// Where the agent of VM `id` under the driver root `root` listens, read from the VM's
/// record alone: no driver needs to be prepared for it (an edge that just restarted
/// serves its VMs' traffic while its driver still starts). `None`: no such VM.
pub fn agent_channel_at(root: &Path, id: &str) -> Option<AgentChannel> {
    validate_id(id).ok()?;
    let record: VmRecord = read_json(&root.join("vms").join(id).join("vm.json")).ok()?;
    Some(AgentChannel {
        netns: net::netns_path(&record.netns),
        addr: net::agent_addr(),
    })
}

fn cached_accel(
    cfg: &VmConfig,
    qemu: &Path,
    boot: &GuestBoot,
    progress: &dyn Fn(&str),
) -> Result<AccelVerdict, VmError> {
    #[derive(Serialize, Deserialize)]
    struct Cached {
        key: String,
        verdict: AccelVerdict,
    }
    let boot_id = fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let key = format!("{} {} {}", boot_id.trim(), qemu.display(), boot.kernel.release);
    let path = cfg.accel_cache.clone().unwrap_or_else(|| cfg.root.join("accel.json"));
    if let Ok(cached) = read_json::<Cached>(&path)
        && cached.key == key
    {
        return Ok(cached.verdict);
    }
    progress("probing whether KVM runs guests at hardware speed");
    let verdict = detect_accel(qemu, boot, cfg.kvm_probe_bound)?;
    write_json_atomic(
        &path,
        &Cached {
            key,
            verdict: verdict.clone(),
        },
    )?;
    Ok(verdict)
}

/// Creates `path` as a sparse file of `mb` MiB.
fn new_ram_file(path: &Path, mb: u64) -> Result<(), VmError> {
    let file = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .map_err(io_err(format!("creating {}", path.display())))?;
    file.set_len(mb << 20)
        .map_err(io_err(format!("sizing {}", path.display())))
}

fn give(path: &Path, uid: u32, gid: u32, mode: u32) -> Result<(), VmError> {
    chown(path, Some(uid), Some(gid)).map_err(io_err(format!("chown {}", path.display())))?;
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).map_err(io_err(format!("chmod {}", path.display())))
}

/// Sums `/proc/<pid>/smaps`, and separately the mapping of `ram_path`.
fn parse_smaps(text: &str, ram_path: &str) -> MemoryUsage {
    let mut usage = MemoryUsage::default();
    let mut in_ram = false;
    for line in text.lines() {
        let mut words = line.split_whitespace();
        let Some(first) = words.next() else { continue };
        if !first.ends_with(':') {
            // A mapping's header: address range, perms, offset, dev, inode, path.
            in_ram = line.ends_with(ram_path);
            continue;
        }
        let kb: u64 = words.next().and_then(|v| v.parse().ok()).unwrap_or(0);
        match first {
            "Rss:" => {
                usage.rss_kb += kb;
                if in_ram {
                    usage.guest_ram_rss_kb += kb;
                }
            }
            "Pss:" => {
                usage.pss_kb += kb;
                if in_ram {
                    usage.guest_ram_pss_kb += kb;
                }
            }
            "Private_Clean:" | "Private_Dirty:" => usage.private_kb += kb,
            _ => {}
        }
    }
    usage
}

/// Field 22 of `/proc/<pid>/stat`: when the process started (clock ticks since boot).
fn process_start(pid: i32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: fields follow the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    rest.split(' ').nth(19)?.parse().ok()
}

/// Sends SIGKILL to the process behind `pidfd` (never to a recycled pid).
fn sigkill(pidfd: &OwnedFd) {
    // SAFETY: signalling through a pidfd we own.
    unsafe { libc::syscall(libc::SYS_pidfd_send_signal, pidfd.as_raw_fd(), libc::SIGKILL, 0, 0) };
}

/// Waits until the process behind `pidfd` has ended.
fn wait_pidfd(pidfd: &OwnedFd, timeout: Duration) -> bool {
    let mut pfd = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: polling one fd we own.
    unsafe { libc::poll(&mut pfd, 1, timeout.as_millis().min(i32::MAX as u128) as i32) > 0 }
}

impl Inner {
    /// Writes the VM's `initrd`: for a microVM the initramfs with its configuration
    /// appended, for a full VM its configuration disk.
    fn write_guest_config(&self, machine: Machine, dir: &Path, spec: &VmSpec) -> Result<(), VmError> {
        let config = GuestConfig {
            hostname: spec.id.clone(),
            access_token: spec.access_token.clone(),
            env: spec.env.clone(),
            start: spec.image.config.start.clone(),
        };
        let dest = dir.join("initrd");
        match machine {
            Machine::Microvm => write_vm_initrd(&self.boot, &dest, &config),
            Machine::Q35 => write_config_disk(&dest, &config),
        }
    }

    /// The record of a VM about to boot for the first time under `vmm`: its accelerator
    /// is the driver's for QEMU (RAM trimmed under TCG, see [`TCG_RAM_TRIM_KB`]); a
    /// Firecracker VM runs only where KVM does.
    fn fresh_record(
        &self,
        spec: &VmSpec,
        uid: u32,
        netns: &str,
        root_disk: PathBuf,
        vmm: Vmm,
        machine: Machine,
    ) -> VmRecord {
        let (accel, tsc_khz) = match vmm {
            Vmm::Qemu => (self.accel.accel, self.tsc_khz.map(|(k, _)| k)),
            Vmm::Firecracker => (Accel::Kvm, None),
        };
        VmRecord {
            id: spec.id.clone(),
            image: spec.image.name.clone(),
            layers: spec.image.layers.clone(),
            memory_mb: spec.memory_mb,
            vcpus: spec.vcpus,
            disk_mb: spec.disk_mb,
            uid,
            groups: Vec::new(),
            netns: netns.to_string(),
            vmlinux: self.boot.kernel.vmlinux(),
            root_disk,
            accel,
            tsc_khz,
            ram_trimmed: vmm == Vmm::Qemu && accel == Accel::Tcg,
            ram: RamMode::Shared,
            state: VmState::Running,
            pid: None,
            pid_start: None,
            forked_from: None,
            vmm,
            machine,
            fc: Default::default(),
        }
    }

    /// Makes a new VM's directory; an existing one means the id is taken.
    fn create_vm_dir(&self, id: &str) -> Result<PathBuf, VmError> {
        let dir = self.vm_dir(id);
        match fs::create_dir(&dir) {
            Ok(()) => Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Err(VmError::Exists(id.to_string())),
            Err(e) => Err(VmError::io(format!("creating {}", dir.display()), e)),
        }
    }

    fn vm_dir(&self, id: &str) -> PathBuf {
        self.cfg.root.join("vms").join(id)
    }

    fn record(&self, id: &str) -> Result<VmRecord, VmError> {
        let path = self.vm_dir(id).join("vm.json");
        if !path.is_file() {
            return Err(VmError::NotFound(id.into()));
        }
        read_json(&path)
    }

    fn save(&self, record: &VmRecord) -> Result<(), VmError> {
        write_json_atomic(&self.vm_dir(&record.id).join("vm.json"), record)
    }

    fn uid_registry(&self) -> PathBuf {
        self.cfg
            .uid_registry
            .clone()
            .unwrap_or_else(|| self.cfg.store.root().join("vm-uids"))
    }

    /// Claims the lowest free uid of the range: a file per uid in the registry, holding
    /// the VM directory that owns it. A uid whose owner's directory is gone (its driver's
    /// data was removed without deleting the VM) is free again.
    fn allocate_uid(&self, id: &str) -> Result<u32, VmError> {
        self.allocate_uid_for(&self.vm_dir(id))
    }

    /// Like [`Inner::allocate_uid`] for any directory of the driver that needs an id of
    /// its own (a shared RAM base's group); free again once `owner` is gone.
    fn allocate_uid_for(&self, owner: &Path) -> Result<u32, VmError> {
        let Some(base) = self.cfg.uid_base else {
            return Ok(0);
        };
        let dir = self.uid_registry();
        fs::create_dir_all(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o700))
            .map_err(io_err(format!("chmod {}", dir.display())))?;
        let _lock = lock_file(&dir.join(".lock"))?;
        for n in 0..UID_SLOTS {
            let uid = base + n;
            let path = dir.join(uid.to_string());
            let claim = || fs::OpenOptions::new().write(true).create_new(true).open(&path);
            let file = match claim() {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    let holder = fs::read_to_string(&path).unwrap_or_default();
                    // Older records hold a bare VM id: those are never taken for stale.
                    let stale = holder.starts_with('/') && !Path::new(holder.trim()).exists();
                    if !stale {
                        continue;
                    }
                    let _ = fs::remove_file(&path);
                    claim().map_err(|e| VmError::io("allocating a uid", e))?
                }
                Err(e) => return Err(VmError::io("allocating a uid", e)),
            };
            use std::io::Write;
            let mut file = file;
            file.write_all(owner.to_string_lossy().as_bytes())
                .map_err(io_err("recording a uid"))?;
            return Ok(uid);
        }
        Err(VmError::Invalid("no free uid left in the VM range".into()))
    }

    fn release_uid(&self, uid: u32) {
        if uid == 0 {
            return;
        }
        let path = self.uid_registry().join(uid.to_string());
        let Ok(_lock) = lock_file(&self.uid_registry().join(".lock")) else {
            return;
        };
        // Only our own claim: a uid reclaimed by another driver stays its.
        let holder = fs::read_to_string(&path).unwrap_or_default();
        if !holder.starts_with('/') || Path::new(holder.trim()).starts_with(&self.cfg.root) {
            let _ = fs::remove_file(&path);
        }
    }

    /// The VM dir (root's, traversable) and `run/` (the VM uid's, for the QMP socket).
    fn prepare_dir(&self, dir: &Path, uid: u32) -> Result<(), VmError> {
        fs::set_permissions(dir, fs::Permissions::from_mode(0o711))
            .map_err(io_err(format!("chmod {}", dir.display())))?;
        let run = dir.join("run");
        fs::create_dir_all(&run).map_err(io_err(format!("creating {}", run.display())))?;
        give(&run, uid, uid, 0o700)
    }

    fn qemu_argv(&self, dir: &Path, record: &VmRecord, start: QemuStart) -> Vec<String> {
        let mem = format!("{}K", guest_ram_kb(record.memory_mb, record.ram_trimmed));
        let (mem_path, share) = match &record.ram {
            RamMode::Shared | RamMode::InStream => (dir.join("ram"), "on"),
            RamMode::Private { base } => (base.clone(), "off"),
        };
        let mut append = String::from("console=ttyS0 panic=-1 quiet random.trust_cpu=on");
        if let Some(khz) = record.tsc_khz {
            append.push_str(&format!(" tsc_early_khz={khz}"));
        }
        let (accel, cpu) = match record.accel {
            Accel::Kvm => ("kvm", "host"),
            // A bounded translation cache: TCG would otherwise grow it up to 1 GiB.
            Accel::Tcg => ("tcg,tb-size=64", "max"),
        };
        let mut argv: Vec<String> = vec![
            self.qemu.to_string_lossy().into(),
            "-name".into(),
            format!("opendsec-{}", record.id),
            "-accel".into(),
            accel.into(),
            "-cpu".into(),
            cpu.into(),
            "-smp".into(),
            record.vcpus.to_string(),
            "-m".into(),
            mem.clone(),
            "-object".into(),
            format!(
                "memory-backend-file,id=ram0,size={mem},mem-path={},share={share}",
                mem_path.display()
            ),
            "-nodefaults".into(),
            "-no-user-config".into(),
            "-display".into(),
            "none".into(),
            "-no-reboot".into(),
            "-serial".into(),
            "stdio".into(),
            "-qmp".into(),
            format!("unix:{},server=on,wait=off", dir.join("run/qmp.sock").display()),
            // No new privileges, no programs, no resource changes, no obsolete syscalls.
            "-sandbox".into(),
            "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny".into(),
        ];
        if record.machine == Machine::Q35 {
            argv.extend(q35_args(dir, super::shim::TAP_FD_PLACEHOLDER, net::GUEST_MAC));
        } else {
            argv.extend(self.microvm_args(dir, record, append));
        }
        match start {
            QemuStart::Boot => {}
            QemuStart::Restore => argv.extend(["-incoming".into(), "defer".into()]),
            // -S: the guest never runs, even once the incoming state is loaded.
            QemuStart::Receive => argv.extend(["-S".into(), "-incoming".into(), "defer".into()]),
        }
        argv
    }

    /// A microVM's machine, kernel, initrd and devices.
    fn microvm_args(&self, dir: &Path, record: &VmRecord, append: String) -> Vec<String> {
        vec![
            "-M".into(),
            "microvm,memory-backend=ram0".into(),
            "-kernel".into(),
            record.vmlinux.to_string_lossy().into(),
            "-initrd".into(),
            dir.join("initrd").to_string_lossy().into(),
            "-append".into(),
            append,
            "-drive".into(),
            format!(
                "id=root,file={},format=raw,if=none,readonly=on",
                record.root_disk.display()
            ),
            "-device".into(),
            "virtio-blk-device,drive=root,serial=opendsec-root".into(),
            "-drive".into(),
            format!(
                "id=rw,file={},format=raw,if=none,discard=unmap",
                dir.join("rw.img").display()
            ),
            "-device".into(),
            "virtio-blk-device,drive=rw,serial=opendsec-rw".into(),
            "-netdev".into(),
            format!("tap,id=net0,fd={},vhost=off", super::shim::TAP_FD_PLACEHOLDER),
            "-device".into(),
            format!("virtio-net-device,netdev=net0,mac={}", net::GUEST_MAC),
        ]
    }

    /// Starts QEMU for `record` under a shim and connects to its QMP socket. The record
    /// is saved with the new pid.
    fn start_qemu(&self, dir: &Path, record: &mut VmRecord, incoming: bool) -> Result<(i32, Qmp), VmError> {
        let start = if incoming { QemuStart::Restore } else { QemuStart::Boot };
        let pid = self.spawn_qemu(dir, record, start)?;
        record.pid = Some(pid);
        record.pid_start = process_start(pid);
        record.state = VmState::Running;
        self.save(record)?;
        Ok((pid, self.connect_started(dir, record, pid)?))
    }

    /// Starts QEMU for `record` in `dir` under a shim; returns its pid.
    fn spawn_qemu(&self, dir: &Path, record: &VmRecord, start: QemuStart) -> Result<i32, VmError> {
        let socket = dir.join("run/qmp.sock");
        if socket.as_os_str().len() > 100 {
            return Err(VmError::Invalid(format!(
                "{} is too long for a unix socket",
                socket.display()
            )));
        }
        for stale in ["exit.json", "qemu.pid", "run/qmp.sock"] {
            let _ = fs::remove_file(dir.join(stale));
        }
        let launch = Launch {
            argv: self.qemu_argv(dir, record, start),
            uid: record.uid,
            gid: record.uid,
            groups: record.groups.clone(),
            netns: Some(net::netns_path(&record.netns)),
            tap: Some(net::TAP.into()),
            workdir: dir.to_path_buf(),
            console_log: dir.join("console.log"),
            console_cap_bytes: self.cfg.console_cap_bytes,
            pid_file: dir.join("qemu.pid"),
            exit_file: dir.join("exit.json"),
            keeper: false,
        };
        let launch_file = dir.join("launch.json");
        write_json_atomic(&launch_file, &launch)?;
        super::shim::spawn(&self.cfg.shim, &launch_file)
    }

    /// Connects to the QMP socket of QEMU `pid` just started in `dir`; kills it if
    /// that fails.
    fn connect_started(&self, dir: &Path, record: &VmRecord, pid: i32) -> Result<Qmp, VmError> {
        let socket = dir.join("run/qmp.sock");
        let alive = || process_start(pid).is_some() && exit_record(dir, pid).is_none();
        match Qmp::connect_until(&socket, Instant::now() + QEMU_START_TIMEOUT, &alive) {
            Ok(qmp) => Ok(qmp),
            Err(e) => {
                // SAFETY: the pid is the QEMU we just started (its shim reaps it).
                unsafe { libc::kill(pid, libc::SIGKILL) };
                let pidfd = pidfd_open(pid);
                if let Some(fd) = &pidfd {
                    wait_pidfd(fd, Duration::from_secs(5));
                }
                Err(VmError::Qemu {
                    id: record.id.clone(),
                    message: format!("no QMP ({e}); console: {}", console_tail(dir, 1500)),
                })
            }
        }
    }

    /// The QEMU process of `record`, if it still runs (and is the one we started).
    fn live_pid(&self, record: &VmRecord) -> Option<i32> {
        let pid = record.pid?;
        match (process_start(pid), record.pid_start) {
            (Some(now), Some(then)) if now == then => Some(pid),
            (Some(_), None) => Some(pid),
            _ => None,
        }
    }

    fn qmp(&self, record: &VmRecord) -> Result<Qmp, VmError> {
        let socket = self.vm_dir(&record.id).join("run/qmp.sock");
        Ok(Qmp::connect(&socket, QMP_TIMEOUT)?)
    }

    /// Removes what a VM that never became whole had: its QEMU (if started), namespace,
    /// uid and directory.
    fn discard(&self, dir: &Path, netns: Option<&str>, uid: Option<u32>) {
        if let Some(pid) = fs::read_to_string(dir.join("qemu.pid"))
            .ok()
            .and_then(|p| p.trim().parse::<i32>().ok())
        {
            // Only if that pid is still a QEMU of this directory.
            let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            if String::from_utf8_lossy(&cmdline).contains(&*dir.to_string_lossy())
                && let Some(pidfd) = pidfd_open(pid)
            {
                sigkill(&pidfd);
                wait_pidfd(&pidfd, Duration::from_secs(10));
            }
        }
        if let Some(netns) = netns {
            let _ = net::delete(netns);
        }
        if let Some(uid) = uid {
            self.release_uid(uid);
        }
        // A retry covers a file that appeared while the tree was being removed.
        if fs::remove_dir_all(dir).is_err() {
            let _ = fs::remove_dir_all(dir);
        }
    }
}

/// The shim's record of how QEMU process `pid` of the VM in `dir` ended.
fn exit_record(dir: &Path, pid: i32) -> Option<ExitInfo> {
    read_json::<ExitInfo>(&dir.join("exit.json"))
        .ok()
        .filter(|e| e.pid == pid)
}

/// Waits until QEMU `pid` has ended and its shim has recorded it (so that nothing of
/// that run writes into the VM's directory afterwards).
fn wait_ended(dir: &Path, pid: i32, pidfd: &OwnedFd, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    if !wait_pidfd(pidfd, timeout) {
        return false;
    }
    while exit_record(dir, pid).is_none() {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    true
}

/// The last `max` bytes of the VM's console, on one line.
fn console_tail(dir: &Path, max: usize) -> String {
    let text = fs::read(dir.join("console.log")).unwrap_or_default();
    let text = String::from_utf8_lossy(&text[text.len().saturating_sub(max)..]).into_owned();
    text.trim().replace("\r\n", " | ").replace('\n', " | ")
}

/// Sends the migration stream to `dest` (a new file, root's) and waits for it.
fn migrate_to_file(qmp: &mut Qmp, dest: &Path) -> Result<u64, VmError> {
    let file = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(dest)
        .map_err(io_err(format!("creating {}", dest.display())))?;
    qmp.execute_with_fd("getfd", json!({"fdname": "snapshot"}), file.as_raw_fd())?;
    qmp.execute("migrate", json!({"uri": "fd:snapshot"}))?;
    wait_migration(qmp, "the snapshot")?;
    file.sync_all().map_err(io_err(format!("syncing {}", dest.display())))?;
    Ok(file.metadata().map(|m| m.len()).unwrap_or(0))
}

fn wait_migration(qmp: &mut Qmp, what: &str) -> Result<(), VmError> {
    let deadline = Instant::now() + MIGRATION_TIMEOUT;
    loop {
        let info = qmp.execute("query-migrate", json!({}))?;
        match info["status"].as_str() {
            Some("completed") => return Ok(()),
            Some("failed") | Some("cancelled") => {
                return Err(VmError::Qmp(QmpError::Command {
                    command: "migrate".into(),
                    class: "failed".into(),
                    desc: format!("{what}: {}", info["error-desc"].as_str().unwrap_or("migration failed")),
                }));
            }
            _ if Instant::now() > deadline => {
                return Err(VmError::Timeout {
                    what: what.into(),
                    seconds: MIGRATION_TIMEOUT.as_secs(),
                });
            }
            _ => std::thread::sleep(Duration::from_millis(1)),
        }
    }
}

/// Sets up a stop-and-copy migration: shared RAM in or out of the stream, and never a
/// pause before switch-over (a live copy interrupted by a crash may have left it on).
fn set_ignore_shared(qmp: &mut Qmp, on: bool) -> Result<(), VmError> {
    qmp.execute(
        "migrate-set-capabilities",
        json!({"capabilities": [
            {"capability": "x-ignore-shared", "state": on},
            {"capability": "pause-before-switchover", "state": false},
        ]}),
    )?;
    Ok(())
}

/// Writes back a file's dirty pages and drops it from the page cache.
fn release_page_cache(path: &Path) -> Result<(), VmError> {
    let file = fs::File::open(path).map_err(io_err(format!("opening {}", path.display())))?;
    file.sync_data()
        .map_err(io_err(format!("syncing {}", path.display())))?;
    // SAFETY: advice on an fd we own.
    unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    Ok(())
}

impl VmHandle {
    pub fn id(&self) -> &str {
        &self.id
    }

    fn dir(&self) -> PathBuf {
        self.inner.vm_dir(&self.id)
    }

    /// Where the guest's agent listens (inside the VM's network namespace).
    pub fn agent(&self) -> Result<AgentChannel, VmError> {
        let record = self.inner.record(&self.id)?;
        Ok(AgentChannel {
            netns: net::netns_path(&record.netns),
            addr: net::agent_addr(),
        })
    }

    pub fn status(&self) -> Result<VmStatus, VmError> {
        let record = self.inner.record(&self.id)?;
        Ok(match record.state {
            VmState::Paused => VmStatus::Paused,
            VmState::Running => match self.inner.live_pid(&record) {
                Some(pid) => VmStatus::Running { pid },
                None => VmStatus::Exited(record.pid.and_then(|pid| exit_record(&self.dir(), pid))),
            },
        })
    }

    pub fn files(&self) -> Result<VmFiles, VmError> {
        let record = self.inner.record(&self.id)?;
        let dir = self.dir();
        Ok(VmFiles {
            vmlinux: record.vmlinux.clone(),
            initrd: dir.join("initrd"),
            root_disk: record.root_disk.clone(),
            rw_disk: dir.join("rw.img"),
            ram: match &record.ram {
                RamMode::Private { base } => base.clone(),
                _ => dir.join("ram"),
            },
            state: dir.join("state"),
            netns: net::netns_path(&record.netns),
            memory_mb: record.memory_mb,
            guest_ram_kb: guest_ram_kb(record.memory_mb, record.ram_trimmed),
            tsc_khz: record.tsc_khz,
            dir,
        })
    }

    /// The machine the VM is (microVM or full VM).
    pub fn machine(&self) -> Result<Machine, VmError> {
        Ok(self.inner.record(&self.id)?.machine)
    }

    /// The uid QEMU runs as.
    pub fn uid(&self) -> Result<u32, VmError> {
        Ok(self.inner.record(&self.id)?.uid)
    }

    pub fn ram_mode(&self) -> Result<RamMode, VmError> {
        Ok(self.inner.record(&self.id)?.ram)
    }

    /// A pidfd of the running QEMU process: readable once it has ended (for an event
    /// loop that marks the sandbox failed when its channel closes).
    pub fn exit_fd(&self) -> Result<OwnedFd, VmError> {
        match self.status()? {
            VmStatus::Running { pid } => pidfd_open(pid).ok_or_else(|| self.bad_state("exited", "watch its exit")),
            VmStatus::Paused => Err(self.bad_state("paused", "watch its exit")),
            VmStatus::Exited(_) => Err(self.bad_state("exited", "watch its exit")),
        }
    }

    /// The last `max` bytes of the guest's console.
    pub fn console_tail(&self, max: usize) -> String {
        console_tail(&self.dir(), max)
    }

    /// Memory of the running QEMU process.
    pub fn memory(&self) -> Result<MemoryUsage, VmError> {
        let record = self.inner.record(&self.id)?;
        let VmStatus::Running { pid } = self.status()? else {
            return Err(self.bad_state("not running", "measure its memory"));
        };
        let ram_path = match &record.ram {
            RamMode::Private { base } => base.clone(),
            _ => self.dir().join("ram"),
        };
        let text = fs::read_to_string(format!("/proc/{pid}/smaps")).map_err(io_err("reading smaps"))?;
        Ok(parse_smaps(&text, &ram_path.to_string_lossy()))
    }

    /// Bytes of guest RAM data kept on disk for this VM (its RAM file).
    pub fn ram_file_bytes(&self) -> u64 {
        allocated_bytes(&self.dir().join("ram"))
    }

    /// Waits until the guest's agent answers `/health`.
    pub fn wait_agent(&self, timeout: Duration) -> Result<Duration, VmError> {
        let agent = self.agent()?;
        let me = self.clone();
        let alive = move || matches!(me.status(), Ok(VmStatus::Running { .. }));
        agent.wait_ready(timeout, &alive).map_err(|e| match e {
            VmError::Agent(m) | VmError::Timeout { what: m, .. } => {
                VmError::Agent(format!("{m}; console: {}", self.console_tail(1500)))
            }
            other => other,
        })
    }

    fn bad_state(&self, state: &str, operation: &'static str) -> VmError {
        VmError::BadState {
            id: self.id.clone(),
            state: state.into(),
            operation,
        }
    }

    fn running_record(&self, operation: &'static str) -> Result<(VmRecord, i32), VmError> {
        let record = self.inner.record(&self.id)?;
        if record.state == VmState::Paused {
            return Err(self.bad_state("paused", operation));
        }
        match self.inner.live_pid(&record) {
            Some(pid) => Ok((record, pid)),
            None => Err(self.bad_state("exited", operation)),
        }
    }

    /// Pause: snapshot the VM and end its QEMU process, releasing its memory. With
    /// shared RAM the stream holds only device state (the RAM file is the memory); a
    /// fork copy's RAM (private pages over the fork's base) goes into the stream.
    pub fn pause(&self) -> Result<PauseReport, VmError> {
        if self.on_firecracker()? {
            return fc::pause(self);
        }
        let dir = self.dir();
        let _lock = lock_file(&dir.join("lock"))?;
        let (mut record, pid) = self.running_record("pause")?;
        let pidfd = pidfd_open(pid).ok_or_else(|| self.bad_state("exited", "pause"))?;
        let mut qmp = self.inner.qmp(&record)?;
        let shared = record.ram == RamMode::Shared;
        set_ignore_shared(&mut qmp, shared)?;
        let t0 = Instant::now();
        qmp.execute("stop", json!({}))?;
        let tmp = dir.join("state.new");
        let state_bytes = match migrate_to_file(&mut qmp, &tmp) {
            Ok(n) => n,
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                // The VM is unharmed: let it run on.
                let _ = qmp.execute("cont", json!({}));
                return Err(e);
            }
        };
        let snapshot = t0.elapsed();
        // The snapshot is complete: from here the VM is paused, whatever happens to
        // this QEMU (a crash before it is gone leaves it for `recover` to end).
        fs::rename(&tmp, dir.join("state")).map_err(io_err("keeping the snapshot"))?;
        let old_base = match &record.ram {
            RamMode::Private { base } => Some(base.clone()),
            _ => None,
        };
        if !shared {
            record.ram = RamMode::InStream;
            record.groups.clear();
        }
        record.state = VmState::Paused;
        self.inner.save(&record)?;
        let t1 = Instant::now();
        let _ = qmp.execute("quit", json!({}));
        drop(qmp);
        if !wait_ended(&dir, pid, &pidfd, Duration::from_secs(10)) {
            sigkill(&pidfd);
            wait_ended(&dir, pid, &pidfd, Duration::from_secs(10));
        }
        let exit = t1.elapsed();
        record.pid = None;
        record.pid_start = None;
        self.inner.save(&record)?;
        if old_base.is_some() {
            self.inner.gc_forks();
        }
        let t2 = Instant::now();
        if shared {
            release_page_cache(&dir.join("ram"))?;
        }
        Ok(PauseReport {
            snapshot,
            exit,
            release: t2.elapsed(),
            state_bytes,
            ram_bytes: if shared { 0 } else { state_bytes },
            incremental: false,
        })
    }

    /// Takes a snapshot of the VM into `dest` (a directory that must not exist): its
    /// device state, RAM and writable disk, and [`SNAPSHOT_META`]. A running VM is
    /// copied live (see `precopy`): it stops only for the pages and disk blocks written
    /// during the copy and its device state; a paused one is copied as it lies.
    /// On failure `dest` is gone and the VM is as it was.
    pub fn snapshot_to(&self, dest: &Path) -> Result<SnapshotReport, VmError> {
        if self.on_firecracker()? {
            return fc::snapshot_to(self, dest);
        }
        let dir = self.dir();
        let _lock = lock_file(&dir.join("lock"))?;
        let record = self.inner.record(&self.id)?;
        fs::create_dir(dest).map_err(io_err(format!("creating {}", dest.display())))?;
        fs::set_permissions(dest, fs::Permissions::from_mode(0o700))
            .map_err(io_err(format!("chmod {}", dest.display())))?;
        let taken = (|| match record.state {
            VmState::Running => {
                if self.inner.live_pid(&record).is_none() {
                    return Err(self.bad_state("exited", "snapshot"));
                }
                // Copied while it runs; it stops only for what changed meanwhile.
                let copied = self.inner.copy_running(&record, dest)?;
                let state_bytes = fs::metadata(dest.join("state")).map_or(0, |m| m.len());
                let bytes = state_bytes + copied.ram_bytes + copied.disk_bytes;
                Ok((copied.source_paused, bytes, copied.ram_in_stream))
            }
            VmState::Paused => {
                let mut bytes =
                    fs::copy(dir.join("state"), dest.join("state")).map_err(io_err("copying the VM's snapshot"))?;
                let in_stream = record.ram == RamMode::InStream;
                if !in_stream {
                    bytes += sparse_copy(&dir.join("ram"), &dest.join("ram"))?;
                }
                bytes += sparse_copy(&dir.join("rw.img"), &dest.join("rw.img"))?;
                Ok((Duration::ZERO, bytes, in_stream))
            }
        })();
        let (source_paused, bytes, ram_in_stream) = match taken {
            Ok(t) => t,
            Err(e) => {
                let _ = fs::remove_dir_all(dest);
                return Err(e);
            }
        };
        let meta = SnapshotMeta {
            source: self.id.clone(),
            image: record.image.clone(),
            layers: record.layers.clone(),
            memory_mb: record.memory_mb,
            vcpus: record.vcpus,
            disk_mb: record.disk_mb,
            vmlinux: record.vmlinux.clone(),
            root_disk: record.root_disk.clone(),
            accel: record.accel,
            tsc_khz: record.tsc_khz,
            ram_trimmed: record.ram_trimmed,
            ram_in_stream,
            vmm: record.vmm,
            machine: record.machine,
        };
        if let Err(e) = write_json_atomic(&dest.join(SNAPSHOT_META), &meta) {
            let _ = fs::remove_dir_all(dest);
            return Err(e);
        }
        Ok(SnapshotReport { source_paused, bytes })
    }

    /// Resume: a new QEMU process restores the paused VM, which continues where it was.
    pub fn resume(&self) -> Result<ResumeReport, VmError> {
        if self.on_firecracker()? {
            return fc::resume(self);
        }
        let dir = self.dir();
        let _lock = lock_file(&dir.join("lock"))?;
        let mut record = self.inner.record(&self.id)?;
        if record.state != VmState::Paused {
            return Err(self.bad_state("running", "resume"));
        }
        let state = dir.join("state");
        if !state.is_file() {
            return Err(VmError::Corrupt {
                path: state,
                message: "a paused VM without its snapshot".into(),
            });
        }
        let from_stream = record.ram == RamMode::InStream;
        if from_stream {
            // The stream carries the RAM: it loads into a fresh shared file.
            new_ram_file(&dir.join("ram"), record.memory_mb)?;
            give(&dir.join("ram"), record.uid, record.uid, 0o600)?;
        }
        let t0 = Instant::now();
        let (pid, mut qmp) = self.inner.start_qemu(&dir, &mut record, true)?;
        let spawn = t0.elapsed();
        let t1 = Instant::now();
        let result = restore(&mut qmp, &state, !from_stream);
        if let Err(e) = result {
            // The VM stays paused, its snapshot untouched. Once this returns, nothing
            // of that QEMU run (nor its shim) writes into the VM's directory.
            drop(qmp);
            match pidfd_open(pid) {
                Some(pidfd) => {
                    sigkill(&pidfd);
                    wait_ended(&dir, pid, &pidfd, Duration::from_secs(10));
                }
                None => {
                    // Already gone: wait for its shim's record of the end.
                    let deadline = Instant::now() + Duration::from_secs(10);
                    while exit_record(&dir, pid).is_none() && Instant::now() < deadline {
                        std::thread::sleep(Duration::from_millis(2));
                    }
                }
            }
            record.state = VmState::Paused;
            record.pid = None;
            record.pid_start = None;
            self.inner.save(&record)?;
            return Err(VmError::Qemu {
                id: self.id.clone(),
                message: format!(
                    "restoring {}: {e}; console: {}",
                    state.display(),
                    console_tail(&dir, 800)
                ),
            });
        }
        let restore_time = t1.elapsed();
        if from_stream {
            record.ram = RamMode::Shared;
            self.inner.save(&record)?;
        }
        Ok(ResumeReport {
            spawn,
            restore: restore_time,
        })
    }

    /// The ids of a fork's copies: 1 to [`MAX_FORK_COUNT`] valid ids, none given twice
    /// (nor this VM's), none of a VM that exists.
    pub(super) fn check_fork_ids(&self, new_ids: &[String]) -> Result<(), VmError> {
        if new_ids.is_empty() || new_ids.len() > MAX_FORK_COUNT {
            return Err(VmError::Invalid(format!(
                "fork count must be 1 to {MAX_FORK_COUNT}, not {}",
                new_ids.len()
            )));
        }
        for (i, id) in new_ids.iter().enumerate() {
            validate_id(id)?;
            if new_ids[..i].contains(id) || id == &self.id {
                return Err(VmError::Invalid(format!("fork id {id} is given twice")));
            }
            if self.inner.vm_dir(id).exists() {
                return Err(VmError::Exists(id.clone()));
            }
        }
        Ok(())
    }

    /// Fork with memory: a live copy of the source (see `precopy`: RAM and disk copied
    /// while it runs; it stops only for the pages and blocks written meanwhile and its
    /// device state), then each copy (one per id in `new_ids`) is a new VM restored from
    /// it, mapping the frozen RAM privately, so the copies share every page none of them
    /// has written.
    pub fn fork(&self, new_ids: &[String]) -> Result<ForkReport, VmError> {
        if self.on_firecracker()? {
            return fc::fork(self, new_ids);
        }
        let started = Instant::now();
        self.check_fork_ids(new_ids)?;
        // A VM whose copy cannot be live copies by stopping, which needs its RAM in a
        // shared file: a copy's private pages are first settled into a file of its own.
        let record = self.inner.record(&self.id)?;
        if !precopy::live_copy_is_exact(&record) && matches!(record.ram, RamMode::Private { .. }) {
            self.pause()?;
            self.resume()?;
        }
        let inner = &self.inner;
        let dir = self.dir();
        let lock = lock_file(&dir.join("lock"))?;
        let (source, _pid) = self.running_record("fork")?;
        let fork_dir = inner.cfg.root.join("forks").join(format!(
            "{}-{}",
            self.id,
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_micros())
                .unwrap_or(0)
        ));
        fs::create_dir_all(&fork_dir).map_err(io_err(format!("creating {}", fork_dir.display())))?;
        fs::set_permissions(&fork_dir, fs::Permissions::from_mode(0o711)).map_err(io_err("chmod fork dir"))?;

        // Everything that does not need the source's memory is ready before the copy.
        let base = fork_dir.join("ram");
        let mut prepared: Vec<(VmRecord, PathBuf)> = Vec::new();
        let mut base_gid = None;
        let discard_all = |prepared: &[(VmRecord, PathBuf)], gid: Option<u32>| {
            for (record, copy_dir) in prepared {
                inner.discard(copy_dir, Some(&record.netns), Some(record.uid));
            }
            let _ = fs::remove_dir_all(&fork_dir);
            if let Some(gid) = gid {
                inner.release_uid(gid);
            }
        };
        let ready = (|| {
            let gid = inner.claim_base_gid(&fork_dir)?;
            base_gid = Some(gid);
            for id in new_ids {
                prepared.push(inner.prepare_copy(&source, id, &base, gid)?);
            }
            Ok::<_, VmError>(gid)
        })();
        let gid = match ready {
            Ok(gid) => gid,
            Err(e) => {
                discard_all(&prepared, base_gid);
                return Err(e);
            }
        };

        let copied = inner.copy_running(&source, &fork_dir);
        drop(lock);
        let copied = match copied {
            Ok(c) => c,
            Err(e) => {
                discard_all(&prepared, Some(gid));
                return Err(e);
            }
        };
        // Copies open the base read-write (QEMU 7.2 has no `rom=on`) and map it
        // privately: the base's group may, nobody else.
        if let Err(e) = give(&base, 0, gid, 0o660) {
            discard_all(&prepared, Some(gid));
            return Err(e);
        }

        // Start every copy's QEMU, then restore each.
        let mut qmps = Vec::new();
        let mut failure = None;
        for (record, copy_dir) in prepared.iter_mut() {
            let step = (|| {
                sparse_copy(&fork_dir.join("rw.img"), &copy_dir.join("rw.img"))?;
                give(&copy_dir.join("rw.img"), record.uid, record.uid, 0o600)?;
                fs::copy(fork_dir.join("state"), copy_dir.join("state")).map_err(io_err("copying the snapshot"))?;
                let (_pid, qmp) = inner.start_qemu(copy_dir, record, true)?;
                Ok::<_, VmError>(qmp)
            })();
            match step {
                Ok(qmp) => qmps.push(qmp),
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        if failure.is_none() {
            for ((_, copy_dir), qmp) in prepared.iter().zip(qmps.iter_mut()) {
                if let Err(e) = restore(qmp, &copy_dir.join("state"), true) {
                    failure = Some(e);
                    break;
                }
            }
        }
        drop(qmps);
        if let Some(e) = failure {
            discard_all(&prepared, Some(gid));
            return Err(e);
        }
        for (_, copy_dir) in &prepared {
            let _ = fs::remove_file(copy_dir.join("state"));
        }
        let _ = fs::remove_file(fork_dir.join("rw.img"));
        let _ = fs::remove_file(fork_dir.join("state"));
        let copies = prepared
            .into_iter()
            .map(|(record, _)| VmHandle {
                inner: self.inner.clone(),
                id: record.id,
            })
            .collect();
        Ok(ForkReport {
            copies,
            source_paused: copied.source_paused,
            total: started.elapsed(),
            ram_bytes: copied.ram_bytes,
            disk_dirty_bytes: copied.disk_dirty_bytes,
        })
    }

    /// Brings a VM back to a state the driver recognises after the edge died in the
    /// middle of an operation (call it for every VM when the edge starts): a QEMU left
    /// stopped by an unfinished pause or fork continues; an unfinished live copy is
    /// cancelled and its receiver ended; a QEMU whose snapshot was
    /// already taken (the VM is paused) is ended; a QEMU still waiting for an incoming
    /// snapshot is ended and the VM stays paused. Returns what it did, if anything.
    pub fn recover(&self) -> Result<Option<String>, VmError> {
        if self.on_firecracker()? {
            return fc::recover(self);
        }
        let dir = self.dir();
        let _lock = lock_file(&dir.join("lock"))?;
        let mut record = self.inner.record(&self.id)?;
        let Some(pid) = self.inner.live_pid(&record) else {
            return Ok(None);
        };
        let end = |record: &mut VmRecord| -> Result<(), VmError> {
            if let Some(pidfd) = pidfd_open(pid) {
                sigkill(&pidfd);
                wait_ended(&dir, pid, &pidfd, Duration::from_secs(10));
            }
            record.state = VmState::Paused;
            record.pid = None;
            record.pid_start = None;
            self.inner.save(record)
        };
        if record.state == VmState::Paused {
            end(&mut record)?;
            return Ok(Some("ended the QEMU of a finished snapshot".into()));
        }
        let mut qmp = self.inner.qmp(&record)?;
        let status = qmp.execute("query-status", json!({}))?;
        let status = status["status"].as_str().unwrap_or("").to_string();
        if status != "inmigrate" && precopy::migration_under_way(&mut qmp) {
            // A live copy the edge did not finish: its migration would stop the VM at
            // the switch-over with nobody to continue it.
            precopy::cancel_and_continue(&mut qmp);
            self.inner.discard_receiver(&self.id);
            return Ok(Some("cancelled an unfinished live copy".into()));
        }
        self.inner.discard_receiver(&self.id);
        match status.as_str() {
            "running" => Ok(None),
            "inmigrate" => {
                drop(qmp);
                if !dir.join("state").is_file() {
                    return Err(VmError::Corrupt {
                        path: dir.join("state"),
                        message: "a restore was under way but the snapshot is gone".into(),
                    });
                }
                end(&mut record)?;
                Ok(Some("ended an unfinished restore; the VM is paused".into()))
            }
            other => {
                qmp.execute("cont", json!({}))?;
                Ok(Some(format!("continued a VM left {other}")))
            }
        }
    }

    /// Ends the QEMU process at once (the guest gets no say); the VM stays on disk,
    /// [`VmStatus::Exited`].
    pub fn kill(&self) -> Result<(), VmError> {
        if self.on_firecracker()? {
            return fc::kill(self);
        }
        let record = self.inner.record(&self.id)?;
        if let Some(pid) = self.inner.live_pid(&record)
            && let Some(pidfd) = pidfd_open(pid)
        {
            sigkill(&pidfd);
            wait_ended(&self.dir(), pid, &pidfd, Duration::from_secs(10));
        }
        Ok(())
    }

    /// Kills the VM if it runs and removes everything it had: files, namespace, uid.
    pub fn delete(&self) -> Result<(), VmError> {
        let dir = self.dir();
        let record = self.inner.record(&self.id)?;
        let _lock = lock_file(&dir.join("lock"))?;
        self.kill()?;
        net::delete(&record.netns)?;
        self.inner.release_uid(record.uid);
        if dir.exists() {
            fs::remove_dir_all(&dir).map_err(io_err(format!("removing {}", dir.display())))?;
        }
        self.inner.gc_forks();
        Ok(())
    }
}

/// Loads the snapshot `state` into a QEMU started with `-incoming defer`, then runs it.
fn restore(qmp: &mut Qmp, state: &Path, ignore_shared: bool) -> Result<(), VmError> {
    set_ignore_shared(qmp, ignore_shared)?;
    let file = fs::File::open(state).map_err(io_err(format!("opening {}", state.display())))?;
    qmp.execute_with_fd("getfd", json!({"fdname": "snapshot"}), file.as_raw_fd())?;
    qmp.execute("migrate-incoming", json!({"uri": "fd:snapshot"}))?;
    wait_migration(qmp, "the restore")?;
    let status = qmp.execute("query-status", json!({}))?;
    if status["status"] != "running" {
        qmp.execute("cont", json!({}))?;
    }
    Ok(())
}

impl Inner {
    /// Makes a fork copy's directory, uid, namespace and initrd (everything that does
    /// not need the source's memory); on failure leaves nothing behind. The copy maps
    /// `base` privately and carries its group `gid`.
    fn prepare_copy(&self, source: &VmRecord, id: &str, base: &Path, gid: u32) -> Result<(VmRecord, PathBuf), VmError> {
        let copy_dir = self.create_vm_dir(id)?;
        let netns = format!("{}{}", self.netns_prefix, id);
        let mut claimed_uid = None;
        let result = (|| {
            let uid = self.allocate_uid(id)?;
            claimed_uid = Some(uid);
            let record = VmRecord {
                id: id.into(),
                uid,
                groups: vec![gid],
                netns: netns.clone(),
                ram: RamMode::Private {
                    base: base.to_path_buf(),
                },
                state: VmState::Paused,
                pid: None,
                pid_start: None,
                forked_from: Some(source.id.clone()),
                fc: Default::default(),
                ..source.clone()
            };
            self.prepare_dir(&copy_dir, uid)?;
            self.link_restored_initrd(&copy_dir)?;
            net::create(&netns, uid)?;
            Ok(record)
        })();
        match result {
            Ok(record) => Ok((record, copy_dir)),
            Err(e) => {
                self.discard(&copy_dir, Some(&netns), claimed_uid);
                Err(e)
            }
        }
    }

    /// The initrd of a VM restored from another's memory. Such a guest never boots
    /// again (`-no-reboot`: a reboot ends QEMU) and QEMU does not load an initrd into
    /// the RAM of an incoming VM, so it needs no configuration of its own: the shared
    /// initramfs, hard-linked (root's, readable by all).
    fn link_restored_initrd(&self, dir: &Path) -> Result<(), VmError> {
        let initrd = dir.join("initrd");
        if fs::hard_link(&self.boot.initramfs, &initrd).is_ok() {
            return Ok(());
        }
        fs::copy(&self.boot.initramfs, &initrd).map_err(io_err("copying the initramfs"))?;
        fs::set_permissions(&initrd, fs::Permissions::from_mode(0o444)).map_err(io_err("chmod the initrd"))
    }

    /// A group of its own for the RAM base in `dir` (recorded in `dir/gid`): the VMs that
    /// map the base carry it, no other VM does, and it is free again once `dir` is gone.
    fn claim_base_gid(&self, dir: &Path) -> Result<u32, VmError> {
        let gid = self.allocate_uid_for(dir)?;
        if let Err(e) = fs::write(dir.join("gid"), gid.to_string()) {
            self.release_uid(gid);
            return Err(VmError::io("recording a RAM base's group", e));
        }
        Ok(gid)
    }

    /// The RAM base of VMs restored from the snapshot RAM file `ram` (the caller holds
    /// `forks.lock`): `forks/snap-<dev>-<inode>/ram`, a hard link of it (so the name
    /// cannot be reused while the base exists), with a group of its own. Collected
    /// like a fork's base once no VM maps it.
    fn snapshot_base(&self, ram: &Path) -> Result<(PathBuf, u32), VmError> {
        use std::os::unix::fs::MetadataExt;
        let meta = fs::metadata(ram).map_err(io_err(format!("reading {}", ram.display())))?;
        let forks = self.cfg.root.join("forks");
        let dir = forks.join(format!("snap-{}-{}", meta.dev(), meta.ino()));
        let base = dir.join("ram");
        let same_file = fs::metadata(&base).is_ok_and(|b| b.dev() == meta.dev() && b.ino() == meta.ino());
        let gid = fs::read_to_string(dir.join("gid"))
            .ok()
            .and_then(|g| g.trim().parse::<u32>().ok());
        if same_file && let Some(gid) = gid {
            return Ok((base, gid));
        }
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
        let (dir, linked) = if fs::hard_link(ram, &base).is_ok() {
            (dir, true)
        } else {
            // Another file system: a copy, in a directory of its own that no later
            // restore reuses (the snapshot's inode number may be reused).
            let _ = fs::remove_dir_all(&dir);
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            let unique = dir.with_extension(format!("copy{nanos}"));
            fs::create_dir(&unique).map_err(io_err(format!("creating {}", unique.display())))?;
            (unique, false)
        };
        let base = dir.join("ram");
        let made = (|| {
            fs::set_permissions(&dir, fs::Permissions::from_mode(0o711))
                .map_err(io_err(format!("chmod {}", dir.display())))?;
            if !linked {
                sparse_copy(ram, &base)?;
            }
            let gid = self.claim_base_gid(&dir)?;
            give(&base, 0, gid, 0o660)?;
            Ok::<_, VmError>((base.clone(), gid))
        })();
        if made.is_err() {
            let gid = fs::read_to_string(dir.join("gid")).ok();
            let _ = fs::remove_dir_all(&dir);
            if let Some(gid) = gid.and_then(|g| g.trim().parse::<u32>().ok()) {
                self.release_uid(gid);
            }
        }
        made
    }

    /// Removes fork directories no VM maps any more.
    fn gc_forks(&self) {
        let Ok(_lock) = lock_file(&self.cfg.root.join("forks.lock")) else {
            return;
        };
        let mut used = std::collections::BTreeSet::new();
        if let Ok(entries) = fs::read_dir(self.cfg.root.join("vms")) {
            for entry in entries.filter_map(Result::ok) {
                if let Ok(record) = read_json::<VmRecord>(&entry.path().join("vm.json"))
                    && let RamMode::Private { base } = record.ram
                    && let Some(parent) = base.parent()
                {
                    used.insert(parent.to_path_buf());
                }
            }
        }
        if let Ok(entries) = fs::read_dir(self.cfg.root.join("forks")) {
            for entry in entries.filter_map(Result::ok) {
                let path = entry.path();
                // A fork under way has no `ram` yet or holds `state`: leave it.
                if !used.contains(&path) && path.join("ram").exists() && !path.join("state").exists() {
                    let gid = fs::read_to_string(path.join("gid"))
                        .ok()
                        .and_then(|g| g.trim().parse::<u32>().ok());
                    let _ = fs::remove_dir_all(&path);
                    if let Some(gid) = gid {
                        self.release_uid(gid);
                    }
                }
            }
        }
    }
}
