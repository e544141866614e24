//! The edge's final word on admission. The leader asks before it places a sandbox here
//! (the proxy's admission hook, answered from the last observation), and the edge checks
//! again before it creates one: its configured capacity against what it runs or has
//! promised to run (live sandboxes of its slice, creations under way, recent admissions
//! not yet in the slice), the host's available memory and disk, and whether its backend
//! can run the sandbox at all. A refused sandbox is reported failed.

use super::{Edge, Running};
use crate::desired::DesiredSandbox;
use crate::proxy;
use opendsec_projections::Isolation;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

impl Edge {
    /// The edge's final word on admission, from what really runs here: the sandboxes the
    /// backend sees and those being created, against this edge's capacity, and the
    /// memory the host still has.
    pub(super) fn admit(&self, d: &DesiredSandbox, observed: &BTreeMap<String, Running>) -> Result<(), String> {
        self.admit_usage(&d.id, d.cpu_millis, d.memory_mb, d.isolation, observed)
    }

    /// Admission from usage: what this edge runs or has promised to run (live sandboxes
    /// of its slice, anything the backend still runs or creates, sandboxes admitted in the
    /// last 30 s that the slice does not show yet), plus the request. MicroVMs count like
    /// containers (their memory is their guest's RAM); a microVM also needs this edge to
    /// run them and room on disk for its RAM file (a paused VM's memory lives there) on
    /// top of the writable disk every sandbox gets. A full VM counts as a microVM (its
    /// disk is an overlay that holds what it writes) and needs a driver that can build
    /// boot disks.
    pub(super) fn admit_usage(
        &self,
        id: &str,
        cpu_millis: u64,
        memory_mb: u64,
        isolation: Isolation,
        observed: &BTreeMap<String, Running>,
    ) -> Result<(), String> {
        let backend = self.backend(isolation);
        if let Some(why) = backend.refusal(&self.cfg.name, isolation) {
            return Err(why);
        }
        let disk_need = backend.disk_need(self.cfg.disk_bytes, memory_mb);
        if let Ok(v) = nix::sys::statvfs::statvfs(&self.cfg.data_dir) {
            let avail = v.blocks_available() * v.fragment_size();
            if avail < disk_need {
                return Err(format!(
                    "admission: edge {} has {} MB of disk left, the sandbox needs {} MB",
                    self.cfg.name,
                    avail >> 20,
                    disk_need >> 20
                ));
            }
        }
        let slice = self.slice.lock().expect("slice lock");
        let creating = self.creating.lock().expect("creating lock");
        let mut admitted = self.admitted.lock().expect("admitted lock");
        admitted.retain(|k, (_, _, at)| at.elapsed() < Duration::from_secs(30) && !slice.sandboxes.contains_key(k));
        let here: Vec<(u64, u64)> = slice
            .sandboxes
            .values()
            .filter(|s| s.id != id)
            .filter(|s| {
                let committed = !s.is_terminal() && s.desired != opendsec_projections::Desired::Killed;
                committed
                    || creating.contains(&s.id)
                    || matches!(observed.get(&s.id), Some(Running::Running | Running::Paused { .. }))
            })
            .map(|s| (s.cpu_millis, s.memory_mb))
            .chain(
                admitted
                    .iter()
                    .filter(|(k, _)| k.as_str() != id)
                    .map(|(_, (c, m, _))| (*c, *m)),
            )
            .collect();
        let cap = &self.cfg.capacity;
        let mem: u64 = here.iter().map(|(_, m)| m).sum::<u64>() + memory_mb;
        let cpu: u64 = here.iter().map(|(c, _)| c).sum::<u64>() + cpu_millis;
        let d = (memory_mb, cpu_millis);
        if here.len() as u64 + 1 > cap.sandboxes {
            return Err(format!(
                "admission: edge {} already runs its maximum of {} sandboxes",
                self.cfg.name, cap.sandboxes
            ));
        }
        if mem > cap.memory_mb {
            return Err(format!(
                "admission: edge {} has no room for {} MB of memory",
                self.cfg.name, d.0
            ));
        }
        if cpu > cap.cpu_millis {
            return Err(format!(
                "admission: edge {} has no room for {} millicores",
                self.cfg.name, d.1
            ));
        }
        if let Some(avail) = host_mem_available_mb()
            && avail < d.0 / 4
        {
            return Err(format!(
                "admission: host of edge {} has only {avail} MB of memory available",
                self.cfg.name
            ));
        }
        Ok(())
    }
}

/// MemAvailable of the host, in MB.
fn host_mem_available_mb() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024)
}

impl Edge {
    /// The proxy's admission hook: the leader's request, answered from the last
    /// observation; an admitted sandbox counts until the slice shows it.
    pub(super) fn admitter(self: &Arc<Self>) -> proxy::Admitter {
        let judge = self.clone();
        Arc::new(move |ask| {
            let observed = judge.last_observed.lock().expect("observed lock").clone();
            judge.admit_usage(&ask.sandbox, ask.cpu_millis, ask.memory_mb, ask.isolation, &observed)?;
            judge
                .admitted
                .lock()
                .expect("admitted lock")
                .insert(ask.sandbox.clone(), (ask.cpu_millis, ask.memory_mb, Instant::now()));
            Ok(())
        })
    }
}
