//! VMs under Firecracker, behind the same [`VmHandle`] as QEMU's. A child of `driver`
//! so that it shares the VM record, the uid registry, the namespaces and the VM shim
//! with QEMU VMs; what differs lives here.
//!
//! Each run of a VM is one jailed Firecracker process (`firecracker::JailSpec`): the
//! jailer, started by `opendsec-vm-shim` (detached, console to `console.log`, `exit.json`
//! at the end), makes `<root>/jails/firecracker/<id>/root` and the cpuset cgroup
//! `<driver's parent>/<id>`, joins the VM's network namespace, drops to the VM's uid and
//! execs Firecracker under its default seccomp filter. Every file the VM uses is
//! hard-linked into the chroot before the process starts, under fixed names (`/rw.img`,
//! `/ram`, ...), so a snapshot's device paths are valid in every later jail.
//!
//! Files in `vms/<id>/` besides the common ones: `ram` and `state`, the memory and device
//! state of the last pause (kept while the VM runs again: Firecracker maps `ram`
//! privately, so it must not change until the process is gone); during a pause
//! `ram.new` (Full) or `ram.diff` (Diff) and `state.new`; `vmm.pid`.
//!
//! Memory: a cold-booted VM's memory is anonymous; a resumed VM maps `ram` (or its
//! fork's frozen base) privately: pages are read on demand and copied when written.
//! Dirty pages are always tracked, and every snapshot of a running process is a Diff:
//! only the pages written since the process's *diff base* ([`DiffBase`]), which is
//! - nothing, for a process booted cold that took no snapshot yet: every page it never
//!   wrote is zero, so the Diff's sparse file is its whole memory;
//! - the memory file it was loaded from (`ram`, or a fork copy's base);
//! - `diffbase`, a hard link to the whole memory its last snapshot or fork produced.
//!
//! A pause merges its Diff onto the base once the process has ended (in place when the
//! base is its own `ram`, else into a copy). A fork or a snapshot of a running VM stops
//! the source only while the Diff and the disk are written; the whole memory (base plus
//! Diff) is put together after the source runs on, and becomes its next base. A record
//! that knows no base (an interrupted snapshot, an older edge's record) takes one Full
//! snapshot. A fork copy maps its fork's frozen memory privately, so copies share
//! every page none of them wrote.
//!
//! Each run is started by `opendsec-vm-shim` through its keeper (`Launch::keeper`): `jailer
//! --id <vm> --uid/--gid <the VM's uid> --chroot-base-dir <root>/jails --netns <the VM's>
//! --cgroup-version 1|2 --parent-cgroup odvm-<hash of root>`, never `--no-seccomp`. The
//! agent channel is the same tap as QEMU's; the vsock device is configured but unused.
//!
//! **Architecture Invariant:** a memory file Firecracker has loaded never changes while a
//! process maps it: a Diff is merged in place onto `ram` only after the process has ended,
//! and onto any other base only into a copy. A Diff is only ever merged onto the base the
//! record named when it was taken: the base is cleared before every snapshot and set again
//! only once the snapshot's memory is whole. A pause records `pending` once its snapshot is
//! complete; `resume`/`recover` finish it (each step repeatable).
//!
//! **Architecture Invariant:** nothing of a Firecracker run outlives it: `kill`, a failed
//! start, a failed load and `delete` end the process and remove its chroot and cgroup; a
//! paused VM has neither; a Firecracker never outlives its shim (the keeper).
//!
//! Not here: guests under Firecracker reach user space only with hardware KVM (this host's
//! PVM never boots a stock kernel); a dirty-block copy of the writable disk in a fork (it
//! is copied whole, sparse, while the source is stopped); Firecracker's vsock as the
//! agent channel. CPU, memory and IO limits are the VM's cgroup's (`cgroup.rs`), which
//! the jailer joins before it execs Firecracker. Binaries: `ops/lib.sh`
//! `ensure_firecracker` (pinned, checksums checked).

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::*;
use crate::vm::firecracker::{
    FcApi, InstanceState, JailSpec, SnapshotKind, cgroup_version, merge_diff, merge_diff_into_copy,
};

/// Names inside every jail (as the jailed process sees them).
const KERNEL: &str = "/vmlinux";
const INITRD: &str = "/initrd";
const ROOT_DISK: &str = "/root.img";
const RW_DISK: &str = "/rw.img";
const STATE: &str = "/state";
const RAM: &str = "/ram";
const SNAP_STATE: &str = "/snap.state";
const SNAP_RAM: &str = "/snap.ram";
/// In `vms/<id>/`: a hard link to the whole memory of the running process's last
/// snapshot or fork, when that is its diff base.
const DIFF_BASE: &str = "diffbase";
const VSOCK: &str = "/v.sock";
/// The guest's vsock context id (every VM is alone in its jail and namespace).
const GUEST_CID: u32 = 3;

