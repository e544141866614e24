//! State moving between edges (the wire side is `crate::transfer`), for a fork copy or a
//! sandbox from a snapshot placed on another edge than that state.
//!
//! - Who serves: the source edge (the event's `source_edge`). Its slice lists what it
//!   serves (`SliceState.served`: transfer id, source, the sandboxes and their edges);
//!   `plan_transfers` has it prepare `<edge data>/transfers/<id>/`: for a VM fork a fork
//!   snapshot of the running (or paused) source (it stops only while its state is
//!   copied), for a VM snapshot links to its files, for a container tar archives (owners,
//!   xattrs, whiteouts) of every layer of the source beneath its image and, taken frozen,
//!   its upper dir, or of a snapshot's chain; then `manifest.json` (each file's size and
//!   SHA-256). A source that ended or a snapshot deleted is `transfers/<id>.failed`,
//!   answered 410 with the reason.
//! - Who pulls: the sandbox's edge, when it creates it ([`Edge::import`], once per
//!   transfer: a fork's copies on one edge share one pull), into
//!   `<edge data>/imports/<id>/`. A VM is restored from it and re-keyed as a local copy;
//!   a container unpacks the layers into `forks/<sandbox>/<k>/` under its image's. A
//!   failed pull fails the sandbox.
//!
//! **Architecture Invariant (cleanup):** the source removes its prepared copy once every
//! sandbox's edge said it pulled it, when the snapshot is deleted, or after
//! [`TRANSFER_TTL`] unpulled; the puller removes `imports/<id>` once no sandbox of its
//! slice waits to start from it, and a failed pull leaves nothing; unpacked layers go
//! with their sandbox.

use super::files::dir_allocated;
use super::{Edge, EdgeError, Running};
use crate::desired::DesiredSandbox;
use crate::proxy;
use crate::transfer::{self, Manifest};
use opendsec_edge_api::pb::TransferTokenReply;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A prepared transfer no edge came to pull is removed after this long.
const TRANSFER_TTL: Duration = Duration::from_secs(30 * 60);

impl Edge {
    /// Prepares transfer `id` in `transfers/<id>/`: a microVM's snapshot (a fork snapshot
    /// of a running source, taken now: it stops only while its state is copied; or a stored
    /// snapshot's files, linked), or a container's file-system layers as tar archives
    /// (every layer of the source beneath its image, then its upper dir, taken frozen; or
    /// a stored snapshot's chain); then the manifest with each file's digest.
    pub(super) fn make_transfer(&self, id: &str) -> Result<u64, EdgeError> {
        use crate::desired::TransferSource;
        let t = self
            .slice
            .lock()
            .expect("slice lock")
            .served
            .get(id)
            .cloned()
            .ok_or_else(|| EdgeError::Store(format!("transfer {id} is no longer served")))?;
        let dest = self.transfers_dir().join(id);
        let tmp = self.transfers_dir().join(format!(".tmp-{id}"));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(self.transfers_dir())?;
        let made = (|| -> Result<(), EdgeError> {
            let backend = self.backend(t.isolation);
            let (source_sandbox, layers) = match &t.source {
                TransferSource::Fork { sandbox } => {
                    let layers = backend.export_fork(sandbox, &tmp, self.images.root())?;
                    (sandbox.clone(), layers)
                }
                TransferSource::Snapshot { snapshot } => {
                    let layers = backend.export_snapshot(self, snapshot, &tmp)?;
                    let source = self
                        .slice
                        .lock()
                        .expect("slice lock")
                        .snapshots
                        .get(snapshot)
                        .map(|x| x.sandbox.clone())
                        .unwrap_or_default();
                    (source, layers)
                }
            };
            transfer::write_manifest(&tmp, id, &t.isolation.to_event(), &source_sandbox, layers)?;
            let _ = std::fs::remove_dir_all(&dest);
            std::fs::rename(&tmp, &dest)?;
            Ok(())
        })();
        if let Err(e) = made {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
        Ok(dir_allocated(&dest))
    }

    /// Removes transfer `id`'s files, and forgets it once every edge has pulled it.
    pub(super) fn remove_transfer(&self, id: &str) -> Result<(), EdgeError> {
        let _ = std::fs::remove_file(self.transfer_failure(id));
        match std::fs::remove_dir_all(self.transfers_dir().join(id)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e.into()),
            _ => {}
        }
        let forgot = {
            let mut slice = self.slice.lock().expect("slice lock");
            let done = slice.served.get(id).is_some_and(|t| !t.is_wanted());
            done && slice.served.remove(id).is_some()
        };
        if forgot {
            self.persist()?;
        }
        Ok(())
    }

