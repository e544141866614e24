//! The edge's microVM sandboxes: what the edge loop (`node/`) does with the QEMU driver
//! (`vm/`) for a sandbox whose isolation is `microvm`, or `vm` (a full VM: the driver's
//! `q35` machine; everything after the create is the same for both). The driver knows VMs; this layer
//! knows sandboxes: their agent tokens, where their snapshots live, how a VM's state reads
//! as an observation, and how a restored guest gets the token of the sandbox it now is.
//!
//! Every call blocks (QMP, file copies, a guest booting): the edge runs them beside its
//! loop. Nothing here lives only in memory: the driver's directories are the truth, so a
//! restarted edge opens the same VMs.
//!
//! - Stop: a running VM's QEMU is killed; a paused VM, having no process, is removed.
//!   Observation: a QEMU that ended is `Running::Failed` with why (its exit and the
//!   console's last word: the agent is the guest's PID 1, so its death panics the guest and
//!   ends QEMU); one the host's OOM killer ended at its cgroup's memory limit (guest RAM +
//!   VMM overhead, `vm/driver/cgroup.rs`) is `Running::Exited` OOM-killed.
//! - Limits: each VM's VMM runs in a cgroup of its own, held to the sandbox's
//!   `cpu_millis` once its guest answers (boosted before, see `vm/driver/cgroup.rs`), with
//!   its memory limit and IO weight; its vCPUs are `ceil(cpu_millis / 1000)`.
//! - Tokens: a guest restored from another's memory (fork copy, sandbox from a snapshot)
//!   holds its source's agent token; the edge re-keys it (`/.opendsec/rekey`, proving the
//!   source's token) before it is reported ready, and checks again before every ready
//!   report of such a VM, so an edge that died in between finishes the job. Each re-key
//!   carries 64 bytes from the host's generator that the guest mixes into its kernel's
//!   pool and reseeds from, so copies never share random numbers (their source's, or
//!   each other's); a guest that cannot be reseeded is not reported ready.
//! - A full VM (`isolation: vm`) is created with the driver's `q35` machine; every later
//!   step (pause, resume, snapshot, fork, stop, re-key, observation) is the microVM's,
//!   since the machine is in the VM's record. Edges with microVMs register with
//!   `opendsec.io/microvm=qemu` (`opendsec edge|up --microvm auto|on|off`), and also
//!   `opendsec.io/fullvm=q35` where the boot disk tools are installed
//!   (`host_can_build_boot_disks`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use opendsec_edge_api::{SandboxTokenKind, sandbox_token};

use crate::desired::DesiredSandbox;
use crate::images::{Image, ImageStore};
use crate::proxy::Sample;
use crate::reconcile::Running;
use crate::vm::{AccelVerdict, Machine, MicroVmDriver, VmConfig, VmError, VmHandle, VmSpec, VmStatus};
use opendsec_projections::Isolation;

/// How long a guest may take from QEMU's start until its agent answers `/health` 2xx
/// (under TCG a cold boot takes seconds; a template's start command may take longer).
const AGENT_READY_TIMEOUT: Duration = Duration::from_secs(180);
/// How long one request to re-key a guest's agent may take.
const REKEY_TIMEOUT: Duration = Duration::from_secs(10);

/// Where the edge keeps its microVMs and what it gives them.
#[derive(Clone, Debug)]
pub struct MicroVmsConfig {
    /// The driver's state (`<edge data>/vms`).
    pub root: PathBuf,
    pub images: ImageStore,
    /// The static agent, which the guest's initramfs carries.
    pub agent_binary: PathBuf,
    /// `opendsec-vm-shim`.
    pub shim: PathBuf,
    /// The key sandbox tokens derive from (the cluster key).
    pub edge_key: String,
    /// Each VM's writable disk, in MiB.
    pub disk_mb: u64,
}

/// The edge's microVMs.
pub struct MicroVms {
    driver: MicroVmDriver,
    edge_key: String,
    disk_mb: u64,
}