/// How long the jailer may take until Firecracker listens on its API socket.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a killed Firecracker may take to be gone (and its shim to record it).
const EXIT_TIMEOUT: Duration = Duration::from_secs(10);

/// What only a Firecracker VM's record holds.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct FcRecord {
    /// What a Diff snapshot of the running process is a diff of; `None` = unknown
    /// (the next snapshot is Full). Cleared before every snapshot (each resets
    /// Firecracker's dirty bitmap) and set again once the snapshot's memory is whole.
    #[serde(default)]
    base: Option<DiffBase>,
    /// A pause whose snapshot is complete but not yet in place (`finish_pause`).
    #[serde(default)]
    pending: Option<SnapshotKind>,
}

impl FcRecord {
    pub(super) fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

/// What the running process's memory is a Diff away from (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum DiffBase {
    /// Booted cold, no snapshot since: every page not in the Diff is zero.
    Zero,
    /// The memory file it was loaded from ([`Inner::memory_file`]).
    Loaded,
    /// `vms/<id>/diffbase`.
    Linked,
}

/// The kernel command line: the console on the serial port (the shim keeps it), a
/// panic or reboot ends the process (`reboot=k`: Firecracker exits on the keyboard
/// controller's reset), no PCI bus to scan.
fn boot_args() -> String {
    "console=ttyS0 reboot=k panic=-1 pci=off quiet random.trust_cpu=on".into()
}

impl MicroVmDriver {
    /// The VMM this driver gives new VMs, and why.
    pub fn vmm(&self) -> &VmmVerdict {
        &self.inner.vmm
    }

    /// Firecracker's binaries, when they were found.
    pub fn firecracker(&self) -> Option<&FirecrackerTools> {
        self.inner.firecracker.as_ref().ok()
    }
}

impl VmHandle {
    pub(super) fn on_firecracker(&self) -> Result<bool, VmError> {
        Ok(self.inner.record(&self.id)?.vmm == Vmm::Firecracker)
    }

    /// The VMM this VM runs under and its accelerator (Firecracker: always KVM).
    pub fn vmm(&self) -> Result<(Vmm, Accel), VmError> {
        let record = self.inner.record(&self.id)?;
        Ok((record.vmm, record.accel))
    }

    /// The jail of a Firecracker VM (its chroot, cgroup and the uid and gid it runs
    /// as); `None` for a QEMU VM.
    pub fn firecracker_jail(&self) -> Result<Option<JailSpec>, VmError> {
        let record = self.inner.record(&self.id)?;
        Ok((record.vmm == Vmm::Firecracker).then(|| self.inner.jail(&record)))
    }

    /// A connection to the API of the VM's running Firecracker process (diagnostics and
    /// tests). Snapshots taken through it are unknown to the driver.
    pub fn firecracker_api(&self) -> Result<FcApi, VmError> {
        let (record, _pid) = self.running_record("reach its Firecracker API")?;
        if record.vmm != Vmm::Firecracker {
            return Err(VmError::Invalid(format!("VM {} runs under QEMU", self.id)));
        }
        FcApi::connect(&self.inner.jail(&record).api_socket())
    }
}

impl Inner {
    fn fc_tools(&self) -> Result<&FirecrackerTools, VmError> {
        self.firecracker.as_ref().map_err(|e| VmError::Prerequisite(e.clone()))
    }

    /// The jail of `record`'s VM. A fork copy runs with its source's group, the only
    /// one that may read the frozen memory every copy maps.
    fn jail(&self, record: &VmRecord) -> JailSpec {
        let (jailer, firecracker) = match &self.firecracker {
            Ok(t) => (t.jailer.clone(), t.firecracker.clone()),
            // Only the chroot's and cgroup's names are needed to remove them.
            Err(_) => (PathBuf::from("jailer"), PathBuf::from("firecracker")),
        };
        JailSpec {
            id: record.id.clone(),
            jailer,
            firecracker,
            chroot_base: self.cfg.root.join("jails"),
            uid: record.uid,
            gid: record.groups.first().copied().unwrap_or(record.uid),
            netns: Some(net::netns_path(&record.netns)),
            parent_cgroup: self.netns_prefix.trim_end_matches('-').to_string(),
            cgroup: cgroup_version(),
        }
    }