    /// The transfers prepared here (or failed, with a reason), and removal of those no
    /// edge came to pull within [`TRANSFER_TTL`].
    pub(super) fn present_transfers(&self) -> BTreeSet<String> {
        let mut out = BTreeSet::new();
        for e in std::fs::read_dir(self.transfers_dir()).into_iter().flatten().flatten() {
            let Some(name) = e.file_name().to_str().map(str::to_string) else {
                continue;
            };
            if name.starts_with('.') {
                continue;
            }
            let stale = e
                .metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|t| t.elapsed().is_ok_and(|age| age > TRANSFER_TTL));
            let id = name.strip_suffix(".failed").unwrap_or(&name).to_string();
            if stale {
                tracing::warn!(transfer = %id, "removing a transfer no edge pulled in time");
                let _ = std::fs::remove_file(self.transfer_failure(&id));
                let _ = std::fs::remove_dir_all(self.transfers_dir().join(&id));
                if let Some(t) = self.slice.lock().expect("slice lock").served.get_mut(&id) {
                    t.pulled.extend(t.destinations.keys().cloned());
                }
                continue;
            }
            out.insert(id);
        }
        out
    }

    /// What the control plane gives this edge for transfer `id` of one of its sandboxes.
    pub(super) fn transfer_credentials(&self, id: &str) -> Result<TransferTokenReply, EdgeError> {
        let mut client = self.client.clone();
        self.rt
            .block_on(client.transfer_token(&self.cfg.name, id))
            .map_err(|e| EdgeError::Store(format!("the control plane gave no token for transfer {id}: {e}")))
    }

    /// The agent token that a microVM starting from another sandbox's state (`source`)
    /// holds until re-keyed: derived here for state of this edge's; for state pulled from
    /// another edge, keyed with that edge's key, so given by the control plane.
    pub(super) fn source_agent_token(&self, d: &DesiredSandbox, source: &str) -> Result<String, EdgeError> {
        match d.transfer.as_deref() {
            Some(id) => Ok(self.transfer_credentials(id)?.source_agent_token),
            None => Ok(opendsec_edge_api::sandbox_token(
                &self.cfg.edge_key,
                opendsec_edge_api::SandboxTokenKind::Agent,
                source,
            )),
        }
    }

    /// The state sandbox `d` starts from, pulled from the edge that holds it (once per
    /// transfer: the copies of one fork share it): its directory and manifest.
    pub(super) fn import(&self, d: &DesiredSandbox) -> Result<(PathBuf, Manifest), EdgeError> {
        let (Some(id), Some(source_edge)) = (d.transfer.as_deref(), d.source_edge.as_deref()) else {
            return Err(EdgeError::Store(format!(
                "sandbox {} starts from no other edge's state",
                d.id
            )));
        };
        if !transfer::valid_transfer(id) {
            return Err(EdgeError::Store(format!("transfer id {id:?} is malformed")));
        }
        let lock = self
            .import_locks
            .lock()
            .expect("import locks")
            .entry(id.to_string())
            .or_default()
            .clone();
        let _one = lock.lock().expect("import lock");
        let dir = self.imports_dir().join(id);
        if let Ok(m) = transfer::read_manifest(&dir) {
            return Ok((dir, m));
        }
        let address = self.slice.lock().expect("slice lock").edges.get(source_edge).cloned();
        let address = address.ok_or_else(|| {
            EdgeError::Store(format!(
                "edge {source_edge}, which holds the state sandbox {} starts from, is not registered",
                d.id
            ))
        })?;
        // Keyed with the holding edge's key, which this edge does not hold: the control
        // plane hands it out for this edge's own sandboxes only.
        let token = self.transfer_credentials(id)?.token;
        let req = transfer::PullRequest {
            transfer: id,
            source_edge,
            address: &address,
            me: &self.cfg.name,
            token: &token,
            trust: &self.trust,
        };
        let pulled = self.rt.block_on(transfer::pull(&req, &dir))?;
        let data: u64 = pulled.manifest.files.iter().map(|f| f.data_bytes).sum();
        tracing::info!(
            transfer = %id,
            from = %source_edge,
            files = pulled.manifest.files.len(),
            wire_bytes = pulled.wire_bytes,
            data_bytes = data,
            took_ms = pulled.took.as_millis() as u64,
            "pulled a transfer from another edge"
        );
        Ok((dir, pulled.manifest))
    }

    /// Removes pulled state no sandbox still waits to start from.
    pub(super) fn sweep_imports(&self, observed: &BTreeMap<String, Running>) {
        let Ok(entries) = std::fs::read_dir(self.imports_dir()) else {
            return;
        };
        let creating = self.creating.lock().expect("creating lock").clone();
        let failed = self.failed.lock().expect("failed lock").clone();
        let slice = self.slice.lock().expect("slice lock");
        for e in entries.flatten() {
            let Some(id) = e.file_name().to_str().map(str::to_string) else {
                continue;
            };
            let waiting = slice
                .sandboxes
                .values()
                .filter(|d| d.transfer.as_deref() == Some(id.as_str()))
                .any(|d| {
                    creating.contains(&d.id)
                        || (d.observed == opendsec_projections::Observed::Pending
                            && d.desired == opendsec_projections::Desired::Running
                            && !failed.contains(&d.id)
                            && !observed.contains_key(&d.id))
                });
            if !waiting {
                tracing::info!(transfer = %id, "removing pulled state no sandbox waits for");
                let _ = std::fs::remove_dir_all(e.path());
                self.import_locks.lock().expect("import locks").remove(&id);
            }
        }
    }
}

