//! The one place where the node tells its two backends apart. A sandbox runs in a
//! container (`crate::container`; the node's side in `containers.rs`) or in a machine:
//! a microVM or a full VM (`crate::microvms` over the driver in `crate::vm`, QEMU or
//! Firecracker). What the node does to a sandbox that both can do (create, pause,
//! resume, stop, remove, snapshot, export for another edge, observe, metrics, console
//! log, the agent's address, what admission needs) goes through [`Backend`], and so does
//! what only one can do (a pack: a container's layers); the rest of the node never asks
//! which isolation a sandbox has.
//!
//! The microVM driver is prepared beside the loop at start (the first start on a machine
//! builds the kernel and initramfs; the KVM verdict is kept in the image store for the
//! host boot): until it is ready, microVM sandboxes are left out of the plan rather than
//! taken for lost (`adoption.rs`).

use super::{Edge, EdgeError, MAX_RESUME_TRIES, containers};
use crate::container::ContainerBackend;
use crate::desired::DesiredSandbox;
use crate::microvms::MicroVms;
use crate::proxy::{AgentAddr, Sample};
use crate::reconcile::Running;
use opendsec_commands::Observation;
use opendsec_projections::Isolation;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::{Arc, Mutex};

/// The backend that runs a sandbox (a closed set: a third backend is a new variant, and
/// the compiler lists every place it must be handled).
pub(super) enum Backend<'e> {
    /// crun or runc, each sandbox under its `opendsec-shim`.
    Containers(&'e ContainerBackend),
    /// The microVM driver, which may still be preparing, or be unavailable here.
    Machines(&'e Machines),
}

/// The edge's microVM driver: being prepared (its first start builds the guest kernel and
/// initramfs), ready, or unavailable and why.
pub(super) enum VmsState {
    Preparing,
    Ready(Arc<MicroVms>),
    Unavailable(String),
}

/// The machine backend's state, shared by the loop and the task that prepares it.
pub(super) struct Machines {
    state: Mutex<VmsState>,
}

impl Machines {
    pub(super) fn new(state: VmsState) -> Machines {
        Machines {
            state: Mutex::new(state),
        }
    }

    pub(super) fn set(&self, state: VmsState) {
        *self.state.lock().expect("vms lock") = state;
    }

    /// The microVMs, when ready; otherwise why a microVM cannot be handled now.
    pub(super) fn ready(&self) -> Result<Arc<MicroVms>, EdgeError> {
        match &*self.state.lock().expect("vms lock") {
            VmsState::Ready(v) => Ok(v.clone()),
            VmsState::Preparing => Err(EdgeError::NoMicroVms(
                "this edge is still preparing its microVM driver".into(),
            )),
            VmsState::Unavailable(why) => Err(EdgeError::NoMicroVms(format!("this edge runs no microVMs: {why}"))),
        }
    }

    pub(super) fn preparing(&self) -> bool {
        matches!(&*self.state.lock().expect("vms lock"), VmsState::Preparing)
    }

    fn unavailable(&self) -> Option<String> {
        match &*self.state.lock().expect("vms lock") {
            VmsState::Unavailable(why) => Some(why.clone()),
            _ => None,
        }
    }
}

impl Edge {
    /// The backend of sandboxes of `isolation`.
    pub(super) fn backend(&self, isolation: Isolation) -> Backend<'_> {
        if isolation.is_machine() {
            Backend::Machines(&self.machines)
        } else {
            Backend::Containers(&self.containers)
        }
    }

    /// The backend that runs sandbox `id`: its isolation in the slice, or for an orphan
    /// (no longer in the slice) the driver that has it.
    pub(super) fn backend_of(&self, id: &str) -> Backend<'_> {
        let in_slice = self
            .slice
            .lock()
            .expect("slice lock")
            .sandboxes
            .get(id)
            .map(|d| d.isolation);
        match in_slice {
            Some(isolation) => self.backend(isolation),
            None if self.machines.ready().is_ok_and(|v| v.has(id)) => Backend::Machines(&self.machines),
            None => Backend::Containers(&self.containers),
        }
    }

    /// Sandbox `id` as this edge's slice has it now.
    pub(super) fn in_slice(&self, id: &str) -> Result<DesiredSandbox, EdgeError> {
        self.slice
            .lock()
            .expect("slice lock")
            .sandboxes
            .get(id)
            .cloned()
            .ok_or_else(|| EdgeError::Store(format!("sandbox {id} is not in this edge's slice")))
    }

    /// What runs on this machine, as the backends see it. A sandbox being created is
    /// observed once its creation has finished.
    pub(super) fn observe(&self, creating: &BTreeSet<String>) -> Result<BTreeMap<String, Running>, EdgeError> {
        let mut out = containers::observe(&self.containers, &self.oom_seen, &self.oom_log, creating)?;
        if let Ok(vms) = self.machines.ready() {
            out.extend(vms.observe()?.into_iter().filter(|(id, _)| !creating.contains(id)));
        }
        Ok(out)
    }

    /// Starts creating sandbox `d` beside the loop (see `create.rs`).
    pub(super) async fn start_creation(self: &Arc<Self>, d: DesiredSandbox, observed: &BTreeMap<String, Running>) {
        match self.backend(d.isolation) {
            Backend::Containers(_) => self.start_container_creation(d, observed).await,
            Backend::Machines(_) => self.start_machine_creation(d, observed).await,
        }
    }

    /// Resumes sandbox `id`: where it was (a container's cgroup thaw, a VM's restore), or
    /// with `cold` (its pause kept only its file system, or a resume drops its memory)
    /// booted again from its file system. A sandbox that cannot be brought back (a VM's
    /// snapshot is damaged, QEMU refuses it, a container's runtime fails) would be tried
    /// for ever: after [`MAX_RESUME_TRIES`] in a row it is reported failed.
    pub(super) async fn resume(self: &Arc<Self>, id: String, cold: bool) -> Result<(), EdgeError> {
        let container = matches!(self.backend_of(&id), Backend::Containers(_));
        if container && !cold && !self.containers.is_stored(&id) {
            return self.blocking(move |e| e.backend_of(&id).resume(&id)).await;
        }
        if self.failed.lock().expect("failed lock").contains(&id) {
            return Ok(()); // reported failed: no more tries while the log catches up
        }
        let sid = id.clone();
        let resumed = if container {
            self.boot_stored_container(&id).await
        } else if cold {
            self.blocking(move |e| {
                let d = e.in_slice(&sid)?;
                let image = e.image_for(&d)?;
                Ok(e.machines.ready()?.boot_again(&d, &image)?)
            })
            .await
        } else {
            self.blocking(move |e| e.backend_of(&sid).resume(&sid)).await
        };
        let tries = {
            let mut failures = self.resume_failures.lock().expect("resume failures lock");
            match &resumed {
                Ok(()) => {
                    failures.remove(&id);
                    0
                }
                Err(_) => {
                    let n = failures.entry(id.clone()).or_insert(0);
                    *n += 1;
                    *n
                }
            }
        };
        match resumed {
            Err(e) if tries >= MAX_RESUME_TRIES => {
                self.failed.lock().expect("failed lock").insert(id.clone());
                self.report(
                    &id,
                    Observation::Failed {
                        reason: if container || cold {
                            format!("the sandbox could not be booted again ({tries} tries): {e}")
                        } else {
                            format!("the microVM could not be restored ({tries} tries): {e}")
                        },
                    },
                )
                .await;
                Ok(())
            }
            other => other,
        }
    }

    /// What a `Ready` observation of sandbox `id` becomes, or `None` when it cannot be
    /// reported yet (retried on the next round). A container is ready as it is. A VM
    /// restored from another's memory answers only that one's token until re-keyed (done
    /// at its creation; again here in case the edge died in between): it is ready once it
    /// takes its own; and it says how it runs: its VMM and accelerator (from its record).
    pub(super) async fn ready_observation(self: &Arc<Self>, id: &str) -> Option<Observation> {
        if let Backend::Containers(_) = self.backend_of(id) {
            return Some(Observation::Ready);
        }
        let source = {
            let slice = self.slice.lock().expect("slice lock");
            slice.sandboxes.get(id).and_then(|d| {
                let of = d.fork_of.clone().map(Some).or_else(|| {
                    d.snapshot
                        .as_ref()
                        .map(|snap| slice.snapshots.get(snap).map(|x| x.sandbox.clone()))
                })?;
                Some((d.clone(), of))
            })
        };
        if let Some((d, source)) = source {
            let sid = id.to_string();
            if let Err(e) = self
                .blocking(move |e| {
                    let token = || match &source {
                        Some(of) => e
                            .source_agent_token(&d, of)
                            .map(Some)
                            .map_err(|x| crate::vm::VmError::Agent(x.to_string())),
                        None => Ok(None),
                    };
                    Ok(e.machines.ready()?.ensure_token(&sid, token)?)
                })
                .await
            {
                tracing::warn!(sandbox = %id, error = %e, "the microVM's agent does not take its token yet; retried on the next round");
                return None;
            }
        }
        match self
            .machines
            .ready()
            .map_err(|e| e.to_string())
            .and_then(|v| v.runtime(id).map_err(|e| e.to_string()))
        {
            Ok((vmm, accelerator)) => Some(Observation::VmReady { vmm, accelerator }),
            Err(e) => {
                tracing::warn!(sandbox = %id, error = %e, "cannot read how the microVM runs; retried on the next round");
                None
            }
        }
    }
}

