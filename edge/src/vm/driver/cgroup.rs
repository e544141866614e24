//! Each VMM process (QEMU, or the jailer that becomes Firecracker) runs in a cgroup of its
//! own, `<parent>/<vm id>` with `<parent>` = `odvm-<hash of the driver's root>` (the
//! Firecracker jail's parent too), holding a CPU quota, a memory limit and an IO weight.
//! The writing is `crate::cgroups`' (shared with the container backend).
//!
//! **Hierarchy.** Each controller where the host has it (`crate::cgroups`): a pure v2
//! host gives one directory, `/sys/fs/cgroup/<parent>/<id>`, controllers enabled on the
//! way down; a v1 host one directory per hierarchy (`cpu`, `cpuacct`, `memory`, `blkio`).
//! On this project's hybrid machines (v1 controllers, a cgroup2 mount at
//! `/sys/fs/cgroup/unified` holding only hugetlb) the quota goes into the v1 `cpu`
//! hierarchy and the limit into v1 `memory`: the cgroup2 mount holds neither. A host
//! without a cpu or memory controller refuses to start the driver (fail closed).
//!
//! **Joining.** The VM shim opens each directory's `cgroup.procs` and the VMM's child
//! writes `0` to each after `fork`, before it drops to the VM's uid and execs: QEMU's
//! whole life, boot included, is inside. Under Firecracker the jailer is the process that
//! joins; on v1 it then also joins its own cpuset cgroup (another hierarchy), on v2 its
//! cgroup is this very directory.
//!
//! **CPU and boot.** Steady state: quota = `cpu_millis` per 100 ms period (the
//! containers' period), at least 1 ms; a VM with no `cpu_millis` ([`VmSpec::cpu_millis`]
//! `None`) has no quota. Under TCG a guest held to a tenth of a core would boot ten times
//! slower (~2.2 s at a full core), so work the platform does for the VM runs *boosted*, at
//! up to its vCPUs plus one core (QEMU's own threads: IO, migration): a cold boot until
//! the guest's agent first answers ([`VmHandle::wait_agent`], which every creator calls),
//! a restore (resume, fork copy, start from a snapshot) until it has loaded, and a pause,
//! snapshot or fork of a running VM while its state is copied. Each of those ends by
//! setting the steady quota again, and so does [`VmHandle::recover`], which a restarted
//! edge calls for every VM (an edge that died mid-boot leaves no VM boosted). A guest can
//! only gain boosted time by asking for those operations; at steady state it is held to
//! `cpu_millis` (`edge/tests/vm_microvm.rs` measures a busy guest at 100 millicores).
//!
//! **Memory.** limit = guest RAM + [`vmm_overhead_mb`], with no swap beyond it where the
//! host accounts swap. The guest's RAM must be inside the limit, not beside it: it is a
//! file (`memory-backend-file`, `share=on`, or a fork's base mapped privately), and its
//! pages are charged to the cgroup of the process that first touches them (page cache
//! while shared; anonymous once a private mapping writes them; shmem if the driver's root
//! were on tmpfs). On a disk file system the shared pages are reclaimable (the kernel
//! writes them back into the file under pressure, so a tight limit slows a guest rather
//! than killing it), private copies' written pages are not. QEMU's disks go through the
//! host page cache too (reclaimable). What is not reclaimable is the rest of QEMU: the
//! TCG translation cache (`tb-size=64`), heap, device and migration buffers, page
//! tables; and what QEMU keeps mapped from files and should keep resident (its binary
//! and libraries, a microVM's kernel and initrd). Pages of a fork's frozen base stay
//! charged to whoever first read them (a receiver, a first copy): a copy is charged only
//! for what it writes.
//!
//! Measured here (QEMU 7.2, TCG, Debian's 6.1 kernel, 256 MiB guest, `base` image;
//! `/proc/<pid>/smaps` and the cgroup's `memory.stat`): a microVM just booted holds 84 MiB
//! of anonymous memory (60 of them translation cache), 57 MiB of its mapped vmlinux and
//! 9 MiB of initrd (clean page cache), ~20 MiB of QEMU's binary and libraries; after a
//! workload (python, 200 MiB written to its disk, 150 MiB into tmpfs, every file of
//! `/usr/bin` read) 90 MiB anonymous, the translation cache full at 64 MiB. A full VM
//! (q35) after the same workload: 94 MiB anonymous, no kernel mapping (its guest reads its
//! kernel off its disk). A fork copy that wrote 150 MiB: 153 MiB anonymous (111 of guest
//! pages it wrote, 26 of translation cache). Hence the bound, for TCG: 192 MiB beside the
//! guest's RAM (~100 MiB for the anonymous part, ~90 for the file-backed working set) plus
//! 1/64 of the RAM (page tables, dirty bitmaps); 128 MiB under KVM (no translation cache);
//! 64 MiB under Firecracker (a few MiB beside its guest's memory, not measured with a
//! running guest: none reaches user space on these PVM hosts). A 256 MiB microVM gets 452
//! MiB. The price, measured: a guest writing its disk hard fills the cgroup with QEMU's
//! page cache and runs at its limit: 400 MiB written with fsync ran at 45 MB/s, 81 MB/s
//! with the limit lifted, and the least recently used guest RAM pages were written back
//! to the RAM file to make room (resident guest RAM 220 -> 146 MiB): reclaim, not OOM.
//! (Opening the writable disk with `cache=none` would keep QEMU's disk IO out of the page
//! cache; not done here.)
//!
//! **OOM.** A VMM over its limit is killed by the kernel's OOM killer (the guest cannot
//! be asked to shrink). Its shim records a SIGKILL; the cgroup, kept until the VM is
//! deleted, counts the kill, so [`VmHandle::oom_killed`] tells an OOM from any other end
//! and the edge reports the sandbox ended as OOM (`microvms.rs`), not just failed.
//!
//! **IO.** Weight 100 (the containers' default) where the host has a weight file (v1
//! `blkio.bfq.weight`/`blkio.weight`, v2 `io.weight`/`io.bfq.weight`); it acts only on
//! devices whose scheduler honours weights (BFQ, or v2's io.cost). On the development
//! machines BFQ is loaded, so the weight is written, but their disks run `mq-deadline` or
//! `none`: it is inert there.
//!
//! **Lifecycle.** The path comes from the VM's id, never from memory, so a restarted
//! edge finds the same cgroup and never makes a second one. Each run of a VMM makes it
//! afresh (counters of an earlier run go, unless a process is still inside); a pause
//! removes it with the process (a paused VM has no process and no cgroup), `delete` and
//! any discarded half-made VM remove it, and a VM whose VMM ended on its own keeps it
//! (its OOM count) until deleted. Fork copies and VMs restored from a snapshot are VMs
//! of their own with cgroups of their own (a copy keeps its source's `cpu_millis`,
//! [`VmHandle::set_cpu_millis`] changes it); a live copy's receiver QEMU runs in
//! `<parent>/<source id>.r` (ids hold no '.'), boosted, with the same memory limit: it
//! holds a whole copy of the RAM, which the source's limit has no room for. The driver
//! removes cgroups whose VM or receiver is gone when it starts.