impl Edge {
    /// Prepares transfer `id` beside the loop; a failure is written where the pulling
    /// edge reads it.
    pub(super) fn start_making_transfer(self: &Arc<Self>, id: String) {
        if !self.preparing.lock().expect("preparing lock").insert(id.clone()) {
            return; // under way
        }
        let edge = self.clone();
        tokio::spawn(async move {
            let (e, tid) = (edge.clone(), id.clone());
            let t = Instant::now();
            let made = tokio::task::spawn_blocking(move || e.make_transfer(&tid))
                .await
                .unwrap_or_else(|p| Err(EdgeError::Store(format!("the task panicked: {p}"))));
            match made {
                Ok(bytes) => {
                    tracing::info!(transfer = %id, bytes, took_ms = t.elapsed().as_millis() as u64, "prepared state for another edge to pull")
                }
                Err(e) => {
                    tracing::warn!(transfer = %id, error = %e, "cannot prepare state for another edge");
                    let _ = std::fs::write(
                        edge.transfer_failure(&id),
                        format!("the source edge cannot provide it: {e}"),
                    );
                }
            }
            edge.preparing.lock().expect("preparing lock").remove(&id);
            edge.wake.notify_one();
        });
    }

    /// Records that transfer `id` cannot be had, for the edge that comes to pull it.
    pub(super) fn fail_transfer(&self, id: &str, reason: String) -> Result<(), EdgeError> {
        tracing::warn!(transfer = %id, %reason, "state another edge is to pull cannot be had");
        std::fs::create_dir_all(self.transfers_dir())
            .and_then(|()| std::fs::write(self.transfer_failure(id), reason))
            .map_err(EdgeError::from)
    }

    /// The proxy's side of serving transfers: where transfer `id`'s files are for edge
    /// `to` (or the HTTP status and why not), and what to do once that edge pulled them.
    pub(super) fn transfer_hooks(self: &Arc<Self>) -> proxy::Transfers {
        let server = self.clone();
        let lookup = Arc::new(move |id: &str, to: &str| -> Result<PathBuf, (u16, String)> {
            {
                let slice = server.slice.lock().expect("slice lock");
                let Some(t) = slice.served.get(id) else {
                    return Err((404, format!("edge {} serves no transfer {id}", server.cfg.name)));
                };
                if !t.sends_to(to) {
                    return Err((403, format!("transfer {id} is not for edge {to}")));
                }
            }
            if let Ok(why) = std::fs::read_to_string(server.transfer_failure(id)) {
                return Err((410, why));
            }
            let dir = server.transfers_dir().join(id);
            if dir.join(transfer::MANIFEST).is_file() {
                Ok(dir)
            } else {
                Err((503, format!("transfer {id} is being prepared")))
            }
        });
        let done = self.clone();
        let pulled = Arc::new(move |id: &str, to: &str| {
            {
                let mut slice = done.slice.lock().expect("slice lock");
                if let Some(t) = slice.served.get_mut(id) {
                    let theirs: Vec<String> = t
                        .destinations
                        .iter()
                        .filter(|(_, e)| e.as_str() == to)
                        .map(|(s, _)| s.clone())
                        .collect();
                    t.pulled.extend(theirs);
                }
            }
            if let Err(e) = done.persist() {
                tracing::error!(error = %e, "cannot persist the slice");
            }
            tracing::info!(transfer = %id, by = %to, "another edge pulled a transfer");
            done.wake.notify_one();
        });
        proxy::Transfers { lookup, pulled }
    }
}
