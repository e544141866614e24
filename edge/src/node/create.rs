//! Creating sandboxes, beside the loop: admitted first (a refusal is reported failed),
//! then made by their backend, one at a time on the host's mounts; a failed creation is
//! reported once and never retried.
//!
//! - A container: a plain create claims a warm container of its image when one is ready
//!   (`warm.rs`); otherwise its spec stacks, over the image's layers, the layers it
//!   starts from: a snapshot's chain, or a fork's private copies of its source's layers
//!   and file system (`forks/<id>/<k>`, bottom first, so a fork of a fork has every
//!   generation's files and outlives its parents), or layers pulled from another edge.
//! - A machine: a cold boot, or a restore of the snapshot it starts from (stored here or
//!   pulled). Fork copies of one source still to be made are made in one driver fork
//!   (they share its frozen RAM), once the source itself exists here.

use super::containers::copy_upper;
use super::files::{copy_tree, tar_extract};
use super::{Edge, EdgeError, Running};
use crate::container::Limits;
use crate::desired::DesiredSandbox;
use crate::microvms::FromSnapshot;
use opendsec_commands::Observation;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

impl Edge {
    /// Creates container sandbox `d`: from a warm container of its image when a plain
    /// create finds one, otherwise cold; either way a plain create keeps its image warm.
    fn create_container(self: &Arc<Self>, d: &DesiredSandbox) -> Result<(), EdgeError> {
        let image = self.image_for(d)?;
        // A plain create from an image claims a warm container of that image if one is
        // ready; either way the image is kept warm for the next create.
        let plain = d.transfer.is_none() && d.snapshot.is_none() && d.fork_of.is_none();
        if plain && self.warm.enabled() {
            let taken = self.warm.take(&d.image);
            // Keeps the image warm; another image's warm containers may make room for it.
            for dropped in self.warm.want(&d.image) {
                self.discard_warm(&dropped);
            }
            if let Some(warm) = taken {
                let t = Instant::now();
                match self.claim_warm(d, &image, &warm) {
                    Ok(()) => {
                        tracing::debug!(sandbox = %d.id, %warm, took = ?t.elapsed(), "claimed a warm container");
                        self.refill_warm();
                        return Ok(());
                    }
                    Err(e) => {
                        tracing::warn!(sandbox = %d.id, %warm, error = %e, "cannot claim a warm container; creating one")
                    }
                }
            }
        }
        let created = self.create_container_cold(d, &image);
        if plain {
            self.refill_warm();
        }
        created
    }

    /// Limits of a sandbox on this edge.
    pub(super) fn limits(&self, d: &DesiredSandbox) -> Limits {
        Limits {
            memory_bytes: d.memory_mb << 20,
            cpu_millis: d.cpu_millis.min(u32::MAX as u64) as u32,
            pids: self.cfg.pids,
            io_weight: Some(100),
            disk_bytes: self.cfg.disk_bytes,
            best_effort: d.cpu_class == opendsec_projections::CpuClass::BestEffort,
        }
    }

    /// Creates container sandbox `d` from scratch: its agent's files, then its spec over
    /// the layers it starts from (see the module doc).
    fn create_container_cold(&self, d: &DesiredSandbox, image: &crate::images::Image) -> Result<(), EdgeError> {
        let super::agent::AgentLaunch {
            mut spec,
            listener,
            config,
        } = self.agent_spec(&d.id, image, self.limits(d))?;
        // Written before the container exists: the pipe holds it until the agent reads it.
        self.send_agent_config(d, image, config.write)?;
        if d.transfer.is_some() {
            // Its source's layers live on another edge: pulled, then unpacked into its
            // own directory (removed with it), bottom first.
            let (dir, manifest) = self.import(d)?;
            for (k, name) in manifest.layers.iter().enumerate() {
                let layer = self.fork_layer(&d.id).join(k.to_string());
                if !layer.is_dir() {
                    tar_extract(&dir.join(name), &layer)?;
                }
                spec.layers.push(layer);
            }
        } else if let Some(snap) = &d.snapshot {
            // A sandbox started from a snapshot stacks the snapshot's layers on the image's.
            spec.layers.extend(self.snapshot_layers(snap)?);
        }
        // A fork starts from a copy of its source's file system as it is now: the layers
        // its source was forked with (copied: they go when their sandbox goes), then what
        // its source wrote, in `forks/<id>/<k>`, bottom first.
        if let (Some(source), None) = (&d.fork_of, &d.transfer) {
            let dir = self.fork_layer(&d.id);
            let source_forks = self.fork_layer(source);
            let inherited: Vec<PathBuf> = self
                .containers
                .get(source)?
                .record
                .layers
                .into_iter()
                .filter(|l| l.starts_with(&source_forks))
                .collect();
            for (k, from) in inherited.iter().enumerate() {
                let layer = dir.join(k.to_string());
                if !layer.is_dir() {
                    copy_tree(from, &layer)?;
                }
                spec.layers.push(layer);
            }
            let layer = dir.join(inherited.len().to_string());
            if !layer.is_dir() {
                copy_upper(&self.containers, source, &layer)?;
            }
            spec.layers.push(layer);
        }
        spec.labels = d.labels.clone();
        if self.containers.get(&d.id).is_ok() {
            return Err(crate::container::ContainerError::AlreadyExists(d.id.clone()).into());
        }
        // Its network, under its policy, before its container: never open, not for an instant.
        self.attach_network(&d.id, &mut spec, Some(d.network.as_deref()))?;
        let created = {
            let _one_at_a_time = self.create_lock.lock().expect("create lock");
            self.containers.create(&spec)
        };
        if let Err(e) = created {
            if !matches!(e, crate::container::ContainerError::AlreadyExists(_)) {
                self.detach_network(&d.id);
            }
            return Err(e.into());
        }
        // The agent holds its own copies.
        drop((listener, config.read));
        Ok(())
    }