    /// Starts a jailed Firecracker for `record` (booting when `load` is `None`, else
    /// ready to load `dir/state` with the memory file `load`) and connects to its API.
    /// The record is saved running with the new pid. On failure nothing of the run is
    /// left (process, chroot, cgroup); the caller resets the record.
    fn start_firecracker(
        &self,
        dir: &Path,
        record: &mut VmRecord,
        load: Option<&Path>,
    ) -> Result<(i32, FcApi), VmError> {
        self.fc_tools()?;
        let jail = self.jail(record);
        let fail = |message: String| VmError::Firecracker {
            id: record.id.clone(),
            message,
        };
        jail.prepare()?;
        let linked = (|| {
            jail.link(&record.root_disk, ROOT_DISK)?;
            jail.link(&dir.join("rw.img"), RW_DISK)?;
            match load {
                None => {
                    jail.link(&record.vmlinux, KERNEL)?;
                    jail.link(&dir.join("initrd"), INITRD)?;
                }
                Some(ram) => {
                    jail.link(&dir.join("state"), STATE)?;
                    jail.link(ram, RAM)?;
                }
            }
            jail.argv()
        })();
        let argv = match linked {
            Ok(argv) => argv,
            Err(e) => {
                let _ = jail.cleanup();
                return Err(e);
            }
        };
        for stale in ["exit.json", "vmm.pid"] {
            let _ = fs::remove_file(dir.join(stale));
        }
        let launch = Launch {
            argv,
            // The jailer needs root; it drops to the VM's uid and gid itself.
            uid: 0,
            gid: 0,
            groups: Vec::new(),
            netns: None,
            tap: None,
            workdir: dir.to_path_buf(),
            console_log: dir.join("console.log"),
            console_cap_bytes: self.cfg.console_cap_bytes,
            pid_file: dir.join("vmm.pid"),
            exit_file: dir.join("exit.json"),
            // The jailer's uid change clears PDEATHSIG: the keeper holds it instead.
            keeper: true,
            cgroups: match self.prepare_cgroup(&self.vm_cgroup(&record.id), record) {
                Ok(dirs) => dirs,
                Err(e) => {
                    let _ = jail.cleanup();
                    return Err(e);
                }
            },
        };
        let launch_file = dir.join("launch.json");
        let spawned = write_json_atomic(&launch_file, &launch)
            .and_then(|()| super::super::shim::spawn(&self.cfg.shim, &launch_file));
        let pid = match spawned {
            Ok(pid) => pid,
            Err(e) => {
                let _ = jail.cleanup();
                return Err(fail(format!("starting the jailer: {e}")));
            }
        };
        record.pid = Some(pid);
        record.pid_start = process_start(pid);
        record.state = VmState::Running;
        self.save(record)?;
        let alive = || process_start(pid).is_some() && exit_record(dir, pid).is_none();
        match FcApi::connect_until(&jail.api_socket(), Instant::now() + START_TIMEOUT, &alive) {
            Ok(api) => Ok((pid, api)),
            Err(e) => {
                let _ = self.stop_firecracker(dir, record);
                Err(fail(format!("{e}; console: {}", console_tail(dir, 1500))))
            }
        }
    }

    /// Ends `record`'s Firecracker process (if it still runs) and removes its jail and
    /// cgroup.
    pub(super) fn stop_firecracker(&self, dir: &Path, record: &VmRecord) -> Result<(), VmError> {
        if let Some(pid) = self.live_pid(record)
            && let Some(pidfd) = pidfd_open(pid)
        {
            sigkill(&pidfd);
            if !wait_ended(dir, pid, &pidfd, EXIT_TIMEOUT) {
                return Err(VmError::Firecracker {
                    id: record.id.clone(),
                    message: format!(
                        "process {pid} did not end within {} s of SIGKILL",
                        EXIT_TIMEOUT.as_secs()
                    ),
                });
            }
        }
        self.jail(record).cleanup()?;
        self.remove_vm_cgroup(&record.id)
    }

    /// Removes what a Firecracker VM that never became whole had.
    fn discard_firecracker(&self, dir: &Path, record: Option<&VmRecord>, netns: &str, uid: Option<u32>) {
        if let Some(record) = record {
            let _ = self.stop_firecracker(dir, record);
        }
        self.discard(dir, Some(netns), uid);
    }