use super::*;
use crate::cgroups::{Cgroup, Controller, Layout};

/// What a VMM's cgroup holds.
const CONTROLLERS: [Controller; 4] = [Controller::Cpu, Controller::CpuAcct, Controller::Memory, Controller::Io];
/// The containers' CFS period.
const CPU_PERIOD_US: u64 = crate::container::oci::CPU_PERIOD_US;
/// The smallest quota the kernel takes.
const MIN_QUOTA_US: u64 = 1000;
/// The containers' default IO weight.
const IO_WEIGHT: u16 = 100;

/// A VMM's memory beside the guest's RAM, MiB: the fixed part for QEMU under TCG (its
/// translation cache is bounded at 64 MiB) and KVM, and for Firecracker.
const QEMU_TCG_OVERHEAD_MB: u64 = 192;
const QEMU_KVM_OVERHEAD_MB: u64 = 128;
const FIRECRACKER_OVERHEAD_MB: u64 = 64;

/// How much memory a VMM may use beyond its guest's RAM, in MiB: a fixed part per VMM
/// and accelerator, plus 1/64 of the guest's RAM (page tables and dirty bitmaps grow with
/// it). The figures it rests on are in the module doc of `vm/driver/cgroup.rs`.
pub fn vmm_overhead_mb(memory_mb: u64, vmm: Vmm, accel: Accel) -> u64 {
    let fixed = match (vmm, accel) {
        (Vmm::Firecracker, _) => FIRECRACKER_OVERHEAD_MB,
        (Vmm::Qemu, Accel::Tcg) => QEMU_TCG_OVERHEAD_MB,
        (Vmm::Qemu, Accel::Kvm) => QEMU_KVM_OVERHEAD_MB,
    };
    fixed + memory_mb.div_ceil(64)
}