    /// Starts creating microVM sandbox `d` beside the loop. A fork copy is made together
    /// with every other copy of its source still to be made (one fork: they share its
    /// frozen RAM), once the source itself exists here.
    pub(super) async fn start_machine_creation(
        self: &Arc<Self>,
        d: DesiredSandbox,
        observed: &BTreeMap<String, Running>,
    ) {
        let batch: Vec<DesiredSandbox> = match &d.fork_of {
            None => vec![d.clone()],
            Some(src) => {
                let creating = self.creating.lock().expect("creating lock").clone();
                let slice = self.slice.lock().expect("slice lock");
                let source_pending = slice.sandboxes.get(src).is_some_and(|s| {
                    s.observed == opendsec_projections::Observed::Pending
                        && s.desired == opendsec_projections::Desired::Running
                });
                if creating.contains(src) || source_pending {
                    return; // the source is not up yet: the next round tries again
                }
                let failed = self.failed.lock().expect("failed lock");
                slice
                    .sandboxes
                    .values()
                    .filter(|c| {
                        c.fork_of.as_deref() == Some(src.as_str())
                            && c.isolation.is_machine()
                            && c.transfer == d.transfer
                    })
                    .filter(|c| {
                        c.observed == opendsec_projections::Observed::Pending
                            && c.desired == opendsec_projections::Desired::Running
                    })
                    .filter(|c| !creating.contains(&c.id) && !failed.contains(&c.id) && !observed.contains_key(&c.id))
                    .take(crate::vm::MAX_FORK_COUNT)
                    .cloned()
                    .collect()
            }
        };
        let mut claimed = Vec::new();
        for c in batch {
            if !self.creating.lock().expect("creating lock").insert(c.id.clone()) {
                continue;
            }
            if let Err(why) = self.admit(&c, observed) {
                self.creating.lock().expect("creating lock").remove(&c.id);
                self.report(&c.id, Observation::Failed { reason: why }).await;
                continue;
            }
            claimed.push(c);
        }
        if claimed.is_empty() {
            return;
        }
        let edge = self.clone();
        tokio::spawn(async move {
            let (e2, batch) = (edge.clone(), claimed.clone());
            let made = tokio::task::spawn_blocking(move || {
                match batch[0].fork_of.clone() {
                    Some(source) => e2.fork_machines(&source, &batch),
                    None => e2.create_machine(&batch[0]),
                }?;
                // Their link out, under their policy; a copy that cannot have it goes.
                for c in &batch {
                    if let Err(e) = e2.attach_machine_network(c) {
                        for c in &batch {
                            e2.detach_network(&c.id);
                            let _ = e2.backend_of(&c.id).remove(&c.id);
                        }
                        return Err(e);
                    }
                }
                Ok(())
            })
            .await
            .unwrap_or_else(|p| Err(EdgeError::Store(format!("the create task panicked: {p}"))));
            for c in &claimed {
                edge.creating.lock().expect("creating lock").remove(&c.id);
            }
            match made {
                Ok(()) => {
                    tracing::info!(sandboxes = ?claimed.iter().map(|c| &c.id).collect::<Vec<_>>(), "created microVMs")
                }
                Err(e) => {
                    tracing::warn!(error = %e, "microVM create failed");
                    for c in &claimed {
                        edge.failed.lock().expect("failed lock").insert(c.id.clone());
                        edge.report(
                            &c.id,
                            Observation::Failed {
                                reason: format!("create failed: {e}"),
                            },
                        )
                        .await;
                    }
                }
            }
            edge.wake.notify_one();
        });
    }