/// The snapshot a microVM is restored from: its files and the sandbox it was taken of
/// (whose token the restored guest still holds).
pub struct FromSnapshot<'a> {
    pub dir: &'a Path,
    /// The agent token its sandbox held (see `Edge::source_agent_token`): the restored
    /// guest's agent takes it until re-keyed.
    pub source_token: &'a str,
}

impl MicroVms {
    /// Prepares the driver (the guest kernel and initramfs are built once per machine, the
    /// accelerator verdict probed once per host boot and kept in the image store) and
    /// brings every VM left by an earlier run of the edge back to a known state.
    pub fn open(cfg: MicroVmsConfig) -> Result<MicroVms, VmError> {
        let mut vm = VmConfig::new(
            &cfg.root,
            cfg.images.clone(),
            cfg.agent_binary.clone(),
            cfg.shim.clone(),
        );
        vm.accel_cache = Some(cfg.images.root().join("accel.json"));
        let driver = MicroVmDriver::new(vm, &|m| tracing::info!(microvm = %m, "preparing microVMs"))?;
        for handle in driver.list()? {
            match handle.recover() {
                Ok(Some(what)) => tracing::info!(sandbox = %handle.id(), %what, "recovered a microVM"),
                Ok(None) => {}
                Err(e) => tracing::warn!(sandbox = %handle.id(), error = %e, "cannot recover a microVM"),
            }
        }
        Ok(MicroVms {
            driver,
            edge_key: cfg.edge_key,
            disk_mb: cfg.disk_mb,
        })
    }

    /// KVM or TCG, and why.
    pub fn accel(&self) -> &AccelVerdict {
        self.driver.accel()
    }

    /// QEMU or Firecracker for new microVMs, and why.
    pub fn vmm(&self) -> &crate::vm::VmmVerdict {
        self.driver.vmm()
    }

    fn token(&self, sandbox: &str) -> String {
        sandbox_token(&self.edge_key, SandboxTokenKind::Agent, sandbox)
    }

    fn spec(&self, d: &DesiredSandbox, image: &Image) -> VmSpec {
        VmSpec {
            id: d.id.clone(),
            image: image.clone(),
            memory_mb: d.memory_mb,
            vcpus: d.cpu_millis.div_ceil(1000).clamp(1, 64) as u32,
            disk_mb: self.disk_mb,
            env: image.env_with(&d.env),
            access_token: self.token(&d.id),
            cpu_millis: vm_cpu_millis(d),
        }
    }

    fn handle(&self, id: &str) -> Result<VmHandle, VmError> {
        self.driver.open(id)
    }

    /// How VM `id` runs: its VMM (`qemu`, `firecracker`) and accelerator (`kvm`, `tcg`).
    pub fn runtime(&self, id: &str) -> Result<(String, String), VmError> {
        runtime_of(&self.handle(id)?)
    }

    /// Whether a VM of this id exists here (in any state).
    pub fn has(&self, id: &str) -> bool {
        self.driver.open(id).is_ok()
    }

    /// Every VM on this machine, as the reconciler sees it.
    pub fn observe(&self) -> Result<BTreeMap<String, Running>, VmError> {
        let mut out = BTreeMap::new();
        for vm in self.driver.list()? {
            let seen = match vm.status() {
                Ok(VmStatus::Running { .. }) => Running::Running,
                Ok(VmStatus::Paused) => Running::Paused {
                    memory: !vm.is_stored(),
                },
                // Its VMM went over its cgroup's memory limit: the sandbox ends as OOM.
                Ok(VmStatus::Exited(_)) if vm.oom_killed() => {
                    tracing::warn!(
                        sandbox = %vm.id(),
                        limit_mib = vm.memory_limit().unwrap_or(0) >> 20,
                        "the host's OOM killer ended a microVM's VMM at its memory limit (guest RAM + VMM overhead)"
                    );
                    Running::Exited {
                        exit_code: 128 + libc::SIGKILL,
                        oom_killed: true,
                    }
                }
                Ok(VmStatus::Exited(info)) => Running::Failed {
                    reason: end_reason(&vm, info.as_ref()),
                },
                Err(e) => {
                    tracing::warn!(sandbox = %vm.id(), error = %e, "cannot read a microVM's state");
                    continue;
                }
            };
            out.insert(vm.id().to_string(), seen);
        }
        Ok(out)
    }

