//! The node's side of the container backend (`crate::container`), as [`super::backend`]
//! calls it: how a container's state reads as an observation (an OOM is never reported
//! as a plain exit), pausing with memory reclaim, stopping, metrics, and the sandbox's
//! file system read frozen for snapshots, forks, transfers and packs.
//!
//! Sandbox files: a snapshot is a copy (`cp -a`, keeping whiteouts and opaque-dir xattrs)
//! of the sandbox's overlay upper dir, taken while its cgroup is frozen, kept as a layer
//! under `<edge data>/snapshots/<id>`; a sandbox started from it stacks the snapshot chain
//! on its image's layers. Pausing freezes the cgroup and, on cgroup v2 hosts with
//! `memory.reclaim`, asks the kernel to reclaim the frozen sandbox's memory.
//!
//! A process the OOM killer ends inside a sandbox ends alone: the sandbox lives on, as a
//! VM does, and its memory cgroup's count of kills (with the last victim's program, from
//! the kernel log) is reported. The sandbox ends as OOM only when its init (the agent)
//! was the one killed.

use super::EdgeError;
use super::files::{copy_tree, dir_size, tar_create};
use crate::container::oom::OomLog;
use crate::container::{ContainerBackend, SandboxStatus, cgroup};
use crate::proxy::Sample;
use crate::reconcile::{OomKills, Running};
use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Every container on this machine but those being created (half there: a directory, no
/// container yet), as the reconciler sees it. `oom` gets the OOM kills counted inside
/// each running one (the victims named by `oom_log`), and keeps the last count of those
/// that ended, so that a kill in their last moments is known to be new.
pub(super) fn observe(
    containers: &ContainerBackend,
    oom: &Mutex<BTreeMap<String, OomKills>>,
    oom_log: &OomLog,
    creating: &BTreeSet<String>,
) -> Result<BTreeMap<String, Running>, EdgeError> {
    let mut out = BTreeMap::new();
    let mut live_cgroups = BTreeSet::new();
    // lxcfs may have died: a new one, and its views in every sandbox, within a tick.
    if let Err(e) = containers.keep_views() {
        tracing::error!(error = %e, "sandboxes' /proc views: cannot restart lxcfs");
    }
    for h in containers.list()? {
        if creating.contains(&h.id) {
            continue;
        }
        let st = match containers.quick_state(&h.id) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(sandbox = %h.id, error = %e, "cannot read sandbox state");
                continue;
            }
        };
        live_cgroups.insert(h.record.cgroups_path.clone());
        let kills = cgroup::oom_kills(&h.record.cgroups_path).unwrap_or(0);
        let running = match (st.status, st.exit) {
            (SandboxStatus::Stored, _) => Running::Paused { memory: false },
            (_, Some(exit)) => Running::Exited {
                exit_code: exit.exit_code,
                oom_killed: exit.oom_killed,
            },
            (SandboxStatus::Paused, None) => Running::Paused { memory: true },
            (SandboxStatus::Created | SandboxStatus::Running, None) => {
                if kills > 0 {
                    let command = oom_log.last_victim(&h.record.cgroups_path).unwrap_or_default();
                    oom.lock()
                        .expect("oom lock")
                        .insert(h.id.clone(), OomKills { kills, command });
                }
                Running::Running
            }
            // Ended before its shim wrote why: killed, and by the OOM killer if its
            // cgroup counted a kill after the last one seen while it ran.
            (SandboxStatus::Stopped | SandboxStatus::Lost, None) => {
                let seen = oom.lock().expect("oom lock").get(&h.id).map_or(0, |o| o.kills);
                Running::Exited {
                    exit_code: 137,
                    oom_killed: kills > seen,
                }
            }
        };
        out.insert(h.id, running);
    }
    oom.lock().expect("oom lock").retain(|id, _| out.contains_key(id));
    oom_log.retain(|cg| live_cgroups.contains(cg));
    Ok(out)
}

/// Freezes the container; a paused sandbox gives its memory back where the host can
/// (cgroup v2).
pub(super) fn pause(containers: &ContainerBackend, id: &str) -> Result<(), EdgeError> {
    containers.pause(id)?;
    if let Ok(h) = containers.get(id)
        && let Some(freed) = cgroup::reclaim(&h.record.cgroups_path)
    {
        tracing::info!(sandbox = %id, freed_bytes = freed, "reclaimed the paused sandbox's memory");
    }
    Ok(())
}

/// Kills the container's processes, thawing it first: a frozen process cannot die.
pub(super) fn stop(containers: &ContainerBackend, id: &str) -> Result<(), EdgeError> {
    let _ = containers.resume(id);
    Ok(containers.kill(id, libc::SIGKILL)?)
}

/// The writable upper dir of a sandbox's overlay (on its size-limited disk).
pub(super) fn upper_dir(containers: &ContainerBackend, id: &str) -> PathBuf {
    containers.config().sandboxes_root.join(id).join("disk").join("upper")
}