    /// Creates a microVM sandbox: cold boot, or a restore of the snapshot it starts from.
    fn create_machine(&self, d: &DesiredSandbox) -> Result<(), EdgeError> {
        let vms = self.machines.ready()?;
        let image = self.image_for(d)?;
        let source = match &d.snapshot {
            None => None,
            // On another edge: pulled from there.
            Some(_) if d.transfer.is_some() => {
                let (dir, manifest) = self.import(d)?;
                Some((dir, manifest.source_sandbox))
            }
            Some(snap) => {
                let source = self
                    .slice
                    .lock()
                    .expect("slice lock")
                    .snapshots
                    .get(snap)
                    .map(|x| x.sandbox.clone());
                let source =
                    source.ok_or_else(|| EdgeError::Store(format!("snapshot {snap} is unknown to this edge")))?;
                Some((self.snapshots_dir().join(snap), source))
            }
        };
        let token = match &source {
            Some((_, of)) => Some(self.source_agent_token(d, of)?),
            None => None,
        };
        let from = source
            .as_ref()
            .zip(token.as_deref())
            .map(|((dir, _), source_token)| FromSnapshot { dir, source_token });
        vms.create(d, &image, from)?;
        Ok(())
    }

    /// Creates microVM fork copies `copies` of `source` in one fork (they share its RAM),
    /// or, when the source runs on another edge, each from the fork snapshot pulled from
    /// there. On failure no copy is left.
    fn fork_machines(&self, source: &str, copies: &[DesiredSandbox]) -> Result<(), EdgeError> {
        let vms = self.machines.ready()?;
        let image = self.image_for(&copies[0])?;
        if copies[0].transfer.is_some() {
            let t = Instant::now();
            let (dir, manifest) = self.import(&copies[0])?;
            let source_token = self.source_agent_token(&copies[0], &manifest.source_sandbox)?;
            let mut made: Vec<&str> = Vec::new();
            for c in copies {
                let from = FromSnapshot {
                    dir: &dir,
                    source_token: &source_token,
                };
                if let Err(e) = vms.create(c, &image, Some(from)) {
                    for id in made {
                        let _ = vms.remove(id);
                    }
                    return Err(e.into());
                }
                made.push(&c.id);
            }
            tracing::info!(%source, copies = copies.len(), took_ms = t.elapsed().as_millis() as u64, "made microVM fork copies from state pulled from another edge");
            return Ok(());
        }
        let scratch = self
            .cfg
            .data_dir
            .join("vm-scratch")
            .join(format!("{source}-{}", opendsec_edge_api::now_ms()));
        std::fs::create_dir_all(scratch.parent().expect("a scratch dir has a parent"))?;
        let refs: Vec<&DesiredSandbox> = copies.iter().collect();
        let paused = vms.fork(source, &refs, &image, &scratch)?;
        tracing::info!(%source, copies = copies.len(), source_paused_ms = paused.as_millis() as u64, "forked a microVM");
        Ok(())
    }
}

impl Edge {
    /// Starts creating container sandbox `d` beside the loop. A template with a start
    /// command is ready once its port is open; if it never opens the sandbox fails.
    pub(super) async fn start_container_creation(
        self: &Arc<Self>,
        d: DesiredSandbox,
        observed: &BTreeMap<String, Running>,
    ) {
        let id = d.id.clone();
        if !self.creating.lock().expect("creating lock").insert(id.clone()) {
            return; // already under way
        }
        if let Err(why) = self.admit(&d, observed) {
            self.creating.lock().expect("creating lock").remove(&id);
            self.report(&id, Observation::Failed { reason: why }).await;
            return;
        }
        let edge = self.clone();
        tokio::spawn(async move {
            let d2 = d.clone();
            let e2 = edge.clone();
            let r = {
                let _slot = edge
                    .creation_slots
                    .acquire()
                    .await
                    .expect("the creation slots are never closed");
                tokio::task::spawn_blocking(move || e2.create_container(&d2)).await
            };
            let r = match r {
                Ok(Ok(())) if edge.has_start_command(&d.image) => match edge.wait_started(&d.id).await {
                    Ok(()) => Ok(Ok(())),
                    Err(why) => {
                        tracing::warn!(sandbox = %d.id, %why, "start command failed");
                        let _ = edge.containers.kill(&d.id, libc::SIGKILL);
                        edge.failed.lock().expect("failed lock").insert(d.id.clone());
                        edge.creating.lock().expect("creating lock").remove(&d.id);
                        edge.report(&d.id, Observation::Failed { reason: why }).await;
                        edge.wake.notify_one();
                        return;
                    }
                },
                other => other,
            };
            edge.creating.lock().expect("creating lock").remove(&d.id);
            match r {
                Ok(Ok(())) => tracing::info!(sandbox = %d.id, "created"),
                Ok(Err(EdgeError::Backend(crate::container::ContainerError::AlreadyExists(_)))) => {
                    tracing::debug!(sandbox = %d.id, "already created");
                }
                Ok(Err(e)) => {
                    tracing::warn!(sandbox = %d.id, error = %e, "create failed");
                    edge.failed.lock().expect("failed lock").insert(d.id.clone());
                    edge.report(
                        &d.id,
                        Observation::Failed {
                            reason: format!("create failed: {e}"),
                        },
                    )
                    .await;
                }
                Err(e) => tracing::error!(sandbox = %d.id, error = %e, "create task panicked"),
            }
            edge.wake.notify_one();
        });
    }
}