    /// Puts the snapshot of a pause whose process has ended in place: a Full one's
    /// memory replaces `ram`; a Diff's is merged onto its base (in place when that is
    /// `ram` itself), then replaces `ram`; then `state`. Every step can be repeated, so
    /// an edge that died half-way finishes here (resume, recover).
    fn finish_pause(&self, dir: &Path, record: &mut VmRecord) -> Result<(), VmError> {
        let Some(kind) = record.fc.pending else {
            return Ok(());
        };
        let ram = dir.join("ram");
        let diff = dir.join("ram.diff");
        if kind == SnapshotKind::Diff && diff.exists() {
            let base = record.fc.base.ok_or_else(|| VmError::Corrupt {
                path: dir.join("vm.json"),
                message: "a Diff pause whose base is unknown".into(),
            })?;
            if base == DiffBase::Loaded && record.ram == RamMode::Shared {
                merge_diff(&ram, &diff)?;
            } else {
                self.whole_memory(dir, record, Some(base), &diff, &dir.join("ram.new"))?;
            }
        }
        if dir.join("ram.new").exists() {
            fs::rename(dir.join("ram.new"), &ram).map_err(io_err("keeping the memory snapshot"))?;
        }
        if dir.join("state.new").exists() {
            fs::rename(dir.join("state.new"), dir.join("state")).map_err(io_err("keeping the snapshot"))?;
        }
        let _ = fs::remove_file(&diff);
        let _ = fs::remove_file(dir.join(DIFF_BASE));
        give(&ram, record.uid, record.uid, 0o600)?;
        give(&dir.join("state"), record.uid, record.uid, 0o600)?;
        let old_base = matches!(record.ram, RamMode::Private { .. });
        record.ram = RamMode::Shared;
        record.groups.clear();
        record.fc = FcRecord::default();
        self.save(record)?;
        if old_base {
            self.gc_forks();
        }
        Ok(())
    }

    /// Makes `dest` the whole memory of `snap`, a snapshot's memory file taken of
    /// `record`'s process: a Diff on `base` is merged onto a copy of that base (the base
    /// untouched), a Diff on nothing or a Full snapshot (`None`) is whole already. `snap`
    /// is gone afterwards; until then this can be repeated.
    fn whole_memory(
        &self,
        dir: &Path,
        record: &VmRecord,
        base: Option<DiffBase>,
        snap: &Path,
        dest: &Path,
    ) -> Result<(), VmError> {
        let onto = match base {
            None => None,
            Some(DiffBase::Zero) => {
                let len = fs::metadata(snap)
                    .map_err(io_err("reading the snapshot's memory"))?
                    .len();
                let memory = record.memory_mb << 20;
                if len > memory {
                    return Err(VmError::Corrupt {
                        path: snap.to_path_buf(),
                        message: format!("{len} bytes of memory for a VM of {memory}"),
                    });
                }
                // Pages after the last one written are zero.
                fs::OpenOptions::new()
                    .write(true)
                    .open(snap)
                    .and_then(|f| f.set_len(memory))
                    .map_err(io_err("sizing the snapshot's memory"))?;
                None
            }
            Some(DiffBase::Loaded) => Some(self.memory_file(dir, record)),
            Some(DiffBase::Linked) => Some(dir.join(DIFF_BASE)),
        };
        match onto {
            None => fs::rename(snap, dest).map_err(io_err("keeping the memory snapshot"))?,
            Some(base_file) => {
                merge_diff_into_copy(&base_file, snap, dest)?;
                let _ = fs::remove_file(snap);
            }
        }
        Ok(())
    }

    /// The memory file a paused VM loads: its own, or (a fork copy never paused) the
    /// fork's frozen base.
    fn memory_file(&self, dir: &Path, record: &VmRecord) -> PathBuf {
        match &record.ram {
            RamMode::Private { base } => base.clone(),
            _ => dir.join("ram"),
        }
    }
}

/// Moves a file the jailed process wrote out of its chroot to `dest` (root's, 0600).
fn take_out(jail: &JailSpec, inside: &str, dest: &Path) -> Result<u64, VmError> {
    let src = jail.host_path(inside);
    match fs::rename(&src, dest) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EXDEV) => {
            sparse_copy(&src, dest)?;
            let _ = fs::remove_file(&src);
        }
        Err(e) => {
            return Err(VmError::io(
                format!("moving {} to {}", src.display(), dest.display()),
                e,
            ));
        }
    }
    give(dest, 0, 0, 0o600)?;
    Ok(allocated_bytes(dest))
}

fn remove_snapshot_files(jail: &JailSpec) {
    let _ = fs::remove_file(jail.host_path(SNAP_STATE));
    let _ = fs::remove_file(jail.host_path(SNAP_RAM));
}

/// Configures a freshly started process as `record` says and boots it.
fn configure_and_start(api: &mut FcApi, record: &VmRecord) -> Result<(), VmError> {
    api.boot_source(KERNEL, Some(INITRD), &boot_args())?;
    api.machine_config(record.vcpus, record.memory_mb, true)?;
    api.drive("root", ROOT_DISK, true)?;
    api.drive("rw", RW_DISK, false)?;
    api.network_interface("eth0", net::TAP, net::GUEST_MAC)?;
    api.vsock(GUEST_CID, VSOCK)?;
    api.start()
}

