//! Adoption after a restart. Sandboxes are not the edge's children (each runs under its
//! own shim, QEMU under `opendsec-vm-shim`), so a killed edge leaves them running and the
//! restarted one takes them up again: its saved slice from `edge.redb`, the containers
//! from their directories, the VMs from their records (the driver `recover`s each: a VM
//! left stopped by an unfinished operation continues). What a killed edge made ahead of
//! need (warm containers) is discarded; orphans are removed by the plan, but only once
//! the slice is past this run's registration index (`reconcile::plan`), since a saved
//! slice may lack the sandbox created just before the edge died.
//!
//! **Architecture Invariant:** sandboxes are not children of the edge: `kill -9` of the
//! edge (or of `opendsec up`) leaves them running, and the restarted edge re-adopts them.

use super::backend::VmsState;
use super::{Edge, EdgeConfig, EdgeError, STATE, store_err};
use crate::container::warm::WARM_ID_PREFIX;
use crate::desired::SliceState;
use crate::microvms::{MicroVms, MicroVmsConfig};
use opendsec_projections::Isolation;
use redb::{Database, ReadableDatabase};
use std::sync::Arc;

/// The slice this edge saved before it stopped (or died), if it is this edge's.
pub(super) fn saved_slice(db: &Database, cfg: &EdgeConfig) -> Result<SliceState, EdgeError> {
    let saved: Option<SliceState> = {
        let tx = db.begin_read().map_err(store_err)?;
        match tx.open_table(STATE) {
            Ok(t) => t
                .get("slice")
                .map_err(store_err)?
                .and_then(|v| serde_json::from_slice(v.value()).ok()),
            Err(_) => None,
        }
    };
    Ok(saved
        .filter(|s| s.edge == cfg.name)
        .unwrap_or_else(|| SliceState::new(&cfg.name)))
}

impl Edge {
    /// Discards the warm containers an edge that did not stop left behind, with their
    /// sockets and config directories.
    pub(super) fn discard_leftover_warm(&self) {
        for wid in self.containers.unstarted() {
            self.discard_warm(&wid);
        }
        for dir in [self.cfg.data_dir.join("config"), self.cfg.data_dir.join("agents")] {
            for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                if entry.file_name().to_string_lossy().starts_with(WARM_ID_PREFIX) {
                    let p = entry.path();
                    let _ = if p.is_dir() {
                        std::fs::remove_dir_all(&p)
                    } else {
                        std::fs::remove_file(&p)
                    };
                }
            }
        }
    }
}

impl Edge {
    /// Prepares the microVM driver beside the loop, when this edge runs microVMs. Its
    /// first start on a machine builds the guest kernel and initramfs: containers are
    /// served meanwhile; microVM sandboxes wait for it.
    pub(super) fn start_machines(self: &Arc<Self>) {
        let Some(mv) = self.cfg.microvm.clone() else {
            return;
        };
        let vcfg = MicroVmsConfig {
            root: self.cfg.data_dir.join("vms"),
            images: self.images.clone(),
            agent_binary: self.cfg.agent_binary.clone(),
            shim: mv.shim,
            edge_key: self.cfg.edge_key.clone(),
            disk_mb: self.cfg.disk_bytes >> 20,
        };
        let e = self.clone();
        tokio::spawn(async move {
            let opened = tokio::task::spawn_blocking(move || MicroVms::open(vcfg)).await;
            let state = match opened {
                Ok(Ok(v)) => {
                    tracing::info!(accelerator = v.accel().accel.as_str(), reason = %v.accel().reason, vmm = v.vmm().vmm.as_str(), vmm_reason = %v.vmm().reason, "microVMs ready");
                    VmsState::Ready(Arc::new(v))
                }
                Ok(Err(err)) => {
                    tracing::error!(error = %err, "this edge cannot run microVMs");
                    VmsState::Unavailable(err.to_string())
                }
                Err(err) => VmsState::Unavailable(format!("preparing the microVM driver panicked: {err}")),
            };
            e.machines.set(state);
            e.wake.notify_one();
        });
    }

    /// The slice as the plan may see it: while the driver cannot see its VMs yet, the
    /// machine sandboxes (and their snapshots and transfers) are left out rather than
    /// taken for lost. `None`: the whole slice.
    pub(super) fn slice_while_preparing(&self, slice: &SliceState) -> Option<SliceState> {
        if !self.machines.preparing() {
            return None;
        }
        let mut containers = slice.clone();
        containers.sandboxes.retain(|_, d| d.isolation == Isolation::Container);
        containers.snapshots.retain(|_, x| x.isolation == Isolation::Container);
        containers.served.retain(|_, t| t.isolation == Isolation::Container);
        Some(containers)
    }
}