/// The memory limit of the cgroup of a VMM whose guest has `memory_mb`, in bytes.
pub fn vmm_memory_limit(memory_mb: u64, vmm: Vmm, accel: Accel) -> u64 {
    (memory_mb + vmm_overhead_mb(memory_mb, vmm, accel)) << 20
}

/// Whether a VMM runs held to its `cpu_millis` or boosted (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum CpuPhase {
    Boosted,
    Steady,
}

/// The CPU quota of `record`'s VMM in `phase`, µs per period (`None`: no quota).
fn cpu_quota_us(record: &VmRecord, phase: CpuPhase) -> Option<u64> {
    let millis = u64::from(record.cpu_millis?);
    Some(match phase {
        CpuPhase::Steady => (millis * CPU_PERIOD_US / 1000).max(MIN_QUOTA_US),
        CpuPhase::Boosted => (u64::from(record.vcpus) + 1) * CPU_PERIOD_US,
    })
}

/// The host's cgroup layout, or why VMs cannot be held to their limits here.
pub(super) fn host_layout() -> Result<Layout, VmError> {
    let layout = Layout::host();
    let lacks = Cgroup::lacks(&layout, &[Controller::Cpu, Controller::Memory]);
    if !lacks.is_empty() {
        return Err(VmError::Prerequisite(format!(
            "each VM's VMM runs in a cgroup with a CPU quota and a memory limit, but this host has no {:?} \
             cgroup controller in /proc/self/mounts",
            lacks
        )));
    }
    Ok(layout)
}

fn cgroup_err(cgroup: &Cgroup) -> impl FnOnce(std::io::Error) -> VmError + '_ {
    move |e| VmError::io(format!("the cgroup {}", cgroup.path()), e)
}

impl Inner {
    /// `odvm-<hash of the root>`: the parent of this driver's VM cgroups (and jails).
    pub(super) fn cgroup_parent(&self) -> String {
        self.netns_prefix.trim_end_matches('-').to_string()
    }

    /// The cgroup of VM `id`'s VMM.
    pub(super) fn vm_cgroup(&self, id: &str) -> Cgroup {
        Cgroup::new(&self.cgroups, &format!("{}/{id}", self.cgroup_parent()), &CONTROLLERS)
    }

    /// The cgroup of the receiver of a live copy of VM `id`.
    pub(super) fn receiver_cgroup(&self, id: &str) -> Cgroup {
        Cgroup::new(&self.cgroups, &format!("{}/{id}.r", self.cgroup_parent()), &CONTROLLERS)
    }

    /// The cgroup of whatever runs from `dir` (a VM's directory or a receiver's).
    pub(super) fn cgroup_of_dir(&self, dir: &Path) -> Option<Cgroup> {
        let name = dir.file_name()?.to_str()?;
        let parent = dir.parent()?;
        if parent == self.cfg.root.join("vms") {
            Some(self.vm_cgroup(name))
        } else if parent == self.cfg.root.join("receivers") {
            Some(self.receiver_cgroup(name))
        } else {
            None
        }
    }

