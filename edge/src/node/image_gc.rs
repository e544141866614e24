//! The edge's part in the image store's garbage collection (`images/gc.rs`): it keeps
//! its in-use set fresh in the (possibly shared) store, removes the records of images
//! the log deleted, and collects what nothing uses any more.
//!
//! The set holds the layers of every sandbox and snapshot the slice has live (resolved
//! through their image's record when first seen, and kept per user afterwards, so an
//! image removed under a running sandbox keeps its layers), and every layer or VM disk
//! that the JSON records under the edge's data directories name (containers' overlay
//! lower dirs, warm containers, VMs' layers and boot disks, forks, snapshots). It is
//! rewritten before a round acts when the slice's live set changed (so a create is never
//! started before its layers are in the set) and at least every [`REFRESH`].

use super::Edge;
use crate::images::{GcOptions, Holder, InUse};
use opendsec_commands::images::is_builtin;
use std::collections::{BTreeMap, BTreeSet};
use std::hash::{Hash, Hasher};
use std::time::{Duration, Instant};

/// How often the JSON records are scanned and the set rewritten, at the least.
const REFRESH: Duration = crate::images::GC_REFRESH;

/// How often the edge collects on its own (beside after an image is deleted).
const COLLECT_EVERY: Duration = Duration::from_secs(3600);

/// What the edge keeps between rounds.
#[derive(Default)]
pub(super) struct ImageGc {
    /// The last set published, what the scan of records found, and when.
    scanned: InUse,
    scanned_at: Option<Instant>,
    signature: u64,
    users: BTreeMap<String, String>,
    deleted: BTreeSet<String>,
    /// Deleted images whose records this run removed already.
    removed: BTreeSet<String>,
    collected_at: Option<Instant>,
    collecting: bool,
}

impl Edge {
    /// Publishes the in-use set if due, removes deleted images' records, and collects
    /// when something was removed or an hour passed. Blocking.
    pub(super) fn image_gc_round(self: &std::sync::Arc<Self>) {
        let (users, deleted, signature) = {
            let slice = self.slice.lock().expect("slice lock");
            let mut users: BTreeMap<String, String> = slice
                .sandboxes
                .values()
                .filter(|s| !s.is_terminal())
                .map(|s| (s.id.clone(), s.image.clone()))
                .collect();
            users.extend(
                slice
                    .snapshots
                    .values()
                    .filter(|s| s.phase != crate::desired::SnapshotPhase::Deleted)
                    .map(|s| (s.id.clone(), s.image.clone())),
            );
            let deleted = slice.images_deleted.clone();
            let mut h = std::collections::hash_map::DefaultHasher::new();
            (&users, &deleted).hash(&mut h);
            (users, deleted, h.finish())
        };
        let owner = self.in_use_owner();
        let mut gc = self.image_gc.lock().expect("image gc lock");
        // The first collection comes after a deletion, or an hour after the start.
        gc.collected_at.get_or_insert_with(Instant::now);
        // A new user needs no scan (its image's record names its layers); a user gone or
        // an image deleted does: what is freed must be judged on what the disk holds now.
        let shrank = gc.users.keys().any(|u| !users.contains_key(u)) || deleted != gc.deleted;
        let due = shrank || gc.scanned_at.is_none_or(|t| t.elapsed() >= REFRESH);
        if !due && signature == gc.signature {
            return;
        }
        let previous = self.images.in_use_of(&owner).unwrap_or_default();
        let mut user_layers = BTreeMap::new();
        for (user, image) in &users {
            let mut layers: BTreeSet<String> = previous.users.get(user).into_iter().flatten().cloned().collect();
            if let Ok(record) = self.images.get(image) {
                layers.extend(record.layers);
            }
            user_layers.insert(user.clone(), layers.into_iter().collect());
        }

        // Deleted images: their warm containers and records go (what their live users
        // use is in `user_layers`).
        let todo: Vec<String> = deleted
            .iter()
            .filter(|n| !gc.removed.contains(*n) && !is_builtin(n))
            .cloned()
            .collect();
        let mut removed_any = false;
        for name in todo {
            for wid in self.warm.forget(&name) {
                self.discard_warm(&wid);
            }
            removed_any |= self.remove_image_record(&name);
            gc.removed.insert(name);
        }
        gc.removed.retain(|n| deleted.contains(n));

        if due || removed_any {
            let mut scanned = InUse::default();
            scanned.scan_dir(&self.images, &self.cfg.data_dir, 4);
            scanned.scan_dir(&self.images, &self.cfg.container.sandboxes_root, 3);
            gc.scanned = scanned;
            gc.scanned_at = Some(Instant::now());
        }
        let set = InUse {
            layers: gc.scanned.layers.clone(),
            disks: gc.scanned.disks.clone(),
            users: user_layers,
            holder: Some(Holder::here(&self.cfg.data_dir)),
        };
        if let Err(e) = self.images.publish_in_use(&owner, &set) {
            tracing::warn!(error = %e, "cannot publish the images in use; nothing is collected");
            return;
        }
        gc.signature = signature;
        gc.users = users;
        gc.deleted = deleted.clone();

        if (removed_any || gc.collected_at.is_none_or(|t| t.elapsed() >= COLLECT_EVERY)) && !gc.collecting {
            gc.collected_at = Some(Instant::now());
            gc.collecting = true;
            // Beside the loop: removing a large layer takes a while.
            let edge = self.clone();
            std::thread::Builder::new()
                .name("image gc".into())
                .spawn(move || {
                    match edge.images.collect(gc_options()) {
                        Ok(r) if r.count() > 0 => tracing::info!(
                            layers = r.layers.len(),
                            disks = r.disks.len(),
                            scratch = r.scratch.len(),
                            bytes = r.bytes,
                            "image store collected"
                        ),
                        Ok(_) => {}
                        Err(e) => tracing::warn!(error = %e, "cannot collect the image store"),
                    }
                    edge.image_gc.lock().expect("image gc lock").collecting = false;
                })
                .expect("spawning the image gc");
        }
    }