impl Backend<'_> {
    /// Pauses the sandbox: everything kept, or (`filesystem`) its processes ended and
    /// only its file system kept (a container's disk and overlay, a VM's disk).
    pub(super) fn pause(&self, id: &str, filesystem: bool) -> Result<(), EdgeError> {
        match (self, filesystem) {
            (Backend::Containers(c), false) => containers::pause(c, id),
            (Backend::Containers(c), true) => Ok(c.store(id)?),
            (Backend::Machines(m), false) => Ok(m.ready()?.pause(id)?),
            (Backend::Machines(m), true) => Ok(m.ready()?.pause_filesystem(id)?),
        }
    }

    pub(super) fn resume(&self, id: &str) -> Result<(), EdgeError> {
        match self {
            Backend::Containers(c) => Ok(c.resume(id)?),
            Backend::Machines(m) => Ok(m.ready()?.resume(id)?),
        }
    }

    /// Ends the sandbox: a container's processes are killed; a running VM's QEMU is
    /// killed, a paused VM (no process) removed.
    pub(super) fn stop(&self, id: &str) -> Result<(), EdgeError> {
        match self {
            Backend::Containers(c) => containers::stop(c, id),
            Backend::Machines(m) => Ok(m.ready()?.stop(id)?),
        }
    }

    /// Frees what the backend holds of the sandbox.
    pub(super) fn remove(&self, id: &str) -> Result<(), EdgeError> {
        match self {
            Backend::Containers(c) => Ok(c.delete(id)?),
            Backend::Machines(m) => Ok(m.ready()?.remove(id)?),
        }
    }

    /// Takes snapshot `dest` of `sandbox` unless its files exist already, and returns
    /// its size: a container's file system as a layer, or a VM's memory, device state and
    /// disk (taken beside its final name and renamed, so a crash leaves no half snapshot;
    /// its sparse files count the data they hold).
    pub(super) fn snapshot(&self, sandbox: &str, dest: &Path) -> Result<u64, EdgeError> {
        match self {
            Backend::Containers(c) => containers::snapshot(c, sandbox, dest),
            Backend::Machines(m) => {
                if !dest.is_dir() {
                    let name = dest.file_name().and_then(|n| n.to_str()).unwrap_or("snapshot");
                    let tmp = dest.with_file_name(format!(".tmp-{name}"));
                    let _ = std::fs::remove_dir_all(&tmp);
                    if let Some(parent) = dest.parent() {
                        std::fs::create_dir_all(parent)?;
                    }
                    m.ready()?.snapshot(sandbox, &tmp)?;
                    std::fs::rename(&tmp, dest)?;
                }
                Ok(super::files::dir_allocated(dest))
            }
        }
    }

    /// A pack of `sandbox` (see `packs.rs`): the image store's layers it stacks (ids, bottom
    /// first), and what `read` made of each layer of its own, bottom first, its writable
    /// layer last (read frozen). A VM's disk is not a layer: refused.
    pub(super) fn pack_layers<T>(
        &self,
        sandbox: &str,
        store_layers: &Path,
        read: &mut dyn FnMut(&Path) -> Result<T, EdgeError>,
    ) -> Result<(Vec<String>, Vec<T>), EdgeError> {
        match self {
            Backend::Containers(c) => containers::pack_layers(c, sandbox, store_layers, read),
            Backend::Machines(_) => Err(EdgeError::Store(format!(
                "sandbox {sandbox} is a VM: its disk is not a layer to pack; snapshot it instead"
            ))),
        }
    }

    /// The state a fork of running `sandbox` on another edge starts from, into the new
    /// directory `dir`: a VM's fork snapshot (it stops only while its state is copied),
    /// or a container's layers as archives. Returns the layer archives' names.
    pub(super) fn export_fork(&self, sandbox: &str, dir: &Path, images_root: &Path) -> Result<Vec<String>, EdgeError> {
        match self {
            Backend::Containers(c) => containers::export_fork(c, sandbox, dir, images_root),
            Backend::Machines(m) => {
                m.ready()?.snapshot(sandbox, dir)?;
                Ok(vec![])
            }
        }
    }

    /// The state a sandbox from stored snapshot `snapshot` on another edge starts from,
    /// into the new directory `dir`: links to a VM snapshot's files (they never change:
    /// a link is a copy), or archives of a container snapshot's layer chain. Returns the
    /// layer archives' names.
    pub(super) fn export_snapshot(&self, edge: &Edge, snapshot: &str, dir: &Path) -> Result<Vec<String>, EdgeError> {
        std::fs::create_dir(dir)?;
        match self {
            Backend::Containers(_) => {
                let mut names = Vec::new();
                for (k, layer) in edge.snapshot_layers(snapshot)?.iter().enumerate() {
                    let name = format!("layer-{k}.tar");
                    super::files::tar_create(layer, &dir.join(&name))?;
                    names.push(name);
                }
                Ok(names)
            }
            Backend::Machines(_) => {
                for e in std::fs::read_dir(edge.snapshots_dir().join(snapshot))? {
                    let e = e?;
                    if e.file_type()?.is_file() && std::fs::hard_link(e.path(), dir.join(e.file_name())).is_err() {
                        std::fs::copy(e.path(), dir.join(e.file_name()))?;
                    }
                }
                Ok(vec![])
            }
        }
    }

    /// The sandbox's counters for the metrics endpoint.
    pub(super) fn sample(&self, id: &str, disk_bytes: u64) -> Option<Sample> {
        match self {
            Backend::Containers(c) => containers::sample(c, id, disk_bytes),
            Backend::Machines(m) => m.ready().ok()?.sample(id),
        }
    }

    /// The end of the sandbox's output: a container's log, a VM's console.
    pub(super) fn log(&self, id: &str, max: usize) -> Option<Vec<u8>> {
        match self {
            Backend::Containers(c) => c.read_log(id, max).ok(),
            Backend::Machines(m) => m.ready().ok()?.log(id, max),
        }
    }

    /// Why this edge cannot run a sandbox of `isolation` at all, if it cannot: a machine
    /// needs the driver, and a full VM a host that can build boot disks.
    pub(super) fn refusal(&self, edge: &str, isolation: Isolation) -> Option<String> {
        let Backend::Machines(m) = self else {
            return None;
        };
        if let Some(why) = m.unavailable() {
            return Some(format!("admission: edge {edge} runs no microVMs: {why}"));
        }
        if isolation == Isolation::Vm && !crate::vm::host_can_build_boot_disks() {
            return Some(format!(
                "admission: edge {edge} runs no full VMs: extlinux, syslinux's mbr.bin or qemu-img is missing"
            ));
        }
        None
    }

    /// Disk a new sandbox needs beside its writable disk of `disk_bytes`: a machine's RAM
    /// file lives there too (a paused VM's memory).
    pub(super) fn disk_need(&self, disk_bytes: u64, memory_mb: u64) -> u64 {
        match self {
            Backend::Containers(_) => disk_bytes,
            Backend::Machines(_) => disk_bytes + (memory_mb << 20),
        }
    }
}