/// [`MicroVmDriver::create`] under Firecracker: the same disks, initrd, uid and
/// namespace as QEMU's, then configure and InstanceStart.
pub(super) fn create(driver: &MicroVmDriver, spec: &VmSpec, progress: &dyn Fn(&str)) -> Result<VmHandle, VmError> {
    let inner = &driver.inner;
    inner.fc_tools()?;
    if spec.vcpus > 32 || (spec.vcpus > 1 && spec.vcpus % 2 == 1) {
        return Err(VmError::Invalid(format!(
            "Firecracker runs 1 or an even number of vCPUs up to 32, not {}",
            spec.vcpus
        )));
    }
    let root_disk = build_root_disk(&inner.cfg.store, &spec.image, progress)?;
    let dir = inner.create_vm_dir(&spec.id)?;
    let netns = format!("{}{}", inner.netns_prefix, spec.id);
    let mut claimed_uid = None;
    let mut started: Option<VmRecord> = None;
    let result = (|| {
        let _lock = lock_file(&dir.join("lock"))?;
        let uid = inner.allocate_uid(&spec.id)?;
        claimed_uid = Some(uid);
        let mut record = inner.fresh_record(spec, uid, &netns, root_disk, Vmm::Firecracker, Machine::Microvm);
        // Dirty pages are tracked from boot: the first Diff holds every page written.
        record.fc.base = Some(DiffBase::Zero);
        inner.prepare_dir(&dir, uid)?;
        create_rw_disk(&inner.cfg.store, spec.disk_mb, &dir.join("rw.img"))?;
        write_vm_initrd(&inner.boot, &dir.join("initrd"), &GuestConfig::of(spec))?;
        give(&dir.join("rw.img"), uid, uid, 0o600)?;
        give(&dir.join("initrd"), uid, uid, 0o400)?;
        net::create(&netns, uid)?;
        write_json_atomic(&dir.join("vm.json"), &record)?;
        let (_pid, mut api) = inner.start_firecracker(&dir, &mut record, None)?;
        started = Some(record.clone());
        configure_and_start(&mut api, &record).map_err(|e| VmError::Firecracker {
            id: record.id.clone(),
            message: format!("booting: {e}; console: {}", console_tail(&dir, 1500)),
        })
    })();
    if let Err(e) = result {
        inner.discard_firecracker(&dir, started.as_ref(), &netns, claimed_uid);
        return Err(e);
    }
    Ok(driver.handle(&spec.id))
}

/// Pause: stop the vCPUs, snapshot (Diff onto `ram` when the VM was loaded from it and
/// took no snapshot since, else Full), end the process, put the snapshot in place.
pub(super) fn pause(vm: &VmHandle) -> Result<PauseReport, VmError> {
    let inner = &vm.inner;
    let dir = vm.dir();
    let _lock = lock_file(&dir.join("lock"))?;
    let (mut record, _pid) = vm.running_record("pause")?;
    let jail = inner.jail(&record);
    let mut api = FcApi::connect(&jail.api_socket())?;
    let kind = if record.fc.base.is_some() {
        SnapshotKind::Diff
    } else {
        SnapshotKind::Full
    };
    let t0 = Instant::now();
    api.pause()?;
    if let Err(e) = api.snapshot_create(kind, SNAP_STATE, SNAP_RAM) {
        remove_snapshot_files(&jail);
        // The VM is unharmed: let it run on.
        let _ = api.resume();
        return Err(e);
    }
    let snapshot = t0.elapsed();
    let ram_pending = dir.join(match kind {
        SnapshotKind::Full => "ram.new",
        SnapshotKind::Diff => "ram.diff",
    });
    let moved = take_out(&jail, SNAP_RAM, &ram_pending)
        .and_then(|ram| Ok((ram, take_out(&jail, SNAP_STATE, &dir.join("state.new"))?)));
    let (ram_bytes, state_bytes) = match moved {
        Ok(sizes) => sizes,
        Err(e) => {
            let _ = fs::remove_file(&ram_pending);
            let _ = fs::remove_file(dir.join("state.new"));
            remove_snapshot_files(&jail);
            let _ = api.resume();
            return Err(e);
        }
    };
    // The snapshot is complete: from here the VM is paused, whatever happens to this
    // process (a crash before it is gone leaves it for `recover` to end).
    record.state = VmState::Paused;
    record.fc.pending = Some(kind);
    inner.save(&record)?;
    let t1 = Instant::now();
    drop(api);
    inner.stop_firecracker(&dir, &record)?;
    let exit = t1.elapsed();
    record.pid = None;
    record.pid_start = None;
    inner.save(&record)?;
    let t2 = Instant::now();
    inner.finish_pause(&dir, &mut record)?;
    release_page_cache(&dir.join("ram"))?;
    Ok(PauseReport {
        snapshot,
        exit,
        release: t2.elapsed(),
        state_bytes,
        ram_bytes,
        incremental: kind == SnapshotKind::Diff,
    })
}

