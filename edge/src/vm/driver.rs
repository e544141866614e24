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
//!
//! The driver's rooms: this file holds the types (config, spec, record, reports) and
//! small helpers; `create.rs` makes VMs (cold boot, restore) and finds them again;
//! `records.rs` the VM's directory, record and uid; `qemu.rs` QEMU processes, QMP and the
//! migration stream; `handle.rs` what a VM is, `recover`, `kill`, `delete`; `suspend.rs`
//! pause, resume, snapshots; `fork.rs` forks and shared RAM bases; `precopy.rs` live
//! copies; `fc.rs` the same operations under Firecracker; `cgroup.rs` each VMM's cgroup
//! (CPU quota, memory limit, IO weight) and why each is what it is.
//!
//! **Architecture Invariant:** QEMU is never the edge's child and nothing lives only in
//! the edge's memory: a restarted edge `open`s each VM from its directory and calls
//! `recover` (a VM left stopped by an unfinished operation continues; a QEMU whose
//! snapshot is complete is ended).
//!
//! **Architecture Invariant:** each VM's QEMU runs as a uid of its own (files 0600 to it;
//! VM directories 0711 root). Exception: QEMU 7.2 opens a RAM base read-write (no `rom=on`
//! before 8.2), so a base is 0660 to a group of its own (an id claimed in the uid
//! registry, owned by the base's directory, freed with it), which only the VMs that map it
//! carry: copies of one fork, or restores of one snapshot, could write their shared base,
//! no other VM can.
//!
//! **Architecture Invariant:** a copy of a running VM (fork, snapshot) is the VM at one
//! instant, RAM and disk alike: it is live only where QEMU's dirty-page log is exact, and
//! stops the source for the whole copy otherwise. QEMU 7.2 under TCG loses writes when a
//! RAM block is a multiple of 64 pages, so under TCG a VM's RAM is 8 KiB short of its MiBs
//! (`ram_trimmed`), which takes QEMU's page-by-page sync; VMs made before are copied
//! stopped. `edge/tests/vm_microvm.rs` checks it page by page.
//!
//! **Architecture Invariant:** `source_paused` is the time the source's vCPUs were
//! stopped: QEMU's `STOP` to `RESUME` event timestamps, not our calls around them.
//!
//! **Architecture Invariant:** every VMM process (QEMU, a live copy's receiver, the
//! jailer that becomes Firecracker) runs from before its exec in a cgroup of its own,
//! named after its VM, with the memory limit guest RAM + VMM overhead; a running VM is
//! held to its `cpu_millis` except while the driver boots, restores or copies it
//! (`cgroup.rs`).

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

mod cgroup;
mod create;
/// VMs under Firecracker: the same handle, another VMM.
mod fc;
mod fork;
mod handle;
mod precopy;
mod qemu;
mod records;
mod suspend;

use cgroup::CpuPhase;
pub use cgroup::{vmm_memory_limit, vmm_overhead_mb};
use qemu::{
    console_tail, exit_record, migrate_to_file, release_page_cache, restore, set_ignore_shared, sigkill, wait_ended,
    wait_pidfd,
};

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
    /// The CPU the VM is held to once its guest answers, in thousandths of a core (a CFS
    /// quota on its VMM's cgroup, see `driver/cgroup.rs`); `None`: its vCPUs alone bound it.
    pub cpu_millis: Option<u32>,
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
    /// The VMM's CPU quota at steady state, thousandths of a core (see `cgroup.rs`).
    /// Absent in records written before VMMs had cgroups: no quota.
    #[serde(default)]
    cpu_millis: Option<u32>,
    /// Paused with its disk only (see [`VmHandle::store`]): no device state, no memory;
    /// its resume boots it again ([`VmHandle::boot_again`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    stored: bool,
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

/// Makes a snapshot's directory `dest` (it must not exist), private to the edge.
fn create_snapshot_dir(dest: &Path) -> Result<(), VmError> {
    fs::create_dir(dest).map_err(io_err(format!("creating {}", dest.display())))?;
    fs::set_permissions(dest, fs::Permissions::from_mode(0o700)).map_err(io_err(format!("chmod {}", dest.display())))
}

/// Ends a snapshot into `dest`: with what was `taken` (how long the source stopped, the
/// bytes copied, whether its RAM went into the device-state stream), its
/// [`SNAPSHOT_META`] describing `record`; on any failure `dest` is removed, so a
/// half-written snapshot is never left to be trusted.
fn finish_snapshot(
    dest: &Path,
    source: &str,
    record: &VmRecord,
    taken: Result<(Duration, u64, bool), VmError>,
) -> Result<SnapshotReport, VmError> {
    let written = taken.and_then(|(source_paused, bytes, ram_in_stream)| {
        let meta = SnapshotMeta {
            source: source.to_string(),
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
        write_json_atomic(&dest.join(SNAPSHOT_META), &meta)?;
        Ok(SnapshotReport { source_paused, bytes })
    });
    if written.is_err() {
        let _ = fs::remove_dir_all(dest);
    }
    written
}

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
    /// Where the host's cgroup controllers are (see `cgroup.rs`).
    cgroups: crate::cgroups::Layout,
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