    /// Makes `cgroup` for a new run of `record`'s VMM, boosted (see the module doc), and
    /// returns the directories the VMM joins.
    pub(super) fn prepare_cgroup(&self, cgroup: &Cgroup, record: &VmRecord) -> Result<Vec<PathBuf>, VmError> {
        // An earlier run's counters go with its cgroup; one still holding a process stays.
        if cgroup.exists() && cgroup.procs().is_empty() {
            let _ = cgroup.remove();
        }
        cgroup.create().map_err(cgroup_err(cgroup))?;
        let limit = vmm_memory_limit(record.memory_mb, record.vmm, record.accel);
        cgroup.set_memory_limit(limit, true).map_err(cgroup_err(cgroup))?;
        cgroup.set_io_weight(IO_WEIGHT).map_err(cgroup_err(cgroup))?;
        cgroup
            .set_cpu_quota(cpu_quota_us(record, CpuPhase::Boosted), CPU_PERIOD_US)
            .map_err(cgroup_err(cgroup))?;
        Ok(cgroup.dirs())
    }

    /// Sets the CPU quota of `record`'s VMM for `phase`; nothing when no VMM runs (a
    /// paused VM has no cgroup).
    pub(super) fn set_cpu_phase(&self, record: &VmRecord, phase: CpuPhase) -> Result<(), VmError> {
        let cgroup = self.vm_cgroup(&record.id);
        if record.state != VmState::Running || !cgroup.exists() {
            return Ok(());
        }
        cgroup
            .set_cpu_quota(cpu_quota_us(record, phase), CPU_PERIOD_US)
            .map_err(cgroup_err(&cgroup))
    }

    /// Removes the cgroup of VM `id` (its VMM has ended).
    pub(super) fn remove_vm_cgroup(&self, id: &str) -> Result<(), VmError> {
        let cgroup = self.vm_cgroup(id);
        cgroup.remove().map_err(cgroup_err(&cgroup))
    }

    /// Removes the empty cgroups of VMs and receivers that are gone (a crash between
    /// removing a VM's directory and its cgroup, say).
    pub(super) fn gc_cgroups(&self) {
        let parent = Cgroup::new(&self.cgroups, &self.cgroup_parent(), &CONTROLLERS);
        for name in parent.children() {
            let owner = match name.strip_suffix(".r") {
                Some(id) => self.cfg.root.join("receivers").join(id),
                None => self.vm_dir(&name),
            };
            let child = parent.child(&name);
            if !owner.exists() && child.procs().is_empty() {
                let _ = child.remove();
            }
        }
    }
}

/// Holds a running VM boosted while it lives (a pause, snapshot or fork under way), and
/// sets its steady quota again when dropped, whatever happened.
pub(super) struct CpuBoost<'a> {
    vm: &'a VmHandle,
}

impl Drop for CpuBoost<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.vm.settle_cpu() {
            tracing::warn!(vm = %self.vm.id, error = %e, "cannot set a VM's CPU quota back after an operation");
        }
    }
}

impl VmHandle {
    /// The cgroup of the VM's VMM: it exists while a VMM runs, and after one ended on its
    /// own until the VM is deleted.
    pub fn cgroup(&self) -> Cgroup {
        self.inner.vm_cgroup(&self.id)
    }

    /// The memory limit the VM's VMM runs under: its guest's RAM plus
    /// [`vmm_overhead_mb`].
    pub fn memory_limit(&self) -> Result<u64, VmError> {
        let record = self.inner.record(&self.id)?;
        Ok(vmm_memory_limit(record.memory_mb, record.vmm, record.accel))
    }