/// Resume: a new jailed Firecracker loads `state` with the memory file mapped
/// privately and runs on where the VM paused.
pub(super) fn resume(vm: &VmHandle) -> Result<ResumeReport, VmError> {
    let inner = &vm.inner;
    let dir = vm.dir();
    let _lock = lock_file(&dir.join("lock"))?;
    let mut record = inner.record(&vm.id)?;
    if record.state != VmState::Paused {
        return Err(vm.bad_state("running", "resume"));
    }
    inner.finish_pause(&dir, &mut record)?;
    let ram = inner.memory_file(&dir, &record);
    for needed in [dir.join("state"), ram.clone()] {
        if !needed.is_file() {
            return Err(VmError::Corrupt {
                path: needed,
                message: "a paused VM without its snapshot".into(),
            });
        }
    }
    // The VM's own snapshot files are its uid's (a restored snapshot arrives as root's).
    give(&dir.join("state"), record.uid, record.uid, 0o600)?;
    if record.ram == RamMode::Shared {
        give(&ram, record.uid, record.uid, 0o600)?;
    }
    let paused = record.clone();
    let t0 = Instant::now();
    let started = inner.start_firecracker(&dir, &mut record, Some(&ram));
    let spawn = t0.elapsed();
    let t1 = Instant::now();
    let loaded = started.and_then(|(_pid, mut api)| {
        api.snapshot_load(STATE, RAM, true, true)
            .map_err(|e| VmError::Firecracker {
                id: vm.id.clone(),
                message: format!(
                    "loading the snapshot {}: {e}; console: {}",
                    dir.join("state").display(),
                    console_tail(&dir, 800)
                ),
            })
    });
    if let Err(e) = loaded {
        // The VM stays paused, its snapshot untouched; nothing of the run is left.
        let _ = inner.stop_firecracker(&dir, &record);
        inner.save(&paused)?;
        return Err(e);
    }
    let restore = t1.elapsed();
    let _ = fs::remove_file(dir.join(DIFF_BASE));
    record.fc.base = Some(DiffBase::Loaded);
    inner.save(&record)?;
    Ok(ResumeReport { spawn, restore })
}

/// Stops the running VM while a snapshot is written into the jail (a Diff on its diff
/// base; Full when it has none) and `copy_disk` copies its writable disk, then lets it
/// run on whatever happened. Returns how long it was stopped, the bytes `copy_disk`
/// wrote, and what the snapshot's memory (at `SNAP_RAM` in the jail, its state at
/// `SNAP_STATE`) is a diff of: pass that to [`keep_whole_memory`]. Until then the
/// record knows no base, so a failure on the way leaves the next snapshot Full.
fn snapshot_running(
    inner: &Inner,
    record: &mut VmRecord,
    copy_disk: &dyn Fn() -> Result<u64, VmError>,
) -> Result<(Duration, u64, Option<DiffBase>), VmError> {
    let jail = inner.jail(record);
    let mut api = FcApi::connect(&jail.api_socket())?;
    // Any snapshot resets Firecracker's dirty bitmap: the old base is void from here.
    let base = record.fc.base.take();
    inner.save(record)?;
    let kind = if base.is_some() {
        SnapshotKind::Diff
    } else {
        SnapshotKind::Full
    };
    let t0 = Instant::now();
    api.pause()?;
    let taken = api
        .snapshot_create(kind, SNAP_STATE, SNAP_RAM)
        .and_then(|()| copy_disk());
    let resumed = api.resume();
    let paused = t0.elapsed();
    let bytes = taken.inspect_err(|_| remove_snapshot_files(&jail))?;
    resumed?;
    Ok((paused, bytes, base))
}

/// Takes the memory of [`snapshot_running`]'s snapshot out of the jail and makes it
/// whole at `dest` (while the VM runs on); the running process's next Diff is a diff
/// of that file, held by a hard link of its own in case the snapshot or fork goes
/// first. Returns the file's allocated bytes.
fn keep_whole_memory(
    inner: &Inner,
    dir: &Path,
    record: &mut VmRecord,
    taken: Option<DiffBase>,
    dest: &Path,
) -> Result<u64, VmError> {
    let jail = inner.jail(record);
    let snap = dest.with_extension("snap");
    take_out(&jail, SNAP_RAM, &snap)?;
    let made = inner.whole_memory(dir, record, taken, &snap, dest);
    let _ = fs::remove_file(&snap);
    made?;
    let link = dir.join(DIFF_BASE);
    let tmp = dir.join("diffbase.tmp");
    let _ = fs::remove_file(&tmp);
    if fs::hard_link(dest, &tmp).is_err() {
        sparse_copy(dest, &tmp)?;
    }
    fs::rename(&tmp, &link).map_err(io_err("keeping the next diff's base"))?;
    record.fc.base = Some(DiffBase::Linked);
    inner.save(record)?;
    Ok(allocated_bytes(dest))
}