    /// Cold-boots the sandbox's VM, or restores it from a snapshot, and returns once its
    /// agent answers with the sandbox's own token.
    pub fn create(&self, d: &DesiredSandbox, image: &Image, from: Option<FromSnapshot<'_>>) -> Result<(), VmError> {
        let spec = self.spec(d, image);
        let progress = |m: &str| tracing::info!(sandbox = %d.id, step = %m, "creating a microVM");
        // A full VM is a q35 PC booting the image's disk; a restore takes its snapshot's machine.
        let machine = if d.isolation == Isolation::Vm {
            Machine::Q35
        } else {
            Machine::Microvm
        };
        let (vm, source) = match from {
            None => (self.driver.create_machine(&spec, machine, &progress)?, None),
            Some(snap) => (
                self.driver.restore_snapshot(&spec, snap.dir, &progress)?.0,
                Some(snap.source_token),
            ),
        };
        let ready = vm
            .wait_agent(AGENT_READY_TIMEOUT)
            .and_then(|_| self.ensure_token(&d.id, || Ok(source.map(str::to_string))));
        if let Err(e) = ready {
            // A guest that never answered is of no use: leave nothing behind.
            let _ = vm.delete();
            return Err(e);
        }
        Ok(())
    }

    /// Makes `copies` of VM `source` with its memory. A running source forks (it stops
    /// only while its state is captured; the copies share its frozen RAM copy-on-write);
    /// a paused one is copied from a snapshot of it. Each copy then gets its own token.
    /// `image` is the copies' (their source's) image; `scratch` is a directory name this
    /// call may use (and removes). Returns how long the source stopped. On failure no
    /// copy is left.
    pub fn fork(
        &self,
        source: &str,
        copies: &[&DesiredSandbox],
        image: &Image,
        scratch: &Path,
    ) -> Result<Duration, VmError> {
        let ids: Vec<String> = copies.iter().map(|c| c.id.clone()).collect();
        let made = self
            .make_copies(source, copies, &ids, image, scratch)
            .and_then(|paused| {
                for copy in copies {
                    let vm = self.handle(&copy.id)?;
                    vm.wait_agent(AGENT_READY_TIMEOUT)?;
                    self.ensure_token(&copy.id, || Ok(Some(self.token(source))))?;
                    // A running source's copies start with its quota; each has its own.
                    vm.set_cpu_millis(vm_cpu_millis(copy))?;
                }
                Ok(paused)
            });
        if made.is_err() {
            for id in &ids {
                let _ = self.remove(id);
            }
        }
        made
    }

    fn make_copies(
        &self,
        source: &str,
        copies: &[&DesiredSandbox],
        ids: &[String],
        image: &Image,
        scratch: &Path,
    ) -> Result<Duration, VmError> {
        let src = self.handle(source)?;
        match src.status()? {
            VmStatus::Running { .. } => Ok(src.fork(ids)?.source_paused),
            VmStatus::Paused => {
                let _ = std::fs::remove_dir_all(scratch);
                src.snapshot_to(scratch)?;
                let restored = copies.iter().try_for_each(|copy| {
                    self.driver
                        .restore_snapshot(&self.spec(copy, image), scratch, &|_| {})
                        .map(|_| ())
                });
                let _ = std::fs::remove_dir_all(scratch);
                restored.map(|()| Duration::ZERO)
            }
            VmStatus::Exited(_) => Err(VmError::BadState {
                id: source.into(),
                state: "exited".into(),
                operation: "fork",
            }),
        }
    }

