//! Disk: `n` sandboxes of the pulled image at once (created concurrently, as a burst),
//! then what they take on the host's disk, measured with `du -sx` (blocks allocated;
//! `-x` leaves out the mounts inside each sandbox's directory, its overlay root and
//! its disk's mount, so a sandbox's writable layer counts as the blocks its sparse ext4
//! file holds): the store's `layers/` and the image's own layer directories before and
//! while they run (a layer is stored once, so neither grows), and the sandboxes'
//! directories. Then they are deleted and freed.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::cold::sync_all;
use super::{IMAGE_NAME, du, sandbox_body};
use crate::sandboxes::UpGuard;
use crate::sandboxes::burst::{create_many, delete_all, settle};

#[derive(Debug, Default)]
pub(super) struct Disk {
    pub(super) n: usize,
    pub(super) running: usize,
    pub(super) failed: usize,
    /// `du -sx` of the store's `layers/`, before the sandboxes and while they run.
    pub(super) store_layers_before: u64,
    pub(super) store_layers_after: u64,
    /// `du -sx` of the image's own layer directories, before and while they run.
    pub(super) image_layers_before: u64,
    pub(super) image_layers_after: u64,
    /// Layer directories in the store, before and while they run.
    pub(super) layer_dirs_before: usize,
    pub(super) layer_dirs_after: usize,
    /// `du -sx` of the running sandboxes' directories together.
    pub(super) sandboxes_bytes: u64,
    /// `du -sx` of the edge's whole sandboxes directory before and while they run (warm
    /// disks and containers, sockets and configurations included).
    pub(super) edge_dir_before: u64,
    pub(super) edge_dir_after: u64,
    /// Sandboxes whose directories were still there 300 s after their delete.
    pub(super) left_over: usize,
    pub(super) errors: Vec<String>,
}

impl Disk {
    pub(super) fn per_sandbox(&self) -> u64 {
        self.sandboxes_bytes / self.running.max(1) as u64
    }
}

fn count_dirs(dir: &Path) -> usize {
    std::fs::read_dir(dir).map(|d| d.flatten().count()).unwrap_or(0)
}

pub(super) async fn disk(up: &Arc<UpGuard>, store: &Path, image_layers: &[PathBuf], n: usize) -> Disk {
    let layers = store.join("layers");
    let mut d = Disk { n, ..Disk::default() };
    // (store layers/, the image's layers, layer directories, the edge's sandboxes directory)
    let measure = || -> Result<(u64, u64, usize, u64), String> {
        sync_all();
        Ok((
            du(std::slice::from_ref(&layers))?,
            du(image_layers)?,
            count_dirs(&layers),
            du(&[up.sandboxes_dir()])?,
        ))
    };
    match measure() {
        Ok(m) => {
            (
                d.store_layers_before,
                d.image_layers_before,
                d.layer_dirs_before,
                d.edge_dir_before,
            ) = m
        }
        Err(e) => d.errors.push(e),
    }
    let label = format!("disk-{}", std::process::id());
    let (ids, http_errors, errors) = create_many(up, &sandbox_body(IMAGE_NAME), &label, n).await;
    d.errors.extend(errors);
    if http_errors > 0 {
        d.errors.push(format!("{http_errors} of {n} creates refused"));
    }
    match settle(up, &label, ids.len(), Instant::now() + Duration::from_secs(300)).await {
        Ok(s) => {
            (d.running, d.failed) = (s.running, s.failed);
            d.errors.extend(s.first_failure.map(|f| format!("failed sandbox: {f}")));
        }
        Err(e) => d.errors.push(e),
    }
    eprintln!("   {} running, {} failed; measuring", d.running, d.failed);
    match measure() {
        Ok(m) => {
            (
                d.store_layers_after,
                d.image_layers_after,
                d.layer_dirs_after,
                d.edge_dir_after,
            ) = m
        }
        Err(e) => d.errors.push(e),
    }
    let dirs: Vec<PathBuf> = ids
        .iter()
        .map(|id| up.sandboxes_dir().join(id))
        .filter(|p| p.is_dir())
        .collect();
    match du(&dirs) {
        Ok(b) => d.sandboxes_bytes = b,
        Err(e) => d.errors.push(e),
    }
    eprintln!("   deleting them");
    d.left_over = delete_all(up, &ids, &mut d.errors).await;
    d
}