/// Where sandbox `id`'s agent listens: a container's Unix socket in `agents`, or a VM's
/// address inside its network namespace, read from the VM's record under `vm_root` so
/// that a restarted edge serves its VMs before its driver is ready.
pub(super) fn agent_addr(agents: &Path, vm_root: &Path, id: &str) -> Option<AgentAddr> {
    let valid = !id.is_empty() && id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if !valid {
        return None;
    }
    let p = agents.join(format!("{id}.sock"));
    if p.exists() {
        return Some(AgentAddr::Unix(p));
    }
    crate::vm::agent_channel_at(vm_root, id).map(AgentAddr::MicroVm)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_edge_without_microvms_refuses_a_machine_at_admission_and_says_why() {
        let m = Machines::new(VmsState::Unavailable("it was started without microVM support".into()));
        for isolation in [Isolation::Microvm, Isolation::Vm] {
            assert_eq!(
                Backend::Machines(&m).refusal("e1", isolation).as_deref(),
                Some("admission: edge e1 runs no microVMs: it was started without microVM support")
            );
        }
    }

    #[test]
    fn a_preparing_driver_refuses_no_microvm_at_admission_but_handles_none_yet() {
        let m = Machines::new(VmsState::Preparing);
        assert_eq!(Backend::Machines(&m).refusal("e1", Isolation::Microvm), None);
        assert!(m.preparing());
        assert!(matches!(m.ready(), Err(EdgeError::NoMicroVms(why)) if why.contains("still preparing")));
    }

    #[test]
    fn a_machine_needs_disk_for_its_ram_file_beside_its_writable_disk() {
        let m = Machines::new(VmsState::Preparing);
        assert_eq!(Backend::Machines(&m).disk_need(1 << 30, 512), (1 << 30) + (512 << 20));
    }

    #[test]
    fn an_agent_is_found_at_its_container_socket_and_malformed_ids_reach_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let (agents, vms) = (dir.path().join("agents"), dir.path().join("vms"));
        std::fs::create_dir_all(&agents).unwrap();
        std::fs::write(agents.join("sb-1.sock"), b"").unwrap();
        std::fs::write(dir.path().join("escape.sock"), b"").unwrap();
        assert!(matches!(agent_addr(&agents, &vms, "sb-1"), Some(AgentAddr::Unix(p)) if p == agents.join("sb-1.sock")));
        assert!(
            agent_addr(&agents, &vms, "sb-2").is_none(),
            "no socket and no VM record"
        );
        for bad in ["", "../escape", "a/b", "a.b"] {
            assert!(agent_addr(&agents, &vms, bad).is_none(), "{bad:?} must reach nothing");
        }
    }
}