    /// Makes sure the guest's agent takes this sandbox's own token, and reseeds the guest
    /// kernel's random number generator from the host's. A guest restored from another's
    /// memory holds that one's token (`source_token`): it is re-keyed with it. Asking
    /// with the right token already changes nothing, so this is safe to repeat (after an
    /// edge restart that came between a restore and its re-key, say).
    /// `source_token` is asked for only when the agent refuses its own token.
    pub fn ensure_token(
        &self,
        id: &str,
        source_token: impl FnOnce() -> Result<Option<String>, VmError>,
    ) -> Result<(), VmError> {
        let channel = self.handle(id)?.agent()?;
        let own = self.token(id);
        let ask = |current: &str| {
            // Fresh bytes each time: the guest's generator is reseeded from them, so a
            // copy never draws its source's (or a sibling's) random numbers.
            let mut entropy = [0u8; 64];
            std::fs::File::open("/dev/urandom")
                .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut entropy))
                .map_err(|e| VmError::Agent(format!("reading the host's /dev/urandom: {e}")))?;
            channel
                .rekey(current, &own, &entropy, REKEY_TIMEOUT)
                .map_err(|e| VmError::Agent(format!("re-keying the agent of {id}: {e}")))
        };
        match ask(&own)? {
            204 => return Ok(()),
            401 => {}
            other => {
                return Err(VmError::Agent(format!(
                    "re-keying the agent of {id}: it answered {other}"
                )));
            }
        }
        let Some(source_token) = source_token()? else {
            return Err(VmError::Agent(format!("the agent of {id} refuses its own token")));
        };
        match ask(&source_token)? {
            204 => {
                tracing::info!(sandbox = %id, "re-keyed the agent restored from another sandbox's memory");
                Ok(())
            }
            other => Err(VmError::Agent(format!(
                "the agent of {id} takes neither its own token nor its source's (it answered {other})"
            ))),
        }
    }

    pub fn pause(&self, id: &str) -> Result<(), VmError> {
        let report = self.handle(id)?.pause()?;
        tracing::info!(sandbox = %id, snapshot_ms = report.snapshot.as_millis() as u64, state_bytes = report.state_bytes, "paused a microVM (its QEMU ended)");
        Ok(())
    }

    pub fn resume(&self, id: &str) -> Result<(), VmError> {
        let report = self.handle(id)?.resume()?;
        tracing::info!(sandbox = %id, restore_ms = report.restore.as_millis() as u64, "resumed a microVM");
        Ok(())
    }

    /// A file-system-only pause of VM `id`: its guest's file systems synced (through its
    /// agent, best effort: a guest that does not answer within 10 s loses what it had not
    /// written), then its QEMU ends and only its disk is kept (see [`VmHandle::store`]).
    pub fn pause_filesystem(&self, id: &str) -> Result<(), VmError> {
        let vm = self.handle(id)?;
        if matches!(vm.status()?, VmStatus::Running { .. })
            && let Ok(agent) = vm.agent()
        {
            let token = self.token(id);
            let synced = std::thread::scope(|s| {
                s.spawn(|| {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .ok()?;
                    rt.block_on(async {
                        tokio::time::timeout(Duration::from_secs(10), agent.exec(&token, "sync", &[]))
                            .await
                            .ok()
                    })
                })
                .join()
                .ok()
                .flatten()
            });
            if !matches!(synced, Some(Ok(_))) {
                tracing::warn!(sandbox = %id, "the guest did not sync its file systems before its file-system-only pause");
            }
        }
        vm.store()?;
        tracing::info!(sandbox = %id, "paused a VM with its disk only (its QEMU ended, its memory dropped)");
        Ok(())
    }

    /// Boots VM sandbox `d` again from its disk (its pause kept only that, or its memory is
    /// dropped now), and returns once its agent answers.
    pub fn boot_again(&self, d: &DesiredSandbox, image: &Image) -> Result<(), VmError> {
        let vm = self.handle(&d.id)?;
        vm.boot_again(&self.spec(d, image))?;
        let waited = vm.wait_agent(AGENT_READY_TIMEOUT)?;
        tracing::info!(sandbox = %d.id, agent_ms = waited.as_millis() as u64, "booted a VM again from its disk");
        Ok(())
    }

    /// Ends the sandbox: a running VM's QEMU is killed (the VM then shows as exited); a
    /// paused VM has no process, so it is removed (it then shows as gone).
    pub fn stop(&self, id: &str) -> Result<(), VmError> {
        let vm = self.handle(id)?;
        match vm.status()? {
            VmStatus::Paused => vm.delete(),
            _ => vm.kill(),
        }
    }

    /// Frees everything the VM holds: its QEMU, files, network namespace and uid.
    pub fn remove(&self, id: &str) -> Result<(), VmError> {
        match self.handle(id) {
            Ok(vm) => vm.delete(),
            Err(VmError::NotFound(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Snapshot `dest` of the sandbox's VM: memory, device state and disk. Returns bytes.
    pub fn snapshot(&self, id: &str, dest: &Path) -> Result<u64, VmError> {
        let report = self.handle(id)?.snapshot_to(dest)?;
        tracing::info!(sandbox = %id, paused_ms = report.source_paused.as_millis() as u64, bytes = report.bytes, "took a microVM snapshot");
        Ok(report.bytes)
    }

    /// The VM's counters for the metrics endpoint: its QEMU's CPU time and memory, and
    /// the data on its writable disk.
    pub fn sample(&self, id: &str) -> Option<Sample> {
        let vm = self.handle(id).ok()?;
        let files = vm.files().ok()?;
        let (cpu_usec, mem_used) = match vm.status().ok()? {
            VmStatus::Running { pid } => (
                process_cpu_usec(pid).unwrap_or(0),
                vm.memory().map(|m| m.rss_kb * 1024).unwrap_or(0),
            ),
            _ => (0, 0),
        };
        let disk_used = {
            use std::os::unix::fs::MetadataExt;
            std::fs::metadata(&files.rw_disk).map(|m| m.blocks() * 512).unwrap_or(0)
        };
        let disk_total = std::fs::metadata(&files.rw_disk).map(|m| m.len()).unwrap_or(0);
        Some(Sample {
            cpu_usec,
            cpu_count: 1,
            mem_used,
            mem_total: files.memory_mb << 20,
            mem_cache: 0,
            disk_used,
            disk_total,
            runtime: runtime_of(&vm).ok(),
            oom_kills: 0,
            network: None,
        })
    }

    /// The end of the guest's console (its kernel and the agent's output).
    pub fn log(&self, id: &str, max: usize) -> Option<Vec<u8>> {
        let vm = self.handle(id).ok()?;
        let path = vm.files().ok()?.dir.join("console.log");
        let bytes = std::fs::read(path).ok()?;
        Some(bytes[bytes.len().saturating_sub(max)..].to_vec())
    }
}

/// The CPU quota of sandbox `d`'s VMM at steady state, in thousandths of a core.
fn vm_cpu_millis(d: &DesiredSandbox) -> Option<u32> {
    Some(d.cpu_millis.clamp(1, u64::from(u32::MAX)) as u32)
}

/// CPU time (user + system) of a process, in microseconds.
fn process_cpu_usec(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    let mut fields = rest.split(' ');
    let utime: u64 = fields.nth(11)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Some((utime + stime) * 1_000_000 / hz)
}

/// Why a VM's QEMU ended, as the log will say: its exit, and what the guest's console
/// said last when it tells (init failed, the kernel panicked: the agent is PID 1, so its
/// death panics the guest).
fn end_reason(vm: &VmHandle, info: Option<&crate::vm::shim::ExitInfo>) -> String {
    let how = match info {
        Some(i) => match i.signal {
            Some(sig) => format!("its QEMU was killed by signal {sig}"),
            None => format!("its QEMU exited with code {}", i.exit_code),
        },
        None => "its QEMU is gone".to_string(),
    };
    let console = vm.console_tail(4096);
    let said = console
        .rsplit(" | ")
        .find(|l| l.contains("opendsec-init: FAILED") || l.contains("Kernel panic") || l.contains("reboot:"))
        .map(|l| format!(" (the console said: {})", l.trim()))
        .unwrap_or_default();
    format!("the microVM ended: {how}; its agent channel is closed{said}")
}

/// `vm`'s VMM and accelerator, as words (see [`MicroVms::runtime`]).
fn runtime_of(vm: &VmHandle) -> Result<(String, String), VmError> {
    let (vmm, accel) = vm.vmm()?;
    Ok((vmm.as_str().to_string(), accel.as_str().to_string()))
}
