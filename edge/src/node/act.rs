//! Carrying out one planned [`Action`]. Every action is idempotent, so after a crash the
//! same plan runs again and converges; an action that fails is retried on the next round
//! (the failures that would repeat for ever are reported instead). Sandbox operations go
//! through the sandbox's backend (`backend.rs`); long ones (creations, transfers) run
//! beside the loop.

use super::{Edge, EdgeError, Running};
use crate::reconcile::Action;
use opendsec_commands::{Observation, SnapshotResult};
use std::collections::BTreeMap;
use std::sync::Arc;

impl Edge {
    pub(super) async fn act(self: &Arc<Self>, action: Action, observed: &BTreeMap<String, Running>) {
        let result: Result<(), EdgeError> = match action {
            Action::Create { id } => {
                self.act_create(id, observed).await;
                Ok(())
            }
            Action::Pause { id, filesystem } => {
                if filesystem {
                    tracing::info!(sandbox = %id, "pausing with its file system only: its processes end");
                }
                let _changing = Changing::mark(self, &id);
                let sid = id.clone();
                let paused = self.blocking(move |e| e.backend_of(&sid).pause(&sid, filesystem)).await;
                if paused.is_ok() {
                    self.observed_now(&id, Running::Paused { memory: !filesystem });
                }
                paused
            }
            Action::Resume { id, cold } => {
                let _changing = Changing::mark(self, &id);
                let resumed = self.resume(id.clone(), cold).await;
                if resumed.is_ok() && !self.failed.lock().expect("failed lock").contains(&id) {
                    self.observed_now(&id, Running::Running);
                }
                resumed
            }
            Action::Stop { id, reason } => {
                tracing::info!(sandbox = %id, %reason, "stopping");
                self.blocking(move |e| e.backend_of(&id).stop(&id)).await
            }
            Action::Remove { id } => self.remove(id).await,
            Action::TakeSnapshot { id, sandbox } => {
                self.take_snapshot(id, sandbox).await;
                Ok(())
            }
            Action::FailSnapshot { id, reason } => {
                self.report_snapshot(&id, SnapshotResult::Failed { reason }).await;
                Ok(())
            }
            Action::RemoveSnapshot { id } => self.remove_snapshot(id).await,
            Action::MakeTransfer { id } => {
                self.start_making_transfer(id);
                Ok(())
            }
            Action::FailTransfer { id, reason } => self.fail_transfer(&id, reason),
            Action::RemoveTransfer { id } => self.blocking(move |e| e.remove_transfer(&id)).await,
            Action::PullImage { name, reference } => {
                self.start_pull(name, reference);
                Ok(())
            }
            Action::PackImage { name, sandbox, scrub } => {
                self.start_pack(name, sandbox, scrub);
                Ok(())
            }
            Action::FailImage { name, reason } => {
                self.report_image(&name, &opendsec_commands::ImageResult::Failed { reason })
                    .await;
                Ok(())
            }
            Action::Report { id, observation } => {
                self.act_report(id, observation).await;
                Ok(())
            }
        };
        if let Err(e) = result {
            tracing::warn!(error = %e, "reconcile action failed; it is retried on the next round");
        }
    }

    /// Records what a pause or resume just did, ahead of the next observation (a request
    /// to the sandbox goes by it: see [`Edge::settling`]).
    fn observed_now(&self, id: &str, now: Running) {
        if let Some(o) = self.last_observed.lock().expect("observed lock").get_mut(id) {
            *o = now;
        }
    }

    /// Whether sandbox `id` is between states here: the slice does not hold log index
    /// `after` yet (the last change the gateway saw), its pause or resume is being carried
    /// out, or the slice wants it running while it is paused here, or paused while it
    /// runs (the action not yet begun). The proxy holds requests to it meanwhile
    /// (`proxy::Settling`); a sandbox that stays paused is for the gateway to answer.
    pub(super) fn settling(&self, id: &str, after: Option<u64>) -> bool {
        use opendsec_projections::Desired;
        if self.changing.lock().expect("changing lock").contains(id) {
            return true;
        }
        let desired = {
            let slice = self.slice.lock().expect("slice lock");
            if after.is_some_and(|n| slice.next_index <= n) {
                return true;
            }
            slice.sandboxes.get(id).map(|d| d.desired)
        };
        let Some(desired) = desired else {
            return false;
        };
        let observed = self.last_observed.lock().expect("observed lock").get(id).cloned();
        matches!(
            (desired, observed),
            (Desired::Running, Some(Running::Paused { .. })) | (Desired::Paused, Some(Running::Running))
        )
    }

    /// Starts creating sandbox `id` unless its creation failed here before (the failure
    /// is reported; it is not retried).
    async fn act_create(self: &Arc<Self>, id: String, observed: &BTreeMap<String, Running>) {
        tracing::debug!(sandbox = %id, "create: start");
        let Some(d) = self.slice.lock().expect("slice lock").sandboxes.get(&id).cloned() else {
            return;
        };
        if self.failed.lock().expect("failed lock").contains(&id) {
            return;
        }
        self.start_creation(d, observed).await;
    }

    /// Removes sandbox `id` from its backend, and the node's own files of it (its agent's
    /// socket, a fork's copied layers).
    async fn remove(self: &Arc<Self>, id: String) -> Result<(), EdgeError> {
        let sock = self.socket_path(&id);
        let gone = id.clone();
        let removed = self
            .blocking(move |e| {
                let r = e.backend_of(&id).remove(&id);
                let _ = std::fs::remove_file(sock);
                let _ = std::fs::remove_dir_all(e.fork_layer(&id));
                r
            })
            .await;
        if removed.is_ok() {
            self.detach_network_when_quiet(gone);
        }
        removed
    }

    /// Reports what the plan saw of sandbox `id`; a `Ready` only once the backend
    /// confirms it (see [`Edge::ready_observation`]).
    async fn act_report(self: &Arc<Self>, id: String, observation: Observation) {
        let observation = match observation {
            Observation::Ready => match self.ready_observation(&id).await {
                Some(ready) => ready,
                None => return,
            },
            other => other,
        };
        self.report(&id, observation).await;
    }
}

/// Marks a sandbox's pause or resume under way for as long as it lives.
struct Changing<'a>(&'a Edge, String);

impl<'a> Changing<'a> {
    fn mark(edge: &'a Edge, id: &str) -> Self {
        edge.changing.lock().expect("changing lock").insert(id.to_string());
        Changing(edge, id.to_string())
    }
}

impl Drop for Changing<'_> {
    fn drop(&mut self) {
        self.0.changing.lock().expect("changing lock").remove(&self.1);
    }
}
