//! Snapshots on this edge: taken through the sandbox's backend into
//! `<edge data>/snapshots/<id>` (idempotent: existing files are only reported again),
//! reported to the log, removed when deleted. A container's snapshot is a layer and a
//! sandbox started from it stacks the snapshot's parent chain on its image's layers; a
//! VM's holds its memory, device state and disk.

use super::{Edge, EdgeError};
use opendsec_commands::{Observation, SnapshotResult};
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

impl Edge {
    /// The snapshot layers beneath a sandbox started from `snapshot`, bottom first.
    pub(super) fn snapshot_layers(&self, snapshot: &str) -> Result<Vec<PathBuf>, EdgeError> {
        let slice = self.slice.lock().expect("slice lock");
        let mut chain = Vec::new();
        let mut next = Some(snapshot.to_string());
        while let Some(id) = next {
            if chain.len() > 64 {
                return Err(EdgeError::Store(format!(
                    "snapshot {snapshot} has a parent chain over 64 deep"
                )));
            }
            let dir = self.snapshots_dir().join(&id);
            if !dir.is_dir() {
                return Err(EdgeError::Store(format!("snapshot {id} has no files on this edge")));
            }
            chain.push(dir);
            next = slice.snapshots.get(&id).and_then(|x| x.parent.clone());
        }
        chain.reverse();
        Ok(chain)
    }

    /// The snapshots whose files are on this machine.
    pub(super) fn present_snapshots(&self) -> BTreeSet<String> {
        std::fs::read_dir(self.snapshots_dir())
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str().map(str::to_string))
            .filter(|n| !n.starts_with('.'))
            .collect()
    }

    pub(super) async fn report_snapshot(&self, id: &str, result: opendsec_commands::SnapshotResult) {
        let key = format!("snapshot:{id}");
        let as_obs = Observation::Failed {
            reason: format!("{result:?}"),
        };
        {
            let reported = self.reported.lock().expect("reported lock");
            if let Some((last, at)) = reported.get(&key)
                && *last == as_obs
                && at.elapsed() < Duration::from_secs(10)
            {
                return;
            }
        }
        let mut client = self.client.clone();
        match client
            .report_snapshot(id, &result, &format!("{}:{key}", self.cfg.name))
            .await
        {
            Ok(index) => {
                tracing::info!(snapshot = %id, ?result, index, "reported");
                self.reported
                    .lock()
                    .expect("reported lock")
                    .insert(key, (as_obs, Instant::now()));
            }
            Err(e) => tracing::warn!(snapshot = %id, error = %e, "snapshot report failed; retried on the next round"),
        }
    }
}

impl Edge {
    /// Takes snapshot `id` of `sandbox` beside the loop and reports it ready (with its
    /// size) or failed.
    pub(super) async fn take_snapshot(self: &Arc<Self>, id: String, sandbox: String) {
        if !self.snapshotting.lock().expect("snapshot lock").insert(id.clone()) {
            return; // under way
        }
        let (e, sid) = (self.clone(), id.clone());
        let isolation = self
            .slice
            .lock()
            .expect("slice lock")
            .snapshots
            .get(&id)
            .map(|x| x.isolation)
            .unwrap_or_default();
        let taken = tokio::task::spawn_blocking(move || {
            let dest = e.snapshots_dir().join(&sid);
            e.backend(isolation).snapshot(&sandbox, &dest)
        })
        .await;
        self.snapshotting.lock().expect("snapshot lock").remove(&id);
        let result = match taken {
            Ok(Ok(size_bytes)) => SnapshotResult::Ready { size_bytes },
            Ok(Err(e)) => SnapshotResult::Failed {
                reason: super::fit_reason(&e.to_string()),
            },
            Err(e) => SnapshotResult::Failed {
                reason: format!("snapshot task failed: {e}"),
            },
        };
        self.report_snapshot(&id, result).await;
    }

    /// Removes snapshot `id`'s files, and what was prepared of it for other edges.
    pub(super) async fn remove_snapshot(self: &Arc<Self>, id: String) -> Result<(), EdgeError> {
        let dir = self.snapshots_dir().join(&id);
        let served = self.transfers_dir().join(&id);
        self.blocking(move |_| {
            let _ = std::fs::remove_dir_all(served);
            std::fs::remove_dir_all(dir).map_err(EdgeError::from)
        })
        .await
    }
}