pub(super) fn snapshot_to(vm: &VmHandle, dest: &Path) -> Result<SnapshotReport, VmError> {
    let inner = &vm.inner;
    let dir = vm.dir();
    let _lock = lock_file(&dir.join("lock"))?;
    let mut record = inner.record(&vm.id)?;
    create_snapshot_dir(dest)?;
    let taken = (|| match record.state {
        VmState::Running => {
            if inner.live_pid(&record).is_none() {
                return Err(vm.bad_state("exited", "snapshot"));
            }
            let copy_disk = || sparse_copy(&dir.join("rw.img"), &dest.join("rw.img"));
            let (paused, mut bytes, taken) = snapshot_running(inner, &mut record, &copy_disk)?;
            bytes += take_out(&inner.jail(&record), SNAP_STATE, &dest.join("state"))?;
            bytes += keep_whole_memory(inner, &dir, &mut record, taken, &dest.join("ram"))?;
            Ok((paused, bytes))
        }
        VmState::Paused => {
            inner.finish_pause(&dir, &mut record)?;
            let mut bytes =
                fs::copy(dir.join("state"), dest.join("state")).map_err(io_err("copying the VM's snapshot"))?;
            bytes += sparse_copy(&inner.memory_file(&dir, &record), &dest.join("ram"))?;
            bytes += sparse_copy(&dir.join("rw.img"), &dest.join("rw.img"))?;
            Ok((Duration::ZERO, bytes))
        }
    })();
    // Firecracker keeps RAM in its own memory file, never in the state stream.
    finish_snapshot(
        dest,
        &vm.id,
        &record,
        taken.map(|(paused, bytes)| (paused, bytes, false)),
    )
}

/// Fork with memory: the source stops while a Diff snapshot is written and its disk
/// copied, then runs on while the Diff is made whole; each copy is a new jailed Firecracker that loads the frozen
/// memory file privately, so the copies share every page none of them has written.
pub(super) fn fork(vm: &VmHandle, new_ids: &[String]) -> Result<ForkReport, VmError> {
    let started = Instant::now();
    let inner = &vm.inner;
    vm.check_fork_ids(new_ids)?;
    let dir = vm.dir();
    let lock = lock_file(&dir.join("lock"))?;
    let (mut source, _pid) = vm.running_record("fork")?;
    let fork_dir = vm.create_fork_dir()?;
    let base = fork_dir.join("ram");
    let mut prepared: Vec<(VmRecord, PathBuf)> = Vec::new();

    // The base's own group: the copies carry it, no other VM does.
    let gid = match inner.claim_base_gid(&fork_dir) {
        Ok(g) => g,
        Err(e) => {
            let _ = fs::remove_dir_all(&fork_dir);
            return Err(e);
        }
    };
    let discard_all = |prepared: &[(VmRecord, PathBuf)]| {
        for (record, copy_dir) in prepared {
            inner.discard_firecracker(copy_dir, Some(record), &record.netns, Some(record.uid));
        }
        let _ = fs::remove_dir_all(&fork_dir);
        inner.release_uid(gid);
    };
    for id in new_ids {
        match inner.prepare_copy(&source, id, &base, gid) {
            Ok(ready) => prepared.push(ready),
            Err(e) => {
                discard_all(&prepared);
                return Err(e);
            }
        }
    }
    let frozen = (|| {
        let copy_disk = || sparse_copy(&dir.join("rw.img"), &fork_dir.join("rw.img"));
        let (paused, _, taken) = snapshot_running(inner, &mut source, &copy_disk)?;
        take_out(&inner.jail(&source), SNAP_STATE, &fork_dir.join("state"))?;
        let ram_bytes = keep_whole_memory(inner, &dir, &mut source, taken, &base)?;
        // Copies map the base read-only with its group; nobody else may.
        give(&base, 0, gid, 0o440)?;
        Ok::<_, VmError>((paused, ram_bytes))
    })();
    drop(lock);
    let (source_paused, ram_bytes) = match frozen {
        Ok(v) => v,
        Err(e) => {
            discard_all(&prepared);
            return Err(e);
        }
    };
    let mut failure = None;
    for (record, copy_dir) in &prepared {
        let step = (|| {
            sparse_copy(&fork_dir.join("rw.img"), &copy_dir.join("rw.img"))?;
            give(&copy_dir.join("rw.img"), record.uid, record.uid, 0o600)?;
            fs::copy(fork_dir.join("state"), copy_dir.join("state")).map_err(io_err("copying the snapshot"))?;
            give(&copy_dir.join("state"), record.uid, record.uid, 0o600)?;
            write_json_atomic(&copy_dir.join("vm.json"), record)?;
            VmHandle {
                inner: vm.inner.clone(),
                id: record.id.clone(),
            }
            .resume()
        })();
        if let Err(e) = step {
            failure = Some(e);
            break;
        }
    }
    if let Some(e) = failure {
        // Each copy's record now says where its process is, if it has one.
        let current: Vec<(VmRecord, PathBuf)> = prepared
            .iter()
            .map(|(r, d)| (inner.record(&r.id).unwrap_or_else(|_| r.clone()), d.clone()))
            .collect();
        discard_all(&current);
        return Err(e);
    }
    let _ = fs::remove_file(fork_dir.join("rw.img"));
    let _ = fs::remove_file(fork_dir.join("state"));
    let copies = prepared
        .into_iter()
        .map(|(record, _)| VmHandle {
            inner: vm.inner.clone(),
            id: record.id,
        })
        .collect();
    Ok(ForkReport {
        copies,
        source_paused,
        total: started.elapsed(),
        ram_bytes,
        // The source is paused for the whole copy: nothing is written meanwhile.
        disk_dirty_bytes: 0,
    })
}