    /// The CPU the VM is held to at steady state, in thousandths of a core (`None`: its
    /// vCPUs alone bound it).
    pub fn cpu_millis(&self) -> Result<Option<u32>, VmError> {
        Ok(self.inner.record(&self.id)?.cpu_millis)
    }

    /// Holds the VM to `millis` from now on (this run and every later one).
    pub fn set_cpu_millis(&self, millis: Option<u32>) -> Result<(), VmError> {
        if millis == Some(0) {
            return Err(VmError::Invalid("cpu_millis must be above 0".into()));
        }
        let _lock = lock_file(&self.dir().join("lock"))?;
        let mut record = self.inner.record(&self.id)?;
        record.cpu_millis = millis;
        self.inner.save(&record)?;
        self.inner.set_cpu_phase(&record, CpuPhase::Steady)
    }

    /// Whether the VM's VMM was ended by the kernel's OOM killer (it went over its memory
    /// limit): its process is gone and its cgroup counted a kill (the VMM is the only
    /// process in it).
    pub fn oom_killed(&self) -> bool {
        matches!(self.status(), Ok(VmStatus::Exited(_))) && self.cgroup().oom_kills().unwrap_or(0) > 0
    }

    /// Sets the VM's steady CPU quota (the end of a boost).
    pub(super) fn settle_cpu(&self) -> Result<(), VmError> {
        let record = self.inner.record(&self.id)?;
        self.inner.set_cpu_phase(&record, CpuPhase::Steady)
    }

    /// Boosts the running VM until the guard is dropped.
    pub(super) fn boost_cpu(&self) -> Result<CpuBoost<'_>, VmError> {
        let record = self.inner.record(&self.id)?;
        self.inner.set_cpu_phase(&record, CpuPhase::Boosted)?;
        Ok(CpuBoost { vm: self })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(cpu_millis: Option<u32>, vcpus: u32) -> VmRecord {
        let json = serde_json::json!({
            "id": "vm", "image": "base", "layers": [], "memory_mb": 256, "vcpus": vcpus,
            "disk_mb": 512, "uid": 1, "groups": [], "netns": "n", "vmlinux": "/k",
            "root_disk": "/r", "accel": "tcg", "tsc_khz": null, "ram": {"mode": "shared"},
            "state": "running", "pid": null, "pid_start": null, "forked_from": null,
            "cpu_millis": cpu_millis,
        });
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn a_vm_is_held_to_its_millicores_at_steady_state_and_to_its_vcpus_plus_one_while_boosted() {
        let r = record(Some(100), 1);
        assert_eq!(cpu_quota_us(&r, CpuPhase::Steady), Some(10_000));
        assert_eq!(cpu_quota_us(&r, CpuPhase::Boosted), Some(200_000));
        assert_eq!(cpu_quota_us(&record(Some(2500), 3), CpuPhase::Steady), Some(250_000));
        assert_eq!(cpu_quota_us(&record(Some(1), 1), CpuPhase::Steady), Some(MIN_QUOTA_US));
        assert_eq!(cpu_quota_us(&record(None, 2), CpuPhase::Steady), None);
        assert_eq!(cpu_quota_us(&record(None, 2), CpuPhase::Boosted), None);
    }

    #[test]
    fn records_written_before_cgroups_have_no_cpu_quota() {
        let mut json = serde_json::to_value(record(Some(5), 1)).unwrap();
        json.as_object_mut().unwrap().remove("cpu_millis");
        let old: VmRecord = serde_json::from_value(json).unwrap();
        assert_eq!(old.cpu_millis, None);
    }

    #[test]
    fn the_memory_limit_is_the_guest_ram_plus_the_vmm_overhead() {
        let limit = vmm_memory_limit(256, Vmm::Qemu, Accel::Tcg);
        assert_eq!(limit, (256 + QEMU_TCG_OVERHEAD_MB + 4) << 20);
        assert!(vmm_memory_limit(8192, Vmm::Qemu, Accel::Kvm) >= (8192 + 128 + 128) << 20);
    }
}