    /// `image prune`: publishes the in-use set now and collects at once (a collection
    /// already under way beside the loop is waited for by the store's locks).
    pub(super) fn pruner(self: &std::sync::Arc<Self>) -> crate::proxy::Pruner {
        let edge = self.clone();
        std::sync::Arc::new(move || {
            {
                let mut gc = edge.image_gc.lock().expect("image gc lock");
                gc.scanned_at = None;
                gc.signature = 0;
            }
            edge.image_gc_round();
            let r = edge.images.collect(gc_options()).map_err(|e| e.to_string())?;
            tracing::info!(
                layers = r.layers.len(),
                disks = r.disks.len(),
                scratch = r.scratch.len(),
                bytes = r.bytes,
                "image store pruned"
            );
            Ok(serde_json::json!({
                "layers": r.layers.len(),
                "disks": r.disks.len(),
                "scratch": r.scratch.len(),
                "bytes": r.bytes,
            }))
        })
    }

    /// The name of this edge's in-use set: its name, host and data directory (unique
    /// however many clusters share the store, and the same after a restart).
    fn in_use_owner(&self) -> String {
        use sha2::Digest;
        let host = nix::unistd::gethostname()
            .map(|h| h.to_string_lossy().into_owned())
            .unwrap_or_default();
        let dir = sha2::Sha256::digest(self.cfg.data_dir.as_os_str().as_encoded_bytes());
        format!("{}.{host}.{}", self.cfg.name, &hex::encode(dir)[..12])
    }

    /// Removes the record of deleted image `name`, and the record of the reference it was
    /// pulled from when no other record names that reference. Whether one went.
    fn remove_image_record(&self, name: &str) -> bool {
        let reference = self.images.get(name).ok().and_then(|i| i.reference);
        let mut removed = match self.images.remove(name) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(image = %name, error = %e, "cannot remove a deleted image's record");
                return false;
            }
        };
        if let Some(reference) = reference.filter(|r| r != name) {
            let others = self.images.list().unwrap_or_default();
            if !others
                .iter()
                .any(|i| i.name != reference && i.reference.as_deref() == Some(reference.as_str()))
            {
                removed |= self.images.remove(&reference).unwrap_or(false);
            }
        }
        tracing::info!(image = %name, removed, "deleted image's record removed");
        removed
    }
}

/// The collection's options: the defaults, or `OPENDSEC_IMAGE_GC_GRACE_SECS` and
/// `OPENDSEC_IMAGE_GC_LEASE_SECS` (seconds) where set.
fn gc_options() -> GcOptions {
    let secs = |name: &str| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .map(Duration::from_secs)
    };
    let default = GcOptions::default();
    GcOptions {
        grace: secs("OPENDSEC_IMAGE_GC_GRACE_SECS").unwrap_or(default.grace),
        lease: secs("OPENDSEC_IMAGE_GC_LEASE_SECS")
            .unwrap_or(default.lease)
            .max(REFRESH * 4),
    }
}