/// See [`VmHandle::recover`]: a process of a finished pause is ended and the pause
/// completed; a process left paused continues; one that never finished loading or
/// booting is ended.
pub(super) fn recover(vm: &VmHandle) -> Result<Option<String>, VmError> {
    let inner = &vm.inner;
    let dir = vm.dir();
    let _lock = lock_file(&dir.join("lock"))?;
    let mut record = inner.record(&vm.id)?;
    let live = inner.live_pid(&record);
    match (record.state, live) {
        (VmState::Paused, live) => {
            let pending = record.fc.pending.is_some();
            inner.stop_firecracker(&dir, &record)?;
            record.pid = None;
            record.pid_start = None;
            inner.save(&record)?;
            inner.finish_pause(&dir, &mut record)?;
            Ok(match (live.is_some(), pending) {
                (true, _) => Some("ended the Firecracker of a finished snapshot".into()),
                (false, true) => Some("completed an interrupted pause".into()),
                (false, false) => None,
            })
        }
        (VmState::Running, None) => {
            // It ended on its own (status says so); its jail goes.
            inner.jail(&record).cleanup()?;
            Ok(None)
        }
        (VmState::Running, Some(_)) => {
            let mut api = FcApi::connect(&inner.jail(&record).api_socket())?;
            match api.state()? {
                InstanceState::Running => Ok(None),
                InstanceState::Paused => {
                    api.resume()?;
                    Ok(Some("continued a VM left paused".into()))
                }
                InstanceState::NotStarted => {
                    drop(api);
                    inner.stop_firecracker(&dir, &record)?;
                    if dir.join("state").is_file() {
                        record.state = VmState::Paused;
                        record.pid = None;
                        record.pid_start = None;
                        inner.save(&record)?;
                        Ok(Some("ended an unfinished restore; the VM is paused".into()))
                    } else {
                        Ok(Some("ended an unfinished boot".into()))
                    }
                }
            }
        }
    }
}

/// Drops what a stored Firecracker VM kept of its memory: a pause's snapshot, finished
/// or not (`state` goes with the QEMU one's, in [`VmHandle::store`]).
pub(super) fn forget_memory(dir: &Path) {
    for file in ["state.new", "ram", "ram.new", "ram.diff", DIFF_BASE] {
        let _ = fs::remove_file(dir.join(file));
    }
}

/// Boots a stored VM under Firecracker, its guest configuration written anew by
/// [`VmHandle::boot_again`]: a new jailed process on its disks, as [`create`] boots one.
/// On failure nothing of the run is left and `stored` (its record before) is saved back.
pub(super) fn boot_stored(vm: &VmHandle, dir: &Path, record: &mut VmRecord, stored: &VmRecord) -> Result<(), VmError> {
    let inner = &vm.inner;
    // Dirty pages are tracked from boot, as after a create.
    record.fc.base = Some(DiffBase::Zero);
    let booted = inner.start_firecracker(dir, record, None).and_then(|(_pid, mut api)| {
        configure_and_start(&mut api, record).map_err(|e| VmError::Firecracker {
            id: record.id.clone(),
            message: format!("booting again: {e}; console: {}", console_tail(dir, 1500)),
        })
    });
    if let Err(e) = booted {
        let _ = inner.stop_firecracker(dir, record);
        inner.save(stored)?;
        return Err(e);
    }
    Ok(())
}

/// Ends the process at once and removes its jail; the VM stays on disk.
pub(super) fn kill(vm: &VmHandle) -> Result<(), VmError> {
    let record = vm.inner.record(&vm.id)?;
    vm.inner.stop_firecracker(&vm.dir(), &record)
}