/// Runs `f` on sandbox `sandbox`'s file system (its overlay upper dir) while the
/// sandbox is frozen, so what `f` reads is consistent; it is thawed again unless it
/// was paused.
pub(super) fn with_frozen_upper<T>(
    containers: &ContainerBackend,
    sandbox: &str,
    f: impl FnOnce(&Path) -> Result<T, EdgeError>,
) -> Result<T, EdgeError> {
    let upper = upper_dir(containers, sandbox);
    if !upper.is_dir() {
        return Err(EdgeError::Store(format!(
            "sandbox {sandbox} has no file system on this edge"
        )));
    }
    let was_running = matches!(
        containers.quick_state(sandbox).map(|s| s.status),
        Ok(SandboxStatus::Running)
    );
    if was_running {
        containers.pause(sandbox)?;
    }
    // Flush what the sandbox wrote before reading its files from outside.
    if let Ok(f) = std::fs::File::open(&upper) {
        // SAFETY: syncfs on a valid, open fd.
        unsafe { libc::syncfs(f.as_raw_fd()) };
    }
    let result = f(&upper);
    if was_running && let Err(e) = containers.resume(sandbox) {
        tracing::error!(%sandbox, error = %e, "cannot thaw the sandbox after reading its file system");
    }
    result
}

/// Copies a running sandbox's file system (its overlay upper dir) to `dest`, freezing
/// it meanwhile so the copy is consistent; it is thawed again unless it was paused.
pub(super) fn copy_upper(containers: &ContainerBackend, sandbox: &str, dest: &Path) -> Result<(), EdgeError> {
    with_frozen_upper(containers, sandbox, |upper| {
        copy_tree(upper, dest).map_err(|e| EdgeError::Store(format!("copying the file system of {sandbox}: {e}")))
    })
}

/// Snapshot `dest` of a container (unless its files exist already): its file system as a
/// layer. Returns its size.
pub(super) fn snapshot(containers: &ContainerBackend, sandbox: &str, dest: &Path) -> Result<u64, EdgeError> {
    if !dest.is_dir() {
        copy_upper(containers, sandbox, dest)?;
    }
    Ok(dir_size(dest))
}

/// A container's state for a fork on another edge, into `dir`: tar archives of its own
/// layers beneath (snapshots it started from, a fork's copy), then of what it wrote,
/// taken frozen; everything but the image, which every edge has. Returns the archives'
/// names, bottom first.
pub(super) fn export_fork(
    containers: &ContainerBackend,
    sandbox: &str,
    dir: &Path,
    images_root: &Path,
) -> Result<Vec<String>, EdgeError> {
    std::fs::create_dir(dir)?;
    let below: Vec<PathBuf> = containers
        .get(sandbox)?
        .record
        .layers
        .into_iter()
        .filter(|l| !l.starts_with(images_root))
        .collect();
    let mut names = Vec::new();
    for (k, layer) in below.iter().enumerate() {
        let name = format!("layer-{k}.tar");
        tar_create(layer, &dir.join(&name))?;
        names.push(name);
    }
    let top = format!("layer-{}.tar", below.len());
    with_frozen_upper(containers, sandbox, |upper| tar_create(upper, &dir.join(&top)))?;
    names.push(top);
    Ok(names)
}

/// A container's file system as layers, for a pack: the ids of the image store's layers it
/// stacks (the directories in `store_layers`, bottom first), and what `read` made of each
/// layer of its own, bottom first: those it starts from (a snapshot's chain, a fork's
/// copies), then what it wrote, read frozen (it is thawed again unless it was paused).
pub(super) fn pack_layers<T>(
    containers: &ContainerBackend,
    sandbox: &str,
    store_layers: &Path,
    read: &mut dyn FnMut(&Path) -> Result<T, EdgeError>,
) -> Result<(Vec<String>, Vec<T>), EdgeError> {
    let mut ids = Vec::new();
    let mut own = Vec::new();
    for layer in containers.get(sandbox)?.record.layers {
        let id = (layer.parent() == Some(store_layers))
            .then(|| layer.file_name().and_then(|n| n.to_str()).map(str::to_string))
            .flatten();
        match id {
            Some(id) if own.is_empty() => ids.push(id),
            Some(id) => {
                return Err(EdgeError::Store(format!(
                    "sandbox {sandbox} stacks store layer {id} above layers of its own: it cannot be packed"
                )));
            }
            None => own.push(read(&layer)?),
        }
    }
    own.push(with_frozen_upper(containers, sandbox, |upper| read(upper))?);
    Ok((ids, own))
}

/// A container's counters for the metrics endpoint: its cgroup's CPU and memory, and its
/// disk (`disk_bytes` when the disk cannot be read).
pub(super) fn sample(containers: &ContainerBackend, id: &str, disk_bytes: u64) -> Option<Sample> {
    let h = containers.get(id).ok()?;
    let u = cgroup::usage(&h.record.cgroups_path).unwrap_or_default();
    let (disk_used, disk_total) = nix::sys::statvfs::statvfs(&h.dir.join("disk"))
        .map(|v| {
            let f = v.fragment_size();
            (v.blocks().saturating_sub(v.blocks_free()) * f, v.blocks() * f)
        })
        .unwrap_or((0, disk_bytes));
    Some(Sample {
        oom_kills: cgroup::oom_kills(&h.record.cgroups_path).unwrap_or(0),
        cpu_usec: u.cpu_usec,
        cpu_count: (h.record.limits.cpu_millis as u64).div_ceil(1000).max(1),
        mem_used: u.memory_bytes,
        mem_total: h.record.limits.memory_bytes,
        mem_cache: u.cache_bytes,
        disk_used,
        disk_total,
        runtime: None,
        network: None,
    })
}
